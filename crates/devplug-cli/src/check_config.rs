//! `devplug check-config`: loads a config file exactly as `run` does and reports the result,
//! without serving anything. For CI (the deploy manifests' embedded config is checked with it)
//! and for people editing a ConfigMap. With `--discover` it also starts each device-plugin
//! resource's backend as `run` does, waits for its first discovery, and prints what it found
//! and what a container given its first healthy device would get: the way to see, on a node,
//! what the kubelet would be told before deploying. Its exit status is one a script can gate
//! on ([`EXIT_NOT_READY`]), and `--json` prints the same as one JSON object.
//!
//! Discovery leaves the node as it was: each backend starts with settings that write nothing
//! outside a private scratch folder, removed before the command ends ([`dry_run`]).

use crate::config::{BackendConfig, Config, ConfigError, ResourceConfig, ResourceKind};
use crate::logging::Warnings;
use devplug::{ContainerEdits, DeviceList};
use devplug_backends::files::MissingFolder;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The exit status of `check-config --discover` when the file is valid but a device-plugin
/// resource found no healthy device, or its backend is not ready (e.g. NVML cannot be loaded).
/// An invalid file exits 1, as every other error.
/// (Not 2: the argument parser exits 2 for a usage error.)
pub const EXIT_NOT_READY: u8 = 3;

/// Arguments of `devplug check-config`.
#[derive(Debug, clap::Args)]
pub struct CheckConfigArgs {
    /// The config file (YAML) to check.
    #[arg(long, short, env = "DEVPLUG_CONFIG")]
    pub config: PathBuf,
    /// Also start each device-plugin resource's backend (as `run` does, but writing nothing on
    /// the node: no CDI spec in the CDI folder, no `files:` folder created), wait for its first
    /// discovery (`--wait` at most) and print its devices and what a container given the first
    /// healthy one would get.
    #[arg(long)]
    pub discover: bool,
    /// With `--discover`: the longest wait for a backend's first discovery, e.g. `20s`.
    #[arg(long, default_value = "20s", value_parser = crate::duration::parse)]
    pub wait: Duration,
    /// Print one JSON object on stdout instead of text: the verdict and, per resource, its
    /// name, backend key and (with `--discover`) devices with their health, why it is not
    /// ready and the warnings its backend logged.
    #[arg(long)]
    pub json: bool,
}

/// The exit statuses, at the end of `check-config --help`.
pub const EXIT_STATUS: &str = "\
Exit status:
  0  the file is valid (with --discover: and every device-plugin resource found at least one
     healthy device; advertise: and DRA-only resources are not started)
  1  the file is invalid or cannot be read (the error on stderr), or another error
  2  a usage error (an unknown flag, a missing --config)
  3  with --discover: the file is valid, but a resource found no healthy device or its backend
     is not ready (e.g. NVML cannot be loaded)";

/// What `check-config` concluded about a file it could load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Valid, and (with `--discover`) every started resource has a healthy device.
    Ready,
    /// Valid, but a started resource has no healthy device or is not ready: [`EXIT_NOT_READY`].
    NotReady,
}

/// One started resource's discovery.
struct Discovered {
    list: DeviceList,
    not_ready: Option<String>,
    finished: bool,
    warnings: Vec<String>,
}

impl Discovered {
    fn ready(&self) -> bool {
        self.not_ready.is_none() && self.list.healthy_count() > 0
    }
}

