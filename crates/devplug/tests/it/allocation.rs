//! Allocate, GetPreferredAllocation and PreStartContainer, through the simulator and raw clients.

use crate::support::{allocate_request, kubelet, plugin_socket, wait_capacity, TestBackend, WAIT};
use devplug::{Health, Host, Options};
use devplug_proto::uds;
use devplug_proto::v1beta1::{self as pb, device_plugin_client::DevicePluginClient};
use kubelet_sim::AllocationError;
use std::time::Duration;

const GRACE: Duration = Duration::from_secs(300);

async fn raw_client(host: &Host, resource: &str) -> DevicePluginClient<tonic::transport::Channel> {
    let socket = plugin_socket(host, resource);
    DevicePluginClient::new(uds::connect(&socket, WAIT).await.unwrap())
}

#[tokio::test]
async fn allocates_two_of_eight_like_the_kubelet() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/npu", TestBackend::new(8)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (8, 8)).await;

    let a = kubelet
        .allocate("pod-a", "main", "example.com/npu", 2)
        .await
        .unwrap();
    assert_eq!(a.device_ids, vec!["dev-0", "dev-1"]);
    assert_eq!(a.env("TEST_DEVICES"), Some("dev-0,dev-1"));
    let b = kubelet
        .allocate("pod-b", "main", "example.com/npu", 6)
        .await
        .unwrap();
    assert_eq!(b.device_ids.len(), 6);
    let err = kubelet
        .allocate("pod-c", "main", "example.com/npu", 1)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AllocationError::Unavailable { available: 0, .. }),
        "{err}"
    );
    // Removing a pod frees its devices.
    assert!(kubelet.remove_pod("pod-a"));
    let c = kubelet
        .allocate("pod-c", "main", "example.com/npu", 2)
        .await
        .unwrap();
    assert_eq!(c.device_ids, vec!["dev-0", "dev-1"]);
    host.shutdown().await;
}

