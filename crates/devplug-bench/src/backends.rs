//! Benchmarks of the event-driven backends through the simulator: a file created until the
//! kubelet sees it, and a burst of 100 hotplugged device nodes until the list settles.

use crate::{print_row, WAIT};
use devplug::{Host, ResourceSettings};
use devplug_backends::hostdev::GroupSettings;
use devplug_backends::{FilesBackend, FilesSettings, HostdevBackend, HostdevSettings};
use kubelet_sim::Kubelet;
use std::sync::Arc;
use std::time::{Duration, Instant};

const RESOURCE: &str = "bench.example/backend";

/// A simulated kubelet in `plugins` and a host serving `backend` as `resource` with no hold-down,
/// once the kubelet has the first list (so it is not counted as an update later).
pub(crate) async fn serve(
    resource: &str,
    backend: Arc<dyn devplug::Backend>,
    plugins: &std::path::Path,
) -> anyhow::Result<(Kubelet, Host)> {
    let kubelet = Kubelet::start(plugins).await?;
    let host = Host::new(plugins)?;
    let settings = ResourceSettings {
        health_hold_down: Duration::ZERO,
        ..Default::default()
    };
    host.add_with(resource, backend, settings)?;
    kubelet
        .wait_for(WAIT, |n| {
            // Connected and the first list received, so it is not counted as an update later.
            let r = n.resource(resource)?;
            (r.is_connected() && r.updates() >= 1).then_some(())
        })
        .await?;
    Ok((kubelet, host))
}

/// One file created at a time, 1,000 times, each until the kubelet lists it.
pub async fn file_created() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("devices");
    std::fs::create_dir(&dir)?;
    let backend = Arc::new(FilesBackend::start(&FilesSettings::new(&dir))?);
    let (kubelet, host) = serve(RESOURCE, backend, &tmp.path().join("plugins")).await?;
    let mut samples = Vec::with_capacity(1000);
    for i in 0..1000 {
        let name = format!("dev-{i}");
        let t = Instant::now();
        std::fs::write(dir.join(&name), "")?;
        kubelet
            .wait_for(WAIT, |n| {
                n.resource(RESOURCE)?.devices().get(&name).map(|_| ())
            })
            .await?;
        samples.push(t.elapsed());
    }
    print_row(
        "files: file created → seen by the kubelet (folder grows to 1,000)",
        &mut samples,
    );
    host.shutdown().await;
    Ok(())
}

/// 100 device nodes appear as fast as the file system allows; counts the lists the kubelet got.
pub async fn hotplug_burst() -> anyhow::Result<()> {
    let mut settle = Vec::new();
    let mut updates = Vec::new();
    for _ in 0..20 {
        let tmp = tempfile::tempdir()?;
        let dev = tmp.path().join("dev");
        std::fs::create_dir_all(tmp.path().join("sys"))?;
        std::fs::create_dir(&dev)?;
        let group = GroupSettings {
            paths: vec!["/dev/ttyUSB*".into()],
            ..Default::default()
        };
        let settings = HostdevSettings {
            dev_root: dev.clone(),
            sys_root: tmp.path().join("sys"),
            ..HostdevSettings::new(vec![group])
        };
        let backend = Arc::new(HostdevBackend::start(&settings)?);
        let (kubelet, host) = serve(RESOURCE, backend, &tmp.path().join("plugins")).await?;
        let before = kubelet.read(|n| n.resource(RESOURCE).map_or(0, |r| r.updates()));
        let t = Instant::now();
        for i in 0..100 {
            std::fs::write(dev.join(format!("ttyUSB{i}")), "")?;
        }
        kubelet
            .wait_for(WAIT, |n| (n.capacity(RESOURCE).0 == 100).then_some(()))
            .await?;
        settle.push(t.elapsed());
        // Anything still coming would be a second update for the same burst.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = kubelet.read(|n| n.resource(RESOURCE).map_or(0, |r| r.updates()));
        updates.push(after - before);
        host.shutdown().await;
    }
    print_row(
        "hostdev: burst of 100 nodes → all seen by the kubelet (20 bursts)",
        &mut settle,
    );
    let max = updates.iter().max().copied().unwrap_or(0);
    let total: u64 = updates.iter().sum();
    println!(
        "| hostdev: ListAndWatch updates per burst of 100 nodes | 20 | {:.1} mean | | {max} |",
        total as f64 / 20.0
    );
    Ok(())
}
