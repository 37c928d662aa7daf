//! Pins the wire contract of the kubelet's APIs: package and service names, full gRPC method
//! paths, and the encoded bytes of messages, computed by hand from the field numbers. The same for
//! `pluginregistration` and pod resources `v1`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_proto::v1beta1 as pb;
use prost::Message;
use std::collections::HashMap;

const GENERATED: &str = include_str!("../src/gen/v1beta1.rs");

/// Bytes of a length-delimited field: tag (field << 3 | 2), length, payload.
fn ld(field: u8, payload: &[u8]) -> Vec<u8> {
    assert!(
        payload.len() < 128,
        "single-byte lengths only in these tests"
    );
    let mut out = vec![(field << 3) | 2, payload.len() as u8];
    out.extend_from_slice(payload);
    out
}

/// Bytes of a varint field with a small value.
fn varint(field: u8, value: u8) -> Vec<u8> {
    assert!(value < 128);
    vec![field << 3, value]
}

#[test]
fn method_paths_match_the_kubelet() {
    let paths = [
        "/v1beta1.Registration/Register",
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
    ];
    for path in paths {
        // Each path appears once in the client (the request path) and once in the server (the route).
        let count = GENERATED.matches(&format!("\"{path}\"")).count();
        assert_eq!(
            count, 2,
            "{path} should be a client path and a server route"
        );
    }
    use tonic::server::NamedService;
    assert_eq!(
        <pb::device_plugin_server::DevicePluginServer<Unimplemented> as NamedService>::NAME,
        "v1beta1.DevicePlugin"
    );
    assert_eq!(
        <pb::registration_server::RegistrationServer<Unimplemented> as NamedService>::NAME,
        "v1beta1.Registration"
    );
}

#[test]
fn descriptor_has_exact_names_and_numbers() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto");
    let fds = protox::compile(["v1beta1/api.proto"], [root]).unwrap();
    let file = &fds.file[0];
    assert_eq!(file.package(), "v1beta1");
    let field = |msg: &str, name: &str| -> i32 {
        let m = file.message_type.iter().find(|m| m.name() == msg).unwrap();
        m.field.iter().find(|f| f.name() == name).unwrap().number()
    };
    let expected = [
        ("DevicePluginOptions", "pre_start_required", 1),
        (
            "DevicePluginOptions",
            "get_preferred_allocation_available",
            2,
        ),
        ("RegisterRequest", "version", 1),
        ("RegisterRequest", "endpoint", 2),
        ("RegisterRequest", "resource_name", 3),
        ("RegisterRequest", "options", 4),
        ("ListAndWatchResponse", "devices", 1),
        ("TopologyInfo", "nodes", 1),
        ("NUMANode", "ID", 1),
        ("Device", "ID", 1),
        ("Device", "health", 2),
        ("Device", "topology", 3),
        ("PreStartContainerRequest", "devices_ids", 1),
        ("PreferredAllocationRequest", "container_requests", 1),
        (
            "ContainerPreferredAllocationRequest",
            "available_deviceIDs",
            1,
        ),
        (
            "ContainerPreferredAllocationRequest",
            "must_include_deviceIDs",
            2,
        ),
        ("ContainerPreferredAllocationRequest", "allocation_size", 3),
        ("PreferredAllocationResponse", "container_responses", 1),
        ("ContainerPreferredAllocationResponse", "deviceIDs", 1),
        ("AllocateRequest", "container_requests", 1),
        ("ContainerAllocateRequest", "devices_ids", 1),
        ("AllocateResponse", "container_responses", 1),
        ("ContainerAllocateResponse", "envs", 1),
        ("ContainerAllocateResponse", "mounts", 2),
        ("ContainerAllocateResponse", "devices", 3),
        ("ContainerAllocateResponse", "annotations", 4),
        ("ContainerAllocateResponse", "cdi_devices", 5),
        ("Mount", "container_path", 1),
        ("Mount", "host_path", 2),
        ("Mount", "read_only", 3),
        ("DeviceSpec", "container_path", 1),
        ("DeviceSpec", "host_path", 2),
        ("DeviceSpec", "permissions", 3),
        ("CDIDevice", "name", 1),
    ];
    for (msg, name, number) in expected {
        assert_eq!(field(msg, name), number, "{msg}.{name}");
    }
    let services: Vec<(&str, Vec<&str>)> = file
        .service
        .iter()
        .map(|s| (s.name(), s.method.iter().map(|m| m.name()).collect()))
        .collect();
    assert_eq!(
        services,
        vec![
            ("Registration", vec!["Register"]),
            (
                "DevicePlugin",
                vec![
                    "GetDevicePluginOptions",
                    "ListAndWatch",
                    "GetPreferredAllocation",
                    "Allocate",
                    "PreStartContainer"
                ]
            ),
        ]
    );
}

