//! Device metadata (KEP-5304, beta in Kubernetes 1.37): a file per request of a prepared claim
//! that tells the container which devices it got and their attributes, mounted read-only where
//! upstream's readers (`k8s.io/dynamic-resource-allocation/devicemetadata`) look for it:
//!
//! - `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`
//!   for a claim the pod names;
//! - `…/resourceclaimtemplates/<pod's claim name>/<request>/<driver>-metadata.json` for a claim
//!   made from a template (its generated name cannot be known from the pod's spec; the claim's
//!   `resource.kubernetes.io/pod-claim-name` annotation gives the pod's name for it).
//!
//! `<request>` is the request's name without a sub-request (`gpus` for `gpus/small`); the
//! document keeps the full name. The file is a stream of `DeviceMetadata` objects
//! (`metadata.resource.k8s.io`), one per API version, newest first, so a reader takes the
//! first it knows: `v1beta1` (1.37) then `v1alpha1` (1.36). Each device carries its driver,
//! pool, name and the attributes its ResourceSlice publishes, in the slice's encoding
//! (`{"int": 0}`, `{"string": "…"}`).
//!
//! On the host the files are under the driver's folder, one folder per claim UID
//! (`<plugins>/<driver>/dra-device-metadata/<uid>/<request>/metadata.json`): on the kubelet's
//! persistent disk beside the checkpoint, so a reboot keeps them for the claims it keeps. The
//! mount is an edit of the request's CDI device in the claim's spec, so exactly the containers
//! that use the request see it. Written and synced before the spec that mounts them; removed
//! at unprepare, and at start for claims the checkpoint no longer holds.

use super::claim_spec::path_segment as clean;
use super::error::PrepareError;
use crate::checkpoint::{Checkpoint, PreparedDevice};
use devplug::{DeviceList, Mount};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a container finds its device metadata.
pub const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// The claim's annotation that gives the pod's name for a claim made from a template.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// The API versions written, newest first (readers take the first they can decode).
const VERSIONS: [&str; 2] = [
    "metadata.resource.k8s.io/v1beta1",
    "metadata.resource.k8s.io/v1alpha1",
];

/// The claim a metadata file describes.
pub(super) struct MetadataClaim<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
    /// The pod's name for the claim when it was made from a template.
    pub pod_claim_name: Option<&'a str>,
}

/// One request's file: where it is on the host, its mount, its text.
pub(super) struct MetadataFile {
    pub request: String,
    pub host_path: PathBuf,
    pub mount: Mount,
    pub text: String,
}

/// The claim's folder of metadata files under `root`.
pub fn claim_dir(root: &Path, uid: &str) -> PathBuf {
    root.join(clean(uid))
}

/// The base name of a request (`gpus` for the sub-request `gpus/small`).
fn base_request(request: &str) -> &str {
    request.split('/').next().unwrap_or(request)
}

/// The file the container reads for `request` of `claim`.
pub(super) fn container_path(driver: &str, claim: &MetadataClaim<'_>, request: &str) -> String {
    let (kind, name) = match claim.pod_claim_name {
        Some(pod_claim) => ("resourceclaimtemplates", pod_claim),
        None => ("resourceclaims", claim.name),
    };
    format!(
        "{CONTAINER_DIR}/{kind}/{}/{}/{}-metadata.json",
        clean(name),
        clean(base_request(request)),
        clean(driver)
    )
}

/// The files of a claim, one per base request, from its prepared devices and their attributes
/// in `list` (a device that left has none).
pub(super) fn files(
    driver: &str,
    root: &Path,
    claim: &MetadataClaim<'_>,
    devices: &[PreparedDevice],
    list: &DeviceList,
) -> Vec<MetadataFile> {
    // Full request names by base request, in the order the claim's devices give them.
    let mut by_base: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for request in devices.iter().flat_map(|d| &d.request_names) {
        let names = by_base.entry(base_request(request).to_owned()).or_default();
        if !names.contains(request) {
            names.push(request.clone());
        }
    }
    by_base
        .into_iter()
        .map(|(base, requests)| {
            let requests: Vec<Value> = requests
                .iter()
                .map(|request| {
                    let devices: Vec<Value> = devices
                        .iter()
                        .filter(|d| d.request_names.contains(request))
                        .map(|d| device_json(driver, d, list))
                        .collect();
                    json!({ "name": request, "devices": devices })
                })
                .collect();
            let host_path = claim_dir(root, claim.uid)
                .join(clean(&base))
                .join("metadata.json");
            MetadataFile {
                mount: Mount {
                    host_path: host_path.display().to_string(),
                    container_path: container_path(driver, claim, &base),
                    read_only: true,
                },
                text: document(claim, &requests),
                host_path,
                request: base,
            }
        })
        .collect()
}

