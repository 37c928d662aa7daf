//! `devplug run --metrics-addr`: readiness follows registration, metrics move with traffic;
//! `--probe-addr` answers the probes whatever clients of the metrics port do.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use kubelet_sim::Kubelet;
use std::time::{Duration, Instant};
use support::{free_port, http_get, Devplug};

const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "example.com/npu";

/// Polls `path` until it answers `code`.
async fn until(port: u16, path: &str, code: u16) -> String {
    let start = Instant::now();
    loop {
        if let Some((got, body)) = http_get(port, path).await {
            if got == code {
                return body;
            }
        }
        assert!(start.elapsed() < WAIT, "{path} never answered {code}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in\n{text}"))
}

#[tokio::test]
async fn readiness_follows_registration_and_metrics_move() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    let config = tmp.path().join("config.yaml");
    let colas = tmp.path().join("colas");
    std::fs::create_dir(&colas).unwrap();
    std::fs::write(colas.join("cola-1"), "").unwrap();
    let text = format!(
        "resources:\n  - name: {RESOURCE}\n    virtual: {{ count: 4 }}\n  - name: example.com/cola\n    files: {{ dir: {} }}\n",
        colas.display()
    );
    std::fs::write(&config, text).unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let devplug = Devplug::run_with(&config, &plugins, &["--metrics-addr", &addr]);

    // No kubelet yet: alive, not ready.
    until(port, "/healthz", 200).await;
    let body = until(port, "/readyz", 503).await;
    assert!(
        body.contains(&format!("{RESOURCE}: not registered with a kubelet yet")),
        "{body}"
    );
    assert!(
        body.contains("the kubelet folder") && body.contains("does not exist"),
        "{body}"
    );

    let kubelet = Kubelet::start(&plugins).await.unwrap();
    until(port, "/readyz", 200).await;
    // Ready means devplug sent its list; the kubelet takes it in on its own time.
    kubelet
        .wait_for(Duration::from_secs(10), |node| {
            (node.capacity(RESOURCE).1 >= 2).then_some(())
        })
        .await
        .unwrap();
    kubelet.allocate("pod", "main", RESOURCE, 2).await.unwrap();
    let text = until(port, "/metrics", 200).await;
    let r = format!("{{resource=\"{RESOURCE}\"}}");
    assert_eq!(metric(&text, &format!("devplug_allocate_total{r}")), 1.0);
    assert_eq!(
        metric(
            &text,
            &format!("devplug_allocate_duration_seconds_count{r}")
        ),
        1.0
    );
    assert_eq!(
        metric(&text, &format!("devplug_registrations_total{r}")),
        1.0
    );
    assert!(metric(&text, &format!("devplug_list_updates_total{r}")) >= 1.0);
    assert_eq!(
        metric(
            &text,
            &format!("devplug_devices{{resource=\"{RESOURCE}\",health=\"healthy\"}}")
        ),
        4.0
    );

    // An unhealthy device's reason shows in the metrics (the kubelet only sees "Unhealthy").
    std::fs::write(colas.join("cola-1"), "fan failure\n").unwrap();
    let unhealthy = "devplug_device_unhealthy{resource=\"example.com/cola\",device=\"cola-1\",reason=\"fan failure\"} 1";
    let start = Instant::now();
    while !until(port, "/metrics", 200)
        .await
        .lines()
        .any(|l| l == unhealthy)
    {
        assert!(start.elapsed() < WAIT, "no {unhealthy}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The kubelet goes away: not ready. A new kubelet: registered again, ready again.
    kubelet.stop().await;
    until(port, "/readyz", 503).await;
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    until(port, "/readyz", 200).await;
    let text = until(port, "/metrics", 200).await;
    assert_eq!(
        metric(&text, &format!("devplug_registrations_total{r}")),
        2.0
    );
    assert_eq!(
        metric(&text, &format!("devplug_kubelet_restarts_total{r}")),
        1.0
    );
    drop(kubelet);

    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(log.contains("metrics and probes listening"), "{log}");
}

#[tokio::test]
async fn metrics_addr_takes_a_bare_port_as_kubernetes_components_do() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    let config = tmp.path().join("config.yaml");
    std::fs::write(
        &config,
        format!("resources:\n  - name: {RESOURCE}\n    virtual: {{ count: 1 }}\n"),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // `:PORT` is every IPv4 interface, so the loopback address answers.
    let devplug = Devplug::run_with(&config, &plugins, &["--metrics-addr", &format!(":{port}")]);
    until(port, "/healthz", 200).await;
    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(log.contains(&format!("0.0.0.0:{port}")), "{log}");
}

/// A client holding twice the metrics port's connection budget open and silent keeps neither
/// the probe port nor the metrics port's own `/healthz` from answering; the probe port serves
/// the probes alone.
#[tokio::test]
async fn probes_answer_while_idle_connections_hold_the_metrics_port() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    let config = tmp.path().join("config.yaml");
    std::fs::write(
        &config,
        format!("resources:\n  - name: {RESOURCE}\n    virtual: {{ count: 1 }}\n"),
    )
    .unwrap();
    let metrics = free_port();
    let probes = loop {
        let port = free_port();
        if port != metrics {
            break port;
        }
    };
    let devplug = Devplug::run_with(
        &config,
        &plugins,
        &[
            "--metrics-addr",
            &format!("127.0.0.1:{metrics}"),
            "--probe-addr",
            &format!("127.0.0.1:{probes}"),
        ],
    );
    until(probes, "/healthz", 200).await;
    until(metrics, "/healthz", 200).await;

    let mut idle = Vec::new();
    for _ in 0..64 {
        idle.push(
            tokio::net::TcpStream::connect(("127.0.0.1", metrics))
                .await
                .unwrap(),
        );
    }
    // No kubelet: alive (200), not ready (503); each answered, not left waiting.
    for (port, path, code) in [
        (probes, "/healthz", 200),
        (probes, "/readyz", 503),
        (metrics, "/healthz", 200),
        (probes, "/metrics", 404),
    ] {
        let got = tokio::time::timeout(Duration::from_secs(5), http_get(port, path))
            .await
            .unwrap_or_else(|_| panic!("{path} on port {port}: no answer within 5 s"));
        let (status, body) = got.unwrap_or_else(|| panic!("{path} on port {port}: no answer"));
        assert_eq!(status, code, "{path} on port {port}: {body}");
    }
    drop(idle);

    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(
        log.contains("probes listening") && log.contains(&format!("127.0.0.1:{probes}")),
        "{log}"
    );
}

