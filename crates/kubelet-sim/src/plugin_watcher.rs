//! The kubelet's plugin watcher and plugin manager, for device plugins and DRA plugins
//!, as one kubelet session runs them:
//!
//! - the watcher walks `plugins_registry/` at start (sub-folders too) and follows it with inotify;
//!   names starting with `.` and files that are not sockets are ignored;
//! - a reconciler runs every [`SimConfig::watcher_reconcile`](crate::SimConfig) (the kubelet: 1 s)
//!   and registers each new socket: dial (10 s), `GetInfo` with a **1 s** deadline, pick the
//!   handler by type, validate (a device plugin: version and name; a DRA plugin: its services,
//!   see `dra`), add the plugin to the actual state, **then** `RegisterPlugin` (a device plugin:
//!   dial the endpoint, `GetDevicePluginOptions`, ListAndWatch; a DRA plugin: add the endpoint
//!   with a lazy connection), then `NotifyRegistrationStatus` (5 s);
//! - a failure before the plugin is in the actual state (dial, GetInfo, validation) is retried
//!   for that socket with backoff from 500 ms doubling to 2 min; a failed `RegisterPlugin` is not
//!   retried (kubernetes#133725): the plugin only gets `Notify(false)`;
//! - a socket that vanished is deregistered: a device plugin's resource endpoint disconnects
//!   (every device unhealthy, the grace period starts; with [`ClientKeying::ResourceName`],
//!   kubelets up to 1.36, whatever client holds the name is dropped, with
//!   [`ClientKeying::SocketPath`] only the plugin's own endpoint); a DRA plugin's endpoint is
//!   removed from its driver.
//!
//! The watcher's real dial sends the socket path as `:authority`; this one
//! sends `localhost`, because tonic's client cannot send a path. Serving a path authority is
//! tested separately with raw HTTP/2 frames (devplug's `tests/it/watcher.rs`).

use crate::config::ClientKeying;
use crate::dra;
use crate::registration::{connect_plugin, disconnect};
use crate::shared::Shared;
use devplug_proto::constants::{
    DIAL_TIMEOUT_SECS, GET_INFO_TIMEOUT_MILLIS, NOTIFY_TIMEOUT_SECS, PLUGIN_TYPE_DEVICE_PLUGIN,
    PLUGIN_TYPE_DRA, VERSION,
};
use devplug_proto::pluginregistration::{
    registration_client::RegistrationClient, InfoRequest, PluginInfo, RegistrationStatus,
};
use devplug_proto::{resource_name, uds};
use inotify::{Inotify, WatchMask};
use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// The plugin manager's per-socket retry: 500 ms doubling to 2 min (exponentialbackoff).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(120);

/// The handler a plugin was registered with, and the name it registered under.
enum Handler {
    /// A device plugin, for this extended resource.
    DevicePlugin(String),
    /// A DRA plugin, for this driver.
    Dra(String),
}

/// A plugin in the actual state.
struct Registered {
    handler: Handler,
    endpoint: PathBuf,
    /// The desired-state timestamp it was registered for: a socket deleted and created again
    /// between two reconciler passes has a new one, and is registered again.
    seen: u64,
}

/// A socket that failed before reaching the actual state, and when to try it again.
struct Retry {
    at: Instant,
    delay: Duration,
}

/// Runs the watcher and reconciler for one kubelet session, until `session` is cancelled.
pub(crate) fn spawn(shared: Arc<Shared>, dir: PathBuf, session: CancellationToken) {
    tokio::spawn(async move {
        if let Err(err) = run(&shared, &dir, &session).await {
            tracing::error!(dir = %dir.display(), %err, "the plugin watcher stopped");
        }
    });
}

async fn run(shared: &Arc<Shared>, dir: &Path, session: &CancellationToken) -> std::io::Result<()> {
    // The kubelet creates the folder at start.
    std::fs::create_dir_all(dir)?;
    let inotify = Inotify::init()?;
    let mut watches = inotify.watches();
    let mut folders: BTreeMap<inotify::WatchDescriptor, PathBuf> = BTreeMap::new();
    let mut desired: BTreeMap<PathBuf, u64> = BTreeMap::new();
    let mut clock: u64 = 0;
    let mask = WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_TO | WatchMask::MOVED_FROM;
    let mut pending = vec![dir.to_path_buf()];
    // The walk: every folder watched, every socket desired.
    while let Some(folder) = pending.pop() {
        let wd = watches.add(&folder, mask)?;
        folders.insert(wd, folder.clone());
        walk(&folder, &mut desired, &mut clock, &mut pending);
    }
    let mut events = inotify.into_event_stream([0u8; 4096])?;
    let mut actual: BTreeMap<PathBuf, Registered> = BTreeMap::new();
    let mut retries: BTreeMap<PathBuf, Retry> = BTreeMap::new();
    let mut tick = tokio::time::interval(shared.config.watcher_reconcile);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = session.cancelled() => return Ok(()),
            _ = tick.tick() => {
                reconcile(shared, session, &desired, &mut actual, &mut retries).await;
            }
            event = events.next() => {
                let Some(event) = event else { return Ok(()) };
                let event = event?;
                let (Some(folder), Some(name)) = (folders.get(&event.wd).cloned(), event.name) else {
                    continue;
                };
                let path = folder.join(&name);
                let appeared = event.mask.intersects(inotify::EventMask::CREATE | inotify::EventMask::MOVED_TO);
                if appeared {
                    if event.mask.contains(inotify::EventMask::ISDIR) {
                        let mut sub = vec![path];
                        while let Some(folder) = sub.pop() {
                            if let Ok(wd) = watches.add(&folder, mask) {
                                folders.insert(wd, folder.clone());
                            }
                            walk(&folder, &mut desired, &mut clock, &mut sub);
                        }
                    } else if is_plugin_socket(&path) {
                        clock += 1;
                        desired.insert(path, clock);
                    }
                } else {
                    desired.remove(&path);
                    retries.remove(&path);
                }
            }
        }
    }
}

