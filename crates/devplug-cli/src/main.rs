//! The `devplug` command: `run` serves device plugins from a config file; `demo` shows the whole
//! lifecycle on the embedded kubelet simulator, with no cluster and no root (`demo --dra`: the DRA
//! path with a real API server and scheduler); `inspect` looks at
//! any device plugin socket as the kubelet would; `check-config` validates a config file;
//! `completions` and `man` print shell completions and the man page.
//! `capacity` sets, removes and lists extended resources on a Node through the API server;
//! `labels` lists and removes the node labels `run` wrote.
//!
//! Three cargo features, all on by default: `cluster` (the Kubernetes API client: `capacity`,
//! `advertise:` resources, `run --node-events`, `dra:` resources), `tools` (`demo` with the
//! kubelet simulator, `inspect`, `completions`, `man`) and `dev-demos` (`demo nvidia` and
//! `demo --dra`, on fake hardware and a local control plane, through the test kit). The image's
//! `devplug` is built with `cluster` and `tools`; built with none (`--no-default-features`), the
//! binary is `devplug-lite`, the node agent the DaemonSets run: `run` and `check-config` only,
//! and they refuse a config or flag that needs the API server, naming it
//! ([`config::needs_cluster`]).

#[cfg(feature = "cluster")]
mod advertise;
#[cfg(feature = "cluster")]
mod capacity;
mod check_config;
#[cfg(feature = "cluster")]
mod cluster_context;
mod cluster_feature;
#[cfg(feature = "cluster")]
mod cluster_features;
mod config;
#[cfg(feature = "tools")]
mod demo;
#[cfg(all(feature = "cluster", feature = "dev-demos"))]
mod demo_dra;
#[cfg(all(feature = "cluster", feature = "dev-demos"))]
mod demo_dra_sharing;
#[cfg(feature = "dev-demos")]
mod demo_nvidia;
#[cfg(feature = "cluster")]
mod dra;
mod duration;
mod endpoints;
mod http;
#[cfg(feature = "tools")]
mod inspect;
#[cfg(feature = "cluster")]
mod labels;
mod listen_addr;
#[cfg(not(feature = "cluster"))]
mod lite;
mod logging;
#[cfg(feature = "cluster")]
mod node_events;
mod node_labels;
mod output;
mod refused;
mod reload;
mod run;

#[cfg(feature = "tools")]
use clap::CommandFactory;
use clap::{Parser, Subcommand};
use logging::LogFormat;
use std::process::ExitCode;

/// The version `--version` prints: the crate version and, when built from a git checkout, the
/// commit (see build.rs).
const VERSION: &str = env!("DEVPLUG_VERSION");

/// The command's name in `--help`, `--version`, completions and the man page: `devplug`, or
/// `devplug-lite` for the device-plugin-only build (no `cluster` feature), as the image names
/// the two binaries.
const NAME: &str = if cfg!(feature = "cluster") {
    "devplug"
} else {
    "devplug-lite"
};

