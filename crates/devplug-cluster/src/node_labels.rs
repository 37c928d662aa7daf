//! Node labels from what the backends discover (`nvidia.com/gpu.product`, …), written one of two
//! ways:
//!
//! - [`Mode::Direct`]: server-side apply of `metadata.labels` on our own Node under the field
//!   manager [`FIELD_MANAGER`]. The API server remembers which keys that manager set, so a key
//!   left out of the next apply is removed from the Node, and nothing another manager set is
//!   touched. Removing them all ([`remove_direct`], the uninstall) is one apply of no labels.
//! - [`Mode::NodeFeature`]: a `NodeFeature` object (`nfd.k8s-sigs.io/v1alpha1`, namespaced,
//!   labelled `nfd.node.kubernetes.io/node-name: <node>`) whose `spec.labels` Node Feature
//!   Discovery's master turns into labels of the Node, as GPU Feature Discovery does. Deleting
//!   the object ([`remove_node_feature`]) makes NFD remove them.
//!
//! [`NodeLabeler`] keeps them in step with the backends, event-driven: a new label set is written
//! at once; in direct mode a watch on our Node puts back a label someone removed or changed.
//!
//! Bounded, whoever else writes: only keys [`writable_key`] allows are written (the GPU vendors'
//! prefixes, never the GPU operators' control labels; an invalid key or value is skipped with a
//! warning, not the whole set), every request has a timeout ([`crate::REQUEST_TIMEOUT`]), and a put-back
//! that follows another within [`FIGHT_WINDOW`] waits longer each time (jittered, from
//! [`FIGHT_FIRST`] to [`FIGHT_MAX`]): two writers with one field manager (an old and a new pod
//! with different label sets, two releases) settle instead of rewriting the Node at round-trip
//! speed, which every Node watcher of the cluster would see. After [`FIGHTS_BEFORE_WARNING`] such
//! put-backs in a row devplug says so once, in its log and in a Warning event on the Node.

