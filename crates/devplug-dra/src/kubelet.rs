//! The kubelet side of a DRA driver: `DRAPlugin` (v1 and v1beta1) on
//! `<plugins>/<driver>/dra.sock`, and a registration socket `<registry>/<driver>-reg.sock` that
//! the kubelet's plugin watcher finds, asks `GetInfo` (type `DRAPlugin`, the driver name, the
//! endpoint, `v1.DRAPlugin` first) and tells whether it registered us.
//!
//! Both sockets are bound under a dot-name (the watcher ignores those) and renamed into place,
//! so the watcher never sees a socket that is not served yet. The kubelet never retries a
//! registration it refused (kubernetes#133725): after `Notify(false)` the registration socket is
//! offered again, after a delay that doubles from 1 s to 60 s while it keeps refusing. Whether
//! the kubelet registered us is published on [`KubeletSide::registered`].

use super::prepare::Preparer;
use super::service::{DraV1, DraV1beta1};
use devplug_proto::constants::{DRA_SOCKET_NAME, DRA_SUPPORTED_VERSIONS, PLUGIN_TYPE_DRA};
use devplug_proto::pluginregistration::{
    self as pr, registration_server::RegistrationServer, InfoRequest, PluginInfo,
    RegistrationStatus, RegistrationStatusResponse,
};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

const REOFFER_FIRST: Duration = Duration::from_secs(1);
const REOFFER_MAX: Duration = Duration::from_secs(60);

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
        let watcher = devplug::WatcherDirs::beside(device_plugins);
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

/// What the kubelet last said about our registration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Registered {
    /// Nothing yet (no kubelet found the socket, or it is being offered again).
    #[default]
    Waiting,
    /// Registered.
    Yes,
    /// Refused, with the kubelet's reason.
    Refused(String),
}

/// The served sockets of one driver; stopped by [`KubeletSide::stop`].
pub struct KubeletSide {
    registered: watch::Receiver<Registered>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    endpoint: PathBuf,
    registration: PathBuf,
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
        let listener = bind_then_rename(&endpoint)?;
        let router = tonic::transport::Server::builder()
            .add_service(DraV1::server(preparer.clone()))
            .add_service(DraV1beta1::server(preparer));
        devplug_proto::uds::spawn_server(
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
                .map(|v| (*v).to_owned())
                .collect(),
        };
        let (registered_tx, registered) = watch::channel(Registered::Waiting);
        let offer_stop = stop.child_token();
        let first = offer(&info, &registration, &offer_stop)?;
        let task = tokio::spawn(follow(
            Offered {
                driver,
                info,
                path: registration.clone(),
                notes: first,
                offer_stop,
            },
            registered_tx,
            stop.clone(),
        ));
        Ok(KubeletSide {
            registered,
            stop,
            task,
            endpoint,
            registration,
        })
    }

    /// What the kubelet last said.
    pub fn registered(&self) -> watch::Receiver<Registered> {
        self.registered.clone()
    }

    /// The `DRAPlugin` socket.
    pub fn endpoint(&self) -> &Path {
        &self.endpoint
    }

    /// Stops serving and removes both sockets.
    pub async fn stop(self) -> Vec<String> {
        self.stop.cancel();
        let _ = self.task.await;
        let mut left = Vec::new();
        for path in [&self.registration, &self.endpoint] {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => left.push(format!("{}: {err}", path.display())),
            }
        }
        left
    }
}

/// One offered registration socket: its notifications arrive on the receiver.
type Offer = mpsc::UnboundedReceiver<RegistrationStatus>;

/// Serves the registration socket at `path` until `stop`.
fn offer(info: &PluginInfo, path: &Path, stop: &CancellationToken) -> std::io::Result<Offer> {
    let listener = bind_then_rename(path)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let service = RegistrationService {
        info: info.clone(),
        notes: tx,
    };
    let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(service));
    devplug_proto::uds::spawn_server(
        router,
        listener,
        stop.clone().cancelled_owned(),
        format!("DRA registration socket of {}", info.name),
    );
    Ok(rx)
}

/// The registration socket being offered.
struct Offered {
    driver: String,
    info: PluginInfo,
    path: PathBuf,
    notes: Offer,
    /// Stops this offer's server (a child of the driver's stop).
    offer_stop: CancellationToken,
}

async fn follow(offered: Offered, registered: watch::Sender<Registered>, stop: CancellationToken) {
    let Offered {
        driver,
        info,
        path,
        mut notes,
        mut offer_stop,
    } = offered;
    let mut delay = REOFFER_FIRST;
    loop {
        let note = tokio::select! {
            () = stop.cancelled() => return,
            note = notes.recv() => note,
        };
        let Some(note) = note else {
            // The server ended; nothing more can arrive on this offer.
            stop.cancelled().await;
            return;
        };
        if note.plugin_registered {
            tracing::info!(driver = %driver, "the kubelet registered the DRA driver");
            delay = REOFFER_FIRST;
            registered.send_replace(Registered::Yes);
            continue;
        }
        tracing::error!(driver = %driver, reason = %note.error, retry_in = ?delay, "the kubelet refused the DRA driver");
        registered.send_replace(Registered::Refused(note.error));
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = delay.saturating_mul(2).min(REOFFER_MAX);
        offer_stop.cancel();
        offer_stop = stop.child_token();
        let _ = std::fs::remove_file(&path);
        match offer(&info, &path, &offer_stop) {
            Ok(next) => {
                notes = next;
                registered.send_replace(Registered::Waiting);
            }
            Err(err) => {
                tracing::error!(driver = %driver, path = %path.display(), %err, "cannot offer the registration socket again");
            }
        }
    }
}

/// Binds a Unix socket under a dot-name beside `path` (owner-only), then renames it to `path`,
/// replacing a stale file there.
fn bind_then_rename(path: &Path) -> std::io::Result<UnixListener> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(err) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(err);
    }
    Ok(listener)
}

struct RegistrationService {
    info: PluginInfo,
    notes: mpsc::UnboundedSender<RegistrationStatus>,
}

#[tonic::async_trait]
impl pr::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let _ = self.notes.send(request.into_inner());
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}
