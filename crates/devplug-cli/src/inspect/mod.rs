//! `devplug inspect`: looks at any device plugin socket the way the kubelet does, ours or
//! another vendor's. With `--socket` it shows the options and device list (or watches it,
//! allocates, or asks for a preferred allocation); without, it lists the sockets in the
//! kubelet's folder.
//!
//! Files: `client` (the kubelet-like client and its one-line errors), `model` (what is shown,
//! serializable, with `Change`, what differs between two device lists), `render` (text tables),
//! `watch` (`--watch`), `discover` (the folder listing), `clock` (UTC timestamps), `dra_health`
//! (`--dra-health`: a DRA driver's device health stream).

mod client;
mod clock;
mod discover;
mod dra_health;
mod model;
pub(crate) mod render;
mod watch;

use anyhow::Context;
use client::Plugin;
use model::{AllocationView, Counts, EditsView, PreferenceView, Summary};
use serde::Serialize;
use std::io::{ErrorKind, Write};
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `devplug inspect`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Without --socket, lists the sockets in --kubelet-dir and asks each plugin for its options and \
device counts. With --socket, shows one plugin's options and devices; --watch, --allocate and \
--preferred choose another action. Inspecting opens its own ListAndWatch stream beside the \
kubelet's; a plugin that feeds every stream from one shared channel may then lose updates to \
the kubelet while --watch runs.")]
pub struct InspectArgs {
    /// The device plugin socket to inspect.
    #[arg(long, short)]
    pub socket: Option<PathBuf>,
    /// The kubelet's device-plugins folder, listed when --socket is not given.
    #[arg(long, env = "DEVPLUG_KUBELET_DIR", default_value = devplug::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
    /// Keep ListAndWatch open and print each new list as a change, until the stream ends or
    /// Ctrl-C.
    #[arg(long, requires = "socket", conflicts_with_all = ["allocate", "preferred"])]
    pub watch: bool,
    /// Allocate these device ids (comma-separated) as one container and print the edits. The
    /// kubelet does not learn of it, but some plugins prepare devices on Allocate.
    #[arg(long, value_name = "IDS", value_delimiter = ',', num_args = 1.., requires = "socket", conflicts_with = "preferred")]
    pub allocate: Option<Vec<String>>,
    /// Ask GetPreferredAllocation for N of the healthy devices and print the choice.
    #[arg(long, value_name = "N", requires = "socket", value_parser = clap::value_parser!(u32).range(1..))]
    pub preferred: Option<u32>,
    /// The socket is a DRA driver's (`<plugins>/<driver>/dra.sock`): show its device health
    /// stream, as the kubelet reads it (with --watch, every message).
    #[arg(long, requires = "socket", conflicts_with_all = ["allocate", "preferred", "resource"])]
    pub dra_health: bool,
    /// Machine-readable output: one JSON document (with --watch, one JSON object per line).
    #[arg(long)]
    pub json: bool,
    /// The kubelet's pod resources socket, asked which pod holds each device (one List and one
    /// GetAllocatableResources call). Skipped when the file does not exist; a failing one is
    /// only noted.
    #[arg(long, env = "DEVPLUG_POD_RESOURCES_SOCKET", default_value = devplug::podresources::DEFAULT_SOCKET)]
    pub pod_resources_socket: PathBuf,
    /// The plugin's resource name, for the holder column; found from the device ids when not
    /// given.
    #[arg(long, requires = "socket")]
    pub resource: Option<String>,
    /// Seconds to wait for the connection and for each answer (1 to 3600).
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout: u64,
}

