//! Every manifest in `deploy/` against the Kubernetes API types (k8s-openapi, API 1.33), strictly:
//! unknown or misplaced fields and wrong types fail with their path. Also: the kustomization
//! lists exactly the manifests beside it, and the objects refer to each other correctly (service
//! account, config volume and file, kubelet folder), and each workload runs the right one of the
//! image's two binaries (the lean `/devplug-lite` unless the config or flags need the API server;
//! the uninstall Jobs the full `/devplug`).
//!
//! The Helm chart is checked the same way when `DEVPLUG_HELM_RENDERED` names a folder of rendered
//! releases (`.ci/render-helm` writes one); rendering needs Helm, which tests do not fetch.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod prometheus_operator;

use deploy_check::{documents, image_transformed, repo_root, strict, yaml_files, CheckError};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The object kinds deploy/ uses, typed.
#[derive(Debug)]
enum Object {
    ServiceAccount(ServiceAccount),
    ConfigMap(ConfigMap),
    DaemonSet(Box<DaemonSet>),
    Pod(Box<Pod>),
    Job(Box<Job>),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
    Role(Role),
    RoleBinding(RoleBinding),
    Policy(Box<ValidatingAdmissionPolicy>),
    PolicyBinding(Box<ValidatingAdmissionPolicyBinding>),
    DeviceClass(Box<DeviceClass>),
    ClaimTemplate(Box<ResourceClaimTemplate>),
    Service(Box<Service>),
    PodMonitor(Box<prometheus_operator::PodMonitor>),
    ServiceMonitor(Box<prometheus_operator::ServiceMonitor>),
    PrometheusRule(Box<prometheus_operator::PrometheusRule>),
    /// The Grafana dashboard (a ConfigMap with `devplug.json`), in the namespace Grafana's
    /// sidecar watches.
    Dashboard(ConfigMap),
}

fn typed(doc: &Value) -> Result<Object, String> {
    let api = doc["apiVersion"].as_str().unwrap_or("");
    let kind = doc["kind"].as_str().unwrap_or("");
    let checked = match (api, kind) {
        ("v1", "ServiceAccount") => strict(doc).map(Object::ServiceAccount),
        ("v1", "ConfigMap") if doc["data"].get("devplug.json").is_some() => {
            strict(doc).map(Object::Dashboard)
        }
        ("v1", "ConfigMap") => strict(doc).map(Object::ConfigMap),
        ("v1", "Service") => strict(doc).map(|s| Object::Service(Box::new(s))),
        ("monitoring.coreos.com/v1", "PodMonitor") => {
            strict(doc).map(|m| Object::PodMonitor(Box::new(m)))
        }
        ("monitoring.coreos.com/v1", "ServiceMonitor") => {
            strict(doc).map(|m| Object::ServiceMonitor(Box::new(m)))
        }
        ("monitoring.coreos.com/v1", "PrometheusRule") => {
            strict(doc).map(|r| Object::PrometheusRule(Box::new(r)))
        }
        ("apps/v1", "DaemonSet") => strict(doc).map(|d| Object::DaemonSet(Box::new(d))),
        ("v1", "Pod") => strict(doc).map(|p| Object::Pod(Box::new(p))),
        ("batch/v1", "Job") => strict(doc).map(|j| Object::Job(Box::new(j))),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => strict(doc).map(Object::ClusterRole),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            strict(doc).map(Object::ClusterRoleBinding)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => strict(doc).map(Object::Role),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => strict(doc).map(Object::RoleBinding),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            strict(doc).map(|p| Object::Policy(Box::new(p)))
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            strict(doc).map(|b| Object::PolicyBinding(Box::new(b)))
        }
        ("resource.k8s.io/v1", "DeviceClass") => {
            strict(doc).map(|c| Object::DeviceClass(Box::new(c)))
        }
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
            strict(doc).map(|t| Object::ClaimTemplate(Box::new(t)))
        }
        _ => {
            return Err(format!(
                "no typed check for apiVersion {api:?} kind {kind:?}; add the type to deploy-check"
            ))
        }
    };
    checked.map_err(|e| e.to_string())
}

/// Every object of `files`, or the list of problems (file, document index, path, what).
fn load(files: &[PathBuf]) -> Result<Vec<Object>, Vec<String>> {
    let mut objects = Vec::new();
    let mut problems = Vec::new();
    for file in files {
        let name = file.strip_prefix(repo_root()).unwrap_or(file).display();
        match documents(file) {
            Err(err) => problems.push(err.to_string()),
            Ok(docs) if docs.is_empty() => problems.push(format!("{name}: no YAML document")),
            Ok(docs) => {
                for (i, doc) in docs.iter().enumerate() {
                    match typed(doc) {
                        Ok(object) => objects.push(object),
                        Err(err) => problems.push(format!("{name}: document {i}: {err}")),
                    }
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(objects)
    } else {
        Err(problems)
    }
}

fn load_ok(files: &[PathBuf]) -> Vec<Object> {
    load(files).unwrap_or_else(|problems| panic!("\n{}", problems.join("\n")))
}

fn kustomize_dir() -> PathBuf {
    repo_root().join("deploy/kustomize")
}

/// The kustomize base's object files (everything but kustomization.yaml).
fn kustomize_manifests() -> Vec<PathBuf> {
    yaml_files(&kustomize_dir())
        .unwrap()
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect()
}

#[test]
fn the_bindings_ignore_unknown_fields_so_the_round_trip_is_needed() {
    let doc = json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "devplug"},
        "automountServiceAccountTokn": false,
    });
    // Plain deserialization silently drops the misspelt field...
    let plain: ServiceAccount = serde_json::from_value(doc.clone()).unwrap();
    assert_eq!(plain.automount_service_account_token, None);
    // ...the strict check reports it.
    let err = strict::<ServiceAccount>(&doc).unwrap_err();
    assert_eq!(
        err.to_string(),
        "automountServiceAccountTokn: unknown field: the Kubernetes type has no such field here"
    );
}

#[test]
fn kustomize_objects_are_strictly_valid_and_refer_to_each_other() {
    let files = kustomize_manifests();
    assert!(files.len() >= 3, "{files:?}");
    let objects = load_ok(&files);
    let problems = references(&objects);
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn kustomization_lists_exactly_the_manifests_beside_it() {
    let path = kustomize_dir().join("kustomization.yaml");
    let docs = documents(&path).unwrap();
    assert_eq!(docs.len(), 1);
    let k = &docs[0];
    assert_eq!(k["apiVersion"], "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k["kind"], "Kustomization");
    let listed: Vec<&str> = k["resources"]
        .as_array()
        .expect("resources is a list")
        .iter()
        .map(|r| r.as_str().expect("each resource is a file name"))
        .collect();
    for r in &listed {
        assert!(
            kustomize_dir().join(r).is_file(),
            "kustomization.yaml lists {r}, which does not exist"
        );
    }
    for file in kustomize_manifests() {
        let name = file.file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            listed.contains(&name.as_str()),
            "{name} is in deploy/kustomize but not in kustomization.yaml's resources"
        );
    }
    // The image transformer matches by name; a name no container uses changes nothing.
    let objects = load_ok(&kustomize_manifests());
    let images: Vec<String> = objects
        .iter()
        .filter_map(|o| match o {
            Object::DaemonSet(d) => pod_spec(d),
            _ => None,
        })
        .flat_map(|spec| spec.containers.iter().filter_map(|c| c.image.clone()))
        .collect();
    for image in k["images"].as_array().into_iter().flatten() {
        let name = image["name"].as_str().unwrap();
        assert!(
            images
                .iter()
                .any(|i| i == name || i.starts_with(&format!("{name}:"))),
            "kustomization.yaml sets image {name:?}, but the containers use {images:?}"
        );
    }
}

/// A kustomization built by hand, for the part of kustomize that deploy/ uses: `resources`
/// (files, and folders built the same way), `namespace`, `patches` by file (strategic merge,
/// the target named by the patch's kind and name), `images`, applied in kustomize's order. Any
/// other field fails, so an overlay that starts using one is not checked wrongly.
fn kustomize_build(dir: &Path) -> Vec<Value> {
    let name = dir.strip_prefix(repo_root()).unwrap_or(dir).display();
    let k = documents(&dir.join("kustomization.yaml"))
        .unwrap()
        .remove(0);
    for key in k.as_object().unwrap().keys() {
        let known = [
            "apiVersion",
            "kind",
            "resources",
            "namespace",
            "patches",
            "images",
        ];
        assert!(
            known.contains(&key.as_str()),
            "{name}: kustomize_build does not do {key:?}; teach it"
        );
    }
    let mut objects = Vec::new();
    for resource in k["resources"].as_array().into_iter().flatten() {
        let path = dir.join(resource.as_str().unwrap());
        if path.is_dir() {
            objects.extend(kustomize_build(&path));
        } else {
            objects.extend(documents(&path).unwrap());
        }
    }
    if let Some(namespace) = k.get("namespace") {
        // As kustomize: cluster-scoped objects get none.
        let cluster_scoped = [
            "ClusterRole",
            "ClusterRoleBinding",
            "Namespace",
            "DeviceClass",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ];
        for object in &mut objects {
            if cluster_scoped.iter().all(|kind| object["kind"] != *kind) {
                object["metadata"]["namespace"] = namespace.clone();
            }
        }
    }
    for patch in k["patches"].as_array().into_iter().flatten() {
        let keys: Vec<&String> = patch.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["path"],
            "{name}: kustomize_build applies patches by file only"
        );
        for patch in documents(&dir.join(patch["path"].as_str().unwrap())).unwrap() {
            let target = objects
                .iter_mut()
                .find(|o| {
                    o["kind"] == patch["kind"]
                        && o["metadata"]["name"] == patch["metadata"]["name"]
                        && (patch["metadata"]["namespace"].is_null()
                            || o["metadata"]["namespace"] == patch["metadata"]["namespace"])
                })
                .unwrap_or_else(|| panic!("{name}: the patch for {} has no target", patch["kind"]));
            strategic_merge(target, &patch, "");
        }
    }
    let images = k["images"].as_array().cloned().unwrap_or_default();
    for object in &mut objects {
        let containers = object.pointer_mut("/spec/template/spec/containers");
        for container in containers
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let image = container["image"].as_str().unwrap().to_owned();
            container["image"] = Value::from(image_transformed(&image, &images));
        }
    }
    objects
}

