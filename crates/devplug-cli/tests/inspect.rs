//! `devplug inspect`, the real binary, against real sockets in temp folders: our own plugin
//! (a `devplug::Host` with the virtual backend, registered with the kubelet simulator), a
//! third-party-style plugin (`kubelet_sim::fake_plugin`), the kubelet's own socket, and broken
//! sockets. Text and JSON output are compared as exact snapshots after redacting temp paths.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::{Health, Host};
use devplug_backends::{VirtualBackend, VirtualSettings};
use devplug_proto::v1beta1 as pb;
use kubelet_sim::fake_plugin::{FakeDevice, FakePlugin, FakeSpec};
use kubelet_sim::Kubelet;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

const BIN: &str = env!("CARGO_BIN_EXE_devplug");
const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "example.com/npu";
const VENDOR: &str = "vendor.example/gpu";

/// A kubelet simulator in a temp folder with our virtual plugin registered: 4 devices over 2
/// NUMA nodes, `npu-3` unhealthy.
struct Ours {
    dir: tempfile::TempDir,
    kubelet: Kubelet,
    host: Host,
    backend: Arc<VirtualBackend>,
    socket: PathBuf,
}

async fn ours() -> Ours {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(dir.path()).await.unwrap();
    let settings = VirtualSettings {
        env: "DUMMY_VISIBLE_DEVICES".into(),
        id_prefix: "npu-".into(),
        numa_nodes: 2,
        ..VirtualSettings::new(4)
    };
    let backend = Arc::new(VirtualBackend::new(&settings).unwrap());
    backend.set_health("npu-3", Health::unhealthy("test"));
    let host = Host::new(dir.path()).unwrap();
    let mut status = host.add_shared(RESOURCE, backend.clone()).unwrap();
    let ready = tokio::time::timeout(WAIT, status.wait_for(|s| s.is_ready()))
        .await
        .expect("our plugin registers")
        .unwrap()
        .clone();
    Ours {
        socket: ready.socket.unwrap(),
        dir,
        kubelet,
        host,
        backend,
    }
}

/// The fake vendor plugin's spec: odd health strings, every kind of container edit.
fn vendor_spec() -> FakeSpec {
    let mut degraded = FakeDevice::healthy("gpu-2").numa(0).numa(1);
    degraded.health = "Degraded".into();
    FakeSpec {
        devices: vec![
            FakeDevice::healthy("gpu-0").numa(0),
            FakeDevice::healthy("gpu-1"),
            degraded,
            FakeDevice::unhealthy("gpu-3").numa(1),
        ],
        options: pb::DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: true,
        },
        edits: pb::ContainerAllocateResponse {
            envs: [("VENDOR_DRIVER".to_owned(), "535".to_owned())].into(),
            mounts: vec![
                pb::Mount {
                    container_path: "/usr/lib/vendor".into(),
                    host_path: "/opt/vendor/lib".into(),
                    read_only: true,
                },
                pb::Mount {
                    container_path: "/var/cache/vendor".into(),
                    host_path: "/var/lib/vendor/cache".into(),
                    read_only: false,
                },
            ],
            devices: vec![pb::DeviceSpec {
                container_path: "/dev/vendorctl".into(),
                host_path: "/dev/vendorctl0".into(),
                permissions: "rw".into(),
            }],
            annotations: [("vendor.example/slot".to_owned(), "3".to_owned())].into(),
            cdi_devices: vec![pb::CdiDevice {
                name: "vendor.example/gpu=all".into(),
            }],
        },
        ids_env: Some("VENDOR_VISIBLE_DEVICES".into()),
    }
}

/// The binary, blind to any pod resources socket the machine has at the default path (a node's
/// kubelet, or one a killed test left behind): tests that want one name it with the flag.
fn bin() -> Command {
    let mut command = Command::new(BIN);
    command.env(
        "DEVPLUG_POD_RESOURCES_SOCKET",
        "/nonexistent/devplug-inspect-test/kubelet.sock",
    );
    command
}

