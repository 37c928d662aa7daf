//! DRA on the real node: the chart with a `dra:` resource, the example's DeviceClass,
//! ResourceClaimTemplate and pod applied unchanged; the scheduler allocates, the kubelet asks
//! devplug to prepare, the runtime applies the CDI spec devplug wrote (containerd here, CRI-O in
//! `crio.rs`). And on a containerd that cannot apply CDI specs (1.6), where the pod runs without
//! its devices: devplug must say so.

use crate::support::{self, figure};
use crate::Outcome;
use devplug_testkit::node::{requirements, Node, NODE_NAME};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use std::time::{Duration, Instant};

const DRIVER: &str = "npu.example.com";

pub fn claim_reaches_the_container(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let release = install_and_wait_for_slice(node).await?;
        let (device, out) = run_example(node, &client, "basic", "dra-npu-demo").await?;
        let edited: Vec<&str> = out
            .lines()
            .filter(|l| l.contains(&device) && l.contains('='))
            .collect();
        assert!(
            !edited.is_empty(),
            "no env names the allocated device {device}:\n{out}"
        );
        figure(&format!(
            "DRA container env from the CDI spec: {}",
            edited.join(" ")
        ));
        device_metadata_in_container(node, &client, "dra-npu-demo", &device).await?;
        health_in_pod_status(&client, "dra-npu-demo", &device).await?;
        let data =
            device_status_in_claim(&client, "dra-npu-demo", DRIVER, ("True", "Prepared", ""))
                .await?;
        assert!(
            data["cdiDevices"]
                .as_array()
                .is_some_and(|ids| !ids.is_empty())
                && data["requests"] == serde_json::json!(["npu"]),
            "the device's data names its CDI devices and request: {data}"
        );
        let claim_uid = pod_claim(&client, "dra-npu-demo")
            .await?
            .metadata
            .uid
            .unwrap_or_default();
        remove_example(node, "basic")?;
        device_metadata_removed(&claim_uid).await?;
        shared_by_capacity(node, &client).await?;
        partitioned(node, &client).await?;
        taints_and_health(node, &client).await?;
        // A pod written for the device plugin (limits, no claim) served by the DRA driver
        // through its DeviceClass's extended resource name.
        let (device, out) =
            run_example(node, &client, "extended-resource", "dra-npu-extended").await?;
        assert!(
            out.lines().any(|l| l.contains(&device)),
            "no env names the device allocated for the extended resource, {device}:\n{out}"
        );
        remove_example(node, "extended-resource")?;
        release.delete_objects(node)?;
        Ok(())
    })
}