use crate::timed;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Node labels, key → value, in key order (what a backend's labels source sends).
pub type NodeLabels = std::collections::BTreeMap<String, String>;

/// The field manager of the labels devplug applies on a Node (direct mode).
pub const FIELD_MANAGER: &str = "devplug-node-labels";
/// NFD's label on a NodeFeature naming the node its labels are for.
pub const NFD_NODE_LABEL: &str = "nfd.node.kubernetes.io/node-name";
/// The label on our NodeFeature objects, so that the uninstall finds them.
pub const OWNER_LABEL: &str = "app.kubernetes.io/managed-by";
/// Its value.
pub const OWNER: &str = "devplug";

/// Retry delay after an API error (doubling to 30 s, jittered).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// A put-back within this long of the previous one is part of a fight with another writer.
pub const FIGHT_WINDOW: Duration = Duration::from_secs(120);
/// The wait before the second put-back of a fight (doubling, jittered).
pub const FIGHT_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two put-backs of a fight.
pub const FIGHT_MAX: Duration = Duration::from_secs(300);
/// Put-backs in a row after which the fight is reported.
pub const FIGHTS_BEFORE_WARNING: u32 = 5;
/// The reason of the Node event reporting a fight.
pub const FIGHT_REASON: &str = "NodeLabelsContested";

/// The label prefixes devplug writes under: the GPU vendors' labellers'.
pub const VENDOR_PREFIXES: [&str; 3] = ["nvidia.com/", "amd.com/", "gpu.intel.com/"];
/// Keys under those prefixes that devplug never writes: the GPU operators' control labels,
/// which select what an operator deploys (`nvidia.com/gpu.deploy.*`) or how it configures the
/// GPUs (`nvidia.com/mig.config`, …). The chart's admission policies refuse them too.
pub const CONTROL_PREFIXES: [&str; 8] = [
    "nvidia.com/gpu.deploy.",
    "nvidia.com/mig.config",
    "nvidia.com/vgpu.config",
    "nvidia.com/gpu.workload.config",
    "nvidia.com/device-plugin.config",
    "nvidia.com/gpu-driver-upgrade",
    "nvidia.com/cc.",
    "nvidia.com/ofed-driver-upgrade",
];

/// Why devplug does not write a label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelRefused {
    /// Not under a GPU vendor's prefix.
    #[error("{0}: not under nvidia.com/, amd.com/ or gpu.intel.com/")]
    Prefix(String),
    /// A GPU operator's control label.
    #[error("{0}: a GPU operator's control label, which devplug never writes")]
    Control(String),
    /// Not a valid label key.
    #[error("{0}: not a valid label key (a DNS prefix, '/', and a name of at most 63 letters, digits, '-', '_', '.')")]
    Key(String),
    /// Not a valid label value.
    #[error("{key}={value:?}: not a valid label value (at most 63 letters, digits, '-', '_', '.', starting and ending with a letter or digit)")]
    Value {
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
}

/// Whether `s` is a label name or value: at most 63 of `[A-Za-z0-9_.-]`, starting and ending
/// with a letter or digit (an empty value is allowed; an empty name is not).
fn label_segment(s: &str) -> bool {
    s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
}

/// Whether devplug may write the label `key`: under a GPU vendor's prefix, not a control label,
/// and a valid key.
pub fn writable_key(key: &str) -> Result<(), LabelRefused> {
    if !VENDOR_PREFIXES.iter().any(|p| key.starts_with(p)) {
        return Err(LabelRefused::Prefix(key.to_owned()));
    }
    if CONTROL_PREFIXES.iter().any(|p| key.starts_with(p)) {
        return Err(LabelRefused::Control(key.to_owned()));
    }
    match key.split_once('/') {
        Some((_, name)) if !name.is_empty() && label_segment(name) => Ok(()),
        _ => Err(LabelRefused::Key(key.to_owned())),
    }
}

/// `labels` without those devplug may not write, and why each was left out.
pub fn writable(labels: &NodeLabels) -> (NodeLabels, Vec<LabelRefused>) {
    let mut kept = NodeLabels::new();
    let mut refused = Vec::new();
    for (key, value) in labels {
        if let Err(why) = writable_key(key) {
            refused.push(why);
        } else if !label_segment(value) {
            refused.push(LabelRefused::Value {
                key: key.clone(),
                value: value.clone(),
            });
        } else {
            kept.insert(key.clone(), value.clone());
        }
    }
    (kept, refused)
}

/// How the labels reach the Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Server-side apply on our own Node's labels.
    Direct,
    /// A NodeFeature object in this namespace, for Node Feature Discovery.
    NodeFeature {
        /// The namespace of the object (devplug's own).
        namespace: String,
    },
}

/// Why labels could not be written or removed.
#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    /// The API server refused or could not be reached.
    #[error("{action} on node {node}: {source}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// The node.
        node: String,
        /// The error.
        #[source]
        source: kube::Error,
    },
}

fn api_error(action: &'static str, node: &str) -> impl FnOnce(kube::Error) -> LabelError {
    let node = node.to_owned();
    move |source| LabelError::Api {
        action,
        node,
        source,
    }
}

/// The NodeFeature kind of Node Feature Discovery.
pub fn node_feature_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nfd.k8s-sigs.io", "v1alpha1", "NodeFeature"),
        "nodefeatures",
    )
}

/// The name of our NodeFeature object for `node`.
pub fn node_feature_name(node: &str) -> String {
    format!("devplug-{node}")
}

/// Applies `labels` as the whole set of labels our field manager owns on `node`: keys it set
/// before and not in `labels` are removed, other managers' keys are left alone. Takes over a
/// key another manager set to a different value (GPU Feature Discovery's, when moving over).
pub async fn apply_direct(
    api: &Api<Node>,
    node: &str,
    labels: &NodeLabels,
) -> Result<(), LabelError> {
    let patch = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": node, "labels": labels },
    });
    timed(api.patch(
        node,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    ))
    .await
    .map_err(api_error("apply labels", node))?;
    Ok(())
}

