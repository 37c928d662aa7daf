//! `node_labels:` in `devplug run`: the labels the backends describe the node with
//! ([`devplug_backends::NodeLabelSource`]), merged over the config's resources (in name order; the
//! first resource to give a key keeps it) and written by `devplug_cluster::node_labels` on our
//! Node (`direct`) or in a NodeFeature object (`node-feature`, in `POD_NAMESPACE`). A change of
//! any backend's labels is written at once. `off` (or a mode change) removes what the previous
//! mode wrote. Nothing is removed at shutdown (a restarting pod must not make labels flap); the
//! uninstall does it (`devplug labels remove`). It needs the API server and this node's name: the
//! full build only; devplug-lite says in its log that it cannot (`crate::lite`).

#[cfg(feature = "cluster")]
use crate::config::{Config, NodeLabelsMode};
use devplug_backends::NodeLabels;
use std::collections::BTreeMap;
use tokio::sync::watch;

/// The started resources' node labels, by resource name (only the backends that have any).
pub type LabelSources = BTreeMap<String, watch::Receiver<NodeLabels>>;

/// The namespace of the NodeFeature object: devplug's own (`POD_NAMESPACE`), else `default`.
#[cfg(feature = "cluster")]
pub fn namespace() -> String {
    std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

/// The writer, started, changed or stopped as the config says.
#[cfg(feature = "cluster")]
pub struct NodeLabelsWriter {
    cluster: std::sync::Arc<crate::cluster_context::ClusterContext>,
    features: crate::cluster_features::ClusterFeatures,
    running: Option<Running>,
    said_no_node: bool,
}

#[cfg(feature = "cluster")]
struct Running {
    mode: NodeLabelsMode,
    client: kube::Client,
    labeler: std::sync::Arc<devplug_cluster::node_labels::NodeLabeler>,
    /// Stops the tasks that follow the backends' labels.
    follow: tokio_util::sync::CancellationToken,
    metrics: crate::cluster_feature::FeatureMetrics,
}

#[cfg(feature = "cluster")]
impl NodeLabelsWriter {
    /// Nothing running yet.
    pub fn new(
        cluster: std::sync::Arc<crate::cluster_context::ClusterContext>,
        features: crate::cluster_features::ClusterFeatures,
    ) -> NodeLabelsWriter {
        NodeLabelsWriter {
            cluster,
            features,
            running: None,
            said_no_node: false,
        }
    }

    /// Matches the writer to `config`, following the labels of `sources` (the config's
    /// started resources', by name).
    async fn write(&mut self, config: &Config, sources: &LabelSources) {
        use devplug_cluster::node_labels::{LabelerOptions, Mode, NodeLabeler};
        use devplug_cluster::policy_check::Feature;
        let mode = config.node_labels.mode;
        if let Some(running) = &mut self.running {
            if running.mode == mode {
                running.follow.cancel();
                running.follow = follow(sources, running.labeler.clone());
                return;
            }
        }
        if let (Some(old), Some(node)) =
            (self.running.take(), self.cluster.node().map(str::to_owned))
        {
            old.follow.cancel();
            tokio::spawn(remove(old.client, old.mode, node));
        }
        let cluster_mode = match mode {
            NodeLabelsMode::Off => return,
            NodeLabelsMode::Direct => Mode::Direct,
            NodeLabelsMode::NodeFeature => Mode::NodeFeature {
                namespace: namespace(),
            },
        };
        let Some(node) = self.cluster.node().map(str::to_owned) else {
            if !self.said_no_node {
                self.said_no_node = true;
                tracing::warn!(
                    "node_labels: without this node's name (NODE_NAME, or --node-name) devplug \
                     cannot label its Node; set it, or `node_labels: {{mode: off}}`"
                );
            }
            return;
        };
        let client = match self.cluster.client().await {
            Ok(client) => client,
            Err(err) => {
                tracing::warn!(%err, "node_labels: no API client; the Node gets no labels");
                return;
            }
        };
        tracing::info!(%node, ?mode, "writing node labels");
        let options = LabelerOptions {
            events: self.features.events(),
            gate: Some(self.features.gate(&client, &node)),
        };
        let labeler = std::sync::Arc::new(NodeLabeler::spawn_with(
            client.clone(),
            node,
            cluster_mode,
            options,
        ));
        let counters = labeler.shared_counters();
        let metrics = crate::cluster_feature::FeatureMetrics {
            name: crate::cluster_features::registry_name(Feature::NodeLabels),
            status: std::sync::Arc::new(move || {
                use std::sync::atomic::Ordering::Relaxed;
                crate::endpoints::FeatureStatus {
                    writes: counters.applied.load(Relaxed),
                    errors: counters.errors.load(Relaxed),
                    fights: counters.fights.load(Relaxed),
                    last_success_unix: counters.last_success_unix.load(Relaxed),
                    problem: crate::cluster_features::failing(
                        counters.consecutive_failures.load(Relaxed),
                    ),
                    ..Default::default()
                }
            }),
        };
        self.running = Some(Running {
            mode,
            client,
            follow: follow(sources, labeler.clone()),
            labeler,
            metrics,
        });
    }
}

#[cfg(feature = "cluster")]
#[async_trait::async_trait]
impl crate::cluster_feature::ClusterFeature for NodeLabelsWriter {
    fn name(&self) -> &'static str {
        "node_labels"
    }

    fn stage(&self) -> crate::cluster_feature::Stage {
        crate::cluster_feature::Stage::AfterHost
    }

    /// [`NodeLabelsWriter::write`], with the started backends' labels.
    async fn apply(&mut self, desired: &crate::cluster_feature::Desired<'_>) -> anyhow::Result<()> {
        self.write(desired.config, desired.labels).await;
        Ok(())
    }

    fn metrics(&self) -> Option<crate::cluster_feature::FeatureMetrics> {
        self.running.as_ref().map(|r| r.metrics.clone())
    }

    // Nothing at shutdown: the labels stay on the Node (a restarting pod must not make them
    // flap); the uninstall removes them.
}

