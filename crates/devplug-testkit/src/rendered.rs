//! The rendered Helm chart (`.ci/render-helm`, named by `DEVPLUG_HELM_RENDERED`) for permission
//! tests: one release's documents, and every permission of it (service accounts, roles, their
//! bindings, admission policies and their bindings) applied to a real API server as Helm would.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::Value;

/// The documents of the rendered release `release` (`<DEVPLUG_HELM_RENDERED>/<release>.yaml`).
/// Panics when the variable is not set or the file cannot be read (a test helper).
pub fn release(release: &str) -> Vec<Value> {
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .unwrap_or_else(|| panic!("DEVPLUG_HELM_RENDERED names the rendered chart"));
    let path = std::path::Path::new(&dir).join(format!("{release}.yaml"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the rendered release {}: {e}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("the rendered release {}: {e}", path.display()))
        .into_iter()
        .filter(|d| d.is_object())
        .collect()
}

/// The kinds [`apply_permissions`] creates, in the order Helm would (accounts before the
/// bindings that name them, policies before their bindings).
pub const PERMISSION_KINDS: [&str; 7] = [
    "ServiceAccount",
    "ClusterRole",
    "Role",
    "ClusterRoleBinding",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

fn api_resource(doc: &Value) -> ApiResource {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let plural = match kind {
        "ValidatingAdmissionPolicy" => "validatingadmissionpolicies".to_owned(),
        other => format!("{}s", other.to_lowercase()),
    };
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), &plural)
}

/// Creates every permission document of `docs` (the kinds of [`PERMISSION_KINDS`], hooks
/// included) with `admin`; one that exists already is left as it is. Returns how many were
/// created. Panics on any other error (a test helper).
pub async fn apply_permissions(admin: &kube::Client, docs: &[Value]) -> usize {
    let mut created = 0;
    for kind in PERMISSION_KINDS {
        for doc in docs.iter().filter(|d| d["kind"] == kind) {
            let resource = api_resource(doc);
            let mut object: DynamicObject = serde_json::from_value(doc.clone())
                .unwrap_or_else(|e| panic!("{kind} {}: {e}", doc["metadata"]["name"]));
            // Helm's hook annotations mean nothing to the API server.
            object.metadata.annotations = None;
            let api: kube::Api<DynamicObject> = match doc["metadata"]["namespace"].as_str() {
                Some(ns) => kube::Api::namespaced_with(admin.clone(), ns, &resource),
                None => kube::Api::all_with(admin.clone(), &resource),
            };
            match api.create(&PostParams::default(), &object).await {
                Ok(_) => created += 1,
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => panic!("create {kind} {}: {e}", doc["metadata"]["name"]),
            }
        }
    }
    created
}

/// The namespace and name of the service account `binding_name`'s first subject (a
/// ClusterRoleBinding or RoleBinding of `docs`). Panics when there is none.
pub fn bound_account(docs: &[Value], binding_name: &str) -> (String, String) {
    let binding = docs
        .iter()
        .find(|d| {
            (d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding")
                && d["metadata"]["name"] == binding_name
        })
        .unwrap_or_else(|| panic!("the release renders no binding {binding_name}"));
    let subject = &binding["subjects"][0];
    (
        subject["namespace"].as_str().unwrap_or_default().to_owned(),
        subject["name"].as_str().unwrap_or_default().to_owned(),
    )
}

/// The chart's DRA permissions alone, as a node's devplug has them when its config has only
/// `dra:` resources: the `dra` release's service accounts, its DRA ClusterRole and binding
/// (`<release>-dra`) and the slices' admission policy and binding (`<release>-dra-slices`),
/// applied with `admin`. Returns the bound account's namespace API and name, for tokens bound to
/// a node ([`crate::api_server::node_token`]). The release's driver is `npu.example.com`.
/// Panics on an error (a test helper).
pub async fn apply_dra_role(
    admin: &kube::Client,
) -> (
    kube::Api<k8s_openapi::api::core::v1::ServiceAccount>,
    String,
) {
    let dra: Vec<Value> = release("dra")
        .into_iter()
        .filter(|d| {
            d["kind"] == "ServiceAccount"
                || d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("-dra") || n.ends_with("-dra-slices"))
        })
        .collect();
    let binding = dra
        .iter()
        .find(|d| d["kind"] == "ClusterRoleBinding")
        .and_then(|d| d["metadata"]["name"].as_str())
        .unwrap_or_else(|| panic!("the dra release renders no DRA ClusterRoleBinding"))
        .to_owned();
    let created = apply_permissions(admin, &dra).await;
    assert!(
        created >= 4,
        "the DRA role, its binding and the slices' policy and binding: {created} created"
    );
    let (namespace, account) = bound_account(&dra, &binding);
    (kube::Api::namespaced(admin.clone(), &namespace), account)
}
