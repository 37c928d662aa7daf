//! DRA on the real node: the chart with a `dra:` resource, the example's DeviceClass,
//! ResourceClaimTemplate and pod applied unchanged; the scheduler allocates, the kubelet asks
//! devplug to prepare, containerd applies the CDI spec devplug wrote.

use crate::support::{self, figure};
use crate::Outcome;
use devplug_testkit::node::{Node, NODE_NAME};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use std::time::{Duration, Instant};

const DRIVER: &str = "npu.example.com";

pub fn claim_reaches_the_container(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let release = support::helm_release(node, "whole-node-dra")?;
        let started = Instant::now();
        release.install(node)?;
        // Published: a ResourceSlice of the driver for this node.
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let slices = node.kubectl(
                &[
                    "get",
                    "resourceslices",
                    "-o",
                    "jsonpath={range .items[*]}{.spec.driver} {.spec.nodeName}{\"\\n\"}{end}",
                ],
                None,
            )?;
            if slices.lines().any(|l| l == format!("{DRIVER} {NODE_NAME}")) {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "no ResourceSlice of {DRIVER} in 90 s\n{}",
                    support::devplug_log(node)
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        figure(&format!(
            "helm install (DRA release) → ResourceSlice published: {:.1} s",
            started.elapsed().as_secs_f64()
        ));
        // The example's pod runs busybox:1.36: the test image under that name.
        node.ctr(&[
            "images",
            "tag",
            "--force",
            devplug_testkit::node::image::BUSYBOX_IMAGE,
            "docker.io/library/busybox:1.36",
        ])?;
        let example = node
            .requirements
            .repo
            .join("deploy/examples/dra/basic/manifests.yaml");
        let example = example.display().to_string();
        let created = Instant::now();
        node.kubectl(&["apply", "-f", &example], None)?;
        support::wait_pod(
            &client,
            "default",
            "dra-npu-demo",
            Duration::from_secs(90),
            support::running,
        )
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        figure(&format!(
            "DRA pod (ResourceClaimTemplate) created → Running: {:.1} s",
            created.elapsed().as_secs_f64()
        ));
        let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
        let claim = claims
            .list(&Default::default())
            .await
            .map_err(|e| format!("list claims: {e}"))?
            .items
            .into_iter()
            .find(|c| {
                c.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("dra-npu-demo"))
            })
            .ok_or("no ResourceClaim made from the template")?;
        let results = claim
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .unwrap_or_default();
        assert_eq!(results.len(), 1, "one device allocated: {results:?}");
        assert_eq!(results[0].driver, DRIVER);
        let device = results[0].device.clone();
        // What containerd applied from devplug's CDI spec: env naming the device.
        let deadline = Instant::now() + Duration::from_secs(30);
        let out = loop {
            let log = node
                .container_log("default", "dra-npu-demo", "demo")
                .unwrap_or_default();
            if log.contains("PATH=") || Instant::now() > deadline {
                break log;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let edited: Vec<&str> = out.lines().filter(|l| l.contains(&device)).collect();
        assert!(
            !edited.is_empty(),
            "no env names the allocated device {device}:\n{out}"
        );
        figure(&format!(
            "DRA container env from the CDI spec: {}",
            edited.join(" ")
        ));
        node.kubectl(
            &[
                "delete",
                "-f",
                &example,
                "--wait=true",
                "--grace-period=0",
                "--force",
            ],
            None,
        )?;
        release.delete_objects(node)?;
        Ok(())
    })
}
