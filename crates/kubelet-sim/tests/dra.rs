//! The kubelet's DRA side against the fake DRA plugin, over real Unix sockets: registration
//! through `plugins_registry/` with the service version chosen as the kubelet chooses it,
//! refusals, prepare/unprepare round trips over v1 and v1beta1, per-claim errors, the per-call
//! timeout, deregistration, several endpoints of one driver, pods sharing claims, and a kubelet
//! restart.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use kubelet_sim::fake_dra_plugin::{FakeDraPlugin, FakeDraSpec};
use kubelet_sim::{
    ClaimError, DraClaim, DraDevice, DraError, DraPluginRecord, DraService, Kubelet, SimConfig,
};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(10);
const DRIVER: &str = "gpu.example.com";

/// A kubelet with the plugin watcher on `<root>/plugins_registry`, reconciling every 20 ms.
struct Node {
    _dir: tempfile::TempDir,
    root: PathBuf,
    kubelet: Kubelet,
}

impl Node {
    async fn start(call_timeout: Duration) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let plugins = root.join("device-plugins");
        let config = SimConfig {
            watcher_reconcile: Duration::from_millis(20),
            dra_call_timeout: call_timeout,
            ..SimConfig::default()
        }
        .with_watcher_beside(&plugins);
        let kubelet = Kubelet::start_with(&plugins, config).await.unwrap();
        Node {
            _dir: dir,
            root,
            kubelet,
        }
    }

    /// Serves a fake plugin with registration socket `<registry>/<name>` and endpoint
    /// `<root>/plugins/<endpoint_folder>/dra.sock`.
    async fn plugin(&self, name: &str, endpoint_folder: &str, spec: FakeDraSpec) -> FakeDraPlugin {
        FakeDraPlugin::serve(
            self.root.join("plugins_registry").join(name),
            self.endpoint(endpoint_folder),
            spec,
        )
        .await
        .unwrap()
    }

    fn endpoint(&self, folder: &str) -> PathBuf {
        self.root.join("plugins").join(folder).join("dra.sock")
    }

    /// Waits until `driver` has exactly `count` registered endpoints.
    async fn registered(&self, driver: &str, count: usize) -> Vec<DraPluginRecord> {
        let found = self
            .kubelet
            .wait_for(WAIT, |n| {
                let list = n.dra_driver(driver);
                (list.len() == count).then(|| list.into_iter().cloned().collect())
            })
            .await;
        match found {
            Ok(list) => list,
            Err(_) => panic!(
                "wanted {count} endpoints of {driver}, the kubelet has {:?}",
                self.kubelet
                    .read(|n| n.dra_plugins().cloned().collect::<Vec<_>>())
            ),
        }
    }
}

fn claim(name: &str) -> DraClaim {
    DraClaim::new("default", name, format!("uid-{name}"))
}

async fn notified(plugin: &FakeDraPlugin) -> (bool, String) {
    plugin
        .wait_notified(WAIT)
        .await
        .expect("the kubelet never called NotifyRegistrationStatus")
}