/// Adds the sockets of `folder` to `desired` and its sub-folders to `pending`.
fn walk(
    folder: &Path,
    desired: &mut BTreeMap<PathBuf, u64>,
    clock: &mut u64,
    pending: &mut Vec<PathBuf>,
) {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            pending.push(path);
        } else if is_plugin_socket(&path) {
            *clock += 1;
            desired.insert(path, *clock);
        }
    }
}

/// A socket whose name does not start with `.`.
fn is_plugin_socket(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    !hidden && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// One pass of the plugin manager's reconciler.
async fn reconcile(
    shared: &Arc<Shared>,
    session: &CancellationToken,
    desired: &BTreeMap<PathBuf, u64>,
    actual: &mut BTreeMap<PathBuf, Registered>,
    retries: &mut BTreeMap<PathBuf, Retry>,
) {
    // Gone, or replaced by a newer socket at the same path: deregister first.
    let gone: Vec<PathBuf> = actual
        .iter()
        .filter(|(p, r)| desired.get(*p) != Some(&r.seen))
        .map(|(p, _)| p.clone())
        .collect();
    for path in gone {
        if let Some(plugin) = actual.remove(&path) {
            deregister(shared, &plugin);
        }
    }
    let now = Instant::now();
    let new: Vec<(PathBuf, u64)> = desired
        .iter()
        .filter(|(p, _)| !actual.contains_key(*p))
        .filter(|(p, _)| retries.get(*p).is_none_or(|r| r.at <= now))
        .map(|(p, seen)| (p.clone(), *seen))
        .collect();
    for (path, seen) in new {
        if session.is_cancelled() {
            return;
        }
        match register(shared, session, &path, seen).await {
            Ok(plugin) => {
                retries.remove(&path);
                actual.insert(path, plugin);
            }
            Err(err) => {
                let delay = retries
                    .get(&path)
                    .map_or(RETRY_FIRST, |r| (r.delay * 2).min(RETRY_MAX));
                tracing::warn!(socket = %path.display(), %err, retry_in = ?delay, "plugin registration failed");
                retries.insert(
                    path,
                    Retry {
                        at: Instant::now() + delay,
                        delay,
                    },
                );
            }
        }
    }
}

/// `RegisterPlugin` as the operation generator runs it; `Ok` once the plugin is in the actual
/// state, whether or not the device plugin could be connected.
async fn register(
    shared: &Arc<Shared>,
    session: &CancellationToken,
    path: &Path,
    seen: u64,
) -> Result<Registered, String> {
    let channel = uds::connect(path, Duration::from_secs(DIAL_TIMEOUT_SECS))
        .await
        .map_err(|err| format!("dial failed at socket {}: {err}", path.display()))?;
    let mut client = RegistrationClient::new(channel);
    let mut request = tonic::Request::new(InfoRequest {});
    request.set_timeout(Duration::from_millis(GET_INFO_TIMEOUT_MILLIS));
    let info = client
        .get_info(request)
        .await
        .map_err(|status| {
            format!(
                "failed to get plugin info using RPC GetInfo at socket {}, err: {}",
                path.display(),
                status.message()
            )
        })?
        .into_inner();
    if info.r#type == PLUGIN_TYPE_DRA {
        return register_dra(shared, session, &mut client, path, seen, info).await;
    }
    if info.r#type != PLUGIN_TYPE_DEVICE_PLUGIN {
        let err = format!("no handler registered for plugin type: {}", info.r#type);
        notify(&mut client, false, &err).await;
        return Err(err);
    }
    if !info.supported_versions.iter().any(|v| v == VERSION) {
        let err = format!(
            "plugin {} supports versions {:?}, the kubelet {VERSION:?}",
            info.name, info.supported_versions
        );
        notify(&mut client, false, &err).await;
        return Err(err);
    }
    if resource_name::validate(&info.name).is_err() {
        let err = format!("invalid name of device plugin socket: {}", info.name);
        notify(&mut client, false, &err).await;
        return Err(err);
    }
    let endpoint = if info.endpoint.is_empty() {
        path.to_path_buf()
    } else {
        PathBuf::from(&info.endpoint)
    };
    // In the actual state first, then RegisterPlugin: a failure here is never retried.
    let registered = Registered {
        handler: Handler::DevicePlugin(info.name.clone()),
        endpoint: endpoint.clone(),
        seen,
    };
    match connect_plugin(
        shared,
        &info.name,
        &endpoint,
        &endpoint.display().to_string(),
        true,
    )
    .await
    {
        Ok(()) => notify(&mut client, true, "").await,
        Err(status) => {
            let err = format!(
                "RegisterPlugin error -- plugin registration failed with err: {}",
                status.message()
            );
            tracing::warn!(resource = %info.name, %err, "device plugin not connected; the kubelet will not retry");
            notify(&mut client, false, &err).await;
        }
    }
    Ok(registered)
}

