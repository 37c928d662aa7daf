//! Allocation as the kubelet's device manager does it:
//!
//! 1. A container that already has devices of the resource keeps them (no call to the plugin).
//! 2. Devices of the pod's init containers are reused first (`must_include`).
//! 3. The rest come from healthy devices no pod holds; if the plugin offers preferred allocation,
//!    it is asked with exactly one container request, its answer is intersected with the
//!    candidates, and any shortfall is filled in order.
//! 4. `Allocate` is sent with exactly one container request; the first response is kept.
//!
//! Topology alignment is not simulated (the topology manager's `none` policy).

use crate::shared::Shared;
use crate::state::{Allocation, PodState};
use devplug_proto::constants::PRE_START_CONTAINER_TIMEOUT_SECS;
use devplug_proto::v1beta1 as pb;
use std::collections::BTreeSet;
use std::time::Duration;

/// Why the simulated kubelet could not give a container its devices. The messages follow the
/// kubelet's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocationError {
    /// No plugin ever registered the resource (or it was removed after its grace period).
    #[error("cannot allocate unregistered device {0}")]
    Unregistered(String),
    /// The plugin is disconnected.
    #[error("endpoint for {0} has been stopped")]
    Stopped(String),
    /// Not enough healthy, free devices.
    #[error("requested number of devices unavailable for {resource}. Requested: {requested}, Available: {available}")]
    Unavailable {
        /// The resource.
        resource: String,
        /// Devices asked for.
        requested: usize,
        /// Devices free and healthy.
        available: usize,
    },
    /// The plugin answered an RPC with an error.
    #[error("{rpc} failed: {code:?}: {message}")]
    Rpc {
        /// Which RPC.
        rpc: &'static str,
        /// The gRPC status code.
        code: tonic::Code,
        /// The plugin's message.
        message: String,
    },
    /// The plugin answered Allocate with no container response.
    #[error("Allocate returned no container responses")]
    EmptyResponse,
}

impl AllocationError {
    fn rpc(rpc: &'static str, status: tonic::Status) -> Self {
        AllocationError::Rpc {
            rpc,
            code: status.code(),
            message: status.message().to_owned(),
        }
    }
}

/// Which kind of container is being admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContainerKind {
    Init,
    App,
}

pub(crate) async fn allocate(
    shared: &Shared,
    pod: &str,
    container: &str,
    kind: ContainerKind,
    resource: &str,
    count: usize,
) -> Result<Allocation, AllocationError> {
    // Admission is serial in the kubelet; so it is here.
    let _admission = shared.admission.lock().await;

    // Decide which ids are needed, under the state lock, without awaiting.
    let plan = shared.read(|node| {
        if let Some(existing) = node.allocation(pod, container, resource) {
            return Ok(Plan::Existing(existing.clone()));
        }
        let r = node
            .resource(resource)
            .ok_or_else(|| AllocationError::Unregistered(resource.to_owned()))?;
        let endpoint = r
            .endpoint
            .as_ref()
            .ok_or_else(|| AllocationError::Stopped(resource.to_owned()))?;
        let reusable: Vec<String> = node
            .pods
            .get(pod)
            .and_then(|p| p.reusable.get(resource))
            .map(|set| set.iter().take(count).cloned().collect())
            .unwrap_or_default();
        let in_use = node.in_use(resource);
        let candidates: Vec<String> = r
            .devices
            .iter()
            .filter(|(id, d)| d.healthy && !in_use.contains(id.as_str()))
            .map(|(id, _)| id.clone())
            .collect();
        let needed = count - reusable.len();
        if candidates.len() < needed {
            return Err(AllocationError::Unavailable {
                resource: resource.to_owned(),
                requested: count,
                available: candidates.len(),
            });
        }
        Ok(Plan::New {
            reusable,
            candidates,
            needed,
            preferred: endpoint.options.get_preferred_allocation_available,
            client: endpoint.client.clone(),
        })
    })?;

    let (mut chosen, candidates, needed, preferred, mut client) = match plan {
        Plan::Existing(allocation) => return Ok(allocation),
        Plan::New {
            reusable,
            candidates,
            needed,
            preferred,
            client,
        } => (reusable, candidates, needed, preferred, client),
    };

    if needed > 0 {
        let mut picked: Vec<String> = Vec::with_capacity(needed);
        if preferred {
            let mut available = candidates.clone();
            available.extend(chosen.iter().cloned());
            let request = pb::PreferredAllocationRequest {
                container_requests: vec![pb::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available,
                    must_include_device_i_ds: chosen.clone(),
                    allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
                }],
            };
            let answer = client
                .get_preferred_allocation(request)
                .await
                .map_err(|s| AllocationError::rpc("GetPreferredAllocation", s))?
                .into_inner();
            let candidate_set: BTreeSet<&String> = candidates.iter().collect();
            if let Some(first) = answer.container_responses.first() {
                for id in &first.device_i_ds {
                    if picked.len() < needed && candidate_set.contains(id) && !picked.contains(id) {
                        picked.push(id.clone());
                    }
                }
            }
        }
        for id in &candidates {
            if picked.len() == needed {
                break;
            }
            if !picked.contains(id) {
                picked.push(id.clone());
            }
        }
        chosen.extend(picked);
    }

    let request = pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest {
            devices_ids: chosen.clone(),
        }],
    };
    let response = client
        .allocate(request)
        .await
        .map_err(|s| AllocationError::rpc("Allocate", s))?
        .into_inner()
        .container_responses
        .into_iter()
        .next()
        .ok_or(AllocationError::EmptyResponse)?;

    let allocation = Allocation {
        device_ids: chosen,
        response,
    };
    shared.modify(|node| {
        let pod_state = node
            .pods
            .entry(pod.to_owned())
            .or_insert_with(PodState::default);
        if kind == ContainerKind::Init {
            pod_state.init_containers.insert(container.to_owned());
        }
        let reusable = pod_state.reusable.entry(resource.to_owned()).or_default();
        match kind {
            ContainerKind::Init => reusable.extend(allocation.device_ids.iter().cloned()),
            ContainerKind::App => {
                for id in &allocation.device_ids {
                    reusable.remove(id);
                }
            }
        }
        pod_state
            .containers
            .entry(container.to_owned())
            .or_default()
            .insert(resource.to_owned(), allocation.clone());
    });
    Ok(allocation)
}

/// Calls PreStartContainer for the container's devices if the plugin asked for it; returns
/// whether it was called.
pub(crate) async fn pre_start(
    shared: &Shared,
    pod: &str,
    container: &str,
    resource: &str,
) -> Result<bool, AllocationError> {
    let call = shared.read(|node| {
        let allocation = node.allocation(pod, container, resource)?;
        let endpoint = node.resource(resource)?.endpoint.as_ref()?;
        endpoint
            .options
            .pre_start_required
            .then(|| (endpoint.client.clone(), allocation.device_ids.clone()))
    });
    let Some((mut client, ids)) = call else {
        return Ok(false);
    };
    let mut request = tonic::Request::new(pb::PreStartContainerRequest { devices_ids: ids });
    request.set_timeout(Duration::from_secs(PRE_START_CONTAINER_TIMEOUT_SECS));
    client
        .pre_start_container(request)
        .await
        .map_err(|s| AllocationError::rpc("PreStartContainer", s))?;
    Ok(true)
}

enum Plan {
    Existing(Allocation),
    New {
        reusable: Vec<String>,
        candidates: Vec<String>,
        needed: usize,
        preferred: bool,
        client: crate::registration::PluginClient,
    },
}
