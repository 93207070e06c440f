//! Workers in the PostgreSQL engine: registration, the streams this
//! replica holds (ownership fenced by `workers.replica_id` and
//! `conn_epoch`), heartbeats, drain, unregister, quarantine release,
//! capability challenges, the command pump that delivers queued commands
//! to the workers connected here, and the views of workers and queues.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Instant,
};

use deadpool_postgres::GenericClient;
use serde_json::json;

use super::{
    cached, db_err, jobs::queue_command, lock, rows, wait, LocalWorker, PgEngine, StreamSlot,
    POLL_INTERVAL,
};
use crate::{
    core::{
        engine::{EventTx, HeartbeatEvent, QueueName, StreamKind},
        model::{
            deepest_pools, revoked_leases, Depths, HeartbeatReply, JobLease, PoolStats,
            PriorityStats, QueueStats, Registration, Verification, VerificationAnswer, Worker,
            WorkerCommand, WorkerState, WorkerStats, MAX_VERIFY_OUTPUT,
        },
        selector::Selector,
    },
    error::{Error, Result},
};

/// Live worker states as stored (ACTIVE, DRAINING, QUARANTINED).
pub(super) const LIVE: [i16; 3] = [
    WorkerState::Active as i16,
    WorkerState::Draining as i16,
    WorkerState::Quarantined as i16,
];

/// GetQueueStats's depths of the open jobs, in one pass over them (one
/// scan, hashed by priority and by selector at once): a row per priority
/// (`GROUPING(…)` = [`BY_PRIORITY`], highest first), a row per worker
/// selector ([`BY_POOL`], in the selectors' order) and one of totals
/// ([`TOTALS`], last; also with no open job). Columns: the grouping, the
/// priority, the selector, then ready, scheduled and running counts, the
/// earliest `ready_at_ms` of the ready and of the scheduled jobs, the
/// latest `created_at_ms`, and the time they were counted at (`now`, one
/// for every row). Public so that tests can check its plan.
pub const QUEUE_STATS: &str =
    "SELECT GROUPING(priority, worker_selector), priority, worker_selector,
            count(*) FILTER (WHERE status = 1 AND ready_at_ms <= now),
            count(*) FILTER (WHERE (status = 1 AND ready_at_ms > now) OR status = 4),
            count(*) FILTER (WHERE status = 2),
            min(ready_at_ms) FILTER (WHERE status = 1 AND ready_at_ms <= now),
            min(ready_at_ms) FILTER (WHERE (status = 1 AND ready_at_ms > now) OR status = 4),
            max(created_at_ms), max(now)
     FROM jobs, (SELECT agq_now_ms() AS now) n WHERE status IN (1, 2, 4)
     GROUP BY GROUPING SETS ((priority), (worker_selector), ())
     ORDER BY 1, priority DESC, worker_selector";

/// The grouping of [`QUEUE_STATS`]'s rows by priority.
const BY_PRIORITY: i32 = 1;

/// The grouping of [`QUEUE_STATS`]'s rows by worker selector (pool).
const BY_POOL: i32 = 2;

/// The grouping of [`QUEUE_STATS`]'s row of totals.
const TOTALS: i32 = 3;

/// A queued command: one of [`WorkerCommand`], or the end of the
/// worker's heartbeat stream with a reason.
pub(super) enum Queued {
    Command(WorkerCommand),
    /// The end of the streams opened up to connection epoch `.1` (streams
    /// of a later registration are not ended).
    End(String, Option<i64>),
}

/// Encodes a command for `worker_commands.command`.
pub(super) fn encode_command(c: &WorkerCommand) -> String {
    match c {
        WorkerCommand::Drain { reason } => json!({"drain": reason}),
        WorkerCommand::CancelJob { job_id, lease_id } => {
            json!({"cancel": job_id, "lease": lease_id})
        }
        WorkerCommand::Verify {
            challenge_id,
            command,
            args,
        } => json!({"verify": {"challenge_id": challenge_id, "command": command, "args": args}}),
    }
    .to_string()
}

/// Decodes a `worker_commands.command`; `None` for a form this binary
/// does not know (skipped).
fn decode_command(text: &str) -> Option<Queued> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let s = |v: &serde_json::Value| v.as_str().map(str::to_string);
    if let Some(r) = v.get("drain") {
        return Some(Queued::Command(WorkerCommand::Drain { reason: s(r)? }));
    }
    if let Some(id) = v.get("cancel") {
        return Some(Queued::Command(WorkerCommand::CancelJob {
            job_id: s(id)?,
            // Commands queued by an older replica name no lease: any
            // attempt of the job.
            lease_id: v.get("lease").and_then(s).unwrap_or_default(),
        }));
    }
    if let Some(e) = v.get("end") {
        return Some(Queued::End(s(e)?, v.get("epoch").and_then(|e| e.as_i64())));
    }
    let c = v.get("verify")?;
    Some(Queued::Command(WorkerCommand::Verify {
        challenge_id: s(c.get("challenge_id")?)?,
        command: s(c.get("command")?)?,
        args: c.get("args")?.as_array()?.iter().filter_map(s).collect(),
    }))
}

/// Cuts `s` to at most `max` bytes at a character boundary.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// The error for a worker that exists but is not live.
fn not_live(id: &str, state: i16) -> Error {
    let name = WorkerState::from_i32(i32::from(state)).map_or("gone", WorkerState::name);
    Error::precondition(format!("worker {id} is {name}; register it again"))
}

impl PgEngine {
    /// The heartbeat age past which a worker is stale, ms.
    pub(super) fn stale_ms(&self) -> i64 {
        self.cfg.stale_after().as_millis() as i64
    }

    /// `NotFound` or `FailedPrecondition` for a worker a statement could
    /// not change because it is missing or not live.
    async fn explain_worker(&self, c: &impl GenericClient, id: &str) -> Error {
        match c
            .query_opt("SELECT state FROM workers WHERE worker_id = $1", &[&id])
            .await
        {
            Err(e) => db_err(e),
            Ok(None) => Error::not_found(format!("worker {id} is not registered")),
            Ok(Some(r)) => {
                let state: i16 = r.get(0);
                if LIVE.contains(&state) {
                    Error::precondition(format!(
                        "worker {id}'s streams moved to another replica; reconnect"
                    ))
                } else {
                    not_live(id, state)
                }
            }
        }
    }

    /// Loses every running lease of worker `id` in `tx`; returns how many,
    /// and the actions of the jobs it changed. The caller touches those
    /// actions ([`PgEngine::touch`]) once `tx` committed, never before: a
    /// watcher woken earlier would re-read the state before the change and
    /// get no second notification.
    ///
    /// Errors: storage errors.
    async fn lose_all(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        id: &str,
        reason: &str,
        label: &str,
    ) -> Result<(u32, Vec<String>)> {
        let running = super::jobs::running_on(tx, id).await?;
        let mut actions = Vec::new();
        for (row, lease) in &running {
            if let Some(e) = self
                .lose_lease(tx, *row, (lease, id), reason, label)
                .await?
            {
                actions.push(e.action_id);
            }
        }
        Ok((running.len() as u32, actions))
    }

