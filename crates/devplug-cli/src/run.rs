//! `devplug run`: serve every resource of a config file until SIGTERM or SIGINT.

use crate::config::Config;
use anyhow::Context;
use devplug::Host;
use std::path::PathBuf;

/// Arguments of `devplug run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The config file (YAML) listing the resources to serve.
    #[arg(long, short, env = "DEVPLUG_CONFIG")]
    pub config: PathBuf,
    /// The kubelet's device-plugins folder.
    #[arg(long, env = "DEVPLUG_KUBELET_DIR", default_value = devplug::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
}

/// Runs until a shutdown signal, then removes our sockets and returns.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config)?;
    let host = Host::new(&args.kubelet_dir)?;
    for resource in &config.resources {
        let backend = resource
            .build()
            .map_err(|(key, err)| anyhow::anyhow!("{}: {key}.{err}", resource.name))?;
        host.add_shared(&resource.name, backend)
            .with_context(|| format!("cannot serve {}", resource.name))?;
    }
    tracing::info!(
        resources = config.resources.len(),
        kubelet_dir = %args.kubelet_dir.display(),
        "devplug running"
    );
    devplug::shutdown_signal().await;
    host.shutdown().await;
    tracing::info!("sockets removed; bye");
    Ok(())
}
