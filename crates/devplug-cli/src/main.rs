//! The `devplug` command: `run` serves device plugins from a config file; `demo` shows the whole
//! lifecycle on the embedded kubelet simulator, with no cluster and no root (`demo --dra`: the DRA
//! path with a real API server and scheduler); `inspect` looks at
//! any device plugin socket as the kubelet would; `check-config` validates a config file;
//! `completions` and `man` print shell completions and the man page.
//! `capacity` sets, removes and lists extended resources on a Node through the API server.
//!
//! Built without the `cluster` feature (no Kubernetes API client), the binary is `devplug-lite`:
//! the same commands but `capacity` and `demo --dra`, and `run`/`check-config` refuse a config or
//! flag that needs the API server, naming it ([`config::needs_cluster`]).

#[cfg(feature = "cluster")]
mod capacity;
mod check_config;
mod config;
mod demo;
#[cfg(feature = "cluster")]
mod demo_dra;
mod demo_nvidia;
#[cfg(feature = "cluster")]
mod dra;
mod duration;
mod endpoints;
mod http;
mod inspect;
mod listen_addr;
mod logging;
mod output;
mod reload;
mod run;

use clap::{CommandFactory, Parser, Subcommand};
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

/// Kubernetes device plugins: virtual devices, device files and host device nodes, served to the
/// kubelet over the device plugin API v1beta1.
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve every resource in a config file to the kubelet until SIGTERM.
    Run(run::RunArgs),
    /// Show a virtual plugin's whole life on a simulated kubelet (no cluster, no root);
    /// `demo nvidia`: the nvidia backend on a fake DGX-1 through the real NVML loading path;
    /// `demo --dra`: the DRA driver with a real API server and scheduler (KUBEBUILDER_ASSETS).
    Demo(DemoArgs),
    /// Look at device plugin sockets as the kubelet would: options, devices, health changes,
    /// allocations. Works with any vendor's plugin.
    Inspect(inspect::InspectArgs),
    /// Check a config file as `run` would load it, then exit: 0 if valid, 1 with the error.
    CheckConfig(check_config::CheckConfigArgs),
    /// Extended resources on a Node's status, through the API server: set, remove (also the
    /// clean uninstall of a device plugin's leftover capacity 0), list.
    #[cfg(feature = "cluster")]
    Capacity(capacity::CapacityArgs),
    /// Not in this build: says to run the full `devplug` instead.
    #[cfg(not(feature = "cluster"))]
    #[command(hide = true, disable_help_flag = true)]
    Capacity {
        /// Whatever was given; ignored.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Print a shell completion script, e.g. `devplug completions bash >
    /// /etc/bash_completion.d/devplug`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `devplug man > devplug.1; man ./devplug.1`.
    Man,
}

/// Prints the completion script for `shell`.
fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), NAME, &mut script);
    output::print(&String::from_utf8_lossy(&script))
}

/// Prints the man page of `devplug` and its subcommands, one roff document.
fn man() -> anyhow::Result<()> {
    let mut page = Vec::new();
    clap_mangen::Man::new(Cli::command()).render(&mut page)?;
    output::print(&String::from_utf8_lossy(&page))
}

/// `devplug demo --dra`, or in devplug-lite the refusal.
#[cfg(feature = "cluster")]
fn demo_dra(runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    runtime.block_on(demo_dra::demo())
}

/// `devplug demo --dra`, or in devplug-lite the refusal.
#[cfg(not(feature = "cluster"))]
fn demo_dra(_: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    Err(anyhow::anyhow!(config::not_in_this_build("demo --dra")))
}

/// Which demo.
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
    let result = match cli.command {
        Command::Run(args) => {
            logging::init(cli.log_format, "info");
            runtime.block_on(run::run(args))
        }
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
                runtime.block_on(demo_nvidia::demo(args.library.as_deref()))
            } else {
                runtime.block_on(demo::demo())
            }
        }
        Command::Inspect(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(inspect::inspect(args))
        }
        #[cfg(feature = "cluster")]
        Command::Capacity(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(capacity::capacity(args))
        }
        #[cfg(not(feature = "cluster"))]
        Command::Capacity { .. } => Err(anyhow::anyhow!(config::not_in_this_build("capacity"))),
        Command::CheckConfig(args) => {
            logging::init(cli.log_format, "warn");
            check_config::check_config(&args)
        }
        Command::Completions { shell } => completions(shell),
        Command::Man => man(),
    };
    match result {
        // Output that could not all be written is not a success (`devplug demo | head`).
        Ok(()) if output::stdout_closed() => ExitCode::FAILURE,
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away: nothing to tell it.
        Err(err) if output::is_stdout_closed(&err) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("error: {}", output::error_text(&err));
            ExitCode::FAILURE
        }
    }
}