    pub(super) async fn pg_register(&self, req: Registration) -> Result<bool> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let old = tx
            .query_opt(
                "SELECT state, instance_id, heartbeat_open, last_heartbeat_at_ms, hostname,
                        quarantine_reason, agq_now_ms()
                 FROM workers WHERE worker_id = $1 FOR UPDATE",
                &[&req.worker_id],
            )
            .await
            .map_err(db_err)?;
        let mut quarantine_reason = String::new();
        // Actions of the jobs a takeover lost, touched after the commit.
        let mut lost_actions = Vec::new();
        if let Some(r) = &old {
            let state: i16 = r.get(0);
            quarantine_reason = r.get(5);
            if LIVE.contains(&state) {
                let current: String = r.get(1);
                let name =
                    WorkerState::from_i32(i32::from(state)).map_or("live", WorkerState::name);
                if req.instance_id.is_empty() || current.is_empty() {
                    return Err(Error::AlreadyExists(format!(
                        "worker {} is already registered and {name}",
                        req.worker_id
                    )));
                }
                if current == req.instance_id {
                    return Ok(true);
                }
                let last: i64 = r.get(3);
                let now: i64 = r.get(6);
                let connected: bool = r.get(2);
                if now - last < self.stale_ms() && connected {
                    let hostname: String = r.get(4);
                    return Err(Error::AlreadyExists(format!(
                        "worker {} is already run by another live agw process (instance {current}, \
                         hostname {hostname:?}, last heartbeat {:.1} s ago); stop that process or give \
                         this one another worker id",
                        req.worker_id,
                        (now - last) as f64 / 1000.0
                    )));
                }
                let (n, actions) = self
                    .lose_all(
                        &tx,
                        &req.worker_id,
                        "its worker process was replaced by a new instance",
                        "takeover",
                    )
                    .await?;
                lost_actions = actions;
                tracing::info!(
                    worker_id = %req.worker_id, old_instance = %current,
                    new_instance = %req.instance_id, requeued = n,
                    "a new instance took over a worker whose process is gone"
                );
            }
        }
        let state = if quarantine_reason.is_empty() {
            WorkerState::Active
        } else {
            WorkerState::Quarantined
        };
        let caps = &req.capabilities;
        let units =
            serde_json::to_string(&caps.units).map_err(|e| Error::Internal(e.to_string()))?;
        let tags = serde_json::to_string(&req.tags).map_err(|e| Error::Internal(e.to_string()))?;
        let mut tools: Vec<String> = caps.commands().cloned().collect();
        tools.sort();
        tools.dedup();
        // Commands for the process that registered before are void; its
        // streams (wherever they are) are ended.
        tx.execute(
            "DELETE FROM worker_commands WHERE worker_id = $1",
            &[&req.worker_id],
        )
        .await
        .map_err(db_err)?;
        if old.is_some() {
            queue_end(
                &tx,
                &req.worker_id,
                "another instance of this worker id took over; this process must stop",
            )
            .await?;
        }
        tx.execute(
            "INSERT INTO workers (worker_id, hostname, platform, agw_version, units, tools, tags,
                 max_concurrent_jobs, state, registered_at_ms, last_heartbeat_at_ms, instance_id,
                 sandboxed, quarantine_reason)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, agq_now_ms(), agq_now_ms(), $10, $11, $12)
             ON CONFLICT (worker_id) DO UPDATE SET hostname = $2, platform = $3, agw_version = $4,
                 units = $5, tools = $6, tags = $7, max_concurrent_jobs = $8, state = $9,
                 registered_at_ms = agq_now_ms(), last_heartbeat_at_ms = agq_now_ms(), stats = NULL,
                 instance_id = $10, sandboxed = $11, quarantine_reason = $12, timeouts_ms = '{}',
                 replica_id = NULL, conn_epoch = workers.conn_epoch + 1, heartbeat_open = false,
                 lease_stream_open = false, suspect_since_ms = NULL",
            &[
                &req.worker_id,
                &req.hostname,
                &req.platform,
                &req.agw_version,
                &units,
                &tools,
                &tags,
                &(req.max_concurrent_jobs as i32),
                &(state as i16),
                &req.instance_id,
                &req.sandboxed,
                &quarantine_reason,
            ],
        )
        .await
        .map_err(db_err)?;
        // Verifications were of the process that registered before.
        tx.execute(
            "DELETE FROM worker_verifications WHERE worker_id = $1",
            &[&req.worker_id],
        )
        .await
        .map_err(db_err)?;
        tx.execute(
            "DELETE FROM worker_challenges WHERE worker_id = $1",
            &[&req.worker_id],
        )
        .await
        .map_err(db_err)?;
        self.commit_and_touch(tx, &lost_actions).await?;
        tracing::info!(worker_id = %req.worker_id, state = state.name(), "worker registered");
        Ok(false)
    }

    /// Takes or refreshes this replica's local entry of worker `id` from
    /// its row; returns the entry's epoch.
    fn local_entry(&self, id: &str, r: &tokio_postgres::Row, epoch: i64) -> Result<()> {
        let tags = serde_json::from_str(r.get("tags"))
            .map_err(|e| Error::Internal(format!("worker {id}: {e}")))?;
        let mut local = lock(&self.local);
        let w = local
            .workers
            .entry(id.to_string())
            .or_insert_with(|| LocalWorker {
                epoch,
                heartbeat: None,
                lease: None,
                last_heartbeat: Instant::now(),
                in_flight: HashMap::new(),
                tools: Vec::new(),
                tags: Default::default(),
                sandboxed: false,
                max: 1,
            });
        w.epoch = epoch;
        w.tools = r.get("tools");
        w.tags = tags;
        w.sandboxed = r.get("sandboxed");
        w.max = u32::try_from(r.get::<_, i32>("max_concurrent_jobs"))
            .unwrap_or(1)
            .max(1);
        Ok(())
    }

    pub(super) async fn pg_open_heartbeat(
        &self,
        id: String,
        tx: EventTx<HeartbeatEvent>,
    ) -> Result<u64> {
        let c = self.client().await?;
        let Some(r) = c
            .query_opt(
                "UPDATE workers SET replica_id = $2, conn_epoch = conn_epoch + 1,
                        heartbeat_open = true, suspect_since_ms = NULL
                 WHERE worker_id = $1 AND state = ANY($3)
                 RETURNING conn_epoch, tools, tags, sandboxed, max_concurrent_jobs, state",
                &[&id, &self.replica_id, &LIVE.to_vec()],
            )
            .await
            .map_err(db_err)?
        else {
            return Err(self.explain_worker(&c, &id).await);
        };
        let draining = r.get::<_, i16>("state") == WorkerState::Draining as i16;
        self.local_entry(&id, &r, r.get(0))?;
        let sid = {
            let mut local = lock(&self.local);
            local.next_stream_id += 1;
            let sid = local.next_stream_id;
            if let Some(w) = local.workers.get_mut(&id) {
                w.heartbeat = Some(StreamSlot { id: sid, tx });
            }
            sid
        };
        self.commands_wake.notify_one();
        self.dispatch_wake.notify_one();
        // A DRAINING worker is told again on its new stream: DrainWorker's
        // command is lost when the pump took it for a stream that had just
        // ended (or maintenance expired it), and without it the worker
        // would never learn to drain. A second copy (DrainWorker's still
        // queued) is harmless: the worker drains once. A DrainWorker
        // committed after the UPDATE above queues its own command, which
        // this stream (its epoch now the current one) receives.
        let rest = async {
            if draining {
                queue_command(&c, &id, &WorkerCommand::drain_requested()).await?;
            }
            resend_pending(&c, &id).await?;
            self.challenge_missing(&c, std::slice::from_ref(&id)).await
        }
        .await;
        if let Err(e) = rest {
            // Refused after it took the worker over: the worker is then
            // suspect and this replica's entry for it gone.
            return Err(self
                .close_refused(c, e, &id, StreamKind::Heartbeat, sid)
                .await);
        }
        Ok(sid)
    }

    pub(super) async fn pg_open_lease_stream(
        &self,
        id: String,
        tx: EventTx<JobLease>,
    ) -> Result<u64> {
        let c = self.client().await?;
        let Some(r) = c
            .query_opt(
                "UPDATE workers SET lease_stream_open = true,
                        replica_id = CASE WHEN heartbeat_open AND replica_id IS NOT NULL
                                          THEN replica_id ELSE $3 END,
                        conn_epoch = CASE WHEN heartbeat_open AND replica_id IS NOT NULL
                                          THEN conn_epoch ELSE conn_epoch + 1 END
                 WHERE worker_id = $1 AND state = ANY($2)
                 RETURNING conn_epoch, tools, tags, sandboxed, max_concurrent_jobs, replica_id",
                &[&id, &LIVE.to_vec(), &self.replica_id],
            )
            .await
            .map_err(db_err)?
        else {
            return Err(self.explain_worker(&c, &id).await);
        };
        let owner: Option<String> = r.get(5);
        // The replica holding the heartbeat stream owns the worker (agw
        // opens both streams on one connection); without one open, the
        // lease stream takes the ownership. The claim re-checks it.
        let epoch = if owner.as_deref() == Some(self.replica_id.as_str()) {
            r.get(0)
        } else {
            -1
        };
        self.local_entry(&id, &r, epoch)?;
        // The new stream takes the worker's leases from now on. Those this
        // replica pushed before, on an earlier stream, that the worker has
        // not listed in `held_leases` since: the heartbeat that named its
        // held leases kept them as still on their way, but that stream may
        // have been dead already (a connection that broke without the
        // server noticing). They go again on this one; a worker ignores a
        // lease it already runs (same lease id), as agw does.
        let (sid, unsent) = {
            let mut local = lock(&self.local);
            local.next_stream_id += 1;
            let sid = local.next_stream_id;
            let unsent: HashSet<String> = match local.workers.get_mut(&id) {
                Some(w) => {
                    w.lease = Some(StreamSlot {
                        id: sid,
                        tx: tx.clone(),
                    });
                    w.in_flight.keys().cloned().collect()
                }
                None => HashSet::new(),
            };
            (sid, unsent)
        };
        if !unsent.is_empty() {
            let ids: Vec<String> = unsent.iter().cloned().collect();
            let again = match self.leases_again(&c, &id, &ids).await {
                Ok(again) => again,
                Err(e) => return Err(self.close_refused(c, e, &id, StreamKind::Lease, sid).await),
            };
            let mut local = lock(&self.local);
            if let Some(w) = local.workers.get_mut(&id) {
                // Those no longer running under that lease are done with.
                let resent: HashSet<&str> = again.iter().map(|l| l.lease_id.as_str()).collect();
                w.in_flight
                    .retain(|l, _| !unsent.contains(l) || resent.contains(l.as_str()));
                let now = Instant::now();
                for lease in &again {
                    tracing::info!(worker_id = %id, job_id = %lease.job.job_id, "lease sent again on the worker's new lease stream");
                    w.in_flight.insert(lease.lease_id.clone(), now);
                }
            }
            drop(local);
            for lease in again {
                let _ = tx.send(lease);
            }
        }
        self.dispatch_wake.notify_one();
        Ok(sid)
    }

    /// Closes stream `sid` of worker `id`, refused with `e` after it was
    /// attached, as if it had ended: the caller, refused, never closes it,
    /// and it would stay open in the database and in memory with nobody
    /// reading it. `c` goes back to the pool unless `e` says it was lost
    /// (the close then takes another). Returns `e`.
    async fn close_refused(
        &self,
        c: deadpool_postgres::Object,
        e: Error,
        id: &str,
        kind: StreamKind,
        sid: u64,
    ) -> Error {
        super::release(c, &e);
        if let Err(close) = self.pg_close_stream(id.to_string(), kind, sid).await {
            tracing::warn!(worker_id = %id, ?kind, error = %close, "closing a refused stream was not recorded");
        }
        e
    }

    /// The leases among `lease_ids` that worker `id` still holds (their
    /// jobs running under them), as they were granted.
    ///
    /// Errors: storage errors; `Internal` for an undecodable row.
    async fn leases_again(
        &self,
        c: &impl GenericClient,
        id: &str,
        lease_ids: &[String],
    ) -> Result<Vec<JobLease>> {
        let sql = format!(
            "SELECT {}, a.traceparent, j.lease_id, j.lease_expires_at_ms,
                    (SELECT {} FROM plan_versions pv
                     WHERE pv.plan_id = j.plan_id AND pv.version = j.plan_version)
             FROM jobs j JOIN actions a ON a.action_id = j.action_id
             WHERE j.worker_id = $1 AND j.status = 2 AND j.lease_id = ANY($2)
             ORDER BY j.id",
            rows::JOB_COLS,
            rows::PLAN_STAMP
        );
        let found = c.query(&sql, &[&id, &lease_ids]).await.map_err(db_err)?;
        let mut out = Vec::with_capacity(found.len());
        for r in &found {
            let job = rows::job(r)?;
            let traceparent: Option<String> = r.get(20);
            let stamp: Option<String> = r.get(23);
            let plan = self
                .plan_version(c, &job.plan_id, job.plan_version, stamp.as_deref())
                .await?
                .ok_or_else(|| Error::Internal(format!("plan {} vanished", job.plan_id)))?;
            out.push(JobLease {
                lease_id: r.get(21),
                attempt: job.attempt,
                expires_at_ms: r.get(22),
                traceparent: traceparent.map(std::sync::Arc::from),
                plan,
                job,
            });
        }
        Ok(out)
    }

    pub(super) async fn pg_heartbeat(
        &self,
        id: String,
        stats: Option<WorkerStats>,
        held: Option<Vec<String>>,
    ) -> Result<HeartbeatReply> {
        // A beat counts only through the heartbeat stream this replica
        // holds for the worker, at the epoch it took it with. One read
        // from a stream this replica has already ended (moved, refused,
        // told to end) or demoted (owned elsewhere) changes nothing: its
        // held leases would re-queue those the worker runs through its
        // current stream, wherever that is. The refusal ends the stream
        // it came from.
        let fenced = {
            let mut local = lock(&self.local);
            match local.workers.get(&id) {
                Some(w) if w.heartbeat.is_some() && w.epoch >= 0 => {
                    Some((w.epoch, w.last_heartbeat.elapsed() < self.cfg.stale_after()))
                }
                Some(w) if w.heartbeat.is_some() => {
                    // Demoted by the dispatcher (owned elsewhere): both
                    // streams end, as the command pump ends them. The
                    // flags are the owner's: nothing to clear.
                    local.end_streams(&id, None);
                    None
                }
                _ => None,
            }
        };
        let Some((epoch, was_fresh)) = fenced else {
            return Err(Error::precondition(format!(
                "worker {id}'s heartbeat stream on this replica has ended; reconnect"
            )));
        };
        let stats = stats.map(|s| rows::encode_stats(&s));
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let updated = tx
            .query_opt(
                &cached(&tx, "UPDATE workers SET last_heartbeat_at_ms = agq_now_ms(), stats = coalesce($2, stats),
                        suspect_since_ms = CASE WHEN heartbeat_open THEN NULL ELSE suspect_since_ms END
                 WHERE worker_id = $1 AND state = ANY($3) AND replica_id = $5 AND conn_epoch = $4
                 RETURNING state").await?,
                &[&id, &stats, &LIVE.to_vec(), &epoch, &self.replica_id],
            )
            .await
            .map_err(db_err)?;
        if updated.is_none() {
            // The worker is no longer live, or no longer owned through
            // this stream: both its streams here end, as the command pump
            // ends them for a queued `end` or a worker that moved, and the
            // row's stream flags are cleared (fenced: a worker owned
            // elsewhere keeps its own). The refusal is this call's answer,
            // so the heartbeat stream gets no `end` of its own.
            let e = self.explain_worker(&tx, &id).await;
            let ended = lock(&self.local).end_streams(&id, None);
            if let Some(epoch) = ended {
                let cleared =
                    clear_stream_flags(&tx, &self.replica_id, &[(id.clone(), epoch)]).await;
                if let Err(c) = match cleared {
                    Ok(()) => tx.commit().await.map_err(db_err),
                    Err(c) => Err(c),
                } {
                    tracing::warn!(worker_id = %id, error = %c, "stream flags of a refused worker not cleared");
                }
            }
            return Err(e);
        }
        let mut revoked = Vec::new();
        if let Some(held) = held {
            let held: HashSet<String> = held.into_iter().collect();
            // Leases pushed within the staleness window may still be on
            // their way to the worker; older ones it has had time to name.
            let window = self.cfg.stale_after();
            let running = super::jobs::running_on(&tx, &id).await?;
            // Read after the running leases: a lease committed before that
            // read was marked in flight before its commit (see the
            // dispatcher's `mark_in_flight`), so it is in this set unless
            // it has been on its way longer than the window.
            let in_flight: HashSet<String> = lock(&self.local)
                .workers
                .get(&id)
                .map(|w| {
                    w.in_flight
                        .iter()
                        .filter(|(_, at)| at.elapsed() < window)
                        .map(|(l, _)| l.clone())
                        .collect()
                })
                .unwrap_or_default();
            revoked = revoked_leases(&held, running.iter().map(|(_, l)| l.as_str()));
            let lost: Vec<(i64, String)> = running
                .into_iter()
                .filter(|(_, l)| !held.contains(l) && !in_flight.contains(l))
                .collect();
            let mut actions = Vec::new();
            for (row, lease) in lost {
                if let Some(e) = self
                    .lose_lease(
                        &tx,
                        row,
                        (&lease, &id),
                        "the worker no longer runs it (reconnected without it)",
                        "not_held",
                    )
                    .await?
                {
                    actions.push(e.action_id);
                }
            }
            tx.commit().await.map_err(db_err)?;
            self.touch(actions.iter().map(String::as_str));
            // What is left in flight is what the worker's next lease
            // stream gets again (see `pg_open_lease_stream`).
            if let Some(w) = lock(&self.local).workers.get_mut(&id) {
                w.in_flight
                    .retain(|l, at| !held.contains(l) && at.elapsed() < window);
            }
        } else {
            tx.commit().await.map_err(db_err)?;
        }
        if let Some(w) = lock(&self.local).workers.get_mut(&id) {
            w.last_heartbeat = Instant::now();
        }
        if !was_fresh {
            self.dispatch_wake.notify_one();
        }
        Ok(HeartbeatReply {
            next_deadline_ms: crate::time::now_ms()
                + self.cfg.heartbeat_interval.as_millis() as i64,
            command: None,
            revoked_leases: revoked,
        })
    }

    /// A stream of worker `id` ended here (see `Engine::close_stream`).
    pub(super) async fn pg_close_stream(
        &self,
        id: String,
        kind: StreamKind,
        sid: u64,
    ) -> Result<()> {
        let epoch = {
            let mut local = lock(&self.local);
            let Some(w) = local.workers.get_mut(&id) else {
                return Ok(());
            };
            let epoch = w.epoch;
            match kind {
                StreamKind::Lease if w.lease.as_ref().is_some_and(|s| s.id == sid) => {
                    w.lease = None;
                }
                StreamKind::Heartbeat if w.heartbeat.as_ref().is_some_and(|s| s.id == sid) => {
                    w.heartbeat = None;
                }
                _ => return Ok(()),
            }
            local.forget_streamless(&id);
            epoch
        };
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let mut lost_actions = Vec::new();
        match kind {
            StreamKind::Lease => {
                tx.execute(
                    "UPDATE workers SET lease_stream_open = false
                     WHERE worker_id = $1 AND (replica_id IS NULL OR (replica_id = $2 AND conn_epoch = $3))",
                    &[&id, &self.replica_id, &epoch],
                )
                .await
                .map_err(db_err)?;
            }
            StreamKind::Heartbeat => {
                let n = tx
                    .execute(
                        "UPDATE workers SET heartbeat_open = false, suspect_since_ms = agq_now_ms()
                         WHERE worker_id = $1 AND replica_id = $2 AND conn_epoch = $3
                           AND state = ANY($4)",
                        &[&id, &self.replica_id, &epoch, &LIVE.to_vec()],
                    )
                    .await
                    .map_err(db_err)?;
                if n == 1 {
                    tracing::info!(worker_id = %id, "heartbeat stream dropped; worker is suspect");
                    if self.cfg.lease_grace.is_zero() {
                        lost_actions = self
                            .lose_all(&tx, &id, "worker's heartbeat stream dropped", "stream_lost")
                            .await?
                            .1;
                    }
                }
            }
        }
        self.commit_and_touch(tx, &lost_actions).await
    }

    pub(super) async fn pg_unregister(&self, id: &str) -> Result<u32> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let found = tx
            .query_opt(
                "SELECT 1 FROM workers WHERE worker_id = $1 FOR UPDATE",
                &[&id],
            )
            .await
            .map_err(db_err)?;
        if found.is_none() {
            return Err(Error::not_found(format!("worker {id} is not registered")));
        }
        let (n, lost_actions) = self
            .lose_all(
                &tx,
                id,
                "the worker unregistered while running it",
                "unregister",
            )
            .await?;
        tx.execute(
            "UPDATE workers SET state = $2 WHERE worker_id = $1",
            &[&id, &(WorkerState::Unregistered as i16)],
        )
        .await
        .map_err(db_err)?;
        queue_end(&tx, id, "worker unregistered").await?;
        self.commit_and_touch(tx, &lost_actions).await?;
        tracing::info!(worker_id = %id, requeued = n, "worker unregistered");
        Ok(n)
    }

    pub(super) async fn pg_drain(&self, id: &str) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        // A worker already DRAINING is left as it is: it was told, and is
        // told again on each heartbeat stream it opens; a command per call
        // would pile up for a worker that does not read them.
        let n = tx
            .execute(
                "UPDATE workers SET state = $2
                 WHERE worker_id = $1 AND state = ANY($3) AND state <> $2",
                &[&id, &(WorkerState::Draining as i16), &LIVE.to_vec()],
            )
            .await
            .map_err(db_err)?;
        if n == 0 {
            let draining = tx
                .query_opt(
                    "SELECT 1 FROM workers WHERE worker_id = $1 AND state = $2",
                    &[&id, &(WorkerState::Draining as i16)],
                )
                .await
                .map_err(db_err)?
                .is_some();
            if draining {
                return Ok(());
            }
            return Err(self.explain_worker(&tx, id).await);
        }
        queue_command(&tx, id, &WorkerCommand::drain_requested()).await?;
        tx.commit().await.map_err(db_err)?;
        tracing::info!(worker_id = %id, "worker draining");
        Ok(())
    }

    pub(super) async fn pg_forget(&self, id: &str) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let Some(r) = tx
            .query_opt(
                "SELECT state, quarantine_reason FROM workers WHERE worker_id = $1 FOR UPDATE",
                &[&id],
            )
            .await
            .map_err(db_err)?
        else {
            return Err(Error::not_found(format!("worker {id} is not registered")));
        };
        let state: i16 = r.get(0);
        if LIVE.contains(&state) {
            let name = WorkerState::from_i32(i32::from(state)).map_or("live", WorkerState::name);
            return Err(Error::precondition(format!(
                "worker {id} is {name}; only a DEAD or UNREGISTERED worker can be forgotten \
                 (drain and unregister it first)"
            )));
        }
        // The row holds the quarantine, which only an admin ends
        // (ReleaseWorker); ForgetWorker takes the worker's own token.
        let reason: String = r.get(1);
        if !reason.is_empty() {
            return Err(crate::store::quarantined_forget(id));
        }
        tx.execute("DELETE FROM workers WHERE worker_id = $1", &[&id])
            .await
            .map_err(db_err)?;
        tx.execute("DELETE FROM worker_commands WHERE worker_id = $1", &[&id])
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        tracing::info!(worker_id = %id, "worker forgotten");
        Ok(())
    }

    pub(super) async fn pg_release(&self, id: &str) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let Some(r) = tx
            .query_opt(
                "SELECT state, quarantine_reason FROM workers WHERE worker_id = $1 FOR UPDATE",
                &[&id],
            )
            .await
            .map_err(db_err)?
        else {
            return Err(Error::not_found(format!("worker {id} is not registered")));
        };
        let state: i16 = r.get(0);
        let reason: String = r.get(1);
        let quarantined = WorkerState::Quarantined as i16;
        if reason.is_empty() && state != quarantined {
            let name = WorkerState::from_i32(i32::from(state)).map_or("gone", WorkerState::name);
            return Err(Error::precondition(format!(
                "worker {id} is {name} and not quarantined"
            )));
        }
        let state = if state == quarantined {
            WorkerState::Active as i16
        } else {
            state
        };
        tx.execute(
            "UPDATE workers SET state = $2, quarantine_reason = '', timeouts_ms = '{}' WHERE worker_id = $1",
            &[&id, &state],
        )
        .await
        .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        tracing::info!(worker_id = %id, "worker released from quarantine");
        self.dispatch_wake.notify_one();
        Ok(())
    }

    /// Workers (of `state` when given; only `id` when given), by id.
    pub(super) async fn pg_workers(
        &self,
        state: Option<WorkerState>,
        id: Option<&str>,
    ) -> Result<Vec<Worker>> {
        let c = self.client().await?;
        self.pg_workers_on(&c, state, id).await
    }

    /// [`PgEngine::pg_workers`] on a connection the caller holds: a call
    /// that holds one must never wait for a second from the pool, or as
    /// many such calls as the pool has connections wait on each other
    /// until the pool's timeout, and the whole replica with them.
    ///
    /// Errors: storage errors.
    pub(super) async fn pg_workers_on(
        &self,
        c: &impl GenericClient,
        state: Option<WorkerState>,
        id: Option<&str>,
    ) -> Result<Vec<Worker>> {
        let rows = c
            .query(
                &format!(
                    "SELECT {} FROM workers w
                     WHERE ($1::smallint IS NULL OR w.state = $1) AND ($2::text IS NULL OR w.worker_id = $2)
                     ORDER BY w.worker_id",
                    rows::WORKER_COLS
                ),
                &[&state.map(|s| s as i16), &id],
            )
            .await
            .map_err(db_err)?;
        let stale = self.stale_ms();
        let mut out = rows
            .iter()
            .map(|r| rows::worker(r, stale))
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<String> = out.iter().map(|w| w.worker_id.clone()).collect();
        let mut verifications = rows::verifications(c, &ids).await?;
        for w in &mut out {
            w.verifications = verifications.remove(&w.worker_id).unwrap_or_default();
        }
        Ok(out)
    }

    pub(super) async fn pg_verify_worker(
        &self,
        id: &str,
        command: &str,
        args: Vec<String>,
    ) -> Result<Verification> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let Some(r) = tx
            .query_opt(
                "SELECT state, tools, units, heartbeat_open FROM workers WHERE worker_id = $1 FOR UPDATE",
                &[&id],
            )
            .await
            .map_err(db_err)?
        else {
            return Err(Error::not_found(format!("worker {id} is not registered")));
        };
        let state: i16 = r.get(0);
        if !LIVE.contains(&state) {
            let name = WorkerState::from_i32(i32::from(state)).map_or("gone", WorkerState::name);
            return Err(Error::precondition(format!(
                "worker {id} is {name}; only a live worker can be challenged"
            )));
        }
        let tools: Vec<String> = r.get(1);
        if !tools.iter().any(|t| t == command) {
            return Err(Error::precondition(format!(
                "worker {id} does not advertise {command:?} (neither a tool nor an agentic unit)"
            )));
        }
        if !r.get::<_, bool>(3) {
            return Err(Error::precondition(format!(
                "worker {id} has no heartbeat stream open to send the challenge on"
            )));
        }
        let units: String = r.get(2);
        let args = if args.is_empty() {
            let unit = serde_json::from_str::<Vec<crate::core::model::AgenticUnit>>(&units)
                .is_ok_and(|u| u.iter().any(|u| u.name == command));
            vec![if unit { "--describe" } else { "--version" }.to_string()]
        } else {
            args
        };
        let v = challenge(&tx, id, command, args).await?;
        tx.commit().await.map_err(db_err)?;
        Ok(v)
    }

    /// Challenges each worker of `ids` whose heartbeat stream this replica
    /// holds (live, `heartbeat_open`, `replica_id` this replica's) for
    /// every command of a plan with `require_verified_tools` it advertises
    /// and has neither passed nor been challenged for. One query for all of
    /// them; the challenges go out as queued commands
    /// (`NOTIFY agq_commands`).
    ///
    /// Errors: storage errors.
    pub(super) async fn challenge_missing(
        &self,
        c: &impl GenericClient,
        ids: &[String],
    ) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        // The versions: each plan's latest, and the older ones open jobs
        // still run (a job keeps its version's requirement after the plan
        // is replaced by one without it).
        let missing = c
            .query(
                "WITH needed AS (
                     SELECT pv.tools FROM plan_versions pv
                     WHERE pv.require_verified
                       AND (EXISTS (SELECT 1 FROM plans p
                                    WHERE p.plan_id = pv.plan_id AND p.version = pv.version)
                            OR EXISTS (SELECT 1 FROM actions a JOIN jobs j ON j.action_id = a.action_id
                                       WHERE a.plan_id = pv.plan_id AND j.plan_version = pv.version
                                         AND j.status IN (1, 2, 4))))
                 SELECT DISTINCT w.worker_id, t.tool, w.units FROM workers w, needed pv,
                     unnest(pv.tools) AS t(tool)
                 WHERE w.worker_id = ANY($1) AND w.state = ANY($2) AND w.heartbeat_open
                   AND w.replica_id = $3
                   AND t.tool = ANY(w.tools)
                   AND NOT EXISTS (SELECT 1 FROM worker_verifications v
                                   WHERE v.worker_id = w.worker_id AND v.tool = t.tool AND v.passed)
                   AND NOT EXISTS (SELECT 1 FROM worker_challenges ch
                                   WHERE ch.worker_id = w.worker_id AND ch.tool = t.tool)
                 ORDER BY w.worker_id, t.tool",
                &[&ids, &LIVE.to_vec(), &self.replica_id],
            )
            .await
            .map_err(db_err)?;
        for r in missing {
            let id: String = r.get(0);
            let tool: String = r.get(1);
            let units: String = r.get(2);
            let unit = serde_json::from_str::<Vec<crate::core::model::AgenticUnit>>(&units)
                .is_ok_and(|u| u.iter().any(|u| u.name == tool));
            let args = vec![if unit { "--describe" } else { "--version" }.to_string()];
            challenge(c, &id, &tool, args).await?;
        }
        Ok(())
    }

    /// [`PgEngine::challenge_missing`] for every worker whose heartbeat
    /// stream is connected here.
    ///
    /// Errors: `StoreUnavailable`/`StoreBusy` when no connection can be
    /// had, storage errors.
    pub(super) async fn challenge_all_missing(&self) -> Result<()> {
        let ids: Vec<String> = lock(&self.local)
            .workers
            .iter()
            .filter(|(_, w)| w.heartbeat.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let c = self.client().await?;
        self.challenge_missing(&c, &ids).await
    }

    pub(super) async fn pg_answer(&self, id: &str, a: VerificationAnswer) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let Some(r) = tx
            .query_opt(
                "DELETE FROM worker_challenges WHERE challenge_id = $1 AND worker_id = $2
                 RETURNING tool, args, requested_at_ms",
                &[&a.challenge_id, &id],
            )
            .await
            .map_err(db_err)?
        else {
            tracing::debug!(worker_id = id, challenge_id = %a.challenge_id, "answer to no pending challenge: ignored");
            return Ok(());
        };
        let passed = a.exit_code == 0;
        let output = cut(a.output, MAX_VERIFY_OUTPUT);
        let error = if passed {
            String::new()
        } else if a.error.is_empty() {
            format!("exited with code {}", a.exit_code)
        } else {
            cut(a.error, MAX_VERIFY_OUTPUT)
        };
        let tool: String = r.get(0);
        tx.execute(
            "INSERT INTO worker_verifications (worker_id, tool, args, challenge_id, requested_at_ms,
                 answered_at_ms, passed, exit_code, output, error)
             VALUES ($1, $2, $3, $4, $5, agq_now_ms(), $6, $7, $8, $9)
             ON CONFLICT (worker_id, tool) DO UPDATE SET args = $3, challenge_id = $4,
                 requested_at_ms = $5, answered_at_ms = agq_now_ms(), passed = $6, exit_code = $7,
                 output = $8, error = $9",
            &[
                &id,
                &tool,
                &r.get::<_, String>(1),
                &a.challenge_id,
                &r.get::<_, i64>(2),
                &passed,
                &a.exit_code,
                &output,
                &error,
            ],
        )
        .await
        .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        tracing::info!(worker_id = id, command = %tool, passed, "capability verification answered");
        self.dispatch_wake.notify_one();
        Ok(())
    }

    /// A slot of worker `id` was freed: wake the dispatcher if the worker
    /// is connected here (its owner's dispatcher polls otherwise).
    pub(super) fn slot_freed(&self, id: &str) {
        if lock(&self.local).workers.contains_key(id) {
            self.dispatch_wake.notify_one();
        }
    }

    /// Delivers queued commands to the workers whose heartbeat streams this
    /// replica holds, and ends the streams it should no longer hold: those
    /// of a worker owned elsewhere now, and a lease stream left without a
    /// heartbeat stream whose worker is no longer live (no `end` reaches
    /// it: commands go out on heartbeat streams).
    ///
    /// Errors: storage errors.
    async fn deliver_commands(&self) -> Result<()> {
        let (mut ids, mut epochs, mut beating) = (Vec::new(), Vec::new(), Vec::new());
        for (id, w) in &lock(&self.local).workers {
            ids.push(id.clone());
            epochs.push(w.epoch);
            beating.push(w.heartbeat.is_some());
        }
        if ids.is_empty() {
            return Ok(());
        }
        let c = self.client().await?;
        // Heartbeat streams this replica holds but no longer owns (the
        // worker reconnected elsewhere, or was declared DEAD while this
        // replica was paused or partitioned): they are ended, and their
        // commands wait for the owner. A lease stream alone is ended once
        // its worker is gone or no longer live; one of a worker owned
        // elsewhere stays (the dispatcher sends it nothing).
        let stale: Vec<(String, i64, bool)> = c
            .query(
                "SELECT l.worker_id, l.epoch, w.worker_id IS NULL
                 FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS l(worker_id, epoch, beating)
                 LEFT JOIN workers w ON w.worker_id = l.worker_id
                 WHERE w.worker_id IS NULL
                    OR (l.beating AND (w.replica_id IS DISTINCT FROM $4 OR w.conn_epoch <> l.epoch))
                    OR (NOT l.beating AND NOT w.state = ANY($5))",
                &[&ids, &epochs, &beating, &self.replica_id, &LIVE.to_vec()],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let mut ended = Vec::new();
        if !stale.is_empty() {
            let mut local = lock(&self.local);
            for (id, epoch, gone) in stale {
                if local.workers.get(&id).is_none_or(|w| w.epoch != epoch) {
                    continue;
                }
                let end = if gone {
                    Error::precondition(format!("worker {id} is not registered; register again"))
                } else {
                    Error::precondition(format!(
                        "worker {id}'s streams moved to another replica; reconnect"
                    ))
                };
                if let Some(epoch) = local.end_streams(&id, Some(end)) {
                    tracing::info!(worker_id = %id, "stale streams ended: the worker is owned elsewhere or gone");
                    ended.push((id, epoch));
                }
            }
        }
        // Cleared now, not with the `end`s below: a failed take of the
        // commands must not leave these flags set.
        clear_stream_flags(&c, &self.replica_id, &ended).await?;
        ended.clear();
        let (ids, epochs): (Vec<String>, Vec<i64>) = ids
            .into_iter()
            .zip(epochs)
            .zip(beating)
            .filter(|(_, beating)| *beating)
            .map(|(held, _)| held)
            .unzip();
        let rows = c
            .query(
                "DELETE FROM worker_commands WHERE id IN (
                     SELECT c.id FROM worker_commands c
                     JOIN workers w ON w.worker_id = c.worker_id
                     JOIN unnest($1::text[], $2::bigint[]) AS l(worker_id, epoch)
                       ON l.worker_id = w.worker_id AND l.epoch = w.conn_epoch
                     WHERE w.replica_id = $3
                     ORDER BY c.id LIMIT 1000 FOR UPDATE OF c SKIP LOCKED)
                 RETURNING id, worker_id, command",
                &[&ids, &epochs, &self.replica_id],
            )
            .await
            .map_err(db_err)?;
        let mut rows: Vec<(i64, String, String)> = rows
            .into_iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        rows.sort();
        let next_deadline_ms =
            crate::time::now_ms() + self.cfg.heartbeat_interval.as_millis() as i64;
        {
            let mut local = lock(&self.local);
            for (_, worker, text) in rows {
                let Some(w) = local.workers.get(&worker) else {
                    continue;
                };
                let Some(hb) = &w.heartbeat else { continue };
                match decode_command(&text) {
                    Some(Queued::Command(command)) => {
                        let _ = hb.tx.send(HeartbeatEvent::Reply(HeartbeatReply {
                            next_deadline_ms,
                            command: Some(command),
                            revoked_leases: Vec::new(),
                        }));
                    }
                    Some(Queued::End(reason, epoch)) => {
                        if epoch.is_some_and(|e| w.epoch > e) {
                            continue;
                        }
                        if let Some(epoch) =
                            local.end_streams(&worker, Some(Error::precondition(reason)))
                        {
                            ended.push((worker, epoch));
                        }
                    }
                    None => tracing::warn!(worker_id = %worker, "unknown queued command skipped"),
                }
            }
        }
        clear_stream_flags(&c, &self.replica_id, &ended).await
    }

    /// Waiting reason of the pending or failed job at row `id`.
    ///
    /// Errors: storage errors.
    pub(super) async fn waiting_reason(&self, c: &impl GenericClient, id: i64) -> Result<String> {
        let Some(r) = c
            .query_opt(
                "SELECT j.status, j.ready_at_ms, agq_now_ms(), j.worker_selector, j.concurrency_key,
                        j.max_running, j.priority, pv.tools, pv.require_sandbox, pv.require_verified,
                        j.action_id
                 FROM jobs j JOIN plan_versions pv
                   ON pv.plan_id = j.plan_id AND pv.version = j.plan_version
                 WHERE j.id = $1 AND j.status IN (1, 4)",
                &[&id],
            )
            .await
            .map_err(db_err)?
        else {
            return Ok(String::new());
        };
        let status: i16 = r.get(0);
        let ready_at: i64 = r.get(1);
        let now: i64 = r.get(2);
        if ready_at > now || status == super::jobs::FAILED {
            return Ok(if status == super::jobs::FAILED {
                format!(
                    "backing off until {} before the next attempt",
                    crate::time::rfc3339(ready_at)
                )
            } else {
                format!("scheduled for {}", crate::time::rfc3339(ready_at))
            });
        }
        let selector_text: String = r.get(3);
        let key: String = r.get(4);
        let max_running: i32 = r.get(5);
        let priority: i32 = r.get(6);
        let tools: Vec<String> = r.get(7);
        let require_sandbox: bool = r.get(8);
        let require_verified: bool = r.get(9);
        let action_id: String = r.get(10);
        let selector = Selector::parse(&selector_text)
            .map_err(|e| Error::Internal(format!("stored selector: {e}")))?;
        let workers = self.pg_workers_on(c, None, None).await?;
        let runs = |w: &Worker, verified: bool| {
            (!require_sandbox || w.sandboxed)
                && tools.iter().all(|t| {
                    w.capabilities.tools.contains(t) || w.capabilities.agentic_units.contains(t)
                })
                && selector.matches(&w.tags)
                && (!verified
                    || !require_verified
                    || tools
                        .iter()
                        .all(|t| w.verifications.iter().any(|v| &v.tool == t && v.passed)))
        };
        let usable = |w: &Worker| w.state == WorkerState::Active && w.fresh && w.connected;
        let capable: Vec<&Worker> = workers
            .iter()
            .filter(|w| usable(w) && runs(w, true))
            .collect();
        let sel = if selector_text.is_empty() {
            String::new()
        } else {
            format!(" and matches worker selector `{selector_text}`")
        };
        if capable.is_empty() && require_verified {
            let unverified: Vec<&str> = workers
                .iter()
                .filter(|w| usable(w) && runs(w, false))
                .map(|w| w.worker_id.as_str())
                .collect();
            if !unverified.is_empty() {
                return Ok(format!(
                    "no fresh worker has passed a verification of [{}] (the plan sets require_verified_tools); \
                     {} worker(s) advertise them but are not verified ({}): the server challenges them; \
                     see agq worker get ID, or agq worker verify ID TOOL",
                    tools.join(", "),
                    unverified.len(),
                    unverified.join(", ")
                ));
            }
        }
        if capable.is_empty() {
            let sandbox = if require_sandbox {
                " and runs tasks in the kernel sandbox (the plan sets require_sandbox)"
            } else {
                ""
            };
            let quarantined = workers
                .iter()
                .filter(|w| w.state == WorkerState::Quarantined && runs(w, true))
                .count();
            let quarantined = if quarantined > 0 {
                format!(
                    " ({quarantined} worker(s) that could are quarantined: agq worker list --state quarantined)"
                )
            } else {
                String::new()
            };
            let hint = if sel.is_empty() {
                "start or repair a worker that advertises them"
            } else {
                "start a worker with matching tags (agw --tag KEY=VALUE) and those tools"
            };
            return Ok(format!(
                "no fresh worker has tools [{}]{sandbox}{sel}; {hint}{quarantined}",
                tools.join(", ")
            ));
        }
        if !key.is_empty() {
            let running: i64 = c
                .query_one(
                    "SELECT count(*) FROM jobs WHERE status = 2 AND concurrency_key = $1",
                    &[&key],
                )
                .await
                .map_err(db_err)?
                .get(0);
            if running >= i64::from(max_running) {
                return Ok(format!(
                    "concurrency limit of {key} reached ({running} running, max_running {max_running})"
                ));
            }
        }
        if capable
            .iter()
            .all(|w| w.active_leases >= w.max_concurrent_jobs.max(1))
        {
            let slots: u32 = capable.iter().map(|w| w.max_concurrent_jobs.max(1)).sum();
            return Ok(format!(
                "all {} capable workers are busy ({slots} of {slots} slots leased)",
                capable.len()
            ));
        }
        let ahead = c
            .query_one(
                "SELECT count(*) FILTER (WHERE priority > $2),
                        count(*) FILTER (WHERE priority = $2 AND action_id = $3 AND id < $1)
                 FROM jobs WHERE status = 1 AND ready_at_ms <= agq_now_ms()",
                &[&id, &priority, &action_id],
            )
            .await
            .map_err(db_err)?;
        Ok(format!(
            "ready at priority {priority}; {} jobs of higher priority and {} earlier jobs of its action wait ahead of it",
            ahead.get::<_, i64>(0),
            ahead.get::<_, i64>(1)
        ))
    }

    pub(super) async fn pg_queue_stats(&self) -> Result<QueueStats> {
        let c = self.client().await?;
        // One pass over the open jobs for the totals, the depths by
        // priority and those by pool.
        let rows = c.query(QUEUE_STATS, &[]).await.map_err(db_err)?;
        let grouping = |r: &tokio_postgres::Row| r.get::<_, i32>(0);
        let r = rows
            .iter()
            .find(|r| grouping(r) == TOTALS)
            .ok_or_else(|| Error::Internal("queue stats without totals".into()))?;
        let n = |r: &tokio_postgres::Row, i: usize| u64::try_from(r.get::<_, i64>(i)).unwrap_or(0);
        let now: i64 = r
            .get::<_, Option<i64>>(9)
            .unwrap_or_else(crate::time::now_ms);
        let secs = |t: Option<i64>, later: bool| {
            t.map_or(0, |t| {
                let d = if later { t - now } else { now - t };
                u64::try_from(d.max(0) / 1000).unwrap_or(0)
            })
        };
        let mut stats = QueueStats {
            ready_length: n(r, 3),
            scheduled_length: n(r, 4),
            running_length: n(r, 5),
            oldest_ready_age_secs: secs(r.get(6), false),
            next_scheduled_due_in_secs: secs(r.get(7), true),
            newest_job_age_secs: secs(r.get(8), false),
            ..Default::default()
        };
        let depths = |r: &tokio_postgres::Row| Depths {
            ready: n(r, 3),
            scheduled: n(r, 4),
            running: n(r, 5),
        };
        stats.by_priority = rows
            .iter()
            .filter(|r| grouping(r) == BY_PRIORITY)
            .map(|r| PriorityStats {
                priority: r.get(1),
                depths: depths(r),
            })
            .collect();
        let by_pool = deepest_pools(
            rows.iter()
                .filter(|r| grouping(r) == BY_POOL)
                .map(|r| (r.get::<_, String>(2), depths(r), ()))
                .collect(),
        );
        let workers = self.pg_workers_on(&c, None, None).await?;
        for (text, pool_depths, ()) in by_pool {
            let matching = Selector::parse(&text).map_or(0, |s| {
                workers
                    .iter()
                    .filter(|w| w.state == WorkerState::Active && w.fresh && s.matches(&w.tags))
                    .count() as u32
            });
            stats.by_pool.push(PoolStats {
                worker_selector: text,
                depths: pool_depths,
                workers_matching: matching,
            });
        }
        for w in &workers {
            if !w.state.is_live() {
                continue;
            }
            stats.workers_total += 1;
            match w.state {
                WorkerState::Draining => stats.workers_draining += 1,
                WorkerState::Quarantined => stats.workers_quarantined += 1,
                _ => {}
            }
            if !w.fresh {
                stats.workers_stale += 1;
            } else if w.state == WorkerState::Active {
                if w.active_leases > 0 {
                    stats.workers_active += 1;
                } else {
                    stats.workers_idle += 1;
                }
            }
        }
        Ok(stats)
    }

    pub(super) async fn pg_peek(&self, queue: QueueName, count: usize) -> Result<Vec<String>> {
        let c = self.client().await?;
        let sql = match queue {
            // The pending jobs ready now, in lease order: those in the
            // claim's index (`jobs_claim`, walked until the LIMIT) and
            // those scheduled for later that are due but still `delayed`
            // (migration 4; a dispatcher round clears it), looked for
            // only when the earliest delayed one (`jobs_delayed`'s first
            // entry) is due, up to now (evaluated once: a bound of the
            // index range, which `agq_now_ms()`, volatile, cannot be).
            QueueName::Ready => {
                "SELECT job_id FROM (
                     (SELECT job_id, priority, id FROM jobs
                      WHERE status = 1 AND NOT delayed AND ready_at_ms <= agq_now_ms()
                      ORDER BY priority DESC, id LIMIT $1)
                     UNION ALL
                     (SELECT job_id, priority, id FROM jobs
                      WHERE status = 1 AND delayed AND ready_at_ms <= (SELECT agq_now_ms())
                        AND (SELECT min(ready_at_ms) FROM jobs WHERE status = 1 AND delayed)
                            <= (SELECT agq_now_ms()))) r
                 ORDER BY priority DESC, id LIMIT $1"
            }
            // Pending jobs due later (always `delayed`: `jobs_delayed`)
            // and failed ones backing off (`jobs_backoff`), each walked in
            // its index's order, up to `count` each: the old jobs kept by
            // retention are never read. (One statement with an OR read
            // the whole table.)
            QueueName::Scheduled => {
                "SELECT job_id FROM (
                     (SELECT job_id, ready_at_ms, id FROM jobs
                      WHERE status = 1 AND delayed AND ready_at_ms > (SELECT agq_now_ms())
                      ORDER BY ready_at_ms, id LIMIT $1)
                     UNION ALL
                     (SELECT job_id, ready_at_ms, id FROM jobs
                      WHERE status = 4 ORDER BY ready_at_ms, id LIMIT $1)) s
                 ORDER BY ready_at_ms, id LIMIT $1"
            }
        };
        Ok(c.query(sql, &[&(count as i64)])
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect())
    }
}

