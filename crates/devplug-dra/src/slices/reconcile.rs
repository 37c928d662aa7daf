//! The publisher's task: one loop over the backend's device list, a watch on the Node and a
//! watch on our own slices, which keeps a cache of the slices and, whenever something changed,
//! plans and makes the writes that bring the API server to the newest list (slices already
//! right adopted, others replaced, missing ones created, extra ones deleted), retrying API
//! errors with a backoff and conflicts at once.
//!
//! The cache can be wrong in a way no watch reports: after the cluster's etcd is restored or
//! rebuilt, a watch resumed at a resource version the new etcd has not reached delivers
//! nothing, and the Node may be a new object with a new UID. So a write that finds its slice
//! gone (404), and a Node whose UID changed, lead to a resync: our slices listed afresh, the
//! Node read, both watches started again from that list, and a full publish at once. A watch
//! that fails (the API server gone, restarted, restored) is treated the same way as soon as
//! the API server answers a read again.

use super::compare::{is_newer, normalized};
use super::publisher::{selector, Published, SliceCounters};
use super::spec::{pool_content, unhealthy_taint_key, PoolContent, Unhealthy};
use devplug::host::backoff::jittered;
use devplug::DeviceList;
use futures_util::future::join_all;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as api;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// First delay after an API error; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// Longest delay between retries.
const RETRY_MAX: Duration = Duration::from_secs(60);
/// Conflicts (409) and vanished slices (404) retried at once, after a fresh read, before
/// backing off.
const CONFLICT_RETRIES: u32 = 5;
/// While a watch is failing, the first wait before asking the API server whether it answers
/// again: once it does, both watches start again from fresh lists (a watch that resumes at a
/// resource version a restored etcd has not reached would deliver nothing) and the slices are
/// published at once. Each unanswered probe doubles the wait up to [`RECOVERY_PROBE_MAX`], and
/// every wait is jittered ([`jittered`]): drivers that lost the API server together (a fleet
/// whose API server restarted) would otherwise ask it in step, 2 requests a second each, while it
/// starts (500 simulated nodes: docs/benchmarks.md, "A fleet of DRA nodes"). Also the longest a
/// probe waits for its answer.
const RECOVERY_PROBE: Duration = Duration::from_millis(500);
/// The longest wait between two probes of an API server that does not answer.
const RECOVERY_PROBE_MAX: Duration = Duration::from_secs(4);

/// Warnings remembered so each is logged once; past this the memory is cleared.
const MAX_WARNED: usize = 10_000;

/// One planned write.
pub(super) enum Write {
    Replace(String, usize),
    Create(usize),
    Delete(String),
}

/// The publisher's task and its state.
pub(super) struct Run {
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
    generation_content: Option<(Vec<api::CounterSet>, Vec<Vec<api::Device>>)>,
    /// (device, attribute) pairs already warned about.
    warned: HashSet<(String, String)>,
    /// When the newest list was noticed, until it is published.
    changed_at: Option<Instant>,
    /// Set by a resync: the watches are to be started again from a fresh list.
    restart_watches: bool,
    /// When each unhealthy device was first seen so (its taint's `timeAdded`).
    unhealthy_since: BTreeMap<String, Time>,
    /// The same, on the monotonic clock: when its taint turns `NoExecute`.
    unhealthy_at: BTreeMap<String, Instant>,
    /// The unhealthy devices whose taint is `NoExecute`, since when.
    no_execute_since: BTreeMap<String, Time>,
    /// How long a device stays unhealthy before its taint turns `NoExecute` (none: never).
    no_execute_after: Option<Duration>,
    /// False once the API server dropped the taints we wrote: unhealthy devices left out.
    taints_kept: bool,
    /// Set when the content changed after a write (taints dropped): publish again.
    republish: bool,
}

impl Run {
    /// A task publishing for `driver` on `node` through `api`, with nothing known yet: no
    /// slices, no Node, an empty device list.
    pub(super) fn new(
        api: Api<ResourceSlice>,
        driver: &str,
        node: &str,
        counters: Arc<SliceCounters>,
        published: watch::Sender<Option<Published>>,
        no_execute_after: Option<Duration>,
    ) -> Run {
        Run {
            api,
            driver: driver.to_owned(),
            node: node.to_owned(),
            counters,
            published,
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
            restart_watches: false,
            unhealthy_since: BTreeMap::new(),
            unhealthy_at: BTreeMap::new(),
            no_execute_since: BTreeMap::new(),
            no_execute_after,
            taints_kept: true,
            republish: false,
        }
    }

