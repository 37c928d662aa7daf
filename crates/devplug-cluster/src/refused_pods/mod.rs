//! Pods the kubelet refused at admission for a resource this devplug serves, dealt with.
//!
//! After a node reboot the kubelet admits every pod bound to the node in one pass as it starts,
//! before any pod runs again, devplug's own DaemonSet pod included: a pod asking for a device
//! plugin resource is refused (`UnexpectedAdmissionError`) and stays Failed. A ReplicaSet makes
//! a new pod (it counts only pods that are not terminal) and the refused one is left behind as
//! garbage; a Job counts a failure; a bare pod is gone for good. This watches its own node's
//! Failed pods (one watch, field selector `spec.nodeName=<node>,status.phase=Failed`) and, by
//! [`rules::classify`]:
//!
//! - a ReplicaSet's (or ReplicationController's) refused pod is deleted once a replacement of
//!   the same controller exists (a watch of the namespace's pods with the refused pod's labels,
//!   [`REPLACEMENT_WAIT`] at most; reported instead when none comes);
//! - a StatefulSet's or DaemonSet's is deleted at once: their controllers delete a failed pod
//!   and make it again themselves;
//! - a bare pod, a Job's pod, or one whose controller kind is unknown is reported: an event on
//!   the pod, and one event on the Node naming them all and what would have kept them. A pod
//!   with such an event already (an earlier devplug reported it) is not reported again.
//!
//! Pods refused for a resource devplug does not serve, pods that failed for any other reason,
//! and pods being deleted are never touched. A restart of devplug alone finds no refused pod of
//! its resources (the kubelet keeps running pods running), so it deletes nothing.
//!
//! Deletes carry the pod's UID as a precondition, so a pod made again under the same name is
//! never the one deleted. RBAC: `get`, `list`, `watch` on pods, `delete` on pods (limited to
//! Failed pods of the node the token was issued on by the chart's admission policy), `create` and
//! `patch` on events.k8s.io events, `list` on core events.

pub mod rules;

use crate::events::node_reference;
use crate::timed;
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Event as CoreEvent, ObjectReference, Pod};
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use rules::{Controller, Verdict};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// How long a refused ReplicaSet pod waits for its replacement before it is reported instead.
pub const REPLACEMENT_WAIT: Duration = Duration::from_secs(600);
/// Pods reported within this long of the first share one Node event.
pub const REPORT_BATCH: Duration = Duration::from_secs(2);
/// The reason of the event on each reported pod (and what marks it as reported).
pub const POD_REASON: &str = "RefusedAtAdmission";
/// The reason of the Node event naming the reported pods.
pub const NODE_REASON: &str = "PodsRefusedAtAdmission";

/// What devplug does with refused pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Delete those whose controller replaced them; report the rest.
    DeleteReplaced,
    /// Report every one; delete none.
    Report,
}

/// Counters of a [`RefusedPods`].
#[derive(Debug, Default)]
pub struct Counters {
    /// Refused pods deleted.
    pub deleted: AtomicU64,
    /// Refused pods reported (an event on the pod; each named in a Node event).
    pub reported: AtomicU64,
    /// Requests made to the API server (watch lists, deletes, event reads and writes).
    pub api_requests: AtomicU64,
    /// Requests that failed.
    pub failed: AtomicU64,
    /// When a request last worked (Unix seconds; 0: never).
    pub last_success_unix: AtomicU64,
}

impl Counters {
    fn request(&self) {
        self.api_requests.fetch_add(1, Ordering::Relaxed);
    }

    fn worked(&self) {
        self.last_success_unix
            .store(crate::unix_now(), Ordering::Relaxed);
    }
}

/// The running watch of one node's refused pods.
#[derive(Debug, Clone)]
pub struct RefusedPods {
    served: watch::Sender<BTreeSet<String>>,
    counters: Arc<Counters>,
}

impl RefusedPods {
    /// Starts watching `node`'s refused pods for the resources in `served`; `instance` names
    /// this reporter in events (the pod, or the node).
    pub fn spawn(
        client: kube::Client,
        node: String,
        instance: String,
        policy: Policy,
        served: BTreeSet<String>,
        stop: CancellationToken,
    ) -> RefusedPods {
        RefusedPods::spawn_gated(client, node, instance, policy, served, stop, None)
    }

