//! The fleet's ResourceSlices: waiting until every node's driver has published, until every
//! node's slices at the API server say what its driver would publish (the truth after a
//! storm, rather than the driver's word), and counting them.

use super::node::SimNode;
use anyhow::Context;
use futures_util::future::join_all;
use futures_util::StreamExt;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use kube::runtime::watcher;
use kube::Api;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Waits until every node's driver has published its slices; returns how long it took.
pub(super) async fn all_published(nodes: &[SimNode], limit: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let waits = nodes.iter().filter_map(|n| n.driver.as_ref()).map(|d| {
        let mut rx = d.slices().published();
        async move {
            rx.wait_for(|p| p.as_ref().is_some_and(|p| p.devices > 0))
                .await
                .is_ok()
        }
    });
    let done = tokio::time::timeout(limit, join_all(waits))
        .await
        .context("not every node published its slices in time")?;
    anyhow::ensure!(done.iter().all(|ok| *ok), "a publisher stopped");
    Ok(started.elapsed())
}

/// The slices of the fleet's driver on the nodes `names` at the API server (a shared cluster
/// may have others).
pub(super) async fn slice_count(client: &kube::Client, names: &[String]) -> anyhow::Result<usize> {
    let params = kube::api::ListParams::default().fields(&format!("spec.driver={}", super::DRIVER));
    Ok(Api::<ResourceSlice>::all(client.clone())
        .list(&params)
        .await?
        .items
        .iter()
        .filter(|s| s.spec.node_name.as_ref().is_some_and(|n| names.contains(n)))
        .count())
}

/// Waits, watching every ResourceSlice as the admin, until each node's slices of its driver
/// are exactly the specs [`SimNode::wanted_slices`] gives (one generation across the pool;
/// taints' `timeAdded`, set by the API server, aside); returns how long it took from `since`.
/// Nodes without a driver are not looked at.
pub(super) async fn all_right(
    admin: &kube::Client,
    nodes: &[SimNode],
    since: Instant,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let wanted: HashMap<(String, String), Vec<String>> = nodes
        .iter()
        .filter(|n| n.driver.is_some())
        .map(|n| {
            let key = (n.settings.driver.clone(), n.name.clone());
            (key, comparable(n.wanted_slices().iter()))
        })
        .collect();
    let api: Api<ResourceSlice> = Api::all(admin.clone());
    let mut events = watcher(api, watcher::Config::default()).boxed();
    let mut seen: BTreeMap<String, ResourceSlice> = BTreeMap::new();
    let mut initial: BTreeMap<String, ResourceSlice> = BTreeMap::new();
    let mut listed = false;
    let mut last = String::new();
    let deadline = tokio::time::Instant::from_std(since + limit);
    loop {
        let event = match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(event)) => event,
            Ok(None) => anyhow::bail!("the slice watch ended"),
            Err(_) => anyhow::bail!(
                "not every node's slices were right within {limit:?}; one that was not: {last}"
            ),
        };
        match event {
            // A watch that failed (the API server away) is started again by the watcher.
            Err(_) => continue,
            Ok(watcher::Event::Init) => initial.clear(),
            Ok(watcher::Event::InitApply(slice)) => {
                initial.insert(slice.metadata.name.clone().unwrap_or_default(), slice);
            }
            Ok(watcher::Event::InitDone) => {
                seen = std::mem::take(&mut initial);
                listed = true;
            }
            Ok(watcher::Event::Apply(slice)) => {
                seen.insert(slice.metadata.name.clone().unwrap_or_default(), slice);
            }
            Ok(watcher::Event::Delete(slice)) => {
                seen.remove(slice.metadata.name.as_deref().unwrap_or_default());
            }
        }
        if !listed {
            continue;
        }
        let mut have: HashMap<(String, String), Vec<&ResourceSliceSpec>> = HashMap::new();
        for slice in seen.values() {
            let node = slice.spec.node_name.clone().unwrap_or_default();
            have.entry((slice.spec.driver.clone(), node))
                .or_default()
                .push(&slice.spec);
        }
        let wrong = wanted.iter().find(|(key, want)| {
            let specs = have.get(*key).map(Vec::as_slice).unwrap_or_default();
            let generations: std::collections::BTreeSet<i64> =
                specs.iter().map(|s| s.pool.generation).collect();
            generations.len() > 1 || comparable(specs.iter().copied()) != **want
        });
        match wrong {
            None => return Ok(since.elapsed()),
            Some(((driver, node), _)) => last = format!("{driver} on {node}"),
        }
    }
}

/// Specs as sorted JSON texts, in the form `slice_specs` makes, at generation 0, with no
/// taint's `timeAdded`.
fn comparable<'a>(specs: impl Iterator<Item = &'a ResourceSliceSpec>) -> Vec<String> {
    let mut texts: Vec<String> = specs
        .map(|spec| {
            let mut spec = devplug_dra::slices::normalized_spec(spec);
            spec.pool.generation = 0;
            for taint in spec
                .devices
                .iter_mut()
                .flatten()
                .flat_map(|d| d.taints.iter_mut().flatten())
            {
                taint.time_added = None;
            }
            serde_json::to_string(&spec).unwrap_or_default()
        })
        .collect();
    texts.sort();
    texts
}
