//! A resource's one backend: [`BackendConfig`], with its YAML key, its settings check, the
//! settings only a DRA driver can serve, its dry run for `check-config --discover`, and how it
//! starts ([`BackendConfig::build`]; [`ResourceConfig::build`] for a resource). Each of these is one exhaustive `match`: a new backend is a
//! variant here and a field in [`super::raw::RawResource`], and the compiler finds the rest.

use super::{ResourceConfig, ResourceKind};
use devplug::dra::ClaimBackend;
use devplug_backends::files::MissingFolder;
use devplug_backends::{
    ascend, fpga, nvidia::MigStrategy, vfio, AmdgpuBackend, AmdgpuSettings, AscendSettings,
    FilesBackend, FilesSettings, FpgaSettings, HostdevBackend, HostdevSettings, IntelGpuBackend,
    IntelGpuSettings, NodeLabelSource, NodeLabels, NvidiaBackend, NvidiaSettings, QatSettings,
    SettingsError, VfioSettings, VirtualBackend, VirtualSettings,
};
use std::path::PathBuf;
use std::sync::Arc;

/// The backend of a resource: which kind of devices it serves, with that kind's settings.
/// Each variant is one key of the config file ([`BackendConfig::key`]).
// A config holds a handful of these, made once per load: boxing the larger settings would save
// nothing worth an indirection in every match.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// `virtual`: software-only devices.
    Virtual(VirtualSettings),
    /// `files`: each file in a watched folder is a device.
    Files(FilesSettings),
    /// `hostdev`: host device nodes by glob, USB id or PCI id.
    Hostdev(HostdevSettings),
    /// `amdgpu`: AMD GPUs and compute partitions from sysfs (e.g. `amd.com/gpu`).
    Amdgpu(AmdgpuSettings),
    /// `intel_gpu`: Intel GPUs from sysfs (`gpu.intel.com/i915` or `gpu.intel.com/xe`).
    IntelGpu(IntelGpuSettings),
    /// `nvidia`: NVIDIA GPUs through NVML, loaded at run time (e.g. `nvidia.com/gpu`).
    Nvidia(NvidiaSettings),
    /// `vfio`: PCI devices bound to `vfio-pci`, one per IOMMU group (VMs, DPDK).
    Vfio(VfioSettings),
    /// `qat`: Intel QAT virtual functions bound to `vfio-pci`, by service (`qat.intel.com/cy`).
    Qat(QatSettings),
    /// `ascend`: Huawei Ascend NPUs (`huawei.com/Ascend910`).
    Ascend(AscendSettings),
    /// `fpga`: Intel FPGA ports under the DFL driver, by the AFU they carry.
    Fpga(FpgaSettings),
}