/// Runs the binary off the async threads (the plugins under test are served in this process).
async fn devplug(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || bin().args(&args).output().unwrap())
        .await
        .unwrap()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Stdout of a successful run, with `replace` pairs applied (temp paths → placeholders).
fn stdout_ok(out: &Output, replace: &[(&str, &str)]) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    redact(stdout, replace)
}

fn redact(mut text: String, replace: &[(&str, &str)]) -> String {
    for (from, to) in replace {
        text = text.replace(from, to);
    }
    text
}

/// The one-line error of a failed run (exit 1).
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
    stderr.trim_end().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_and_json_of_our_plugin() {
    let o = ours().await;
    let socket = path(&o.socket);
    let out = devplug(&["inspect", "--socket", socket]).await;
    assert_eq!(
        stdout_ok(&out, &[(socket, "<socket>")]),
        "\
socket   <socket>
options  pre_start_required=false get_preferred_allocation_available=false
devices  4 devices (Healthy 3, Unhealthy 1)

ID     HEALTH     NUMA
npu-0  Healthy    0
npu-1  Healthy    1
npu-2  Healthy    0
npu-3  Unhealthy  1
"
    );

    let out = devplug(&["inspect", "--socket", socket, "--json"]).await;
    assert_eq!(
        stdout_ok(&out, &[(socket, "<socket>")]),
        r#"{
  "socket": "<socket>",
  "options": {
    "pre_start_required": false,
    "get_preferred_allocation_available": false
  },
  "devices": [
    {
      "id": "npu-0",
      "health": "Healthy",
      "numa_nodes": [
        0
      ]
    },
    {
      "id": "npu-1",
      "health": "Healthy",
      "numa_nodes": [
        1
      ]
    },
    {
      "id": "npu-2",
      "health": "Healthy",
      "numa_nodes": [
        0
      ]
    },
    {
      "id": "npu-3",
      "health": "Unhealthy",
      "numa_nodes": [
        1
      ]
    }
  ],
  "counts": {
    "total": 4,
    "healthy": 3,
    "unhealthy": 1,
    "by_health": {
      "Healthy": 3,
      "Unhealthy": 1
    }
  }
}
"#
    );
    // Inspecting opened and closed extra streams; the kubelet's view is unchanged.
    assert_eq!(o.kubelet.read(|n| n.capacity(RESOURCE)), (4, 3));
    assert_eq!(o.kubelet.read(|n| n.registration_count(RESOURCE)), 1);
    o.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_prints_edits_and_unknown_ids_fail_in_one_line() {
    let o = ours().await;
    let socket = path(&o.socket);
    let out = devplug(&["inspect", "-s", socket, "--allocate", "npu-1,npu-2"]).await;
    assert_eq!(
        stdout_ok(&out, &[(socket, "<socket>")]),
        "\
Allocate npu-1,npu-2 on <socket>: 1 container response
env:
  DUMMY_VISIBLE_DEVICES=npu-1,npu-2
device nodes (host -> container, permissions):
  (none)
mounts (host -> container):
  (none)
annotations:
  (none)
CDI devices:
  (none)
"
    );

    let out = devplug(&["inspect", "-s", socket, "--allocate", "npu-0,nope"]).await;
    assert_eq!(
        error_line(&out),
        "error: Allocate failed: InvalidArgument: example.com/npu: cannot allocate: unknown device ids [\"nope\"]"
    );

    let out = devplug(&["inspect", "-s", socket, "--allocate", "npu-0", "--json"]).await;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        value["container_responses"][0]["envs"]["DUMMY_VISIBLE_DEVICES"],
        "npu-0"
    );
    o.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_reports_the_choice_even_when_not_offered() {
    let o = ours().await;
    let socket = path(&o.socket);
    let out = devplug(&["inspect", "-s", socket, "--preferred", "2"]).await;
    assert_eq!(
        stdout_ok(&out, &[(socket, "<socket>")]),
        "\
note: the plugin's options say GetPreferredAllocation is not available (the kubelet would not call it); asked anyway
GetPreferredAllocation of 2 from 3 healthy devices on <socket>: npu-0,npu-1
"
    );
    let out = devplug(&["inspect", "-s", socket, "--preferred", "2", "--json"]).await;
    assert_eq!(
        stdout_ok(&out, &[(socket, "<socket>")]),
        r#"{
  "socket": "<socket>",
  "get_preferred_allocation_available": false,
  "available": [
    "npu-0",
    "npu-1",
    "npu-2"
  ],
  "size": 2,
  "chosen": [
    "npu-0",
    "npu-1"
  ]
}
"#
    );
    o.host.shutdown().await;
}

