//! Whether the admission policy that keeps a cluster feature to its own node is in force.
//!
//! RBAC grants a verb on a kind; the chart's ValidatingAdmissionPolicies narrow each feature's
//! writes to the node its token was issued on and the fields the feature owns. A policy whose
//! binding is missing (deleted, or created after the DaemonSet) limits nothing, and the API
//! server does not say so. So before a feature writes, devplug asks: a server-side dry run of a
//! write the policy must refuse. The dry run goes through admission like the real write and
//! changes nothing. Refused by a ValidatingAdmissionPolicy: [`PolicyState::InForce`]. Accepted:
//! [`PolicyState::Missing`], the feature must not run where policies are required. Anything
//! else (the API server unreachable, the kind not installed): [`PolicyState::Unknown`], asked
//! again later.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::Api;
use std::sync::Arc;
use std::time::Duration;

/// The label key and capacity name the probes write: under a domain no one owns.
pub const PROBE_KEY: &str = "devplug.invalid/policy-probe";
/// The node and driver of the ResourceSlice the DRA probe writes: names no node or driver has.
pub const PROBE_NODE: &str = "devplug-policy-probe.invalid";
/// See [`PROBE_NODE`].
pub const PROBE_DRIVER: &str = "devplug-policy-probe.invalid";
/// How long one probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyState {
    /// The write that must be refused was refused by an admission policy.
    InForce,
    /// The write that must be refused was accepted: nothing limits this token.
    Missing(String),
    /// The probe could not tell (the reason).
    Unknown(String),
}

impl PolicyState {
    /// Whether the policy is known to be in force.
    pub fn in_force(&self) -> bool {
        matches!(self, PolicyState::InForce)
    }
}

/// The features a probe exists for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// `advertise:` resources on the Node's status.
    Advertise,
    /// Node labels on the Node (`node_labels: direct`).
    NodeLabels,
    /// Node labels in a NodeFeature object (`node_labels: node-feature`).
    NodeFeatures,
    /// Deleting pods refused at admission (`refused_pods: delete-replaced`).
    RefusedPods,
    /// The uninstall Job removing resources and labels from every Node.
    Uninstall,
    /// A DRA driver's ResourceSlices (`dra:` resources).
    DraSlices,
}

impl Feature {
    /// The name used in logs, events, metrics and `/readyz`.
    pub fn name(self) -> &'static str {
        match self {
            Feature::Advertise => "advertise",
            Feature::NodeLabels => "node_labels",
            Feature::NodeFeatures => "node_labels (node-feature)",
            Feature::RefusedPods => "refused_pods",
            Feature::Uninstall => "uninstall",
            Feature::DraSlices => "dra_slices",
        }
    }

    /// What an operator does when the policy is missing.
    pub fn fix(self) -> &'static str {
        match self {
            Feature::Advertise => {
                "the chart's ValidatingAdmissionPolicy and binding <release>-advertise"
            }
            Feature::NodeLabels => {
                "the chart's ValidatingAdmissionPolicy and binding <release>-node-labels"
            }
            Feature::NodeFeatures => {
                "the chart's ValidatingAdmissionPolicy and binding <release>-node-features"
            }
            Feature::RefusedPods => {
                "the chart's ValidatingAdmissionPolicy and binding <release>-refused-pods"
            }
            Feature::Uninstall => {
                "the chart's ValidatingAdmissionPolicy and binding <release>-uninstall (hooks)"
            }
            Feature::DraSlices => {
                "the chart's ValidatingAdmissionPolicy and binding <release>-dra-slices"
            }
        }
    }
}

/// What one node's devplug needs to probe: its client and node, and where it runs.
#[derive(Clone)]
pub struct Probe {
    /// The feature's client (its token).
    pub client: kube::Client,
    /// This node.
    pub node: String,
    /// The namespace of devplug's pod (NodeFeature objects live there).
    pub namespace: String,
    /// devplug's own pod (`POD_NAME`), the one pod the refused-pods probe may aim a delete at.
    pub pod: Option<String>,
}

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probe")
            .field("node", &self.node)
            .field("namespace", &self.namespace)
            .field("pod", &self.pod)
            .finish_non_exhaustive()
    }
}

