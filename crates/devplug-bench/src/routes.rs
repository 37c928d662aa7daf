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
