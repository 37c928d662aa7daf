//! `advertise:` resources of `devplug run`: extended resources with no device and no socket,
//! kept on the process's own Node. Event-driven: a watch on that one Node; whenever it
//! changes (the kubelet's status updates, someone's `kubectl patch`), what we advertise is
//! compared with its status and set again where it differs. A resource that leaves the desired
//! set is removed once. When the watch fails (the API server restarting), the API server is
//! asked every 0.5 s whether it answers again; once it does, the Node is read and the watch
//! started afresh, so a change made meanwhile is repaired at once, not after the watch's
//! backoff. Nothing is removed at shutdown: a restarting pod must not make capacity
//! flap; use `devplug capacity remove` to take one away for good.

use crate::capacity::{self, extended_resources};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Retry delay after an API error (doubling to 30 s, jittered).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// While the watch is failing, how often to ask the API server whether it answers again.
const RECOVERY_PROBE: Duration = Duration::from_millis(500);

/// Counters of an [`Advertiser`], for metrics and tests.
#[derive(Debug, Default)]
pub struct AdvertiseCounters {
    /// Times a resource was set because the Node differed (first set included).
    pub applied: std::sync::atomic::AtomicU64,
    /// Times a resource was removed because it left the config.
    pub removed: std::sync::atomic::AtomicU64,
    /// API errors.
    pub errors: std::sync::atomic::AtomicU64,
    /// Errors since the last pass that worked (0 when the last one did).
    pub consecutive_failures: std::sync::atomic::AtomicU64,
    /// When the Node was last seen right or made right (Unix seconds; 0: never).
    pub last_success_unix: std::sync::atomic::AtomicU64,
}

/// Keeps resources advertised on one Node until dropped or stopped.
#[derive(Debug)]
pub struct Advertiser {
    desired: watch::Sender<BTreeMap<String, u64>>,
    counters: Arc<AdvertiseCounters>,
    stop: CancellationToken,
}

impl Advertiser {
    /// Starts advertising on `node` (empty set at first; see [`Advertiser::set`]).
    pub fn spawn(client: kube::Client, node: String, stop: CancellationToken) -> Advertiser {
        Advertiser::spawn_gated(client, node, stop, None)
    }

    /// The same, writing nothing before `gate` is passed ([`crate::policy_check::Gate`]).
    pub fn spawn_gated(
        client: kube::Client,
        node: String,
        stop: CancellationToken,
        gate: Option<crate::policy_check::Gate>,
    ) -> Advertiser {
        let (desired, rx) = watch::channel(BTreeMap::new());
        let counters = Arc::new(AdvertiseCounters::default());
        let task_stop = stop.clone();
        let task_counters = counters.clone();
        tokio::spawn(async move {
            let feature = crate::policy_check::Feature::Advertise;
            if crate::policy_check::pass(gate.as_ref(), feature, &task_stop).await {
                run(Api::all(client), node, rx, task_counters, task_stop).await;
            }
        });
        Advertiser {
            desired,
            counters,
            stop,
        }
    }

    /// The resources to advertise now, name → count. Resources no longer listed are removed
    /// from the Node.
    pub fn set(&self, resources: BTreeMap<String, u64>) {
        self.desired.send_if_modified(|current| {
            let changed = *current != resources;
            *current = resources;
            changed
        });
    }

    /// The counters.
    pub fn counters(&self) -> &AdvertiseCounters {
        &self.counters
    }

    /// The counters, to keep beside the advertiser (metrics).
    pub fn shared_counters(&self) -> Arc<AdvertiseCounters> {
        self.counters.clone()
    }
}

