//! The third-party-style fake plugin against the simulated kubelet: registration, device list
//! updates, allocation with its configured edits, preferred allocation, and stopping.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_proto::v1beta1 as pb;
use kubelet_sim::fake_plugin::{FakeDevice, FakePlugin, FakeSpec};
use kubelet_sim::{AllocationError, Kubelet, NodeState, SimConfig};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);
const RESOURCE: &str = "vendor.example/gpu";

fn spec() -> FakeSpec {
    FakeSpec {
        devices: vec![
            FakeDevice::healthy("gpu-0").numa(0),
            FakeDevice::healthy("gpu-1").numa(0),
            FakeDevice::healthy("gpu-2").numa(1),
            FakeDevice::unhealthy("gpu-3").numa(1),
        ],
        options: pb::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        },
        edits: pb::ContainerAllocateResponse {
            envs: [("VENDOR_DRIVER".to_owned(), "535".to_owned())].into(),
            mounts: vec![pb::Mount {
                container_path: "/usr/lib/vendor".into(),
                host_path: "/opt/vendor/lib".into(),
                read_only: true,
            }],
            devices: vec![pb::DeviceSpec {
                container_path: "/dev/vendorctl".into(),
                host_path: "/dev/vendorctl".into(),
                permissions: "rw".into(),
            }],
            annotations: [("vendor.example/slot".to_owned(), "3".to_owned())].into(),
            cdi_devices: vec![pb::CdiDevice {
                name: "vendor.example/gpu=all".into(),
            }],
        },
        ids_env: Some("VENDOR_VISIBLE_DEVICES".into()),
    }
}

async fn wait_capacity(kubelet: &Kubelet, want: (usize, usize)) {
    let got = kubelet
        .wait_for(WAIT, |n: &NodeState| {
            (n.capacity(RESOURCE) == want).then_some(())
        })
        .await;
    assert!(
        got.is_ok(),
        "wanted {want:?}, the kubelet has {:?}",
        kubelet.read(|n| n.capacity(RESOURCE))
    );
}

#[tokio::test]
async fn registers_streams_and_allocates_with_its_edits() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start_with(
        dir.path(),
        SimConfig {
            grace: Duration::from_secs(300),
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let plugin = FakePlugin::serve(dir.path().join("vendor-gpu.sock"), spec())
        .await
        .unwrap();
    plugin
        .register(kubelet.socket_path(), RESOURCE)
        .await
        .unwrap();
    wait_capacity(&kubelet, (4, 3)).await;
    let numa = kubelet.read(|n| {
        n.resource(RESOURCE).unwrap().devices()["gpu-2"]
            .numa_nodes
            .clone()
    });
    assert_eq!(numa, vec![1]);
    let options = kubelet.read(|n| n.resource(RESOURCE).unwrap().options().unwrap());
    assert!(options.get_preferred_allocation_available);

    // The kubelet asks for a preference (first available) and allocates.
    let a = kubelet.allocate("pod", "main", RESOURCE, 2).await.unwrap();
    assert_eq!(a.device_ids, vec!["gpu-0", "gpu-1"]);
    assert_eq!(a.env("VENDOR_VISIBLE_DEVICES"), Some("gpu-0,gpu-1"));
    assert_eq!(a.env("VENDOR_DRIVER"), Some("535"));
    assert_eq!(a.response.mounts[0].host_path, "/opt/vendor/lib");
    assert_eq!(a.response.devices[0].permissions, "rw");
    assert_eq!(a.response.annotations["vendor.example/slot"], "3");
    assert_eq!(a.response.cdi_devices[0].name, "vendor.example/gpu=all");

    // Health changes and whole-list updates reach the kubelet.
    assert!(plugin.set_health("gpu-3", "Healthy"));
    assert!(!plugin.set_health("nope", "Healthy"));
    wait_capacity(&kubelet, (4, 4)).await;
    plugin.set_devices(vec![FakeDevice::healthy("gpu-9")]);
    wait_capacity(&kubelet, (1, 1)).await;

    // Stopping ends the stream: the kubelet marks the devices unhealthy.
    let socket = plugin.socket_path().to_owned();
    plugin.stop().await;
    assert!(!socket.exists());
    wait_capacity(&kubelet, (1, 0)).await;
    let err = kubelet
        .allocate("pod-2", "main", RESOURCE, 1)
        .await
        .unwrap_err();
    assert_eq!(err, AllocationError::Stopped(RESOURCE.into()));
}

#[tokio::test]
async fn unknown_ids_are_invalid_and_preferences_honour_must_include() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = FakePlugin::serve(dir.path().join("p.sock"), spec())
        .await
        .unwrap();
    let channel = devplug_proto::uds::connect(plugin.socket_path(), WAIT)
        .await
        .unwrap();
    let mut client = pb::device_plugin_client::DevicePluginClient::new(channel);
    let err = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec!["gpu-0".into(), "gpu-7".into()],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(err.message(), "unknown device ids: gpu-7");

    let answer = client
        .get_preferred_allocation(pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["gpu-0".into(), "gpu-1".into(), "gpu-2".into()],
                must_include_device_i_ds: vec!["gpu-2".into()],
                allocation_size: 2,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.container_responses[0].device_i_ds,
        ["gpu-2", "gpu-0"]
    );
    plugin.stop().await;
}

#[tokio::test]
async fn a_refused_registration_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(dir.path()).await.unwrap();
    let plugin = FakePlugin::serve(dir.path().join("p.sock"), spec())
        .await
        .unwrap();
    let err = plugin
        .register(kubelet.socket_path(), "gpu")
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("the ResourceName \"gpu\" is invalid"),
        "{err}"
    );
    plugin.stop().await;
}
