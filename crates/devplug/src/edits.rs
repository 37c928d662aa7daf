//! What an allocation does to a container: env vars, device nodes, mounts, annotations and CDI
//! devices. Backends return [`ContainerEdits`]; the host turns them into the wire form.

use devplug_proto::v1beta1 as pb;
use std::collections::BTreeMap;

/// The edits the kubelet applies to one container for one resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Host device nodes to expose.
    pub devices: Vec<DeviceNode>,
    /// Bind mounts.
    pub mounts: Vec<Mount>,
    /// Annotations passed to the container runtime.
    pub annotations: BTreeMap<String, String>,
    /// Fully qualified CDI device names (`vendor.com/class=name`).
    pub cdi_devices: Vec<String>,
}

/// A host device node made available in the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    /// Path on the host, e.g. `/dev/ttyUSB0`.
    pub host_path: String,
    /// Path in the container (often the same as `host_path`).
    pub container_path: String,
    /// Cgroup permissions: a combination of `r`, `w` and `m` (mknod).
    pub permissions: String,
}

/// A bind mount from the host into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mount read-only.
    pub read_only: bool,
}

impl ContainerEdits {
    /// Sets an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.envs.insert(key.into(), value.into());
        self
    }

    /// The wire form for one container.
    pub fn into_wire(self) -> pb::ContainerAllocateResponse {
        pb::ContainerAllocateResponse {
            envs: self.envs.into_iter().collect(),
            mounts: self
                .mounts
                .into_iter()
                .map(|m| pb::Mount {
                    container_path: m.container_path,
                    host_path: m.host_path,
                    read_only: m.read_only,
                })
                .collect(),
            devices: self
                .devices
                .into_iter()
                .map(|d| pb::DeviceSpec {
                    container_path: d.container_path,
                    host_path: d.host_path,
                    permissions: d.permissions,
                })
                .collect(),
            annotations: self.annotations.into_iter().collect(),
            cdi_devices: self
                .cdi_devices
                .into_iter()
                .map(|name| pb::CdiDevice { name })
                .collect(),
        }
    }
}
