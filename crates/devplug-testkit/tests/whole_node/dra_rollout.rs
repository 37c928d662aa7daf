//! A surge rollout of the DRA driver with claims prepared throughout: the chart's DaemonSet on
//! the pod network (`ci/whole-node-dra-surge-values.yaml`), where it rolls out with
//! `maxSurge: 1`; the new pod registers under socket names of its own while the old one still
//! serves, and the kubelet (1.33+) keeps both. Pods with a claim each are created every
//! 250 ms from 1 s before the rollout to 3 s after it; none may see a prepare refused, and the
//! kubelet's registry must have held both instances' registration sockets at once. (With
//! `maxSurge: 0` instead, a run saw one instance at a time and a prepare refused: `dra.sock`
//! gone between the old pod's exit and the new one's start.)
//!
//! The test node has no kube-proxy, so pods on the pod network reach no service address: the
//! driver is told `kubernetes.default.svc` (a name the API server's certificate holds), the pods
//! get a host alias for it at the pod network's gateway, and this test forwards the gateway's
//! port 6443 to the API server on the host's loopback (TLS passes through untouched).

use crate::support::{self, figure, Namespace};
use crate::Outcome;
use devplug_testkit::node::{Node, API_PORT, KUBELET_ROOT, NODE_NAME, POD_GATEWAY};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DRIVER: &str = "npu.example.com";
const NS: &str = "dp-dra-rollout";
const CLASS: &str = "rollout-npu";

/// Forwards `POD_GATEWAY:API_PORT` to the API server once the pod network's bridge has that
/// address (a pod made it); runs until aborted.
async fn forward_api_server() -> Result<(), String> {
    let listen = format!("{POD_GATEWAY}:{API_PORT}");
    let deadline = Instant::now() + Duration::from_secs(90);
    let listener = loop {
        match tokio::net::TcpListener::bind(&listen).await {
            Ok(listener) => break listener,
            Err(err) if Instant::now() > deadline => {
                return Err(format!(
                    "cannot listen on {listen} (no pod network bridge?): {err}"
                ))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    loop {
        let (mut inbound, _) = listener
            .accept()
            .await
            .map_err(|e| format!("{listen}: {e}"))?;
        tokio::spawn(async move {
            if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", API_PORT)).await
            {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// The release, its DaemonSet's pods given the host alias.
fn release(node: &Node) -> Result<support::Release, String> {
    let mut release = support::helm_release(node, "whole-node-dra-surge")?;
    for object in release
        .objects
        .iter_mut()
        .filter(|o| o["kind"] == "DaemonSet")
    {
        object["spec"]["template"]["spec"]["hostAliases"] =
            json!([{"ip": POD_GATEWAY, "hostnames": ["kubernetes.default.svc"]}]);
    }
    Ok(release)
}

/// A pod with a claim of one device from the class, which prints its env and exits.
fn claim_pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "npu", "resourceClaimTemplateName": "npu"}],
            "containers": [{
                "name": "c",
                "image": devplug_testkit::node::image::BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", "env | grep VIRTUAL_DEVICES"],
                "resources": {"claims": [{"name": "npu"}]},
            }],
        },
    })
}

/// The driver's registration sockets in the kubelet's registry now.
fn registrations() -> usize {
    std::fs::read_dir(std::path::Path::new(KUBELET_ROOT).join("plugins_registry"))
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.starts_with(DRIVER) && name.ends_with("-reg.sock")
                })
                .count()
        })
        .unwrap_or(0)
}

pub fn surge_rollout(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let forward = tokio::spawn(forward_api_server());
        let outcome = rollout(node).await;
        let forwarded = if forward.is_finished() {
            forward.await.unwrap_or_else(|e| Err(e.to_string()))
        } else {
            forward.abort();
            Ok(())
        };
        outcome.and(forwarded)
    })
}

async fn rollout(node: &'static Node) -> Result<(), String> {
    let release = release(node)?;
    let strategy = release
        .objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .map(|d| d["spec"]["updateStrategy"]["rollingUpdate"].clone())
        .ok_or("the release has no DaemonSet")?;
    assert_eq!(
        strategy["maxSurge"], 1,
        "off the host network the chart surges: {strategy}"
    );
    let installed = Instant::now();
    release.install(node)?;
    support::wait_for_slices(node, &format!("a ResourceSlice of {DRIVER}"), |line| {
        line.starts_with(&format!("{DRIVER} {NODE_NAME} "))
    })
    .await?;
    support::wait_daemonset_ready(node)?;
    figure(&format!(
        "DRA driver on the pod network (API server through the gateway): helm install → slice \
         published, pod Ready: {:.1} s",
        installed.elapsed().as_secs_f64()
    ));
    let ns = Namespace::create(node, NS)?;
    support::apply(
        node,
        &[
            json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": CLASS},
                "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]},
            }),
            json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "npu", "namespace": NS},
                "spec": {"spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": CLASS}}]}}},
            }),
        ],
    )?;

    // The registry sampled every 20 ms: both instances registered at once is the surge.
    let stop = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (stop, most) = (stop.clone(), most.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                most.fetch_max(registrations(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let creator = {
        let stop = stop.clone();
        tokio::task::spawn_blocking(move || {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                if support::apply(node, &[claim_pod(&format!("p{n}"))]).is_ok() {
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    support::patch_daemonset(
        node,
        r#"{"spec":{"template":{"metadata":{"annotations":{"devplug.test/rollout":"dra"}}}}}"#,
    )?;
    support::wait_daemonset_ready(node)?;
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let created = creator.await.map_err(|e| format!("pod creator: {e}"))?;
    let _ = sampler.await;
    let most = most.load(Ordering::Relaxed);

    // Every pod runs and exits (4 devices: the later ones wait for a claim to be freed).
    let deadline = Instant::now() + Duration::from_secs(240);
    let phases = loop {
        let out = node.kubectl(
            &[
                "get",
                "pods",
                "-n",
                NS,
                "-o",
                "jsonpath={range .items[*]}{.metadata.name} {.status.phase}{\"\\n\"}{end}",
            ],
            None,
        )?;
        let open = out
            .lines()
            .filter(|l| !l.ends_with(" Succeeded") && !l.ends_with(" Failed"))
            .count();
        if open == 0 {
            break out;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{open} of {created} pods did not run to the end in 240 s:\n{out}\n{}",
                support::devplug_log(node)
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let failed: Vec<&str> = phases.lines().filter(|l| l.ends_with(" Failed")).collect();
    let refused = node.kubectl(
        &[
            "get",
            "events",
            "-n",
            NS,
            "--field-selector",
            "reason=FailedPrepareDynamicResources",
            "-o",
            "jsonpath={range .items[*]}{.involvedObject.name}: {.message}{\"\\n\"}{end}",
        ],
        None,
    )?;
    figure(&format!(
        "DRA driver surge rollout: {:.1} s; {created} pods with a claim created throughout, {} \
         failed, {} prepares refused; at most {most} registrations of {DRIVER} at once",
        took.as_secs_f64(),
        failed.len(),
        refused.lines().count()
    ));
    assert!(failed.is_empty(), "pods failed: {failed:?}");
    assert!(
        refused.trim().is_empty(),
        "prepares refused during the rollout:\n{refused}"
    );
    assert!(
        most >= 2,
        "the old and the new driver were never registered at once (at most {most})"
    );
    ns.delete(node)?;
    let _ = node.kubectl(
        &["delete", "deviceclass", CLASS, "--ignore-not-found"],
        None,
    );
    release.delete_objects(node)
}
