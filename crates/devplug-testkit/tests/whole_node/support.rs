//! What the scenarios share: installing as an operator does (Helm's rendered chart, with its
//! hooks treated as Helm treats them; kustomize through kubectl), pods, waits on the API, the
//! kubelet's allocatable as it sees it (PodResources), and the figures.

use devplug_testkit::node::{Node, KUBELET_ROOT, NODE_NAME};
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::runtime::wait::await_condition;
use kube::Api;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The line every test container prints after what the test reads.
pub const DONE: &str = "--- devplug-test: done";

/// Prints a figure for the benchmarks page.
pub fn figure(text: &str) {
    crate::say(&format!("figure: {text}"));
}

/// Waits until devplug's DaemonSet has rolled out and its pods are Ready (registered and
/// streaming: its `/readyz`).
pub fn wait_daemonset_ready(node: &Node) -> Result<(), String> {
    node.kubectl(
        &[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "daemonset/devplug",
            "--timeout=180s",
        ],
        None,
    )
    .map(drop)
}

/// A merge patch of devplug's DaemonSet in kube-system.
pub fn patch_daemonset(node: &Node, patch: &str) -> Result<(), String> {
    node.kubectl(
        &[
            "-n",
            "kube-system",
            "patch",
            "daemonset",
            "devplug",
            "--type=merge",
            "-p",
            patch,
        ],
        None,
    )
    .map(drop)
}

/// A Helm release rendered offline: its objects, and its hooks apart, as Helm keeps them.
pub struct Release {
    pub name: String,
    pub objects: Vec<Value>,
    pub hooks: Vec<Value>,
}

fn annotation<'a>(object: &'a Value, key: &str) -> Option<&'a str> {
    object["metadata"]["annotations"][key].as_str()
}

/// The release rendered into `<DEVPLUG_HELM_RENDERED>/<name>.yaml` by `.ci/render-helm`.
pub fn helm_release(node: &Node, name: &str) -> Result<Release, String> {
    let path = node.requirements.helm_rendered.join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let on_crio = node.runtime_name()? == "cri-o";
    let (hooks, objects) = docs
        .into_iter()
        .filter(|d| !d.is_null())
        .map(|mut d| {
            if on_crio {
                qualify_images(&mut d);
            }
            d
        })
        .partition(|d| annotation(d, "helm.sh/hook").is_some());
    Ok(Release {
        name: name.to_owned(),
        objects,
        hooks,
    })
}

/// Names devplug's image in full wherever the chart names it short (`devplug:<tag>`, the chart's
/// default repository): CRI-O resolves a short name only through the machine's
/// `/etc/containers/registries.conf`, which the test node leaves alone. What an operator does
/// on such a node with `--set image.repository=docker.io/library/devplug`.
fn qualify_images(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                match item {
                    Value::String(image) if key == "image" && image.starts_with("devplug:") => {
                        *image = format!("docker.io/library/{image}");
                    }
                    other => qualify_images(other),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(qualify_images),
        _ => {}
    }
}

fn as_list(objects: &[Value]) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": objects}).to_string()
}

/// `kubectl apply` of `objects`.
pub fn apply(node: &Node, objects: &[Value]) -> Result<(), String> {
    node.kubectl(&["apply", "-f", "-"], Some(&as_list(objects)))
        .map(drop)
}

impl Release {
    /// What `helm install` does with this chart: every object but the hooks. (It has no
    /// install hooks; the uninstall hooks run at uninstall only.)
    pub fn install(&self, node: &Node) -> Result<(), String> {
        let install_hooks: Vec<&Value> = self
            .hooks
            .iter()
            .filter(|h| annotation(h, "helm.sh/hook").is_some_and(|e| e.contains("install")))
            .collect();
        if !install_hooks.is_empty() {
            return Err(format!(
                "{}: the chart has install hooks now; teach the test to run them",
                self.name
            ));
        }
        apply(node, &self.objects)
    }

