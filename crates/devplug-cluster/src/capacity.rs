//! Extended resources on a Node's status: set, remove and list
//! with JSON patches on `nodes/status`, the way `kubectl patch --subresource=status --type=json`
//! does it. Resource names go into RFC 6901 pointers (`/` → `~1`, `~` → `~0`).
//!
//! A resource set here is a *cluster-level* extended resource: no device plugin backs it, the
//! scheduler only counts it. Removing one also clears what the kubelet leaves for a device
//! plugin that is gone (capacity `0`, kept forever, kubernetes#52510).

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::Api;
use std::collections::BTreeMap;

/// Why a capacity change failed.
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// The API server refused or could not be reached.
    #[error("{action} on node {node}: {source}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// The node.
        node: String,
        /// The error.
        #[source]
        source: kube::Error,
    },
    /// The resource name is not an extended resource name.
    #[error("{0:?} is not an extended resource name (it needs a domain, e.g. example.com/dongle, outside kubernetes.io/)")]
    NotExtended(String),
    /// Someone else kept changing the resource while we removed it.
    #[error("{0:?} on node {1} kept changing while being removed; try again")]
    Races(String, String),
    /// The JSON patch could not be built (a bug).
    #[error("cannot build the JSON patch: {0}")]
    Patch(#[from] serde_json::Error),
}

/// What [`remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// The key was there and is gone now.
    Removed,
    /// The key was not there: nothing to do.
    AlreadyGone,
}

/// One extended resource on a node: what its status says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeResource {
    /// `status.capacity[name]`, if present.
    pub capacity: Option<String>,
    /// `status.allocatable[name]`, if present.
    pub allocatable: Option<String>,
}

/// `name` escaped for a JSON pointer (RFC 6901): `~` → `~0`, then `/` → `~1`.
pub fn escape_pointer(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// Whether `name` looks like an extended resource name (a domain prefix and a name, outside
/// `kubernetes.io/`). The API server checks the rest (characters, lengths) and says what is wrong.
pub fn check_name(name: &str) -> Result<(), CapacityError> {
    let extended = name
        .split_once('/')
        .is_some_and(|(domain, rest)| !domain.is_empty() && !rest.is_empty())
        && !name.contains("kubernetes.io/");
    if extended {
        Ok(())
    } else {
        Err(CapacityError::NotExtended(name.to_owned()))
    }
}

fn api_error(action: &'static str, node: &str) -> impl FnOnce(kube::Error) -> CapacityError {
    let node = node.to_owned();
    move |source| CapacityError::Api {
        action,
        node,
        source,
    }
}

/// Extended resources (names with a `/`) in a node's status, by name.
pub fn extended_resources(node: &Node) -> BTreeMap<String, NodeResource> {
    let mut out: BTreeMap<String, NodeResource> = BTreeMap::new();
    let Some(status) = &node.status else {
        return out;
    };
    let is_extended = |k: &String| k.contains('/') && !k.contains("kubernetes.io/");
    for (k, v) in status
        .capacity
        .iter()
        .flatten()
        .filter(|(k, _)| is_extended(k))
    {
        out.entry(k.clone()).or_default().capacity = Some(v.0.clone());
    }
    for (k, v) in status
        .allocatable
        .iter()
        .flatten()
        .filter(|(k, _)| is_extended(k))
    {
        out.entry(k.clone()).or_default().allocatable = Some(v.0.clone());
    }
    out
}

/// The extended resources of `node`.
pub async fn list(
    api: &Api<Node>,
    node: &str,
) -> Result<BTreeMap<String, NodeResource>, CapacityError> {
    let found = crate::timed(api.get_status(node))
        .await
        .map_err(api_error("get", node))?;
    Ok(extended_resources(&found))
}

/// Sets capacity and allocatable of `resource` on `node` to `count` (adds or replaces).
pub async fn set(
    api: &Api<Node>,
    node: &str,
    resource: &str,
    count: u64,
) -> Result<(), CapacityError> {
    check_name(resource)?;
    let current = crate::timed(api.get_status(node))
        .await
        .map_err(api_error("get", node))?;
    let status = current.status.unwrap_or_default();
    let key = escape_pointer(resource);
    let value = serde_json::Value::String(count.to_string());
    let mut ops = Vec::new();
    // An `add` below a missing map fails: create the map first.
    for (field, map) in [
        ("capacity", &status.capacity),
        ("allocatable", &status.allocatable),
    ] {
        if map.is_none() {
            ops.push(
                serde_json::json!({"op": "add", "path": format!("/status/{field}"), "value": {}}),
            );
        }
        ops.push(serde_json::json!({"op": "add", "path": format!("/status/{field}/{key}"), "value": value}));
    }
    let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))?;
    crate::timed(api.patch_status(node, &PatchParams::default(), &Patch::Json::<()>(patch)))
        .await
        .map_err(api_error("patch status", node))?;
    Ok(())
}

