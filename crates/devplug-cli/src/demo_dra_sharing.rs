//! The sharing step of `devplug demo --dra`: one virtual GPU of 100 cores and 16Gi shared by
//! capacity, served by a second DRA driver; three pods whose claims ask for 40 cores each. The
//! real scheduler puts two on the GPU and leaves the third waiting (20 cores are left); the
//! kubelet prepares one share, and its CDI spec shows what the container is told.

use crate::demo::{detail, ms};
use anyhow::Context;
use devplug_backends::virtual_devices::{VirtualBackend, VirtualSettings, VirtualShare};
use devplug_dra::kubelet::{KubeletDirs, Registered};
use devplug_dra::{ClaimBackend, DraDriver, DraDriverSettings};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::PostParams;
use kube::Api;
use kubelet_sim::{DraClaim, Kubelet};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The sharing driver's name.
pub(crate) const DRIVER: &str = "gpu.example.com";
const CLASS: &str = "gpu-share";
const PODS: [&str; 3] = ["server-a", "server-b", "server-c"];

/// Runs the sharing step on the demo's node; returns the driver, for the demo to stop.
pub(crate) async fn walk(
    client: &kube::Client,
    kubelet: &Kubelet,
    dirs: &KubeletDirs,
    node: &str,
    namespace: &str,
    cdi_dir: &Path,
    wait: Duration,
) -> anyhow::Result<DraDriver> {
    let settings = VirtualSettings {
        env: "GPU_VISIBLE_DEVICES".into(),
        id_prefix: "gpu-".into(),
        share: Some(VirtualShare {
            cores: 100,
            memory: Some("16Gi".into()),
            memory_step: "1Gi".into(),
        }),
        ..VirtualSettings::new(1)
    };
    let backend: Arc<dyn ClaimBackend> = Arc::new(
        VirtualBackend::new(&settings)
            .map_err(|e| anyhow::anyhow!("{}: {}", e.field, e.problem))?,
    );
    let driver_settings = DraDriverSettings {
        driver: DRIVER.into(),
        node: node.into(),
        dirs: dirs.clone(),
        cdi_dir: cdi_dir.to_owned(),
        no_execute_after: None,
        device_metadata: false,
    };
    let driver = DraDriver::start(driver_settings, backend, client.clone())
        .await
        .context("cannot start the sharing DRA driver")?;
    let mut registered = driver.registered();
    tokio::time::timeout(wait, registered.wait_for(|r| *r == Registered::Yes))
        .await
        .context("the kubelet did not register the sharing driver in time")?
        .context("the sharing driver stopped")?;
    detail(&format!(
        "driver {DRIVER} publishes gpu-0 with allowMultipleAllocations: cores 100 (steps of 1), memory 16Gi (steps of 1Gi)"
    ));

    let classes: Api<DeviceClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": { "name": CLASS },
                "spec": { "selectors": [{ "cel": {
                    "expression": format!("device.driver == \"{DRIVER}\"") } }] },
            }))?,
        )
        .await
        .context("cannot create the sharing DeviceClass")?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let started = Instant::now();
    for pod in PODS {
        claims
            .create(
                &PostParams::default(),
                &object(json!({
                    "metadata": { "name": pod },
                    "spec": { "devices": { "requests": [{
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": CLASS,
                            "capacity": { "requests": { "cores": "40", "memory": "4Gi" } },
                        },
                    }] } },
                }))?,
            )
            .await
            .context("cannot create a sharing ResourceClaim")?;
        pods.create(
            &PostParams::default(),
            &object(json!({
                "metadata": { "name": pod },
                "spec": {
                    "resourceClaims": [{ "name": "gpu", "resourceClaimName": pod }],
                    "containers": [{ "name": "main", "image": "example.invalid/server",
                                     "resources": { "claims": [{ "name": "gpu" }] } }],
                },
            }))?,
        )
        .await
        .context("cannot create a sharing Pod")?;
    }
    detail("three pods, each with a claim asking capacity.requests {cores: 40, memory: 4Gi}:");
    // Two fit (80 of 100 cores); the third would need 120.
    let deadline = Instant::now() + wait;
    let mut placed = Vec::new();
    while placed.len() < 2 {
        placed.clear();
        for pod in PODS {
            let claim = claims.get(pod).await.context("cannot read a claim")?;
            let result = claim
                .status
                .and_then(|s| s.allocation)
                .and_then(|a| a.devices)
                .and_then(|d| d.results)
                .and_then(|r| r.into_iter().next());
            if let Some(result) = result {
                placed.push((pod, result));
            }
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "the scheduler did not place two shares within {} s",
                wait.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (pod, result) in &placed {
        let consumed: Vec<String> = result
            .consumed_capacity
            .iter()
            .flatten()
            .map(|(k, v)| format!("{k} {}", v.0))
            .collect();
        detail(&format!(
            "  {pod}: {} share {} consumed {}",
            result.device,
            result.share_id.as_deref().unwrap_or("-"),
            consumed.join(", ")
        ));
    }
    // The scheduler has looked at all three by now; give it a moment more for the third.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let waiting: Vec<&str> = {
        let mut waiting = Vec::new();
        for pod in PODS {
            let bound = pods
                .get(pod)
                .await
                .context("cannot read a Pod")?
                .spec
                .and_then(|s| s.node_name)
                .is_some();
            if !bound {
                waiting.push(pod);
            }
        }
        waiting
    };
    detail(&format!(
        "  {}: pending, 20 cores left ({} after the pods were created)",
        waiting.join(", "),
        ms(started.elapsed())
    ));

    let Some((pod, _)) = placed.first() else {
        anyhow::bail!("no share was placed");
    };
    let claim = claims.get(pod).await.context("cannot read a claim")?;
    let uid = claim.metadata.uid.context("the claim has no UID")?;
    let started = Instant::now();
    let answer = kubelet
        .dra_prepare(DRIVER, &[DraClaim::new(namespace, *pod, &uid)])
        .await
        .context("NodePrepareResources of a share failed")?;
    if let Some(Err(err)) = answer.get(&uid) {
        anyhow::bail!("NodePrepareResources of {pod}: {err:?}");
    }
    let spec_path = devplug_dra::prepare::spec_path(cdi_dir, DRIVER, &uid);
    let text = std::fs::read_to_string(&spec_path)
        .with_context(|| format!("cannot read {}", spec_path.display()))?;
    let spec: serde_json::Value = serde_json::from_str(&text).context("the CDI spec")?;
    let env: Vec<&str> = spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str())
        .collect();
    detail(&format!(
        "the kubelet prepares {pod}'s share in {}: its container is told {}",
        ms(started.elapsed()),
        env.join(" ")
    ));
    Ok(driver)
}

fn object<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> anyhow::Result<T> {
    serde_json::from_value(value).context("building a Kubernetes object")
}
