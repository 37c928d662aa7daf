//! `devplug run`: serve every resource of a config file until SIGTERM or SIGINT, reloading the
//! file when it changes. A reload is validated whole first; an invalid file keeps the previous
//! config serving. A valid one is diffed by resource name: unchanged resources keep their
//! sockets and streams, changed ones are updated in place where possible, removed ones stop and
//! new ones start.
//!
//! The cluster features (node events, `advertise:` capacity, `dra:` drivers, refused pods, node
//! labels; [`crate::cluster_feature`]) use the API server (kube-rs), only in the full build
//! (cargo feature `cluster`); devplug-lite refuses those it cannot serve at start, naming the
//! field or flag, and says in its log what it leaves undone ([`crate::lite`]).

use crate::cluster_feature::{Desired, FeatureSet, Stage};
use crate::config::{Built, BuiltBackend, Config, ResourceConfig};
use crate::endpoints::{self, Endpoints, ReloadCounters};
use crate::reload::ConfigWatch;
use anyhow::Context;
use devplug::{Host, ResourceSettings};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Arguments of `devplug run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The config file (YAML) listing the resources to serve; watched for changes.
    #[arg(long, short, env = "DEVPLUG_CONFIG")]
    pub config: PathBuf,
    /// The kubelet's device-plugins folder.
    #[arg(long, env = "DEVPLUG_KUBELET_DIR", default_value = devplug::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
    /// Serve /metrics, /healthz and /readyz over HTTP on this address (e.g. :8080, which is
    /// 0.0.0.0:8080, or 127.0.0.1:8080). Off by default: nothing listens on TCP unless this is set.
    #[arg(long, env = "DEVPLUG_METRICS_ADDR", value_parser = crate::listen_addr::parse)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Serve /healthz and /readyz alone on this address too, for the kubelet's probes: a
    /// listener with a connection budget of its own, so that clients of the metrics port cannot
    /// keep the probes waiting (same forms as --metrics-addr, e.g. :8081). Off by default.
    #[arg(long, env = "DEVPLUG_PROBE_ADDR", value_parser = crate::listen_addr::parse)]
    pub probe_addr: Option<std::net::SocketAddr>,
    /// The kubelet's plugin-watcher folder, for resources with `registration: watcher`
    /// (default: `plugins_registry` beside the kubelet folder).
    #[arg(long, env = "DEVPLUG_PLUGINS_REGISTRY_DIR")]
    pub plugins_registry_dir: Option<PathBuf>,
    /// Where resources with `registration: watcher` put their plugin sockets; never the
    /// device-plugins folder (default: `plugins/devplug` beside the kubelet folder).
    #[arg(long, env = "DEVPLUG_PLUGIN_SOCKET_DIR")]
    pub plugin_socket_dir: Option<PathBuf>,
    /// Follow the kubelet's pod resources API on this socket (usually
    /// /var/lib/kubelet/pod-resources/kubelet.sock): devices allocated per resource in /metrics,
    /// re-registering when the kubelet's allocatable falls short of our healthy devices, and a
    /// warning when it lists another plugin's devices under one of our resource names.
    /// Off when not set.
    #[arg(long, env = "DEVPLUG_POD_RESOURCES_SOCKET")]
    pub pod_resources_socket: Option<PathBuf>,
    /// Seconds between two pod resources polls (each poll is two calls, paced one a second: the
    /// kubelet's 100 calls a second are shared by every client on the node).
    #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub pod_resources_interval: u64,
    /// This node's name (the downward API's spec.nodeName), for `advertise:` resources and node
    /// events.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// The kubeconfig for `advertise:` resources and node events (default: KUBECONFIG,
    /// ~/.kube/config, then the in-cluster account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Write Kubernetes Events on this node (NODE_NAME): devices unhealthy (with the reason) and
    /// recovered, registration lost and regained, config reloads that failed. Rate-limited and
    /// aggregated. Needs create/patch on events.k8s.io events in namespace default. Full
    /// `devplug` only (devplug-lite has no API client).
    #[arg(long, env = "DEVPLUG_NODE_EVENTS")]
    pub node_events: bool,
    /// Run a cluster feature (advertise:, node labels, refused pods) only once the admission
    /// policy that keeps its writes to this node is shown in force (a server-side dry run of a
    /// write it must refuse); until then `/readyz` says which is missing. The Helm chart, which
    /// installs those policies, sets it. Without it a missing policy is only logged.
    #[arg(long, env = "DEVPLUG_REQUIRE_POLICIES")]
    pub require_policies: bool,
    /// Where `dra:` resources write the CDI spec of each prepared claim (the container
    /// runtime's dynamic CDI folder).
    #[arg(long, env = "DEVPLUG_CDI_DIR", default_value = devplug_proto::constants::CDI_DYNAMIC_DIR)]
    pub cdi_dir: PathBuf,
}

/// The plugin-watcher folders from the flags, defaulting beside the kubelet folder.
fn watcher_dirs(args: &RunArgs) -> devplug::host::WatcherDirs {
    let beside = devplug::host::WatcherDirs::beside(&args.kubelet_dir);
    devplug::host::WatcherDirs {
        registry: args.plugins_registry_dir.clone().unwrap_or(beside.registry),
        sockets: args.plugin_socket_dir.clone().unwrap_or(beside.sockets),
    }
}

/// Runs until a shutdown signal, then removes our sockets and returns.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    // Handlers before any socket exists: a signal during start-up still cleans up.
    let shutdown = devplug::shutdown_signal();
    let (config, text) = Config::load(&args.config)?;
    let mut watch = ConfigWatch::new(&args.config)
        .with_context(|| format!("cannot watch config file {}", args.config.display()))?;
    warn_if_no_kubelet_folder(&args.kubelet_dir);
    let problems = endpoints::Problems::default();
    let drivers = endpoints::Drivers::default();
    let features = endpoints::Features::default();
    #[cfg(not(feature = "cluster"))]
    if args.node_events {
        return Err(crate::lite::node_events_refused());
    }
    let host = Arc::new(Host::new(&args.kubelet_dir)?.with_watcher_dirs(watcher_dirs(&args)));
    let mut runner = Runner {
        features: cluster_features(&args, &host, &problems, &drivers, &features),
        host,
        current: BTreeMap::new(),
        backends: BTreeMap::new(),
        labels: BTreeMap::new(),
        text,
        reloads: Arc::default(),
        problems: problems.clone(),
    };
    runner.start(&config).await?;
    if let Some(socket) = &args.pod_resources_socket {
        // Two calls per poll, each at least `interval / 2` apart (and never under a second).
        let interval = std::time::Duration::from_secs(args.pod_resources_interval)
            .div_f64(2.0)
            .max(devplug::podresources::MIN_INTERVAL);
        runner.host.watch_pod_resources(socket.clone(), interval);
    }
    let stop_http = CancellationToken::new();
    let endpoints = Endpoints {
        host: runner.host.clone(),
        reloads: runner.reloads.clone(),
        problems: runner.problems.clone(),
        drivers,
        features,
    };
    if let Some(addr) = args.metrics_addr {
        endpoints::serve(addr, endpoints.clone(), stop_http.clone())
            .await
            .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
    }
    if let Some(addr) = args.probe_addr {
        endpoints::serve_probes(addr, endpoints, stop_http.clone())
            .await
            .with_context(|| format!("cannot listen on --probe-addr {addr}"))?;
    }
    tracing::info!(
        resources = config.resources.len(),
        kubelet_dir = %args.kubelet_dir.display(),
        config = %args.config.display(),
        "devplug running"
    );

    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            changed = watch.changed() => match changed {
                Ok(text) => runner.reload(text, &args.config).await,
                Err(err) => tracing::error!(config = %args.config.display(), %err, "cannot read the config file; keeping the previous config"),
            },
        }
    }
    stop_http.cancel();
    runner.features.stop().await;
    let report = runner.host.shutdown().await;
    if report.is_clean() {
        tracing::info!("sockets removed; bye");
    } else {
        tracing::warn!(left_behind = ?report.left_behind, "shut down, but some sockets of ours could not be removed; remove them by hand");
    }
    Ok(())
}

/// Where other Kubernetes distributions keep the kubelet's device-plugins folder.
const OTHER_KUBELET_DIRS: [(&str, &str); 2] = [
    ("k0s", "/var/lib/k0s/kubelet/device-plugins"),
    (
        "MicroK8s",
        "/var/snap/microk8s/common/var/lib/kubelet/device-plugins",
    ),
];

/// Says once, at start, that the kubelet folder is not there (yet), naming the flag and where
/// other distributions keep it; the host then waits for the folder to appear.
fn warn_if_no_kubelet_folder(dir: &std::path::Path) {
    if let Some(inner) = kubelet_root_given(dir) {
        tracing::error!(
            kubelet_dir = %dir.display(),
            "--kubelet-dir names the kubelet's root folder (it holds device-plugins/ and no \
             kubelet.sock): the kubelet will never be found there; set --kubelet-dir {} (or \
             DEVPLUG_KUBELET_DIR)",
            inner.display()
        );
        return;
    }
    if dir.exists() {
        return;
    }
    let known = OTHER_KUBELET_DIRS
        .iter()
        .filter(|(_, path)| std::path::Path::new(path).is_dir())
        .map(|(who, path)| format!("{path} ({who})"))
        .collect::<Vec<_>>();
    let elsewhere = OTHER_KUBELET_DIRS
        .iter()
        .map(|(who, path)| format!("{who}: {path}"))
        .collect::<Vec<_>>()
        .join("; ");
    if known.is_empty() {
        tracing::warn!(
            kubelet_dir = %dir.display(),
            "no kubelet here yet: the kubelet folder does not exist; waiting for it to appear. If the kubelet keeps it elsewhere, set --kubelet-dir (or DEVPLUG_KUBELET_DIR). Other distributions: {elsewhere}"
        );
    } else {
        tracing::warn!(
            kubelet_dir = %dir.display(),
            found = %known.join(", "),
            "no kubelet here yet: the kubelet folder does not exist, but a kubelet folder was found elsewhere; set --kubelet-dir to it. Waiting for the configured folder meanwhile"
        );
    }
}

/// The `device-plugins/` folder inside `dir` when `dir` is the kubelet's root rather than that
/// folder (a common slip: `--kubelet-dir /var/lib/kubelet`).
fn kubelet_root_given(dir: &std::path::Path) -> Option<PathBuf> {
    let inner = dir.join("device-plugins");
    let socket = devplug_proto::constants::KUBELET_SOCKET_NAME;
    (inner.is_dir() && !dir.join(socket).exists()).then_some(inner)
}

/// The running config and the host serving it.
struct Runner {
    host: Arc<Host>,
    current: BTreeMap<String, ResourceConfig>,
    /// The started device plugin resources' backends, by name, for their DRA drivers
    /// (`device_plugin: true`: one instance serves both).
    backends: BTreeMap<String, BuiltBackend>,
    /// Their node labels, where they have any.
    labels: crate::node_labels::LabelSources,
    text: String,
    reloads: Arc<ReloadCounters>,
    /// What `/readyz` reports beside the resources.
    problems: endpoints::Problems,
    /// The cluster features, in the order the converge applies them.
    features: FeatureSet,
}

/// The cluster features of the full build, in order: node events (the others publish through
/// them), `advertise:` capacity, then, after the host, the `dra:` drivers, refused pods and node
/// labels. They share this node's name and one API client.
#[cfg(feature = "cluster")]
fn cluster_features(
    args: &RunArgs,
    host: &Arc<Host>,
    problems: &endpoints::Problems,
    drivers: &endpoints::Drivers,
    features: &endpoints::Features,
) -> FeatureSet {
    use crate::cluster_feature::ClusterFeature;
    let cluster = crate::cluster_context::ClusterContext::new(
        args.node_name.clone(),
        args.kubeconfig.clone(),
    );
    let shared = crate::cluster_features::ClusterFeatures::new(
        args.require_policies,
        problems.clone(),
        features.clone(),
    );
    let list: Vec<Box<dyn ClusterFeature>> = vec![
        Box::new(crate::node_events::NodeEventsFeature::new(
            args.node_events,
            host.clone(),
            cluster.clone(),
            shared.clone(),
        )),
        Box::new(crate::advertise::Advertise::new(
            cluster.clone(),
            shared.clone(),
        )),
        Box::new(crate::dra::DraDrivers::new(crate::dra::DraSetup {
            dirs: devplug_dra::kubelet::KubeletDirs::beside(&args.kubelet_dir),
            cdi_dir: args.cdi_dir.clone(),
            cluster: cluster.clone(),
            problems: problems.clone(),
            drivers: drivers.clone(),
            features: shared.clone(),
        })),
        Box::new(crate::refused::RefusedPodsWatch::new(
            cluster.clone(),
            shared.clone(),
        )),
        Box::new(crate::node_labels::NodeLabelsWriter::new(
            cluster,
            shared.clone(),
        )),
    ];
    FeatureSet::new(list, shared)
}

/// devplug-lite's one feature: saying what of each config it leaves undone.
#[cfg(not(feature = "cluster"))]
fn cluster_features(
    _: &RunArgs,
    _: &Arc<Host>,
    _: &endpoints::Problems,
    _: &endpoints::Drivers,
    _: &endpoints::Features,
) -> FeatureSet {
    FeatureSet::new(vec![Box::new(crate::lite::WhatLiteCannotDo)])
}

/// The resources of a config that are served as device plugins, by name.
fn device_plugin_resources(resources: &[ResourceConfig]) -> BTreeMap<String, ResourceConfig> {
    resources
        .iter()
        .filter(|r| r.serves_device_plugin())
        .map(|r| (r.name.clone(), r.clone()))
        .collect()
}

/// A resource's backend, or what is wrong with its config (`<key>.<problem>`).
fn build(resource: &ResourceConfig) -> Result<Built, String> {
    resource
        .build()
        .map_err(|(key, err)| format!("{key}.{err}"))
}

fn settings_of(resource: &ResourceConfig) -> ResourceSettings {
    ResourceSettings {
        health_hold_down: resource
            .health_hold_down
            .unwrap_or(devplug::host::DEFAULT_HEALTH_HOLD_DOWN),
        registration: resource
            .registration
            .map(devplug::Registration::from)
            .unwrap_or_default(),
        ..Default::default()
    }
}

impl Runner {
    /// Starts every resource; any failure stops the program.
    async fn start(&mut self, config: &Config) -> anyhow::Result<()> {
        let converged = self.converge(config, true).await;
        if let Some(failure) = converged.applied.failed.into_iter().next() {
            return Err(failure.into());
        }
        match converged.failed.into_iter().next() {
            None => Ok(()),
            Some((_, err)) => Err(err),
        }
    }

    /// Makes the running process serve `config`: the one sequence of start and reload.
    ///
    /// 1. the cluster features of [`Stage::BeforeHost`]: node events, `advertise:` resources
    ///    on the Node;
    /// 2. every feature lets go of what the config changes (DRA drivers whose resource left or
    ///    changed stop, so that a changed resource's old backend is gone before its new one is
    ///    built);
    /// 3. the device plugin resources applied to the host, their backends built;
    /// 4. the features of [`Stage::AfterHost`]: DRA drivers, a `device_plugin: true`
    ///    resource's with the backend step 3 built (one instance serves both); refused pods and
    ///    node labels, which follow the started backends.
    ///
    /// `strict` (start): stop at the first failure (a feature, or a device plugin resource that
    /// cannot be served), which stops the program. The features that failed come back by name.
    async fn converge(&mut self, config: &Config, strict: bool) -> Converged {
        let before = Desired {
            config,
            backends: &self.backends,
            labels: &self.labels,
        };
        let mut failed = self
            .features
            .apply(Stage::BeforeHost, &before, strict)
            .await;
        if strict && !failed.is_empty() {
            return Converged {
                applied: devplug::host::Applied::default(),
                failed,
            };
        }
        self.features.release(config).await;
        let mut built = BTreeMap::new();
        let applied = self
            .host
            .apply(
                &mut self.current,
                device_plugin_resources(&config.resources),
                |name, resource| {
                    let resource_built = build(resource)?;
                    let backend = resource_built.backend.clone();
                    built.insert(name.to_owned(), resource_built);
                    Ok::<_, String>((backend as Arc<dyn devplug::Backend>, settings_of(resource)))
                },
            )
            .await;
        if strict && !applied.failed.is_empty() {
            return Converged { applied, failed };
        }
        for name in &applied.removed {
            self.backends.remove(name);
            self.labels.remove(name);
        }
        for (name, Built { backend, labels }) in built {
            self.backends.insert(name.clone(), backend);
            match labels {
                Some(labels) => self.labels.insert(name, labels),
                None => self.labels.remove(&name),
            };
        }
        let after = Desired {
            config,
            backends: &self.backends,
            labels: &self.labels,
        };
        failed.extend(self.features.apply(Stage::AfterHost, &after, strict).await);
        Converged { applied, failed }
    }

    /// Tells the node events, if any, that a config reload failed.
    fn reload_failed(&self, err: &crate::config::ConfigError) {
        #[cfg(feature = "cluster")]
        if let Some(events) = self.features.shared().events() {
            events.publish(devplug_cluster::events::NodeEvent::config_reload_failed(
                &err.to_string(),
            ));
        }
        #[cfg(not(feature = "cluster"))]
        let _ = err;
    }

    /// Applies a changed config file, or keeps the previous one if the new one is invalid.
    async fn reload(&mut self, text: String, path: &std::path::Path) {
        if text == self.text {
            return;
        }
        let config = match Config::parse(&text, path) {
            Ok(config) => config,
            Err(err) => {
                tracing::error!(error = %err, "config reload failed; keeping the previous config");
                self.reload_failed(&err);
                self.reloads.failures.fetch_add(1, Ordering::Relaxed);
                self.text = text;
                return;
            }
        };
        self.text = text;
        let mut report = Report::default();
        let Converged { applied, failed } = self.converge(&config, false).await;
        for (what, err) in failed {
            tracing::error!(error = %format!("{err:#}"), "cannot apply the config's {what}: resources");
            report.failed.push(what);
        }
        for failure in &applied.failed {
            tracing::error!(resource = %failure.resource(), error = %failure, "cannot apply the new config for this resource; it keeps its previous config");
            report.failed.push(failure.resource().to_owned());
        }
        report.added = applied.added;
        report.changed = applied
            .changed
            .into_iter()
            .map(|(name, how)| format!("{name} ({how:?})"))
            .collect();
        report.removed = applied.removed;
        report.unchanged = applied.unchanged.len();
        let counter = if report.failed.is_empty() {
            &self.reloads.reloads
        } else {
            &self.reloads.failures
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            added = ?report.added,
            changed = ?report.changed,
            removed = ?report.removed,
            unchanged = report.unchanged,
            failed = ?report.failed,
            "config reloaded"
        );
    }
}

/// What [`Runner::converge`] did: the host's report, and the steps beside it that failed.
struct Converged {
    applied: devplug::host::Applied,
    failed: Vec<(String, anyhow::Error)>,
}

#[derive(Default)]
struct Report {
    added: Vec<String>,
    changed: Vec<String>,
    removed: Vec<String>,
    failed: Vec<String>,
    unchanged: usize,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_kubelet_root_given_for_its_device_plugins_folder_is_noticed() {
        let root = tempfile::tempdir().unwrap();
        let inner = root.path().join("device-plugins");
        std::fs::create_dir(&inner).unwrap();
        assert_eq!(kubelet_root_given(root.path()), Some(inner.clone()));
        // The right folder, or one with a kubelet.sock of its own, is not a slip.
        assert_eq!(kubelet_root_given(&inner), None);
        std::fs::write(root.path().join("kubelet.sock"), "").unwrap();
        assert_eq!(kubelet_root_given(root.path()), None);
    }
}