    /// The first half of `helm uninstall`: every object of the release deleted, waited for.
    pub fn delete_objects(&self, node: &Node) -> Result<(), String> {
        node.kubectl(
            &[
                "delete",
                "--ignore-not-found",
                "--wait=true",
                "--timeout=120s",
                "-f",
                "-",
            ],
            Some(&as_list(&self.objects)),
        )
        .map(drop)
    }

    /// The second half: the `post-delete` hooks by weight, each Job waited for, and those with
    /// `hook-succeeded` in their delete policy deleted after. Returns how long the Jobs ran.
    pub fn run_post_delete_hooks(
        &self,
        node: &Node,
        timeout: Duration,
    ) -> Result<Duration, String> {
        let mut hooks: Vec<&Value> = self
            .hooks
            .iter()
            .filter(|h| {
                annotation(h, "helm.sh/hook")
                    .is_some_and(|e| e.split(',').any(|e| e.trim() == "post-delete"))
            })
            .collect();
        hooks.sort_by_key(|h| {
            annotation(h, "helm.sh/hook-weight")
                .and_then(|w| w.parse::<i64>().ok())
                .unwrap_or(0)
        });
        let started = Instant::now();
        for hook in &hooks {
            apply(node, std::slice::from_ref(hook))?;
            if hook["kind"] == "Job" {
                let name = hook["metadata"]["name"].as_str().unwrap_or_default();
                let ns = hook["metadata"]["namespace"].as_str().unwrap_or("default");
                // Complete, or Failed (no waiting out the timeout for a Job that gave up).
                let deadline = Instant::now() + timeout;
                loop {
                    let state = node.kubectl(
                        &[
                            "get",
                            "job",
                            name,
                            "-n",
                            ns,
                            "-o",
                            "jsonpath={range .status.conditions[*]}{.type}={.status} {end}",
                        ],
                        None,
                    )?;
                    if state.contains("Complete=True") {
                        break;
                    }
                    if state.contains("Failed=True") || Instant::now() > deadline {
                        let logs = node
                            .kubectl(
                                &[
                                    "get",
                                    "pods",
                                    "-n",
                                    ns,
                                    "-l",
                                    &format!("job-name={name}"),
                                    "-o",
                                    "wide",
                                ],
                                None,
                            )
                            .unwrap_or_default();
                        return Err(format!(
                            "the post-delete Job {name} did not complete ({state}):\n{logs}"
                        ));
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        let took = started.elapsed();
        let succeeded: Vec<Value> = hooks
            .iter()
            .filter(|h| {
                annotation(h, "helm.sh/hook-delete-policy")
                    .is_some_and(|p| p.contains("hook-succeeded"))
            })
            .map(|h| (*h).clone())
            .collect();
        node.kubectl(
            &["delete", "--ignore-not-found", "--wait=true", "-f", "-"],
            Some(&as_list(&succeeded)),
        )?;
        Ok(took)
    }
}

/// The Node's allocatable and capacity of `resource` (None: no such key).
pub async fn node_resource(
    client: &kube::Client,
    resource: &str,
) -> Result<(Option<i64>, Option<i64>), String> {
    let nodes: Api<KubeNode> = Api::all(client.clone());
    let node = nodes
        .get(NODE_NAME)
        .await
        .map_err(|e| format!("get Node: {e}"))?;
    Ok(quantities(&node, resource))
}

fn quantities(node: &KubeNode, resource: &str) -> (Option<i64>, Option<i64>) {
    let read = |map: Option<
        &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| {
        map.and_then(|m| m.get(resource))
            .and_then(|q| q.0.parse::<i64>().ok())
    };
    let status = node.status.as_ref();
    (
        read(status.and_then(|s| s.allocatable.as_ref())),
        read(status.and_then(|s| s.capacity.as_ref())),
    )
}

/// Waits until the Node's (allocatable, capacity) of `resource` satisfies `want`; how long.
pub async fn wait_node_resource(
    client: &kube::Client,
    resource: &str,
    timeout: Duration,
    want: impl Fn(Option<i64>, Option<i64>) -> bool,
) -> Result<Duration, String> {
    let started = Instant::now();
    let nodes: Api<KubeNode> = Api::all(client.clone());
    let resource_name = resource.to_owned();
    let condition = move |node: Option<&KubeNode>| {
        node.is_some_and(|n| {
            let (allocatable, capacity) = quantities(n, &resource_name);
            want(allocatable, capacity)
        })
    };
    match tokio::time::timeout(timeout, await_condition(nodes, NODE_NAME, condition)).await {
        Ok(Ok(_)) => Ok(started.elapsed()),
        Ok(Err(err)) => Err(format!("watching the Node: {err}")),
        Err(_) => {
            let now = node_resource(client, resource)
                .await
                .unwrap_or((None, None));
            Err(format!(
                "{resource} on the Node never got as wanted in {timeout:?}; now (allocatable, capacity) = {now:?}"
            ))
        }
    }
}

/// A pod of the test image: `script` runs in `sh`, then [`DONE`] is printed and it sleeps, so
/// its output can be read while it runs. `limits` are extended resources.
pub fn pod(namespace: &str, name: &str, limits: &[(&str, u32)], script: &str) -> Value {
    let limits: serde_json::Map<String, Value> = limits
        .iter()
        .map(|(resource, n)| ((*resource).to_owned(), json!(n.to_string())))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "c",
                "image": devplug_testkit::node::image::BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", format!("{script}\necho '{DONE}'\nexec sleep 3600")],
                "resources": {"limits": limits},
            }],
        },
    })
}

