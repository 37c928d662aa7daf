//! `devplug inspect` without `--socket`: lists the sockets in the kubelet's device-plugins
//! folder. `kubelet.sock` is reported as the registration socket (and whether it accepts
//! connections); every other socket is asked for its options and first device list, all at
//! once; a socket that does not answer as a device plugin is listed with the reason. Files that
//! are not sockets (the kubelet's checkpoint, for one) are skipped.

use super::client::{one_line, Plugin};
use super::model::{Counts, OptionsView};
use super::render;
use devplug_proto::constants::KUBELET_SOCKET_NAME;
use serde::Serialize;
use std::io::ErrorKind;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a socket turned out to be.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SocketKind {
    /// The kubelet's registration socket.
    Kubelet {
        /// Whether something accepts connections on it.
        listening: bool,
    },
    /// A device plugin that answered.
    DevicePlugin {
        /// Its options.
        options: OptionsView,
        /// Its first device list, counted.
        counts: Counts,
    },
    /// A socket that did not answer as a device plugin.
    NotADevicePlugin {
        /// Why, in one line.
        reason: String,
    },
}

/// One socket in the folder.
#[derive(Debug, Clone, Serialize)]
pub struct SocketEntry {
    /// The file name.
    pub name: String,
    /// What it is.
    #[serde(flatten)]
    pub kind: SocketKind,
}

/// The whole listing.
#[derive(Debug, Clone, Serialize)]
pub struct Listing {
    /// The folder listed.
    pub kubelet_dir: String,
    /// Its sockets, by name.
    pub sockets: Vec<SocketEntry>,
}

/// The socket files in `dir`, sorted by name.
fn sockets_in(dir: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|err| match err.kind() {
        ErrorKind::NotFound => {
            anyhow::anyhow!("no kubelet device-plugins folder at {}", dir.display())
        }
        ErrorKind::PermissionDenied => anyhow::anyhow!(
            "permission denied: cannot list {} (run as root)",
            dir.display()
        ),
        _ => anyhow::anyhow!(
            "cannot list {}: {}",
            dir.display(),
            one_line(&err.to_string())
        ),
    })?;
    let mut sockets: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    sockets.sort();
    Ok(sockets)
}

/// Asks one socket what it is.
async fn probe(name: String, path: PathBuf, timeout: Duration) -> SocketEntry {
    let kind = if name == KUBELET_SOCKET_NAME {
        let connect = tokio::net::UnixStream::connect(&path);
        let listening = matches!(tokio::time::timeout(timeout, connect).await, Ok(Ok(_)));
        SocketKind::Kubelet { listening }
    } else {
        match ask(&path, timeout).await {
            Ok((options, counts)) => SocketKind::DevicePlugin { options, counts },
            Err(err) => SocketKind::NotADevicePlugin {
                reason: err.reason(),
            },
        }
    };
    SocketEntry { name, kind }
}

async fn ask(
    path: &Path,
    timeout: Duration,
) -> Result<(OptionsView, Counts), super::client::InspectError> {
    let mut plugin = Plugin::connect(path, timeout).await?;
    let options = plugin.options().await?;
    let (devices, _stream) = plugin.first_list().await?;
    Ok((options, Counts::of(&devices)))
}

/// Lists and probes every socket in `dir`.
pub async fn list(dir: &Path, timeout: Duration) -> anyhow::Result<Listing> {
    let mut probes = tokio::task::JoinSet::new();
    for (name, path) in sockets_in(dir)? {
        probes.spawn(probe(name, path, timeout));
    }
    let mut sockets = Vec::new();
    while let Some(done) = probes.join_next().await {
        sockets.push(done?);
    }
    sockets.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Listing {
        kubelet_dir: dir.display().to_string(),
        sockets,
    })
}

/// The listing as text: one block per socket.
pub fn render(listing: &Listing) -> String {
    let n = listing.sockets.len();
    let mut out = format!(
        "{}: {n} socket{}\n",
        listing.kubelet_dir,
        if n == 1 { "" } else { "s" }
    );
    for s in &listing.sockets {
        out.push('\n');
        out.push_str(&s.name);
        out.push('\n');
        match &s.kind {
            SocketKind::Kubelet { listening } => {
                out.push_str("  the kubelet's registration socket");
                out.push_str(if *listening {
                    " (listening)\n"
                } else {
                    " (not listening: the kubelet is down or the file is stale)\n"
                });
            }
            SocketKind::DevicePlugin { options, counts } => {
                out.push_str(&format!("  device plugin: {}\n", render::counts(counts)));
                out.push_str(&format!("  options: {}\n", render::options(options)));
            }
            SocketKind::NotADevicePlugin { reason } => {
                out.push_str(&format!("  not answering as a device plugin: {reason}\n"));
            }
        }
    }
    out
}