/// Kubernetes device plugins and DRA drivers: virtual devices, device files, host device nodes,
/// GPUs (NVIDIA, AMD, Intel) and accelerators, served to the kubelet over the device plugin API
/// v1beta1 or Dynamic Resource Allocation.
///
/// Backends (a resource's key in the config file): virtual, files, hostdev, nvidia, amdgpu,
/// intel_gpu, vfio, qat, ascend, fpga, and advertise (a count on the Node, no device).
#[derive(Debug, Parser)]
#[command(name = NAME, version = VERSION, propagate_version = true)]
struct Cli {
    /// Log format.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "DEVPLUG_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start and consumed at once: boxing `run`'s arguments would buy nothing. (Only the
// lean build, whose other variants are small, trips this lint.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve every resource in a config file to the kubelet until SIGTERM, SIGINT, SIGHUP or
    /// SIGQUIT.
    #[command(after_long_help = CONFIG_FORMAT)]
    Run(run::RunArgs),
    /// Show a virtual plugin's whole life on a simulated kubelet (no cluster, no root);
    /// `demo nvidia`: the nvidia backend on a fake DGX-1 through the real NVML loading path;
    /// `demo --dra`: the DRA driver with a real API server and scheduler (KUBEBUILDER_ASSETS).
    #[cfg(feature = "tools")]
    Demo(DemoArgs),
    /// Look at device plugin sockets as the kubelet would: options, devices, health changes,
    /// allocations. Works with any vendor's plugin.
    #[cfg(feature = "tools")]
    Inspect(inspect::InspectArgs),
    /// Check a config file as `run` would load it, then exit: 0 if valid, 1 with the error;
    /// `--discover`: also what each resource finds (3 if one has no healthy device).
    #[command(after_long_help = check_config::EXIT_STATUS)]
    CheckConfig(check_config::CheckConfigArgs),
    /// Extended resources on a Node's status, through the API server: set, remove (also the
    /// clean uninstall of a device plugin's leftover capacity 0), list.
    #[cfg(feature = "cluster")]
    Capacity(capacity::CapacityArgs),
    /// The node labels `run` wrote (`node_labels:`), through the API server: list, and remove
    /// them and nothing else (the uninstall).
    #[cfg(feature = "cluster")]
    Labels(labels::LabelsArgs),
    /// Print a shell completion script, e.g. `devplug completions bash >
    /// /etc/bash_completion.d/devplug`.
    #[cfg(feature = "tools")]
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `devplug man > devplug.1; man ./devplug.1`; with
    /// `--dir`, write devplug.1 and one page per command (devplug-run.1, ...) there.
    #[cfg(feature = "tools")]
    Man {
        /// Write every page into this existing folder instead of printing devplug(1).
        #[arg(long, value_name = "DIR")]
        dir: Option<std::path::PathBuf>,
    },
    /// A command this build leaves out (or a typo): see [`left_out`].
    #[cfg(not(all(feature = "cluster", feature = "tools")))]
    #[command(external_subcommand)]
    LeftOut(Vec<String>),
}

/// The error for a command that this build leaves out, naming the build that has it; any other
/// word is an unknown command.
#[cfg(not(all(feature = "cluster", feature = "tools")))]
fn left_out(args: &[String]) -> anyhow::Error {
    let name = args.first().map_or("", String::as_str);
    match name {
        "capacity" | "labels" => anyhow::anyhow!(config::not_in_this_build(name)),
        "demo" | "inspect" | "completions" | "man" => anyhow::anyhow!(
            "{name}: not in {NAME}, the device-plugin-only build; run the full `devplug` binary \
             instead (in the image: /devplug), or build with `--features tools`"
        ),
        _ => anyhow::anyhow!("unknown command {name:?}; `{NAME} --help` lists the commands"),
    }
}

/// Prints the completion script for `shell`.
#[cfg(feature = "tools")]
fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), NAME, &mut script);
    output::print(&String::from_utf8_lossy(&script))
}

/// The config file's format, at the end of `run --help` and in devplug-run(1).
const CONFIG_FORMAT: &str = "\
Config file (YAML; an unknown field is an error naming it):
  registration: socket            # or watcher (the plugin watcher); per resource too
  resources:
    - name: example.com/npu       # the extended resource pods ask for
      virtual: { count: 8 }       # exactly one backend: virtual, files, hostdev,
                                  #   nvidia, amdgpu, intel_gpu, vfio, qat, ascend
                                  #   or fpga (or advertise:)
      health_hold_down: 5s        # a recovered device waits this long (at most 1h)
      dra: { driver: npu.example.com }   # serve it as a DRA driver instead
                                         #   (device_plugin: true: as both)
Every backend's fields are in docs/configuration.md; `devplug check-config --config FILE` checks a
file as run loads it, naming the line, the field and the allowed values.";

/// Prints devplug(1), or with `dir` writes it and a page per command there.
#[cfg(feature = "tools")]
fn man(dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let Some(dir) = dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(Cli::command()).render(&mut page)?;
        return output::print(&String::from_utf8_lossy(&page));
    };
    clap_mangen::generate_to(Cli::command(), dir)
        .and_then(|()| write_run_page(dir))
        .with_context(|| format!("cannot write the man pages into {}", dir.display()))?;
    let mut written: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(NAME) && name.ends_with(".1"))
        .collect();
    written.sort();
    output::print(&format!("{}\n", written.join("\n")))
}

