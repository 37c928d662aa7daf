//! A device plugin client that behaves like the kubelet (Unix socket, `:authority: localhost`,
//! bounded waits) and turns every failure into one line that says what went wrong: no socket,
//! permission denied, a stale socket file, not a device plugin, a timeout, or the plugin's own
//! gRPC error.

use super::model::{devices_of, DeviceView, OptionsView};
use devplug_proto::constants::KUBELET_SOCKET_NAME;
use devplug_proto::uds;
use devplug_proto::v1beta1::{self as pb, device_plugin_client::DevicePluginClient};
use std::future::Future;
use std::io::ErrorKind;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::codec::Streaming;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Why a socket could not be inspected. Each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// Nothing at the path.
    #[error("no socket at {0}")]
    NoSocket(PathBuf),
    /// Something other than a socket at the path.
    #[error("{0} is not a socket")]
    NotASocket(PathBuf),
    /// The socket (or its folder) is not ours to open.
    #[error("permission denied: {0} (run as root or as the socket's owner)")]
    PermissionDenied(PathBuf),
    /// A socket file with nobody listening.
    #[error("connection refused: nothing listens on {0} (a stale socket file)")]
    Refused(PathBuf),
    /// The other side did not answer in time.
    #[error("timed out after {secs} s {what} {path}")]
    Timeout {
        /// How long we waited, in seconds.
        secs: u64,
        /// What we were waiting for.
        what: &'static str,
        /// The socket.
        path: PathBuf,
    },
    /// The socket answers, but not as a v1beta1 device plugin.
    #[error("{path} is not a device plugin: {detail}")]
    NotAPlugin {
        /// The socket.
        path: PathBuf,
        /// What it did instead.
        detail: String,
    },
    /// The connection failed for another reason.
    #[error("cannot connect to {path}: {detail}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        detail: String,
    },
    /// The plugin answered a call with an error.
    #[error("{rpc} failed: {code:?}: {message}")]
    Rpc {
        /// The call.
        rpc: &'static str,
        /// The gRPC status code.
        code: Code,
        /// The plugin's message, on one line.
        message: String,
    },
    /// ListAndWatch ended before its first message.
    #[error("the plugin ended ListAndWatch without sending a device list")]
    NoList,
}

impl InspectError {
    /// The message without the socket's path, for lists that already name the socket.
    pub fn reason(&self) -> String {
        match self {
            InspectError::NoSocket(_) => "the socket vanished".to_owned(),
            InspectError::NotASocket(_) => "not a socket".to_owned(),
            InspectError::PermissionDenied(_) => {
                "permission denied (run as root or as the socket's owner)".to_owned()
            }
            InspectError::Refused(_) => {
                "connection refused: nothing listens on it (a stale socket file)".to_owned()
            }
            InspectError::Timeout { secs, what, .. } => {
                let what = what.rsplit_once(' ').map_or(*what, |(head, _)| head);
                format!("timed out after {secs} s {what}")
            }
            InspectError::NotAPlugin { detail, .. } | InspectError::Connect { detail, .. } => {
                detail.clone()
            }
            InspectError::Rpc { .. } | InspectError::NoList => self.to_string(),
        }
    }
}

/// A connection to one device plugin socket.
pub struct Plugin {
    path: PathBuf,
    timeout: Duration,
    client: DevicePluginClient<Channel>,
    /// The socket has answered a call: later transport failures are breaks, not a sign that
    /// it does not speak gRPC.
    answered: bool,
}

/// An open ListAndWatch stream.
pub type DeviceStream = Streaming<pb::ListAndWatchResponse>;

