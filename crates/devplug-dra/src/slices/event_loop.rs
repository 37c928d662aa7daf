//! The publisher's task loop: one loop over the backend's device list, a watch on the Node and a
//! watch on our own slices, which keeps a cache of the slices and, whenever something changed,
//! publishes (`reconcile`), retrying API errors with a backoff.
//!
//! The cache can be wrong in a way no watch reports: after the cluster's etcd is restored or
//! rebuilt, a watch resumed at a resource version the new etcd has not reached delivers
//! nothing, and the Node may be a new object with a new UID. So a write that finds its slice
//! gone (404), and a Node whose UID changed, lead to a resync: our slices listed afresh, the
//! Node read, both watches started again from that list, and a full publish at once. A watch
//! that fails (the API server gone, restarted, restored) is treated the same way as soon as
//! the API server answers a read again.

use super::reconcile::Run;
use super::shared::selector;
use devplug::host::backoff::Backoff;
use devplug::DeviceList;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::core::PartialObjectMeta;
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use std::ops::ControlFlow;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// First delay after an API error; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// Longest delay between retries.
const RETRY_MAX: Duration = Duration::from_secs(60);
/// While a watch is failing, the first wait before asking the API server whether it answers
/// again: once it does, both watches start again from fresh lists (a watch that resumes at a
/// resource version a restored etcd has not reached would deliver nothing) and the slices are
/// published at once. Each unanswered probe doubles the wait up to [`RECOVERY_PROBE_MAX`], and
/// every wait is jittered ([`Backoff::jittered`]): drivers that lost the API server together (a fleet
/// whose API server restarted) would otherwise ask it in step, 2 requests a second each, while it
/// starts (500 simulated nodes: docs/benchmarks.md, "A fleet of DRA nodes"). Also the longest a
/// probe waits for its answer.
/// While nothing listens at the server's address, the waits stop at [`NO_SERVER_PROBE_MAX`].
const RECOVERY_PROBE: Duration = Duration::from_millis(500);
/// The longest wait between two probes of an API server that does not answer.
const RECOVERY_PROBE_MAX: Duration = Duration::from_secs(4);
/// The longest wait between two probes while nothing listens at the API server's address (a
/// connection refused: the server is down, and a probe costs it nothing, not even a TLS
/// handshake): so that a driver's slices are right within about a second of the server's
/// return whatever the outage's length. A server that accepts but answers with errors or not
/// at all (starting, or its etcd away) is spared, with the waits up to [`RECOVERY_PROBE_MAX`].
const NO_SERVER_PROBE_MAX: Duration = Duration::from_secs(1);

/// The middle of a watch's timeout: each watch asks the API server to end it after this,
/// jittered over 75-125 % (180-300 s, below kube-rs's 290 s default's load-balancer margin at
/// the top), once per driver: the watches of a fleet that started together (a rollout, the API
/// server's return) would otherwise all end and list again in the same second every 290 s.
const WATCH_TIMEOUT: Duration = Duration::from_secs(240);

/// A watch's timeout in whole seconds, jittered ([`WATCH_TIMEOUT`]).
fn watch_timeout() -> u32 {
    u32::try_from(devplug::host::backoff::jittered(WATCH_TIMEOUT).as_secs()).unwrap_or(240)
}

/// A watch's events, as the watcher gives them.
type Events<K> = BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

/// Our Node as its watch gives it: the metadata alone (its UID is all the loop needs; a whole
/// Node, its status and image list included, is tens of KiB an event, and its status changes
/// often).
type NodeMeta = PartialObjectMeta<Node>;

/// The watches of our Node and of our slices, and how to start them again.
struct Watches {
    /// Asks for metadata alone (kube-rs: an `Api` of `PartialObjectMeta`).
    nodes: Api<NodeMeta>,
    node_config: watcher::Config,
    slices: Api<ResourceSlice>,
    slice_config: watcher::Config,
    node_events: Events<NodeMeta>,
    slice_events: Events<ResourceSlice>,
}

