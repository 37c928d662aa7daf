//! NVIDIA GPUs through the GPU image and the chart's GPU mode, on a node without a GPU: the
//! fake `libnvidia-ml.so` (crates/fake-nvml, 8 GPUs) in a driver root laid out as NVIDIA's
//! installer lays one out, device nodes made with mknod. What a pod gets is checked inside it:
//! its GPUs' UUIDs, their `/dev/nvidia*` nodes and no others, and the driver's files at
//! `/usr/local/nvidia` (the layout CUDA images search), read-only, from the driver root.

use crate::support::{self, figure, Namespace};
use crate::Outcome;
use devplug_testkit::node::Node;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const GPU: &str = "nvidia.com/gpu";
/// What the fake NVML reports as the driver version.
const DRIVER_VERSION: &str = "570.86.15";
/// The host folder the test makes (`ci/whole-node-gpu-values.yaml` names it), inside the
/// node's folder so that the node's cleanup unmounts and removes it.
const GPU_DIR: &str = "/var/tmp/devplug-test-node/gpu";
/// Marks the fake libcuda's content, so the pod can show which file it got.
const LIBCUDA_TEXT: &str = "devplug-test libcuda for driver 570.86.15";
/// The CDI spec the backend writes for this resource.
const CDI_SPEC: &str = "/var/run/cdi/devplug-nvidia.com_gpu.json";

