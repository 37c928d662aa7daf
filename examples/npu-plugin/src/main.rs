//! The device plugin: the node's NPUs as the extended resource `vendor.example/npu`.

use devplug::Host;
use npu_plugin::Npus;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    // Log lines on stdout, INFO and up: "waiting for the kubelet socket", "registered with the
    // kubelet". Without a subscriber, a plugin whose kubelet is missing says nothing at all.
    // Colours only on a terminal: a log file or a pipe gets plain text.
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    // An error as a sentence, not as Rust's Debug output of the error value.
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("npu-plugin: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), devplug::HostError> {
    // First, so that a SIGTERM or Ctrl-C that comes while starting ends the plugin cleanly too.
    let stop = devplug::shutdown_signal();
    // The kubelet's device-plugins folder, unless an argument names another one.
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| devplug::DEFAULT_KUBELET_DIR.to_owned());
    let host = Host::new(dir)?;
    host.add("vendor.example/npu", Npus::discover(4))?;
    stop.await;
    host.shutdown().await;
    Ok(())
}
