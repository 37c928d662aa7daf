//! Registration through the kubelet's plugin watcher: a host with
//! `Registration::Watcher` against the simulator running its plugin watcher on
//! `plugins_registry/`, over real sockets. Kubelet restart, `Notify(false)`, an operator deleting
//! the registration socket, a dropped stream, and the watcher's path `:authority`.

use crate::raw_h2::RawH2Client;
use crate::support::{wait_capacity, TestBackend, WAIT};
use devplug::host::RefusedRetry;
use devplug::{Host, Registration, ResourceSettings};
use devplug_proto::pluginregistration as pr;
use kubelet_sim::{Kubelet, SimConfig};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const RESOURCE: &str = "example.com/npu";

fn watcher_settings() -> ResourceSettings {
    ResourceSettings {
        health_hold_down: Duration::ZERO,
        registration: Registration::Watcher,
        ..Default::default()
    }
}

/// A node layout in a temp folder: `device-plugins/` and `plugins_registry/` side by side, a
/// simulator running the plugin watcher (reconciler every 100 ms), and a host.
async fn node() -> (tempfile::TempDir, Kubelet, Host) {
    let root = tempfile::tempdir().unwrap();
    let dp = root.path().join("device-plugins");
    let config = SimConfig {
        grace: Duration::from_secs(300),
        watcher_reconcile: Duration::from_millis(100),
        ..SimConfig::default()
    }
    .with_watcher_beside(&dp);
    let kubelet = Kubelet::start_with(&dp, config).await.unwrap();
    let host = Host::new(&dp).unwrap().with_refused_retry(RefusedRetry {
        first: Duration::from_millis(200),
        max: Duration::from_secs(1),
    });
    (root, kubelet, host)
}

/// The registration socket of ours in `plugins_registry/`.
fn registration_socket(root: &Path) -> PathBuf {
    let dir = root.join("plugins_registry");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| !p.file_name().unwrap().to_str().unwrap().starts_with('.'))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one registration socket in {dir:?}: {found:?}"
    );
    found.remove(0)
}

async fn wait_registrations(kubelet: &Kubelet, count: usize) {
    let got = kubelet
        .wait_for(WAIT, |n| {
            (n.registration_count(RESOURCE) >= count).then_some(())
        })
        .await;
    assert!(
        got.is_ok(),
        "wanted {count} registrations, have {:?}",
        kubelet.read(|n| n.registrations().to_vec())
    );
}

#[tokio::test]
async fn registers_through_the_watcher_and_survives_a_kubelet_restart() {
    let (root, mut kubelet, host) = node().await;
    let mut status = host
        .add_with(RESOURCE, Arc::new(TestBackend::new(4)), watcher_settings())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    status.wait_for(|s| s.registered).await.unwrap();

    let records = kubelet.read(|n| n.registrations().to_vec());
    assert_eq!(records.len(), 1);
    assert!(
        records[0].via_watcher,
        "registered through the watcher, not kubelet.sock"
    );
    // The plugin socket is outside device-plugins/, so a restarting kubelet cannot delete it.
    let plugin = status.borrow().socket.clone().unwrap();
    assert!(
        plugin.starts_with(root.path().join("plugins/devplug")),
        "{plugin:?}"
    );
    assert_eq!(records[0].endpoint, plugin.display().to_string());
    let registration = registration_socket(root.path());
    let inode = std::fs::metadata(&registration).unwrap().ino();

    kubelet.restart().await.unwrap();
    // The new kubelet finds our socket by its walk: nothing of ours is created again.
    wait_registrations(&kubelet, 2).await;
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    assert!(kubelet.read(|n| n.registrations().iter().all(|r| r.via_watcher)));
    assert_eq!(std::fs::metadata(&registration).unwrap().ino(), inode);
    assert!(plugin.exists());
    let metrics = host.metrics();
    assert_eq!(metrics[0].1.kubelet_restarts, 1, "{metrics:?}");

    let sockets = host.watcher_dirs().sockets.clone();
    assert!(sockets.is_dir());
    host.shutdown().await;
    assert!(
        !registration.exists() && !plugin.exists(),
        "both sockets removed"
    );
    assert!(!sockets.exists(), "the emptied socket folder removed");
    // The watcher saw the registration socket go: the endpoint is disconnected.
    kubelet
        .wait_for(WAIT, |n| {
            (!n.resource(RESOURCE)?.is_connected()).then_some(())
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn a_refused_registration_is_offered_again() {
    let (_root, kubelet, host) = node().await;
    // The kubelet fails to dial us back once: RegisterPlugin fails and is never retried by the
    // kubelet; only Notify(false) tells us.
    kubelet.fail_next_plugin_connects(1);
    let mut status = host
        .add_with(RESOURCE, Arc::new(TestBackend::new(2)), watcher_settings())
        .unwrap();
    status
        .wait_for(|s| {
            s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("injected"))
        })
        .await
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (2, 2)).await;
    status.wait_for(|s| s.registered).await.unwrap();
    let metrics = host.metrics();
    assert_eq!(metrics[0].1.registration_failures, 1);
    assert_eq!(metrics[0].1.registrations, 1);
    host.shutdown().await;
}

#[tokio::test]
async fn a_deleted_registration_socket_comes_back() {
    let (root, kubelet, host) = node().await;
    host.add_with(RESOURCE, Arc::new(TestBackend::new(3)), watcher_settings())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (3, 3)).await;
    let registration = registration_socket(root.path());
    std::fs::remove_file(&registration).unwrap();
    // Deregistered (devices unhealthy), then registered again through the new socket.
    wait_registrations(&kubelet, 2).await;
    wait_capacity(&kubelet, RESOURCE, (3, 3)).await;
    assert!(registration.exists());
    host.shutdown().await;
}

