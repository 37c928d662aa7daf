//! `devplug run`'s cluster features in one shape. Each of them (node events, `advertise:`
//! capacity, the `dra:` drivers, refused pods, node labels; in devplug-lite, the one that says
//! what that build cannot do) is a [`ClusterFeature`]. The converge in `run.rs`, the one
//! sequence of start and reload, hands every config to each feature at its [`Stage`], shows each
//! running feature's counters in `/metrics` and `/readyz`, and stops them at shutdown, in the
//! reverse of their order.

// devplug-lite's one feature reads only the config and shows no counters.
#![cfg_attr(not(feature = "cluster"), allow(dead_code))]

use crate::config::{BuiltBackend, Config};
use crate::endpoints::FeatureStatus;
use crate::node_labels::LabelSources;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a feature is asked to serve: the config, and the device plugin resources' started
/// backends and their node labels (as they are after the host applied the config, for the
/// features of [`Stage::AfterHost`]).
pub struct Desired<'a> {
    pub config: &'a Config,
    /// By resource name: a `dra: {device_plugin: true}` resource's driver serves this instance.
    pub backends: &'a BTreeMap<String, BuiltBackend>,
    pub labels: &'a LabelSources,
}

/// When a feature is applied, against the host's device plugin resources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Before the host: it needs no backend (node events, advertised capacity).
    BeforeHost,
    /// After the host built the backends: it follows them (DRA drivers, refused pods, labels).
    AfterHost,
}

/// A feature's counters, read at each scrape.
pub type StatusFn = Arc<dyn Fn() -> FeatureStatus + Send + Sync>;

/// What `/metrics` and `/readyz` show of a running feature.
#[derive(Clone)]
pub struct FeatureMetrics {
    /// Its name there (`devplug_cluster_*{feature="..."}`).
    pub name: &'static str,
    pub status: StatusFn,
}

/// One cluster feature of `devplug run`.
#[async_trait::async_trait]
pub trait ClusterFeature: Send {
    /// Its name in the log and the reload report when it fails.
    fn name(&self) -> &'static str;

    /// When the converge applies it.
    fn stage(&self) -> Stage;

    /// Before the host builds the new config's backends: let go of what the config changes or
    /// removes (a changed DRA resource's old backend, so that one instance runs at a time).
    async fn release(&mut self, _config: &Config) {}

    /// Makes it serve `desired`: started, changed or stopped as the config says.
    async fn apply(&mut self, desired: &Desired<'_>) -> anyhow::Result<()>;

    /// Its counters while it runs; `None` when it does not run or shows them elsewhere (the DRA
    /// drivers, under `devplug_dra_*`).
    fn metrics(&self) -> Option<FeatureMetrics> {
        None
    }

    /// At shutdown.
    async fn stop(&mut self) {}
}

/// The features of a process, in the order they are applied.
pub struct FeatureSet {
    features: Vec<Shown>,
    /// Where their counters are shown.
    #[cfg(feature = "cluster")]
    shared: crate::cluster_features::ClusterFeatures,
}

/// A feature and the counters last shown for it.
struct Shown {
    feature: Box<dyn ClusterFeature>,
    metrics: Option<FeatureMetrics>,
}

impl FeatureSet {
    /// `features` in the order they are applied; their counters are shown through `shared`.
    #[cfg(feature = "cluster")]
    pub fn new(
        features: Vec<Box<dyn ClusterFeature>>,
        shared: crate::cluster_features::ClusterFeatures,
    ) -> FeatureSet {
        FeatureSet {
            features: features.into_iter().map(Shown::new).collect(),
            shared,
        }
    }

    /// `features` in the order they are applied (devplug-lite: nothing to show).
    #[cfg(not(feature = "cluster"))]
    pub fn new(features: Vec<Box<dyn ClusterFeature>>) -> FeatureSet {
        FeatureSet {
            features: features.into_iter().map(Shown::new).collect(),
        }
    }

    /// The features' shared context (gates, node events).
    #[cfg(feature = "cluster")]
    pub fn shared(&self) -> &crate::cluster_features::ClusterFeatures {
        &self.shared
    }

    /// Every feature lets go of what `config` changes, before the host builds backends.
    pub async fn release(&mut self, config: &Config) {
        for shown in &mut self.features {
            shown.feature.release(config).await;
        }
    }

    /// Applies the features of `stage`, in order. With `strict` (start) it stops at the first
    /// that fails. Returns those that failed, by name.
    pub async fn apply(
        &mut self,
        stage: Stage,
        desired: &Desired<'_>,
        strict: bool,
    ) -> Vec<(String, anyhow::Error)> {
        let mut failed = Vec::new();
        for shown in self.features.iter_mut() {
            if shown.feature.stage() != stage {
                continue;
            }
            let result = shown.feature.apply(desired).await;
            #[cfg(feature = "cluster")]
            shown.show(&self.shared);
            if let Err(err) = result {
                failed.push((shown.feature.name().to_owned(), err));
                if strict {
                    break;
                }
            }
        }
        failed
    }