/// Adds each file's mount to the edits of the requests it describes (every sub-request of
/// its base request).
pub(super) fn mount_into(files: &[MetadataFile], edits: &mut [(String, devplug::ContainerEdits)]) {
    for (request, edits) in edits.iter_mut() {
        if let Some(file) = files.iter().find(|f| f.request == base_request(request)) {
            edits.mounts.push(file.mount.clone());
        }
    }
}

fn device_json(driver: &str, device: &PreparedDevice, list: &DeviceList) -> Value {
    let mut out = json!({
        "driver": driver,
        "pool": device.pool,
        "name": device.device,
    });
    if let Some(found) = list.devices().iter().find(|d| d.id == device.id) {
        let attributes = crate::slices::published_attributes(driver, found);
        if !attributes.is_empty() {
            out["attributes"] = json!(attributes);
        }
    }
    out
}

/// The stream of `DeviceMetadata` objects, one per version in [`VERSIONS`], each on lines of
/// its own and ended by a newline.
fn document(claim: &MetadataClaim<'_>, requests: &[Value]) -> String {
    let mut text = String::new();
    for version in VERSIONS {
        let mut object = json!({
            "apiVersion": version,
            "kind": "DeviceMetadata",
            "metadata": {
                "name": claim.name,
                "namespace": claim.namespace,
                "uid": claim.uid,
                "generation": 1,
            },
            "requests": requests,
        });
        if let Some(pod_claim) = claim.pod_claim_name {
            object["podClaimName"] = json!(pod_claim);
        }
        // A Value made of maps, strings and numbers always serializes.
        text.push_str(&serde_json::to_string_pretty(&object).unwrap_or_default());
        text.push('\n');
    }
    text
}

