//! Ready device backends for devplug, each chosen by a key in the config file.
//!
//! - [`virtual_devices`] (`virtual:`): devices that exist only in software, like the dummy NPU of
//!   the classic tutorial, for demos, tests and scheduling experiments.
//! - [`files`] (`files:`): each regular file in a watched folder is a device; its first line is
//!   its health.
//! - [`hostdev`] (`hostdev:`): host device nodes by glob, USB id or PCI id, with sharing counts,
//!   NUMA-aware preferred allocation and event-driven hotplug.
//! - [`amdgpu`] (`amdgpu:`): AMD GPUs and compute partitions from sysfs and KFD's topology,
//!   with exact link-aware preferred allocation and CDI specs.
//! - [`intel_gpu`] (`intel_gpu:`): Intel GPUs (`i915` or `xe`) from sysfs, with sharing counts,
//!   SR-IOV virtual functions, `/dev/dri/by-path` mounts and CDI specs.
//! - [`vfio`] (`vfio:`, `qat:`): PCI devices bound to `vfio-pci`, one per IOMMU group, for
//!   VMs (KubeVirt's `PCI_RESOURCE_…`) and DPDK; Intel QAT virtual functions by service.
//! - [`ascend`] (`ascend:`): Huawei Ascend NPUs (`/dev/davinci<N>`, `ASCEND_VISIBLE_DEVICES`).
//! - [`fpga`] (`fpga:`): Intel FPGA ports under the DFL driver, by the AFU they carry.
//! - [`nvidia`] (`nvidia:`): NVIDIA GPUs through NVML (loaded at run time), with time-slicing
//!   replicas, NVLink-aware exact preferred allocation, CDI specs and health that recovers.
//!
//! Shared pieces: [`dra_attributes`] (what each backend's devices say about themselves for
//! DRA selectors), [`placement`] (exact preferred allocation over a pair-weight matrix),
//! [`replicas`] (spread or pack preferred allocation over shares of physical devices),
//! `sysfs` (PCI and DRM reading), `sysfs_watch`
//! (discover, follow with inotify, keep vanished GPUs Unhealthy), [`node_backend`] (the
//! allocation, CDI and events shared by `vfio`, `qat`, `ascend` and `fpga`). The fake sysfs and
//! /dev trees their tests run on are in the test kit (`devplug-testkit`), not here.
//!
//! Every backend is also a [`devplug::dra::ClaimBackend`] (a core trait: no Kubernetes API
//! client here), so any of them can be served as a DRA driver by `devplug-dra`: `virtual` and
//! `nvidia` with shares and partitions, the others handing devices to claims whole
//! (`claims.rs`).
//!
//! Each backend has a settings struct that deserializes from the config file (unknown fields are
//! errors) and a `validate` that names the field and the fix.

pub mod amdgpu;
pub mod ascend;
mod claims;
pub mod dra_attributes;
pub mod files;
pub mod fpga;
pub mod hostdev;
mod inotify_batch;
pub mod intel_gpu;
pub mod node_backend;
pub mod node_labels;
pub mod nvidia;
pub mod placement;
pub mod replicas;
pub mod settings;
mod sysfs;
mod sysfs_watch;
pub mod vfio;
pub mod virtual_devices;

pub use amdgpu::{AmdgpuBackend, AmdgpuSettings};
pub use ascend::AscendSettings;
pub use files::{FilesBackend, FilesSettings};
pub use fpga::FpgaSettings;
pub use hostdev::{HostdevBackend, HostdevSettings};
pub use intel_gpu::{IntelGpuBackend, IntelGpuSettings};
pub use node_backend::NodeBackend;
pub use node_labels::{NodeLabelSource, NodeLabels};
pub use nvidia::{NvidiaBackend, NvidiaSettings};
pub use settings::SettingsError;
pub use vfio::{QatSettings, VfioSettings};
pub use virtual_devices::{VirtualBackend, VirtualSettings};