#[tokio::test]
async fn v1_is_chosen_when_both_are_listed_and_a_round_trip_gives_cdi_ids() {
    let node = Node::start(Duration::from_secs(45)).await;
    let plugin = node
        .plugin("gpu-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    assert_eq!(notified(&plugin).await, (true, String::new()));
    let records = node.registered(DRIVER, 1).await;
    assert_eq!(records[0].service, DraService::V1);
    assert_eq!(records[0].endpoint, node.endpoint(DRIVER));
    assert_eq!(records[0].registration_socket, plugin.registration_socket());

    // Two claims in one call: each gets its devices.
    let (a, b) = (claim("a"), claim("b"));
    let results = node
        .kubelet
        .dra_prepare(DRIVER, &[a.clone(), b.clone()])
        .await
        .unwrap();
    assert_eq!(results.len(), 2);
    let a_devices = results["uid-a"].as_ref().unwrap();
    assert_eq!(
        a_devices,
        &vec![DraDevice {
            request_names: vec!["req-0".into()],
            pool_name: "node-0".into(),
            device_name: "dev-0".into(),
            cdi_device_ids: vec!["gpu.example.com/device=dev-0".into()],
            share_id: None,
        }]
    );
    assert_eq!(
        results["uid-b"].as_ref().unwrap()[0].cdi_device_ids,
        ["gpu.example.com/device=dev-1"]
    );
    let calls = plugin.calls();
    assert_eq!(calls.len(), 1, "one call for both claims");
    assert_eq!(calls[0].service, DraService::V1);
    assert_eq!(calls[0].claims, [a.clone(), b.clone()]);

    // The kubelet keeps what it prepared.
    let kept = node.kubelet.read(|n| {
        let claim = n.dra_claim(DRIVER, "uid-a").unwrap();
        (
            claim.claim.clone(),
            claim
                .cdi_device_ids()
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>(),
            n.dra_prepared(DRIVER).count(),
        )
    });
    assert_eq!(
        kept,
        (a.clone(), vec!["gpu.example.com/device=dev-0".into()], 2)
    );

    // Unprepare: done at the plugin, forgotten at the kubelet.
    let results = node.kubelet.dra_unprepare(DRIVER, &[a, b]).await.unwrap();
    assert_eq!(results["uid-a"], Ok(()));
    assert_eq!(results["uid-b"], Ok(()));
    assert!(plugin.prepared().is_empty());
    assert_eq!(node.kubelet.read(|n| n.dra_prepared(DRIVER).count()), 0);
    assert_eq!(plugin.calls()[1].method, "NodeUnprepareResources");
    plugin.stop().await;
}

#[tokio::test]
async fn a_v1beta1_only_plugin_is_called_over_v1beta1() {
    let node = Node::start(Duration::from_secs(45)).await;
    let spec = FakeDraSpec::new(DRIVER).only(&[DraService::V1beta1]);
    let plugin = node.plugin("gpu-reg.sock", DRIVER, spec).await;
    assert_eq!(notified(&plugin).await, (true, String::new()));
    assert_eq!(
        node.registered(DRIVER, 1).await[0].service,
        DraService::V1beta1
    );
    let c = claim("c");
    let results = node
        .kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&c))
        .await
        .unwrap();
    assert_eq!(
        results["uid-c"].as_ref().unwrap()[0].cdi_device_ids,
        ["gpu.example.com/device=dev-0"]
    );
    let results = node.kubelet.dra_unprepare(DRIVER, &[c]).await.unwrap();
    assert_eq!(results["uid-c"], Ok(()));
    assert!(plugin
        .calls()
        .iter()
        .all(|call| call.service == DraService::V1beta1));
    plugin.stop().await;
}

#[tokio::test]
async fn the_plugins_order_decides_the_version() {
    let node = Node::start(Duration::from_secs(45)).await;
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.supported_versions = vec![
        "v1beta1.DRAPlugin".into(),
        "v1.DRAPlugin".into(),
        "v2.DRAPlugin".into(),
    ];
    let plugin = node.plugin("gpu-reg.sock", DRIVER, spec).await;
    assert_eq!(notified(&plugin).await, (true, String::new()));
    assert_eq!(
        node.registered(DRIVER, 1).await[0].service,
        DraService::V1beta1,
        "the first listed service the kubelet knows"
    );
    node.kubelet
        .dra_prepare(DRIVER, &[claim("x")])
        .await
        .unwrap();
    assert_eq!(plugin.calls()[0].service, DraService::V1beta1);
    plugin.stop().await;
}