/// The label keys our field manager owns on `node` (from its `managedFields`).
pub fn owned_keys(node: &Node) -> BTreeSet<String> {
    node.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.manager.as_deref() == Some(FIELD_MANAGER) && m.operation.as_deref() == Some("Apply")
        })
        .filter_map(|m| m.fields_v1.as_ref())
        .filter_map(|f| f.0.pointer("/f:metadata/f:labels")?.as_object().cloned())
        .flat_map(|labels| {
            labels
                .into_iter()
                .filter_map(|(k, _)| k.strip_prefix("f:").map(str::to_owned))
        })
        .collect()
}

/// Removes every label our field manager set on `node` and nothing else; returns the keys it
/// owned (none: the Node is not touched).
pub async fn remove_direct(api: &Api<Node>, node: &str) -> Result<BTreeSet<String>, LabelError> {
    let found = timed(api.get(node)).await.map_err(api_error("get", node))?;
    let owned = owned_keys(&found);
    if !owned.is_empty() {
        apply_direct(api, node, &NodeLabels::new()).await?;
    }
    Ok(owned)
}

/// Applies our NodeFeature object for `node` in `namespace` with `labels`.
pub async fn apply_node_feature(
    client: &kube::Client,
    namespace: &str,
    node: &str,
    labels: &NodeLabels,
) -> Result<(), LabelError> {
    let resource = node_feature_resource();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource);
    let name = node_feature_name(node);
    let object = serde_json::json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": { NFD_NODE_LABEL: node, OWNER_LABEL: OWNER },
        },
        "spec": { "labels": labels },
    });
    timed(api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&object),
    ))
    .await
    .map_err(api_error("apply NodeFeature", node))?;
    Ok(())
}

/// Deletes our NodeFeature objects in `namespace`: `node`'s, or every node's (`None`). Returns
/// the names deleted; none when there are none, or NFD's NodeFeature kind is not installed.
pub async fn remove_node_feature(
    client: &kube::Client,
    namespace: &str,
    node: Option<&str>,
) -> Result<Vec<String>, LabelError> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &node_feature_resource());
    let mut selector = format!("{OWNER_LABEL}={OWNER}");
    if let Some(node) = node {
        selector.push_str(&format!(",{NFD_NODE_LABEL}={node}"));
    }
    let who = node.unwrap_or("*");
    let list = match timed(api.list(&ListParams::default().labels(&selector))).await {
        Ok(list) => list,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Vec::new()),
        Err(e) => return Err(api_error("list NodeFeatures", who)(e)),
    };
    let mut deleted = Vec::new();
    for object in list.items {
        let Some(name) = object.metadata.name else {
            continue;
        };
        match timed(api.delete(&name, &DeleteParams::default())).await {
            Ok(_) => deleted.push(name),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(api_error("delete NodeFeature", who)(e)),
        }
    }
    Ok(deleted)
}

/// Counters of a [`NodeLabeler`], for metrics and tests.
#[derive(Debug, Default)]
pub struct LabelCounters {
    /// Label sets written.
    pub applied: std::sync::atomic::AtomicU64,
    /// API errors.
    pub errors: std::sync::atomic::AtomicU64,
    /// Put-backs that followed another within [`FIGHT_WINDOW`] (another writer undoes ours).
    pub fights: std::sync::atomic::AtomicU64,
    /// Labels left out because devplug may not write them ([`writable`]).
    pub skipped: std::sync::atomic::AtomicU64,
    /// When a label set was last written (Unix seconds; 0: never).
    pub last_success_unix: std::sync::atomic::AtomicU64,
    /// Errors since the last write that worked (0 when the last one did).
    pub consecutive_failures: std::sync::atomic::AtomicU64,
}

/// What a [`NodeLabeler`] is started with beside its client, node and mode.
#[derive(Debug, Clone, Default)]
pub struct LabelerOptions {
    /// Where a fight over the labels is reported as a Warning event.
    pub events: Option<crate::events::NodeEvents>,
    /// Passed before the first write ([`crate::policy_check::Gate`]).
    pub gate: Option<crate::policy_check::Gate>,
}