/// Writes the files (folders 0755, files 0644, each replaced atomically and synced: unlike a
/// CDI spec, the checkpoint does not hold their text).
pub(super) async fn write(files: Vec<(PathBuf, String)>) -> Result<(), PrepareError> {
    tokio::task::spawn_blocking(move || {
        for (path, text) in files {
            devplug::cdi::write_atomic(&path, text.as_bytes()).map_err(|source| {
                PrepareError::WriteMetadata {
                    path: path.clone(),
                    source: Arc::new(source),
                }
            })?;
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|join| {
        Err(PrepareError::WriteMetadata {
            path: PathBuf::new(),
            source: Arc::new(std::io::Error::other(join.to_string())),
        })
    })
}

/// Removes a claim's metadata folder; one already gone (or that cannot be there: a path
/// through a file) is fine.
pub(super) fn remove(root: &Path, uid: &str) -> Result<(), PrepareError> {
    use std::io::ErrorKind::{NotADirectory, NotFound};
    let dir = claim_dir(root, uid);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(err) if matches!(err.kind(), NotFound | NotADirectory) => Ok(()),
        Err(source) => Err(PrepareError::RemoveMetadata {
            path: dir,
            source: Arc::new(source),
        }),
    }
}

/// Removes the metadata folders under `root` of claims `checkpoint` does not hold (unprepared
/// while devplug was not running). Returns how many went.
pub fn remove_stale_metadata(root: &Path, driver: &str, checkpoint: &Checkpoint) -> usize {
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    let owned: std::collections::HashSet<String> =
        checkpoint.claims.keys().map(|uid| clean(uid)).collect();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if owned.contains(name) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match std::fs::remove_dir_all(entry.path()) {
            Ok(()) => {
                removed += 1;
                tracing::info!(%driver, folder = %entry.path().display(), "removed the device metadata of a claim no longer prepared");
            }
            Err(err) => {
                tracing::warn!(%driver, folder = %entry.path().display(), %err, "cannot remove stale device metadata")
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hold::Hold;
    use devplug::dra::AttributeValue;
    use devplug::Device;

    fn prepared(requests: &[&str], device: &str) -> PreparedDevice {
        PreparedDevice {
            request_names: requests.iter().map(|r| r.to_string()).collect(),
            pool: "node-a".into(),
            device: device.into(),
            id: device.into(),
            cdi_device_ids: Vec::new(),
            hold: Hold::Exclusive,
        }
    }

    fn claim(pod_claim_name: Option<&str>) -> MetadataClaim<'_> {
        MetadataClaim {
            namespace: "ns",
            name: "pod-gpu-x7k2q",
            uid: "u-1",
            pod_claim_name,
        }
    }

    #[test]
    fn a_claim_by_name_and_one_from_a_template_are_read_where_upstream_looks() {
        assert_eq!(
            container_path("gpu.example.com", &claim(None), "gpus/small"),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/pod-gpu-x7k2q/gpus/gpu.example.com-metadata.json"
        );
        assert_eq!(
            container_path("gpu.example.com", &claim(Some("gpu")), "gpus"),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpus/gpu.example.com-metadata.json"
        );
    }

    #[test]
    fn each_request_gets_a_stream_of_both_versions_with_the_published_attributes() {
        let gpu = Device::new("gpu-0")
            .with_numa_nodes([1])
            .with_attribute("uuid", AttributeValue::String("GPU-0".into()))
            .with_attribute("index", AttributeValue::Int(0));
        let list = DeviceList::new([gpu]);
        let root = Path::new("/plugins/gpu.example.com/dra-device-metadata");
        let files = files(
            "gpu.example.com",
            root,
            &claim(Some("gpu")),
            &[
                prepared(&["gpus/small"], "gpu-0"),
                prepared(&["nics"], "gone"),
            ],
            &list,
        );
        let requests: Vec<&str> = files.iter().map(|f| f.request.as_str()).collect();
        assert_eq!(requests, ["gpus", "nics"]);
        assert_eq!(
            files[0].host_path,
            root.join("u-1/gpus/metadata.json"),
            "one folder per claim UID"
        );
        assert!(files[0].mount.read_only);
        let objects: Vec<Value> = serde_json::Deserializer::from_str(&files[0].text)
            .into_iter::<Value>()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(objects.len(), 2);
        assert_eq!(objects[0]["apiVersion"], "metadata.resource.k8s.io/v1beta1");
        assert_eq!(
            objects[1]["apiVersion"],
            "metadata.resource.k8s.io/v1alpha1"
        );
        assert_eq!(objects[0]["requests"], objects[1]["requests"]);
        let first = &objects[0];
        assert_eq!(first["kind"], "DeviceMetadata");
        assert_eq!(first["metadata"]["uid"], "u-1");
        assert_eq!(first["metadata"]["generation"], 1);
        assert_eq!(first["podClaimName"], "gpu");
        assert_eq!(first["requests"][0]["name"], "gpus/small");
        let device = &first["requests"][0]["devices"][0];
        assert_eq!(device["driver"], "gpu.example.com");
        assert_eq!(device["pool"], "node-a");
        assert_eq!(device["name"], "gpu-0");
        assert_eq!(device["attributes"]["uuid"], json!({"string": "GPU-0"}));
        assert_eq!(device["attributes"]["index"], json!({"int": 0}));
        assert_eq!(
            device["attributes"]["resource.kubernetes.io/numaNode"],
            json!({"int": 1}),
            "the standard attributes the slice adds are there too"
        );
        let gone: Value = serde_json::Deserializer::from_str(&files[1].text)
            .into_iter::<Value>()
            .next()
            .unwrap()
            .unwrap();
        assert!(gone["requests"][0]["devices"][0]
            .get("attributes")
            .is_none());
        assert!(files[0].text.ends_with("}\n"));
    }

    #[test]
    fn stale_folders_go_and_owned_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        for uid in ["kept", "stale"] {
            std::fs::create_dir_all(dir.path().join(uid).join("r")).unwrap();
        }
        let mut checkpoint = Checkpoint::new("gpu.example.com");
        checkpoint.claims.insert(
            "kept".into(),
            crate::checkpoint::PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                devices: Vec::new(),
                cdi_spec: PathBuf::new(),
                cdi_spec_json: None,
            },
        );
        assert_eq!(
            remove_stale_metadata(dir.path(), "gpu.example.com", &checkpoint),
            1
        );
        assert!(dir.path().join("kept/r").exists());
        assert!(!dir.path().join("stale").exists());
        remove(dir.path(), "kept").unwrap();
        remove(dir.path(), "kept").unwrap();
        assert!(!dir.path().join("kept").exists());
    }
}
