//! A client of the kubelet's pod resources API v1: which pod holds which
//! device, and what the kubelet counts as allocatable.
//!
//! - [`PodResourcesClient`]: `List`, `GetAllocatableResources` and `Get` over the kubelet's
//!   socket ([`DEFAULT_SOCKET`]), with tonic's 4 MiB decode limit raised (a large node's `List`
//!   is bigger) and at most one call per [`MIN_INTERVAL`]: the kubelet's rate limit (100 QPS, burst
//!   10) is shared by every client on the node, and excess calls get `ResourceExhausted`.
//! - [`holders`] and [`allocatable_counts`]: the answers reduced to what a plugin needs, with
//!   the kubelet's per-NUMA-node duplicates removed.
//! - [`watch_in_use`]: the set of devices in use per resource on a watch channel, for backends
//!   that want it (GPU sharing, cleanup), without making [`Backend`](crate::Backend) bigger.

use devplug_proto::constants::POD_RESOURCES_SOCKET;
use devplug_proto::podresources::{
    pod_resources_lister_client::PodResourcesListerClient, AllocatableResourcesRequest,
    AllocatableResourcesResponse, GetPodResourcesRequest, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use devplug_proto::uds;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// The kubelet's pod resources socket.
pub const DEFAULT_SOCKET: &str = POD_RESOURCES_SOCKET;

/// The least time between two calls of one client.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// The largest answer accepted: 64 MiB (tonic's default is 4 MiB; a `List` of a node with many
/// pods and devices can be larger).
pub const MAX_DECODE_BYTES: usize = 64 * 1024 * 1024;

/// After `ResourceExhausted` (the kubelet's rate limit), calls wait this much longer, doubling
/// up to [`EXHAUSTED_MAX`].
const EXHAUSTED_FIRST: Duration = Duration::from_secs(1);
const EXHAUSTED_MAX: Duration = Duration::from_secs(30);

/// Why a pod resources call failed.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket did not accept a connection.
    #[error("cannot connect to the kubelet's pod resources socket {path}: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered with an error (`ResourceExhausted` when rate-limited).
    #[error("the kubelet's pod resources API answered: {}", .0.message())]
    Call(#[from] tonic::Status),
}

/// A client of the kubelet's pod resources API, paced to one call per interval.
#[derive(Debug, Clone)]
pub struct PodResourcesClient {
    client: PodResourcesListerClient<Channel>,
    interval: Duration,
    penalty: Duration,
    last: Option<Instant>,
}

impl PodResourcesClient {
    /// Connects to the socket at `path`, failing after `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, PodResourcesError> {
        let channel =
            uds::connect(path, timeout)
                .await
                .map_err(|source| PodResourcesError::Connect {
                    path: path.to_owned(),
                    source,
                })?;
        let client =
            PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_DECODE_BYTES);
        Ok(PodResourcesClient {
            client,
            interval: MIN_INTERVAL,
            penalty: Duration::ZERO,
            last: None,
        })
    }

    /// Sets the least time between two calls (default [`MIN_INTERVAL`]). Tests use less; a
    /// production client should not: every client on the node shares the kubelet's 100 QPS.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Waits until the next call is allowed, and marks it made.
    async fn pace(&mut self) {
        if let Some(last) = self.last {
            tokio::time::sleep_until(last + self.interval + self.penalty).await;
        }
        self.last = Some(Instant::now());
    }

    /// Records how a call went: `ResourceExhausted` slows the next calls down.
    fn settle<T>(&mut self, result: Result<T, tonic::Status>) -> Result<T, PodResourcesError> {
        match result {
            Ok(value) => {
                self.penalty = Duration::ZERO;
                Ok(value)
            }
            Err(status) => {
                if status.code() == tonic::Code::ResourceExhausted {
                    self.penalty = if self.penalty.is_zero() {
                        EXHAUSTED_FIRST
                    } else {
                        self.penalty.saturating_mul(2).min(EXHAUSTED_MAX)
                    };
                }
                Err(status.into())
            }
        }
    }

    /// `List`: the resources of every active pod.
    pub async fn list(&mut self) -> Result<ListPodResourcesResponse, PodResourcesError> {
        self.pace().await;
        let result = self
            .client
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner);
        self.settle(result)
    }

    /// `GetAllocatableResources`: what the kubelet can allocate (healthy devices only).
    pub async fn allocatable(&mut self) -> Result<AllocatableResourcesResponse, PodResourcesError> {
        self.pace().await;
        let result = self
            .client
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await
            .map(tonic::Response::into_inner);
        self.settle(result)
    }

    /// `Get`: one pod's resources (kubelets from 1.27 with the gate, on by default from 1.34).
    pub async fn get(
        &mut self,
        namespace: &str,
        pod: &str,
    ) -> Result<PodResources, PodResourcesError> {
        self.pace().await;
        let result = self
            .client
            .get(GetPodResourcesRequest {
                pod_name: pod.to_owned(),
                pod_namespace: namespace.to_owned(),
            })
            .await
            .map(|r| r.into_inner().pod_resources.unwrap_or_default());
        self.settle(result)
    }
}