/// Whether `error` is a refusal by a ValidatingAdmissionPolicy (the API server's message names
/// the policy and its binding: `ValidatingAdmissionPolicy '<p>' with binding '<b>' denied
/// request: …`).
pub fn refused_by_policy(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(e) => {
            e.message.contains("ValidatingAdmissionPolicy") && e.message.contains("denied request")
        }
        _ => false,
    }
}

fn dry_run() -> PatchParams {
    PatchParams {
        dry_run: true,
        ..PatchParams::default()
    }
}

/// The state a probe's answer shows.
fn state_of<T>(
    accepted: &str,
    answer: Result<Result<T, kube::Error>, tokio::time::error::Elapsed>,
) -> PolicyState {
    match answer {
        Err(_) => PolicyState::Unknown(format!(
            "the API server did not answer within {} s",
            PROBE_TIMEOUT.as_secs()
        )),
        Ok(Ok(_)) => PolicyState::Missing(format!(
            "the API server accepted {accepted} (a dry run): no admission policy limits this token"
        )),
        Ok(Err(err)) if refused_by_policy(&err) => PolicyState::InForce,
        Ok(Err(err)) => PolicyState::Unknown(format!("the probe failed: {err}")),
    }
}

impl Probe {
    /// Probes `feature`'s policy once.
    pub async fn check(&self, feature: Feature) -> PolicyState {
        match feature {
            Feature::Advertise => self.advertise().await,
            Feature::NodeLabels => self.node_labels().await,
            Feature::NodeFeatures => self.node_features().await,
            Feature::RefusedPods => self.refused_pods().await,
            Feature::Uninstall => self.uninstall().await,
            Feature::DraSlices => self.dra_slices().await,
        }
    }

    /// A ResourceSlice of another node, of a driver no config names (created as a dry run).
    async fn dra_slices(&self) -> PolicyState {
        let slices: Api<ResourceSlice> = Api::all(self.client.clone());
        let slice: Result<ResourceSlice, _> = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "devplug-policy-probe"},
            "spec": {
                "driver": PROBE_DRIVER,
                "nodeName": PROBE_NODE,
                "pool": {"name": PROBE_NODE, "generation": 0, "resourceSliceCount": 1},
                "devices": [],
            },
        }));
        let slice = match slice {
            Ok(slice) => slice,
            Err(err) => return PolicyState::Unknown(format!("the probe's slice: {err}")),
        };
        let params = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let answer = tokio::time::timeout(PROBE_TIMEOUT, slices.create(&params, &slice)).await;
        state_of("a ResourceSlice of another node and driver", answer)
    }

    /// A label added to a Node through its status (the uninstall only ever removes; its role
    /// always has `nodes/status`).
    async fn uninstall(&self) -> PolicyState {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = serde_json::json!({"metadata": {"labels": {"nvidia.com/devplug-policy-probe": "added"}}});
        let answer = tokio::time::timeout(
            PROBE_TIMEOUT,
            nodes.patch_status(&self.node, &dry_run(), &Patch::Merge(&patch)),
        )
        .await;
        state_of("a label added to a Node", answer)
    }

    /// A capacity devplug does not advertise, on its own Node's status.
    async fn advertise(&self) -> PolicyState {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = serde_json::json!({"status": {
            "capacity": {PROBE_KEY: "1"},
            "allocatable": {PROBE_KEY: "1"},
        }});
        let answer = tokio::time::timeout(
            PROBE_TIMEOUT,
            nodes.patch_status(&self.node, &dry_run(), &Patch::Merge(&patch)),
        )
        .await;
        state_of(
            "a capacity outside the advertise: resources on the Node's status",
            answer,
        )
    }

    /// A label outside the vendors' prefixes on its own Node.
    async fn node_labels(&self) -> PolicyState {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = serde_json::json!({"metadata": {"labels": {PROBE_KEY: "refused"}}});
        let answer = tokio::time::timeout(
            PROBE_TIMEOUT,
            nodes.patch(&self.node, &dry_run(), &Patch::Merge(&patch)),
        )
        .await;
        state_of("a label outside the vendors' prefixes on the Node", answer)
    }

    /// A NodeFeature object under another name than its node's.
    async fn node_features(&self) -> PolicyState {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("nfd.k8s-sigs.io", "v1alpha1", "NodeFeature"),
            "nodefeatures",
        );
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.namespace, &resource);
        let object = DynamicObject::new("devplug-policy-probe", &resource)
            .within(&self.namespace)
            .data(serde_json::json!({"spec": {"labels": {}}}));
        let mut object = object;
        object.metadata.labels = Some(
            [(
                crate::node_labels::NFD_NODE_LABEL.to_owned(),
                self.node.clone(),
            )]
            .into_iter()
            .collect(),
        );
        let params = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let answer = tokio::time::timeout(PROBE_TIMEOUT, api.create(&params, &object)).await;
        state_of("a NodeFeature object named after no node", answer)
    }

    /// A delete of devplug's own pod, which is running (not refused at admission).
    async fn refused_pods(&self) -> PolicyState {
        let Some(pod) = &self.pod else {
            return PolicyState::Unknown(
                "devplug's own pod is not known (POD_NAME), so there is no pod to aim the probe at"
                    .to_owned(),
            );
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let params = DeleteParams {
            dry_run: true,
            ..DeleteParams::default()
        };
        let answer = tokio::time::timeout(PROBE_TIMEOUT, pods.delete(pod, &params)).await;
        state_of("deleting devplug's own running pod", answer)
    }
}

