//! A minimal third-party-style device plugin, written straight against the v1beta1 gRPC API and
//! not with the devplug library: it stands for "another vendor's plugin" in tests, and plugin
//! authors can use it to exercise their own kubelet-side tooling.
//!
//! It serves a device list that tests change at will, fixed options, `Allocate` answered with
//! configurable container edits (unknown ids are refused with `InvalidArgument`), and
//! `GetPreferredAllocation` answered with the must-include ids followed by the first available
//! ones. [`FakePlugin::register`] calls `Register` on a `kubelet.sock`, as a plugin would.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use kubelet_sim::fake_plugin::{FakeDevice, FakePlugin, FakeSpec};
//! let spec = FakeSpec {
//!     devices: vec![FakeDevice::healthy("gpu-0").numa(0), FakeDevice::healthy("gpu-1").numa(1)],
//!     ids_env: Some("FAKE_VISIBLE_DEVICES".into()),
//!     ..FakeSpec::default()
//! };
//! let plugin = FakePlugin::serve("/tmp/device-plugins/vendor-gpu.sock", spec).await?;
//! plugin.register("/tmp/device-plugins/kubelet.sock", "vendor.example/gpu").await?;
//! plugin.set_health("gpu-1", "Unhealthy");
//! plugin.stop().await;
//! # Ok(()) }
//! ```

use devplug_proto::constants::{DIAL_TIMEOUT_SECS, HEALTHY, UNHEALTHY, VERSION};
use devplug_proto::uds;
use devplug_proto::v1beta1::{
    self as pb,
    device_plugin_server::{DevicePlugin, DevicePluginServer},
    registration_client::RegistrationClient,
};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// One device as the fake plugin sends it in ListAndWatch. The health string is sent as is, so
/// tests can also send strings the kubelet counts as unhealthy (anything but `"Healthy"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeDevice {
    /// The device id.
    pub id: String,
    /// The health string sent on the wire.
    pub health: String,
    /// NUMA nodes; empty sends no topology.
    pub numa_nodes: Vec<i64>,
}

impl FakeDevice {
    /// A device with health `"Healthy"` and no topology.
    pub fn healthy(id: impl Into<String>) -> Self {
        FakeDevice {
            id: id.into(),
            health: HEALTHY.to_owned(),
            numa_nodes: Vec::new(),
        }
    }

    /// A device with health `"Unhealthy"` and no topology.
    pub fn unhealthy(id: impl Into<String>) -> Self {
        FakeDevice {
            health: UNHEALTHY.to_owned(),
            ..FakeDevice::healthy(id)
        }
    }

    /// The same device with one more NUMA node.
    pub fn numa(mut self, node: i64) -> Self {
        self.numa_nodes.push(node);
        self
    }

    fn to_wire(&self) -> pb::Device {
        pb::Device {
            id: self.id.clone(),
            health: self.health.clone(),
            topology: pb::TopologyInfo::for_numa_nodes(&self.numa_nodes),
        }
    }
}

/// What the fake plugin serves.
#[derive(Debug, Clone, Default)]
pub struct FakeSpec {
    /// The initial device list (change it later with [`FakePlugin::set_devices`]).
    pub devices: Vec<FakeDevice>,
    /// The options GetDevicePluginOptions returns.
    pub options: pb::DevicePluginOptions,
    /// The container edits every Allocate container response carries (env, device specs,
    /// mounts, annotations, CDI names).
    pub edits: pb::ContainerAllocateResponse,
    /// If set, this env var is added to each response with the requested ids, comma-separated.
    pub ids_env: Option<String>,
}

/// Why the fake plugin could not serve or register.
#[derive(Debug, thiserror::Error)]
pub enum FakePluginError {
    /// The socket could not be bound.
    #[error("cannot bind {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The socket path has no file name to send as the registration endpoint.
    #[error("socket path {0} has no file name")]
    NoFileName(PathBuf),
    /// `kubelet.sock` could not be dialled.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// The kubelet socket.
        path: PathBuf,
        /// The error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet refused the registration.
    #[error("registration refused: {:?}: {}", .0.code(), .0.message())]
    Refused(#[source] Status),
}

/// A running fake plugin. Dropping it stops serving (the socket file stays until
/// [`FakePlugin::stop`]).
pub struct FakePlugin {
    socket: PathBuf,
    options: pb::DevicePluginOptions,
    devices: Arc<watch::Sender<Vec<FakeDevice>>>,
    stop: CancellationToken,
    server: Option<JoinHandle<()>>,
}

impl FakePlugin {
    /// Binds `socket` (replacing a stale file there) and serves `spec` on it.
    pub async fn serve(
        socket: impl Into<PathBuf>,
        spec: FakeSpec,
    ) -> Result<FakePlugin, FakePluginError> {
        let socket = socket.into();
        let _ = std::fs::remove_file(&socket);
        let listener =
            tokio::net::UnixListener::bind(&socket).map_err(|source| FakePluginError::Bind {
                path: socket.clone(),
                source,
            })?;
        let devices = Arc::new(watch::Sender::new(spec.devices.clone()));
        let stop = CancellationToken::new();
        let service = FakeService {
            spec: Arc::new(spec.clone()),
            devices: devices.clone(),
            stop: stop.clone(),
        };
        let server = uds::spawn_server(
            tonic::transport::Server::builder().add_service(DevicePluginServer::new(service)),
            listener,
            stop.clone().cancelled_owned(),
            "the fake plugin server".to_owned(),
        );
        Ok(FakePlugin {
            socket,
            options: spec.options,
            devices,
            stop,
            server: Some(server),
        })
    }

