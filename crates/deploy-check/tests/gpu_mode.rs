//! The chart's GPU mode (`gpu.vendor`), on the releases `.ci/render-helm` rendered into
//! `DEVPLUG_HELM_RENDERED`: a GPU release serves its vendor's resource with what that needs.
//! nvidia: the `-gpu` image (glibc binaries that can load NVML), the host's driver root at
//! `/driver-root` with `host_driver_root` naming the same host folder, privileged (NVML opens
//! the device nodes); every GPU release: /dev, /sys and the CDI folder it writes specs into.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use deploy_check::{documents, yaml_files};
use serde_json::Value;
use std::path::Path;

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// The volume's host path mounted at `path` in the devplug container, if any.
fn host_path_at(daemonset: &Value, path: &str) -> Option<String> {
    let spec = &daemonset["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let mount = container["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["mountPath"] == path)?;
    let volume = spec["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])?;
    volume["hostPath"]["path"].as_str().map(str::to_owned)
}

#[cfg_attr(
    no_helm_rendered,
    ignore = "needs the rendered Helm chart: run .ci/render-helm target/helm-rendered and set DEVPLUG_HELM_RENDERED"
)]
#[test]
fn gpu_releases_mount_and_run_what_their_vendor_needs() {
    // Ignored where the variable is not set; run anyway, it fails.
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let mut seen = Vec::new();
    for file in yaml_files(Path::new(&dir)).unwrap() {
        let objects = documents(&file).unwrap();
        let name = file.display().to_string();
        let Some(configmap) = of_kind(&objects, "ConfigMap").into_iter().next() else {
            continue;
        };
        let config: Value =
            serde_saphyr::from_str(configmap["data"]["config.yaml"].as_str().unwrap()).unwrap();
        let resources = config["resources"].as_array().cloned().unwrap_or_default();
        let gpu = resources.iter().find_map(|r| {
            ["nvidia", "amdgpu", "intel_gpu"]
                .into_iter()
                .find(|k| r.get(*k).is_some())
                .map(|k| (k, &r[k]))
        });
        let Some((vendor, settings)) = gpu else {
            continue;
        };
        seen.push(vendor);
        // gpu.vendor puts its resource first, and the chart's default resource is not beside it.
        if resources[0].get(vendor).is_some() {
            assert!(
                resources.iter().all(|r| r["name"] != "dummy.com/npu"),
                "{name}"
            );
            if vendor == "intel_gpu" {
                let driver = settings["driver"].as_str().unwrap_or("i915");
                assert_eq!(
                    resources[0]["name"],
                    format!("gpu.intel.com/{driver}"),
                    "{name}"
                );
            }
        }
        let daemonset = of_kind(&objects, "DaemonSet")[0];
        let container = &daemonset["spec"]["template"]["spec"]["containers"][0];
        let image = container["image"].as_str().unwrap();
        let cdi_dir = settings["cdi_dir"].as_str().unwrap_or("/var/run/cdi");
        assert_eq!(
            host_path_at(daemonset, cdi_dir).as_deref(),
            Some(cdi_dir),
            "{name}: the CDI folder {cdi_dir} is the host's"
        );
        assert_eq!(
            host_path_at(daemonset, "/dev").as_deref(),
            Some("/dev"),
            "{name}"
        );
        assert_eq!(
            host_path_at(daemonset, "/sys").as_deref(),
            Some("/sys"),
            "{name}"
        );
        if vendor == "nvidia" {
            assert!(
                image.ends_with("-gpu"),
                "{name}: nvidia runs the GPU image, not {image}"
            );
            let roots = settings["driver_roots"].as_array().unwrap();
            assert_eq!(roots, &[Value::from("/driver-root")], "{name}");
            assert_eq!(
                host_path_at(daemonset, "/driver-root"),
                settings["host_driver_root"].as_str().map(str::to_owned),
                "{name}: host_driver_root is the host folder mounted at /driver-root"
            );
            // Privileged, or under NVIDIA's runtime (which gives the pod its GPUs).
            let runtime_class = &daemonset["spec"]["template"]["spec"]["runtimeClassName"];
            assert!(
                container["securityContext"]["privileged"] == true || runtime_class.is_string(),
                "{name}: NVML cannot open the GPUs' device nodes"
            );
        } else {
            assert!(
                !image.ends_with("-gpu"),
                "{name}: {vendor} needs no GPU image"
            );
            assert_eq!(container["securityContext"]["privileged"], false, "{name}");
        }
    }
    for vendor in ["nvidia", "amdgpu", "intel_gpu"] {
        assert!(
            seen.contains(&vendor),
            "no rendered release serves {vendor}: {seen:?}"
        );
    }
}

