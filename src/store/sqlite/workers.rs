//! Worker lifecycle in the SQLite engine: registration, heartbeat and
//! lease streams, drain, unregister, the public views of workers and the
//! queue, and the reaper tick that catches stale workers, dropped streams
//! past their grace, expired leases and due jobs.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::Instant,
};

use rusqlite::Connection;

use super::{
    sql::{jobs, workers as wstore},
    state::{Effect, Sched, State, StreamSlot, WorkerEntry},
};
use crate::{
    core::{
        engine::{EventTx, HeartbeatEvent, StreamKind},
        model::{
            deepest_pools, revoked_leases, Depths, HeartbeatReply, JobLease, PoolStats,
            PriorityStats, QueueStats, Registration, Verification, Worker, WorkerCommand,
            WorkerState, WorkerStats,
        },
        selector::Selector,
    },
    error::{Error, Result},
    time::now_ms,
};

/// How long a DEAD or UNREGISTERED worker stays listed: 24 hours, in ms.
pub(super) const DEPARTED_RETENTION_MS: i64 = 24 * 3600 * 1000;

impl State {
    fn live_worker(&self, id: &str) -> Result<&WorkerEntry> {
        let w = self
            .workers
            .get(id)
            .ok_or_else(|| Error::not_found(format!("worker {id} is not registered")))?;
        match w.state {
            s if s.is_live() => Ok(w),
            s => Err(Error::precondition(format!(
                "worker {id} is {}; register it again",
                s.name()
            ))),
        }
    }

