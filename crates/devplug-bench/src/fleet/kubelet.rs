//! The kubelet stand-in of every simulated node. One watch of the benchmark's pods serves all
//! nodes (as one informer would); each event goes to the worker of the pod's node, and the
//! per-node work is per node, as on a real node: for a pod bound there, in a task of its own
//! (the kubelet's pod workers run side by side, so pods landing on a node together reach its
//! driver together), read its claims
//! (the kubelet reads each claim to learn its UID), call that node's `NodePrepareResources`
//! over the driver's real socket, and mark the pod Running (a status patch, as kwok does);
//! for a pod being deleted, `NodeUnprepareResources`, then the final delete a kubelet makes;
//! for a pod that runs for a while only (a short-lived Job's, [`workload::RUN_FOR`]), at its
//! end `NodeUnprepareResources` and the phase `Succeeded`, as the kubelet when its container
//! exits 0.
//!
//! Times are kept by the pod's workload name: its Job's ([`workload::JOB_LABEL`]) or its own.

use super::workload;
use devplug_proto::dra_v1::{self, dra_plugin_client::DraPluginClient};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use kube::Api;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;

/// How long a pod whose claims are not ready to prepare waits before the next try.
const RETRY: Duration = Duration::from_millis(500);

/// What the stand-ins saw, shared with the workload.
#[derive(Default)]
pub struct Observed {
    /// When each pod (by workload name) was marked Running.
    pub running: Mutex<HashMap<String, Instant>>,
    /// When each pod (by workload name) was first seen bound to its node.
    pub bound: Mutex<HashMap<String, Instant>>,
    /// Pods (by workload name) that ran their time and succeeded.
    pub succeeded: Mutex<HashMap<String, Instant>>,
    /// Successful `NodePrepareResources` calls per claim UID, and the node that answered.
    pub prepared: Mutex<HashMap<String, (u32, String)>>,
    /// Successful `NodeUnprepareResources` calls per claim UID.
    pub unprepared: Mutex<HashMap<String, u32>>,
    /// `NodePrepareResources` round trips (over the socket), in order.
    pub prepare_times: Mutex<Vec<Duration>>,
    /// Calls that failed (an error from the driver or the socket), with why.
    pub failures: Mutex<Vec<String>>,
}

impl Observed {
    /// The calls that failed so far, with why.
    pub fn failures(&self) -> Vec<String> {
        copy(&self.failures)
    }

    /// Successful `NodePrepareResources` calls per claim UID so far, with the node.
    pub fn prepared(&self) -> HashMap<String, (u32, String)> {
        copy(&self.prepared)
    }

    /// Successful `NodeUnprepareResources` calls per claim UID so far.
    pub fn unprepared(&self) -> HashMap<String, u32> {
        copy(&self.unprepared)
    }
}

/// What `field` holds now (empty if a holder panicked).
fn copy<T: Clone + Default>(field: &Mutex<T>) -> T {
    field.lock().map(|f| f.clone()).unwrap_or_default()
}

/// Pods marked Running, by count (for waits without polling).
pub type RunningCount = watch::Receiver<usize>;

/// One node's worker: its pods and the driver's socket.
struct Worker {
    /// The driver's socket as last registered.
    endpoint: watch::Receiver<PathBuf>,
    /// The connection, and the socket it was made to.
    channel: Option<(PathBuf, Channel)>,
    /// Prepared claims of each pod UID on this node.
    prepared: HashMap<String, Vec<dra_v1::Claim>>,
    /// Claims of each pod UID whose `NodePrepareResources` got no answer (the socket failed
    /// mid-call): the driver may have prepared them, so a deletion unprepares them too, as the
    /// kubelet does for a claim in its cache.
    attempted: HashMap<String, Vec<dra_v1::Claim>>,
    /// Pods (by UID) whose claims were unprepared for their deletion: a retry of an older
    /// event of theirs, still queued, must not prepare them again.
    finished: HashSet<String>,
    /// Pods (by UID) whose prepare runs in a task of its own now.
    in_flight: HashSet<String>,
    /// What the pods' own tasks send back.
    outcomes: mpsc::UnboundedSender<Outcome>,
    /// What the node's pods' own tasks need.
    ctx: Arc<Ctx>,
    retry: mpsc::UnboundedSender<Pod>,
}

