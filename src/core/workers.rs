//! Worker lifecycle in the core: registration, heartbeat and lease streams,
//! drain, unregister, and the reaper tick that catches stale workers,
//! dropped streams past their grace, expired leases and due jobs.

use std::{collections::HashSet, time::Instant};

use rusqlite::Connection;
use tonic::Status;

use super::state::{Effect, State, StreamSlot, StreamTx, WorkerEntry};
use crate::{
    error::{Error, Result},
    pb::{self, WorkerState},
    store::{self, workers as wstore},
    time::ts,
};

/// How long a DEAD or UNREGISTERED worker stays listed: 24 hours, in ms.
pub const DEPARTED_RETENTION_MS: i64 = 24 * 3600 * 1000;

/// Which stream of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// The bidirectional Heartbeat stream.
    Heartbeat,
    /// The LeaseJobs server stream.
    Lease,
}

impl State {
    fn live_worker(&self, id: &str) -> Result<&WorkerEntry> {
        let w = self
            .workers
            .get(id)
            .ok_or_else(|| Error::not_found(format!("worker {id} is not registered")))?;
        match w.state {
            WorkerState::Active | WorkerState::Draining => Ok(w),
            s => Err(Error::precondition(format!(
                "worker {id} is {}; register it again",
                state_name(s)
            ))),
        }
    }

    /// Registers a validated worker (seed: WORKER.REGISTER). One live
    /// process per worker id, told apart by `instance_id`:
    /// - the id is new, DEAD or UNREGISTERED: registered;
    /// - the same instance registers again while ACTIVE or DRAINING: it
    ///   resumes, nothing changes (its leases and streams are kept);
    /// - another instance while the current one is fresh and its heartbeat
    ///   stream open: refused;
    /// - another instance while the current one is stale or its heartbeat
    ///   stream gone: it takes over; the leases of the old instance (a
    ///   process that is gone) are re-queued and its streams ended.
    ///
    /// Returns true when it resumed.
    ///
    /// Errors: `AlreadyExists` while another live instance holds the id
    /// (or, for a request without `instance_id`, while the id is ACTIVE or
    /// DRAINING); storage errors.
    pub fn register(&mut self, conn: &Connection, req: pb::RegisterWorkerRequest) -> Result<bool> {
        if let Some(w) = self.workers.get(&req.worker_id) {
            if matches!(w.state, WorkerState::Active | WorkerState::Draining) {
                let current = w.info.instance_id.clone();
                if req.instance_id.is_empty() || current.is_empty() {
                    return Err(Error::AlreadyExists(format!(
                        "worker {} is already registered and {}",
                        req.worker_id,
                        state_name(w.state)
                    )));
                }
                if current == req.instance_id {
                    return Ok(true);
                }
                let now = Instant::now();
                let connected = w.heartbeat.as_ref().is_some_and(|h| !h.tx.is_closed());
                if self.is_fresh(w, now) && connected {
                    let ago = now.saturating_duration_since(w.last_heartbeat);
                    return Err(Error::AlreadyExists(format!(
                        "worker {} is already run by another live agw process (instance {current}, \
                         hostname {:?}, last heartbeat {:.1} s ago); stop that process or give \
                         this one another worker id",
                        req.worker_id,
                        w.info.hostname,
                        ago.as_secs_f64()
                    )));
                }
                let n = self.lose_all(
                    conn,
                    &req.worker_id,
                    "its worker process was replaced by a new instance",
                    "takeover",
                )?;
                self.hang_up(
                    &req.worker_id,
                    "another instance of this worker id took over; this process must stop",
                );
                tracing::info!(
                    worker_id = %req.worker_id,
                    old_instance = %current,
                    new_instance = %req.instance_id,
                    requeued = n,
                    "a new instance took over a worker whose process is gone"
                );
            }
        }
        let now_ms = store::now_ms();
        let info = pb::Worker {
            worker_id: req.worker_id.clone(),
            hostname: req.hostname,
            platform: req.platform,
            agw_version: req.agw_version,
            capabilities: req.capabilities,
            max_concurrent_jobs: req.max_concurrent_jobs,
            tags: req.tags,
            state: WorkerState::Active as i32,
            sandboxed: req.sandboxed,
            instance_id: req.instance_id,
            ..Default::default()
        };
        wstore::upsert(conn, &info, now_ms)?;
        let tools: HashSet<String> = info
            .capabilities
            .as_ref()
            .map(|c| c.tools.iter().cloned().collect())
            .unwrap_or_default();
        let entry = WorkerEntry {
            max: info.max_concurrent_jobs.max(1),
            info,
            state: WorkerState::Active,
            tools,
            leases: Default::default(),
            last_heartbeat: Instant::now(),
            last_heartbeat_ms: now_ms,
            flushed_heartbeat_ms: now_ms,
            stats: Default::default(),
            heartbeat: None,
            lease_stream: None,
            suspect_since: None,
            registered_at_ms: now_ms,
            avail_key: None,
            last_lease_seq: 0,
        };
        if let Some(old) = self.workers.insert(req.worker_id.clone(), entry) {
            if let Some((load, seq)) = old.avail_key {
                self.available.remove(&(load, seq, req.worker_id.clone()));
            }
        }
        self.refresh_available(&req.worker_id);
        tracing::info!(worker_id = %req.worker_id, "worker registered");
        Ok(false)
    }

