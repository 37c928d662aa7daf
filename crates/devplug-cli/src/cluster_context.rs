//! What every cluster feature of `devplug run` shares (advertise, node events, DRA drivers,
//! node labels, refused pods): this node's name, and one API client, connected the first time a
//! feature needs it (a config without a cluster feature never connects) and cloned by each
//! feature after that. The one message for a missing node name is here too.

use anyhow::Context;
use std::path::PathBuf;
use std::sync::Arc;

/// This node's name and the process's one API client.
pub struct ClusterContext {
    node: Option<String>,
    kubeconfig: Option<PathBuf>,
    client: tokio::sync::OnceCell<kube::Client>,
}

impl ClusterContext {
    /// Nothing connected yet.
    pub fn new(node: Option<String>, kubeconfig: Option<PathBuf>) -> Arc<ClusterContext> {
        Arc::new(ClusterContext {
            node,
            kubeconfig,
            client: tokio::sync::OnceCell::new(),
        })
    }

    /// This node's name (`NODE_NAME`, `--node-name`), if given.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// This node's name, or the error that says how to give it; `who_needs` names the feature
    /// and its verb (`advertise: resources need`, `--node-events needs`).
    pub fn need_node(&self, who_needs: &str) -> anyhow::Result<String> {
        self.node.clone().with_context(|| no_node_name(who_needs))
    }

    /// The API client, connected on the first call (the kubeconfig, else the usual places, else
    /// the in-cluster account); a failed connection is tried again on the next call.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let client = self
            .client
            .get_or_try_init(|| devplug_cluster::connect(self.kubeconfig.as_deref()))
            .await?;
        Ok(client.clone())
    }
}

/// What a feature that needs this node's name says without it (`who_needs`: the feature and
/// its verb).
pub fn no_node_name(who_needs: &str) -> String {
    format!(
        "{who_needs} this node's name: set NODE_NAME (the downward API's spec.nodeName) or \
         --node-name"
    )
}
