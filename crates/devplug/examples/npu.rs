//! A complete device plugin in a few lines: four NPUs whose ids go into `NPU_VISIBLE_DEVICES`.
//! docs/writing-a-plugin.md shows this file.
//!
//! Against the kubelet simulator (no kubelet needed; it registers, a pod gets two NPUs, the
//! example prints what the container got and exits):
//! `cargo run -p devplug --example npu -- --simulator`
//!
//! Against a real kubelet, as root, with its device-plugins folder:
//! `cargo run -p devplug --example npu -- /var/lib/kubelet/device-plugins` (Ctrl-C stops it).

use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList, Host};
use tokio::sync::watch;

struct Npus(watch::Sender<DeviceList>);

impl Backend for Npus {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.0.subscribe()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}

const RESOURCE: &str = "vendor.example/npu";

fn npus() -> Npus {
    let devices = DeviceList::new((0..4).map(|i| Device::new(format!("npu-{i}"))));
    Npus(watch::Sender::new(devices))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = std::env::args().nth(1);
    if arg.as_deref() == Some("--simulator") {
        return simulator().await;
    }
    let dir = arg.unwrap_or_else(|| devplug::DEFAULT_KUBELET_DIR.to_owned());
    let host = Host::new(&dir)?;
    let mut status = host.add(RESOURCE, npus())?;
    println!(
        "serving {RESOURCE} (4 devices); waiting for a kubelet at {dir}/kubelet.sock \
         (Ctrl-C stops; `-- --simulator` runs against the kubelet simulator instead)"
    );
    tokio::select! {
        _ = devplug::shutdown_signal() => {}
        registered = status.wait_for(|s| s.registered) => {
            if registered.is_ok() {
                println!("registered with the kubelet; the node now has {RESOURCE}: 4");
            }
            devplug::shutdown_signal().await;
        }
    }
    host.shutdown().await;
    Ok(())
}

/// The same plugin against the kubelet simulator in a temporary folder.
async fn simulator() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let kubelet = kubelet_sim::Kubelet::start(dir.path()).await?;
    let host = Host::new(dir.path())?;
    host.add(RESOURCE, npus())?;
    println!("kubelet simulator at {}", kubelet.socket_path().display());
    kubelet
        .wait_for(std::time::Duration::from_secs(10), |n| {
            (n.capacity(RESOURCE) == (4, 4)).then_some(())
        })
        .await?;
    println!("registered: the simulated node has {RESOURCE}: 4");
    let got = kubelet.allocate("pod-a", "main", RESOURCE, 2).await?;
    println!(
        "a container asking for 2 got {:?}: NPU_VISIBLE_DEVICES={}",
        got.device_ids,
        got.env("NPU_VISIBLE_DEVICES").unwrap_or_default()
    );
    host.shutdown().await;
    kubelet.stop().await;
    Ok(())
}
