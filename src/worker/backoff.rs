//! Exponential backoff with jitter for reconnects and retried updates.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff: `initial`, 2×, 4× … up to `max`, each delay scattered
/// by ±20 % so that a fleet of workers does not reconnect in lock-step.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// The worker's reconnect schedule: 1 s, 2 s, 4 s … at most 60 s.
    pub fn reconnect() -> Self {
        Self::new(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// A backoff starting at `initial` and doubling up to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max,
            next: initial,
        }
    }

    /// The nominal (un-jittered) delay the next call to [`Backoff::next_delay`]
    /// is based on.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// The next delay to wait (with jitter), doubling the nominal delay for
    /// the call after.
    pub fn next_delay(&mut self) -> Duration {
        let nominal = self.next;
        self.next = (self.next * 2).min(self.max);
        let factor = rand::rng().random_range(0.8..=1.2);
        nominal.mul_f64(factor).min(self.max)
    }

    /// Back to the initial delay (after a connection was established).
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_max_with_jitter() {
        let mut b = Backoff::reconnect();
        let nominal: Vec<u64> = (0..9)
            .map(|_| {
                let n = b.peek();
                let d = b.next_delay();
                assert!(d >= n.mul_f64(0.8) && d <= n.mul_f64(1.2).min(Duration::from_secs(60)));
                n.as_secs()
            })
            .collect();
        assert_eq!(nominal, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        b.reset();
        assert_eq!(b.peek(), Duration::from_secs(1));
    }
}
