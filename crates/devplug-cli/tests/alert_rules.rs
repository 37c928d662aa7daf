//! The chart's alerts against devplug's real metrics: `devplug run` on the kubelet simulator
//! and a real API server (with the pod resources API) serves a device plugin resource, a
//! resource with unhealthy devices and a DRA driver whose prepare fails; its `/metrics` is
//! scraped, and
//!
//! - every metric the chart's PrometheusRule and Grafana dashboard read is in the scrape;
//! - every input series of the promtool tests (deploy/helm/devplug/ci/alert-rules-test.yaml)
//!   is a series of the scrape (name and labels, less those Prometheus adds);
//! - every alert has a test in which it fires;
//! - `promtool test rules` passes over the PrometheusRule as `.ci/render-helm` rendered it
//!   (release "monitoring"), not a copy.
//!
//! So a metric renamed or relabelled in devplug, or an alert that stops firing, fails here.
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use kubelet_sim::Kubelet;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::cluster::cluster_with_node;
use support::Devplug;

/// Labels Prometheus adds to a scraped series (target labels and the PodMonitor's relabeling).
const TARGET_LABELS: [&str; 7] = [
    "namespace",
    "pod",
    "node",
    "job",
    "instance",
    "container",
    "endpoint",
];

const DRIVER: &str = "npu.alerts.example.com";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A series: its metric name and labels.
type Series = (String, BTreeMap<String, String>);

/// Parses `name{a="b",c="d"}` (a label value may hold escaped quotes, backslashes and
/// newlines) and returns it with the rest of the line.
fn parse_series(text: &str) -> Result<(Series, &str), String> {
    let text = text.trim_start();
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(text.len());
    let name = text[..end].to_owned();
    if name.is_empty() {
        return Err(format!("no metric name in {text:?}"));
    }
    let mut rest = &text[end..];
    let mut labels = BTreeMap::new();
    if let Some(inner) = rest.strip_prefix('{') {
        rest = inner;
        loop {
            rest = rest.trim_start_matches([' ', ',']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = rest.find('=').ok_or(format!("no = in {text:?}"))?;
            let key = rest[..eq].trim().to_owned();
            rest = rest[eq + 1..]
                .trim_start()
                .strip_prefix('"')
                .ok_or(format!("unquoted value in {text:?}"))?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let close = loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err(format!("unterminated value in {text:?}")),
                    },
                    Some((i, '"')) => break i,
                    Some((_, c)) => value.push(c),
                    None => return Err(format!("unterminated value in {text:?}")),
                }
            };
            rest = &rest[close + 1..];
            labels.insert(key, value);
        }
    }
    Ok(((name, labels), rest))
}

/// The series of a Prometheus text exposition.
fn scraped_series(exposition: &str) -> BTreeSet<Series> {
    exposition
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| parse_series(l).unwrap().0)
        .collect()
}

/// The `devplug_*` metric names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("devplug_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// The release "monitoring" as `.ci/render-helm` rendered it.
fn rendered_monitoring() -> Vec<Value> {
    let dir = std::env::var_os("DEVPLUG_HELM_RENDERED")
        .expect("DEVPLUG_HELM_RENDERED names the rendered chart");
    let path = Path::new(&dir).join("monitoring.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap()
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// Scrapes a devplug serving a device plugin resource, a resource with unhealthy devices,
/// and a DRA driver that was asked to prepare a claim the API server does not have.
async fn scrape_real_devplug() -> Option<String> {
    let (server, _client, _nodes) =
        cluster_with_node("alert_rules_hold_over_a_real_scrape", "alerts-node").await?;
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let config = kubelet_sim::SimConfig {
        watcher_reconcile: Duration::from_millis(50),
        ..kubelet_sim::SimConfig::default()
    }
    .with_watcher_beside(&plugins)
    .with_pod_resources_beside(&plugins);
    let kubelet = Kubelet::start_with(&plugins, config).await.unwrap();
    let pod_resources = kubelet.pod_resources_socket().unwrap().to_owned();
    let colas = dir.path().join("colas");
    std::fs::create_dir_all(&colas).unwrap();
    std::fs::write(colas.join("cola-1"), "bubbles gone flat\n").unwrap();
    std::fs::write(colas.join("cola-2"), "bubbles gone flat\n").unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "node_labels: {{ mode: direct }}\nresources:\n  - name: example.com/npu\n    virtual: {{ count: 2 }}\n  \
             - name: example.com/cola\n    files: {{ dir: {} }}\n  \
             - name: example.com/dra-npu\n    virtual: {{ count: 2 }}\n    dra: {{ driver: {DRIVER} }}\n",
            colas.display()
        ),
    )
    .unwrap();
    let port = support::free_port();
    let devplug = Devplug::run_with(
        &config,
        &plugins,
        &[
            "--node-name",
            "alerts-node",
            "--kubeconfig",
            server.kubeconfig.to_str().unwrap(),
            "--cdi-dir",
            dir.path().join("cdi").to_str().unwrap(),
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--pod-resources-socket",
            pod_resources.to_str().unwrap(),
        ],
    );
    kubelet
        .wait_for(Duration::from_secs(20), |node| {
            (!node.dra_driver(DRIVER).is_empty()
                && node.capacity("example.com/npu").0 == 2
                && node.capacity("example.com/cola").0 == 2)
                .then_some(())
        })
        .await
        .unwrap();
    let missing = kubelet_sim::DraClaim::new("default", "gone", "uid-gone");
    let answer = kubelet
        .dra_prepare(DRIVER, std::slice::from_ref(&missing))
        .await
        .unwrap();
    assert!(answer["uid-gone"].is_err(), "{answer:?}");
    // The slices published and the driver registered: every family has its series.
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = support::http_get(port, "/metrics").await.unwrap().1;
        if metrics.contains(&format!("devplug_dra_registered{{driver=\"{DRIVER}\"}} 1"))
            && metrics.contains("devplug_foreign_devices{resource=\"example.com/npu\"} 0")
            && metrics.contains("devplug_cluster_policy_in_force{feature=\"node_labels\"}")
            && metrics.contains("devplug_cluster_policy_in_force{feature=\"refused_pods\"}")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
    Some(metrics)
}

