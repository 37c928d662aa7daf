//! A minimal DRA plugin (kubelet plugin of a DRA driver), written straight against the
//! `pluginregistration` and `DRAPlugin` gRPC APIs: it stands for a DRA driver in tests and demos
//! of the kubelet's DRA side, and lets tests make it misbehave.
//!
//! It serves `pluginregistration.Registration` on a registration socket (meant for the
//! kubelet's `plugins_registry/`; bound under a hidden name, then renamed, so the watcher never
//! sees a socket that is not served yet) and `DRAPlugin` in the versions of
//! [`FakeDraSpec::services`] on its endpoint (the kubelet's default is
//! `plugins/<driver>/dra.sock`). `GetInfo` answers type `DRAPlugin`, the driver name, the
//! endpoint and [`FakeDraSpec::supported_versions`]; every `NotifyRegistrationStatus` is kept.
//!
//! `NodePrepareResources` gives each new claim one device, `dev-<n>` in
//! [`FakeDraSpec::pool`], request `req-0`, CDI id `<cdi_kind>=dev-<n>`, and the same devices
//! again when the claim is prepared again; [`FakeDraPlugin::set_answer`] chooses other devices.
//! [`FakeDraPlugin::fail_claim`] makes a claim fail, [`FakeDraPlugin::skip_claim`] leaves it
//! out of the answer, and [`FakeDraPlugin::set_hang`] makes calls never answer.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use kubelet_sim::fake_dra_plugin::{FakeDraPlugin, FakeDraSpec};
//! let plugin = FakeDraPlugin::serve(
//!     "/tmp/kubelet/plugins_registry/gpu.example.com-reg.sock",
//!     "/tmp/kubelet/plugins/gpu.example.com/dra.sock",
//!     FakeDraSpec::new("gpu.example.com"),
//! )
//! .await?;
//! let notification = plugin.wait_notified(std::time::Duration::from_secs(5)).await;
//! println!("{notification:?}");
//! plugin.stop().await;
//! # Ok(()) }
//! ```

use crate::dra::{DraClaim, DraDevice, DraService, PREPARE, UNPREPARE};
use devplug_proto::constants::PLUGIN_TYPE_DRA;
use devplug_proto::pluginregistration::{
    self as reg,
    registration_server::{Registration, RegistrationServer},
};
use devplug_proto::{dra_v1, dra_v1beta1, uds};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// What the fake DRA plugin says and serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeDraSpec {
    /// The driver name `GetInfo` gives.
    pub driver: String,
    /// `GetInfo`'s `supported_versions` (default `["v1.DRAPlugin", "v1beta1.DRAPlugin"]`).
    pub supported_versions: Vec<String>,
    /// The `DRAPlugin` versions actually served on the endpoint (default both).
    pub services: Vec<DraService>,
    /// The pool of the devices it prepares (default `"node-0"`).
    pub pool: String,
    /// The `vendor/class` of the CDI ids it gives (default `"<driver>/device"`).
    pub cdi_kind: String,
    /// The endpoint `GetInfo` gives, if not the one served (`Some("")` asks the kubelet to use
    /// the registration socket).
    pub advertised_endpoint: Option<String>,
}

impl FakeDraSpec {
    /// A plugin of `driver` listing and serving v1 and v1beta1.
    pub fn new(driver: impl Into<String>) -> Self {
        let driver = driver.into();
        FakeDraSpec {
            supported_versions: DraService::ALL
                .iter()
                .map(|s| s.name().to_owned())
                .collect(),
            services: DraService::ALL.to_vec(),
            pool: "node-0".to_owned(),
            cdi_kind: format!("{driver}/device"),
            advertised_endpoint: None,
            driver,
        }
    }

    /// The same spec listing and serving only `services`, in this order.
    pub fn only(mut self, services: &[DraService]) -> Self {
        self.supported_versions = services.iter().map(|s| s.name().to_owned()).collect();
        self.services = services.to_vec();
        self
    }
}

