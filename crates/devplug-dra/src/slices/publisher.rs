//! The publisher's handle: [`SlicePublisher`] starts the task (`event_loop`), shows what it
//! confirmed ([`Published`], [`SliceCounters`]) and, at shutdown, deletes the slices it
//! published ([`delete_slices`] does the same for a driver that is gone).

use super::reconcile::Run;
use super::shared::{selector, Published, SliceCounters, SliceError};
use super::validate::check_driver_name;
use devplug::DeviceList;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, ListParams};
use kube::Api;
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the publisher awaits before its first request to the API server: the proof that the
/// admission policy keeping a node's token to its own node's slices is in force (devplug's
/// command wires `devplug_cluster::policy_check`'s gate here). Until it returns, nothing is
/// read or written; the driver still serves the kubelet.
pub type WriteGate =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

/// How a publisher publishes, beyond its driver and node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SliceOptions {
    /// How long a device stays unhealthy before its taint turns from `NoSchedule` to
    /// `NoExecute` (pods using it that do not tolerate the taint are then evicted by the
    /// cluster's device taint controller); `None`: never.
    pub no_execute_after: Option<std::time::Duration>,
}

/// Deletes every ResourceSlice of `driver` on `node`; returns how many it deleted. One already
/// gone counts as deleted by someone else, not as an error. Needs `list` and `delete` on
/// `resourceslices`.
pub async fn delete_slices(
    client: kube::Client,
    driver: &str,
    node: &str,
) -> Result<usize, SliceError> {
    delete_all(&Api::all(client), driver, node).await
}

async fn delete_all(
    api: &Api<ResourceSlice>,
    driver: &str,
    node: &str,
) -> Result<usize, SliceError> {
    let err = |source| SliceError::Api {
        driver: driver.to_owned(),
        node: node.to_owned(),
        source,
    };
    let listed = api
        .list(&ListParams::default().fields(&selector(driver, node)))
        .await
        .map_err(err)?;
    let mut deleted = 0usize;
    for slice in listed.items {
        let Some(name) = slice.metadata.name else {
            continue;
        };
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => deleted = deleted.saturating_add(1),
            Err(kube::Error::Api(status)) if status.is_not_found() => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(deleted)
}

/// Publishes one backend's devices as the ResourceSlices of (driver, node) until stopped.
#[derive(Debug)]
pub struct SlicePublisher {
    api: Api<ResourceSlice>,
    driver: String,
    node: String,
    counters: Arc<SliceCounters>,
    published: watch::Receiver<Option<Published>>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl SlicePublisher {
    /// Starts publishing `devices` for `driver` on `node`. Stops when `stop` is cancelled or
    /// the publisher is dropped (the slices stay, for the next instance to adopt), or through
    /// [`SlicePublisher::stop`] (the slices stay too) or [`SlicePublisher::remove`] (the slices
    /// are deleted). Refuses a driver name the API
    /// server would refuse.
    pub fn spawn(
        client: kube::Client,
        driver: &str,
        node: &str,
        devices: watch::Receiver<DeviceList>,
        stop: &CancellationToken,
    ) -> Result<SlicePublisher, SliceError> {
        Self::spawn_with(client, driver, node, devices, stop, SliceOptions::default())
    }

    /// [`SlicePublisher::spawn`] with `options`.
    pub fn spawn_with(
        client: kube::Client,
        driver: &str,
        node: &str,
        devices: watch::Receiver<DeviceList>,
        stop: &CancellationToken,
        options: SliceOptions,
    ) -> Result<SlicePublisher, SliceError> {
        Self::spawn_gated(client, driver, node, devices, stop, options, None)
    }

    /// [`SlicePublisher::spawn_with`], the task first awaiting `gate` ([`WriteGate`]).
    pub fn spawn_gated(
        client: kube::Client,
        driver: &str,
        node: &str,
        devices: watch::Receiver<DeviceList>,
        stop: &CancellationToken,
        options: SliceOptions,
        gate: Option<WriteGate>,
    ) -> Result<SlicePublisher, SliceError> {
        check_driver_name(driver)?;
        let stop = stop.child_token();
        let counters = Arc::new(SliceCounters::default());
        let (published_tx, published) = watch::channel(None);
        let run = Run::new(
            Api::all(client.clone()),
            driver,
            node,
            counters.clone(),
            published_tx,
            options.no_execute_after,
        );
        let task = tokio::spawn(run.run(client.clone(), devices, stop.clone(), gate));
        Ok(SlicePublisher {
            api: Api::all(client),
            driver: driver.to_owned(),
            node: node.to_owned(),
            counters,
            published,
            stop,
            task: Some(task),
        })
    }

    /// The counters.
    pub fn counters(&self) -> &SliceCounters {
        &self.counters
    }

    /// The counters, shared (for a view that outlives this borrow).
    pub fn shared_counters(&self) -> Arc<SliceCounters> {
        self.counters.clone()
    }

    /// What the API server holds, as last confirmed (`None` until the first publish).
    pub fn published(&self) -> watch::Receiver<Option<Published>> {
        self.published.clone()
    }

    /// Waits until the slices show `list` (compared by content), e.g. the list a test or a
    /// benchmark just sent; `None` if the publisher stopped first.
    pub async fn wait_published(&self, list: &DeviceList) -> Option<Published> {
        let mut rx = self.published.clone();
        let result = rx
            .wait_for(|p| p.as_ref().is_some_and(|p| p.list == *list))
            .await
            .ok()?
            .clone();
        result
    }

    /// Stops publishing and keeps this driver's slices of the node, as upstream's kubelet-plugin
    /// helper does: a driver that comes back (a restart, a rolling update) finds them and
    /// publishes over them, so the scheduler never sees the node without its devices; one that
    /// does not is cleaned up by the kubelet, which wipes a gone driver's slices 30 s after it
    /// unregistered (`defaultWipingDelay`, pkg/kubelet/cm/dra).
    pub async fn stop(mut self) {
        self.stop_task().await;
        tracing::info!(driver = %self.driver, node = %self.node, "stopped publishing; ResourceSlices kept for the next start");
    }

    /// Stops publishing and deletes this driver's slices of the node (the driver is gone for
    /// good: its resource left the config); returns how many were deleted.
    pub async fn remove(mut self) -> Result<usize, SliceError> {
        self.stop_task().await;
        let deleted = delete_all(&self.api, &self.driver, &self.node).await?;
        tracing::info!(driver = %self.driver, node = %self.node, deleted, "ResourceSlices removed");
        Ok(deleted)
    }

    /// Stops the publishing task and waits for it.
    async fn stop_task(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            if let Err(err) = task.await {
                tracing::warn!(driver = %self.driver, node = %self.node, %err, "the slice publisher task failed");
            }
        }
    }
}

impl Drop for SlicePublisher {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
