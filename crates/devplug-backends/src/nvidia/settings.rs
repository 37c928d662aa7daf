//! Settings of the `nvidia` backend: where NVML is, which GPUs this resource serves, what
//! `Allocate` sends, time-slicing replicas (with per-GPU counts), and the health policy.

use crate::hostdev::ReplicaPolicy;
use crate::settings::{check_absolute, default_cdi_dir, default_dev_root, default_sys_root};
use crate::SettingsError;
use serde::Deserialize;
use std::path::PathBuf;

/// The most replicas one GPU may be split into (bounds the device list and the env var).
pub const MAX_REPLICAS: u32 = 256;

/// Where drivers live, in the order they are tried (NVIDIA's driver container mounts its root
/// at `/run/nvidia/driver`; the GPU Operator's plugin sees it at `/driver-root`).
pub const DEFAULT_DRIVER_ROOTS: [&str; 3] = ["/", "/run/nvidia/driver", "/driver-root"];

/// XIDs that mean "the application failed, the GPU is fine" (docs/gpus.md, "XID policy"):
/// NVIDIA's list (13, 31, 43, 45, 68) without 109 (a context-switch timeout: NVIDIA's XID
/// catalog says reset the GPU), plus 94 (a contained ECC error: the catalog says restart the
/// application), as NVIDIA/k8s-device-plugin#1974 argues.
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 94];

/// Settings of the `nvidia` backend.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvidiaSettings {
    /// The `libnvidia-ml.so.1` to load. Default: the first that exists under a driver root
    /// (`<root>/usr/lib/x86_64-linux-gnu`, or `aarch64-linux-gnu` on arm64, `<root>/usr/lib64`,
    /// `<root>/usr/lib`), else the dynamic loader's search path.
    #[serde(default)]
    pub library: Option<PathBuf>,
    /// Driver roots to look for the library under (default `/`, `/run/nvidia/driver`,
    /// `/driver-root`).
    #[serde(default = "default_driver_roots")]
    pub driver_roots: Vec<PathBuf>,
    /// Where the driver root NVML was found under is on the host, when devplug sees it at
    /// another path (the chart mounts the host's driver root at `/driver-root` and sets this
    /// to the host path). Default: the path devplug sees. Mounts handed to the runtime are
    /// host paths.
    #[serde(default)]
    pub host_driver_root: Option<PathBuf>,
    /// Give every container with a GPU the driver's user-space files of the version NVML
    /// reports (libraries at `/usr/local/nvidia/lib64`, `nvidia-smi` and the other programs at
    /// `/usr/local/nvidia/bin`, the firmware folder), read-only, in the CDI spec (`cdi-cri`) and
    /// in `Allocate` (`device-specs`), so CUDA works without NVIDIA's container toolkit
    /// (default true; false where the toolkit is the runtime and mounts them itself).
    #[serde(default = "yes")]
    pub driver_files: bool,
    /// Serve only GPUs whose product name matches one of these globs (e.g. `"*H100*"`), so
    /// mixed nodes get one resource per model. Default: every GPU.
    #[serde(default)]
    pub models: Vec<String>,
    /// Leave out GPUs whose product name matches one of these globs.
    #[serde(default)]
    pub exclude_models: Vec<String>,
    /// MIG, as NVIDIA's `--mig-strategy`: `none` (default; GPUs in MIG mode are served whole),
    /// `single` (every served GPU is in MIG mode with one profile; its MIG devices are the
    /// devices) or `mixed` (with `mig_profile`: the MIG devices of that profile; without: only
    /// the GPUs not in MIG mode).
    #[serde(default)]
    pub mig_strategy: MigStrategy,
    /// With `mig_strategy: mixed`: the MIG profile this resource serves, e.g. `1g.10gb`
    /// (NVIDIA names the resource `nvidia.com/mig-1g.10gb`). Not allowed with other strategies.
    #[serde(default)]
    pub mig_profile: Option<String>,
    /// The host's /proc, for `driver/nvidia-caps/mig-minors` (for tests: a fake tree).
    #[serde(default = "default_proc_root")]
    pub proc_root: PathBuf,
    /// What `Allocate` sends, any of `envvar` (`NVIDIA_VISIBLE_DEVICES=<uuids>`), `cdi-cri`
    /// (CDI names `nvidia.com/gpu=<uuid>` plus the spec file), `device-specs` (the device
    /// nodes). Default `[envvar, cdi-cri]`.
    #[serde(default = "default_strategies")]
    pub device_list_strategy: Vec<ListStrategy>,
    /// Where the CDI spec goes (default `/var/run/cdi`).
    #[serde(default = "default_cdi_dir")]
    pub cdi_dir: PathBuf,
    /// Time-slicing: each GPU is advertised this many times, as `<uuid>::<n>` (default 1: the
    /// UUID alone).
    #[serde(default = "one")]
    pub replicas: u32,
    /// Per-GPU replica counts; the first entry that matches a GPU wins.
    #[serde(default)]
    pub replica_overrides: Vec<ReplicaOverride>,
    /// Which replicas a container gets: `spread` (fewest used replicas first, distinct GPUs
    /// where possible; default) or `pack`.
    #[serde(default)]
    pub replica_policy: ReplicaPolicy,
    /// Refuse a request for more than one replica (NVIDIA's `failRequestsGreaterThanOne`).
    #[serde(default)]
    pub fail_requests_greater_than_one: bool,
    /// Health checking.
    #[serde(default)]
    pub health: HealthSettings,
    /// The host's /dev (for tests: a fake tree).
    #[serde(default = "default_dev_root")]
    pub dev_root: PathBuf,
    /// The host's /sys (for tests: a fake tree).
    #[serde(default = "default_sys_root")]
    pub sys_root: PathBuf,
    /// Longest wait between attempts to load the driver (ms, default 30000; the first retry
    /// comes after 500 ms, then doubling).
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
    /// Share each whole GPU by capacity between DRA claims, through MPS (DRA only; replicas
    /// and MIG devices are not shared this way).
    #[serde(default)]
    pub share: Option<MpsShare>,
}