/// The field a list of the Kubernetes types merges by, as kustomize's strategic merge does for
/// the lists deploy/ patches; other lists are replaced.
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "containers" | "initContainers" | "volumes" | "env" => Some("name"),
        "volumeMounts" => Some("mountPath"),
        "ports" => Some("containerPort"),
        _ => None,
    }
}

/// `patch` merged into `target` (a strategic merge patch without directives).
fn strategic_merge(target: &mut Value, patch: &Value, field: &str) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                assert!(
                    !key.starts_with('$'),
                    "kustomize_build: no patch directives ({key})"
                );
                if value.is_null() {
                    target.remove(key);
                } else if let Some(existing) = target.get_mut(key) {
                    strategic_merge(existing, value, key);
                } else {
                    target.insert(key.clone(), value.clone());
                }
            }
        }
        (Value::Array(target), Value::Array(patch)) if merge_key(field).is_some() => {
            let key = merge_key(field).unwrap();
            let mut added = Vec::new();
            for item in patch {
                match target.iter_mut().find(|t| t[key] == item[key]) {
                    Some(existing) => strategic_merge(existing, item, ""),
                    None => added.push(item.clone()),
                }
            }
            // kustomize puts the new items first.
            target.splice(0..0, added);
        }
        (target, patch) => *target = patch.clone(),
    }
}

/// The base and every folder in deploy/overlays.
fn kustomizations() -> Vec<PathBuf> {
    let mut dirs = vec![kustomize_dir()];
    let overlays = std::fs::read_dir(repo_root().join("deploy/overlays")).unwrap();
    let mut overlays: Vec<PathBuf> = overlays.flatten().map(|e| e.path()).collect();
    overlays.sort();
    dirs.extend(overlays.into_iter().filter(|p| {
        p.join("kustomization.yaml").is_file() && !p.to_string_lossy().ends_with("-uninstall")
    }));
    dirs
}

/// The clean uninstall's kustomizations: the folder itself and the registry's overlay of it.
fn uninstall_kustomizations() -> Vec<PathBuf> {
    vec![
        repo_root().join("deploy/kustomize-uninstall"),
        repo_root().join("deploy/overlays/registry-uninstall"),
    ]
}

fn typed_ok(name: &str, docs: &[Value]) -> Vec<Object> {
    let (objects, problems): (Vec<_>, Vec<_>) = docs.iter().map(typed).partition(Result::is_ok);
    let problems: Vec<String> = problems.into_iter().map(Result::unwrap_err).collect();
    assert!(problems.is_empty(), "{name}:\n{}", problems.join("\n"));
    objects.into_iter().map(Result::unwrap).collect()
}

#[test]
fn kustomize_builds_are_strictly_valid_and_refer_to_each_other() {
    let dirs = kustomizations();
    assert!(dirs.len() >= 3, "{dirs:?}");
    for dir in dirs {
        let name = dir.strip_prefix(repo_root()).unwrap().display().to_string();
        let objects = typed_ok(&name, &kustomize_build(&dir));
        let problems = references(&objects);
        assert!(problems.is_empty(), "{name}:\n{}", problems.join("\n"));
    }
}

/// Lists merged by key in any order, so that two builds compare as kustomize means them.
fn normalized(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let mut v = normalized(v);
                    if let (Some(key), Value::Array(items)) = (merge_key(k), &mut v) {
                        items.sort_by_key(|i| i[key].to_string());
                    }
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(normalized).collect()),
        other => other.clone(),
    }
}

/// The hand build against kubectl's kustomize, where kubectl is installed (it needs no cluster).
#[test]
fn the_hand_build_is_what_kubectl_kustomize_makes() {
    for dir in kustomizations()
        .into_iter()
        .chain(uninstall_kustomizations())
    {
        let output = match std::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(&dir)
            .output()
        {
            Ok(output) => output,
            Err(err) => {
                eprintln!("kubectl kustomize: {err}: the hand build is not compared");
                return;
            }
        };
        let name = dir.strip_prefix(repo_root()).unwrap().display().to_string();
        assert!(
            output.status.success(),
            "kubectl kustomize {name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8(output.stdout).unwrap();
        let theirs: Vec<Value> = serde_saphyr::from_multiple::<Value>(&text).unwrap();
        let key = |o: &Value| format!("{}/{}", o["kind"], o["metadata"]["name"]);
        let mut ours: Vec<Value> = kustomize_build(&dir).iter().map(normalized).collect();
        let mut theirs: Vec<Value> = theirs.iter().map(normalized).collect();
        ours.sort_by_key(key);
        theirs.sort_by_key(key);
        assert_eq!(ours, theirs, "{name}");
    }
}

/// The NVIDIA overlay as kubectl applies it: the GPU image, the nvidia resource alone, the
/// driver root, /dev, /sys and the CDI folder, privileged, NVIDIA nodes only.
#[test]
fn the_nvidia_overlay_serves_nvidia_gpus() {
    let dir = repo_root().join("deploy/overlays/nvidia");
    let built = kustomize_build(&dir);
    let objects = typed_ok("deploy/overlays/nvidia", &built);
    assert!(references(&objects).is_empty());
    let (ds, cm) = release_objects(&objects);
    let config: Value = serde_saphyr::from_str(&cm.data.as_ref().unwrap()["config.yaml"]).unwrap();
    let resources = config["resources"].as_array().unwrap();
    assert_eq!(resources.len(), 1, "{config}");
    assert_eq!(resources[0]["name"], "nvidia.com/gpu");
    let spec = pod_spec(ds).unwrap();
    let container = &spec.containers[0];
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        container.image.as_deref(),
        Some(&*format!("devplug:{version}-gpu"))
    );
    let host_path_at = |path: &str| mounted_host_path(spec, container, path);
    let host_root = resources[0]["nvidia"]["host_driver_root"].as_str().unwrap();
    assert_eq!(
        host_path_at("/driver-root"),
        Some((host_root.to_owned(), true))
    );
    assert_eq!(host_path_at("/dev"), Some(("/dev".into(), true)));
    assert_eq!(host_path_at("/sys"), Some(("/sys".into(), true)));
    assert_eq!(
        host_path_at("/var/run/cdi"),
        Some(("/var/run/cdi".into(), false))
    );
    let selector = spec.node_selector.as_ref().unwrap();
    assert_eq!(
        selector
            .get("feature.node.kubernetes.io/pci-10de.present")
            .map(String::as_str),
        Some("true")
    );
}