/// What a pod's own task needs: the API client, the shared observations, the Running count and
/// the node's name.
struct Ctx {
    node: String,
    client: kube::Client,
    observed: Arc<Observed>,
    running: watch::Sender<usize>,
}

/// A pod's prepare, done in a task of its own (as the kubelet's pod workers run side by side),
/// back to the node's worker.
struct Outcome {
    pod: Pod,
    uid: String,
    result: Result<Option<Vec<dra_v1::Claim>>, Failure>,
    /// Whether the pod was marked Running.
    running: bool,
}

/// A prepare that failed.
struct Failure {
    why: String,
    /// The claims of a call that got no answer (the driver may have prepared them).
    attempted: Option<Vec<dra_v1::Claim>>,
}

/// The stand-ins of all nodes: the shared watch and a worker per node.
pub struct Kubelets {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// What they saw.
    pub observed: Arc<Observed>,
    /// Pods marked Running so far.
    pub running: RunningCount,
}

impl Kubelets {
    /// Starts a worker for each `(node, driver socket as registered)` and the watch of
    /// `namespace`'s pods.
    pub fn start(
        client: kube::Client,
        namespace: &str,
        nodes: &[(String, watch::Receiver<PathBuf>)],
    ) -> Kubelets {
        let observed = Arc::new(Observed::default());
        let (running_tx, running) = watch::channel(0usize);
        let mut tasks = Vec::with_capacity(nodes.len() + 1);
        let mut routes: HashMap<String, mpsc::UnboundedSender<Pod>> = HashMap::new();
        for (node, endpoint) in nodes {
            let (tx, rx) = mpsc::unbounded_channel();
            let (outcomes_tx, outcomes_rx) = mpsc::unbounded_channel();
            routes.insert(node.clone(), tx.clone());
            let worker = Worker {
                endpoint: endpoint.clone(),
                channel: None,
                prepared: HashMap::new(),
                attempted: HashMap::new(),
                finished: HashSet::new(),
                in_flight: HashSet::new(),
                outcomes: outcomes_tx,
                ctx: Arc::new(Ctx {
                    node: node.clone(),
                    client: client.clone(),
                    observed: observed.clone(),
                    running: running_tx.clone(),
                }),
                retry: tx,
            };
            tasks.push(tokio::spawn(worker.run(rx, outcomes_rx)));
        }
        let pods: Api<Pod> = Api::namespaced(client, namespace);
        tasks.push(tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(pods, watcher::Config::default()));
            while let Some(event) = events.next().await {
                let (pod, gone) = match event {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => (pod, false),
                    Ok(watcher::Event::Delete(pod)) => (pod, true),
                    Ok(_) => continue,
                    Err(err) => {
                        tracing::debug!(%err, "the pod watch failed; it starts again");
                        tokio::time::sleep(RETRY).await;
                        continue;
                    }
                };
                let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                if let Some(route) = node.and_then(|n| routes.get(&n)) {
                    let mut pod = pod;
                    if gone {
                        // A pod gone from the API server: a deletion mark, so the worker
                        // unprepares it and makes no final delete.
                        pod.metadata
                            .annotations
                            .get_or_insert_default()
                            .insert(GONE.into(), "1".into());
                    }
                    let _ = route.send(pod);
                }
            }
        }));
        Kubelets {
            tasks,
            observed,
            running,
        }
    }

    /// Stops every worker and the watch.
    pub fn stop(self) {
        for task in self.tasks {
            task.abort();
        }
    }
}

/// Marks a pod event as the pod's deletion from the API server.
const GONE: &str = "devplug-bench/gone";

/// Marks a pod event as the end of the pod's running time ([`workload::RUN_FOR`]).
const ENDS: &str = "devplug-bench/ends";

/// The name a pod's times are kept by: its Job's, or its own.
fn workload_name(pod: &Pod) -> Option<String> {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(workload::JOB_LABEL).cloned())
        .or_else(|| pod.metadata.name.clone())
}

/// Whether the pod event carries the mark `mark`.
fn marked(pod: &Pod, mark: &str) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(mark))
}