/// GPUs shared by capacity through NVIDIA MPS: each GPU is published with `cores` (100, a
/// percentage of its SMs) and `memory` (its bytes, in steps of `memory_step`); a claim's share
/// reaches its container as MPS limits, with devplug running one MPS control daemon per shared
/// GPU while it has shares.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsShare {
    /// The unit memory is shared in, a quantity (`1Gi`; default `1Gi`).
    #[serde(default = "default_memory_step")]
    pub memory_step: String,
    /// Where devplug keeps each GPU's MPS pipe and log folders (`<dir>/<uuid>/pipe`, `/log`),
    /// as devplug sees it (default `/run/devplug/mps`; mount the host's folder there).
    #[serde(default = "default_mps_dir")]
    pub dir: PathBuf,
    /// The same folder as the host names it, for the containers' mounts (default: `dir`).
    #[serde(default)]
    pub host_dir: Option<PathBuf>,
}

fn default_memory_step() -> String {
    "1Gi".to_owned()
}

fn default_mps_dir() -> PathBuf {
    PathBuf::from("/run/devplug/mps")
}

impl MpsShare {
    /// The memory step in bytes, or what is wrong with it.
    pub fn memory_step_bytes(&self) -> Result<u64, SettingsError> {
        devplug::dra::parse_quantity(&self.memory_step)
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                SettingsError::new(
                    "share.memory_step",
                    format!(
                        "{:?} is not a whole quantity above 0, such as 1Gi or 512Mi",
                        self.memory_step
                    ),
                )
            })
    }
}

/// How GPUs in MIG mode are served (NVIDIA's `--mig-strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// MIG is ignored: a GPU in MIG mode is served whole, by its UUID.
    #[default]
    None,
    /// Every served GPU is in MIG mode with MIG devices of one profile, and those are the
    /// devices (if no served GPU is in MIG mode, the GPUs are served whole, as NVIDIA does).
    Single,
    /// One resource per MIG profile (`mig_profile`); an entry without `mig_profile` serves
    /// the GPUs that are not in MIG mode.
    Mixed,
    /// DRA only: a GPU in MIG mode is published as its MIG partitions (one device per profile
    /// and placement, consuming the GPU's memory and compute slices as shared counters, so the
    /// scheduler picks partitions that fit together); devplug creates the partition's GPU and
    /// compute instance when a claim is prepared and destroys them when it is unprepared. GPUs
    /// not in MIG mode are served whole. The MIG mode itself is the operator's to set.
    Dynamic,
}

/// One per-GPU replica count.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaOverride {
    /// GPUs by UUID, by index (`"3"`) or by product-name glob (`"*A100*"`).
    pub gpus: Vec<String>,
    /// Replicas for these GPUs.
    pub replicas: u32,
}

/// One thing `Allocate` can send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES` with the UUIDs (for NVIDIA's container runtime or hook).
    Envvar,
    /// CDI device names in the response, and the CDI spec file.
    CdiCri,
    /// The device nodes as device specs.
    DeviceSpecs,
}

/// Health checking.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthSettings {
    /// Watch NVML events (default true). Off: every GPU NVML lists is Healthy.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// XIDs that leave the GPU healthy (default: 13, 31, 43, 45, 68, 94). A recovery action
    /// other than NONE still makes any XID count.
    #[serde(default = "default_ignored")]
    pub ignored_xids: Vec<u64>,
    /// How often faulted GPUs are checked for recovery, and the longest single event wait (ms,
    /// default 1000).
    #[serde(default = "default_check_ms")]
    pub check_interval_ms: u64,
}