    /// Stops every feature, in the reverse of their order.
    pub async fn stop(&mut self) {
        for shown in self.features.iter_mut().rev() {
            shown.feature.stop().await;
        }
    }
}

impl Shown {
    fn new(feature: Box<dyn ClusterFeature>) -> Shown {
        Shown {
            feature,
            metrics: None,
        }
    }

    /// Shows the feature's counters through `shared` from now on, or stops showing them once it
    /// stopped. Replaced counters (a restart with other settings) are registered in place; the
    /// policy's state stays until the new gate finds it again.
    #[cfg(feature = "cluster")]
    fn show(&mut self, shared: &crate::cluster_features::ClusterFeatures) {
        let now = self.feature.metrics();
        match (&self.metrics, &now) {
            (Some(a), Some(b)) if a.name == b.name && Arc::ptr_eq(&a.status, &b.status) => return,
            (_, Some(metrics)) => shared.register(metrics.name, metrics.status.clone()),
            (Some(before), None) => shared.unregister(before.name),
            (None, None) => return,
        }
        self.metrics = now;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Mutex;

    /// A feature that writes what it was asked to `log`, failing its apply when told to.
    struct Recorder {
        name: &'static str,
        stage: Stage,
        fails: bool,
        log: Arc<Mutex<Vec<String>>>,
    }

    #[async_trait::async_trait]
    impl ClusterFeature for Recorder {
        fn name(&self) -> &'static str {
            self.name
        }
        fn stage(&self) -> Stage {
            self.stage
        }
        async fn release(&mut self, _: &Config) {
            self.log
                .lock()
                .unwrap()
                .push(format!("release {}", self.name));
        }
        async fn apply(&mut self, _: &Desired<'_>) -> anyhow::Result<()> {
            self.log
                .lock()
                .unwrap()
                .push(format!("apply {}", self.name));
            if self.fails {
                anyhow::bail!("{} failed", self.name);
            }
            Ok(())
        }
        async fn stop(&mut self) {
            self.log.lock().unwrap().push(format!("stop {}", self.name));
        }
    }

    fn set(features: &[(&'static str, Stage, bool)], log: &Arc<Mutex<Vec<String>>>) -> FeatureSet {
        let list: Vec<Box<dyn ClusterFeature>> = features
            .iter()
            .map(|&(name, stage, fails)| {
                Box::new(Recorder {
                    name,
                    stage,
                    fails,
                    log: log.clone(),
                }) as Box<dyn ClusterFeature>
            })
            .collect();
        #[cfg(feature = "cluster")]
        return FeatureSet::new(
            list,
            crate::cluster_features::ClusterFeatures::new(
                false,
                crate::endpoints::Problems::default(),
                crate::endpoints::Features::default(),
            ),
        );
        #[cfg(not(feature = "cluster"))]
        FeatureSet::new(list)
    }

    #[tokio::test]
    async fn each_stage_applies_its_features_in_order_and_start_stops_at_the_first_failure() {
        let config = Config::parse(
            "resources:\n  - name: example.com/a\n    virtual: {count: 1}\n",
            std::path::Path::new("t.yaml"),
        )
        .unwrap();
        let (backends, labels) = (BTreeMap::new(), LabelSources::new());
        let desired = Desired {
            config: &config,
            backends: &backends,
            labels: &labels,
        };
        let log = Arc::new(Mutex::new(Vec::new()));
        let features = [
            ("a", Stage::AfterHost, false),
            ("b", Stage::BeforeHost, false),
            ("c", Stage::AfterHost, true),
            ("d", Stage::AfterHost, false),
        ];
        let mut all = set(&features, &log);
        assert!(all
            .apply(Stage::BeforeHost, &desired, true)
            .await
            .is_empty());
        all.release(&config).await;
        let failed = all.apply(Stage::AfterHost, &desired, true).await;
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].0, "c");
        all.stop().await;
        assert_eq!(
            log.lock().unwrap().drain(..).collect::<Vec<_>>(),
            [
                "apply b",
                "release a",
                "release b",
                "release c",
                "release d",
                "apply a",
                "apply c",
                "stop d",
                "stop c",
                "stop b",
                "stop a"
            ]
        );
        // A reload (not strict) goes on past a failure and reports it.
        let failed = all.apply(Stage::AfterHost, &desired, false).await;
        assert_eq!(failed.len(), 1);
        assert_eq!(
            log.lock().unwrap().drain(..).collect::<Vec<_>>(),
            ["apply a", "apply c", "apply d"]
        );
    }
}
