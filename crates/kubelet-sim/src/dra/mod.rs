//! The kubelet's DRA side, for plugins whose `GetInfo` type is `DRAPlugin`:
//! the registration handler the plugin watcher hands them to, the per-driver
//! `NodePrepareResources` / `NodeUnprepareResources` calls, and the claims the kubelet keeps as
//! prepared. What it mirrors, from the kubelet 1.34–1.36 sources (`pkg/kubelet/cm/dra/plugin/
//! dra_plugin_manager.go`, `dra_plugin.go`, `pkg/kubelet/cm/dra/manager.go`):
//!
//! - **Validation**: the service is the first entry of the plugin's `supported_versions` that
//!   the kubelet knows (`v1.DRAPlugin`, `v1beta1.DRAPlugin`): the plugin's order decides, not
//!   the kubelet's. An empty list or no known entry is refused; the plugin watcher then sends
//!   `Notify(false)` and retries the socket with backoff. The driver name is not checked at
//!   registration: a plugin named `""` registers, and every call for it fails with
//!   `DRA driver name is empty`.
//! - **Several endpoints per driver** (rolling updates, kubelets 1.33+): each registration
//!   socket adds one endpoint; an endpoint already registered for the driver is refused
//!   (`Notify(false)`, not retried). Calls go to the most recently registered endpoint that is
//!   connected (here: whose socket accepts a connection), else to the most recent one.
//! - **Deregistration**: when a registration socket disappears, the endpoint it registered is
//!   removed (by driver and endpoint: the socket of a refused duplicate removes the endpoint it
//!   named, as in the kubelet); with none left, calls fail with
//!   `DRA driver <name> is not registered`.
//! - **Calls**: one gRPC connection per endpoint, made lazily (authority `localhost`, as grpc-go
//!   sends for `unix://` targets), each call bounded by the per-call timeout (45 s;
//!   [`SimConfig::dra_call_timeout`](crate::SimConfig)). Every requested claim UID must be in the
//!   answer (a missing one is an error for that claim: the kubelet's
//!   `NodePrepareResources skipped N ResourceClaims`), a non-empty `error` is that claim's error,
//!   and a result for a UID that was not asked for fails the whole call.
//! - **Pods**: the kubelet prepares a pod's claims in one call per driver, skips claims already
//!   prepared (another pod shares them), and unprepares a claim only when no pod references it
//!   any more ([`Kubelet::dra_prepare_pod`](crate::Kubelet::dra_prepare_pod),
//!   [`Kubelet::dra_remove_pod`](crate::Kubelet::dra_remove_pod)).
//! - **Kubelet restart**: registered plugins are forgotten (they register again through the
//!   watcher); prepared claims and pod references stay, as the kubelet's claim checkpoint keeps
//!   them.
//!
//! Left out: ResourceSlices and their wiping, the optional `DRAResourceHealth` stream, CDI spec
//! files, and the ResourceClaim objects themselves (callers name the claims).

pub(crate) mod types;

use types::DraEndpoint;
pub use types::{
    ClaimError, ClaimResults, DraClaim, DraDevice, DraError, DraPluginRecord, DraService,
    HealthService, PreparedClaim,
};

use crate::shared::Shared;
pub use devplug_proto::dra_health::HealthStream;
use devplug_proto::{dra_v1, dra_v1beta1};
use hyper_util::rt::TokioIo;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// How long the kubelet waits for an endpoint's socket to accept before a call (its
/// connectivity check in `dra_plugin.go`).
const CONNECT_CHECK: Duration = Duration::from_secs(1);

/// The name of the prepare call, as error messages give it.
pub(crate) const PREPARE: &str = "NodePrepareResources";

/// The method name of the device health stream, for errors.
const WATCH_HEALTH: &str = "NodeWatchResources";
/// The name of the unprepare call, as error messages give it.
pub(crate) const UNPREPARE: &str = "NodeUnprepareResources";

/// `validateSupportedServices`: the first entry of the plugin's list the kubelet knows.
pub(crate) fn validate(
    driver: &str,
    endpoint: &Path,
    supported: &[String],
) -> Result<DraService, String> {
    let chosen = if supported.is_empty() {
        Err("empty list of supported gRPC services (aka supported versions)".to_owned())
    } else {
        supported
            .iter()
            .find_map(|s| DraService::from_name(s))
            .ok_or_else(|| {
                format!(
                    "none of services supported by the plugin ({}) are supported by the kubelet ({})",
                    go_quoted(supported.iter().map(String::as_str)),
                    go_quoted(DraService::ALL.iter().map(|s| s.name())),
                )
            })
    };
    chosen.map_err(|err| {
        format!(
            "invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {}: {err}",
            endpoint.display()
        )
    })
}

