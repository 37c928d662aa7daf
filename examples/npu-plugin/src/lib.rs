//! Four NPUs, served as a device plugin (`src/main.rs`) and as a DRA driver
//! (`src/bin/npu-dra.rs`). docs/writing-a-plugin.md walks through this crate.

// region: backend
use devplug::{AllocateError, Backend, ContainerEdits, Device, DeviceList};
use tokio::sync::watch;

/// The node's NPUs: their list, and what a container given some of them gets.
pub struct Npus {
    devices: watch::Sender<DeviceList>,
}

impl Npus {
    /// `count` NPUs, `npu-0`, `npu-1`, … A real backend finds its devices here, and keeps
    /// sending a new list on the channel when one appears, goes or changes health.
    pub fn discover(count: usize) -> Npus {
        let list = DeviceList::new((0..count).map(|i| Device::new(format!("npu-{i}"))));
        Npus {
            devices: watch::Sender::new(list),
        }
    }
}

impl Backend for Npus {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.subscribe()
    }

    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        Ok(ContainerEdits::default().env("NPU_VISIBLE_DEVICES", ids.join(",")))
    }
}
// endregion: backend

// region: claim-backend
/// Claims get whole NPUs, with the edits `allocate` gives a device plugin's container.
impl devplug::dra::ClaimBackend for Npus {}
// endregion: claim-backend