/// The basic example's container read its device metadata file (KEP-5304, the driver's
/// `device_metadata: true`) where upstream's readers look, after its env: a stream of v1beta1
/// then v1alpha1 `DeviceMetadata`, naming the claim, the pod's name for it, the request and
/// the allocated device with the attributes its slice publishes.
async fn device_metadata_in_container(
    node: &Node,
    client: &kube::Client,
    pod: &str,
    device: &str,
) -> Result<(), String> {
    let claim = pod_claim(client, pod)
        .await?
        .metadata
        .name
        .unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    let objects = loop {
        let log = node
            .container_log("default", pod, "demo")
            .unwrap_or_default();
        let start = log.find("\n{").map(|i| i + 1).unwrap_or(log.len());
        let objects: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&log[start..])
            .into_iter::<serde_json::Value>()
            .map_while(Result::ok)
            .collect();
        if objects.len() == 2 {
            break objects;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the container of {pod} printed no device metadata stream in 30 s:\n{log}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let versions: Vec<&str> = objects
        .iter()
        .filter_map(|o| o["apiVersion"].as_str())
        .collect();
    assert_eq!(
        versions,
        [
            "metadata.resource.k8s.io/v1beta1",
            "metadata.resource.k8s.io/v1alpha1"
        ]
    );
    let first = &objects[0];
    assert_eq!(first["kind"], "DeviceMetadata");
    assert_eq!(first["metadata"]["name"], claim.as_str());
    assert_eq!(first["podClaimName"], "npu", "{first}");
    assert_eq!(first["requests"][0]["name"], "npu", "{first}");
    let got = &first["requests"][0]["devices"][0];
    assert_eq!(got["driver"], DRIVER);
    assert_eq!(got["name"], device);
    assert!(
        got["attributes"]["resource.kubernetes.io/numaNode"]["int"].is_i64(),
        "the device's attributes as its slice has them: {got}"
    );
    figure(&format!(
        "DRA device metadata read in the container: {} {}",
        versions.join(" + "),
        got
    ));
    Ok(())
}

/// Once the basic example's pod is gone, the kubelet unprepares its claim and devplug removes
/// the claim's device metadata folder. The example is deleted with `--force`: the kubelet then
/// unprepares from its DRA manager's reconcile loop, which runs every 60 s (a pod deleted
/// gracefully is unprepared as it terminates), so this waits up to 90 s. Only this claim's
/// folder counts: a claim an earlier scenario left prepared (its driver deleted before the
/// kubelet unprepared it) is no business of this one.
async fn device_metadata_removed(claim_uid: &str) -> Result<(), String> {
    let dir = std::path::Path::new(devplug_testkit::node::KUBELET_ROOT)
        .join("plugins")
        .join(DRIVER)
        .join("dra-device-metadata")
        .join(claim_uid);
    let removed = Instant::now();
    while dir.exists() {
        if removed.elapsed() > Duration::from_secs(90) {
            return Err(format!(
                "the device metadata of the unprepared claim is still in {} after 90 s",
                dir.display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    figure(&format!(
        "DRA example deleted (--force) → its claim unprepared, its device metadata removed: {:.1} s",
        removed.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// The kubelet shows the health devplug streams (`DRAResourceHealth`) in the pod's status: the
/// claim's device `Healthy` (without the stream it would read `Unknown`). The kubelet names the
/// device by the CDI id devplug returned for it (one per request), so the claim's one device is
/// found by the claim's name.
async fn health_in_pod_status(
    client: &kube::Client,
    pod: &str,
    device: &str,
) -> Result<(), String> {
    let started = Instant::now();
    let shown = support::wait_pod(
        client,
        "default",
        pod,
        Duration::from_secs(60),
        |p: &k8s_openapi::api::core::v1::Pod| !device_health(p).is_empty(),
    )
    .await
    .map_err(|e| format!("no allocatedResourcesStatus in the pod's status: {e}"))?;
    let health = device_health(&shown);
    assert!(
        health
            .iter()
            .any(|(name, _, h)| name == "claim:npu" && h == "Healthy"),
        "the claim's device {device} Healthy in the pod's status: {health:?}"
    );
    figure(&format!(
        "DRA device health in the pod's status (allocatedResourcesStatus, from devplug's \
         health stream) within {:.1} s: {health:?}",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Waits (60 s) until the claim of pod `pod` (generated from its template: named after the pod)
/// has one entry of `driver` in `status.devices` whose `Ready` condition has `want`'s status
/// and reason and a message containing `want`'s third part; returns its `data`. Shown as a figure.
async fn device_status_in_claim(
    client: &kube::Client,
    pod: &str,
    driver: &str,
    want: (&str, &str, &str),
) -> Result<serde_json::Value, String> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let started = Instant::now();
    let mut seen = String::new();
    while started.elapsed() < Duration::from_secs(60) {
        let list = claims
            .list(&Default::default())
            .await
            .map_err(|e| format!("list claims: {e}"))?;
        let entry = list
            .items
            .into_iter()
            .filter(|c| {
                c.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(pod))
            })
            .flat_map(|c| c.status.and_then(|s| s.devices).unwrap_or_default())
            .find(|d| d.driver == driver);
        if let Some(entry) = entry {
            let ready = entry
                .conditions
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| (c.status, c.reason, c.message))
                .unwrap_or_default();
            let data = entry.data.map(|d| d.0).unwrap_or_default();
            seen = format!("{} {:?} {data}", entry.device, ready);
            if ready.0 == want.0 && ready.1 == want.1 && ready.2.contains(want.2) {
                figure(&format!(
                    "DRA device status in the claim (status.devices, written by devplug) within {:.1} s: {seen}",
                    started.elapsed().as_secs_f64()
                ));
                return Ok(data);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(format!(
        "the claim of {pod} has no {driver} entry in status.devices with Ready {want:?} in 60 s (last seen: {seen:?})"
    ))
}

/// Every (status name, resource id, health) in the pod's `allocatedResourcesStatus`.
pub fn device_health(pod: &k8s_openapi::api::core::v1::Pod) -> Vec<(String, String, String)> {
    pod.status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .flat_map(|c| c.allocated_resources_status.iter().flatten())
        .flat_map(|r| {
            r.resources.iter().flatten().map(|res| {
                (
                    r.name.clone(),
                    res.resource_id.clone(),
                    res.health.clone().unwrap_or_default(),
                )
            })
        })
        .collect()
}

/// The `sharing` example: two pods whose claims ask for 50 cores and 4Gi each, on the one GPU
/// of `gpu.example.com` that allows multiple allocations; both Running, each container told
/// the device and its share.
async fn shared_by_capacity(node: &Node, client: &kube::Client) -> Result<(), String> {
    let took = apply_and_run(node, client, "sharing", &["dra-share-a", "dra-share-b"]).await?;
    figure(&format!(
        "sharing example: two pods on one GPU created → Running: {:.1} s",
        took.as_secs_f64()
    ));
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let mut shares = Vec::new();
    for claim in claims
        .list(&Default::default())
        .await
        .map_err(|e| format!("list claims: {e}"))?
        .items
    {
        let results = claim
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .unwrap_or_default();
        shares.extend(
            results
                .into_iter()
                .filter(|r| r.driver == "gpu.example.com")
                .map(|r| (r.device, r.share_id)),
        );
    }
    assert_eq!(shares.len(), 2, "two shares: {shares:?}");
    assert!(
        shares.iter().all(|(d, s)| d == "gpu-0" && s.is_some()) && shares[0].1 != shares[1].1,
        "two distinct shares of gpu-0: {shares:?}"
    );
    for pod in ["dra-share-a", "dra-share-b"] {
        let out = printed_env(node, pod).await;
        for want in [
            "GPU_VISIBLE_DEVICES=gpu-0",
            "GPU_VISIBLE_DEVICES_CORES=50",
            "GPU_VISIBLE_DEVICES_MEMORY=4294967296",
        ] {
            assert!(
                out.lines().any(|l| l == want),
                "{pod}: no {want} in the container:\n{out}"
            );
        }
    }
    figure("sharing example: both containers see GPU_VISIBLE_DEVICES=gpu-0, _CORES=50, _MEMORY=4294967296");
    remove_example(node, "sharing")
}

/// The `partitions` example: a quarter and a half of one 4-slice device, both Running, each
/// container told its partition and slices, the two not overlapping.
async fn partitioned(node: &Node, client: &kube::Client) -> Result<(), String> {
    let pods = ["dra-part-quarter", "dra-part-half"];
    let took = apply_and_run(node, client, "partitions", &pods).await?;
    let mut slices = Vec::new();
    for pod in pods {
        let out = printed_env(node, pod).await;
        let device = support::env_value(&out, "PART_VISIBLE_DEVICES")
            .ok_or_else(|| format!("{pod}: no PART_VISIBLE_DEVICES:\n{out}"))?
            .to_owned();
        let range = support::env_value(&out, "PART_VISIBLE_DEVICES_SLICES")
            .ok_or_else(|| format!("{pod}: no PART_VISIBLE_DEVICES_SLICES:\n{out}"))?
            .to_owned();
        let (first, last) = range
            .split_once('-')
            .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
            .ok_or_else(|| format!("{pod}: slices {range:?}"))?;
        slices.push((device, first, last));
    }
    figure(&format!(
        "partitions example: a quarter and a half of one device created → Running: {:.1} s; {slices:?}",
        took.as_secs_f64()
    ));
    let (quarter, half) = (&slices[0], &slices[1]);
    assert!(
        quarter.0.starts_with("part-0-s1-") && quarter.1 == quarter.2,
        "{quarter:?}"
    );
    assert!(
        half.0.starts_with("part-0-s2-") && half.2 == half.1 + 1,
        "{half:?}"
    );
    assert!(
        quarter.1 < half.1 || quarter.1 > half.2,
        "the quarter {quarter:?} overlaps the half {half:?}"
    );
    remove_example(node, "partitions")
}

/// The `taints` example's boards (files whose first line is their health).
const BOARDS: &str = "/var/lib/devplug/boards";

/// The `taints` example: board-b says it is broken, so its slice entry carries a NoSchedule
/// taint and the example's pod gets board-a; then board-a breaks while the pod runs, and the
/// kubelet shows it Unhealthy, with the reason, in the pod's status (devplug's health stream),
/// and Healthy again once it recovers.
async fn taints_and_health(node: &Node, client: &kube::Client) -> Result<(), String> {
    let write = |board: &str, line: &str| {
        let path = format!("{BOARDS}/{board}");
        std::fs::write(&path, format!("{line}\n")).map_err(|e| format!("{path}: {e}"))
    };
    std::fs::create_dir_all(BOARDS).map_err(|e| format!("{BOARDS}: {e}"))?;
    write("board-a", "Healthy")?;
    write("board-b", "fan failure")?;
    let outcome = async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let taints = slice_taints(node)?;
            if taints.lines().any(|l| l == "board-b NoSchedule fan-failure") {
                figure(&format!("taints example: board-b tainted in its ResourceSlice: {:?}", taints.lines().filter(|l| l.starts_with("board-")).collect::<Vec<_>>()));
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "board-b has no NoSchedule taint in 60 s:\n{taints}\n{}",
                    support::devplug_log(node)
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (device, out) = run_example_of(node, client, "taints", "board-user", "boards.example.com").await?;
        assert_eq!(device, "board-a", "never the tainted board");
        assert!(
            out.lines().any(|l| l == "BOARDS=board-a"),
            "BOARDS=board-a in the container:\n{out}"
        );
        let broke = Instant::now();
        write("board-a", "overheated")?;
        let shows = |want: &'static str| {
            move |p: &k8s_openapi::api::core::v1::Pod| {
                p.status
                    .iter()
                    .flat_map(|s| s.container_statuses.iter().flatten())
                    .flat_map(|c| c.allocated_resources_status.iter().flatten())
                    .filter(|r| r.name == "claim:board")
                    .flat_map(|r| r.resources.iter().flatten())
                    .any(|h| {
                        h.health.as_deref() == Some(want)
                            && (want == "Healthy"
                                || h.message.as_deref().is_some_and(|m| m.contains("overheated")))
                    })
            }
        };
        let unhealthy = support::wait_pod(
            client,
            "default",
            "board-user",
            Duration::from_secs(60),
            shows("Unhealthy"),
        )
        .await
        .map_err(|e| format!("board-a Unhealthy (overheated) in the pod's status: {e}"))?;
        device_status_in_claim(client, "board-user", "boards.example.com", ("False", "Unhealthy", "overheated")).await?;
        figure(&format!(
            "DRA health in the pod's status: board-a Unhealthy with its reason {:.1} s after its file said so: {:?}",
            broke.elapsed().as_secs_f64(),
            device_health(&unhealthy)
        ));
        write("board-a", "Healthy")?;
        support::wait_pod(
            client,
            "default",
            "board-user",
            Duration::from_secs(60),
            shows("Healthy"),
        )
        .await
        .map_err(|e| format!("board-a Healthy again in the pod's status: {e}"))?;
        device_status_in_claim(client, "board-user", "boards.example.com", ("True", "Prepared", "")).await?;
        device_taint_rule_evicts(node, client, &write).await?;
        remove_example(node, "taints")
    }
    .await;
    let _ = std::fs::remove_dir_all(BOARDS);
    outcome
}

/// Every device of the node's ResourceSlices as a line `<name> <effects> <values>` of its
/// taints (blank after the name for an untainted one).
fn slice_taints(node: &Node) -> Result<String, String> {
    node.kubectl(
        &[
            "get",
            "resourceslices",
            "-o",
            "jsonpath={range .items[*].spec.devices[*]}{.name} {.taints[*].effect} {.taints[*].value}{\"\\n\"}{end}",
        ],
        None,
    )
}

/// An administrator's DeviceTaintRule (`resource.k8s.io/v1beta2`, the `DRADeviceTaintRules`
/// gate that Kubernetes 1.37 turns on) with `NoExecute` on board-a, which `board-user` uses:
/// kube-controller-manager evicts the pod. devplug's own health taints keep working beside the
/// rule: board-b, repaired, loses its taint in devplug's slice, where the rule's taint never
/// shows (it is the administrator's, not the driver's).
async fn device_taint_rule_evicts(
    node: &Node,
    client: &kube::Client,
    write: &(dyn Fn(&str, &str) -> Result<(), String> + Sync),
) -> Result<(), String> {
    let rule = r#"{"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule",
        "metadata": {"name": "board-a-maintenance"},
        "spec": {"deviceSelector": {"driver": "boards.example.com", "device": "board-a"},
                 "taint": {"key": "example.com/maintenance", "value": "planned", "effect": "NoExecute"}}}"#;
    let tainted = Instant::now();
    node.kubectl(&["apply", "-f", "-"], Some(rule))?;
    let outcome = async {
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "default");
        let deadline = Instant::now() + Duration::from_secs(60);
        while pods
            .get_opt("board-user")
            .await
            .map_err(|e| format!("get board-user: {e}"))?
            .is_some_and(|p| p.metadata.deletion_timestamp.is_none())
        {
            if Instant::now() > deadline {
                return Err(format!(
                    "board-user not evicted 60 s after a NoExecute DeviceTaintRule on its board:\n{}",
                    node.kubectl(&["get", "devicetaintrules", "-o", "yaml"], None)
                        .unwrap_or_default()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        figure(&format!(
            "DeviceTaintRule NoExecute on board-a: its pod evicted {:.1} s after the rule was created",
            tainted.elapsed().as_secs_f64()
        ));
        // 1.36.2's kube-scheduler panics when a ResourceSlice changes while a DeviceTaintRule
        // exists (its slice tracker expects the rule in v1alpha3 and gets v1beta2; fixed for
        // 1.37 and in a later 1.36 patch, kubernetes PR 139651): the rule goes before the next
        // slice change, and the scheduler starts again if it fell over all the same.
        node.kubectl(&["delete", "devicetaintrule", "board-a-maintenance", "--wait=true"], None)?;
        if !node.scheduler_running() {
            figure("DeviceTaintRule: kube-scheduler 1.36.2 exited (its DeviceTaintRule panic); started again");
        }
        node.restart_scheduler()?;
        write("board-b", "Healthy")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let taints = slice_taints(node)?;
            let boards: Vec<&str> = taints
                .lines()
                .filter(|l| l.starts_with("board-"))
                .map(str::trim_end)
                .collect();
            if boards == ["board-a", "board-b"] {
                figure("DeviceTaintRule beside devplug's health taints: board-b repaired, its taint gone from the slice; the rule's taint never in it");
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "board-b's health taint still in the slice 60 s after its repair:\n{taints}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    .await;
    node.kubectl(
        &[
            "delete",
            "devicetaintrule",
            "board-a-maintenance",
            "--ignore-not-found",
        ],
        None,
    )?;
    outcome
}

/// The node switched to a containerd without CDI (Debian 12's 1.6.20): the claim is allocated
/// and prepared and its pod runs without the device, and devplug says so at ERROR, in
/// `/readyz` and in a Node event. Then the node's own containerd again.
pub fn runtime_without_cdi_says_so(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let bin_dir = requirements::containerd_without_cdi()?;
        let outcome = async {
            let switched = Instant::now();
            let runtime = node
                .switch_containerd(Some((&bin_dir, "containerd-without-cdi")))
                .await?;
            figure(&format!(
                "runtime switched to {runtime} (kubelet and containerd restarted, images \
                 imported): {:.1} s",
                switched.elapsed().as_secs_f64()
            ));
            says_so(node, &runtime).await
        }
        .await;
        // Back to the node's own containerd, whatever happened.
        let back = node.switch_containerd(None).await.map(drop);
        outcome.and(back)
    })
}

async fn says_so(node: &'static Node, runtime: &str) -> Result<(), String> {
    let client = node.client().await?;
    let release = install_and_wait_for_slice(node).await?;
    // /readyz (the release is on the host network, metrics on 18080) names the driver and why.
    let deadline = Instant::now() + Duration::from_secs(30);
    let readyz = loop {
        let got = support::http_get(18080, "/readyz");
        if let Some((503, body)) = &got {
            break body.clone();
        }
        if Instant::now() > deadline {
            return Err(format!(
                "/readyz on a runtime without CDI: {got:?}, not 503\n{}",
                support::devplug_log(node)
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        readyz.contains(&format!("DRA driver {DRIVER}")) && readyz.contains(runtime),
        "/readyz does not name the driver and the runtime: {readyz}"
    );
    figure(&format!("/readyz on {runtime}: 503 {}", readyz.trim()));
    // The whole log: the ERROR comes at start, before the lines of every listener and driver.
    let log = support::devplug_log_tail(node, 10_000);
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("cannot apply CDI specs")),
        "no ERROR about CDI in devplug's log:\n{log}"
    );
    // The Node event, where `kubectl describe node` shows it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let event = loop {
        let messages = node.kubectl(
            &[
                "get",
                "events",
                "-n",
                "default",
                "--field-selector",
                "reason=ContainerRuntimeWithoutCDI",
                "-o",
                "jsonpath={range .items[*]}{.involvedObject.kind}/{.involvedObject.name}: {.message}{\"\\n\"}{end}",
            ],
            None,
        )?;
        if let Some(line) = messages.lines().find(|l| l.contains(runtime)) {
            break line.to_owned();
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no ContainerRuntimeWithoutCDI event naming {runtime} in 30 s: {messages:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(event.starts_with(&format!("Node/{NODE_NAME}: ")), "{event}");
    // Where an operator looks: `kubectl describe node`.
    let described = node.kubectl(&["describe", "node", NODE_NAME], None)?;
    assert!(
        described.contains("ContainerRuntimeWithoutCDI"),
        "kubectl describe node does not show the event:\n{described}"
    );
    // What devplug warns of: the claim is prepared, the pod runs, no CDI edit reaches it.
    let (device, out) = run_example(node, &client, "basic", "dra-npu-demo").await?;
    assert!(
        !out.lines().any(|l| l.contains(&device)),
        "{runtime} applied the CDI spec after all (the scenario's premise is wrong):\n{out}"
    );
    figure(&format!(
        "DRA container on {runtime}: Running, no env names its device {device} (the runtime \
         ignored the CDI spec devplug wrote)"
    ));
    remove_example(node, "basic")?;
    release.delete_objects(node)?;
    Ok(())
}

/// The DRA release installed, and the driver's ResourceSlice for this node published.
async fn install_and_wait_for_slice(node: &Node) -> Result<support::Release, String> {
    let release = support::helm_release(node, "whole-node-dra")?;
    let started = Instant::now();
    release.install(node)?;
    support::wait_for_slices(node, &format!("a ResourceSlice of {DRIVER}"), |line| {
        line.starts_with(&format!("{DRIVER} {NODE_NAME} "))
    })
    .await?;
    figure(&format!(
        "helm install (DRA release) → ResourceSlice published: {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(release)
}

/// The manifests of `deploy/examples/dra/<name>/`.
fn example(name: &str) -> String {
    devplug_testkit::node::requirements::repo_root()
        .join(format!("deploy/examples/dra/{name}/manifests.yaml"))
        .display()
        .to_string()
}

/// A DRA example applied unchanged and its pod `pod` Running: the device allocated to the
/// pod's claim and what the container printed (its env).
async fn run_example(
    node: &Node,
    client: &kube::Client,
    name: &str,
    pod: &str,
) -> Result<(String, String), String> {
    run_example_of(node, client, name, pod, DRIVER).await
}

/// [`run_example`] for an example whose claim is of `driver`.
async fn run_example_of(
    node: &Node,
    client: &kube::Client,
    name: &str,
    pod: &str,
    driver: &str,
) -> Result<(String, String), String> {
    let took = apply_and_run(node, client, name, &[pod]).await?;
    figure(&format!(
        "DRA pod ({name} example) created → Running: {:.1} s",
        took.as_secs_f64()
    ));
    let results = pod_claim(client, pod)
        .await?
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
    assert_eq!(results.len(), 1, "one device allocated: {results:?}");
    assert_eq!(results[0].driver, driver);
    let device = results[0].device.clone();
    Ok((device, printed_env(node, pod).await))
}

/// The ResourceClaim made for `pod` from its template (in `default`, named after the pod).
async fn pod_claim(client: &kube::Client, pod: &str) -> Result<ResourceClaim, String> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    claims
        .list(&Default::default())
        .await
        .map_err(|e| format!("list claims: {e}"))?
        .items
        .into_iter()
        .find(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(pod))
        })
        .ok_or_else(|| format!("no ResourceClaim made for pod {pod}"))
}

/// Applies the DRA example `name` unchanged and waits (90 s each) until its `pods` run; how
/// long that took. Its pods run busybox:1.36: the test image is tagged so first.
pub(crate) async fn apply_and_run(
    node: &Node,
    client: &kube::Client,
    name: &str,
    pods: &[&str],
) -> Result<Duration, String> {
    node.tag_image(
        devplug_testkit::node::image::BUSYBOX_IMAGE,
        "docker.io/library/busybox:1.36",
    )?;
    let created = Instant::now();
    node.kubectl(&["apply", "-f", &example(name)], None)?;
    for pod in pods {
        support::wait_pod(
            client,
            "default",
            pod,
            Duration::from_secs(90),
            support::running,
        )
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
    }
    Ok(created.elapsed())
}

/// What the example pod's `demo` container printed: its env (`env | sort`, so once PATH is
/// there it is all there), waiting up to 30 s.
async fn printed_env(node: &Node, pod: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = node
            .container_log("default", pod, "demo")
            .unwrap_or_default();
        if log.contains("PATH=") || Instant::now() > deadline {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) fn remove_example(node: &Node, name: &str) -> Result<(), String> {
    node.kubectl(
        &[
            "delete",
            "-f",
            &example(name),
            "--wait=true",
            "--grace-period=0",
            "--force",
            "--ignore-not-found",
        ],
        None,
    )
    .map(drop)
}