#[test]
fn device_with_topology_encodes_by_hand() {
    let device = pb::Device {
        id: "gpu-0".into(),
        health: "Healthy".into(),
        topology: Some(pb::TopologyInfo {
            nodes: vec![pb::NumaNode { id: 1 }],
        }),
    };
    let numa = varint(1, 1); // NUMANode.ID = 1
    let topology = ld(1, &numa); // TopologyInfo.nodes
    let expected = [ld(1, b"gpu-0"), ld(2, b"Healthy"), ld(3, &topology)].concat();
    assert_eq!(device.encode_to_vec(), expected);
    assert_eq!(
        expected,
        b"\x0a\x05gpu-0\x12\x07Healthy\x1a\x04\x0a\x02\x08\x01".to_vec()
    );
}

#[test]
fn container_allocate_response_encodes_by_hand() {
    let resp = pb::ContainerAllocateResponse {
        envs: HashMap::from([("K".to_owned(), "V".to_owned())]),
        mounts: vec![pb::Mount {
            container_path: "/c".into(),
            host_path: "/h".into(),
            read_only: true,
        }],
        devices: vec![pb::DeviceSpec {
            container_path: "/dev/x".into(),
            host_path: "/dev/y".into(),
            permissions: "rw".into(),
        }],
        annotations: HashMap::from([("a".to_owned(), "b".to_owned())]),
        cdi_devices: vec![pb::CdiDevice {
            name: "v.com/c=n".into(),
        }],
    };
    let map_entry = |k: &[u8], v: &[u8]| [ld(1, k), ld(2, v)].concat();
    let mount = [ld(1, b"/c"), ld(2, b"/h"), varint(3, 1)].concat();
    let spec = [ld(1, b"/dev/x"), ld(2, b"/dev/y"), ld(3, b"rw")].concat();
    let cdi = ld(1, b"v.com/c=n");
    let expected = [
        ld(1, &map_entry(b"K", b"V")),
        ld(2, &mount),
        ld(3, &spec),
        ld(4, &map_entry(b"a", b"b")),
        ld(5, &cdi),
    ]
    .concat();
    assert_eq!(resp.encode_to_vec(), expected);
    assert_eq!(&expected[..8], b"\x0a\x06\x0a\x01K\x12\x01V");
}

#[test]
fn register_and_preference_requests_encode_by_hand() {
    let req = pb::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "x.sock".into(),
        resource_name: "a.com/b".into(),
        options: Some(pb::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    };
    let expected = [
        ld(1, b"v1beta1"),
        ld(2, b"x.sock"),
        ld(3, b"a.com/b"),
        ld(4, &varint(2, 1)),
    ]
    .concat();
    assert_eq!(req.encode_to_vec(), expected);

    let pref = pb::ContainerPreferredAllocationRequest {
        available_device_i_ds: vec!["a".into(), "b".into()],
        must_include_device_i_ds: vec!["a".into()],
        allocation_size: 2,
    };
    let expected = [ld(1, b"a"), ld(1, b"b"), ld(2, b"a"), varint(3, 2)].concat();
    assert_eq!(pref.encode_to_vec(), expected);
}

/// A server type for reading `NamedService::NAME`; never served.
struct Unimplemented;

