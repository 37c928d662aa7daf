//! The `devplug` command: `run` serves device plugins from a config file; `demo` shows the whole
//! lifecycle on the embedded kubelet simulator, with no cluster and no root; `inspect` looks at
//! any device plugin socket as the kubelet would; `check-config` validates a config file;
//! `capacity` sets, removes and lists extended resources on a Node through the API server.

mod capacity;
mod check_config;
mod config;
mod demo;
mod duration;
mod endpoints;
mod http;
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
    /// Show a virtual plugin's whole life on a simulated kubelet (no cluster, no root).
    Demo,
    /// Look at device plugin sockets as the kubelet would: options, devices, health changes,
    /// allocations. Works with any vendor's plugin.
    Inspect(inspect::InspectArgs),
    /// Check a config file as `run` would load it, then exit: 0 if valid, 1 with the error.
    CheckConfig(check_config::CheckConfigArgs),
    /// Extended resources on a Node's status, through the API server: set, remove (also the
    /// clean uninstall of a device plugin's leftover capacity 0), list.
    Capacity(capacity::CapacityArgs),
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
        Command::Demo => {
            logging::init(cli.log_format, "error");
            runtime.block_on(demo::demo())
        }
        Command::Inspect(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(inspect::inspect(args))
        }
        Command::Capacity(args) => {
            logging::init(cli.log_format, "warn");
            runtime.block_on(capacity::capacity(args))
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