impl Worker {
    async fn run(
        mut self,
        mut pods: mpsc::UnboundedReceiver<Pod>,
        mut outcomes: mpsc::UnboundedReceiver<Outcome>,
    ) {
        loop {
            tokio::select! {
                pod = pods.recv() => match pod {
                    Some(pod) => self.handle(pod).await,
                    None => return,
                },
                Some(outcome) = outcomes.recv() => self.settle(outcome),
            }
        }
    }

    async fn handle(&mut self, pod: Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        if self.finished.contains(&uid) {
            // A pod that ended (its phase `Succeeded`) and is deleted afterwards still needs
            // the kubelet's last word: a deletion that came before its end was written left
            // it terminating (deleting it again once gone is answered "not found").
            if !marked(&pod, GONE)
                && pod.metadata.deletion_timestamp.is_some()
                && !self.final_delete(&pod, &uid).await
            {
                self.again(pod);
            }
            return;
        }
        if let Some(name) = workload_name(&pod) {
            if let Ok(mut bound) = self.ctx.observed.bound.lock() {
                bound.entry(name).or_insert_with(Instant::now);
            }
        }
        if marked(&pod, ENDS) {
            self.end(pod, uid).await;
            return;
        }
        let gone = marked(&pod, GONE);
        if gone || pod.metadata.deletion_timestamp.is_some() {
            if self.in_flight.contains(&uid) {
                // Its prepare is still running: unprepared once that ends.
                self.again(pod);
                return;
            }
            let claims = self
                .prepared
                .remove(&uid)
                .or_else(|| self.attempted.remove(&uid));
            if let Some(claims) = claims {
                if let Err(claims) = self.unprepare(claims).await {
                    // As the kubelet: the pod is not removed while its claims are prepared;
                    // the unprepare is tried again (the driver may be restarting).
                    self.prepared.insert(uid, claims);
                    self.again(pod);
                    return;
                }
            }
            if !gone && !self.final_delete(&pod, &uid).await {
                self.again(pod);
                return;
            }
            self.finished.insert(uid);
            return;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if self.prepared.contains_key(&uid)
            || self.in_flight.contains(&uid)
            || matches!(phase, Some("Running" | "Succeeded" | "Failed"))
        {
            return;
        }
        // Each pod's prepare in a task of its own, as the kubelet's pod workers run side by
        // side: pods landing on the node together reach the driver together.
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(err) => {
                self.fail(format!("connect: {err}"));
                self.again(pod);
                return;
            }
        };
        self.in_flight.insert(uid.clone());
        let (ctx, outcomes) = (self.ctx.clone(), self.outcomes.clone());
        tokio::spawn(async move {
            let result = prepare(&ctx, channel, &pod, &uid).await;
            // Prepared but not marked (the failure is recorded): the claims stay prepared
            // until the pod's deletion.
            let running = matches!(result, Ok(Some(_))) && mark_running(&ctx, &pod).await;
            let _ = outcomes.send(Outcome {
                pod,
                uid,
                result,
                running,
            });
        });
    }

    /// A pod's prepare ended: recorded, its end scheduled, or tried again.
    fn settle(&mut self, outcome: Outcome) {
        let Outcome {
            pod,
            uid,
            result,
            running,
        } = outcome;
        self.in_flight.remove(&uid);
        match result {
            Ok(Some(claims)) => {
                self.attempted.remove(&uid);
                self.prepared.insert(uid, claims);
                if running {
                    self.end_later(pod);
                }
            }
            // Claims not allocated or reserved yet: try again shortly.
            Ok(None) => self.again(pod),
            Err(failure) => {
                if let Some(claims) = failure.attempted {
                    // The connection may be broken: made again at the next call.
                    self.channel = None;
                    self.attempted.insert(uid, claims);
                }
                if let Ok(mut f) = self.ctx.observed.failures.lock() {
                    f.push(failure.why);
                }
                self.again(pod);
            }
        }
    }

