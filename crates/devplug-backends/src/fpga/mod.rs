//! The `fpga` backend (config key `fpga`): Intel FPGA ports under the kernel's DFL driver,
//! one resource per accelerator function (AFU) or per region interface.
//!
//! - `settings`: which ports (`afu_id`, `interface_id`), the environment variable, CDI, the
//!   roots.
//! - `discover`: regions, ports, their AFU and interface ids.
//!
//! A container gets `/dev/dfl-port.<m>` for each port, CDI names of kind = the resource name,
//! and the ports' names in `env` if set. devplug never reprograms an FPGA: the resource serves
//! the ports that carry the AFU now (Intel's plugin, in `region` mode with its webhook and
//! CRI hook, can program one). A port whose AFU changes to another is listed Unhealthy,
//! saying what it carries; one with no AFU (`afu_id` all `f`) is Unhealthy.

mod discover;
pub mod settings;

pub use settings::FpgaSettings;

use crate::node_backend::{scan_result, EnvNaming, Flavor, NodeBackend};
use crate::settings::SettingsError;
use crate::sysfs_watch::Words;

/// Starts the `fpga` backend for `resource`. Must be called inside a tokio runtime.
pub fn start(resource: &str, settings: &FpgaSettings) -> Result<NodeBackend, SettingsError> {
    settings.validate()?;
    let flavor = Flavor {
        what: "fpga",
        words: Words {
            noun: "FPGA port",
            gone: "is gone from sysfs",
        },
        env: match &settings.env {
            Some(name) => EnvNaming::List(name.clone()),
            None => EnvNaming::Nothing,
        },
        dev_root: settings.dev_root.clone(),
        cdi_dir: settings.cdi.then(|| settings.cdi_dir.clone()),
    };
    let s = settings.clone();
    NodeBackend::start(resource, flavor, move |kind| {
        scan_result(discover::scan(&s), &s.dev_root, kind)
    })
}
