//! The ResourceSlice publisher against a real kube-apiserver (`KUBEBUILDER_ASSETS`, started once
//! for this binary): devices with attributes, capacities and the Node as owner; generation bumps;
//! unhealthy devices leaving and coming back; 300 devices in 3 slices adopted by a restarted
//! publisher without duplicates; repair of a slice deleted or edited by someone; waiting for the
//! Node; kept at a stop, deleted at a removal; the RBAC rules it needs. Each test has its own Node. Without
//! `KUBEBUILDER_ASSETS` each test prints SKIPPED and returns.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug::dra::AttributeValue;
use devplug::{Device, DeviceList, Health};
use devplug_dra::slices::{SliceOptions, SlicePublisher, MAX_DEVICES_PER_SLICE};
use devplug_testkit::api_server::{admin, new_node};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::Api;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "npu.example.com";
const WAIT: Duration = Duration::from_secs(30);

fn fields(node: &str) -> String {
    format!("spec.nodeName={node},spec.driver={DRIVER}")
}

/// Our slices of `node`, by name.
async fn slices(api: &Api<ResourceSlice>, node: &str) -> BTreeMap<String, ResourceSlice> {
    api.list(&ListParams::default().fields(&fields(node)))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|s| (s.metadata.name.clone().unwrap(), s))
        .collect()
}

/// Waits (watching, not polling) until the slices of `node` satisfy `done`; returns them.
async fn wait_slices(
    api: &Api<ResourceSlice>,
    node: &str,
    what: &str,
    done: impl Fn(&BTreeMap<String, ResourceSlice>) -> bool,
) -> BTreeMap<String, ResourceSlice> {
    let config = watcher::Config::default().fields(&fields(node));
    let mut events = watcher(api.clone(), config).boxed();
    let mut seen = BTreeMap::new();
    // While the watch lists (at its start, or after it restarted) the picture is partial.
    let mut listing: Option<BTreeMap<String, ResourceSlice>> = None;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let event = tokio::time::timeout_at(deadline, events.next())
            .await
            .unwrap_or_else(|_| panic!("{what}: not seen in {WAIT:?}; slices now: {seen:#?}"))
            .unwrap()
            .unwrap();
        match event {
            watcher::Event::Init => listing = Some(BTreeMap::new()),
            watcher::Event::InitApply(s) => {
                if let Some(listing) = &mut listing {
                    listing.insert(s.metadata.name.clone().unwrap(), s);
                }
            }
            watcher::Event::InitDone => seen = listing.take().unwrap_or_default(),
            watcher::Event::Apply(s) => {
                seen.insert(s.metadata.name.clone().unwrap(), s);
            }
            watcher::Event::Delete(s) => {
                seen.remove(s.metadata.name.as_ref().unwrap());
            }
        }
        if listing.is_none() && done(&seen) {
            return seen;
        }
    }
}

/// Device names of all slices, with repeats kept (to find duplicates).
fn device_names(slices: &BTreeMap<String, ResourceSlice>) -> Vec<String> {
    slices
        .values()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect()
}

/// True when every slice is at one generation and their count is what each says.
fn complete(slices: &BTreeMap<String, ResourceSlice>) -> bool {
    let gens: BTreeSet<i64> = slices.values().map(|s| s.spec.pool.generation).collect();
    gens.len() == 1
        && slices
            .values()
            .all(|s| usize::try_from(s.spec.pool.resource_slice_count).ok() == Some(slices.len()))
}

fn npus(n: usize) -> Vec<Device> {
    (0..n)
        .map(|i| {
            Device::new(format!("npu-{i}"))
                .with_numa_nodes([i64::try_from(i % 2).unwrap()])
                .with_attribute("index", AttributeValue::Int(i64::try_from(i).unwrap()))
        })
        .collect()
}

struct Setup {
    client: kube::Client,
    api: Api<ResourceSlice>,
    node: String,
    uid: String,
}

async fn setup(test: &str, prefix: &str) -> Option<Setup> {
    let client = admin(test).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let node = new_node(&nodes, prefix).await;
    let uid = nodes.get(&node).await.unwrap().metadata.uid.unwrap();
    Some(Setup {
        api: Api::all(client.clone()),
        client,
        node,
        uid,
    })
}

