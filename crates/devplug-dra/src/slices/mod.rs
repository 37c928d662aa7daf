//! The ResourceSlice publisher: one backend's device list published as
//! `resource.k8s.io/v1` ResourceSlices for one (driver, node).
//!
//! - **One pool** per driver and node, named after the node; `spec.nodeName` is the node. The
//!   devices are split over as many slices as needed, at most [`MAX_DEVICES_PER_SLICE`] each
//!   (the v1 API's limit), every slice carrying the pool's `resourceSliceCount`.
//! - **Generation**: the pool's generation is bumped whenever its content changes, and every
//!   slice is then written with the new one (consumers use only the newest generation, and
//!   count its slices to know the pool is complete). Repairing a slice that someone deleted or
//!   edited, while the content is unchanged, writes it at the same generation.
//! - **Names** come from `generateName: <node>-<driver>-`. At start, the slices of this driver
//!   and node (field selectors `spec.nodeName`, `spec.driver`) are adopted: reused when they
//!   fit, left as they are when they already say exactly what we would write (a restart with
//!   the same devices writes nothing), deleted when extra. A restarted devplug never leaves
//!   duplicates.
//! - **Owner**: each slice is owned by the Node (so the garbage collector removes them with
//!   it). Until the Node exists, nothing is published: the Node is watched, not polled.
//! - **Devices**: every one. An unhealthy device stays in its slice with a `NoSchedule` taint
//!   `<driver>/unhealthy` whose value is the reason (`DRADeviceTaints`, beta and on by default
//!   in Kubernetes 1.36): the scheduler allocates it to no claim that does not tolerate it, and
//!   `kubectl get resourceslices -o yaml` says why; recovery removes the taint. An API server
//!   that drops the taints it is sent (the feature off) is noticed on the first write, and from
//!   then on unhealthy devices are left out of the pool instead. Each
//!   device is named by [`names::device_name`](crate::names::device_name), carries the
//!   backend's attributes and capacities (an invalid one is left out with one WARN naming the
//!   device and the attribute), and a `numa` int attribute from its first NUMA node when the
//!   backend gave no `numa` of its own. The backend id is not published: the name is a pure
//!   function of it, and backends publish what users select on (`uuid`, `path`…) as
//!   attributes.
//! - **Event-driven**: the backend's `watch` channel (a burst is coalesced: the newest list is
//!   published, lists are never queued), a watch on our own slices (a slice deleted or edited by
//!   someone is repaired at once) and a watch on the Node (its UID for the owner reference).
//! - **Errors**: an API error is retried after 1 s, doubling to 60 s; a conflict (409) re-reads
//!   the slices and tries again at once. Nothing panics.
//! - **Shutdown**: [`SlicePublisher::stop`] (and dropping the publisher) stops publishing and
//!   keeps the slices for the next instance to adopt, as upstream's kubelet-plugin helper does
//!   (the kubelet wipes those of a driver gone for good 30 s after it unregistered);
//!   [`SlicePublisher::remove`] deletes this driver's slices of the node (a driver removed for
//!   good takes its devices off the scheduler's list at once).
//!
//! The module, one idea a file:
//!
//! - `spec`: what the slices of a device list are ([`slice_specs`]): one pool, unhealthy devices
//!   tainted, [`MAX_DEVICES_PER_SLICE`] a slice.
//! - `api_device`: one backend device as the API's `Device`: its attributes, capacities and
//!   `numa`.
//! - `validate`: the API server's rules for what we write: the driver name, each attribute and
//!   capacity.
//! - `quantity`: capacities as quantities, in the canonical form the API server writes back.
//! - `compare`: slices read from the API server made comparable with ours (resource versions,
//!   the canonical form of a spec).
//! - `shared`: what the publisher's handle and its task share: its counters ([`SliceCounters`]),
//!   what it confirmed ([`Published`]), its errors ([`SliceError`]), the field selector of our
//!   slices.
//! - `publisher`: [`SlicePublisher`], the task's handle, and [`delete_slices`].
//! - `event_loop`: the publisher's task loop over the device list, the Node and our slices,
//!   with its resyncs and its retries.
//! - `reconcile`: the task's state and its writes (adopt, replace, create, delete), conflicts
//!   retried at once.
//! - `plan`: the writes that turn the slices the API server has into the ones we want.
//! - `cache`: our slices as the API server has them, from the watch and our own writes.
//! - `taint_clock`: when each unhealthy device turned so, and when its taint turns `NoExecute`.

mod api_device;
mod cache;
mod compare;
mod event_loop;
mod plan;
mod publisher;
pub(crate) mod quantity;
mod reconcile;
mod shared;
mod spec;
mod taint_clock;
mod validate;

pub(crate) use api_device::published_attributes;
pub use api_device::{NUMA_ATTRIBUTE, NUMA_NODE_ATTRIBUTE};
pub use compare::normalized as normalized_spec;
pub use publisher::{delete_slices, SliceOptions, SlicePublisher, WriteGate};
pub use shared::{read_node_uid, Published, SliceCounters, SliceError};
pub use spec::{
    slice_specs, unhealthy_taint_key, Skipped, SliceSpecs, MAX_DEVICES_PER_SLICE,
    MAX_TAINTED_PER_SLICE,
};
pub use validate::{check_driver_name, MAX_DRIVER_NAME_LEN};
