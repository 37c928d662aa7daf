//! Kubernetes clients whose requests are counted, client-side: every driver of the fleet gets
//! its own client (its own connection, as a node's driver has), all counting into one total, so
//! the figures are the drivers' requests alone (the kubelet stand-ins and the workload use
//! other clients).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The User-Agent of the drivers' clients (what the API server's logs and audit show).
pub const DRIVER_USER_AGENT: &str = "devplug-fleet-driver";

/// Requests made through the clients of one [`ClientFactory`].
#[derive(Debug, Default)]
pub struct ApiCount(AtomicU64);

impl ApiCount {
    /// Requests so far (a watch counts once, when it starts).
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }

    /// `n` more requests (the clients count one each).
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }
}

/// Makes clients for one kubeconfig, each counting into the same [`ApiCount`].
#[derive(Clone)]
pub struct ClientFactory {
    config: kube::Config,
    count: Arc<ApiCount>,
}

impl ClientFactory {
    /// Clients for the kubeconfig at `path` (its current context), identified as `user_agent`.
    pub async fn new(path: &Path, user_agent: &str) -> anyhow::Result<ClientFactory> {
        let file = kube::config::Kubeconfig::read_from(path)?;
        let mut config =
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await?;
        config.headers.push((
            http::header::USER_AGENT,
            http::HeaderValue::from_str(user_agent)?,
        ));
        Ok(ClientFactory {
            config,
            count: Arc::new(ApiCount::default()),
        })
    }

    /// The shared count.
    pub fn count(&self) -> Arc<ApiCount> {
        self.count.clone()
    }

    /// A new client: a connection of its own, its requests counted.
    pub fn client(&self) -> anyhow::Result<kube::Client> {
        let count = self.count.clone();
        let layer =
            tower::util::MapRequestLayer::new(move |req: http::Request<kube::client::Body>| {
                count.add(1);
                req
            });
        Ok(kube::client::ClientBuilder::try_from(self.config.clone())?
            .with_layer(&layer)
            .build())
    }
}
