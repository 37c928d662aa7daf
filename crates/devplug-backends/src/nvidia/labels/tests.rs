use super::*;
use crate::nvidia::seam::{MigInfo, Snapshot};

fn h100(index: u32) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        name: "NVIDIA H100 80GB HBM3".into(),
        minor: index,
        memory_bytes: 81_559 << 20,
        bus_id: format!("0000:0{index}:00.0"),
        nvlinks: Vec::new(),
        compute_capability: Some((9, 0)),
        mig_capable: true,
        mig_enabled: false,
        migs: Vec::new(),
        mig_profiles: Vec::new(),
    }
}

fn view_of(settings: &NvidiaSettings, gpus: Vec<GpuInfo>) -> View {
    let n = gpus.len();
    let mut view = View::build(
        settings,
        &Snapshot {
            gpus,
            lost: Vec::new(),
            pcie: vec![vec![None; n]; n],
        },
    );
    view.driver_version = Some("570.86.15".into());
    view.cuda_version = Some((12, 8));
    view
}

fn settings(sys: &Path) -> NvidiaSettings {
    NvidiaSettings {
        sys_root: sys.to_owned(),
        proc_root: sys.to_owned(),
        ..Default::default()
    }
}

fn healthy(_: &str, _: Option<u32>) -> Health {
    Health::Healthy
}

fn labels(pairs: &[(&str, &str)]) -> NodeLabels {
    pairs
        .iter()
        .map(|(k, v)| (format!("nvidia.com/{k}"), (*v).to_owned()))
        .collect()
}

#[test]
fn whole_gpus_carry_gfds_labels_in_gfds_formats() {
    let tmp = tempfile::tempdir().unwrap();
    let settings = settings(tmp.path());
    let view = view_of(&settings, (0..8).map(h100).collect());
    let got = node_labels(&settings, &view, &healthy);
    let want = labels(&[
        ("cuda.driver-version.full", "570.86.15"),
        ("cuda.driver-version.major", "570"),
        ("cuda.driver-version.minor", "86"),
        ("cuda.driver-version.revision", "15"),
        ("cuda.driver.major", "570"),
        ("cuda.driver.minor", "86"),
        ("cuda.driver.rev", "15"),
        ("cuda.runtime-version.full", "12.8"),
        ("cuda.runtime-version.major", "12"),
        ("cuda.runtime-version.minor", "8"),
        ("cuda.runtime.major", "12"),
        ("cuda.runtime.minor", "8"),
        ("gpu.compute.major", "9"),
        ("gpu.compute.minor", "0"),
        ("gpu.count", "8"),
        ("gpu.family", "hopper"),
        ("gpu.memory", "81559"),
        ("gpu.present", "true"),
        ("gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("gpu.replicas", "1"),
        ("gpu.sharing-strategy", "none"),
        ("mig.capable", "true"),
        ("mps.capable", "false"),
    ]);
    assert_eq!(got, want);
}

#[test]
fn a_lost_gpu_leaves_the_count_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let settings = settings(tmp.path());
    let view = view_of(&settings, (0..8).map(h100).collect());
    let all = node_labels(&settings, &view, &healthy);
    let lost = |uuid: &str, _: Option<u32>| {
        if uuid == "GPU-3" {
            Health::unhealthy("GPU is lost")
        } else {
            Health::Healthy
        }
    };
    let mut got = node_labels(&settings, &view, &lost);
    assert_eq!(got.remove("nvidia.com/gpu.count").as_deref(), Some("7"));
    let mut rest = all.clone();
    rest.remove("nvidia.com/gpu.count");
    assert_eq!(got, rest);
}

#[test]
fn time_slicing_is_shared_with_its_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let mut settings = settings(tmp.path());
    settings.replicas = 4;
    let view = view_of(&settings, (0..2).map(h100).collect());
    let got = node_labels(&settings, &view, &healthy);
    assert_eq!(
        got["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3-SHARED"
    );
    assert_eq!(got["nvidia.com/gpu.replicas"], "4");
    assert_eq!(got["nvidia.com/gpu.count"], "2");
    assert_eq!(got["nvidia.com/gpu.sharing-strategy"], "time-slicing");
}

#[test]
fn nothing_served_writes_no_label() {
    let tmp = tempfile::tempdir().unwrap();
    let settings = settings(tmp.path());
    let view = view_of(&settings, Vec::new());
    assert!(node_labels(&settings, &view, &healthy).is_empty());
}

