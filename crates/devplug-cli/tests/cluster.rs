//! The `devplug` binary against a real kube-apiserver (`KUBEBUILDER_ASSETS`, shared helper of
//! devplug-cluster): `devplug capacity set|list|remove`, and `devplug run` keeping `advertise:`
//! resources on its Node and removing one that leaves the config. Skipped loudly without the
//! binaries. Full build only (feature `cluster`); devplug-lite's refusals are in tests/lite.rs.
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use devplug_cluster::capacity;
use devplug_testkit::api_server::{self, ApiServer};
use kube::api::{Patch, PatchParams};
use kube::Api;
use kubelet_sim::Kubelet;
use std::process::Command;
use std::time::Duration;
use support::cluster::cluster_with_node;
use support::Devplug;

const BIN: &str = env!("CARGO_BIN_EXE_devplug");

/// `devplug run` of `config` (YAML) in `dir` as node `node` of `server`, with its CDI folder in
/// `dir` and metrics on a free port: the process and that port.
fn run_on_node(
    server: &ApiServer,
    dir: &std::path::Path,
    plugins: &std::path::Path,
    node: &str,
    config: &str,
) -> (Devplug, u16) {
    run_on_node_with(server, dir, plugins, node, config, &[])
}

/// [`run_on_node`] with `extra` arguments.
fn run_on_node_with(
    server: &ApiServer,
    dir: &std::path::Path,
    plugins: &std::path::Path,
    node: &str,
    config: &str,
    extra: &[&str],
) -> (Devplug, u16) {
    let path = dir.join("config.yaml");
    std::fs::write(&path, config).unwrap();
    let port = support::free_port();
    let cdi = dir.join("cdi");
    let metrics = format!("127.0.0.1:{port}");
    let mut args = vec![
        "--node-name",
        node,
        "--kubeconfig",
        server.kubeconfig.to_str().unwrap(),
        "--cdi-dir",
        cdi.to_str().unwrap(),
        "--metrics-addr",
        &metrics,
    ];
    args.extend_from_slice(extra);
    let devplug = Devplug::run_with(&path, plugins, &args);
    (devplug, port)
}

/// A kubelet simulator in `dir` that also follows its plugin watcher's folder (for DRA
/// drivers), and its device-plugins folder.
async fn watcher_kubelet(dir: &std::path::Path) -> (Kubelet, std::path::PathBuf) {
    let plugins = dir.join("device-plugins");
    let config = kubelet_sim::SimConfig {
        watcher_reconcile: Duration::from_millis(50),
        ..kubelet_sim::SimConfig::default()
    }
    .with_watcher_beside(&plugins);
    (
        Kubelet::start_with(&plugins, config).await.unwrap(),
        plugins,
    )
}

