//! The training run: `devplug run` under callgrind, driven through what a node agent does on a
//! node, against the kubelet simulator over real sockets in a temp folder.
//!
//! What runs here is what gets packed at the front of the binary, in two scenarios:
//!
//! - [`Scenario::Core`], what every node agent runs: start and config parsing, three `virtual`
//!   resources of 1,000 devices (the memory goal's case) registered on `kubelet.sock`,
//!   ListAndWatch, Allocate, the metrics and health endpoints, shutdown on SIGTERM;
//! - [`Scenario::Broad`], the same plus a `files` resource registered through the plugin
//!   watcher, a `hostdev` resource on `/dev/null`, the PodResources client, a device turning
//!   unhealthy and a new one appearing, a config reload, and a kubelet restart with
//!   re-registration.
//!
//! The core's functions go first, then what only the broad run added, so the block every node
//! touches stays dense. Code neither run reaches (the GPU backends' discovery, error paths) still
//! works; it is only left out of the packed block, so a node that runs it keeps a little more of
//! the binary resident.

use anyhow::{bail, Context};
use kubelet_sim::{Kubelet, NodeState, SimConfig};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Under callgrind the process runs 20–50 times slower, and CI machines are busy: generous.
const WAIT: Duration = Duration::from_secs(180);
const VIRTUAL: [&str; 3] = [
    "train.devplug.dev/a",
    "train.devplug.dev/b",
    "train.devplug.dev/c",
];
const FILES: &str = "train.devplug.dev/files";
const HOSTDEV: &str = "train.devplug.dev/null";
const ALLOCATIONS: usize = 30;

/// Which paths a training run takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// What every node agent runs: three virtual resources, allocations, endpoints, SIGTERM.
    Core,
    /// The core plus files (plugin watcher), hostdev, PodResources, health changes, a config
    /// reload and a kubelet restart.
    Broad,
}

/// Runs `binary` (with its symbol table) under callgrind through `scenario` in the empty folder
/// `work`; returns callgrind's output file.
pub async fn run(binary: &Path, scenario: Scenario, work: &Path) -> anyhow::Result<PathBuf> {
    let kubelet_dir = work.join("kubelet");
    let plugins = kubelet_dir.join("device-plugins");
    let sim = SimConfig::default()
        .with_watcher_beside(&plugins)
        .with_pod_resources_beside(&plugins);
    let registry = sim.plugins_registry.clone().context("no watcher folder")?;
    let pod_resources = sim
        .pod_resources_socket
        .clone()
        .context("no pod resources")?;
    let mut kubelet = Kubelet::start_with(&plugins, sim).await?;

    let files = work.join("files");
    std::fs::create_dir_all(&files)?;
    for id in ["cola-0", "cola-1", "cola-2"] {
        std::fs::write(files.join(id), "")?;
    }
    let config = work.join("config.yaml");
    std::fs::write(&config, config_text(scenario, &files, 1000))?;
    let port = free_port()?;
    let out = work.join("callgrind.out");
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=callgrind")
        .arg("--demangle=no")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(binary)
        .arg("run")
        .arg("--config")
        .arg(&config)
        .arg("--kubelet-dir")
        .arg(&plugins)
        .arg("--metrics-addr")
        .arg(format!("127.0.0.1:{port}"));
    if scenario == Scenario::Broad {
        command
            .arg("--plugins-registry-dir")
            .arg(&registry)
            .arg("--plugin-socket-dir")
            .arg(kubelet_dir.join("plugins").join("devplug"))
            .arg("--pod-resources-socket")
            .arg(&pod_resources);
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(work.join("run.log"))?)
        .spawn()
        .context("starting valgrind")?;
    let driven = drive(&mut kubelet, scenario, &files, &config, port).await;
    let stopped = stop(&mut child).await;
    kubelet.stop().await;
    let log = || {
        std::fs::read_to_string(work.join("run.log"))
            .unwrap_or_default()
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    };
    driven.with_context(|| format!("the training run failed; its log ends:\n{}", log()))?;
    stopped
        .with_context(|| format!("devplug run did not end cleanly; its log ends:\n{}", log()))?;
    Ok(out)
}

/// The config: three virtual resources; for the broad run also files through the plugin watcher,
/// and hostdev.
fn config_text(scenario: Scenario, files: &Path, count: usize) -> String {
    let mut text = String::from("resources:\n");
    for name in VIRTUAL {
        text.push_str(&format!(
            "  - name: {name}\n    virtual: {{ count: {count}, numa_nodes: 2 }}\n"
        ));
    }
    if scenario == Scenario::Core {
        return text;
    }
    text.push_str(&format!(
        "  - name: {FILES}\n    registration: watcher\n    files: {{ dir: {} }}\n",
        files.display()
    ));
    text.push_str(&format!(
        "  - name: {HOSTDEV}\n    hostdev: {{ groups: [ {{ paths: [\"/dev/null\"] }} ], count: 4 }}\n"
    ));
    text
}

