//! Device names in a ResourceSlice. The API server takes a DNS label (lower-case letters,
//! digits and `-`, at most 63 characters); backend ids are freer (`GPU-3f2a…`, `ttyUSB0`,
//! `0000:03:00.0`). The name is a pure function of the id, so the slice publisher and the
//! prepare path agree without sharing state: an id that already is a DNS label is its own name,
//! any other gets a cleaned form plus 8 hex digits of a hash of the id, so two ids never meet
//! on one name in practice (`GPU-a` → `gpu-a-a414910b`, while `gpu-a` stays `gpu-a`).

/// The longest name the API server takes for a device.
pub const MAX_DEVICE_NAME_LEN: usize = 63;

/// True when `name` is a DNS label (RFC 1123).
pub fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_DEVICE_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// The ResourceSlice device name of the backend device `id`.
pub fn device_name(id: &str) -> String {
    if is_dns_label(id) {
        return id.to_owned();
    }
    let mut clean = String::with_capacity(id.len());
    for c in id.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            clean.push(c);
        } else if !clean.ends_with('-') {
            clean.push('-');
        }
    }
    // Leave room for "-" and 8 hex digits.
    clean.truncate(MAX_DEVICE_NAME_LEN - 9);
    let clean = clean.trim_matches('-');
    let hash = fnv1a(id.as_bytes());
    if clean.is_empty() {
        format!("d-{hash:08x}")
    } else {
        format!("{clean}-{hash:08x}")
    }
}

/// 32-bit FNV-1a: small, stable across versions and platforms (the name must never change for
/// an id, or prepared claims would lose their devices after an upgrade).
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stay_and_others_get_a_stable_hash() {
        assert_eq!(device_name("npu-0"), "npu-0");
        assert_eq!(
            device_name("GPU-a"),
            format!("gpu-a-{:08x}", fnv1a(b"GPU-a"))
        );
        assert_ne!(device_name("GPU-a"), device_name("gpu-a"));
        assert!(device_name("0000:03:00.0").starts_with("0000-03-00-0-"));
        assert!(device_name("___").starts_with("d-"));
        let long = "X".repeat(200);
        assert!(is_dns_label(&device_name(&long)));
        for id in [
            "ttyUSB0",
            "MIG-1/2",
            "a..b",
            "-x-",
            "GPU-3f2a4b5c-1111-2222-3333-444455556666",
        ] {
            assert!(
                is_dns_label(&device_name(id)),
                "{id} -> {}",
                device_name(id)
            );
        }
        // Pinned: a changed hash would orphan prepared claims across an upgrade.
        assert_eq!(device_name("GPU-a"), "gpu-a-a414910b");
    }
}
