//! The pod resources client against the simulator's PodResources v1:
//! List/Get/GetAllocatableResources over a Unix socket, NUMA duplicates, init containers left out, the kubelet's rate limit, answers over tonic's 4 MiB default, the
//! devices-in-use channel, and the watchdog that registers again when the kubelet lost us.

use crate::support::{no_hold_down, wait_capacity, TestBackend, WAIT};
use devplug::podresources::{self, PodResourcesClient, PodResourcesError};
use devplug::{Device, Health, Host};
use devplug_proto::podresources as pr;
use kubelet_sim::{ClientKeying, Kubelet, SimConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RESOURCE: &str = "example.com/npu";

async fn node(clients: ClientKeying) -> (tempfile::TempDir, Kubelet, Host) {
    let root = tempfile::tempdir().unwrap();
    let dp = root.path().join("device-plugins");
    let config = SimConfig {
        grace: Duration::from_secs(300),
        clients,
        ..SimConfig::default()
    }
    .with_pod_resources_beside(&dp);
    let kubelet = Kubelet::start_with(&dp, config).await.unwrap();
    let host = Host::new(&dp).unwrap();
    (root, kubelet, host)
}

async fn client(kubelet: &Kubelet) -> PodResourcesClient {
    PodResourcesClient::connect(kubelet.pod_resources_socket().unwrap(), WAIT)
        .await
        .unwrap()
        .with_interval(Duration::ZERO)
}

#[tokio::test]
async fn list_get_and_allocatable_show_who_holds_what() {
    let (_root, kubelet, host) = node(ClientKeying::default()).await;
    let backend = TestBackend::new(0);
    // dev-0 sits on two NUMA nodes: the kubelet lists it once per node.
    backend.publish(vec![
        Device::new("dev-0").with_numa_nodes([0, 1]),
        Device::new("dev-1").with_numa_nodes([1]),
        Device::new("dev-2"),
        Device::new("dev-3").with_numa_nodes([0]),
    ]);
    host.add_with(RESOURCE, Arc::new(backend.clone()), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    let a = kubelet
        .allocate("team-a/train", "main", RESOURCE, 3)
        .await
        .unwrap();
    let b = kubelet
        .allocate_init("setup", "init", RESOURCE, 1)
        .await
        .unwrap();

    let mut client = client(&kubelet).await;
    let list = client.list().await.unwrap();
    // Init containers are not reported; "setup" has no app container, so no devices.
    let raw: usize = list
        .pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .flat_map(|c| &c.devices)
        .map(|d| d.device_ids.len())
        .sum();
    let held = podresources::holders(&list);
    let ours = &held[RESOURCE];
    assert_eq!(ours.len(), 3, "{held:?}");
    for id in &a.device_ids {
        assert_eq!(ours[id].to_string(), format!("team-a/train/main"));
    }
    assert!(
        !ours.contains_key(&b.device_ids[0]),
        "init containers are not listed"
    );
    let on_two_nodes = a.device_ids.iter().filter(|id| *id == "dev-0").count();
    assert_eq!(
        raw,
        3 + on_two_nodes,
        "a device on two NUMA nodes is listed twice"
    );

    let pod = client.get("team-a", "train").await.unwrap();
    assert_eq!(
        (pod.namespace.as_str(), pod.name.as_str()),
        ("team-a", "train")
    );
    let missing = client.get("team-a", "nope").await.unwrap_err();
    assert!(
        missing
            .to_string()
            .contains("pod nope in namespace team-a not found"),
        "{missing}"
    );

    backend.set_health("dev-3", Health::unhealthy("test"));
    wait_capacity(&kubelet, RESOURCE, (4, 3)).await;
    let allocatable = client.allocatable().await.unwrap();
    assert_eq!(podresources::allocatable_counts(&allocatable)[RESOURCE], 3);
    host.shutdown().await;
}

#[tokio::test]
async fn the_rate_limit_is_met_and_respected() {
    let (_root, kubelet, _host) = node(ClientKeying::default()).await;
    // 40 unpaced calls at once exhaust the kubelet's burst of 10 (100 a second refill).
    let unpaced = client(&kubelet).await;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..40 {
        let mut c = unpaced.clone();
        calls.spawn(async move { c.list().await });
    }
    let mut refused = 0;
    while let Some(result) = calls.join_next().await {
        if let Err(PodResourcesError::Call(status)) = result.unwrap() {
            assert_eq!(status.code(), tonic::Code::ResourceExhausted);
            assert_eq!(status.message(), "rejected by rate limit");
            refused += 1;
        }
    }
    assert!(refused >= 20, "only {refused} of 40 calls were refused");
    // The default client paces itself to one call a second.
    let mut paced = PodResourcesClient::connect(kubelet.pod_resources_socket().unwrap(), WAIT)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // the bucket refills
    let started = Instant::now();
    paced.list().await.unwrap();
    paced.list().await.unwrap();
    assert!(started.elapsed() >= podresources::MIN_INTERVAL);
}

#[tokio::test]
async fn answers_over_four_mib_are_decoded() {
    // A kubelet-sized answer: 120,000 GPU-UUID-sized ids in one List, about 4.8 MiB.
    struct Big;
    #[tonic::async_trait]
    impl pr::pod_resources_lister_server::PodResourcesLister for Big {
        async fn list(
            &self,
            _: tonic::Request<pr::ListPodResourcesRequest>,
        ) -> Result<tonic::Response<pr::ListPodResourcesResponse>, tonic::Status> {
            let ids = (0..120_000).map(|i| format!("GPU-{i:036}")).collect();
            Ok(tonic::Response::new(pr::ListPodResourcesResponse {
                pod_resources: vec![pr::PodResources {
                    name: "p".into(),
                    namespace: "n".into(),
                    containers: vec![pr::ContainerResources {
                        name: "c".into(),
                        devices: vec![pr::ContainerDevices {
                            resource_name: RESOURCE.into(),
                            device_ids: ids,
                            topology: None,
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
            }))
        }
        async fn get_allocatable_resources(
            &self,
            _: tonic::Request<pr::AllocatableResourcesRequest>,
        ) -> Result<tonic::Response<pr::AllocatableResourcesResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented(""))
        }
        async fn get(
            &self,
            _: tonic::Request<pr::GetPodResourcesRequest>,
        ) -> Result<tonic::Response<pr::GetPodResourcesResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented(""))
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubelet.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    devplug_proto::uds::spawn_server(
        tonic::transport::Server::builder().add_service(
            pr::pod_resources_lister_server::PodResourcesListerServer::new(Big)
                .max_encoding_message_size(64 << 20),
        ),
        listener,
        stop.clone().cancelled_owned(),
        "big".into(),
    );
    let mut client = PodResourcesClient::connect(&path, WAIT).await.unwrap();
    let list = client.list().await.unwrap();
    use prost::Message;
    assert!(
        list.encoded_len() > 4 * 1024 * 1024,
        "{}",
        list.encoded_len()
    );
    assert_eq!(podresources::holders(&list)[RESOURCE].len(), 120_000);
    stop.cancel();
}

#[tokio::test]
async fn in_use_and_allocated_follow_the_pods() {
    let (_root, kubelet, host) = node(ClientKeying::default()).await;
    host.add_with(RESOURCE, Arc::new(TestBackend::new(4)), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    host.watch_pod_resources(
        kubelet.pod_resources_socket().unwrap().to_owned(),
        Duration::from_millis(50),
    );
    let mut in_use = host.in_use();
    let got = kubelet.allocate("p", "main", RESOURCE, 2).await.unwrap();
    tokio::time::timeout(
        WAIT,
        in_use.wait_for(|u| u.get(RESOURCE).is_some_and(|s| s.len() == 2)),
    )
    .await
    .unwrap()
    .unwrap();
    let ids: Vec<String> = in_use.borrow()[RESOURCE].iter().cloned().collect();
    let mut want = got.device_ids.clone();
    want.sort();
    assert_eq!(ids, want);
    assert_eq!(host.metrics()[0].1.allocated, Some(2));
    kubelet.remove_pod("p");
    tokio::time::timeout(WAIT, in_use.wait_for(|u| !u.contains_key(RESOURCE)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(host.metrics()[0].1.allocated, Some(0));
    host.shutdown().await;
}

#[tokio::test]
async fn the_watchdog_registers_again_when_the_kubelet_lost_us() {
    // Kubelets up to 1.36: a second instance registers, then stops; the end of its stream
    // disconnects whatever client holds the name (the second), and our stream, still open, is
    // no longer counted. Nothing tells us but the kubelet's allocatable.
    let (root, kubelet, a) = node(ClientKeying::ResourceName).await;
    a.add_with(RESOURCE, Arc::new(TestBackend::new(3)), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (3, 3)).await;
    a.watch_pod_resources(
        kubelet.pod_resources_socket().unwrap().to_owned(),
        Duration::from_millis(100),
    );
    let b = Host::new(root.path().join("device-plugins")).unwrap();
    b.add_with(RESOURCE, Arc::new(TestBackend::new(3)), no_hold_down())
        .unwrap();
    kubelet
        .wait_for(WAIT, |n| {
            (n.registration_count(RESOURCE) == 2).then_some(())
        })
        .await
        .unwrap();
    b.shutdown().await;
    // The kubelet drops to 0, then the watchdog brings it back within a few polls.
    let back = kubelet
        .wait_for(WAIT, |n| {
            (n.registration_count(RESOURCE) == 3 && n.capacity(RESOURCE) == (3, 3)).then_some(())
        })
        .await;
    assert!(
        back.is_ok(),
        "kubelet has {:?}",
        kubelet.read(|n| n.capacity(RESOURCE))
    );
    assert_eq!(a.metrics()[0].1.watchdog_reregistrations, 1);
    a.shutdown().await;
}

#[tokio::test]
async fn devices_of_another_plugin_under_our_name_are_counted() {
    // Another device plugin registers our resource name with devices of its own, more than
    // ours (so the kubelet's allocatable is not short and the watchdog has no reason to act):
    // the kubelet keeps its registration, and we count its devices.
    let (root, kubelet, a) = node(ClientKeying::SocketPath).await;
    a.add_with(RESOURCE, Arc::new(TestBackend::new(3)), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (3, 3)).await;
    a.watch_pod_resources(
        kubelet.pod_resources_socket().unwrap().to_owned(),
        Duration::from_millis(100),
    );
    let foreign = |host: &Host| host.metrics()[0].1.foreign_devices;
    let deadline = Instant::now() + WAIT;
    while foreign(&a) != Some(0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(foreign(&a), Some(0), "only our devices at first");
    let other = TestBackend::new(0);
    other.publish((0..4).map(|i| Device::new(format!("gpu-{i}"))).collect());
    let b = Host::new(root.path().join("device-plugins")).unwrap();
    b.add_with(RESOURCE, Arc::new(other), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    let deadline = Instant::now() + WAIT;
    while foreign(&a) != Some(4) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(foreign(&a), Some(4), "the other plugin's 4 devices");
    b.shutdown().await;
    a.shutdown().await;
}
