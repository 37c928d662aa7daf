//! The simulated kubelet's `Registration` service, as the device manager handles it
//!: check version and resource name, dial the plugin back
//! inside the call (authority `localhost`, 10 s), ask its options, make it the resource's
//! endpoint, then consume ListAndWatch until it ends; on the end, disconnect the resource's
//! endpoint (every device unhealthy) and forget the resource after the grace period.
//!
//! Which endpoint a stream's end disconnects follows [`ClientKeying`]: kubelets 1.25 to 1.36 look
//! the resource name up again and disconnect whatever client holds it now, so the end of an old
//! instance's stream cuts off a newer registration. An older client that a
//! new registration replaced keeps streaming, and its lists still update the resource, as the
//! kubelet's name-keyed update callback does.

use crate::config::ClientKeying;
use crate::shared::Shared;
use crate::state::{Endpoint, RegistrationRecord, ResourceState, SimDevice};
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
        connect_plugin(
            &self.shared,
            &req.resource_name,
            &socket,
            &req.endpoint,
            false,
        )
        .await?;
        Ok(Response::new(pb::Empty {}))
    }
}

/// The kubelet's `connectClient` + `PluginConnected`: dial the plugin's socket (authority
/// `localhost`, 10 s), ask its options, make it the resource's endpoint and start consuming its
/// ListAndWatch. `endpoint` is recorded as the plugin gave it; `via_watcher` says which route.
pub(crate) async fn connect_plugin(
    shared: &Arc<Shared>,
    resource_name: &str,
    socket: &std::path::Path,
    endpoint: &str,
    via_watcher: bool,
) -> Result<(), Status> {
    let socket = socket.to_path_buf();
    let injected = shared
        .failing_connects
        .fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |n| n.checked_sub(1),
        )
        .is_ok();
    if injected {
        return Err(Status::unknown(format!(
            "failed to dial device plugin: {}: injected fault",
            socket.display()
        )));
    }
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

    let session = shared
        .session
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let stop = session.child_token();
    let keying = shared.config.clients;
    let generation = shared.modify(|node| {
        let resource = node
            .resources
            .entry(resource_name.to_owned())
            .or_insert_with(ResourceState::new);
        if let Some(old) = resource.endpoint.take() {
            // The kubelet overwrites its client entry without closing the old client; with
            // clients keyed by socket path, a client of the same path is the one replaced.
            if keying == ClientKeying::SocketPath && old.socket == socket {
                old.stop.cancel();
            }
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
            resource: resource_name.to_owned(),
            endpoint: endpoint.to_owned(),
            at: Instant::now(),
            via_watcher,
        });
        resource.generation
    });
    tracing::info!(resource = %resource_name, %endpoint, via_watcher, "plugin registered");
    tokio::spawn(list_and_watch(
        shared.clone(),
        resource_name.to_owned(),
        client,
        generation,
        stop,
        session,
    ));
    Ok(())
}

/// One client's life at the kubelet: consume its ListAndWatch stream until it ends or the kubelet
/// closes the client, then do what the kubelet's `runClient` does next (unless the kubelet
/// itself went away).
async fn list_and_watch(
    shared: Arc<Shared>,
    resource: String,
    client: PluginClient,
    generation: u64,
    stop: CancellationToken,
    session: CancellationToken,
) {
    consume(&shared, &resource, client, &stop).await;
    if session.is_cancelled() {
        return;
    }
    // runClient: look the client up again and disconnect it.
    match shared.config.clients {
        ClientKeying::ResourceName => {
            let current = shared.read(|node| {
                node.resource(&resource)
                    .filter(|r| r.endpoint.is_some())
                    .map(|r| r.generation)
            });
            if let Some(current) = current {
                if current != generation {
                    tracing::info!(%resource, "an older client's stream ended; disconnecting the current one, as kubelets up to 1.36 do");
                }
                disconnect(&shared, &resource, current);
            }
        }
        ClientKeying::SocketPath => disconnect(&shared, &resource, generation),
    }
}

/// Reads one client's ListAndWatch stream into the node state until it ends or `stop` fires.
async fn consume(
    shared: &Arc<Shared>,
    resource: &str,
    mut client: PluginClient,
    stop: &CancellationToken,
) {
    let mut stream = tokio::select! {
        _ = stop.cancelled() => return,
        opened = client.list_and_watch(pb::Empty {}) => match opened {
            Ok(response) => response.into_inner(),
            Err(status) => {
                tracing::warn!(%resource, %status, "ListAndWatch failed");
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
                if let Some(r) = node.resources.get_mut(resource) {
                    // The kubelet's update callback is keyed by name: any live client's list
                    // replaces the resource's devices while an endpoint is registered.
                    if r.endpoint.is_some() {
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
                return;
            }
            Err(status) => {
                tracing::info!(%resource, %status, "ListAndWatch broke");
                return;
            }
        }
    }
}

/// The plugin went away: its devices turn unhealthy, and the resource is dropped after the grace
/// period unless the plugin registers again.
pub(crate) fn disconnect(shared: &Arc<Shared>, resource: &str, generation: u64) {
    let still_current = shared.modify(|node| match node.resources.get_mut(resource) {
        Some(r) if r.generation == generation && r.endpoint.is_some() => {
            // Deregister first, then close: the closed client's own stream end then finds
            // nothing to disconnect, as in the kubelet's disconnectClient.
            if let Some(endpoint) = r.endpoint.take() {
                endpoint.stop.cancel();
            }
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