#[tokio::test]
async fn unknown_and_repeated_ids_are_rejected_and_the_plugin_keeps_serving() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/npu", TestBackend::new(4)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (4, 4)).await;
    let mut client = raw_client(&host, "example.com/npu").await;

    let err = client
        .allocate(allocate_request(&["dev-0", "nope", "gone"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("\"nope\"") && err.message().contains("\"gone\""),
        "{}",
        err.message()
    );
    assert!(err.message().contains("example.com/npu"));
    let err = client
        .allocate(allocate_request(&["dev-1", "dev-1"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("repeated device ids [\"dev-1\"]"),
        "{}",
        err.message()
    );
    let err = client
        .allocate(pb::AllocateRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Still serving: N container requests get N responses, in order.
    let mut two = allocate_request(&["dev-0"]);
    two.container_requests.push(pb::ContainerAllocateRequest {
        devices_ids: vec!["dev-2".into(), "dev-3".into()],
    });
    let resp = client.allocate(two).await.unwrap().into_inner();
    assert_eq!(resp.container_responses.len(), 2);
    assert_eq!(
        resp.container_responses[1].envs["TEST_DEVICES"],
        "dev-2,dev-3"
    );
    assert!(kubelet.read(|n| n.resource("example.com/npu").unwrap().is_connected()));
    let a = kubelet
        .allocate("pod", "main", "example.com/npu", 1)
        .await
        .unwrap();
    assert_eq!(a.device_ids.len(), 1);
    host.shutdown().await;
}

#[tokio::test]
async fn preferred_allocation_is_used_when_offered_and_cleaned_up() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let options = Options {
        preferred_allocation: true,
        pre_start_required: false,
    };
    host.add("example.com/npu", TestBackend::new(5).with_options(options))
        .unwrap();
    wait_capacity(&kubelet, "example.com/npu", (5, 5)).await;
    assert!(kubelet.read(|n| n
        .resource("example.com/npu")
        .unwrap()
        .options()
        .unwrap()
        .get_preferred_allocation_available));

    // The test backend prefers the highest ids.
    let a = kubelet
        .allocate("pod-a", "main", "example.com/npu", 2)
        .await
        .unwrap();
    assert_eq!(a.device_ids, vec!["dev-4", "dev-3"]);

    // Raw: must-include first, bounded by size, only available ids.
    let mut client = raw_client(&host, "example.com/npu").await;
    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let resp = client
        .get_preferred_allocation(pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: ids(&["dev-0", "dev-1", "dev-2"]),
                must_include_device_i_ds: ids(&["dev-0"]),
                allocation_size: 2,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.container_responses[0].device_i_ds,
        ids(&["dev-0", "dev-2"])
    );
    // Best effort, never an error, even for an impossible size.
    let resp = client
        .get_preferred_allocation(pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: ids(&["dev-1"]),
                must_include_device_i_ds: vec![],
                allocation_size: 9,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.container_responses[0].device_i_ds, ids(&["dev-1"]));
    host.shutdown().await;
}

#[tokio::test]
async fn init_container_devices_are_reused_and_unhealthy_devices_are_skipped() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(4);
    host.add("example.com/npu", backend.clone()).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (4, 4)).await;
    backend.set_health("dev-0", Health::unhealthy("broken"));
    wait_capacity(&kubelet, "example.com/npu", (4, 3)).await;

    let init = kubelet
        .allocate_init("pod", "init", "example.com/npu", 1)
        .await
        .unwrap();
    assert_eq!(init.device_ids, vec!["dev-1"]);
    let main = kubelet
        .allocate("pod", "main", "example.com/npu", 2)
        .await
        .unwrap();
    assert_eq!(
        main.device_ids,
        vec!["dev-1", "dev-2"],
        "the init container's device is reused first"
    );
    // Asking again for the same container returns the cached answer.
    assert_eq!(
        kubelet
            .allocate("pod", "main", "example.com/npu", 2)
            .await
            .unwrap(),
        main
    );
    host.shutdown().await;
}

#[tokio::test]
async fn pre_start_runs_only_when_the_backend_asks() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let with = TestBackend::new(2).with_options(Options {
        pre_start_required: true,
        preferred_allocation: false,
    });
    let without = TestBackend::new(2);
    host.add("example.com/with", with.clone()).unwrap();
    host.add("example.com/without", without.clone()).unwrap();
    wait_capacity(&kubelet, "example.com/with", (2, 2)).await;
    wait_capacity(&kubelet, "example.com/without", (2, 2)).await;

    kubelet
        .allocate("pod", "main", "example.com/with", 1)
        .await
        .unwrap();
    kubelet
        .allocate("pod", "main", "example.com/without", 1)
        .await
        .unwrap();
    assert!(kubelet
        .start_container("pod", "main", "example.com/with")
        .await
        .unwrap());
    assert!(!kubelet
        .start_container("pod", "main", "example.com/without")
        .await
        .unwrap());
    assert_eq!(
        *with.pre_started.lock().unwrap(),
        vec![vec!["dev-0".to_owned()]]
    );
    assert!(without.pre_started.lock().unwrap().is_empty());
    host.shutdown().await;
}

#[tokio::test]
async fn the_kubelet_refuses_what_the_real_one_refuses() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let channel = uds::connect(&kubelet.socket_path(), WAIT).await.unwrap();
    let mut client = pb::registration_client::RegistrationClient::new(channel);
    let bad_version = pb::RegisterRequest {
        version: "v1alpha".into(),
        endpoint: "x.sock".into(),
        resource_name: "example.com/x".into(),
        options: None,
    };
    let err = client.register(bad_version).await.unwrap_err();
    assert!(
        err.message().contains("not supported by kubelet"),
        "{}",
        err.message()
    );
    let bad_name = pb::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "x.sock".into(),
        resource_name: "gpu".into(),
        options: None,
    };
    let err = client.register(bad_name).await.unwrap_err();
    assert!(err.message().contains("is invalid"), "{}", err.message());
    let nobody = pb::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "x.sock".into(),
        resource_name: "example.com/x".into(),
        options: None,
    };
    let err = client.register(nobody).await.unwrap_err();
    assert!(
        err.message().contains("failed to dial device plugin"),
        "{}",
        err.message()
    );
    assert!(kubelet.read(|n| n.registrations().is_empty()));
    drop(dir);
}
