//! Tests of `view.rs`.

use super::*;
use crate::nvidia::seam::PcieLevel;
use crate::nvidia::settings::ReplicaOverride;
use std::path::PathBuf;

fn gpu(index: u32, name: &str, links: &[&str]) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        name: name.into(),
        minor: index,
        memory_bytes: 1 << 30,
        bus_id: format!("0000:0{index}:00.0"),
        nvlinks: links.iter().map(|s| s.to_string()).collect(),
        compute_capability: None,
        mig_capable: false,
        mig_enabled: false,
        migs: Vec::new(),
        mig_profiles: Vec::new(),
    }
}

fn mig(uuid: &str, profile: &str, gi: u32) -> MigInfo {
    MigInfo {
        uuid: uuid.into(),
        profile: profile.into(),
        gi,
        ci: 0,
        memory_bytes: 1,
        attributes: Default::default(),
    }
}

#[test]
fn mig_caps_from_mig_minors_and_what_is_left_out() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = gpu(0, "NVIDIA A100-SXM4-40GB", &[]);
    a.minor = 3;
    a.mig_enabled = true;
    a.migs = vec![mig("MIG-a", "1g.5gb", 7), mig("MIG-b", "1g.5gb", 8)];
    let snapshot = Snapshot {
        gpus: vec![a, gpu(1, "NVIDIA A100-SXM4-40GB", &[])],
        lost: Vec::new(),
        pcie: vec![vec![None; 2]; 2],
    };
    let settings = NvidiaSettings {
        mig_strategy: MigStrategy::Mixed,
        mig_profile: Some("1g.5gb".into()),
        proc_root: tmp.path().to_owned(),
        sys_root: tmp.path().to_owned(),
        ..Default::default()
    };
    // No mig-minors: nothing served, and the reason.
    let view = View::build(&settings, &snapshot);
    assert!(view.gpus.is_empty());
    assert!(view.problem.as_deref().unwrap().contains("mig-minors"));
    // MIG-b's GI has no entry: it is left out; MIG-a gets its GI and CI nodes.
    let dir = tmp.path().join("driver/nvidia-caps");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("mig-minors"),
        "config 1\nmonitor 2\ngpu3/gi7/access 66\ngpu3/gi7/ci0/access 67\ngpu3/gi8/ci0/access 77\n",
    )
    .unwrap();
    let view = View::build(&settings, &snapshot);
    assert_eq!(view.problem, None);
    assert_eq!(view.gpus.len(), 1);
    assert_eq!(view.gpus[0].uuid(), "MIG-a");
    assert_eq!(
        view.gpus[0].nodes(),
        [
            PathBuf::from("nvidia3"),
            PathBuf::from("nvidia-caps/nvidia-cap66"),
            PathBuf::from("nvidia-caps/nvidia-cap67")
        ]
    );
    // single: GPU 1 has MIG off while GPU 0 has it on.
    let single = NvidiaSettings {
        mig_strategy: MigStrategy::Single,
        mig_profile: None,
        ..settings.clone()
    };
    let view = View::build(&single, &snapshot);
    assert!(view.gpus.is_empty());
    assert!(view.problem.unwrap().contains("GPU 1"));
    // single with no GPU in MIG mode: the GPUs whole (as NVIDIA does).
    let plain = Snapshot {
        gpus: vec![gpu(0, "x", &[]), gpu(1, "x", &[])],
        lost: Vec::new(),
        pcie: vec![vec![None; 2]; 2],
    };
    let view = View::build(&single, &plain);
    assert_eq!(view.gpus.len(), 2);
    assert_eq!(view.gpus[1].uuid(), "GPU-1");
}

/// The A100-40GB's GPU-instance profiles and placements (NVIDIA's MIG user guide).
fn a100_profiles() -> Vec<GiProfile> {
    let p = |id, slices, memory_mib, placements: &[(u32, u32)]| GiProfile {
        id,
        slices,
        memory_mib,
        placements: placements.to_vec(),
    };
    vec![
        p(
            0,
            1,
            4864,
            &[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)],
        ),
        p(1, 2, 9856, &[(0, 2), (2, 2), (4, 2)]),
        p(2, 3, 19_968, &[(0, 4), (4, 4)]),
        p(3, 4, 19_968, &[(0, 4)]),
        p(4, 7, 40_192, &[(0, 8)]),
        p(7, 1, 9856, &[(0, 2), (2, 2), (4, 2), (6, 2)]),
    ]
}

