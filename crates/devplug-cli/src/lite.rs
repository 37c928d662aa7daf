//! What devplug-lite (the device-plugin-only build: no `cluster` feature, no API client) cannot
//! do, in one place. The settings it cannot serve at all are refused when the config is read
//! ([`crate::config::needs_cluster`]: `advertise:` and `dra:` resources) and the flags when
//! `run` starts (`--node-events`), each worded by [`crate::config::not_in_this_build`]; the
//! settings it serves without their cluster part (pods the kubelet refused, node labels) are
//! said here, in the log, each time a config is applied.

use crate::config::{Config, NodeLabelsMode, RefusedPodsPolicy};

/// devplug-lite's one cluster feature: [`say_what_it_cannot_do`] with each config applied.
pub struct WhatLiteCannotDo;

#[async_trait::async_trait]
impl crate::cluster_feature::ClusterFeature for WhatLiteCannotDo {
    fn name(&self) -> &'static str {
        "devplug-lite"
    }

    fn stage(&self) -> crate::cluster_feature::Stage {
        crate::cluster_feature::Stage::AfterHost
    }

    async fn apply(&mut self, desired: &crate::cluster_feature::Desired<'_>) -> anyhow::Result<()> {
        say_what_it_cannot_do(desired.config);
        Ok(())
    }
}

/// `run --node-events` in devplug-lite, which has no API client.
pub fn node_events_refused() -> anyhow::Error {
    anyhow::anyhow!(crate::config::not_in_this_build(
        "--node-events (DEVPLUG_NODE_EVENTS)"
    ))
}

/// Says in the log what of `config` this build leaves undone, unless the config turned it off.
pub fn say_what_it_cannot_do(config: &Config) {
    if config.refused_pods != RefusedPodsPolicy::Off && !crate::refused::served(config).is_empty() {
        tracing::info!(
            "devplug-lite cannot delete or report pods the kubelet refused at admission \
             (refused_pods; the full devplug with NODE_NAME can): after a reboot a refused pod \
             without a controller stays Failed; set `refused_pods: off` to silence this"
        );
    }
    if config.node_labels.mode != NodeLabelsMode::Off {
        tracing::warn!(
            "devplug-lite cannot write node labels (node_labels: {:?}; it has no API client): \
             run the full devplug image, or set `node_labels: {{mode: off}}` to silence this",
            config.node_labels.mode
        );
    }
}