/// `/readyz` on `port` until `done` says so (10 s at most); the last answer.
async fn readyz_until(port: u16, done: impl Fn(&(u16, String)) -> bool) -> (u16, String) {
    let mut last = (0, String::new());
    for _ in 0..200 {
        if let Some(answer) = support::http_get(port, "/readyz").await {
            last = answer;
            if done(&last) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last
}

fn devplug(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_set_list_remove() {
    let Some((server, _, _)) = cluster_with_node("capacity_set_list_remove", "cli-capacity").await
    else {
        return;
    };
    let kc = server.kubeconfig.to_str().unwrap().to_owned();
    let run = |args: Vec<&str>| {
        let mut all = vec!["capacity"];
        all.extend(args);
        all.extend(["--kubeconfig", kc.as_str()]);
        let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        devplug(&all)
    };
    let (ok, out, err) = run(vec![
        "set",
        "example.com/dongle=4",
        "--node",
        "cli-capacity",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out, "example.com/dongle=4 set on node cli-capacity\n");
    let (ok, out, err) = run(vec!["list", "--node", "cli-capacity"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "RESOURCE            CAPACITY  ALLOCATABLE\nexample.com/dongle  4         4\n"
    );
    let (ok, out, _) = run(vec![
        "remove",
        "example.com/dongle",
        "--node",
        "cli-capacity",
    ]);
    assert!(ok);
    assert_eq!(out, "example.com/dongle removed from node cli-capacity\n");
    let (ok, out, _) = run(vec![
        "remove",
        "example.com/dongle",
        "--node",
        "cli-capacity",
    ]);
    assert!(ok, "a missing key is not an error");
    assert_eq!(
        out,
        "example.com/dongle on node cli-capacity: already gone\n"
    );
    // The uninstall's way: nothing removed where no admission policy limits the token (here
    // the admin's), and the message says which policy and how to do without.
    run(vec![
        "set",
        "example.com/dongle=4",
        "--node",
        "cli-capacity",
    ]);
    let (ok, _, err) = run(vec![
        "remove",
        "example.com/dongle",
        "--node",
        "cli-capacity",
        "--require-policy",
        "--policy-wait-secs",
        "1",
    ]);
    assert!(!ok);
    assert!(
        err.contains("-uninstall") && err.contains("nothing was changed"),
        "{err}"
    );
    let (ok, out, _) = run(vec!["list", "--node", "cli-capacity"]);
    assert!(ok && out.contains("example.com/dongle  4"), "{out}");
    let (ok, _, err) = run(vec!["set", "dongle=4", "--node", "cli-capacity"]);
    assert!(!ok);
    assert!(err.contains("not an extended resource name"), "{err}");
    let (ok, _, err) = run(vec!["list", "--node", "no-such-node"]);
    assert!(!ok);
    assert!(err.contains("no-such-node"), "{err}");
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_advertises_on_its_node_and_follows_the_config() {
    let Some((server, _, nodes)) = cluster_with_node(
        "run_advertises_on_its_node_and_follows_the_config",
        "cli-advertise",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    let _kubelet = Kubelet::start(&plugins).await.unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n  - name: example.com/dongle\n    advertise: { count: 3 }\n  - name: example.com/licence\n    advertise: { count: 1 }\n",
    )
    .unwrap();
    let devplug = Devplug::run_with(
        &config,
        &plugins,
        &[
            "--node-name",
            "cli-advertise",
            "--kubeconfig",
            server.kubeconfig.to_str().unwrap(),
            "--node-events",
        ],
    );
    let wait = |resource: &'static str, want: Option<&'static str>| {
        let nodes = nodes.clone();
        async move {
            for _ in 0..200 {
                let now = capacity::list(&nodes, "cli-advertise").await.unwrap();
                if now.get(resource).and_then(|r| r.capacity.as_deref()) == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            panic!("{resource} never became {want:?}");
        }
    };
    wait("example.com/dongle", Some("3")).await;
    wait("example.com/licence", Some("1")).await;
    capacity::remove(&nodes, "cli-advertise", "example.com/dongle")
        .await
        .unwrap();
    wait("example.com/dongle", Some("3")).await;
    std::fs::write(
        &config,
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n  - name: example.com/dongle\n    advertise: { count: 3 }\n",
    )
    .unwrap();
    wait("example.com/licence", None).await;
    // A broken config keeps the previous one running and says so on the Node.
    std::fs::write(&config, "resources: [ { name: example.com/npu } ]\n").unwrap();
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(
        api_server::client(&server.kubeconfig).await.unwrap(),
        "default",
    );
    let mut reasons = Vec::new();
    for _ in 0..100 {
        reasons = events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("cli-advertise")
            })
            .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect::<Vec<_>>();
        if reasons.iter().any(|(r, _)| r == "ConfigReloadFailed") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        reasons
            .iter()
            .any(|(r, n)| r == "ConfigReloadFailed" && n.contains("no backend")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|(r, _)| r == "Registered"),
        "{reasons:?}"
    );
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    // Kept at shutdown: a restarting pod must not make capacity flap.
    wait("example.com/dongle", Some("3")).await;
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_a_dra_driver_and_keeps_its_slices_at_shutdown() {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::api::ListParams;
    let Some((server, client, _)) = cluster_with_node(
        "run_serves_a_dra_driver_and_keeps_its_slices_at_shutdown",
        "cli-dra",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (kubelet, plugins) = watcher_kubelet(dir.path()).await;
    let config = dir.path().join("config.yaml");
    // One resource as DRA only, one as a device plugin.
    std::fs::write(
        &config,
        "resources:\n  - name: example.com/npu\n    virtual: { count: 3 }\n    dra: { driver: npu.cli.example.com }\n  - name: example.com/dp\n    virtual: { count: 2 }\n",
    )
    .unwrap();
    let cdi = dir.path().join("cdi");
    let port = support::free_port();
    // A spec of this driver's left by a claim unprepared while devplug was down, and one of
    // another program's: the first goes at start, the second stays.
    std::fs::create_dir_all(&cdi).unwrap();
    let stale = cdi.join("devplug-npu.cli.example.com-gone.json");
    let foreign = cdi.join("vendor-npu.json");
    for (path, kind) in [
        (&stale, "npu.cli.example.com/claim"),
        (&foreign, "vendor.example/npu"),
    ] {
        std::fs::write(
            path,
            format!(r#"{{"cdiVersion":"0.5.0","kind":"{kind}","devices":[]}}"#),
        )
        .unwrap();
    }
    let devplug = Devplug::run_with(
        &config,
        &plugins,
        &[
            "--node-name",
            "cli-dra",
            "--kubeconfig",
            server.kubeconfig.to_str().unwrap(),
            "--cdi-dir",
            cdi.to_str().unwrap(),
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    let slices: Api<ResourceSlice> = Api::all(client);
    let params = ListParams::default().fields("spec.nodeName=cli-dra");
    let mut devices = 0;
    for _ in 0..200 {
        let list = slices.list(&params).await.unwrap();
        devices = list
            .items
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        if devices == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(devices, 3, "the DRA resource's devices are published");
    assert!(!stale.exists(), "the stale claim spec is removed at start");
    assert!(foreign.exists(), "another program's spec is left alone");
    kubelet
        .wait_for(Duration::from_secs(10), |node| {
            (!node.dra_driver("npu.cli.example.com").is_empty()
                && node.capacity("example.com/dp").0 == 2)
                .then_some(())
        })
        .await
        .unwrap();
    assert_eq!(
        kubelet.read(|node| node.capacity("example.com/npu").0),
        0,
        "a dra: resource without device_plugin: true is not a device plugin"
    );
    // Ready once the slices are published and the kubelet registered the driver; its
    // counters in /metrics.
    let ready = readyz_until(port, |(status, _)| *status == 200).await;
    assert_eq!(ready.0, 200, "{}", ready.1);
    let (_, metrics) = support::http_get(port, "/metrics").await.unwrap();
    for line in [
        "devplug_dra_registered{driver=\"npu.cli.example.com\"} 1",
        "devplug_dra_slice_consecutive_failures{driver=\"npu.cli.example.com\"} 0",
        "devplug_dra_slice_publishes_total{driver=\"npu.cli.example.com\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    // A claim the API server does not have: the kubelet's NodePrepareResources gets an error
    // for it, and /metrics counts the claim, the error and the call's duration.
    let missing = kubelet_sim::DraClaim::new("default", "no-such-claim", "uid-missing");
    let answer = kubelet
        .dra_prepare("npu.cli.example.com", std::slice::from_ref(&missing))
        .await
        .unwrap();
    assert!(answer["uid-missing"].is_err(), "{answer:?}");
    let unprepared = kubelet
        .dra_unprepare("npu.cli.example.com", std::slice::from_ref(&missing))
        .await
        .unwrap();
    assert!(unprepared["uid-missing"].is_ok(), "{unprepared:?}");
    let (_, metrics) = support::http_get(port, "/metrics").await.unwrap();
    for line in [
        "devplug_dra_prepare_claims_total{driver=\"npu.cli.example.com\"} 1",
        "devplug_dra_prepare_errors_total{driver=\"npu.cli.example.com\"} 1",
        "devplug_dra_prepare_duration_seconds_count{driver=\"npu.cli.example.com\"} 1",
        "devplug_dra_prepare_duration_seconds_bucket{driver=\"npu.cli.example.com\",le=\"+Inf\"} 1",
        "devplug_dra_unprepare_claims_total{driver=\"npu.cli.example.com\"} 1",
        "devplug_dra_unprepare_errors_total{driver=\"npu.cli.example.com\"} 0",
        "devplug_dra_unprepare_duration_seconds_count{driver=\"npu.cli.example.com\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    let uids = |list: kube::core::ObjectList<ResourceSlice>| -> Vec<Option<String>> {
        let mut uids: Vec<_> = list.items.into_iter().map(|s| s.metadata.uid).collect();
        uids.sort();
        uids
    };
    let before = uids(slices.list(&params).await.unwrap());
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    // Kept for the next start, as upstream's kubelet-plugin helper keeps them (the kubelet wipes
    // a driver's slices 30 s after it is gone for good): no scheduling gap across a restart.
    assert_eq!(
        uids(slices.list(&params).await.unwrap()),
        before,
        "shutdown keeps the slices"
    );
}

/// A DRA driver on a node whose runtime cannot apply CDI (containerd 1.6, as its Node reports)
/// says so: at ERROR in its log and in `/readyz` (503), naming the driver and the runtime.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_dra_driver_on_a_runtime_without_cdi_says_so_in_readyz() {
    let Some((server, _, nodes)) = cluster_with_node(
        "a_dra_driver_on_a_runtime_without_cdi_says_so_in_readyz",
        "cli-old-runtime",
    )
    .await
    else {
        return;
    };
    let info = serde_json::json!({"status": {"nodeInfo": {
        "containerRuntimeVersion": "containerd://1.6.20",
        "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "", "osImage": "",
        "kubeletVersion": "", "kubeProxyVersion": "", "operatingSystem": "linux",
        "architecture": "amd64"
    }}});
    nodes
        .patch_status(
            "cli-old-runtime",
            &PatchParams::default(),
            &Patch::Merge(&info),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let (devplug, port) = run_on_node(
        server,
        dir.path(),
        &plugins,
        "cli-old-runtime",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.old.example.com }\n",
    );
    let want = "DRA driver npu.old.example.com: the container runtime is containerd://1.6.20, \
                which cannot apply CDI specs";
    let last = readyz_until(port, |(_, text)| text.contains(want)).await;
    assert_eq!(last.0, 503, "{}", last.1);
    assert!(last.1.contains(want), "{}", last.1);
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    assert!(
        log.contains("DRA claims will reach no container on this node"),
        "{log}"
    );
}

/// With `--require-policies` (the chart sets it), a DRA driver publishes no ResourceSlice until
/// the admission policy keeping its slices to its node is in force: here none is installed (the
/// test's token is the admin's, which nothing limits), so `/readyz` names the missing policy and
/// the fix, and the node has no slice of the driver.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_dra_driver_publishes_no_slice_without_its_policy_where_policies_are_required() {
    let Some((server, client, _)) = cluster_with_node(
        "a_dra_driver_publishes_no_slice_without_its_policy_where_policies_are_required",
        "cli-no-policy",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let (devplug, port) = run_on_node_with(
        server,
        dir.path(),
        &plugins,
        "cli-no-policy",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.nopolicy.example.com }\n",
        &["--require-policies"],
    );
    let want =
        "cluster feature dra_slices: does not run: no admission policy keeps it to this node";
    let last = readyz_until(port, |(_, text)| text.contains(want)).await;
    assert_eq!(last.0, 503, "{}", last.1);
    assert!(
        last.1.contains(want) && last.1.contains("<release>-dra-slices"),
        "{}",
        last.1
    );
    let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client);
    let listed = slices
        .list(&kube::api::ListParams::default().fields("spec.driver=npu.nopolicy.example.com"))
        .await
        .unwrap();
    assert!(
        listed.items.is_empty(),
        "slices published without their policy"
    );
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    assert!(log.contains("dra_slices"), "{log}");
}

/// A new DRA driver publishes its slice only once the kubelet has registered it: before, the
/// scheduler could bind a pod the kubelet cannot prepare yet ("DRA driver ... is not
/// registered"), retried only after the pod's sync backoff. No kubelet watches the registry at
/// first: devplug serves (`/readyz` answers) and no slice appears; a kubelet that registers the
/// driver brings it.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_driver_publishes_its_slice_once_the_kubelet_registered_it() {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::api::ListParams;
    let Some((server, client, _)) = cluster_with_node(
        "a_dra_driver_publishes_its_slice_once_the_kubelet_registered_it",
        "cli-unregistered",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let (devplug, port) = run_on_node(
        server,
        dir.path(),
        &plugins,
        "cli-unregistered",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.unreg.example.com }\n",
    );
    let slices: Api<ResourceSlice> = Api::all(client);
    let mine = ListParams::default().fields("spec.driver=npu.unreg.example.com");
    readyz_until(port, |(code, _)| *code != 0).await;
    // Up and serving, unregistered: whatever the wait, no slice.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        slices.list(&mine).await.unwrap().items.is_empty(),
        "a slice published before the kubelet registered the driver"
    );
    let (_kubelet, _) = watcher_kubelet(dir.path()).await;
    let mut published = false;
    for _ in 0..200 {
        if !slices.list(&mine).await.unwrap().items.is_empty() {
            published = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(
        published,
        "no slice 10 s after the kubelet registered the driver\n{log}"
    );
    assert!(status.success(), "{log}");
}

/// A DRA driver whose checkpoint cannot be used (corrupt, or another driver's) is refused
/// alone: `/readyz` names it and says what to do, while the config's other resource registers
/// with the kubelet and serves.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_corrupt_dra_checkpoint_refuses_only_its_driver() {
    let Some((server, _, _)) = cluster_with_node(
        "a_corrupt_dra_checkpoint_refuses_only_its_driver",
        "cli-corrupt-checkpoint",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let driver_dir = dir.path().join("plugins").join("npu.corrupt.example.com");
    std::fs::create_dir_all(&driver_dir).unwrap();
    std::fs::write(driver_dir.join("checkpoint.json"), "{ not json").unwrap();
    let (devplug, port) = run_on_node(
        server,
        dir.path(),
        &plugins,
        "cli-corrupt-checkpoint",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.corrupt.example.com }\n  - name: example.com/dp\n    virtual: { count: 3 }\n",
    );
    let want = "DRA driver npu.corrupt.example.com: the DRA checkpoint";
    let last = readyz_until(port, |(_, text)| text.contains(want)).await;
    assert_eq!(last.0, 503, "{}", last.1);
    assert!(last.1.contains(want), "{}", last.1);
    assert!(last.1.contains("cannot be used"), "{}", last.1);
    // The other resource is served all the same.
    let served = kubelet
        .wait_for(Duration::from_secs(10), |n| {
            (n.capacity("example.com/dp") == (3, 3)).then_some(())
        })
        .await;
    assert!(served.is_ok(), "{}", last.1);
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    assert!(log.contains("this DRA driver cannot start"), "{log}");
    kubelet.stop().await;
}

/// A config of DRA resources only (the chart's `dra` example) becomes ready once the driver's
/// slices are published and the kubelet registered it: there is no device plugin to wait for.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_dra_only_config_becomes_ready() {
    let Some((server, _, _)) =
        cluster_with_node("a_dra_only_config_becomes_ready", "cli-dra-only").await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (kubelet, plugins) = watcher_kubelet(dir.path()).await;
    let (devplug, port) = run_on_node(
        server,
        dir.path(),
        &plugins,
        "cli-dra-only",
        "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n    dra: { driver: npu.only.example.com }\n",
    );
    let ready = readyz_until(port, |(status, _)| *status == 200).await;
    assert_eq!(ready.0, 200, "{}", ready.1);
    // The plugin watcher's folder replaced by a file: the kubelet can never find the driver,
    // and /healthz says so.
    kubelet.stop().await;
    let registry = dir.path().join("plugins_registry");
    // Deleted and a file put in its place, again while devplug, which makes its socket anew in
    // a folder it sees emptied, races the recursive delete.
    let mut tries = 0;
    while !registry.is_file() {
        tries += 1;
        assert!(
            tries < 100,
            "cannot replace {} with a file",
            registry.display()
        );
        if std::fs::remove_dir_all(&registry).is_ok() {
            let _ = std::fs::write(&registry, "oops");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut health = (0, String::new());
    for _ in 0..200 {
        if let Some(answer) = support::http_get(port, "/healthz").await {
            health = answer;
            if health.0 == 503 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(health.0, 503, "{}", health.1);
    assert!(
        health.1.contains("DRA driver npu.only.example.com") && health.1.contains("not a folder"),
        "{}",
        health.1
    );
    std::fs::remove_file(&registry).unwrap();
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
}

/// Whether the kubelet has the GPU resource's 4 devices and its DRA driver registered, within
/// 20 s.
async fn served_both_ways(kubelet: &Kubelet) -> bool {
    kubelet
        .wait_for(Duration::from_secs(20), |node| {
            (!node.dra_driver("gpu.reload.example.com").is_empty()
                && node.capacity("nvidia.com/gpu").0 == 4)
                .then_some(())
        })
        .await
        .is_ok()
}

/// A `dra: {device_plugin: true}` resource changed by a reload is served by one backend
/// instance, device plugin and DRA driver alike: NVML (the fake, which logs every `nvmlInit`)
/// is opened once for the new config, not once for each side.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_resource_served_both_ways_has_one_backend_instance() {
    let Some((server, _, _)) = cluster_with_node(
        "a_reloaded_resource_served_both_ways_has_one_backend_instance",
        "cli-reload-dra",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (kubelet, plugins) = watcher_kubelet(dir.path()).await;
    // The fake NVML as a driver installs it, logging each nvmlInit.
    let lib_dir = dir.path().join("driver/usr/lib64");
    let dev = dir.path().join("dev");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("nvidiactl"), "").unwrap();
    let topology = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fake-nvml/topologies/pcie-4gpu.yaml");
    let mut text = std::fs::read_to_string(topology).unwrap();
    text.push_str("\ninit_log: inits.log\n");
    std::fs::write(lib_dir.join("fake-nvml.yaml"), text).unwrap();
    let exe = std::env::current_exe().unwrap();
    let fake = exe.parent().unwrap().join("libfake_nvml.so");
    std::fs::copy(&fake, lib_dir.join("libnvidia-ml.so.1")).unwrap();
    let inits = || {
        std::fs::read_to_string(lib_dir.join("inits.log"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    let cdi = dir.path().join("cdi");
    let config_text = |extra: &str| {
        format!(
            "resources:\n  - name: nvidia.com/gpu\n    nvidia: {{ library: {}, dev_root: {}, sys_root: {}, cdi_dir: {}{extra} }}\n    dra: {{ driver: gpu.reload.example.com, device_plugin: true }}\n",
            lib_dir.join("libnvidia-ml.so.1").display(),
            dev.display(),
            dir.path().join("sys").display(),
            cdi.display(),
        )
    };
    let (devplug, port) = run_on_node(
        server,
        dir.path(),
        &plugins,
        "cli-reload-dra",
        &config_text(""),
    );
    let config = dir.path().join("config.yaml");
    if !served_both_ways(&kubelet).await {
        let (_, log) = devplug.terminate(Duration::from_secs(10)).await;
        panic!("never served both ways: {log}");
    }
    assert_eq!(inits(), 1, "one backend at start, shared by both sides");
    // A change of the backend's settings: a new instance for the new config, one only.
    std::fs::write(&config, config_text(", retry_max_ms: 5000")).unwrap();
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = support::http_get(port, "/metrics")
            .await
            .map(|(_, m)| m)
            .unwrap_or_default();
        if metrics.contains("devplug_config_reloads_total 1\n") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        metrics.contains("devplug_config_reloads_total 1\n")
            && metrics.contains("devplug_config_reload_failures_total 0\n"),
        "the reload applied:\n{metrics}"
    );
    assert!(served_both_ways(&kubelet).await);
    // The driver started again, registered and published: ready.
    let ready = readyz_until(port, |(status, _)| *status == 200).await;
    assert_eq!(ready.0, 200, "{}", ready.1);
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    assert_eq!(
        inits(),
        2,
        "the reload opened NVML more than once for one resource (two backend instances):\n{log}"
    );
}