/// A list as Go's `%q` prints a `[]string`: `["a" "b"]`.
fn go_quoted<'a>(items: impl Iterator<Item = &'a str>) -> String {
    let quoted: Vec<String> = items.map(|s| format!("{s:?}")).collect();
    format!("[{}]", quoted.join(" "))
}

/// `RegisterPlugin` for a DRA plugin: adds the endpoint, with a lazy connection to it.
pub(crate) fn add(
    shared: &Arc<Shared>,
    driver: &str,
    endpoint: &Path,
    registration_socket: &Path,
    service: DraService,
    health: Option<HealthService>,
) -> Result<(), String> {
    let channel = lazy_channel(endpoint);
    let record = DraPluginRecord {
        driver: driver.to_owned(),
        endpoint: endpoint.to_path_buf(),
        registration_socket: registration_socket.to_path_buf(),
        service,
        health,
        registered_at: Instant::now(),
    };
    let added = shared.modify(|node| {
        let plugins = &mut node.dra.plugins;
        if plugins
            .iter()
            .any(|p| p.record.driver == driver && p.record.endpoint == endpoint)
        {
            // One instance cannot take over another instance's endpoint.
            return Err(format!(
                "endpoint {} already registered for DRA driver plugin {driver}",
                endpoint.display()
            ));
        }
        plugins.push(DraEndpoint { record, channel });
        Ok(plugins.iter().filter(|p| p.record.driver == driver).count())
    })?;
    tracing::info!(%driver, endpoint = %endpoint.display(), %service, endpoints = added, "DRA plugin registered");
    Ok(())
}

/// `DeRegisterPlugin`: removes the driver's endpoint (the first match, as the kubelet does).
pub(crate) fn remove(shared: &Arc<Shared>, driver: &str, endpoint: &Path) {
    let removed = shared.modify(|node| {
        let plugins = &mut node.dra.plugins;
        let found = plugins
            .iter()
            .position(|p| p.record.driver == driver && p.record.endpoint == endpoint);
        found.map(|i| plugins.remove(i)).is_some()
    });
    if removed {
        tracing::info!(%driver, endpoint = %endpoint.display(), "DRA plugin deregistered");
    }
}

/// A connection made on first use, with authority `localhost`.
fn lazy_channel(path: &Path) -> Channel {
    let path = path.to_path_buf();
    Endpoint::from_static("http://localhost").connect_with_connector_lazy(tower::service_fn(
        move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        },
    ))
}

/// Checks that `path` accepts a connection within [`CONNECT_CHECK`].
async fn accepts(path: &Path) -> std::io::Result<()> {
    match tokio::time::timeout(CONNECT_CHECK, UnixStream::connect(path)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(err)) => Err(err),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no connection within 1s",
        )),
    }
}

/// The endpoint a call for `driver` goes to: the newest that accepts connections, else the
/// newest (whose failure to connect is the call's error).
async fn pick(shared: &Shared, driver: &str) -> Result<(Channel, DraService, PathBuf), DraError> {
    if driver.is_empty() {
        return Err(DraError::EmptyDriverName);
    }
    let candidates: Vec<(Channel, DraService, PathBuf)> = shared.read(|node| {
        node.dra
            .plugins
            .iter()
            .rev()
            .filter(|p| p.record.driver == driver)
            .map(|p| {
                (
                    p.channel.clone(),
                    p.record.service,
                    p.record.endpoint.clone(),
                )
            })
            .collect()
    });
    let mut first_error = None;
    for (channel, service, endpoint) in candidates {
        match accepts(&endpoint).await {
            Ok(()) => return Ok((channel, service, endpoint)),
            Err(source) => {
                first_error.get_or_insert(DraError::Dial {
                    driver: driver.to_owned(),
                    endpoint,
                    source,
                });
            }
        }
    }
    Err(first_error.unwrap_or_else(|| DraError::NotRegistered(driver.to_owned())))
}