    /// For a pod that runs for a while only ([`workload::RUN_FOR`]): its end handled after that
    /// time.
    fn end_later(&self, mut pod: Pod) {
        let run_for = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(workload::RUN_FOR))
            .and_then(|ms| ms.parse::<u64>().ok());
        let Some(ms) = run_for else { return };
        pod.metadata
            .annotations
            .get_or_insert_default()
            .insert(ENDS.into(), "1".into());
        let retry = self.retry.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let _ = retry.send(pod);
        });
    }

    /// The end of a pod's running time: its claims unprepared, then its phase `Succeeded`, as
    /// the kubelet when its only container exits 0 (nothing when it was deleted meanwhile).
    async fn end(&mut self, pod: Pod, uid: String) {
        let Some(claims) = self.prepared.remove(&uid) else {
            return;
        };
        if let Err(claims) = self.unprepare(claims).await {
            self.prepared.insert(uid, claims);
            self.again(pod);
            return;
        }
        let (Some(name), Some(namespace)) = (&pod.metadata.name, &pod.metadata.namespace) else {
            return;
        };
        let at = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = json!({ "status": {
            "phase": "Succeeded",
            "conditions": [{ "type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": at },
                { "type": "ContainersReady", "status": "False", "reason": "PodCompleted", "lastTransitionTime": at }],
        } });
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), namespace);
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
        {
            Ok(_) => {
                if let (Some(key), Ok(mut done)) =
                    (workload_name(&pod), self.ctx.observed.succeeded.lock())
                {
                    done.insert(key, Instant::now());
                }
                self.finished.insert(uid);
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                self.finished.insert(uid);
            }
            Err(err) => {
                // Unprepared already (so no claims are kept); the phase is written again
                // shortly.
                self.fail(format!("pod {name} not marked Succeeded: {err}"));
                self.prepared.insert(uid, Vec::new());
                self.again(pod);
            }
        }
    }

    /// The pod's event handled again after [`RETRY`].
    fn again(&self, pod: Pod) {
        let retry = self.retry.clone();
        tokio::spawn(async move {
            tokio::time::sleep(RETRY).await;
            let _ = retry.send(pod);
        });
    }

    /// `NodeUnprepareResources` for `claims`; on any failure the claims come back, to be tried
    /// again.
    async fn unprepare(&mut self, claims: Vec<dra_v1::Claim>) -> Result<(), Vec<dra_v1::Claim>> {
        if claims.is_empty() {
            return Ok(());
        }
        let result = async {
            let channel = self.channel().await?;
            let answer = DraPluginClient::new(channel)
                .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
                    claims: claims.clone(),
                })
                .await?
                .into_inner();
            anyhow::Ok(answer)
        }
        .await;
        match result {
            Ok(answer) => {
                let mut failed = Vec::new();
                for claim in claims {
                    match answer.claims.get(&claim.uid) {
                        Some(r) if r.error.is_empty() => {
                            if let Ok(mut un) = self.ctx.observed.unprepared.lock() {
                                let n = un.entry(claim.uid.clone()).or_default();
                                *n = n.saturating_add(1);
                            }
                        }
                        other => {
                            self.fail(format!("unprepare {}: {other:?}", claim.name));
                            failed.push(claim);
                        }
                    }
                }
                if failed.is_empty() {
                    Ok(())
                } else {
                    Err(failed)
                }
            }
            Err(err) => {
                self.channel = None;
                self.fail(format!("unprepare: {err}"));
                Err(claims)
            }
        }
    }

    /// The connection to the driver's socket as last registered: made again when the driver
    /// registered another socket (a restart) or the last call failed.
    async fn channel(&mut self) -> anyhow::Result<Channel> {
        let endpoint = self.endpoint.borrow().clone();
        if let Some((to, channel)) = &self.channel {
            if *to == endpoint {
                return Ok(channel.clone());
            }
        }
        let channel = devplug_proto::uds::connect(&endpoint, Duration::from_secs(5)).await?;
        self.channel = Some((endpoint, channel.clone()));
        Ok(channel)
    }

    fn fail(&self, what: String) {
        if let Ok(mut f) = self.ctx.observed.failures.lock() {
            f.push(format!("{}: {what}", self.ctx.node));
        }
    }

    /// The kubelet's last word on a deleted pod: removed for good once its containers (none
    /// here) stopped and its claims were unprepared. False when it failed (to be tried again).
    async fn final_delete(&self, pod: &Pod, uid: &str) -> bool {
        let (Some(name), Some(namespace)) = (&pod.metadata.name, &pod.metadata.namespace) else {
            return true;
        };
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), namespace);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => true,
            Err(kube::Error::Api(s)) if s.is_not_found() || s.code == 409 => true,
            Err(err) => {
                self.fail(format!("pod {name} not deleted: {err}"));
                false
            }
        }
    }
}

