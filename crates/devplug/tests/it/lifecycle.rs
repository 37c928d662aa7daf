//! Registration, streaming, kubelet restarts, ordering of start-up, removal and shutdown.

use crate::support::{kubelet, no_hold_down, wait_capacity, TestBackend, WAIT};
use devplug::{
    AllocateError, Backend, ContainerEdits, Device, DeviceList, Health, Host, ResourceSettings,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

const GRACE: Duration = Duration::from_secs(300);

#[tokio::test]
async fn registers_and_streams_the_first_list() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let mut status = host.add("example.com/npu", TestBackend::new(8)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (8, 8)).await;

    let regs = kubelet.read(|n| n.registrations().to_vec());
    assert_eq!(regs.len(), 1);
    assert!(regs[0].endpoint.starts_with("devplug-example.com_npu-"));
    assert!(dir.path().join(&regs[0].endpoint).exists());
    status.wait_for(|s| s.is_ready()).await.unwrap();
    host.shutdown().await;
}

#[tokio::test]
async fn health_changes_reach_the_kubelet_and_recover() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(4);
    host.add_with("example.com/npu", Arc::new(backend.clone()), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, "example.com/npu", (4, 4)).await;

    backend.set_health("dev-2", Health::unhealthy("overheated"));
    wait_capacity(&kubelet, "example.com/npu", (4, 3)).await;
    let healthy =
        kubelet.read(|n| n.resource("example.com/npu").unwrap().devices()["dev-2"].healthy);
    assert!(!healthy);

    backend.set_health("dev-2", Health::Healthy);
    wait_capacity(&kubelet, "example.com/npu", (4, 4)).await;

    // A new device list replaces the old one entirely, with topology.
    backend.publish(vec![Device::new("x").with_numa_nodes([1])]);
    wait_capacity(&kubelet, "example.com/npu", (1, 1)).await;
    let numa = kubelet.read(|n| {
        n.resource("example.com/npu").unwrap().devices()["x"]
            .numa_nodes
            .clone()
    });
    assert_eq!(numa, vec![1]);
    host.shutdown().await;
}

#[tokio::test]
async fn two_resources_in_one_process() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/a", TestBackend::new(2)).unwrap();
    host.add("example.com/b", TestBackend::new(3)).unwrap();
    wait_capacity(&kubelet, "example.com/a", (2, 2)).await;
    wait_capacity(&kubelet, "example.com/b", (3, 3)).await;
    let sockets = kubelet.read(|n| {
        [
            n.resource("example.com/a").unwrap().socket().cloned(),
            n.resource("example.com/b").unwrap().socket().cloned(),
        ]
    });
    assert_ne!(sockets[0], sockets[1], "each resource has its own socket");
    assert!(host.is_ready());

    // The same resource twice is refused; a bad name is refused with the kubelet's rule.
    assert!(host.add("example.com/a", TestBackend::new(1)).is_err());
    let err = host
        .add("npu", TestBackend::new(1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"npu\"") && err.contains("vendor.example/device"),
        "{err}"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn twenty_kubelet_restarts_each_followed_by_registration() {
    let (dir, mut kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/npu", TestBackend::new(3)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (3, 3)).await;
    let fds_before = open_fds();

    for round in 1..=20u64 {
        kubelet.restart().await.unwrap();
        assert_eq!(
            kubelet.read(|n| n.capacity("example.com/npu")),
            (0, 0),
            "round {round}: checkpoint restores no devices"
        );
        kubelet
            .wait_for(WAIT, |n| {
                let r = n.resource("example.com/npu")?;
                (r.is_connected()
                    && r.capacity() == 3
                    && n.registration_count("example.com/npu") as u64 == round + 1)
                    .then_some(())
            })
            .await
            .unwrap_or_else(|_| panic!("round {round}: not registered again"));
    }
    // Exactly one registration per kubelet: no duplicates, none missed.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        kubelet.read(|n| n.registration_count("example.com/npu")),
        21
    );
    let metrics = &host.metrics()[0].1;
    assert_eq!((metrics.registrations, metrics.kubelet_restarts), (21, 20));
    let sockets: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        sockets.len(),
        2,
        "only kubelet.sock and our socket remain: {sockets:?}"
    );
    // The count is the whole test process's: the binary's other tests, running beside this
    // one, open and close their own descriptors meanwhile. Theirs go within seconds; a leak of
    // this test's twenty restarts (one or more a round) stays.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut fds_after = open_fds();
    while fds_after > fds_before + 4 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        fds_after = open_fds();
    }
    assert!(
        fds_after <= fds_before + 4,
        "fds leaked: {fds_before} -> {fds_after} (for 10 s)"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn plugin_started_before_the_kubelet_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let host = Host::new(dir.path()).unwrap();
    let status = host.add("example.com/npu", TestBackend::new(2)).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!status.borrow().registered);
    assert!(
        status.borrow().socket.as_ref().unwrap().exists(),
        "serving before the kubelet exists"
    );

    let kubelet = kubelet_sim::Kubelet::start(dir.path()).await.unwrap();
    // The simulated kubelet wipes the folder on start, as the real one does: we rebind and register.
    wait_capacity(&kubelet, "example.com/npu", (2, 2)).await;
    host.shutdown().await;
}