impl Watches {
    /// Starts watching the Node `node` and the slices of `driver` on it.
    fn start(
        client: kube::Client,
        slices: Api<ResourceSlice>,
        driver: &str,
        node: &str,
    ) -> Watches {
        let nodes: Api<NodeMeta> = Api::all(client);
        let node_config = watcher::Config::default()
            .fields(&format!("metadata.name={node}"))
            .timeout(watch_timeout());
        let slice_config = watcher::Config::default()
            .fields(&selector(driver, node))
            .timeout(watch_timeout());
        let node_events = Self::watch(&nodes, &node_config);
        let slice_events = Self::watch(&slices, &slice_config);
        Watches {
            nodes,
            node_config,
            slices,
            slice_config,
            node_events,
            slice_events,
        }
    }

    fn watch<K>(api: &Api<K>, config: &watcher::Config) -> Events<K>
    where
        K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    {
        watcher(api.clone(), config.clone())
            .default_backoff()
            .boxed()
    }

    /// A watch that failed is parked (its stream yields nothing) until [`Watches::restart`]:
    /// while the API server does not answer, the driver's probe alone asks it, with its own
    /// backoff, instead of each watch retrying beside it (three requests where one tells).
    fn park_node(&mut self) {
        self.node_events = futures_util::stream::pending().boxed();
    }

    /// [`Watches::park_node`] for the slices' watch.
    fn park_slices(&mut self) {
        self.slice_events = futures_util::stream::pending().boxed();
    }

    /// Both watches started again, from fresh lists.
    fn restart(&mut self) {
        self.node_events = Self::watch(&self.nodes, &self.node_config);
        self.slice_events = Self::watch(&self.slices, &self.slice_config);
    }
}

/// What the loop keeps between its turns: what the watches said so far, and when to try again.
struct LoopState {
    /// False once the backend's channel closed (its last list stays published).
    devices_open: bool,
    /// True once the Node's watch has listed (the Node found or not).
    node_listed: bool,
    /// Whether the Node's current list found it.
    node_found_in_list: bool,
    // Lists each watch made since it was (re)created: a second one means it restarted.
    node_lists: u32,
    slice_lists: u32,
    /// When a failed publish is tried again.
    retry_at: Option<Instant>,
    /// The waits after failed publishes (jittered, like every writer to the API server).
    retry: Backoff,
    /// Something changed since the last publish.
    dirty: bool,
    // Set while a watch is failing: when to ask the API server again, and the wait before.
    probe_at: Option<Instant>,
    probe: Backoff,
    /// The waits between probes while nothing listens at the server's address.
    no_server: Backoff,
}

impl LoopState {
    fn new() -> LoopState {
        LoopState {
            devices_open: true,
            node_listed: false,
            node_found_in_list: false,
            node_lists: 0,
            slice_lists: 0,
            retry_at: None,
            retry: Backoff::new(RETRY_FIRST, RETRY_MAX).jittered(),
            dirty: true,
            probe_at: None,
            probe: Backoff::new(RECOVERY_PROBE, RECOVERY_PROBE_MAX).jittered(),
            no_server: Backoff::new(RECOVERY_PROBE, NO_SERVER_PROBE_MAX).jittered(),
        }
    }
}

/// A time no wait of the loop reaches (a branch that is off still needs one).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