/// A namespace of the scenario's own, deleted (with its pods) when dropped... by `delete`.
pub struct Namespace {
    pub name: String,
}

impl Namespace {
    pub fn create(node: &Node, name: &str) -> Result<Namespace, String> {
        let _ = node.kubectl(
            &[
                "delete",
                "namespace",
                name,
                "--ignore-not-found",
                "--wait=true",
            ],
            None,
        );
        node.kubectl(&["create", "namespace", name], None)?;
        // The controller-manager makes its default ServiceAccount; pods need it.
        let deadline = Instant::now() + Duration::from_secs(30);
        while node
            .kubectl(&["get", "serviceaccount", "default", "-n", name], None)
            .is_err()
        {
            if Instant::now() > deadline {
                return Err(format!(
                    "namespace {name} got no default ServiceAccount in 30 s"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Namespace {
            name: name.to_owned(),
        })
    }

    pub fn delete(&self, node: &Node) -> Result<(), String> {
        node.kubectl(
            &[
                "delete",
                "pods",
                "--all",
                "-n",
                &self.name,
                "--grace-period=0",
                "--force",
                "--wait=true",
            ],
            None,
        )?;
        node.kubectl(
            &[
                "delete",
                "namespace",
                &self.name,
                "--wait=true",
                "--timeout=120s",
            ],
            None,
        )
        .map(drop)
    }
}

/// Why a pod is where it is: phase, reason, message, conditions, container states.
pub fn describe(pod: &Pod) -> String {
    let status = pod.status.clone().unwrap_or_default();
    format!(
        "phase {:?}, reason {:?}, message {:?}, conditions {:?}, containers {:?}",
        status.phase,
        status.reason,
        status.message,
        status
            .conditions
            .unwrap_or_default()
            .iter()
            .map(|c| format!(
                "{}={} {}",
                c.type_,
                c.status,
                c.message.clone().unwrap_or_default()
            ))
            .collect::<Vec<_>>(),
        status
            .container_statuses
            .unwrap_or_default()
            .iter()
            .map(|c| format!("{}: {:?}", c.name, c.state))
            .collect::<Vec<_>>(),
    )
}

/// Waits until the pod satisfies `want` (a terminal phase that does not is a failure at once).
pub async fn wait_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
    want: impl Fn(&Pod) -> bool + Clone + Send + 'static,
) -> Result<Pod, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let check = want.clone();
    let condition = move |pod: Option<&Pod>| {
        pod.is_some_and(|p| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            check(p) || matches!(phase, Some("Failed") | Some("Succeeded"))
        })
    };
    let waited =
        tokio::time::timeout(timeout, await_condition(pods.clone(), name, condition)).await;
    let pod = pods
        .get(name)
        .await
        .map_err(|e| format!("get pod {namespace}/{name}: {e}"))?;
    match waited {
        Ok(Ok(_)) if want(&pod) => Ok(pod),
        Ok(Ok(_)) => Err(format!("pod {namespace}/{name} ended: {}", describe(&pod))),
        Ok(Err(err)) => Err(format!("watching pod {namespace}/{name}: {err}")),
        Err(_) => Err(format!(
            "pod {namespace}/{name} after {timeout:?}: {}",
            describe(&pod)
        )),
    }
}

