//! Which refused pods are ours, and what to do with each: pure functions of the Pod object, so
//! that every rule is a unit test.
//!
//! The kubelet refuses a pod at admission when its device manager cannot allocate the pod's
//! devices (`devicesToAllocate` in `pkg/kubelet/cm/devicemanager/manager.go`); the pod becomes
//! terminal: `status.phase: Failed`, `status.reason: UnexpectedAdmissionError` and a message
//! `Allocate failed due to <the device manager's error>, which is unexpected`. Its errors name
//! the resource last: `cannot allocate unregistered device R`, `no healthy devices present;
//! cannot allocate unhealthy devices R`, `previously allocated devices are no longer healthy;
//! cannot allocate unhealthy devices R`, `requested number of devices unavailable for R.
//! Requested: …`. After a node reboot the first three are what a device plugin run as a
//! DaemonSet leaves behind: the kubelet admits every pod before the plugin's pod runs again.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use std::collections::BTreeSet;

/// `status.reason` of a pod the kubelet refused at admission for an unexpected error.
pub const REFUSED_REASON: &str = "UnexpectedAdmissionError";

/// The device manager's errors, each followed by the resource's name.
/// (`no healthy devices present; …` and `previously allocated devices are no longer healthy;
/// …` both end in the second.)
const DEVICE_MANAGER_ERRORS: [&str; 3] = [
    "cannot allocate unregistered device ",
    "cannot allocate unhealthy devices ",
    "requested number of devices unavailable for ",
];

/// A pod's controller, from its owner reference with `controller: true`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Controller {
    /// Its kind, e.g. `ReplicaSet`.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its UID: a replacement pod carries the same one.
    pub uid: String,
}

/// What to do with a pod the watch saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not a pod refused for a resource we serve (or already being deleted): never touched.
    Ignore(&'static str),
    /// Refused for `resource`; its controller (a ReplicaSet or ReplicationController) creates a
    /// replacement, as it counts only pods that are not terminal: delete the refused one once
    /// the replacement exists.
    DeleteWhenReplaced {
        /// The resource the kubelet named.
        resource: String,
        /// The controller whose replacement is awaited.
        controller: Controller,
    },
    /// Refused for `resource`; its controller (a StatefulSet or DaemonSet) deletes a failed pod
    /// and creates it again itself: deleting it at once does what the controller would.
    Delete {
        /// The resource the kubelet named.
        resource: String,
        /// The controller that makes the pod again.
        controller: Controller,
    },
    /// Refused for `resource`, and nothing makes it again (a bare pod; a Job's pod, a counted
    /// failure of its Job; a controller of a kind we do not know): reported, never deleted.
    Report {
        /// The resource the kubelet named.
        resource: String,
        /// What owns it, if anything.
        controller: Option<Controller>,
    },
}

/// The resource a refused pod's message names, if the pod is one the kubelet refused at
/// admission for a device manager error.
pub fn refused_resource(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Failed") || status.reason.as_deref() != Some(REFUSED_REASON)
    {
        return None;
    }
    let message = status.message.as_deref()?;
    DEVICE_MANAGER_ERRORS.iter().find_map(|error| {
        let (_, rest) = message.split_once(error)?;
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '/' | '-' | '_'))
            .collect();
        // "…unavailable for R. Requested: 2": a resource name never ends in a dot.
        let name = name.trim_end_matches('.');
        (!name.is_empty()).then(|| name.to_owned())
    })
}

/// Whether some container of the pod (init containers too) asks for `resource`.
fn requests(pod: &Pod, resource: &str) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .any(|r| {
            r.limits.as_ref().is_some_and(|l| l.contains_key(resource))
                || r.requests
                    .as_ref()
                    .is_some_and(|l| l.contains_key(resource))
        })
}

/// The pod's controller (the owner reference with `controller: true`).
pub fn controller(pod: &Pod) -> Option<Controller> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o: &&OwnerReference| o.controller == Some(true))
        .map(|o| Controller {
            kind: o.kind.clone(),
            name: o.name.clone(),
            uid: o.uid.clone(),
        })
}