/// One `NodePrepareResources` or `NodeUnprepareResources` call the plugin received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeDraCall {
    /// The service version it came over.
    pub service: DraService,
    /// `"NodePrepareResources"` or `"NodeUnprepareResources"`.
    pub method: &'static str,
    /// The claims, in request order.
    pub claims: Vec<DraClaim>,
}

/// Why the fake DRA plugin could not serve.
#[derive(Debug, thiserror::Error)]
pub enum FakeDraError {
    /// A socket (or its folder) could not be created.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What tests change and read while the plugin runs.
#[derive(Debug, Default)]
struct Behaviour {
    answers: HashMap<String, Vec<DraDevice>>,
    failing: HashMap<String, String>,
    skipped: BTreeSet<String>,
    hang: bool,
    prepared: BTreeMap<String, Vec<DraDevice>>,
    calls: Vec<FakeDraCall>,
    next_device: usize,
}

struct Inner {
    spec: FakeDraSpec,
    endpoint: PathBuf,
    behaviour: Mutex<Behaviour>,
    notifications: watch::Sender<Vec<(bool, String)>>,
    stop: CancellationToken,
}

impl Inner {
    fn behaviour(&self) -> MutexGuard<'_, Behaviour> {
        self.behaviour.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits forever (until the plugin stops) when hanging.
    async fn maybe_hang(&self) -> Result<(), Status> {
        if self.behaviour().hang {
            self.stop.cancelled().await;
            return Err(Status::unavailable("the plugin is stopping"));
        }
        Ok(())
    }

    /// The answer to a prepare: claim UID → devices or error; skipped claims are left out.
    fn prepare(
        &self,
        service: DraService,
        claims: Vec<DraClaim>,
    ) -> BTreeMap<String, Result<Vec<DraDevice>, String>> {
        let mut b = self.behaviour();
        let mut answer = BTreeMap::new();
        for claim in &claims {
            if b.skipped.contains(&claim.uid) {
                continue;
            }
            if let Some(error) = b.failing.get(&claim.uid) {
                answer.insert(claim.uid.clone(), Err(error.clone()));
                continue;
            }
            let devices = if let Some(devices) = b.answers.get(&claim.uid) {
                devices.clone()
            } else if let Some(devices) = b.prepared.get(&claim.uid) {
                devices.clone()
            } else {
                let name = format!("dev-{}", b.next_device);
                b.next_device += 1;
                vec![DraDevice {
                    request_names: vec!["req-0".to_owned()],
                    pool_name: self.spec.pool.clone(),
                    cdi_device_ids: vec![format!("{}={name}", self.spec.cdi_kind)],
                    device_name: name,
                    share_id: None,
                }]
            };
            b.prepared.insert(claim.uid.clone(), devices.clone());
            answer.insert(claim.uid.clone(), Ok(devices));
        }
        b.calls.push(FakeDraCall {
            service,
            method: PREPARE,
            claims,
        });
        answer
    }