impl BackendConfig {
    /// The key this backend has in the config file; messages name its fields under it
    /// (`virtual.count`).
    pub fn key(&self) -> &'static str {
        match self {
            BackendConfig::Virtual(_) => "virtual",
            BackendConfig::Files(_) => "files",
            BackendConfig::Hostdev(_) => "hostdev",
            BackendConfig::Amdgpu(_) => "amdgpu",
            BackendConfig::IntelGpu(_) => "intel_gpu",
            BackendConfig::Nvidia(_) => "nvidia",
            BackendConfig::Vfio(_) => "vfio",
            BackendConfig::Qat(_) => "qat",
            BackendConfig::Ascend(_) => "ascend",
            BackendConfig::Fpga(_) => "fpga",
        }
    }

    /// Checks the settings without starting anything; the error's field is relative to
    /// [`BackendConfig::key`].
    pub fn validate(&self) -> Result<(), SettingsError> {
        match self {
            BackendConfig::Virtual(settings) => settings.validate(),
            BackendConfig::Files(settings) => settings.validate(),
            BackendConfig::Hostdev(settings) => settings.validate(),
            BackendConfig::Amdgpu(settings) => settings.validate(),
            BackendConfig::IntelGpu(settings) => settings.validate(),
            BackendConfig::Nvidia(settings) => settings.validate(),
            BackendConfig::Vfio(settings) => settings.validate(),
            BackendConfig::Qat(settings) => settings.validate(),
            BackendConfig::Ascend(settings) => settings.validate(),
            BackendConfig::Fpga(settings) => settings.validate(),
        }
    }

    /// The first setting that only a DRA driver can serve (devices shared by capacity or split
    /// into partitions: the device plugin API counts whole devices), as the field the message
    /// names, or `None`.
    pub fn dra_only_setting(&self) -> Option<&'static str> {
        match self {
            BackendConfig::Virtual(settings) => {
                if settings.share.is_some() {
                    Some("virtual.share")
                } else if settings.partitions.is_some() {
                    Some("virtual.partitions")
                } else {
                    None
                }
            }
            BackendConfig::Nvidia(settings) => {
                if settings.share.is_some() {
                    Some("nvidia.share")
                } else if settings.mig_strategy == MigStrategy::Dynamic {
                    Some("nvidia.mig_strategy: dynamic")
                } else {
                    None
                }
            }
            BackendConfig::Files(_)
            | BackendConfig::Hostdev(_)
            | BackendConfig::Amdgpu(_)
            | BackendConfig::IntelGpu(_)
            | BackendConfig::Vfio(_)
            | BackendConfig::Qat(_)
            | BackendConfig::Ascend(_)
            | BackendConfig::Fpga(_) => None,
        }
    }

    /// These settings as `check-config --discover` starts them: the same discovery, with
    /// nothing written on the node. A `files:` folder that is missing is waited for, not
    /// created; CDI specs go to `cdi_dir` (a scratch folder) rather than the CDI folder, where a
    /// running devplug's own spec of the same name would otherwise be overwritten, then removed
    /// when the backend stops. The spec's file name and the CDI device names a container gets
    /// do not depend on the folder.
    pub fn dry_run(&mut self, cdi_dir: PathBuf) {
        match self {
            BackendConfig::Files(s) => s.missing = MissingFolder::Wait,
            BackendConfig::Amdgpu(s) => s.cdi_dir = cdi_dir,
            BackendConfig::IntelGpu(s) => s.cdi_dir = cdi_dir,
            BackendConfig::Nvidia(s) => s.cdi_dir = cdi_dir,
            BackendConfig::Vfio(s) => s.cdi_dir = cdi_dir,
            BackendConfig::Qat(s) => s.cdi_dir = cdi_dir,
            BackendConfig::Ascend(s) => s.cdi_dir = cdi_dir,
            BackendConfig::Fpga(s) => s.cdi_dir = cdi_dir,
            BackendConfig::Virtual(_) | BackendConfig::Hostdev(_) => {}
        }
    }

    /// Starts the backend (watchers included; needs a tokio runtime) for resource `name`, with
    /// its node labels where it has them. Errors name the field, relative to
    /// [`BackendConfig::key`].
    pub fn build(&self, name: &str) -> Result<Built, SettingsError> {
        match self {
            BackendConfig::Virtual(settings) => VirtualBackend::new(settings).map(shared),
            BackendConfig::Files(settings) => FilesBackend::start(settings).map(shared),
            BackendConfig::Hostdev(settings) => HostdevBackend::start(settings).map(shared),
            BackendConfig::Amdgpu(settings) => AmdgpuBackend::start(settings).map(labelled),
            BackendConfig::IntelGpu(settings) => IntelGpuBackend::start(settings).map(labelled),
            BackendConfig::Nvidia(settings) => NvidiaBackend::start(name, settings).map(labelled),
            BackendConfig::Vfio(settings) => vfio::start(name, settings).map(shared),
            BackendConfig::Qat(settings) => vfio::start_qat(name, settings).map(shared),
            BackendConfig::Ascend(settings) => ascend::start(name, settings).map(shared),
            BackendConfig::Fpga(settings) => fpga::start(name, settings).map(shared),
        }
    }
}

impl ResourceConfig {
    /// Starts the resource's backend (see [`BackendConfig::build`]). Errors name the backend
    /// key and the field. Only a resource of devices has one: the callers build only those
    /// (`serves_device_plugin`, and validation refuses `dra:` on an `advertise:` resource).
    pub fn build(&self) -> Result<Built, (&'static str, SettingsError)> {
        // What the backends log while starting (and, where they spawn in this span, after)
        // names the resource. At ERROR level so that no log filter disables the span itself.
        let _span = tracing::error_span!("resource", resource = %self.name).entered();
        match &self.kind {
            ResourceKind::Devices(backend) => {
                backend.build(&self.name).map_err(|e| (backend.key(), e))
            }
            ResourceKind::Advertise(_) => Err((
                "advertise",
                SettingsError::new("", "an advertise: resource has no backend to start"),
            )),
        }
    }
}

/// A started backend: a [`ClaimBackend`], which serves a resource's device plugin (as a
/// [`devplug::Backend`]) and, in the full build, its DRA driver, from one instance.
pub type BuiltBackend = Arc<dyn ClaimBackend>;