/// Runs one call with the per-call timeout (sent as `grpc-timeout` and enforced here).
async fn timed<T>(
    driver: &str,
    method: &'static str,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, DraError> {
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) if started.elapsed() >= timeout => {
            tracing::debug!(%status, "DRA call ended at its deadline");
            Err(DraError::Timeout {
                driver: driver.to_owned(),
                method,
                after: timeout,
            })
        }
        Ok(Err(status)) => Err(DraError::Status {
            driver: driver.to_owned(),
            method,
            code: status.code(),
            message: status.message().to_owned(),
        }),
        Err(_) => Err(DraError::Timeout {
            driver: driver.to_owned(),
            method,
            after: timeout,
        }),
    }
}

/// Checks an answer (claim UID → value or error) against the claims asked for.
fn check<T>(
    driver: &str,
    method: &'static str,
    claims: &[DraClaim],
    mut answer: BTreeMap<String, (T, String)>,
) -> Result<ClaimResults<T>, DraError> {
    if let Some(uid) = answer
        .keys()
        .find(|uid| !claims.iter().any(|c| &&c.uid == uid))
    {
        return Err(DraError::UnknownClaim {
            driver: driver.to_owned(),
            method,
            uid: uid.clone(),
        });
    }
    Ok(claims
        .iter()
        .map(|claim| {
            let result = match answer.remove(&claim.uid) {
                None => Err(ClaimError::NotAnswered),
                Some((_, error)) if !error.is_empty() => Err(ClaimError::Failed(error)),
                Some((value, _)) => Ok(value),
            };
            (claim.uid.clone(), result)
        })
        .collect())
}

/// Opens the device health stream (`DRAResourceHealth/NodeWatchResources`) of `driver`'s
/// chosen endpoint, as the kubelet does at registration with the `ResourceHealthStatus`
/// feature: in `v1` where the plugin lists it (a 1.37 kubelet's choice), else `v1alpha1`. No
/// deadline: the stream lives as long as the plugin.
pub(crate) async fn watch_health(shared: &Shared, driver: &str) -> Result<HealthStream, DraError> {
    let (channel, _, endpoint) = pick(shared, driver).await?;
    let listed = shared.read(|node| {
        node.dra
            .plugins
            .iter()
            .find(|p| p.record.driver == driver && p.record.endpoint == endpoint)
            .and_then(|p| p.record.health)
    });
    // A plugin that lists none is asked in v1alpha1, as kubelets before 1.37 asked every plugin
    // (an Unimplemented answer then says it has no stream).
    let service = listed.unwrap_or(HealthService::V1alpha1);
    HealthStream::open(channel, service)
        .await
        .map_err(|status| DraError::Status {
            driver: driver.to_owned(),
            method: WATCH_HEALTH,
            code: status.code(),
            message: status.message().to_owned(),
        })
}

/// `NodePrepareResources` for `claims` on `driver`; claims that succeed are recorded as
/// prepared.
pub(crate) async fn prepare(
    shared: &Shared,
    driver: &str,
    claims: &[DraClaim],
) -> Result<ClaimResults<Vec<DraDevice>>, DraError> {
    let (channel, service, _) = pick(shared, driver).await?;
    let timeout = shared.config.dra_call_timeout;
    let answer: BTreeMap<String, (Vec<DraDevice>, String)> = match service {
        DraService::V1 => {
            let mut request = tonic::Request::new(dra_v1::NodePrepareResourcesRequest {
                claims: claims.iter().map(DraClaim::to_v1).collect(),
            });
            request.set_timeout(timeout);
            let mut client = dra_v1::dra_plugin_client::DraPluginClient::new(channel);
            timed(
                driver,
                PREPARE,
                timeout,
                client.node_prepare_resources(request),
            )
            .await?
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r.devices.into_iter().map(DraDevice::from_v1).collect();
                (uid, (devices, r.error))
            })
            .collect()
        }
        DraService::V1beta1 => {
            let mut request = tonic::Request::new(dra_v1beta1::NodePrepareResourcesRequest {
                claims: claims.iter().map(DraClaim::to_v1beta1).collect(),
            });
            request.set_timeout(timeout);
            let mut client = dra_v1beta1::dra_plugin_client::DraPluginClient::new(channel);
            timed(
                driver,
                PREPARE,
                timeout,
                client.node_prepare_resources(request),
            )
            .await?
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r.devices.into_iter().map(DraDevice::from_v1beta1).collect();
                (uid, (devices, r.error))
            })
            .collect()
        }
    };
    let results = check(driver, PREPARE, claims, answer)?;
    let now = Instant::now();
    shared.modify(|node| {
        let prepared = node.dra.prepared.entry(driver.to_owned()).or_default();
        for claim in claims {
            if let Some(Ok(devices)) = results.get(&claim.uid) {
                prepared.insert(
                    claim.uid.clone(),
                    PreparedClaim {
                        claim: claim.clone(),
                        devices: devices.clone(),
                        prepared_at: now,
                    },
                );
            }
        }
    });
    Ok(results)
}