#[cfg_attr(
    any(no_api_server, no_helm_rendered, no_promtool),
    ignore = "needs an API server (KUBEBUILDER_ASSETS), the rendered Helm chart (.ci/render-helm, DEVPLUG_HELM_RENDERED) and promtool (DEVPLUG_PROMTOOL): docs/testing.md"
)]
#[tokio::test]
async fn alert_rules_hold_over_a_real_scrape() {
    let Some(metrics) = scrape_real_devplug().await else {
        return;
    };
    let scraped = scraped_series(&metrics);
    let names: BTreeSet<&str> = scraped.iter().map(|(n, _)| n.as_str()).collect();

    let release = rendered_monitoring();
    let rule = release
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .expect("the monitoring release has a PrometheusRule");
    let dashboard = release
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["data"].get("devplug.json").is_some())
        .expect("the monitoring release has the dashboard");
    let dashboard: Value =
        serde_json::from_str(dashboard["data"]["devplug.json"].as_str().unwrap()).unwrap();

    // What the rules and the dashboard read, devplug exports.
    let mut read: Vec<(String, String)> = Vec::new();
    let alerts: Vec<String> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .map(|r| {
            let alert = r["alert"].as_str().unwrap().to_owned();
            read.push((alert.clone(), r["expr"].as_str().unwrap().to_owned()));
            alert
        })
        .collect();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            read.push((
                format!("dashboard panel {}", panel["title"]),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    for (what, expr) in &read {
        let used = metric_names(expr);
        assert!(!used.is_empty(), "{what}: no devplug metric in {expr}");
        for name in used {
            assert!(
                names.contains(name.as_str()),
                "{what} reads {name}, which devplug does not export:\n{metrics}"
            );
        }
    }

    // The promtool tests' input series are real series, and each alert fires in one.
    let tests_path = repo().join("deploy/helm/devplug/ci/alert-rules-test.yaml");
    let tests_text = std::fs::read_to_string(&tests_path).unwrap();
    let tests: Value = serde_saphyr::from_str(&tests_text).unwrap();
    let mut fired = BTreeSet::new();
    for test in tests["tests"].as_array().unwrap() {
        for input in test["input_series"].as_array().unwrap() {
            let text = input["series"].as_str().unwrap();
            let ((name, mut labels), _) = parse_series(text).unwrap();
            for added in TARGET_LABELS {
                labels.remove(added);
            }
            assert!(
                scraped.contains(&(name.clone(), labels.clone())),
                "input series {text} is not a series devplug exports ({name} {labels:?}):\n{metrics}"
            );
        }
        for check in test["alert_rule_test"].as_array().unwrap() {
            if check["exp_alerts"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
            {
                fired.insert(check["alertname"].as_str().unwrap().to_owned());
            }
        }
    }
    for alert in &alerts {
        assert!(
            fired.contains(alert),
            "alert {alert} fires in no test of {}",
            tests_path.display()
        );
    }

    // promtool over the rendered rules.
    let work = tempfile::tempdir().unwrap();
    std::fs::write(
        work.path().join("rules.yaml"),
        serde_json::to_string_pretty(&rule["spec"]).unwrap(),
    )
    .unwrap();
    let tests_copy = work.path().join("alert-rules-test.yaml");
    std::fs::write(&tests_copy, &tests_text).unwrap();
    let promtool = std::env::var_os("DEVPLUG_PROMTOOL").expect("DEVPLUG_PROMTOOL names promtool");
    for args in [
        vec![
            "check".into(),
            "rules".into(),
            work.path().join("rules.yaml"),
        ],
        vec!["test".into(), "rules".into(), tests_copy.clone()],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(&args)
            .output()
            .expect("promtool runs");
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn series_are_parsed_with_escaped_values() {
    let ((name, labels), rest) =
        parse_series(r#"devplug_device_unhealthy{resource="a",reason="say \"hi\", \\ ok"} 1"#)
            .unwrap();
    assert_eq!(name, "devplug_device_unhealthy");
    assert_eq!(labels["reason"], r#"say "hi", \ ok"#);
    assert_eq!(rest.trim(), "1");
    assert_eq!(
        metric_names("rate(devplug_allocate_total[5m]) / devplug_x"),
        BTreeSet::from(["devplug_allocate_total".into(), "devplug_x".into()])
    );
}
