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
//! - **Devices**: healthy ones only. An unhealthy device is taken out of the pool, which every
//!   cluster understands; device taints (`NoSchedule` on a published device) would keep it
//!   visible, but they are alpha behind the `DRADeviceTaints` gate, so not used yet. Each
//!   device is named by [`names::device_name`], carries the backend's attributes and
//!   capacities (an invalid one is left out with one WARN naming the device and the
//!   attribute), and a `numa` int attribute from its first NUMA node when the backend gave no
//!   `numa` of its own. The backend id is not published: the name is a pure function of it,
//!   and backends publish what users select on (`uuid`, `path`…) as attributes.
//! - **Event-driven**: the backend's `watch` channel (a burst is coalesced: the newest list is
//!   published, lists are never queued), a watch on our own slices (a slice deleted or edited by
//!   someone is repaired at once) and a watch on the Node (its UID for the owner reference).
//! - **Errors**: an API error is retried after 1 s, doubling to 60 s; a conflict (409) re-reads
//!   the slices and tries again at once. Nothing panics.
//! - **Shutdown**: [`SlicePublisher::shutdown`] deletes this driver's slices of the node (the
//!   issue's "removed on shutdown of the driver"); dropping the publisher only stops it, leaving
//!   the slices for the next instance to adopt.

use crate::names;
use devplug::attributes::{AttributeValue, DeviceAttributes, MAX_PER_DEVICE};
use devplug::{Device, DeviceList};
use futures_util::future::join_all;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as api;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The most devices one ResourceSlice may hold in `resource.k8s.io/v1` (`ResourceSliceSpec.
/// devices`: "Must not have more than 128 entries"; 64 when devices use taints or counters,
/// which we do not).
pub const MAX_DEVICES_PER_SLICE: usize = 128;

/// The attribute added from a device's first NUMA node when the backend gives none.
pub const NUMA_ATTRIBUTE: &str = "numa";

/// The longest DRA driver name the API server takes.
pub const MAX_DRIVER_NAME_LEN: usize = 63;

/// First delay after an API error; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// Longest delay between retries.
const RETRY_MAX: Duration = Duration::from_secs(60);
/// Conflicts (409) retried at once, after a fresh read, before backing off.
const CONFLICT_RETRIES: u32 = 5;
/// Warnings remembered so each is logged once; past this the memory is cleared.
const MAX_WARNED: usize = 10_000;

/// A device or attribute left out of the pool, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The backend id of the device.
    pub device: String,
    /// The attribute or capacity left out; `None` when the whole device was.
    pub attribute: Option<String>,
    /// Why.
    pub reason: String,
}

/// The slices one device list becomes (see [`slice_specs`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SliceSpecs {
    /// The specs, in order; at least one (an empty pool is one slice with no devices).
    pub specs: Vec<api::ResourceSliceSpec>,
    /// What was left out, for one WARN each.
    pub skipped: Vec<Skipped>,
}

/// The pool content of a device list: the devices of each slice, and what was left out.
#[derive(Debug, Clone, PartialEq, Default)]
struct PoolContent {
    slices: Vec<Vec<api::Device>>,
    skipped: Vec<Skipped>,
}

/// The ResourceSlice specs for `list`, published by `driver` on `node` at pool `generation`:
/// healthy devices only, in the backend's order, [`MAX_DEVICES_PER_SLICE`] a slice. A pure
/// function: the publisher uses it, tests and tools can too.
pub fn slice_specs(driver: &str, node: &str, generation: i64, list: &DeviceList) -> SliceSpecs {
    let content = pool_content(list);
    let count = content.slices.len();
    SliceSpecs {
        specs: content
            .slices
            .iter()
            .map(|devices| spec(driver, node, generation, count, devices))
            .collect(),
        skipped: content.skipped,
    }
}

fn spec(
    driver: &str,
    node: &str,
    generation: i64,
    count: usize,
    devices: &[api::Device],
) -> api::ResourceSliceSpec {
    api::ResourceSliceSpec {
        driver: driver.to_owned(),
        node_name: Some(node.to_owned()),
        pool: api::ResourcePool {
            name: node.to_owned(),
            generation,
            resource_slice_count: i64::try_from(count).unwrap_or(i64::MAX),
        },
        // The API server leaves an empty list out; so do we, or every comparison would differ.
        devices: (!devices.is_empty()).then(|| devices.to_vec()),
        ..Default::default()
    }
}

fn pool_content(list: &DeviceList) -> PoolContent {
    let mut skipped = Vec::new();
    let mut names_taken: BTreeMap<String, &str> = BTreeMap::new();
    let mut devices = Vec::with_capacity(list.healthy_count());
    for device in list.devices() {
        if !device.health.is_healthy() {
            continue;
        }
        let name = names::device_name(&device.id);
        if let Some(first) = names_taken.get(&name) {
            skipped.push(Skipped {
                device: device.id.clone(),
                attribute: None,
                reason: format!("its slice name {name:?} is also the name of device {first:?}"),
            });
            continue;
        }
        names_taken.insert(name.clone(), &device.id);
        devices.push(api_device(device, name, &mut skipped));
    }
    let mut slices: Vec<Vec<api::Device>> = Vec::new();
    let mut rest = devices.into_iter().peekable();
    while rest.peek().is_some() {
        slices.push(rest.by_ref().take(MAX_DEVICES_PER_SLICE).collect());
    }
    if slices.is_empty() {
        slices.push(Vec::new());
    }
    PoolContent { slices, skipped }
}

