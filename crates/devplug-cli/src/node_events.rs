//! `--node-events` in `devplug run`: what happens to the resources (registered, unhealthy, a
//! reload that failed, a DRA driver's runtime problem, a cluster feature's missing policy)
//! published as Events on our Node by `devplug_cluster::events`. Started at start-up with the
//! first config; devplug-lite refuses the flag ([`crate::config::not_in_this_build`]).

use crate::cluster_feature::{ClusterFeature, Desired, Stage};
use std::sync::Arc;

/// Node events, started with the first config when the flag asks for them.
pub struct NodeEventsFeature {
    wanted: bool,
    host: Arc<devplug::host::Host>,
    cluster: Arc<crate::cluster_context::ClusterContext>,
    features: crate::cluster_features::ClusterFeatures,
    started: bool,
}

impl NodeEventsFeature {
    /// `wanted`: the flag; the host's events are forwarded once started.
    pub fn new(
        wanted: bool,
        host: Arc<devplug::host::Host>,
        cluster: Arc<crate::cluster_context::ClusterContext>,
        features: crate::cluster_features::ClusterFeatures,
    ) -> NodeEventsFeature {
        NodeEventsFeature {
            wanted,
            host,
            cluster,
            features,
            started: false,
        }
    }
}

#[async_trait::async_trait]
impl ClusterFeature for NodeEventsFeature {
    fn name(&self) -> &'static str {
        "node events"
    }

    /// First of all: the other features publish through it.
    fn stage(&self) -> Stage {
        Stage::BeforeHost
    }

    /// Starts node events with this node's name and the shared API client, once.
    async fn apply(&mut self, _: &Desired<'_>) -> anyhow::Result<()> {
        if !self.wanted || self.started {
            return Ok(());
        }
        let node = self.cluster.need_node("--node-events needs")?;
        let client = self.cluster.client().await?;
        let instance = std::env::var("POD_NAME").unwrap_or_else(|_| node.clone());
        let events = devplug_cluster::events::NodeEvents::spawn(
            client,
            node,
            instance,
            tokio_util::sync::CancellationToken::new(),
        );
        events.forward(self.host.events());
        self.features.set_events(events);
        self.started = true;
        Ok(())
    }
}