#[tonic::async_trait]
impl pb::registration_server::Registration for Unimplemented {
    async fn register(
        &self,
        _: tonic::Request<pb::RegisterRequest>,
    ) -> Result<tonic::Response<pb::Empty>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
}

#[tonic::async_trait]
impl pb::device_plugin_server::DevicePlugin for Unimplemented {
    async fn get_device_plugin_options(
        &self,
        _: tonic::Request<pb::Empty>,
    ) -> Result<tonic::Response<pb::DevicePluginOptions>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
    type ListAndWatchStream = tokio_stream::Empty<Result<pb::ListAndWatchResponse, tonic::Status>>;
    async fn list_and_watch(
        &self,
        _: tonic::Request<pb::Empty>,
    ) -> Result<tonic::Response<Self::ListAndWatchStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
    async fn get_preferred_allocation(
        &self,
        _: tonic::Request<pb::PreferredAllocationRequest>,
    ) -> Result<tonic::Response<pb::PreferredAllocationResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
    async fn allocate(
        &self,
        _: tonic::Request<pb::AllocateRequest>,
    ) -> Result<tonic::Response<pb::AllocateResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
    async fn pre_start_container(
        &self,
        _: tonic::Request<pb::PreStartContainerRequest>,
    ) -> Result<tonic::Response<pb::PreStartContainerResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("test"))
    }
}

/// A compiled `.proto`: package, (message, field, number) and (service, methods).
type Described = (
    String,
    Vec<(String, String, i32)>,
    Vec<(String, Vec<String>)>,
);

/// The package, field numbers and services of a compiled `.proto`.
fn fields_of(proto: &str) -> Described {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto");
    let fds = protox::compile([proto], [root]).unwrap();
    let file = fds.file.iter().find(|f| f.name() == proto).unwrap();
    let fields = file
        .message_type
        .iter()
        .flat_map(|m| {
            m.field
                .iter()
                .map(|f| (m.name().to_owned(), f.name().to_owned(), f.number()))
        })
        .collect();
    let services = file
        .service
        .iter()
        .map(|s| {
            (
                s.name().to_owned(),
                s.method.iter().map(|m| m.name().to_owned()).collect(),
            )
        })
        .collect();
    (file.package().to_owned(), fields, services)
}

#[test]
fn pluginregistration_matches_the_kubelet() {
    let (package, fields, services) = fields_of("pluginregistration/api.proto");
    assert_eq!(package, "pluginregistration");
    let expected = [
        ("PluginInfo", "type", 1),
        ("PluginInfo", "name", 2),
        ("PluginInfo", "endpoint", 3),
        ("PluginInfo", "supported_versions", 4),
        ("RegistrationStatus", "plugin_registered", 1),
        ("RegistrationStatus", "error", 2),
    ];
    let got: Vec<(&str, &str, i32)> = fields
        .iter()
        .map(|(m, f, n)| (m.as_str(), f.as_str(), *n))
        .collect();
    assert_eq!(got, expected);
    assert_eq!(
        services,
        vec![(
            "Registration".to_owned(),
            vec!["GetInfo".to_owned(), "NotifyRegistrationStatus".to_owned()]
        )]
    );
    use devplug_proto::pluginregistration as pr;
    use tonic::server::NamedService;
    assert_eq!(
        <pr::registration_server::RegistrationServer<UnimplementedWatcher> as NamedService>::NAME,
        "pluginregistration.Registration"
    );
    let generated = include_str!("../src/gen/pluginregistration.rs");
    for path in [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ] {
        assert_eq!(
            generated.matches(&format!("\"{path}\"")).count(),
            2,
            "{path}"
        );
    }
    // PluginInfo{type: "DevicePlugin", name: "a/b", endpoint: "/s", supported_versions: ["v1beta1"]}
    let info = pr::PluginInfo {
        r#type: "DevicePlugin".into(),
        name: "a/b".into(),
        endpoint: "/s".into(),
        supported_versions: vec!["v1beta1".into()],
    };
    let mut want = ld(1, b"DevicePlugin");
    want.extend(ld(2, b"a/b"));
    want.extend(ld(3, b"/s"));
    want.extend(ld(4, b"v1beta1"));
    assert_eq!(info.encode_to_vec(), want);
    let status = pr::RegistrationStatus {
        plugin_registered: true,
        error: "e".into(),
    };
    let mut want = varint(1, 1);
    want.extend(ld(2, b"e"));
    assert_eq!(status.encode_to_vec(), want);
}