impl Default for HealthSettings {
    fn default() -> Self {
        HealthSettings {
            enabled: true,
            ignored_xids: default_ignored(),
            check_interval_ms: default_check_ms(),
        }
    }
}

impl Default for NvidiaSettings {
    /// Every GPU, NVML from the driver roots, envvar + CDI, no replicas, health on.
    fn default() -> Self {
        NvidiaSettings {
            library: None,
            driver_roots: default_driver_roots(),
            host_driver_root: None,
            driver_files: true,
            models: Vec::new(),
            exclude_models: Vec::new(),
            mig_strategy: MigStrategy::None,
            mig_profile: None,
            proc_root: default_proc_root(),
            device_list_strategy: default_strategies(),
            cdi_dir: default_cdi_dir(),
            replicas: 1,
            replica_overrides: Vec::new(),
            replica_policy: ReplicaPolicy::Spread,
            fail_requests_greater_than_one: false,
            health: HealthSettings::default(),
            dev_root: default_dev_root(),
            sys_root: default_sys_root(),
            retry_max_ms: default_retry_max_ms(),
            share: None,
        }
    }
}

fn default_driver_roots() -> Vec<PathBuf> {
    DEFAULT_DRIVER_ROOTS.iter().map(PathBuf::from).collect()
}

fn default_proc_root() -> PathBuf {
    PathBuf::from("/proc")
}

fn default_strategies() -> Vec<ListStrategy> {
    vec![ListStrategy::Envvar, ListStrategy::CdiCri]
}

fn default_ignored() -> Vec<u64> {
    DEFAULT_IGNORED_XIDS.to_vec()
}

fn default_check_ms() -> u64 {
    1000
}

