//! The fleet's workload: a DeviceClass of the fleet's driver, a ResourceClaimTemplate of one
//! device (or one share, or one partition), and what asks for it: pods of one claim each, or
//! Jobs of one such pod, as clusterloader2's DRA test makes (long-running ones for the fill,
//! short-lived ones, whose pod the kubelet stand-in ends after [`RUN_FOR`], for the churn).

use super::Variant;
use anyhow::Context;
use futures_util::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The namespace of the benchmark's pods (a shard's: `fleet-<i>`).
pub const NAMESPACE: &str = "fleet";

/// The label of the simulated Nodes that marks which run's they are, where the fleet shares
/// its cluster (an existing one, or shards); the Nodes are tainted
/// ([`SIMULATED_TAINT`]) so that no real workload lands on them, and the run's pods select
/// and tolerate them.
pub const GROUP_LABEL: &str = "devplug-fleet/group";

/// The taint of the simulated Nodes of a shared cluster (`NoSchedule`).
pub const SIMULATED_TAINT: &str = "devplug-fleet/simulated";

/// Where a run's workload goes: its namespace, and the group of Nodes its pods select (`None`:
/// every Node, the run's own control plane having no others).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The namespace of its pods, Jobs and claims.
    pub namespace: String,
    /// The value of [`GROUP_LABEL`] on its Nodes.
    pub group: Option<String>,
}

impl Target {
    /// The whole fleet in its own control plane.
    pub fn own() -> Target {
        Target {
            namespace: NAMESPACE.to_owned(),
            group: None,
        }
    }
}
/// The claim template every pod uses.
const TEMPLATE: &str = "one-device";

/// When each pod or Job (by name) was sent to the API server.
pub type Created = Arc<Mutex<HashMap<String, Instant>>>;

/// The label the Job controller puts on a Job's pods: the Job's name.
pub const JOB_LABEL: &str = "batch.kubernetes.io/job-name";

/// The annotation of a pod the kubelet stand-in ends (phase `Succeeded`) this many
/// milliseconds after it marked it Running: a short-lived Job's pod.
pub const RUN_FOR: &str = "devplug-bench/run-for-ms";

/// What the workload creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A pod of one claim.
    Pod,
    /// A Job of one such pod, which runs for the time given (`None`: until deleted).
    Job(Option<Duration>),
}

/// How fast the workload's objects are created.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pace {
    /// This many creations in flight at once, as fast as they go.
    InFlight(usize),
    /// This many a second.
    PerSecond(f64),
}

/// Claims a pod can get on one node of `devices` devices.
pub fn per_node(variant: Variant, devices: usize) -> usize {
    match variant {
        Variant::Whole => devices,
        // Two shares of 50 of a device's 100 cores; two partitions of 1 of its 2 slices.
        Variant::Share | Variant::Partitions => devices.saturating_mul(2),
    }
}

/// The namespace, the DeviceClass of `driver` and the claim template of `variant`.
pub async fn prepare(
    client: &kube::Client,
    target: &Target,
    driver: &str,
    variant: Variant,
) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    created_or_there(
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": target.namespace } }))?,
            )
            .await,
    )?;
    // One DeviceClass for every shard of a shared cluster: the first one makes it.
    let classes: Api<DeviceClass> = Api::all(client.clone());
    created_or_there(
        classes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": "fleet" },
                    "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == \"{driver}\"") } }] },
                }))?,
            )
            .await,
    )?;
    let exactly = match variant {
        Variant::Whole => json!({ "deviceClassName": "fleet" }),
        Variant::Share => {
            json!({ "deviceClassName": "fleet", "capacity": { "requests": { "cores": "50" } } })
        }
        Variant::Partitions => json!({ "deviceClassName": "fleet", "selectors": [{ "cel": {
            "expression": format!("device.attributes[\"{driver}\"].slices == 1") } }] }),
    };
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), &target.namespace);
    templates
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": TEMPLATE },
                "spec": { "spec": { "devices": { "requests": [{ "name": "dev", "exactly": exactly }] } } },
            }))?,
        )
        .await?;
    Ok(())
}

/// An object made, or there already (made by another shard).
fn created_or_there<T>(result: Result<T, kube::Error>) -> anyhow::Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// The pod of one claim from the template, as a pod or a Job's template: on the target's
/// Nodes where they are a group of a shared cluster.
fn pod_spec(target: &Target) -> serde_json::Value {
    let mut spec = json!({
        "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10",
            "resources": { "requests": { "cpu": "10m", "memory": "16Mi" }, "claims": [{ "name": "dev" }] } }],
        "resourceClaims": [{ "name": "dev", "resourceClaimTemplateName": TEMPLATE }],
    });
    if let Some(group) = &target.group {
        spec["nodeSelector"] = json!({ GROUP_LABEL: group });
        spec["tolerations"] =
            json!([{ "key": SIMULATED_TAINT, "operator": "Exists", "effect": "NoSchedule" }]);
    }
    spec
}

/// Creates pod `name`, noting when it was sent.
pub async fn create(
    client: &kube::Client,
    target: &Target,
    created: &Created,
    name: &str,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &target.namespace);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": "fleet" } },
        "spec": pod_spec(target),
    }))?;
    if let Ok(mut c) = created.lock() {
        c.insert(name.to_owned(), Instant::now());
    }
    pods.create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("create pod {name}"))?;
    Ok(())
}

