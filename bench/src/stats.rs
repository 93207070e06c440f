//! What the simulated clients record: latency histograms (microseconds,
//! HdrHistogram), completion counts and times, shared by all workers of a
//! run behind one mutex and taken (and reset) per phase.

use std::{
    sync::{Mutex, OnceLock},
    time::Instant,
};

use hdrhistogram::Histogram;
use tokio::sync::Notify;

/// Microseconds since the first call in this process: the one clock every
/// submit time (carried in the job input) and receipt time is read from.
pub fn now_us() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// A histogram of microseconds from 1 µs to 10 minutes, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// Percentiles of a histogram, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Summary {
    /// Samples.
    pub count: u64,
    /// Median, ms.
    pub p50: f64,
    /// 99th percentile, ms.
    pub p99: f64,
    /// Largest, ms.
    pub max: f64,
}

impl Summary {
    /// The summary of `h` (microsecond samples).
    pub fn of(h: &Histogram<u64>) -> Summary {
        if h.is_empty() {
            return Summary::default();
        }
        Summary {
            count: h.len(),
            p50: h.value_at_quantile(0.50) as f64 / 1000.0,
            p99: h.value_at_quantile(0.99) as f64 / 1000.0,
            max: h.max() as f64 / 1000.0,
        }
    }
}

/// Everything recorded during one phase.
pub struct Record {
    /// Submit time (from the job input) to lease receipt on the worker.
    pub enqueue_to_lease: Histogram<u64>,
    /// Round trip of the completion report (UpdateJob / SET result).
    pub completion_ack: Histogram<u64>,
    /// From sending a completion to receiving the worker's next lease (a
    /// free slot refilled), for workers with one slot.
    pub slot_to_lease: Histogram<u64>,
    /// Heartbeat send to its acknowledgement.
    pub heartbeat_ack: Histogram<u64>,
    /// Leases received.
    pub leased: u64,
    /// Completions acknowledged.
    pub completed: u64,
    /// Failed calls (any RPC or Redis error) and the last one's text.
    pub errors: u64,
    /// The last error.
    pub last_error: Option<String>,
    /// [`now_us`] of the last acknowledged completion.
    pub last_done_us: u64,
    /// Completions at which [`Recorder::done`] fires.
    pub target: u64,
}

impl Default for Record {
    fn default() -> Self {
        Record {
            enqueue_to_lease: histogram(),
            completion_ack: histogram(),
            slot_to_lease: histogram(),
            heartbeat_ack: histogram(),
            leased: 0,
            completed: 0,
            errors: 0,
            last_error: None,
            last_done_us: 0,
            target: u64::MAX,
        }
    }
}

/// The shared recorder of a run.
#[derive(Default)]
pub struct Recorder {
    rec: Mutex<Record>,
    /// Fires when `completed` reaches `target`.
    pub done: Notify,
}

impl Recorder {
    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.rec.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a phase: clears everything and arms [`Recorder::done`] at
    /// `target` completions.
    pub fn reset(&self, target: u64) {
        let mut r = self.lock();
        *r = Record {
            target,
            ..Record::default()
        };
    }

    /// Takes the phase's record (and starts an empty one without a target).
    pub fn take(&self) -> Record {
        std::mem::take(&mut *self.lock())
    }

    /// Completions so far in this phase.
    pub fn completed(&self) -> u64 {
        self.lock().completed
    }

    /// A lease arrived `now` for a job submitted at `submitted_us`;
    /// `freed_us` is when this worker's slot was freed, if it has one slot.
    pub fn leased(&self, submitted_us: Option<u64>, freed_us: Option<u64>, now: u64) {
        let mut r = self.lock();
        r.leased += 1;
        if let Some(t) = submitted_us {
            let _ = r.enqueue_to_lease.record(now.saturating_sub(t).max(1));
        }
        if let Some(t) = freed_us {
            let _ = r.slot_to_lease.record(now.saturating_sub(t).max(1));
        }
    }

    /// A completion sent at `sent_us` was acknowledged `now`.
    pub fn completed_at(&self, sent_us: u64, now: u64) {
        let fire = {
            let mut r = self.lock();
            let _ = r.completion_ack.record(now.saturating_sub(sent_us).max(1));
            r.completed += 1;
            r.last_done_us = r.last_done_us.max(now);
            r.completed == r.target
        };
        if fire {
            self.done.notify_one();
        }
    }

    /// A heartbeat round trip.
    pub fn heartbeat(&self, rtt_us: u64) {
        let _ = self.lock().heartbeat_ack.record(rtt_us.max(1));
    }

    /// A failed call.
    pub fn error(&self, what: String) {
        let mut r = self.lock();
        r.errors += 1;
        r.last_error = Some(what);
    }
}