    /// The same, deleting nothing before `gate` is passed ([`crate::policy_check::Gate`]; only
    /// the deletes need a policy: reporting writes events only).
    pub fn spawn_gated(
        client: kube::Client,
        node: String,
        instance: String,
        policy: Policy,
        served: BTreeSet<String>,
        stop: CancellationToken,
        gate: Option<crate::policy_check::Gate>,
    ) -> RefusedPods {
        let (tx, rx) = watch::channel(served);
        let counters = Arc::new(Counters::default());
        let ctx = Ctx {
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: "devplug".into(),
                    instance: Some(instance),
                },
            ),
            client,
            node,
            policy,
            counters: counters.clone(),
        };
        let gate = gate.filter(|_| policy == Policy::DeleteReplaced);
        tokio::spawn(async move {
            let feature = crate::policy_check::Feature::RefusedPods;
            if crate::policy_check::pass(gate.as_ref(), feature, &stop).await {
                run(ctx, rx, stop).await;
            }
        });
        RefusedPods {
            served: tx,
            counters,
        }
    }

    /// The resources served now (after a config reload).
    pub fn set_served(&self, served: BTreeSet<String>) {
        self.served.send_replace(served);
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The counters, to keep beside the watch (metrics).
    pub fn shared_counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }
}

#[derive(Clone)]
struct Ctx {
    client: kube::Client,
    recorder: Recorder,
    node: String,
    policy: Policy,
    counters: Arc<Counters>,
}

/// A pod to report, with the resource its refusal named.
struct Reported {
    pod: Pod,
    resource: String,
    controller: Option<Controller>,
}

async fn run(ctx: Ctx, mut served: watch::Receiver<BTreeSet<String>>, stop: CancellationToken) {
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    // Only this node's Failed pods, listed from the API server's watch cache (resourceVersion
    // 0): no consistent read reaching etcd, also when the watch starts again after an outage.
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={},status.phase=Failed", ctx.node))
        .any_semantic();
    let mut events = watcher(pods, config).default_backoff().boxed();
    // The node's Failed pods as the watch has them, by UID.
    let mut known: BTreeMap<String, Pod> = BTreeMap::new();
    // Pods acted on (deleted, awaiting a replacement, reported): never twice.
    let mut handled: HashSet<String> = HashSet::new();
    let (report_tx, mut report_rx) = mpsc::unbounded_channel::<Reported>();
    let mut batch: Vec<Reported> = Vec::new();
    let mut flush_at: Option<tokio::time::Instant> = None;
    tracing::info!(node = %ctx.node, policy = ?ctx.policy, "watching this node's pods refused at admission");
    loop {
        let due =
            flush_at.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400));
        tokio::select! {
            () = stop.cancelled() => return,
            changed = served.changed() => {
                if changed.is_err() {
                    return;
                }
                let now = served.borrow_and_update().clone();
                for pod in known.values() {
                    consider(&ctx, pod, &now, &mut handled, &report_tx, &stop);
                }
            }
            event = events.next() => match event {
                Some(Ok(watcher::Event::Init)) => {
                    ctx.counters.request();
                    ctx.counters.worked();
                    known.clear();
                }
                Some(Ok(watcher::Event::InitApply(pod) | watcher::Event::Apply(pod))) => {
                    let now = served.borrow().clone();
                    consider(&ctx, &pod, &now, &mut handled, &report_tx, &stop);
                    if let Some(uid) = pod.uid() {
                        known.insert(uid, pod);
                    }
                }
                Some(Ok(watcher::Event::Delete(pod))) => {
                    if let Some(uid) = pod.uid() {
                        known.remove(&uid);
                        handled.remove(&uid);
                    }
                }
                Some(Ok(watcher::Event::InitDone)) => {}
                Some(Err(err)) => {
                    ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%err, "cannot watch this node's failed pods; retrying");
                }
                None => return,
            },
            reported = report_rx.recv() => {
                if let Some(reported) = reported {
                    flush_at.get_or_insert_with(|| tokio::time::Instant::now() + REPORT_BATCH);
                    batch.push(reported);
                }
            }
            () = tokio::time::sleep_until(due), if flush_at.is_some() => {
                flush_at = None;
                // Off the watch loop: a slow API server holds up reporting, not watching.
                let (ctx, batch, stop) = (ctx.clone(), std::mem::take(&mut batch), stop.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = report(&ctx, batch) => {}
                    }
                });
            }
        }
    }
}