#[tokio::test]
async fn removing_a_resource_disconnects_it_and_the_grace_period_forgets_it() {
    let (dir, kubelet) = kubelet(Duration::from_millis(300)).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/a", TestBackend::new(2)).unwrap();
    host.add("example.com/b", TestBackend::new(1)).unwrap();
    wait_capacity(&kubelet, "example.com/a", (2, 2)).await;
    wait_capacity(&kubelet, "example.com/b", (1, 1)).await;
    let socket_a = kubelet.read(|n| {
        n.resource("example.com/a")
            .unwrap()
            .socket()
            .cloned()
            .unwrap()
    });

    assert!(host.remove("example.com/a").await);
    assert!(!socket_a.exists(), "our socket is removed");
    // The kubelet marks the devices unhealthy, then forgets the resource after the grace period.
    wait_capacity(&kubelet, "example.com/a", (2, 0)).await;
    kubelet
        .wait_for(WAIT, |n| {
            n.resource("example.com/a").is_none().then_some(())
        })
        .await
        .unwrap();
    assert_eq!(
        kubelet.read(|n| n.capacity("example.com/b")),
        (1, 1),
        "the other resource is untouched"
    );
    assert_eq!(host.resources(), vec!["example.com/b".to_owned()]);

    host.shutdown().await;
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("kubelet.sock")]);
}

