//! `devplug check-config`: loads a config file exactly as `run` does and reports the result,
//! without serving anything. For CI (the deploy manifests' embedded config is checked with it)
//! and for people editing a ConfigMap. With `--discover` it also starts each device-plugin
//! resource's backend as `run` does, waits for its first discovery, and prints what it found
//! and what a container given its first healthy device would get: the way to see, on a node,
//! what the kubelet would be told before deploying.

use crate::config::{Config, ConfigError};
use devplug::{Backend, ContainerEdits, DeviceList};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `devplug check-config`.
#[derive(Debug, clap::Args)]
pub struct CheckConfigArgs {
    /// The config file (YAML) to check.
    #[arg(long, short, env = "DEVPLUG_CONFIG")]
    pub config: PathBuf,
    /// Also start each device-plugin resource's backend (as `run` does: it may write the CDI
    /// specs `run` writes), wait for its first discovery (`--wait` at most) and print its
    /// devices and what a container given the first healthy one would get.
    #[arg(long)]
    pub discover: bool,
    /// With `--discover`: the longest wait for a backend's first discovery, e.g. `20s`.
    #[arg(long, default_value = "20s", value_parser = crate::duration::parse)]
    pub wait: Duration,
}

/// Exits 0 with a one-line summary if the file would run, or returns the loader's error. With
/// `--discover`, then the discovery report (`runtime` runs the backends).
pub fn check_config(
    args: &CheckConfigArgs,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    // The same steps as `Config::load`, keeping only the parsed config.
    let text = std::fs::read_to_string(&args.config).map_err(|source| ConfigError::Read {
        path: args.config.clone(),
        source,
    })?;
    let config = Config::parse(&text, &args.config)?;
    let names: Vec<&str> = config.resources.iter().map(|r| r.name.as_str()).collect();
    crate::output::print(&format!(
        "{}: ok: {} resource{} ({})\n",
        args.config.display(),
        names.len(),
        if names.len() == 1 { "" } else { "s" },
        names.join(", ")
    ))?;
    if !args.discover {
        return Ok(());
    }
    let mut report = String::new();
    runtime.block_on(async {
        for resource in config.resources.iter().filter(|r| r.serves_device_plugin()) {
            let backend = resource.build().map_err(|(key, err)| {
                anyhow::anyhow!("resource {}: {key}: {err}", resource.name)
            })?;
            let waited = tokio::time::timeout(args.wait, backend.discovered())
                .await
                .is_err();
            let list = backend.devices().borrow().clone();
            describe(
                &mut report,
                &resource.name,
                backend.as_ref(),
                &list,
                waited,
                args.wait,
            );
        }
        anyhow::Ok(())
    })?;
    crate::output::print(&report)
}

/// Lists at most this many device ids per resource.
const SHOWN_IDS: usize = 8;

/// One resource's discovery, as text.
fn describe(
    out: &mut String,
    name: &str,
    backend: &dyn Backend,
    list: &DeviceList,
    waited: bool,
    wait: Duration,
) {
    let healthy = list.healthy_count();
    let _ = writeln!(out, "{name}: {} devices, {healthy} healthy", list.len());
    if waited {
        let _ = writeln!(
            out,
            "  first discovery not finished after {}: the kubelet would get this list",
            crate::duration::format(wait)
        );
    }
    if let Some(why) = backend.not_ready() {
        let _ = writeln!(out, "  not ready: {why}");
    }
    let ids: Vec<&str> = list.devices().iter().map(|d| d.id.as_str()).collect();
    if !ids.is_empty() {
        let more = ids.len().saturating_sub(SHOWN_IDS);
        let shown = ids
            .iter()
            .take(SHOWN_IDS)
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        let _ = writeln!(out, "  devices: {shown}{tail}");
    }
    for device in list.devices().iter().filter(|d| !d.health.is_healthy()) {
        let _ = writeln!(out, "  unhealthy: {}: {}", device.id, device.health);
    }
    let Some(first) = list.devices().iter().find(|d| d.health.is_healthy()) else {
        return;
    };
    match backend.allocate(std::slice::from_ref(&first.id)) {
        Ok(edits) => {
            let _ = writeln!(out, "  a container given {} gets:", first.id);
            edits_text(out, &edits);
        }
        Err(err) => {
            let _ = writeln!(out, "  allocating {} fails: {err}", first.id);
        }
    }
}

fn edits_text(out: &mut String, edits: &ContainerEdits) {
    for (k, v) in &edits.envs {
        let _ = writeln!(out, "    env {k}={v}");
    }
    for d in &edits.devices {
        let _ = writeln!(
            out,
            "    device {} <- {} ({})",
            d.container_path, d.host_path, d.permissions
        );
    }
    for m in &edits.mounts {
        let ro = if m.read_only { "ro" } else { "rw" };
        let _ = writeln!(
            out,
            "    mount {} <- {} ({ro})",
            m.container_path, m.host_path
        );
    }
    for (k, v) in &edits.annotations {
        let _ = writeln!(out, "    annotation {k}={v}");
    }
    for c in &edits.cdi_devices {
        let _ = writeln!(out, "    cdi {c}");
    }
}