    /// Attaches a newly opened stream to the worker, replacing an older one
    /// of the same kind. Returns the stream's id.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED).
    pub fn open_heartbeat(&mut self, id: &str, tx: StreamTx<pb::HeartbeatResponse>) -> Result<u64> {
        self.live_worker(id)?;
        let sid = self.next_stream_id;
        self.next_stream_id += 1;
        if let Some(w) = self.workers.get_mut(id) {
            w.heartbeat = Some(StreamSlot { id: sid, tx });
        }
        Ok(sid)
    }

    /// Attaches a newly opened lease stream, replacing an older one.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED).
    pub fn open_lease_stream(&mut self, id: &str, tx: StreamTx<pb::JobLease>) -> Result<u64> {
        self.live_worker(id)?;
        let sid = self.next_stream_id;
        self.next_stream_id += 1;
        if let Some(w) = self.workers.get_mut(id) {
            w.lease_stream = Some(StreamSlot { id: sid, tx });
        }
        self.refresh_available(id);
        Ok(sid)
    }

    /// A stream of the worker ended. A dropped heartbeat stream makes the
    /// worker suspect: its leases return to pending after the grace period
    /// (at once when the grace is zero) unless it comes back.
    ///
    /// Errors: storage errors.
    pub fn close_stream(
        &mut self,
        conn: &Connection,
        id: &str,
        kind: StreamKind,
        sid: u64,
    ) -> Result<()> {
        let Some(w) = self.workers.get_mut(id) else {
            return Ok(());
        };
        match kind {
            StreamKind::Lease => {
                if w.lease_stream.as_ref().is_some_and(|s| s.id == sid) {
                    w.lease_stream = None;
                }
                self.refresh_available(id);
            }
            StreamKind::Heartbeat => {
                if w.heartbeat.as_ref().is_none_or(|s| s.id != sid) {
                    return Ok(());
                }
                w.heartbeat = None;
                if !matches!(w.state, WorkerState::Active | WorkerState::Draining) {
                    return Ok(());
                }
                w.suspect_since = Some(Instant::now());
                tracing::info!(worker_id = %id, "heartbeat stream dropped; worker is suspect");
                if self.cfg.lease_grace.is_zero() {
                    self.lose_all(conn, id, "worker's heartbeat stream dropped", "stream_lost")?;
                }
            }
        }
        Ok(())
    }

