//! Log output: `tracing` to stderr, as text or JSON, filtered by `RUST_LOG` (default `info`).
//! Text is coloured only when stderr is a terminal and `NO_COLOR` is unset or empty
//! (<https://no-color.org>), so log files and `kubectl logs` get plain text.
//!
//! `RUST_LOG` takes a level and `target=level` directives (`info`, `warn,devplug=debug`), parsed
//! by `tracing_subscriber`'s `Targets` filter. Span and field filters (`[span{x=1}]`) are not
//! supported: they need a regex engine, which was a sixth of the binary's resident code
//! (docs/benchmarks.md, "Memory"). A value that does not parse is reported and the default used.

use clap::ValueEnum;
use std::ffi::OsString;
use std::io::IsTerminal;
use std::str::FromStr;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;

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

/// The filter for `rust_log` (the value of `RUST_LOG`), or `default_filter` when it is unset
/// or empty; an error names what did not parse.
pub fn filter(rust_log: Option<&str>, default_filter: &str) -> (Targets, Option<String>) {
    let fallback = || Targets::from_str(default_filter).unwrap_or_default();
    match rust_log.map(str::trim).filter(|v| !v.is_empty()) {
        None => (fallback(), None),
        Some(value) => match Targets::from_str(value) {
            Ok(targets) => (targets, None),
            Err(err) => (
                fallback(),
                Some(format!(
                    "RUST_LOG={value:?} is not understood ({err}); using {default_filter:?}. \
                     It takes a level and target=level directives, e.g. warn,devplug=debug"
                )),
            ),
        },
    }
}

/// Installs the global subscriber. `default_filter` applies when `RUST_LOG` is unset.
pub fn init(format: LogFormat, default_filter: &str) {
    init_capturing(format, default_filter, None);
}

/// [`init`], also keeping every warning and error in `warnings` (whatever `RUST_LOG` says), for
/// a command that reports them in its output (`check-config --json`).
pub fn init_capturing(format: LogFormat, default_filter: &str, warnings: Option<Warnings>) {
    let warn = tracing_subscriber::filter::LevelFilter::WARN;
    let rust_log = std::env::var("RUST_LOG").ok();
    let (targets, problem) = filter(rust_log.as_deref(), default_filter);
    let colour = use_colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => tracing_subscriber::registry()
            .with(layer.with_filter(targets))
            .with(warnings.map(|w| w.with_filter(warn)))
            .init(),
        LogFormat::Json => tracing_subscriber::registry()
            .with(layer.json().with_filter(targets))
            .with(warnings.map(|w| w.with_filter(warn)))
            .init(),
    }
    if let Some(problem) = problem {
        tracing::warn!("{problem}");
    }
}

/// The warnings and errors logged since the last [`Warnings::take`], each as its message
/// followed by its other fields (`field=value`). A handle: clones share one list.
#[derive(Debug, Clone, Default)]
pub struct Warnings(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Warnings {
    /// The lines kept so far, leaving the list empty.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut line = EventLine::default();
        event.record(&mut line);
        let text = if line.fields.is_empty() {
            line.message
        } else {
            format!("{}{}", line.message, line.fields)
        };
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(text);
    }
}

/// One event as text: its message, then ` field=value` for each other field.
#[derive(Default)]
struct EventLine {
    message: String,
    fields: String,
}

impl tracing::field::Visit for EventLine {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            self.message = value.to_owned();
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_directives_and_fallback() {
        use tracing::Level;
        let (t, problem) = filter(Some("warn,devplug=debug"), "info");
        assert!(problem.is_none());
        assert!(t.would_enable("devplug::host", &Level::DEBUG));
        assert!(!t.would_enable("h2::codec", &Level::INFO));
        assert!(t.would_enable("h2::codec", &Level::WARN));
        let (t, problem) = filter(None, "info");
        assert!(problem.is_none());
        assert!(t.would_enable("anything", &Level::INFO));
        assert!(!t.would_enable("anything", &Level::DEBUG));
        let (t, problem) = filter(Some("devplug=loud"), "error");
        assert!(problem.unwrap().contains("not understood"));
        assert!(t.would_enable("x", &Level::ERROR));
        assert!(!t.would_enable("x", &Level::WARN));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some(OsString::new())));
        assert!(!use_colour(true, Some(OsString::from("1"))));
        assert!(!use_colour(false, None));
        assert!(!use_colour(false, Some(OsString::from("1"))));
    }
}