/// Acts on one pod the watch showed, by its verdict.
fn consider(
    ctx: &Ctx,
    pod: &Pod,
    served: &BTreeSet<String>,
    handled: &mut HashSet<String>,
    reports: &mpsc::UnboundedSender<Reported>,
    stop: &CancellationToken,
) {
    let Some(uid) = pod.uid() else {
        return;
    };
    if handled.contains(&uid) {
        return;
    }
    let verdict = rules::classify(pod, served);
    let (resource, controller, deletion) = match verdict {
        Verdict::Ignore(why) => {
            tracing::trace!(pod = %pod.name_any(), why, "failed pod left alone");
            return;
        }
        Verdict::Delete {
            resource,
            controller,
        } => (resource, Some(controller), Some(false)),
        Verdict::DeleteWhenReplaced {
            resource,
            controller,
        } => (resource, Some(controller), Some(true)),
        Verdict::Report {
            resource,
            controller,
        } => (resource, controller, None),
    };
    handled.insert(uid);
    let reported = Reported {
        pod: pod.clone(),
        resource,
        controller,
    };
    match (ctx.policy, deletion) {
        (Policy::DeleteReplaced, Some(wait)) => {
            let ctx = ctx.clone();
            let reports = reports.clone();
            let stop = stop.clone();
            // Cancelled with the watch: `refused_pods: off` stops pending deletes at once.
            tokio::spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = async {
                        if wait && !replaced(&ctx, &reported).await {
                            let _ = reports.send(reported);
                            return;
                        }
                        delete_pod(&ctx, &reported).await;
                    } => {}
                }
            });
        }
        _ => {
            let _ = reports.send(reported);
        }
    }
}

/// Waits until a replacement of the refused pod exists (true), or [`REPLACEMENT_WAIT`] passes.
async fn replaced(ctx: &Ctx, reported: &Reported) -> bool {
    let Some(by) = &reported.controller else {
        return false;
    };
    let namespace = reported.pod.namespace().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let selector = reported
        .pod
        .labels()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let counters = ctx.counters.clone();
    let stream = watcher(
        api,
        watcher::Config::default().labels(&selector).any_semantic(),
    )
    .default_backoff()
    .inspect_ok(move |event| {
        if matches!(event, watcher::Event::Init) {
            counters.request();
        }
    })
    .applied_objects();
    let found = tokio::time::timeout(REPLACEMENT_WAIT, async {
        let mut stream = std::pin::pin!(stream);
        loop {
            match stream.next().await {
                Some(Ok(candidate)) if rules::replaces(&candidate, &reported.pod, by) => {
                    return true
                }
                Some(_) => {}
                None => return false,
            }
        }
    })
    .await;
    let found = found.unwrap_or(false);
    if !found {
        tracing::warn!(
            pod = %format!("{namespace}/{}", reported.pod.name_any()),
            controller = %format!("{} {}", by.kind, by.name),
            "no replacement of a refused pod within {} s; reporting it instead of deleting it",
            REPLACEMENT_WAIT.as_secs()
        );
    }
    found
}

/// Deletes the refused pod (only that one: its UID is a precondition).
async fn delete_pod(ctx: &Ctx, reported: &Reported) {
    let namespace = reported.pod.namespace().unwrap_or_default();
    let name = reported.pod.name_any();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: reported.pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    ctx.counters.request();
    match timed(api.delete(&name, &params)).await {
        Ok(_) => {
            ctx.counters.worked();
            let deleted = ctx.counters.deleted.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::info!(
                pod = %format!("{namespace}/{name}"),
                resource = %reported.resource,
                controller = %reported.controller.as_ref().map(|c| format!("{} {}", c.kind, c.name)).unwrap_or_default(),
                deleted,
                api_requests = ctx.counters.api_requests.load(Ordering::Relaxed),
                "deleted a pod the kubelet refused at admission; its controller replaces it"
            );
        }
        // Gone already, or a new pod under the name: nothing of ours to delete.
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
        Err(err) => {
            ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pod = %format!("{namespace}/{name}"), %err, "cannot delete a refused pod");
        }
    }
}

/// Whether an earlier devplug already put its event on the pod.
async fn already_reported(ctx: &Ctx, pod: &Pod) -> bool {
    let (Some(namespace), Some(uid)) = (pod.namespace(), pod.uid()) else {
        return false;
    };
    let events: Api<CoreEvent> = Api::namespaced(ctx.client.clone(), &namespace);
    ctx.counters.request();
    // From the watch cache: an event written a moment ago may be missed, and the pod reported
    // twice, which is better than a read of etcd per refused pod.
    let params = ListParams::default()
        .fields(&format!("involvedObject.uid={uid},reason={POD_REASON}"))
        .match_any();
    match timed(events.list(&params)).await {
        Ok(list) => !list.items.is_empty(),
        Err(err) => {
            ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%err, "cannot read the pod's events; reporting it");
            false
        }
    }
}