impl Plugin {
    /// Connects to the socket at `path` as the kubelet does, waiting at most `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Plugin, InspectError> {
        let channel = channel(path, timeout).await?;
        Ok(Plugin {
            path: path.to_owned(),
            timeout,
            client: DevicePluginClient::new(channel),
            answered: false,
        })
    }

    /// Calls GetDevicePluginOptions.
    pub async fn options(&mut self) -> Result<OptionsView, InspectError> {
        let mut client = self.client.clone();
        let call = client.get_device_plugin_options(pb::Empty {});
        let options = self
            .bounded("GetDevicePluginOptions", "waiting for options from", call)
            .await?;
        Ok(options.into())
    }

    /// Opens ListAndWatch and waits for its first message.
    pub async fn first_list(&mut self) -> Result<(Vec<DeviceView>, DeviceStream), InspectError> {
        let mut client = self.client.clone();
        let call = client.list_and_watch(pb::Empty {});
        let mut stream = self
            .bounded("ListAndWatch", "waiting for ListAndWatch from", call)
            .await?;
        let first = tokio::time::timeout(self.timeout, stream.message())
            .await
            .map_err(|_| InspectError::Timeout {
                secs: self.timeout.as_secs(),
                what: "waiting for the first device list from",
                path: self.path.clone(),
            })?
            .map_err(|status| self.rpc_error("ListAndWatch", status))?
            .ok_or(InspectError::NoList)?;
        Ok((devices_of(first), stream))
    }

    /// Waits (without a time limit) for the stream's next list; `None` when the plugin ends it.
    pub async fn next_list(
        &self,
        stream: &mut DeviceStream,
    ) -> Result<Option<Vec<DeviceView>>, InspectError> {
        let message = stream
            .message()
            .await
            .map_err(|status| self.rpc_error("ListAndWatch", status))?;
        Ok(message.map(devices_of))
    }

    /// Calls Allocate with one container request for `ids`.
    pub async fn allocate(&mut self, ids: &[String]) -> Result<pb::AllocateResponse, InspectError> {
        let mut client = self.client.clone();
        let call = client.allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: ids.to_vec(),
            }],
        });
        self.bounded("Allocate", "waiting for Allocate from", call)
            .await
    }

    /// Calls GetPreferredAllocation with one container request.
    pub async fn preferred(
        &mut self,
        available: &[String],
        size: u32,
    ) -> Result<pb::PreferredAllocationResponse, InspectError> {
        let mut client = self.client.clone();
        let call = client.get_preferred_allocation(pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: available.to_vec(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: i32::try_from(size).unwrap_or(i32::MAX),
            }],
        });
        self.bounded(
            "GetPreferredAllocation",
            "waiting for GetPreferredAllocation from",
            call,
        )
        .await
    }

    /// Awaits a unary call for at most the timeout and classifies its error.
    async fn bounded<T>(
        &mut self,
        rpc: &'static str,
        what: &'static str,
        call: impl Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, InspectError> {
        let answer = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| InspectError::Timeout {
                secs: self.timeout.as_secs(),
                what,
                path: self.path.clone(),
            })?
            .map(tonic::Response::into_inner)
            .map_err(|status| self.rpc_error(rpc, status))?;
        self.answered = true;
        Ok(answer)
    }

    fn rpc_error(&self, rpc: &'static str, status: Status) -> InspectError {
        classify(&self.path, rpc, status, self.answered)
    }
}

/// Turns a failed call into an error. Before the socket has answered anything, a transport
/// failure means it does not speak gRPC; `Unimplemented` means it is not a device plugin,
/// except for GetPreferredAllocation, which a plugin may leave out.
fn classify(path: &Path, rpc: &'static str, status: Status, answered: bool) -> InspectError {
    let message = one_line(status.message());
    match status.code() {
        Code::Unimplemented if rpc != "GetPreferredAllocation" => {
            let mut detail = format!("it does not serve v1beta1.DevicePlugin/{rpc}");
            if path.file_name().is_some_and(|n| n == KUBELET_SOCKET_NAME) {
                detail.push_str(" (kubelet.sock is the kubelet's registration socket)");
            }
            InspectError::NotAPlugin {
                path: path.to_owned(),
                detail,
            }
        }
        Code::Unknown | Code::Unavailable | Code::Internal
            if !answered && is_transport_failure(&status) =>
        {
            InspectError::NotAPlugin {
                path: path.to_owned(),
                detail: format!("it does not answer gRPC ({message})"),
            }
        }
        code => InspectError::Rpc { rpc, code, message },
    }
}