/// Keeps one Node's labels as the backends describe it, until dropped.
#[derive(Debug)]
pub struct NodeLabeler {
    desired: watch::Sender<Option<NodeLabels>>,
    counters: std::sync::Arc<LabelCounters>,
    stop: CancellationToken,
}

impl NodeLabeler {
    /// Starts writing labels for `node` as `mode` says (nothing until [`NodeLabeler::set`]).
    pub fn spawn(client: kube::Client, node: String, mode: Mode) -> NodeLabeler {
        NodeLabeler::spawn_with(client, node, mode, LabelerOptions::default())
    }

    /// The same, with `options`.
    pub fn spawn_with(
        client: kube::Client,
        node: String,
        mode: Mode,
        options: LabelerOptions,
    ) -> NodeLabeler {
        let (desired, rx) = watch::channel(None);
        let counters = std::sync::Arc::new(LabelCounters::default());
        let stop = CancellationToken::new();
        let feature = match mode {
            Mode::Direct => crate::policy_check::Feature::NodeLabels,
            Mode::NodeFeature { .. } => crate::policy_check::Feature::NodeFeatures,
        };
        let task = Task {
            client,
            node,
            mode,
            counters: counters.clone(),
            events: options.events,
        };
        let (gate, task_stop) = (options.gate, stop.clone());
        tokio::spawn(async move {
            if crate::policy_check::pass(gate.as_ref(), feature, &task_stop).await {
                task.run(rx, task_stop).await;
            }
        });
        NodeLabeler {
            desired,
            counters,
            stop,
        }
    }

    /// The labels the Node should carry now; keys left out are removed.
    pub fn set(&self, labels: NodeLabels) {
        self.desired.send_if_modified(|current| {
            let changed = current.as_ref() != Some(&labels);
            *current = Some(labels);
            changed
        });
    }

    /// The counters.
    pub fn counters(&self) -> &LabelCounters {
        &self.counters
    }

    /// The counters, to keep beside the labeler (metrics).
    pub fn shared_counters(&self) -> std::sync::Arc<LabelCounters> {
        self.counters.clone()
    }
}