#[test]
fn dynamic_mig_publishes_partitions_that_consume_the_gpus_slices() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = gpu(0, "NVIDIA A100-SXM4-40GB", &[]);
    a.memory_bytes = 40_960 << 20;
    a.mig_enabled = true;
    a.mig_profiles = a100_profiles();
    let snapshot = Snapshot {
        gpus: vec![a, gpu(1, "NVIDIA A100-SXM4-40GB", &[])],
        lost: Vec::new(),
        pcie: vec![vec![None; 2]; 2],
    };
    let settings = NvidiaSettings {
        mig_strategy: MigStrategy::Dynamic,
        proc_root: tmp.path().to_owned(),
        sys_root: tmp.path().to_owned(),
        ..Default::default()
    };
    let view = View::build(&settings, &snapshot);
    assert_eq!(view.problem, None);
    // GPU 1 (MIG off) whole, GPU 0 as 7 + 3 + 2 + 1 + 1 + 4 partitions.
    assert_eq!(view.gpus.len(), 1 + 18);
    assert_eq!(view.gpus[0].ids, ["GPU-1"]);
    assert_eq!(view.counter_sets.len(), 1);
    let set = &view.counter_sets[0];
    assert_eq!(set.name, "gpu-0");
    assert_eq!(
        set.counters.len(),
        9,
        "8 memory slices and the compute slices"
    );
    assert_eq!(set.counters[COMPUTE_SLICES], 7);
    let part = view.served("gpu-0-mig-3g-20gb-4").unwrap();
    let attributes = part.attributes.as_ref().unwrap();
    assert_eq!(attributes.consumes.len(), 1);
    let consumed = &attributes.consumes[0].counters;
    assert_eq!(consumed[COMPUTE_SLICES], 3);
    let slices: Vec<&str> = consumed
        .keys()
        .filter(|k| k.starts_with("memory-slice-"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        slices,
        [
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "memory-slice-7"
        ]
    );
    assert!(view.served("gpu-0-mig-1g-10gb-6").is_ok());
    assert!(view.served("gpu-0-mig-7g-40gb-0").is_ok());
    assert!(
        view.served("gpu-0-mig-1g-5gb-7").is_err(),
        "no 1g.5gb at slice 7"
    );
    // The CDI spec has the whole GPU only: a partition's MIG device does not exist yet.
    let spec = view.spec(tmp.path());
    assert_eq!(
        spec.to_json().matches("\"name\"").count(),
        1,
        "{}",
        spec.to_json()
    );
    // Without profiles from NVML, a GPU in MIG mode serves nothing, and says so.
    let mut bare = snapshot.clone();
    bare.gpus[0].mig_profiles.clear();
    let view = View::build(&settings, &bare);
    assert_eq!(view.gpus.len(), 1);
    assert!(view.problem.unwrap().contains("no MIG profiles"));
}

#[test]
fn models_replicas_and_weights() {
    let snapshot = Snapshot {
        gpus: vec![
            gpu(
                0,
                "NVIDIA H100 80GB HBM3",
                &["0000:01:00.0", "0000:01:00.0", "0000:f0:00.0"],
            ),
            gpu(
                1,
                "NVIDIA H100 80GB HBM3",
                &["0000:00:00.0", "0000:00:00.0", "0000:f0:00.0"],
            ),
            gpu(2, "NVIDIA A100-SXM4-40GB", &[]),
        ],
        lost: Vec::new(),
        pcie: vec![
            vec![None, Some(PcieLevel::Single), Some(PcieLevel::System)],
            vec![Some(PcieLevel::Single), None, Some(PcieLevel::System)],
            vec![Some(PcieLevel::System), Some(PcieLevel::System), None],
        ],
    };
    let settings = NvidiaSettings {
        replicas: 2,
        replica_overrides: vec![ReplicaOverride {
            gpus: vec!["GPU-1".into()],
            replicas: 3,
        }],
        ..Default::default()
    };
    let view = View::build(&settings, &snapshot);
    assert_eq!(view.gpus[0].ids, ["GPU-0::0", "GPU-0::1"]);
    assert_eq!(view.gpus[1].ids.len(), 3);
    // 2 direct links + 1 through the same switch, plus PCIe SINGLE.
    assert_eq!(view.matrix.weight(0, 1), 3 * NVLINK_SCORE + 50);
    assert_eq!(view.matrix.weight(0, 2), 10);

    let h100 = NvidiaSettings {
        models: vec!["*H100*".into()],
        ..Default::default()
    };
    let view = View::build(&h100, &snapshot);
    assert_eq!(view.gpus.len(), 2);
    assert_eq!(view.gpus[1].ids, ["GPU-1"]);
    assert!(!view.shared);
}
