//! The publisher's task state ([`Run`]) and its writes: whenever something changed, the writes
//! that bring the API server to the newest list are planned (`plan`) and made (slices already
//! right adopted, others replaced, missing ones created, extra ones deleted), conflicts retried
//! at once after a fresh read. The loop that drives it is `event_loop`.
//!
//! A write that finds its slice gone (404) leads to a resync: our slices listed afresh, the
//! Node read, both watches started again from that list (see `event_loop`), and a full publish
//! at once.

use super::cache::SliceCache;
use super::plan::{owner, plan, requests, Requests};
use super::shared::{selector, Published, SliceCounters};
use super::spec::{pool_content, unhealthy_taint_key, PoolContent, Unhealthy};
use super::taint_clock::TaintClock;
use devplug::DeviceList;
use futures_util::future::join_all;
use k8s_openapi::api::resource::v1 as api;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use std::collections::HashSet;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Conflicts (409) and vanished slices (404) retried at once, after a fresh read, before
/// backing off.
const CONFLICT_RETRIES: u32 = 5;

/// Warnings remembered so each is logged once; past this the memory is cleared.
const MAX_WARNED: usize = 10_000;

/// The publisher's task and its state.
pub(super) struct Run {
    // What it was given.
    pub(super) api: Api<ResourceSlice>,
    pub(super) driver: String,
    pub(super) node: String,
    pub(super) counters: Arc<SliceCounters>,
    published: watch::Sender<Option<Published>>,
    // What it observed.
    /// Our slices as the API server has them.
    pub(super) cache: SliceCache,
    /// The Node's UID; `None` while it does not exist.
    pub(super) node_uid: Option<String>,
    // What it publishes.
    /// The newest device list and its pool content.
    pub(super) list: DeviceList,
    content: PoolContent,
    /// The pool generation we write, and the content it stands for.
    generation: i64,
    generation_content: Option<(Vec<api::CounterSet>, Vec<Vec<api::Device>>)>,
    /// (device, attribute) pairs already warned about.
    warned: HashSet<(String, String)>,
    /// When the newest list was noticed, until it is published.
    changed_at: Option<Instant>,
    /// When each unhealthy device turned so, and when its taint turns `NoExecute`.
    pub(super) taint_clock: TaintClock,
    /// False once the API server dropped the taints we wrote: unhealthy devices left out.
    taints_kept: bool,
    // What it is to do next.
    /// Set by a resync: the watches are to be started again from a fresh list.
    pub(super) restart_watches: bool,
    /// Set when the content changed after a write (taints dropped): publish again.
    pub(super) republish: bool,
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
            cache: SliceCache::new(),
            node_uid: None,
            list: DeviceList::default(),
            content: PoolContent::default(),
            generation: 0,
            generation_content: None,
            warned: HashSet::new(),
            changed_at: None,
            taint_clock: TaintClock::new(no_execute_after),
            taints_kept: true,
            restart_watches: false,
            republish: false,
        }
    }

    /// Takes a new device list: its pool content, and one WARN for each new problem.
    pub(super) fn set_list(&mut self, list: DeviceList) {
        self.taint_clock.update(&list, &self.driver);
        let key = unhealthy_taint_key(&self.driver);
        let unhealthy = if self.taints_kept {
            self.taint_clock.taints(&key)
        } else {
            Unhealthy::LeaveOut
        };
        self.content = pool_content(&self.driver, &list, unhealthy);
        self.list = list;
        self.changed_at = Some(Instant::now());
        self.warn_skipped();
    }

    /// One WARN for each device or attribute left out of the pool content that was not
    /// warned about before.
    fn warn_skipped(&mut self) {
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

    /// Brings the API server to the newest list; conflicts re-read and retry at once, and a
    /// slice that vanished under us resyncs (slices and Node read afresh, watches restarted).
    pub(super) async fn reconcile(&mut self) -> Result<(), kube::Error> {
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
    pub(super) async fn reread_node(&mut self) -> Result<(), kube::Error> {
        self.node_uid =
            super::shared::read_node_uid(self.api.clone().into_client(), &self.node).await?;
        Ok(())
    }

    /// Reads our slices afresh (after a conflict: the watch may lag behind).
    async fn reread(&mut self) -> Result<(), kube::Error> {
        let listed = self
            .api
            .list(&ListParams::default().fields(&selector(&self.driver, &self.node)))
            .await?;
        self.cache.replace(listed.items);
        Ok(())
    }

    fn targets(&self, generation: i64) -> Vec<api::ResourceSliceSpec> {
        self.content.specs(&self.driver, &self.node, generation)
    }

    /// What a pool generation stands for: the counter sets and the devices' slices.
    fn layout(&self) -> (Vec<api::CounterSet>, Vec<Vec<api::Device>>) {
        (self.content.counters.clone(), self.content.slices.clone())
    }

    async fn reconcile_once(&mut self) -> Result<(), kube::Error> {
        let Some(uid) = self.node_uid.clone() else {
            return Ok(());
        };
        let owner = owner(&self.node, &uid);
        let newest = self
            .cache
            .by_name
            .values()
            .filter(|s| s.spec.pool.name == self.node)
            .map(|s| s.spec.pool.generation)
            .max();
        // Already right (a restart with the same devices, or our own writes coming back)?
        if let Some(generation) = newest {
            if plan(
                &self.cache.by_name,
                &self.node,
                &self.targets(generation),
                &owner,
            )
            .is_empty()
            {
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
        let writes = plan(&self.cache.by_name, &self.node, &targets, &owner);
        let wrote = !writes.is_empty();
        let Requests { puts, deletes } = requests(
            writes,
            &self.cache.by_name,
            &targets,
            &owner,
            &self.driver,
            &self.node,
        );
        self.put_all(&puts).await?;
        self.delete_all(&deletes).await?;
        if self.republish {
            self.set_list(self.list.clone());
        }
        self.confirm(wrote);
        Ok(())
    }

    /// Creates and replaces `puts` at once, caching what the API server answered; notices an
    /// API server that drops the taints we sent.
    async fn put_all(
        &mut self,
        puts: &[(Option<String>, ResourceSlice)],
    ) -> Result<(), kube::Error> {
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
                    self.cache.wrote(slice);
                }
                Err(err) => {
                    failed.get_or_insert(err);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Deletes `deletes` at once; one already gone counts as deleted.
    async fn delete_all(&mut self, deletes: &[String]) -> Result<(), kube::Error> {
        let api = &self.api;
        let deleted = join_all(deletes.iter().map(|name| async {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
                Err(err) => Err(err),
            }
        }))
        .await;
        let mut failed = None;
        for (name, result) in deletes.iter().zip(deleted) {
            match result {
                Ok(()) => {
                    self.counters.writes.fetch_add(1, Relaxed);
                    self.cache.deleted(name);
                }
                Err(err) => {
                    failed.get_or_insert(err);
                }
            }
        }
        failed.map_or(Ok(()), Err)
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
