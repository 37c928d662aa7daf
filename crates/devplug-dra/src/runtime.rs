//! Whether this node's container runtime applies CDI specs, from its Node's
//! `status.nodeInfo.containerRuntimeVersion`. A DRA driver hands its devices to containers
//! only through the CDI spec of each prepared claim; a runtime that does not read CDI runs the
//! pod without them and says nothing, so the driver says it instead.
//!
//! CDI arrived in containerd 1.7 (off unless `enable_cdi = true`; on by default from 2.0) and
//! CRI-O 1.23 (on by default). Other runtimes are not judged.

use k8s_openapi::api::core::v1::Node;
use kube::Api;

/// What the runtime's version says about CDI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CdiSupport {
    /// The runtime applies CDI specs by default.
    Yes,
    /// It can, if configured (containerd 1.7: `enable_cdi = true`).
    IfEnabled(String),
    /// It cannot: DRA claims reach no container here.
    No(String),
    /// A runtime this check does not know.
    Unknown,
}

/// `major.minor` of a version such as `1.6.20`, `v1.7.0-rc.1` or `2.2.7+unknown`.
fn major_minor(version: &str) -> Option<(u64, u64)> {
    let mut parts = version.trim_start_matches('v').split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Judges a `containerRuntimeVersion` (`containerd://1.6.20`, `cri-o://1.30.2`).
pub fn cdi_support(runtime_version: &str) -> CdiSupport {
    let Some((runtime, version)) = runtime_version.split_once("://") else {
        return CdiSupport::Unknown;
    };
    let Some(at) = major_minor(version) else {
        return CdiSupport::Unknown;
    };
    match runtime {
        "containerd" if at < (1, 7) => CdiSupport::No(format!(
            "the container runtime is {runtime_version}, which cannot apply CDI specs \
             (containerd 1.7 or newer can): pods get their claims prepared but none of their \
             devices"
        )),
        "containerd" if at < (2, 0) => CdiSupport::IfEnabled(format!(
            "the container runtime is {runtime_version}: it applies CDI specs only with \
             enable_cdi = true (and cdi_spec_dirs naming this driver's folder) in its CRI plugin \
             config"
        )),
        "containerd" => CdiSupport::Yes,
        "cri-o" if at < (1, 23) => CdiSupport::No(format!(
            "the container runtime is {runtime_version}, which cannot apply CDI specs \
             (CRI-O 1.23 or newer can): pods get their claims prepared but none of their devices"
        )),
        "cri-o" => CdiSupport::Yes,
        _ => CdiSupport::Unknown,
    }
}

/// Reads this node's runtime version and judges it; an error is the API server's. A list by
/// name, not a get: the driver's RBAC lets it list and watch Nodes (for the slices' owner
/// reference) and no more.
pub async fn node_cdi_support(
    client: kube::Client,
    node: &str,
) -> Result<(String, CdiSupport), kube::Error> {
    let params = kube::api::ListParams::default().fields(&format!("metadata.name={node}"));
    let list = Api::<Node>::all(client).list(&params).await?;
    let version = list
        .items
        .into_iter()
        .next()
        .and_then(|n| n.status)
        .and_then(|s| s.node_info)
        .map(|i| i.container_runtime_version)
        .unwrap_or_default();
    let support = cdi_support(&version);
    Ok((version, support))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_that_cannot_or_may_not_apply_cdi_are_named() {
        assert!(
            matches!(cdi_support("containerd://1.6.20"), CdiSupport::No(m) if m.contains("containerd://1.6.20"))
        );
        assert!(matches!(
            cdi_support("containerd://1.7.27"),
            CdiSupport::IfEnabled(m) if m.contains("enable_cdi = true")
        ));
        assert_eq!(cdi_support("containerd://2.2.7"), CdiSupport::Yes);
        assert_eq!(cdi_support("containerd://v2.0.0-rc.1"), CdiSupport::Yes);
        assert!(matches!(cdi_support("cri-o://1.22.5"), CdiSupport::No(_)));
        assert_eq!(cdi_support("cri-o://1.30.2"), CdiSupport::Yes);
        assert_eq!(cdi_support("docker://27.0.1"), CdiSupport::Unknown);
        assert_eq!(cdi_support(""), CdiSupport::Unknown);
        assert_eq!(cdi_support("containerd://x.y"), CdiSupport::Unknown);
    }
}
