//! Node labels: what a backend that describes hardware would have the Node say about it
//! (`nvidia.com/gpu.product`, `amd.com/gpu.family`, …, as the vendors' own labellers name them).
//!
//! A cluster concern beside the device plugin, so not part of [`devplug::Backend`]: the backends
//! that have labels (`nvidia`, `amdgpu`, `intel_gpu`) implement [`NodeLabelSource`] as well, and
//! whoever builds a resource from its config keeps the receiver beside the backend. Writing the
//! labels is the caller's (the cluster side of `devplug run`).

use std::collections::BTreeMap;
use tokio::sync::watch;

/// Node labels, key → value, in key order.
pub type NodeLabels = BTreeMap<String, String>;

/// A backend that describes its hardware with node labels.
pub trait NodeLabelSource {
    /// The labels this backend would write for its hardware, under its vendor's prefix; a new
    /// value on every change (a GPU lost, a MIG layout, a driver version).
    fn node_labels(&self) -> watch::Receiver<NodeLabels>;
}
