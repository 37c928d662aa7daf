//! The plugin against the kubelet simulator, as docs/writing-a-plugin.md shows it: the device
//! plugin's binary registers, lists its NPUs and answers an Allocate; the DRA side registers
//! through the plugin watcher and prepares a claim, with the claims' allocations from a table
//! instead of the API server.

// region: uses
use devplug::BoxFuture;
use devplug_dra::claims::{AllocatedDevice, ClaimRef, ClaimSource};
use devplug_dra::kubelet::{KubeletDirs, KubeletSide, Registered};
use devplug_dra::prepare::{PrepareFiles, Preparer};
use kubelet_sim::{DraClaim, Kubelet, SimConfig};
use npu_plugin::Npus;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
// endregion: uses

// region: device-plugin
#[tokio::test]
async fn the_plugin_registers_and_a_container_gets_its_npus() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    std::fs::create_dir(&dir).unwrap();

    // The plugin before its kubelet: it says what it waits for.
    let mut plugin = Plugin::start(&dir);
    plugin.wait_for_log("waiting for the kubelet socket").await;

    let kubelet = Kubelet::start(&dir).await.unwrap();
    kubelet
        .wait_for(Duration::from_secs(10), |node| {
            (node.capacity("vendor.example/npu") == (4, 4)).then_some(())
        })
        .await
        .unwrap();
    plugin.wait_for_log("registered with the kubelet").await;

    let got = kubelet
        .allocate("pod-a", "main", "vendor.example/npu", 2)
        .await
        .unwrap();
    assert_eq!(got.device_ids.len(), 2);
    let ids = got.device_ids.join(",");
    assert_eq!(got.env("NPU_VISIBLE_DEVICES"), Some(ids.as_str()));

    // SIGTERM, as the container runtime sends it: a clean exit, the plugin's socket removed.
    assert!(plugin.stop().await, "the plugin exits with status 0");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .filter(|name| name != "kubelet.sock")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    kubelet.stop().await;
}
// endregion: device-plugin

// region: plugin-helper
/// The plugin's binary, running, with its log lines.
struct Plugin {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Plugin {
    fn start(dir: &Path) -> Plugin {
        let mut child = Command::new(env!("CARGO_BIN_EXE_npu-plugin"))
            .arg(dir)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                println!("plugin: {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Plugin { child, lines }
    }

    /// Waits up to 10 s for a log line that contains `text`.
    async fn wait_for_log(&mut self, text: &str) {
        let found = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(line) = self.lines.recv().await {
                // A pipe, as a log file: plain text, no colour codes.
                assert!(
                    !line.contains('\u{1b}'),
                    "colour codes in the log: {line:?}"
                );
                if line.contains(text) {
                    return true;
                }
            }
            false
        })
        .await;
        assert_eq!(found, Ok(true), "the plugin logs {text:?} within 10 s");
    }

    /// Sends SIGTERM and waits up to 10 s for the exit; whether it exited with status 0.
    async fn stop(&mut self) -> bool {
        let pid = self.child.id().to_string();
        let sent = Command::new("sh")
            .args(["-c", "kill -TERM \"$0\"", &pid])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        for _ in 0..1000 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the plugin did not exit within 10 s of SIGTERM");
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
// endregion: plugin-helper

// region: dra
const DRIVER: &str = "npu.example.com";

/// Claims as the scheduler allocated them: `uid-1` has npu-1 and npu-2 for its request `npus`.
/// The driver reads them from the API server; this table stands in for it.
struct Claims;

impl ClaimSource for Claims {
    fn allocation<'a>(
        &'a self,
        claim: &'a ClaimRef,
    ) -> BoxFuture<'a, Result<Vec<AllocatedDevice>, String>> {
        let npu = |name: &str| AllocatedDevice {
            request: "npus".into(),
            pool: "node-a".into(),
            device: name.into(),
            hold: devplug_dra::Hold::Exclusive,
            consumed: Default::default(),
            tolerates_unhealthy: false,
            pod_claim_name: None,
        };
        let found = (claim.uid == "uid-1").then(|| vec![npu("npu-1"), npu("npu-2")]);
        Box::pin(async move { found.ok_or_else(|| format!("no claim {}", claim.uid)) })
    }
}

#[tokio::test]
async fn the_driver_prepares_a_claim_for_the_kubelet() {
    let root = tempfile::tempdir().unwrap();
    let device_plugins = root.path().join("device-plugins");
    std::fs::create_dir(&device_plugins).unwrap();
    let config = SimConfig::default().with_watcher_beside(&device_plugins);
    let kubelet = Kubelet::start_with(&device_plugins, config).await.unwrap();

    // The driver's kubelet side (what DraDriver::start runs besides the ResourceSlices).
    let dirs = KubeletDirs::beside(&device_plugins);
    let files = PrepareFiles {
        cdi_dir: root.path().join("cdi"),
        checkpoint: dirs.driver_dir(DRIVER).join("checkpoint.json"),
    };
    let npus = Arc::new(Npus::discover(4));
    let preparer = Preparer::new(DRIVER, "node-a", npus, Arc::new(Claims), files.clone()).unwrap();
    let side = KubeletSide::start(Arc::new(preparer), &dirs).unwrap();
    let mut registered = side.registered();
    let waited = tokio::time::timeout(
        Duration::from_secs(10),
        registered.wait_for(|r| *r == Registered::Yes),
    )
    .await;
    // `is_ok_and` drops the borrow of the watch channel that `wait_for` returns.
    assert!(waited.is_ok_and(|r| r.is_ok()), "registered within 10 s");

    // The kubelet prepares the claim of a pod: its devices and their CDI ids come back, and
    // the CDI spec the container runtime applies carries the backend's edits.
    let claim = DraClaim::new("default", "npus", "uid-1");
    let prepared = kubelet.dra_prepare(DRIVER, &[claim]).await.unwrap();
    let devices = prepared["uid-1"].as_ref().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(names, ["npu-1", "npu-2"]);
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("{DRIVER}/claim=uid-1-npus")]
    );
    let spec_path = devplug_dra::prepare::spec_path(&files.cdi_dir, DRIVER, "uid-1");
    let spec = std::fs::read_to_string(spec_path).unwrap();
    assert!(spec.contains("NPU_VISIBLE_DEVICES=npu-1,npu-2"), "{spec}");

    assert!(side.stop().await.is_empty());
    kubelet.stop().await;
}
// endregion: dra