/// One device as the API has it: attributes and capacities that pass the API server's rules,
/// then `numa` when the backend gave none and there is room.
fn api_device(device: &Device, name: String, skipped: &mut Vec<Skipped>) -> api::Device {
    let given = device.dra_attributes();
    let mut attributes = BTreeMap::new();
    let mut capacity = BTreeMap::new();
    let mut room = MAX_PER_DEVICE;
    let mut skip = |attribute: &str, reason: String| {
        skipped.push(Skipped {
            device: device.id.clone(),
            attribute: Some(attribute.to_owned()),
            reason,
        });
    };
    for (key, value) in &given.attributes {
        match check_attribute(key, value) {
            Err(reason) => skip(key, reason),
            Ok(()) if room == 0 => skip(key, too_many()),
            Ok(()) => {
                room = room.saturating_sub(1);
                attributes.insert(key.clone(), api_attribute(value));
            }
        }
    }
    for (key, &value) in &given.capacity {
        match check_capacity(key, value) {
            Err(reason) => skip(key, reason),
            Ok(()) if room == 0 => skip(key, too_many()),
            Ok(()) => {
                room = room.saturating_sub(1);
                capacity.insert(
                    key.clone(),
                    api::DeviceCapacity {
                        value: quantity(value),
                        ..Default::default()
                    },
                );
            }
        }
    }
    if !given.attributes.contains_key(NUMA_ATTRIBUTE) && room > 0 {
        if let Some(&numa) = device.numa_nodes.first() {
            attributes.insert(
                NUMA_ATTRIBUTE.to_owned(),
                api::DeviceAttribute {
                    int: Some(numa),
                    ..Default::default()
                },
            );
        }
    }
    api::Device {
        name,
        attributes: (!attributes.is_empty()).then_some(attributes),
        capacity: (!capacity.is_empty()).then_some(capacity),
        ..Default::default()
    }
}

fn too_many() -> String {
    format!("more than {MAX_PER_DEVICE} attributes and capacities")
}

fn api_attribute(value: &AttributeValue) -> api::DeviceAttribute {
    let mut out = api::DeviceAttribute::default();
    match value {
        AttributeValue::Int(v) => out.int = Some(*v),
        AttributeValue::Bool(v) => out.bool = Some(*v),
        AttributeValue::String(v) => out.string = Some(v.clone()),
        AttributeValue::Version(v) => out.version = Some(v.clone()),
    }
    out
}

/// The API server's rules for one attribute: [`DeviceAttributes::check`] on it alone, and a
/// version must be a semantic version.
fn check_attribute(name: &str, value: &AttributeValue) -> Result<(), String> {
    let mut one = DeviceAttributes::default();
    one.attributes.insert(name.to_owned(), value.clone());
    one.check()?;
    if let AttributeValue::Version(v) = value {
        if !is_semver(v) {
            return Err(format!(
                "{v:?} is not a semantic version (semver.org 2.0.0)"
            ));
        }
    }
    Ok(())
}

/// The API server's rules for one capacity: a valid name, and a value a quantity can hold
/// (at most 2^63 - 1).
fn check_capacity(name: &str, value: u64) -> Result<(), String> {
    let mut one = DeviceAttributes::default();
    one.capacity.insert(name.to_owned(), value);
    one.check()?;
    if i64::try_from(value).is_err() {
        return Err(format!("{value} is over the largest quantity (2^63 - 1)"));
    }
    Ok(())
}

/// True for a semantic version as semver.org 2.0.0 defines it (`1.2.3`, `1.0.0-rc.1+build.5`).
fn is_semver(v: &str) -> bool {
    let (rest, build) = match v.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (v, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let numeric = |s: &str| {
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
    };
    let ident =
        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|pre| {
            pre.split('.')
                .all(|p| ident(p) && (!p.bytes().all(|b| b.is_ascii_digit()) || numeric(p)))
        })
        && build.is_none_or(|build| build.split('.').all(ident))
}

/// `value` as the API server writes it back (a DecimalSI quantity in canonical form: trailing
/// zeros folded into k, M, G, T, P or E), so a published capacity compares equal to what we
/// read back and is never written again for nothing.
fn quantity(value: u64) -> Quantity {
    Quantity(canonical_quantity(value))
}

fn canonical_quantity(value: u64) -> String {
    const SUFFIXES: [&str; 6] = ["k", "M", "G", "T", "P", "E"];
    if value == 0 {
        return "0".to_owned();
    }
    let mut mantissa = value;
    let mut thousands = 0usize;
    while mantissa.is_multiple_of(1000) && thousands < SUFFIXES.len() {
        mantissa /= 1000;
        thousands = thousands.saturating_add(1);
    }
    match thousands.checked_sub(1).and_then(|i| SUFFIXES.get(i)) {
        Some(suffix) => format!("{mantissa}{suffix}"),
        None => mantissa.to_string(),
    }
}

