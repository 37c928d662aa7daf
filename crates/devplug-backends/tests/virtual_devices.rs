//! The virtual backend through the kubelet simulator, over real sockets.
#![allow(clippy::unwrap_used)] // a panic in a test is a failed test

use devplug::{Health, Host};
use devplug_backends::{VirtualBackend, VirtualSettings};
use kubelet_sim::Kubelet;
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_pod_gets_two_of_eight_virtual_devices_in_its_env() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start(dir.path()).await.unwrap();
    let host = Host::new(dir.path()).unwrap();
    let settings = VirtualSettings {
        env: "DUMMY_VISIBLE_DEVICES".into(),
        id_prefix: "npu-".into(),
        ..VirtualSettings::new(8)
    };
    let backend = Arc::new(VirtualBackend::new(&settings).unwrap());
    host.add_shared("dummy.com/npu", backend.clone()).unwrap();
    kubelet
        .wait_for(WAIT, |n| {
            (n.capacity("dummy.com/npu") == (8, 8)).then_some(())
        })
        .await
        .unwrap();

    let a = kubelet
        .allocate("pod-a", "main", "dummy.com/npu", 2)
        .await
        .unwrap();
    assert_eq!(a.env("DUMMY_VISIBLE_DEVICES"), Some("npu-0,npu-1"));
    // Unlike the tutorial's plugin, allocated devices stay healthy.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(kubelet.read(|n| n.capacity("dummy.com/npu")), (8, 8));

    assert!(backend.set_health("npu-5", Health::unhealthy("simulated fault")));
    kubelet
        .wait_for(WAIT, |n| {
            (n.capacity("dummy.com/npu") == (8, 7)).then_some(())
        })
        .await
        .unwrap();
    host.shutdown().await;
}
