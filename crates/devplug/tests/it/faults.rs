//! Faults found by running devplug as operators do: the kubelet folder removed and
//! created again, a wrong folder, a kubelet that binds before it listens, a kubelet down for a
//! while, a rolling upgrade on kubelets that key clients by resource name, a list over the
//! kubelet's 4 MiB limit, and 10,000 bad ids in one Allocate. Each test fails on the code
//! before its fix.

use crate::support::{allocate_request, kubelet, plugin_socket, wait_capacity, TestBackend, WAIT};
use devplug::{Device, Host, HostError};
use devplug_proto::uds;
use devplug_proto::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_sim::{Kubelet, SimConfig};
use std::time::{Duration, Instant};

const GRACE: Duration = Duration::from_secs(300);
const RESOURCE: &str = "example.com/npu";

/// Waits until `resource` has been registered `count` times with the host's status.
async fn registrations(host: &Host, resource: &str, count: u64) {
    let mut status = host.status(resource).unwrap();
    let reached = tokio::time::timeout(
        WAIT,
        status.wait_for(|s| s.registrations >= count && s.is_ready()),
    )
    .await
    .is_ok();
    assert!(
        reached,
        "{resource}: wanted {count} registrations, status {:?}",
        status.borrow()
    );
}

#[tokio::test]
async fn kubelet_folder_removed_and_created_again_registers_again() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    let kubelet = Kubelet::start(&dir).await.unwrap();
    let host = Host::new(&dir).unwrap();
    host.add(RESOURCE, TestBackend::new(4)).unwrap();
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;

    // A node re-image or a careless script: the folder goes, with the kubelet.
    kubelet.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
    // Without a kubelet for a moment, the host keeps following the parent.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(host.health().is_ok(), "a missing folder is waited for");
    assert!(!host.folder_present());

    // The folder comes back first (the reported case: devplug re-binds its socket there)...
    std::fs::create_dir_all(&dir).unwrap();
    let rebound = async {
        while host.status(RESOURCE).unwrap().borrow().socket.is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(WAIT, rebound).await.unwrap();
    // ...and only then a kubelet: it must be noticed and registered with.
    let kubelet = Kubelet::start(&dir).await.unwrap();
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    registrations(&host, RESOURCE, 2).await;
    assert!(host.health().is_ok());
    host.shutdown().await;
}

#[tokio::test]
async fn a_missing_folder_is_waited_for_and_not_created() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("var/lib/kubelet/device-plugins");
    let host = Host::new(&dir).unwrap();
    host.add(RESOURCE, TestBackend::new(2)).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !dir.exists(),
        "devplug must not create the kubelet's folder"
    );
    assert!(!root.path().join("var").exists());
    assert!(host.health().is_ok());

    // The kubelet arrives: its folder, then kubelet.sock. Registered without polling.
    let kubelet = Kubelet::start(&dir).await.unwrap();
    wait_capacity(&kubelet, RESOURCE, (2, 2)).await;
    host.shutdown().await;
}

#[tokio::test]
async fn a_kubelet_path_that_is_a_file_says_so() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("device-plugins");
    std::fs::write(&file, "").unwrap();
    let err = Host::new(&file)
        .err()
        .expect("a file is not a kubelet folder");
    assert!(matches!(err, HostError::NotAFolder(_)), "{err:?}");
    assert!(err.to_string().contains("is a file, not a folder"), "{err}");
}

#[tokio::test]
async fn a_folder_replaced_by_a_file_fails_health_until_it_is_a_folder_again() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    let kubelet = Kubelet::start(&dir).await.unwrap();
    let host = Host::new(&dir).unwrap();
    host.add(RESOURCE, TestBackend::new(1)).unwrap();
    wait_capacity(&kubelet, RESOURCE, (1, 1)).await;
    kubelet.stop().await;

    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::write(&dir, "oops").unwrap();
    let broken = async {
        while host.health().is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(WAIT, broken).await.unwrap();
    let reason = host.health().unwrap_err();
    assert!(reason.contains("not a folder"), "{reason}");

    std::fs::remove_file(&dir).unwrap();
    let kubelet = Kubelet::start(&dir).await.unwrap();
    // The watch is re-armed (after its retry delay) and the resource registers again.
    wait_capacity(&kubelet, RESOURCE, (1, 1)).await;
    assert!(host.health().is_ok());
    host.shutdown().await;
}

/// The kubelet binds kubelet.sock before it listens, so the first dial after a restart is
/// refused. The retry must come within milliseconds, not after 100 ms. The simulator's gap is
/// 20 ms here (1 ms by default) so that a loaded machine still dials inside it.
#[tokio::test]
async fn restarts_register_again_despite_the_bind_listen_gap() {
    let dir = tempfile::tempdir().unwrap();
    let config = SimConfig {
        grace: GRACE,
        listen_delay: Duration::from_millis(20),
        ..SimConfig::default()
    };
    let mut kubelet = Kubelet::start_with(dir.path(), config).await.unwrap();
    let host = Host::new(dir.path()).unwrap();
    host.add(RESOURCE, TestBackend::new(2)).unwrap();
    registrations(&host, RESOURCE, 1).await;
    let refusals = || host.metrics()[0].1.registration_failures;
    let mut took = Vec::new();
    let mut refused_rounds = 0;
    for round in 2..=6 {
        let before = refusals();
        let started = Instant::now();
        kubelet.restart().await.unwrap();
        registrations(&host, RESOURCE, round).await;
        took.push(started.elapsed());
        if refusals() > before {
            refused_rounds += 1;
        }
    }
    assert!(
        refused_rounds >= 3,
        "the simulator's bind→listen gap should refuse most first dials: {refused_rounds} of 5 rounds"
    );
    // The median, so that one round stalled by a loaded CI machine does not fail the test: the
    // old 100 ms first retry put every refused round above the line, and the count above
    // shows that most rounds were refused. A retry from 1 ms, doubling, lands at 20-35 ms.
    took.sort();
    let median = took[took.len() / 2];
    assert!(median < Duration::from_millis(90), "restarts took {took:?}");
    host.shutdown().await;
}

