//! gRPC channels over Unix sockets, dialled the way the kubelet dials (protocol.md §3.3):
//! `:authority` is `localhost`, never the socket path, and the connection is made eagerly.

use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Error};

/// Connects to the gRPC server on the Unix socket at `path`, failing after `timeout`.
///
/// Requests carry `:authority: localhost`, as kubelets since 1.26 send to device plugins.
pub async fn connect(path: &Path, timeout: Duration) -> Result<Channel, Error> {
    let path: PathBuf = path.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