    pub(super) async fn run(
        mut self,
        client: kube::Client,
        mut devices: watch::Receiver<DeviceList>,
        stop: CancellationToken,
    ) {
        let nodes: Api<Node> = Api::all(client);
        let node_config =
            watcher::Config::default().fields(&format!("metadata.name={}", self.node));
        let node_watch = || {
            watcher(nodes.clone(), node_config.clone())
                .default_backoff()
                .boxed()
        };
        let slice_config = watcher::Config::default().fields(&selector(&self.driver, &self.node));
        let slices = self.api.clone();
        let slice_watch = || {
            watcher(slices.clone(), slice_config.clone())
                .default_backoff()
                .boxed()
        };
        let mut node_events = node_watch();
        let mut slice_events = slice_watch();
        let first = devices.borrow_and_update().clone();
        self.set_list(first);
        let mut devices_open = true;
        let mut node_listed = false;
        let mut node_found_in_list = false;
        // Lists each watch made since it was (re)created: a second one means it restarted.
        let mut node_lists = 0u32;
        let mut slice_lists = 0u32;
        let mut retry_at: Option<Instant> = None;
        let mut delay = RETRY_FIRST;
        let mut dirty = true;
        // Set while a watch is failing: when to ask the API server again, and the wait before.
        let mut probe_at: Option<Instant> = None;
        let mut probe_wait = RECOVERY_PROBE;
        loop {
            let probe_due =
                probe_at.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
            let due = retry_at.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
            let escalation = self.escalation_due();
            let escalation_due =
                escalation.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
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
                            watcher::Event::Init => {
                                node_found_in_list = false;
                                node_lists = node_lists.saturating_add(1);
                                if node_lists > 1 {
                                    tracing::info!(node = %self.node, driver = %self.driver, "the Node's watch started again; reading our slices and the Node afresh");
                                    self.restart_watches = true;
                                }
                            }
                            watcher::Event::InitApply(n) | watcher::Event::Apply(n) => {
                                node_found_in_list = true;
                                if let (Some(old), Some(new)) = (&self.node_uid, &n.metadata.uid) {
                                    if old != new {
                                        // A new Node object: the cluster, or the Node, was made
                                        // again; what we know of our slices may be stale too.
                                        tracing::info!(node = %self.node, "our Node is a new object (its UID changed); reading our slices afresh");
                                        self.restart_watches = true;
                                    }
                                }
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
                        tracing::warn!(node = %self.node, %err, "watching our Node failed; reading everything afresh once the API server answers");
                        self.counters.errors.fetch_add(1, Relaxed);
                        probe_at.get_or_insert_with(|| Instant::now() + jittered(probe_wait));
                    }
                    None => return,
                },
                event = slice_events.next() => match event {
                    Some(Ok(watcher::Event::Init)) if slice_lists > 0 => {
                        tracing::info!(node = %self.node, driver = %self.driver, "the watch of our slices started again; reading our slices and the Node afresh");
                        self.restart_watches = true;
                    }
                    Some(Ok(event)) => {
                        if matches!(event, watcher::Event::Init) {
                            slice_lists = slice_lists.saturating_add(1);
                        }
                        dirty |= self.slice_event(event);
                    }
                    Some(Err(err)) => {
                        tracing::warn!(driver = %self.driver, node = %self.node, %err, "watching our ResourceSlices failed; reading everything afresh once the API server answers");
                        self.counters.errors.fetch_add(1, Relaxed);
                        probe_at.get_or_insert_with(|| Instant::now() + jittered(probe_wait));
                    }
                    None => return,
                },
                () = tokio::time::sleep_until(due), if retry_at.is_some() => {
                    retry_at = None;
                    dirty = true;
                }
                () = tokio::time::sleep_until(escalation_due), if escalation.is_some() => {
                    // A device unhealthy for no_execute_after: its taint turns NoExecute.
                    let list = self.list.clone();
                    self.set_list(list);
                    dirty = true;
                }
                () = tokio::time::sleep_until(probe_due), if probe_at.is_some() => {
                    let answered = tokio::select! {
                        () = stop.cancelled() => return,
                        read = tokio::time::timeout(RECOVERY_PROBE, self.reread_node()) => matches!(read, Ok(Ok(()))),
                    };
                    if answered {
                        tracing::info!(driver = %self.driver, node = %self.node, "the API server answers again; reading our slices and Node afresh");
                        probe_at = None;
                        probe_wait = RECOVERY_PROBE;
                        self.counters.resyncs.fetch_add(1, Relaxed);
                        self.restart_watches = true;
                    } else {
                        probe_wait = probe_wait.saturating_mul(2).min(RECOVERY_PROBE_MAX);
                        probe_at = Some(Instant::now() + jittered(probe_wait));
                    }
                }
            }
            if std::mem::take(&mut self.restart_watches) {
                // Fresh lists for both: the cache is ready again once the slices are listed.
                node_events = node_watch();
                slice_events = slice_watch();
                self.cache_ready = false;
                self.relist = None;
                node_listed = false;
                node_lists = 0;
                // Known again from the fresh list (a changed UID is then no news).
                self.node_uid = None;
                slice_lists = 0;
                retry_at = None;
                delay = RETRY_FIRST;
                dirty = true;
                continue;
            }
            if !dirty
                || retry_at.is_some()
                || !self.cache_ready
                || !node_listed
                || self.node_uid.is_none()
            {
                continue;
            }
            dirty = false;
            let result = tokio::select! {
                () = stop.cancelled() => return,
                result = self.reconcile() => result,
            };
            dirty |= std::mem::take(&mut self.republish);
            match result {
                Ok(()) => {
                    self.counters.consecutive_failures.store(0, Relaxed);
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    self.counters.last_success_unix.store(now, Relaxed);
                    if delay > RETRY_FIRST {
                        tracing::info!(driver = %self.driver, node = %self.node, "ResourceSlices published again after errors");
                    }
                    delay = RETRY_FIRST;
                }
                Err(err) => {
                    tracing::warn!(driver = %self.driver, node = %self.node, %err, retry_in = ?delay, "cannot publish ResourceSlices; retrying");
                    self.counters.errors.fetch_add(1, Relaxed);
                    self.counters.consecutive_failures.fetch_add(1, Relaxed);
                    retry_at = Some(Instant::now() + delay);
                    delay = delay.saturating_mul(2).min(RETRY_MAX);
                }
            }
        }
    }

    /// When the next unhealthy device's taint turns `NoExecute`, if one will.
    fn escalation_due(&self) -> Option<Instant> {
        let after = self.no_execute_after?;
        self.unhealthy_at
            .iter()
            .filter(|(id, _)| !self.no_execute_since.contains_key(*id))
            .filter_map(|(_, at)| at.checked_add(after))
            .min()
    }

    /// Takes a new device list: its pool content, and one WARN for each new problem.
    fn set_list(&mut self, list: DeviceList) {
        // Seconds, as the API server keeps a time: what we write is what we read back.
        let now = Time(
            k8s_openapi::jiff::Timestamp::from_second(
                k8s_openapi::jiff::Timestamp::now().as_second(),
            )
            .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now()),
        );
        let still = |id: &String| list.get(id).is_some_and(|d| !d.health.is_healthy());
        self.unhealthy_since.retain(|id, _| still(id));
        self.unhealthy_at.retain(|id, _| still(id));
        self.no_execute_since.retain(|id, _| still(id));
        let instant = Instant::now();
        for device in list.devices() {
            if !device.health.is_healthy() && !self.unhealthy_since.contains_key(&device.id) {
                self.unhealthy_since.insert(device.id.clone(), now.clone());
                self.unhealthy_at.insert(device.id.clone(), instant);
            }
        }
        if let Some(after) = self.no_execute_after {
            for (id, at) in &self.unhealthy_at {
                let due = at.checked_add(after).is_some_and(|due| due <= instant);
                if due && !self.no_execute_since.contains_key(id) {
                    tracing::warn!(driver = %self.driver, device = %id, after = ?after,
                        "device unhealthy for no_execute_after: its taint is now NoExecute (pods that do not tolerate it are evicted)");
                    self.no_execute_since.insert(id.clone(), now.clone());
                }
            }
        }
        let key = unhealthy_taint_key(&self.driver);
        let unhealthy = if self.taints_kept {
            Unhealthy::Taint {
                key: &key,
                since: &self.unhealthy_since,
                no_execute: &self.no_execute_since,
            }
        } else {
            Unhealthy::LeaveOut
        };
        self.content = pool_content(&list, unhealthy);
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

    /// Brings the API server to the newest list; conflicts re-read and retry at once, and a
    /// slice that vanished under us resyncs (slices and Node read afresh, watches restarted).
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
                Err(kube::Error::Api(status))
                    if status.is_not_found() && conflicts < CONFLICT_RETRIES =>
                {
                    conflicts = conflicts.saturating_add(1);
                    tracing::warn!(driver = %self.driver, node = %self.node, reason = %status.message, "a slice we know of is gone from the API server (restored or rebuilt etcd?); reading our slices and Node afresh");
                    self.counters.resyncs.fetch_add(1, Relaxed);
                    self.restart_watches = true;
                    self.reread().await?;
                    self.reread_node().await?;
                    if self.node_uid.is_none() {
                        return Ok(());
                    }
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Reads our Node afresh: its UID, or `None` when it does not exist.
    async fn reread_node(&mut self) -> Result<(), kube::Error> {
        let nodes: Api<Node> = Api::all(self.api.clone().into_client());
        self.node_uid = nodes
            .get_opt(&self.node)
            .await?
            .and_then(|n| n.metadata.uid);
        Ok(())
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
        self.content.specs(&self.driver, &self.node, generation)
    }

    /// What a pool generation stands for: the counter sets and the devices' slices.
    fn layout(&self) -> (Vec<api::CounterSet>, Vec<Vec<api::Device>>) {
        (self.content.counters.clone(), self.content.slices.clone())
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
                self.generation_content = Some(self.layout());
                self.confirm(false);
                return Ok(());
            }
        }
        // New content, or someone wrote a newer generation: a new generation. The same
        // content (a slice deleted or edited by someone, a retry after an error) is written at
        // the generation it already has.
        let layout = self.layout();
        if self.generation_content.as_ref() != Some(&layout)
            || newest.is_some_and(|g| g > self.generation)
        {
            self.generation = self.generation.max(newest.unwrap_or(0)).saturating_add(1);
            self.generation_content = Some(layout);
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
        let sent_taints = puts.iter().any(|(_, slice)| has_taints(&slice.spec));
        for result in written {
            match result {
                Ok(slice) => {
                    self.counters.writes.fetch_add(1, Relaxed);
                    if sent_taints && self.taints_kept && !has_taints(&slice.spec) {
                        // The API server drops the field: the scheduler would see these
                        // devices as usable. Leave them out instead.
                        tracing::warn!(driver = %self.driver, node = %self.node, "the API server keeps no device taints (the DRADeviceTaints feature is off); unhealthy devices are left out of the ResourceSlices instead");
                        self.taints_kept = false;
                        self.republish = true;
                    }
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
        if self.republish {
            self.set_list(self.list.clone());
        }
        self.confirm(wrote);
        Ok(())
    }

    /// Records that the API server shows the newest list.
    fn confirm(&mut self, wrote: bool) {
        let devices = self.content.slices.iter().map(Vec::len).sum();
        let slices = self.content.slice_count();
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

/// True when some device of `spec` has a taint.
fn has_taints(spec: &api::ResourceSliceSpec) -> bool {
    spec.devices
        .iter()
        .flatten()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_waits_are_spread_over_75_to_125_percent() {
        let waits: Vec<Duration> = (0..200).map(|_| jittered(RECOVERY_PROBE_MAX)).collect();
        let (lo, hi) = (
            RECOVERY_PROBE_MAX.mul_f64(0.75),
            RECOVERY_PROBE_MAX.mul_f64(1.25),
        );
        assert!(waits.iter().all(|w| *w >= lo && *w < hi), "{waits:?}");
        // Spread, not one value: drivers that lost the API server together do not probe in step.
        let distinct: std::collections::BTreeSet<_> = waits.iter().collect();
        assert!(distinct.len() > 100, "{} distinct waits", distinct.len());
    }
}