/// Removes what `mode` wrote for `node`.
#[cfg(feature = "cluster")]
async fn remove(client: kube::Client, mode: NodeLabelsMode, node: String) {
    use devplug_cluster::node_labels;
    let result = match mode {
        NodeLabelsMode::Off => return,
        NodeLabelsMode::Direct => {
            let nodes = kube::Api::all(client);
            node_labels::remove_direct(&nodes, &node).await.map(drop)
        }
        NodeLabelsMode::NodeFeature => {
            node_labels::remove_node_feature(&client, &namespace(), Some(&node))
                .await
                .map(drop)
        }
    };
    if let Err(err) = result {
        tracing::warn!(%err, "node_labels: cannot remove the labels of the previous mode");
    }
}

/// The labels of `receivers` merged: in name order, the first to give a key keeps it.
#[cfg(feature = "cluster")]
pub fn merged(receivers: &[(String, watch::Receiver<NodeLabels>)]) -> NodeLabels {
    let mut out = NodeLabels::new();
    for (name, rx) in receivers {
        for (key, value) in rx.borrow().iter() {
            match out.get(key) {
                Some(kept) if kept != value => {
                    tracing::debug!(resource = %name, %key, %value, %kept, "label given by an earlier resource too; keeping the first");
                }
                Some(_) => {}
                None => {
                    out.insert(key.clone(), value.clone());
                }
            }
        }
    }
    out
}

/// Follows the labels of `sources` into `labeler` until the token is cancelled.
#[cfg(feature = "cluster")]
fn follow(
    sources: &LabelSources,
    labeler: std::sync::Arc<devplug_cluster::node_labels::NodeLabeler>,
) -> tokio_util::sync::CancellationToken {
    let stop = tokio_util::sync::CancellationToken::new();
    let receivers: Vec<(String, watch::Receiver<NodeLabels>)> = sources
        .iter()
        .map(|(name, rx)| (name.clone(), rx.clone()))
        .collect();
    let changed = std::sync::Arc::new(tokio::sync::Notify::new());
    for (_, rx) in &receivers {
        let (mut rx, changed, stop) = (rx.clone(), changed.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    c = rx.changed() => if c.is_err() { return },
                }
                changed.notify_one();
            }
        });
    }
    let for_task = stop.clone();
    tokio::spawn(async move {
        loop {
            labeler.set(merged(&receivers));
            tokio::select! {
                _ = for_task.cancelled() => return,
                () = changed.notified() => {}
            }
        }
    });
    stop
}

#[cfg(all(test, feature = "cluster"))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_first_resource_to_give_a_key_keeps_it() {
        let labels = |pairs: &[(&str, &str)]| -> NodeLabels {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let (_a_tx, a) = tokio::sync::watch::channel(labels(&[("nvidia.com/gpu.count", "4")]));
        let (_b_tx, b) = tokio::sync::watch::channel(labels(&[
            ("nvidia.com/gpu.count", "2"),
            ("nvidia.com/mig-1g.5gb.count", "7"),
        ]));
        let got = merged(&[("a".into(), a), ("b".into(), b)]);
        assert_eq!(
            got,
            labels(&[
                ("nvidia.com/gpu.count", "4"),
                ("nvidia.com/mig-1g.5gb.count", "7")
            ])
        );
    }
}