/// Whether the pod runs.
pub fn running(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Waits for the container `c` of the pod to have printed [`DONE`]; what it printed before.
pub async fn container_output(
    node: &Node,
    namespace: &str,
    pod: &str,
    timeout: Duration,
) -> Result<String, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let log = node.container_log(namespace, pod, "c");
        if let Ok(text) = &log {
            if let Some((before, _)) = text.split_once(DONE) {
                return Ok(before.to_owned());
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{namespace}/{pod} printed no '{DONE}' in {timeout:?}: {log:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value of `NAME=` in `env` output.
pub fn env_value<'a>(output: &'a str, name: &str) -> Option<&'a str> {
    output
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
}

/// Samples the kubelet's own allocatable count of `resource` (PodResources
/// `GetAllocatableResources`) every 20 ms until stopped: the kubelet's view, finer than the
/// Node status it publishes.
pub struct AllocatableSampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<(Duration, usize)>>>,
    task: tokio::task::JoinHandle<()>,
}

/// What a sampler saw.
#[derive(Debug)]
pub struct Sampled {
    pub samples: usize,
    pub min: usize,
    /// The longest run of samples at 0, from its first to the first non-zero after it.
    pub longest_zero: Duration,
    pub failed_calls: usize,
}

impl AllocatableSampler {
    pub fn start(resource: &str) -> AllocatableSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (stop2, samples2, resource) = (stop.clone(), samples.clone(), resource.to_owned());
        let task = tokio::spawn(async move {
            let socket = std::path::Path::new(KUBELET_ROOT).join("pod-resources/kubelet.sock");
            let started = Instant::now();
            let mut client = None;
            while !stop2.load(Ordering::Relaxed) {
                if client.is_none() {
                    client = devplug::podresources::PodResourcesClient::connect(
                        &socket,
                        Duration::from_secs(1),
                    )
                    .await
                    .ok()
                    .map(|c| c.with_interval(Duration::from_millis(20)));
                }
                let count = match client.as_mut() {
                    Some(c) => match c.allocatable().await {
                        Ok(answer) => devplug::podresources::allocatable_counts(&answer)
                            .get(&resource)
                            .copied()
                            .unwrap_or(0),
                        Err(_) => {
                            client = None;
                            usize::MAX
                        }
                    },
                    None => usize::MAX,
                };
                if let Ok(mut s) = samples2.lock() {
                    s.push((started.elapsed(), count));
                }
                if count == usize::MAX {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        AllocatableSampler {
            stop,
            samples,
            task,
        }
    }

    pub async fn finish(self) -> Sampled {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        let samples = self.samples.lock().map(|s| s.clone()).unwrap_or_default();
        let answered: Vec<&(Duration, usize)> =
            samples.iter().filter(|(_, n)| *n != usize::MAX).collect();
        let mut longest = Duration::ZERO;
        let mut zero_since: Option<Duration> = None;
        for (at, n) in &answered {
            match (n, zero_since) {
                (0, None) => zero_since = Some(*at),
                (0, Some(_)) => {}
                (_, Some(since)) => {
                    longest = longest.max(at.saturating_sub(since));
                    zero_since = None;
                }
                _ => {}
            }
        }
        if let (Some(since), Some((last, _))) = (zero_since, answered.last()) {
            longest = longest.max(last.saturating_sub(since));
        }
        Sampled {
            samples: answered.len(),
            min: answered.iter().map(|(_, n)| *n).min().unwrap_or(0),
            longest_zero: longest,
            failed_calls: samples.len() - answered.len(),
        }
    }
}

/// The pods of `namespace` that the kubelet refused at admission (`UnexpectedAdmissionError`
/// and the like: phase Failed before any container ran), by name with their message.
pub async fn refused_pods(client: &kube::Client, namespace: &str) -> Result<Vec<String>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(&Default::default())
        .await
        .map_err(|e| format!("list pods: {e}"))?;
    Ok(list
        .items
        .iter()
        .filter(|p| {
            let s = p.status.as_ref();
            s.and_then(|s| s.phase.as_deref()) == Some("Failed")
                && s.and_then(|s| s.reason.as_deref())
                    .is_some_and(|r| r.contains("Admission"))
        })
        .map(|p| {
            format!(
                "{}: {}",
                p.metadata.name.clone().unwrap_or_default(),
                p.status
                    .as_ref()
                    .and_then(|s| s.message.clone())
                    .unwrap_or_default()
            )
        })
        .collect())
}

/// The devplug pods of the DaemonSet labelled `app.kubernetes.io/name=devplug` in kube-system.
pub async fn devplug_pods(client: &kube::Client) -> Result<Vec<Pod>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let list = pods
        .list(&kube::api::ListParams::default().labels("app.kubernetes.io/name=devplug"))
        .await
        .map_err(|e| format!("list devplug pods: {e}"))?;
    Ok(list.items)
}

/// The kubelet's and devplug's log tails, for a failure message.
pub fn devplug_log(node: &Node) -> String {
    devplug_log_tail(node, 15)
}

/// The last `lines` lines of each devplug container's log on the node.
pub fn devplug_log_tail(node: &Node, lines: usize) -> String {
    let dir = node.layout.pod_logs();
    let mut out = String::new();
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("kube-system_devplug") {
            if let Ok(text) = node.container_log(
                "kube-system",
                name.split('_').nth(1).unwrap_or_default(),
                "devplug",
            ) {
                let tail: Vec<&str> = text.lines().rev().take(lines).collect();
                out.push_str(&format!(
                    "--- {name}:\n{}\n",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
        }
    }
    out
}

/// Removes whatever a scenario may have left installed: devplug's DaemonSets (every install
/// labels them `app.kubernetes.io/name=devplug`), the scenarios' namespaces, the DRA example.
pub fn reset(node: &Node) {
    let _ = node.kubectl(
        &[
            "delete",
            "daemonset",
            "-n",
            "kube-system",
            "-l",
            "app.kubernetes.io/name=devplug",
            "--wait=true",
        ],
        None,
    );
    for name in ["basic", "extended-resource"] {
        let example = node
            .requirements
            .repo
            .join(format!("deploy/examples/dra/{name}/manifests.yaml"));
        let _ = node.kubectl(
            &[
                "delete",
                "--ignore-not-found",
                "--wait=true",
                "--grace-period=0",
                "--force",
                "-f",
                &example.display().to_string(),
            ],
            None,
        );
    }
    let namespaces = node
        .kubectl(
            &[
                "get",
                "namespaces",
                "-o",
                "jsonpath={.items[*].metadata.name}",
            ],
            None,
        )
        .unwrap_or_default();
    for ns in namespaces
        .split_whitespace()
        .filter(|n| n.starts_with("dp-"))
    {
        let _ = node.kubectl(
            &[
                "delete",
                "pods",
                "--all",
                "-n",
                ns,
                "--grace-period=0",
                "--force",
            ],
            None,
        );
        let _ = node.kubectl(
            &["delete", "namespace", ns, "--wait=true", "--timeout=60s"],
            None,
        );
    }
}

/// Follows the Node object (a watch) and remembers the least allocatable of `resource` it
/// published: what the scheduler saw.
pub struct NodeAllocatableWatch {
    least: Arc<Mutex<Option<i64>>>,
    updates: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeAllocatableWatch {
    pub fn start(client: &kube::Client, resource: &str) -> NodeAllocatableWatch {
        use futures_util::StreamExt;
        let least = Arc::new(Mutex::new(None));
        let updates = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let nodes: Api<KubeNode> = Api::all(client.clone());
        let (least2, updates2, resource) = (least.clone(), updates.clone(), resource.to_owned());
        let task = tokio::spawn(async move {
            let config = kube::runtime::watcher::Config::default()
                .fields(&format!("metadata.name={NODE_NAME}"));
            let mut events = kube::runtime::watcher(nodes, config).boxed();
            while let Some(event) = events.next().await {
                let node = match event {
                    Ok(
                        kube::runtime::watcher::Event::Apply(n)
                        | kube::runtime::watcher::Event::InitApply(n),
                    ) => n,
                    _ => continue,
                };
                let (allocatable, _) = quantities(&node, &resource);
                updates2.fetch_add(1, Ordering::Relaxed);
                if let (Ok(mut least), Some(a)) = (least2.lock(), allocatable) {
                    *least = Some(least.map_or(a, |l: i64| l.min(a)));
                }
            }
        });
        NodeAllocatableWatch {
            least,
            updates,
            task,
        }
    }

    /// (least allocatable seen, Node updates seen).
    pub fn finish(self) -> (Option<i64>, usize) {
        self.task.abort();
        let least = self.least.lock().map(|l| *l).unwrap_or(None);
        (least, self.updates.load(Ordering::Relaxed))
    }
}

/// GET `path` on `127.0.0.1:port` (a host-network pod's endpoint), blocking for at most 5 s:
/// the status code and body, or `None` if nothing answered.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Deletes pod `pod` (gracefully: the kubelet unprepares its claims as it terminates) and waits
/// (90 s at most: the kubelet's DRA reconcile loop, every 60 s, catches what that misses) until
/// the ResourceClaim `claim` it used (made on its own, so it stays) has no `status.devices`
/// left: the kubelet unprepared it and the driver removed its device status. How long that took.
pub async fn device_status_gone_with_pod(
    node: &Node,
    namespace: &str,
    pod: &str,
    claim: &str,
) -> Result<Duration, String> {
    node.kubectl(
        &["delete", "pod", pod, "-n", namespace, "--wait=true"],
        None,
    )?;
    let deleted = Instant::now();
    loop {
        let devices = node.kubectl(
            &[
                "get",
                "resourceclaim",
                claim,
                "-n",
                namespace,
                "-o",
                "jsonpath={.status.devices}",
            ],
            None,
        )?;
        if devices.trim().is_empty() || devices.trim() == "[]" {
            return Ok(deleted.elapsed());
        }
        if deleted.elapsed() > Duration::from_secs(90) {
            return Err(format!(
                "the device status of claim {namespace}/{claim} stayed 90 s after its pod was \
                 deleted: {devices}\n{}",
                devplug_log(node)
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (90 s at most) until some ResourceSlice, as a line `<driver> <node> <counter sets>`,
/// is what `want` looks for; the error names `what` and has devplug's log.
pub async fn wait_for_slices(
    node: &Node,
    what: &str,
    want: impl Fn(&str) -> bool,
) -> Result<(), String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let slices = node.kubectl(
            &[
                "get",
                "resourceslices",
                "-o",
                "jsonpath={range .items[*]}{.spec.driver} {.spec.nodeName} {.spec.sharedCounters[*].name}{\"\\n\"}{end}",
            ],
            None,
        )?;
        if slices.lines().any(&want) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!(
                "no ResourceSlice with {what} in 90 s:\n{slices}\n{}",
                devplug_log(node)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
