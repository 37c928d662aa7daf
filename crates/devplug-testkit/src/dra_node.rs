//! What the DRA tests against the real API server share: a node's kubelet (the simulator, its
//! plugin watcher in a temp folder) with devplug's DRA driver registered to it, a namespace,
//! claims and pods, and waits for allocations and slices.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test support: a failure is the test's

use devplug_dra::kubelet::{KubeletDirs, Registered};
use devplug_dra::ClaimBackend;
use devplug_dra::{DraDriver, DraDriverSettings};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::PostParams;
use kube::Api;
use kubelet_sim::{Kubelet, SimConfig};
use std::sync::Arc;
use std::time::Duration;

/// A node's kubelet and devplug's driver on it.
pub struct DraNode {
    /// The kubelet's folders and the CDI folder; removed on drop.
    pub root: tempfile::TempDir,
    /// The node's kubelet.
    pub kubelet: Kubelet,
    /// The driver's settings (to start it again).
    pub settings: DraDriverSettings,
    /// The driver, registered with the kubelet.
    pub driver: DraDriver,
}

/// A node's kubelet (the simulator) in a temp folder, with its plugin watcher beside its
/// device-plugins folder (checking every 50 ms): the folder (removed on drop), the
/// device-plugins folder and the kubelet.
pub async fn kubelet() -> (tempfile::TempDir, std::path::PathBuf, Kubelet) {
    let root = tempfile::tempdir().unwrap();
    let device_plugins = root.path().join("device-plugins");
    std::fs::create_dir_all(&device_plugins).unwrap();
    let config = SimConfig {
        watcher_reconcile: Duration::from_millis(50),
        ..SimConfig::default()
    }
    .with_watcher_beside(&device_plugins);
    let kubelet = Kubelet::start_with(&device_plugins, config).await.unwrap();
    (root, device_plugins, kubelet)
}

/// Starts the kubelet simulator for `node` and devplug's driver `driver` over `backend`, and
/// waits (10 s at most) until the kubelet has registered the driver.
pub async fn start(
    client: &kube::Client,
    node: &str,
    driver: &str,
    backend: Arc<dyn ClaimBackend>,
) -> DraNode {
    let (root, device_plugins, kubelet) = kubelet().await;
    let settings = DraDriverSettings {
        driver: driver.into(),
        node: node.into(),
        dirs: KubeletDirs::beside(&device_plugins),
        cdi_dir: root.path().join("cdi"),
        no_execute_after: None,
        device_metadata: false,
    };
    let driver = start_driver(&settings, backend, client).await;
    DraNode {
        root,
        kubelet,
        settings,
        driver,
    }
}

/// Starts the driver of `settings` and waits until the kubelet has registered it.
pub async fn start_driver(
    settings: &DraDriverSettings,
    backend: Arc<dyn ClaimBackend>,
    client: &kube::Client,
) -> DraDriver {
    let driver = DraDriver::start(settings.clone(), backend, client.clone())
        .await
        .unwrap();
    let mut registered = driver.registered();
    tokio::time::timeout(
        Duration::from_secs(10),
        registered.wait_for(|r| *r == Registered::Yes),
    )
    .await
    .expect("the kubelet registered the driver within 10 s")
    .unwrap();
    driver
}

/// Creates namespace `name`.
pub async fn namespace(client: &kube::Client, name: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({ "metadata": { "name": name } })).unwrap(),
        )
        .await
        .unwrap();
}

/// Claim `name` in `ns` with one request `request` of the given `exactly` (class, selectors,
/// capacity), and a pod of the same name using it.
pub async fn claim_and_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    request: &str,
    exactly: serde_json::Value,
) {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::resource::v1::ResourceClaim;
    use serde_json::json;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": name },
                "spec": { "devices": { "requests": [{ "name": request, "exactly": exactly }] } },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": {
                "resourceClaims": [{ "name": request, "resourceClaimName": name }],
                "containers": [{ "name": "main", "image": "example.invalid/job",
                                 "resources": { "claims": [{ "name": request }] } }],
            },
        }))
        .unwrap(),
    )
    .await
    .unwrap();
}

/// The claim `name`'s one result, once the scheduler allocated it.
pub async fn allocation(
    claims: &Api<k8s_openapi::api::resource::v1::ResourceClaim>,
    name: &str,
) -> Option<k8s_openapi::api::resource::v1::DeviceRequestAllocationResult> {
    let claim = claims.get(name).await.ok()?;
    let results = claim.status?.allocation?.devices?.results?;
    assert_eq!(results.len(), 1, "{results:?}");
    results.into_iter().next()
}

/// The shared control plane with the scheduler running, a client, and node `node` made
/// schedulable; `None` (the test skips, loudly) without `KUBEBUILDER_ASSETS`.
pub async fn scheduled(test: &str, node: &str) -> Option<kube::Client> {
    let server = crate::api_server::ApiServer::shared(test)?;
    server.start_scheduler().unwrap();
    let client = crate::api_server::client(&server.kubeconfig).await.unwrap();
    crate::api_server::schedulable_node(&client, node).await;
    Some(client)
}

/// Node `node`'s ResourceSlices of `driver`, once `ready` finds them as the test expects
/// (20 s at most; `what` names it in the timeout).
pub async fn pool(
    client: &kube::Client,
    node: &str,
    driver: &str,
    what: &str,
    ready: impl Fn(&[k8s_openapi::api::resource::v1::ResourceSlice]) -> bool,
) -> Vec<k8s_openapi::api::resource::v1::ResourceSlice> {
    let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client.clone());
    let fields = format!("spec.nodeName={node},spec.driver={driver}");
    crate::api_server::until(what, Duration::from_secs(20), || async {
        let list = slices
            .list(&kube::api::ListParams::default().fields(&fields))
            .await
            .ok()?;
        ready(&list.items).then_some(list.items)
    })
    .await
}

/// Creates DeviceClass `name`, selecting the devices the CEL `expression` matches.
pub async fn device_class(client: &kube::Client, name: &str, expression: &str) {
    let classes: Api<k8s_openapi::api::resource::v1::DeviceClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": { "name": name },
                "spec": { "selectors": [{ "cel": { "expression": expression } }] },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
}
