//! The shutdown signal: SIGTERM (what the kubelet's container runtime sends) or SIGINT.

use tokio::signal::unix::{signal, SignalKind};

/// Resolves on the first SIGTERM or SIGINT, logging which one arrived.
pub async fn shutdown_signal() {
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
                _ = int.recv() => tracing::info!("SIGINT received; shutting down"),
            }
        }
        (Err(err), _) | (_, Err(err)) => {
            tracing::error!(%err, "cannot listen for signals; running until killed");
            std::future::pending::<()>().await;
        }
    }
}