/// devplug-run(1) again, with the config file's format in a CONFIG FILE section kept as
/// written (clap_mangen would fill its lines into one paragraph under EXTRA).
#[cfg(feature = "tools")]
fn write_run_page(dir: &std::path::Path) -> std::io::Result<()> {
    let mut cli = Cli::command().disable_help_subcommand(true);
    cli.build();
    let Some(run) = cli.find_subcommand("run").cloned() else {
        return Ok(());
    };
    let man = clap_mangen::Man::new(run);
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    man.render_options_section(&mut page)?;
    page.extend_from_slice(b".SH \"CONFIG FILE\"\n.nf\n");
    for line in CONFIG_FORMAT.lines() {
        // `\&` first: a line may start with a space or a dot, which roff would act on.
        page.extend_from_slice(format!("\\&{}\n", line.replace('\\', "\\e")).as_bytes());
    }
    page.extend_from_slice(b".fi\n");
    man.render_version_section(&mut page)?;
    std::fs::write(dir.join(man.get_filename()), page)
}

/// `devplug demo --dra`.
#[cfg(all(feature = "cluster", feature = "dev-demos"))]
fn demo_dra(runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    runtime.block_on(demo_dra::demo())
}

/// `devplug demo --dra` in a build without the API client: the refusal.
#[cfg(all(not(feature = "cluster"), feature = "dev-demos"))]
fn demo_dra(_: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    Err(anyhow::anyhow!(config::not_in_this_build("demo --dra")))
}

/// `devplug demo nvidia`.
#[cfg(feature = "dev-demos")]
fn demo_nvidia(
    runtime: &tokio::runtime::Runtime,
    library: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    runtime.block_on(demo_nvidia::demo(library))
}

/// `demo --dra` and `demo nvidia` in a build without the demos on fake hardware (the image's):
/// the refusal, naming the build that has them.
#[cfg(all(feature = "tools", not(feature = "dev-demos")))]
fn dev_demo_left_out(which: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "demo {which}: not in this build of {NAME}: the demos on fake hardware and a local \
         control plane are built with the dev-demos feature, which the image leaves out; run it \
         from a checkout (`cargo run -- demo {which}`)"
    )
}

/// `devplug demo --dra` without the dev-demos feature.
#[cfg(all(feature = "tools", not(feature = "dev-demos")))]
fn demo_dra(_: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    Err(dev_demo_left_out("--dra"))
}

/// `devplug demo nvidia` without the dev-demos feature.
#[cfg(all(feature = "tools", not(feature = "dev-demos")))]
fn demo_nvidia(_: &tokio::runtime::Runtime, _: Option<&std::path::Path>) -> anyhow::Result<()> {
    Err(dev_demo_left_out("nvidia"))
}

/// Which demo.
#[cfg(feature = "tools")]
#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// `npu` (default): a virtual NPU plugin; `nvidia`: NVIDIA GPUs on the fake NVML.
    #[arg(default_value = "npu", value_parser = ["npu", "nvidia"])]
    what: String,
    /// The fake NVML library for `nvidia` (default: libfake_nvml.so next to this binary).
    #[arg(long)]
    library: Option<std::path::PathBuf>,
    /// The DRA path instead: etcd, kube-apiserver and kube-scheduler from KUBEBUILDER_ASSETS
    /// (default: target/k8s-assets), a Node, the simulated kubelet and devplug's DRA driver; a
    /// ResourceClaim allocated by the scheduler and prepared through the driver. No root.
    #[arg(long, conflicts_with_all = ["what", "library"], hide = !config::HAS_CLUSTER)]
    dra: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    // The status of a command that succeeded but has a verdict to give (`check-config`).
    let mut status = ExitCode::SUCCESS;
    let result = match cli.command {
        Command::Run(args) => {
            logging::init(cli.log_format, "info");
            runtime.block_on(run::run(args))
        }
        #[cfg(feature = "tools")]
        Command::Demo(args) => {
            // kube-rs logs every 5xx at ERROR, and `demo --dra` polls /readyz (500 until the
            // API server is ready); its own errors end the demo with a message anyway.
            let filter = if args.dra {
                "error,kube_client::client::builder=off"
            } else {
                "error"
            };
            logging::init(cli.log_format, filter);
            if args.dra {
                demo_dra(&runtime)
            } else if args.what == "nvidia" {
                demo_nvidia(&runtime, args.library.as_deref())
            } else {
                runtime.block_on(demo::demo())
            }
        }
        #[cfg(feature = "tools")]
        Command::Inspect(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(inspect::inspect(args))
        }
        #[cfg(feature = "cluster")]
        Command::Capacity(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(capacity::capacity(args))
        }
        #[cfg(feature = "cluster")]
        Command::Labels(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(labels::labels(args))
        }
        Command::CheckConfig(args) => {
            let warnings = args.json.then(logging::Warnings::default);
            logging::init_capturing(cli.log_format, "warn", warnings.clone());
            check_config::check_config(&args, &runtime, warnings.as_ref()).map(|verdict| {
                if verdict == check_config::Verdict::NotReady {
                    status = ExitCode::from(check_config::EXIT_NOT_READY);
                }
            })
        }
        #[cfg(feature = "tools")]
        Command::Completions { shell } => completions(shell),
        #[cfg(feature = "tools")]
        Command::Man { dir } => man(dir.as_deref()),
        #[cfg(not(all(feature = "cluster", feature = "tools")))]
        Command::LeftOut(args) => Err(left_out(&args)),
    };
    match result {
        // Output that could not all be written is not a success (`devplug demo | head`).
        Ok(()) if output::stdout_closed() => ExitCode::FAILURE,
        Ok(()) => status,
        // The reader went away: nothing to tell it.
        Err(err) if output::is_stdout_closed(&err) => ExitCode::FAILURE,
        Err(err) => {
            fatal(cli.log_format, &output::error_text(&err));
            ExitCode::FAILURE
        }
    }
}

