//! The DRA driver: the same NPUs under the driver name `npu.example.com`, published as
//! ResourceSlices, each claim prepared into a CDI spec. Needs the API server (in-cluster, or
//! the kubeconfig) and this node's name in `NODE_NAME`.

use devplug_dra::kubelet::KubeletDirs;
use devplug_dra::{DraDriver, DraDriverSettings};
use npu_plugin::Npus;
use std::path::Path;
use std::sync::Arc;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    // Colours only on a terminal: a log file or a pipe gets plain text.
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    // An error as a sentence (with its causes), not as Rust's Debug output of the error value.
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            let mut message = format!("npu-dra: {err}");
            let mut source = err.source();
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("{message}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let stop = devplug::shutdown_signal();
    let settings = DraDriverSettings {
        driver: "npu.example.com".to_owned(),
        node: std::env::var("NODE_NAME").map_err(|_| "set NODE_NAME to this node's name")?,
        dirs: KubeletDirs::beside(Path::new(devplug::DEFAULT_KUBELET_DIR)),
        cdi_dir: devplug::cdi::DEFAULT_CDI_DIR.into(),
        no_execute_after: None,
        device_metadata: false,
    };
    let client = kube::Client::try_default().await?;
    let driver = DraDriver::start(settings, Arc::new(Npus::discover(4)), client).await?;
    stop.await;
    for problem in driver.shutdown().await {
        eprintln!("at shutdown: {problem}");
    }
    Ok(())
}