/// Removes `resource` from `node`'s capacity and allocatable. A key that is not there is
/// [`Removed::AlreadyGone`], not an error; a key removed by someone else between our read and
/// our patch (the API server answers 422 to a `remove` of a missing path) is read again.
pub async fn remove(api: &Api<Node>, node: &str, resource: &str) -> Result<Removed, CapacityError> {
    check_name(resource)?;
    let key = escape_pointer(resource);
    for _ in 0..3 {
        let current = crate::timed(api.get_status(node))
            .await
            .map_err(api_error("get", node))?;
        let present = extended_resources(&current)
            .remove(resource)
            .unwrap_or_default();
        let mut ops = Vec::new();
        if present.capacity.is_some() {
            ops.push(
                serde_json::json!({"op": "remove", "path": format!("/status/capacity/{key}")}),
            );
        }
        if present.allocatable.is_some() {
            ops.push(
                serde_json::json!({"op": "remove", "path": format!("/status/allocatable/{key}")}),
            );
        }
        if ops.is_empty() {
            return Ok(Removed::AlreadyGone);
        }
        let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops))?;
        match crate::timed(api.patch_status(
            node,
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        ))
        .await
        {
            Ok(_) => return Ok(Removed::Removed),
            Err(kube::Error::Api(status)) if status.code == 422 => continue,
            Err(err) => return Err(api_error("patch status", node)(err)),
        }
    }
    Err(CapacityError::Races(resource.to_owned(), node.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_escape_tilde_then_slash() {
        assert_eq!(escape_pointer("example.com/dongle"), "example.com~1dongle");
        assert_eq!(escape_pointer("a~b.example/c~1"), "a~0b.example~1c~01");
    }

    #[test]
    fn only_extended_names_pass() {
        assert!(check_name("example.com/dongle").is_ok());
        for bad in [
            "dongle",
            "/x",
            "example.com/",
            "kubernetes.io/x",
            "x.kubernetes.io/y",
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}

/// The clean-uninstall recipe's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanOptions {
    /// How long to wait for the kubelet to report the resource at 0 (capacity and allocatable):
    /// the device plugin gone and its 5-minute grace over.
    pub wait_for_zero: std::time::Duration,
    /// After removing, how long to wait before checking that the kubelet did not put it back
    /// (after a kubelet restart a checkpointed resource comes back for another grace period).
    pub recheck_after: std::time::Duration,
    /// How many times to remove it at most.
    pub attempts: u32,
}

impl Default for CleanOptions {
    fn default() -> Self {
        CleanOptions {
            wait_for_zero: std::time::Duration::from_secs(600),
            recheck_after: std::time::Duration::from_secs(60),
            attempts: 3,
        }
    }
}

/// What [`clean`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanReport {
    /// How many removals were made (0: it was already gone).
    pub removals: u32,
    /// How many times the kubelet put it back after a removal.
    pub came_back: u32,
}

/// Why [`clean`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum CleanError {
    /// An API call failed.
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// The resource did not reach 0 in time.
    #[error("{resource} on node {node} still reads capacity {capacity:?}, allocatable {allocatable:?} after {waited:?}: a device plugin still serves it, or its 5-minute grace period at the kubelet is not over")]
    NotZero {
        /// The resource.
        resource: String,
        /// The node.
        node: String,
        /// Its capacity.
        capacity: Option<String>,
        /// Its allocatable.
        allocatable: Option<String>,
        /// How long we waited.
        waited: std::time::Duration,
    },
    /// It came back after every removal.
    #[error("{resource} on node {node} came back after each of {attempts} removals (a kubelet still has it in its checkpoint?)")]
    KeepsComingBack {
        /// The resource.
        resource: String,
        /// The node.
        node: String,
        /// Removals made.
        attempts: u32,
    },
}

fn is_zero(value: &Option<String>) -> bool {
    value.as_deref().is_none_or(|v| v == "0")
}

/// The clean-uninstall recipe for a device plugin's resource that the kubelet keeps at 0
/// forever: wait until capacity and allocatable read 0 (the plugin is gone
/// and its grace is over, so no new pod can get the devices), remove the keys, check again after
/// [`CleanOptions::recheck_after`], and repeat at most [`CleanOptions::attempts`] times.
pub async fn clean(
    api: &Api<Node>,
    node: &str,
    resource: &str,
    options: CleanOptions,
) -> Result<CleanReport, CleanError> {
    check_name(resource)?;
    let mut report = CleanReport {
        removals: 0,
        came_back: 0,
    };
    loop {
        // 1. Wait for 0 (polling the node; the wait is minutes, the poll every 2 s).
        let started = tokio::time::Instant::now();
        loop {
            let now = list(api, node).await?.remove(resource);
            let Some(present) = now else {
                if report.removals == 0 {
                    return Ok(report);
                }
                break;
            };
            if is_zero(&present.capacity) && is_zero(&present.allocatable) {
                break;
            }
            if started.elapsed() >= options.wait_for_zero {
                return Err(CleanError::NotZero {
                    resource: resource.to_owned(),
                    node: node.to_owned(),
                    capacity: present.capacity,
                    allocatable: present.allocatable,
                    waited: options.wait_for_zero,
                });
            }
            let left = options.wait_for_zero.saturating_sub(started.elapsed());
            tokio::time::sleep(left.min(std::time::Duration::from_secs(2))).await;
        }
        // 2. Remove, unless it is gone already (after a re-check).
        if report.removals >= options.attempts {
            return Err(CleanError::KeepsComingBack {
                resource: resource.to_owned(),
                node: node.to_owned(),
                attempts: report.removals,
            });
        }
        if remove(api, node, resource).await? == Removed::Removed {
            report.removals += 1;
        }
        // 3. Check again later: a kubelet restart re-adds checkpointed resources.
        tokio::time::sleep(options.recheck_after).await;
        if list(api, node).await?.contains_key(resource) {
            report.came_back += 1;
            tracing::warn!(%resource, %node, "the resource came back after removal; removing it again");
            continue;
        }
        return Ok(report);
    }
}
