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
        Self::counting_into(path, user_agent, Arc::new(ApiCount::default())).await
    }

    /// [`ClientFactory::new`], counting into `count` (shared with other factories).
    pub async fn counting_into(
        path: &Path,
        user_agent: &str,
        count: Arc<ApiCount>,
    ) -> anyhow::Result<ClientFactory> {
        let file = kube::config::Kubeconfig::read_from(path)?;
        let mut config =
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await?;
        config.headers.push((
            http::header::USER_AGENT,
            http::HeaderValue::from_str(user_agent)?,
        ));
        Ok(ClientFactory { config, count })
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

/// The drivers' clients, all counting into one total: each node's driver on a token of its own
/// node under the chart's DRA role (as a DaemonSet's pod has it; not exempt from the API
/// server's priority and fairness), where the rendered chart is at hand
/// (`DEVPLUG_HELM_RENDERED`) and the control plane is the run's own; else every driver on the
/// admin's token (or, on an existing cluster, its kubeconfig's credentials).
pub struct DriverClients {
    /// One factory per node, in the nodes' order; or one for all.
    factories: Vec<ClientFactory>,
    count: Arc<ApiCount>,
    /// Who the drivers are to the API server, for the report.
    pub identity: String,
}

impl DriverClients {
    /// The drivers' clients for the nodes `names` of the cluster whose admin is `admin`
    /// (`kubeconfig`, on `server`).
    pub async fn new(
        server: Option<&devplug_testkit::api_server::ApiServer>,
        admin: &kube::Client,
        kubeconfig: &Path,
        names: &[String],
    ) -> anyhow::Result<DriverClients> {
        let count = Arc::new(ApiCount::default());
        let Some(server) = server else {
            // An existing cluster: its kubeconfig's credentials for every driver.
            return Ok(DriverClients {
                factories: vec![
                    ClientFactory::counting_into(kubeconfig, DRIVER_USER_AGENT, count.clone())
                        .await?,
                ],
                count,
                identity: format!(
                    "the credentials of {} for every driver",
                    kubeconfig.display()
                ),
            });
        };
        if std::env::var_os("DEVPLUG_HELM_RENDERED").is_none() {
            return Ok(DriverClients {
                factories: vec![
                    ClientFactory::counting_into(kubeconfig, DRIVER_USER_AGENT, count.clone())
                        .await?,
                ],
                count,
                identity: "the admin's token for every driver (exempt from priority and fairness; set DEVPLUG_HELM_RENDERED to the rendered chart for each node's own token)".into(),
            });
        }
        let (accounts, account) = devplug_testkit::rendered::apply_dra_role(admin).await;
        let mut factories = Vec::with_capacity(names.len());
        for name in names {
            let token =
                devplug_testkit::api_server::node_token(&accounts, &account, Some(name)).await;
            let path = server.kubeconfig_for_token(&format!("driver-{name}"), &token)?;
            factories
                .push(ClientFactory::counting_into(&path, DRIVER_USER_AGENT, count.clone()).await?);
        }
        Ok(DriverClients {
            factories,
            count,
            identity: format!(
                "a token of its own node per driver, service account {}/{account} under the chart's DRA role and slices policy",
                accounts.namespace().unwrap_or_default()
            ),
        })
    }

    /// The shared count.
    pub fn count(&self) -> Arc<ApiCount> {
        self.count.clone()
    }

    /// A new client for the driver of node `i` (a connection of its own, counted).
    pub fn client(&self, i: usize) -> anyhow::Result<kube::Client> {
        let factory = self
            .factories
            .get(i)
            .or_else(|| self.factories.first())
            .ok_or_else(|| anyhow::anyhow!("no driver client"))?;
        factory.client()
    }
}