impl Drop for NodeLabeler {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Whether `node` carries every label of `wanted` with its value.
fn carries(node: &Node, wanted: &NodeLabels) -> bool {
    let labels = node.metadata.labels.as_ref();
    wanted
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// Put-backs of one fight with another writer: how many in a row, the last one's time, and the
/// growing wait before the next.
struct Fight {
    streak: u32,
    last: Option<tokio::time::Instant>,
    backoff: devplug::host::backoff::Backoff,
    reported: bool,
}

impl Fight {
    fn new() -> Fight {
        Fight {
            streak: 0,
            last: None,
            backoff: devplug::host::backoff::Backoff::new(FIGHT_FIRST, FIGHT_MAX).jittered(),
            reported: false,
        }
    }

    /// A put-back is due now: how long to wait before it (none for the first of a fight).
    fn put_back(&mut self, now: tokio::time::Instant) -> Duration {
        // Measured from the previous put-back's write, which came after its wait.
        let close = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < FIGHT_WINDOW);
        let wait = if close {
            self.streak = self.streak.saturating_add(1);
            self.backoff.next_delay()
        } else {
            self.streak = 1;
            self.backoff.reset();
            self.reported = false;
            Duration::ZERO
        };
        self.last = Some(now + wait);
        wait
    }
}

/// The labeler's task.
struct Task {
    client: kube::Client,
    node: String,
    mode: Mode,
    counters: std::sync::Arc<LabelCounters>,
    events: Option<crate::events::NodeEvents>,
}

impl Task {
    async fn run(self, mut desired: watch::Receiver<Option<NodeLabels>>, stop: CancellationToken) {
        use std::sync::atomic::Ordering::Relaxed;
        let node = self.node.clone();
        let nodes: Api<Node> = Api::all(self.client.clone());
        // Direct mode watches our Node, to put back what someone removes; NFD owns the Node in
        // the other mode. Served from the watch cache (no consistent read reaching etcd).
        let mut events = match self.mode {
            Mode::Direct => watcher(
                nodes.clone(),
                watcher::Config::default()
                    .fields(&format!("metadata.name={node}"))
                    .any_semantic(),
            )
            .default_backoff()
            .applied_objects()
            .boxed(),
            Mode::NodeFeature { .. } => futures_util::stream::pending().boxed(),
        };
        let mut written: Option<NodeLabels> = None;
        // No write before this (an API error's retry, or a fight's wait).
        let mut hold: Option<tokio::time::Instant> = None;
        let mut retry = devplug::host::backoff::Backoff::new(RETRY_FIRST, RETRY_MAX).jittered();
        let mut fight = Fight::new();
        let mut warned: BTreeSet<String> = BTreeSet::new();
        loop {
            let due =
                hold.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400));
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = desired.changed() => {
                    if changed.is_err() { return }
                    // New labels from the backends go out at once.
                    hold = None;
                }
                event = events.next() => match event {
                    Some(Ok(n)) => {
                        let wanted = desired.borrow().as_ref().map(|w| writable(w).0);
                        match (&written, &wanted) {
                            (Some(w), Some(want)) if w == want && !carries(&n, want) => {
                                written = None;
                                let wait = fight.put_back(tokio::time::Instant::now());
                                if fight.streak > 1 {
                                    self.counters.fights.fetch_add(1, Relaxed);
                                }
                                if fight.streak >= FIGHTS_BEFORE_WARNING && !fight.reported {
                                    fight.reported = true;
                                    self.report_fight(fight.streak, wait);
                                }
                                if !wait.is_zero() {
                                    hold = Some(tokio::time::Instant::now() + wait);
                                    continue;
                                }
                            }
                            _ => continue,
                        }
                    }
                    Some(Err(err)) => {
                        tracing::debug!(%node, %err, "watching our Node for its labels failed; retrying");
                        continue;
                    }
                    None => return,
                },
                _ = tokio::time::sleep_until(due), if hold.is_some() => hold = None,
            }
            if hold.is_some() {
                continue;
            }
            // Nothing is written before the backends have said what they describe.
            let Some(all) = desired.borrow_and_update().clone() else {
                continue;
            };
            let (wanted, refused) = writable(&all);
            for why in refused {
                if warned.insert(why.to_string()) {
                    self.counters.skipped.fetch_add(1, Relaxed);
                    tracing::warn!(%node, %why, "node label left out");
                }
            }
            if written.as_ref() == Some(&wanted) {
                continue;
            }
            match self.write(&nodes, &wanted).await {
                Ok(()) => {
                    tracing::info!(%node, labels = wanted.len(), "node labels written");
                    written = Some(wanted);
                    self.counters.applied.fetch_add(1, Relaxed);
                    self.counters
                        .last_success_unix
                        .store(crate::unix_now(), Relaxed);
                    self.counters.consecutive_failures.store(0, Relaxed);
                    retry.reset();
                }
                Err(err) => {
                    let delay = retry.next_delay();
                    tracing::warn!(%node, %err, retry_in = ?delay, "cannot write the node labels; retrying");
                    self.counters.errors.fetch_add(1, Relaxed);
                    self.counters.consecutive_failures.fetch_add(1, Relaxed);
                    hold = Some(tokio::time::Instant::now() + delay);
                }
            }
        }
    }

    async fn write(&self, nodes: &Api<Node>, wanted: &NodeLabels) -> Result<(), LabelError> {
        match &self.mode {
            // No labels: remove ours, without touching a Node that has none.
            Mode::Direct if wanted.is_empty() => remove_direct(nodes, &self.node).await.map(drop),
            Mode::Direct => apply_direct(nodes, &self.node, wanted).await,
            Mode::NodeFeature { namespace } => {
                apply_node_feature(&self.client, namespace, &self.node, wanted).await
            }
        }
    }

    /// Says once per fight that another writer keeps undoing our labels.
    fn report_fight(&self, streak: u32, wait: Duration) {
        let note = format!(
            "another writer keeps changing the labels devplug writes on this Node under field \
             manager {FIELD_MANAGER} ({streak} put-backs in a row); devplug now waits up to {} s \
             between put-backs. Two devplug releases labelling one node, or pods of one release \
             with different configs, do this: label each node from one of them",
            FIGHT_MAX.as_secs()
        );
        tracing::warn!(node = %self.node, streak, wait = ?wait, "{note}");
        if let Some(events) = &self.events {
            events.publish(crate::events::NodeEvent {
                warning: true,
                reason: FIGHT_REASON.into(),
                action: "PutBack".into(),
                note,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_vendor_keys_that_are_not_control_labels_are_writable() {
        assert_eq!(writable_key("nvidia.com/gpu.product"), Ok(()));
        assert_eq!(writable_key("amd.com/gpu.device-id"), Ok(()));
        assert_eq!(writable_key("gpu.intel.com/cards"), Ok(()));
        assert!(matches!(
            writable_key("example.com/x"),
            Err(LabelRefused::Prefix(_))
        ));
        assert!(matches!(
            writable_key("nvidia.com.evil/x"),
            Err(LabelRefused::Prefix(_))
        ));
        for control in [
            "nvidia.com/gpu.deploy.operands",
            "nvidia.com/mig.config",
            "nvidia.com/mig.config.state",
            "nvidia.com/device-plugin.config",
        ] {
            assert!(
                matches!(writable_key(control), Err(LabelRefused::Control(_))),
                "{control}"
            );
        }
        assert!(matches!(
            writable_key("nvidia.com/"),
            Err(LabelRefused::Key(_))
        ));
        assert!(matches!(
            writable_key("nvidia.com/a/b"),
            Err(LabelRefused::Key(_))
        ));
        assert!(matches!(
            writable_key(&format!("nvidia.com/{}", "a".repeat(64))),
            Err(LabelRefused::Key(_))
        ));
    }

    #[test]
    fn an_invalid_label_is_left_out_and_the_others_kept() {
        let labels: NodeLabels = [
            ("nvidia.com/gpu.product", "NVIDIA-H100"),
            ("nvidia.com/gpu.family", "not a value"),
            ("nvidia.com/gpu.deploy.driver", "false"),
            ("nvidia.com/gpu.count", ""),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let (kept, refused) = writable(&labels);
        assert_eq!(
            kept.keys().map(String::as_str).collect::<Vec<_>>(),
            ["nvidia.com/gpu.count", "nvidia.com/gpu.product"]
        );
        assert_eq!(refused.len(), 2, "{refused:?}");
    }

    #[test]
    fn put_backs_close_together_wait_longer_each_time() {
        let mut fight = Fight::new();
        let mut now = tokio::time::Instant::now();
        // Someone removed a label once: put back at once.
        assert_eq!(fight.put_back(now), Duration::ZERO);
        let mut waits = Vec::new();
        for _ in 0..12 {
            now += Duration::from_millis(50);
            let wait = fight.put_back(now);
            waits.push(wait);
            now += wait;
        }
        assert!(waits[0] >= FIGHT_FIRST.mul_f64(0.75), "{waits:?}");
        assert!(
            waits.windows(2).all(|w| w[1] >= w[0].mul_f64(0.6)),
            "{waits:?}"
        );
        assert!(
            *waits.last().unwrap_or(&Duration::ZERO) >= FIGHT_MAX.mul_f64(0.75),
            "{waits:?}"
        );
        assert!(
            waits.iter().all(|w| *w <= FIGHT_MAX.mul_f64(1.25)),
            "{waits:?}"
        );
        // Quiet for longer than the window: the next put-back is at once again.
        now += FIGHT_WINDOW;
        assert_eq!(fight.put_back(now), Duration::ZERO);
        assert_eq!(fight.streak, 1);
    }
}