#[test]
fn podresources_matches_the_kubelet() {
    let (package, fields, services) = fields_of("podresources/api.proto");
    assert_eq!(package, "v1");
    let expected = [
        ("AllocatableResourcesResponse", "devices", 1),
        ("AllocatableResourcesResponse", "cpu_ids", 2),
        ("AllocatableResourcesResponse", "memory", 3),
        ("ListPodResourcesResponse", "pod_resources", 1),
        ("PodResources", "name", 1),
        ("PodResources", "namespace", 2),
        ("PodResources", "containers", 3),
        ("PodResources", "cpu_ids", 4),
        ("PodResources", "memory", 5),
        ("ContainerResources", "name", 1),
        ("ContainerResources", "devices", 2),
        ("ContainerResources", "cpu_ids", 3),
        ("ContainerResources", "memory", 4),
        ("ContainerResources", "dynamic_resources", 5),
        ("ContainerMemory", "memory_type", 1),
        ("ContainerMemory", "size", 2),
        ("ContainerMemory", "topology", 3),
        ("ContainerDevices", "resource_name", 1),
        ("ContainerDevices", "device_ids", 2),
        ("ContainerDevices", "topology", 3),
        ("TopologyInfo", "nodes", 1),
        ("NUMANode", "ID", 1),
        ("DynamicResource", "claim_name", 2),
        ("DynamicResource", "claim_namespace", 3),
        ("DynamicResource", "claim_resources", 4),
        ("ClaimResource", "cdi_devices", 1),
        ("ClaimResource", "driver_name", 2),
        ("ClaimResource", "pool_name", 3),
        ("ClaimResource", "device_name", 4),
        ("ClaimResource", "share_id", 5),
        ("CDIDevice", "name", 1),
        ("GetPodResourcesRequest", "pod_name", 1),
        ("GetPodResourcesRequest", "pod_namespace", 2),
        ("GetPodResourcesResponse", "pod_resources", 1),
    ];
    let got: Vec<(&str, &str, i32)> = fields
        .iter()
        .map(|(m, f, n)| (m.as_str(), f.as_str(), *n))
        .collect();
    assert_eq!(got, expected);
    assert_eq!(
        services,
        vec![(
            "PodResourcesLister".to_owned(),
            vec![
                "List".to_owned(),
                "GetAllocatableResources".to_owned(),
                "Get".to_owned()
            ]
        )]
    );
    let generated = include_str!("../src/gen/v1.rs");
    for path in [
        "/v1.PodResourcesLister/List",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/Get",
    ] {
        assert_eq!(
            generated.matches(&format!("\"{path}\"")).count(),
            2,
            "{path}"
        );
    }
    use devplug_proto::podresources as pr;
    // ContainerDevices{resource_name: "a/b", device_ids: ["d"], topology: {nodes: [{ID: 1}]}}
    let devices = pr::ContainerDevices {
        resource_name: "a/b".into(),
        device_ids: vec!["d".into()],
        topology: Some(pr::TopologyInfo {
            nodes: vec![pr::NumaNode { id: 1 }],
        }),
    };
    let mut want = ld(1, b"a/b");
    want.extend(ld(2, b"d"));
    want.extend(ld(3, &ld(1, &varint(1, 1))));
    assert_eq!(devices.encode_to_vec(), want);
}

/// A Registration (plugin watcher) service that is never called, to name the generated server type.
struct UnimplementedWatcher;

