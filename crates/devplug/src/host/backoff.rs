//! Retry delays: doubling from a first delay to a cap, optionally jittered.
//!
//! Registration's start at a millisecond: a Go kubelet creates `kubelet.sock` with `bind()` and
//! accepts only after `listen()`, so a plugin that dials the moment the file appears is often
//! refused once, and a first retry 100 ms later would make a kubelet restart cost 100 ms (a p90
//! of 102 ms was measured that way); a new kubelet starts the sequence again. Every writer to the
//! API server (advertised capacity, node labels, the admission-policy probes, the DRA driver's
//! ResourceSlices and its probe of a lost API server) jitters its own ([`Backoff::jittered`]):
//! every node's devplug loses an API server at once, and without jitter they would all come back
//! in step. Registration and the socket binds are not jittered: they wait for this node's kubelet
//! alone, which no other node's devplug asks, so a jitter would only delay them.

use std::time::Duration;

/// A doubling delay from `first` to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
    jitter: bool,
}

impl Backoff {
    /// Delays `first`, `2 × first`, … up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            next: first,
            jitter: false,
        }
    }

    /// The same, each delay spread over 75–125 % of itself ([`jittered`]).
    pub fn jittered(mut self) -> Self {
        self.jitter = true;
        self
    }

    /// The next delay; each call doubles the one after it, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        if self.jitter {
            jittered(delay)
        } else {
            delay
        }
    }

    /// Starts again from the first delay.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// Whether a delay was taken since the start or the last [`Backoff::reset`].
    pub fn backed_off(&self) -> bool {
        self.next > self.first
    }
}

/// `wait` spread over 75–125 % of itself, differently in each process and each time.
pub fn jittered(wait: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    // A fresh RandomState has keys of its own: an empty hash of it is a random number.
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let spread = (random % 1000) as f64 / 2000.0;
    wait.mul_f64(0.75 + spread)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(1), ms(10));
        let got: Vec<_> = (0..6).map(|_| b.next_delay()).collect();
        assert_eq!(got, [ms(1), ms(2), ms(4), ms(8), ms(10), ms(10)]);
        b.reset();
        assert_eq!(b.next_delay(), ms(1));
    }

    #[test]
    fn jittered_delays_stay_within_a_quarter_of_the_doubling() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(1000), ms(4000)).jittered();
        for want in [1000, 2000, 4000, 4000] {
            let got = b.next_delay();
            assert!(
                got >= ms(want * 3 / 4) && got <= ms(want * 5 / 4),
                "{got:?} for {want}"
            );
        }
    }
}