/// The host folder mounted at `path` in `container` of `spec`, and whether read-only.
fn mounted_host_path(spec: &PodSpec, container: &Container, path: &str) -> Option<(String, bool)> {
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    let host = volume.host_path.as_ref()?.path.clone();
    Some((host, mount.read_only == Some(true)))
}

/// The host path that `path` in `container` is, through the deepest host-path mount at or
/// above it (`/var/lib/x` mounted from the host's `/var/lib/x` makes `/var/lib/x/dev` the
/// host's `/var/lib/x/dev`).
fn host_path_below(spec: &PodSpec, container: &Container, path: &str) -> Option<String> {
    let (mount, rest) = container
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.mount_path != "/")
        .filter_map(|m| {
            let rest = std::path::Path::new(path)
                .strip_prefix(&m.mount_path)
                .ok()?;
            Some((m, rest))
        })
        .max_by_key(|(m, _)| m.mount_path.len())?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    let host = std::path::Path::new(&volume.host_path.as_ref()?.path).join(rest);
    Some(host.to_string_lossy().trim_end_matches('/').to_owned())
}

/// The DaemonSet and ConfigMap of a release.
fn release_objects(objects: &[Object]) -> (&DaemonSet, &ConfigMap) {
    let ds = objects.iter().find_map(|o| match o {
        Object::DaemonSet(d) => Some(d.as_ref()),
        _ => None,
    });
    let cm = objects.iter().find_map(|o| match o {
        Object::ConfigMap(c) => Some(c),
        _ => None,
    });
    (ds.unwrap(), cm.unwrap())
}

/// A change to a list of documents.
type Change = Box<dyn Fn(&mut [Value])>;

#[test]
fn what_a_gpu_resource_needs_is_checked() {
    let built = kustomize_build(&repo_root().join("deploy/overlays/nvidia"));
    let problems_after = |change: &dyn Fn(&mut [Value])| {
        let mut docs = built.clone();
        change(&mut docs);
        references(&typed_ok("changed overlay", &docs)).join("\n")
    };
    assert_eq!(problems_after(&|_| {}), "");
    fn ds(docs: &mut [Value]) -> &mut Value {
        docs.iter_mut().find(|d| d["kind"] == "DaemonSet").unwrap()
    }
    fn container(docs: &mut [Value]) -> &mut Value {
        &mut ds(docs)["spec"]["template"]["spec"]["containers"][0]
    }
    let cases: Vec<(&str, Change, &str)> = vec![
        (
            "the static image",
            Box::new(|docs| container(docs)["image"] = json!("devplug:0.1.0")),
            "cannot load NVML",
        ),
        (
            "another host driver root",
            Box::new(|docs| {
                let volumes = &mut ds(docs)["spec"]["template"]["spec"]["volumes"];
                for v in volumes.as_array_mut().unwrap() {
                    if v["name"] == "driver-root" {
                        v["hostPath"]["path"] = json!("/run/nvidia/driver");
                    }
                }
            }),
            "is the host's driver root (host_driver_root /) mounted",
        ),
        (
            "unprivileged",
            Box::new(|docs| {
                let c = container(docs);
                c["securityContext"]["privileged"] = json!(false);
                c["securityContext"]["allowPrivilegeEscalation"] = json!(false);
            }),
            "run privileged, or under NVIDIA's runtime",
        ),
        (
            "privileged without escalation",
            Box::new(|docs| {
                let c = container(docs);
                c["securityContext"]["allowPrivilegeEscalation"] = json!(false);
            }),
            "privileged with allowPrivilegeEscalation false",
        ),
        (
            "the CDI folder read-only",
            Box::new(|docs| {
                let c = container(docs);
                for m in c["volumeMounts"].as_array_mut().unwrap() {
                    if m["mountPath"] == "/var/run/cdi" {
                        m["readOnly"] = json!(true);
                    }
                }
            }),
            "cdi_dir /var/run/cdi is not the host's /var/run/cdi mounted writable",
        ),
        (
            "no /dev",
            Box::new(|docs| {
                let c = container(docs);
                c["volumeMounts"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|m| m["mountPath"] != "/dev");
            }),
            "dev_root /dev is not the host's /dev",
        ),
        (
            "a mount twice",
            Box::new(|docs| {
                let c = container(docs);
                let mounts = c["volumeMounts"].as_array_mut().unwrap();
                mounts.push(mounts[0].clone());
            }),
            "is mounted twice",
        ),
    ];
    for (what, change, needle) in cases {
        let problems = problems_after(&*change);
        assert!(problems.contains(needle), "{what}: {problems:?}");
    }
}

#[test]
fn example_pods_are_strictly_valid() {
    let files = yaml_files(&repo_root().join("deploy/examples")).unwrap();
    assert!(!files.is_empty());
    for object in load_ok(&files) {
        assert!(matches!(object, Object::Pod(_)), "{object:?}");
    }
}

/// Each DRA example (`deploy/examples/dra/<feature>/manifests.yaml`): classes, claim templates
/// and pods, strictly typed; a class selects a driver that the example's config serves.
#[test]
fn dra_examples_are_strictly_valid() {
    let dir = repo_root().join("deploy/examples/dra");
    let mut features: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    features.sort();
    assert!(features.len() >= 3, "{features:?}");
    for feature in features {
        let config = std::fs::read_to_string(feature.join("config.yaml")).unwrap();
        let objects = load_ok(&[feature.join("manifests.yaml")]);
        assert!(
            objects.iter().any(|o| matches!(o, Object::Pod(_))),
            "{feature:?}: no pod"
        );
        for object in objects {
            if let Object::DeviceClass(class) = object {
                let selects = class
                    .spec
                    .iter()
                    .flat_map(|s| s.selectors.iter().flatten())
                    .filter_map(|s| s.cel.as_ref())
                    .any(|cel| {
                        cel.expression
                            .split('"')
                            .nth(1)
                            .is_some_and(|driver| config.contains(&format!("driver: {driver}")))
                    });
                assert!(
                    selects,
                    "{feature:?}: the class selects no driver of the config"
                );
            }
        }
    }
}

/// A change to a document.
type Mutation = Box<dyn Fn(&mut Value)>;

#[test]
fn mistakes_in_a_real_manifest_are_caught_with_their_path() {
    let original = documents(&kustomize_dir().join("daemonset.yaml"))
        .unwrap()
        .remove(0);
    let cases: Vec<(&str, Mutation, &str)> = vec![
        (
            "misspelt field",
            Box::new(|d| d["spec"]["template"]["spec"]["hostNetwrok"] = json!(true)),
            "spec.template.spec.hostNetwrok: unknown field",
        ),
        (
            "misplaced field",
            Box::new(|d| {
                let c = &mut d["spec"]["template"]["spec"]["containers"][0];
                c["ports"][0]["readinessProbe"] = c["readinessProbe"].clone();
            }),
            "spec.template.spec.containers[0].ports[0].readinessProbe: unknown field",
        ),
        (
            "wrong type",
            Box::new(|d| {
                d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsUser"] =
                    json!("0")
            }),
            "spec.template.spec.containers[0].securityContext.runAsUser: invalid type: string \"0\"",
        ),
        (
            "wrong kind",
            Box::new(|d| d["apiVersion"] = json!("v1")),
            "no typed check for apiVersion \"v1\" kind \"DaemonSet\"",
        ),
    ];
    assert!(typed(&original).is_ok());
    for (what, mutate, needle) in cases {
        let mut doc = original.clone();
        mutate(&mut doc);
        let err = typed(&doc).expect_err(what);
        assert!(
            err.starts_with(needle),
            "{what}: {err:?} should start with {needle:?}"
        );
    }
}

#[cfg_attr(
    no_helm_rendered,
    ignore = "needs the rendered Helm chart: run .ci/render-helm target/helm-rendered and set DEVPLUG_HELM_RENDERED"
)]
#[test]
fn rendered_helm_releases_are_strictly_valid_and_refer_to_each_other() {
    // Ignored where the variable is not set; run anyway, it fails.
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let files = yaml_files(Path::new(&dir)).unwrap();
    assert!(!files.is_empty(), "no rendered releases in {dir:?}");
    for file in files {
        let objects = load_ok(std::slice::from_ref(&file));
        let problems = references(&objects);
        assert!(
            problems.is_empty(),
            "{}:\n{}",
            file.display(),
            problems.join("\n")
        );
    }
}