    /// The answer to an unprepare: claim UID → error (empty when done).
    fn unprepare(&self, service: DraService, claims: Vec<DraClaim>) -> BTreeMap<String, String> {
        let mut b = self.behaviour();
        let mut answer = BTreeMap::new();
        for claim in &claims {
            if b.skipped.contains(&claim.uid) {
                continue;
            }
            if let Some(error) = b.failing.get(&claim.uid) {
                answer.insert(claim.uid.clone(), error.clone());
                continue;
            }
            b.prepared.remove(&claim.uid);
            answer.insert(claim.uid.clone(), String::new());
        }
        b.calls.push(FakeDraCall {
            service,
            method: UNPREPARE,
            claims,
        });
        answer
    }
}

/// A running fake DRA plugin. Dropping it stops serving (the socket files stay until
/// [`FakeDraPlugin::stop`]).
pub struct FakeDraPlugin {
    inner: Arc<Inner>,
    registration: PathBuf,
    registration_stop: CancellationToken,
    servers: Vec<JoinHandle<()>>,
}

impl FakeDraPlugin {
    /// Serves `DRAPlugin` on `endpoint` (creating its folder), then `Registration` on
    /// `registration_socket`; stale files at either path are replaced.
    pub async fn serve(
        registration_socket: impl Into<PathBuf>,
        endpoint: impl Into<PathBuf>,
        spec: FakeDraSpec,
    ) -> Result<FakeDraPlugin, FakeDraError> {
        let registration = registration_socket.into();
        let endpoint = endpoint.into();
        let stop = CancellationToken::new();
        let inner = Arc::new(Inner {
            spec,
            endpoint: endpoint.clone(),
            behaviour: Mutex::new(Behaviour::default()),
            notifications: watch::Sender::new(Vec::new()),
            stop: stop.clone(),
        });
        let mut servers = Vec::new();

        let listener = bind(&endpoint)?;
        let mut router = tonic::transport::Server::builder().add_optional_service(
            inner
                .spec
                .services
                .contains(&DraService::V1)
                .then(|| dra_v1::dra_plugin_server::DraPluginServer::new(V1(inner.clone()))),
        );
        router =
            router.add_optional_service(inner.spec.services.contains(&DraService::V1beta1).then(
                || dra_v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(inner.clone())),
            ));
        servers.push(uds::spawn_server(
            router,
            listener,
            stop.clone().cancelled_owned(),
            "the fake DRA plugin server".to_owned(),
        ));

        // Bound under a hidden name, renamed once served: the watcher ignores names with a dot.
        let hidden = hidden_name(&registration);
        let listener = bind(&hidden)?;
        let registration_stop = stop.child_token();
        servers.push(uds::spawn_server(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(RegistrationService(inner.clone()))),
            listener,
            registration_stop.clone().cancelled_owned(),
            "the fake DRA registration server".to_owned(),
        ));
        std::fs::rename(&hidden, &registration).map_err(|source| FakeDraError::Io {
            what: "rename to",
            path: registration.clone(),
            source,
        })?;
        Ok(FakeDraPlugin {
            inner,
            registration,
            registration_stop,
            servers,
        })
    }

    /// The registration socket.
    pub fn registration_socket(&self) -> &Path {
        &self.registration
    }

    /// The `DRAPlugin` socket.
    pub fn endpoint(&self) -> &Path {
        &self.inner.endpoint
    }

    /// Every `NotifyRegistrationStatus` received: (registered, error).
    pub fn notifications(&self) -> Vec<(bool, String)> {
        self.inner.notifications.borrow().clone()
    }

    /// Waits up to `timeout` for the first `NotifyRegistrationStatus`.
    pub async fn wait_notified(&self, timeout: Duration) -> Option<(bool, String)> {
        let mut changes = self.inner.notifications.subscribe();
        let first = async {
            let list = changes.wait_for(|list| !list.is_empty()).await.ok()?;
            list.first().cloned()
        };
        tokio::time::timeout(timeout, first).await.ok().flatten()
    }

    /// Answers `devices` for the claim with UID `uid` from now on.
    pub fn set_answer(&self, uid: &str, devices: Vec<DraDevice>) {
        self.inner
            .behaviour()
            .answers
            .insert(uid.to_owned(), devices);
    }

    /// Answers `error` for the claim with UID `uid` (prepare and unprepare) from now on.
    pub fn fail_claim(&self, uid: &str, error: &str) {
        self.inner
            .behaviour()
            .failing
            .insert(uid.to_owned(), error.to_owned());
    }

    /// Leaves the claim with UID `uid` out of every answer from now on.
    pub fn skip_claim(&self, uid: &str) {
        self.inner.behaviour().skipped.insert(uid.to_owned());
    }

    /// Answers the claim with UID `uid` normally again.
    pub fn heal_claim(&self, uid: &str) {
        let mut b = self.inner.behaviour();
        b.failing.remove(uid);
        b.skipped.remove(uid);
    }

    /// With `true`, calls received from now on never answer (until the plugin stops).
    pub fn set_hang(&self, hang: bool) {
        self.inner.behaviour().hang = hang;
    }

    /// The claims prepared at the plugin and not unprepared since, by UID.
    pub fn prepared(&self) -> BTreeMap<String, Vec<DraDevice>> {
        self.inner.behaviour().prepared.clone()
    }

    /// Every call answered so far (hanging ones are not), oldest first.
    pub fn calls(&self) -> Vec<FakeDraCall> {
        self.inner.behaviour().calls.clone()
    }

    /// Stops serving `Registration` and removes the registration socket, as a plugin does when
    /// it shuts down or is replaced; `DRAPlugin` stays served.
    pub fn remove_registration(&self) {
        self.registration_stop.cancel();
        let _ = std::fs::remove_file(&self.registration);
    }

    /// Stops serving and removes both sockets.
    pub async fn stop(mut self) {
        self.inner.stop.cancel();
        for server in self.servers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
        let _ = std::fs::remove_file(&self.registration);
        let _ = std::fs::remove_file(&self.inner.endpoint);
    }
}

