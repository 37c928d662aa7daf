//! `advertise:` resources in `devplug run`: counts of an extended resource written into our
//! Node's capacity by `devplug_cluster::advertise` (no device plugin; the kubelet keeps them).
//! Started with the first config that has one; it needs the API server and this node's name, so
//! devplug-lite refuses such a config when it reads it ([`crate::config::needs_cluster`]).

use crate::cluster_feature::{ClusterFeature, Desired, FeatureMetrics, Stage};
use crate::config::ResourceConfig;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The `advertise:` resources of a config, name → count.
pub fn advertised(resources: &[ResourceConfig]) -> BTreeMap<String, u64> {
    resources
        .iter()
        .filter_map(|r| Some((r.name.clone(), r.kind.advertised()?)))
        .collect()
}

/// The advertiser, started the first time a config has `advertise:` resources.
pub struct Advertise {
    cluster: Arc<crate::cluster_context::ClusterContext>,
    features: crate::cluster_features::ClusterFeatures,
    running: Option<(devplug_cluster::advertise::Advertiser, FeatureMetrics)>,
}

impl Advertise {
    /// Nothing advertised yet.
    pub fn new(
        cluster: Arc<crate::cluster_context::ClusterContext>,
        features: crate::cluster_features::ClusterFeatures,
    ) -> Advertise {
        Advertise {
            cluster,
            features,
            running: None,
        }
    }

    /// Starts the advertiser (API client, `NODE_NAME`).
    async fn start(&mut self) -> anyhow::Result<()> {
        let node = self.cluster.need_node("advertise: resources need")?;
        let client = self.cluster.client().await?;
        tracing::info!(%node, "advertising extended resources on our Node");
        let gate = self.features.gate(&client, &node);
        let advertiser = devplug_cluster::advertise::Advertiser::spawn_gated(
            client,
            node,
            tokio_util::sync::CancellationToken::new(),
            Some(gate),
        );
        let counters = advertiser.shared_counters();
        let metrics = FeatureMetrics {
            name: crate::cluster_features::registry_name(
                devplug_cluster::policy_check::Feature::Advertise,
            ),
            status: Arc::new(move || {
                use std::sync::atomic::Ordering::Relaxed;
                crate::endpoints::FeatureStatus {
                    writes: counters
                        .applied
                        .load(Relaxed)
                        .saturating_add(counters.removed.load(Relaxed)),
                    errors: counters.errors.load(Relaxed),
                    last_success_unix: counters.last_success_unix.load(Relaxed),
                    problem: crate::cluster_features::failing(
                        counters.consecutive_failures.load(Relaxed),
                    ),
                    ..Default::default()
                }
            }),
        };
        self.running = Some((advertiser, metrics));
        Ok(())
    }
}

#[async_trait::async_trait]
impl ClusterFeature for Advertise {
    fn name(&self) -> &'static str {
        "advertise"
    }

    /// Capacity needs no backend: written before the device plugin resources start.
    fn stage(&self) -> Stage {
        Stage::BeforeHost
    }

    /// Hands the config's `advertise:` resources to the advertiser, starting it the first time
    /// there are any; once started it keeps running (an empty set removes what it wrote).
    async fn apply(&mut self, desired: &Desired<'_>) -> anyhow::Result<()> {
        let resources = advertised(&desired.config.resources);
        if self.running.is_none() {
            if resources.is_empty() {
                return Ok(());
            }
            self.start().await?;
        }
        if let Some((advertiser, _)) = &self.running {
            advertiser.set(resources);
        }
        Ok(())
    }

    fn metrics(&self) -> Option<FeatureMetrics> {
        self.running.as_ref().map(|(_, metrics)| metrics.clone())
    }

    // Nothing at shutdown: the capacity stays on the Node for the next devplug; the uninstall
    // removes it.
}
