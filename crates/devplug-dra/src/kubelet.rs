//! The kubelet side of a DRA driver: `DRAPlugin` (v1 and v1beta1) on
//! `<plugins>/<driver>/dra.sock`, and a registration socket `<registry>/<driver>-reg.sock` that
//! the kubelet's plugin watcher finds, asks `GetInfo` (type `DRAPlugin`, the driver name, the
//! endpoint, `v1.DRAPlugin` first) and tells whether it registered us.
//!
//! Those fixed names unless another live instance serves them: then `dra-<tag>.sock` and
//! `<driver>-<tag>-reg.sock`, `<tag>` eight hex digits of this process instance
//! ([`devplug::host::instance_tag`]). So during a rolling update with surge the old and the new
//! devplug are registered at once, each with its own sockets, and the kubelet (1.33+: several
//! endpoints per driver) calls the newer one; the older one's calls in flight finish, and its
//! stop removes only its own files. With the same names the two would replace each other's
//! sockets (the kubelet refuses a second registration of an endpoint it has) and the one
//! stopping last would delete the other's. After a reboot or a restart, with no other instance,
//! the fixed names come back ([`KubeletDirs::names_for_instance`] says why). Where a tagged path
//! would not fit in a Unix socket's 107 bytes the fixed names are used, and said in the log.
//! Sockets of earlier instances that no one serves any more are removed at start.
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

    /// The `DRAPlugin` socket of `driver`'s instance `tag`: `<plugins>/<driver>/dra-<tag>.sock`,
    /// or `dra.sock` where that would not fit in a Unix socket's address.
    pub fn endpoint(&self, driver: &str, tag: &str) -> PathBuf {
        let tagged = self.driver_dir(driver).join(format!("dra-{tag}.sock"));
        if fits(&tagged) {
            tagged
        } else {
            self.driver_dir(driver).join(DRA_SOCKET_NAME)
        }
    }

    /// The registration socket of `driver`'s instance `tag`:
    /// `<registry>/<driver>-<tag>-reg.sock`, or `<driver>-reg.sock` where that would not fit.
    pub fn registration(&self, driver: &str, tag: &str) -> PathBuf {
        let tagged = self.registry.join(format!("{driver}-{tag}-reg.sock"));
        if fits(&tagged) {
            tagged
        } else {
            self.registry.join(format!("{driver}-reg.sock"))
        }
    }

    /// The sockets a starting instance of `driver` serves: the fixed names (`dra.sock`,
    /// `<driver>-reg.sock`) unless another live instance serves them (a rolling update with
    /// surge), then names of this instance's own ([`Self::endpoint`],
    /// [`Self::registration`]). The fixed names first, because after a reboot or a restart the
    /// kubelet is often already dialling the registration socket it knew (its dial waits up to
    /// 10 s for the path to accept): a new socket at the same path is registered at once, a
    /// socket at a new path only after that dial gives up, by which time the pods' first
    /// prepare has failed and waits out the kubelet's 10 s retry.
    pub fn names_for_instance(&self, driver: &str) -> (PathBuf, PathBuf) {
        let fixed = (
            self.driver_dir(driver).join(DRA_SOCKET_NAME),
            self.registry.join(format!("{driver}-reg.sock")),
        );
        let live = |path: &Path| std::os::unix::net::UnixStream::connect(path).is_ok();
        if !live(&fixed.0) && !live(&fixed.1) {
            return fixed;
        }
        let tag = devplug::host::instance_tag(driver);
        let tagged = (self.endpoint(driver, &tag), self.registration(driver, &tag));
        if tagged == fixed {
            tracing::warn!(%driver, "another instance serves this driver's sockets and names of this instance's own would not fit in a Unix socket's address: the two replace each other's sockets; a shorter kubelet folder or driver name avoids it");
        }
        tagged
    }

    /// Whether `name` (a file in the driver's folder) is an endpoint of some instance of a
    /// driver: `dra-<tag>.sock` or `dra.sock`.
    fn is_endpoint_name(name: &str) -> bool {
        name == DRA_SOCKET_NAME
            || name
                .strip_prefix("dra-")
                .and_then(|rest| rest.strip_suffix(".sock"))
                .is_some_and(devplug::host::is_instance_tag)
    }

    /// Whether `name` (a file in the registry) is a registration socket of some instance of
    /// `driver`: `<driver>-<tag>-reg.sock` or `<driver>-reg.sock`.
    fn is_registration_name(driver: &str, name: &str) -> bool {
        let Some(rest) = name
            .strip_prefix(driver)
            .and_then(|rest| rest.strip_prefix('-'))
        else {
            return false;
        };
        rest == "reg.sock"
            || rest
                .strip_suffix("-reg.sock")
                .is_some_and(devplug::host::is_instance_tag)
    }
}