/// Prints the summary (text or `--json`) if the file would run, or returns the loader's error
/// (with `--json`, after printing the object that says so). With `--discover`, then the
/// discovery report (`runtime` runs the backends); `warnings` holds what the backends log, for
/// `--json`.
pub fn check_config(
    args: &CheckConfigArgs,
    runtime: &tokio::runtime::Runtime,
    warnings: Option<&Warnings>,
) -> anyhow::Result<Verdict> {
    let config = match load(&args.config) {
        Ok(config) => config,
        Err(err) => {
            let err = anyhow::Error::from(err);
            if args.json {
                let object = json!({
                    "config": args.config.display().to_string(),
                    "valid": false,
                    "error": crate::output::error_text(&err),
                    "verdict": "invalid",
                    "exit_code": 1,
                });
                crate::output::print(&format!("{object}\n"))?;
            }
            return Err(err);
        }
    };
    let names: Vec<&str> = config.resources.iter().map(|r| r.name.as_str()).collect();
    if !args.json {
        crate::output::print(&format!(
            "{}: ok: {} resource{} ({})\n",
            args.config.display(),
            names.len(),
            if names.len() == 1 { "" } else { "s" },
            names.join(", ")
        ))?;
    }
    let loading_warnings = warnings.map(Warnings::take).unwrap_or_default();
    let mut found: Vec<Option<Discovered>> = Vec::new();
    if args.discover {
        let scratch = Scratch::new();
        let mut report = String::new();
        let result = runtime.block_on(async {
            for resource in &config.resources {
                if !resource.serves_device_plugin() {
                    found.push(None);
                    continue;
                }
                let discovered = discover(resource, args.wait, &scratch, warnings).await?;
                if !args.json {
                    describe(
                        &mut report,
                        &resource.name,
                        &discovered,
                        args.wait,
                        &discovered.backend,
                    );
                }
                found.push(Some(discovered.result));
            }
            anyhow::Ok(())
        });
        scratch.remove();
        result?;
        if !args.json {
            crate::output::print(&report)?;
        }
    }
    let verdict = if found.iter().flatten().all(Discovered::ready) {
        Verdict::Ready
    } else {
        Verdict::NotReady
    };
    if args.json {
        let object = json_report(args, &config.resources, &found, &loading_warnings, verdict);
        crate::output::print(&format!("{object}\n"))?;
    } else if verdict == Verdict::NotReady {
        let not_ready: Vec<String> = config
            .resources
            .iter()
            .zip(&found)
            .filter_map(|(r, d)| d.as_ref().filter(|d| !d.ready()).map(|d| (r, d)))
            // The reason is in the report above; said once, for scripts that count it.
            .map(|(r, d)| match &d.not_ready {
                Some(_) => format!("{} (its backend is not ready)", r.name),
                None => format!("{} (no healthy device)", r.name),
            })
            .collect();
        eprintln!(
            "{}: not ready: {}",
            args.config.display(),
            not_ready.join(", ")
        );
    }
    Ok(verdict)
}

/// The same steps as `Config::load`, keeping only the parsed config.
fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    Config::parse(&text, path)
}

/// A started backend with what its discovery found.
struct Started {
    backend: crate::config::BuiltBackend,
    result: Discovered,
}

impl std::ops::Deref for Started {
    type Target = Discovered;
    fn deref(&self) -> &Discovered {
        &self.result
    }
}

/// Starts `resource`'s backend with [`dry_run`] settings and waits (at most `wait`) for its
/// first discovery.
async fn discover(
    resource: &ResourceConfig,
    wait: Duration,
    scratch: &Scratch,
    warnings: Option<&Warnings>,
) -> anyhow::Result<Started> {
    let backend = dry_run(resource, scratch)
        .build()
        .map_err(|(key, err)| anyhow::anyhow!("resource {}: {key}: {err}", resource.name))?
        .backend;
    let finished = tokio::time::timeout(wait, backend.discovered())
        .await
        .is_ok();
    let list = backend.devices().borrow().clone();
    let not_ready = backend.not_ready();
    let mut warnings = warnings.map(Warnings::take).unwrap_or_default();
    warnings.extend(missing_folder(resource));
    Ok(Started {
        backend,
        result: Discovered {
            list,
            not_ready,
            finished,
            warnings,
        },
    })
}

/// Why a `files:` resource found nothing, where its folder does not exist: what `run` would do
/// about it (`missing:`), and the fix.
fn missing_folder(resource: &ResourceConfig) -> Option<String> {
    let ResourceKind::Devices(BackendConfig::Files(settings)) = &resource.kind else {
        return None;
    };
    if settings.dir.exists() {
        return None;
    }
    let dir = settings.dir.display();
    Some(match settings.missing {
        MissingFolder::Wait => format!(
            "files.dir {dir} does not exist: `run` waits for it and serves no device until it \
             appears (create it, mount it into the container at the same path, or set \
             `missing: create`)"
        ),
        MissingFolder::Create => format!(
            "files.dir {dir} does not exist: `run` creates it (missing: create), empty, so the \
             resource serves no device until files are put there"
        ),
    })
}

