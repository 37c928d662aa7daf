//! devplug on CRI-O, the runtime of OpenShift and many kubeadm clusters, which applies CDI
//! specs its own way: the node switched to CRI-O (the kubelet restarted on its socket, the
//! images put into its storage), the chart installed with `ci/whole-node-crio-values.yaml`
//! (device plugin resources, one of them named to the runtime as CDI devices, and a DRA
//! driver), a device-plugin pod and a claim's pod checked by what their containers get, the
//! claim's device status, then a reboot (CRI-O stopped as its service unit stops it, every
//! container killed, /var/run emptied) after which both run again with their devices, and the
//! device status gone once the claim's pod is; then the DRA scenarios of `dra.rs` and
//! `dra_rollout.rs` as they run on containerd (the chart named with devplug's full image name,
//! as `support::helm_release` does on CRI-O). The node goes back to its own containerd
//! whatever happened.

use crate::device_plugins::{self, NPU, VFIO, VFIO_CDI_SPEC};
use crate::reboot::{remove_claim_specs, running_since};
use crate::support::{self, figure, Namespace};
use crate::Outcome;
use devplug_testkit::node::{Node, NODE_NAME};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const NS: &str = "dp-crio";
const DRA_DRIVER: &str = "npu.example.com";
const CLASS: &str = "crio-npu";

pub fn devplug_on_crio(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let outcome = async {
            let switched = Instant::now();
            let runtime = node.switch_to_crio().await?;
            figure(&format!(
                "runtime switched to {runtime} (kubelet and containerd stopped, images put \
                 into CRI-O's storage with skopeo, CRI-O and the kubelet started, Node Ready): \
                 {:.1} s",
                switched.elapsed().as_secs_f64()
            ));
            on_crio(node).await?;
            // The DRA scenario as it runs on containerd: the examples' claims (env, device
            // metadata through a CDI mount, health, device status), sharing, partitions, taints
            // and a DeviceTaintRule, the extended resource.
            let dra = Instant::now();
            crate::dra::claim_reaches_the_container(node).await?;
            figure(&format!(
                "CRI-O: the DRA scenario (dra_claim_reaches_the_container) passed: {:.1} s",
                dra.elapsed().as_secs_f64()
            ));
            // And the DRA driver's surge rollout, as on containerd.
            let rollout = Instant::now();
            crate::dra_rollout::surge_rollout(node).await?;
            figure(&format!(
                "CRI-O: the DRA surge rollout scenario (dra_surge_rollout_refuses_no_prepare) \
                 passed: {:.1} s",
                rollout.elapsed().as_secs_f64()
            ));
            Ok::<(), String>(())
        }
        .await;
        let back = node.switch_containerd(None).await.map(drop);
        outcome.and(back)
    })
}

/// A Deployment `dev` of one pod with 2 NPUs and a GPU on vfio-pci, and a pod `claim` with a
/// ResourceClaim of the DRA driver's devices; each prints its env and `/dev/vfio`.
fn workloads() -> Vec<Value> {
    let container = |limits: Value| {
        json!({
            "name": "c",
            "image": devplug_testkit::node::image::BUSYBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["sh", "-c", format!("env | sort\nls -l /dev/vfio/ 2>&1\necho '{}'\nexec sleep 3600", support::DONE)],
            "resources": limits,
        })
    };
    vec![
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "dev", "namespace": NS},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "dev"}},
                     "template": {"metadata": {"labels": {"app": "dev"}},
                                  "spec": {"terminationGracePeriodSeconds": 0,
                                           "containers": [container(json!({"limits": {NPU: "2", VFIO: "1"}}))]}}},
        }),
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRA_DRIVER}\"")}}]},
        }),
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "npu", "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": CLASS}}]}},
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "claim", "namespace": NS},
            "spec": {"terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "npu", "resourceClaimName": "npu"}],
                     "containers": [container(json!({"claims": [{"name": "npu"}]}))]},
        }),
    ]
}

