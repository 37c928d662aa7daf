//! The prepared claims of one DRA driver on this node, in a JSON file beside its socket
//! (`<plugins>/<driver>/checkpoint.json`), written atomically after every change and read at
//! start, so a restarted devplug answers a repeated `NodePrepareResources` from what it did
//! before (never preparing a claim twice) and can still unprepare claims prepared before the
//! restart (never losing one).
//!
//! The file says its format's version. This devplug writes [`VERSION`] and reads every version
//! since the first ([`READS`]), so a node's driver upgraded onto a new format restores every
//! claim the previous release wrote, and writes the new format at its next change. An older
//! devplug refuses a newer format (it would misread it): roll back with no claim prepared on the
//! node, or to a release that reads this one.
//!
//! - Version 1: pretty-printed, each claim's CDI spec as an escaped JSON string
//!   (`cdi_spec_json`).
//! - Version 2: compact, the CDI spec as JSON itself (`cdi_spec_content`): about a third fewer
//!   bytes to write per prepare, and nothing to escape.

use crate::hold::Hold;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The format version written in the file.
pub const VERSION: u32 = 2;

/// The format versions this devplug reads.
pub const READS: std::ops::RangeInclusive<u32> = 1..=VERSION;

/// One prepared device of a claim, as answered to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    /// The claim's requests this device serves.
    pub request_names: Vec<String>,
    /// The pool (the node name).
    pub pool: String,
    /// The device's name in the ResourceSlice.
    pub device: String,
    /// The backend's id of the device.
    pub id: String,
    /// CDI ids (`vendor/class=name`) the runtime injects for this device.
    pub cdi_device_ids: Vec<String>,
    /// How the claim holds the device (written as `share_id` and `admin_access`).
    #[serde(flatten)]
    pub hold: Hold,
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// Its devices.
    pub devices: Vec<PreparedDevice>,
    /// The CDI spec file written for it.
    pub cdi_spec: PathBuf,
    /// That file's content, so a spec lost with `/var/run/cdi` (a tmpfs, emptied by a reboot)
    /// can be written again from here. Absent in checkpoints written before it was kept. In the
    /// file (version 2) it is JSON itself, under `cdi_spec_content`.
    #[serde(
        default,
        rename = "cdi_spec_content",
        skip_serializing_if = "Option::is_none",
        with = "raw_json"
    )]
    pub cdi_spec_json: Option<String>,
}

/// A CDI spec's text kept as written, embedded in the checkpoint as JSON rather than as a
/// string. JSON keeps no whitespace after a value, so the spec's final newline (the CDI writer
/// ends every file with one) is left out in the file and put back when read.
mod raw_json {
    use serde::de::Error as _;
    use serde::ser::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::value::RawValue;

    pub fn serialize<S: Serializer>(text: &Option<String>, to: S) -> Result<S::Ok, S::Error> {
        match text {
            None => to.serialize_none(),
            Some(text) => RawValue::from_string(text.trim_end().to_owned())
                .map_err(S::Error::custom)?
                .serialize(to),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(from: D) -> Result<Option<String>, D::Error> {
        let raw: Option<Box<RawValue>> = Option::deserialize(from).map_err(D::Error::custom)?;
        Ok(raw.map(|raw| format!("{}\n", raw.get())))
    }
}

/// What every version of the file starts with.
#[derive(Deserialize)]
struct Header {
    version: u32,
}

/// Version 1 of the file, as the first releases wrote it.
#[derive(Deserialize)]
struct CheckpointV1 {
    driver: String,
    claims: BTreeMap<String, PreparedClaimV1>,
}

/// A prepared claim in version 1: the CDI spec's text as a JSON string.
#[derive(Deserialize)]
struct PreparedClaimV1 {
    namespace: String,
    name: String,
    devices: Vec<PreparedDevice>,
    cdi_spec: PathBuf,
    #[serde(default)]
    cdi_spec_json: Option<String>,
}

impl From<CheckpointV1> for Checkpoint {
    fn from(old: CheckpointV1) -> Checkpoint {
        let claims = old
            .claims
            .into_iter()
            .map(|(uid, claim)| {
                let claim = PreparedClaim {
                    namespace: claim.namespace,
                    name: claim.name,
                    devices: claim.devices,
                    cdi_spec: claim.cdi_spec,
                    cdi_spec_json: claim.cdi_spec_json,
                };
                (uid, claim)
            })
            .collect();
        Checkpoint {
            version: VERSION,
            driver: old.driver,
            claims,
        }
    }
}

/// Which file is at the checkpoint's path: a save renames a new file into place, so another
/// instance's save (a rolling update with surge, both instances serving for a moment) shows as
/// another stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
    len: u64,
}

impl FileStamp {
    /// The stamp of the file at `path`; `None` when there is none.
    pub fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
            len: meta.len(),
        })
    }
}

/// Every prepared claim of one driver, by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    version: u32,
    /// The driver the file belongs to.
    pub driver: String,
    /// Prepared claims by UID.
    pub claims: BTreeMap<String, PreparedClaim>,
}

/// A checkpoint file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// It could not be read.
    #[error("cannot read the DRA checkpoint {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is not a checkpoint of this driver in a format we know.
    #[error(
        "the DRA checkpoint {path} cannot be used: {reason}; the claims it lists may still be \
         prepared: move it away only after checking /var/run/cdi and the pods on this node"
    )]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

