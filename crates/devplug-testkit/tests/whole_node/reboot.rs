//! A node reboot with every kind of device pod on it, devplug installed each way an operator
//! can (docs/install.md, "Install modes"):
//!
//! 1. As the chart's DaemonSet (`ci/whole-node-reboot-values.yaml`: a device plugin resource
//!    and a DRA driver, `refusedPods` at its default). On
//!    the node: a Deployment of three device pods, a bare pod and a Job's pod (device plugin
//!    resources), a pod with a ResourceClaim and a pod asking `limits: {example.com/npu: 1}`
//!    served by the DRA driver through its DeviceClass's extended resource name. After the
//!    reboot the kubelet refuses the device plugin pods (it admits them before devplug's pod
//!    runs); devplug deletes the Deployment's refused pods once their replacements exist and
//!    reports the bare and Job pods (an event on each, one on the Node); the DRA pods run again
//!    (the kubelet waits for the driver), their CDI specs written again after the reboot
//!    emptied `/var/run/cdi`.
//! 2. As the host service `deploy/systemd/install` puts in place (from the image archive, with
//!    `ctr`), started before the kubelet as its unit is: nothing refused, every pod runs again.
//!
//! Figures: kubelet start → every surviving device pod Running again, per mode; the API
//! requests devplug made for the cleanup (from its log).

use crate::device_plugins::NPU;
use crate::support::{self, figure, Namespace};
use crate::Outcome;
use devplug_testkit::node::{Node, KUBELET_ROOT, NODE_NAME};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

const NS: &str = "dp-reboot";
/// The DRA driver of the DRA release and its resource (served by no device plugin).
const DRA_DRIVER: &str = "npu.example.com";
const DRA_RESOURCE: &str = "example.com/npu";
/// The DeviceClass this scenario makes: claims name it, and it serves [`DRA_RESOURCE`] as an
/// extended resource.
const CLASS: &str = "reboot-npu";

/// A pod template running the test image: prints its env, then sleeps.
fn template(labels: Value, limits: Value, restart: &str) -> Value {
    json!({
        "metadata": {"labels": labels},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "c",
                "image": devplug_testkit::node::image::BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", format!("env | sort\necho '{}'\nexec sleep 3600", support::DONE)],
                "resources": {"limits": limits},
            }],
        },
    })
}

/// The device plugin workloads: a Deployment `web` of 3 pods with 2 devices each, a bare pod
/// `bare` and the Job `train`'s pod with one each: all 8 devices. The Job's pod restarts its
/// container on failure; with `restartPolicy: OnFailure` the Job controller counts container
/// restarts against `backoff_limit` (a reboot restarts it once: 2 lets it run on; 0 fails the
/// Job at its first failure, as a training Job that must not run twice does).
fn device_plugin_workloads(backoff_limit: u32) -> Vec<Value> {
    let mut bare = template(json!({"app": "bare"}), json!({NPU: "1"}), "Always");
    bare["apiVersion"] = json!("v1");
    bare["kind"] = json!("Pod");
    bare["metadata"]["name"] = json!("bare");
    bare["metadata"]["namespace"] = json!(NS);
    vec![
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                     "template": template(json!({"app": "web"}), json!({NPU: "2"}), "Always")},
        }),
        bare,
        json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": NS},
            "spec": {"backoffLimit": backoff_limit,
                     "template": template(json!({"app": "train"}), json!({NPU: "1"}), "OnFailure")},
        }),
    ]
}

/// The DRA workloads: a DeviceClass serving [`DRA_RESOURCE`] as an extended resource, a pod
/// `claim` with a ResourceClaim of it, and a pod `extended` asking `limits:` for the resource.
fn dra_workloads() -> Vec<Value> {
    let mut claim_pod = template(json!({"app": "claim"}), json!({}), "Always");
    claim_pod["apiVersion"] = json!("v1");
    claim_pod["kind"] = json!("Pod");
    claim_pod["metadata"]["name"] = json!("claim");
    claim_pod["metadata"]["namespace"] = json!(NS);
    claim_pod["spec"]["resourceClaims"] = json!([{"name": "npu", "resourceClaimName": "npu"}]);
    claim_pod["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "npu"}]});
    let mut extended = template(
        json!({"app": "extended"}),
        json!({DRA_RESOURCE: "1"}),
        "Always",
    );
    extended["apiVersion"] = json!("v1");
    extended["kind"] = json!("Pod");
    extended["metadata"]["name"] = json!("extended");
    extended["metadata"]["namespace"] = json!(NS);
    vec![
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRA_DRIVER}\"")}}],
                     "extendedResourceName": DRA_RESOURCE},
        }),
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "npu", "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": CLASS}}]}},
        }),
        claim_pod,
        extended,
    ]
}

