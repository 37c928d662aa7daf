//! The fleet simulator at CI size, once in each mode: 20 simulated nodes, each with devplug's
//! real DRA driver and a kubelet stand-in, against a real etcd, kube-apiserver,
//! kube-controller-manager and (but in the driver mode) kube-scheduler.
//!
//! - scheduler-perf: 80 pods (4 a node) created at once, the scheduler at 5,000 QPS;
//! - clusterloader2: the control plane's default client rates, the fleet filled to 90% with
//!   Jobs at 10 a second, then 30 s of short-lived Jobs (5 a second, each pod running 2 s, so
//!   that they fit the 10% left free), every driver restarted in turn during it (a rolling
//!   update);
//! - driver: no scheduler, 20 bursts of 8 pods, each on its own node, allocated and bound by
//!   the bench.
//!
//! Asserts correctness only (every pod Running, every claim prepared and unprepared exactly
//! once, no ResourceSlice left after the drivers stop): `run` returns an error when one of
//! them does not hold. Timing goes to docs/benchmarks.md through `devplug-bench fleet`, never
//! into an assertion. The three runs take turns: each starts a control plane of its own, and
//! two at once would share this machine's cores.

use devplug_bench::fleet::{self, FleetOptions, Mode};
use std::time::Duration;

/// One run at a time.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run(options: FleetOptions) {
    let _turn = TURN.lock().await;
    let mode = options.mode.name();
    if let Err(err) = fleet::run(options).await {
        panic!("the fleet run in the {mode} mode failed: {err:#}");
    }
}

#[cfg_attr(
    no_controller_manager,
    ignore = "needs the whole control plane: KUBEBUILDER_ASSETS naming a folder with etcd, \
              kube-apiserver, kube-scheduler and kube-controller-manager (envtest's assets lack \
              the last two; docs/testing.md says where they come from)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_perf_mode_binds_and_runs_every_pod() {
    run(FleetOptions {
        idle: Duration::from_secs(2),
        // 80 pods: kube-controller-manager 1.36's ResourceClaim controller can make a second
        // claim for a pod when over 100 claims it made are not yet in its informer (its cache
        // of recent creations holds 100), which a burst of pods on this machine can reach; the
        // pod then never runs. The bench's larger runs say so when it happens.
        devices: 4,
        ..FleetOptions::new(Mode::SchedulerPerf, 20)
    })
    .await;
}

#[cfg_attr(
    no_controller_manager,
    ignore = "needs the whole control plane: KUBEBUILDER_ASSETS naming a folder with etcd, \
              kube-apiserver, kube-scheduler and kube-controller-manager (envtest's assets lack \
              the last two; docs/testing.md says where they come from)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusterloader2_mode_fills_and_churns_jobs_through_a_rolling_restart() {
    run(FleetOptions {
        churn: Duration::from_secs(30),
        job_running: Duration::from_secs(2),
        idle: Duration::from_secs(2),
        rolling_restart: true,
        ..FleetOptions::new(Mode::Clusterloader2, 20)
    })
    .await;
}

#[cfg_attr(
    no_controller_manager,
    ignore = "needs the whole control plane: KUBEBUILDER_ASSETS naming a folder with etcd, \
              kube-apiserver, kube-scheduler and kube-controller-manager (envtest's assets lack \
              the last two; docs/testing.md says where they come from)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_mode_prepares_every_burst() {
    run(FleetOptions {
        idle: Duration::from_secs(2),
        ..FleetOptions::new(Mode::Driver, 20)
    })
    .await;
}

#[cfg_attr(
    no_controller_manager,
    ignore = "needs the whole control plane: KUBEBUILDER_ASSETS naming a folder with etcd, \
              kube-apiserver, kube-scheduler and kube-controller-manager (envtest's assets lack \
              the last two; docs/testing.md says where they come from)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_share_an_existing_cluster_and_leave_nothing_behind() {
    let _turn = TURN.lock().await;
    // The cluster the shards find: started here, as a user's would be running already.
    let plane = fleet::start_plane(None, true).await.expect("control plane");
    let kubeconfig = plane
        .plane
        .as_ref()
        .expect("the plane's API server")
        .server()
        .kubeconfig
        .clone();
    let shard = |index: usize| FleetOptions {
        kubeconfig: Some(kubeconfig.clone()),
        shard: Some(fleet::Shard { index, count: 2 }),
        churn: Duration::from_secs(10),
        job_running: Duration::from_secs(1),
        idle: Duration::from_secs(1),
        ..FleetOptions::new(Mode::Clusterloader2, 8)
    };
    let (first, second) = tokio::join!(fleet::run(shard(0)), fleet::run(shard(1)));
    if let Err(err) = first.and(second) {
        panic!("a shard failed: {err:#}");
    }
    // Each shard removed its own Nodes; nothing of the run is left.
    let admin = devplug_testkit::api_server::client(&kubeconfig)
        .await
        .expect("client");
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(admin);
    let left = nodes
        .list_metadata(&Default::default())
        .await
        .expect("list Nodes")
        .items
        .len();
    assert_eq!(left, 0, "simulated Nodes left in the cluster");
}
