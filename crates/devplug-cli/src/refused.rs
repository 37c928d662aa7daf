//! `refused_pods:` in `devplug run`: pods the kubelet refused at admission for one of the
//! config's device plugin resources (after a node reboot, before devplug's pod ran again) are
//! deleted where their controller replaces them and reported where nothing does
//! (`devplug_cluster::refused_pods` has the rules). It needs the API server and this node's name
//! (`NODE_NAME`): the full build only; devplug-lite says in its log that it cannot
//! (`crate::lite`).

use crate::config::Config;
#[cfg(feature = "cluster")]
use crate::config::RefusedPodsPolicy;
use std::collections::BTreeSet;

/// The device plugin resources of `config`: those the kubelet's device manager can refuse.
pub(crate) fn served(config: &Config) -> BTreeSet<String> {
    config
        .resources
        .iter()
        .filter(|r| r.serves_device_plugin())
        .map(|r| r.name.clone())
        .collect()
}

/// The watch of refused pods, started, changed or stopped as the config says.
#[cfg(feature = "cluster")]
pub struct RefusedPodsWatch {
    cluster: std::sync::Arc<crate::cluster_context::ClusterContext>,
    running: Option<(
        RefusedPodsPolicy,
        devplug_cluster::refused_pods::RefusedPods,
        tokio_util::sync::CancellationToken,
    )>,
    said_no_node: bool,
}

#[cfg(feature = "cluster")]
impl RefusedPodsWatch {
    /// Nothing running yet.
    pub fn new(
        cluster: std::sync::Arc<crate::cluster_context::ClusterContext>,
    ) -> RefusedPodsWatch {
        RefusedPodsWatch {
            cluster,
            running: None,
            said_no_node: false,
        }
    }

    /// Matches the watch to `config`: started with the first policy that is not `off` while a
    /// device plugin resource is served, the served resources updated, restarted when the policy
    /// changes, stopped by `off` or when no device plugin resource is left.
    pub async fn apply(
        &mut self,
        config: &Config,
        features: &crate::cluster_features::ClusterFeatures,
    ) {
        use devplug_cluster::policy_check::Feature;
        use devplug_cluster::refused_pods::{Policy, RefusedPods};
        let policy = match config.refused_pods {
            RefusedPodsPolicy::Off => None,
            RefusedPodsPolicy::Report => Some(Policy::Report),
            RefusedPodsPolicy::DeleteReplaced => Some(Policy::DeleteReplaced),
        };
        let served = served(config);
        if let Some((running, watch, _)) = &self.running {
            if *running == config.refused_pods && !served.is_empty() {
                watch.set_served(served);
                return;
            }
        }
        if let Some((_, _, stop)) = self.running.take() {
            stop.cancel();
            features.unregister(Feature::RefusedPods);
        }
        // Nothing to watch for without a device plugin resource.
        let (Some(policy), false) = (policy, served.is_empty()) else {
            return;
        };
        let Some(node) = self.cluster.node().map(str::to_owned) else {
            if !self.said_no_node {
                self.said_no_node = true;
                // Debug, not info: `run` outside a pod (a checkout, a test) has no node name and
                // nothing to look up; the chart and the base set NODE_NAME where it matters.
                tracing::debug!(
                    "refused_pods: without this node's name (NODE_NAME, or --node-name) devplug \
                     cannot look up the pods the kubelet refused at admission; set it, or \
                     `refused_pods: off` to say this on purpose"
                );
            }
            return;
        };
        let client = match self.cluster.client().await {
            Ok(client) => client,
            Err(err) => {
                tracing::warn!(%err, "refused_pods: no API client; pods the kubelet refused at admission are left alone");
                return;
            }
        };
        let instance = std::env::var("POD_NAME").unwrap_or_else(|_| node.clone());
        let stop = tokio_util::sync::CancellationToken::new();
        let gate = features.gate(&client, &node);
        let watch = RefusedPods::spawn_gated(
            client,
            node,
            instance,
            policy,
            served,
            stop.clone(),
            Some(gate),
        );
        let counters = watch.shared_counters();
        features.register(Feature::RefusedPods, move || {
            use std::sync::atomic::Ordering::Relaxed;
            crate::endpoints::FeatureStatus {
                writes: counters
                    .deleted
                    .load(Relaxed)
                    .saturating_add(counters.reported.load(Relaxed)),
                errors: counters.failed.load(Relaxed),
                last_success_unix: counters.last_success_unix.load(Relaxed),
                ..Default::default()
            }
        });
        self.running = Some((config.refused_pods, watch, stop));
    }

    /// Stops the watch.
    pub fn stop(&mut self) {
        if let Some((_, _, stop)) = self.running.take() {
            stop.cancel();
        }
    }
}