/// `NodeUnprepareResources` for `claims` on `driver`; claims that succeed are no longer
/// prepared.
pub(crate) async fn unprepare(
    shared: &Shared,
    driver: &str,
    claims: &[DraClaim],
) -> Result<ClaimResults<()>, DraError> {
    let (channel, service, _) = pick(shared, driver).await?;
    let timeout = shared.config.dra_call_timeout;
    let answer: BTreeMap<String, ((), String)> = match service {
        DraService::V1 => {
            let mut request = tonic::Request::new(dra_v1::NodeUnprepareResourcesRequest {
                claims: claims.iter().map(DraClaim::to_v1).collect(),
            });
            request.set_timeout(timeout);
            let mut client = dra_v1::dra_plugin_client::DraPluginClient::new(channel);
            timed(
                driver,
                UNPREPARE,
                timeout,
                client.node_unprepare_resources(request),
            )
            .await?
            .claims
            .into_iter()
            .map(|(uid, r)| (uid, ((), r.error)))
            .collect()
        }
        DraService::V1beta1 => {
            let mut request = tonic::Request::new(dra_v1beta1::NodeUnprepareResourcesRequest {
                claims: claims.iter().map(DraClaim::to_v1beta1).collect(),
            });
            request.set_timeout(timeout);
            let mut client = dra_v1beta1::dra_plugin_client::DraPluginClient::new(channel);
            timed(
                driver,
                UNPREPARE,
                timeout,
                client.node_unprepare_resources(request),
            )
            .await?
            .claims
            .into_iter()
            .map(|(uid, r)| (uid, ((), r.error)))
            .collect()
        }
    };
    let results = check(driver, UNPREPARE, claims, answer)?;
    shared.modify(|node| {
        if let Some(prepared) = node.dra.prepared.get_mut(driver) {
            for (uid, result) in &results {
                if result.is_ok() {
                    prepared.remove(uid);
                }
            }
            if prepared.is_empty() {
                node.dra.prepared.remove(driver);
            }
        }
    });
    Ok(results)
}

/// The first failed claim of `results`, as the kubelet reports it for a pod.
fn first_failure<T>(
    driver: &str,
    method: &'static str,
    claims: &[DraClaim],
    results: &ClaimResults<T>,
) -> Result<(), DraError> {
    for claim in claims {
        if let Some(Err(error)) = results.get(&claim.uid) {
            return Err(DraError::ClaimFailed {
                driver: driver.to_owned(),
                method,
                claim: claim.name.clone(),
                error: error.clone(),
            });
        }
    }
    Ok(())
}

/// The kubelet's `PrepareResources` for one pod: every driver must be registered (else nothing
/// changes), the pod references each claim, claims not yet prepared are prepared in one call
/// per driver, and the first failure is the pod's error.
pub(crate) async fn prepare_pod(
    shared: &Shared,
    pod: &str,
    claims: &[(&str, DraClaim)],
) -> Result<(), DraError> {
    // The validation pass: no driver missing, nothing recorded yet.
    for (driver, _) in claims {
        if driver.is_empty() {
            return Err(DraError::EmptyDriverName);
        }
        let known = shared.read(|node| node.dra.plugins.iter().any(|p| p.record.driver == *driver));
        if !known {
            return Err(DraError::NotRegistered((*driver).to_owned()));
        }
    }
    let batches: BTreeMap<String, Vec<DraClaim>> = shared.modify(|node| {
        let refs = node.dra.pods.entry(pod.to_owned()).or_default();
        let mut batches: BTreeMap<String, Vec<DraClaim>> = BTreeMap::new();
        for (driver, claim) in claims {
            refs.insert(((*driver).to_owned(), claim.clone()));
            let prepared = node
                .dra
                .prepared
                .get(*driver)
                .is_some_and(|p| p.contains_key(&claim.uid));
            let batch = batches.entry((*driver).to_owned()).or_default();
            if !prepared && !batch.contains(claim) {
                batch.push(claim.clone());
            }
        }
        batches.retain(|_, batch| !batch.is_empty());
        batches
    });
    for (driver, batch) in batches {
        let results = prepare(shared, &driver, &batch).await?;
        first_failure(&driver, PREPARE, &batch, &results)?;
    }
    Ok(())
}

