//! The fleet's three modes, each named after the upstream test it is compared with, and what
//! each sets up: the control plane's client rates, the nodes' devices, how the workload comes.
//!
//! - `scheduler-perf`: the shape of scheduler_perf's `SchedulingWithResourceClaimTemplate`
//!   (500 nodes, 5,000 pods of one claim from a template each, the scheduler's client at 5,000
//!   requests a second and as many in a burst); every pod created at once; bound pods a second
//!   (what upstream measures, without a kubelet or driver) reported apart from Running pods a
//!   second (what devplug's drivers and the kubelet stand-ins add).
//! - `clusterloader2`: its DRA steady-state test: the control plane's default client rates, the
//!   fleet filled to 90% with long-running Jobs created at a paced rate, then short-lived Jobs
//!   at a steady rate; pod startup p50/p90/p99 against its 5 s thresholds.
//! - `driver`: no scheduler; the bench allocates each claim and binds each pod itself, in
//!   bursts of pods landing on one node at once: the driver and its node alone.

use std::time::Duration;

/// What a fleet run is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// scheduler_perf's DRA test shape: the scheduler at 5,000 QPS, every pod at once.
    SchedulerPerf,
    /// clusterloader2's DRA steady-state test: default client rates, paced fill, Job churn.
    Clusterloader2,
    /// The scheduler bypassed: bursts of pods on one node, devplug alone.
    Driver,
}

impl Mode {
    /// The name `--mode` takes.
    pub fn name(self) -> &'static str {
        match self {
            Mode::SchedulerPerf => "scheduler-perf",
            Mode::Clusterloader2 => "clusterloader2",
            Mode::Driver => "driver",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "scheduler-perf" => Ok(Mode::SchedulerPerf),
            "clusterloader2" => Ok(Mode::Clusterloader2),
            "driver" => Ok(Mode::Driver),
            other => Err(format!(
                "--mode {other:?}: give scheduler-perf, clusterloader2 or driver"
            )),
        }
    }
}

/// scheduler_perf's client rate for its in-process scheduler (QPS and burst alike).
pub const SCHEDULER_PERF_QPS: u32 = 5_000;

/// Claims a node holds in scheduler_perf's shape (5,000 pods on 500 nodes).
pub const SCHEDULER_PERF_DEVICES: usize = 10;

/// scheduler_perf's threshold for `SchedulingWithResourceClaimTemplate/5000pods_500nodes`, pods
/// bound a second: with the 1.36 scheduler (the one these runs use) and with 1.37's.
pub const SCHEDULER_PERF_THRESHOLD: (f64, f64) = (56.0, 120.0);

/// clusterloader2's DRA test: the fill's pace (`LOAD_TEST_THROUGHPUT`), the steady state's
/// (`STEADY_STATE_QPS`) and its Jobs' running time (`JOB_RUNNING_TIME`).
pub const CL2_FILL_RATE: f64 = 10.0;
/// See [`CL2_FILL_RATE`].
pub const CL2_CHURN_RATE: f64 = 5.0;
/// See [`CL2_FILL_RATE`].
pub const CL2_JOB_RUNNING: Duration = Duration::from_secs(30);

/// clusterloader2's pod startup thresholds (p50, p90 and p99 alike).
pub const CL2_STARTUP_THRESHOLD: Duration = Duration::from_secs(5);

/// Pods of one burst in the driver mode: every device of the node at once.
pub const DRIVER_BURST: usize = 8;
