//! Counters of a driver's `NodePrepareResources` and `NodeUnprepareResources` calls, as atomics
//! (the driver links no metrics library), read as a [`ClaimMetricsSnapshot`] by whoever exports
//! them: calls and their duration as a histogram, claims answered and claims answered with an
//! error, for each of the two operations.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds of the call duration buckets, in seconds: a call reads its claims from the API
/// server (up to [`crate::prepare::CLAIM_READ_DEADLINE`]) and may start a backend's helper, so
/// the range is wider than Allocate's.
pub const CLAIM_CALL_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0,
];

/// Live counters of one operation (prepare or unprepare).
#[derive(Debug, Default)]
pub struct OperationCounters {
    calls: AtomicU64,
    claims: AtomicU64,
    errors: AtomicU64,
    micros: AtomicU64,
    buckets: [AtomicU64; CLAIM_CALL_BUCKETS.len()],
}

impl OperationCounters {
    /// Records one call that took `took` and answered `claims` claims, `errors` of them with an
    /// error.
    pub fn record(&self, took: Duration, claims: usize, errors: usize) {
        self.calls.fetch_add(1, Relaxed);
        self.claims
            .fetch_add(u64::try_from(claims).unwrap_or(u64::MAX), Relaxed);
        self.errors
            .fetch_add(u64::try_from(errors).unwrap_or(u64::MAX), Relaxed);
        self.micros
            .fetch_add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX), Relaxed);
        let secs = took.as_secs_f64();
        if let Some(i) = CLAIM_CALL_BUCKETS.iter().position(|&le| secs <= le) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
    }

    /// A reading of the counters.
    pub fn snapshot(&self) -> OperationSnapshot {
        let mut cumulative = 0u64;
        let buckets = self
            .buckets
            .iter()
            .map(|b| {
                cumulative = cumulative.saturating_add(b.load(Relaxed));
                cumulative
            })
            .collect();
        OperationSnapshot {
            calls: self.calls.load(Relaxed),
            claims: self.claims.load(Relaxed),
            errors: self.errors.load(Relaxed),
            seconds: Duration::from_micros(self.micros.load(Relaxed)).as_secs_f64(),
            buckets,
        }
    }
}

/// A reading of one operation's counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OperationSnapshot {
    /// Calls answered.
    pub calls: u64,
    /// Claims answered, over all calls.
    pub claims: u64,
    /// Claims answered with an error.
    pub errors: u64,
    /// Time spent answering calls, in seconds.
    pub seconds: f64,
    /// Calls per duration bucket, cumulative as Prometheus expects, matching
    /// [`CLAIM_CALL_BUCKETS`].
    pub buckets: Vec<u64>,
}

/// The stages of a `NodePrepareResources` call, in order: the claims read from the API server
/// (with nothing locked), the wait for the driver's lock, the change (the backend, the CDI specs,
/// the state), and the checkpoint write it waited for (its own, or its group's).
pub const PREPARE_STAGES: [&str; 4] = ["read", "lock", "change", "write"];

/// Time spent in each stage of [`PREPARE_STAGES`] over all prepare calls, in microseconds.
#[derive(Debug, Default)]
pub struct StageCounters([AtomicU64; PREPARE_STAGES.len()]);

impl StageCounters {
    /// Adds one call's time in each stage, in [`PREPARE_STAGES`]' order.
    pub fn record(&self, stages: [Duration; PREPARE_STAGES.len()]) {
        for (sum, took) in self.0.iter().zip(stages) {
            sum.fetch_add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX), Relaxed);
        }
    }

    /// Seconds spent in each stage so far, in [`PREPARE_STAGES`]' order.
    pub fn snapshot(&self) -> [f64; PREPARE_STAGES.len()] {
        let mut out = [0.0; PREPARE_STAGES.len()];
        for (o, sum) in out.iter_mut().zip(&self.0) {
            *o = Duration::from_micros(sum.load(Relaxed)).as_secs_f64();
        }
        out
    }
}

/// Live counters of a driver's claim calls.
#[derive(Debug, Default)]
pub struct ClaimMetrics {
    /// `NodePrepareResources`.
    pub prepare: OperationCounters,
    /// `NodeUnprepareResources`.
    pub unprepare: OperationCounters,
    /// Where `NodePrepareResources` calls spent their time.
    pub prepare_stages: StageCounters,
}

/// A reading of a driver's claim calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimMetricsSnapshot {
    /// `NodePrepareResources`.
    pub prepare: OperationSnapshot,
    /// `NodeUnprepareResources`.
    pub unprepare: OperationSnapshot,
    /// Seconds `NodePrepareResources` calls spent in each of [`PREPARE_STAGES`].
    pub prepare_stages: [f64; PREPARE_STAGES.len()],
}

impl ClaimMetrics {
    /// A reading of both operations.
    pub fn snapshot(&self) -> ClaimMetricsSnapshot {
        ClaimMetricsSnapshot {
            prepare: self.prepare.snapshot(),
            unprepare: self.unprepare.snapshot(),
            prepare_stages: self.prepare_stages.snapshot(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_lands_in_its_bucket_and_every_one_above() {
        let ops = OperationCounters::default();
        ops.record(Duration::from_millis(20), 3, 1);
        ops.record(Duration::from_secs(60), 1, 0);
        let s = ops.snapshot();
        assert_eq!((s.calls, s.claims, s.errors), (2, 4, 1));
        let at = |le: f64| s.buckets[CLAIM_CALL_BUCKETS.iter().position(|&b| b == le).unwrap()];
        assert_eq!((at(0.01), at(0.025), at(30.0)), (0, 1, 1), "{s:?}");
        assert!((s.seconds - 60.02).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn each_stage_sums_its_own_time() {
        let stages = StageCounters::default();
        let ms = Duration::from_millis;
        stages.record([ms(3), ms(0), ms(1), ms(2)]);
        stages.record([ms(1), ms(5), ms(1), ms(2)]);
        let s = stages.snapshot();
        for (got, want) in s.iter().zip([0.004, 0.005, 0.002, 0.004]) {
            assert!((got - want).abs() < 1e-9, "{s:?}");
        }
    }
}