/// A resource's started backend, and its node labels where it describes its hardware with
/// them ([`NodeLabelSource`]): the two are composed here, where the config builds a resource.
pub struct Built {
    /// The backend.
    pub backend: BuiltBackend,
    /// Its node labels, for `node_labels:`.
    pub labels: Option<tokio::sync::watch::Receiver<NodeLabels>>,
}

/// A started backend with no node labels.
fn shared(backend: impl ClaimBackend) -> Built {
    Built {
        backend: Arc::new(backend),
        labels: None,
    }
}

/// A started backend that describes its hardware with node labels.
fn labelled(backend: impl ClaimBackend + NodeLabelSource) -> Built {
    Built {
        labels: Some(backend.node_labels()),
        backend: Arc::new(backend),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{test_parse as parse, HAS_CLUSTER};
    use std::path::Path;

    /// The resource's backend settings of one kind, or a panic naming the backend it has.
    macro_rules! settings {
        ($resource:expr, $variant:ident) => {
            match &$resource.kind {
                ResourceKind::Devices(BackendConfig::$variant(settings)) => settings,
                other => panic!("expected {}, got {other:?}", stringify!($variant)),
            }
        };
    }

    #[test]
    fn every_key_is_listed_once_in_keys_in_the_order_the_file_is_read() {
        // Every backend key at once: the message lists each backend the file has, by key(),
        // in the order they are resolved, which is the order of KEYS.
        let every = "resources:
  - name: a.com/x
    virtual: { count: 1 }
    files: { dir: /x }
    hostdev: { groups: [ { paths: [/dev/null] } ] }
    amdgpu: {}
    intel_gpu: {}
    nvidia: {}
    vfio: { pci: [ { vendor: 10de } ] }
    qat: { service: cy }
    ascend: {}
    fpga: {}
    advertise: { count: 1 }
";
        let err = parse(every).unwrap_err();
        assert!(
            err.ends_with(&format!(
                "resources[0] (a.com/x): 11 backends ({}): a resource has exactly one",
                ResourceKind::KEYS.join(", ")
            )),
            "{err}"
        );
        let mut keys = ResourceKind::KEYS.to_vec();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(
            keys.len(),
            ResourceKind::KEYS.len(),
            "a key is listed twice"
        );
        // Each key alone resolves to a kind whose key() is that key.
        for key in ResourceKind::KEYS {
            let line = every
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{key}:")))
                .unwrap();
            let text = format!("resources:\n  - name: a.com/x\n{line}\n");
            let raw: crate::config::raw::RawConfig = serde_saphyr::from_str(&text).unwrap();
            let resolved = raw.resources.into_iter().next().unwrap().resolve().unwrap();
            assert_eq!(resolved.kind.key(), key);
        }
    }

    #[test]
    fn the_documented_shape_parses() {
        let config = parse(
            "resources:\n  - name: example.com/npu\n    virtual:\n      count: 64\n      env: DUMMY_VISIBLE_DEVICES\n",
        )
        .unwrap();
        let settings = settings!(config.resources[0], Virtual);
        assert_eq!(settings.count, 64);
        assert_eq!(settings.env, "DUMMY_VISIBLE_DEVICES");
    }

    #[test]
    fn the_issue_config_shapes_parse() {
        let config = parse(
            "resources:
  - name: example.com/cola
    files: { dir: /etc/colas, env: COLA_DEVICES }
  - name: example.com/serial
    hostdev:
      groups:
        - paths: [\"/dev/ttyUSB*\"]
      count: 1
  - name: example.com/fuse
    hostdev: { groups: [ { paths: [\"/dev/fuse\"] } ], count: 100 }
",
        )
        .unwrap();
        assert_eq!(config.resources.len(), 3);
        assert_eq!(settings!(config.resources[2], Hostdev).count, 100);
    }

    #[test]
    fn accelerator_backends_parse() {
        let config = parse(
            "resources:
  - name: nvidia.com/GA102GL_A10
    vfio: { pci: [ { vendor: 10de, device: \"2236\" } ] }
  - name: qat.intel.com/cy
    qat: { service: cy }
  - name: huawei.com/Ascend910
    ascend: {}
  - name: fpga.example.com/nlb0
    fpga: { afu_id: d8424dc4a4a3c413f89e433683f9040b, env: FPGA_PORTS }
",
        )
        .unwrap();
        let keys: Vec<&str> = config.resources.iter().map(|r| r.kind.key()).collect();
        assert_eq!(keys, ["vfio", "qat", "ascend", "fpga"]);
        let vfio = settings!(config.resources[0], Vfio);
        assert_eq!(vfio.env, devplug_backends::vfio::VfioEnv::PciResource);
        let qat = settings!(config.resources[1], Qat);
        assert_eq!(qat.service, devplug_backends::vfio::QatService::Cy);
        assert_eq!(qat.env_prefix, "QAT");
        let ascend = settings!(config.resources[2], Ascend);
        assert_eq!(ascend.env, "ASCEND_VISIBLE_DEVICES");
    }

    #[test]
    fn gpu_backends_parse() {
        let config = parse(
            "resources:
  - name: amd.com/gpu
    amdgpu: {}
  - name: amd.com/cpx_nps4
    amdgpu: { partition_type: cpx_nps4, cdi_dir: /run/cdi }
  - name: gpu.intel.com/xe
    intel_gpu: { driver: xe, count: 4, policy: pack, by_path: false }
",
        )
        .unwrap();
        let amd = settings!(config.resources[1], Amdgpu);
        assert_eq!(amd.partition_type.as_deref(), Some("cpx_nps4"));
        assert_eq!(amd.cdi_dir, Path::new("/run/cdi"));
        assert!(settings!(config.resources[0], Amdgpu).cdi);
        let intel = settings!(config.resources[2], IntelGpu);
        assert_eq!(intel.driver, devplug_backends::intel_gpu::IntelDriver::Xe);
        assert_eq!(intel.count, 4);
        assert_eq!(intel.policy, devplug_backends::hostdev::ReplicaPolicy::Pack);
        assert!(!intel.by_path);
        assert_eq!(
            config.resources[2].kind.key(),
            "intel_gpu",
            "the YAML key is intel_gpu"
        );
    }

    #[test]
    fn the_nvidia_shapes_parse() {
        let config = parse(
            "resources:
  - name: nvidia.com/gpu
    nvidia:
      exclude_models: [\"*H100*\"]
      replicas: 4
      replica_overrides: [ { gpus: [\"GPU-8a6e\", \"3\", \"*A10*\"], replicas: 2 } ]
      replica_policy: pack
      device_list_strategy: [cdi-cri, device-specs]
      health: { ignored_xids: [13, 43], check_interval_ms: 500 }
  - name: nvidia.com/h100
    nvidia: { models: [\"*H100*\"], library: /run/nvidia/driver/usr/lib64/libnvidia-ml.so.1 }
  - name: nvidia.com/mig-1g.10gb
    nvidia: { mig_strategy: mixed, mig_profile: 1g.10gb, proc_root: /host/proc }
  - name: nvidia.com/mig-gpu
    nvidia: { mig_strategy: single }
",
        )
        .unwrap();
        let gpu = settings!(config.resources[0], Nvidia);
        assert_eq!(gpu.replicas, 4);
        assert_eq!(gpu.replica_overrides[0].gpus.len(), 3);
        assert_eq!(
            gpu.replica_policy,
            devplug_backends::hostdev::ReplicaPolicy::Pack
        );
        assert_eq!(gpu.health.ignored_xids, [13, 43]);
        assert!(gpu.health.enabled);
        assert!(!gpu.sends(devplug_backends::nvidia::ListStrategy::Envvar));
        let h100 = settings!(config.resources[1], Nvidia);
        assert_eq!(h100.models, ["*H100*"]);
        assert_eq!(h100.mig_strategy, MigStrategy::None);
        assert_eq!(h100.mig_profile, None);
        assert_eq!(h100.proc_root, std::path::Path::new("/proc"));
        let mig = settings!(config.resources[2], Nvidia);
        assert_eq!(mig.mig_strategy, MigStrategy::Mixed);
        assert_eq!(mig.mig_profile.as_deref(), Some("1g.10gb"));
        assert_eq!(mig.proc_root, std::path::Path::new("/host/proc"));
        let single = settings!(config.resources[3], Nvidia);
        assert_eq!(single.mig_strategy, MigStrategy::Single);
        assert_eq!(
            h100.health.ignored_xids,
            devplug_backends::nvidia::DEFAULT_IGNORED_XIDS
        );
    }

    #[test]
    fn advertise_parses() {
        let text = "resources:\n  - name: example.com/dongle\n    advertise: { count: 4 }\n";
        if !HAS_CLUSTER {
            // devplug-lite: refused, naming the field (see the tests in validate.rs).
            assert!(parse(text)
                .unwrap_err()
                .contains("resources[0].advertise: needs"));
            return;
        }
        let config = parse(text).unwrap();
        assert_eq!(
            config.resources[0].kind,
            ResourceKind::Advertise(crate::config::AdvertiseSettings { count: 4 })
        );
    }
}