impl Checkpoint {
    /// An empty checkpoint of `driver`.
    pub fn new(driver: &str) -> Checkpoint {
        Checkpoint {
            version: VERSION,
            driver: driver.to_owned(),
            claims: BTreeMap::new(),
        }
    }

    /// Reads the checkpoint at `path`; a missing file is an empty checkpoint.
    pub fn load(path: &Path, driver: &str) -> Result<Checkpoint, CheckpointError> {
        let text = match std::fs::read(path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Checkpoint::new(driver))
            }
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let invalid = |reason: String| CheckpointError::Invalid {
            path: path.display().to_string(),
            reason,
        };
        let header: Header = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        let checkpoint: Checkpoint = match header.version {
            1 => serde_json::from_slice::<CheckpointV1>(&text)
                .map_err(|e| invalid(format!("version 1: {e}")))?
                .into(),
            VERSION => serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?,
            other => {
                return Err(invalid(format!(
                    "version {other}: this devplug reads versions {} to {} (a newer devplug \
                     wrote it?)",
                    READS.start(),
                    READS.end()
                )))
            }
        };
        if checkpoint.driver != driver {
            return Err(invalid(format!(
                "it belongs to driver {:?}, not {driver:?}",
                checkpoint.driver
            )));
        }
        Ok(checkpoint)
    }

    /// Writes the checkpoint to `path` atomically, readable by its owner only (0600), in a
    /// folder only its owner can enter (0700): it names every pod's claims on the node.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
        devplug::cdi::write_atomic_mode(path, &text, 0o600).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint of npu.example.com with one claim, `u1`, of `devices` and CDI spec `spec`.
    fn with_claim(devices: Vec<PreparedDevice>, spec: &str) -> Checkpoint {
        let mut checkpoint = Checkpoint::new("npu.example.com");
        let claim = PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            devices,
            cdi_spec: "/var/run/cdi/x.json".into(),
            cdi_spec_json: Some(spec.into()),
        };
        checkpoint.claims.insert("u1".into(), claim);
        checkpoint
    }

    #[test]
    fn the_checkpoint_and_its_folder_are_its_owners_only() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("npu.example.com");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.join("checkpoint.json");
        Checkpoint::new("npu.example.com").save(&path).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir), 0o700);
        // A file left world-readable by an older devplug is narrowed at the next save.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        Checkpoint::new("npu.example.com").save(&path).unwrap();
        assert_eq!(mode(&path), 0o600);
    }

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        assert_eq!(
            Checkpoint::load(&path, "npu.example.com").unwrap(),
            Checkpoint::new("npu.example.com")
        );
        let device = PreparedDevice {
            request_names: vec!["npus".into()],
            pool: "node-a".into(),
            device: "npu-1".into(),
            id: "npu-1".into(),
            cdi_device_ids: vec!["npu.example.com/claim=u1-npus".into()],
            hold: Hold::Exclusive,
        };
        let checkpoint = with_claim(vec![device], "{}\n");
        checkpoint.save(&path).unwrap();
        assert_eq!(
            Checkpoint::load(&path, "npu.example.com").unwrap(),
            checkpoint
        );
        let err = Checkpoint::load(&path, "gpu.example.com").unwrap_err();
        assert!(err.to_string().contains("belongs to driver"), "{err}");
        std::fs::write(&path, b"{").unwrap();
        let err = Checkpoint::load(&path, "npu.example.com").unwrap_err();
        assert!(err.to_string().contains("cannot be used"), "{err}");
        // A format from a newer devplug is refused, naming what this one reads.
        std::fs::write(
            &path,
            br#"{"version":3,"driver":"npu.example.com","claims":{}}"#,
        )
        .unwrap();
        let err = Checkpoint::load(&path, "npu.example.com").unwrap_err();
        assert!(
            err.to_string()
                .contains("version 3: this devplug reads versions 1 to 2"),
            "{err}"
        );
    }

    #[test]
    fn the_previous_format_is_read_and_the_current_one_is_smaller() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let v1 = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/checkpoint-v1.json"
        ))
        .unwrap();
        std::fs::write(&path, &v1).unwrap();
        let loaded = Checkpoint::load(&path, "npu.example.com").unwrap();
        assert_eq!(loaded.claims.len(), 3);
        loaded.save(&path).unwrap();
        let v2 = std::fs::read_to_string(&path).unwrap();
        assert!(v2.starts_with("{\"version\":2,"), "{v2}");
        assert_eq!(Checkpoint::load(&path, "npu.example.com").unwrap(), loaded);
        // The fixture's three claims: about 2,600 bytes in format 1, about 1,800 in format 2.
        assert!(
            v2.len() * 10 < v1.len() * 7,
            "{} → {} bytes",
            v1.len(),
            v2.len()
        );
    }

    #[test]
    fn the_spec_is_json_in_the_file_and_the_same_text_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let spec = "{\n  \"cdiVersion\": \"0.3.0\",\n  \"devices\": []\n}\n";
        with_claim(Vec::new(), spec).save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("\"cdi_spec_content\":{\n  \"cdiVersion\""),
            "{text}"
        );
        let loaded = Checkpoint::load(&path, "npu.example.com").unwrap();
        assert_eq!(loaded.claims["u1"].cdi_spec_json.as_deref(), Some(spec));
    }
}
