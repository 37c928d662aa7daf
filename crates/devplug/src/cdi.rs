//! CDI (Container Device Interface) spec files: a spec built from the same [`ContainerEdits`]
//! that `Allocate` sends, written atomically (a temp file in the same folder, then a rename, so
//! a runtime never reads half a file), rewritten only when its content changes, and removed
//! when the writer is dropped if the file is still the one it wrote (a newer instance's file is
//! left alone). Backends name devices `<kind>=<name>` in `Allocate`; the runtime resolves them
//! from these files.
//!
//! `cdiVersion` is the lowest version that covers the fields used (as the reference Go library
//! computes it), so older runtimes, which reject versions newer than they know, still load it:
//! `0.5.0` once a device name starts with a digit (PCI addresses) or a node has a `hostPath`.

use crate::edits::ContainerEdits;
use serde::Serialize;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where dynamic CDI specs live on a host.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";

/// A whole CDI spec file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Spec {
    /// Spec version.
    #[serde(rename = "cdiVersion")]
    pub cdi_version: String,
    /// `vendor/class`, e.g. `amd.com/gpu`.
    pub kind: String,
    /// The devices, each addressable as `kind=name`.
    pub devices: Vec<SpecDevice>,
    /// Edits applied once when any device of the spec is requested.
    #[serde(rename = "containerEdits", skip_serializing_if = "Edits::is_empty")]
    pub container_edits: Edits,
}

/// One named device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecDevice {
    /// Name within the kind (letters, digits, `_`, `-`, `.`, `:`).
    pub name: String,
    /// What the device adds to a container.
    #[serde(rename = "containerEdits")]
    pub container_edits: Edits,
}

/// CDI container edits (the subset devplug produces).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Edits {
    /// Environment variables, `KEY=VALUE`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(rename = "deviceNodes", skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<SpecNode>,
    /// Bind mounts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<SpecMount>,
}

/// A device node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host (devplug always sets it, so a dev root other than /dev works).
    #[serde(rename = "hostPath", skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// Cgroup permissions (`rw`, `rwm`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecMount {
    /// Path on the host.
    #[serde(rename = "hostPath")]
    pub host_path: String,
    /// Path in the container.
    #[serde(rename = "containerPath")]
    pub container_path: String,
    /// Mount options (`ro`, `nosuid`, `nodev`, `bind`).
    pub options: Vec<String>,
}

impl Edits {
    /// True when the edits change nothing.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

impl From<&ContainerEdits> for Edits {
    /// The CDI form of `Allocate` edits (annotations and CDI names have no CDI counterpart).
    fn from(edits: &ContainerEdits) -> Self {
        Edits {
            env: edits.envs.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            device_nodes: edits
                .devices
                .iter()
                .map(|d| SpecNode {
                    path: d.container_path.clone(),
                    host_path: Some(d.host_path.clone()),
                    permissions: Some(d.permissions.clone()),
                })
                .collect(),
            mounts: edits
                .mounts
                .iter()
                .map(|m| SpecMount {
                    host_path: m.host_path.clone(),
                    container_path: m.container_path.clone(),
                    options: if m.read_only {
                        vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()]
                    } else {
                        vec!["nosuid".into(), "nodev".into(), "bind".into()]
                    },
                })
                .collect(),
        }
    }
}

impl Spec {
    /// An empty spec of `kind`.
    pub fn new(kind: impl Into<String>) -> Self {
        Spec {
            cdi_version: String::new(),
            kind: kind.into(),
            devices: Vec::new(),
            container_edits: Edits::default(),
        }
    }

    /// Adds a device.
    pub fn device(mut self, name: impl Into<String>, edits: &ContainerEdits) -> Self {
        self.devices.push(SpecDevice {
            name: name.into(),
            container_edits: edits.into(),
        });
        self
    }

    /// Sets the edits shared by every device (applied once per container).
    pub fn common(mut self, edits: &ContainerEdits) -> Self {
        self.container_edits = edits.into();
        self
    }

    /// The lowest spec version that covers what this spec uses.
    pub fn minimum_version(&self) -> &'static str {
        let class_has_dot = self
            .kind
            .split_once('/')
            .is_some_and(|(_, class)| class.contains('.'));
        if class_has_dot {
            return "0.6.0";
        }
        let name_starts_with_digit = self
            .devices
            .iter()
            .any(|d| !d.name.starts_with(|c: char| c.is_ascii_alphabetic()));
        let edits = std::iter::once(&self.container_edits)
            .chain(self.devices.iter().map(|d| &d.container_edits));
        let mut host_path = false;
        for e in edits {
            host_path |= e.device_nodes.iter().any(|n| n.host_path.is_some());
        }
        // Mounts carry no `type` here, so 0.4.0 (which added it) is never needed on its own.
        if name_starts_with_digit || host_path {
            "0.5.0"
        } else {
            "0.3.0"
        }
    }

    /// The JSON text, with `cdiVersion` set to [`Spec::minimum_version`].
    pub fn to_json(&self) -> String {
        let mut spec = self.clone();
        spec.cdi_version = self.minimum_version().to_owned();
        // Serializing plain strings and vectors cannot fail.
        serde_json::to_string_pretty(&spec).unwrap_or_default() + "\n"
    }

    /// The fully qualified name of one device, `kind=name`.
    pub fn qualified(&self, name: &str) -> String {
        qualified_name(&self.kind, name)
    }
}

