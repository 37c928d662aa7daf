//! The `Backend` trait: what a vendor writes. Discovery and health go out on a watch channel;
//! allocation questions come in as plain calls. The host does everything about the kubelet.

use crate::device::DeviceList;
use crate::edits::ContainerEdits;
use std::future::Future;
use std::pin::Pin;
use tokio::sync::watch;

/// A boxed future, for the one async hook of [`Backend`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A source of devices for one extended resource.
///
/// The backend owns knowledge of devices; the kubelet owns which are allocated. A backend never
/// marks allocated devices unhealthy and keeps no allocation bookkeeping of its own.
pub trait Backend: Send + Sync + 'static {
    /// The latest device list. The host streams every new value to the kubelet; a slow kubelet
    /// never blocks the sender, it just skips to the newest list.
    fn devices(&self) -> watch::Receiver<DeviceList>;

    /// The edits for one container that was given `ids`. The host has already checked that the
    /// ids are known and not repeated.
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError>;

    /// Which devices to give a container, best effort. Called only when
    /// [`Options::preferred_allocation`] is set. The host cleans the answer up: must-include ids
    /// first, only available ids, no repeats, at most `size` ids. Never an error: an error here
    /// fails the pod.
    fn preferred(&self, request: &PreferenceRequest<'_>) -> Vec<String> {
        first_fit(request)
    }

    /// Runs before each start of a container that has `ids`. Called only when
    /// [`Options::pre_start_required`] is set; an error fails the container start.
    fn pre_start(&self, ids: &[String]) -> BoxFuture<'_, Result<(), PreStartError>> {
        let _ = ids;
        Box::pin(async { Ok(()) })
    }

    /// Which optional calls this backend wants from the kubelet.
    fn options(&self) -> Options {
        Options::default()
    }

    /// Resolves when the backend's first discovery has ended: it has found its devices, or
    /// found that it cannot (a driver that is not there). The host registers the resource only
    /// after that (or after [`crate::host::FIRST_DISCOVERY_WAIT`] at most), so the kubelet's first
    /// device list is the truth, not an empty list that a slow discovery fills a moment later.
    /// The default resolves at once, for backends whose first list is ready when they are built.
    fn discovered(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Why the backend cannot serve its devices right now (e.g. a driver that is not loaded
    /// yet), or `None` when it can. The process keeps serving either way; readiness probes
    /// report the reason.
    fn not_ready(&self) -> Option<String> {
        None
    }

    /// Problems that do not stop the backend but that an operator should see, such as a
    /// device pattern that matches nothing (often a typo). Exported as metrics; the backend
    /// logs each once itself. Read on every metrics scrape: keep it cheap.
    fn warnings(&self) -> Vec<BackendWarning> {
        Vec::new()
    }
}

/// A problem a backend reports without stopping (see [`Backend::warnings`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendWarning {
    /// A short stable name for the kind of problem, e.g. `group_matches_nothing`.
    pub kind: &'static str,
    /// What exactly, e.g. the group's pattern.
    pub detail: String,
}

/// The optional parts of the protocol a backend takes part in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Ask the kubelet to call [`Backend::pre_start`] before each container start.
    pub pre_start_required: bool,
    /// Ask the kubelet to call [`Backend::preferred`] before allocating.
    pub preferred_allocation: bool,
}

/// One container's preferred-allocation question.
#[derive(Debug, Clone, Copy)]
pub struct PreferenceRequest<'a> {
    /// Devices the kubelet may choose from.
    pub available: &'a [String],
    /// Devices that must be part of the answer (reused from init containers).
    pub must_include: &'a [String],
    /// How many devices the container needs in total.
    pub size: usize,
}

/// The default preference: the must-include ids, then the available ones in order.
pub fn first_fit(request: &PreferenceRequest<'_>) -> Vec<String> {
    request
        .must_include
        .iter()
        .chain(request.available)
        .take(request.size.max(request.must_include.len()))
        .cloned()
        .collect()
}

/// Why an allocation failed. The kubelet fails the pod's admission with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// The request cannot be met as asked (gRPC `InvalidArgument`).
    #[error("{0}")]
    InvalidRequest(String),
    /// The backend could not prepare the devices (gRPC `Internal`).
    #[error("{0}")]
    Failed(String),
}

/// Why a pre-start hook failed. The kubelet fails the container start with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PreStartError(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn first_fit_puts_must_include_first() {
        let available = ids(&["a", "b", "c", "d"]);
        let must = ids(&["c"]);
        let got = first_fit(&PreferenceRequest {
            available: &available,
            must_include: &must,
            size: 2,
        });
        assert_eq!(got, ids(&["c", "a"]));
    }

    #[test]
    fn first_fit_is_best_effort_when_short() {
        let available = ids(&["a"]);
        let got = first_fit(&PreferenceRequest {
            available: &available,
            must_include: &[],
            size: 5,
        });
        assert_eq!(got, ids(&["a"]));
    }
}
