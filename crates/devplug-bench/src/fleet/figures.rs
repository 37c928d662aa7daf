//! How the fleet's figures are measured and printed: the drivers' request count sampled over
//! time ([`Sampler`]), percentiles, rates, each phase's CPU use, and [`report`], which prints
//! one figure.

use super::api_count::ApiCount;
use super::metrics;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The drivers' request count sampled every 250 ms.
#[derive(Clone)]
pub struct Sampler {
    count: Arc<ApiCount>,
    samples: Arc<Mutex<Vec<(Instant, u64)>>>,
}

impl Sampler {
    pub(super) fn start(count: Arc<ApiCount>) -> (Sampler, tokio::task::JoinHandle<()>) {
        let sampler = Sampler {
            count,
            samples: Arc::new(Mutex::new(Vec::new())),
        };
        let s = sampler.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let value = s.count.get();
                if let Ok(mut v) = s.samples.lock() {
                    v.push((Instant::now(), value));
                }
            }
        });
        (sampler, task)
    }

    /// Requests so far.
    pub fn now(&self) -> u64 {
        self.count.get()
    }

    /// Records the count now, beside the 250 ms samples, and returns the instant: a phase
    /// marks its start and end, so that its peak counts every request it made even when it is
    /// shorter than the sampling period (else 24 requests in 0.2 s could peak at 0 in 1 s).
    pub fn mark(&self) -> Instant {
        let now = Instant::now();
        let value = self.count.get();
        if let Ok(mut v) = self.samples.lock() {
            v.push((now, value));
            // The ticks and the marks interleave; keep them in time order.
            v.sort_by_key(|(t, _)| *t);
        }
        now
    }

    /// The most requests in any 1 s window between `from` and `to` (give [`Sampler::mark`]s
    /// for both).
    pub fn peak_per_second(&self, from: Instant, to: Instant) -> u64 {
        let Ok(samples) = self.samples.lock() else {
            return 0;
        };
        let window: Vec<_> = samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .collect();
        let mut peak = 0;
        for (i, (t, c)) in window.iter().enumerate() {
            if let Some((_, later)) = window[i..]
                .iter()
                .take_while(|(u, _)| u.duration_since(*t) <= Duration::from_secs(1))
                .last()
            {
                peak = peak.max(later.saturating_sub(*c));
            }
        }
        peak
    }
}

/// The `q` quantile of `sorted` (not empty), nearest rank.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted.get(i).copied().unwrap_or_default()
}

/// p50/p90/p99/max of `samples`, formatted.
pub fn percentiles(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "no samples".to_owned();
    }
    samples.sort();
    let at = |q: f64| quantile(samples, q);
    format!(
        "n={} p50={} p90={} p99={} max={}",
        samples.len(),
        fmt(at(0.5)),
        fmt(at(0.9)),
        fmt(at(0.99)),
        fmt(at(1.0))
    )
}

/// p50, p90 and p99 of `samples`, each said within or over `threshold` (clusterloader2's pod
/// startup thresholds are one figure for all three).
pub(super) fn thresholds(samples: &mut [Duration], threshold: Duration) -> String {
    if samples.is_empty() {
        return "no samples".to_owned();
    }
    samples.sort();
    let parts: Vec<String> = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)]
        .into_iter()
        .map(|(name, q)| {
            let at = quantile(samples, q);
            let verdict = if at <= threshold { "within" } else { "OVER" };
            format!("{name} {} {verdict} {}", fmt(at), fmt(threshold))
        })
        .collect();
    parts.join(", ")
}

pub(super) fn fmt(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

/// Prints one figure.
pub fn report(what: &str, value: impl std::fmt::Display) {
    println!("{what}: {value}");
}

pub(super) fn rate(requests: u64, took: Duration) -> String {
    format!(
        "{:.1}/s ({requests} in {:.1} s)",
        requests as f64 / took.as_secs_f64().max(1e-3),
        took.as_secs_f64()
    )
}

/// CPU seconds of each process of the run's own control plane (in `dir`; none on an existing
/// cluster) and of this one, for a phase's CPU use.
pub(super) fn cpu_now(dir: Option<&std::path::Path>) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = dir
        .map(metrics::control_plane_processes)
        .unwrap_or_default()
        .into_iter()
        .map(|(name, (cpu, _))| (name, cpu))
        .collect();
    if let Some((cpu, _)) = metrics::process_usage("self") {
        out.push(("devplug-bench (drivers + stand-ins + workload)".into(), cpu));
    }
    out
}

pub(super) fn report_cpu(
    phase: &str,
    before: &[(String, f64)],
    after: &[(String, f64)],
    took: Duration,
) {
    let parts: Vec<String> = after
        .iter()
        .map(|(name, cpu)| {
            let was = before
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, c)| *c);
            format!(
                "{name} {:.0}%",
                (cpu - was) / took.as_secs_f64().max(1e-3) * 100.0
            )
        })
        .collect();
    report(
        &format!("CPU during {phase} (100% = one core)"),
        parts.join(", "),
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_phase_shorter_than_the_sampling_period_peaks_at_what_it_made() {
        let count = Arc::new(ApiCount::default());
        let (sampler, task) = Sampler::start(count.clone());
        tokio::time::sleep(Duration::from_millis(50)).await;
        let from = sampler.mark();
        count.add(24);
        let to = sampler.mark();
        task.abort();
        assert_eq!(sampler.now(), 24);
        assert_eq!(sampler.peak_per_second(from, to), 24);
    }

    #[test]
    fn thresholds_say_which_percentile_is_over() {
        let mut samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        samples[99] = Duration::from_secs(9);
        assert_eq!(
            thresholds(&mut samples, Duration::from_millis(90)),
            "p50 50.0 ms within 90.0 ms, p90 90.0 ms within 90.0 ms, p99 99.0 ms OVER 90.0 ms"
        );
        assert_eq!(thresholds(&mut [], Duration::from_secs(5)), "no samples");
    }
}