fn spawn(s: &Setup, devices: watch::Receiver<DeviceList>) -> SlicePublisher {
    SlicePublisher::spawn(
        s.client.clone(),
        DRIVER,
        &s.node,
        devices,
        &CancellationToken::new(),
    )
    .unwrap()
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn devices_appear_with_attributes_capacity_and_owner() {
    let Some(s) = setup(
        "devices_appear_with_attributes_capacity_and_owner",
        "slices",
    )
    .await
    else {
        return;
    };
    let list = DeviceList::new([
        Device::new("GPU-a")
            .with_numa_nodes([1])
            .with_attribute("model", AttributeValue::String("x1".into()))
            .with_attribute("driverVersion", AttributeValue::Version("1.2.3".into()))
            .with_attribute("mig", AttributeValue::Bool(false))
            .with_attribute(
                "resource.kubernetes.io/pciBusID",
                AttributeValue::String("0000:3b:00.0".into()),
            )
            .with_capacity("memory", 16 << 30)
            .with_capacity("cores", 80_000),
        Device::new("npu-1").with_attribute("bad-name", AttributeValue::Int(1)),
    ]);
    let (_tx, rx) = watch::channel(list.clone());
    let publisher = spawn(&s, rx);
    let published = tokio::time::timeout(WAIT, publisher.wait_published(&list))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((published.slices, published.devices), (1, 2));
    assert_eq!(published.generation, 1);

    let all = slices(&s.api, &s.node).await;
    assert_eq!(all.len(), 1, "{all:#?}");
    let (name, slice) = all.iter().next().unwrap();
    assert!(name.starts_with(&format!("{}-{DRIVER}-", s.node)), "{name}");
    let owners = slice.metadata.owner_references.as_ref().unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!(
        (
            owners[0].kind.as_str(),
            owners[0].name.as_str(),
            owners[0].uid.as_str()
        ),
        ("Node", s.node.as_str(), s.uid.as_str())
    );
    assert_eq!(slice.spec.driver, DRIVER);
    assert_eq!(slice.spec.node_name.as_deref(), Some(s.node.as_str()));
    assert_eq!(slice.spec.pool.name, s.node);
    assert_eq!(slice.spec.pool.resource_slice_count, 1);
    let devices = slice.spec.devices.as_ref().unwrap();
    assert_eq!(devices[0].name, "gpu-a-a414910b");
    let attrs = devices[0].attributes.as_ref().unwrap();
    assert_eq!(attrs["model"].string.as_deref(), Some("x1"));
    assert_eq!(attrs["driverVersion"].version.as_deref(), Some("1.2.3"));
    assert_eq!(attrs["mig"].bool, Some(false));
    assert_eq!(attrs["numa"].int, Some(1));
    assert_eq!(
        attrs["resource.kubernetes.io/pciBusID"].string.as_deref(),
        Some("0000:3b:00.0")
    );
    let capacity = devices[0].capacity.as_ref().unwrap();
    assert_eq!(capacity["memory"].value.0, "17179869184");
    assert_eq!(capacity["cores"].value.0, "80k");
    assert_eq!(devices[1].name, "npu-1");
    assert!(
        devices[1].attributes.is_none(),
        "the invalid one is left out"
    );

    // Settled: what we wrote is what the server shows, so nothing is written again, even when
    // the same list is sent again.
    let writes = publisher
        .counters()
        .writes
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(writes, 1);
    _tx.send_replace(DeviceList::new(list.devices().to_vec()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        publisher
            .counters()
            .writes
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let again = slices(&s.api, &s.node).await;
    assert_eq!(
        again[name].metadata.resource_version,
        slice.metadata.resource_version
    );
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_change_bumps_the_generation_and_unhealthy_devices_are_tainted_until_they_recover() {
    let Some(s) = setup(
        "a_change_bumps_the_generation_and_unhealthy_devices_are_tainted_until_they_recover",
        "slices-gen",
    )
    .await
    else {
        return;
    };
    let first = DeviceList::new(npus(4));
    let (tx, rx) = watch::channel(first.clone());
    let publisher = spawn(&s, rx);
    assert_eq!(
        publisher.wait_published(&first).await.unwrap().generation,
        1
    );

    // An attribute changes.
    let mut devices = npus(4);
    devices[3] = devices[3]
        .clone()
        .with_attribute("model", AttributeValue::String("x2".into()));
    let second = DeviceList::new(devices);
    tx.send_replace(second.clone());
    assert_eq!(
        publisher.wait_published(&second).await.unwrap().generation,
        2
    );
    let all = slices(&s.api, &s.node).await;
    let slice = all.values().next().unwrap();
    assert_eq!(slice.spec.pool.generation, 2);
    assert_eq!(
        slice.spec.devices.as_ref().unwrap()[3]
            .attributes
            .as_ref()
            .unwrap()["model"]
            .string
            .as_deref(),
        Some("x2")
    );

    // npu-1 turns unhealthy: it stays, with a NoSchedule taint saying why, which the API
    // server keeps (DRADeviceTaints is on in 1.36).
    let mut sick = second.clone();
    assert!(sick.set_health("npu-1", Health::unhealthy("XID 79")));
    tx.send_replace(sick.clone());
    let published = publisher.wait_published(&sick).await.unwrap();
    assert_eq!((published.generation, published.devices), (3, 4));
    let taints = |all: &BTreeMap<String, ResourceSlice>| -> Vec<(String, String, String, bool)> {
        all.values()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .flat_map(|d| {
                d.taints.iter().flatten().map(|t| {
                    (
                        d.name.clone(),
                        t.key.clone(),
                        format!("{}={}", t.value.clone().unwrap_or_default(), t.effect),
                        t.time_added.is_some(),
                    )
                })
            })
            .collect()
    };
    let all = slices(&s.api, &s.node).await;
    assert_eq!(device_names(&all), ["npu-0", "npu-1", "npu-2", "npu-3"]);
    assert_eq!(
        taints(&all),
        [(
            "npu-1".to_owned(),
            format!("{DRIVER}/unhealthy"),
            "XID-79=NoSchedule".to_owned(),
            true
        )]
    );

    // And comes back: the taint goes.
    tx.send_replace(second.clone());
    let published = publisher.wait_published(&second).await.unwrap();
    assert_eq!((published.generation, published.devices), (4, 4));
    let all = slices(&s.api, &s.node).await;
    assert_eq!(device_names(&all), ["npu-0", "npu-1", "npu-2", "npu-3"]);
    assert!(taints(&all).is_empty());

    // A burst is coalesced: only the newest list needs to reach the server.
    let mut last = second.clone();
    for i in 0..20 {
        last = second.clone();
        let health = if i % 2 == 0 {
            Health::unhealthy("flap")
        } else {
            Health::Healthy
        };
        last.set_health("npu-0", health);
        tx.send_replace(last.clone());
    }
    let published = publisher.wait_published(&last).await.unwrap();
    assert!(published.generation < 4 + 20, "{}", published.generation);
    assert_eq!(device_names(&slices(&s.api, &s.node).await).len(), 4);
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_device_unhealthy_for_no_execute_after_gets_a_no_execute_taint_until_it_recovers() {
    let Some(s) = setup(
        "a_device_unhealthy_for_no_execute_after_gets_a_no_execute_taint_until_it_recovers",
        "slices-noexec",
    )
    .await
    else {
        return;
    };
    let healthy = DeviceList::new(npus(2));
    let (tx, rx) = watch::channel(healthy.clone());
    let after = Duration::from_secs(2);
    let publisher = SlicePublisher::spawn_with(
        s.client.clone(),
        DRIVER,
        &s.node,
        rx,
        &CancellationToken::new(),
        SliceOptions {
            no_execute_after: Some(after),
        },
    )
    .unwrap();
    publisher.wait_published(&healthy).await.unwrap();
    let effects = |all: &BTreeMap<String, ResourceSlice>| -> Vec<(String, String)> {
        all.values()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .flat_map(|d| {
                d.taints
                    .iter()
                    .flatten()
                    .map(|t| (d.name.clone(), t.effect.clone()))
            })
            .collect()
    };
    let mut sick = healthy.clone();
    sick.set_health("npu-1", Health::unhealthy("ECC"));
    let broke = std::time::Instant::now();
    tx.send_replace(sick.clone());
    publisher.wait_published(&sick).await.unwrap();
    assert_eq!(
        effects(&slices(&s.api, &s.node).await),
        [("npu-1".to_owned(), "NoSchedule".to_owned())]
    );
    // After `after`, with no new list from the backend, the taint turns NoExecute.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let all = slices(&s.api, &s.node).await;
        if effects(&all) == [("npu-1".to_owned(), "NoExecute".to_owned())] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no NoExecute taint: {:?}",
            effects(&all)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = broke.elapsed();
    eprintln!("NoSchedule → NoExecute after {took:?} (no_execute_after {after:?})");
    assert!(took >= after, "not before no_execute_after: {took:?}");
    // Recovery removes it.
    tx.send_replace(healthy.clone());
    publisher.wait_published(&healthy).await.unwrap();
    assert!(effects(&slices(&s.api, &s.node).await).is_empty());
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn three_hundred_devices_in_three_slices_and_no_duplicates_after_a_restart() {
    let Some(s) = setup(
        "three_hundred_devices_in_three_slices_and_no_duplicates_after_a_restart",
        "slices-300",
    )
    .await
    else {
        return;
    };
    let list = DeviceList::new(npus(300));
    let (tx, rx) = watch::channel(list.clone());
    let publisher = spawn(&s, rx.clone());
    let published = publisher.wait_published(&list).await.unwrap();
    assert_eq!((published.slices, published.devices), (3, 300));
    let before = slices(&s.api, &s.node).await;
    assert_eq!(before.len(), 3);
    assert!(complete(&before));
    let mut sizes: Vec<usize> = before
        .values()
        .map(|s| s.spec.devices.as_ref().unwrap().len())
        .collect();
    sizes.sort_unstable();
    assert_eq!(
        sizes,
        [
            300 - 2 * MAX_DEVICES_PER_SLICE,
            MAX_DEVICES_PER_SLICE,
            MAX_DEVICES_PER_SLICE
        ]
    );
    let names = device_names(&before);
    assert_eq!(names.len(), 300);
    assert_eq!(names.iter().collect::<BTreeSet<_>>().len(), 300);

    // A restart with the same devices adopts the slices and writes nothing.
    drop(publisher);
    let publisher = spawn(&s, rx.clone());
    let published = publisher.wait_published(&list).await.unwrap();
    assert_eq!(published.generation, 1);
    assert_eq!(
        publisher
            .counters()
            .writes
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    let after = slices(&s.api, &s.node).await;
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );

    // A restart with fewer devices, and a stray slice of ours left by someone: two slices at a
    // new generation, the rest deleted, still no duplicates.
    drop(publisher);
    let stray: ResourceSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"generateName": format!("{}-stray-", s.node)},
        "spec": {
            "driver": DRIVER, "nodeName": s.node,
            "pool": {"name": s.node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "npu-0"}],
        },
    }))
    .unwrap();
    s.api.create(&PostParams::default(), &stray).await.unwrap();
    let fewer = DeviceList::new(npus(200));
    tx.send_replace(fewer.clone());
    let publisher = spawn(&s, rx);
    let published = publisher.wait_published(&fewer).await.unwrap();
    assert_eq!((published.slices, published.generation), (2, 2));
    let now = slices(&s.api, &s.node).await;
    assert_eq!(now.len(), 2, "{:?}", now.keys());
    assert!(complete(&now));
    let names = device_names(&now);
    assert_eq!(names.len(), 200);
    assert_eq!(names.iter().collect::<BTreeSet<_>>().len(), 200);
    assert!(
        now.keys().all(|n| before.contains_key(n)),
        "reused, not new"
    );
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_slice_deleted_or_edited_by_someone_is_repaired() {
    let Some(s) = setup(
        "a_slice_deleted_or_edited_by_someone_is_repaired",
        "slices-repair",
    )
    .await
    else {
        return;
    };
    let list = DeviceList::new(npus(200));
    let (_tx, rx) = watch::channel(list.clone());
    let publisher = spawn(&s, rx);
    publisher.wait_published(&list).await.unwrap();
    let before = slices(&s.api, &s.node).await;
    assert_eq!(before.len(), 2);

    let victim = before.keys().next().unwrap().clone();
    s.api
        .delete(&victim, &DeleteParams::default())
        .await
        .unwrap();
    let repaired = wait_slices(&s.api, &s.node, "a recreated slice", |all| {
        all.len() == 2 && !all.contains_key(&victim) && device_names(all).len() == 200
    })
    .await;
    assert!(complete(&repaired));
    assert_eq!(
        repaired.values().next().unwrap().spec.pool.generation,
        1,
        "same content, same generation"
    );

    // Someone empties a slice: its devices come back.
    let (name, slice) = repaired.iter().next().unwrap();
    let mut edited = slice.clone();
    edited.spec.devices = Some(Vec::new());
    s.api
        .replace(name, &PostParams::default(), &edited)
        .await
        .unwrap();
    let name = name.clone();
    let restored = wait_slices(&s.api, &s.node, "an edited slice restored", |all| {
        all.get(&name)
            .is_some_and(|s| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty()))
            && device_names(all).len() == 200
    })
    .await;
    assert!(complete(&restored));
    assert_eq!(restored[&name].spec.pool.generation, 1);
    drop(publisher);
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn nothing_is_published_until_the_node_exists() {
    let Some(client) = admin("nothing_is_published_until_the_node_exists").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let node = format!("slices-late-{}", std::process::id());
    let list = DeviceList::new(npus(2));
    let (_tx, rx) = watch::channel(list.clone());
    let publisher =
        SlicePublisher::spawn(client.clone(), DRIVER, &node, rx, &CancellationToken::new())
            .unwrap();
    let api: Api<ResourceSlice> = Api::all(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(slices(&api, &node).await.is_empty());
    assert!(publisher.published().borrow().is_none());

    let created: Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": node}})).unwrap();
    let created = nodes
        .create(&PostParams::default(), &created)
        .await
        .unwrap();
    tokio::time::timeout(WAIT, publisher.wait_published(&list))
        .await
        .unwrap()
        .unwrap();
    let all = slices(&api, &node).await;
    let owner = &all
        .values()
        .next()
        .unwrap()
        .metadata
        .owner_references
        .as_ref()
        .unwrap()[0];
    assert_eq!(Some(&owner.uid), created.metadata.uid.as_ref());
}

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn a_stop_keeps_the_slices_for_the_next_start_and_a_removal_deletes_them() {
    let Some(s) = setup(
        "a_stop_keeps_the_slices_for_the_next_start_and_a_removal_deletes_them",
        "slices-stop",
    )
    .await
    else {
        return;
    };
    let list = DeviceList::new(npus(150));
    let (_tx, rx) = watch::channel(list.clone());
    let publisher = spawn(&s, rx);
    publisher.wait_published(&list).await.unwrap();
    let before = slices(&s.api, &s.node).await;
    assert_eq!(before.len(), 2);
    publisher.stop().await;
    // Kept while the driver is away: the scheduler still sees the node's devices.
    let kept = slices(&s.api, &s.node).await;
    let uids = |all: &BTreeMap<String, ResourceSlice>| -> Vec<Option<String>> {
        let mut uids: Vec<_> = all.values().map(|s| s.metadata.uid.clone()).collect();
        uids.sort();
        uids
    };
    assert_eq!(uids(&kept), uids(&before));
    // The next start publishes over them: the same objects, none deleted and made again.
    let (_tx, rx) = watch::channel(list.clone());
    let publisher = spawn(&s, rx);
    publisher.wait_published(&list).await.unwrap();
    assert_eq!(uids(&slices(&s.api, &s.node).await), uids(&before));
    assert_eq!(publisher.remove().await.unwrap(), 2);
    assert!(slices(&s.api, &s.node).await.is_empty());
}

/// Publish latency after one device changes health: from the send on the backend's channel to
/// the publisher confirming the write. Printed, never asserted.
#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn publish_latency_after_a_change() {
    let Some(s) = setup("publish_latency_after_a_change", "slices-latency").await else {
        return;
    };
    for count in [8usize, 300] {
        let base = DeviceList::new(npus(count));
        let (tx, rx) = watch::channel(base.clone());
        let publisher = spawn(&s, rx);
        publisher.wait_published(&base).await.unwrap();
        let mut times = Vec::new();
        for i in 0..40 {
            let mut next = base.clone();
            if i % 2 == 0 {
                next.set_health("npu-1", Health::unhealthy("x"));
            }
            let t = Instant::now();
            tx.send_replace(next.clone());
            publisher.wait_published(&next).await.unwrap();
            times.push(t.elapsed());
        }
        times.sort_unstable();
        let writes = publisher
            .counters()
            .writes
            .load(std::sync::atomic::Ordering::Relaxed);
        let slices = count.div_ceil(MAX_DEVICES_PER_SLICE);
        eprintln!(
            "publish latency, {count} devices ({slices} slices, {writes} writes for 40 changes): \
             median {:?}, p90 {:?}, max {:?}",
            times[times.len() / 2],
            times[times.len() * 9 / 10],
            times[times.len() - 1]
        );
        publisher.remove().await.unwrap();
    }
}

/// The rules the publisher needs, exactly (the deploy manifests carry the same).
const RULES: &str = r#"[
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
     "verbs": ["list", "watch", "create", "update", "delete"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}
]"#;

#[cfg_attr(
    no_api_server,
    ignore = "needs an API server: set KUBEBUILDER_ASSETS (docs/testing.md)"
)]
#[tokio::test]
async fn the_rbac_rules_are_enough() {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let Some(s) = setup("the_rbac_rules_are_enough", "slices-rbac").await else {
        return;
    };
    let pp = PostParams::default();
    let name = "devplug-dra-slices";
    let sa: ServiceAccount = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "kube-system"},
    }))
    .unwrap();
    Api::<ServiceAccount>::namespaced(s.client.clone(), "kube-system")
        .create(&pp, &sa)
        .await
        .unwrap();
    let rules: serde_json::Value = serde_json::from_str(RULES).unwrap();
    let role: ClusterRole = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name}, "rules": rules,
    }))
    .unwrap();
    Api::<ClusterRole>::all(s.client.clone())
        .create(&pp, &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(s.client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    let request: TokenRequest = serde_json::from_value(serde_json::json!({
        "spec": {"audiences": [], "expirationSeconds": 3600},
    }))
    .unwrap();
    let issued: TokenRequest = Api::<ServiceAccount>::namespaced(s.client.clone(), "kube-system")
        .create_subresource("token", name, &pp, &request)
        .await
        .unwrap();
    let server = devplug_testkit::api_server::ApiServer::shared("rbac").unwrap();
    let config = server
        .kubeconfig_for_token("dra-slices", &issued.status.unwrap().token.unwrap())
        .unwrap();
    let driver = devplug_testkit::api_server::client(&config).await.unwrap();

    // Everything the publisher does, as that account: publish 200 devices, change them
    // (replace), shrink them (delete), repair, shut down.
    let list = DeviceList::new(npus(200));
    let (tx, rx) = watch::channel(list.clone());
    let publisher =
        SlicePublisher::spawn(driver, DRIVER, &s.node, rx, &CancellationToken::new()).unwrap();
    tokio::time::timeout(WAIT, publisher.wait_published(&list))
        .await
        .unwrap()
        .unwrap();
    let fewer = DeviceList::new(npus(100));
    tx.send_replace(fewer.clone());
    tokio::time::timeout(WAIT, publisher.wait_published(&fewer))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(slices(&s.api, &s.node).await.len(), 1);
    assert_eq!(
        publisher
            .counters()
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(publisher.remove().await.unwrap(), 1);
    assert!(slices(&s.api, &s.node).await.is_empty());
}
