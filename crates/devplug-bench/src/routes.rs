//! Kubelet restart → devices streaming again, by registration route: `kubelet.sock` (the plugin
//! re-binds in `device-plugins/` and calls Register) against the plugin watcher (the new kubelet
//! finds the registration socket in `plugins_registry/` by its walk and dials the plugin socket,
//! which it did not delete). Timed from the start of the simulated restart (every socket in
//! `device-plugins/` deleted, a new kubelet.sock) until the kubelet holds the full device list
//! from a new connection. The simulator's watcher reconciler runs every 1 s, as the kubelet's.

use crate::{print_row, WAIT};
use devplug::{Host, Registration, ResourceSettings};
use devplug_backends::{VirtualBackend, VirtualSettings};
use kubelet_sim::{Kubelet, SimConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RESOURCE: &str = "bench.example/route";
const DEVICES: usize = 100;

/// Prints one row per route.
pub(crate) async fn restart_by_route(rounds: usize) -> anyhow::Result<()> {
    for (label, registration) in [
        ("kubelet.sock", Registration::Socket),
        ("plugin watcher", Registration::Watcher),
    ] {
        let root = tempfile::tempdir()?;
        let dp = root.path().join("device-plugins");
        let config = SimConfig::default().with_watcher_beside(&dp);
        let mut kubelet = Kubelet::start_with(&dp, config).await?;
        let host = Host::new(&dp)?;
        let backend = Arc::new(VirtualBackend::new(&VirtualSettings::new(DEVICES))?);
        let settings = ResourceSettings {
            health_hold_down: Duration::ZERO,
            registration,
            ..Default::default()
        };
        host.add_with(RESOURCE, backend, settings)?;
        kubelet
            .wait_for(WAIT, |n| {
                (n.capacity(RESOURCE) == (DEVICES, DEVICES)).then_some(())
            })
            .await?;
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let before = kubelet.read(|n| n.resource(RESOURCE).map_or(0, |r| r.connections()));
            let t = Instant::now();
            kubelet.restart().await?;
            kubelet
                .wait_for(WAIT, |n| {
                    let r = n.resource(RESOURCE)?;
                    (r.connections() > before && r.is_connected() && r.allocatable() == DEVICES)
                        .then_some(())
                })
                .await?;
            samples.push(t.elapsed());
        }
        print_row(
            &format!("kubelet restart → {DEVICES} devices streaming again, {label} route"),
            &mut samples,
        );
        host.shutdown().await;
    }
    Ok(())
}

/// One PodResources `List` and one `GetAllocatableResources`, over the simulator's socket, on a
/// node with 1,000 devices of which 500 are held by 250 pods (2 each, NUMA topology on 2
/// nodes). Calls are 12 ms apart to stay under the kubelet's 100 per second.
pub(crate) async fn pod_resources_cost() -> anyhow::Result<()> {
    use devplug::podresources::PodResourcesClient;
    use prost::Message;
    let root = tempfile::tempdir()?;
    let dp = root.path().join("device-plugins");
    let config = SimConfig::default().with_pod_resources_beside(&dp);
    let kubelet = Kubelet::start_with(&dp, config).await?;
    let host = Host::new(&dp)?;
    let settings = VirtualSettings {
        numa_nodes: 2,
        ..VirtualSettings::new(1000)
    };
    host.add_with(
        RESOURCE,
        Arc::new(VirtualBackend::new(&settings)?),
        ResourceSettings {
            health_hold_down: Duration::ZERO,
            ..Default::default()
        },
    )?;
    kubelet
        .wait_for(WAIT, |n| {
            (n.capacity(RESOURCE) == (1000, 1000)).then_some(())
        })
        .await?;
    for pod in 0..250 {
        kubelet
            .allocate(&format!("bench/pod-{pod}"), "main", RESOURCE, 2)
            .await?;
    }
    let socket = kubelet
        .pod_resources_socket()
        .ok_or_else(|| anyhow::anyhow!("no pod resources socket"))?
        .to_owned();
    let mut client = PodResourcesClient::connect(&socket, WAIT)
        .await?
        .with_interval(Duration::ZERO);
    let mut list = Vec::new();
    let mut allocatable = Vec::new();
    let mut list_bytes = 0;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(12)).await;
        let t = Instant::now();
        let answer = client.list().await?;
        list.push(t.elapsed());
        list_bytes = answer.encoded_len();
        tokio::time::sleep(Duration::from_millis(12)).await;
        let t = Instant::now();
        client.allocatable().await?;
        allocatable.push(t.elapsed());
    }
    print_row(
        &format!("PodResources List, 250 pods / 500 devices ({list_bytes} bytes)"),
        &mut list,
    );
    print_row(
        "PodResources GetAllocatableResources, 1,000 devices",
        &mut allocatable,
    );
    host.shutdown().await;
    Ok(())
}