/// Who holds a device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Holder {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container's name.
    pub container: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.pod, self.container)
    }
}

/// Resource name → device id → holder, from a `List` answer. A device the kubelet lists once
/// per NUMA node appears once; a device reused by a pod's later containers (init-container
/// reuse) is shown with the first container listed.
pub fn holders(list: &ListPodResourcesResponse) -> BTreeMap<String, BTreeMap<String, Holder>> {
    let mut out: BTreeMap<String, BTreeMap<String, Holder>> = BTreeMap::new();
    for pod in &list.pod_resources {
        for container in &pod.containers {
            for devices in &container.devices {
                let by_id = out.entry(devices.resource_name.clone()).or_default();
                for id in &devices.device_ids {
                    by_id.entry(id.clone()).or_insert_with(|| Holder {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                    });
                }
            }
        }
    }
    out
}

/// Resource name → ids the kubelet can allocate, from a `GetAllocatableResources` answer, with
/// per-NUMA-node duplicates removed.
pub fn allocatable_ids(
    answer: &AllocatableResourcesResponse,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for devices in &answer.devices {
        out.entry(devices.resource_name.clone())
            .or_default()
            .extend(devices.device_ids.iter().cloned());
    }
    out
}

/// Resource name → how many devices the kubelet can allocate.
pub fn allocatable_counts(answer: &AllocatableResourcesResponse) -> BTreeMap<String, usize> {
    allocatable_ids(answer)
        .into_iter()
        .map(|(name, ids)| (name, ids.len()))
        .collect()
}

/// Devices in use, by resource name.
pub type InUse = BTreeMap<String, BTreeSet<String>>;

/// Polls `List` every `interval` (at least [`MIN_INTERVAL`] in production) and publishes the
/// devices in use per resource; the channel changes only when the set does. Connection errors
/// are retried at the same pace and logged once per kind. Stops when `stop` is cancelled.
pub fn watch_in_use(
    socket: PathBuf,
    interval: Duration,
    stop: CancellationToken,
) -> watch::Receiver<InUse> {
    let (tx, rx) = watch::channel(InUse::new());
    tokio::spawn(async move {
        let mut client: Option<PodResourcesClient> = None;
        let mut last_error: Option<String> = None;
        loop {
            let outcome = async {
                if client.is_none() {
                    let c = PodResourcesClient::connect(&socket, Duration::from_secs(10)).await?;
                    client = Some(c.with_interval(interval));
                }
                match client.as_mut() {
                    Some(c) => c.list().await,
                    None => Err(PodResourcesError::Call(tonic::Status::unavailable(
                        "no client",
                    ))),
                }
            };
            let result = tokio::select! {
                _ = stop.cancelled() => return,
                result = outcome => result,
            };
            match result {
                Ok(list) => {
                    last_error = None;
                    let in_use: InUse = holders(&list)
                        .into_iter()
                        .map(|(name, ids)| (name, ids.into_keys().collect()))
                        .collect();
                    tx.send_if_modified(|current| {
                        let changed = *current != in_use;
                        if changed {
                            *current = in_use;
                        }
                        changed
                    });
                }
                Err(err) => {
                    let message = err.to_string();
                    if last_error.as_deref() != Some(message.as_str()) {
                        tracing::warn!(error = %message, "pod resources: List failed; retrying");
                        last_error = Some(message);
                    }
                    if matches!(err, PodResourcesError::Connect { .. }) {
                        client = None;
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(interval) => {}
                        }
                    }
                }
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use devplug_proto::podresources::{
        ContainerDevices, ContainerResources, NumaNode, TopologyInfo,
    };

    fn devices(resource: &str, ids: &[&str], numa: Option<i64>) -> ContainerDevices {
        ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
            topology: numa.map(|id| TopologyInfo {
                nodes: vec![NumaNode { id }],
            }),
        }
    }

    #[test]
    fn numa_duplicates_are_removed() {
        let list = ListPodResourcesResponse {
            pod_resources: vec![PodResources {
                name: "p".into(),
                namespace: "ns".into(),
                containers: vec![ContainerResources {
                    name: "c".into(),
                    // A device on two NUMA nodes is listed once per node.
                    devices: vec![
                        devices("a.com/x", &["d0", "d1"], Some(0)),
                        devices("a.com/x", &["d1"], Some(1)),
                    ],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        let held = holders(&list);
        assert_eq!(held["a.com/x"].len(), 2);
        assert_eq!(held["a.com/x"]["d1"].to_string(), "ns/p/c");
        let answer = AllocatableResourcesResponse {
            devices: vec![
                devices("a.com/x", &["d0", "d1"], Some(0)),
                devices("a.com/x", &["d1", "d2"], Some(1)),
            ],
            ..Default::default()
        };
        assert_eq!(allocatable_counts(&answer)["a.com/x"], 3);
    }
}
