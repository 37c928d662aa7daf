//! What `devplug run`'s cluster features (advertise, node labels, refused pods) share: the gate
//! each passes before its first write, and where their outcomes go.
//!
//! The gate ([`devplug_cluster::policy_check::Gate`]) proves, with a server-side dry run of a
//! write that must be refused, that the admission policy keeping the feature to its own node is
//! in force. With `--require-policies` (the chart sets it) a feature whose policy is not found
//! in force does not run: `/readyz` names it and the fix, the log says it once and, with node
//! events, so does a Warning event on the Node; it starts by itself once the policy is there.
//! Without it (a host service, a hand-written install) devplug warns once and runs.
//!
//! Each running feature's counters ([`crate::cluster_feature::ClusterFeature::metrics`]) are
//! registered here as a view ([`crate::endpoints::FeatureView`]):
//! writes, errors, fights, last success and its policy's state in `/metrics`, repeated failures
//! in `/readyz`.

use crate::cluster_feature::StatusFn;
use crate::endpoints::{FeatureStatus, FeatureView, Features, Problems};
use devplug_cluster::events::{NodeEvent, NodeEvents};
use devplug_cluster::policy_check::{Feature, Gate, PolicyState, Probe};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

/// Failed requests in a row after which a feature shows in `/readyz`.
pub const FAILURES_NOT_READY: u64 = 3;

/// The registry name of `feature` (both node-label modes are `node_labels`).
pub fn registry_name(feature: Feature) -> &'static str {
    match feature {
        Feature::Advertise => "advertise",
        Feature::NodeLabels | Feature::NodeFeatures => "node_labels",
        Feature::RefusedPods => "refused_pods",
        Feature::Uninstall => "uninstall",
        Feature::DraSlices => "dra_slices",
    }
}

/// The state last found of each feature's policy, by registry name.
type PolicyStates = Arc<RwLock<BTreeMap<&'static str, PolicyState>>>;

/// The cluster features' shared context.
#[derive(Clone)]
pub struct ClusterFeatures {
    /// Whether a feature runs only with its policy in force (`--require-policies`).
    pub required: bool,
    /// `/readyz`'s problems.
    problems: Problems,
    /// `/metrics`' and `/readyz`'s views of the features.
    features: Features,
    /// Node events, with `--node-events`: set once, seen by every clone.
    events: Arc<std::sync::OnceLock<NodeEvents>>,
    policies: PolicyStates,
}

impl ClusterFeatures {
    /// No feature yet.
    pub fn new(required: bool, problems: Problems, features: Features) -> ClusterFeatures {
        ClusterFeatures {
            required,
            problems,
            features,
            events: Arc::default(),
            policies: PolicyStates::default(),
        }
    }

    /// Node events, once started (for every clone of this context; the first set stays).
    pub fn set_events(&self, events: NodeEvents) {
        let _ = self.events.set(events);
    }

    /// The node events, if started.
    pub fn events(&self) -> Option<NodeEvents> {
        self.events.get().cloned()
    }

    /// The gate of a feature using `client` on `node`.
    pub fn gate(&self, client: &kube::Client, node: &str) -> Gate {
        let this = self.clone();
        Gate {
            probe: Probe {
                client: client.clone(),
                node: node.to_owned(),
                namespace: crate::node_labels::namespace(),
                pod: std::env::var("POD_NAME").ok().filter(|p| !p.is_empty()),
            },
            required: self.required,
            report: Arc::new(move |feature, state| this.found(feature, state)),
        }
    }

    /// What a probe found of `feature`'s policy: kept for `/metrics`, and said (once per change)
    /// in the log, `/readyz` and a Node event.
    fn found(&self, feature: Feature, state: &PolicyState) {
        let name = registry_name(feature);
        let before = self
            .policies
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name, state.clone());
        let changed = before.as_ref() != Some(state);
        let subject = format!("cluster feature {name}");
        let mut problems = self.problems.write().unwrap_or_else(|e| e.into_inner());
        match state {
            PolicyState::InForce => {
                problems.remove(&subject);
                if changed && before.is_some() {
                    tracing::info!(
                        feature = name,
                        "its admission policy is in force now; it runs"
                    );
                } else if changed {
                    tracing::debug!(feature = name, "its admission policy is in force");
                }
            }
            PolicyState::Missing(why) if self.required => {
                let problem = format!(
                    "does not run: no admission policy keeps it to this node ({why}); install {}",
                    feature.fix()
                );
                problems.insert(subject, problem.clone());
                if changed {
                    tracing::error!(feature = name, "{problem}");
                    if let Some(events) = self.events.get() {
                        events.publish(NodeEvent {
                            warning: true,
                            reason: "AdmissionPolicyMissing".into(),
                            action: name.into(),
                            note: format!("{name} {problem}"),
                        });
                    }
                }
            }
            PolicyState::Missing(why) => {
                if changed {
                    tracing::warn!(
                        feature = name,
                        "no admission policy keeps this token to its own node ({why}); running \
                         all the same. The chart installs one and sets --require-policies"
                    );
                }
            }
            PolicyState::Unknown(why) if self.required => {
                problems.insert(
                    subject,
                    format!("does not run yet: cannot tell whether its admission policy is in force ({why})"),
                );
                if changed {
                    tracing::warn!(feature = name, %why, "cannot tell whether the admission policy is in force; asking again");
                }
            }
            PolicyState::Unknown(why) => {
                tracing::debug!(feature = name, %why, "cannot tell whether the admission policy is in force; running");
            }
        }
    }

    /// Shows the outcome of the feature `name` ([`registry_name`]) through `status` (its
    /// counters) from now on.
    pub fn register(&self, name: &'static str, status: StatusFn) {
        let view = View {
            name,
            policies: self.policies.clone(),
            status,
        };
        self.features
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), Box::new(view));
    }

    /// The feature `name` stopped: no longer shown.
    pub fn unregister(&self, name: &str) {
        self.features
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.policies
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.problems
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&format!("cluster feature {name}"));
    }
}

