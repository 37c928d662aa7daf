//! A complete device plugin in a few lines: four NPUs whose ids go into `NPU_VISIBLE_DEVICES`.
//! The README shows this file. Run it against a kubelet folder with
//! `cargo run -p devplug --example npu -- /var/lib/kubelet/device-plugins`.

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

#[tokio::main]
async fn main() -> Result<(), devplug::HostError> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| devplug::DEFAULT_KUBELET_DIR.to_owned());
    let devices = DeviceList::new((0..4).map(|i| Device::new(format!("npu-{i}"))));
    let host = Host::new(dir)?;
    host.add("vendor.example/npu", Npus(watch::Sender::new(devices)))?;
    devplug::shutdown_signal().await;
    host.shutdown().await;
    Ok(())
}