fn write(path: &Path, text: &[u8]) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The host's side under `root`: a driver root with the fake NVML (with the topology
/// `crates/fake-nvml/topologies/<topology>.yaml`) under its versioned name and the `.so.1`
/// link, a libcuda and an `nvidia-smi`; a /dev with a node per GPU and the control nodes (all
/// `c 1 3`, /dev/null's numbers: harmless if opened). Returns the GPUs' UUIDs.
fn make_driver(node: &Node, root: &Path, topology: &str) -> Result<Vec<String>, String> {
    node.remember_made_file(Path::new(CDI_SPEC))?;
    shared_mount(root)?;
    let repo = &node.requirements.repo;
    let lib_dir = root.join("driver-root/usr/lib/x86_64-linux-gnu");
    let fake = repo.join("target/debug/libfake_nvml.so");
    let library = std::fs::read(&fake).map_err(|e| {
        format!(
            "{}: {e} (cargo builds it with this test: crates/fake-nvml is a dev-dependency)",
            fake.display()
        )
    })?;
    write(
        &lib_dir.join(format!("libnvidia-ml.so.{DRIVER_VERSION}")),
        &library,
    )?;
    let link = lib_dir.join("libnvidia-ml.so.1");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(format!("libnvidia-ml.so.{DRIVER_VERSION}"), &link)
        .map_err(|e| format!("{}: {e}", link.display()))?;
    let topology =
        std::fs::read_to_string(repo.join(format!("crates/fake-nvml/topologies/{topology}.yaml")))
            .map_err(|e| format!("the fake NVML's topology: {e}"))?;
    write(&lib_dir.join("fake-nvml.yaml"), topology.as_bytes())?;
    write(
        &lib_dir.join(format!("libcuda.so.{DRIVER_VERSION}")),
        LIBCUDA_TEXT.as_bytes(),
    )?;
    let smi = root.join("driver-root/usr/bin/nvidia-smi");
    write(
        &smi,
        b"#!/bin/sh\necho \"nvidia-smi from the driver root\"\n",
    )?;
    set_mode(&smi, 0o755)?;
    let topology: serde_json::Value =
        serde_saphyr::from_str(&topology).map_err(|e| format!("the fake NVML's topology: {e}"))?;
    let uuids: Vec<String> = topology["gpus"]
        .as_array()
        .map(|gpus| {
            gpus.iter()
                .filter_map(|g| g["uuid"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).map_err(|e| format!("{}: {e}", dev.display()))?;
    let mut nodes: Vec<String> = (0..uuids.len()).map(|i| format!("nvidia{i}")).collect();
    nodes.extend(["nvidiactl", "nvidia-uvm"].map(String::from));
    for name in nodes {
        let path = dev.join(name);
        if path.exists() {
            continue;
        }
        run("mknod", &[&path.display().to_string(), "c", "1", "3"])?;
    }
    Ok(uuids)
}

/// Makes `dir` a shared mount point, as systemd makes `/` on a real node: the chart mounts the
/// driver root with `HostToContainer` propagation (a driver container mounts it later), which
/// the runtime refuses on a private mount.
fn shared_mount(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let here = dir.display().to_string();
    if !mounts
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(here.as_str()))
    {
        run("mount", &["--bind", &here, &here])?;
    }
    run("mount", &["--make-rshared", &here])
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let status = std::process::Command::new(program)
        .args(args)
        .status()
        .map_err(|e| format!("{program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{program} {}: {status}", args.join(" ")))
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// devplug's GPU image, imported under the name the chart's GPU mode runs.
fn import_gpu_image(node: &Node) -> Result<(), String> {
    let name = "docker.io/library/devplug:0.1.0-gpu";
    if node
        .ctr(&["images", "ls", "-q"])?
        .lines()
        .any(|l| l == name)
    {
        return Ok(());
    }
    let main = &node.requirements.image_archive;
    let archive: PathBuf = main.with_file_name(
        main.file_name()
            .and_then(|n| n.to_str())
            .map(|n| n.replace(".oci.tar", "-gpu.oci.tar"))
            .unwrap_or_default(),
    );
    if !archive.is_file() {
        return Err(format!(
            "the GPU image at {} is missing: `.ci/build-image` builds it beside the main one",
            archive.display()
        ));
    }
    node.import_image(&archive, &[name.to_owned()])
}

pub fn reach_the_container(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let uuids = make_driver(node, Path::new(GPU_DIR), "dgx1-v100")?;
        import_gpu_image(node)?;
        let release = support::helm_release(node, "whole-node-gpu")?;
        let started = Instant::now();
        release.install(node)?;
        support::wait_node_resource(&client, GPU, Duration::from_secs(90), |a, c| {
            a == Some(8) && c == Some(8)
        })
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        figure(&format!(
            "GPU image, chart with gpu.vendor=nvidia → 8 GPUs (fake NVML) allocatable on the Node: {:.1} s",
            started.elapsed().as_secs_f64()
        ));
        // The first list was the whole one: the plugin registered after NVML's discovery.
        let log = support::devplug_log(node);
        assert!(
            !log.contains("first discovery has not ended"),
            "registered before discovery ended:\n{log}"
        );

        let ns = Namespace::create(node, "dp-gpu")?;
        let script = "env | sort\n\
             ls -l /dev/ | grep nvidia\n\
             echo \"libcuda: $(cat /usr/local/nvidia/lib64/libcuda.so.1)\"\n\
             ls /usr/local/nvidia/lib64/\n\
             /usr/local/nvidia/bin/nvidia-smi\n\
             grep ' /usr/local/nvidia/' /proc/self/mountinfo";
        let pod = support::pod(&ns.name, "two-gpus", &[(GPU, 2)], script);
        support::apply(node, &[pod])?;
        support::wait_pod(
            &client,
            &ns.name,
            "two-gpus",
            Duration::from_secs(60),
            support::running,
        )
        .await?;
        let out =
            support::container_output(node, &ns.name, "two-gpus", Duration::from_secs(30)).await?;

        // Its two GPUs by UUID.
        let visible = support::env_value(&out, "NVIDIA_VISIBLE_DEVICES")
            .ok_or_else(|| format!("no NVIDIA_VISIBLE_DEVICES in the container:\n{out}"))?;
        let given: Vec<&str> = visible.split(',').collect();
        assert_eq!(given.len(), 2, "two GPUs: {visible}");
        let index = |uuid: &str| uuids.iter().position(|u| u == uuid);
        let minors: Vec<usize> = given
            .iter()
            .map(|u| index(u).ok_or_else(|| format!("{u} is not a GPU of the node")))
            .collect::<Result<_, _>>()?;
        // Their nodes and the control nodes, no other GPU's.
        let mut nodes: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with('c'))
            .filter_map(|l| l.split_whitespace().last())
            .filter(|n| n.starts_with("nvidia"))
            .collect();
        nodes.sort_unstable();
        let mut want: Vec<String> = minors.iter().map(|m| format!("nvidia{m}")).collect();
        want.extend(["nvidia-uvm".to_owned(), "nvidiactl".to_owned()]);
        want.sort_unstable();
        assert_eq!(nodes, want, "the container's /dev:\n{out}");
        // The driver's files, from the driver root, read-only, where CUDA images look.
        assert!(
            out.contains(&format!("libcuda: {LIBCUDA_TEXT}")),
            "libcuda.so.1 is the driver root's:\n{out}"
        );
        for name in [
            format!("libcuda.so.{DRIVER_VERSION}"),
            "libcuda.so".to_owned(),
            "libnvidia-ml.so.1".to_owned(),
        ] {
            assert!(
                out.lines().any(|l| l == name),
                "{name} in /usr/local/nvidia/lib64:\n{out}"
            );
        }
        assert!(
            out.contains("nvidia-smi from the driver root"),
            "nvidia-smi ran from /usr/local/nvidia/bin:\n{out}"
        );
        let mounts: Vec<&str> = out
            .lines()
            .filter(|l| l.contains(" /usr/local/nvidia/"))
            .collect();
        assert!(!mounts.is_empty(), "no driver mounts:\n{out}");
        for m in &mounts {
            assert!(m.contains(" ro,") || m.contains(" ro "), "read-only: {m}");
        }

        ns.delete(node)?;
        release.delete_objects(node)?;
        Ok(())
    })
}