#[tokio::test]
async fn a_stream_dropped_without_a_restart_is_offered_again() {
    let (_root, kubelet, host) = node().await;
    host.add_with(RESOURCE, Arc::new(TestBackend::new(2)), watcher_settings())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (2, 2)).await;
    assert!(kubelet.disconnect(RESOURCE));
    wait_capacity(&kubelet, RESOURCE, (2, 0)).await;
    // The kubelet does not redial; after RELINK_WAIT the host offers itself again.
    let got = kubelet
        .wait_for(devplug::host::RELINK_WAIT + WAIT, |n| {
            (n.registration_count(RESOURCE) == 2 && n.capacity(RESOURCE) == (2, 2)).then_some(())
        })
        .await;
    assert!(got.is_ok(), "{:?}", kubelet.read(|n| n.capacity(RESOURCE)));
    host.shutdown().await;
}

#[tokio::test]
async fn the_registration_socket_serves_the_watchers_path_authority() {
    let (root, kubelet, host) = node().await;
    let mut status = host
        .add_with(RESOURCE, Arc::new(TestBackend::new(1)), watcher_settings())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (1, 1)).await;
    let plugin = status.borrow_and_update().socket.clone().unwrap();
    let registration = registration_socket(root.path());
    let path = registration.to_str().unwrap().to_owned();
    // grpc-go sends the bare path, newer grpc-go the percent-encoded path.
    for authority in [path.clone(), path.replace('/', "%2F")] {
        let mut client = RawH2Client::connect(&registration, &authority).await;
        let info: pr::PluginInfo = tokio::time::timeout(
            WAIT,
            client.unary(
                "/pluginregistration.Registration/GetInfo",
                &pr::InfoRequest {},
            ),
        )
        .await
        .unwrap()
        .unwrap_or_else(|state| panic!("GetInfo with authority {authority:?} failed: {state:?}"));
        assert_eq!(info.r#type, "DevicePlugin");
        assert_eq!(info.name, RESOURCE);
        assert_eq!(info.endpoint, plugin.display().to_string());
        assert_eq!(info.supported_versions, ["v1beta1"]);
        let _: pr::RegistrationStatusResponse = client
            .unary(
                "/pluginregistration.Registration/NotifyRegistrationStatus",
                &pr::RegistrationStatus {
                    plugin_registered: true,
                    error: String::new(),
                },
            )
            .await
            .unwrap_or_else(|state| {
                panic!("Notify with authority {authority:?} failed: {state:?}")
            });
    }
    host.shutdown().await;
}

#[tokio::test]
async fn a_plugin_watcher_folder_replaced_by_a_file_fails_health() {
    let (root, kubelet, host) = node().await;
    host.add_with(RESOURCE, Arc::new(TestBackend::new(1)), watcher_settings())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (1, 1)).await;
    assert!(host.health().is_ok());
    kubelet.stop().await;

    let registry = root.path().join("plugins_registry");
    std::fs::remove_dir_all(&registry).unwrap();
    std::fs::write(&registry, "oops").unwrap();
    let broken = async {
        while host.health().is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(WAIT, broken)
        .await
        .expect("/healthz fails while the plugin watcher's folder is a file");
    let reason = host.health().unwrap_err();
    assert!(reason.contains("not a folder"), "{reason}");
    host.shutdown().await;
}
