//! The config file's shape as serde reads it: every backend key an optional field, as the YAML
//! has them. [`RawResource::resolve`] turns the keys into the one [`BackendConfig`] of a
//! [`ResourceConfig`]; nothing after it sees this shape.

use super::{
    AdvertiseSettings, BackendConfig, DraSettings, NodeLabelsSettings, RefusedPodsPolicy,
    RegistrationRoute, ResourceConfig, ResourceKind,
};
use devplug_backends::{
    AmdgpuSettings, AscendSettings, FilesSettings, FpgaSettings, HostdevSettings, IntelGpuSettings,
    NvidiaSettings, QatSettings, VfioSettings, VirtualSettings,
};
use serde::Deserialize;

/// The whole config file, as written. Named `Config` for serde: its messages name the type
/// they expected (`expected struct Config`).
#[derive(Debug, Deserialize)]
#[serde(rename = "Config", deny_unknown_fields)]
pub(super) struct RawConfig {
    /// How resources register with the kubelet unless they say otherwise (default `socket`).
    #[serde(default)]
    pub(super) registration: Option<RegistrationRoute>,
    /// What `run` does with pods the kubelet refused at admission for these resources.
    #[serde(default)]
    pub(super) refused_pods: RefusedPodsPolicy,
    /// Whether and how node labels are written.
    #[serde(default)]
    pub(super) node_labels: NodeLabelsSettings,
    /// The resources to serve, each on its own socket.
    pub(super) resources: Vec<RawResource>,
}

/// One resource, as written: any number of backend keys (exactly one is valid). Named
/// `ResourceConfig` for serde's messages; the fields are in the order serde lists them when it
/// names the expected fields of an unknown one.
#[derive(Debug, Deserialize)]
#[serde(rename = "ResourceConfig", deny_unknown_fields)]
pub(super) struct RawResource {
    /// Extended resource name, e.g. `example.com/npu`.
    pub(super) name: String,
    /// Software-only devices.
    #[serde(rename = "virtual")]
    virtual_devices: Option<VirtualSettings>,
    /// Each file in a watched folder is a device.
    files: Option<FilesSettings>,
    /// Host device nodes by glob, USB id or PCI id.
    hostdev: Option<HostdevSettings>,
    /// AMD GPUs and compute partitions from sysfs.
    amdgpu: Option<AmdgpuSettings>,
    /// Intel GPUs from sysfs.
    intel_gpu: Option<IntelGpuSettings>,
    /// NVIDIA GPUs through NVML.
    nvidia: Option<NvidiaSettings>,
    /// PCI devices bound to `vfio-pci`.
    vfio: Option<VfioSettings>,
    /// Intel QAT virtual functions by service.
    qat: Option<QatSettings>,
    /// Huawei Ascend NPUs.
    ascend: Option<AscendSettings>,
    /// Intel FPGA ports by AFU.
    fpga: Option<FpgaSettings>,
    /// See [`ResourceConfig::health_hold_down`].
    #[serde(default, deserialize_with = "crate::duration::deserialize_opt")]
    pub(super) health_hold_down: Option<std::time::Duration>,
    /// See [`ResourceConfig::registration`].
    #[serde(default)]
    registration: Option<RegistrationRoute>,
    /// A count on the Node's status, no device.
    advertise: Option<AdvertiseSettings>,
    /// See [`ResourceConfig::dra`].
    dra: Option<DraSettings>,
}

impl RawResource {
    /// The resource with its one backend, or why it has none or several (`no backend: …`,
    /// `2 backends (virtual, files): …`). The one place where the keys meet their variants.
    pub(super) fn resolve(self) -> Result<ResourceConfig, String> {
        let RawResource {
            name,
            virtual_devices,
            files,
            hostdev,
            amdgpu,
            intel_gpu,
            nvidia,
            vfio,
            qat,
            ascend,
            fpga,
            health_hold_down,
            registration,
            advertise,
            dra,
        } = self;
        // In the order of ResourceKind::KEYS, which the messages list them in.
        let mut kinds: Vec<ResourceKind> = [
            virtual_devices.map(BackendConfig::Virtual),
            files.map(BackendConfig::Files),
            hostdev.map(BackendConfig::Hostdev),
            amdgpu.map(BackendConfig::Amdgpu),
            intel_gpu.map(BackendConfig::IntelGpu),
            nvidia.map(BackendConfig::Nvidia),
            vfio.map(BackendConfig::Vfio),
            qat.map(BackendConfig::Qat),
            ascend.map(BackendConfig::Ascend),
            fpga.map(BackendConfig::Fpga),
        ]
        .into_iter()
        .flatten()
        .map(ResourceKind::Devices)
        .chain(advertise.map(ResourceKind::Advertise))
        .collect();
        if kinds.len() > 1 {
            let keys: Vec<&str> = kinds.iter().map(ResourceKind::key).collect();
            return Err(format!(
                "{} backends ({}): a resource has exactly one",
                keys.len(),
                keys.join(", ")
            ));
        }
        let kind = kinds.pop().ok_or_else(|| {
            format!(
                "no backend: add exactly one of {}",
                ResourceKind::KEYS.join(", ")
            )
        })?;
        Ok(ResourceConfig {
            name,
            kind,
            health_hold_down,
            registration,
            dra,
        })
    }
}
