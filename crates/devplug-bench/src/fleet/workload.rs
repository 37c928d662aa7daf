//! clusterloader2's DRA workload: a DeviceClass of the fleet's driver, a ResourceClaimTemplate
//! of one device (or one share, or one partition), pods of one claim each; fill, then churn.

use super::Variant;
use anyhow::Context;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The namespace of the benchmark's pods.
pub const NAMESPACE: &str = "fleet";
/// The claim template every pod uses.
const TEMPLATE: &str = "one-device";

/// When each pod (by name) was sent to the API server.
pub type Created = Arc<Mutex<HashMap<String, Instant>>>;

/// Claims a pod can get on one node of `devices` devices.
pub fn per_node(variant: Variant, devices: usize) -> usize {
    match variant {
        Variant::Whole => devices,
        // Two shares of 50 of a device's 100 cores; two partitions of 1 of its 2 slices.
        Variant::Share | Variant::Partitions => devices.saturating_mul(2),
    }
}

/// The namespace, the DeviceClass of `driver` and the claim template of `variant`.
pub async fn prepare(client: &kube::Client, driver: &str, variant: Variant) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": NAMESPACE } }))?,
        )
        .await?;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "fleet" },
                "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == \"{driver}\"") } }] },
            }))?,
        )
        .await?;
    let exactly = match variant {
        Variant::Whole => json!({ "deviceClassName": "fleet" }),
        Variant::Share => {
            json!({ "deviceClassName": "fleet", "capacity": { "requests": { "cores": "50" } } })
        }
        Variant::Partitions => json!({ "deviceClassName": "fleet", "selectors": [{ "cel": {
            "expression": format!("device.attributes[\"{driver}\"].slices == 1") } }] }),
    };
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
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

/// A pod of one claim from the template.
fn pod(name: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": "fleet" } },
        "spec": {
            "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": { "requests": { "cpu": "10m", "memory": "16Mi" }, "claims": [{ "name": "dev" }] } }],
            "resourceClaims": [{ "name": "dev", "resourceClaimTemplateName": TEMPLATE }],
        },
    }))?)
}

/// Creates pod `name`, noting when it was sent.
pub async fn create(client: &kube::Client, created: &Created, name: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let pod = pod(name)?;
    if let Ok(mut c) = created.lock() {
        c.insert(name.to_owned(), Instant::now());
    }
    pods.create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("create pod {name}"))?;
    Ok(())
}

/// Creates `names` with at most `in_flight` requests at once.
pub async fn create_all(
    client: &kube::Client,
    created: &Created,
    names: &[String],
    in_flight: usize,
) -> anyhow::Result<()> {
    let mut results = futures_util::stream::iter(names)
        .map(|name| create(client, created, name))
        .buffer_unordered(in_flight.max(1));
    while let Some(result) = results.next().await {
        result?;
    }
    Ok(())
}

/// Deletes pod `name` as a user does (graceful: the kubelet stand-in finishes it).
pub async fn delete(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
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
/// and no claims left.
pub async fn wait_empty(client: &kube::Client, limit: Duration) -> anyhow::Result<Duration> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);
    loop {
        let p = pods.list_metadata(&Default::default()).await?.items.len();
        let c = claims.list_metadata(&Default::default()).await?.items.len();
        if p == 0 && c == 0 {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "after {limit:?}: {p} pods and {c} claims left"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