#[tokio::test]
async fn unknown_versions_are_refused_with_notify_false_and_retried() {
    let node = Node::start(Duration::from_secs(45)).await;
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.supported_versions = vec!["v1alpha4.Node".into()];
    let plugin = node.plugin("gpu-reg.sock", DRIVER, spec).await;
    let (registered, error) = notified(&plugin).await;
    assert!(!registered);
    assert_eq!(
        error,
        format!(
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC \
             versions of DRA driver plugin {DRIVER} at endpoint {}: none of services supported \
             by the plugin ([\"v1alpha4.Node\"]) are supported by the kubelet \
             ([\"v1.DRAPlugin\" \"v1beta1.DRAPlugin\"])",
            node.endpoint(DRIVER).display()
        )
    );
    assert_eq!(node.kubelet.read(|n| n.dra_plugins().count()), 0);
    let err = node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    assert!(
        matches!(err, DraError::NotRegistered(ref d) if d == DRIVER),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "DRA driver gpu.example.com is not registered"
    );

    // Not in the actual state: the plugin manager tries the socket again after 500 ms.
    let again = tokio::time::timeout(WAIT, async {
        while plugin.notifications().len() < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(again.is_ok(), "a refused socket is retried");
    assert!(plugin.calls().is_empty());
    plugin.stop().await;

    // An empty list is refused as well.
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.supported_versions.clear();
    let plugin = node.plugin("empty-reg.sock", "empty", spec).await;
    let (registered, error) = notified(&plugin).await;
    assert!(!registered);
    assert!(
        error.ends_with("empty list of supported gRPC services (aka supported versions)"),
        "{error}"
    );
    plugin.stop().await;
}

#[tokio::test]
async fn a_claim_missing_from_the_answer_fails_alone() {
    let node = Node::start(Duration::from_secs(45)).await;
    let plugin = node
        .plugin("gpu-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    node.registered(DRIVER, 1).await;
    plugin.skip_claim("uid-b");
    plugin.fail_claim("uid-c", "device dev-7 is gone");
    let claims = [claim("a"), claim("b"), claim("c")];
    let results = node.kubelet.dra_prepare(DRIVER, &claims).await.unwrap();
    assert!(results["uid-a"].is_ok());
    assert_eq!(results["uid-b"], Err(ClaimError::NotAnswered));
    assert_eq!(
        results["uid-c"],
        Err(ClaimError::Failed("device dev-7 is gone".into()))
    );
    let prepared: Vec<String> = node.kubelet.read(|n| {
        n.dra_prepared(DRIVER)
            .map(|c| c.claim.uid.clone())
            .collect()
    });
    assert_eq!(prepared, ["uid-a"], "only the claim that succeeded is kept");

    // Unprepare is checked the same way; the failed claim stays prepared.
    plugin.heal_claim("uid-b");
    plugin.fail_claim("uid-a", "busy");
    let results = node
        .kubelet
        .dra_unprepare(DRIVER, &claims[..2])
        .await
        .unwrap();
    assert_eq!(results["uid-a"], Err(ClaimError::Failed("busy".into())));
    assert_eq!(results["uid-b"], Ok(()));
    assert!(node
        .kubelet
        .read(|n| n.dra_claim(DRIVER, "uid-a").is_some()));
    plugin.stop().await;
}

#[tokio::test]
async fn a_plugin_that_never_answers_hits_the_call_timeout() {
    let timeout = Duration::from_millis(300);
    let node = Node::start(timeout).await;
    let plugin = node
        .plugin("gpu-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    node.registered(DRIVER, 1).await;
    plugin.set_hang(true);
    let started = Instant::now();
    let err = node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(
            err,
            DraError::Timeout { ref driver, method: "NodePrepareResources", after }
                if driver == DRIVER && after == timeout
        ),
        "{err:?}"
    );
    assert!(took >= timeout && took < WAIT, "{took:?}");
    assert_eq!(node.kubelet.read(|n| n.dra_prepared(DRIVER).count()), 0);
    let err = node
        .kubelet
        .dra_unprepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    assert!(matches!(err, DraError::Timeout { .. }), "{err:?}");

    // Answering again, it is usable again.
    plugin.set_hang(false);
    assert!(node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap()["uid-a"]
        .is_ok());
    plugin.stop().await;
}

#[tokio::test]
async fn a_removed_registration_socket_deregisters_the_driver() {
    let node = Node::start(Duration::from_secs(45)).await;
    let plugin = node
        .plugin("gpu-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    node.registered(DRIVER, 1).await;
    plugin.remove_registration();
    node.registered(DRIVER, 0).await;
    let err = node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "DRA driver gpu.example.com is not registered"
    );
    assert!(
        plugin.calls().is_empty(),
        "the endpoint is not called any more"
    );
    let err = node
        .kubelet
        .dra_prepare("", &[claim("a")])
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "DRA driver name is empty");
    plugin.stop().await;
}

#[tokio::test]
async fn a_dead_endpoint_is_a_dial_error() {
    let node = Node::start(Duration::from_secs(45)).await;
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.services.clear();
    let plugin = node.plugin("gpu-reg.sock", DRIVER, spec).await;
    node.registered(DRIVER, 1).await;
    // Registered, but its DRAPlugin socket is gone (the plugin crashed, the file stayed or not).
    std::fs::remove_file(plugin.endpoint()).unwrap();
    let err = node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    match &err {
        DraError::Dial {
            driver, endpoint, ..
        } => {
            assert_eq!(driver, DRIVER);
            assert_eq!(endpoint, &node.endpoint(DRIVER));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string().starts_with(&format!(
            "DRA driver gpu.example.com: failed to connect to {}",
            node.endpoint(DRIVER).display()
        )),
        "{err}"
    );
    plugin.stop().await;
}

#[tokio::test]
async fn a_service_the_plugin_does_not_serve_is_a_grpc_status() {
    let node = Node::start(Duration::from_secs(45)).await;
    // Lists v1 but serves only v1beta1: the kubelet trusts the list.
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.services = vec![DraService::V1beta1];
    let plugin = node.plugin("gpu-reg.sock", DRIVER, spec).await;
    node.registered(DRIVER, 1).await;
    let err = node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DraError::Status {
                code: tonic::Code::Unimplemented,
                ..
            }
        ),
        "{err:?}"
    );
    plugin.stop().await;
}

#[tokio::test]
async fn a_rolling_update_keeps_the_driver_usable() {
    let node = Node::start(Duration::from_secs(45)).await;
    let old = node
        .plugin("gpu-old-reg.sock", "gpu-old", FakeDraSpec::new(DRIVER))
        .await;
    node.registered(DRIVER, 1).await;
    let new = node
        .plugin("gpu-new-reg.sock", "gpu-new", FakeDraSpec::new(DRIVER))
        .await;
    let both = node.registered(DRIVER, 2).await;
    assert_eq!(notified(&new).await, (true, String::new()));
    assert!(both[0].registered_at <= both[1].registered_at);

    // Calls go to the newest endpoint that accepts connections.
    node.kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap();
    assert_eq!((old.calls().len(), new.calls().len()), (0, 1));

    // The new instance's endpoint is down but still registered: the old one is used.
    std::fs::remove_file(new.endpoint()).unwrap();
    node.kubelet
        .dra_prepare(DRIVER, &[claim("b")])
        .await
        .unwrap();
    assert_eq!((old.calls().len(), new.calls().len()), (1, 1));

    // The old instance goes away: only the new one stays registered.
    old.remove_registration();
    let left = node.registered(DRIVER, 1).await;
    assert_eq!(left[0].endpoint, node.endpoint("gpu-new"));

    old.stop().await;
    new.stop().await;
}

#[tokio::test]
async fn an_endpoint_registered_twice_is_refused_and_not_retried() {
    let node = Node::start(Duration::from_secs(45)).await;
    let first = node
        .plugin("gpu-a-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    node.registered(DRIVER, 1).await;
    // A second instance whose GetInfo names the first one's endpoint.
    let endpoint = node.endpoint(DRIVER);
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.advertised_endpoint = Some(endpoint.display().to_string());
    let second = node.plugin("gpu-b-reg.sock", "gpu-b", spec).await;
    let (ok, error) = notified(&second).await;
    assert!(!ok);
    assert_eq!(
        error,
        format!(
            "RegisterPlugin error -- plugin registration failed with err: endpoint {} already \
             registered for DRA driver plugin {DRIVER}",
            endpoint.display()
        )
    );
    let records = node.registered(DRIVER, 1).await;
    assert_eq!(records[0].registration_socket, first.registration_socket());
    // In the actual state already: never tried again.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(second.notifications().len(), 1);
    first.stop().await;
    second.stop().await;
}

#[tokio::test]
async fn an_empty_endpoint_means_the_registration_socket() {
    let node = Node::start(Duration::from_secs(45)).await;
    let mut spec = FakeDraSpec::new(DRIVER);
    spec.advertised_endpoint = Some(String::new());
    let plugin = node.plugin("gpu-reg.sock", DRIVER, spec).await;
    let records = node.registered(DRIVER, 1).await;
    assert_eq!(records[0].endpoint, plugin.registration_socket());
    // The registration socket serves no DRAPlugin: the call reaches it and is unimplemented.
    let err = node
        .kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DraError::Status {
                code: tonic::Code::Unimplemented,
                ..
            }
        ),
        "{err:?}"
    );
    plugin.stop().await;
}

#[tokio::test]
async fn pods_share_claims_and_the_last_one_unprepares() {
    let node = Node::start(Duration::from_secs(45)).await;
    let gpu = node
        .plugin("gpu-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    let nic = node
        .plugin(
            "nic-reg.sock",
            "nic.example.com",
            FakeDraSpec::new("nic.example.com"),
        )
        .await;
    node.registered(DRIVER, 1).await;
    node.registered("nic.example.com", 1).await;
    let (shared, own, net) = (claim("shared"), claim("own"), claim("net"));

    // A driver that is not registered: nothing changes.
    let err = node
        .kubelet
        .dra_prepare_pod(
            "pod-a",
            &[(DRIVER, shared.clone()), ("fpga.example.com", own.clone())],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "DRA driver fpga.example.com is not registered"
    );
    assert_eq!(node.kubelet.read(|n| n.dra_pod_claims("pod-a").count()), 0);
    assert!(gpu.calls().is_empty());

    // One call per driver, with all of that driver's claims.
    node.kubelet
        .dra_prepare_pod(
            "pod-a",
            &[
                (DRIVER, shared.clone()),
                (DRIVER, own.clone()),
                ("nic.example.com", net.clone()),
            ],
        )
        .await
        .unwrap();
    assert_eq!(gpu.calls().len(), 1);
    assert_eq!(gpu.calls()[0].claims, [shared.clone(), own.clone()]);
    assert_eq!(nic.calls()[0].claims, std::slice::from_ref(&net));

    // A second pod using the shared claim: already prepared, no call.
    node.kubelet
        .dra_prepare_pod("pod-b", &[(DRIVER, shared.clone())])
        .await
        .unwrap();
    assert_eq!(gpu.calls().len(), 1);

    // Pod a goes: its own claims are unprepared, the shared one stays.
    assert!(node.kubelet.dra_remove_pod("pod-a").await.unwrap());
    assert_eq!(gpu.calls()[1].method, "NodeUnprepareResources");
    assert_eq!(gpu.calls()[1].claims, std::slice::from_ref(&own));
    assert_eq!(nic.calls()[1].claims, [net]);
    assert!(node
        .kubelet
        .read(|n| n.dra_claim(DRIVER, "uid-shared").is_some()));
    assert!(node
        .kubelet
        .read(|n| n.dra_claim(DRIVER, "uid-own").is_none()));

    // Pod b goes, failing first: it keeps its reference and can be retried.
    gpu.fail_claim("uid-shared", "still busy");
    let err = node.kubelet.dra_remove_pod("pod-b").await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "NodeUnprepareResources failed for ResourceClaim shared: still busy"
    );
    assert_eq!(node.kubelet.read(|n| n.dra_pod_claims("pod-b").count()), 1);
    gpu.heal_claim("uid-shared");
    assert!(node.kubelet.dra_remove_pod("pod-b").await.unwrap());
    assert!(gpu.prepared().is_empty());
    assert_eq!(node.kubelet.read(|n| n.dra_prepared(DRIVER).count()), 0);
    assert!(!node.kubelet.dra_remove_pod("pod-b").await.unwrap());

    // A claim the plugin leaves out fails the pod, as the kubelet's "skipped" error does.
    gpu.skip_claim("uid-lost");
    let err = node
        .kubelet
        .dra_prepare_pod("pod-c", &[(DRIVER, claim("lost"))])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DraError::ClaimFailed {
                error: ClaimError::NotAnswered,
                ..
            }
        ),
        "{err:?}"
    );
    gpu.stop().await;
    nic.stop().await;
}

#[tokio::test]
async fn a_kubelet_restart_keeps_prepared_claims_and_plugins_register_again() {
    let mut node = Node::start(Duration::from_secs(45)).await;
    let plugin = node
        .plugin("gpu-reg.sock", DRIVER, FakeDraSpec::new(DRIVER))
        .await;
    let before = node.registered(DRIVER, 1).await[0].registered_at;
    node.kubelet
        .dra_prepare(DRIVER, &[claim("a")])
        .await
        .unwrap();
    node.kubelet.restart().await.unwrap();
    let after = node
        .kubelet
        .wait_for(WAIT, |n| {
            n.dra_driver(DRIVER)
                .first()
                .map(|p| p.registered_at)
                .filter(|at| *at > before)
        })
        .await
        .unwrap();
    assert!(after > before);
    assert!(node
        .kubelet
        .read(|n| n.dra_claim(DRIVER, "uid-a").is_some()));
    let results = node
        .kubelet
        .dra_unprepare(DRIVER, &[claim("a")])
        .await
        .unwrap();
    assert_eq!(results["uid-a"], Ok(()));
    plugin.stop().await;
}
