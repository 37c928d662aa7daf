//! What the publisher's handle (`publisher`), its task (`reconcile`, `event_loop`) and the
//! driver-name check (`validate`) share: what the task reports ([`SliceCounters`],
//! [`Published`]), why a publisher could not start or clean up ([`SliceError`]), and the field
//! selector of our slices.

use devplug::DeviceList;
use std::sync::atomic::AtomicU64;

/// Counters of a [`SlicePublisher`](super::SlicePublisher), for metrics and benchmarks.
#[derive(Debug, Default)]
pub struct SliceCounters {
    /// Pool states written to the API server (each one or more slice writes).
    pub publishes: AtomicU64,
    /// Slices created, replaced or deleted.
    pub writes: AtomicU64,
    /// API errors (each followed by a retry).
    pub errors: AtomicU64,
    /// Microseconds from noticing a new device list to its last slice written, for the most
    /// recent list that needed writes.
    pub last_publish_latency_us: AtomicU64,
    /// Resyncs: our slices and Node read afresh because a slice we knew of was gone.
    pub resyncs: AtomicU64,
    /// Publish attempts that failed since the last one that worked (0: the slices are right
    /// as far as we know).
    pub consecutive_failures: AtomicU64,
    /// When the API server last confirmed our slices, in seconds since the Unix epoch (0:
    /// never).
    pub last_success_unix: AtomicU64,
}

/// What the API server holds, as last confirmed by the publisher.
#[derive(Debug, Clone)]
pub struct Published {
    /// The backend's device list the slices show.
    pub list: DeviceList,
    /// The pool generation.
    pub generation: i64,
    /// How many slices the pool has.
    pub slices: usize,
    /// How many devices were published (healthy ones, less any skipped).
    pub devices: usize,
}

/// Why a publisher could not start or clean up.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// The driver name is not one the API server takes.
    #[error("DRA driver name {name:?}: {reason}")]
    DriverName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An API call failed.
    #[error("ResourceSlices of driver {driver} on node {node}: {source}")]
    Api {
        /// The driver.
        driver: String,
        /// The node.
        node: String,
        /// The API error.
        source: kube::Error,
    },
}

/// The field selector of the slices of `driver` on `node`.
pub(super) fn selector(driver: &str, node: &str) -> String {
    format!("spec.nodeName={node},spec.driver={driver}")
}

/// The UID of the Node `node`, or `None` when there is none: what the publisher reads when it
/// probes a lost API server and after a resync. A list of the one Node (field selector
/// `metadata.name`, its metadata alone), not a get: the chart's DRA role may list and watch
/// Nodes (the slices' watch of the Node) but not get one, and a refused read would count as an
/// API server that does not answer, for ever.
pub async fn read_node_uid(
    client: kube::Client,
    node: &str,
) -> Result<Option<String>, kube::Error> {
    use k8s_openapi::api::core::v1::Node;
    let nodes: kube::Api<kube::core::PartialObjectMeta<Node>> = kube::Api::all(client);
    let listed = nodes
        .list(
            &kube::api::ListParams::default()
                .fields(&format!("metadata.name={node}"))
                .limit(1),
        )
        .await?;
    Ok(listed.items.into_iter().find_map(|n| n.metadata.uid))
}