/// The monitoring objects of a release find devplug's pods: each PodMonitor selects the pods
/// and names their metrics port; each ServiceMonitor selects a Service of the release that
/// selects the pods, by a port of that Service that leads to the metrics port; every alert has
/// a name and an expression over devplug's metrics; the dashboard carries the Grafana
/// sidecar's label and is a dashboard whose every query reads devplug's metrics.
fn monitoring_references(objects: &[Object], ds: &DaemonSet, spec: &PodSpec) -> Vec<String> {
    use std::collections::BTreeMap;
    let mut problems = Vec::new();
    let empty = BTreeMap::new();
    let pod_labels = ds
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref())
        .unwrap_or(&empty);
    let selects_pods = |selector: &BTreeMap<String, String>| {
        !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
    };
    let container_ports: Vec<&str> = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| p.name.as_deref())
        .collect();
    let services: Vec<&Service> = objects
        .iter()
        .filter_map(|o| match o {
            Object::Service(s) => Some(s.as_ref()),
            _ => None,
        })
        .collect();
    for object in objects {
        match object {
            Object::PodMonitor(m) => {
                if !selects_pods(m.spec.selector.match_labels.as_ref().unwrap_or(&empty)) {
                    problems.push("the PodMonitor does not select the DaemonSet's pods".into());
                }
                for endpoint in &m.spec.pod_metrics_endpoints {
                    let port = endpoint.port.as_deref().unwrap_or("");
                    if !container_ports.contains(&port) {
                        problems.push(format!(
                            "the PodMonitor scrapes port {port:?}, the pods' ports are {container_ports:?}"
                        ));
                    }
                }
            }
            Object::ServiceMonitor(m) => {
                let wanted = m.spec.selector.match_labels.as_ref().unwrap_or(&empty);
                let service = services.iter().find(|s| {
                    let labels = s.metadata.labels.as_ref().unwrap_or(&empty);
                    !wanted.is_empty() && wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
                });
                let Some(service) = service else {
                    problems.push("the ServiceMonitor selects no Service of the release".into());
                    continue;
                };
                let service_spec = service.spec.clone().unwrap_or_default();
                if !selects_pods(service_spec.selector.as_ref().unwrap_or(&empty)) {
                    problems
                        .push("the metrics Service does not select the DaemonSet's pods".into());
                }
                for endpoint in &m.spec.endpoints {
                    let name = endpoint.port.as_deref();
                    let port = service_spec
                        .ports
                        .iter()
                        .flatten()
                        .find(|p| p.name.as_deref() == name);
                    let target = port.and_then(|p| p.target_port.as_ref()).map(|t| match t {
                        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => {
                            s.clone()
                        }
                        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i) => {
                            i.to_string()
                        }
                    });
                    if !target
                        .as_deref()
                        .is_some_and(|t| container_ports.contains(&t))
                    {
                        problems.push(format!(
                            "the ServiceMonitor's port {name:?} does not lead to a named port of the pods ({container_ports:?})"
                        ));
                    }
                }
            }
            Object::PrometheusRule(r) => {
                for rule in r.spec.groups.iter().flat_map(|g| &g.rules) {
                    if rule.alert.as_deref().unwrap_or("").is_empty()
                        || !rule.expr.contains("devplug_")
                    {
                        problems.push(format!(
                            "a rule without an alert name or devplug's metrics: {rule:?}"
                        ));
                    }
                }
            }
            Object::Dashboard(c) => {
                let labels = c.metadata.labels.as_ref().unwrap_or(&empty);
                if labels.get("grafana_dashboard").map(String::as_str) != Some("1") {
                    problems.push(format!(
                        "the dashboard lacks grafana_dashboard: \"1\": {labels:?}"
                    ));
                }
                let json = c.data.as_ref().and_then(|d| d.get("devplug.json"));
                let dashboard: Value = json
                    .and_then(|j| serde_json::from_str(j).ok())
                    .unwrap_or(Value::Null);
                let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
                if panels.is_empty() {
                    problems.push("the dashboard's devplug.json has no panels".into());
                }
                for panel in &panels {
                    for target in panel["targets"].as_array().into_iter().flatten() {
                        if !target["expr"]
                            .as_str()
                            .is_some_and(|e| e.contains("devplug_"))
                        {
                            problems.push(format!(
                                "dashboard panel {}: a query without devplug's metrics",
                                panel["title"]
                            ));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    problems
}

fn pod_spec(d: &DaemonSet) -> Option<&PodSpec> {
    d.spec.template.spec.as_ref()
}

/// Cross-object checks for one release: the DaemonSet runs as the ServiceAccount, mounts the
/// ConfigMap so that `--config` names one of its keys, mounts the kubelet folder at the
/// `--kubelet-dir` it passes (same path inside as outside), and selects its own pods.
fn references(objects: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    let daemonsets: Vec<&DaemonSet> = objects
        .iter()
        .filter_map(|o| match o {
            Object::DaemonSet(d) => Some(d.as_ref()),
            _ => None,
        })
        .collect();
    let config_maps: Vec<&ConfigMap> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ConfigMap(c) => Some(c),
            _ => None,
        })
        .collect();
    let accounts: Vec<&ServiceAccount> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ServiceAccount(s) => Some(s),
            _ => None,
        })
        .collect();
    let ([ds], [cm]) = (daemonsets.as_slice(), config_maps.as_slice()) else {
        return vec![format!(
            "expected one DaemonSet and one ConfigMap, found {} and {}",
            daemonsets.len(),
            config_maps.len()
        )];
    };

    let namespaces: Vec<&Option<String>> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ServiceAccount(s) => Some(&s.metadata.namespace),
            Object::ConfigMap(c) => Some(&c.metadata.namespace),
            Object::DaemonSet(d) => Some(&d.metadata.namespace),
            Object::Pod(p) => Some(&p.metadata.namespace),
            Object::Job(j) => Some(&j.metadata.namespace),
            Object::ClaimTemplate(t) => Some(&t.metadata.namespace),
            Object::Service(s) => Some(&s.metadata.namespace),
            Object::PodMonitor(m) => Some(&m.metadata.namespace),
            Object::ServiceMonitor(m) => Some(&m.metadata.namespace),
            Object::PrometheusRule(r) => Some(&r.metadata.namespace),
            // Cluster-scoped, or (node events) in namespace default by design, or (the
            // dashboard) where Grafana's sidecar looks.
            Object::Dashboard(_)
            | Object::DeviceClass(_)
            | Object::ClusterRole(_)
            | Object::ClusterRoleBinding(_)
            | Object::Role(_)
            | Object::RoleBinding(_)
            | Object::Policy(_)
            | Object::PolicyBinding(_) => None,
        })
        .collect();
    if namespaces.windows(2).any(|w| w[0] != w[1]) {
        problems.push(format!(
            "objects are in different namespaces: {namespaces:?}"
        ));
    }

    let Some(spec) = pod_spec(ds) else {
        return vec!["the DaemonSet has no pod spec".into()];
    };
    problems.extend(monitoring_references(objects, ds, spec));
    {
        let ds_spec = &ds.spec;
        let labels = ds_spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref());
        for (k, v) in ds_spec.selector.match_labels.iter().flatten() {
            if labels.and_then(|l| l.get(k)) != Some(v) {
                problems.push(format!(
                    "the selector's {k}={v} is not a label of the pod template"
                ));
            }
        }
    }
    if !accounts.is_empty()
        && !accounts
            .iter()
            .any(|sa| spec.service_account_name == sa.metadata.name)
    {
        problems.push(format!(
            "the pods run as {:?}, the ServiceAccounts are {:?}",
            spec.service_account_name,
            accounts
                .iter()
                .map(|sa| &sa.metadata.name)
                .collect::<Vec<_>>()
        ));
    }
    problems.extend(rbac_references(objects));

    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let Some(container) = spec.containers.first() else {
        return vec!["the DaemonSet has no container".into()];
    };
    let args = container.args.as_deref().unwrap_or_default();
    let arg = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();

    // --config FILE: a mount of the ConfigMap's volume holds FILE, and FILE is a key of the map.
    let config_volume = volumes
        .iter()
        .find(|v| v.config_map.as_ref().map(|c| &c.name) == cm.metadata.name.as_ref());
    match (arg("--config"), config_volume) {
        (None, _) => problems.push("the container has no --config argument".into()),
        (_, None) => problems.push(format!(
            "no volume mounts the ConfigMap {:?}",
            cm.metadata.name
        )),
        (Some(file), Some(volume)) => {
            let key = mounts
                .iter()
                .filter(|m| m.name == volume.name)
                .find_map(|m| file.strip_prefix(&format!("{}/", m.mount_path)));
            let keys = cm.data.as_ref();
            match key {
                None => problems.push(format!(
                    "--config {file} is not inside a mount of volume {:?}",
                    volume.name
                )),
                Some(key) if !keys.is_some_and(|d| d.contains_key(key)) => {
                    problems.push(format!("--config {file}: the ConfigMap has no key {key:?}"))
                }
                Some(_) => {}
            }
        }
    }

    // The binary: the full one only where the API server is used.
    let config = cm
        .data
        .as_ref()
        .and_then(|d| d.get("config.yaml"))
        .map(|text| serde_saphyr::from_str::<Value>(text))
        .transpose();
    match config {
        Ok(config) => {
            let config = config.unwrap_or(Value::Null);
            problems.extend(binary_problem(
                "the DaemonSet",
                container.command.as_deref(),
                needs_cluster(&config, args),
            ));
            problems.extend(gpu_problems(&config, spec, container));
        }
        Err(err) => problems.push(format!("the ConfigMap's config.yaml is not YAML: {err}")),
    }

    problems.extend(pod_problems(spec, container));
    problems.extend(http_problems(container));

    // --kubelet-dir DIR: mounted from the host's DIR at DIR.
    match arg("--kubelet-dir") {
        None => problems.push("the container has no --kubelet-dir argument".into()),
        Some(dir) => {
            let mounted = mounts.iter().filter(|m| m.mount_path == dir).any(|m| {
                volumes.iter().any(|v| {
                    v.name == m.name && v.host_path.as_ref().is_some_and(|h| h.path == dir)
                })
            });
            if !mounted {
                problems.push(format!(
                    "--kubelet-dir {dir} is not the host's {dir} mounted at the same path"
                ));
            }
        }
    }
    problems
}

