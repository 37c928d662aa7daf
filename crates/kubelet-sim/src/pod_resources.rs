//! The kubelet's pod resources API v1, served from the simulator's state on
//! its own socket:
//!
//! - `List`: active pods only (a removed pod is gone), app containers only (init containers are
//!   not reported), each container's devices grouped per resource and NUMA node: a device is
//!   listed once per NUMA node it has, or once without topology;
//! - `GetAllocatableResources`: healthy devices of every resource, the same way;
//! - `Get`: one pod, or the kubelet's "pod %s in namespace %s not found";
//! - a token bucket of 100 calls per second with a burst of 10, shared by every client; excess
//!   calls get `ResourceExhausted` "rejected by rate limit".
//!
//! Pods are named `namespace/name` in [`Kubelet::allocate`](crate::Kubelet::allocate); a name
//! without `/` is in namespace `default`.

use crate::shared::Shared;
use crate::state::{NodeState, SimDevice};
use devplug_proto::constants::{POD_RESOURCES_BURST, POD_RESOURCES_QPS};
use devplug_proto::podresources::{
    pod_resources_lister_server::PodResourcesLister, AllocatableResourcesRequest,
    AllocatableResourcesResponse, ContainerDevices, ContainerResources, GetPodResourcesRequest,
    GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, NumaNode,
    PodResources, TopologyInfo,
};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tonic::{Request, Response, Status};

/// The kubelet's token bucket.
#[derive(Debug)]
pub(crate) struct RateLimit {
    tokens: f64,
    at: Instant,
}

impl RateLimit {
    pub(crate) fn new() -> Self {
        RateLimit {
            tokens: f64::from(POD_RESOURCES_BURST),
            at: Instant::now(),
        }
    }

    fn take(&mut self) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * f64::from(POD_RESOURCES_QPS);
        self.tokens = (self.tokens + refill).min(f64::from(POD_RESOURCES_BURST));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The `v1.PodResourcesLister` service.
pub(crate) struct PodResourcesService {
    pub(crate) shared: Arc<Shared>,
    pub(crate) limit: Arc<Mutex<RateLimit>>,
}

impl PodResourcesService {
    fn admit(&self) -> Result<(), Status> {
        self.shared.modify(|node| node.pod_resources_calls += 1);
        let allowed = self.limit.lock().unwrap_or_else(|e| e.into_inner()).take();
        if allowed {
            Ok(())
        } else {
            Err(Status::resource_exhausted("rejected by rate limit"))
        }
    }
}

/// Splits `namespace/name`; a bare name is in `default`.
pub(crate) fn split_pod(pod: &str) -> (&str, &str) {
    pod.split_once('/').unwrap_or(("default", pod))
}

/// Devices of one resource as the kubelet lists them: grouped per NUMA node (a device on two
/// nodes appears in both groups), devices without topology in one group without topology.
fn grouped<'a>(
    resource: &str,
    ids: impl IntoIterator<Item = &'a String>,
    devices: Option<&BTreeMap<String, SimDevice>>,
) -> Vec<ContainerDevices> {
    let mut by_node: BTreeMap<Option<i64>, Vec<String>> = BTreeMap::new();
    for id in ids {
        let nodes = devices
            .and_then(|d| d.get(id))
            .map(|d| d.numa_nodes.clone())
            .unwrap_or_default();
        if nodes.is_empty() {
            by_node.entry(None).or_default().push(id.clone());
        }
        for node in nodes {
            by_node.entry(Some(node)).or_default().push(id.clone());
        }
    }
    by_node
        .into_iter()
        .map(|(node, device_ids)| ContainerDevices {
            resource_name: resource.to_owned(),
            device_ids,
            topology: node.map(|id| TopologyInfo {
                nodes: vec![NumaNode { id }],
            }),
        })
        .collect()
}

fn pod_resources(node: &NodeState, pod: &str) -> Option<PodResources> {
    let state = node.pods.get(pod)?;
    let (namespace, name) = split_pod(pod);
    let containers = state
        .containers
        .iter()
        .filter(|(container, _)| !state.init_containers.contains(*container))
        .map(|(container, resources)| ContainerResources {
            name: container.clone(),
            devices: resources
                .iter()
                .flat_map(|(resource, allocation)| {
                    grouped(
                        resource,
                        &allocation.device_ids,
                        node.resources.get(resource).map(|r| &r.devices),
                    )
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    Some(PodResources {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        containers,
        ..Default::default()
    })
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.admit()?;
        let pod_resources = self.shared.read(|node| {
            node.pods
                .keys()
                .filter_map(|pod| pod_resources(node, pod))
                .collect()
        });
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        self.admit()?;
        let devices = self.shared.read(|node| {
            node.resources
                .iter()
                .flat_map(|(name, r)| {
                    let healthy = r
                        .devices
                        .iter()
                        .filter(|(_, d)| d.healthy)
                        .map(|(id, _)| id);
                    grouped(name, healthy, Some(&r.devices))
                })
                .collect()
        });
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        self.admit()?;
        let req = request.into_inner();
        let key = if req.pod_namespace == "default" {
            req.pod_name.clone()
        } else {
            format!("{}/{}", req.pod_namespace, req.pod_name)
        };
        let found = self.shared.read(|node| {
            pod_resources(node, &key).or_else(|| {
                // A pod in `default` may also have been named with its namespace.
                pod_resources(node, &format!("{}/{}", req.pod_namespace, req.pod_name))
            })
        });
        match found {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(pod),
            })),
            None => Err(Status::unknown(format!(
                "pod {} in namespace {} not found",
                req.pod_name, req.pod_namespace
            ))),
        }
    }
}
