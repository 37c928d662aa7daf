//! The optional HTTP listeners of `devplug run`. `--metrics-addr`: `/metrics` in the Prometheus
//! text format, `/healthz` (the process is working: it answers and can follow the kubelet
//! folder, and the plugin watcher's where a resource or a DRA driver registers through it) and
//! `/readyz` (every configured resource is registered with the kubelet, its ListAndWatch stream
//! is open and its device list can be sent; every DRA driver has its ResourceSlices published
//! and current and is registered with the kubelet). `--probe-addr`: `/healthz` and `/readyz`
//! alone, on a listener with a connection budget of its own, so that whatever the metrics port
//! suffers (a client holding connections open) the kubelet's probes are answered.

mod prometheus;

use crate::http::{self, Response};
use devplug::Host;
pub use prometheus::{render, render_drivers, render_features};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Counters of the config file, kept by the reload loop.
#[derive(Debug, Default)]
pub struct ReloadCounters {
    /// Reloads applied.
    pub reloads: AtomicU64,
    /// Reloads refused (invalid file) or partly failed.
    pub failures: AtomicU64,
}

/// What the endpoints read.
#[derive(Clone)]
pub struct Endpoints {
    /// The host serving the resources.
    pub host: Arc<Host>,
    /// Config reload counters.
    pub reloads: Arc<ReloadCounters>,
    /// Problems outside the host that keep the process from doing its job, by what they are
    /// about (a DRA driver on a runtime that cannot apply CDI): `/readyz` names them.
    pub problems: Problems,
    /// The running DRA drivers, by driver name: their readiness and counters.
    pub drivers: Drivers,
    /// The running cluster features (advertise, node labels, refused pods), by name.
    pub features: Features,
}

/// Cluster features with an outcome of their own, by name, kept by whoever starts and stops
/// them.
pub type Features =
    Arc<std::sync::RwLock<std::collections::BTreeMap<String, Box<dyn FeatureView>>>>;

/// What the endpoints read of a cluster feature.
pub trait FeatureView: Send + Sync {
    /// Its outcome now.
    fn status(&self) -> FeatureStatus;
}

/// A cluster feature's outcome, for `/metrics` and `/readyz`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeatureStatus {
    /// Writes made to the API server (label sets, capacity changes, pods deleted or reported).
    pub writes: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Put-backs that followed another writer's change closely (node labels).
    pub fights: u64,
    /// When a request last worked (Unix seconds; 0: never).
    pub last_success_unix: u64,
    /// Whether its admission policy was found in force; `None` before the first probe.
    pub policy_in_force: Option<bool>,
    /// Why it cannot do its work now, for `/readyz`.
    pub problem: Option<String>,
}

/// Problems outside the host, by subject, shared with whoever finds them.
pub type Problems = Arc<std::sync::RwLock<std::collections::BTreeMap<String, String>>>;

/// Components beside the host with a readiness and counters of their own (DRA drivers), by
/// name, kept by whoever starts and stops them.
pub type Drivers = Arc<std::sync::RwLock<std::collections::BTreeMap<String, Box<dyn DriverView>>>>;

/// What the endpoints read of a DRA driver.
pub trait DriverView: Send + Sync {
    /// `Err` with the reason when it cannot work until something outside it is fixed.
    fn working(&self) -> Result<(), String>;
    /// Why it is not ready, or `None`.
    fn not_ready(&self) -> Option<String>;
    /// Its counters now.
    fn counters(&self) -> DriverCounters;
}