impl Run {
    pub(super) async fn run(
        mut self,
        client: kube::Client,
        mut devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
        gate: Option<super::publisher::WriteGate>,
    ) {
        if let Some(gate) = gate {
            tokio::select! {
                () = stop.cancelled() => return,
                () = gate() => {}
            }
        }
        let mut watches = Watches::start(client, self.api.clone(), &self.driver, &self.node);
        let first = devices.borrow_and_update().clone();
        self.set_list(first);
        let mut state = LoopState::new();
        loop {
            let probe_due = state.probe_at.unwrap_or_else(far_future);
            let due = state.retry_at.unwrap_or_else(far_future);
            let escalation = self.taint_clock.escalation_due();
            let escalation_due = escalation.unwrap_or_else(far_future);
            tokio::select! {
                () = stop.cancelled() => return,
                changed = devices.changed(), if state.devices_open => match changed {
                    Ok(()) => {
                        let list = devices.borrow_and_update().clone();
                        self.set_list(list);
                        state.dirty = true;
                    }
                    Err(_) => {
                        tracing::debug!(driver = %self.driver, "the backend stopped; its last list stays published");
                        state.devices_open = false;
                    }
                },
                event = watches.node_events.next() => match event {
                    Some(event) => {
                        if event.is_err() {
                            watches.park_node();
                        }
                        self.node_event(event, &mut state);
                    }
                    None => return,
                },
                event = watches.slice_events.next() => match event {
                    Some(event) => {
                        if event.is_err() {
                            watches.park_slices();
                        }
                        self.slice_event(event, &mut state);
                    }
                    None => return,
                },
                () = tokio::time::sleep_until(due), if state.retry_at.is_some() => {
                    state.retry_at = None;
                    state.dirty = true;
                }
                () = tokio::time::sleep_until(escalation_due), if escalation.is_some() => {
                    // A device unhealthy for no_execute_after: its taint turns NoExecute.
                    let list = self.list.clone();
                    self.set_list(list);
                    state.dirty = true;
                }
                () = tokio::time::sleep_until(probe_due), if state.probe_at.is_some() => {
                    if self.probe(&stop, &mut state).await.is_break() {
                        return;
                    }
                }
            }
            if std::mem::take(&mut self.restart_watches) {
                watches.restart();
                self.forget_watched(&mut state);
                continue;
            }
            // While the API server is probed (a watch failed), the probe alone asks it: a
            // publish waits for its answer, and the resync that follows publishes.
            if !state.dirty
                || state.retry_at.is_some()
                || state.probe_at.is_some()
                || !self.cache.ready
                || !state.node_listed
                || self.node_uid.is_none()
            {
                continue;
            }
            if self.publish(&stop, &mut state).await.is_break() {
                return;
            }
        }
    }

