//! `devplug labels list|remove`: the node labels `run` wrote (`node_labels:`), through the API
//! server. `remove` is the uninstall's: on our Node, only the keys devplug's field manager owns
//! (other managers' labels stay); and our NodeFeature objects, for NFD to remove its labels.

use devplug_cluster::node_labels;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use std::path::PathBuf;

/// Arguments of `devplug labels`.
#[derive(Debug, clap::Args)]
pub struct LabelsArgs {
    #[command(subcommand)]
    action: Action,
    /// The kubeconfig to use (default: KUBECONFIG, ~/.kube/config, then the in-cluster account).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    policy: crate::cluster_features::UninstallPolicyArgs,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// List the labels devplug wrote on the node (the keys its field manager owns).
    List {
        /// The node.
        #[arg(long, env = "NODE_NAME")]
        node: String,
    },
    /// Remove the labels devplug wrote, and nothing else: on the node (direct mode) and its
    /// NodeFeature object (node-feature mode).
    Remove {
        /// The node.
        #[arg(
            long,
            env = "NODE_NAME",
            required_unless_present = "all_nodes",
            conflicts_with = "all_nodes"
        )]
        node: Option<String>,
        /// Every node of the cluster (the uninstall Job).
        #[arg(long)]
        all_nodes: bool,
        /// The namespace of the NodeFeature objects (devplug's own).
        #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
        namespace: String,
    },
}

/// Runs `devplug labels`.
pub async fn labels(args: LabelsArgs) -> anyhow::Result<()> {
    let client = devplug_cluster::connect(args.kubeconfig.as_deref()).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    match args.action {
        Action::List { node } => {
            let found = nodes.get(&node).await?;
            let all = found.metadata.labels.clone().unwrap_or_default();
            for key in node_labels::owned_keys(&found) {
                let value = all.get(&key).map_or("", String::as_str);
                println!("{key}={value}");
            }
        }
        Action::Remove {
            node,
            all_nodes,
            namespace,
        } => {
            let targets = crate::cluster_features::removal_targets(
                &client,
                node.as_deref(),
                all_nodes,
                &args.policy,
            )
            .await?;
            for target in &targets {
                let removed = node_labels::remove_direct(&nodes, target).await?;
                if removed.is_empty() {
                    println!("node {target}: no labels of devplug");
                } else {
                    let keys: Vec<String> = removed.into_iter().collect();
                    println!("node {target}: removed {}", keys.join(", "));
                }
            }
            let which = if all_nodes { None } else { node.as_deref() };
            for name in node_labels::remove_node_feature(&client, &namespace, which).await? {
                println!("NodeFeature {namespace}/{name} deleted");
            }
        }
    }
    Ok(())
}