/// The HTTP listeners: `--metrics-addr` and `--probe-addr` listen on the container ports named
/// `metrics` and `probes`; the kubelet's liveness and readiness probes go to the probe listener
/// (a connection budget of its own, which clients of the metrics port cannot spend); every
/// `$(VAR)` in the arguments is an env var of the container (the kubelet leaves an unknown one
/// as written, which devplug then refuses as an address).
fn http_problems(container: &Container) -> Vec<String> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let mut problems = Vec::new();
    let args = container.args.as_deref().unwrap_or_default();
    let arg = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let ports = container.ports.as_deref().unwrap_or_default();
    let named = |name: &str| {
        ports
            .iter()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port)
    };
    // The port of a listen address (`[$(POD_IP)]:8081`, `0.0.0.0:8080`, `:8080`).
    let port_of = |addr: &str| {
        addr.rsplit_once(':')
            .and_then(|(_, p)| p.parse::<i32>().ok())
    };
    for (flag, name) in [("--metrics-addr", "metrics"), ("--probe-addr", "probes")] {
        match (arg(flag), named(name)) {
            (None, _) => problems.push(format!("the container has no {flag} argument")),
            (Some(addr), port) if port_of(addr) != port || port.is_none() => problems.push(
                format!("{flag} {addr} is not on the container port named {name:?} ({port:?})"),
            ),
            _ => {}
        }
    }
    let probe_port = arg("--probe-addr").and_then(|a| port_of(a));
    for (what, probe) in [
        ("liveness", &container.liveness_probe),
        ("readiness", &container.readiness_probe),
    ] {
        let Some(get) = probe.as_ref().and_then(|p| p.http_get.as_ref()) else {
            problems.push(format!("the container has no HTTP {what} probe"));
            continue;
        };
        let port = match &get.port {
            IntOrString::Int(n) => Some(*n),
            IntOrString::String(name) => named(name),
        };
        if port.is_none() || port != probe_port {
            problems.push(format!(
                "the {what} probe goes to port {:?}, not to the probe listener (--probe-addr, port {probe_port:?})",
                get.port
            ));
        }
    }
    let env: Vec<&str> = container
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    for a in args {
        let mut rest = a.as_str();
        while let Some((_, after)) = rest.split_once("$(") {
            let Some((var, tail)) = after.split_once(')') else {
                break;
            };
            if !env.contains(&var) {
                problems.push(format!(
                    "argument {a:?} names $({var}), which is not an env var of the container"
                ));
            }
            rest = tail;
        }
    }
    problems
}

/// What the API server refuses in a pod spec that the typed check cannot see: a volume name
/// twice, a mount of a missing volume, a mount path twice, `privileged` without privilege
/// escalation, `Bidirectional` propagation unprivileged.
fn pod_problems(spec: &PodSpec, container: &Container) -> Vec<String> {
    let mut problems = Vec::new();
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    for (i, v) in volumes.iter().enumerate() {
        if volumes[..i].iter().any(|o| o.name == v.name) {
            problems.push(format!("volume {:?} is named twice", v.name));
        }
    }
    for (i, m) in mounts.iter().enumerate() {
        if !volumes.iter().any(|v| v.name == m.name) {
            problems.push(format!(
                "{} mounts volume {:?}, which is missing",
                m.mount_path, m.name
            ));
        }
        if mounts[..i].iter().any(|o| o.mount_path == m.mount_path) {
            problems.push(format!("{} is mounted twice", m.mount_path));
        }
    }
    let security = container.security_context.as_ref();
    let privileged = security.and_then(|s| s.privileged) == Some(true);
    if privileged && security.and_then(|s| s.allow_privilege_escalation) == Some(false) {
        problems.push("privileged with allowPrivilegeEscalation false: refused".into());
    }
    for m in mounts {
        if m.mount_propagation.as_deref() == Some("Bidirectional") && !privileged {
            problems.push(format!(
                "{}: Bidirectional propagation needs privileged",
                m.mount_path
            ));
        }
    }
    problems
}

/// The backends that hand the runtime host paths under their `dev_root` and write CDI specs
/// (the GPUs, and the accelerators on the shared node backend), as config keys.
const HOST_PATH_KEYS: [&str; 7] = [
    "nvidia",
    "amdgpu",
    "intel_gpu",
    "vfio",
    "qat",
    "ascend",
    "fpga",
];

/// devplug's default NVIDIA driver roots (`nvidia::DEFAULT_DRIVER_ROOTS` in devplug-backends).
const DEFAULT_DRIVER_ROOTS: [&str; 3] = ["/", "/run/nvidia/driver", "/driver-root"];

/// What a GPU or accelerator backend's resource needs from the pod it runs in. Every one: its `dev_root` and,
/// when it writes a CDI spec, its `cdi_dir` (writable) mounted from the same host paths, since
/// the paths it hands the runtime are host paths. nvidia also: the GPU image (binaries built for
/// glibc, which can load NVML), one of its `driver_roots` mounted from the host, that folder
/// being `host_driver_root` where set, and a way to open the GPUs' device nodes: privileged, or
/// a RuntimeClass (NVIDIA's runtime giving the pod its GPUs).
fn gpu_problems(config: &Value, spec: &PodSpec, container: &Container) -> Vec<String> {
    let host_path_at = |path: &str| mounted_host_path(spec, container, path);
    let mut problems = Vec::new();
    let resources = config["resources"].as_array().into_iter().flatten();
    for (i, resource) in resources.enumerate() {
        let Some((backend, settings)) = HOST_PATH_KEYS
            .iter()
            .find_map(|k| resource.get(*k).map(|s| (*k, s)))
        else {
            continue;
        };
        let at = format!("resources[{i}].{backend}");
        let setting =
            |key: &str, default: &str| settings[key].as_str().unwrap_or(default).to_owned();
        let dev = setting("dev_root", "/dev");
        if host_path_below(spec, container, &dev) != Some(dev.clone()) {
            problems.push(format!(
                "{at}.dev_root {dev} is not the host's {dev} mounted at the same path"
            ));
        }
        let cdi = if backend == "nvidia" {
            settings["device_list_strategy"].as_array().is_none_or(|s| {
                s.iter()
                    .any(|s| s.as_str().is_some_and(|s| s.starts_with("cdi")))
            })
        } else {
            settings["cdi"] != false
        };
        let cdi_dir = setting("cdi_dir", "/var/run/cdi");
        if cdi && host_path_at(&cdi_dir) != Some((cdi_dir.clone(), false)) {
            problems.push(format!(
                "{at}.cdi_dir {cdi_dir} is not the host's {cdi_dir} mounted writable at the same \
                 path (the runtime reads the CDI spec there)"
            ));
        }
        if backend != "nvidia" {
            continue;
        }
        if let Some(share) = settings.get("share").filter(|s| !s.is_null()) {
            let dir = share["dir"]
                .as_str()
                .unwrap_or("/run/devplug/mps")
                .to_owned();
            let host = share["host_dir"].as_str().unwrap_or(&dir).to_owned();
            if host_path_at(&dir) != Some((host.clone(), false)) {
                problems.push(format!(
                    "{at}.share.dir {dir} is not the host's {host} mounted writable (the MPS \
                     pipes the containers mount live there)"
                ));
            }
        }
        let image = container.image.as_deref().unwrap_or_default();
        if !image.ends_with("-gpu") {
            problems.push(format!(
                "{at}: image {image} cannot load NVML; the GPU image is tagged <version>-gpu"
            ));
        }
        let roots: Vec<String> = match settings["driver_roots"].as_array() {
            Some(roots) => roots
                .iter()
                .filter_map(|r| r.as_str().map(str::to_owned))
                .collect(),
            None => DEFAULT_DRIVER_ROOTS.map(str::to_owned).to_vec(),
        };
        let host_root = settings["host_driver_root"].as_str();
        let mounted = roots.iter().any(|root| {
            host_path_at(root).is_some_and(|(host, _)| host == host_root.unwrap_or(root))
        });
        if !mounted {
            problems.push(format!(
                "{at}: none of driver_roots {roots:?} is the host's driver root ({}) mounted",
                host_root.map_or("host_driver_root unset: the same path".into(), |h| format!(
                    "host_driver_root {h}"
                ))
            ));
        }
        let privileged = container
            .security_context
            .as_ref()
            .and_then(|s| s.privileged)
            == Some(true);
        if !privileged && spec.runtime_class_name.is_none() {
            problems.push(format!(
                "{at}: NVML opens the GPUs' device nodes: run privileged, or under NVIDIA's \
                 runtime (runtimeClassName)"
            ));
        }
    }
    problems
}