    /// Takes an event of the Node's watch: its UID (the slices' owner), a restarted watch (a
    /// resync), a failed one (a probe of the API server).
    fn node_event(
        &mut self,
        event: Result<watcher::Event<NodeMeta>, watcher::Error>,
        state: &mut LoopState,
    ) {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                tracing::warn!(node = %self.node, %err, "watching our Node failed; reading everything afresh once the API server answers");
                self.watch_failed(state);
                return;
            }
        };
        let before = self.node_uid.clone();
        match event {
            watcher::Event::Init => {
                state.node_found_in_list = false;
                state.node_lists = state.node_lists.saturating_add(1);
                if state.node_lists > 1 {
                    tracing::info!(node = %self.node, driver = %self.driver, "the Node's watch started again; reading our slices and the Node afresh");
                    self.restart_watches = true;
                }
            }
            watcher::Event::InitApply(n) | watcher::Event::Apply(n) => {
                state.node_found_in_list = true;
                if let (Some(old), Some(new)) = (&self.node_uid, &n.metadata.uid) {
                    if old != new {
                        // A new Node object: the cluster, or the Node, was made
                        // again; what we know of our slices may be stale too.
                        tracing::info!(node = %self.node, "our Node is a new object (its UID changed); reading our slices afresh");
                        self.restart_watches = true;
                    }
                }
                self.node_uid = n.metadata.uid;
            }
            watcher::Event::InitDone => {
                if !state.node_found_in_list {
                    self.node_uid = None;
                }
                if self.node_uid.is_none() && !state.node_listed {
                    tracing::info!(node = %self.node, driver = %self.driver, "no Node object yet; ResourceSlices follow when it appears");
                }
                state.node_listed = true;
            }
            watcher::Event::Delete(_) => {
                // Publishing now would make slices the garbage collector takes
                // away again (their owner is gone); wait for the Node.
                tracing::info!(node = %self.node, "our Node was deleted; waiting for it");
                self.node_uid = None;
            }
        }
        state.dirty |= before != self.node_uid;
    }

    /// Takes an event of our slices' watch: into the cache, or a restarted watch (a resync), or
    /// a failed one (a probe of the API server).
    fn slice_event(
        &mut self,
        event: Result<watcher::Event<ResourceSlice>, watcher::Error>,
        state: &mut LoopState,
    ) {
        match event {
            Ok(watcher::Event::Init) if state.slice_lists > 0 => {
                tracing::info!(node = %self.node, driver = %self.driver, "the watch of our slices started again; reading our slices and the Node afresh");
                self.restart_watches = true;
            }
            Ok(event) => {
                if matches!(event, watcher::Event::Init) {
                    state.slice_lists = state.slice_lists.saturating_add(1);
                }
                state.dirty |= self.cache.apply(event);
            }
            Err(err) => {
                tracing::warn!(driver = %self.driver, node = %self.node, %err, "watching our ResourceSlices failed; reading everything afresh once the API server answers");
                self.watch_failed(state);
            }
        }
    }

    /// A watch failed: counted, and the API server probed (unless a probe is already due).
    fn watch_failed(&self, state: &mut LoopState) {
        self.counters.errors.fetch_add(1, Relaxed);
        let probe = &mut state.probe;
        state
            .probe_at
            .get_or_insert_with(|| Instant::now() + probe.next_delay());
    }

    /// Asks the API server whether it answers again (a read of our Node): if it does, a
    /// resync; if not, the next probe after a longer wait. Breaks when stopped meanwhile.
    async fn probe(&mut self, stop: &CancellationToken, state: &mut LoopState) -> ControlFlow<()> {
        let read = tokio::select! {
            () = stop.cancelled() => return ControlFlow::Break(()),
            read = tokio::time::timeout(RECOVERY_PROBE, self.reread_node()) => read,
        };
        match read {
            Ok(Ok(())) => {
                tracing::info!(driver = %self.driver, node = %self.node, "the API server answers again; reading our slices and Node afresh");
                state.probe_at = None;
                state.probe.reset();
                state.no_server.reset();
                self.counters.resyncs.fetch_add(1, Relaxed);
                self.restart_watches = true;
            }
            Ok(Err(err)) if no_server_listening(&err) => {
                state.probe_at = Some(Instant::now() + state.no_server.next_delay());
            }
            // An error from a server that answered, or no answer in time: spared.
            Ok(Err(_)) | Err(_) => {
                state.probe_at = Some(Instant::now() + state.probe.next_delay());
            }
        }
        ControlFlow::Continue(())
    }

    /// The watches started again: what they said is forgotten until their fresh lists come,
    /// and a publish follows at once.
    fn forget_watched(&mut self, state: &mut LoopState) {
        // The cache is ready again once the slices are listed.
        self.cache.restart();
        state.node_listed = false;
        state.node_lists = 0;
        // Known again from the fresh list (a changed UID is then no news).
        self.node_uid = None;
        state.slice_lists = 0;
        state.retry_at = None;
        state.retry.reset();
        state.dirty = true;
    }

    /// Publishes the newest list; a failure is retried after the delay, which doubles. Breaks
    /// when stopped meanwhile.
    async fn publish(
        &mut self,
        stop: &CancellationToken,
        state: &mut LoopState,
    ) -> ControlFlow<()> {
        state.dirty = false;
        let result = tokio::select! {
            () = stop.cancelled() => return ControlFlow::Break(()),
            result = self.reconcile() => result,
        };
        state.dirty |= std::mem::take(&mut self.republish);
        match result {
            Ok(()) => {
                self.counters.consecutive_failures.store(0, Relaxed);
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                self.counters.last_success_unix.store(now, Relaxed);
                if state.retry.backed_off() {
                    tracing::info!(driver = %self.driver, node = %self.node, "ResourceSlices published again after errors");
                }
                state.retry.reset();
            }
            Err(err) => {
                let wait = state.retry.next_delay();
                tracing::warn!(driver = %self.driver, node = %self.node, %err, retry_in = ?wait, "cannot publish ResourceSlices; retrying");
                self.counters.errors.fetch_add(1, Relaxed);
                self.counters.consecutive_failures.fetch_add(1, Relaxed);
                state.retry_at = Some(Instant::now() + wait);
            }
        }
        ControlFlow::Continue(())
    }
}