#[test]
fn families_are_gfds() {
    let cases = [
        ((6, 0), "pascal"),
        ((7, 0), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
        ((13, 0), "rubin"),
        ((11, 0), "undefined"),
        ((14, 0), "undefined"),
    ];
    for ((major, minor), want) in cases {
        assert_eq!(family(major, minor), want, "{major}.{minor}");
    }
}

#[test]
fn products_and_values_are_sanitised_as_gfd_does() {
    assert_eq!(
        product(&["NVIDIA A100-SXM4-40GB", "MIG", "1g.5gb"], false),
        "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    );
    assert_eq!(
        product(&["NVIDIA GeForce RTX 4090 (Laptop)"], true),
        "NVIDIA-GeForce-RTX-4090-Laptop-SHARED"
    );
    assert_eq!(sanitise("  DGX  H100 \n"), "DGX-H100");
    let long = sanitise(&"x".repeat(70));
    assert_eq!(long.len(), 63);
    assert_eq!(sanitise("(abc)-"), "abc");
}

#[test]
fn machine_and_mode_come_from_sysfs_when_it_has_them() {
    let tmp = tempfile::tempdir().unwrap();
    let settings = settings(tmp.path());
    let dmi = tmp.path().join("class/dmi/id");
    std::fs::create_dir_all(&dmi).unwrap();
    std::fs::write(dmi.join("product_name"), "DGXH100 (rev 2)\n").unwrap();
    for i in 0..2 {
        let dev = tmp.path().join(format!("bus/pci/devices/0000:0{i}:00.0"));
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("class"), "0x030200\n").unwrap();
    }
    let view = view_of(&settings, (0..2).map(h100).collect());
    let got = node_labels(&settings, &view, &healthy);
    assert_eq!(got["nvidia.com/gpu.machine"], "DGXH100-rev-2");
    assert_eq!(got["nvidia.com/gpu.mode"], "compute");
}

/// Two A100s in MIG mode with two 1g.5gb devices each, their caps in `mig-minors`.
fn a100_migs(sys: &Path) -> Vec<GpuInfo> {
    let dir = sys.join("driver/nvidia-caps");
    std::fs::create_dir_all(&dir).unwrap();
    let mut minors = String::from("config 1\nmonitor 2\n");
    let mut gpus = Vec::new();
    for g in 0..2u32 {
        let mut gpu = h100(g);
        gpu.name = "NVIDIA A100-SXM4-40GB".into();
        gpu.memory_bytes = 40_960 << 20;
        gpu.compute_capability = Some((8, 0));
        gpu.mig_enabled = true;
        for gi in [7u32, 8] {
            gpu.migs.push(MigInfo {
                uuid: format!("MIG-{g}-{gi}"),
                profile: "1g.5gb".into(),
                gi,
                ci: 0,
                memory_bytes: 4864 << 20,
                attributes: super::super::seam::MigAttributes {
                    multiprocessors: 14,
                    gi_slices: 1,
                    ci_slices: 1,
                    copy_engines: 1,
                    decoders: 0,
                    encoders: 0,
                    jpeg_engines: 0,
                    ofa_engines: 0,
                },
            });
            minors.push_str(&format!(
                "gpu{g}/gi{gi}/access {}\ngpu{g}/gi{gi}/ci0/access {}\n",
                100 + g * 10 + gi,
                200 + g * 10 + gi
            ));
        }
        gpus.push(gpu);
    }
    std::fs::write(dir.join("mig-minors"), minors).unwrap();
    gpus
}

#[test]
fn mig_single_names_the_profile_and_counts_mig_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let mut settings = settings(tmp.path());
    settings.mig_strategy = MigStrategy::Single;
    let view = view_of(&settings, a100_migs(tmp.path()));
    let unhealthy_one = |uuid: &str, gi: Option<u32>| {
        if uuid == "GPU-1" && gi == Some(8) {
            Health::unhealthy("XID 94")
        } else {
            Health::Healthy
        }
    };
    let got = node_labels(&settings, &view, &unhealthy_one);
    assert_eq!(
        got["nvidia.com/gpu.product"],
        "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    );
    assert_eq!(got["nvidia.com/gpu.count"], "3");
    assert_eq!(got["nvidia.com/gpu.memory"], "4864");
    assert_eq!(got["nvidia.com/gpu.family"], "ampere");
    assert_eq!(got["nvidia.com/mig.strategy"], "single");
    assert_eq!(got["nvidia.com/mps.capable"], "false");
    // The MIG device's attributes, as GFD's migAttributeLabeler writes them.
    for (key, want) in [
        ("multiprocessors", "14"),
        ("slices.gi", "1"),
        ("slices.ci", "1"),
        ("engines.copy", "1"),
        ("engines.decoder", "0"),
        ("engines.encoder", "0"),
        ("engines.jpeg", "0"),
        ("engines.ofa", "0"),
    ] {
        assert_eq!(got[&format!("nvidia.com/gpu.{key}")], want, "{key}");
    }
}

#[test]
fn mig_mixed_labels_each_profile_as_its_own_resource() {
    let tmp = tempfile::tempdir().unwrap();
    let mut settings = settings(tmp.path());
    settings.mig_strategy = MigStrategy::Mixed;
    settings.mig_profile = Some("1g.5gb".into());
    let view = view_of(&settings, a100_migs(tmp.path()));
    let got = node_labels(&settings, &view, &healthy);
    assert_eq!(got["nvidia.com/mig.strategy"], "mixed");
    assert_eq!(got["nvidia.com/mig-1g.5gb.count"], "4");
    assert_eq!(
        got["nvidia.com/mig-1g.5gb.product"],
        "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    );
    assert_eq!(got["nvidia.com/mig-1g.5gb.memory"], "4864");
    assert_eq!(got["nvidia.com/mig-1g.5gb.replicas"], "1");
    assert_eq!(got["nvidia.com/mig-1g.5gb.multiprocessors"], "14");
    assert_eq!(got["nvidia.com/mig-1g.5gb.slices.gi"], "1");
    assert_eq!(got["nvidia.com/mig-1g.5gb.engines.copy"], "1");
    assert_eq!(got["nvidia.com/mig-1g.5gb.engines.ofa"], "0");
    assert_eq!(got["nvidia.com/gpu.product"], "NVIDIA-A100-SXM4-40GB");
    assert_eq!(got["nvidia.com/gpu.memory"], "40960");
    // The whole GPUs' labels carry no MIG attributes (GFD's full-GPU labeler has none).
    assert!(!got.contains_key("nvidia.com/gpu.multiprocessors"));
}