/// Creates Job `name` of one pod that runs for `run_for` (`None`: until deleted), noting when
/// it was sent.
pub async fn create_job(
    client: &kube::Client,
    target: &Target,
    created: &Created,
    name: &str,
    run_for: Option<Duration>,
) -> anyhow::Result<()> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), &target.namespace);
    let mut spec = pod_spec(target);
    spec["restartPolicy"] = json!("Never");
    let mut annotations = serde_json::Map::new();
    if let Some(run_for) = run_for {
        annotations.insert(RUN_FOR.into(), json!(run_for.as_millis().to_string()));
    }
    let job: Job = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": "fleet" } },
        "spec": {
            "completions": 1, "parallelism": 1, "backoffLimit": 0,
            "template": {
                "metadata": { "labels": { "app": "fleet" }, "annotations": annotations },
                "spec": spec,
            },
        },
    }))?;
    if let Ok(mut c) = created.lock() {
        c.insert(name.to_owned(), Instant::now());
    }
    jobs.create(&PostParams::default(), &job)
        .await
        .with_context(|| format!("create Job {name}"))?;
    Ok(())
}

/// Creates one object of `kind` named `name`.
pub async fn create_kind(
    client: &kube::Client,
    target: &Target,
    created: &Created,
    name: &str,
    kind: Kind,
) -> anyhow::Result<()> {
    match kind {
        Kind::Pod => create(client, target, created, name).await,
        Kind::Job(run_for) => create_job(client, target, created, name, run_for).await,
    }
}

/// Creates `names` as `kind` at `pace`.
pub async fn create_all(
    client: &kube::Client,
    target: &Target,
    created: &Created,
    names: &[String],
    kind: Kind,
    pace: Pace,
) -> anyhow::Result<()> {
    match pace {
        Pace::InFlight(in_flight) => {
            let mut results = futures_util::stream::iter(names)
                .map(|name| create_kind(client, target, created, name, kind))
                .buffer_unordered(in_flight.max(1));
            while let Some(result) = results.next().await {
                result?;
            }
        }
        Pace::PerSecond(rate) => {
            anyhow::ensure!(
                rate.is_finite() && rate > 0.0,
                "a creation rate must be above 0 a second"
            );
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            let mut tasks = Vec::with_capacity(names.len());
            for name in names {
                tick.tick().await;
                let (client, target) = (client.clone(), target.clone());
                let (created, name) = (created.clone(), name.clone());
                tasks.push(tokio::spawn(async move {
                    create_kind(&client, &target, &created, &name, kind).await
                }));
            }
            for task in tasks {
                task.await??;
            }
        }
    }
    Ok(())
}

/// Deletes every Job of the namespace, their pods with them (graceful: the kubelet stand-ins
/// finish the ones still running). In the foreground: each Job stays, being deleted, until its
/// pods are gone, so the Job controller still takes its tracking finalizer off a pod that ends
/// meanwhile (a Job gone first can leave such a pod behind).
pub async fn delete_jobs(client: &kube::Client, target: &Target) -> anyhow::Result<()> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), &target.namespace);
    let params = DeleteParams {
        propagation_policy: Some(kube::api::PropagationPolicy::Foreground),
        ..DeleteParams::default()
    };
    jobs.delete_collection(&params, &Default::default())
        .await
        .context("delete the Jobs")?;
    Ok(())
}

/// Deletes pod `name` as a user does (graceful: the kubelet stand-in finishes it).
pub async fn delete(client: &kube::Client, target: &Target, name: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &target.namespace);
    match pods.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(err) => Err(err).with_context(|| format!("delete pod {name}")),
    }
}

/// Startup latencies (sent → marked Running) of `names`; the ones not Running are counted
/// apart.
pub fn latencies(
    created: &Created,
    running: &Mutex<HashMap<String, Instant>>,
    names: &[String],
) -> (Vec<Duration>, usize) {
    let (Ok(created), Ok(running)) = (created.lock(), running.lock()) else {
        return (Vec::new(), names.len());
    };
    let mut out = Vec::with_capacity(names.len());
    let mut missing = 0;
    for name in names {
        match (created.get(name), running.get(name)) {
            (Some(c), Some(r)) => out.push(r.saturating_duration_since(*c)),
            _ => missing += 1,
        }
    }
    (out, missing)
}

/// Waits (polling the API server every 500 ms, `limit` at most) until `namespace` has no pods
/// and no claims left; the claims no pod owns (the bench made them: the driver mode) are
/// deleted once every pod is gone, as their user would.
pub async fn wait_empty(
    client: &kube::Client,
    target: &Target,
    limit: Duration,
) -> anyhow::Result<Duration> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &target.namespace);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &target.namespace);
    loop {
        let p = pods.list_metadata(&Default::default()).await?.items.len();
        let left = claims.list_metadata(&Default::default()).await?.items;
        if p == 0 && left.is_empty() {
            return Ok(started.elapsed());
        }
        if p == 0 {
            for claim in left
                .iter()
                .filter(|c| c.metadata.owner_references.is_none())
            {
                if let Some(name) = &claim.metadata.name {
                    match claims.delete(name, &DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.is_not_found() => {}
                        Err(err) => {
                            return Err(err).with_context(|| format!("delete claim {name}"))
                        }
                    }
                }
            }
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "after {limit:?}: {p} pods and {} claims left",
            left.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
