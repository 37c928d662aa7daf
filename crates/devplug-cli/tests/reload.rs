//! `devplug run` reloading its config file, through the kubelet simulator: plain rewrites and
//! Kubernetes ConfigMap-style symlink swaps, valid and invalid.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use kubelet_sim::{Kubelet, NodeState};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::Devplug;

const WAIT: Duration = Duration::from_secs(10);

fn virtual_resource(name: &str, count: usize) -> String {
    format!("  - name: {name}\n    virtual: {{ count: {count} }}\n")
}

fn config(resources: &[(&str, usize)]) -> String {
    let mut text = String::from("resources:\n");
    for (name, count) in resources {
        text.push_str(&virtual_resource(name, *count));
    }
    text
}

/// (connections, registrations) of a resource at the kubelet.
fn history(node: &NodeState, name: &str) -> (u64, usize) {
    let connections = node.resource(name).map_or(0, |r| r.connections());
    (connections, node.registration_count(name))
}

async fn wait(kubelet: &Kubelet, what: &str, check: impl Fn(&NodeState) -> bool) {
    if kubelet
        .wait_for(WAIT, |n| check(n).then_some(()))
        .await
        .is_err()
    {
        let state = kubelet.read(|n| {
            n.resources()
                .map(|(name, r)| {
                    format!(
                        "{name}: capacity {}/{} connections {}",
                        r.capacity(),
                        r.allocatable(),
                        r.connections()
                    )
                })
                .collect::<Vec<_>>()
        });
        panic!("timed out waiting for {what}; kubelet has {state:#?}");
    }
}

/// A ConfigMap-style mount: `config.yaml -> ..data/config.yaml`, `..data -> ..v<N>`.
struct ConfigMapDir {
    dir: PathBuf,
    version: u32,
}

impl ConfigMapDir {
    fn new(dir: &Path, text: &str) -> ConfigMapDir {
        std::fs::create_dir_all(dir).unwrap();
        let mut map = ConfigMapDir {
            dir: dir.to_owned(),
            version: 0,
        };
        map.update(text);
        symlink("..data/config.yaml", dir.join("config.yaml")).unwrap();
        map
    }

    fn path(&self) -> PathBuf {
        self.dir.join("config.yaml")
    }

    /// What the kubelet does on a ConfigMap update: new folder, new link, atomic rename.
    fn update(&mut self, text: &str) {
        self.version += 1;
        let version = format!("..v{}", self.version);
        std::fs::create_dir(self.dir.join(&version)).unwrap();
        std::fs::write(self.dir.join(&version).join("config.yaml"), text).unwrap();
        let tmp = self.dir.join("..data_tmp");
        symlink(&version, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
    }
}

#[tokio::test]
async fn a_configmap_update_adds_changes_removes_and_leaves_the_rest_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let (keep, change, remove, add) = (
        "example.com/keep",
        "example.com/change",
        "example.com/remove",
        "example.com/add",
    );
    let mut map = ConfigMapDir::new(
        &tmp.path().join("etc"),
        &config(&[(keep, 2), (change, 2), (remove, 2)]),
    );
    let devplug = Devplug::run(&map.path(), &plugins);
    wait(&kubelet, "three resources", |n| {
        [keep, change, remove]
            .iter()
            .all(|r| n.capacity(r) == (2, 2))
    })
    .await;
    let before = kubelet.read(|n| history(n, keep));
    assert_eq!(before, (1, 1));

    map.update(&config(&[(keep, 2), (change, 5), (add, 3)]));
    wait(&kubelet, "the reload", |n| {
        n.capacity(change) == (5, 5) && n.capacity(add) == (3, 3) && n.capacity(remove) == (2, 0)
    })
    .await;
    // The changed resource was updated in place: same stream, no new registration.
    assert_eq!(kubelet.read(|n| history(n, change)), (1, 1));
    // The untouched resource was never reconnected.
    assert_eq!(kubelet.read(|n| history(n, keep)), before);
    assert_eq!(kubelet.read(|n| n.capacity(keep)), (2, 2));

    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(log.contains("config reloaded"), "{log}");
}

#[tokio::test]
async fn an_invalid_reload_keeps_the_old_config_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let path = tmp.path().join("config.yaml");
    std::fs::write(&path, config(&[("example.com/a", 2)])).unwrap();
    let devplug = Devplug::run(&path, &plugins);
    wait(&kubelet, "a", |n| n.capacity("example.com/a") == (2, 2)).await;

    // Invalid: unknown field. Nothing changes at the kubelet.
    std::fs::write(
        &path,
        "resources:\n  - name: example.com/a\n    virtual: { count: 4, colour: red }\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(kubelet.read(|n| n.capacity("example.com/a")), (2, 2));
    assert_eq!(kubelet.read(|n| history(n, "example.com/a")), (1, 1));

    // A later valid file applies (an editor's write-and-rename this time).
    let staged = tmp.path().join(".config.yaml.swp");
    std::fs::write(&staged, config(&[("example.com/a", 4)])).unwrap();
    std::fs::rename(&staged, &path).unwrap();
    wait(&kubelet, "a with 4 devices", |n| {
        n.capacity("example.com/a") == (4, 4)
    })
    .await;

    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(
        log.contains("config reload failed; keeping the previous config"),
        "{log}"
    );
    assert!(log.contains("colour"), "the reason names the field: {log}");
}
