//! What the command prints: stdout written through a handle, so that a reader that went away
//! (`devplug … | head`) ends the output quietly instead of panicking as `println!` does, and
//! errors printed as one line with each cause once.

use std::fmt::Write as _;
use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once a write to stdout found the reader gone.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// stdout was closed by its reader (e.g. `| head`): the program stops and exits 1 without a
/// message, as the output has nowhere to go.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct StdoutClosed;

/// Writes `text` to stdout and flushes. A closed stdout is [`StdoutClosed`] (and remembered,
/// see [`stdout_closed`]); other write errors are returned as they are.
pub fn print(text: &str) -> anyhow::Result<()> {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Err(StdoutClosed.into());
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Err(StdoutClosed.into())
        }
        Err(err) => Err(anyhow::Error::new(err).context("cannot write to stdout")),
    }
}

/// Prints one line for progress output that has no way to stop early: after the reader went
/// away the line is dropped, and [`stdout_closed`] tells the caller at the end.
#[cfg(feature = "tools")]
pub fn line(text: &str) {
    let _ = print(&format!("{text}\n"));
}

/// Whether a write to stdout found the reader gone.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// Whether `err` is (or was caused by) a closed stdout.
pub fn is_stdout_closed(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| cause.is::<StdoutClosed>())
}

/// `err` and its causes as one line, `outer: cause: cause`, leaving out a cause whose text the
/// line already holds (errors that write their source into their own message and also return
/// it from `source()` would otherwise print it twice).
pub fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.contains(&part) {
            let _ = write!(text, ": {part}");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}: {source}")]
    struct ReadError {
        path: &'static str,
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_printed_once() {
        let io = std::io::Error::from_raw_os_error(17);
        let io_text = io.to_string();
        let err = anyhow::Error::new(ReadError {
            path: "/x",
            source: io,
        })
        .context("starting");
        let text = error_text(&err);
        assert_eq!(text.matches(&io_text).count(), 1, "{text}");
        assert_eq!(text, format!("starting: cannot read /x: {io_text}"));
        // Causes that are not in the message yet are kept.
        let plain = anyhow::Error::new(std::io::Error::from_raw_os_error(2)).context("open /y");
        assert_eq!(
            error_text(&plain),
            format!("open /y: {}", std::io::Error::from_raw_os_error(2))
        );
    }

    #[test]
    fn a_closed_stdout_is_recognised_through_context() {
        let err = anyhow::Error::new(StdoutClosed).context("printing the table");
        assert!(is_stdout_closed(&err));
        assert!(!is_stdout_closed(&anyhow::anyhow!("other")));
    }
}
