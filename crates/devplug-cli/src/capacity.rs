//! `devplug capacity set|remove|list`: extended resources on a Node's status, and the
//! clean uninstall of a device plugin's leftover resource, through the API
//! server with the usual kubeconfig resolution (`--kubeconfig`, `KUBECONFIG`, `~/.kube/config`,
//! in-cluster).

use anyhow::Context;
use devplug_cluster::capacity::{self, CleanOptions, Removed};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use std::path::PathBuf;

/// Arguments of `devplug capacity`.
#[derive(Debug, clap::Args)]
pub struct CapacityArgs {
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
    /// Set NAME=COUNT in the node's capacity and allocatable (e.g. example.com/dongle=4).
    Set {
        /// NAME=COUNT.
        resource: String,
        /// The node.
        #[arg(long, env = "NODE_NAME")]
        node: String,
    },
    /// Remove NAMEs from the node's capacity and allocatable; a missing key is "already gone".
    Remove {
        /// The extended resource names.
        #[arg(required = true, num_args = 1..)]
        resources: Vec<String>,
        /// The node.
        #[arg(
            long,
            env = "NODE_NAME",
            required_unless_present = "all_nodes",
            conflicts_with = "all_nodes"
        )]
        node: Option<String>,
        /// Every node of the cluster (the uninstall Job), in parallel.
        #[arg(long)]
        all_nodes: bool,
        /// Clean uninstall of a device plugin's resource: wait until the kubelet reports it at
        /// 0 (plugin gone, 5-minute grace over), remove, re-check, retry (bounded).
        #[arg(long)]
        after_device_plugin: bool,
        /// With --after-device-plugin: how long to wait for 0, in seconds.
        #[arg(long, value_name = "SECS", default_value_t = 600)]
        wait_secs: u64,
        /// With --after-device-plugin: seconds before checking that it stayed gone.
        #[arg(long, value_name = "SECS", default_value_t = 60)]
        recheck_secs: u64,
        /// With --after-device-plugin: removals at most.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
        attempts: u32,
    },
    /// List the node's extended resources: capacity and allocatable.
    List {
        /// The node.
        #[arg(long, env = "NODE_NAME")]
        node: String,
    },
}

/// Removes one resource from one node: plainly, or with the clean-uninstall recipe.
async fn remove_one(
    nodes: &Api<Node>,
    node: &str,
    resource: &str,
    options: Option<CleanOptions>,
) -> anyhow::Result<String> {
    let Some(options) = options else {
        return Ok(match capacity::remove(nodes, node, resource).await? {
            Removed::Removed => format!("{resource} removed from node {node}"),
            Removed::AlreadyGone => format!("{resource} on node {node}: already gone"),
        });
    };
    let report = capacity::clean(nodes, node, resource, options).await?;
    Ok(if report.removals == 0 {
        format!("{resource} on node {node}: already gone")
    } else {
        format!(
            "{resource} removed from node {node} ({} removal{}, came back {} time{})",
            report.removals,
            if report.removals == 1 { "" } else { "s" },
            report.came_back,
            if report.came_back == 1 { "" } else { "s" }
        )
    })
}

/// Runs `devplug capacity`.
pub async fn capacity(args: CapacityArgs) -> anyhow::Result<()> {
    let client = devplug_cluster::connect(args.kubeconfig.as_deref()).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    match args.action {
        Action::Set { resource, node } => {
            let (name, count) = resource
                .split_once('=')
                .context("give NAME=COUNT, e.g. example.com/dongle=4")?;
            let count: u64 = count
                .parse()
                .with_context(|| format!("{count:?} is not a whole number of devices"))?;
            capacity::set(&nodes, &node, name, count).await?;
            println!("{name}={count} set on node {node}");
        }
        Action::Remove {
            resources,
            node,
            all_nodes,
            after_device_plugin,
            wait_secs,
            recheck_secs,
            attempts,
        } => {
            let targets = crate::cluster_features::removal_targets(
                &client,
                node.as_deref(),
                all_nodes,
                &args.policy,
            )
            .await?;
            let options = after_device_plugin.then_some(CleanOptions {
                wait_for_zero: std::time::Duration::from_secs(wait_secs),
                recheck_after: std::time::Duration::from_secs(recheck_secs),
                attempts,
            });
            let mut work = tokio::task::JoinSet::new();
            for node in &targets {
                for resource in &resources {
                    let (nodes, node, resource) = (nodes.clone(), node.clone(), resource.clone());
                    work.spawn(async move {
                        let said = remove_one(&nodes, &node, &resource, options).await;
                        (node, resource, said)
                    });
                }
            }
            let mut results = Vec::new();
            while let Some(done) = work.join_next().await {
                results.push(done.context("a removal task failed")?);
            }
            results.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
            let mut failed = 0;
            for (node, resource, said) in results {
                match said {
                    Ok(line) => println!("{line}"),
                    Err(err) => {
                        failed += 1;
                        eprintln!("error: {resource} on node {node}: {err:#}");
                    }
                }
            }
            if failed > 0 {
                anyhow::bail!("{failed} removal(s) failed");
            }
        }
        Action::List { node } => {
            let listed = capacity::list(&nodes, &node).await?;
            if listed.is_empty() {
                println!("node {node} has no extended resources");
            } else {
                let width = listed.keys().map(String::len).max().unwrap_or(0).max(8);
                println!("{:width$}  CAPACITY  ALLOCATABLE", "RESOURCE");
                for (name, r) in listed {
                    println!(
                        "{name:width$}  {:8}  {}",
                        r.capacity.as_deref().unwrap_or("-"),
                        r.allocatable.as_deref().unwrap_or("-")
                    );
                }
            }
        }
    }
    Ok(())
}
