//! gRPC over Unix sockets: channels dialled the way the kubelet dials
//! (`:authority` is `localhost`, never the socket path, and the connection is made eagerly), and
//! servers on a listener we accept from ourselves, each connection wrapped in
//! [`AuthorityFix`] so that clients sending the socket path as `:authority` are served too.

use crate::authority::AuthorityFix;
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;
use tonic::transport::server::Router;
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

/// Serves `router` on `listener` in a new task until `shutdown` resolves; a server failure is
/// logged, naming `what` (e.g. `"plugin server for vendor.example/npu"`).
///
/// Every accepted connection goes through [`AuthorityFix`], so kubelets up to 1.25 (which send the
/// socket path as `:authority`) reach the services like newer ones.
pub fn spawn_server(
    router: Router,
    listener: UnixListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    what: String,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let served = router
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityFix::new)),
                shutdown,
            )
            .await;
        if let Err(err) = served {
            tracing::error!(%err, "{what} failed");
        }
    })
}