/// The kubelet's `UnprepareResources` for a removed pod: claims other pods still reference only
/// lose this pod's reference; the others are unprepared in one call per driver. On a failure
/// the pod keeps its references (the kubelet retries); returns false if the pod had none.
pub(crate) async fn remove_pod(shared: &Shared, pod: &str) -> Result<bool, DraError> {
    let (batches, known) = shared.read(|node| {
        let Some(refs) = node.dra.pods.get(pod) else {
            return (BTreeMap::new(), false);
        };
        let mut batches: BTreeMap<String, Vec<DraClaim>> = BTreeMap::new();
        for (driver, claim) in refs {
            let shared_with_others = node
                .dra
                .pods
                .iter()
                .any(|(other, r)| other != pod && r.contains(&(driver.clone(), claim.clone())));
            if !shared_with_others {
                batches
                    .entry(driver.clone())
                    .or_default()
                    .push(claim.clone());
            }
        }
        (batches, true)
    });
    if !known {
        return Ok(false);
    }
    for (driver, batch) in batches {
        let results = unprepare(shared, &driver, &batch).await?;
        first_failure(&driver, UNPREPARE, &batch, &results)?;
    }
    shared.modify(|node| node.dra.pods.remove(pod));
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_plugins_order_decides_among_known_services() {
        let at = Path::new("/p/dra.sock");
        let both = validate("d", at, &names(&["v1.DRAPlugin", "v1beta1.DRAPlugin"]));
        assert_eq!(both, Ok(DraService::V1));
        let beta_first = validate("d", at, &names(&["v1beta1.DRAPlugin", "v1.DRAPlugin"]));
        assert_eq!(beta_first, Ok(DraService::V1beta1));
        let unknown_first = validate("d", at, &names(&["v2.DRAPlugin", "v1beta1.DRAPlugin"]));
        assert_eq!(unknown_first, Ok(DraService::V1beta1));
    }

    #[test]
    fn unknown_or_no_services_are_refused_with_the_kubelets_words() {
        let at = Path::new("/p/dra.sock");
        let err = validate("gpu.example.com", at, &names(&["v1alpha4.Node"])).unwrap_err();
        assert_eq!(
            err,
            "invalid supported gRPC versions of DRA driver plugin gpu.example.com at endpoint \
             /p/dra.sock: none of services supported by the plugin ([\"v1alpha4.Node\"]) are \
             supported by the kubelet ([\"v1.DRAPlugin\" \"v1beta1.DRAPlugin\"])"
        );
        let err = validate("d", at, &[]).unwrap_err();
        assert!(
            err.ends_with("empty list of supported gRPC services (aka supported versions)"),
            "{err}"
        );
    }

    #[test]
    fn answers_are_checked_claim_by_claim() {
        let a = DraClaim::new("ns", "a", "uid-a");
        let b = DraClaim::new("ns", "b", "uid-b");
        let c = DraClaim::new("ns", "c", "uid-c");
        let answer = BTreeMap::from([
            ("uid-a".to_owned(), (1, String::new())),
            ("uid-c".to_owned(), (0, "no such device".to_owned())),
        ]);
        let results = check("d", PREPARE, &[a, b, c.clone()], answer).unwrap();
        assert_eq!(results["uid-a"], Ok(1));
        assert_eq!(results["uid-b"], Err(ClaimError::NotAnswered));
        assert_eq!(
            results["uid-c"],
            Err(ClaimError::Failed("no such device".into()))
        );
        let stray = BTreeMap::from([("uid-x".to_owned(), (1, String::new()))]);
        let err = check("d", PREPARE, &[c], stray).unwrap_err();
        assert_eq!(
            err.to_string(),
            "NodePrepareResources returned result for unknown claim UID uid-x"
        );
    }
}