/// Whether `err` says that nothing listens at the API server's address (a connection refused),
/// found among its causes.
fn no_server_listening(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wait of a fresh state's backoff after `taken` earlier ones.
    fn wait_after(backoff: fn(LoopState) -> Backoff, taken: usize) -> Duration {
        let mut b = backoff(LoopState::new());
        for _ in 0..taken {
            b.next_delay();
        }
        b.next_delay()
    }

    #[test]
    fn watch_timeouts_are_spread_between_3_and_5_minutes() {
        let timeouts: std::collections::BTreeSet<u32> = (0..200).map(|_| watch_timeout()).collect();
        assert!(
            timeouts.iter().all(|t| (180..=300).contains(t)),
            "{timeouts:?}"
        );
        assert!(timeouts.len() > 50, "{} distinct timeouts", timeouts.len());
    }

    #[test]
    fn probe_and_retry_waits_are_spread_over_75_to_125_percent() {
        for (backoff, max) in [
            (
                (|s| s.probe) as fn(LoopState) -> Backoff,
                RECOVERY_PROBE_MAX,
            ),
            (|s| s.retry, RETRY_MAX),
        ] {
            // Past the cap: 0.5 s doubling to 4 s takes 4 waits, 1 s to 60 s takes 6.
            let waits: Vec<Duration> = (0..200).map(|_| wait_after(backoff, 10)).collect();
            let (lo, hi) = (max.mul_f64(0.75), max.mul_f64(1.25));
            assert!(waits.iter().all(|w| *w >= lo && *w < hi), "{waits:?}");
            // Spread, not one value: drivers that lost the API server together do not ask it in
            // step.
            let distinct: std::collections::BTreeSet<_> = waits.iter().collect();
            assert!(distinct.len() > 100, "{} distinct waits", distinct.len());
        }
        let waits: Vec<Duration> = (0..200).map(|_| wait_after(|s| s.no_server, 10)).collect();
        assert!(
            waits.iter().all(|w| *w >= NO_SERVER_PROBE_MAX.mul_f64(0.75)
                && *w < NO_SERVER_PROBE_MAX.mul_f64(1.25)),
            "{waits:?}"
        );
        let first = wait_after(|s| s.probe, 0);
        assert!(first >= RECOVERY_PROBE.mul_f64(0.75) && first < RECOVERY_PROBE.mul_f64(1.25));
    }

    /// A request to an address where nothing listens is told apart from a server that answers
    /// with an error: only the first is probed again within a second.
    #[tokio::test]
    async fn a_refused_connection_is_no_server_and_an_error_answer_is_not() {
        // A port that was free a moment ago: nothing listens there.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let err = get_node(port).await.unwrap_err();
        assert!(no_server_listening(&err), "{err:?}");

        // A server that answers every request with an error (a 500: kube's client retries a 503).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"etcd away","reason":"InternalError","code":500}"#;
                let answer = format!(
                    "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            }
        });
        let err = get_node(port).await.unwrap_err();
        assert!(!no_server_listening(&err), "{err:?}");
        server.abort();
    }

    async fn get_node(port: u16) -> Result<Option<Node>, kube::Error> {
        let url = format!("http://127.0.0.1:{port}").parse().unwrap();
        let client = kube::Client::try_from(kube::Config::new(url)).unwrap();
        kube::Api::<Node>::all(client).get_opt("n").await
    }
}