/// The first wait between two probes of a policy not (yet) in force; doubling, jittered. Short:
/// a chart install creates the policies with the DaemonSet, and the API server enforces a new
/// policy only once it has loaded it, a second or two later, so a first probe often finds it
/// missing (with 5 s here, a new DRA driver's first slice came 5.7 s after the install on the
/// whole node, against 0.8 s without the gate).
pub const REPROBE_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two probes.
pub const REPROBE_MAX: Duration = Duration::from_secs(300);

/// Told each state a probe finds (for the log, `/readyz`, metrics and events).
pub type Report = Arc<dyn Fn(Feature, &PolicyState) + Send + Sync>;

/// What a cluster feature passes before its first write.
#[derive(Clone)]
pub struct Gate {
    /// The probe, with the feature's client.
    pub probe: Probe,
    /// Whether the feature may run only with its policy in force (the chart's installs); when
    /// not, a policy not found in force is reported and the feature runs all the same.
    pub required: bool,
    /// Told each state found.
    pub report: Report,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("probe", &self.probe)
            .field("required", &self.required)
            .finish_non_exhaustive()
    }
}

impl Gate {
    /// Returns once `feature` may write: its policy is in force, or it is not required. Where it
    /// is required and not (yet) in force, probes again after a jittered wait growing from
    /// [`REPROBE_FIRST`] to [`REPROBE_MAX`], for as long as it takes (the caller cancels).
    pub async fn pass(&self, feature: Feature) {
        let mut wait = devplug::host::backoff::Backoff::new(REPROBE_FIRST, REPROBE_MAX).jittered();
        loop {
            let state = self.probe.check(feature).await;
            (self.report)(feature, &state);
            if state.in_force() || !self.required {
                return;
            }
            tokio::time::sleep(wait.next_delay()).await;
        }
    }
}

/// Waits up to `timeout` for `feature`'s policy to be found in force (a policy just created is
/// in force once the API server has loaded it, within a second or two); the last state found.
pub async fn wait_in_force(probe: &Probe, feature: Feature, timeout: Duration) -> PolicyState {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let state = probe.check(feature).await;
        if state.in_force() || tokio::time::Instant::now() >= deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `gate`, if any, passed for `feature`; false when `stop` came first.
pub async fn pass(
    gate: Option<&Gate>,
    feature: Feature,
    stop: &tokio_util::sync::CancellationToken,
) -> bool {
    let Some(gate) = gate else {
        return true;
    };
    tokio::select! {
        () = stop.cancelled() => false,
        () = gate.pass(feature) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Invalid")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn only_an_admission_policy_refusal_counts_as_in_force() {
        let refusal = api_error(
            422,
            "nodes \"a\" is forbidden: ValidatingAdmissionPolicy 'devplug-node-labels' with \
             binding 'devplug-node-labels' denied request: devplug may change only labels",
        );
        assert_eq!(state_of::<()>("x", Ok(Err(refusal))), PolicyState::InForce);
        let rbac = api_error(403, "nodes \"a\" is forbidden: User cannot patch resource");
        assert!(matches!(
            state_of::<()>("x", Ok(Err(rbac))),
            PolicyState::Unknown(_)
        ));
        assert!(matches!(
            state_of("x", Ok(Ok(()))),
            PolicyState::Missing(m) if m.contains("accepted x")
        ));
    }
}