/// A DRA driver's counters, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DriverCounters {
    /// Pool states written to the API server.
    pub publishes: u64,
    /// API errors while publishing or watching.
    pub errors: u64,
    /// Publish attempts that failed since the last one that worked.
    pub consecutive_failures: u64,
    /// When the API server last confirmed the slices (Unix seconds; 0: never).
    pub last_success_unix: u64,
    /// Slices and Node read afresh after a watch failed or a slice was gone.
    pub resyncs: u64,
    /// 1 while the kubelet has the driver registered.
    pub registered: u64,
    /// Claims whose device status (`status.devices`) was written.
    pub status_writes: u64,
    /// Device status writes refused or failed.
    pub status_errors: u64,
    /// The kubelet's NodePrepareResources and NodeUnprepareResources calls (DRA drivers run
    /// only in the build with the API client).
    #[cfg(feature = "cluster")]
    pub claims: devplug_dra::claim_metrics::ClaimMetricsSnapshot,
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` until `stop`. Binding errors
/// are returned at once.
pub async fn serve(
    addr: SocketAddr,
    endpoints: Endpoints,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "metrics and probes listening");
    http::serve(
        listener,
        http::Limits::METRICS,
        stop,
        move |path: String| {
            let endpoints = endpoints.clone();
            async move {
                match path.as_str() {
                    "/metrics" => metrics(&endpoints),
                    "/healthz" => healthy(&endpoints),
                    "/readyz" => ready(&endpoints),
                    _ => Response::text(404, "not found: try /metrics, /healthz or /readyz\n"),
                }
            }
        },
    );
    Ok(())
}

/// Binds `addr` and serves `/healthz` and `/readyz` alone until `stop`, for the kubelet's
/// probes, within [`http::Limits::PROBES`]. Binding errors are returned at once.
pub async fn serve_probes(
    addr: SocketAddr,
    endpoints: Endpoints,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "probes listening");
    http::serve(listener, http::Limits::PROBES, stop, move |path: String| {
        let endpoints = endpoints.clone();
        async move {
            match path.as_str() {
                "/healthz" => healthy(&endpoints),
                "/readyz" => ready(&endpoints),
                _ => Response::text(
                    404,
                    "not found: this port serves /healthz and /readyz; /metrics is on --metrics-addr\n",
                ),
            }
        }
    });
    Ok(())
}

fn healthy(endpoints: &Endpoints) -> Response {
    let drivers = endpoints.drivers.read().unwrap_or_else(|e| e.into_inner());
    let working = endpoints
        .host
        .health()
        .and_then(|()| drivers.values().try_for_each(|driver| driver.working()));
    match working {
        Ok(()) => Response::text(200, "ok\n"),
        Err(reason) => Response::text(503, format!("not working: {reason}\n")),
    }
}

fn ready(endpoints: &Endpoints) -> Response {
    let mut problems: Vec<String> = endpoints
        .problems
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(subject, problem)| format!("{subject}: {problem}"))
        .collect();
    for (driver, view) in endpoints
        .drivers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        let subject = format!("DRA driver {driver}");
        if let Some(why) = view.not_ready() {
            // A known problem of the driver (its runtime) is said once, with this added.
            match problems.iter_mut().find(|p| p.starts_with(&subject)) {
                Some(known) => known.push_str(&format!("; {why}")),
                None => problems.push(format!("{subject}: {why}")),
            }
        }
    }
    for (feature, view) in endpoints
        .features
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        if let Some(why) = view.status().problem {
            problems.push(format!("{feature}: {why}"));
        }
    }
    // A config of DRA drivers only has no device plugin to wait for.
    let drivers_only = endpoints.host.resources().is_empty()
        && !endpoints
            .drivers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
    if (endpoints.host.is_ready() || drivers_only) && problems.is_empty() {
        return Response::text(200, "ready\n");
    }
    let mut waiting: Vec<String> = endpoints
        .host
        .metrics()
        .into_iter()
        .filter_map(|(name, m)| Some(format!("{name}: {}", m.not_ready?)))
        .collect();
    waiting.extend(problems);
    if endpoints.host.registry_present() == Some(false) {
        waiting.push(format!(
            "the plugin watcher's folder {} does not exist (registration: watcher)",
            endpoints.host.watcher_dirs().registry.display()
        ));
    }
    if !endpoints.host.folder_present() {
        waiting.push(format!(
            "the kubelet folder {} does not exist",
            endpoints.host.dir().display()
        ));
    }
    Response::text(503, format!("not ready\n{}\n", waiting.join("\n")))
}

fn metrics(endpoints: &Endpoints) -> Response {
    let drivers: Vec<(String, DriverCounters)> = endpoints
        .drivers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(name, view)| (name.clone(), view.counters()))
        .collect();
    let features: Vec<(String, FeatureStatus)> = endpoints
        .features
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(name, view)| (name.clone(), view.status()))
        .collect();
    let mut body = render(&endpoints.host.metrics(), &endpoints.reloads);
    body.push_str(&render_drivers(&drivers));
    body.push_str(&render_features(&features));
    Response {
        status: 200,
        content_type: "text/plain; version=0.0.4; charset=utf-8",
        body,
    }
}