/// Clears the stream flags of the workers `ended` (worker id, epoch)
/// whose streams this replica ended from memory (a delivered `end`, a
/// refused beat, a stale stream): the streams' close handlers then find no
/// entry and write nothing, and the row would read `connected` until the
/// worker registered again. Fenced by this replica and the epoch: a worker
/// owned elsewhere since, or connected again, keeps its flags. A live
/// worker whose heartbeat stream was open becomes suspect, as when the
/// stream closes.
///
/// Errors: storage errors.
pub(super) async fn clear_stream_flags(
    c: &impl GenericClient,
    replica_id: &str,
    ended: &[(String, i64)],
) -> Result<()> {
    if ended.is_empty() {
        return Ok(());
    }
    let (ids, epochs): (Vec<&str>, Vec<i64>) = ended.iter().map(|(i, e)| (i.as_str(), *e)).unzip();
    c.execute(
        "UPDATE workers w SET heartbeat_open = false, lease_stream_open = false,
                suspect_since_ms = CASE WHEN w.heartbeat_open AND w.state = ANY($4)
                                        THEN agq_now_ms() ELSE w.suspect_since_ms END
         FROM unnest($1::text[], $2::bigint[]) AS l(worker_id, epoch)
         WHERE w.worker_id = l.worker_id AND w.replica_id = $3 AND w.conn_epoch = l.epoch",
        &[&ids, &epochs, &replica_id, &LIVE.to_vec()],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

/// Queues the end of worker `id`'s streams opened so far (those of its
/// current connection epoch and before).
///
/// Errors: storage errors.
pub(super) async fn queue_end(c: &impl GenericClient, id: &str, reason: &str) -> Result<()> {
    c.execute(
        "INSERT INTO worker_commands (worker_id, command, created_at_ms)
         VALUES ($1, json_build_object('end', $2::text,
                     'epoch', (SELECT conn_epoch FROM workers WHERE worker_id = $1))::text,
                 agq_now_ms())",
        &[&id, &reason],
    )
    .await
    .map_err(db_err)?;
    super::notify_names(c, super::COMMAND_CHANNEL, &[id.to_string()]).await
}

/// Queues again, for worker `id`'s new heartbeat stream, the challenges it
/// has not answered: one sent on an earlier stream may have been lost with
/// it. Same challenge ids: an answer to either copy settles the challenge,
/// a second answer is ignored.
///
/// Errors: storage errors; `Internal` for stored arguments that are not a
/// JSON array of strings.
async fn resend_pending(c: &impl GenericClient, id: &str) -> Result<()> {
    let pending = c
        .query(
            "SELECT challenge_id, tool, args FROM worker_challenges WHERE worker_id = $1
             ORDER BY requested_at_ms, challenge_id",
            &[&id],
        )
        .await
        .map_err(db_err)?;
    for r in pending {
        let args: String = r.get(2);
        let args: Vec<String> =
            serde_json::from_str(&args).map_err(|e| Error::Internal(e.to_string()))?;
        let cmd = WorkerCommand::Verify {
            challenge_id: r.get(0),
            command: r.get(1),
            args,
        };
        queue_command(c, id, &cmd).await?;
    }
    Ok(())
}

/// Records a challenge of worker `id` to run `command` with `args` and
/// queues it.
///
/// Errors: storage errors.
async fn challenge(
    c: &impl GenericClient,
    id: &str,
    command: &str,
    args: Vec<String>,
) -> Result<Verification> {
    let challenge_id = uuid::Uuid::new_v4().to_string();
    let args_json = serde_json::to_string(&args).map_err(|e| Error::Internal(e.to_string()))?;
    c.execute(
        "DELETE FROM worker_challenges WHERE worker_id = $1 AND tool = $2",
        &[&id, &command],
    )
    .await
    .map_err(db_err)?;
    let requested: i64 = c
        .query_one(
            "INSERT INTO worker_challenges (challenge_id, worker_id, tool, args, requested_at_ms)
             VALUES ($1, $2, $3, $4, agq_now_ms()) RETURNING requested_at_ms",
            &[&challenge_id, &id, &command, &args_json],
        )
        .await
        .map_err(db_err)?
        .get(0);
    queue_command(
        c,
        id,
        &WorkerCommand::Verify {
            challenge_id: challenge_id.clone(),
            command: command.to_string(),
            args: args.clone(),
        },
    )
    .await?;
    tracing::info!(worker_id = id, command, challenge_id = %challenge_id, "capability challenge sent");
    Ok(Verification {
        tool: command.to_string(),
        args,
        challenge_id,
        requested_at_ms: requested,
        answered_at_ms: None,
        passed: false,
        exit_code: -1,
        output: String::new(),
        error: String::new(),
    })
}

/// The challenge loop: challenges the workers connected here for the
/// tools of plans with `require_verified_tools` they have not passed,
/// woken by `NOTIFY agq_verify` (such a plan stored on any replica) and at
/// every (re)connect of the listener (notifications sent meanwhile are
/// lost), and every [`super::CHALLENGE_SWEEP`] as a fallback (a sweep that
/// failed).
pub(super) async fn challenge_loop(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    while wait(&engine.verify_wake, super::CHALLENGE_SWEEP, &mut stop).await {
        let r = engine.challenge_all_missing().await;
        if let Err(e) = engine.observe(r) {
            tracing::warn!(error = %e, "capability challenges not sent; retrying");
        }
    }
}

/// The command pump: delivers queued commands to the workers connected
/// here, woken by `NOTIFY agq_commands` and polling as a fallback.
pub(super) async fn command_pump(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    while wait(&engine.commands_wake, POLL_INTERVAL, &mut stop).await {
        let r = engine.deliver_commands().await;
        if let Err(e) = engine.observe(r) {
            tracing::debug!(error = %e, "command delivery failed; retrying");
        }
    }
}