/// Checks that `path` exists and is a socket.
pub fn check_socket(path: &Path) -> Result<(), InspectError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => Ok(()),
        Ok(_) => Err(InspectError::NotASocket(path.to_owned())),
        Err(err) if err.kind() == ErrorKind::NotFound => {
            Err(InspectError::NoSocket(path.to_owned()))
        }
        Err(err) if err.kind() == ErrorKind::PermissionDenied => {
            Err(InspectError::PermissionDenied(path.to_owned()))
        }
        Err(err) => Err(InspectError::Connect {
            path: path.to_owned(),
            detail: one_line(&err.to_string()),
        }),
    }
}

/// A gRPC channel to the socket at `path`, as the kubelet dials it, waiting at most `timeout`;
/// the errors say what is wrong with the path (no socket, refused, not a socket…).
pub async fn channel(path: &Path, timeout: Duration) -> Result<Channel, InspectError> {
    check_socket(path)?;
    tokio::time::timeout(timeout, uds::connect(path, timeout))
        .await
        .map_err(|_| InspectError::Timeout {
            secs: timeout.as_secs(),
            what: "connecting to",
            path: path.to_owned(),
        })?
        .map_err(|err| connect_error(path, &err))
}

/// Maps a failed dial to one of the errors above, by the I/O error underneath.
fn connect_error(path: &Path, err: &(dyn std::error::Error + 'static)) -> InspectError {
    match io_kind(err) {
        Some(ErrorKind::ConnectionRefused) => InspectError::Refused(path.to_owned()),
        Some(ErrorKind::PermissionDenied) => InspectError::PermissionDenied(path.to_owned()),
        Some(ErrorKind::NotFound) => InspectError::NoSocket(path.to_owned()),
        Some(ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof) => {
            InspectError::NotAPlugin {
                path: path.to_owned(),
                detail: format!(
                    "it closed the connection without answering gRPC ({})",
                    chain(err)
                ),
            }
        }
        _ => InspectError::Connect {
            path: path.to_owned(),
            detail: chain(err),
        },
    }
}

/// The kind of the first `std::io::Error` in an error's source chain.
fn io_kind(err: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        next = e.source();
    }
    None
}

/// True when a status comes from the connection rather than from a gRPC server.
fn is_transport_failure(status: &Status) -> bool {
    use std::error::Error;
    let mut next = status.source();
    while let Some(e) = next {
        if e.is::<tonic::transport::Error>() || e.is::<std::io::Error>() {
            return true;
        }
        next = e.source();
    }
    let message = status.message();
    message.starts_with("transport error") || message.starts_with("h2 protocol error")
}

/// An error and its sources on one line, without repeats.
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(err);
    while let Some(e) = next {
        let text = one_line(&e.to_string());
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// `text` with line breaks turned into spaces.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(rpc: &'static str, status: Status, answered: bool) -> String {
        classify(Path::new("/d/x.sock"), rpc, status, answered).to_string()
    }

    #[test]
    fn unimplemented_means_not_a_plugin_except_for_optional_calls() {
        assert_eq!(
            kind("GetDevicePluginOptions", Status::unimplemented(""), false),
            "/d/x.sock is not a device plugin: it does not serve \
             v1beta1.DevicePlugin/GetDevicePluginOptions"
        );
        assert_eq!(
            kind(
                "GetPreferredAllocation",
                Status::unimplemented("not here"),
                true
            ),
            "GetPreferredAllocation failed: Unimplemented: not here"
        );
        let kubelet = classify(
            Path::new("/d/kubelet.sock"),
            "Allocate",
            Status::unimplemented(""),
            false,
        );
        assert!(kubelet
            .to_string()
            .ends_with("(kubelet.sock is the kubelet's registration socket)"));
    }

    #[test]
    fn transport_failures_count_only_before_the_first_answer() {
        let broken = || Status::unavailable("transport error");
        assert!(kind("ListAndWatch", broken(), false).contains("does not answer gRPC"));
        assert_eq!(
            kind("ListAndWatch", broken(), true),
            "ListAndWatch failed: Unavailable: transport error"
        );
        // A plugin's own message that mentions connections is its own error.
        assert_eq!(
            kind(
                "Allocate",
                Status::internal("lost connection to the\ndriver"),
                false
            ),
            "Allocate failed: Internal: lost connection to the driver"
        );
    }
}
