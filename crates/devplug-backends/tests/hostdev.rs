//! The hostdev backend through the kubelet simulator, on a fake /dev and sysfs tree in a temp
//! folder (no hardware, no root), with real inotify.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::{Backend, Host};
use devplug_backends::hostdev::{GroupSettings, PciMatch, ReplicaPolicy, UsbMatch};
use devplug_backends::{HostdevBackend, HostdevSettings};
use kubelet_sim::Kubelet;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod support;

use support::WAIT;

/// A fake machine: two FTDI serial adapters (0403:6001) below a USB controller on NUMA 0, an
/// NVIDIA GPU (10de:2230) on NUMA 1 with card and render nodes, and /dev/fuse.
struct FakeHost {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl FakeHost {
    fn new() -> FakeHost {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_owned();
        let host = FakeHost { _tmp: tmp, root };
        let ctrl = "devices/pci0000:00/0000:00:14.0";
        host.file(&format!("sys/{ctrl}/numa_node"), "0\n");
        for (port, tty, usbdev) in [("1-1", "ttyUSB0", "002"), ("1-2", "ttyUSB1", "003")] {
            let dev = format!("{ctrl}/usb1/{port}");
            host.file(&format!("sys/{dev}/idVendor"), "0403\n");
            host.file(&format!("sys/{dev}/idProduct"), "6001\n");
            host.file(
                &format!("sys/{dev}/uevent"),
                &format!("MAJOR=189\nDEVNAME=bus/usb/001/{usbdev}\n"),
            );
            host.file(
                &format!("sys/{dev}/{port}:1.0/{tty}/uevent"),
                &format!("DEVNAME={tty}\n"),
            );
            host.link(
                &format!("sys/bus/usb/devices/{port}"),
                &format!("../../../{dev}"),
            );
            host.link(
                &format!("sys/bus/usb/devices/{port}:1.0"),
                &format!("../../../{dev}/{port}:1.0"),
            );
            host.file(&format!("dev/{tty}"), "");
            host.file(&format!("dev/bus/usb/001/{usbdev}"), "");
        }
        let gpu = "devices/pci0000:3a/0000:3b:00.0";
        host.file(&format!("sys/{gpu}/vendor"), "0x10de\n");
        host.file(&format!("sys/{gpu}/device"), "0x2230\n");
        host.file(&format!("sys/{gpu}/class"), "0x030000\n");
        host.file(&format!("sys/{gpu}/numa_node"), "1\n");
        host.file(
            &format!("sys/{gpu}/drm/card0/uevent"),
            "DEVNAME=dri/card0\n",
        );
        host.file(
            &format!("sys/{gpu}/drm/renderD128/uevent"),
            "DEVNAME=dri/renderD128\n",
        );
        host.link(
            "sys/bus/pci/devices/0000:3b:00.0",
            &format!("../../../{gpu}"),
        );
        host.file("dev/dri/card0", "");
        host.file("dev/dri/renderD128", "");
        host.file("dev/fuse", "");
        host
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn file(&self, rel: &str, text: &str) {
        let path = self.path(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    fn link(&self, rel: &str, target: &str) {
        let path = self.path(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        symlink(target, path).unwrap();
    }

    fn settings(&self, groups: Vec<GroupSettings>) -> HostdevSettings {
        HostdevSettings {
            dev_root: self.path("dev"),
            sys_root: self.path("sys"),
            ..HostdevSettings::new(groups)
        }
    }
}

fn paths(p: &[&str]) -> GroupSettings {
    GroupSettings {
        paths: p.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

async fn serve(fake: &FakeHost, resources: Vec<(&str, HostdevSettings)>) -> (Kubelet, Host) {
    let backends = resources
        .into_iter()
        .map(|(name, settings)| {
            let backend: Arc<dyn Backend> = Arc::new(HostdevBackend::start(&settings).unwrap());
            (name, backend)
        })
        .collect();
    support::serve(&fake.path("kubelet/device-plugins"), backends).await
}

/// Waits until the kubelet lists exactly these (id, healthy, NUMA nodes).
async fn ids(kubelet: &Kubelet, resource: &str, want: &[(&str, bool, &[i64])]) {
    support::devices(kubelet, resource, want).await;
}

fn specs(alloc: &kubelet_sim::Allocation, root: &Path) -> Vec<(String, String, String)> {
    alloc
        .response
        .devices
        .iter()
        .map(|d| {
            let host = d
                .host_path
                .strip_prefix(&root.display().to_string())
                .unwrap_or(&d.host_path)
                .to_owned();
            (host, d.container_path.clone(), d.permissions.clone())
        })
        .collect()
}

#[tokio::test]
async fn usb_serial_adapters_a_pci_gpu_and_fuse_from_a_fake_tree() {
    let fake = FakeHost::new();
    let serial = GroupSettings {
        usb: vec![UsbMatch {
            vendor: "0403".into(),
            product: Some("6001".into()),
        }],
        ..Default::default()
    };
    let gpu = GroupSettings {
        pci: vec![PciMatch {
            vendor: Some("10de".into()),
            class: Some("03".into()),
            ..Default::default()
        }],
        permissions: "rwm".into(),
        ..Default::default()
    };
    let fuse = HostdevSettings {
        count: 3,
        ..fake.settings(vec![paths(&["/dev/fuse"])])
    };
    let (kubelet, host) = serve(
        &fake,
        vec![
            ("example.com/serial", fake.settings(vec![serial])),
            ("example.com/gpu", fake.settings(vec![gpu])),
            ("example.com/fuse", fuse),
        ],
    )
    .await;

    ids(
        &kubelet,
        "example.com/serial",
        &[("usb-1-1", true, &[0]), ("usb-1-2", true, &[0])],
    )
    .await;
    ids(
        &kubelet,
        "example.com/gpu",
        &[("pci-0000:3b:00.0", true, &[1])],
    )
    .await;
    ids(
        &kubelet,
        "example.com/fuse",
        &[
            ("fuse-0", true, &[]),
            ("fuse-1", true, &[]),
            ("fuse-2", true, &[]),
        ],
    )
    .await;

    let root = fake.path("");
    let serial = kubelet
        .allocate("pod", "main", "example.com/serial", 1)
        .await
        .unwrap();
    let want = |v: &[(&str, &str, &str)]| {
        v.iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        specs(&serial, &root),
        want(&[
            ("dev/bus/usb/001/002", "/dev/bus/usb/001/002", "rw"),
            ("dev/ttyUSB0", "/dev/ttyUSB0", "rw")
        ])
    );
    let gpu = kubelet
        .allocate("pod", "main", "example.com/gpu", 1)
        .await
        .unwrap();
    assert_eq!(
        specs(&gpu, &root),
        want(&[
            ("dev/dri/card0", "/dev/dri/card0", "rwm"),
            ("dev/dri/renderD128", "/dev/dri/renderD128", "rwm")
        ])
    );
    let fuse = kubelet
        .allocate("pod", "main", "example.com/fuse", 2)
        .await
        .unwrap();
    assert_eq!(fuse.device_ids.len(), 2);
    assert_eq!(
        specs(&fuse, &root),
        want(&[("dev/fuse", "/dev/fuse", "rw")]),
        "shares of one node give one device spec"
    );
    host.shutdown().await;
}

/// The DRA attributes come from what discovery read (node paths, USB and PCI ids, the PCI
/// address and its root complex); the device plugin side is unchanged (above).
#[tokio::test]
async fn dra_attributes_from_what_discovery_found() {
    use support::{dra, map};
    let fake = FakeHost::new();
    let serial = GroupSettings {
        usb: vec![UsbMatch {
            vendor: "0403".into(),
            product: Some("6001".into()),
        }],
        ..Default::default()
    };
    let gpu = GroupSettings {
        pci: vec![PciMatch {
            vendor: Some("10de".into()),
            ..Default::default()
        }],
        ..Default::default()
    };
    let fuse = HostdevSettings {
        count: 2,
        ..fake.settings(vec![paths(&["/dev/fuse"])])
    };
    let list = |settings: &HostdevSettings| {
        HostdevBackend::start(settings)
            .unwrap()
            .devices()
            .borrow()
            .clone()
    };
    let serial = list(&fake.settings(vec![serial]));
    assert_eq!(
        dra(&serial, "usb-1-2"),
        map(&[
            ("path", "/dev/bus/usb/001/003"),
            ("productID", "6001"),
            ("vendorID", "0403"),
        ])
    );
    let gpu = list(&fake.settings(vec![gpu]));
    assert_eq!(
        dra(&gpu, "pci-0000:3b:00.0"),
        map(&[
            ("deviceID", "2230"),
            ("path", "/dev/dri/card0"),
            ("resource.kubernetes.io/pciBusID", "0000:3b:00.0"),
            ("resource.kubernetes.io/pcieRoot", "pci0000:3a"),
            ("vendorID", "10de"),
        ])
    );
    let fuse = list(&fuse);
    for id in ["fuse-0", "fuse-1"] {
        assert_eq!(dra(&fuse, id), map(&[("path", "/dev/fuse")]));
    }
}

#[tokio::test]
async fn hotplug_of_globbed_and_exact_nodes() {
    let fake = FakeHost::new();
    let (kubelet, host) = serve(
        &fake,
        vec![
            (
                "example.com/tty",
                fake.settings(vec![paths(&["/dev/ttyUSB*"])]),
            ),
            (
                "example.com/fuse",
                fake.settings(vec![paths(&["/dev/fuse"])]),
            ),
            (
                "example.com/render",
                fake.settings(vec![paths(&["/dev/dri/renderD*"])]),
            ),
        ],
    )
    .await;
    ids(
        &kubelet,
        "example.com/tty",
        &[("ttyUSB0", true, &[]), ("ttyUSB1", true, &[])],
    )
    .await;

    fake.file("dev/ttyUSB2", "");
    ids(
        &kubelet,
        "example.com/tty",
        &[
            ("ttyUSB0", true, &[]),
            ("ttyUSB1", true, &[]),
            ("ttyUSB2", true, &[]),
        ],
    )
    .await;
    std::fs::remove_file(fake.path("dev/ttyUSB0")).unwrap();
    ids(
        &kubelet,
        "example.com/tty",
        &[("ttyUSB1", true, &[]), ("ttyUSB2", true, &[])],
    )
    .await;

    // A node named exactly turns unhealthy when it vanishes, and healthy when it is back.
    std::fs::remove_file(fake.path("dev/fuse")).unwrap();
    ids(&kubelet, "example.com/fuse", &[("fuse", false, &[])]).await;
    fake.file("dev/fuse", "");
    ids(&kubelet, "example.com/fuse", &[("fuse", true, &[])]).await;

    // A whole sub-folder going and coming back is followed too.
    ids(
        &kubelet,
        "example.com/render",
        &[("dri_renderD128", true, &[])],
    )
    .await;
    std::fs::remove_dir_all(fake.path("dev/dri")).unwrap();
    ids(&kubelet, "example.com/render", &[]).await;
    fake.file("dev/dri/renderD129", "");
    ids(
        &kubelet,
        "example.com/render",
        &[("dri_renderD129", true, &[])],
    )
    .await;
    host.shutdown().await;
}

#[tokio::test]
async fn shared_devices_spread_or_pack() {
    let fake = FakeHost::new();
    fake.file("dev/dri/renderD129", "");
    let render = |policy| HostdevSettings {
        count: 2,
        policy,
        ..fake.settings(vec![paths(&["/dev/dri/renderD*"])])
    };
    let (kubelet, host) = serve(
        &fake,
        vec![
            ("example.com/spread", render(ReplicaPolicy::Spread)),
            ("example.com/pack", render(ReplicaPolicy::Pack)),
        ],
    )
    .await;
    for r in ["example.com/spread", "example.com/pack"] {
        kubelet
            .wait_for(WAIT, |n| (n.capacity(r) == (4, 4)).then_some(()))
            .await
            .unwrap();
    }
    let spread = kubelet
        .allocate("pod", "main", "example.com/spread", 2)
        .await
        .unwrap();
    assert_eq!(spread.device_ids, ["dri_renderD128-0", "dri_renderD129-0"]);
    assert_eq!(spread.response.devices.len(), 2);
    let pack = kubelet
        .allocate("pod", "main", "example.com/pack", 2)
        .await
        .unwrap();
    assert_eq!(pack.device_ids, ["dri_renderD128-0", "dri_renderD128-1"]);
    assert_eq!(pack.response.devices.len(), 1);
    host.shutdown().await;
}

#[test]
fn bad_settings_name_the_field() {
    let bad = |groups: Vec<GroupSettings>| HostdevSettings::new(groups).validate().unwrap_err();
    assert_eq!(bad(vec![]).field, "groups");
    assert_eq!(bad(vec![paths(&["ttyUSB*"])]).field, "groups[0].paths[0]");
    assert_eq!(bad(vec![GroupSettings::default()]).field, "groups[0].paths");
    let usb = GroupSettings {
        usb: vec![UsbMatch {
            vendor: "xyz".into(),
            product: None,
        }],
        ..Default::default()
    };
    assert_eq!(bad(vec![usb]).field, "groups[0].usb[0].vendor");
    let perms = GroupSettings {
        permissions: "rx".into(),
        ..paths(&["/dev/fuse"])
    };
    assert_eq!(bad(vec![perms]).field, "groups[0].permissions");
    let count = HostdevSettings {
        count: 0,
        ..HostdevSettings::new(vec![paths(&["/dev/fuse"])])
    };
    assert_eq!(count.validate().unwrap_err().field, "count");
}

/// A group that matches nothing (a typo in a glob or a USB id) is reported as a warning, for
/// the metrics endpoint, and stops being one when a matching device appears.
#[tokio::test]
async fn groups_that_match_nothing_are_reported() {
    let fake = FakeHost::new();
    let settings = fake.settings(vec![
        paths(&["/dev/ttyUSB*"]),
        paths(&["/dev/ttyUSX*"]),
        GroupSettings {
            usb: vec![UsbMatch {
                vendor: "0403".into(),
                product: Some("6002".into()),
            }],
            ..Default::default()
        },
    ]);
    let backend = HostdevBackend::start(&settings).unwrap();
    let details = |backend: &HostdevBackend| -> Vec<String> {
        devplug::Backend::warnings(backend)
            .into_iter()
            .map(|w| {
                assert_eq!(w.kind, "group_matches_nothing");
                w.detail
            })
            .collect()
    };
    assert_eq!(
        details(&backend),
        ["groups[1]: paths /dev/ttyUSX*", "groups[2]: usb 0403:6002"]
    );
    // Created right after start, before the hotplug watches are armed: still seen.
    let mut devices = devplug::Backend::devices(&backend);
    fake.file("dev/ttyUSX0", "");
    tokio::time::timeout(WAIT, devices.wait_for(|list| list.len() == 3))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(details(&backend), ["groups[2]: usb 0403:6002"]);
}
