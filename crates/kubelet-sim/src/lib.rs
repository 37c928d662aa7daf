//! kubelet-sim: a stand-in for the kubelet's device manager, over real Unix sockets in any folder.
//!
//! It serves `v1beta1.Registration` on `kubelet.sock`, validates registrations like the kubelet,
//! dials plugins back (authority `localhost`, 10 s), consumes ListAndWatch and derives capacity and
//! allocatable, allocates containers like the kubelet, runs PreStartContainer when asked, applies
//! the disconnect grace period, and simulates a kubelet restart exactly: every socket in the folder
//! is deleted and a new `kubelet.sock` is served.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let kubelet = kubelet_sim::Kubelet::start("/tmp/device-plugins").await?;
//! let npu = kubelet
//!     .wait_for(std::time::Duration::from_secs(5), |node| {
//!         (node.capacity("dummy.com/npu").0 > 0).then_some(())
//!     })
//!     .await?;
//! let allocation = kubelet.allocate("pod-a", "main", "dummy.com/npu", 2).await?;
//! println!("{:?}", allocation.env("DUMMY_VISIBLE_DEVICES"));
//! # Ok(()) }
//! ```
//!
//! With [`SimConfig::plugins_registry`] set it also runs the kubelet's plugin watcher on that
//! folder (`plugin_watcher`): device plugins registering through a socket there are found, asked
//! `GetInfo`, connected and notified as the kubelet does, and so are DRA plugins (`dra`): their
//! service version is chosen as the kubelet chooses it, and [`Kubelet::dra_prepare`] /
//! [`Kubelet::dra_unprepare`] call `NodePrepareResources` / `NodeUnprepareResources` on them
//! and check the answers as the kubelet does.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use kubelet_sim::{DraClaim, Kubelet, SimConfig};
//! let dir = std::path::Path::new("/tmp/kubelet/device-plugins");
//! let kubelet = Kubelet::start_with(dir, SimConfig::default().with_watcher_beside(dir)).await?;
//! let claim = DraClaim::new("default", "gpu-claim", "4f1c…");
//! let results = kubelet.dra_prepare("gpu.example.com", &[claim]).await?;
//! for (uid, result) in &results {
//!     println!("{uid}: {result:?}");
//! }
//! # Ok(()) }
//! ```
//!
//! Files: `device_manager` (the [`Kubelet`] handle, the state its services share, booting and
//! restarting), `config` (how the simulated kubelet behaves: [`SimConfig`], [`ClientKeying`]),
//! `registration` (the Registration service and the ListAndWatch consumer),
//! `allocation` (the kubelet's allocation rules), `state` (what the node knows),
//! `plugin_watcher` (the plugin watcher and plugin manager), `dra` (the kubelet's DRA
//! registration handler, calls and prepared claims), `pod_resources` (the pod resources API),
//! [`fake_plugin`], a minimal device plugin written without the devplug library (another
//! vendor's plugin, for tests), and [`fake_dra_plugin`], a minimal DRA plugin of the same kind.

mod allocation;
mod config;
mod device_manager;
mod dra;
pub mod fake_dra_plugin;
pub mod fake_plugin;
mod plugin_watcher;
mod pod_resources;
mod registration;
mod shared;
mod state;

pub use allocation::AllocationError;
pub use config::{ClientKeying, SimConfig};
pub use device_manager::{Kubelet, SimError};
pub use dra::{
    ClaimError, ClaimResults, DraClaim, DraDevice, DraError, DraPluginRecord, DraService,
    HealthService, HealthStream, PreparedClaim,
};
pub use state::{Allocation, NodeState, RegistrationRecord, ResourceState, SimDevice};