    /// The socket the plugin serves.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Replaces the device list; every open ListAndWatch stream gets the new list.
    pub fn set_devices(&self, devices: Vec<FakeDevice>) {
        self.devices.send_replace(devices);
    }

    /// Sets one device's health string; returns false if there is no such device.
    pub fn set_health(&self, id: &str, health: &str) -> bool {
        self.devices
            .send_if_modified(|list| match list.iter_mut().find(|d| d.id == id) {
                Some(device) if device.health != health => {
                    device.health = health.to_owned();
                    true
                }
                _ => false,
            })
            || self.devices.borrow().iter().any(|d| d.id == id)
    }

    /// The current device list.
    pub fn devices(&self) -> Vec<FakeDevice> {
        self.devices.borrow().clone()
    }

    /// Calls `Register` on the kubelet socket at `kubelet_socket` for `resource`, sending this
    /// plugin's socket file name as the endpoint. The kubelet dials back inside the call, so the
    /// plugin is already serving.
    pub async fn register(
        &self,
        kubelet_socket: impl AsRef<Path>,
        resource: &str,
    ) -> Result<(), FakePluginError> {
        let kubelet_socket = kubelet_socket.as_ref();
        let endpoint = self
            .socket
            .file_name()
            .ok_or_else(|| FakePluginError::NoFileName(self.socket.clone()))?
            .to_string_lossy()
            .into_owned();
        let channel = uds::connect(kubelet_socket, Duration::from_secs(DIAL_TIMEOUT_SECS))
            .await
            .map_err(|source| FakePluginError::Connect {
                path: kubelet_socket.to_owned(),
                source,
            })?;
        RegistrationClient::new(channel)
            .register(pb::RegisterRequest {
                version: VERSION.to_owned(),
                endpoint,
                resource_name: resource.to_owned(),
                options: Some(self.options),
            })
            .await
            .map_err(FakePluginError::Refused)?;
        Ok(())
    }

    /// Ends every stream, stops serving and removes the socket file.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(server) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for FakePlugin {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The DevicePlugin service.
struct FakeService {
    spec: Arc<FakeSpec>,
    devices: Arc<watch::Sender<Vec<FakeDevice>>>,
    stop: CancellationToken,
}

type DeviceStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

fn to_wire(devices: &[FakeDevice]) -> pb::ListAndWatchResponse {
    pb::ListAndWatchResponse {
        devices: devices.iter().map(FakeDevice::to_wire).collect(),
    }
}

#[tonic::async_trait]
impl DevicePlugin for FakeService {
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        Ok(Response::new(self.spec.options))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut changes = self.devices.subscribe();
        let stop = self.stop.clone();
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                let message = to_wire(&changes.borrow_and_update());
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    changed = changes.changed() => if changed.is_err() { return },
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|req| {
                let size = usize::try_from(req.allocation_size).unwrap_or(0);
                let mut chosen: Vec<String> = Vec::with_capacity(size);
                let wanted = req
                    .must_include_device_i_ds
                    .into_iter()
                    .chain(req.available_device_i_ds);
                for id in wanted {
                    if chosen.len() == size {
                        break;
                    }
                    if !chosen.contains(&id) {
                        chosen.push(id);
                    }
                }
                pb::ContainerPreferredAllocationResponse {
                    device_i_ds: chosen,
                }
            })
            .collect();
        Ok(Response::new(pb::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let known: BTreeSet<String> = self.devices.borrow().iter().map(|d| d.id.clone()).collect();
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            let unknown: Vec<&str> = req
                .devices_ids
                .iter()
                .filter(|id| !known.contains(*id))
                .map(String::as_str)
                .collect();
            if !unknown.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "unknown device ids: {}",
                    unknown.join(", ")
                )));
            }
            let mut response = self.spec.edits.clone();
            if let Some(env) = &self.spec.ids_env {
                response.envs.insert(env.clone(), req.devices_ids.join(","));
            }
            container_responses.push(response);
        }
        Ok(Response::new(pb::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}
