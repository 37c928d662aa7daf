//! The kubelet's DRA device health stream, `DRAResourceHealth/NodeWatchResources`, served on
//! the driver's `DRAPlugin` socket in both packages the kubelets speak: `v1` (Kubernetes 1.37+,
//! which prefers it) and `v1alpha1` (1.34-1.36, and 1.37-1.39 for older drivers). With the `ResourceHealthStatus` feature (beta and
//! on in Kubernetes 1.36) the kubelet opens it when the driver registers and shows the health of
//! each allocated device in the status of the pods that use it
//! (`status.containerStatuses[].allocatedResourcesStatus`, the reason as `message`).
//!
//! Each message lists every device of the pool: at once, on every change of the backend's list
//! (event-driven, from the same channel the ResourceSlices follow), and again every
//! [`RESEND_EVERY`] without a change. The resend is the kubelet's rule, not polling: it reads a
//! device as `Unknown` once no message named it for the timeout the message gives
//! ([`HEALTH_TIMEOUT_SECONDS`]), which is how it tells a hung driver from a quiet one.

use devplug::{DeviceList, Health};
use devplug_proto::dra_health_v1 as pb_v1;
use devplug_proto::dra_health_v1alpha1 as pb;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

/// How long the kubelet may trust one message about a device (sent in every message).
pub const HEALTH_TIMEOUT_SECONDS: i64 = 60;

/// How often the whole list goes again when nothing changed: well within the timeout, so a
/// late message never turns a device `Unknown`.
pub const RESEND_EVERY: Duration = Duration::from_secs(20);

/// The kubelet's limit on a health message (longer ones it cuts).
const MAX_MESSAGE: usize = 1024;

/// The `DRAResourceHealth` service of one driver: its pool's devices and their health.
#[derive(Clone)]
pub struct DeviceHealthService {
    pool: String,
    devices: watch::Receiver<DeviceList>,
    stop: CancellationToken,
}

impl DeviceHealthService {
    /// The tonic server for the devices of `pool` in `devices`; streams end with `stop`.
    pub fn server(
        pool: &str,
        devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
    ) -> pb::dra_resource_health_server::DraResourceHealthServer<DeviceHealthService> {
        pb::dra_resource_health_server::DraResourceHealthServer::new(DeviceHealthService {
            pool: pool.to_owned(),
            devices,
            stop,
        })
    }
}

/// One message: every device of `list` in `pool`, determined now.
pub fn health_message(pool: &str, list: &DeviceList) -> pb::NodeWatchResourcesResponse {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let devices = list
        .devices()
        .iter()
        .map(|device| {
            let (health, message) = match &device.health {
                Health::Healthy => (pb::HealthStatus::Healthy, String::new()),
                Health::Unhealthy { reason } => (
                    pb::HealthStatus::Unhealthy,
                    reason.chars().take(MAX_MESSAGE).collect(),
                ),
            };
            pb::DeviceHealth {
                device: Some(pb::DeviceIdentifier {
                    pool_name: pool.to_owned(),
                    device_name: crate::names::device_name(&device.id),
                }),
                health: health.into(),
                last_updated_time: now,
                health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                message,
            }
        })
        .collect();
    pb::NodeWatchResourcesResponse { devices }
}

/// A health stream of messages `M` (one package's `NodeWatchResourcesResponse`).
type HealthStream<M> = Pin<Box<dyn tokio_stream::Stream<Item = Result<M, tonic::Status>> + Send>>;

impl DeviceHealthService {
    /// The same service for the kubelet's `v1` API (Kubernetes 1.37+), served beside `v1alpha1`
    /// on the driver's socket: one list of devices, two wire packages.
    pub fn server_v1(
        pool: &str,
        devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
    ) -> pb_v1::dra_resource_health_server::DraResourceHealthServer<DeviceHealthService> {
        pb_v1::dra_resource_health_server::DraResourceHealthServer::new(DeviceHealthService {
            pool: pool.to_owned(),
            devices,
            stop,
        })
    }

    /// The stream every `NodeWatchResources` call gets: the whole list at once, on every change
    /// and every [`RESEND_EVERY`], each message made by [`health_message`] and put in the
    /// caller's package by `into`.
    fn stream<M: Send + 'static>(
        &self,
        into: fn(pb::NodeWatchResourcesResponse) -> M,
    ) -> HealthStream<M> {
        let mut devices = self.devices.clone();
        let pool = self.pool.clone();
        let stop = self.stop.clone();
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                let message = into(health_message(&pool, &devices.borrow_and_update()));
                tokio::select! {
                    _ = stop.cancelled() => return,
                    sent = tx.send(Ok(message)) => if sent.is_err() { return },
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(RESEND_EVERY) => {}
                    changed = devices.changed() => if changed.is_err() {
                        // The backend is gone: keep the stream (its end reads as every device
                        // Unknown) until shutdown or the kubelet leaves.
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            _ = tx.closed() => {}
                        }
                        return;
                    },
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}

#[tonic::async_trait]
impl pb::dra_resource_health_server::DraResourceHealth for DeviceHealthService {
    type NodeWatchResourcesStream = HealthStream<pb::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: tonic::Request<pb::NodeWatchResourcesRequest>,
    ) -> Result<tonic::Response<Self::NodeWatchResourcesStream>, tonic::Status> {
        Ok(tonic::Response::new(self.stream(|m| m)))
    }
}

#[tonic::async_trait]
impl pb_v1::dra_resource_health_server::DraResourceHealth for DeviceHealthService {
    type NodeWatchResourcesStream = HealthStream<pb_v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: tonic::Request<pb_v1::NodeWatchResourcesRequest>,
    ) -> Result<tonic::Response<Self::NodeWatchResourcesStream>, tonic::Status> {
        Ok(tonic::Response::new(
            self.stream(pb_v1::NodeWatchResourcesResponse::from),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devplug::Device;

    #[test]
    fn every_device_with_its_health_and_reason() {
        let list = DeviceList::new([
            Device::new("gpu-0"),
            Device::new("GPU_1").with_health(Health::unhealthy("x".repeat(2000))),
        ]);
        let message = health_message("node-a", &list);
        assert_eq!(message.devices.len(), 2);
        let broken = &message.devices[1];
        let id = broken.device.as_ref().unwrap();
        assert_eq!(id.pool_name, "node-a");
        assert_eq!(id.device_name, crate::names::device_name("GPU_1"));
        assert_eq!(broken.health(), pb::HealthStatus::Unhealthy);
        assert_eq!(broken.message.len(), MAX_MESSAGE);
        assert_eq!(broken.health_check_timeout_seconds, HEALTH_TIMEOUT_SECONDS);
        assert!(broken.last_updated_time > 1_700_000_000);
        assert_eq!(message.devices[0].health(), pb::HealthStatus::Healthy);
        assert!(message.devices[0].message.is_empty());
    }

    #[test]
    fn the_v1_message_says_what_the_v1alpha1_one_says() {
        let list = DeviceList::new([
            Device::new("gpu-0"),
            Device::new("gpu-1").with_health(Health::unhealthy("XID 79")),
        ]);
        let alpha = health_message("node-a", &list);
        let v1 = pb_v1::NodeWatchResourcesResponse::from(alpha.clone());
        // Field for field, number for number: the bytes on the wire are the same.
        use prost::Message;
        assert_eq!(alpha.encode_to_vec(), v1.encode_to_vec());
        assert_eq!(v1.devices[1].health(), pb_v1::HealthStatus::Unhealthy);
        assert_eq!(v1.devices[1].message, "XID 79");
    }
}