/// The namespace's pods by name.
async fn pods(client: &kube::Client) -> Result<BTreeMap<String, Pod>, String> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    Ok(api
        .list(&Default::default())
        .await
        .map_err(|e| format!("list pods: {e}"))?
        .items
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
        .collect())
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

fn reason(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.reason.as_deref())
        .unwrap_or("")
}

/// Running with every container ready, started after `since` (a container of this boot).
pub(crate) fn running_since(pod: &Pod, restarted: bool) -> bool {
    phase(pod) == "Running"
        && pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .all(|c| c.ready && (!restarted || c.restart_count >= 1))
            })
}

/// Waits (1 s steps) until `check` of the namespace's pods gives a value.
async fn until<T>(
    client: &kube::Client,
    what: &str,
    timeout: Duration,
    check: impl Fn(&BTreeMap<String, Pod>) -> Option<T>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let now = pods(client).await?;
        if let Some(value) = check(&now) {
            return Ok(value);
        }
        if Instant::now() > deadline {
            let seen: Vec<String> = now
                .values()
                .map(|p| {
                    format!(
                        "{} {} {}",
                        p.metadata.name.clone().unwrap_or_default(),
                        phase(p),
                        reason(p)
                    )
                })
                .collect();
            return Err(format!("{what}: not within {timeout:?}; pods: {seen:?}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Events with `reason` about `name` in `namespace`.
async fn events(client: &kube::Client, namespace: &str, name: &str, reason: &str) -> Vec<String> {
    Api::<Event>::namespaced(client.clone(), namespace)
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .map(|e| e.note.unwrap_or_default())
        .collect()
}

/// The web pods Running, and their names.
fn web_running(now: &BTreeMap<String, Pod>) -> Vec<String> {
    now.iter()
        .filter(|(name, p)| name.starts_with("web-") && running_since(p, false))
        .map(|(name, _)| name.clone())
        .collect()
}

/// Waits until the 3 web pods, the Job's pod and the pods `named` are Running; the pods then.
async fn all_running(
    client: &kube::Client,
    named: &[&str],
) -> Result<BTreeMap<String, Pod>, String> {
    until(
        client,
        "every pod Running",
        Duration::from_secs(120),
        |now| {
            let ready = named
                .iter()
                .all(|n| now.get(*n).is_some_and(|p| running_since(p, false)))
                && web_running(now).len() == 3
                && now
                    .iter()
                    .any(|(n, p)| n.starts_with("train-") && running_since(p, false));
            ready.then(|| now.clone())
        },
    )
    .await
}

/// The CDI specs the DRA driver wrote for claims, which a reboot removes (`/var/run` is a tmpfs).
pub(crate) fn remove_claim_specs() -> Result<usize, String> {
    let mut removed = 0;
    for entry in std::fs::read_dir("/var/run/cdi")
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry.file_name().to_string_lossy().contains(DRA_DRIVER) {
            std::fs::remove_file(entry.path())
                .map_err(|e| format!("{}: {e}", entry.path().display()))?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// The last count of API requests devplug's refused-pods watch logged.
fn cleanup_requests(node: &Node, pod: &str) -> Option<u64> {
    let log = node.container_log("kube-system", pod, "devplug").ok()?;
    log.lines()
        .filter_map(|l| l.split("api_requests").nth(1))
        // `api_requests=N` (text) or `"api_requests":N` (JSON, the chart's default).
        .filter_map(|rest| {
            rest.trim_start_matches(['"', ':', '='])
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .next_back()
}

pub fn node_reboot(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;

        // 1. The DaemonSet.
        let release = support::helm_release(node, "whole-node-reboot")?;
        release.install(node)?;
        support::wait_node_resource(&client, NPU, Duration::from_secs(90), |a, _| a == Some(8))
            .await
            .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        support::wait_for_slices(node, &format!("a ResourceSlice of {DRA_DRIVER}"), |line| {
            line.starts_with(&format!("{DRA_DRIVER} {NODE_NAME} "))
        })
        .await?;
        let ns = Namespace::create(node, NS)?;
        support::apply(node, &device_plugin_workloads(0))?;
        support::apply(node, &dra_workloads())?;
        let before = all_running(&client, &["bare", "claim", "extended"]).await?;
        let web_before: Vec<String> = web_running(&before);
        let train = before
            .keys()
            .find(|n| n.starts_with("train-"))
            .cloned()
            .ok_or("no Job pod")?;

        let rebooted = Instant::now();
        let mut specs_removed = 0;
        node.reboot(|| {
            specs_removed = remove_claim_specs()?;
            Ok(())
        })
        .await?;
        let kubelet_started = Instant::now();
        assert!(
            specs_removed >= 2,
            "the claims' CDI specs were there: {specs_removed}"
        );

        // Every pod that survives: three new web pods, the two DRA pods again.
        let old: Vec<String> = web_before.iter().map(|n| uid(&before[n])).collect();
        let survivors = until(
            &client,
            "the surviving pods Running",
            Duration::from_secs(180),
            |now| {
                let web: Vec<&String> = now
                    .iter()
                    .filter(|(n, p)| {
                        n.starts_with("web-") && running_since(p, false) && !old.contains(&uid(p))
                    })
                    .map(|(n, _)| n)
                    .collect();
                let dra = ["claim", "extended"]
                    .iter()
                    .all(|n| now.get(*n).is_some_and(|p| running_since(p, true)));
                (web.len() == 3 && dra).then_some(())
            },
        )
        .await;
        let survived_in = kubelet_started.elapsed();
        survivors.map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        // The refused web pods deleted by devplug; the bare and Job pods left, refused.
        until(
            &client,
            "the refused web pods deleted",
            Duration::from_secs(60),
            |now| (!now.values().any(|p| old.contains(&uid(p)))).then_some(()),
        )
        .await?;
        let now = pods(&client).await?;
        for name in ["bare", train.as_str()] {
            let pod = now.get(name).ok_or(format!("{name} was deleted"))?;
            assert_eq!(
                (phase(pod), reason(pod)),
                ("Failed", "UnexpectedAdmissionError"),
                "{name} refused"
            );
        }
        let mut pod_events = BTreeMap::new();
        for name in ["bare", train.as_str()] {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let found = events(&client, NS, name, "RefusedAtAdmission").await;
                if !found.is_empty() {
                    pod_events.insert(name.to_owned(), found);
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "no RefusedAtAdmission event on {name}\n{}",
                        support::devplug_log(node)
                    ));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        let on_node = events(&client, "default", NODE_NAME, "PodsRefusedAtAdmission").await;
        assert!(
            on_node.iter().any(|n| n.contains(&format!("2 in {NS}"))
                && !n.contains("bare")
                && !n.contains(train.as_str())
                && n.contains("host service")),
            "the Node event counts the bare and Job pods by namespace, naming neither: {on_node:?}"
        );
        // The DRA pods have their devices: specs written again, the env from them.
        for name in ["claim", "extended"] {
            let out = support::container_output(node, NS, name, Duration::from_secs(30)).await?;
            assert!(
                out.lines().any(|l| l.starts_with("VIRTUAL_DEVICES=")),
                "{name} has its device after the reboot:\n{out}"
            );
        }
        let devplug_pod = support::devplug_pods(&client)
            .await?
            .into_iter()
            .find_map(|p| p.metadata.name)
            .ok_or("no devplug pod")?;
        let requests = cleanup_requests(node, &devplug_pod);
        figure(&format!(
            "node reboot, devplug as the chart's DaemonSet: kubelet start → every surviving device pod Running \
             (3 new Deployment pods, the claim pod and the extended-resource pod through DRA) {:.1} s; \
             refused: the 3 Deployment pods (deleted by devplug), the bare and the Job pod \
             (reported: {pod_events:?}); API requests for the cleanup: {requests:?}; whole reboot {:.1} s",
            survived_in.as_secs_f64(),
            rebooted.elapsed().as_secs_f64()
        ));

        // devplug restarted alone (its pod deleted; the DaemonSet makes a new one): nothing
        // deleted, nothing reported again.
        let pods_before: Vec<String> = pods(&client).await?.keys().cloned().collect();
        node.kubectl(
            &[
                "delete",
                "pod",
                "-n",
                "kube-system",
                &devplug_pod,
                "--wait=true",
            ],
            None,
        )?;
        // The new pod's watch has started (it logs that when it starts watching).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let new_pod = support::devplug_pods(&client)
                .await?
                .into_iter()
                .filter_map(|p| p.metadata.name)
                .find(|n| *n != devplug_pod);
            let watching = new_pod.is_some_and(|p| {
                node.container_log("kube-system", &p, "devplug")
                    .unwrap_or_default()
                    .contains("watching this node's pods refused at admission")
            });
            if watching {
                break;
            }
            if Instant::now() > deadline {
                return Err("the new devplug pod did not start its watch within 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let pods_after: Vec<String> = pods(&client).await?.keys().cloned().collect();
        assert_eq!(
            pods_before, pods_after,
            "devplug restarted alone deleted pods"
        );
        for name in ["bare", train.as_str()] {
            assert_eq!(
                events(&client, NS, name, "RefusedAtAdmission").await.len(),
                1,
                "{name} reported again by the restarted devplug"
            );
        }
        // The claim's pod gone: its claim unprepared, its device status removed.
        let unprepared = support::device_status_gone_with_pod(node, NS, "claim", "npu").await?;
        figure(&format!(
            "the claim's pod deleted → its device status gone from the claim (unprepared): \
             {:.1} s",
            unprepared.as_secs_f64()
        ));
        ns.delete(node)?;
        let _ = node.kubectl(
            &["delete", "deviceclass", CLASS, "--ignore-not-found"],
            None,
        );
        release.delete_objects(node)?;

        // 2. The host service, installed by deploy/systemd/install from the image archive.
        host_service(node, &client).await
    })
}

/// The host service's config: the release's device plugin resource (devplug-lite serves no DRA).
const HOST_CONFIG: &str = "resources:\n  - name: dummy.com/npu\n    virtual:\n      count: 8\n      env: DUMMY_VISIBLE_DEVICES\n";

async fn host_service(node: &Node, client: &kube::Client) -> Result<(), String> {
    let root = node.layout.dir.join("host-root");
    let config = node.layout.dir.join("devplug-host.yaml");
    std::fs::write(&config, HOST_CONFIG).map_err(|e| e.to_string())?;
    let install = node.requirements.repo.join("deploy/systemd/install");
    let out = std::process::Command::new(&install)
        .args(["--root", &root.display().to_string(), "--archive"])
        .arg(&node.requirements.image_archive)
        .arg("--config")
        .arg(&config)
        .env("CONTAINERD_ADDRESS", node.layout.containerd_socket())
        .env(
            "PATH",
            format!(
                "{}:{}",
                node.requirements.assets.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .output()
        .map_err(|e| format!("{}: {e}", install.display()))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("deploy/systemd/install failed: {said}"));
    }
    figure(&format!("host service installed: {}", said.trim()));
    // What the unit runs, under the install's root.
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/devplug.service"))
        .map_err(|e| e.to_string())?;
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .ok_or("the unit has no ExecStart")?;
    let mut words = exec.split_whitespace().map(|w| {
        if w.starts_with('/') && !w.starts_with(KUBELET_ROOT) {
            root.join(w.trim_start_matches('/')).display().to_string()
        } else {
            w.to_owned()
        }
    });
    let binary = words.next().ok_or("an empty ExecStart")?;
    let args: Vec<String> = words.collect();
    let binary = Path::new(&binary).to_path_buf();
    node.start_host_process("devplug-host", &binary, &args)?;
    let ns = Namespace::create(node, NS)?;
    support::apply(node, &device_plugin_workloads(2))?;
    let before = all_running(client, &["bare"]).await?;
    node.reboot(|| {
        // It died with the node; its unit starts it again, before the kubelet's.
        let _ = node.stop_host_process("devplug-host");
        node.start_host_process("devplug-host", &binary, &args)
    })
    .await?;
    let kubelet_started = Instant::now();
    let names: Vec<String> = before.keys().cloned().collect();
    let result = until(
        client,
        "every pod Running again",
        Duration::from_secs(180),
        |now| {
            let all = names.iter().all(|n| {
                now.get(n)
                    .is_some_and(|p| uid(p) == uid(&before[n]) && running_since(p, true))
            });
            let refused: Vec<&String> = now
                .iter()
                .filter(|(_, p)| phase(p) == "Failed")
                .map(|(n, _)| n)
                .collect();
            if !refused.is_empty() {
                return Some(Err(format!("refused with the host service: {refused:?}")));
            }
            all.then_some(Ok(()))
        },
    )
    .await;
    let took = kubelet_started.elapsed();
    ns.delete(node)?;
    node.stop_host_process("devplug-host")?;
    result??;
    figure(&format!(
        "node reboot, devplug as the host service (deploy/systemd/install): 0 of {} device pods \
         refused; kubelet start → every device pod Running again {:.1} s",
        names.len(),
        took.as_secs_f64()
    ));
    Ok(())
}