/// The nvidia backend in the real binary: NVML missing keeps the process up, serving its other
/// resources, with /readyz 503 and the reason; the library appearing (the fake NVML, with
/// /dev/nvidiactl made) makes it ready; an injected XID shows in the metrics with its reason.
#[tokio::test]
async fn nvidia_not_ready_until_the_driver_appears_and_xid_reasons_in_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    let lib_dir = tmp.path().join("driver/usr/lib64");
    let dev = tmp.path().join("dev");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::create_dir_all(&dev).unwrap();
    let topology = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fake-nvml/topologies/pcie-4gpu.yaml");
    std::fs::copy(&topology, lib_dir.join("fake-nvml.yaml")).unwrap();
    let config = tmp.path().join("config.yaml");
    let text = format!(
        "resources:\n  - name: {RESOURCE}\n    virtual: {{ count: 2 }}\n  - name: nvidia.com/gpu\n    health_hold_down: 0s\n    nvidia: {{ library: {}, dev_root: {}, sys_root: {}, cdi_dir: {} }}\n",
        lib_dir.join("libnvidia-ml.so.1").display(),
        dev.display(),
        tmp.path().join("sys").display(),
        tmp.path().join("cdi").display(),
    );
    std::fs::write(&config, text).unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let kubelet = Kubelet::start(&plugins).await.unwrap();
    let devplug = Devplug::run_with(&config, &plugins, &["--metrics-addr", &addr]);

    // The virtual resource is served; nvidia registers with nothing and holds readiness.
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (2, 2)).then_some(()))
        .await
        .unwrap();
    let start = Instant::now();
    let body = loop {
        let body = until(port, "/readyz", 503).await;
        if body.contains("NVML not available") || start.elapsed() > WAIT {
            break body;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        body.contains("nvidia.com/gpu: NVML not available"),
        "{body}"
    );

    // The driver arrives.
    let exe = std::env::current_exe().unwrap();
    let fake = exe.parent().unwrap().join("libfake_nvml.so");
    // Installed as package managers do (a half-written library must not be dlopened).
    std::fs::copy(&fake, lib_dir.join(".libnvidia-ml.so.1.new")).unwrap();
    std::fs::rename(
        lib_dir.join(".libnvidia-ml.so.1.new"),
        lib_dir.join("libnvidia-ml.so.1"),
    )
    .unwrap();
    std::fs::write(dev.join("nvidiactl"), "").unwrap();
    if kubelet
        .wait_for(WAIT, |n| {
            (n.capacity("nvidia.com/gpu") == (4, 4)).then_some(())
        })
        .await
        .is_err()
    {
        let (_, log) = devplug.terminate(WAIT).await;
        panic!("the GPUs never came: {log}");
    }
    until(port, "/readyz", 200).await;

    // An XID: the kubelet sees one fewer, the metrics say why.
    let control = lib_dir.join("pcie-4gpu.control");
    std::fs::write(&control, "xid 2 79 1\n").unwrap();
    kubelet
        .wait_for(WAIT, |n| {
            (n.capacity("nvidia.com/gpu") == (4, 3)).then_some(())
        })
        .await
        .unwrap();
    let text = until(port, "/metrics", 200).await;
    assert!(
        text.contains(
            "reason=\"xid 79: GPU has fallen off the bus (recovery action GPU_RESET)\"} 1"
        ),
        "{text}"
    );
    drop(kubelet);
    let (status, log) = devplug.terminate(WAIT).await;
    assert!(status.success(), "{log}");
    assert!(log.contains("NVML loaded"), "{log}");
}

/// `registration: watcher` with no `plugins_registry/` yet: `/readyz` names the folder, as it
/// names a missing kubelet folder.
#[tokio::test]
async fn readyz_names_a_missing_plugin_watcher_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let config = tmp.path().join("config.yaml");
    std::fs::write(
        &config,
        format!("registration: watcher\nresources:\n  - name: {RESOURCE}\n    virtual: {{ count: 2 }}\n"),
    )
    .unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let devplug = Devplug::run_with(&config, &plugins, &["--metrics-addr", &addr]);
    let body = until(port, "/readyz", 503).await;
    let registry = tmp.path().join("plugins_registry");
    assert!(
        body.contains(&format!(
            "the plugin watcher's folder {} does not exist",
            registry.display()
        )),
        "{body}"
    );
    let (status, log) = devplug.terminate(Duration::from_secs(10)).await;
    assert!(status.success(), "{log}");
}
