//! The fleet simulator at CI size: 20 simulated nodes, each with devplug's real DRA driver and
//! a kubelet stand-in, against a real etcd, kube-apiserver, kube-controller-manager and
//! kube-scheduler; filled to 90% and churned for 30 s, every driver restarted in turn during
//! the churn (a rolling update). Asserts correctness only (every pod Running, every claim
//! prepared and unprepared exactly once, no ResourceSlice left after the drivers stop): `run`
//! returns an error when one of them does not hold. Timing goes to docs/benchmarks.md through
//! `devplug-bench fleet`, never into an assertion.

use devplug_bench::fleet::{self, FleetOptions};
use std::time::Duration;

#[cfg_attr(
    no_controller_manager,
    ignore = "needs the whole control plane: KUBEBUILDER_ASSETS naming a folder with etcd, \
              kube-apiserver, kube-scheduler and kube-controller-manager (envtest's assets lack \
              the last two; docs/testing.md says where they come from)"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_nodes_fill_and_churn_correctly() {
    let options = FleetOptions {
        churn: Duration::from_secs(30),
        idle: Duration::from_secs(2),
        rolling_restart: true,
        ..FleetOptions::new(20)
    };
    if let Err(err) = fleet::run(options).await {
        panic!("the fleet run failed: {err:#}");
    }
}
