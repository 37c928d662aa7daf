//! The files backend through the kubelet simulator, with real inotify in temp folders.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::{Host, ResourceSettings};
use devplug_backends::files::MissingFolder;
use devplug_backends::{FilesBackend, FilesSettings};
use kubelet_sim::Kubelet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "example.com/cola";

async fn devices(kubelet: &Kubelet, want: &[(&str, bool)]) {
    let want: Vec<(String, bool)> = want.iter().map(|(id, h)| (id.to_string(), *h)).collect();
    let got = kubelet
        .wait_for(WAIT, |n| {
            let now: Vec<(String, bool)> = n
                .resource(RESOURCE)?
                .devices()
                .iter()
                .map(|(id, d)| (id.clone(), d.healthy))
                .collect();
            (now == want).then_some(())
        })
        .await;
    if got.is_err() {
        let now = kubelet.read(|n| n.resource(RESOURCE).map(|r| r.devices().clone()));
        panic!("wanted {want:?}, the kubelet has {now:?}");
    }
}

async fn start(dir: &Path, settings: FilesSettings, hold_down: Duration) -> (Kubelet, Host) {
    let plugins = dir.join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let host = Host::new(&plugins).unwrap();
    let backend = Arc::new(FilesBackend::start(&settings).unwrap());
    host.add_with(
        RESOURCE,
        backend,
        ResourceSettings {
            health_hold_down: hold_down,
            ..Default::default()
        },
    )
    .unwrap();
    (kubelet, host)
}

#[tokio::test]
async fn files_added_removed_and_renamed_change_the_list() {
    let tmp = tempfile::tempdir().unwrap();
    let colas = tmp.path().join("colas");
    std::fs::create_dir(&colas).unwrap();
    std::fs::write(colas.join("cola-1"), "").unwrap();
    let (kubelet, host) = start(tmp.path(), FilesSettings::new(&colas), Duration::ZERO).await;
    devices(&kubelet, &[("cola-1", true)]).await;

    std::fs::write(colas.join("cola-2"), "").unwrap();
    devices(&kubelet, &[("cola-1", true), ("cola-2", true)]).await;
    std::fs::rename(colas.join("cola-2"), colas.join("cola-3")).unwrap();
    devices(&kubelet, &[("cola-1", true), ("cola-3", true)]).await;
    std::fs::remove_file(colas.join("cola-1")).unwrap();
    devices(&kubelet, &[("cola-3", true)]).await;
    // Moved in from elsewhere, and out again.
    std::fs::write(tmp.path().join("outside"), "").unwrap();
    std::fs::rename(tmp.path().join("outside"), colas.join("cola-9")).unwrap();
    devices(&kubelet, &[("cola-3", true), ("cola-9", true)]).await;
    std::fs::rename(colas.join("cola-9"), tmp.path().join("outside")).unwrap();
    devices(&kubelet, &[("cola-3", true)]).await;
    // Not devices: hidden files and folders.
    std::fs::write(colas.join(".swap"), "").unwrap();
    std::fs::create_dir(colas.join("sub")).unwrap();
    std::fs::write(colas.join("cola-4"), "").unwrap();
    devices(&kubelet, &[("cola-3", true), ("cola-4", true)]).await;
    host.shutdown().await;
}

#[tokio::test]
async fn a_file_marked_unhealthy_recovers_after_the_hold_down() {
    let tmp = tempfile::tempdir().unwrap();
    let colas = tmp.path().join("colas");
    std::fs::create_dir(&colas).unwrap();
    std::fs::write(colas.join("cola-1"), "Healthy\n").unwrap();
    std::fs::write(colas.join("cola-2"), "").unwrap();
    let (kubelet, host) = start(
        tmp.path(),
        FilesSettings::new(&colas),
        Duration::from_secs(2),
    )
    .await;
    devices(&kubelet, &[("cola-1", true), ("cola-2", true)]).await;

    std::fs::write(colas.join("cola-1"), "bubbles gone flat\n").unwrap();
    devices(&kubelet, &[("cola-1", false), ("cola-2", true)]).await;
    std::fs::write(colas.join("cola-1"), "Healthy\n").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(kubelet.read(|n| n.capacity(RESOURCE)), (2, 1), "held down");
    devices(&kubelet, &[("cola-1", true), ("cola-2", true)]).await;
    host.shutdown().await;
}

#[tokio::test]
async fn allocation_sets_the_env_and_mounts_each_file() {
    let tmp = tempfile::tempdir().unwrap();
    let colas = tmp.path().join("colas");
    let settings = FilesSettings {
        env: "COLA_DEVICES".into(),
        mount: Some("/colas".into()),
        missing: MissingFolder::Create,
        ..FilesSettings::new(&colas)
    };
    let (kubelet, host) = start(tmp.path(), settings, Duration::ZERO).await;
    assert!(colas.is_dir(), "created");
    std::fs::write(colas.join("a"), "").unwrap();
    std::fs::write(colas.join("b"), "").unwrap();
    devices(&kubelet, &[("a", true), ("b", true)]).await;
    let alloc = kubelet.allocate("pod", "main", RESOURCE, 2).await.unwrap();
    assert_eq!(alloc.env("COLA_DEVICES"), Some("a,b"));
    let mounts: Vec<_> = alloc
        .response
        .mounts
        .iter()
        .map(|m| (m.host_path.clone(), m.container_path.as_str(), m.read_only))
        .collect();
    assert_eq!(
        mounts,
        vec![
            (colas.join("a").display().to_string(), "/colas/a", true),
            (colas.join("b").display().to_string(), "/colas/b", true)
        ]
    );
    host.shutdown().await;
}

#[tokio::test]
async fn a_missing_folder_is_waited_for_and_followed_when_it_comes_and_goes() {
    let tmp = tempfile::tempdir().unwrap();
    let colas = tmp.path().join("later/colas");
    let (kubelet, host) = start(tmp.path(), FilesSettings::new(&colas), Duration::ZERO).await;
    devices(&kubelet, &[]).await;

    std::fs::create_dir_all(&colas).unwrap();
    std::fs::write(colas.join("cola-1"), "").unwrap();
    devices(&kubelet, &[("cola-1", true)]).await;

    std::fs::remove_dir_all(tmp.path().join("later")).unwrap();
    devices(&kubelet, &[]).await;
    std::fs::create_dir_all(&colas).unwrap();
    std::fs::write(colas.join("cola-2"), "").unwrap();
    devices(&kubelet, &[("cola-2", true)]).await;
    host.shutdown().await;
}

/// Each device carries its file name as the DRA attribute `file` (a name that is not a DNS
/// label gets a hashed ResourceSlice name, so selectors need it).
#[tokio::test]
async fn the_file_name_is_a_dra_attribute() {
    use devplug::dra::AttributeValue;
    use devplug::Backend;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("Cola_1"), "").unwrap();
    let backend = FilesBackend::start(&FilesSettings::new(tmp.path())).unwrap();
    let list = backend.devices().borrow().clone();
    let attrs = list.get("Cola_1").unwrap().dra_attributes();
    attrs.check().unwrap();
    assert_eq!(
        attrs.attributes["file"],
        AttributeValue::String("Cola_1".into())
    );
    assert_eq!(attrs.attributes.len(), 1);
}