/// Whether `path` fits in a Unix socket's address.
fn fits(path: &Path) -> bool {
    path.as_os_str().len() <= devplug::host::MAX_SOCKET_PATH
}

/// Removes the sockets of earlier instances of `driver` that no one serves any more (a killed
/// devplug leaves its files), keeping this instance's and any live one's.
async fn remove_dead_instances(
    dirs: KubeletDirs,
    driver: String,
    endpoint: PathBuf,
    registration: PathBuf,
) {
    devplug::host::remove_dead_sockets(
        &dirs.registry,
        |name| KubeletDirs::is_registration_name(&driver, name),
        &registration,
    )
    .await;
    devplug::host::remove_dead_sockets(
        &dirs.driver_dir(&driver),
        KubeletDirs::is_endpoint_name,
        &endpoint,
    )
    .await;
}

/// The served sockets of one driver; stopped by [`KubeletSide::stop`].
pub struct KubeletSide {
    registration: RegistrationSocket,
    stop: CancellationToken,
    endpoint: devplug::host::OwnedSocket,
    registration_path: PathBuf,
    server: JoinHandle<()>,
}

impl KubeletSide {
    /// Binds and serves both sockets of `preparer`'s driver, then follows the kubelet's answers.
    pub fn start(preparer: Arc<Preparer>, dirs: &KubeletDirs) -> std::io::Result<KubeletSide> {
        let driver = preparer.driver().to_owned();
        let (endpoint, registration_path) = dirs.names_for_instance(&driver);
        std::fs::create_dir_all(dirs.driver_dir(&driver))?;
        std::fs::create_dir_all(&dirs.registry)?;
        let stop = CancellationToken::new();
        let (listener, owned) = devplug::host::bind_owned_socket(&endpoint)?;
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
        let registration = match RegistrationSocket::start(
            info,
            registration_path.clone(),
            RefusedRetry::default(),
        ) {
            Ok(socket) => socket,
            Err(err) => {
                stop.cancel();
                let _ = owned.remove();
                return Err(err);
            }
        };
        tokio::spawn(remove_dead_instances(
            dirs.clone(),
            driver,
            endpoint,
            registration_path.clone(),
        ));
        Ok(KubeletSide {
            registration,
            stop,
            endpoint: owned,
            registration_path,
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
        self.endpoint.path()
    }

    /// The registration socket the plugin watcher finds.
    pub fn registration_path(&self) -> &Path {
        &self.registration_path
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
                self.endpoint.path().display()
            ));
        }
        // Only our own file: another instance may have bound this path (fixed names).
        match self.endpoint.remove() {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => left.push(format!("{}: {err}", self.endpoint.path().display())),
        }
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_per_instance_and_fall_back_where_they_would_not_fit() {
        let dirs = KubeletDirs {
            registry: "/var/lib/kubelet/plugins_registry".into(),
            plugins: "/var/lib/kubelet/plugins".into(),
        };
        assert_eq!(
            dirs.endpoint("npu.example.com", "0123abcd"),
            Path::new("/var/lib/kubelet/plugins/npu.example.com/dra-0123abcd.sock")
        );
        assert_eq!(
            dirs.registration("npu.example.com", "0123abcd"),
            Path::new("/var/lib/kubelet/plugins_registry/npu.example.com-0123abcd-reg.sock")
        );
        // A 63-character driver name: the tagged registration socket would take 115 bytes.
        let long = format!("{}.example.com", "d".repeat(51));
        assert_eq!(long.len(), 63);
        let registration = dirs.registration(&long, "0123abcd");
        assert_eq!(
            registration,
            Path::new("/var/lib/kubelet/plugins_registry").join(format!("{long}-reg.sock"))
        );
        assert!(fits(&registration));

        for ours in ["dra.sock", "dra-0123abcd.sock"] {
            assert!(KubeletDirs::is_endpoint_name(ours), "{ours}");
        }
        for other in [
            "dra-x.sock",
            "dra-0123abcd.json",
            "checkpoint.json",
            "dra-0123ABCD.sock",
        ] {
            assert!(!KubeletDirs::is_endpoint_name(other), "{other}");
        }
        let driver = "npu.example.com";
        for ours in [
            "npu.example.com-reg.sock",
            "npu.example.com-0123abcd-reg.sock",
        ] {
            assert!(KubeletDirs::is_registration_name(driver, ours), "{ours}");
        }
        for other in [
            "gpu.example.com-reg.sock",
            "npu.example.com-io-reg.sock",
            "npu.example.com-io-0123abcd-reg.sock",
            "npu.example.comreg.sock",
        ] {
            assert!(!KubeletDirs::is_registration_name(driver, other), "{other}");
        }
    }
}