/// A registered feature: its counters and its policy's state.
struct View {
    name: &'static str,
    policies: PolicyStates,
    status: StatusFn,
}

impl FeatureView for View {
    fn status(&self) -> FeatureStatus {
        let mut status = (self.status)();
        status.policy_in_force = self
            .policies
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(self.name)
            // Unknown counts as not in force: where policies are required the feature waits.
            .map(PolicyState::in_force);
        status
    }
}

/// A problem for `/readyz` after [`FAILURES_NOT_READY`] failed requests in a row.
pub fn failing(consecutive: u64) -> Option<String> {
    (consecutive >= FAILURES_NOT_READY).then(|| {
        format!("its last {consecutive} requests to the API server failed (the log says why)")
    })
}

/// The uninstall's flags of `capacity remove` and `labels remove`.
#[derive(Debug, Clone, clap::Args)]
pub struct UninstallPolicyArgs {
    /// Remove nothing before the admission policy that limits this token to removing is shown
    /// in force (a server-side dry run of a write it must refuse; a policy just made is in
    /// force within a second or two): the chart's uninstall Job passes it.
    #[arg(long, global = true, env = "DEVPLUG_REQUIRE_POLICIES")]
    pub require_policy: bool,
    /// With --require-policy: how long to wait for the policy, in seconds.
    #[arg(long, global = true, value_name = "SECS", default_value_t = 60)]
    pub policy_wait_secs: u64,
}

/// The Nodes a removal works on: `node`, or every Node with `all_nodes`; with
/// `--require-policy`, only once the uninstall's admission policy is in force (else an error
/// saying which is missing, nothing changed).
pub async fn removal_targets(
    client: &kube::Client,
    node: Option<&str>,
    all_nodes: bool,
    policy: &UninstallPolicyArgs,
) -> anyhow::Result<Vec<String>> {
    use anyhow::Context;
    let targets: Vec<String> = match node {
        Some(node) if !all_nodes => vec![node.to_owned()],
        _ => kube::Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
            .list(&Default::default())
            .await
            .context("cannot list the nodes")?
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect(),
    };
    if let (true, Some(first)) = (policy.require_policy, targets.first()) {
        uninstall_policy_in_force(client, first, policy.policy_wait_secs).await?;
    }
    Ok(targets)
}

/// Waits until the uninstall's admission policy, made with the Job, is in force, or says which
/// is missing, after `wait_secs`. `node` is any Node the probe may aim at.
async fn uninstall_policy_in_force(
    client: &kube::Client,
    node: &str,
    wait_secs: u64,
) -> anyhow::Result<()> {
    let probe = Probe {
        client: client.clone(),
        node: node.to_owned(),
        namespace: crate::node_labels::namespace(),
        pod: None,
    };
    match devplug_cluster::policy_check::wait_in_force(
        &probe,
        Feature::Uninstall,
        std::time::Duration::from_secs(wait_secs),
    )
    .await
    {
        PolicyState::InForce => Ok(()),
        PolicyState::Missing(why) | PolicyState::Unknown(why) => anyhow::bail!(
            "--require-policy: no admission policy limits this token to removing ({why}); \
             nothing was changed. Install {} (helm uninstall makes it with the Job), or leave \
             out --require-policy",
            Feature::Uninstall.fix()
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn context(required: bool) -> (ClusterFeatures, Problems, Features) {
        let problems = Problems::default();
        let features = Features::default();
        (
            ClusterFeatures::new(required, problems.clone(), features.clone()),
            problems,
            features,
        )
    }

    #[test]
    fn a_missing_policy_is_a_readiness_problem_only_where_required() {
        let (required, problems, features) = context(true);
        required.register(
            registry_name(Feature::NodeLabels),
            Arc::new(FeatureStatus::default),
        );
        required.found(
            Feature::NodeLabels,
            &PolicyState::Missing("accepted".into()),
        );
        let said = problems
            .read()
            .unwrap()
            .get("cluster feature node_labels")
            .cloned();
        assert!(
            said.as_deref()
                .is_some_and(|p| p.contains("does not run") && p.contains("-node-labels")),
            "{said:?}"
        );
        let status = features.read().unwrap()["node_labels"].status();
        assert_eq!(status.policy_in_force, Some(false));
        required.found(Feature::NodeLabels, &PolicyState::InForce);
        assert!(problems.read().unwrap().is_empty());
        let status = features.read().unwrap()["node_labels"].status();
        assert_eq!(status.policy_in_force, Some(true));

        let (optional, problems, _) = context(false);
        optional.found(Feature::Advertise, &PolicyState::Missing("accepted".into()));
        optional.found(Feature::Advertise, &PolicyState::Unknown("timeout".into()));
        assert!(problems.read().unwrap().is_empty());
    }

    #[test]
    fn repeated_failures_make_a_feature_not_ready() {
        assert_eq!(failing(0), None);
        assert_eq!(failing(FAILURES_NOT_READY - 1), None);
        assert!(failing(FAILURES_NOT_READY).is_some());
    }
}
