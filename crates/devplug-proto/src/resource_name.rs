//! The kubelet's rule for extended resource names (`IsExtendedResourceName`, `k8s.io/apimachinery` helpers).
//!
//! A name is valid when it has exactly one `/`, does not contain `kubernetes.io/`, does not start
//! with `requests.`, and `"requests." + name` is a qualified name: a DNS-1123 subdomain prefix of
//! at most 253 characters and a name part of at most 63 characters matching
//! `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`.

use std::fmt;

/// Why a resource name is not a valid extended resource name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidResourceName {
    /// The name that was checked.
    pub name: String,
    /// What is wrong with it, in words a person can act on.
    pub reason: String,
}

impl fmt::Display for InvalidResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid resource name {:?}: {} (expected the form vendor.example/device)",
            self.name, self.reason
        )
    }
}

impl std::error::Error for InvalidResourceName {}

/// Checks `name` the way the kubelet does before it accepts a registration.
pub fn validate(name: &str) -> Result<(), InvalidResourceName> {
    let fail = |reason: String| {
        Err(InvalidResourceName {
            name: name.to_owned(),
            reason,
        })
    };
    let Some((prefix, short)) = name.split_once('/') else {
        return fail("it has no '/': an extended resource needs a domain prefix".into());
    };
    if name.contains("kubernetes.io/") {
        return fail("the kubernetes.io/ prefix is reserved for native resources".into());
    }
    if name.starts_with("requests.") {
        return fail("it must not start with \"requests.\"".into());
    }
    if short.contains('/') {
        return fail("it has more than one '/'".into());
    }
    let quota_prefix = format!("requests.{prefix}");
    if prefix.is_empty() {
        return fail("the prefix before '/' is empty".into());
    }
    if quota_prefix.len() > 253 {
        return fail(format!(
            "the prefix is {} characters; at most 244 are allowed",
            prefix.len()
        ));
    }
    if !is_dns1123_subdomain(&quota_prefix) {
        return fail(format!(
            "the prefix {prefix:?} is not a DNS subdomain (lowercase letters, digits, '-' and '.', \
             starting and ending with a letter or digit)"
        ));
    }
    if short.is_empty() {
        return fail("the name after '/' is empty".into());
    }
    if short.len() > 63 {
        return fail(format!(
            "the name after '/' is {} characters; at most 63 are allowed",
            short.len()
        ));
    }
    if !is_qualified_name_part(short) {
        return fail(format!(
            "the name {short:?} must consist of letters, digits, '-', '_' or '.', and start and \
             end with a letter or digit"
        ));
    }
    Ok(())
}

fn is_dns1123_subdomain(s: &str) -> bool {
    s.split('.').all(|label| {
        let b = label.as_bytes();
        match (b.first(), b.last()) {
            (Some(first), Some(last)) => {
                is_lower_alnum(*first)
                    && is_lower_alnum(*last)
                    && b.iter().all(|c| is_lower_alnum(*c) || *c == b'-')
            }
            _ => false,
        }
    })
}

fn is_lower_alnum(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::validate;

    #[test]
    fn accepts_kubelet_valid_names() {
        for name in [
            "vendor.example/foo",
            "dummy.com/npu",
            "example.com/cola",
            "nvidia.com/gpu",
            "a/b",
            "squat.ai/serial",
            "example.com/Foo_bar.1",
            "intel.com/sgx-enclave",
        ] {
            assert_eq!(validate(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn rejects_what_the_kubelet_rejects() {
        for name in [
            "gpu",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/gpu",
            "requests.example.com/gpu",
            "example.com/a/b",
            "/gpu",
            "example.com/",
            "Example.com/gpu",
            "example..com/gpu",
            "-example.com/gpu",
            "example.com/-gpu",
            "example.com/gpu-",
            "example.com/g pu",
            "example_com/gpu",
        ] {
            assert!(validate(name).is_err(), "{name} should be rejected");
        }
    }

    #[test]
    fn length_limits() {
        let long_name = format!("example.com/{}", "a".repeat(64));
        assert!(validate(&long_name).unwrap_err().reason.contains("63"));
        assert!(validate(&format!("example.com/{}", "a".repeat(63))).is_ok());
        // "requests." + prefix must stay within 253 characters.
        let prefix = format!("{}.com", "a".repeat(240));
        assert_eq!(prefix.len(), 244);
        assert!(validate(&format!("{prefix}/x")).is_err() == (prefix.len() > 244));
        let label = "a".repeat(60);
        let prefix = [label.as_str(); 5].join(".");
        assert!(validate(&format!("{prefix}/x"))
            .unwrap_err()
            .reason
            .contains("244"));
    }

    #[test]
    fn error_names_the_fix() {
        let err = validate("gpu").unwrap_err().to_string();
        assert!(err.contains("\"gpu\""), "{err}");
        assert!(err.contains("vendor.example/device"), "{err}");
    }
}