/// The image's full build (deploy/Containerfile.prebuilt; tests/install.rs pins both names).
const FULL: &str = "/devplug";
/// The image's device-plugin-only build: no Kubernetes API client.
const LITE: &str = "/devplug-lite";

/// The resource keys that need the Kubernetes API client. Keep in step with devplug's
/// `config::needs_cluster` (crates/devplug-cli/src/config.rs), which devplug-lite uses to refuse
/// such a config.
const CLUSTER_KEYS: [&str; 2] = ["advertise", "dra"];

/// What in devplug's config (the ConfigMap's `config.yaml`) or the container's arguments needs the
/// Kubernetes API client, if anything: a resource with one of [`CLUSTER_KEYS`] (`advertise:`,
/// `dra:`), `refused_pods` other than `off` (its default, `delete-replaced`, included:
/// devplug-lite only says in its log that it cannot) with a device plugin resource,
/// `node_labels.mode` other than `off`, or
/// `--node-events`.
fn needs_cluster(config: &Value, args: &[String]) -> Option<String> {
    // `off` unquoted reads as a YAML 1.1 boolean to some parsers; devplug reads it as the word.
    let refused_pods = config.get("refused_pods");
    let off = refused_pods.and_then(Value::as_str) == Some("off")
        || refused_pods.and_then(Value::as_bool) == Some(false);
    // The kubelet refuses pods only for device plugin resources.
    let device_plugin = config["resources"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| {
            r.get("advertise").is_none()
                && r.get("dra")
                    .is_none_or(|d| d["device_plugin"] == Value::Bool(true))
        });
    if !off && device_plugin {
        return Some("refused_pods".to_owned());
    }
    // Node labels are written through the API server (devplug-lite only says it cannot).
    let mode = &config["node_labels"]["mode"];
    if mode.as_str().is_some_and(|m| m != "off") {
        return Some("node_labels.mode".to_owned());
    }
    let resources = config["resources"].as_array().into_iter().flatten();
    for (i, resource) in resources.enumerate() {
        if let Some(key) = CLUSTER_KEYS.iter().find(|k| resource.get(**k).is_some()) {
            return Some(format!("resources[{i}].{key}"));
        }
    }
    args.iter().find(|a| a.as_str() == "--node-events").cloned()
}

/// A problem if a workload's `command` is not the binary it should run: the full one when
/// `needs` names what needs the API server, else the lean one (less memory).
fn binary_problem(what: &str, command: Option<&[String]>, needs: Option<String>) -> Option<String> {
    let want = if needs.is_some() { FULL } else { LITE };
    if command == Some(&[want.to_owned()][..]) {
        return None;
    }
    Some(match needs {
        Some(field) => {
            format!("{what} runs {command:?}, but {field} needs the API client: command [{FULL:?}]")
        }
        None => format!(
            "{what} runs {command:?}; nothing needs the API client, so command [{LITE:?}] (the \
             device-plugin-only build, less memory)"
        ),
    })
}