/// The error that ends the program, on stderr: as text, or with `--log-format json` as one JSON
/// log line whose message is the error's first line and whose `snippet` field holds the rest
/// (a config file's lines around the error), so that log readers keep the message readable.
fn fatal(format: LogFormat, text: &str) {
    if format == LogFormat::Json && tracing::dispatcher::has_been_set() {
        match text.split_once('\n') {
            Some((message, snippet)) => tracing::error!(snippet, "{message}"),
            None => tracing::error!("{text}"),
        }
    } else {
        eprintln!("error: {text}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResourceKind;
    #[cfg(not(feature = "tools"))]
    use clap::CommandFactory as _;
    use std::collections::BTreeSet;

    /// The words of `text`: runs of letters, digits and `_`, so that `intel_gpu` is one word.
    fn words(text: &str) -> BTreeSet<&str> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect()
    }

    /// A file of the repository, by its path from the root.
    fn repo_file(path: &str) -> String {
        let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(path);
        std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
    }

    /// Every list of backends a user reads names each key of the config file, so that a new
    /// backend cannot be left out of them.
    #[test]
    fn every_list_of_backends_names_every_backend_key() {
        let mut cli = Cli::command();
        cli.build();
        let help = cli.render_long_help().to_string();
        let run_help = cli
            .find_subcommand_mut("run")
            .unwrap()
            .render_long_help()
            .to_string();
        let chart = repo_file("deploy/helm/devplug/Chart.yaml");
        let chart_description = chart
            .lines()
            .find(|l| l.starts_with("description:"))
            .unwrap()
            .to_owned();
        let readme = repo_file("README.md");
        let backends_table: String = readme
            .split("\n## ")
            .find(|section| section.starts_with("Backends\n"))
            .unwrap()
            .lines()
            .filter(|l| l.starts_with('|'))
            .collect::<Vec<_>>()
            .join("\n");
        let deploy_readme = repo_file("deploy/README.md");
        let examples_row = deploy_readme
            .lines()
            .find(|l| l.starts_with("| `examples/` |"))
            .unwrap()
            .to_owned();
        let texts = [
            (format!("{NAME} --help"), help),
            (format!("{NAME} run --help"), run_help),
            ("the chart's description".to_owned(), chart_description),
            ("README.md's backends table".to_owned(), backends_table),
            ("deploy/README.md's examples row".to_owned(), examples_row),
        ];
        for (what, text) in &texts {
            let found = words(text);
            let missing: Vec<&str> = ResourceKind::KEYS
                .into_iter()
                .filter(|key| !found.contains(key))
                .collect();
            assert!(
                missing.is_empty(),
                "{what} does not name {missing:?}:\n{text}"
            );
        }
    }
}
