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
    features: crate::cluster_features::ClusterFeatures,
    running: Option<Running>,
    said_no_node: bool,
}

/// The running watch.
#[cfg(feature = "cluster")]
struct Running {
    policy: RefusedPodsPolicy,
    watch: devplug_cluster::refused_pods::RefusedPods,
    stop: tokio_util::sync::CancellationToken,
    metrics: crate::cluster_feature::FeatureMetrics,
}

#[cfg(feature = "cluster")]
impl RefusedPodsWatch {
    /// Nothing running yet.
    pub fn new(
        cluster: std::sync::Arc<crate::cluster_context::ClusterContext>,
        features: crate::cluster_features::ClusterFeatures,
    ) -> RefusedPodsWatch {
        RefusedPodsWatch {
            cluster,
            features,
            running: None,
            said_no_node: false,
        }
    }

    /// Matches the watch to `config`: started with the first policy that is not `off` while a
    /// device plugin resource is served, the served resources updated, restarted when the policy
    /// changes, stopped by `off` or when no device plugin resource is left.
    async fn follow(&mut self, config: &Config) {
        use devplug_cluster::policy_check::Feature;
        use devplug_cluster::refused_pods::{Policy, RefusedPods};
        let policy = match config.refused_pods {
            RefusedPodsPolicy::Off => None,
            RefusedPodsPolicy::Report => Some(Policy::Report),
            RefusedPodsPolicy::DeleteReplaced => Some(Policy::DeleteReplaced),
        };
        let served = served(config);
        if let Some(running) = &self.running {
            if running.policy == config.refused_pods && !served.is_empty() {
                running.watch.set_served(served);
                return;
            }
        }
        if let Some(running) = self.running.take() {
            running.stop.cancel();
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
        let gate = self.features.gate(&client, &node);
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
        let metrics = crate::cluster_feature::FeatureMetrics {
            name: crate::cluster_features::registry_name(Feature::RefusedPods),
            status: std::sync::Arc::new(move || {
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
            }),
        };
        self.running = Some(Running {
            policy: config.refused_pods,
            watch,
            stop,
            metrics,
        });
    }
}

#[cfg(feature = "cluster")]
#[async_trait::async_trait]
impl crate::cluster_feature::ClusterFeature for RefusedPodsWatch {
    fn name(&self) -> &'static str {
        "refused_pods"
    }

    fn stage(&self) -> crate::cluster_feature::Stage {
        crate::cluster_feature::Stage::AfterHost
    }

    /// [`RefusedPodsWatch::follow`].
    async fn apply(&mut self, desired: &crate::cluster_feature::Desired<'_>) -> anyhow::Result<()> {
        self.follow(desired.config).await;
        Ok(())
    }

    fn metrics(&self) -> Option<crate::cluster_feature::FeatureMetrics> {
        self.running.as_ref().map(|r| r.metrics.clone())
    }

    /// Stops the watch.
    async fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop.cancel();
        }
    }
}
