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
    /// Remove nothing before the admission policy that limits this token to removing is shown
    /// in force (a server-side dry run of a write it must refuse; up to 60 s, for a policy just
    /// made): the chart's uninstall Job passes it.
    #[arg(long, global = true, env = "DEVPLUG_REQUIRE_POLICIES")]
    require_policy: bool,
    /// With --require-policy: how long to wait for the policy, in seconds.
    #[arg(long, global = true, value_name = "SECS", default_value_t = 60)]
    policy_wait_secs: u64,
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
            let targets: Vec<String> = match &node {
                Some(node) if !all_nodes => vec![node.clone()],
                _ => nodes
                    .list(&Default::default())
                    .await?
                    .items
                    .into_iter()
                    .filter_map(|n| n.metadata.name)
                    .collect(),
            };
            if let (true, Some(first)) = (args.require_policy, targets.first()) {
                crate::cluster_features::uninstall_policy_in_force(
                    &client,
                    first,
                    args.policy_wait_secs,
                )
                .await?;
            }
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