/// What to do with `pod`, when the resources this devplug serves are `served`.
pub fn classify(pod: &Pod, served: &BTreeSet<String>) -> Verdict {
    if pod.metadata.deletion_timestamp.is_some() {
        return Verdict::Ignore("already being deleted");
    }
    let Some(resource) = refused_resource(pod) else {
        return Verdict::Ignore("not refused at admission by the device manager");
    };
    if !served.contains(&resource) {
        return Verdict::Ignore("refused for a resource this devplug does not serve");
    }
    // The message names the resource; the pod must really ask for it.
    if !requests(pod, &resource) {
        return Verdict::Ignore("the pod does not ask for the resource its refusal names");
    }
    match controller(pod) {
        Some(c) if matches!(c.kind.as_str(), "ReplicaSet" | "ReplicationController") => {
            Verdict::DeleteWhenReplaced {
                resource,
                controller: c,
            }
        }
        Some(c) if matches!(c.kind.as_str(), "StatefulSet" | "DaemonSet") => Verdict::Delete {
            resource,
            controller: c,
        },
        controller => Verdict::Report {
            resource,
            controller,
        },
    }
}

/// Whether `candidate` replaces `refused`: another pod of the same controller that is neither
/// terminal nor being deleted.
pub fn replaces(candidate: &Pod, refused: &Pod, by: &Controller) -> bool {
    candidate.metadata.uid != refused.metadata.uid
        && candidate.metadata.deletion_timestamp.is_none()
        && !matches!(
            candidate.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed" | "Succeeded")
        )
        && controller(candidate).is_some_and(|c| c.uid == by.uid)
}

