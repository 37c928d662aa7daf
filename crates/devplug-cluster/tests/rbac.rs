//! The uninstall Job's ServiceAccount and RBAC from `deploy/kustomize-uninstall/rbac.yaml`,
//! applied to a real API server: a token for that account (TokenRequest) can do exactly what the
//! clean uninstall needs (read nodes, read and patch their status) and is refused everything
//! else. Skipped loudly without `KUBEBUILDER_ASSETS`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_cluster::capacity::{self, CleanOptions};
use devplug_testkit::api_server::{self, ApiServer};
use devplug_testkit::api_server::{admin, new_node};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchParams};
use kube::Api;
use std::time::Duration;

fn forbidden<T: std::fmt::Debug>(result: Result<T, kube::Error>, what: &str) {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn the_uninstall_account_can_do_exactly_what_it_needs() {
    let Some(admin) = admin("the_uninstall_account_can_do_exactly_what_it_needs").await else {
        return;
    };
    // Apply the manifests as written.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/kustomize-uninstall/rbac.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).unwrap();
    assert_eq!(docs.len(), 3);
    let pp = PostParams::default();
    for doc in docs {
        match doc["kind"].as_str().unwrap() {
            "ServiceAccount" => {
                let sa: ServiceAccount = serde_json::from_value(doc).unwrap();
                Api::<ServiceAccount>::namespaced(admin.clone(), "kube-system")
                    .create(&pp, &sa)
                    .await
                    .unwrap();
            }
            "ClusterRole" => {
                let role: ClusterRole = serde_json::from_value(doc).unwrap();
                Api::<ClusterRole>::all(admin.clone())
                    .create(&pp, &role)
                    .await
                    .unwrap();
            }
            "ClusterRoleBinding" => {
                let binding: ClusterRoleBinding = serde_json::from_value(doc).unwrap();
                Api::<ClusterRoleBinding>::all(admin.clone())
                    .create(&pp, &binding)
                    .await
                    .unwrap();
            }
            other => panic!("unexpected kind {other}"),
        }
    }
    let nodes: Api<Node> = Api::all(admin.clone());
    let node = new_node(&nodes, "rbac").await;
    let status = serde_json::json!({"status": {
        "capacity": {"example.com/old": "0"}, "allocatable": {"example.com/old": "0"},
    }});
    nodes
        .patch_status(&node, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();

    // A token for the account, as the Job's pod would get.
    let request: TokenRequest = serde_json::from_value(serde_json::json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 3600},
    }))
    .unwrap();
    let issued: TokenRequest = Api::<ServiceAccount>::namespaced(admin.clone(), "kube-system")
        .create_subresource("token", "devplug-uninstall", &pp, &request)
        .await
        .unwrap();
    let token = issued.status.unwrap().token.unwrap();
    let server = ApiServer::shared("rbac").unwrap();
    let config = server.kubeconfig_for_token("uninstall", &token).unwrap();
    let job = api_server::client(&config).await.unwrap();
    let as_job: Api<Node> = Api::all(job.clone());

    // Allowed: list, get, watch nodes; get and patch their status (the whole recipe).
    assert!(!as_job
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());
    as_job.get(&node).await.unwrap();
    let _events = as_job
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap();
    let options = CleanOptions {
        wait_for_zero: Duration::from_secs(5),
        recheck_after: Duration::from_millis(200),
        attempts: 2,
    };
    let report = capacity::clean(&as_job, &node, "example.com/old", options)
        .await
        .unwrap();
    assert_eq!(report.removals, 1);
    assert!(!capacity::list(&nodes, &node)
        .await
        .unwrap()
        .contains_key("example.com/old"));

    // Refused: anything else.
    let labels = serde_json::json!({"metadata": {"labels": {"x": "y"}}});
    forbidden(
        as_job
            .patch(&node, &PatchParams::default(), &Patch::Merge(&labels))
            .await,
        "patch a node",
    );
    forbidden(
        as_job.delete(&node, &DeleteParams::default()).await,
        "delete a node",
    );
    let another: Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "rbac-other"}})).unwrap();
    forbidden(as_job.create(&pp, &another).await, "create a node");
    forbidden(
        Api::<Pod>::all(job.clone())
            .list(&ListParams::default())
            .await,
        "list pods",
    );
    forbidden(
        Api::<ConfigMap>::namespaced(job.clone(), "kube-system")
            .list(&ListParams::default())
            .await,
        "list config maps",
    );
    forbidden(
        Api::<ClusterRole>::all(job).get("devplug-uninstall").await,
        "read its own role",
    );
}