impl Drop for FakeDraPlugin {
    fn drop(&mut self) {
        self.inner.stop.cancel();
    }
}

/// Binds a Unix socket at `path`, creating its folder and replacing a stale file.
fn bind(path: &Path) -> Result<tokio::net::UnixListener, FakeDraError> {
    let io = |what| {
        let path = path.to_path_buf();
        move |source| FakeDraError::Io { what, path, source }
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io("create the folder of"))?;
    }
    let _ = std::fs::remove_file(path);
    tokio::net::UnixListener::bind(path).map_err(io("bind"))
}

/// `dir/.name` for `dir/name`.
fn hidden_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "reg.sock".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}"))
}

/// The `Registration` service.
struct RegistrationService(Arc<Inner>);

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        let spec = &self.0.spec;
        Ok(Response::new(reg::PluginInfo {
            r#type: PLUGIN_TYPE_DRA.to_owned(),
            name: spec.driver.clone(),
            endpoint: spec
                .advertised_endpoint
                .clone()
                .unwrap_or_else(|| self.0.endpoint.display().to_string()),
            supported_versions: spec.supported_versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        self.0
            .notifications
            .send_modify(|list| list.push((status.plugin_registered, status.error)));
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// One `DRAPlugin` server per package, from one template so the two cannot drift apart.
macro_rules! fake_dra_service {
    ($name:ident, $pkg:ident, $service:expr, $from:path, $to:path) => {
        #[doc = concat!("`DRAPlugin` of package `", stringify!($pkg), "`.")]
        struct $name(Arc<Inner>);

        #[tonic::async_trait]
        impl $pkg::dra_plugin_server::DraPlugin for $name {
            async fn node_prepare_resources(
                &self,
                request: Request<$pkg::NodePrepareResourcesRequest>,
            ) -> Result<Response<$pkg::NodePrepareResourcesResponse>, Status> {
                self.0.maybe_hang().await?;
                let claims = request.into_inner().claims;
                let answer = self
                    .0
                    .prepare($service, claims.into_iter().map($from).collect());
                let claims = answer
                    .into_iter()
                    .map(|(uid, result)| {
                        let r = match result {
                            Ok(devices) => $pkg::NodePrepareResourceResponse {
                                devices: devices.iter().map($to).collect(),
                                error: String::new(),
                            },
                            Err(error) => $pkg::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error,
                            },
                        };
                        (uid, r)
                    })
                    .collect();
                Ok(Response::new($pkg::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$pkg::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$pkg::NodeUnprepareResourcesResponse>, Status> {
                self.0.maybe_hang().await?;
                let claims = request.into_inner().claims;
                let answer = self
                    .0
                    .unprepare($service, claims.into_iter().map($from).collect());
                let claims = answer
                    .into_iter()
                    .map(|(uid, error)| (uid, $pkg::NodeUnprepareResourceResponse { error }))
                    .collect();
                Ok(Response::new($pkg::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

fake_dra_service!(
    V1,
    dra_v1,
    DraService::V1,
    DraClaim::from_v1,
    DraDevice::to_v1
);
fake_dra_service!(
    V1beta1,
    dra_v1beta1,
    DraService::V1beta1,
    DraClaim::from_v1beta1,
    DraDevice::to_v1beta1
);
