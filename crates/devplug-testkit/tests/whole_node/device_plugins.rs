//! The device-plugin backends through the chart: what a container gets from each, what the
//! scheduler says to an over-ask, and a config change through the ConfigMap without a restart.

use crate::support::{self, figure, Namespace, Release};
use crate::Outcome;
use devplug_testkit::fake_sysfs::{FakeSysfs, PciSpec};
use devplug_testkit::node::Node;
use std::time::{Duration, Instant};

pub const NPU: &str = "dummy.com/npu";
pub const TESTDEV: &str = "example.com/testdev";
pub const COLA: &str = "example.com/cola";
pub const VFIO: &str = "example.com/vfio";
const COLAS_DIR: &str = "/var/lib/devplug-test/colas";
/// The fake sysfs and /dev of the `vfio` resource (`ci/whole-node-values.yaml` names it).
const VFIO_TREE: &str = "/var/lib/devplug-test/vfio";
/// Its two GPUs bound to vfio-pci: (address, IOMMU group).
const VFIO_GPUS: [(&str, u32); 2] = [("0000:3b:00.0", 40), ("0000:86:00.0", 41)];
/// The IOMMU group of the fake GPU at PCI `address`.
pub fn vfio_group(address: &str) -> Option<u32> {
    VFIO_GPUS
        .iter()
        .find(|(a, _)| *a == address)
        .map(|(_, group)| *group)
}

/// The CDI spec the `vfio` resource writes on the host.
pub const VFIO_CDI_SPEC: &str = "/var/run/cdi/devplug-example.com_vfio.json";