/// `kind=name`, as `Allocate` sends it.
pub fn qualified_name(kind: &str, name: &str) -> String {
    format!("{kind}={name}")
}

/// Checks a CDI kind (`vendor/class`): vendor a DNS-subdomain-like prefix, class up to 63
/// letters, digits, `-`, `_`, `.`, alphanumeric at both ends.
pub fn validate_kind(kind: &str) -> Result<(), String> {
    let Some((vendor, class)) = kind.split_once('/') else {
        return Err(format!("{kind:?} must be vendor/class, e.g. amd.com/gpu"));
    };
    let alnum_ends = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    let vendor_ok = alnum_ends(vendor)
        && vendor.len() <= 253
        && vendor
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    let class_ok = alnum_ends(class)
        && class.len() <= 63
        && class
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if vendor_ok && class_ok {
        Ok(())
    } else {
        Err(format!(
            "{kind:?} is not a valid CDI kind (vendor.com/class; letters, digits, '-', '_', '.')"
        ))
    }
}

/// Checks a CDI device name: letters, digits, `_`, `-`, `.`, `:`, starting with a letter or
/// digit.
pub fn valid_device_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c))
}

/// Writes `bytes` to `path` atomically: a temp file in the same folder (created if missing),
/// synced, then renamed over `path`, so a reader sees the old file or the new one, never half
/// of one. Returns the (device, inode) of the new file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<(u64, u64)> {
    write_atomic_mode(path, bytes, 0o644)
}

/// [`write_atomic`] with the file's permission bits (`0o600` for a file only its owner may
/// read); the folder is made if missing, with the usual permissions.
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<(u64, u64)> {
    write_atomic_inner(path, bytes, mode, true)
}

/// [`write_atomic`] without the fsync: a reader still sees the old file or the new one, but a
/// power loss may leave either, or an empty file. For files something durable can write again
/// (a DRA claim's CDI spec, kept whole in the synced checkpoint and restored from it at start
/// when the file is missing or differs); it saves a disk flush on each write.
pub fn write_atomic_unsynced(path: &Path, bytes: &[u8]) -> std::io::Result<(u64, u64)> {
    write_atomic_inner(path, bytes, 0o644, false)
}