/// Reads a child's stdout lines on a thread, so the test can wait for each with a timeout.
fn lines_of(child: &mut Child) -> mpsc::UnboundedReceiver<String> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

async fn next_line(lines: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(WAIT, lines.recv())
        .await
        .expect("a line from devplug inspect --watch")
        .expect("devplug inspect --watch ended early")
}

async fn wait_exit(child: Child) -> Output {
    tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_json_sees_a_health_change_and_the_end_of_the_stream() {
    let o = ours().await;
    let mut child = bin()
        .args(["inspect", "-s", path(&o.socket), "--watch", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = lines_of(&mut child);

    let initial: serde_json::Value = serde_json::from_str(&next_line(&mut lines).await).unwrap();
    assert_eq!(initial["event"], "initial");
    assert_eq!(initial["counts"]["healthy"], 3);
    assert_eq!(initial["devices"].as_array().unwrap().len(), 4);
    let time = initial["time"].as_str().unwrap();
    assert!(
        time.len() == 24 && time.ends_with('Z') && &time[10..11] == "T",
        "{time}"
    );

    assert!(o
        .backend
        .set_health("npu-1", Health::unhealthy("overheated")));
    let update: serde_json::Value = serde_json::from_str(&next_line(&mut lines).await).unwrap();
    let mut redacted = update.clone();
    redacted["time"] = "<time>".into();
    assert_eq!(
        redacted,
        serde_json::json!({
            "event": "update",
            "time": "<time>",
            "update": 1,
            "appeared": [],
            "vanished": [],
            "changed": [{
                "id": "npu-1",
                "before": {"id": "npu-1", "health": "Healthy", "numa_nodes": [1]},
                "after": {"id": "npu-1", "health": "Unhealthy", "numa_nodes": [1]},
            }],
            "counts": {"total": 4, "healthy": 2, "unhealthy": 2,
                       "by_health": {"Healthy": 2, "Unhealthy": 2}},
        })
    );

    // Our plugin shutting down ends the stream: one last line, exit 0.
    o.host.shutdown().await;
    let end: serde_json::Value = serde_json::from_str(&next_line(&mut lines).await).unwrap();
    assert_eq!(end["event"], "end");
    let out = wait_exit(child).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(o.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_text_on_a_vendor_plugin_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vendor-gpu.sock");
    let plugin = FakePlugin::serve(&socket, vendor_spec()).await.unwrap();
    let mut child = bin()
        .args(["inspect", "-s", path(&socket), "--watch"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = lines_of(&mut child);
    loop {
        if next_line(&mut lines).await.contains("watching for changes") {
            break;
        }
    }
    let mut devices = plugin.devices();
    devices.remove(0);
    devices[0].health = "Unhealthy".into();
    devices.push(FakeDevice::healthy("gpu-4").numa(1));
    plugin.set_devices(devices);
    let mut update = Vec::new();
    for _ in 0..4 {
        update.push(next_line(&mut lines).await);
    }
    let header = &update[0];
    let (time, rest) = header.split_once("  ").unwrap();
    assert!(time.ends_with('Z'), "{header}");
    assert_eq!(
        rest,
        "update 1: 4 devices (Healthy 1, Degraded 1, Unhealthy 2)"
    );
    assert_eq!(
        update[1..].join("\n"),
        "  changed   gpu-1  health Healthy -> Unhealthy\n  appeared  gpu-4  Healthy, NUMA 1\n  vanished  gpu-0"
    );

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = wait_exit(child).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    plugin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vendor_plugin_registered_with_the_simulator() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(dir.path()).await.unwrap();
    let socket = dir.path().join("vendor-gpu.sock");
    let plugin = FakePlugin::serve(&socket, vendor_spec()).await.unwrap();
    plugin
        .register(kubelet.socket_path(), VENDOR)
        .await
        .unwrap();
    let s = path(&socket);

    let out = devplug(&["inspect", "--socket", s]).await;
    assert_eq!(
        stdout_ok(&out, &[(s, "<socket>")]),
        "\
socket   <socket>
options  pre_start_required=true get_preferred_allocation_available=true
devices  4 devices (Healthy 2, Degraded 1, Unhealthy 1)

ID     HEALTH     NUMA
gpu-0  Healthy    0
gpu-1  Healthy    -
gpu-2  Degraded   0,1
gpu-3  Unhealthy  1
note: the kubelet counts every health other than \"Healthy\" as unhealthy (\"Degraded\")
"
    );

    let out = devplug(&["inspect", "--socket", s, "--allocate", "gpu-0,gpu-1"]).await;
    assert_eq!(
        stdout_ok(&out, &[(s, "<socket>")]),
        "\
Allocate gpu-0,gpu-1 on <socket>: 1 container response
env:
  VENDOR_DRIVER=535
  VENDOR_VISIBLE_DEVICES=gpu-0,gpu-1
device nodes (host -> container, permissions):
  /dev/vendorctl0  ->  /dev/vendorctl  rw
mounts (host -> container):
  /opt/vendor/lib        ->  /usr/lib/vendor    ro
  /var/lib/vendor/cache  ->  /var/cache/vendor  rw
annotations:
  vendor.example/slot=3
CDI devices:
  vendor.example/gpu=all
"
    );
    let out = devplug(&["inspect", "--socket", s, "--allocate", "gpu-9"]).await;
    assert_eq!(
        error_line(&out),
        "error: Allocate failed: InvalidArgument: unknown device ids: gpu-9"
    );

    let out = devplug(&["inspect", "--socket", s, "--preferred", "1"]).await;
    assert_eq!(
        stdout_ok(&out, &[(s, "<socket>")]),
        "GetPreferredAllocation of 1 from 2 healthy devices on <socket>: gpu-0\n"
    );
    // The kubelet still sees the vendor's plugin as it was.
    assert_eq!(kubelet.read(|n| n.capacity(VENDOR)), (4, 2));
    plugin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_the_kubelet_folder() {
    let o = ours().await;
    let dir = o.dir.path();
    let vendor = FakePlugin::serve(dir.join("vendor-gpu.sock"), vendor_spec())
        .await
        .unwrap();
    vendor
        .register(o.kubelet.socket_path(), VENDOR)
        .await
        .unwrap();
    // A socket file nobody listens on, the kubelet's checkpoint, and a folder: the first is
    // listed with the reason, the others are skipped.
    drop(std::os::unix::net::UnixListener::bind(dir.join("stale.sock")).unwrap());
    std::fs::write(dir.join("kubelet_internal_checkpoint"), "{}").unwrap();
    std::fs::create_dir(dir.join("sub")).unwrap();

    let ours_name = o.socket.file_name().unwrap().to_str().unwrap().to_owned();
    let replace = [(path(dir), "<dir>"), (ours_name.as_str(), "<ours>.sock")];
    let out = devplug(&["inspect", "--kubelet-dir", path(dir)]).await;
    assert_eq!(
        stdout_ok(&out, &replace),
        "\
<dir>: 4 sockets

<ours>.sock
  device plugin: 4 devices (Healthy 3, Unhealthy 1)
  options: pre_start_required=false get_preferred_allocation_available=false

kubelet.sock
  the kubelet's registration socket (listening)

stale.sock
  not answering as a device plugin: connection refused: nothing listens on it (a stale socket file)

vendor-gpu.sock
  device plugin: 4 devices (Healthy 2, Degraded 1, Unhealthy 1)
  options: pre_start_required=true get_preferred_allocation_available=true
"
    );

    let out = devplug(&["inspect", "--kubelet-dir", path(dir), "--json"]).await;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kinds: Vec<&str> = value["sockets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "device_plugin",
            "kubelet",
            "not_a_device_plugin",
            "device_plugin"
        ]
    );
    assert_eq!(value["sockets"][0]["counts"]["healthy"], 3);
    assert_eq!(value["sockets"][1]["listening"], true);
    vendor.stop().await;
    o.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_say_what_went_wrong_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(dir.path()).await.unwrap();
    let d = path(dir.path());

    let out = devplug(&["inspect", "-s", &format!("{d}/none.sock")]).await;
    assert_eq!(
        error_line(&out),
        format!("error: no socket at {d}/none.sock")
    );

    std::fs::write(dir.path().join("file"), "x").unwrap();
    let out = devplug(&["inspect", "-s", &format!("{d}/file")]).await;
    assert_eq!(error_line(&out), format!("error: {d}/file is not a socket"));

    drop(std::os::unix::net::UnixListener::bind(dir.path().join("stale.sock")).unwrap());
    let out = devplug(&["inspect", "-s", &format!("{d}/stale.sock")]).await;
    assert_eq!(
        error_line(&out),
        format!(
            "error: connection refused: nothing listens on {d}/stale.sock (a stale socket file)"
        )
    );

    let out = devplug(&["inspect", "-s", path(&kubelet.socket_path())]).await;
    assert_eq!(
        error_line(&out),
        format!(
            "error: {d}/kubelet.sock is not a device plugin: it does not serve \
             v1beta1.DevicePlugin/GetDevicePluginOptions (kubelet.sock is the kubelet's \
             registration socket)"
        )
    );

    // Accepting connections and closing them at once: not gRPC at all.
    let rude = std::os::unix::net::UnixListener::bind(dir.path().join("rude.sock")).unwrap();
    std::thread::spawn(move || rude.incoming().for_each(drop));
    let out = devplug(&["inspect", "-s", &format!("{d}/rude.sock")]).await;
    let line = error_line(&out);
    assert!(
        line.starts_with(&format!("error: {d}/rude.sock is not a device plugin: it ")),
        "{line}"
    );

    // Listening but never answering: the wait is bounded.
    let _silent = std::os::unix::net::UnixListener::bind(dir.path().join("silent.sock")).unwrap();
    let out = devplug(&[
        "inspect",
        "-s",
        &format!("{d}/silent.sock"),
        "--timeout",
        "1",
    ])
    .await;
    let line = error_line(&out);
    assert!(
        line.starts_with("error: timed out after 1 s") && line.ends_with("silent.sock"),
        "{line}"
    );

    let out = devplug(&["inspect", "--kubelet-dir", &format!("{d}/nope")]).await;
    assert_eq!(
        error_line(&out),
        format!("error: no kubelet device-plugins folder at {d}/nope")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_column_comes_from_pod_resources() {
    let root = tempfile::tempdir().unwrap();
    let dp = root.path().join("device-plugins");
    let config = kubelet_sim::SimConfig::default().with_pod_resources_beside(&dp);
    let kubelet = Kubelet::start_with(&dp, config).await.unwrap();
    let settings = VirtualSettings {
        id_prefix: "npu-".into(),
        ..VirtualSettings::new(3)
    };
    let host = Host::new(&dp).unwrap();
    let mut status = host
        .add_shared(RESOURCE, Arc::new(VirtualBackend::new(&settings).unwrap()))
        .unwrap();
    let ready = tokio::time::timeout(WAIT, status.wait_for(|s| s.is_ready()))
        .await
        .unwrap()
        .unwrap()
        .clone();
    let socket = ready.socket.unwrap();
    kubelet
        .wait_for(WAIT, |n| (n.capacity(RESOURCE) == (3, 3)).then_some(()))
        .await
        .unwrap();
    let got = kubelet
        .allocate("ml/train-0", "worker", RESOURCE, 1)
        .await
        .unwrap();
    assert_eq!(got.device_ids, ["npu-0"]);
    let pr = kubelet.pod_resources_socket().unwrap().to_owned();
    let args = [
        "inspect",
        "--socket",
        path(&socket),
        "--pod-resources-socket",
        path(&pr),
    ];
    let out = devplug(&args).await;
    assert_eq!(
        stdout_ok(&out, &[(path(&socket), "<socket>")]),
        "\
socket         <socket>
options        pre_start_required=false get_preferred_allocation_available=false
devices        3 devices (Healthy 3)
pod resources  example.com/npu: 1 in use

ID     HEALTH   NUMA  HOLDER
npu-0  Healthy  -     ml/train-0/worker
npu-1  Healthy  -     -
npu-2  Healthy  -     -
"
    );
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let out = devplug(&json_args).await;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        value["pod_resources"],
        serde_json::json!({
            "resource": "example.com/npu",
            "holders": {"npu-0": {"namespace": "ml", "pod": "train-0", "container": "worker"}},
            "error": null
        })
    );
    host.shutdown().await;
}

/// A DRA driver's health stream on a real socket (devplug's `DRAResourceHealth` service over a
/// device list), inspected once as a table and as JSON; and a device plugin socket, which has
/// no such stream, said so in words.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_health_shows_each_devices_health_and_reason() {
    use devplug::{Device, DeviceList};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("dra.sock");
    let list = DeviceList::new([
        Device::new("board-a"),
        Device::new("board-b").with_health(Health::unhealthy("fan failure")),
    ]);
    let (_tx, rx) = tokio::sync::watch::channel(list);
    let stop = tokio_util::sync::CancellationToken::new();
    let router = tonic::transport::Server::builder().add_service(
        devplug_dra::device_health::DeviceHealthService::server("node-a", rx, stop.clone()),
    );
    let listener = devplug::host::bind_socket(&socket).unwrap();
    devplug_proto::uds::spawn_server(
        router,
        listener,
        stop.clone().cancelled_owned(),
        "test health".into(),
    );
    let out = devplug(&["inspect", "--socket", path(&socket), "--dra-health"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("DRA device health: 2 devices (1 not Healthy)"),
        "{text}"
    );
    assert!(text.contains("node-a  board-a  Healthy    60s"), "{text}");
    assert!(
        text.contains("node-a  board-b  Unhealthy  60s      fan failure"),
        "{text}"
    );
    let out = devplug(&[
        "inspect",
        "--socket",
        path(&socket),
        "--dra-health",
        "--json",
    ])
    .await;
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[1]["health"], "Unhealthy");
    assert_eq!(rows[1]["message"], "fan failure");

    // That socket served v1alpha1 only (read after v1's Unimplemented); one serving only v1, as
    // a driver written for 1.37 may, reads the same.
    let (_tx, rx) = tokio::sync::watch::channel(DeviceList::new([
        Device::new("board-a"),
        Device::new("board-b").with_health(Health::unhealthy("fan failure")),
    ]));
    let v1_socket = dir.path().join("dra-v1.sock");
    let router = tonic::transport::Server::builder().add_service(
        devplug_dra::device_health::DeviceHealthService::server_v1("node-a", rx, stop.clone()),
    );
    devplug_proto::uds::spawn_server(
        router,
        devplug::host::bind_socket(&v1_socket).unwrap(),
        stop.clone().cancelled_owned(),
        "test health v1".into(),
    );
    let out = devplug(&["inspect", "--socket", path(&v1_socket), "--dra-health"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("node-a  board-b  Unhealthy  60s      fan failure"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A device plugin's socket has no health stream.
    let ours = ours().await;
    let out = devplug(&["inspect", "--socket", path(&ours.socket), "--dra-health"]).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("serves no DRA device health stream"), "{err}");
    stop.cancel();
}
