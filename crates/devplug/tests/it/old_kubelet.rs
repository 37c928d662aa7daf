//! Kubelets up to 1.25 dial plugins with the socket path as `:authority` (grpc-go on a bare path),
//! which h2 alone would reset. A raw HTTP/2 client sends exactly that and must be served fully:
//! options, a ListAndWatch stream with updates, Allocate, and errors as gRPC statuses.

use crate::raw_h2::RawH2Client;
use crate::support::{
    allocate_request, kubelet, no_hold_down, plugin_socket, wait_capacity, TestBackend, WAIT,
};
use devplug::{Health, Host, Options};
use devplug_proto::v1beta1 as pb;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test]
async fn a_kubelet_sending_the_socket_path_as_authority_is_served() {
    let (dir, kubelet) = kubelet(Duration::from_secs(300)).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(4).with_options(Options {
        pre_start_required: true,
        preferred_allocation: true,
    });
    host.add_with("example.com/npu", Arc::new(backend.clone()), no_hold_down())
        .unwrap();
    wait_capacity(&kubelet, "example.com/npu", (4, 4)).await;
    let socket = plugin_socket(&host, "example.com/npu");

    let mut client = RawH2Client::connect(&socket, socket.to_str().unwrap()).await;
    tokio::time::timeout(WAIT, async {
        let options: pb::DevicePluginOptions = client
            .unary(
                "/v1beta1.DevicePlugin/GetDevicePluginOptions",
                &pb::Empty {},
            )
            .await
            .unwrap_or_else(|state| panic!("options refused: {state:?}"));
        assert!(options.get_preferred_allocation_available && options.pre_start_required);

        let watch = client
            .start("/v1beta1.DevicePlugin/ListAndWatch", &pb::Empty {})
            .await;
        let first: pb::ListAndWatchResponse = client.next_message(watch).await.unwrap();
        assert_eq!(first.devices.len(), 4);

        // Later requests reuse the authority from HPACK's dynamic table.
        let allocated: pb::AllocateResponse = client
            .unary(
                "/v1beta1.DevicePlugin/Allocate",
                &allocate_request(&["dev-1", "dev-2"]),
            )
            .await
            .unwrap_or_else(|state| panic!("allocate refused: {state:?}"));
        let envs = &allocated.container_responses[0].envs;
        assert_eq!(envs["TEST_DEVICES"], "dev-1,dev-2");

        let refused = client
            .unary::<pb::AllocateResponse>(
                "/v1beta1.DevicePlugin/Allocate",
                &allocate_request(&["nope"]),
            )
            .await
            .unwrap_err();
        assert_eq!(refused.reset, None);
        assert_eq!(refused.header("grpc-status"), Some("3"), "{refused:?}");
        assert!(refused.header("grpc-message").unwrap().contains("nope"));

        backend.set_health("dev-0", Health::unhealthy("overheated"));
        let update: pb::ListAndWatchResponse = client.next_message(watch).await.unwrap();
        let dev0 = update.devices.iter().find(|d| d.id == "dev-0").unwrap();
        assert_eq!(dev0.health, "Unhealthy");
    })
    .await
    .expect("the old-kubelet client timed out");

    // The simulator's own connection was never disturbed.
    wait_capacity(&kubelet, "example.com/npu", (4, 3)).await;
    assert_eq!(kubelet.read(|n| n.registrations().len()), 1);
    host.shutdown().await;
}

/// The other direction: Go plugins built on older helpers dial `kubelet.sock` by bare path too,
/// so the simulator must accept a path `:authority` on its Registration service.
#[tokio::test]
async fn the_simulator_accepts_a_registration_sent_with_a_path_authority() {
    let (dir, kubelet) = kubelet(Duration::from_secs(300)).await;
    let host = Host::new(dir.path()).unwrap();
    host.add("example.com/npu", TestBackend::new(3)).unwrap();
    wait_capacity(&kubelet, "example.com/npu", (3, 3)).await;
    let socket = plugin_socket(&host, "example.com/npu");
    let kubelet_sock = dir.path().join("kubelet.sock");

    // Register our running plugin's socket a second time, under another name, the way a Go
    // plugin would: the simulator dials back and streams its devices under that name.
    let mut client = RawH2Client::connect(&kubelet_sock, kubelet_sock.to_str().unwrap()).await;
    let register = pb::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: socket.file_name().unwrap().to_str().unwrap().into(),
        resource_name: "example.com/second-name".into(),
        options: None,
    };
    let reply = tokio::time::timeout(
        WAIT,
        client.unary::<pb::Empty>("/v1beta1.Registration/Register", &register),
    )
    .await
    .expect("Register timed out");
    assert!(reply.is_ok(), "Register refused: {:?}", reply.err());
    wait_capacity(&kubelet, "example.com/second-name", (3, 3)).await;

    // And a refusal arrives as a gRPC status, not a reset stream.
    let bad = pb::RegisterRequest {
        version: "v1alpha".into(),
        ..register
    };
    let refused = client
        .unary::<pb::Empty>("/v1beta1.Registration/Register", &bad)
        .await
        .unwrap_err();
    assert_eq!(refused.reset, None);
    assert_ne!(refused.header("grpc-status"), Some("0"), "{refused:?}");
    host.shutdown().await;
}