/// The value of an integer quantity in the forms the API server writes (`123`, `5k`, `16Gi`,
/// `1e3`); `None` for anything else (fractions, negative values), which then compares as
/// different and is written again.
fn parse_quantity(q: &str) -> Option<u64> {
    let digits = q.bytes().take_while(u8::is_ascii_digit).count();
    let (number, suffix) = q.split_at(digits);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => {
            let exp: u32 = suffix
                .strip_prefix('e')
                .or_else(|| suffix.strip_prefix('E'))?
                .parse()
                .ok()?;
            10u64.checked_pow(exp)?
        }
    };
    number.checked_mul(factor)
}

/// True when `a` has a newer resource version than `b`. Kubernetes 1.35 made resource versions
/// of one resource comparable (KEP-5504): positive integers without leading zeros, compared as
/// numbers of any length. Anything else compares as not newer.
fn is_newer(a: &ResourceSlice, b: &ResourceSlice) -> bool {
    fn valid(rv: &str) -> bool {
        !rv.is_empty() && rv.bytes().all(|c| c.is_ascii_digit()) && !rv.starts_with('0')
    }
    match (&a.metadata.resource_version, &b.metadata.resource_version) {
        (Some(a), Some(b)) if valid(a) && valid(b) => (a.len(), a.as_str()) > (b.len(), b.as_str()),
        _ => false,
    }
}

/// A spec read from the API server, in the form [`slice_specs`] makes: capacities in
/// canonical form, empty lists and maps left out.
fn normalized(spec: &api::ResourceSliceSpec) -> api::ResourceSliceSpec {
    let mut spec = spec.clone();
    if spec.devices.as_ref().is_some_and(Vec::is_empty) {
        spec.devices = None;
    }
    for device in spec.devices.iter_mut().flatten() {
        if device.attributes.as_ref().is_some_and(BTreeMap::is_empty) {
            device.attributes = None;
        }
        if device.capacity.as_ref().is_some_and(BTreeMap::is_empty) {
            device.capacity = None;
        }
        for capacity in device.capacity.iter_mut().flat_map(BTreeMap::values_mut) {
            if let Some(value) = parse_quantity(&capacity.value.0) {
                capacity.value = quantity(value);
            }
        }
    }
    spec
}

/// Counters of a [`SlicePublisher`], for metrics and benchmarks.
#[derive(Debug, Default)]
pub struct SliceCounters {
    /// Pool states written to the API server (each one or more slice writes).
    pub publishes: AtomicU64,
    /// Slices created, replaced or deleted.
    pub writes: AtomicU64,
    /// API errors (each followed by a retry).
    pub errors: AtomicU64,
    /// Microseconds from noticing a new device list to its last slice written, for the most
    /// recent list that needed writes.
    pub last_publish_latency_us: AtomicU64,
}

/// What the API server holds, as last confirmed by the publisher.
#[derive(Debug, Clone)]
pub struct Published {
    /// The backend's device list the slices show.
    pub list: DeviceList,
    /// The pool generation.
    pub generation: i64,
    /// How many slices the pool has.
    pub slices: usize,
    /// How many devices were published (healthy ones, less any skipped).
    pub devices: usize,
}

/// Why a publisher could not start or clean up.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// The driver name is not one the API server takes.
    #[error("DRA driver name {name:?}: {reason}")]
    DriverName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An API call failed.
    #[error("ResourceSlices of driver {driver} on node {node}: {source}")]
    Api {
        /// The driver.
        driver: String,
        /// The node.
        node: String,
        /// The API error.
        source: kube::Error,
    },
}

/// Checks a DRA driver name: a DNS subdomain of at most [`MAX_DRIVER_NAME_LEN`] characters
/// (`npu.example.com`).
pub fn check_driver_name(driver: &str) -> Result<(), SliceError> {
    let bad = |reason: String| SliceError::DriverName {
        name: driver.to_owned(),
        reason,
    };
    devplug::attributes::check_dns_subdomain(driver).map_err(bad)?;
    if driver.len() > MAX_DRIVER_NAME_LEN {
        return Err(bad(format!(
            "{} characters; the API server takes at most {MAX_DRIVER_NAME_LEN}",
            driver.len()
        )));
    }
    Ok(())
}

/// The field selector of the slices of `driver` on `node`.
fn selector(driver: &str, node: &str) -> String {
    format!("spec.nodeName={node},spec.driver={driver}")
}

/// Deletes every ResourceSlice of `driver` on `node`; returns how many it deleted. One already
/// gone counts as deleted by someone else, not as an error. Needs `list` and `delete` on
/// `resourceslices`.
pub async fn delete_slices(
    client: kube::Client,
    driver: &str,
    node: &str,
) -> Result<usize, SliceError> {
    delete_all(&Api::all(client), driver, node).await
}

