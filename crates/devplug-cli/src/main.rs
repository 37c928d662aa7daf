//! The `devplug` command: `run` serves device plugins from a config file; `demo` shows the whole
//! lifecycle on the embedded kubelet simulator, with no cluster and no root; `inspect` looks at
//! any device plugin socket as the kubelet would; `check-config` validates a config file.

mod check_config;
mod config;
mod demo;
mod demo_nvidia;
mod duration;
mod endpoints;
mod inspect;
mod logging;
mod reload;
mod run;

use clap::{Parser, Subcommand};
use logging::LogFormat;
use std::process::ExitCode;

/// Kubernetes device plugins: virtual devices, device files and host device nodes, served to the
/// kubelet over the device plugin API v1beta1.
#[derive(Debug, Parser)]
#[command(name = "devplug", version, propagate_version = true)]
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
    /// `demo nvidia`: the nvidia backend on a fake DGX-1 through the real NVML loading path.
    Demo(DemoArgs),
    /// Look at device plugin sockets as the kubelet would: options, devices, health changes,
    /// allocations. Works with any vendor's plugin.
    Inspect(inspect::InspectArgs),
    /// Check a config file as `run` would load it, then exit: 0 if valid, 1 with the error.
    CheckConfig(check_config::CheckConfigArgs),
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
            logging::init(cli.log_format, "error");
            if args.what == "nvidia" {
                runtime.block_on(demo_nvidia::demo(args.library.as_deref()))
            } else {
                runtime.block_on(demo::demo())
            }
        }
        Command::Inspect(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(inspect::inspect(args))
        }
        Command::CheckConfig(args) => {
            logging::init(cli.log_format, "warn");
            check_config::check_config(&args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