/// A kubelet down for a while (its stale kubelet.sock refusing every dial) grows the retry
/// delay; the new kubelet.sock must start the retries again from 1 ms.
#[tokio::test]
async fn a_new_kubelet_resets_the_delay_grown_while_it_was_down() {
    let (dir, mut kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add(RESOURCE, TestBackend::new(3)).unwrap();
    wait_capacity(&kubelet, RESOURCE, (3, 3)).await;

    kubelet.crash().await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let refused = host.metrics()[0].1.registration_failures;
    assert!(refused >= 5, "retries against the stale socket: {refused}");

    let started = Instant::now();
    kubelet.restart().await.unwrap();
    wait_capacity(&kubelet, RESOURCE, (3, 3)).await;
    let took = started.elapsed();
    // The delay grown while down is over a second by now; a reset retry takes milliseconds.
    assert!(
        took < Duration::from_millis(600),
        "registered again after {took:?}"
    );
    host.shutdown().await;
}

/// A rolling upgrade on kubelets up to 1.36: instance B registers while A still runs, then A
/// stops. The kubelet's end of A's stream disconnects B (the client it finds under the name):
/// B must register again at once, not after a second.
#[tokio::test]
async fn rolling_upgrade_old_instance_stopping_does_not_cut_off_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = Kubelet::start_with(
        dir.path(),
        SimConfig {
            grace: GRACE,
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let a = Host::new(dir.path()).unwrap();
    a.add(RESOURCE, TestBackend::new(4)).unwrap();
    registrations(&a, RESOURCE, 1).await;
    let b = Host::new(dir.path()).unwrap();
    b.add(RESOURCE, TestBackend::new(4)).unwrap();
    registrations(&b, RESOURCE, 1).await;
    let b_socket = plugin_socket(&b, RESOURCE);
    kubelet
        .wait_for(WAIT, |n| {
            (n.resource(RESOURCE)?.socket()? == &b_socket).then_some(())
        })
        .await
        .unwrap();

    let stopped = Instant::now();
    let report = a.shutdown().await;
    assert!(report.is_clean(), "{report:?}");
    // The simulator did what the kubelet does: B was cut off, and B registered again.
    registrations(&b, RESOURCE, 2).await;
    wait_capacity(&kubelet, RESOURCE, (4, 4)).await;
    let healed = stopped.elapsed();
    assert!(
        healed < Duration::from_millis(900),
        "allocatable came back after {healed:?} (the old 1 s delay)"
    );
    let b_again = kubelet.read(|n| n.resource(RESOURCE).and_then(|r| r.socket().cloned()));
    assert_eq!(b_again.as_ref(), Some(&b_socket));
    kubelet
        .allocate("pod", "main", RESOURCE, 2)
        .await
        .expect("B serves allocations after A stopped");
    b.shutdown().await;
}

#[tokio::test]
async fn a_list_over_the_kubelets_limit_makes_the_resource_not_ready() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    let backend = TestBackend::new(2);
    let mut status = host
        .add_shared(RESOURCE, std::sync::Arc::new(backend.clone()))
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (2, 2)).await;
    tokio::time::timeout(WAIT, status.wait_for(|s| s.is_ready()))
        .await
        .unwrap()
        .unwrap();

    // 80,000 ids of 60 characters: about 5.9 MB on the wire.
    let huge: Vec<Device> = (0..80_000)
        .map(|i| Device::new(format!("{i:060}")))
        .collect();
    backend.publish(huge);
    tokio::time::timeout(WAIT, status.wait_for(|s| s.list_error.is_some()))
        .await
        .unwrap()
        .unwrap();
    assert!(!status.borrow().is_ready());
    let metrics = &host.metrics()[0].1;
    let reason = metrics.not_ready.clone().unwrap();
    assert!(reason.contains("device list not sent"), "{reason}");
    assert!(
        reason.contains("4 MiB") || reason.contains("4194304"),
        "{reason}"
    );
    assert!(!host.is_ready());
    // The kubelet keeps the last list it got.
    assert_eq!(kubelet.read(|n| n.capacity(RESOURCE)), (2, 2));

    backend.publish(vec![Device::new("a")]);
    tokio::time::timeout(WAIT, status.wait_for(|s| s.is_ready()))
        .await
        .unwrap()
        .unwrap();
    wait_capacity(&kubelet, RESOURCE, (1, 1)).await;
    host.shutdown().await;
}

#[tokio::test]
async fn ten_thousand_unknown_ids_get_a_short_error() {
    let (dir, kubelet) = kubelet(GRACE).await;
    let host = Host::new(dir.path()).unwrap();
    host.add(RESOURCE, TestBackend::new(2)).unwrap();
    wait_capacity(&kubelet, RESOURCE, (2, 2)).await;
    let socket = plugin_socket(&host, RESOURCE);
    let mut client = DevicePluginClient::new(uds::connect(&socket, WAIT).await.unwrap());
    let ids: Vec<String> = (0..10_000).map(|i| format!("no-such-device-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let err = client
        .allocate(allocate_request(&refs))
        .await
        .expect_err("unknown ids are refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let message = err.message();
    assert!(message.len() < 400, "{} bytes: {message}", message.len());
    assert!(message.contains("\"no-such-device-0\""), "{message}");
    assert!(message.contains("and 9995 more"), "{message}");
    host.shutdown().await;
}