impl Drop for Advertiser {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn run(
    api: Api<Node>,
    node: String,
    mut desired: watch::Receiver<BTreeMap<String, u64>>,
    counters: Arc<AdvertiseCounters>,
    stop: CancellationToken,
) {
    // From the watch cache: no consistent read of etcd at every (re)start of the watch.
    let config = watcher::Config::default()
        .fields(&format!("metadata.name={node}"))
        .any_semantic();
    let new_watch = || {
        watcher(api.clone(), config.clone())
            .default_backoff()
            .applied_objects()
            .boxed()
    };
    let mut events = new_watch();
    let mut probe_at: Option<tokio::time::Instant> = None;
    let mut advertised: BTreeSet<String> = BTreeSet::new();
    let mut last_seen: Option<Node> = None;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut retry = devplug::host::backoff::Backoff::new(RETRY_FIRST, RETRY_MAX).jittered();
    loop {
        let far = || tokio::time::Instant::now() + Duration::from_secs(86_400);
        let due = retry_at.unwrap_or_else(far);
        let probe_due = probe_at.unwrap_or_else(far);
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = desired.changed() => {
                if changed.is_err() {
                    return;
                }
                // Fresh state: the cached object may be old.
                last_seen = match crate::timed(api.get_status(&node)).await {
                    Ok(n) => Some(n),
                    Err(err) => {
                        tracing::warn!(%node, %err, "cannot read our Node; retrying");
                        counters.errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        retry_at = Some(tokio::time::Instant::now() + retry.next_delay());
                        continue;
                    }
                };
            }
            event = events.next() => match event {
                Some(Ok(n)) => last_seen = Some(n),
                Some(Err(err)) => {
                    tracing::warn!(%node, %err, "watching our Node failed; reading it afresh once the API server answers");
                    probe_at.get_or_insert_with(|| tokio::time::Instant::now() + RECOVERY_PROBE);
                    continue;
                }
                None => return,
            },
            _ = tokio::time::sleep_until(due), if retry_at.is_some() => {
                retry_at = None;
                last_seen = crate::timed(api.get_status(&node)).await.ok().or(last_seen);
            }
            _ = tokio::time::sleep_until(probe_due), if probe_at.is_some() => {
                match tokio::time::timeout(RECOVERY_PROBE, api.get_status(&node)).await {
                    Ok(Ok(n)) => {
                        tracing::info!(%node, "the API server answers again; watching our Node afresh");
                        last_seen = Some(n);
                        events = new_watch();
                        probe_at = None;
                        retry_at = None;
                        retry.reset();
                    }
                    _ => {
                        probe_at = Some(tokio::time::Instant::now() + RECOVERY_PROBE);
                        continue;
                    }
                }
            }
        }
        let Some(current) = &last_seen else { continue };
        let wanted = desired.borrow().clone();
        match reconcile(&api, &node, current, &wanted, &mut advertised, &counters).await {
            Ok(()) => {
                retry.reset();
                counters
                    .consecutive_failures
                    .store(0, std::sync::atomic::Ordering::Relaxed);
                counters
                    .last_success_unix
                    .store(crate::unix_now(), std::sync::atomic::Ordering::Relaxed);
            }
            Err(err) => {
                counters
                    .consecutive_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let delay = retry.next_delay();
                tracing::warn!(%node, %err, retry_in = ?delay, "cannot advertise on our Node; retrying");
                counters
                    .errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                retry_at = Some(tokio::time::Instant::now() + delay);
            }
        }
    }
}

async fn reconcile(
    api: &Api<Node>,
    node: &str,
    current: &Node,
    wanted: &BTreeMap<String, u64>,
    advertised: &mut BTreeSet<String>,
    counters: &AdvertiseCounters,
) -> Result<(), capacity::CapacityError> {
    use std::sync::atomic::Ordering::Relaxed;
    let present = extended_resources(current);
    for (name, count) in wanted {
        let want = count.to_string();
        let r = present.get(name);
        let right = r.is_some_and(|r| {
            r.capacity.as_deref() == Some(want.as_str())
                && r.allocatable.as_deref() == Some(want.as_str())
        });
        if !right {
            tracing::info!(%node, resource = %name, count, "advertising");
            capacity::set(api, node, name, *count).await?;
            counters.applied.fetch_add(1, Relaxed);
        }
        advertised.insert(name.clone());
    }
    let gone: Vec<String> = advertised
        .iter()
        .filter(|n| !wanted.contains_key(*n))
        .cloned()
        .collect();
    for name in gone {
        tracing::info!(%node, resource = %name, "no longer advertised; removing");
        capacity::remove(api, node, &name).await?;
        counters.removed.fetch_add(1, Relaxed);
        advertised.remove(&name);
    }
    Ok(())
}