/// RBAC and Job checks: every binding names a ClusterRole and ServiceAccounts of the release;
/// every Job runs as one of its accounts and calls `devplug capacity` (or `devplug labels`, where
/// the release writes node labels) with the full binary; the uninstall role grants exactly
/// get/list/watch on nodes and get/patch on nodes/status (and patch on nodes with node labels);
/// the advertise role the same; the node labels' role patch on nodes, limited by its policy.
fn rbac_references(objects: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    let roles: Vec<&ClusterRole> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ClusterRole(r) => Some(r),
            _ => None,
        })
        .collect();
    let accounts: Vec<(&Option<String>, &Option<String>)> = objects
        .iter()
        .filter_map(|o| match o {
            Object::ServiceAccount(s) => Some((&s.metadata.name, &s.metadata.namespace)),
            _ => None,
        })
        .collect();
    // The release writes node labels (direct or for NFD): its uninstall removes them.
    let node_labels_on = objects.iter().any(|o| match o {
        Object::ClusterRole(r) => r
            .metadata
            .name
            .as_deref()
            .is_some_and(|n| n.ends_with("-node-labels")),
        Object::Role(r) => r
            .metadata
            .name
            .as_deref()
            .is_some_and(|n| n.ends_with("-node-labels")),
        _ => false,
    });
    let policies: Vec<&ValidatingAdmissionPolicy> = objects
        .iter()
        .filter_map(|o| match o {
            Object::Policy(p) => Some(&**p),
            _ => None,
        })
        .collect();
    for policy in &policies {
        // The policy restricts the release's own account: its match condition names it.
        let conditions = policy
            .spec
            .as_ref()
            .and_then(|s| s.match_conditions.as_ref())
            .map(|c| c.iter().map(|c| c.expression.clone()).collect::<Vec<_>>())
            .unwrap_or_default();
        let names_ours = accounts.iter().any(|(n, ns)| {
            let user = format!(
                "system:serviceaccount:{}:{}",
                ns.as_deref().unwrap_or(""),
                n.as_deref().unwrap_or("")
            );
            conditions.iter().any(|c| c.contains(&user))
        });
        if !names_ours {
            problems.push(format!(
                "policy {:?} does not match the release's service account: {conditions:?}",
                policy.metadata.name
            ));
        }
    }
    for o in objects {
        match o {
            Object::PolicyBinding(b) => {
                let policy = Some(b.spec.policy_name.as_str());
                if !policies
                    .iter()
                    .any(|p| p.metadata.name.as_deref() == policy)
                {
                    problems.push(format!(
                        "policy binding {:?} refers to policy {policy:?}, which is not in the release",
                        b.metadata.name
                    ));
                }
            }
            Object::ClusterRoleBinding(b) => {
                if b.role_ref.kind != "ClusterRole"
                    || !roles
                        .iter()
                        .any(|r| r.metadata.name.as_deref() == Some(&b.role_ref.name))
                {
                    problems.push(format!(
                        "binding {:?} refers to role {:?}, which is not in the release",
                        b.metadata.name, b.role_ref.name
                    ));
                }
                for s in b.subjects.iter().flatten() {
                    let found = s.kind == "ServiceAccount"
                        && accounts.iter().any(|(n, ns)| {
                            n.as_deref() == Some(&s.name) && ns.as_deref() == s.namespace.as_deref()
                        });
                    if !found {
                        problems.push(format!(
                            "binding {:?} names subject {} {}/{}, which is not in the release",
                            b.metadata.name,
                            s.kind,
                            s.namespace.as_deref().unwrap_or(""),
                            s.name
                        ));
                    }
                }
            }
            Object::ClusterRole(r) => {
                let mut grants: Vec<String> = r
                    .rules
                    .iter()
                    .flatten()
                    .flat_map(|rule| {
                        let groups = rule.api_groups.clone().unwrap_or_default();
                        let resources = rule.resources.clone().unwrap_or_default();
                        let verbs = rule.verbs.clone();
                        groups.into_iter().flat_map(move |g| {
                            let verbs = verbs.clone();
                            resources.clone().into_iter().flat_map(move |res| {
                                let g = g.clone();
                                verbs
                                    .clone()
                                    .into_iter()
                                    .map(move |v| format!("{g}/{res}:{v}"))
                            })
                        })
                    })
                    .collect();
                grants.sort();
                let mut exactly = vec![
                    "/nodes/status:get",
                    "/nodes/status:patch",
                    "/nodes:get",
                    "/nodes:list",
                    "/nodes:watch",
                ];
                let name = r.metadata.name.as_deref().unwrap_or("");
                // The uninstall removes the node labels devplug wrote: patch on nodes too.
                if name.ends_with("uninstall") && node_labels_on {
                    exactly.insert(4, "/nodes:patch");
                }
                if (name.ends_with("uninstall") || name.ends_with("advertise")) && grants != exactly
                {
                    problems.push(format!(
                        "role {name} grants {grants:?}, not exactly {exactly:?}"
                    ));
                }
                // Direct node labels: its own Node, held to its labels by the policy.
                let labels = ["/nodes:get", "/nodes:list", "/nodes:patch", "/nodes:watch"];
                if name.ends_with("-node-labels") {
                    if grants != labels {
                        problems.push(format!(
                            "role {name} grants {grants:?}, not exactly {labels:?}"
                        ));
                    }
                    if !policies
                        .iter()
                        .any(|p| p.metadata.name.as_deref() == Some(name))
                    {
                        problems.push(format!(
                            "role {name} may patch any Node, and no policy {name} limits it"
                        ));
                    }
                }
            }
            Object::Role(r) => {
                let rules: Vec<_> = r.rules.iter().flatten().collect();
                let one = |group: &str, resource: &str, verbs: &[&str]| {
                    rules.len() == 1
                        && rules[0].api_groups.as_deref() == Some(&[group.to_owned()][..])
                        && rules[0].resources.as_deref() == Some(&[resource.to_owned()][..])
                        && rules[0].verbs == verbs
                };
                let name = r.metadata.name.as_deref().unwrap_or("");
                let namespace = r.metadata.namespace.as_deref();
                // NodeFeature objects (node labels for NFD) in the release's namespace: written
                // by the pods, listed and deleted by the uninstall.
                let node_features = namespace == Some("kube-system")
                    && if name.ends_with("-node-labels") {
                        one(
                            "nfd.k8s-sigs.io",
                            "nodefeatures",
                            &["get", "list", "create", "patch", "delete"],
                        )
                    } else {
                        name.ends_with("-uninstall")
                            && one("nfd.k8s-sigs.io", "nodefeatures", &["list", "delete"])
                    };
                let events = namespace == Some("default")
                    && one("events.k8s.io", "events", &["create", "patch"]);
                if !node_features && !events {
                    problems.push(format!(
                        "role {:?} is not exactly create/patch events in default, nor the \
                         NodeFeature access of node labels in the release's namespace",
                        r.metadata.name
                    ));
                }
            }
            Object::RoleBinding(b) => {
                let role_found = objects.iter().any(|o| {
                    matches!(o, Object::Role(r) if r.metadata.name.as_deref() == Some(&b.role_ref.name))
                });
                if !role_found {
                    problems.push(format!(
                        "role binding {:?} names a missing role",
                        b.metadata.name
                    ));
                }
            }
            Object::Job(j) => {
                let spec = j.spec.as_ref().and_then(|s| s.template.spec.as_ref());
                let Some(spec) = spec else {
                    problems.push(format!("job {:?} has no pod spec", j.metadata.name));
                    continue;
                };
                if !accounts
                    .iter()
                    .any(|(n, ns)| n == &&spec.service_account_name && ns == &&j.metadata.namespace)
                {
                    problems.push(format!(
                        "job {:?} runs as {:?}, which is not an account of the release",
                        j.metadata.name, spec.service_account_name
                    ));
                }
                for c in &spec.containers {
                    let args = c.args.as_deref().unwrap_or_default();
                    let command = args.first().map(String::as_str);
                    // `labels remove` only where the release writes node labels.
                    let labels = node_labels_on && command == Some("labels");
                    if command != Some("capacity") && !labels {
                        problems.push(format!(
                            "job {:?} container {} does not run `devplug capacity`: {args:?}",
                            j.metadata.name, c.name
                        ));
                    }
                    problems.extend(binary_problem(
                        &format!("job {:?} container {}", j.metadata.name, c.name),
                        c.command.as_deref(),
                        command.map(str::to_owned),
                    ));
                }
            }
            _ => {}
        }
    }
    problems
}

fn uninstall_dir() -> PathBuf {
    repo_root().join("deploy/kustomize-uninstall")
}

#[test]
fn kustomize_uninstall_is_strictly_valid_and_consistent() {
    let files: Vec<PathBuf> = yaml_files(&uninstall_dir())
        .unwrap()
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect();
    let objects = load_ok(&files);
    let kinds: Vec<&str> = objects
        .iter()
        .map(|o| match o {
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::Job(_) => "Job",
            _ => "other",
        })
        .collect();
    assert_eq!(
        kinds,
        ["Job", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"],
        "{files:?}"
    );
    let problems = rbac_references(&objects);
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    let k = &documents(&uninstall_dir().join("kustomization.yaml")).unwrap()[0];
    let listed: Vec<&str> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    for file in &files {
        let name = file.file_name().unwrap().to_str().unwrap();
        assert!(
            listed.contains(&name),
            "{name} is not in kustomization.yaml"
        );
    }
    // A broken role is caught.
    let wider: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "devplug-uninstall"},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["*"]}],
    }))
    .unwrap();
    assert!(!rbac_references(&[Object::ClusterRole(wider)]).is_empty());
}

#[test]
fn the_wrong_binary_for_the_config_is_caught() {
    let objects = || load_ok(&kustomize_manifests());
    assert!(references(&objects()).is_empty());
    let set = |objects: &mut [Object], f: &dyn Fn(&mut DaemonSet, &mut ConfigMap)| {
        let (mut ds, mut cm) = (None, None);
        for o in objects.iter_mut() {
            match o {
                Object::DaemonSet(d) => ds = Some(d),
                Object::ConfigMap(c) => cm = Some(c),
                _ => {}
            }
        }
        f(ds.unwrap(), cm.unwrap());
    };
    fn container(d: &mut DaemonSet) -> &mut Container {
        &mut d.spec.template.spec.as_mut().unwrap().containers[0]
    }

    // The full binary with nothing that needs it: memory wasted.
    let mut full = objects();
    set(&mut full, &|d, _| {
        container(d).command = Some(vec!["/devplug".into()])
    });
    let problems = references(&full);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("nothing needs the API client")),
        "{problems:?}"
    );

    // The lean binary with an advertise: resource, or with --node-events: it would refuse.
    let mut advertising = objects();
    set(&mut advertising, &|_, c| {
        let data = c.data.as_mut().unwrap();
        let text = data.get_mut("config.yaml").unwrap();
        text.push_str("  - name: example.com/dongle\n    advertise: { count: 4 }\n");
    });
    let problems = references(&advertising);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("resources[1].advertise needs the API client")),
        "{problems:?}"
    );
    let mut dra = objects();
    set(&mut dra, &|_, c| {
        let data = c.data.as_mut().unwrap();
        let text = data.get_mut("config.yaml").unwrap();
        text.push_str("  - name: example.com/gpu\n    dra: { driver: gpu.example.com }\n");
    });
    let problems = references(&dra);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("resources[1].dra needs the API client")),
        "{problems:?}"
    );
    let mut events = objects();
    set(&mut events, &|d, _| {
        container(d)
            .args
            .as_mut()
            .unwrap()
            .push("--node-events".into())
    });
    let problems = references(&events);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("--node-events needs the API client")),
        "{problems:?}"
    );

    // An uninstall Job on the lean binary cannot run `capacity`.
    let mut job_objects = load_ok(
        &yaml_files(&uninstall_dir())
            .unwrap()
            .into_iter()
            .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
            .collect::<Vec<_>>(),
    );
    for o in &mut job_objects {
        if let Object::Job(j) = o {
            let spec = j.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
            spec.containers[0].command = Some(vec!["/devplug-lite".into()]);
        }
    }
    let problems = rbac_references(&job_objects);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("capacity needs the API client")),
        "{problems:?}"
    );
}

