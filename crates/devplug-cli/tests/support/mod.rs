//! Running the `devplug` binary in tests: start `devplug run`, stop it with SIGTERM, read its log.
// Each test binary includes this module and uses part of it.
#![allow(dead_code)]

#[cfg(feature = "cluster")]
pub mod cluster;

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_devplug");

/// A running `devplug run`.
pub struct Devplug {
    child: Child,
}

impl Devplug {
    /// Starts `devplug run --config <config> --kubelet-dir <plugins>` with logs on stderr.
    pub fn run(config: &Path, plugins: &Path) -> Devplug {
        Devplug::run_with(config, plugins, &[])
    }

    /// Like [`Devplug::run`], with more arguments.
    pub fn run_with(config: &Path, plugins: &Path, extra: &[&str]) -> Devplug {
        let child = Command::new(BIN)
            .arg("run")
            .arg("--config")
            .arg(config)
            .arg("--kubelet-dir")
            .arg(plugins)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Devplug { child }
    }

    /// Sends SIGTERM and waits for the exit; returns the status and everything logged.
    pub async fn terminate(self, wait: Duration) -> (ExitStatus, String) {
        self.stop_with("TERM", wait).await
    }

    /// Sends `signal` (a name `kill` takes, e.g. `HUP`) and waits for the exit; returns the
    /// status and everything logged.
    pub async fn stop_with(mut self, signal: &str, wait: Duration) -> (ExitStatus, String) {
        let pid = self.child.id().to_string();
        let killed = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap();
        assert!(killed.success());
        let sent = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                sent.elapsed() < wait,
                "devplug did not exit after SIG{signal}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let mut stderr = String::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
        }
        (status, stderr)
    }
}

impl Drop for Devplug {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nobody listens on now (for `--metrics-addr`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// GET `path` on `127.0.0.1:port`; the status code and body, or `None` if nothing answered.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let code = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}