#[tonic::async_trait]
impl devplug_proto::pluginregistration::registration_server::Registration for UnimplementedWatcher {
    async fn get_info(
        &self,
        _: tonic::Request<devplug_proto::pluginregistration::InfoRequest>,
    ) -> Result<tonic::Response<devplug_proto::pluginregistration::PluginInfo>, tonic::Status> {
        Err(tonic::Status::unimplemented(""))
    }
    async fn notify_registration_status(
        &self,
        _: tonic::Request<devplug_proto::pluginregistration::RegistrationStatus>,
    ) -> Result<
        tonic::Response<devplug_proto::pluginregistration::RegistrationStatusResponse>,
        tonic::Status,
    > {
        Err(tonic::Status::unimplemented(""))
    }
}

#[test]
fn dra_matches_the_kubelet() {
    for (proto, package, generated) in [
        (
            "dra/v1/api.proto",
            "k8s.io.kubelet.pkg.apis.dra.v1",
            include_str!("../src/gen/k8s.io.kubelet.pkg.apis.dra.v1.rs"),
        ),
        (
            "dra/v1beta1/api.proto",
            "k8s.io.kubelet.pkg.apis.dra.v1beta1",
            include_str!("../src/gen/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"),
        ),
    ] {
        let (got_package, fields, services) = fields_of(proto);
        assert_eq!(got_package, package);
        let mut expected = vec![
            ("NodePrepareResourcesRequest", "claims", 1),
            ("NodePrepareResourcesResponse", "claims", 1),
            ("NodePrepareResourceResponse", "devices", 1),
            ("NodePrepareResourceResponse", "error", 2),
            ("Device", "request_names", 1),
            ("Device", "pool_name", 2),
            ("Device", "device_name", 3),
            ("Device", "cdi_device_ids", 4),
            ("Device", "share_id", 5),
            ("NodeUnprepareResourcesRequest", "claims", 1),
            ("NodeUnprepareResourcesResponse", "claims", 1),
            ("NodeUnprepareResourceResponse", "error", 1),
            ("Claim", "namespace", 1),
            ("Claim", "uid", 2),
            ("Claim", "name", 3),
        ];
        if package.ends_with("v1beta1") {
            // share_id came with v1 (Kubernetes 1.35).
            expected.retain(|(_, field, _)| *field != "share_id");
        }
        // Map entries are nested messages; the top-level messages are what the wire names.
        let got: Vec<(&str, &str, i32)> = fields
            .iter()
            .map(|(m, f, n)| (m.as_str(), f.as_str(), *n))
            .collect();
        assert_eq!(got, expected, "{proto}");
        assert_eq!(
            services,
            vec![(
                "DRAPlugin".to_owned(),
                vec![
                    "NodePrepareResources".to_owned(),
                    "NodeUnprepareResources".to_owned()
                ]
            )]
        );
        for method in ["NodePrepareResources", "NodeUnprepareResources"] {
            let path = format!("\"/{package}.DRAPlugin/{method}\"");
            assert_eq!(generated.matches(&path).count(), 2, "{path}");
        }
    }
    assert_eq!(
        devplug_proto::constants::DRA_SUPPORTED_VERSIONS,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    // Claim{namespace: "n", uid: "u", name: "c"} and a device with a CDI id, encoded by hand.
    use devplug_proto::dra_v1 as dra;
    let claim = dra::Claim {
        namespace: "n".into(),
        uid: "u".into(),
        name: "c".into(),
    };
    let mut want = ld(1, b"n");
    want.extend(ld(2, b"u"));
    want.extend(ld(3, b"c"));
    assert_eq!(claim.encode_to_vec(), want);
    let device = dra::Device {
        request_names: vec!["r".into()],
        pool_name: "p".into(),
        device_name: "d".into(),
        cdi_device_ids: vec!["k/c=d".into()],
        share_id: None,
    };
    let mut want = ld(1, b"r");
    want.extend(ld(2, b"p"));
    want.extend(ld(3, b"d"));
    want.extend(ld(4, b"k/c=d"));
    assert_eq!(device.encode_to_vec(), want);
}
