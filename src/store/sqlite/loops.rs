//! The SQLite engine's background loops: the reaper (stale workers,
//! dropped streams past their grace, expired leases, due jobs), the
//! retention sweeper, the store-health gauge, and the refresh of the
//! gauges served by `/metrics`.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{watch, Notify};

use super::{
    sql::{self, retention},
    state::State,
    writer::Writer,
};
use crate::{
    config::EngineConfig,
    core::model::{JobStatus, QueueStats, WorkerState},
    error::Error,
    metrics::{PoolLabel, QueueLabel, SharedMetrics, StatusLabel, WorkerLabel},
    time::now_ms,
};

/// Starts the loops on the current runtime; they end when `stop` turns
/// true (or the writer stops). `up` follows the store's health into the
/// `store_up` gauge.
pub(super) fn start(
    writer: &Writer<State>,
    cfg: &EngineConfig,
    mut up: watch::Receiver<bool>,
    store_up: Gauge,
    schedules_changed: Arc<Notify>,
    stop: watch::Receiver<bool>,
) {
    let mut stop_gauge = stop.clone();
    tokio::spawn(async move {
        loop {
            store_up.set(i64::from(*up.borrow_and_update()));
            tokio::select! {
                r = up.changed() => if r.is_err() { return },
                _ = stop_gauge.changed() => return,
            }
        }
    });
    if let Some(retention) = cfg.job_retention {
        tokio::spawn(retention_sweeper(writer.clone(), retention, stop.clone()));
    }
    tokio::spawn(schedule_loop(
        writer.clone(),
        schedules_changed,
        stop.clone(),
    ));
    tokio::spawn(reaper(writer.clone(), tick_period(cfg), stop));
}

/// Longest the schedule loop sleeps without looking at the schedules again.
const SCHEDULE_POLL: Duration = Duration::from_secs(60);

/// The schedule loop: sleeps until the soonest tick of an active schedule
/// (or a change of the schedules, or [`SCHEDULE_POLL`]), then fires what is
/// due ([`State::fire_schedules`]) in one operation.
async fn schedule_loop(
    writer: Writer<State>,
    changed: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let next = match writer.run(|_, c| sql::schedules::next_due(c)).await {
            Ok(n) => n,
            Err(Error::Unavailable) => return,
            Err(e) => {
                tracing::warn!(error = %e, "reading the next schedule tick failed");
                Some(now_ms() + 1000)
            }
        };
        let wait = match next {
            Some(t) => Duration::from_millis(u64::try_from(t - now_ms()).unwrap_or(0)),
            None => SCHEDULE_POLL,
        };
        tokio::select! {
            _ = tokio::time::sleep(wait.min(SCHEDULE_POLL)) => {}
            _ = changed.notified() => continue,
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        match writer.write(|s, c| s.fire_schedules(c, now_ms())).await {
            Ok(_) => {}
            Err(Error::Unavailable) => return,
            Err(e) => {
                tracing::warn!(error = %e, "firing schedules failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// How often the reaper runs: a tenth of the heartbeat interval or of the
/// grace, between 10 ms and 1 s.
fn tick_period(cfg: &EngineConfig) -> Duration {
    let base = cfg.heartbeat_interval.min(if cfg.lease_grace.is_zero() {
        cfg.heartbeat_interval
    } else {
        cfg.lease_grace
    });
    (base / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Sets the gauges of `/metrics` from a snapshot: jobs by status
/// (`counts`, keyed by the stored status value), queue depths, and
/// workers by (state, fresh). A status missing from `counts` has no job
/// (its gauge is set to 0), or, with `missing_unknown`, is still being
/// counted (its gauge is left as it is).
pub(crate) fn refresh_gauges(
    m: &SharedMetrics,
    counts: &HashMap<i32, i64>,
    queue: &QueueStats,
    workers: &HashMap<(WorkerState, bool), i64>,
    missing_unknown: bool,
) {
    for status in JobStatus::ALL {
        let n = match counts.get(&(status as i32)) {
            Some(&n) => n,
            // Not counted yet: the gauge keeps its value (unset after a start).
            None if missing_unknown => continue,
            None => 0,
        };
        m.jobs
            .get_or_create(&StatusLabel {
                status: status.name().into(),
            })
            .set(n);
    }
    for (name, depth) in [
        ("ready", queue.ready_length),
        ("scheduled", queue.scheduled_length),
        ("running", queue.running_length),
    ] {
        m.queue_length
            .get_or_create(&QueueLabel { queue: name.into() })
            .set(depth as i64);
    }
    m.pool_queue_length.clear();
    for pool in &queue.by_pool {
        for (name, n) in [
            ("ready", pool.depths.ready),
            ("scheduled", pool.depths.scheduled),
            ("running", pool.depths.running),
        ] {
            m.pool_queue_length
                .get_or_create(&PoolLabel {
                    queue: name.into(),
                    worker_selector: pool.worker_selector.clone(),
                })
                .set(n as i64);
        }
    }
    m.workers_active.set(i64::from(queue.workers_active));
    m.workers_idle.set(i64::from(queue.workers_idle));
    m.workers.clear();
    for state in WorkerState::ALL {
        for fresh in [true, false] {
            let n = workers.get(&(state, fresh)).copied().unwrap_or(0);
            m.workers
                .get_or_create(&WorkerLabel {
                    state: state.name().to_lowercase(),
                    fresh: fresh.to_string(),
                })
                .set(n);
        }
    }
}

/// Most jobs one retention operation deletes: it holds the single writer
/// for a few milliseconds; the sweeper queues the next one after it.
const EXPIRE_CHUNK: usize = 100;

/// The retention loop: every tenth of `retention` (between 100 ms and
/// 1 minute) deletes the actions finished longer than `retention` ago, in
/// operations of at most [`EXPIRE_CHUNK`] jobs, each queued once the one
/// before it committed so other work runs in between; then gives free
/// pages beyond the slack back to the file system
/// ([`retention::vacuum_some`]).
async fn retention_sweeper(
    writer: Writer<State>,
    retention: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let period = (retention / 10).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.changed() => return,
        }
        let cutoff_ms = now_ms().saturating_sub(retention_ms);
        let mut expired = 0;
        loop {
            if *stop.borrow() {
                return;
            }
            match writer
                .write_direct_rows(EXPIRE_CHUNK, move |s, c| {
                    s.expire_finished(c, cutoff_ms, EXPIRE_CHUNK)
                })
                .await
            {
                Ok(0) => break,
                Ok(n) => expired += n,
                Err(Error::Unavailable) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "retention sweep failed");
                    break;
                }
            }
        }
        if expired > 0 {
            tracing::debug!(expired, "retention sweep deleted finished jobs and actions");
            loop {
                match writer.write_direct(|_, c| retention::vacuum_some(c)).await {
                    Ok(n) if n >= retention::VACUUM_MAX_PAGES => {}
                    Ok(_) | Err(Error::Unavailable) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "incremental vacuum failed");
                        break;
                    }
                }
            }
        }
    }
}

/// The reaper loop: runs [`State::tick`] every `period` until stopped.
async fn reaper(writer: Writer<State>, period: Duration, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {
                let (queued, queued_ms) = (Instant::now(), now_ms());
                if !writer.submit(move |s, c| s.tick(c, queued, queued_ms)) {
                    return;
                }
            }
            _ = stop.changed() => return,
        }
    }
}