async fn delete_all(
    api: &Api<ResourceSlice>,
    driver: &str,
    node: &str,
) -> Result<usize, SliceError> {
    let err = |source| SliceError::Api {
        driver: driver.to_owned(),
        node: node.to_owned(),
        source,
    };
    let listed = api
        .list(&ListParams::default().fields(&selector(driver, node)))
        .await
        .map_err(err)?;
    let mut deleted = 0usize;
    for slice in listed.items {
        let Some(name) = slice.metadata.name else {
            continue;
        };
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => deleted = deleted.saturating_add(1),
            Err(kube::Error::Api(status)) if status.is_not_found() => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(deleted)
}

/// Publishes one backend's devices as the ResourceSlices of (driver, node) until stopped.
#[derive(Debug)]
pub struct SlicePublisher {
    api: Api<ResourceSlice>,
    driver: String,
    node: String,
    counters: Arc<SliceCounters>,
    published: watch::Receiver<Option<Published>>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl SlicePublisher {
    /// Starts publishing `devices` for `driver` on `node`. Stops when `stop` is cancelled or
    /// the publisher is dropped (the slices stay, for the next instance to adopt), or through
    /// [`SlicePublisher::shutdown`] (the slices are deleted). Refuses a driver name the API
    /// server would refuse.
    pub fn spawn(
        client: kube::Client,
        driver: &str,
        node: &str,
        devices: watch::Receiver<DeviceList>,
        stop: &CancellationToken,
    ) -> Result<SlicePublisher, SliceError> {
        check_driver_name(driver)?;
        let stop = stop.child_token();
        let counters = Arc::new(SliceCounters::default());
        let (published_tx, published) = watch::channel(None);
        let run = Run {
            api: Api::all(client.clone()),
            driver: driver.to_owned(),
            node: node.to_owned(),
            counters: counters.clone(),
            published: published_tx,
            cache: BTreeMap::new(),
            relist: None,
            deleted: HashSet::new(),
            cache_ready: false,
            node_uid: None,
            list: DeviceList::default(),
            content: PoolContent::default(),
            generation: 0,
            generation_content: None,
            warned: HashSet::new(),
            changed_at: None,
        };
        let task = tokio::spawn(run.run(client.clone(), devices, stop.clone()));
        Ok(SlicePublisher {
            api: Api::all(client),
            driver: driver.to_owned(),
            node: node.to_owned(),
            counters,
            published,
            stop,
            task: Some(task),
        })
    }

    /// The counters.
    pub fn counters(&self) -> &SliceCounters {
        &self.counters
    }

    /// What the API server holds, as last confirmed (`None` until the first publish).
    pub fn published(&self) -> watch::Receiver<Option<Published>> {
        self.published.clone()
    }

    /// Waits until the slices show `list` (compared by content), e.g. the list a test or a
    /// benchmark just sent; `None` if the publisher stopped first.
    pub async fn wait_published(&self, list: &DeviceList) -> Option<Published> {
        let mut rx = self.published.clone();
        let result = rx
            .wait_for(|p| p.as_ref().is_some_and(|p| p.list == *list))
            .await
            .ok()?
            .clone();
        result
    }

    /// Stops publishing and deletes this driver's slices of the node; returns how many were
    /// deleted.
    pub async fn shutdown(mut self) -> Result<usize, SliceError> {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            if let Err(err) = task.await {
                tracing::warn!(driver = %self.driver, node = %self.node, %err, "the slice publisher task failed");
            }
        }
        let deleted = delete_all(&self.api, &self.driver, &self.node).await?;
        tracing::info!(driver = %self.driver, node = %self.node, deleted, "ResourceSlices removed");
        Ok(deleted)
    }
}

impl Drop for SlicePublisher {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One planned write.
enum Write {
    Replace(String, usize),
    Create(usize),
    Delete(String),
}

/// The publisher's task and its state.
struct Run {
    api: Api<ResourceSlice>,
    driver: String,
    node: String,
    counters: Arc<SliceCounters>,
    published: watch::Sender<Option<Published>>,
    /// Our slices as the API server has them, by name (from the watch and our writes).
    cache: BTreeMap<String, ResourceSlice>,
    /// Slices listed since the watch (re)started, until its list is complete.
    relist: Option<BTreeMap<String, ResourceSlice>>,
    /// Slices we deleted whose deletion the watch has not shown yet (names are never reused).
    deleted: HashSet<String>,
    /// True once the watch has listed every slice.
    cache_ready: bool,
    /// The Node's UID; `None` while it does not exist.
    node_uid: Option<String>,
    /// The newest device list and its pool content.
    list: DeviceList,
    content: PoolContent,
    /// The pool generation we write, and the content it stands for.
    generation: i64,
    generation_content: Option<Vec<Vec<api::Device>>>,
    /// (device, attribute) pairs already warned about.
    warned: HashSet<(String, String)>,
    /// When the newest list was noticed, until it is published.
    changed_at: Option<Instant>,
}

impl Run {
    async fn run(
        mut self,
        client: kube::Client,
        mut devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
    ) {
        let nodes: Api<Node> = Api::all(client);
        let node_config =
            watcher::Config::default().fields(&format!("metadata.name={}", self.node));
        let mut node_events = watcher(nodes, node_config).default_backoff().boxed();
        let slice_config = watcher::Config::default().fields(&selector(&self.driver, &self.node));
        let mut slice_events = watcher(self.api.clone(), slice_config)
            .default_backoff()
            .boxed();
        let first = devices.borrow_and_update().clone();
        self.set_list(first);
        let mut devices_open = true;
        let mut node_listed = false;
        let mut node_found_in_list = false;
        let mut retry_at: Option<Instant> = None;
        let mut delay = RETRY_FIRST;
        let mut dirty = true;
        loop {
            let due = retry_at.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
            tokio::select! {
                () = stop.cancelled() => return,
                changed = devices.changed(), if devices_open => match changed {
                    Ok(()) => {
                        let list = devices.borrow_and_update().clone();
                        self.set_list(list);
                        dirty = true;
                    }
                    Err(_) => {
                        tracing::debug!(driver = %self.driver, "the backend stopped; its last list stays published");
                        devices_open = false;
                    }
                },
                event = node_events.next() => match event {
                    Some(Ok(event)) => {
                        let before = self.node_uid.clone();
                        match event {
                            watcher::Event::Init => node_found_in_list = false,
                            watcher::Event::InitApply(n) | watcher::Event::Apply(n) => {
                                node_found_in_list = true;
                                self.node_uid = n.metadata.uid;
                            }
                            watcher::Event::InitDone => {
                                if !node_found_in_list {
                                    self.node_uid = None;
                                }
                                if self.node_uid.is_none() && !node_listed {
                                    tracing::info!(node = %self.node, driver = %self.driver, "no Node object yet; ResourceSlices follow when it appears");
                                }
                                node_listed = true;
                            }
                            watcher::Event::Delete(_) => {
                                // Publishing now would make slices the garbage collector takes
                                // away again (their owner is gone); wait for the Node.
                                tracing::info!(node = %self.node, "our Node was deleted; waiting for it");
                                self.node_uid = None;
                            }
                        }
                        dirty |= before != self.node_uid;
                    }
                    Some(Err(err)) => {
                        tracing::warn!(node = %self.node, %err, "watching our Node failed; the watch retries");
                        self.counters.errors.fetch_add(1, Relaxed);
                    }
                    None => return,
                },
                event = slice_events.next() => match event {
                    Some(Ok(event)) => dirty |= self.slice_event(event),
                    Some(Err(err)) => {
                        tracing::warn!(driver = %self.driver, node = %self.node, %err, "watching our ResourceSlices failed; the watch retries");
                        self.counters.errors.fetch_add(1, Relaxed);
                    }
                    None => return,
                },
                () = tokio::time::sleep_until(due), if retry_at.is_some() => {
                    retry_at = None;
                    dirty = true;
                }
            }
            if !dirty || retry_at.is_some() || !self.cache_ready || self.node_uid.is_none() {
                continue;
            }
            dirty = false;
            let result = tokio::select! {
                () = stop.cancelled() => return,
                result = self.reconcile() => result,
            };
            match result {
                Ok(()) => {
                    if delay > RETRY_FIRST {
                        tracing::info!(driver = %self.driver, node = %self.node, "ResourceSlices published again after errors");
                    }
                    delay = RETRY_FIRST;
                }
                Err(err) => {
                    tracing::warn!(driver = %self.driver, node = %self.node, %err, retry_in = ?delay, "cannot publish ResourceSlices; retrying");
                    self.counters.errors.fetch_add(1, Relaxed);
                    retry_at = Some(Instant::now() + delay);
                    delay = delay.saturating_mul(2).min(RETRY_MAX);
                }
            }
        }
    }

    /// Takes a new device list: its pool content, and one WARN for each new problem.
    fn set_list(&mut self, list: DeviceList) {
        self.content = pool_content(&list);
        self.list = list;
        self.changed_at = Some(Instant::now());
        if self.warned.len() > MAX_WARNED {
            self.warned.clear();
        }
        for skipped in &self.content.skipped {
            let key = (
                skipped.device.clone(),
                skipped.attribute.clone().unwrap_or_default(),
            );
            if self.warned.insert(key) {
                match &skipped.attribute {
                    Some(attribute) => {
                        tracing::warn!(driver = %self.driver, device = %skipped.device, %attribute, reason = %skipped.reason, "attribute left out of the ResourceSlice")
                    }
                    None => {
                        tracing::warn!(driver = %self.driver, device = %skipped.device, reason = %skipped.reason, "device left out of the ResourceSlice")
                    }
                }
            }
        }
    }

    /// Applies a watch event to the cache; true when it may need a write. The watch lags
    /// behind our own writes (whose answers are cached at once), so an event no newer than the
    /// cached object (resource versions are comparable since Kubernetes 1.35, KEP-5504) and
    /// late news of a slice we deleted are dropped: taking them would look like someone undid
    /// our write, and cost a conflict and a re-read.
    fn slice_event(&mut self, event: watcher::Event<ResourceSlice>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(slice) => {
                if let (Some(relist), Some(name)) = (&mut self.relist, slice.metadata.name.clone())
                {
                    relist.insert(name, slice);
                }
                false
            }
            watcher::Event::InitDone => {
                if let Some(mut listed) = self.relist.take() {
                    for (name, slice) in &mut listed {
                        if let Some(known) = self.cache.remove(name) {
                            if is_newer(&known, slice) {
                                *slice = known;
                            }
                        }
                    }
                    self.cache = listed;
                }
                self.deleted.clear();
                self.cache_ready = true;
                true
            }
            watcher::Event::Apply(slice) => {
                let Some(name) = slice.metadata.name.clone() else {
                    return false;
                };
                if self.deleted.contains(&name) {
                    return false;
                }
                if let Some(known) = self.cache.get(&name) {
                    if known.metadata.resource_version == slice.metadata.resource_version
                        || is_newer(known, &slice)
                    {
                        return false;
                    }
                }
                self.cache.insert(name, slice);
                true
            }
            watcher::Event::Delete(slice) => match slice.metadata.name {
                Some(name) => {
                    self.deleted.remove(&name);
                    self.cache.remove(&name).is_some()
                }
                None => false,
            },
        }
    }

    /// Brings the API server to the newest list; conflicts re-read and retry at once.
    async fn reconcile(&mut self) -> Result<(), kube::Error> {
        let mut conflicts = 0u32;
        loop {
            match self.reconcile_once().await {
                Ok(()) => return Ok(()),
                Err(kube::Error::Api(status))
                    if status.is_conflict() && conflicts < CONFLICT_RETRIES =>
                {
                    conflicts = conflicts.saturating_add(1);
                    tracing::debug!(driver = %self.driver, node = %self.node, reason = %status.message, "conflict; reading our slices again");
                    self.reread().await?;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Reads our slices afresh (after a conflict: the watch may lag behind).
    async fn reread(&mut self) -> Result<(), kube::Error> {
        let listed = self
            .api
            .list(&ListParams::default().fields(&selector(&self.driver, &self.node)))
            .await?;
        self.cache = listed
            .items
            .into_iter()
            .filter_map(|s| s.metadata.name.clone().map(|n| (n, s)))
            .collect();
        Ok(())
    }

    fn owner(&self, uid: &str) -> OwnerReference {
        OwnerReference {
            api_version: "v1".to_owned(),
            kind: "Node".to_owned(),
            name: self.node.clone(),
            uid: uid.to_owned(),
            controller: Some(true),
            block_owner_deletion: None,
        }
    }

    fn targets(&self, generation: i64) -> Vec<api::ResourceSliceSpec> {
        let count = self.content.slices.len();
        self.content
            .slices
            .iter()
            .map(|devices| spec(&self.driver, &self.node, generation, count, devices))
            .collect()
    }

    /// The writes that turn the cache into `targets`: slices already right are kept, others of
    /// our pool are reused (replaced), missing ones created, the rest deleted.
    fn plan(&self, targets: &[api::ResourceSliceSpec], owner: &OwnerReference) -> Vec<Write> {
        // Each slice read once, in the form targets have; `None` when its owner is wrong.
        let mut free: Vec<(&String, Option<api::ResourceSliceSpec>)> = self
            .cache
            .iter()
            .map(|(name, slice)| {
                let owned =
                    slice.metadata.owner_references.as_deref() == Some(std::slice::from_ref(owner));
                (name, owned.then(|| normalized(&slice.spec)))
            })
            .collect();
        let mut missing = Vec::new();
        for (i, target) in targets.iter().enumerate() {
            match free
                .iter()
                .position(|(_, spec)| spec.as_ref() == Some(target))
            {
                Some(at) => {
                    free.remove(at);
                }
                None => missing.push(i),
            }
        }
        // Pool names cannot change: only slices of our pool can be reused.
        let (mut reusable, others): (Vec<&String>, Vec<&String>) =
            free.into_iter().map(|(name, _)| name).partition(|name| {
                self.cache
                    .get(*name)
                    .is_some_and(|s| s.spec.pool.name == self.node)
            });
        reusable.reverse();
        let mut writes: Vec<Write> = missing
            .into_iter()
            .map(|i| match reusable.pop() {
                Some(name) => Write::Replace(name.clone(), i),
                None => Write::Create(i),
            })
            .collect();
        writes.extend(
            reusable
                .into_iter()
                .chain(others)
                .map(|name| Write::Delete(name.clone())),
        );
        writes
    }

    async fn reconcile_once(&mut self) -> Result<(), kube::Error> {
        let Some(uid) = self.node_uid.clone() else {
            return Ok(());
        };
        let owner = self.owner(&uid);
        let newest = self
            .cache
            .values()
            .filter(|s| s.spec.pool.name == self.node)
            .map(|s| s.spec.pool.generation)
            .max();
        // Already right (a restart with the same devices, or our own writes coming back)?
        if let Some(generation) = newest {
            if self.plan(&self.targets(generation), &owner).is_empty() {
                self.generation = generation;
                self.generation_content = Some(self.content.slices.clone());
                self.confirm(false);
                return Ok(());
            }
        }
        // New content, or someone wrote a newer generation: a new generation. The same
        // content (a slice deleted or edited by someone, a retry after an error) is written at
        // the generation it already has.
        if self.generation_content.as_ref() != Some(&self.content.slices)
            || newest.is_some_and(|g| g > self.generation)
        {
            self.generation = self.generation.max(newest.unwrap_or(0)).saturating_add(1);
            self.generation_content = Some(self.content.slices.clone());
        }
        let targets = self.targets(self.generation);
        let writes = self.plan(&targets, &owner);
        let wrote = !writes.is_empty();
        // Creates and replacements at once, then deletions (the new generation is complete
        // before anything of the old one goes; consumers use the newest anyway).
        let mut puts: Vec<(Option<String>, ResourceSlice)> = Vec::new();
        let mut deletes: Vec<String> = Vec::new();
        for write in writes {
            match write {
                Write::Replace(name, i) => {
                    let Some(mut slice) = self.cache.get(&name).cloned() else {
                        continue;
                    };
                    slice.spec = targets.get(i).cloned().unwrap_or_default();
                    slice.metadata.owner_references = Some(vec![owner.clone()]);
                    puts.push((Some(name), slice));
                }
                Write::Create(i) => {
                    let slice = ResourceSlice {
                        metadata: ObjectMeta {
                            generate_name: Some(format!("{}-{}-", self.node, self.driver)),
                            owner_references: Some(vec![owner.clone()]),
                            ..Default::default()
                        },
                        spec: targets.get(i).cloned().unwrap_or_default(),
                    };
                    puts.push((None, slice));
                }
                Write::Delete(name) => deletes.push(name),
            }
        }
        let api = &self.api;
        let post = PostParams::default();
        let written = join_all(puts.iter().map(|(name, slice)| async {
            match name {
                Some(name) => api.replace(name, &post, slice).await,
                None => api.create(&post, slice).await,
            }
        }))
        .await;
        let mut failed = None;
        for result in written {
            match result {
                Ok(slice) => {
                    self.counters.writes.fetch_add(1, Relaxed);
                    if let Some(name) = slice.metadata.name.clone() {
                        self.cache.insert(name, slice);
                    }
                }
                Err(err) => {
                    failed.get_or_insert(err);
                }
            }
        }
        if let Some(err) = failed {
            return Err(err);
        }
        let deleted = join_all(deletes.iter().map(|name| async {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
                Err(err) => Err(err),
            }
        }))
        .await;
        for (name, result) in deletes.iter().zip(deleted) {
            match result {
                Ok(()) => {
                    self.counters.writes.fetch_add(1, Relaxed);
                    self.cache.remove(name);
                    if self.deleted.len() < MAX_WARNED {
                        self.deleted.insert(name.clone());
                    }
                }
                Err(err) => {
                    failed.get_or_insert(err);
                }
            }
        }
        if let Some(err) = failed {
            return Err(err);
        }
        self.confirm(wrote);
        Ok(())
    }

    /// Records that the API server shows the newest list.
    fn confirm(&mut self, wrote: bool) {
        let devices = self.content.slices.iter().map(Vec::len).sum();
        let slices = self.content.slices.len();
        if wrote {
            self.counters.publishes.fetch_add(1, Relaxed);
            if let Some(at) = self.changed_at.take() {
                let us = u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX);
                self.counters.last_publish_latency_us.store(us, Relaxed);
            }
            if self.counters.publishes.load(Relaxed) == 1 {
                tracing::info!(driver = %self.driver, node = %self.node, devices, slices, generation = self.generation, "ResourceSlices published");
            } else {
                tracing::debug!(driver = %self.driver, node = %self.node, devices, slices, generation = self.generation, "ResourceSlices updated");
            }
        } else {
            self.changed_at = None;
        }
        let generation = self.generation;
        let list = &self.list;
        self.published.send_if_modified(|current| {
            let same = current
                .as_ref()
                .is_some_and(|p| p.generation == generation && p.list == *list);
            if !same {
                *current = Some(Published {
                    list: list.clone(),
                    generation,
                    slices,
                    devices,
                });
            }
            !same
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devplug::Health;

    fn attr<'a>(
        spec: &'a api::ResourceSliceSpec,
        device: usize,
        name: &str,
    ) -> &'a api::DeviceAttribute {
        &spec.devices.as_ref().unwrap()[device]
            .attributes
            .as_ref()
            .unwrap()[name]
    }

    #[test]
    fn specs_split_name_and_describe_devices() {
        let mut devices: Vec<Device> = (0..300)
            .map(|i| Device::new(format!("npu-{i}")).with_numa_nodes([i64::from(i % 2)]))
            .collect();
        devices[0] = Device::new("GPU-a")
            .with_numa_nodes([1])
            .with_attribute("model", AttributeValue::String("x1".into()))
            .with_attribute("bad-name", AttributeValue::Int(1))
            .with_attribute(
                "driverVersion",
                AttributeValue::Version("1.2.3-rc.1".into()),
            )
            .with_attribute("firmware", AttributeValue::Version("1.02.3".into()))
            .with_attribute("long", AttributeValue::String("x".repeat(65)))
            .with_capacity("memory", 16 << 30)
            .with_capacity("huge", u64::MAX);
        devices[1] = Device::new("npu-1")
            .with_numa_nodes([0])
            .with_attribute("numa", AttributeValue::Int(7));
        devices[2] = devices[2].clone().with_health(Health::unhealthy("gone"));
        let list = DeviceList::new(devices);
        let out = slice_specs("npu.example.com", "node-a", 4, &list);

        // 299 healthy devices: 128 + 128 + 43, each slice knowing the count.
        let sizes: Vec<usize> = out
            .specs
            .iter()
            .map(|s| s.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [128, 128, 43]);
        for spec in &out.specs {
            assert_eq!(spec.driver, "npu.example.com");
            assert_eq!(spec.node_name.as_deref(), Some("node-a"));
            assert_eq!(spec.pool.name, "node-a");
            assert_eq!(spec.pool.generation, 4);
            assert_eq!(spec.pool.resource_slice_count, 3);
        }
        let first = &out.specs[0];
        let names: Vec<&str> = first
            .devices
            .as_ref()
            .unwrap()
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(
            names[..3],
            ["gpu-a-a414910b", "npu-1", "npu-3"],
            "unhealthy npu-2 left out"
        );
        assert_eq!(attr(first, 0, "model").string.as_deref(), Some("x1"));
        assert_eq!(
            attr(first, 0, "driverVersion").version.as_deref(),
            Some("1.2.3-rc.1")
        );
        assert_eq!(
            attr(first, 0, "numa").int,
            Some(1),
            "numa from the first NUMA node"
        );
        assert_eq!(
            attr(first, 1, "numa").int,
            Some(7),
            "the backend's numa wins"
        );
        assert_eq!(attr(first, 2, "numa").int, Some(1));
        let d0 = &first.devices.as_ref().unwrap()[0];
        assert_eq!(
            d0.capacity.as_ref().unwrap()["memory"].value.0,
            "17179869184"
        );
        assert!(!d0.capacity.as_ref().unwrap().contains_key("huge"));
        let attrs = d0.attributes.as_ref().unwrap();
        for bad in ["bad-name", "firmware", "long"] {
            assert!(!attrs.contains_key(bad), "{bad}");
        }
        let mut skipped: Vec<&str> = out
            .skipped
            .iter()
            .map(|s| s.attribute.as_deref().unwrap())
            .collect();
        skipped.sort_unstable();
        assert_eq!(skipped, ["bad-name", "firmware", "huge", "long"]);
        assert!(out.skipped.iter().all(|s| s.device == "GPU-a"));
    }

    #[test]
    fn an_empty_pool_is_one_empty_slice_and_clashing_names_keep_the_first() {
        let out = slice_specs("d.example.com", "n", 1, &DeviceList::default());
        assert_eq!(out.specs.len(), 1);
        assert!(out.specs[0].devices.is_none());
        assert_eq!(out.specs[0].pool.resource_slice_count, 1);

        // "gpu-a-a414910b" is already a label, and the name of "GPU-a" too.
        let list = DeviceList::new([Device::new("gpu-a-a414910b"), Device::new("GPU-a")]);
        let out = slice_specs("d.example.com", "n", 1, &list);
        assert_eq!(out.specs[0].devices.as_ref().unwrap().len(), 1);
        assert_eq!(out.skipped.len(), 1);
        assert_eq!(out.skipped[0].device, "GPU-a");
        assert!(out.skipped[0].attribute.is_none());
    }

    #[test]
    fn too_many_attributes_keep_the_first_32() {
        let mut device = Device::new("d").with_numa_nodes([0]);
        for i in 0..40 {
            device = device.with_attribute(format!("a{i:02}"), AttributeValue::Bool(true));
        }
        let out = slice_specs("d.example.com", "n", 1, &DeviceList::new([device]));
        let attrs = out.specs[0].devices.as_ref().unwrap()[0]
            .attributes
            .as_ref()
            .unwrap();
        assert_eq!(attrs.len(), MAX_PER_DEVICE);
        assert!(!attrs.contains_key("numa"), "no room left");
        assert_eq!(out.skipped.len(), 8);
    }

    #[test]
    fn quantities_are_written_as_the_api_server_writes_them_back() {
        assert_eq!(canonical_quantity(0), "0");
        assert_eq!(canonical_quantity(1000), "1k");
        assert_eq!(canonical_quantity(80_000_000_000), "80G");
        assert_eq!(canonical_quantity(1_500_000), "1500k");
        assert_eq!(canonical_quantity(17_179_869_184), "17179869184");
        assert_eq!(canonical_quantity(7_000_000_000_000_000_000), "7E");
        for v in [0, 1, 999, 1000, 17_179_869_184, 80_000_000_000, 1 << 62] {
            assert_eq!(parse_quantity(&canonical_quantity(v)), Some(v));
        }
        assert_eq!(parse_quantity("16Gi"), Some(16 << 30));
        assert_eq!(parse_quantity("2e3"), Some(2000));
        assert_eq!(parse_quantity("1.5"), None);
        assert_eq!(parse_quantity("-1"), None);
        assert_eq!(parse_quantity("99E"), None, "overflow");
    }

    #[test]
    fn semantic_versions() {
        for ok in [
            "0.0.0",
            "1.2.3",
            "10.20.30",
            "1.0.0-rc.1",
            "1.0.0-alpha-a.b-c",
            "1.0.0+build.5",
            "1.0.0-0.3.7+x",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in [
            "",
            "1",
            "1.2",
            "1.2.3.4",
            "01.2.3",
            "1.2.3-",
            "1.2.3-01",
            "1.2.3+",
            "1.2.3-a..b",
            "v1.2.3",
            "1.2.x",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }

    #[test]
    fn driver_names() {
        assert!(check_driver_name("npu.example.com").is_ok());
        assert!(check_driver_name("example.com/npu").is_err());
        assert!(check_driver_name(&format!("{}.com", "a".repeat(60))).is_err());
    }
}
