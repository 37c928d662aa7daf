//! Images for a node that reaches no registry: a one-layer busybox image made here (the test
//! pods and the pod sandbox run it), and devplug's own image archive, both imported into
//! containerd with `ctr`.

use ring::digest::{digest, SHA256};
use std::path::Path;

/// The test pods' image (and the sandbox image): busybox, `sleep` as its entrypoint.
pub const BUSYBOX_IMAGE: &str = "devplug.test/busybox:1";

fn sha256(bytes: &[u8]) -> String {
    digest(&SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn append(
    builder: &mut tar::Builder<Vec<u8>>,
    path: &str,
    mode: u32,
    data: &[u8],
) -> Result<(), String> {
    let mut header = tar::Header::new_ustar();
    header.set_size(data.len() as u64);
    header.set_mode(mode);
    header.set_uid(0);
    header.set_gid(0);
    header.set_entry_type(tar::EntryType::Regular);
    builder
        .append_data(&mut header, path, data)
        .map_err(|e| format!("image archive: {path}: {e}"))
}

fn append_link(
    builder: &mut tar::Builder<Vec<u8>>,
    path: &str,
    target: &str,
) -> Result<(), String> {
    let mut header = tar::Header::new_ustar();
    header.set_size(0);
    header.set_mode(0o777);
    header.set_entry_type(tar::EntryType::Symlink);
    builder
        .append_link(&mut header, path, target)
        .map_err(|e| format!("image archive: {path}: {e}"))
}

fn append_dir(builder: &mut tar::Builder<Vec<u8>>, path: &str) -> Result<(), String> {
    let mut header = tar::Header::new_ustar();
    header.set_size(0);
    header.set_mode(0o755);
    header.set_entry_type(tar::EntryType::Directory);
    builder
        .append_data(&mut header, path, std::io::empty())
        .map_err(|e| format!("image archive: {path}: {e}"))
}

/// An OCI image archive (`ctr images import` reads it) of one layer: `/bin/busybox` from
/// `busybox` with `/bin/sh` linking to it, `/tmp`, named [`BUSYBOX_IMAGE`].
pub fn busybox_archive(busybox: &Path) -> Result<Vec<u8>, String> {
    let binary = std::fs::read(busybox).map_err(|e| format!("{}: {e}", busybox.display()))?;
    let mut layer = tar::Builder::new(Vec::new());
    append_dir(&mut layer, "bin")?;
    append_dir(&mut layer, "tmp")?;
    append(&mut layer, "bin/busybox", 0o755, &binary)?;
    append_link(&mut layer, "bin/sh", "busybox")?;
    let layer = layer
        .into_inner()
        .map_err(|e| format!("image archive: layer: {e}"))?;
    let layer_digest = sha256(&layer);
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": ["/bin/busybox", "sleep", "2147483647"],
            "Env": ["PATH=/bin"],
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
    })
    .to_string();
    let config_digest = sha256(config.as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer_digest}"),
            "size": layer.len(),
        }],
    })
    .to_string();
    let manifest_digest = sha256(manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest.len(),
            "annotations": {"io.containerd.image.name": BUSYBOX_IMAGE},
        }],
    })
    .to_string();
    let mut archive = tar::Builder::new(Vec::new());
    append(
        &mut archive,
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    append(&mut archive, "index.json", 0o644, index.as_bytes())?;
    append_dir(&mut archive, "blobs")?;
    append_dir(&mut archive, "blobs/sha256")?;
    for (digest, bytes) in [
        (&layer_digest, layer.as_slice()),
        (&config_digest, config.as_bytes()),
        (&manifest_digest, manifest.as_bytes()),
    ] {
        append(
            &mut archive,
            &format!("blobs/sha256/{digest}"),
            0o644,
            bytes,
        )?;
    }
    archive
        .into_inner()
        .map_err(|e| format!("image archive: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busybox_archive_is_an_oci_layout_whose_digests_match() {
        let dir = std::env::temp_dir().join(format!("devplug-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("busybox");
        std::fs::write(&fake, b"not really busybox").unwrap();
        let archive = busybox_archive(&fake).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let mut files = std::collections::BTreeMap::new();
        let mut reader = tar::Archive::new(archive.as_slice());
        for entry in reader.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().display().to_string();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
            files.insert(path, bytes);
        }
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifest_digest = index["manifests"][0]["digest"].as_str().unwrap();
        assert_eq!(
            index["manifests"][0]["annotations"]["io.containerd.image.name"],
            BUSYBOX_IMAGE
        );
        let blob =
            |d: &str| files[&format!("blobs/sha256/{}", d.trim_start_matches("sha256:"))].clone();
        let manifest = blob(manifest_digest);
        assert_eq!(format!("sha256:{}", sha256(&manifest)), manifest_digest);
        let manifest: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
        let layer_digest = manifest["layers"][0]["digest"].as_str().unwrap();
        let layer = blob(layer_digest);
        assert_eq!(format!("sha256:{}", sha256(&layer)), layer_digest);
        let mut names = Vec::new();
        for entry in tar::Archive::new(layer.as_slice()).entries().unwrap() {
            names.push(entry.unwrap().path().unwrap().display().to_string());
        }
        assert_eq!(names, ["bin", "tmp", "bin/busybox", "bin/sh"]);
    }
}