/// A folder for what the backends would write on the node (CDI specs), under the temp folder;
/// made by the first backend that writes there, removed by [`Scratch::remove`].
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = std::env::temp_dir();
        // The backends' settings want absolute paths.
        let tmp = if tmp.is_absolute() {
            tmp
        } else {
            PathBuf::from("/tmp")
        };
        Scratch(tmp.join(format!(
            "devplug-check-config.{}.{nanos}",
            std::process::id()
        )))
    }

    fn remove(&self) {
        match std::fs::remove_dir_all(&self.0) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                tracing::warn!(dir = %self.0.display(), %err, "cannot remove check-config's scratch folder");
            }
        }
    }
}

/// `resource` as `check-config --discover` starts it: the same discovery, with nothing written
/// on the node. A `files:` folder that is missing is waited for, not created; CDI specs go to
/// `scratch` rather than the CDI folder (where a running devplug's own spec of the same name
/// would otherwise be overwritten, then removed when the backend stops). The spec's file name
/// and the CDI device names a container gets do not depend on the folder.
fn dry_run(resource: &ResourceConfig, scratch: &Scratch) -> ResourceConfig {
    let mut resource = resource.clone();
    if let ResourceKind::Devices(backend) = &mut resource.kind {
        backend.dry_run(scratch.0.clone());
    }
    resource
}

/// The `--json` object.
fn json_report(
    args: &CheckConfigArgs,
    resources: &[ResourceConfig],
    found: &[Option<Discovered>],
    loading_warnings: &[String],
    verdict: Verdict,
) -> Value {
    let resources: Vec<Value> = resources
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut object = json!({
                "name": r.name,
                "backend": r.kind.key(),
                "device_plugin": r.serves_device_plugin(),
                "dra": r.dra.is_some(),
                "discovered": false,
            });
            if let Some(d) = found.get(i).and_then(Option::as_ref) {
                let devices: Vec<Value> = d
                    .list
                    .devices()
                    .iter()
                    .map(|dev| {
                        json!({
                            "id": dev.id,
                            "healthy": dev.health.is_healthy(),
                            "health": dev.health.to_string(),
                        })
                    })
                    .collect();
                let extra = json!({
                    "discovered": true,
                    "ready": d.ready(),
                    "first_discovery_finished": d.finished,
                    "devices": devices,
                    "healthy": d.list.healthy_count(),
                    "not_ready": d.not_ready,
                    "warnings": d.warnings,
                });
                if let (Value::Object(o), Value::Object(e)) = (&mut object, extra) {
                    o.extend(e);
                }
            }
            object
        })
        .collect();
    let (word, code) = match verdict {
        Verdict::Ready => ("ok", 0),
        Verdict::NotReady => ("not-ready", EXIT_NOT_READY),
    };
    json!({
        "config": args.config.display().to_string(),
        "valid": true,
        "discover": args.discover,
        "verdict": word,
        "exit_code": code,
        "warnings": loading_warnings,
        "resources": resources,
    })
}

/// "1 device", "4 devices".
fn devices(n: usize) -> String {
    format!("{n} device{}", if n == 1 { "" } else { "s" })
}

/// Lists at most this many device ids per resource.
const SHOWN_IDS: usize = 8;

/// One resource's discovery, as text.
fn describe(
    out: &mut String,
    name: &str,
    found: &Discovered,
    wait: Duration,
    backend: &crate::config::BuiltBackend,
) {
    let list = &found.list;
    let healthy = list.healthy_count();
    let _ = writeln!(out, "{name}: {}, {healthy} healthy", devices(list.len()));
    if !found.finished {
        let _ = writeln!(
            out,
            "  first discovery not finished after {}: the kubelet would get this list",
            crate::duration::format(wait)
        );
    }
    if let Some(why) = &found.not_ready {
        let _ = writeln!(out, "  not ready: {why}");
    }
    for warning in &found.warnings {
        let _ = writeln!(out, "  warning: {warning}");
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
