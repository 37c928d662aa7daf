//! Benchmarks of the accelerator backends (`vfio`, `qat`, `ascend`, `fpga`) on fake trees (in
//! /dev/shm when present): discovery at start, and a change (VFs enabled, a device bound to
//! `vfio-pci`, an NPU's node removed) until the kubelet simulator has it.

use crate::{print_row, WAIT};
use devplug::Backend;
use devplug_backends::hostdev::PciMatch;
use devplug_backends::vfio::QatService;
use devplug_backends::{ascend, fpga, vfio, AscendSettings, FpgaSettings, QatSettings};
use devplug_backends::{NodeBackend, SettingsError, VfioSettings};
use devplug_testkit::fake_accelerators::{AscendNode, FpgaCard, QatCard};
use devplug_testkit::fake_sysfs::{scratch_dir, FakeSysfs, PciSpec};
use std::sync::Arc;
use std::time::Instant;

/// A node with 4 QAT Gen4 cards of 16 VFs each (64 VFs), and 8 GPUs bound to vfio-pci.
fn qat_node() -> anyhow::Result<(tempfile::TempDir, FakeSysfs, Vec<QatCard>)> {
    let tmp = tempfile::tempdir_in(scratch_dir())?;
    let tree = FakeSysfs::new(tmp.path())?;
    tree.load_vfio()?;
    let cards: Vec<QatCard> = (0..4u32)
        .map(|k| {
            QatCard::gen4(
                &format!("0000:{:02x}:00.0", 0x3d + 2 * k),
                i64::from(k / 2),
                "sym;asym",
                100 + 20 * k,
            )
        })
        .collect();
    for card in &cards {
        card.create(&tree)?;
        card.set_numvfs(&tree, 16)?;
    }
    for k in 0..8u32 {
        tree.vfio_device(&PciSpec {
            address: format!("0000:{:02x}:00.0", 0x81 + k),
            vendor: 0x10de,
            device: 0x2236,
            class: 0x030200,
            numa: i64::from(k / 4),
            iommu_group: 10 + k,
        })?;
    }
    Ok((tmp, tree, cards))
}

fn qat_settings(tree: &FakeSysfs) -> QatSettings {
    QatSettings {
        service: QatService::Cy,
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..QatSettings::default()
    }
}

fn vfio_settings(tree: &FakeSysfs) -> VfioSettings {
    VfioSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..VfioSettings::new(vec![PciMatch {
            vendor: Some("10de".into()),
            ..Default::default()
        }])
    }
}

/// Starts a backend 100 times (first scan, CDI spec written, list published) and prints the
/// times as one row.
fn start_row(
    label: &str,
    want: usize,
    start: impl Fn() -> Result<NodeBackend, SettingsError>,
) -> anyhow::Result<()> {
    let mut samples = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let backend = start()?;
        let n = backend.devices().borrow().len();
        samples.push(t.elapsed());
        anyhow::ensure!(n == want, "{label}: found {n} devices, not {want}");
    }
    print_row(label, &mut samples);
    Ok(())
}

/// Backend start (first scan, CDI spec written, list published), 100 times each.
pub async fn discovery() -> anyhow::Result<()> {
    let (_tmp, tree, _) = qat_node()?;
    start_row(
        "qat: discovery at start, 4 Gen4 cards × 16 VFs on vfio-pci (+ 8 other vfio devices), CDI spec",
        64,
        || vfio::start_qat("qat.intel.com/cy", &qat_settings(&tree)),
    )?;
    start_row(
        "vfio: discovery at start, 8 GPUs on vfio-pci among 76 PCI devices, CDI spec",
        8,
        || vfio::start("example.com/gpu-vm", &vfio_settings(&tree)),
    )?;

    let tmp = tempfile::tempdir_in(scratch_dir())?;
    let tree = FakeSysfs::new(tmp.path())?;
    AscendNode::ascend910(8).create(&tree)?;
    let settings = AscendSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..AscendSettings::default()
    };
    start_row("ascend: discovery at start, 8 NPUs, CDI spec", 8, || {
        ascend::start("huawei.com/Ascend910", &settings)
    })?;

    let afu = "d8424dc4a4a3c413f89e433683f9040b";
    for region in 0..2u32 {
        FpgaCard {
            address: format!("0000:{:02x}:00.0", 0x5e + region),
            numa: i64::from(region),
            region,
            interface_id: "ce48969398f05f33946d560708be108a".into(),
            ports: vec![(2 * region, afu.into()), (2 * region + 1, afu.into())],
        }
        .create(&tree)?;
    }
    let settings = FpgaSettings {
        sys_root: tree.sys_root(),
        dev_root: tree.dev_root(),
        cdi_dir: tree.path("cdi"),
        ..FpgaSettings::afu(afu)
    };
    start_row(
        "fpga: discovery at start, 2 DFL cards × 2 ports, CDI spec",
        4,
        || fpga::start("fpga.example.com/nlb0", &settings),
    )?;
    Ok(())
}

/// Changes until the kubelet has them: 16 VFs enabled on a card (made by the fake tree as the
/// kernel would: device, group, `vfio-pci` binding, `/dev/vfio/<group>`) until the kubelet
/// lists 64 again, and one GPU unbound from and bound back to `vfio-pci` until its health
/// flips.
pub async fn change_latency() -> anyhow::Result<()> {
    let (tmp, tree, cards) = qat_node()?;
    let qat: Arc<dyn Backend> =
        Arc::new(vfio::start_qat("qat.intel.com/cy", &qat_settings(&tree))?);
    let (kubelet, host) =
        crate::backends::serve("qat.intel.com/cy", qat, &tmp.path().join("plugins")).await?;
    let mut samples = Vec::new();
    for _ in 0..20 {
        cards[3].set_numvfs(&tree, 0)?;
        kubelet
            .wait_for(WAIT, |n| {
                (n.capacity("qat.intel.com/cy") == (48, 48)).then_some(())
            })
            .await?;
        cards[3].set_numvfs(&tree, 16)?;
        let t = Instant::now();
        kubelet
            .wait_for(WAIT, |n| {
                (n.capacity("qat.intel.com/cy") == (64, 64)).then_some(())
            })
            .await?;
        samples.push(t.elapsed());
    }
    print_row(
        "qat: 16 VFs enabled on a card (tree made) → kubelet lists all 64 (20 runs, 10 ms debounce)",
        &mut samples,
    );
    host.shutdown().await;

    let gpu: Arc<dyn Backend> = Arc::new(vfio::start("example.com/gpu-vm", &vfio_settings(&tree))?);
    let (kubelet, host) =
        crate::backends::serve("example.com/gpu-vm", gpu, &tmp.path().join("plugins2")).await?;
    let mut samples = Vec::new();
    for i in 0..400 {
        let healthy = i % 2 == 1;
        let t = Instant::now();
        if healthy {
            tree.bind_vfio("0000:81:00.0", 10)?;
        } else {
            tree.unbind_vfio("0000:81:00.0", 10)?;
        }
        kubelet
            .wait_for(WAIT, |n| {
                let d = n
                    .resource("example.com/gpu-vm")?
                    .devices()
                    .get("0000:81:00.0")?;
                (d.healthy == healthy).then_some(())
            })
            .await?;
        samples.push(t.elapsed());
    }
    print_row(
        "vfio: GPU unbound from / bound to vfio-pci → health seen by the kubelet (8 GPUs)",
        &mut samples,
    );
    host.shutdown().await;
    Ok(())
}