/// What would have kept a reported pod, for its events.
pub const HOW_TO_KEEP: &str = "run devplug as a host service started before the kubelet \
     (deploy/systemd), or serve the resource through DRA (a DeviceClass with \
     extendedResourceName keeps `limits:` pods unchanged); the kubelet waits for a DRA driver";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn served() -> BTreeSet<String> {
        ["example.com/npu".to_owned()].into()
    }

    fn pod(message: &str, owner: Option<(&str, &str)>, resource: &str) -> Pod {
        let owners: Vec<_> = owner
            .into_iter()
            .map(|(kind, uid)| {
                json!({"apiVersion": "apps/v1", "kind": kind, "name": "owner", "uid": uid,
                       "controller": true})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "ownerReferences": owners},
            "spec": {"nodeName": "n", "containers": [{"name": "c", "image": "i",
                "resources": {"limits": {resource: "1"}}}]},
            "status": {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                       "message": message}
        }))
        .unwrap()
    }

    const UNREGISTERED: &str = "Allocate failed due to cannot allocate unregistered device \
                                example.com/npu, which is unexpected";

    #[test]
    fn each_device_manager_error_names_its_resource() {
        for (message, want) in [
            (UNREGISTERED, "example.com/npu"),
            (
                "Allocate failed due to no healthy devices present; cannot allocate unhealthy \
                 devices example.com/npu, which is unexpected",
                "example.com/npu",
            ),
            (
                "Allocate failed due to previously allocated devices are no longer healthy; \
                 cannot allocate unhealthy devices vendor.example/gpu-mem, which is unexpected",
                "vendor.example/gpu-mem",
            ),
            (
                "Allocate failed due to requested number of devices unavailable for \
                 example.com/npu. Requested: 2, Available: 1, which is unexpected",
                "example.com/npu",
            ),
        ] {
            assert_eq!(
                refused_resource(&pod(message, None, want)).as_deref(),
                Some(want),
                "{message}"
            );
        }
    }

    #[test]
    fn a_replica_set_pod_is_deleted_once_replaced() {
        let p = pod(UNREGISTERED, Some(("ReplicaSet", "rs1")), "example.com/npu");
        let Verdict::DeleteWhenReplaced {
            resource,
            controller,
        } = classify(&p, &served())
        else {
            panic!("{:?}", classify(&p, &served()));
        };
        assert_eq!(resource, "example.com/npu");
        assert_eq!(controller.uid, "rs1");
    }

    #[test]
    fn stateful_set_and_daemon_set_pods_are_deleted_as_their_controllers_would() {
        for kind in ["StatefulSet", "DaemonSet"] {
            let p = pod(UNREGISTERED, Some((kind, "o1")), "example.com/npu");
            assert!(
                matches!(classify(&p, &served()), Verdict::Delete { .. }),
                "{kind}"
            );
        }
    }

    #[test]
    fn bare_job_and_unknown_controller_pods_are_only_reported() {
        for owner in [None, Some(("Job", "j1")), Some(("TrainingRun", "t1"))] {
            let p = pod(UNREGISTERED, owner, "example.com/npu");
            assert!(
                matches!(classify(&p, &served()), Verdict::Report { .. }),
                "{owner:?}: {:?}",
                classify(&p, &served())
            );
        }
    }

    #[test]
    fn a_pod_refused_for_another_plugins_resource_is_never_touched() {
        let message = UNREGISTERED.replace("example.com/npu", "nvidia.com/gpu");
        let p = pod(&message, Some(("ReplicaSet", "rs1")), "nvidia.com/gpu");
        assert_eq!(
            classify(&p, &served()),
            Verdict::Ignore("refused for a resource this devplug does not serve")
        );
        // A resource whose name starts like ours is another resource.
        let message = UNREGISTERED.replace("example.com/npu", "example.com/npu-large");
        let p = pod(&message, None, "example.com/npu-large");
        assert!(matches!(classify(&p, &served()), Verdict::Ignore(_)));
    }

    #[test]
    fn other_failures_running_pods_and_pods_being_deleted_are_never_touched() {
        let mut p = pod(UNREGISTERED, Some(("ReplicaSet", "rs1")), "example.com/npu");
        p.status.as_mut().unwrap().reason = Some("OutOfcpu".into());
        assert!(matches!(classify(&p, &served()), Verdict::Ignore(_)));
        let mut p = pod(UNREGISTERED, None, "example.com/npu");
        p.status.as_mut().unwrap().phase = Some("Running".into());
        assert!(matches!(classify(&p, &served()), Verdict::Ignore(_)));
        let mut p = pod("container exited with code 1", None, "example.com/npu");
        p.status.as_mut().unwrap().reason = Some("Error".into());
        assert!(matches!(classify(&p, &served()), Verdict::Ignore(_)));
        let mut p = pod(UNREGISTERED, None, "example.com/npu");
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert_eq!(
            classify(&p, &served()),
            Verdict::Ignore("already being deleted")
        );
    }

    #[test]
    fn a_message_naming_our_resource_for_a_pod_that_does_not_ask_for_it_is_ignored() {
        let p = pod(UNREGISTERED, None, "example.com/other");
        assert_eq!(
            classify(&p, &served()),
            Verdict::Ignore("the pod does not ask for the resource its refusal names")
        );
    }

    #[test]
    fn a_replacement_is_a_live_pod_of_the_same_controller() {
        let refused = pod(UNREGISTERED, Some(("ReplicaSet", "rs1")), "example.com/npu");
        let by = controller(&refused).unwrap();
        let mut other = refused.clone();
        other.metadata.uid = Some("u2".into());
        other.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(replaces(&other, &refused, &by));
        assert!(!replaces(&refused, &refused, &by), "not itself");
        let mut failed_too = other.clone();
        failed_too.status.as_mut().unwrap().phase = Some("Failed".into());
        assert!(
            !replaces(&failed_too, &refused, &by),
            "not another refused one"
        );
        let foreign = pod(UNREGISTERED, Some(("ReplicaSet", "rs2")), "example.com/npu");
        let mut foreign = foreign;
        foreign.metadata.uid = Some("u3".into());
        foreign.status.as_mut().unwrap().phase = Some("Running".into());
        assert!(
            !replaces(&foreign, &refused, &by),
            "not another controller's"
        );
    }
}