/// One line naming a reported pod and what owns it.
fn describe(reported: &Reported) -> String {
    let pod = &reported.pod;
    let owner = match &reported.controller {
        Some(c) => format!("{} {}", c.kind, c.name),
        None => "no controller".to_owned(),
    };
    format!(
        "{}/{} ({owner})",
        pod.namespace().unwrap_or_default(),
        pod.name_any()
    )
}

/// An event on each pod of `batch` not reported before, and one on the Node naming them.
async fn report(ctx: &Ctx, batch: Vec<Reported>) {
    let mut named = Vec::new();
    let mut resources = BTreeSet::new();
    for reported in batch {
        if already_reported(ctx, &reported.pod).await {
            continue;
        }
        let why = match &reported.controller {
            Some(c) if c.kind == "Job" => {
                "its Job counts it as a failed pod; nothing runs it again"
            }
            Some(_) => "devplug does not know whether its controller makes it again",
            None => "it has no controller; nothing runs it again",
        };
        let note = format!(
            "the kubelet refused this pod at admission ({}) before devplug had registered {} \
             with it; {why}. To keep such pods at a reboot: {}",
            rules::REFUSED_REASON,
            reported.resource,
            rules::HOW_TO_KEEP
        );
        let reference: ObjectReference = reported.pod.object_ref(&());
        let event = Event {
            type_: EventType::Warning,
            reason: POD_REASON.into(),
            note: Some(note),
            action: "Report".into(),
            secondary: None,
        };
        ctx.counters.request();
        if let Err(err) = timed(ctx.recorder.publish(&event, &reference)).await {
            ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pod = %describe(&reported), %err, "cannot write the refused pod's event");
        }
        ctx.counters.reported.fetch_add(1, Ordering::Relaxed);
        resources.insert(reported.resource.clone());
        named.push(describe(&reported));
    }
    if named.is_empty() {
        return;
    }
    let resources = resources.into_iter().collect::<Vec<_>>().join(", ");
    // The Node's events are readable by whoever reads namespace default: they name counts by
    // namespace, not other tenants' pods (each pod's own event, in its namespace, names it).
    let note = format!(
        "the kubelet refused {} pod(s) asking for {resources} at admission ({}) before devplug \
         had registered, and nothing makes them again: {} (each has a {POD_REASON} event). To \
         keep such pods at a reboot: {}",
        named.len(),
        rules::REFUSED_REASON,
        by_namespace(&named),
        rules::HOW_TO_KEEP
    );
    let event = Event {
        type_: EventType::Warning,
        reason: NODE_REASON.into(),
        note: Some(truncate(note, 1000)),
        action: "Report".into(),
        secondary: None,
    };
    ctx.counters.request();
    if let Err(err) = timed(ctx.recorder.publish(&event, &node_reference(&ctx.node))).await {
        ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%err, "cannot write the node event naming the refused pods");
    }
    tracing::warn!(
        pods = %named.join(", "),
        reported = ctx.counters.reported.load(Ordering::Relaxed),
        api_requests = ctx.counters.api_requests.load(Ordering::Relaxed),
        "pods the kubelet refused at admission, which nothing makes again: reported on the pods and the Node"
    );
}

/// `namespace/name (owner)` lines as counts by namespace: `2 in team-a, 1 in team-b`.
fn by_namespace(named: &[String]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for line in named {
        let namespace = line.split_once('/').map_or("", |(ns, _)| ns);
        let count = counts.entry(namespace).or_default();
        *count = count.saturating_add(1);
    }
    counts
        .iter()
        .map(|(ns, n)| format!("{n} in {ns}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `text` cut to at most `max` bytes on a character boundary (an event's note is at most 1 kB).
fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max.saturating_sub(3);
        while !text.is_char_boundary(end) {
            end = end.saturating_sub(1);
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::{by_namespace, truncate};

    #[test]
    fn the_node_event_counts_pods_by_namespace_without_naming_them() {
        let named = [
            "team-a/web-1 (no controller)".to_owned(),
            "team-b/db-0 (Job db)".to_owned(),
            "team-a/web-2 (no controller)".to_owned(),
        ];
        assert_eq!(by_namespace(&named), "2 in team-a, 1 in team-b");
    }

    #[test]
    fn a_long_note_is_cut_on_a_character_boundary() {
        let cut = truncate("é".repeat(600), 1000);
        assert!(cut.len() <= 1000 && cut.ends_with("..."), "{}", cut.len());
        assert_eq!(truncate("short".into(), 1000), "short");
    }
}
