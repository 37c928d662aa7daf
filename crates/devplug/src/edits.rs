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

    /// These edits and `other`'s, for one container given both: device nodes, mounts and CDI
    /// devices once each; an env var both set to different values gets both, joined with `,`
    /// (`VISIBLE_DEVICES=a,b`), in this order; `other`'s annotations win.
    pub fn merge(mut self, other: ContainerEdits) -> ContainerEdits {
        for (key, value) in other.envs {
            match self.envs.get_mut(&key) {
                Some(mine) if *mine != value => {
                    mine.push(',');
                    mine.push_str(&value);
                }
                Some(_) => {}
                None => {
                    self.envs.insert(key, value);
                }
            }
        }
        for device in other.devices {
            if !self.devices.contains(&device) {
                self.devices.push(device);
            }
        }
        for mount in other.mounts {
            if !self.mounts.contains(&mount) {
                self.mounts.push(mount);
            }
        }
        self.annotations.extend(other.annotations);
        for cdi in other.cdi_devices {
            if !self.cdi_devices.contains(&cdi) {
                self.cdi_devices.push(cdi);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_joins_differing_env_and_keeps_nodes_once() {
        let node = |p: &str| DeviceNode {
            host_path: p.into(),
            container_path: p.into(),
            permissions: "rw".into(),
        };
        let mut a = ContainerEdits::default().env("V", "gpu-0").env("SAME", "1");
        a.devices.push(node("/dev/a"));
        let mut b = ContainerEdits::default()
            .env("V", "gpu-1")
            .env("SAME", "1")
            .env("N", "x");
        b.devices.extend([node("/dev/a"), node("/dev/b")]);
        let merged = a.merge(b);
        assert_eq!(merged.envs["V"], "gpu-0,gpu-1");
        assert_eq!(merged.envs["SAME"], "1");
        assert_eq!(merged.envs["N"], "x");
        assert_eq!(merged.devices, [node("/dev/a"), node("/dev/b")]);
    }
}