#[test]
fn probes_that_miss_the_probe_listener_are_caught() {
    let objects = || load_ok(&kustomize_manifests());
    assert!(references(&objects()).is_empty());
    let problems_after = |change: &dyn Fn(&mut Container)| {
        let mut objects = objects();
        for o in &mut objects {
            if let Object::DaemonSet(d) = o {
                let spec = d.spec.template.spec.as_mut().unwrap();
                change(&mut spec.containers[0]);
            }
        }
        references(&objects)
    };
    let says = |problems: Vec<String>, needle: &str| {
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "no {needle:?} in {problems:?}"
        );
    };
    // The liveness probe back on the metrics port, which any client can fill.
    says(
        problems_after(&|c| {
            let probe = c.liveness_probe.as_mut().unwrap();
            probe.http_get.as_mut().unwrap().port =
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("metrics".into());
        }),
        "the liveness probe goes to port",
    );
    // No probe listener at all.
    says(
        problems_after(&|c| {
            let args = c.args.as_mut().unwrap();
            let i = args.iter().position(|a| a == "--probe-addr").unwrap();
            args.drain(i..i + 2);
        }),
        "no --probe-addr argument",
    );
    // The probe listener on another port than the one the probes name.
    says(
        problems_after(&|c| {
            let args = c.args.as_mut().unwrap();
            let i = args.iter().position(|a| a == "--probe-addr").unwrap();
            args[i + 1] = "[$(POD_IP)]:9999".into();
        }),
        "is not on the container port named \"probes\"",
    );
    // $(POD_IP) without the env var: the kubelet would pass it as written.
    says(
        problems_after(&|c| {
            c.env.as_mut().unwrap().retain(|e| e.name != "POD_IP");
        }),
        "names $(POD_IP), which is not an env var of the container",
    );
}

#[test]
fn a_broken_file_is_reported_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "kind: Pod\nkind: Pod\n").unwrap();
    let err = documents(&file).unwrap_err();
    assert!(matches!(err, CheckError::Yaml { .. }), "{err}");
    assert!(err.to_string().contains("bad.yaml"), "{err}");
}

#[cfg_attr(
    no_helm_rendered,
    ignore = "needs the rendered Helm chart: run .ci/render-helm target/helm-rendered and set DEVPLUG_HELM_RENDERED"
)]
#[test]
fn the_monitoring_release_renders_every_monitoring_object_strictly() {
    // Ignored where the variable is not set; run anyway, it fails.
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let file = Path::new(&dir).join("monitoring.yaml");
    let docs = deploy_check::documents(&file).unwrap();
    let objects = typed_ok("monitoring", &docs);
    let kinds: Vec<&str> = objects
        .iter()
        .filter_map(|o| match o {
            Object::PodMonitor(_) => Some("PodMonitor"),
            Object::ServiceMonitor(_) => Some("ServiceMonitor"),
            Object::Service(_) => Some("Service"),
            Object::PrometheusRule(_) => Some("PrometheusRule"),
            Object::Dashboard(_) => Some("Dashboard"),
            _ => None,
        })
        .collect();
    for kind in [
        "PodMonitor",
        "ServiceMonitor",
        "Service",
        "PrometheusRule",
        "Dashboard",
    ] {
        assert!(kinds.contains(&kind), "no {kind} in {kinds:?}");
    }
    // The checks are strict: a misspelled field, a field in the wrong place or a malformed
    // duration in any of them is refused.
    for doc in &docs {
        let (path, bad) = match doc["kind"].as_str() {
            Some("PodMonitor") => ("/spec/podMetricsEndpoints/0", json!({"intervall": "30s"})),
            Some("ServiceMonitor") => ("/spec/endpoints/0", json!({"interval": "30 s"})),
            Some("PrometheusRule") => ("/spec/groups/0/rules/0", json!({"for": "15"})),
            _ => continue,
        };
        let mut broken = doc.clone();
        let target = broken.pointer_mut(path).unwrap().as_object_mut().unwrap();
        for (k, v) in bad.as_object().unwrap() {
            target.insert(k.clone(), v.clone());
        }
        assert!(typed(&broken).is_err(), "{path}: {bad} accepted");
    }
    // Without monitoring (the demo release), none of them.
    let demo = deploy_check::documents(&Path::new(&dir).join("demo.yaml")).unwrap();
    assert!(
        demo.iter()
            .all(|d| d["apiVersion"] != "monitoring.coreos.com/v1"),
        "monitoring objects by default"
    );
}

/// Copies the folder `from` into `to`, files and folders.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The images of every container of `objects` (DaemonSets' and Jobs').
fn container_images(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .filter_map(|o| o.pointer("/spec/template/spec/containers"))
        .filter_map(Value::as_array)
        .flatten()
        .map(|c| c["image"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The README's and docs/install.md's registry step, run as written on a copy of deploy/, gives
/// the install (overlays/registry) and the clean uninstall (overlays/registry-uninstall) the
/// same image from the registry: the uninstall after the documented install can pull its image.
#[test]
fn the_registry_step_gives_install_and_uninstall_the_same_image() {
    let registry = "registry.test/team";
    for doc in ["README.md", "deploy/README.md", "docs/install.md"] {
        let text = std::fs::read_to_string(repo_root().join(doc)).unwrap();
        let step = text
            .lines()
            .find(|l| l.starts_with("sed -i ") && l.contains("newName"))
            .unwrap_or_else(|| panic!("{doc} shows no `sed -i ... newName` step"));
        let copy = tempfile::tempdir().unwrap();
        for dir in ["kustomize", "kustomize-uninstall", "overlays"] {
            copy_tree(
                &repo_root().join("deploy").join(dir),
                &copy.path().join("deploy").join(dir),
            );
        }
        let ran = std::process::Command::new("sh")
            .arg("-c")
            .arg(step)
            .current_dir(copy.path())
            .env("REGISTRY", registry)
            .output()
            .unwrap();
        assert!(
            ran.status.success(),
            "{doc}: {step}: {}",
            String::from_utf8_lossy(&ran.stderr)
        );
        let want = format!("{registry}/devplug:0.1.0");
        for overlay in ["registry", "registry-uninstall"] {
            let built = kustomize_build(&copy.path().join("deploy/overlays").join(overlay));
            let images = container_images(&built);
            assert!(
                !images.is_empty(),
                "{doc}: overlays/{overlay} has no container"
            );
            assert!(
                images.iter().all(|i| *i == want),
                "{doc}'s step leaves overlays/{overlay} with {images:?}, not {want}"
            );
        }
    }
    // Without the step, the uninstall overlay names the same image as the install one.
    let images = |o: &str| {
        container_images(&kustomize_build(
            &repo_root().join("deploy/overlays").join(o),
        ))
    };
    let install = images("registry");
    assert!(images("registry-uninstall")
        .iter()
        .all(|i| install.contains(i)));
}

/// The uninstall Job removes exactly the device-plugin resources of the base's config, so that
/// nobody edits the names by hand for the config this repository ships.
#[test]
fn the_uninstall_job_removes_the_base_configs_resources() {
    let base = kustomize_build(&kustomize_dir());
    let config = base
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .and_then(|cm| cm["data"]["config.yaml"].as_str())
        .expect("the base has its ConfigMap");
    let config: Value = serde_saphyr::from_str(config).unwrap();
    let mut served: Vec<&str> = config["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r.get("advertise").is_none())
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    served.sort_unstable();
    for dir in uninstall_kustomizations() {
        let built = kustomize_build(&dir);
        let job = built.iter().find(|o| o["kind"] == "Job").expect("a Job");
        let args: Vec<&str> = job["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut named: Vec<&str> = args.iter().copied().filter(|a| a.contains('/')).collect();
        named.sort_unstable();
        assert_eq!(
            named,
            served,
            "{}: the Job's resources vs the base's config",
            dir.display()
        );
        let typed = typed_ok(&dir.display().to_string(), &built);
        let problems = rbac_references(&typed);
        assert!(
            problems.is_empty(),
            "{}:\n{}",
            dir.display(),
            problems.join("\n")
        );
    }
}