/// The pod's claims read and prepared; `None` when one is not allocated and reserved for
/// the pod yet.
async fn prepare(
    ctx: &Ctx,
    channel: Channel,
    pod: &Pod,
    uid: &str,
) -> Result<Option<Vec<dra_v1::Claim>>, Failure> {
    let failed = |why: String| Failure {
        why: format!("{}: {why}", ctx.node),
        attempted: None,
    };
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let spec_claims = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.clone())
        .unwrap_or_default();
    // A claim named in the pod's spec, or one the ResourceClaim controller made from a
    // template, named in the pod's status once made.
    let mut names: Vec<String> = spec_claims
        .iter()
        .filter_map(|c| c.resource_claim_name.clone())
        .collect();
    let from_templates = spec_claims.len().saturating_sub(names.len());
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default();
    if statuses.len() < from_templates {
        return Ok(None);
    }
    names.extend(statuses.into_iter().filter_map(|s| s.resource_claim_name));
    let api: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut claims = Vec::with_capacity(names.len());
    for name in names {
        let claim = api
            .get(&name)
            .await
            .map_err(|e| failed(format!("claim {name}: {e}")))?;
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| r.iter().any(|c| c.uid == uid));
        let allocated = claim
            .status
            .as_ref()
            .is_some_and(|s| s.allocation.is_some());
        if !reserved || !allocated {
            return Ok(None);
        }
        claims.push(dra_v1::Claim {
            namespace: namespace.clone(),
            name,
            uid: claim.metadata.uid.unwrap_or_default(),
        });
    }
    let started = Instant::now();
    let answer = DraPluginClient::new(channel)
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        })
        .await;
    let took = started.elapsed();
    let answer = match answer {
        Ok(answer) => answer.into_inner(),
        Err(status) => {
            return Err(Failure {
                why: format!("{}: NodePrepareResources: {status}", ctx.node),
                attempted: Some(claims),
            });
        }
    };
    if let Ok(mut times) = ctx.observed.prepare_times.lock() {
        times.push(took);
    }
    for claim in &claims {
        match answer.claims.get(&claim.uid) {
            Some(r) if r.error.is_empty() && !r.devices.is_empty() => {}
            Some(r) => return Err(failed(format!("claim {}: {}", claim.name, r.error))),
            None => return Err(failed(format!("claim {}: no answer", claim.name))),
        }
    }
    if let Ok(mut prepared) = ctx.observed.prepared.lock() {
        for claim in &claims {
            let entry = prepared
                .entry(claim.uid.clone())
                .or_insert((0, ctx.node.clone()));
            entry.0 = entry.0.saturating_add(1);
            entry.1 = ctx.node.clone();
        }
    }
    Ok(Some(claims))
}

/// Marks the pod Running; false when the status patch failed.
async fn mark_running(ctx: &Ctx, pod: &Pod) -> bool {
    let (Some(name), Some(namespace), Some(key)) = (
        &pod.metadata.name,
        &pod.metadata.namespace,
        workload_name(pod),
    ) else {
        return false;
    };
    let at = k8s_openapi::jiff::Timestamp::now().to_string();
    let condition =
        |kind: &str| json!({ "type": kind, "status": "True", "lastTransitionTime": at });
    let status = json!({ "status": {
        "phase": "Running", "startTime": at,
        "conditions": [condition("PodScheduled"), condition("Initialized"),
            condition("ContainersReady"), condition("Ready")],
    } });
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    match api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
    {
        Ok(_) => {
            if let Ok(mut running) = ctx.observed.running.lock() {
                running.insert(key, Instant::now());
            }
            ctx.running.send_modify(|n| *n = n.saturating_add(1));
            true
        }
        Err(err) => {
            if let Ok(mut f) = ctx.observed.failures.lock() {
                f.push(format!(
                    "{}: pod {name} not marked Running: {err}",
                    ctx.node
                ));
            }
            false
        }
    }
}