fn write_atomic_inner(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    sync: bool,
) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        // The mode given at creation is narrowed by the umask; a stale temp file keeps its own.
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.write_all(bytes)?;
        if sync {
            file.sync_all()?;
        }
        let meta = file.metadata()?;
        std::fs::rename(&tmp, path)?;
        Ok((meta.dev(), meta.ino()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes one spec file, atomically, and removes it on drop if it is still ours.
#[derive(Debug)]
pub struct CdiWriter {
    path: PathBuf,
    /// The text last written and the (device, inode) of the file it went into.
    written: Option<(String, u64, u64)>,
}

impl CdiWriter {
    /// A writer of `<dir>/<stem>.json`. Nothing is written yet.
    pub fn new(dir: &Path, stem: &str) -> Self {
        let stem: String = stem
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        CdiWriter {
            path: dir.join(format!("{stem}.json")),
            written: None,
        }
    }

    /// The spec file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `spec` unless the file already holds exactly this text; a spec with no devices
    /// (which CDI forbids) removes the file instead. Returns true if the file changed.
    pub fn write(&mut self, spec: &Spec) -> std::io::Result<bool> {
        if spec.devices.is_empty() {
            return self.remove().map(|_| true);
        }
        let text = spec.to_json();
        if let Some((old, dev, ino)) = &self.written {
            if *old == text && self.is_ours(*dev, *ino) {
                return Ok(false);
            }
        }
        let (dev, ino) = write_atomic(&self.path, text.as_bytes())?;
        self.written = Some((text, dev, ino));
        Ok(true)
    }

    fn is_ours(&self, dev: u64, ino: u64) -> bool {
        std::fs::metadata(&self.path).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
    }

    /// Removes the file if it is still the one this writer wrote.
    pub fn remove(&mut self) -> std::io::Result<()> {
        if let Some((_, dev, ino)) = self.written.take() {
            if self.is_ours(dev, ino) {
                return std::fs::remove_file(&self.path);
            }
        }
        Ok(())
    }
}

impl Drop for CdiWriter {
    fn drop(&mut self) {
        if let Err(err) = self.remove() {
            tracing::warn!(path = %self.path.display(), %err, "cannot remove the CDI spec");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::edits::{DeviceNode, Mount};

    fn node(host: &str, container: &str) -> DeviceNode {
        DeviceNode {
            host_path: host.into(),
            container_path: container.into(),
            permissions: "rw".into(),
        }
    }

    fn amd_spec() -> Spec {
        let gpu = ContainerEdits {
            devices: vec![
                node("/dev/dri/card1", "/dev/dri/card1"),
                node("/dev/dri/renderD128", "/dev/dri/renderD128"),
            ],
            ..Default::default()
        };
        let kfd = ContainerEdits {
            devices: vec![node("/dev/kfd", "/dev/kfd")],
            ..Default::default()
        };
        Spec::new("amd.com/gpu")
            .device("0000:0c:00.0", &gpu)
            .common(&kfd)
    }

    #[test]
    fn exact_json() {
        let want = r#"{
  "cdiVersion": "0.5.0",
  "kind": "amd.com/gpu",
  "devices": [
    {
      "name": "0000:0c:00.0",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/dri/card1",
            "hostPath": "/dev/dri/card1",
            "permissions": "rw"
          },
          {
            "path": "/dev/dri/renderD128",
            "hostPath": "/dev/dri/renderD128",
            "permissions": "rw"
          }
        ]
      }
    }
  ],
  "containerEdits": {
    "deviceNodes": [
      {
        "path": "/dev/kfd",
        "hostPath": "/dev/kfd",
        "permissions": "rw"
      }
    ]
  }
}
"#;
        assert_eq!(amd_spec().to_json(), want);
        assert_eq!(
            amd_spec().qualified("0000:0c:00.0"),
            "amd.com/gpu=0000:0c:00.0"
        );
    }

    #[test]
    fn exact_json_with_env_and_mounts_and_no_common_edits() {
        let edits = ContainerEdits {
            mounts: vec![Mount {
                host_path: "/dev/dri/by-path/pci-0000:00:02.0-card".into(),
                container_path: "/dev/dri/by-path/pci-0000:00:02.0-card".into(),
                read_only: true,
            }],
            ..Default::default()
        }
        .env("A", "1");
        let spec = Spec::new("gpu.intel.com/i915").device("card0", &edits);
        let want = r#"{"cdiVersion":"0.3.0","kind":"gpu.intel.com/i915","devices":[{"name":"card0","containerEdits":{"env":["A=1"],"mounts":[{"hostPath":"/dev/dri/by-path/pci-0000:00:02.0-card","containerPath":"/dev/dri/by-path/pci-0000:00:02.0-card","options":["ro","nosuid","nodev","bind"]}]}}]}"#;
        let mut compact = spec.clone();
        compact.cdi_version = spec.minimum_version().into();
        assert_eq!(serde_json::to_string(&compact).unwrap(), want);
    }

    #[test]
    fn versions() {
        assert_eq!(Spec::new("a.com/x").minimum_version(), "0.3.0");
        assert_eq!(amd_spec().minimum_version(), "0.5.0");
        assert_eq!(Spec::new("a.com/x.y").minimum_version(), "0.6.0");
        let named = Spec::new("a.com/x").device("9", &ContainerEdits::default());
        assert_eq!(named.minimum_version(), "0.5.0");
    }

    #[test]
    fn kinds_and_names() {
        assert!(validate_kind("amd.com/gpu").is_ok());
        assert!(validate_kind("gpu.intel.com/xe").is_ok());
        assert!(validate_kind("gpu").is_err());
        assert!(validate_kind("Amd.com/gpu").is_err());
        assert!(validate_kind("amd.com/-gpu").is_err());
        assert!(valid_device_name("0000:0c:00.0"));
        assert!(valid_device_name("amdgpu_xcp_3"));
        assert!(!valid_device_name("-x"));
        assert!(!valid_device_name("a/b"));
    }

    #[test]
    fn writes_atomically_skips_unchanged_and_removes_only_its_own_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cdi");
        let mut writer = CdiWriter::new(&dir, "devplug-amd.com/gpu");
        assert_eq!(writer.path(), dir.join("devplug-amd.com_gpu.json"));
        assert!(writer.write(&amd_spec()).unwrap());
        assert!(
            !writer.write(&amd_spec()).unwrap(),
            "unchanged: not rewritten"
        );
        let text = std::fs::read_to_string(writer.path()).unwrap();
        assert_eq!(text, amd_spec().to_json());
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");

        // Deleted behind our back: written again.
        std::fs::remove_file(writer.path()).unwrap();
        assert!(writer.write(&amd_spec()).unwrap());
        assert!(writer.path().exists());

        // Another instance replaces the file: our drop leaves theirs alone.
        let mut newer = CdiWriter::new(&dir, "devplug-amd.com/gpu");
        assert!(newer.write(&amd_spec()).unwrap());
        drop(writer);
        assert!(newer.path().exists(), "the newer instance's file stays");
        let path = newer.path().to_owned();
        drop(newer);
        assert!(!path.exists(), "removed by the instance that wrote it");

        // No devices: no file (CDI requires at least one device).
        let mut empty = CdiWriter::new(&dir, "x");
        assert!(empty.write(&amd_spec()).unwrap());
        assert!(empty.write(&Spec::new("amd.com/gpu")).unwrap());
        assert!(!empty.path().exists());
    }
}