    /// Records a heartbeat: refreshes freshness and stats, clears suspicion,
    /// and, when `held` is given, re-queues every lease of the worker that
    /// it no longer runs.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED), storage errors.
    pub fn heartbeat(
        &mut self,
        conn: &Connection,
        id: &str,
        stats: Option<pb::WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<pb::HeartbeatResponse> {
        self.live_worker(id)?;
        let now = Instant::now();
        let was_fresh = self.workers.get(id).is_some_and(|w| self.is_fresh(w, now));
        if let Some(held) = held {
            let held: HashSet<String> = held.into_iter().collect();
            // Leases sent on the current lease stream may still be in
            // flight; only those of earlier streams can be known lost.
            let lost: Vec<i64> = self
                .workers
                .get(id)
                .map(|w| {
                    let current = w.lease_stream.as_ref().map_or(0, |s| s.id);
                    w.leases
                        .iter()
                        .filter(|row| {
                            self.leases.get(row).is_some_and(|l| {
                                !held.contains(&l.lease_id)
                                    && (l.stream_id == 0 || l.stream_id != current)
                            })
                        })
                        .copied()
                        .collect()
                })
                .unwrap_or_default();
            for row in lost {
                self.lose_lease(
                    conn,
                    row,
                    "the worker no longer runs it (reconnected without it)",
                    "not_held",
                )?;
            }
        }
        if let Some(w) = self.workers.get_mut(id) {
            w.last_heartbeat = now;
            w.last_heartbeat_ms = store::now_ms();
            if let Some(stats) = stats {
                w.stats = stats;
            }
            if w.heartbeat.is_some() {
                w.suspect_since = None;
            }
        }
        if !was_fresh {
            self.wants_dispatch = true;
        }
        Ok(pb::HeartbeatResponse {
            next_deadline: Some(self.next_deadline_ts()),
            command: None,
        })
    }

    /// Loses every lease of worker `id`; returns how many.
    fn lose_all(&mut self, conn: &Connection, id: &str, reason: &str, label: &str) -> Result<u32> {
        let rows: Vec<i64> = self
            .workers
            .get(id)
            .map(|w| w.leases.iter().copied().collect())
            .unwrap_or_default();
        for row in &rows {
            self.lose_lease(conn, *row, reason, label)?;
        }
        Ok(rows.len() as u32)
    }

    fn set_state(&mut self, conn: &Connection, id: &str, state: WorkerState) -> Result<()> {
        wstore::set_state(conn, id, state)?;
        if let Some(w) = self.workers.get_mut(id) {
            w.state = state;
            w.info.state = state as i32;
        }
        self.refresh_available(id);
        Ok(())
    }

    /// Ends both streams of a worker that left or died.
    fn hang_up(&mut self, id: &str, why: &str) {
        if let Some(w) = self.workers.get_mut(id) {
            w.lease_stream = None;
            if let Some(hb) = w.heartbeat.take() {
                self.outbox.push(Effect::Heartbeat(
                    hb.tx,
                    Err(Status::failed_precondition(why.to_string())),
                ));
            }
            w.suspect_since = None;
        }
        self.refresh_available(id);
    }

    /// Deregisters the worker and re-queues what it holds (seed: WORKER.UNREGISTER).
    ///
    /// Errors: `NotFound`, storage errors.
    pub fn unregister(&mut self, conn: &Connection, id: &str) -> Result<u32> {
        if !self.workers.contains_key(id) {
            return Err(Error::not_found(format!("worker {id} is not registered")));
        }
        let n = self.lose_all(
            conn,
            id,
            "the worker unregistered while running it",
            "unregister",
        )?;
        self.set_state(conn, id, WorkerState::Unregistered)?;
        self.hang_up(id, "worker unregistered");
        tracing::info!(worker_id = %id, requeued = n, "worker unregistered");
        Ok(n)
    }

    /// Puts the worker in DRAINING and tells it over its heartbeat stream.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED), storage errors.
    pub fn drain(&mut self, conn: &Connection, id: &str) -> Result<pb::Worker> {
        self.live_worker(id)?;
        self.set_state(conn, id, WorkerState::Draining)?;
        self.command(
            id,
            pb::heartbeat_response::Command::Drain(pb::DrainCommand {
                reason: "drain requested".into(),
            }),
        );
        tracing::info!(worker_id = %id, "worker draining");
        self.worker_view(id)
    }

    /// The reaper: promotes due jobs, fails expired leases, re-queues the
    /// leases of workers suspect past the grace, marks stale workers DEAD,
    /// flushes heartbeats to the database now and then.
    ///
    /// Errors: storage errors.
    pub fn tick(&mut self, conn: &Connection) -> Result<()> {
        let now = Instant::now();
        let now_ms = store::now_ms();
        self.promote_due(conn, now_ms)?;
        let expired: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires_at_ms <= now_ms)
            .map(|(r, _)| *r)
            .collect();
        for row in expired {
            let secs = self.cfg.job_timeout.as_secs();
            self.lose_lease(
                conn,
                row,
                &format!("job timed out: lease expired after {secs} s"),
                "timeout",
            )?;
        }
        let mut stale = Vec::new();
        let mut suspect = Vec::new();
        for (id, w) in &self.workers {
            if !matches!(w.state, WorkerState::Active | WorkerState::Draining) {
                continue;
            }
            if !self.is_fresh(w, now) {
                stale.push(id.clone());
            } else if !w.leases.is_empty()
                && w.suspect_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.lease_grace)
            {
                suspect.push(id.clone());
            }
        }
        for id in suspect {
            self.lose_all(
                conn,
                &id,
                "the worker's heartbeat stream dropped and it did not come back",
                "stream_lost",
            )?;
        }
        for id in stale {
            let secs = self.cfg.stale_after().as_secs_f64();
            tracing::warn!(worker_id = %id, "no heartbeat for {secs:.1} s; worker is DEAD");
            self.lose_all(
                conn,
                &id,
                &format!("the worker sent no heartbeat for {secs:.1} s"),
                "stale_heartbeat",
            )?;
            self.set_state(conn, &id, WorkerState::Dead)?;
            self.hang_up(
                &id,
                "no heartbeat for 3 x the interval: worker declared DEAD; register again",
            );
        }
        self.flush_heartbeats(conn, false)?;
        self.forget_departed(conn, now_ms)?;
        self.sweep_interned();
        Ok(())
    }

    /// Forgets DEAD and UNREGISTERED workers silent for longer than
    /// [`DEPARTED_RETENTION_MS`], so restarts with new ids do not pile up.
    ///
    /// Errors: storage errors.
    fn forget_departed(&mut self, conn: &Connection, now_ms: i64) -> Result<()> {
        let old: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                matches!(w.state, WorkerState::Dead | WorkerState::Unregistered)
                    && now_ms - w.last_heartbeat_ms > DEPARTED_RETENTION_MS
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in old {
            wstore::delete(conn, &id)?;
            self.workers.remove(&id);
        }
        Ok(())
    }

    /// Writes heartbeat times and stats of workers whose stored copy is
    /// older than the heartbeat interval (all of them when `all`).
    ///
    /// Errors: storage errors.
    pub fn flush_heartbeats(&mut self, conn: &Connection, all: bool) -> Result<()> {
        let every = self.cfg.heartbeat_interval.as_millis().max(5000) as i64;
        for (id, w) in self.workers.iter_mut() {
            let due = w.last_heartbeat_ms > w.flushed_heartbeat_ms
                && (all || w.last_heartbeat_ms - w.flushed_heartbeat_ms >= every);
            if due {
                wstore::flush_heartbeat(conn, id, w.last_heartbeat_ms, &w.stats)?;
                w.flushed_heartbeat_ms = w.last_heartbeat_ms;
            }
        }
        Ok(())
    }

    /// The public view of worker `id`.
    ///
    /// Errors: `NotFound`.
    pub fn worker_view(&self, id: &str) -> Result<pb::Worker> {
        let w = self
            .workers
            .get(id)
            .ok_or_else(|| Error::not_found(format!("worker {id} is not registered")))?;
        Ok(self.view(w))
    }

    /// Public views of every worker (of `state` when given), by id.
    pub fn worker_views(&self, state: Option<WorkerState>) -> Vec<pb::Worker> {
        let mut out: Vec<pb::Worker> = self
            .workers
            .values()
            .filter(|w| state.is_none_or(|s| s == w.state))
            .map(|w| self.view(w))
            .collect();
        out.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        out
    }

    fn view(&self, w: &WorkerEntry) -> pb::Worker {
        let now = Instant::now();
        let mut v = w.info.clone();
        v.state = w.state as i32;
        v.fresh =
            matches!(w.state, WorkerState::Active | WorkerState::Draining) && self.is_fresh(w, now);
        v.last_heartbeat_at = Some(ts(w.last_heartbeat_ms));
        v.stats = Some(w.stats);
        v.active_leases = w.leases.len() as u32;
        v.connected =
            w.heartbeat.is_some() && w.lease_stream.as_ref().is_some_and(|s| !s.tx.is_closed());
        v.registered_at = Some(ts(w.registered_at_ms));
        v
    }

    /// Queue depth and worker counts (seed: QUEUE.STATS).
    pub fn queue_stats(&self) -> pb::GetQueueStatsResponse {
        let now = Instant::now();
        let now_ms = store::now_ms();
        let oldest = self.ready.values().map(|w| w.since_ms).min();
        let next_due = self.delayed.first().map(|(due, _)| *due);
        let mut s = pb::GetQueueStatsResponse {
            ready_length: self.ready.len() as u64,
            scheduled_length: self.delayed.len() as u64,
            running_length: self.leases.len() as u64,
            oldest_ready_age_secs: oldest
                .map(|t| ((now_ms - t).max(0) / 1000) as u64)
                .unwrap_or(0),
            next_scheduled_due_in_secs: next_due
                .map(|t| ((t - now_ms).max(0) / 1000) as u64)
                .unwrap_or(0),
            ..Default::default()
        };
        for w in self.workers.values() {
            if !matches!(w.state, WorkerState::Active | WorkerState::Draining) {
                continue;
            }
            s.workers_total += 1;
            let fresh = self.is_fresh(w, now);
            if !fresh {
                s.workers_stale += 1;
            } else if w.state == WorkerState::Active {
                s.workers_active += 1;
                if w.leases.is_empty() {
                    s.workers_idle += 1;
                }
            }
        }
        s
    }
}

/// Lower-case name of a worker state.
pub fn state_name(s: WorkerState) -> &'static str {
    match s {
        WorkerState::Unspecified => "unspecified",
        WorkerState::Active => "ACTIVE",
        WorkerState::Draining => "DRAINING",
        WorkerState::Dead => "DEAD",
        WorkerState::Unregistered => "UNREGISTERED",
    }
}