/// The host folder of the MIG scenario (`ci/whole-node-gpu-mig-values.yaml` names it).
const MIG_DIR: &str = "/var/tmp/devplug-test-node/gpu-mig";
/// The MIG example's DRA driver.
const MIG_DRIVER: &str = "gpu.nvidia.com";

/// `mig-minors` as the driver writes it for `gpus` GPUs (`config` 1, `monitor` 2, then per GPU
/// 15 GIs of one GI node and 8 CI nodes each), and the caps minors it lists.
fn mig_minors(gpus: usize) -> (String, Vec<usize>) {
    let mut text = String::from("config 1\nmonitor 2\n");
    let mut minors = vec![1, 2];
    for g in 0..gpus {
        for gi in 0..15 {
            let base = 3 + g * 135 + gi * 9;
            text.push_str(&format!("gpu{g}/gi{gi}/access {base}\n"));
            minors.push(base);
            for ci in 0..8 {
                text.push_str(&format!("gpu{g}/gi{gi}/ci{ci}/access {}\n", base + 1 + ci));
                minors.push(base + 1 + ci);
            }
        }
    }
    (text, minors)
}

/// MIG partitions made per claim on the real node: the GPU image with `mig_strategy: dynamic`
/// and a DRA driver, on the fake NVML with two A100-40GB in MIG mode (no MIG device yet), a
/// `mig-minors` and its caps nodes. The `mig-partitions` example is applied unchanged (its
/// CUDA image is the test's busybox under that name): the scheduler fits a 3g.20gb and a
/// 2g.10gb, devplug creates them at prepare, and each container gets its own MIG UUID and
/// its GI and CI caps nodes; deleting the pods destroys them.
pub fn mig_partitions_reach_the_container(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let root = Path::new(MIG_DIR);
        let uuids = make_driver(node, root, "a100-partitions")?;
        let (text, minors) = mig_minors(uuids.len());
        write(
            &root.join("proc/driver/nvidia-caps/mig-minors"),
            text.as_bytes(),
        )?;
        let caps = root.join("dev/nvidia-caps");
        std::fs::create_dir_all(&caps).map_err(|e| format!("{}: {e}", caps.display()))?;
        for minor in minors {
            let path = caps.join(format!("nvidia-cap{minor}"));
            if !path.exists() {
                run("mknod", &[&path.display().to_string(), "c", "1", "3"])?;
            }
        }
        import_gpu_image(node)?;
        node.ctr(&[
            "images",
            "tag",
            "--force",
            devplug_testkit::node::image::BUSYBOX_IMAGE,
            "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
        ])?;
        let release = support::helm_release(node, "whole-node-gpu-mig")?;
        let started = Instant::now();
        release.install(node)?;
        support::wait_for_slices(node, "the GPUs' counter sets", |line| {
            line.starts_with(MIG_DRIVER) && line.contains("gpu-1")
        })
        .await?;
        figure(&format!(
            "GPU image, mig_strategy dynamic → 2 GPUs' MIG partitions published: {:.1} s",
            started.elapsed().as_secs_f64()
        ));

        let pods = ["dra-mig-three", "dra-mig-two"];
        let took = crate::dra::apply_and_run(node, &client, "mig-partitions", &pods).await?;
        figure(&format!(
            "MIG partitions example: a 3g.20gb and a 2g.10gb created by devplug at prepare → both pods Running: {:.1} s",
            took.as_secs_f64()
        ));
        let mut given = Vec::new();
        for pod in pods {
            let deadline = Instant::now() + Duration::from_secs(30);
            let out = loop {
                let log = node
                    .container_log("default", pod, "demo")
                    .unwrap_or_default();
                if log.contains("caps:") || Instant::now() > deadline {
                    break log;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            let visible = support::env_value(&out, "NVIDIA_VISIBLE_DEVICES")
                .ok_or_else(|| format!("{pod}: no NVIDIA_VISIBLE_DEVICES:\n{out}"))?
                .to_owned();
            assert!(
                visible.starts_with("MIG-") && !visible.contains(','),
                "{pod}: one MIG device: {visible}\n{out}"
            );
            // The GI and CI access nodes of its own partition, no other.
            let caps: Vec<&str> = out
                .lines()
                .filter_map(|l| l.strip_prefix("caps: "))
                .flat_map(str::split_whitespace)
                .collect();
            assert_eq!(caps.len(), 2, "{pod}: its GI and CI caps nodes:\n{out}");
            given.push((visible, caps.join(" ")));
        }
        assert_ne!(given[0], given[1], "two partitions, two MIG devices");
        figure(&format!("MIG partitions in the containers: {given:?}"));

        crate::dra::remove_example(node, "mig-partitions")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let log = support::devplug_log(node);
            let destroyed = log.matches("MIG partition destroyed").count();
            if destroyed >= 2 {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the pods are gone, {destroyed} of 2 MIG partitions destroyed in 60 s:\n{log}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        release.delete_objects(node)?;
        Ok(())
    })
}

/// The host folder of the node-labels scenario (`ci/whole-node-gpu-labels-values.yaml` names it).
const LABELS_DIR: &str = "/var/tmp/devplug-test-node/gpu-labels";
/// The product label of the fake DGX-1's GPUs, as GPU Feature Discovery writes it.
const V100_PRODUCT: &str = "Tesla-V100-SXM2-16GB";

/// The Node's labels.
async fn node_labels(
    nodes: &kube::Api<k8s_openapi::api::core::v1::Node>,
) -> Result<BTreeMap<String, String>, String> {
    let node = nodes
        .get(devplug_testkit::node::NODE_NAME)
        .await
        .map_err(|e| format!("the Node: {e}"))?;
    Ok(node.metadata.labels.unwrap_or_default())
}

/// Waits until the Node's labels satisfy `check`.
async fn wait_labels(
    nodes: &kube::Api<k8s_openapi::api::core::v1::Node>,
    what: &str,
    timeout: Duration,
    check: impl Fn(&BTreeMap<String, String>) -> bool,
) -> Result<BTreeMap<String, String>, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let labels = node_labels(nodes).await?;
        if check(&labels) {
            return Ok(labels);
        }
        if Instant::now() > deadline {
            return Err(format!("the Node's labels never showed {what}: {labels:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The GPU chart on the fake driver labels the Node as GPU Feature Discovery does; a pod
/// selecting the product label runs; a GPU lost takes one off `nvidia.com/gpu.count`; the
/// uninstall Job removes every label devplug wrote and nothing else.
pub fn labels_follow_the_gpus(node: &'static Node) -> Outcome {
    Box::pin(async move {
        let client = node.client().await?;
        let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
        let root = Path::new(LABELS_DIR);
        make_driver(node, root, "dgx1-v100")?;
        // The fake NVML's fault file (the topology names it beside itself).
        let control = root.join("driver-root/usr/lib/x86_64-linux-gnu/dgx1-v100.control");
        write(&control, b"")?;
        import_gpu_image(node)?;
        // Another tool's labels, one under NVIDIA's prefix: they must outlive the uninstall.
        node.kubectl(
            &[
                "label",
                "node",
                devplug_testkit::node::NODE_NAME,
                "--overwrite",
                "nvidia.com/gpu.deploy.operands=false",
                "example.com/rack=r1",
            ],
            None,
        )?;
        let before = node_labels(&nodes).await?;
        let release = support::helm_release(node, "whole-node-gpu-labels")?;
        let started = Instant::now();
        release.install(node)?;
        let labels = wait_labels(&nodes, "GFD's labels", Duration::from_secs(90), |l| {
            l.get("nvidia.com/gpu.count").map(String::as_str) == Some("8")
        })
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        figure(&format!(
            "GPU chart (nodeLabels auto) → GFD's labels on the Node: {:.1} s",
            started.elapsed().as_secs_f64()
        ));
        for (key, want) in [
            ("nvidia.com/gpu.product", V100_PRODUCT),
            ("nvidia.com/gpu.memory", "16160"),
            ("nvidia.com/gpu.family", "volta"),
            ("nvidia.com/gpu.compute.major", "7"),
            ("nvidia.com/gpu.compute.minor", "0"),
            ("nvidia.com/gpu.replicas", "1"),
            ("nvidia.com/gpu.sharing-strategy", "none"),
            ("nvidia.com/cuda.driver.major", "570"),
            ("nvidia.com/cuda.driver.minor", "86"),
            ("nvidia.com/cuda.driver.rev", "15"),
            ("nvidia.com/cuda.runtime.major", "12"),
            ("nvidia.com/cuda.runtime.minor", "8"),
            ("nvidia.com/mig.capable", "false"),
            // Another tool's label under the same prefix is left as it was.
            ("nvidia.com/gpu.deploy.operands", "false"),
        ] {
            assert_eq!(
                labels.get(key).map(String::as_str),
                Some(want),
                "{key}: {labels:?}"
            );
        }

        // A pod selecting the product, as pods written for GFD's labels do, runs.
        let ns = Namespace::create(node, "dp-gpu-labels")?;
        let mut pod = support::pod(&ns.name, "by-product", &[(GPU, 1)], "true");
        pod["spec"]["nodeSelector"] = serde_json::json!({ "nvidia.com/gpu.product": V100_PRODUCT });
        support::apply(node, &[pod])?;
        support::wait_pod(
            &client,
            &ns.name,
            "by-product",
            Duration::from_secs(60),
            support::running,
        )
        .await?;
        ns.delete(node)?;

        // A GPU falls off the bus: the count follows.
        let lost_at = Instant::now();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&control)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"lost 3\n"))
            .map_err(|e| format!("{}: {e}", control.display()))?;
        wait_labels(&nodes, "gpu.count 7", Duration::from_secs(30), |l| {
            l.get("nvidia.com/gpu.count").map(String::as_str) == Some("7")
        })
        .await
        .map_err(|e| format!("{e}\n{}", support::devplug_log(node)))?;
        figure(&format!(
            "a GPU lost → nvidia.com/gpu.count 8 → 7 on the Node: {:.2} s",
            lost_at.elapsed().as_secs_f64()
        ));
        nvml_failure_fails_no_pod(
            node,
            &client,
            &control.with_file_name("dgx1-v100.broken"),
            7,
        )
        .await?;

        // The uninstall: the DaemonSet gone, then the post-delete Job's node-labels container
        // (its device-resources container waits out the kubelet's 5-minute grace: the
        // uninstall scenario runs that one).
        release.delete_objects(node)?;
        let mut hooks = support::Release {
            name: release.name.clone(),
            objects: Vec::new(),
            hooks: release.hooks.clone(),
        };
        for hook in &mut hooks.hooks {
            if hook["kind"] == "Job" {
                if let Some(containers) =
                    hook["spec"]["template"]["spec"]["containers"].as_array_mut()
                {
                    containers.retain(|c| c["name"] == "node-labels");
                }
            }
        }
        let took = hooks.run_post_delete_hooks(node, Duration::from_secs(120))?;
        figure(&format!(
            "uninstall: the post-delete Job removed devplug's node labels in {:.1} s",
            took.as_secs_f64()
        ));
        let after = node_labels(&nodes).await?;
        assert_eq!(
            after, before,
            "every label devplug wrote gone, every other label as it was"
        );
        Ok(())
    })
}

/// NVML breaks (as after a driver upgrade without a reboot: `nvmlInit` fails with a version
/// mismatch, every call with `UNKNOWN`) while a Deployment holds every healthy GPU, and two of
/// its pods go at that moment (finished, or replaced by a rollout), so the Deployment makes new
/// ones while the Node still advertises the GPUs. A plugin whose devices vanish or whose
/// Allocate fails makes a storm of Failed pods (`UnexpectedAdmissionError`, replaced at once
/// by the Deployment, refused again). Counted for 30 s: how many pods Failed, when the Node's
/// allocatable fell, what `/readyz` said; then NVML mended: every pod Running again. `healthy`:
/// the GPUs the Node has when it starts.
async fn nvml_failure_fails_no_pod(
    node: &Node,
    client: &kube::Client,
    broken: &Path,
    healthy: i64,
) -> Result<(), String> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, ListParams};
    let ns = Namespace::create(node, "dp-nvml-fails")?;
    // The Node's allocatable follows the lost GPU (the kubelet's status, after the labels).
    support::wait_node_resource(client, GPU, Duration::from_secs(60), |a, _| {
        a == Some(healthy)
    })
    .await?;
    let replicas = healthy;
    let deployment = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-users", "namespace": ns.name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "gpu-users"}},
            "template": {
                "metadata": {"labels": {"app": "gpu-users"}},
                "spec": {
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{
                        "name": "c",
                        "image": devplug_testkit::node::image::BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["sleep", "3600"],
                        "resources": {"limits": {GPU: "1"}},
                    }],
                },
            },
        },
    });
    support::apply(node, &[deployment])?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let listed = || async {
        pods.list(&ListParams::default().labels("app=gpu-users"))
            .await
            .map_err(|e| format!("list pods: {e}"))
            .map(|l| l.items)
    };
    let phase = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default()
    };
    let running = |items: &[Pod]| items.iter().filter(|p| phase(p) == "Running").count();
    let deadline = Instant::now() + Duration::from_secs(90);
    while running(&listed().await?) != usize::try_from(replicas).unwrap_or(0) {
        if Instant::now() > deadline {
            return Err(format!("{replicas} GPU pods not Running in 90 s"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    write(broken, b"")?;
    let broke = Instant::now();
    let names: Vec<String> = listed()
        .await?
        .iter()
        .take(2)
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let mut args = vec!["delete", "pod", "-n", ns.name.as_str(), "--wait=false"];
    args.extend(names.iter().map(String::as_str));
    node.kubectl(&args, None)?;
    let mut failed: std::collections::BTreeSet<String> = Default::default();
    // Pods that failed once the Node said it had no GPU (and 2 s for the scheduler to see it).
    let mut failed_after_zero: std::collections::BTreeSet<String> = Default::default();
    let mut allocatable_zero: Option<Duration> = None;
    let mut readyz = String::new();
    while broke.elapsed() < Duration::from_secs(30) {
        let settled =
            allocatable_zero.is_some_and(|at| broke.elapsed() > at + Duration::from_secs(2));
        for p in listed().await? {
            if phase(&p) == "Failed" {
                let name = p.metadata.name.clone().unwrap_or_default();
                if settled && !failed.contains(&name) {
                    failed_after_zero.insert(name.clone());
                }
                failed.insert(name);
            }
        }
        if allocatable_zero.is_none() && support::node_resource(client, GPU).await?.0 == Some(0) {
            allocatable_zero = Some(broke.elapsed());
        }
        if !readyz.starts_with("503") {
            if let Some((code, body)) = support::http_get(18081, "/readyz") {
                readyz = format!("{code} {}", body.trim());
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let items = listed().await?;
    figure(&format!(
        "NVML broken (version mismatch) while {replicas} pods held every GPU and 2 were replaced: \
         {} pods Failed in 30 s; Node allocatable {GPU} 0 after {:?}; {} still Running, {} Pending; /readyz: {readyz}",
        failed.len(),
        allocatable_zero.map(|d| format!("{:.1} s", d.as_secs_f64())),
        running(&items),
        items.iter().filter(|p| phase(p) == "Pending").count(),
    ));

    std::fs::remove_file(broken).map_err(|e| format!("{}: {e}", broken.display()))?;
    let mended = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    while running(&listed().await?) != usize::try_from(replicas).unwrap_or(0) {
        if Instant::now() > deadline {
            return Err(format!(
                "{replicas} GPU pods not Running 120 s after NVML was mended\n{}",
                support::devplug_log_tail(node, 40)
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    figure(&format!(
        "NVML mended: all {replicas} pods Running again {:.1} s later",
        mended.elapsed().as_secs_f64()
    ));
    ns.delete(node)?;
    // The storm ends once the Node says it has no GPU: the devices stay listed, Unhealthy, so
    // the capacity does not come back until NVML does and the new pods wait Pending.
    assert!(
        failed_after_zero.is_empty(),
        "pods Failed after the Node's allocatable fell to 0: {failed_after_zero:?}"
    );
    assert!(
        allocatable_zero.is_some(),
        "the Node's allocatable never fell to 0"
    );
    assert!(readyz.contains("NVML"), "/readyz names NVML: {readyz:?}");
    Ok(())
}
