//! The API server's rules for what the publisher writes: the driver name, and each attribute
//! and capacity of a device (a value it would refuse is left out, not sent).

use super::shared::SliceError;
use devplug::dra::{AttributeValue, DeviceAttributes};

/// The longest DRA driver name the API server takes.
pub const MAX_DRIVER_NAME_LEN: usize = 63;

/// Checks a DRA driver name: a DNS subdomain of at most [`MAX_DRIVER_NAME_LEN`] characters
/// (`npu.example.com`).
pub fn check_driver_name(driver: &str) -> Result<(), SliceError> {
    let bad = |reason: String| SliceError::DriverName {
        name: driver.to_owned(),
        reason,
    };
    devplug::dra::check_dns_subdomain(driver).map_err(bad)?;
    if driver.len() > MAX_DRIVER_NAME_LEN {
        return Err(bad(format!(
            "{} characters; the API server takes at most {MAX_DRIVER_NAME_LEN}",
            driver.len()
        )));
    }
    Ok(())
}

/// The API server's rules for one attribute: [`DeviceAttributes::check`] on it alone, and a
/// version must be a semantic version.
pub(super) fn check_attribute(name: &str, value: &AttributeValue) -> Result<(), String> {
    let mut one = DeviceAttributes::default();
    one.attributes.insert(name.to_owned(), value.clone());
    one.check()?;
    if let AttributeValue::Version(v) = value {
        if !is_semver(v) {
            return Err(format!(
                "{v:?} is not a semantic version (semver.org 2.0.0)"
            ));
        }
    }
    Ok(())
}

/// The API server's rules for one capacity: a valid name, and a value a quantity can hold
/// (at most 2^63 - 1).
pub(super) fn check_capacity(name: &str, value: u64) -> Result<(), String> {
    let mut one = DeviceAttributes::default();
    one.capacity.insert(name.to_owned(), value);
    one.check()?;
    if i64::try_from(value).is_err() {
        return Err(format!("{value} is over the largest quantity (2^63 - 1)"));
    }
    Ok(())
}

/// True for a semantic version as semver.org 2.0.0 defines it (`1.2.3`, `1.0.0-rc.1+build.5`).
fn is_semver(v: &str) -> bool {
    let (rest, build) = match v.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (v, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let numeric = |s: &str| {
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
    };
    let ident =
        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|pre| {
            pre.split('.')
                .all(|p| ident(p) && (!p.bytes().all(|b| b.is_ascii_digit()) || numeric(p)))
        })
        && build.is_none_or(|build| build.split('.').all(ident))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semantic_versions() {
        for ok in [
            "0.0.0",
            "1.2.3",
            "10.20.30",
            "1.0.0-rc.1",
            "1.0.0-alpha-a.b-c",
            "1.0.0+build.5",
            "1.0.0-0.3.7+x",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in [
            "",
            "1",
            "1.2",
            "1.2.3.4",
            "01.2.3",
            "1.2.3-",
            "1.2.3-01",
            "1.2.3+",
            "1.2.3-a..b",
            "v1.2.3",
            "1.2.x",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }

    #[test]
    fn driver_names() {
        assert!(check_driver_name("npu.example.com").is_ok());
        assert!(check_driver_name("example.com/npu").is_err());
        assert!(check_driver_name(&format!("{}.com", "a".repeat(60))).is_err());
    }
}