    /// Registers a validated worker (the WORKER.REGISTER command). One live
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
    pub(super) fn register(&mut self, conn: &Connection, req: Registration) -> Result<bool> {
        if let Some(w) = self.workers.get(&req.worker_id) {
            if w.state.is_live() {
                let current = w.info.instance_id.clone();
                if req.instance_id.is_empty() || current.is_empty() {
                    return Err(Error::AlreadyExists(format!(
                        "worker {} is already registered and {}",
                        req.worker_id,
                        w.state.name()
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
        let now_ms = now_ms();
        // A quarantined id stays quarantined across restarts and
        // re-registrations until an admin releases it.
        let quarantine_reason = self
            .workers
            .get(&req.worker_id)
            .map(|w| w.info.quarantine_reason.clone())
            .unwrap_or_default();
        let state = if quarantine_reason.is_empty() {
            WorkerState::Active
        } else {
            WorkerState::Quarantined
        };
        let info = Worker {
            worker_id: req.worker_id.clone(),
            hostname: req.hostname,
            platform: req.platform,
            agw_version: req.agw_version,
            capabilities: req.capabilities,
            max_concurrent_jobs: req.max_concurrent_jobs,
            tags: req.tags,
            state,
            fresh: true,
            last_heartbeat_at_ms: now_ms,
            stats: WorkerStats::default(),
            active_leases: 0,
            connected: false,
            registered_at_ms: now_ms,
            sandboxed: req.sandboxed,
            instance_id: req.instance_id,
            quarantine_reason,
            verifications: Vec::new(),
        };
        wstore::upsert(conn, &info, now_ms)?;
        // Verifications were of the process that registered before.
        wstore::clear_verifications(conn, &req.worker_id)?;
        let tools: super::state::Set<String> = info.capabilities.commands().cloned().collect();
        let entry = WorkerEntry {
            key_id: std::sync::Arc::from(req.worker_id.as_str()),
            max: info.max_concurrent_jobs.max(1),
            info,
            state,
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
            fleet_slots: 0,
            last_lease_seq: 0,
            timeouts: Default::default(),
            verified: Default::default(),
            pending: Default::default(),
        };
        if let Some(old) = self.workers.insert(req.worker_id.clone(), entry) {
            if let Some(key) = old.avail_key {
                self.available.remove(&key);
            }
            self.fleet_slots = self.fleet_slots.saturating_sub(u64::from(old.fleet_slots));
        }
        self.refresh_available(&req.worker_id);
        tracing::info!(worker_id = %req.worker_id, state = state.name(), "worker registered");
        Ok(false)
    }

    /// Attaches a newly opened stream to the worker, replacing an older one
    /// of the same kind. Returns the stream's id.
    ///
    /// A DRAINING worker is told again on the new stream: the Drain command
    /// is sent only on the stream open at DrainWorker's time, and is lost
    /// when there was none (the worker was reconnecting) or it ended right
    /// after; without it the worker would never learn to drain.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED).
    pub(super) fn open_heartbeat(&mut self, id: &str, tx: EventTx<HeartbeatEvent>) -> Result<u64> {
        self.live_worker(id)?;
        let sid = self.next_stream_id;
        self.next_stream_id += 1;
        let mut draining = false;
        if let Some(w) = self.workers.get_mut(id) {
            w.heartbeat = Some(StreamSlot { id: sid, tx });
            draining = w.state == WorkerState::Draining;
        }
        self.refresh_available(id);
        if draining {
            self.command(id, WorkerCommand::drain_requested());
        }
        self.resend_pending(id);
        self.challenge_missing(id);
        Ok(sid)
    }

    /// Attaches a newly opened lease stream, replacing an older one, and
    /// sends on it again every lease of the worker that went out on an
    /// earlier stream and that the worker has not listed in `held_leases`
    /// since: the heartbeat that named its held leases kept them as still
    /// on their way, but that stream may have been dead already (a
    /// connection that broke without the server noticing). A worker
    /// ignores a lease it already runs (same lease id), as agw does.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED),
    /// storage errors reading the leased jobs back (nothing is attached).
    pub(super) fn open_lease_stream(
        &mut self,
        conn: &Connection,
        id: &str,
        tx: EventTx<JobLease>,
    ) -> Result<u64> {
        let sid = self.next_stream_id;
        let unsent: Vec<i64> = self
            .live_worker(id)?
            .leases
            .iter()
            .copied()
            .filter(|row| self.leases.get(row).is_some_and(|l| !l.acknowledged))
            .collect();
        let mut again = Vec::with_capacity(unsent.len());
        for row in unsent {
            let Some(l) = self.leases.get(&row) else {
                continue;
            };
            let Some(job) = jobs::get_by_row(conn, row, false)? else {
                continue;
            };
            let traceparent = jobs::action_traceparent(conn, &job.action_id)?.map(Arc::from);
            again.push((
                row,
                JobLease {
                    lease_id: l.lease_id.clone(),
                    job,
                    plan: l.plan.plan.clone(),
                    attempt: l.attempt,
                    expires_at_ms: l.expires_at_ms,
                    traceparent,
                },
            ));
        }
        self.next_stream_id += 1;
        for (row, lease) in again {
            if let Some(l) = self.leases.get_mut(&row) {
                l.stream_id = sid;
            }
            tracing::info!(worker_id = %id, job_id = %lease.job.job_id, "lease sent again on the worker's new lease stream");
            self.outbox.push(Effect::Lease(tx.clone(), Box::new(lease)));
        }
        if let Some(w) = self.workers.get_mut(id) {
            w.lease_stream = Some(StreamSlot { id: sid, tx });
        }
        self.refresh_available(id);
        Ok(sid)
    }

    /// A stream of the worker ended: it is let go. A dropped heartbeat
    /// stream makes the worker suspect: its leases return to pending after
    /// the grace period unless it comes back ([`Self::lose_if_suspect`]
    /// at once when the grace is zero, else the reaper tick). Writes no
    /// SQL, so it runs while the store cannot commit too.
    pub(super) fn detach_stream(&mut self, id: &str, kind: StreamKind, sid: u64) {
        let Some(w) = self.workers.get_mut(id) else {
            return;
        };
        match kind {
            StreamKind::Lease => {
                if w.lease_stream.as_ref().is_some_and(|s| s.id == sid) {
                    w.lease_stream = None;
                }
            }
            StreamKind::Heartbeat => {
                if w.heartbeat.as_ref().is_none_or(|s| s.id != sid) {
                    return;
                }
                w.heartbeat = None;
                if w.state.is_live() {
                    w.suspect_since = Some(Instant::now());
                    tracing::info!(worker_id = %id, "heartbeat stream dropped; worker is suspect");
                }
            }
        }
        self.refresh_available(id);
    }

    /// Re-queues the leases of worker `id` when it is suspect (its
    /// heartbeat stream dropped and no other opened since): what a zero
    /// lease grace does at once.
    ///
    /// Errors: storage errors.
    pub(super) fn lose_if_suspect(&mut self, conn: &Connection, id: &str) -> Result<()> {
        let suspect = self.workers.get(id).is_some_and(|w| {
            w.state.is_live() && w.heartbeat.is_none() && w.suspect_since.is_some()
        });
        if suspect {
            self.lose_all(conn, id, "worker's heartbeat stream dropped", "stream_lost")?;
        }
        Ok(())
    }

    /// Records a heartbeat: refreshes freshness and stats, clears suspicion,
    /// and, when `held` is given, re-queues every lease of the worker that
    /// it no longer runs and answers with the held leases that are no
    /// longer its own (revoked while it was away).
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED), storage errors.
    pub(super) fn heartbeat(
        &mut self,
        conn: &Connection,
        id: &str,
        stats: Option<WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<HeartbeatReply> {
        self.live_worker(id)?;
        let now = Instant::now();
        let was_fresh = self.workers.get(id).is_some_and(|w| self.is_fresh(w, now));
        let mut revoked = Vec::new();
        if let Some(held) = held {
            let held: HashSet<String> = held.into_iter().collect();
            let current = self.workers.get(id).into_iter().flat_map(|w| {
                w.leases
                    .iter()
                    .filter_map(|row| self.leases.get(row))
                    .map(|l| l.lease_id.as_str())
            });
            revoked = revoked_leases(&held, current);
            // Leases sent on the current lease stream, while it is open,
            // may still be in flight (they are sent again on the worker's
            // next lease stream, see `open_lease_stream`); only those of
            // earlier or closed streams can be known lost.
            let rows: Vec<i64> = self
                .workers
                .get(id)
                .map(|w| w.leases.iter().copied().collect())
                .unwrap_or_default();
            let current = self
                .workers
                .get(id)
                .and_then(|w| w.lease_stream.as_ref())
                .filter(|s| !s.tx.is_closed())
                .map_or(0, |s| s.id);
            let mut lost = Vec::new();
            for row in rows {
                let Some(l) = self.leases.get_mut(&row) else {
                    continue;
                };
                if held.contains(&l.lease_id) {
                    l.acknowledged = true;
                } else if l.stream_id == 0 || l.stream_id != current {
                    lost.push(row);
                }
            }
            for row in lost {
                self.lose_lease(
                    conn,
                    row,
                    "the worker no longer runs it (reconnected without it)",
                    "not_held",
                )?;
            }
        }
        let mut cleared = false;
        if let Some(w) = self.workers.get_mut(id) {
            w.last_heartbeat = now;
            w.last_heartbeat_ms = now_ms();
            if let Some(stats) = stats {
                w.stats = stats;
            }
            if w.heartbeat.is_some() {
                cleared = w.suspect_since.take().is_some();
            }
        }
        if cleared {
            // No longer suspect: it may lease again.
            self.refresh_available(id);
        }
        if !was_fresh {
            self.wants_dispatch = true;
        }
        Ok(HeartbeatReply {
            next_deadline_ms: self.next_deadline_ms(),
            command: None,
            revoked_leases: revoked,
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
            w.info.state = state;
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
                    HeartbeatEvent::End(Error::precondition(why)),
                ));
            }
            w.suspect_since = None;
        }
        self.refresh_available(id);
    }

    /// Deregisters the worker and re-queues what it holds (the WORKER.UNREGISTER command).
    ///
    /// Errors: `NotFound`, storage errors.
    pub(super) fn unregister(&mut self, conn: &Connection, id: &str) -> Result<u32> {
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

    /// Puts the worker in DRAINING and tells it over its heartbeat stream;
    /// a worker already DRAINING is left as it is (it was told, and is
    /// told again on each heartbeat stream it opens).
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (DEAD or UNREGISTERED), storage errors.
    pub(super) fn drain(&mut self, conn: &Connection, id: &str) -> Result<Worker> {
        if self.live_worker(id)?.state == WorkerState::Draining {
            return self.worker_view(id);
        }
        self.set_state(conn, id, WorkerState::Draining)?;
        self.command(id, WorkerCommand::drain_requested());
        tracing::info!(worker_id = %id, "worker draining");
        self.worker_view(id)
    }

    /// Counts a lease of `id` that hit the job timeout at `now_ms`; at
    /// [`EngineConfig::quarantine_after_timeouts`] within the window, an
    /// ACTIVE worker is QUARANTINED: it keeps heartbeating (it is hung, not
    /// gone) but gets no new leases until released. A timeout counts only
    /// while the worker's heartbeat stream is open and it is not suspect:
    /// a lease that expired while its worker could not reach the server
    /// (a server restart after an outage, a dropped stream) says nothing
    /// of a hung worker.
    ///
    /// Errors: storage errors.
    ///
    /// [`EngineConfig::quarantine_after_timeouts`]: crate::config::EngineConfig::quarantine_after_timeouts
    fn count_timeout(&mut self, conn: &Connection, id: &str, now_ms: i64) -> Result<()> {
        let limit = self.cfg.quarantine_after_timeouts as usize;
        let window_ms = self.cfg.quarantine_window.as_millis() as i64;
        let Some(w) = self.workers.get_mut(id) else {
            return Ok(());
        };
        if w.heartbeat.is_none() || w.suspect_since.is_some() {
            return Ok(());
        }
        w.timeouts.push_back(now_ms);
        while w.timeouts.front().is_some_and(|t| *t <= now_ms - window_ms) {
            w.timeouts.pop_front();
        }
        if limit == 0 || w.timeouts.len() < limit || w.state != WorkerState::Active {
            return Ok(());
        }
        let reason = format!(
            "{} leases hit the job timeout ({} s) within {} s, the last at {}; the worker \
             kept heartbeating (hung?). Investigate it, then `agq worker release {id}`",
            w.timeouts.len(),
            self.cfg.job_timeout.as_secs(),
            self.cfg.quarantine_window.as_secs(),
            crate::time::rfc3339(now_ms)
        );
        wstore::set_quarantine(conn, id, WorkerState::Quarantined, &reason)?;
        if let Some(w) = self.workers.get_mut(id) {
            w.state = WorkerState::Quarantined;
            w.info.state = WorkerState::Quarantined;
            w.info.quarantine_reason = reason.clone();
            w.timeouts.clear();
        }
        self.refresh_available(id);
        self.metrics.worker_quarantines.inc();
        tracing::warn!(worker_id = %id, reason, "worker quarantined");
        Ok(())
    }

    /// Ends a quarantine (ReleaseWorker): a QUARANTINED worker is ACTIVE
    /// again; a departed one keeps its state and registers ACTIVE next
    /// time. Either way its reason is cleared and its timeouts forgotten.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` when it is not
    /// quarantined, storage errors.
    pub(super) fn release_quarantine(&mut self, conn: &Connection, id: &str) -> Result<Worker> {
        let w = self
            .workers
            .get(id)
            .ok_or_else(|| Error::not_found(format!("worker {id} is not registered")))?;
        if w.info.quarantine_reason.is_empty() && w.state != WorkerState::Quarantined {
            return Err(Error::precondition(format!(
                "worker {id} is {} and not quarantined",
                w.state.name()
            )));
        }
        let state = if w.state == WorkerState::Quarantined {
            WorkerState::Active
        } else {
            w.state
        };
        wstore::set_quarantine(conn, id, state, "")?;
        if let Some(w) = self.workers.get_mut(id) {
            w.state = state;
            w.info.state = state;
            w.info.quarantine_reason.clear();
            w.timeouts.clear();
        }
        self.refresh_available(id);
        tracing::info!(worker_id = %id, "worker released from quarantine");
        self.worker_view(id)
    }

    /// Deletes the record of a DEAD or UNREGISTERED worker now, as
    /// [`State::tick`] does after [`DEPARTED_RETENTION_MS`] (ForgetWorker).
    ///
    /// Errors: `NotFound`, `FailedPrecondition` while ACTIVE or DRAINING
    /// or while its quarantine has not been released, storage errors.
    pub(super) fn forget(&mut self, conn: &Connection, id: &str) -> Result<()> {
        let w = self
            .workers
            .get(id)
            .ok_or_else(|| Error::not_found(format!("worker {id} is not registered")))?;
        if w.state.is_live() {
            return Err(Error::precondition(format!(
                "worker {id} is {}; only a DEAD or UNREGISTERED worker can be forgotten \
                 (drain and unregister it first)",
                w.state.name()
            )));
        }
        // The record holds the quarantine, which only an admin ends
        // (ReleaseWorker); ForgetWorker takes the worker's own token.
        if !w.info.quarantine_reason.is_empty() {
            return Err(crate::store::quarantined_forget(id));
        }
        wstore::delete(conn, id)?;
        if let Some(w) = self.workers.remove(id) {
            self.fleet_slots = self.fleet_slots.saturating_sub(u64::from(w.fleet_slots));
        }
        tracing::info!(worker_id = %id, "worker forgotten");
        Ok(())
    }

    /// The reaper: promotes due jobs, fails expired leases, re-queues the
    /// leases of workers suspect past the grace, marks stale workers DEAD,
    /// flushes heartbeats to the database now and then.
    ///
    /// Silence is judged as of `queued` (monotonic) and `queued_ms` (Unix
    /// milliseconds), the moment the tick was queued to the writer, not
    /// the moment it runs: every heartbeat and report queued before the
    /// tick has been applied by then, and those queued after it are not
    /// yet, so time the writer spent on a long queue never counts as a
    /// worker's silence or a late report (a worker whose heartbeats wait
    /// behind a burst of submissions is not declared DEAD for it).
    ///
    /// Errors: storage errors.
    pub(super) fn tick(
        &mut self,
        conn: &Connection,
        queued: Instant,
        queued_ms: i64,
    ) -> Result<()> {
        let now_ms = now_ms();
        self.promote_due(conn, now_ms)?;
        let expired: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires_at_ms <= queued_ms)
            .map(|(r, _)| *r)
            .collect();
        for row in expired {
            let secs = self.cfg.job_timeout.as_secs();
            let holder = self.leases.get(&row).map(|l| l.worker_id.clone());
            self.lose_lease(
                conn,
                row,
                &format!("job timed out: lease expired after {secs} s"),
                "timeout",
            )?;
            if let Some(worker_id) = holder {
                self.count_timeout(conn, &worker_id, now_ms)?;
            }
        }
        let mut stale = Vec::new();
        let mut suspect = Vec::new();
        for (id, w) in &self.workers {
            if !w.state.is_live() {
                continue;
            }
            if !self.is_fresh(w, queued) {
                stale.push(id.clone());
            } else if !w.leases.is_empty()
                && w.suspect_since
                    .is_some_and(|t| queued.saturating_duration_since(t) >= self.cfg.lease_grace)
                && self
                    .started
                    .is_none_or(|t| queued.saturating_duration_since(t) >= self.cfg.restart_grace())
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
    /// [`DEPARTED_RETENTION_MS`], so restarts with new ids do not pile up;
    /// a quarantined one is kept until an admin releases it.
    ///
    /// Errors: storage errors.
    fn forget_departed(&mut self, conn: &Connection, now_ms: i64) -> Result<()> {
        let old: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                matches!(w.state, WorkerState::Dead | WorkerState::Unregistered)
                    && now_ms - w.last_heartbeat_ms > DEPARTED_RETENTION_MS
                    // the record holds a quarantine only an admin ends
                    && w.info.quarantine_reason.is_empty()
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in old {
            wstore::delete(conn, &id)?;
            if let Some(w) = self.workers.remove(&id) {
                self.fleet_slots = self.fleet_slots.saturating_sub(u64::from(w.fleet_slots));
            }
        }
        Ok(())
    }

    /// Writes heartbeat times and stats of workers whose stored copy is
    /// older than the heartbeat interval (all of them when `all`).
    ///
    /// Errors: storage errors.
    pub(super) fn flush_heartbeats(&mut self, conn: &Connection, all: bool) -> Result<()> {
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
    pub(super) fn worker_view(&self, id: &str) -> Result<Worker> {
        let w = self
            .workers
            .get(id)
            .ok_or_else(|| Error::not_found(format!("worker {id} is not registered")))?;
        Ok(self.view(w))
    }

    /// Public views of every worker (of `state` when given), by id.
    pub(super) fn worker_views(&self, state: Option<WorkerState>) -> Vec<Worker> {
        let mut out: Vec<Worker> = self
            .workers
            .values()
            .filter(|w| state.is_none_or(|s| s == w.state))
            .map(|w| self.view(w))
            .collect();
        out.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        out
    }

    fn view(&self, w: &WorkerEntry) -> Worker {
        let now = Instant::now();
        let mut v = w.info.clone();
        v.state = w.state;
        v.fresh = w.state.is_live() && self.is_fresh(w, now);
        v.last_heartbeat_at_ms = w.last_heartbeat_ms;
        v.stats = w.stats;
        v.active_leases = w.leases.len() as u32;
        v.connected =
            w.heartbeat.is_some() && w.lease_stream.as_ref().is_some_and(|s| !s.tx.is_closed());
        v.registered_at_ms = w.registered_at_ms;
        v.verifications = w.verified.values().cloned().collect();
        let mut pending: Vec<Verification> = w.pending.values().cloned().collect();
        pending.sort_by(|a, b| a.tool.cmp(&b.tool));
        v.verifications.extend(pending);
        v
    }

    /// Queue depth and worker counts (the QUEUE.STATS command), with the
    /// per-priority and per-pool breakdowns: one pass over every open job.
    pub(super) fn queue_stats(&self) -> QueueStats {
        let now = Instant::now();
        let now_ms = now_ms();
        let (oldest, newest) =
            self.ready
                .values()
                .fold((None, None), |(lo, hi): (Option<i64>, Option<i64>), w| {
                    (
                        Some(lo.map_or(w.since_ms, |t| t.min(w.since_ms))),
                        Some(hi.map_or(w.since_ms, |t| t.max(w.since_ms))),
                    )
                });
        let age = |t: Option<i64>| t.map_or(0, |t| ((now_ms - t).max(0) / 1000) as u64);
        let next_due = self.delayed.first().map(|(due, _)| *due);
        let mut s = QueueStats {
            ready_length: self.ready.len() as u64,
            scheduled_length: self.delayed.len() as u64,
            running_length: self.leases.len() as u64,
            oldest_ready_age_secs: age(oldest),
            newest_job_age_secs: age(newest),
            next_scheduled_due_in_secs: next_due
                .map(|t| ((t - now_ms).max(0) / 1000) as u64)
                .unwrap_or(0),
            ..Default::default()
        };
        for w in self.workers.values() {
            if !w.state.is_live() {
                continue;
            }
            s.workers_total += 1;
            if !self.is_fresh(w, now) {
                s.workers_stale += 1;
                continue;
            }
            match w.state {
                WorkerState::Active if w.leases.is_empty() => s.workers_idle += 1,
                WorkerState::Active => s.workers_active += 1,
                WorkerState::Draining => s.workers_draining += 1,
                _ => s.workers_quarantined += 1,
            }
        }
        self.breakdowns(&mut s, now);
        s
    }

    /// Fills the per-priority and per-pool figures of `s`.
    fn breakdowns(&self, s: &mut QueueStats, now: Instant) {
        // One pass over the open jobs, counted per settings object (shared
        // by an action's jobs), then folded by priority and by pool.
        let mut per_sched: HashMap<*const Sched, (Depths, &Sched)> = HashMap::new();
        let open = (self.ready.values().map(|w| (&*w.sched, 0u8)))
            .chain(self.delayed_jobs.values().map(|w| (&*w.sched, 1)))
            .chain(self.leases.values().map(|l| (&*l.sched, 2)));
        for (sched, kind) in open {
            let e = per_sched
                .entry(sched as *const Sched)
                .or_insert((Depths::default(), sched));
            match kind {
                0 => e.0.ready += 1,
                1 => e.0.scheduled += 1,
                _ => e.0.running += 1,
            }
        }
        let mut by_priority: BTreeMap<std::cmp::Reverse<i32>, Depths> = BTreeMap::new();
        let mut by_pool: BTreeMap<String, (Depths, &Selector)> = BTreeMap::new();
        for (d, sched) in per_sched.into_values() {
            let p = by_priority
                .entry(std::cmp::Reverse(sched.priority))
                .or_default();
            let pool = &mut by_pool
                .entry(sched.selector.to_string())
                .or_insert((Depths::default(), &sched.selector))
                .0;
            for t in [p, pool] {
                t.ready += d.ready;
                t.scheduled += d.scheduled;
                t.running += d.running;
            }
        }
        s.by_priority = by_priority
            .into_iter()
            .map(|(std::cmp::Reverse(priority), depths)| PriorityStats { priority, depths })
            .collect();
        let fresh: Vec<&WorkerEntry> = self
            .workers
            .values()
            .filter(|w| w.state == WorkerState::Active && self.is_fresh(w, now))
            .collect();
        let by_pool = deepest_pools(
            by_pool
                .into_iter()
                .map(|(text, (depths, selector))| (text, depths, selector))
                .collect(),
        );
        s.by_pool = by_pool
            .into_iter()
            .map(|(worker_selector, depths, selector)| PoolStats {
                workers_matching: fresh
                    .iter()
                    .filter(|w| selector.matches(&w.info.tags))
                    .count() as u32,
                worker_selector,
                depths,
            })
            .collect();
    }
}