fn default_retry_max_ms() -> u64 {
    30_000
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn check_replicas(field: &str, n: u32) -> Result<(), SettingsError> {
    if (1..=MAX_REPLICAS).contains(&n) {
        Ok(())
    } else {
        Err(SettingsError::new(
            field,
            format!("{n} must be between 1 and {MAX_REPLICAS}"),
        ))
    }
}

fn check_globs(field: &str, globs: &[String]) -> Result<(), SettingsError> {
    for (i, g) in globs.iter().enumerate() {
        glob::Pattern::new(g).map_err(|e| {
            SettingsError::new(format!("{field}[{i}]"), format!("{g:?} is not a glob: {e}"))
        })?;
    }
    Ok(())
}

/// `[<c>c.]<g>g.<m>gb` with an optional `+<suffix>` (e.g. `1g.10gb+me`), as NVIDIA prints
/// profiles.
fn valid_profile(p: &str) -> bool {
    let base = p.split_once('+').map_or(p, |(b, ext)| {
        if ext.is_empty() || !ext.chars().all(|c| c.is_ascii_alphanumeric()) {
            ""
        } else {
            b
        }
    });
    let parts: Vec<&str> = base.split('.').collect();
    let num = |s: &str, unit: &str| {
        s.strip_suffix(unit)
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
    };
    match parts.as_slice() {
        [g, m] => num(g, "g") && num(m, "gb"),
        [c, g, m] => num(c, "c") && num(g, "g") && num(m, "gb"),
        _ => false,
    }
}

impl NvidiaSettings {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if let Some(lib) = &self.library {
            check_absolute("library", lib)?;
        }
        for (i, root) in self.driver_roots.iter().enumerate() {
            check_absolute(&format!("driver_roots[{i}]"), root)?;
        }
        if let Some(root) = &self.host_driver_root {
            check_absolute("host_driver_root", root)?;
        }
        check_globs("models", &self.models)?;
        check_globs("exclude_models", &self.exclude_models)?;
        if let Some(profile) = &self.mig_profile {
            if self.mig_strategy != MigStrategy::Mixed {
                return Err(SettingsError::new(
                    "mig_profile",
                    "is only for mig_strategy: mixed (one resource entry per profile)",
                ));
            }
            if !valid_profile(profile) {
                return Err(SettingsError::new(
                    "mig_profile",
                    format!(
                        "{profile:?} is not a MIG profile name such as 1g.10gb, 3g.40gb or \
                         1c.3g.40gb"
                    ),
                ));
            }
        }
        if self.device_list_strategy.is_empty() {
            return Err(SettingsError::new(
                "device_list_strategy",
                "is empty: name at least one of envvar, cdi-cri, device-specs",
            ));
        }
        check_absolute("cdi_dir", &self.cdi_dir)?;
        check_replicas("replicas", self.replicas)?;
        for (i, o) in self.replica_overrides.iter().enumerate() {
            check_replicas(&format!("replica_overrides[{i}].replicas"), o.replicas)?;
            if o.gpus.is_empty() {
                return Err(SettingsError::new(
                    format!("replica_overrides[{i}].gpus"),
                    "is empty: name GPUs by UUID, index or model glob",
                ));
            }
            check_globs(&format!("replica_overrides[{i}].gpus"), &o.gpus)?;
        }
        if self.health.check_interval_ms == 0 || self.health.check_interval_ms > 60_000 {
            return Err(SettingsError::new(
                "health.check_interval_ms",
                "must be between 1 and 60000",
            ));
        }
        if self.retry_max_ms < 100 {
            return Err(SettingsError::new("retry_max_ms", "must be at least 100"));
        }
        check_absolute("dev_root", &self.dev_root)?;
        check_absolute("proc_root", &self.proc_root)?;
        if self.mig_strategy == MigStrategy::Dynamic
            && (self.replicas > 1 || !self.replica_overrides.is_empty())
        {
            return Err(SettingsError::new(
                "mig_strategy",
                "dynamic MIG partitions are given whole, not as time-slicing replicas: remove \
                 replicas (or use mig_strategy: mixed with replicas)",
            ));
        }
        if let Some(share) = &self.share {
            share.memory_step_bytes()?;
            check_absolute("share.dir", &share.dir)?;
            if let Some(host) = &share.host_dir {
                check_absolute("share.host_dir", host)?;
            }
            if self.replicas > 1 || !self.replica_overrides.is_empty() {
                return Err(SettingsError::new(
                    "share",
                    "GPUs are shared either by time-slicing replicas or by capacity through \
                     MPS, not both: remove replicas or share",
                ));
            }
        }
        check_absolute("sys_root", &self.sys_root)
    }

    /// True if `strategy` is among those configured.
    pub fn sends(&self, strategy: ListStrategy) -> bool {
        self.device_list_strategy.contains(&strategy)
    }

    /// The library paths to try, in order.
    pub fn library_candidates(&self) -> Vec<PathBuf> {
        if let Some(lib) = &self.library {
            return vec![lib.clone()];
        }
        let mut out = Vec::new();
        for root in &self.driver_roots {
            for dir in super::driver_files::NVML_DIRS {
                let path = root.join(dir).join("libnvidia-ml.so.1");
                if path.exists() {
                    out.push(path);
                }
            }
        }
        // The dynamic loader's own search (ldconfig cache, LD_LIBRARY_PATH).
        out.push(PathBuf::from("libnvidia-ml.so.1"));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_profile_only_with_mixed_and_well_formed() {
        let with = |strategy, profile: Option<&str>| NvidiaSettings {
            mig_strategy: strategy,
            mig_profile: profile.map(str::to_owned),
            ..Default::default()
        };
        assert!(NvidiaSettings::default().validate().is_ok());
        for ok in ["1g.10gb", "1c.3g.40gb", "1g.10gb+me", "7g.80gb"] {
            assert!(
                with(MigStrategy::Mixed, Some(ok)).validate().is_ok(),
                "{ok}"
            );
        }
        assert!(with(MigStrategy::Mixed, None).validate().is_ok());
        assert!(with(MigStrategy::Single, None).validate().is_ok());
        for bad in [
            "mig-1g.10gb",
            "1g",
            "1g.10",
            "g.10gb",
            "1g.10gb+",
            "x.1g.10gb",
        ] {
            let err = with(MigStrategy::Mixed, Some(bad)).validate().unwrap_err();
            assert_eq!(err.field, "mig_profile", "{bad}");
        }
        let err = with(MigStrategy::Single, Some("1g.10gb"))
            .validate()
            .unwrap_err();
        assert!(
            err.problem.contains("only for mig_strategy: mixed"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_the_field() {
        let cases = [
            NvidiaSettings {
                replicas: 0,
                ..Default::default()
            },
            NvidiaSettings {
                models: vec!["[".into()],
                ..Default::default()
            },
            NvidiaSettings {
                device_list_strategy: vec![],
                ..Default::default()
            },
            NvidiaSettings {
                replica_overrides: vec![ReplicaOverride {
                    gpus: vec!["0".into()],
                    replicas: 999,
                }],
                ..Default::default()
            },
        ];
        let fields: Vec<String> = cases
            .iter()
            .map(|s| s.validate().unwrap_err().field)
            .collect();
        assert_eq!(
            fields,
            [
                "replicas",
                "models[0]",
                "device_list_strategy",
                "replica_overrides[0].replicas"
            ]
        );
    }
}