/// Runs `devplug inspect`.
pub async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(args.timeout);
    let Some(socket) = &args.socket else {
        let listing = discover::list(&args.kubelet_dir, timeout).await?;
        let text = if args.json {
            pretty(&listing)?
        } else {
            discover::render(&listing)
        };
        emit(&text)?;
        return Ok(());
    };
    if args.dra_health {
        return dra_health::show(socket, timeout, args.watch, args.json).await;
    }
    if args.watch {
        return watch::watch(socket, timeout, args.json).await;
    }
    let mut plugin = Plugin::connect(socket, timeout).await?;
    let name = socket.display().to_string();
    let text = if let Some(ids) = &args.allocate {
        let response = plugin.allocate(ids).await?;
        let view = AllocationView {
            socket: name,
            requested: ids.clone(),
            container_responses: response
                .container_responses
                .into_iter()
                .map(EditsView::from)
                .collect(),
        };
        if view.container_responses.is_empty() {
            anyhow::bail!(
                "Allocate returned no container response (the kubelet would fail the pod)"
            );
        }
        if args.json {
            pretty(&view)?
        } else {
            render::allocation(&view)
        }
    } else if let Some(size) = args.preferred {
        let options = plugin.options().await?;
        let (devices, _stream) = plugin.first_list().await?;
        let available: Vec<String> = devices
            .iter()
            .filter(|d| d.is_healthy())
            .map(|d| d.id.clone())
            .collect();
        let answer = plugin.preferred(&available, size).await.map_err(|err| {
            if options.get_preferred_allocation_available {
                anyhow::Error::new(err)
            } else {
                anyhow::anyhow!(
                    "{err} (the plugin's options say GetPreferredAllocation is not available)"
                )
            }
        })?;
        let view = PreferenceView {
            socket: name,
            get_preferred_allocation_available: options.get_preferred_allocation_available,
            available,
            size,
            chosen: answer
                .container_responses
                .into_iter()
                .next()
                .map(|r| r.device_i_ds)
                .unwrap_or_default(),
        };
        if args.json {
            pretty(&view)?
        } else {
            preference_text(&view)
        }
    } else {
        let options = plugin.options().await?;
        let (devices, _stream) = plugin.first_list().await?;
        let pod_resources = if args.pod_resources_socket.exists() {
            Some(
                holders(
                    &args.pod_resources_socket,
                    args.resource.as_deref(),
                    &devices,
                )
                .await,
            )
        } else {
            None
        };
        let summary = Summary {
            socket: name,
            options,
            counts: Counts::of(&devices),
            devices,
            pod_resources,
        };
        if args.json {
            pretty(&summary)?
        } else {
            render::summary(&summary)
        }
    };
    emit(&text)?;
    Ok(())
}

/// Asks the kubelet's pod resources API who holds the plugin's devices. The resource is
/// `resource`, or the one at the kubelet whose ids overlap the plugin's most (allocatable or in
/// use). Any failure is reported in the view, never as an error: inspecting works without it.
async fn holders(
    socket: &std::path::Path,
    resource: Option<&str>,
    devices: &[model::DeviceView],
) -> model::PodResourcesView {
    use devplug::podresources::{self, PodResourcesClient};
    let asked = async {
        let mut client = PodResourcesClient::connect(socket, Duration::from_secs(2)).await?;
        let list = client.list().await?;
        let allocatable = client.allocatable().await?;
        Ok::<_, podresources::PodResourcesError>((list, allocatable))
    };
    let (list, allocatable) = match asked.await {
        Ok(answers) => answers,
        Err(err) => {
            return model::PodResourcesView {
                error: Some(err.to_string()),
                ..Default::default()
            }
        }
    };
    let held = podresources::holders(&list);
    let resource = resource.map(str::to_owned).or_else(|| {
        let mut known = podresources::allocatable_ids(&allocatable);
        for (name, ids) in &held {
            known
                .entry(name.clone())
                .or_default()
                .extend(ids.keys().cloned());
        }
        known
            .into_iter()
            .map(|(name, ids)| {
                let overlap = devices.iter().filter(|d| ids.contains(&d.id)).count();
                (overlap, name)
            })
            .filter(|(overlap, _)| *overlap > 0)
            .max()
            .map(|(_, name)| name)
    });
    let holders = resource
        .as_ref()
        .and_then(|r| held.get(r))
        .map(|ids| {
            ids.iter()
                .map(|(id, h)| {
                    (
                        id.clone(),
                        model::HolderView {
                            namespace: h.namespace.clone(),
                            pod: h.pod.clone(),
                            container: h.container.clone(),
                        },
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    model::PodResourcesView {
        resource,
        holders,
        error: None,
    }
}

fn preference_text(view: &PreferenceView) -> String {
    let mut out = String::new();
    if !view.get_preferred_allocation_available {
        out.push_str(
            "note: the plugin's options say GetPreferredAllocation is not available (the kubelet \
             would not call it); asked anyway\n",
        );
    }
    let chosen = if view.chosen.is_empty() {
        "(none)".to_owned()
    } else {
        view.chosen.join(",")
    };
    out.push_str(&format!(
        "GetPreferredAllocation of {} from {} healthy device{} on {}: {chosen}\n",
        view.size,
        view.available.len(),
        if view.available.len() == 1 { "" } else { "s" },
        view.socket,
    ));
    out
}

fn pretty(value: &impl Serialize) -> anyhow::Result<String> {
    Ok(format!("{}\n", serde_json::to_string_pretty(value)?))
}

/// Whether stdout still takes output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Emitted {
    /// Written.
    Written,
    /// The reader went away (e.g. `| head`); stop quietly.
    Closed,
}

/// Writes `text` to stdout and flushes, so `--watch` lines reach a pipe at once.
fn emit(text: &str) -> anyhow::Result<Emitted> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(Emitted::Written),
        Err(err) if err.kind() == ErrorKind::BrokenPipe => Ok(Emitted::Closed),
        Err(err) => Err(err).context("cannot write to stdout"),
    }
}