/// The kustomize overlay for NVIDIA nodes: its config's `host_driver_root` is the host folder
/// its DaemonSet patch mounts at `/driver-root`, which is the config's driver root; the GPU image.
#[test]
fn the_nvidia_overlay_mounts_the_driver_root_its_config_names() {
    let dir = deploy_check::repo_root().join("deploy/overlays/nvidia");
    let config_patch = &documents(&dir.join("config-patch.yaml")).unwrap()[0];
    let config: Value =
        serde_saphyr::from_str(config_patch["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let nvidia = &config["resources"][0]["nvidia"];
    let daemonset = &documents(&dir.join("daemonset-patch.yaml")).unwrap()[0];
    assert_eq!(nvidia["driver_roots"], serde_json::json!(["/driver-root"]));
    assert_eq!(
        host_path_at(daemonset, "/driver-root").as_deref(),
        nvidia["host_driver_root"].as_str()
    );
    assert_eq!(
        host_path_at(daemonset, "/var/run/cdi").as_deref(),
        nvidia["cdi_dir"].as_str()
    );
    let kustomization = &documents(&dir.join("kustomization.yaml")).unwrap()[0];
    assert_eq!(kustomization["images"][0]["name"], "devplug");
    assert!(kustomization["images"][0]["newTag"]
        .as_str()
        .unwrap()
        .ends_with("-gpu"));
}

/// Whether `term` (a nodeSelectorTerm of `In` and `Exists` expressions) holds for `labels`.
fn term_matches(term: &Value, labels: &[(&str, &str)]) -> bool {
    term["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|e| {
            let key = e["key"].as_str().unwrap_or("");
            let value = labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
            match e["operator"].as_str() {
                Some("In") => value
                    .is_some_and(|v| e["values"].as_array().into_iter().flatten().any(|w| w == v)),
                Some("Exists") => value.is_some(),
                other => panic!("operator {other:?} not modelled"),
            }
        })
}

/// Whether the DaemonSet's pods may run on a Linux node with `labels`.
fn schedules_on(daemonset: &Value, labels: &[(&str, &str)]) -> bool {
    let spec = &daemonset["spec"]["template"]["spec"];
    let mut all: Vec<(&str, &str)> = vec![("kubernetes.io/os", "linux")];
    all.extend_from_slice(labels);
    let selector_ok = spec["nodeSelector"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| all.iter().any(|(l, w)| l == k && v == w));
    let terms = &spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    let affinity_ok = match terms.as_array() {
        None => true,
        Some(terms) => terms.iter().any(|t| term_matches(t, &all)),
    };
    selector_ok && affinity_ok
}

#[cfg_attr(
    no_helm_rendered,
    ignore = "needs the rendered Helm chart: run .ci/render-helm target/helm-rendered and set DEVPLUG_HELM_RENDERED"
)]
#[test]
fn gpu_releases_schedule_with_node_feature_discovery_or_without_it() {
    // Ignored where the variable is not set; run anyway, it fails.
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let daemonset = |release: &str| {
        let objects = documents(&Path::new(&dir).join(format!("{release}.yaml"))).unwrap();
        of_kind(&objects, "DaemonSet")[0].clone()
    };
    let t = "true";
    let nvidia = daemonset("gpu-nvidia");
    // NFD as NVIDIA's GPU operator configures it, NFD's defaults, GFD's (or a hand-set) label.
    for label in [
        "feature.node.kubernetes.io/pci-10de.present",
        "feature.node.kubernetes.io/pci-0302_10de.present",
        "feature.node.kubernetes.io/pci-0300_10de.present",
        "nvidia.com/gpu.present",
    ] {
        assert!(schedules_on(&nvidia, &[(label, t)]), "{label}");
    }
    assert!(!schedules_on(&nvidia, &[]), "a node without a GPU label");
    assert!(!schedules_on(
        &nvidia,
        &[("nvidia.com/gpu.present", "false")]
    ));
    assert!(!schedules_on(
        &nvidia,
        &[("feature.node.kubernetes.io/amd-gpu", t)]
    ));
    // The operator's own affinity (example.com/pool=gpu) holds as well as one GPU label.
    let amd = daemonset("gpu-amdgpu");
    let pool = ("example.com/pool", "gpu");
    assert!(schedules_on(
        &amd,
        &[pool, ("feature.node.kubernetes.io/amd-gpu", t)]
    ));
    assert!(schedules_on(
        &amd,
        &[
            pool,
            ("feature.node.kubernetes.io/pci-0380_1002.present", t)
        ]
    ));
    assert!(!schedules_on(
        &amd,
        &[("feature.node.kubernetes.io/amd-gpu", t)]
    ));
    assert!(!schedules_on(&amd, &[pool]));
    // gpu.nodeSelector replaces the vendor's labels.
    let intel = daemonset("gpu-intel");
    assert!(schedules_on(&intel, &[("example.com/gpu", "intel")]));
    assert!(!schedules_on(
        &intel,
        &[("intel.feature.node.kubernetes.io/gpu", t)]
    ));
}
