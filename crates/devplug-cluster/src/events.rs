//! Kubernetes Events on the Node (events.k8s.io/v1, through kube-rs' recorder), so that
//! `kubectl describe node` and event pipelines show what an operator needs: a device unhealthy
//! with its reason, recovered, the registration with the kubelet lost and regained, a config
//! reload that failed.
//!
//! - Aggregated: the recorder turns repeats of one (reason, action) on the Node into a series
//!   with a count instead of new objects; the action names the resource and device.
//! - Rate-limited: a token bucket ([`BURST`] events, then one per [`REFILL`]); events over it are
//!   dropped and counted, never queued without bound. A flapping device cannot flood the API
//!   server.
//!
//! Events are written in namespace `default` (Nodes are cluster-scoped; that is where kubectl
//! looks for them). RBAC: `create` and `patch` on `events.k8s.io` `events` there, and nothing
//! else: the Node is referred to as the kubelet refers to it in its own Node events (kind
//! `Node`, name and UID both the node's name; `nodeRef` in the kubelet's `kubelet.go`), which
//! `kubectl describe node` finds beside events that carry the Node object's UID. So no Node
//! is read, and an install with only `--node-events` needs no access to Nodes.

use devplug::host::HostEvent;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Events allowed at once.
pub const BURST: u32 = 20;
/// One more event allowed per this long.
pub const REFILL: Duration = Duration::from_secs(3);

/// One event for the Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEvent {
    /// Warning (something is wrong) or not.
    pub warning: bool,
    /// CamelCase reason, e.g. `DeviceUnhealthy`.
    pub reason: String,
    /// What it is about, e.g. `example.com/npu npu-3` (also the aggregation key).
    pub action: String,
    /// The human text.
    pub note: String,
}

impl NodeEvent {
    /// The Node event for a host event.
    pub fn from_host(event: &HostEvent) -> NodeEvent {
        match event {
            HostEvent::DeviceUnhealthy {
                resource,
                device,
                reason,
            } => NodeEvent {
                warning: true,
                reason: "DeviceUnhealthy".into(),
                action: format!("{resource} {device}"),
                note: format!("{resource} device {device} is unhealthy: {reason}"),
            },
            HostEvent::DeviceRecovered { resource, device } => NodeEvent {
                warning: false,
                reason: "DeviceRecovered".into(),
                action: format!("{resource} {device}"),
                note: format!("{resource} device {device} is healthy again"),
            },
            HostEvent::RegistrationLost { resource, error } => NodeEvent {
                warning: true,
                reason: "RegistrationLost".into(),
                action: resource.clone(),
                note: match error {
                    Some(e) => {
                        format!("{resource}: the kubelet no longer has our registration: {e}")
                    }
                    None => format!("{resource}: the kubelet no longer has our registration"),
                },
            },
            HostEvent::Registered { resource, again } => NodeEvent {
                warning: false,
                reason: if *again { "Reregistered" } else { "Registered" }.into(),
                action: resource.clone(),
                note: format!("{resource}: registered with the kubelet"),
            },
        }
    }

    /// A config reload that failed (the previous config keeps running).
    pub fn config_reload_failed(error: &str) -> NodeEvent {
        NodeEvent {
            warning: true,
            reason: "ConfigReloadFailed".into(),
            action: "config".into(),
            note: format!("config reload failed, the previous config keeps running: {error}"),
        }
    }
}

/// Counters of a [`NodeEvents`].
#[derive(Debug, Default)]
pub struct EventCounters {
    /// Events written (created or added to a series).
    pub published: AtomicU64,
    /// Events dropped by the rate limit.
    pub dropped: AtomicU64,
    /// Events the API server refused.
    pub failed: AtomicU64,
}

/// Sends events to one Node until dropped or stopped.
#[derive(Debug, Clone)]
pub struct NodeEvents {
    tx: mpsc::Sender<NodeEvent>,
    counters: Arc<EventCounters>,
}

impl NodeEvents {
    /// Starts the writer for `node`; `instance` names this reporter (the pod, or the node).
    pub fn spawn(
        client: kube::Client,
        node: String,
        instance: String,
        stop: CancellationToken,
    ) -> NodeEvents {
        let (tx, rx) = mpsc::channel(64);
        let counters = Arc::new(EventCounters::default());
        tokio::spawn(write(client, node, instance, rx, counters.clone(), stop));
        NodeEvents { tx, counters }
    }

    /// Queues an event; dropped (and counted) when the queue is full.
    pub fn publish(&self, event: NodeEvent) {
        if self.tx.try_send(event).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forwards a host's events until the host is gone.
    pub fn forward(&self, mut events: broadcast::Receiver<HostEvent>) {
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                match events.recv().await {
                    Ok(event) => this.publish(NodeEvent::from_host(&event)),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        this.counters.dropped.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
    }

    /// The counters.
    pub fn counters(&self) -> &EventCounters {
        &self.counters
    }
}

/// The Node as the kubelet's own Node events refer to it: kind, name, and the name as UID.
pub(crate) fn node_reference(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.to_owned()),
        uid: Some(node.to_owned()),
        ..Default::default()
    }
}

async fn write(
    client: kube::Client,
    node: String,
    instance: String,
    mut rx: mpsc::Receiver<NodeEvent>,
    counters: Arc<EventCounters>,
    stop: CancellationToken,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "devplug".into(),
            instance: Some(instance),
        },
    );
    let regarding = node_reference(&node);
    let mut tokens = f64::from(BURST);
    let mut refilled = Instant::now();
    loop {
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            event = rx.recv() => match event {
                Some(e) => e,
                None => return,
            },
        };
        let now = Instant::now();
        tokens = (tokens + now.duration_since(refilled).as_secs_f64() / REFILL.as_secs_f64())
            .min(f64::from(BURST));
        refilled = now;
        if tokens < 1.0 {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(reason = %event.reason, "node event dropped by the rate limit");
            continue;
        }
        tokens -= 1.0;
        let ev = Event {
            type_: if event.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: event.reason.clone(),
            note: Some(event.note.clone()),
            action: event.action.clone(),
            secondary: None,
        };
        match crate::timed(recorder.publish(&ev, &regarding)).await {
            Ok(()) => {
                counters.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%node, reason = %event.reason, %err, "cannot write a node event");
            }
        }
    }
}