/// The DRA handler's `ValidatePlugin` and `RegisterPlugin` (`dra`), with the plugin manager's
/// notifications: a validation failure is retried, a registration failure is not.
async fn register_dra(
    shared: &Arc<Shared>,
    session: &CancellationToken,
    client: &mut RegistrationClient<Channel>,
    path: &Path,
    seen: u64,
    info: PluginInfo,
) -> Result<Registered, String> {
    let endpoint = if info.endpoint.is_empty() {
        path.to_path_buf()
    } else {
        PathBuf::from(&info.endpoint)
    };
    let service = match dra::validate(&info.name, &endpoint, &info.supported_versions) {
        Ok(service) => service,
        Err(err) => {
            let err = format!("RegisterPlugin error -- plugin validation failed with err: {err}");
            notify(client, false, &err).await;
            return Err(err);
        }
    };
    if session.is_cancelled() {
        // This kubelet session ended during GetInfo: its registrations are gone already.
        return Err("the kubelet stopped".to_owned());
    }
    let registered = Registered {
        handler: Handler::Dra(info.name.clone()),
        endpoint: endpoint.clone(),
        seen,
    };
    let health = dra::HealthService::pick(&info.supported_versions);
    match dra::add(shared, &info.name, &endpoint, path, service, health) {
        Ok(()) => notify(client, true, "").await,
        Err(err) => {
            let err = format!("RegisterPlugin error -- plugin registration failed with err: {err}");
            tracing::warn!(driver = %info.name, %err, "DRA plugin not registered; the kubelet will not retry");
            notify(client, false, &err).await;
        }
    }
    Ok(registered)
}

/// `NotifyRegistrationStatus` with the kubelet's 5 s deadline; its failure is only logged.
async fn notify(client: &mut RegistrationClient<Channel>, registered: bool, error: &str) {
    let mut request = tonic::Request::new(RegistrationStatus {
        plugin_registered: registered,
        error: error.to_owned(),
    });
    request.set_timeout(Duration::from_secs(NOTIFY_TIMEOUT_SECS));
    if let Err(status) = client.notify_registration_status(request).await {
        tracing::warn!(%status, "NotifyRegistrationStatus failed");
    }
}

/// `DeRegisterPlugin`: the plugin's socket is gone; disconnect its client (a device plugin) or
/// remove its endpoint (a DRA plugin).
fn deregister(shared: &Arc<Shared>, plugin: &Registered) {
    let resource = match &plugin.handler {
        Handler::DevicePlugin(resource) => resource,
        Handler::Dra(driver) => {
            dra::remove(shared, driver, &plugin.endpoint);
            return;
        }
    };
    let generation = shared.read(|node| {
        let r = node.resource(resource)?;
        let endpoint = r.endpoint.as_ref()?;
        let ours = endpoint.socket == plugin.endpoint;
        (ours || shared.config.clients == ClientKeying::ResourceName).then_some(r.generation)
    });
    tracing::info!(%resource, "plugin socket removed; deregistering");
    if let Some(generation) = generation {
        disconnect(shared, resource, generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_visible_sockets_are_plugins() {
        let dir = tempfile::tempdir().unwrap();
        let visible = dir.path().join("x.sock");
        let hidden = dir.path().join(".x.sock");
        let _a = std::os::unix::net::UnixListener::bind(&visible).unwrap();
        let _b = std::os::unix::net::UnixListener::bind(&hidden).unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, "").unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let nested = sub.join("y.sock");
        let _c = std::os::unix::net::UnixListener::bind(&nested).unwrap();
        assert!(is_plugin_socket(&visible));
        assert!(
            !is_plugin_socket(&hidden),
            "names starting with . are ignored"
        );
        assert!(!is_plugin_socket(&file), "only sockets");
        let (mut desired, mut clock, mut pending) =
            (BTreeMap::new(), 0, vec![dir.path().to_path_buf()]);
        while let Some(folder) = pending.pop() {
            walk(&folder, &mut desired, &mut clock, &mut pending);
        }
        let found: Vec<&PathBuf> = desired.keys().collect();
        assert_eq!(found, [&nested, &visible], "sub-folders are walked too");
    }
}
