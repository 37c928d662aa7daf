//! The kubelet side of a DRA driver: `DRAPlugin` (v1 and v1beta1) on
//! `<plugins>/<driver>/dra.sock`, and a registration socket `<registry>/<driver>-reg.sock` that
//! the kubelet's plugin watcher finds, asks `GetInfo` (type `DRAPlugin`, the driver name, the
//! endpoint, `v1.DRAPlugin` first) and tells whether it registered us.
//!
//! Both sockets are bound under a dot-name (the watcher ignores those) and renamed into place,
//! so the watcher never sees a socket that is not served yet. The registration socket is the
//! core's [`devplug::host::RegistrationSocket`], as the device plugins' watcher route has it: created
//! again when deleted, offered again after a delay that doubles from 1 s to 60 s while the
//! kubelet refuses it (the kubelet never retries a registration it refused,
//! kubernetes#133725). Whether the kubelet registered us is published on
//! [`KubeletSide::registered`].

use super::prepare::Preparer;
use super::service::{DraV1, DraV1beta1};
use crate::device_health::DeviceHealthService;
use devplug::host::{RefusedRetry, RegistrationSocket};
use devplug_proto::constants::{
    DRA_HEALTH_SERVICES, DRA_SOCKET_NAME, DRA_SUPPORTED_VERSIONS, PLUGIN_TYPE_DRA,
};
use devplug_proto::pluginregistration::PluginInfo;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long a stop waits for the kubelet's calls in flight (a `NodePrepareResources` starting
/// an MPS daemon, say) to finish: half the chart's termination grace period (10 s), so the rest
/// of the shutdown still fits in it.
pub const IN_FLIGHT_LIMIT: Duration = Duration::from_secs(5);

pub use devplug::host::Registered;

/// The kubelet's folders a DRA driver uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletDirs {
    /// The plugin watcher's folder (`/var/lib/kubelet/plugins_registry`).
    pub registry: PathBuf,
    /// The plugins' folder (`/var/lib/kubelet/plugins`); the driver's socket and checkpoint go
    /// in `<plugins>/<driver>/`.
    pub plugins: PathBuf,
}

impl KubeletDirs {
    /// The folders beside a device-plugins folder: `../plugins_registry` and `../plugins` (the
    /// same root as the device plugin host's watcher route).
    pub fn beside(device_plugins: &Path) -> KubeletDirs {
        let watcher = devplug::host::WatcherDirs::beside(device_plugins);
        let plugins = watcher
            .sockets
            .parent()
            .map_or_else(|| watcher.sockets.clone(), Path::to_path_buf);
        KubeletDirs {
            registry: watcher.registry,
            plugins,
        }
    }

    /// `<plugins>/<driver>`: the driver's own folder.
    pub fn driver_dir(&self, driver: &str) -> PathBuf {
        self.plugins.join(driver)
    }

    /// The `DRAPlugin` socket of `driver`.
    pub fn endpoint(&self, driver: &str) -> PathBuf {
        self.driver_dir(driver).join(DRA_SOCKET_NAME)
    }

    /// The registration socket of `driver`.
    pub fn registration(&self, driver: &str) -> PathBuf {
        self.registry.join(format!("{driver}-reg.sock"))
    }
}

/// The served sockets of one driver; stopped by [`KubeletSide::stop`].
pub struct KubeletSide {
    registration: RegistrationSocket,
    stop: CancellationToken,
    endpoint: PathBuf,
    server: JoinHandle<()>,
}

impl KubeletSide {
    /// Binds and serves both sockets of `preparer`'s driver, then follows the kubelet's answers.
    pub fn start(preparer: Arc<Preparer>, dirs: &KubeletDirs) -> std::io::Result<KubeletSide> {
        let driver = preparer.driver().to_owned();
        let endpoint = dirs.endpoint(&driver);
        let registration = dirs.registration(&driver);
        std::fs::create_dir_all(dirs.driver_dir(&driver))?;
        std::fs::create_dir_all(&dirs.registry)?;
        let stop = CancellationToken::new();
        let listener = devplug::host::bind_socket(&endpoint)?;
        let router = tonic::transport::Server::builder()
            .add_service(DraV1::server(preparer.clone()))
            .add_service(DraV1beta1::server(preparer.clone()))
            .add_service(DeviceHealthService::server(
                preparer.pool(),
                preparer.devices(),
                stop.clone(),
            ))
            .add_service(DeviceHealthService::server_v1(
                preparer.pool(),
                preparer.devices(),
                stop.clone(),
            ));
        let server = devplug_proto::uds::spawn_server(
            router,
            listener,
            stop.clone().cancelled_owned(),
            format!("DRA plugin server of {driver}"),
        );
        let info = PluginInfo {
            r#type: PLUGIN_TYPE_DRA.to_owned(),
            name: driver.clone(),
            endpoint: endpoint.display().to_string(),
            supported_versions: DRA_SUPPORTED_VERSIONS
                .iter()
                .chain(DRA_HEALTH_SERVICES.iter())
                .map(|v| (*v).to_owned())
                .collect(),
        };
        let registration =
            match RegistrationSocket::start(info, registration, RefusedRetry::default()) {
                Ok(registration) => registration,
                Err(err) => {
                    stop.cancel();
                    return Err(err);
                }
            };
        Ok(KubeletSide {
            registration,
            stop,
            endpoint,
            server,
        })
    }

    /// What the kubelet last said.
    pub fn registered(&self) -> watch::Receiver<Registered> {
        self.registration.registered()
    }

    /// Whether the plugin watcher's folder can be followed.
    pub fn folder_health(&self) -> devplug::host::FolderHealth {
        self.registration.folder_health()
    }

    /// The `DRAPlugin` socket.
    pub fn endpoint(&self) -> &Path {
        &self.endpoint
    }

    /// Stops serving and removes both sockets; returns what could not be removed, with why.
    ///
    /// The calls in flight finish first (for up to [`IN_FLIGHT_LIMIT`]): a prepare or unprepare
    /// the kubelet made before the stop writes its checkpoint before this returns, so a driver
    /// started next in this process (the config's reload, a restart) reads what it did. A call
    /// still running after the limit is cut short and named in the result; the kubelet repeats
    /// it, and both calls are idempotent.
    pub async fn stop(self) -> Vec<String> {
        // The registration socket first: the kubelet deregisters us, then the endpoint goes.
        let mut left: Vec<String> = self.registration.stop().await.into_iter().collect();
        self.stop.cancel();
        let mut server = self.server;
        if tokio::time::timeout(IN_FLIGHT_LIMIT, &mut server)
            .await
            .is_err()
        {
            server.abort();
            left.push(format!(
                "{}: calls still in flight after {IN_FLIGHT_LIMIT:?} were cut short (the kubelet repeats them)",
                self.endpoint.display()
            ));
        }
        match std::fs::remove_file(&self.endpoint) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => left.push(format!("{}: {err}", self.endpoint.display())),
        }
        left
    }
}