/// Waits (`timeout`) until the Deployment's pod other than `old` (a uid) is ready; its name.
async fn dev_pod(client: &kube::Client, old: &str, timeout: Duration) -> Result<String, String> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let deadline = Instant::now() + timeout;
    loop {
        let pods = api
            .list(&kube::api::ListParams::default().labels("app=dev"))
            .await
            .map_err(|e| format!("list pods: {e}"))?
            .items;
        let found = pods.iter().find(|p| {
            p.metadata.uid.as_deref() != Some(old)
                && p.metadata.deletion_timestamp.is_none()
                && running_since(p, false)
        });
        if let Some(name) = found.and_then(|p| p.metadata.name.clone()) {
            return Ok(name);
        }
        if Instant::now() > deadline {
            let seen: Vec<String> = pods.iter().map(support::describe).collect();
            return Err(format!(
                "no new pod of Deployment dev ready in {timeout:?}: {seen:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the Deployment's pod must get: two NPU ids, one GPU's address in
/// `PCI_RESOURCE_EXAMPLE_COM_VFIO`, `/dev/vfio/vfio` and that GPU's group node.
async fn check_dev(node: &Node, pod: &str) -> Result<String, String> {
    let out = support::container_output(node, NS, pod, Duration::from_secs(30)).await?;
    let npus = support::env_value(&out, "DUMMY_VISIBLE_DEVICES")
        .ok_or_else(|| format!("no DUMMY_VISIBLE_DEVICES in {pod}:\n{out}"))?;
    assert_eq!(npus.split(',').count(), 2, "two NPU ids in {pod}: {npus}");
    let address = support::env_value(&out, "PCI_RESOURCE_EXAMPLE_COM_VFIO")
        .ok_or_else(|| format!("no PCI_RESOURCE_EXAMPLE_COM_VFIO in {pod}:\n{out}"))?;
    let group = device_plugins::vfio_group(address)
        .ok_or_else(|| format!("PCI_RESOURCE_EXAMPLE_COM_VFIO={address}: not one GPU"))?;
    for name in ["vfio".to_owned(), group.to_string()] {
        assert!(
            out.lines()
                .any(|l| l.starts_with('c') && l.ends_with(&format!(" {name}"))),
            "/dev/vfio/{name} is a character device in {pod}:\n{out}"
        );
    }
    Ok(format!("NPUs {npus}, GPU {address} (/dev/vfio/{group})"))
}

/// What the claim's pod must get from the claim's CDI spec: `VIRTUAL_DEVICES`.
async fn check_claim(node: &Node) -> Result<String, String> {
    let out = support::container_output(node, NS, "claim", Duration::from_secs(30)).await?;
    support::env_value(&out, "VIRTUAL_DEVICES")
        .map(|v| format!("VIRTUAL_DEVICES={v}"))
        .ok_or_else(|| format!("no VIRTUAL_DEVICES (the claim's CDI spec) in claim:\n{out}"))
}

/// The CDI names of `resource`'s devices in the allocations the kubelet checkpointed (each
/// entry's `AllocResp` is the plugin's `ContainerAllocateResponse`, protobuf in base64): what
/// the kubelet passes to the runtime in the CRI's `CDIDevices`, which CRI-O must resolve
/// from its CDI folders or refuse the container.
fn checkpointed_cdi_names(resource: &str) -> Result<Vec<String>, String> {
    use base64::Engine;
    let path = std::path::Path::new(devplug_testkit::node::KUBELET_ROOT)
        .join("device-plugins/kubelet_internal_checkpoint");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let checkpoint: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let prefix = format!("{resource}=");
    let mut names = Vec::new();
    for entry in checkpoint["Data"]["PodDeviceEntries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["ResourceName"] == resource)
    {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(entry["AllocResp"].as_str().unwrap_or_default())
            .map_err(|e| format!("{}: AllocResp: {e}", path.display()))?;
        let text = String::from_utf8_lossy(&bytes);
        for (at, _) in text.match_indices(&prefix) {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "./=_:-".contains(*c))
                .collect();
            names.push(name);
        }
    }
    Ok(names)
}

/// The ResourceClaim `npu`'s field at the JSONPath `path`.
fn claim_field(node: &Node, path: &str) -> Result<String, String> {
    node.kubectl(
        &[
            "get",
            "resourceclaim",
            "npu",
            "-n",
            NS,
            "-o",
            &format!("jsonpath={path}"),
        ],
        None,
    )
}

async fn on_crio(node: &'static Node) -> Result<(), String> {
    let client = node.client().await?;
    device_plugins::make_host_devices(node)?;
    let release = support::helm_release(node, "whole-node-crio")?;
    let installed = Instant::now();
    release.install(node)?;
    for (resource, count) in [(NPU, 8), (VFIO, 2)] {
        support::wait_node_resource(&client, resource, Duration::from_secs(90), move |a, _| {
            a == Some(count)
        })
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
    }
    support::wait_for_slices(node, &format!("a ResourceSlice of {DRA_DRIVER}"), |line| {
        line.starts_with(&format!("{DRA_DRIVER} {NODE_NAME} "))
    })
    .await?;
    support::wait_daemonset_ready(node)?;
    figure(&format!(
        "CRI-O: helm install → {NPU}, {VFIO} allocatable and the DRA driver's slice published: \
         {:.1} s",
        installed.elapsed().as_secs_f64()
    ));
    assert!(
        std::path::Path::new(VFIO_CDI_SPEC).is_file(),
        "the vfio resource's CDI spec {VFIO_CDI_SPEC} is written"
    );

    let ns = Namespace::create(node, NS)?;
    let created = Instant::now();
    support::apply(node, &workloads())?;
    let dev = dev_pod(&client, "", Duration::from_secs(90))
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
    support::wait_pod(&client, NS, "claim", Duration::from_secs(90), |p| {
        running_since(p, false)
    })
    .await
    .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
    let took = created.elapsed();
    let dev_got = check_dev(node, &dev).await?;
    let claim_got = check_claim(node).await?;
    figure(&format!(
        "CRI-O: a device-plugin pod (its vfio devices named to CRI-O as CDI devices) and a claim's \
         pod created → Running: {:.1} s; the first got {dev_got}, the second {claim_got} from the \
         claim's CDI spec",
        took.as_secs_f64()
    ));
    let cdi_names = checkpointed_cdi_names(VFIO)?;
    assert!(
        !cdi_names.is_empty(),
        "the kubelet passed CRI-O CDI names for {VFIO} (its checkpoint has none)"
    );
    figure(&format!(
        "CRI-O: CDI names the kubelet passed for {VFIO} (from its checkpoint), resolved by CRI-O \
         from {VFIO_CDI_SPEC}: {cdi_names:?}"
    ));
    let ready_status = claim_field(
        node,
        "{.status.devices[0].conditions[?(@.type==\"Ready\")].status}",
    )?;
    assert_eq!(
        ready_status, "True",
        "the claim's device status says Ready once the pod runs"
    );

    let old_dev = Api::<Pod>::namespaced(client.clone(), NS)
        .get(&dev)
        .await
        .map_err(|e| format!("get {dev}: {e}"))?
        .metadata
        .uid
        .unwrap_or_default();
    let rebooted = Instant::now();
    let mut specs_removed = 0;
    node.reboot(|| {
        specs_removed = remove_claim_specs()?;
        Ok(())
    })
    .await?;
    assert!(specs_removed >= 1, "the claim's CDI spec was there");
    let kubelet_started = Instant::now();
    support::wait_pod(&client, NS, "claim", Duration::from_secs(180), |p| {
        running_since(p, true)
    })
    .await
    .map_err(|e| format!("after the reboot: {e}\n{}", support::devplug_log(node)))?;
    // The Deployment's pod: either admitted again (devplug registered in time) or refused at
    // admission and replaced by a new one, which devplug's refused-pods watch lets run.
    let dev_after = match support::wait_pod(&client, NS, &dev, Duration::from_secs(5), |p| {
        running_since(p, true)
    })
    .await
    {
        Ok(_) => dev.clone(),
        Err(_) => dev_pod(&client, &old_dev, Duration::from_secs(180))
            .await
            .map_err(|e| format!("after the reboot: {e}\n{}", support::devplug_log(node)))?,
    };
    let survived_in = kubelet_started.elapsed();
    let dev_got = check_dev(node, &dev_after).await?;
    let claim_got = check_claim(node).await?;
    figure(&format!(
        "CRI-O: node reboot (CRI-O stopped with SIGTERM, containers killed, /var/run emptied; \
         its images kept) → kubelet start → the claim's pod and the Deployment's pod ({}) \
         Running with their devices: {:.1} s (whole reboot {:.1} s); {dev_got}; {claim_got}",
        if dev_after == dev {
            "the same pod"
        } else {
            "a replacement"
        },
        survived_in.as_secs_f64(),
        rebooted.elapsed().as_secs_f64()
    ));

    let unprepared = support::device_status_gone_with_pod(node, NS, "claim", "npu").await?;
    figure(&format!(
        "CRI-O: the claim's pod deleted → its device status gone from the claim (unprepared): \
         {:.1} s",
        unprepared.as_secs_f64()
    ));

    ns.delete(node)?;
    let _ = node.kubectl(
        &["delete", "deviceclass", CLASS, "--ignore-not-found"],
        None,
    );
    release.delete_objects(node)
}