#[tokio::test]
async fn an_oversized_list_is_not_sent_and_the_stream_stays_open() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(2);
    host.add("example.com/npu", backend.clone()).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (2, 2)).await;

    let huge = (0..100_000)
        .map(|i| Device::new(format!("{i:040}")))
        .collect();
    backend.publish(huge);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        kubelet.read(|n| n.capacity("example.com/npu")),
        (2, 2),
        "the kubelet keeps the last list it could receive"
    );
    backend.publish(vec![Device::new("a"), Device::new("b"), Device::new("c")]);
    wait_capacity(&kubelet, "example.com/npu", (3, 3)).await;
    assert!(kubelet.read(|n| n.resource("example.com/npu").unwrap().is_connected()));
    host.shutdown().await;
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test]
async fn readiness_follows_registration() {
    let (dir, mut kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let mut status = host.add("example.com/npu", TestBackend::new(1)).unwrap();
    status.wait_for(|s| s.is_ready()).await.unwrap();
    kubelet.restart().await.unwrap();
    // After the restart the status goes not-ready, then ready again with a second registration.
    tokio::time::timeout(
        WAIT,
        status.wait_for(|s| s.registrations == 2 && s.is_ready()),
    )
    .await
    .unwrap()
    .unwrap();
    host.shutdown().await;
}

#[tokio::test]
async fn garbage_vanishing_clients_and_parallel_streams_do_not_hurt() {
    use devplug_proto::v1beta1::{device_plugin_client::DevicePluginClient, Empty};
    use tokio::io::AsyncWriteExt;

    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(3);
    let mut status = host
        .add_with("example.com/npu", Arc::new(backend.clone()), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, "example.com/npu", (3, 3)).await;
    let socket = status.borrow().socket.clone().unwrap();

    // Garbage bytes, then a hang-up.
    let mut raw = tokio::net::UnixStream::connect(&socket).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\xff garbage")
        .await
        .unwrap();
    drop(raw);

    // A second ListAndWatch stream (an inspector) sees the list too, then vanishes mid-stream.
    let channel = devplug_proto::uds::connect(&socket, WAIT).await.unwrap();
    let mut client = DevicePluginClient::new(channel);
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().devices.len(), 3);
    status.wait_for(|s| s.streams == 2).await.unwrap();
    backend.set_health("dev-0", Health::unhealthy("x"));
    let second = stream.message().await.unwrap().unwrap();
    assert_eq!(second.devices[0].health, "Unhealthy");
    drop(stream);
    drop(client);
    status.wait_for(|s| s.streams == 1).await.unwrap();

    // The kubelet's stream was never interrupted and still gets updates.
    wait_capacity(&kubelet, "example.com/npu", (3, 2)).await;
    backend.set_health("dev-0", Health::Healthy);
    wait_capacity(&kubelet, "example.com/npu", (3, 3)).await;
    let connections = kubelet.read(|n| n.resource("example.com/npu").unwrap().connections());
    assert_eq!(connections, 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        kubelet.read(|n| n.registration_count("example.com/npu")),
        1,
        "an inspector leaving is not a kubelet leaving"
    );
    host.shutdown().await;
}

#[tokio::test]
async fn a_dropped_stream_without_restart_leads_to_registering_again() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/npu", TestBackend::new(2)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (2, 2)).await;

    assert!(kubelet.disconnect("example.com/npu"));
    assert_eq!(kubelet.read(|n| n.capacity("example.com/npu")), (2, 0));
    // The kubelet never dials back by itself; the plugin registers again after a short delay.
    kubelet
        .wait_for(WAIT, |n| {
            (n.registration_count("example.com/npu") == 2
                && n.capacity("example.com/npu") == (2, 2))
                .then_some(())
        })
        .await
        .unwrap();
    host.shutdown().await;
}

#[tokio::test]
async fn a_recovered_device_waits_out_the_hold_down() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(2);
    let settings = ResourceSettings {
        health_hold_down: Duration::from_secs(2),
        ..Default::default()
    };
    host.add_with("example.com/npu", Arc::new(backend.clone()), settings)
        .unwrap();
    wait_capacity(&kubelet, "example.com/npu", (2, 2)).await;

    // Breaking is immediate.
    backend.set_health("dev-0", Health::unhealthy("link down"));
    wait_capacity(&kubelet, "example.com/npu", (2, 1)).await;
    let updates = kubelet.read(|n| n.resource("example.com/npu").unwrap().updates());

    // Flapping inside the hold-down sends nothing to the kubelet.
    backend.set_health("dev-0", Health::Healthy);
    backend.set_health("dev-0", Health::unhealthy("link down again"));
    backend.set_health("dev-0", Health::Healthy);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        kubelet.read(|n| n.capacity("example.com/npu")),
        (2, 1),
        "still held down"
    );
    assert_eq!(
        kubelet.read(|n| n.resource("example.com/npu").unwrap().updates()),
        updates,
        "no churn"
    );

    // Once the device has stayed healthy for the hold-down, the kubelet is told, once.
    wait_capacity(&kubelet, "example.com/npu", (2, 2)).await;
    assert_eq!(
        kubelet.read(|n| n.resource("example.com/npu").unwrap().updates()),
        updates + 1
    );
    host.shutdown().await;
}

