//! The `ascend` backend (config key `ascend`): Huawei Ascend NPUs, from their device nodes.
//!
//! - `settings`: the environment variable, CDI, the roots.
//! - `discover`: `/dev/davinci<N>`, the shared nodes, the NPUs' PCI devices.
//!
//! A container gets `/dev/davinci<N>` per NPU, `/dev/davinci_manager`, `/dev/devmm_svm` and
//! `/dev/hisi_hdc` once, and `ASCEND_VISIBLE_DEVICES=<N>,…`, as Huawei's plugin gives them
//! when Ascend's container runtime is not used; CDI names of kind = the resource name
//! (`huawei.com/Ascend910`). Health: an NPU is there while its node is; a node that vanishes
//! (driver unloaded, NPU reset) makes it Unhealthy until it is back, and without
//! `/dev/davinci_manager` every NPU is Unhealthy. Huawei's plugin reads fault codes through
//! the DCMI library; devplug does not load it (no sysfs file carries that health).

mod discover;
pub mod settings;

pub use settings::AscendSettings;

use crate::node_backend::{scan_result, EnvNaming, Flavor, NodeBackend};
use crate::settings::SettingsError;
use crate::sysfs_watch::Words;

/// Starts the `ascend` backend for `resource` (Huawei names it `huawei.com/Ascend910`,
/// `huawei.com/Ascend310P`, …). Must be called inside a tokio runtime.
pub fn start(resource: &str, settings: &AscendSettings) -> Result<NodeBackend, SettingsError> {
    settings.validate()?;
    let flavor = Flavor {
        what: "ascend",
        words: Words {
            noun: "NPU",
            gone: "is gone from /dev",
        },
        env: EnvNaming::List(settings.env.clone()),
        dev_root: settings.dev_root.clone(),
        cdi_dir: settings.cdi.then(|| settings.cdi_dir.clone()),
    };
    let s = settings.clone();
    NodeBackend::start(resource, flavor, move |kind| {
        scan_result(discover::scan(&s.sys_root, &s.dev_root), &s.dev_root, kind)
    })
}
