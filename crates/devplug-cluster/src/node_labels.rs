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

use devplug::NodeLabels;
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

/// The field manager of the labels devplug applies on a Node (direct mode).
pub const FIELD_MANAGER: &str = "devplug-node-labels";
/// NFD's label on a NodeFeature naming the node its labels are for.
pub const NFD_NODE_LABEL: &str = "nfd.node.kubernetes.io/node-name";
/// The label on our NodeFeature objects, so that the uninstall finds them.
pub const OWNER_LABEL: &str = "app.kubernetes.io/managed-by";
/// Its value.
pub const OWNER: &str = "devplug";

/// Retry delay after an API error (doubling to 30 s).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

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
    api.patch(
        node,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
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
    let found = api.get(node).await.map_err(api_error("get", node))?;
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
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&object),
    )
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
    let list = match api.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => list,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Vec::new()),
        Err(e) => return Err(api_error("list NodeFeatures", who)(e)),
    };
    let mut deleted = Vec::new();
    for object in list.items {
        let Some(name) = object.metadata.name else {
            continue;
        };
        match api.delete(&name, &DeleteParams::default()).await {
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
        let (desired, rx) = watch::channel(None);
        let counters = std::sync::Arc::new(LabelCounters::default());
        let stop = CancellationToken::new();
        tokio::spawn(run(client, node, mode, rx, counters.clone(), stop.clone()));
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

async fn run(
    client: kube::Client,
    node: String,
    mode: Mode,
    mut desired: watch::Receiver<Option<NodeLabels>>,
    counters: std::sync::Arc<LabelCounters>,
    stop: CancellationToken,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let nodes: Api<Node> = Api::all(client.clone());
    // Direct mode watches our Node, to put back what someone removes; NFD owns the Node in the
    // other mode.
    let mut events = match mode {
        Mode::Direct => watcher(
            nodes.clone(),
            watcher::Config::default().fields(&format!("metadata.name={node}")),
        )
        .default_backoff()
        .applied_objects()
        .boxed(),
        Mode::NodeFeature { .. } => futures_util::stream::pending().boxed(),
    };
    let mut written: Option<NodeLabels> = None;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut delay = RETRY_FIRST;
    loop {
        let due =
            retry_at.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400));
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = desired.changed() => if changed.is_err() { return },
            event = events.next() => match event {
                Some(Ok(n)) => {
                    let wanted = desired.borrow().clone();
                    match (&written, &wanted) {
                        (Some(w), Some(want)) if w == want && !carries(&n, want) => written = None,
                        _ => continue,
                    }
                }
                Some(Err(err)) => {
                    tracing::debug!(%node, %err, "watching our Node for its labels failed; retrying");
                    continue;
                }
                None => return,
            },
            _ = tokio::time::sleep_until(due), if retry_at.is_some() => retry_at = None,
        }
        // Nothing is written before the backends have said what they describe.
        let Some(wanted) = desired.borrow_and_update().clone() else {
            continue;
        };
        if written.as_ref() == Some(&wanted) {
            continue;
        }
        let result = match &mode {
            // No labels: remove ours, without touching a Node that has none.
            Mode::Direct if wanted.is_empty() => remove_direct(&nodes, &node).await.map(drop),
            Mode::Direct => apply_direct(&nodes, &node, &wanted).await,
            Mode::NodeFeature { namespace } => {
                apply_node_feature(&client, namespace, &node, &wanted).await
            }
        };
        match result {
            Ok(()) => {
                tracing::info!(%node, labels = wanted.len(), "node labels written");
                counters.applied.fetch_add(1, Relaxed);
                written = Some(wanted);
                delay = RETRY_FIRST;
            }
            Err(err) => {
                tracing::warn!(%node, %err, retry_in = ?delay, "cannot write the node labels; retrying");
                counters.errors.fetch_add(1, Relaxed);
                retry_at = Some(tokio::time::Instant::now() + delay);
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    }
}
