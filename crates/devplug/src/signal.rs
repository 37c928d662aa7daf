//! The shutdown signal: SIGTERM (what the kubelet's container runtime sends), SIGINT (Ctrl-C),
//! SIGHUP (the terminal went away) or SIGQUIT. Each ends the program the same clean way:
//! streams closed, sockets removed, exit 0. Without a handler, SIGHUP and SIGQUIT would kill
//! the process and leave its sockets behind.

use std::future::Future;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// Installs the handlers now and resolves on the first SIGTERM, SIGINT, SIGHUP or SIGQUIT,
/// logging which one arrived. Call it first thing: a signal that comes before the call kills
/// the process the default way. Must be called inside a tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    let listen = |kind| signal(kind).map_err(|err| (err, kind));
    let streams = (|| {
        Ok::<[Signal; 4], (std::io::Error, SignalKind)>([
            listen(SignalKind::terminate())?,
            listen(SignalKind::interrupt())?,
            listen(SignalKind::hangup())?,
            listen(SignalKind::quit())?,
        ])
    })();
    async move {
        let [mut term, mut int, mut hup, mut quit] = match streams {
            Ok(streams) => streams,
            Err((err, kind)) => {
                tracing::error!(%err, signal = ?kind, "cannot listen for signals; running until killed");
                return std::future::pending().await;
            }
        };
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = hup.recv() => "SIGHUP",
            _ = quit.recv() => "SIGQUIT",
        };
        tracing::info!("{name} received; shutting down");
    }
}
