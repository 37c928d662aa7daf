//! What the publisher observed of its slices: a cache of our slices as the API server has them,
//! fed by the watch of our slices and by the answers to our own writes.

use super::compare::is_newer;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::watcher;
use std::collections::{BTreeMap, HashSet};

/// Deleted slices remembered until the watch shows their deletion; past this, no more are
/// remembered.
const MAX_DELETED: usize = 10_000;

/// Our slices as the API server has them.
pub(super) struct SliceCache {
    /// Our slices as the API server has them, by name (from the watch and our writes).
    pub(super) by_name: BTreeMap<String, ResourceSlice>,
    /// Slices listed since the watch (re)started, until its list is complete.
    relist: Option<BTreeMap<String, ResourceSlice>>,
    /// Slices we deleted whose deletion the watch has not shown yet (names are never reused).
    deleted: HashSet<String>,
    /// True once the watch has listed every slice.
    pub(super) ready: bool,
}

impl SliceCache {
    /// An empty cache, not ready until the watch has listed our slices.
    pub(super) fn new() -> SliceCache {
        SliceCache {
            by_name: BTreeMap::new(),
            relist: None,
            deleted: HashSet::new(),
            ready: false,
        }
    }

    /// The watch starts again: the cache is ready again once its fresh list is complete.
    pub(super) fn restart(&mut self) {
        self.ready = false;
        self.relist = None;
    }

    /// Takes `listed` (our slices read afresh) as the cache.
    pub(super) fn replace(&mut self, listed: Vec<ResourceSlice>) {
        self.by_name = listed
            .into_iter()
            .filter_map(|s| s.metadata.name.clone().map(|n| (n, s)))
            .collect();
    }

    /// A slice we created or replaced, as the API server answered.
    pub(super) fn wrote(&mut self, slice: ResourceSlice) {
        if let Some(name) = slice.metadata.name.clone() {
            self.by_name.insert(name, slice);
        }
    }

    /// A slice we deleted (or found gone).
    pub(super) fn deleted(&mut self, name: &str) {
        self.by_name.remove(name);
        if self.deleted.len() < MAX_DELETED {
            self.deleted.insert(name.to_owned());
        }
    }

    /// Applies a watch event to the cache; true when it may need a write. The watch lags
    /// behind our own writes (whose answers are cached at once), so an event no newer than the
    /// cached object (resource versions are comparable since Kubernetes 1.35, KEP-5504) and
    /// late news of a slice we deleted are dropped: taking them would look like someone undid
    /// our write, and cost a conflict and a re-read.
    pub(super) fn apply(&mut self, event: watcher::Event<ResourceSlice>) -> bool {
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
                        if let Some(known) = self.by_name.remove(name) {
                            if is_newer(&known, slice) {
                                *slice = known;
                            }
                        }
                    }
                    self.by_name = listed;
                }
                self.deleted.clear();
                self.ready = true;
                true
            }
            watcher::Event::Apply(slice) => {
                let Some(name) = slice.metadata.name.clone() else {
                    return false;
                };
                if self.deleted.contains(&name) {
                    return false;
                }
                if let Some(known) = self.by_name.get(&name) {
                    if known.metadata.resource_version == slice.metadata.resource_version
                        || is_newer(known, &slice)
                    {
                        return false;
                    }
                }
                self.by_name.insert(name, slice);
                true
            }
            watcher::Event::Delete(slice) => match slice.metadata.name {
                Some(name) => {
                    self.deleted.remove(&name);
                    self.by_name.remove(&name).is_some()
                }
                None => false,
            },
        }
    }
}