#[tokio::test]
async fn update_swaps_a_backend_in_place_or_restarts_when_options_change() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/npu", TestBackend::new(2)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (2, 2)).await;

    let same_options = Arc::new(TestBackend::new(5));
    let done = host
        .update("example.com/npu", same_options, ResourceSettings::default())
        .await
        .unwrap();
    assert_eq!(done, devplug::host::Updated::InPlace);
    wait_capacity(&kubelet, "example.com/npu", (5, 5)).await;
    assert_eq!(
        kubelet.read(|n| n.resource("example.com/npu").unwrap().connections()),
        1,
        "stream untouched"
    );
    let a = kubelet
        .allocate("pod", "main", "example.com/npu", 1)
        .await
        .unwrap();
    assert_eq!(
        a.env("TEST_DEVICES"),
        Some("dev-0"),
        "the new backend answers Allocate"
    );

    let options = devplug::Options {
        preferred_allocation: true,
        pre_start_required: false,
    };
    let other_options = Arc::new(TestBackend::new(3).with_options(options));
    let done = host
        .update(
            "example.com/npu",
            other_options,
            ResourceSettings::default(),
        )
        .await
        .unwrap();
    assert_eq!(done, devplug::host::Updated::Restarted);
    kubelet
        .wait_for(WAIT, |n| {
            let r = n.resource("example.com/npu")?;
            (r.connections() == 2
                && r.capacity() == 3
                && r.options()?.get_preferred_allocation_available)
                .then_some(())
        })
        .await
        .unwrap();
    assert!(host
        .update(
            "example.com/none",
            Arc::new(TestBackend::new(1)),
            ResourceSettings::default()
        )
        .await
        .is_err());
    host.shutdown().await;
}

/// A backend whose first discovery takes a while: its list is empty until `finish` publishes
/// the devices and ends the discovery.
#[derive(Clone)]
struct SlowDiscovery {
    devices: TestBackend,
    done: Arc<watch::Sender<bool>>,
}

impl SlowDiscovery {
    fn new() -> Self {
        let devices = TestBackend::new(0);
        SlowDiscovery {
            devices,
            done: Arc::new(watch::Sender::new(false)),
        }
    }

    fn finish(&self, count: usize) {
        self.devices.publish(
            (0..count)
                .map(|i| Device::new(format!("gpu-{i}")))
                .collect(),
        );
        self.done.send_replace(true);
    }
}

impl Backend for SlowDiscovery {
    fn devices(&self) -> watch::Receiver<DeviceList> {
        self.devices.devices()
    }
    fn allocate(&self, ids: &[String]) -> Result<ContainerEdits, AllocateError> {
        self.devices.allocate(ids)
    }
    fn discovered(&self) -> devplug::BoxFuture<'_, ()> {
        let mut done = self.done.subscribe();
        Box::pin(async move {
            let _ = done.wait_for(|d| *d).await;
        })
    }
}

#[tokio::test]
async fn registration_waits_for_the_first_discovery_so_the_first_list_is_the_truth() {
    let (dir, kubelet) = kubelet(Duration::from_secs(5)).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = SlowDiscovery::new();
    host.add("example.com/gpu", backend.clone()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        kubelet.read(|n| n.registrations().is_empty()),
        "registered before the first discovery ended"
    );
    backend.finish(4);
    wait_capacity(&kubelet, "example.com/gpu", (4, 4)).await;
    // One list: the kubelet never saw the empty one.
    let updates = kubelet.read(|n| n.resource("example.com/gpu").map(|r| r.updates()));
    assert_eq!(updates, Some(1));
    host.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn a_discovery_that_never_ends_delays_registration_by_the_bound_only() {
    let (dir, kubelet) = kubelet(Duration::from_secs(5)).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = SlowDiscovery::new();
    let settings = ResourceSettings {
        first_discovery_wait: Duration::from_millis(200),
        ..Default::default()
    };
    host.add_with("example.com/gpu", Arc::new(backend.clone()), settings)
        .unwrap();
    kubelet
        .wait_for(WAIT, |n| (!n.registrations().is_empty()).then_some(()))
        .await
        .expect("registered after the bound");
    // A discovery that ends later is still sent, as the next list.
    backend.devices.publish(vec![Device::new("late")]);
    wait_capacity(&kubelet, "example.com/gpu", (1, 1)).await;
    host.shutdown().await;
    kubelet.stop().await;
}