/// The host's side of the whole-node release: two device nodes for `hostdev`, two files for
/// `files`, a fake sysfs tree with two GPUs on vfio-pci for `vfio` (removed by the node's
/// cleanup).
pub fn make_host_devices(node: &Node) -> Result<(), String> {
    node.make_test_device(0)?;
    node.make_test_device(1)?;
    std::fs::create_dir_all(COLAS_DIR).map_err(|e| format!("{COLAS_DIR}: {e}"))?;
    node.remember_made_file(std::path::Path::new("/var/lib/devplug-test"))?;
    node.remember_made_file(std::path::Path::new(VFIO_CDI_SPEC))?;
    for name in ["cherry", "lime"] {
        let path = std::path::Path::new(COLAS_DIR).join(name);
        std::fs::write(&path, "Healthy\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    make_vfio_tree()
}

/// Two NVIDIA GPUs bound to vfio-pci in their own IOMMU groups, their `/dev/vfio` nodes
/// character devices (the runtime refuses plain files), as `/dev/null` is.
fn make_vfio_tree() -> Result<(), String> {
    let fail = |e: std::io::Error| format!("{VFIO_TREE}: {e}");
    let tree = FakeSysfs::new(std::path::Path::new(VFIO_TREE)).map_err(fail)?;
    tree.load_vfio().map_err(fail)?;
    let mut nodes = vec![tree.path("dev/vfio/vfio")];
    for (address, group) in VFIO_GPUS {
        tree.vfio_device(&PciSpec {
            address: address.to_owned(),
            vendor: 0x10de,
            device: 0x2236,
            class: 0x030200,
            numa: -1,
            iommu_group: group,
        })
        .map_err(fail)?;
        nodes.push(tree.path(&format!("dev/vfio/{group}")));
    }
    for path in nodes {
        std::fs::remove_file(&path).map_err(fail)?;
        devplug_testkit::node::make_null_device(&path)?;
    }
    Ok(())
}

/// Installs the chart with `ci/whole-node-values.yaml` and waits for its four resources on
/// the Node; returns the release and how long install → all allocatable took.
pub async fn install(node: &Node, client: &kube::Client) -> Result<(Release, Duration), String> {
    make_host_devices(node)?;
    let release = support::helm_release(node, "whole-node")?;
    let started = Instant::now();
    release.install(node)?;
    for (resource, count) in [(NPU, 8), (TESTDEV, 2), (COLA, 2), (VFIO, 2)] {
        support::wait_node_resource(client, resource, Duration::from_secs(90), move |a, _| {
            a == Some(count)
        })
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
    }
    let took = started.elapsed();
    // Ready too (its /readyz): a pod that is not yet Ready counts as unavailable, and a rolling
    // update replaces such a pod without waiting for its successor.
    support::wait_daemonset_ready(node)?;
    Ok((release, took))
}

pub fn reach_the_container(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let (release, took) = install(node, &client).await?;
        figure(&format!(
            "helm install (rendered chart applied) → {NPU}, {TESTDEV}, {COLA} and {VFIO} allocatable on the Node: {:.1} s",
            took.as_secs_f64()
        ));
        let ns = Namespace::create(node, "dp-backends")?;

        // One container asks for a device of each backend.
        let script = "env | sort\nls -l /dev/ | grep devplug-test\nls /colas/\ngrep ' /colas/' /proc/self/mountinfo";
        let pod = support::pod(
            &ns.name,
            "all-three",
            &[(NPU, 2), (TESTDEV, 1), (COLA, 1)],
            script,
        );
        let created = Instant::now();
        support::apply(node, &[pod])?;
        support::wait_pod(
            &client,
            &ns.name,
            "all-three",
            Duration::from_secs(60),
            support::running,
        )
        .await?;
        figure(&format!(
            "pod with devices of three resources created → Running: {:.1} s",
            created.elapsed().as_secs_f64()
        ));
        let out =
            support::container_output(node, &ns.name, "all-three", Duration::from_secs(30)).await?;

        let npus = support::env_value(&out, "DUMMY_VISIBLE_DEVICES")
            .ok_or_else(|| format!("no DUMMY_VISIBLE_DEVICES in the container:\n{out}"))?;
        let ids: Vec<&str> = npus.split(',').collect();
        assert_eq!(ids.len(), 2, "two virtual ids, got {npus:?}");
        assert!(ids[0] != ids[1], "two different ids: {npus}");

        // hostdev: one of the two nodes, a character device inside, the other not there.
        let devices: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("devplug-test-"))
            .collect();
        assert_eq!(
            devices.len(),
            1,
            "exactly one test device node in the container:\n{out}"
        );
        assert!(
            devices[0].starts_with('c'),
            "a character device: {}",
            devices[0]
        );

        // files: one file's id in COLAS and that file mounted at /colas/<id>, read-only.
        let cola = support::env_value(&out, "COLAS").ok_or_else(|| format!("no COLAS:\n{out}"))?;
        assert!(
            ["cherry", "lime"].contains(&cola),
            "COLAS names a file: {cola}"
        );
        assert!(
            out.lines().any(|l| l == cola),
            "/colas/{cola} listed:\n{out}"
        );
        let mount = out
            .lines()
            .find(|l| l.contains(&format!(" /colas/{cola} ")))
            .ok_or_else(|| format!("/colas/{cola} is not a mount:\n{out}"))?;
        assert!(
            mount.contains(" ro,") || mount.contains(" ro "),
            "read-only mount: {mount}"
        );

        // The file's device turns unhealthy: the kubelet shows it in the pod's status, under
        // the resource's name (ResourceHealthStatus), and again once it recovers.
        let cola_file = format!("{COLAS_DIR}/{cola}");
        let broke = Instant::now();
        std::fs::write(&cola_file, "cap off\n").map_err(|e| format!("{cola_file}: {e}"))?;
        let shows = |want: &'static str| {
            let cola = cola.to_owned();
            move |p: &k8s_openapi::api::core::v1::Pod| {
                crate::dra::device_health(p)
                    .iter()
                    .any(|(name, id, h)| name == COLA && *id == cola && h == want)
            }
        };
        let unhealthy = support::wait_pod(
            &client,
            &ns.name,
            "all-three",
            Duration::from_secs(30),
            shows("Unhealthy"),
        )
        .await;
        let took = broke.elapsed();
        std::fs::write(&cola_file, "").map_err(|e| format!("{cola_file}: {e}"))?;
        unhealthy
            .map_err(|e| format!("the unhealthy {COLA} device {cola} in the pod's status: {e}"))?;
        figure(&format!(
            "device plugin health in the pod's status: {COLA} {cola} Unhealthy {:.1} s after its \
             file said so",
            took.as_secs_f64()
        ));
        support::wait_pod(
            &client,
            &ns.name,
            "all-three",
            Duration::from_secs(30),
            shows("Healthy"),
        )
        .await
        .map_err(|e| format!("{COLA} {cola} Healthy again in the pod's status: {e}"))?;

        // vfio: a GPU for a VM, as KubeVirt's virt-launcher finds it: its group's node and
        // the container node, and its address in PCI_RESOURCE_<NAME>.
        let script = "env | sort\nls -l /dev/vfio/";
        support::apply(node, &[support::pod(&ns.name, "vm", &[(VFIO, 1)], script)])?;
        support::wait_pod(
            &client,
            &ns.name,
            "vm",
            Duration::from_secs(60),
            support::running,
        )
        .await?;
        let out = support::container_output(node, &ns.name, "vm", Duration::from_secs(30)).await?;
        let address = support::env_value(&out, "PCI_RESOURCE_EXAMPLE_COM_VFIO")
            .ok_or_else(|| format!("no PCI_RESOURCE_EXAMPLE_COM_VFIO in the container:\n{out}"))?;
        let (_, group) = VFIO_GPUS
            .iter()
            .find(|(a, _)| *a == address)
            .ok_or_else(|| format!("PCI_RESOURCE_EXAMPLE_COM_VFIO={address}: not one GPU"))?;
        for name in ["vfio".to_owned(), group.to_string()] {
            assert!(
                out.lines()
                    .any(|l| l.starts_with('c') && l.ends_with(&format!(" {name}"))),
                "/dev/vfio/{name} is a character device in the container:\n{out}"
            );
        }
        let other = VFIO_GPUS.iter().find(|(a, _)| *a != address).map(|g| g.1);
        assert!(
            !out.lines()
                .any(|l| other.is_some_and(|g| l.ends_with(&format!(" {g}")))),
            "the other GPU's group is not in the container:\n{out}"
        );

        // Asking for more than the node has: Pending, with the scheduler's reason.
        support::apply(
            node,
            &[support::pod(&ns.name, "too-many", &[(NPU, 9)], "true")],
        )?;
        let pending = support::wait_pod(
            &client,
            &ns.name,
            "too-many",
            Duration::from_secs(30),
            |p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.status == "False"
                                && c.message
                                    .as_deref()
                                    .is_some_and(|m| m.contains("Insufficient dummy.com/npu"))
                        })
                    })
            },
        )
        .await?;
        assert_eq!(
            pending.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Pending")
        );

        // A config change through the ConfigMap: 8 → 6 NPUs, the plugin pod not restarted.
        let before = support::devplug_pods(&client).await?;
        let configmap = release
            .objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap")
            .cloned()
            .ok_or("the release has no ConfigMap")?;
        let mut changed = configmap.clone();
        let text = configmap["data"]["config.yaml"]
            .as_str()
            .unwrap_or_default();
        assert!(text.contains("count: 8"), "the release's config: {text}");
        changed["data"]["config.yaml"] = text.replacen("count: 8", "count: 6", 1).into();
        let edited = Instant::now();
        support::apply(node, &[changed])?;
        support::wait_node_resource(&client, NPU, Duration::from_secs(120), |a, c| {
            a == Some(6) && c == Some(6)
        })
        .await?;
        figure(&format!(
            "ConfigMap edited (8 → 6 devices) → Node capacity 6, no restart: {:.1} s",
            edited.elapsed().as_secs_f64()
        ));
        let after = support::devplug_pods(&client).await?;
        let ids = |pods: &[k8s_openapi::api::core::v1::Pod]| {
            pods.iter()
                .map(|p| p.metadata.uid.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&before), ids(&after), "the same devplug pod");
        let restarts: i32 = after
            .iter()
            .flat_map(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.clone())
                    .unwrap_or_default()
            })
            .map(|c| c.restart_count)
            .sum();
        assert_eq!(restarts, 0, "devplug's container did not restart");

        ns.delete(node)?;
        release.delete_objects(node)?;
        Ok(())
    })
}