async fn drive(
    kubelet: &mut Kubelet,
    scenario: Scenario,
    files: &Path,
    config: &Path,
    port: u16,
) -> anyhow::Result<()> {
    let broad = scenario == Scenario::Broad;
    kubelet
        .wait_for(WAIT, |n: &NodeState| {
            let virtuals = VIRTUAL.iter().all(|r| n.capacity(r) == (1000, 1000));
            let others = !broad || (n.capacity(FILES) == (3, 3) && n.capacity(HOSTDEV) == (4, 4));
            (virtuals && others).then_some(())
        })
        .await
        .context("waiting for every resource to register with its devices")?;
    allocations(kubelet, broad, "first").await?;
    for path in ["/metrics", "/healthz", "/readyz"] {
        http_get(port, path).await?;
    }
    if !broad {
        return Ok(());
    }

    // A device turns unhealthy, a new one appears, the broken one heals.
    std::fs::write(files.join("cola-1"), "bubbles gone flat\n")?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(FILES) == (3, 2)).then_some(()))
        .await
        .context("waiting for cola-1 to turn unhealthy")?;
    std::fs::write(files.join("cola-3"), "")?;
    std::fs::write(files.join("cola-1"), "")?;
    kubelet
        .wait_for(WAIT, |n| (n.capacity(FILES) == (4, 4)).then_some(()))
        .await
        .context("waiting for cola-3 and a healthy cola-1")?;

    // A config reload that changes every virtual resource.
    std::fs::write(config, config_text(scenario, files, 999))?;
    kubelet
        .wait_for(WAIT, |n| {
            VIRTUAL.iter().all(|r| n.capacity(r).0 == 999).then_some(())
        })
        .await
        .context("waiting for the reloaded config")?;

    // A kubelet restart: every socket in device-plugins/ deleted, registration again.
    kubelet.restart().await?;
    kubelet
        .wait_for(WAIT, |n| {
            let virtuals = VIRTUAL.iter().all(|r| n.capacity(r) == (999, 999));
            (virtuals && n.capacity(FILES) == (4, 4) && n.capacity(HOSTDEV) == (4, 4)).then_some(())
        })
        .await
        .context("waiting for re-registration after the kubelet restart")?;
    allocations(kubelet, broad, "second").await?;
    http_get(port, "/metrics").await?;
    Ok(())
}

/// Pods asking for devices of every resource, admitted and removed.
async fn allocations(kubelet: &Kubelet, broad: bool, round: &str) -> anyhow::Result<()> {
    for i in 0..ALLOCATIONS {
        let pod = format!("train-{round}-{i}");
        for resource in VIRTUAL {
            kubelet
                .allocate(&pod, "main", resource, 2)
                .await
                .with_context(|| format!("allocating 2 of {resource}"))?;
        }
        if !broad {
            kubelet.remove_pod(&pod);
            continue;
        }
        kubelet
            .allocate(&pod, "files", FILES, 1)
            .await
            .with_context(|| format!("allocating 1 of {FILES}"))?;
        kubelet
            .allocate(&pod, "null", HOSTDEV, 1)
            .await
            .with_context(|| format!("allocating 1 of {HOSTDEV}"))?;
        kubelet.remove_pod(&pod);
    }
    Ok(())
}

/// A GET on the metrics listener; the answer must be 200.
async fn http_get(port: u16, path: &str) -> anyhow::Result<()> {
    let mut stream =
        tokio::time::timeout(WAIT, tokio::net::TcpStream::connect(("127.0.0.1", port)))
            .await
            .context("connecting to the metrics listener: timed out")??;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .with_context(|| format!("GET {path}: timed out"))??;
    let answer = String::from_utf8_lossy(&answer);
    if !answer.starts_with("HTTP/1.1 200") {
        bail!(
            "GET {path} answered {}",
            answer.lines().next().unwrap_or("")
        );
    }
    Ok(())
}

/// A port nobody listens on now.
fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

/// SIGTERM, then the exit (callgrind writes its file as the process exits); 0 expected.
async fn stop(child: &mut Child) -> anyhow::Result<()> {
    let pid = i32::try_from(child.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .context("the child's pid")?;
    if let Err(e) = rustix::process::kill_process(pid, rustix::process::Signal::TERM) {
        let _ = child.kill();
        return Err(e).context("sending SIGTERM");
    }
    for _ in 0..WAIT.as_millis() / 100 {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                return Ok(());
            }
            bail!("devplug run exited with {status}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = child.kill();
    bail!("devplug run did not exit within {WAIT:?} of SIGTERM")
}
