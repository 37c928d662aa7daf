//! The devplug config shipped in `deploy/` is one `devplug` accepts: the kustomize ConfigMap's
//! `config.yaml`, the Helm chart's default `config:` values, and (when `DEVPLUG_HELM_RENDERED`
//! names a folder of rendered releases, as `.ci/run` sets it) every rendered ConfigMap. Each is
//! checked by the real binary's `check-config`. The manifests' Kubernetes types are checked in
//! `crates/deploy-check`.
//!
//! Built without the `cluster` feature (`cargo test -p devplug-cli --no-default-features --test
//! deploy_config`, as .ci/run does), the binary under test is devplug-lite, and each config is
//! checked by it where the manifests run `/devplug-lite`: the lean build accepts every config it
//! is deployed with.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_devplug");
/// Whether the binary under test is devplug-lite.
const LITE: bool = cfg!(not(feature = "cluster"));

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `config.yaml` of every ConfigMap in `path` but the chart's Grafana dashboard.
fn embedded_configs(path: &Path) -> Vec<String> {
    yaml_documents(path)
        .iter()
        .filter(|d| d["kind"] == "ConfigMap" && d["data"].get("devplug.json").is_none())
        .map(|d| {
            d["data"]["config.yaml"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: a ConfigMap without config.yaml", path.display()))
                .to_owned()
        })
        .collect()
}

/// Runs `devplug check-config` on `text`; panics with its message unless it is accepted.
fn accepted(origin: &str, text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, text).unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{origin}: devplug rejects the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(": ok: "));
}

#[test]
fn the_kustomize_config_map_holds_a_valid_config() {
    let path = repo().join("deploy/kustomize/configmap.yaml");
    let configs = embedded_configs(&path);
    assert_eq!(configs.len(), 1);
    accepted("deploy/kustomize/configmap.yaml", &configs[0]);
}

/// The DRA examples' configs: the full build (which a `dra:` resource is deployed with)
/// accepts each; devplug-lite refuses each, naming the `dra` setting.
#[test]
fn the_dra_examples_configs_are_valid() {
    let dir = repo().join("deploy/examples/dra");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path().join("config.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        if LITE {
            let out = Command::new(BIN)
                .args(["check-config", "--config", path.to_str().unwrap()])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains(".dra: needs the Kubernetes API client"),
                "{}: devplug-lite should refuse it: {err}",
                path.display()
            );
        } else {
            accepted(&path.display().to_string(), &text);
        }
        checked += 1;
    }
    assert!(checked >= 3, "{checked} examples");
}

#[test]
fn the_kustomize_overlays_configs_are_valid() {
    let path = repo().join("deploy/overlays/nvidia/config-patch.yaml");
    let configs = embedded_configs(&path);
    assert_eq!(configs.len(), 1);
    accepted("deploy/overlays/nvidia/config-patch.yaml", &configs[0]);
}

#[test]
fn the_helm_demo_values_hold_a_valid_config_and_the_defaults_none() {
    let values = yaml_documents(&repo().join("deploy/helm/devplug/examples/demo-values.yaml"));
    let config = &values[0]["config"];
    assert!(config.is_object(), "demo-values.yaml has no config: block");
    // The chart renders it with toYaml; JSON is YAML too, and the loader reads it the same.
    accepted(
        "deploy/helm/devplug/examples/demo-values.yaml config:",
        &serde_json::to_string_pretty(config).unwrap(),
    );
    // The defaults serve nothing: the chart refuses to render them (.ci/render_helm.py checks).
    let defaults = yaml_documents(&repo().join("deploy/helm/devplug/values.yaml"));
    assert_eq!(
        defaults[0]["config"]["resources"],
        serde_json::json!([]),
        "values.yaml names resources"
    );
}

#[cfg_attr(
    no_helm_rendered,
    ignore = "needs the rendered Helm chart: run .ci/render-helm target/helm-rendered and set DEVPLUG_HELM_RENDERED"
)]
#[test]
fn rendered_helm_config_maps_hold_valid_configs() {
    // Ignored where the variable is not set; run anyway, it fails.
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let runs_lite = yaml_documents(&path).iter().any(|d| {
                d["kind"] == "DaemonSet"
                    && d["spec"]["template"]["spec"]["containers"][0]["command"][0]
                        == "/devplug-lite"
            });
            if LITE && !runs_lite {
                // Deployed with the full /devplug: checked by the full build.
                continue;
            }
            for config in embedded_configs(&path) {
                accepted(&path.display().to_string(), &config);
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no rendered ConfigMap in {dir:?}");
}

#[test]
fn check_config_reports_a_bad_file_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        "resources:\n  - name: example.com/npu\n    virtual: { count: 0 }\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config", file.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr
            .contains("bad.yaml: resources[0] (example.com/npu): virtual.count: must be between 1"),
        "{stderr}"
    );
}
