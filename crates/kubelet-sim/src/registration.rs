//! The simulated kubelet's `Registration` service, as the device manager handles it
//! (protocol.md §3.2, §3.3, §3.5, §3.9): check version and resource name, dial the plugin back
//! inside the call (authority `localhost`, 10 s), ask its options, replace any previous endpoint
//! of the resource, then consume ListAndWatch until it ends; on the end, mark every device
//! unhealthy and forget the resource after the grace period.

use crate::state::{Endpoint, RegistrationRecord, ResourceState, SimDevice};
use crate::Shared;
use devplug_proto::constants::{DIAL_TIMEOUT_SECS, HEALTHY, VERSION};
use devplug_proto::v1beta1::{self as pb, device_plugin_client::DevicePluginClient};
use devplug_proto::{resource_name, uds};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// A gRPC client to one plugin.
pub(crate) type PluginClient = DevicePluginClient<Channel>;

/// The Registration service on kubelet.sock.
pub(crate) struct RegistrationService {
    pub(crate) shared: Arc<Shared>,
}

#[tonic::async_trait]
impl pb::registration_server::Registration for RegistrationService {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let req = request.into_inner();
        // The kubelet returns plain Go errors, which grpc-go sends as code Unknown.
        if req.version != VERSION {
            return Err(Status::unknown(format!(
                "requested API version {:?} is not supported by kubelet. Supported version is {:?}",
                req.version, VERSION
            )));
        }
        if let Err(err) = resource_name::validate(&req.resource_name) {
            tracing::warn!(%err, "registration refused");
            return Err(Status::unknown(format!(
                "the ResourceName {:?} is invalid",
                req.resource_name
            )));
        }
        let socket = self.shared.dir.join(&req.endpoint);
        let channel = uds::connect(&socket, Duration::from_secs(DIAL_TIMEOUT_SECS))
            .await
            .map_err(|err| {
                Status::unknown(format!(
                    "failed to dial device plugin: {}: {err}",
                    socket.display()
                ))
            })?;
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(pb::Empty {})
            .await?
            .into_inner();

        let stop = self.shared.stop.child_token();
        let generation = self.shared.modify(|node| {
            let resource = node
                .resources
                .entry(req.resource_name.clone())
                .or_insert_with(ResourceState::new);
            if let Some(old) = resource.endpoint.take() {
                old.stop.cancel();
            }
            resource.generation += 1;
            resource.stopped_at = None;
            resource.endpoint = Some(Endpoint {
                socket: socket.clone(),
                options,
                client: client.clone(),
                stop: stop.clone(),
            });
            node.registrations.push(RegistrationRecord {
                resource: req.resource_name.clone(),
                endpoint: req.endpoint.clone(),
                at: Instant::now(),
            });
            resource.generation
        });
        tracing::info!(resource = %req.resource_name, endpoint = %req.endpoint, "plugin registered");
        tokio::spawn(list_and_watch(
            self.shared.clone(),
            req.resource_name,
            client,
            generation,
            stop,
        ));
        Ok(Response::new(pb::Empty {}))
    }
}

/// Consumes one plugin's ListAndWatch stream until it ends or the endpoint is replaced.
async fn list_and_watch(
    shared: Arc<Shared>,
    resource: String,
    mut client: PluginClient,
    generation: u64,
    stop: CancellationToken,
) {
    let mut stream = tokio::select! {
        _ = stop.cancelled() => return,
        opened = client.list_and_watch(pb::Empty {}) => match opened {
            Ok(response) => response.into_inner(),
            Err(status) => {
                tracing::warn!(%resource, %status, "ListAndWatch failed");
                disconnect(&shared, &resource, generation);
                return;
            }
        },
    };
    loop {
        let message = tokio::select! {
            _ = stop.cancelled() => return,
            message = stream.message() => message,
        };
        match message {
            Ok(Some(list)) => shared.modify(|node| {
                if let Some(r) = node.resources.get_mut(&resource) {
                    if r.generation == generation {
                        r.devices = list
                            .devices
                            .into_iter()
                            .map(|d| {
                                let device = SimDevice {
                                    healthy: d.health == HEALTHY,
                                    numa_nodes: d
                                        .topology
                                        .map(|t| t.nodes.iter().map(|n| n.id).collect())
                                        .unwrap_or_default(),
                                };
                                (d.id, device)
                            })
                            .collect();
                        r.updates += 1;
                    }
                }
            }),
            Ok(None) => {
                tracing::info!(%resource, "plugin ended ListAndWatch");
                break;
            }
            Err(status) => {
                tracing::info!(%resource, %status, "ListAndWatch broke");
                break;
            }
        }
    }
    disconnect(&shared, &resource, generation);
}

/// The plugin went away: its devices turn unhealthy, and the resource is dropped after the grace
/// period unless the plugin registers again.
pub(crate) fn disconnect(shared: &Arc<Shared>, resource: &str, generation: u64) {
    let still_current = shared.modify(|node| match node.resources.get_mut(resource) {
        Some(r) if r.generation == generation => {
            r.endpoint = None;
            r.stopped_at = Some(Instant::now());
            for device in r.devices.values_mut() {
                device.healthy = false;
            }
            true
        }
        _ => false,
    });
    if still_current {
        schedule_removal(shared, resource, generation);
    }
}

/// Forgets `resource` after the grace period if it is still the same stopped endpoint.
pub(crate) fn schedule_removal(shared: &Arc<Shared>, resource: &str, generation: u64) {
    let shared = shared.clone();
    let resource = resource.to_owned();
    let grace = shared.config.grace;
    let stop = shared.stop.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(grace) => {}
        }
        shared.modify(|node| {
            let expired = node
                .resources
                .get(&resource)
                .is_some_and(|r| r.generation == generation && r.endpoint.is_none());
            if expired {
                tracing::info!(%resource, "grace period over; resource removed");
                node.resources.remove(&resource);
            }
        });
    });
}
