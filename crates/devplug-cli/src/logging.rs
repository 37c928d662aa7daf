//! Log output: `tracing` to stderr, as text or JSON, filtered by `RUST_LOG` (default `info`).
//! Text is coloured only when stderr is a terminal and `NO_COLOR` is unset or empty
//! (<https://no-color.org>), so log files and `kubectl logs` get plain text.

use clap::ValueEnum;
use std::ffi::OsString;
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Whether to write ANSI colour codes: only to a terminal, and not when `NO_COLOR` is set to
/// anything but the empty string.
pub fn use_colour(stderr_is_terminal: bool, no_color: Option<OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber. `default_filter` applies when `RUST_LOG` is unset.
pub fn init(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let colour = use_colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some(OsString::new())));
        assert!(!use_colour(true, Some(OsString::from("1"))));
        assert!(!use_colour(false, None));
        assert!(!use_colour(false, Some(OsString::from("1"))));
    }
}
