//! `devplug check-config`: loads a config file exactly as `run` does and reports the result,
//! without serving anything. For CI (the deploy manifests' embedded config is checked with it)
//! and for people editing a ConfigMap.

use crate::config::{Config, ConfigError};
use std::path::PathBuf;

/// Arguments of `devplug check-config`.
#[derive(Debug, clap::Args)]
pub struct CheckConfigArgs {
    /// The config file (YAML) to check.
    #[arg(long, short, env = "DEVPLUG_CONFIG")]
    pub config: PathBuf,
}

/// Exits 0 with a one-line summary if the file would run, or returns the loader's error.
pub fn check_config(args: &CheckConfigArgs) -> anyhow::Result<()> {
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
    ))
}
