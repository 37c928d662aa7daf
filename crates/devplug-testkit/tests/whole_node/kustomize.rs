//! The kustomize base, then the registry overlay over it, applied with `kubectl apply -k` as
//! the deploy README says. The node's containerd holds the image under both names.

use crate::device_plugins::NPU;
use crate::support::{self, figure, Namespace};
use crate::Outcome;
use devplug_testkit::node::Node;
use std::time::{Duration, Instant};

async fn gets_two_ids(
    node: &Node,
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<(), String> {
    support::apply(node, &[support::pod(ns, name, &[(NPU, 2)], "env | sort")])?;
    support::wait_pod(client, ns, name, Duration::from_secs(60), support::running).await?;
    let out = support::container_output(node, ns, name, Duration::from_secs(30)).await?;
    let ids = support::env_value(&out, "DUMMY_VISIBLE_DEVICES")
        .ok_or_else(|| format!("no ids:\n{out}"))?;
    assert_eq!(ids.split(',').count(), 2, "{ids}");
    Ok(())
}

pub fn base_and_overlay(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let repo = node.requirements.repo.clone();
        let base = repo.join("deploy/kustomize").display().to_string();
        let overlay = repo.join("deploy/overlays/registry").display().to_string();
        let started = Instant::now();
        node.kubectl(&["apply", "-k", &base], None)?;
        // Ready means registered and streaming (its /readyz); then the Node says so too.
        support::wait_daemonset_ready(node)?;
        support::wait_node_resource(&client, NPU, Duration::from_secs(90), |a, _| a == Some(8))
            .await
            .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        figure(&format!(
            "kubectl apply -k deploy/kustomize → {NPU} allocatable: {:.1} s",
            started.elapsed().as_secs_f64()
        ));
        let ns = Namespace::create(node, "dp-kustomize")?;
        gets_two_ids(node, &client, &ns.name, "base").await?;

        // The overlay renames the image: a rolling update to registry.example.com/devplug.
        node.kubectl(&["apply", "-k", &overlay], None)?;
        support::wait_daemonset_ready(node)?;
        let pods = support::devplug_pods(&client).await?;
        let images: Vec<String> = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .flat_map(|p| p.spec.clone().map(|s| s.containers).unwrap_or_default())
            .filter_map(|c| c.image)
            .collect();
        assert_eq!(
            images,
            ["registry.example.com/devplug:0.1.0"],
            "the overlay's image runs"
        );
        support::wait_node_resource(&client, NPU, Duration::from_secs(60), |a, _| a == Some(8))
            .await?;
        gets_two_ids(node, &client, &ns.name, "overlay").await?;
        ns.delete(node)?;
        node.kubectl(&["delete", "-k", &overlay, "--wait=true"], None)?;
        Ok(())
    })
}
