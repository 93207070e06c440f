//! The dispatcher of one replica: it claims ready jobs for the workers
//! whose streams this replica holds and pushes the leases after the
//! commit. A round is one transaction for all of them: lock their rows
//! (each still ACTIVE, fresh by the database's clock, and owned by this
//! replica at the same `conn_epoch`), pick ready jobs each class of
//! workers (same tools, sandbox, verified tools and matching selectors)
//! can run, in lease order (`priority DESC, id`, walking the partial index
//! `jobs_claim`) with `FOR UPDATE SKIP LOCKED` so replicas never wait on
//! each other's rows, hold concurrency keys under a transaction-level
//! advisory lock while counting their running jobs, share the jobs out
//! to the least loaded workers, and grant them all in one
//! `UPDATE … FROM unnest(…)`. It wakes on `NOTIFY agq_ready`, a freed
//! slot, a stream opened here, and polls every [`POLL_INTERVAL`] so that a
//! lost notification only delays.
//!
//! Jobs submitted with a `run_at` ahead are pending but `delayed`
//! (migration 4): out of `jobs_claim`, so that no claim walks past them.
//! A round that finds some due first clears their `delayed` (walking
//! `jobs_delayed` from the earliest), then claims: a job scheduled for
//! later is leased within a poll interval of its `run_at`, as when it
//! stayed in the claim's index, and in the same order.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
};

use super::{cached, db_err, lock, rows, wait, PgEngine, POLL_INTERVAL};
use crate::{
    core::{
        model::{JobLease, JobStatus, WorkerState},
        selector::Selector,
    },
    error::{Error, Result},
};

/// A worker the dispatcher may lease to.
struct Candidate {
    id: String,
    epoch: i64,
    tools: Vec<String>,
    tags: HashMap<String, String>,
    sandboxed: bool,
    max: u32,
}

/// Workers that can run the same jobs: (tools, sandboxed, verified
/// tools, matching selectors), each sorted.
type Class = (Vec<String>, bool, Vec<String>, Vec<String>);

/// A ready job a claim picked: (row id, concurrency key, its limit).
type Picked = (i64, String, i32);

/// The round's first statement, outside its transaction: whether a job
/// the claim can see is ready now, and whether a delayed job (submitted
/// with a `run_at` ahead: out of `jobs_claim` until due; migration 4) is
/// due. Each reads the first entry of a partial index, however many jobs
/// are scheduled for later: the first in lease order of `jobs_claim` (a
/// pending job there is ready from when it was written), and the
/// earliest of `jobs_delayed` (`min`, which the planner reads off the
/// index). Both are written so that a table scan would cost the planner
/// more (a sort, an aggregate of every row), whatever its statistics.
pub const READY_CHECK: &str = "SELECT
     coalesce((SELECT true FROM jobs WHERE status = 1 AND NOT delayed AND ready_at_ms <= agq_now_ms()
               ORDER BY priority DESC, id LIMIT 1), false),
     coalesce((SELECT min(ready_at_ms) FROM jobs WHERE status = 1 AND delayed) <= agq_now_ms(), false)";

/// Delayed jobs that are due, [`PROMOTE_BATCH`] at most, earliest first,
/// join the claimable ones (`jobs_claim`): only the column `delayed`
/// changes (the job was pending and stays so). It walks `jobs_delayed`
/// from the earliest up to now (`(SELECT agq_now_ms())`, evaluated once,
/// bounds the index range; the function itself, volatile, could only
/// filter), and updates the rows by primary key (`= ANY(ARRAY(…))`: an
/// `IN (…)` of up to 10,000 rows is planned as a hash join over a scan of
/// every job). Rows another transaction holds are skipped, for the next
/// round.
const PROMOTE_DUE: &str = "UPDATE jobs SET delayed = false
     WHERE id = ANY(ARRAY(SELECT id FROM jobs
                          WHERE status = 1 AND delayed AND ready_at_ms <= (SELECT agq_now_ms())
                          ORDER BY ready_at_ms LIMIT 10000 FOR UPDATE SKIP LOCKED))";

/// The LIMIT of [`PROMOTE_DUE`] (keep the two equal): a batch this large
/// may have left more.
const PROMOTE_BATCH: u64 = 10_000;

/// Settings of the round's transaction, set before [`CLAIM`]: the claim
/// must walk `jobs_claim` in lease order and stop at its LIMIT; the
/// planner, misjudging how many rows the plan filter keeps, would
/// otherwise sort every ready job (milliseconds per claim with a backlog).
pub const CLAIM_SETTINGS: &str = "SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off";

/// The claim of one class of workers: ready jobs it can run, in lease
/// order. Parameters: $1 the class's tools (`text[]`), $2 sandboxed,
/// $3 its verified tools (`text[]`), $4 the selectors it matches
/// (`text[]`), $5 how many (`bigint`), $6 row ids already picked for an
/// earlier class (`bigint[]`). Public so that tests can check its plan.
pub const CLAIM: &str = "SELECT j.id, j.concurrency_key, j.max_running FROM jobs j
     JOIN plan_versions pv ON pv.plan_id = j.plan_id AND pv.version = j.plan_version
     WHERE j.status = 1 AND NOT j.delayed AND j.ready_at_ms <= agq_now_ms()
       AND pv.tools <@ $1 AND (NOT pv.require_sandbox OR $2)
       AND (NOT pv.require_verified OR pv.tools <@ $3)
       AND j.worker_selector = ANY($4) AND NOT (j.id = ANY($6))
       AND (j.concurrency_key = ''
            OR (SELECT count(*) FROM jobs r
                WHERE r.status = 2 AND r.concurrency_key = j.concurrency_key)
               < j.max_running)
     ORDER BY j.priority DESC, j.id
     LIMIT $5 FOR UPDATE OF j SKIP LOCKED";

/// The dispatcher loop.
pub(super) async fn run(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    while wait(&engine.dispatch_wake, POLL_INTERVAL, &mut stop).await {
        // Rounds repeat while they lease: more jobs may be ready.
        for _ in 0..64 {
            match engine.dispatch_round().await {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    let _ = engine.observe::<()>(Err(e));
                    break;
                }
            }
        }
    }
}

impl PgEngine {
    /// One round over the local workers; true when it leased something
    /// (another round may lease more).
    ///
    /// Errors: storage errors.
    async fn dispatch_round(&self) -> Result<bool> {
        let candidates: Vec<Candidate> = {
            let local = lock(&self.local);
            let mut v: Vec<Candidate> = local
                .workers
                .iter()
                .filter(|(_, w)| {
                    w.epoch >= 0 && w.lease.as_ref().is_some_and(|l| !l.tx.is_closed())
                })
                .map(|(id, w)| Candidate {
                    id: id.clone(),
                    epoch: w.epoch,
                    tools: w.tools.clone(),
                    tags: w.tags.clone(),
                    sandboxed: w.sandboxed,
                    max: w.max,
                })
                .collect();
            // Rows are locked in id order.
            v.sort_by(|a, b| a.id.cmp(&b.id));
            v
        };
        if candidates.is_empty() {
            return Ok(false);
        }
        let mut client = self.client().await?;
        let check = client
            .query_one(&cached(&client, READY_CHECK).await?, &[])
            .await
            .map_err(db_err)?;
        let (ready, due): (bool, bool) = (check.get(0), check.get(1));
        if due {
            // Every delayed job due now joins the claimable ones before
            // the claim, so that it picks in lease order among all the
            // jobs ready now, as if none had been delayed.
            let promote = cached(&client, PROMOTE_DUE).await?;
            while client.execute(&promote, &[]).await.map_err(db_err)? >= PROMOTE_BATCH {}
        }
        if !ready && !due {
            return Ok(false);
        }
        let selectors: Vec<(String, Option<Selector>)> = client
            .query(
                &cached(&client, "SELECT selector FROM selectors").await?,
                &[],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| {
                let text: String = r.get(0);
                let parsed = Selector::parse(&text).ok();
                (text, parsed)
            })
            .collect();
        let tx = client.transaction().await.map_err(db_err)?;
        tx.batch_execute(CLAIM_SETTINGS).await.map_err(db_err)?;
        let ids: Vec<String> = candidates.iter().map(|w| w.id.clone()).collect();
        let found: HashMap<String, tokio_postgres::Row> = tx
            .query(
                &cached(&tx, "SELECT w.worker_id, w.state, w.conn_epoch, w.replica_id,
                        (SELECT count(*) FROM jobs r WHERE r.status = 2 AND r.worker_id = w.worker_id),
                        ARRAY(SELECT v.tool FROM worker_verifications v
                              WHERE v.worker_id = w.worker_id AND v.passed ORDER BY v.tool),
                        w.last_heartbeat_at_ms > agq_now_ms() - $2 AND w.suspect_since_ms IS NULL
                 FROM workers w WHERE w.worker_id = ANY($1) ORDER BY w.worker_id FOR UPDATE").await?,
                &[&ids, &self.stale_ms()],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| (r.get::<_, String>(0), r))
            .collect();
        // Free slots of the workers that may lease (by candidate index),
        // their loads, and their classes.
        let mut free = vec![0usize; candidates.len()];
        let mut load = vec![0i64; candidates.len()];
        let mut classes: BTreeMap<Class, Vec<usize>> = BTreeMap::new();
        let mut moved = Vec::new();
        for (i, w) in candidates.iter().enumerate() {
            let Some(r) = found.get(&w.id) else { continue };
            let state: i16 = r.get(1);
            let epoch: i64 = r.get(2);
            let owner: Option<String> = r.get(3);
            if owner.as_deref() != Some(self.replica_id.as_str()) || epoch != w.epoch {
                // Another replica (or a newer stream here) holds the worker.
                moved.push(i);
                continue;
            }
            // Only ACTIVE, fresh (a heartbeat, or the registration, within
            // 3 x the interval, by the database's clock) and not suspect
            // (its heartbeat stream dropped: what it leased now would be
            // taken back after the grace, each time costing an attempt).
            if state != WorkerState::Active as i16 || !r.get::<_, bool>(6) {
                continue;
            }
            let running: i64 = r.get(4);
            load[i] = running;
            free[i] = usize::try_from(i64::from(w.max) - running).unwrap_or(0);
            if free[i] == 0 {
                continue;
            }
            let mut tools = w.tools.clone();
            tools.sort();
            let matching: Vec<String> = selectors
                .iter()
                .filter(|(_, s)| s.as_ref().is_some_and(|s| s.matches(&w.tags)))
                .map(|(t, _)| t.clone())
                .collect();
            let class = (tools, w.sandboxed, r.get::<_, Vec<String>>(5), matching);
            classes.entry(class).or_default().push(i);
        }
        if !moved.is_empty() {
            let mut local = lock(&self.local);
            for i in moved {
                let w = &candidates[i];
                if let Some(l) = local.workers.get_mut(&w.id) {
                    if l.epoch == w.epoch {
                        l.epoch = -1;
                    }
                }
            }
        }
        if classes.is_empty() {
            return Ok(false);
        }
        // Ready jobs each class can run, in lease order; a job already
        // picked for an earlier class is not picked again. Jobs of a
        // concurrency key already at its limit are passed over (counted
        // here without the key's lock: the locked count below decides),
        // so a saturated key's backlog never keeps other jobs from free
        // slots.
        let mut picked: Vec<i64> = Vec::new();
        let mut by_class: Vec<(Vec<usize>, Vec<Picked>)> = Vec::new();
        for ((tools, sandboxed, verified, matching), members) in classes {
            let want: usize = members.iter().map(|i| free[*i]).sum();
            let rows = tx
                .query(
                    &cached(&tx, CLAIM).await?,
                    &[
                        &tools,
                        &sandboxed,
                        &verified,
                        &matching,
                        &((want + 32) as i64),
                        &picked,
                    ],
                )
                .await
                .map_err(db_err)?;
            let jobs: Vec<Picked> = rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect();
            picked.extend(jobs.iter().map(|j| j.0));
            by_class.push((members, jobs));
        }
        // Concurrency keys: every replica counts a key's running jobs under
        // the same advisory lock (taken in key order: no deadlock), so two
        // claims never both see room for the last slot.
        let mut keys: Vec<&str> = by_class
            .iter()
            .flat_map(|(_, jobs)| jobs.iter().map(|j| j.1.as_str()))
            .filter(|k| !k.is_empty())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        keys.sort();
        // Jobs running per key, counted under the keys' locks and kept up
        // to date as this round grants: a job may start while its key runs
        // fewer than its own action's max_running (actions sharing a key
        // may set different limits).
        let mut running: HashMap<String, i64> = HashMap::new();
        if !keys.is_empty() {
            for k in &keys {
                tx.execute(
                    &cached(
                        &tx,
                        "SELECT pg_advisory_xact_lock(hashtextextended('agq concurrency key ' || $1, 0))",
                    )
                    .await?,
                    &[k],
                )
                .await
                .map_err(db_err)?;
            }
            running = tx
                .query(
                    &cached(
                        &tx,
                        "SELECT concurrency_key, count(*) FROM jobs
                     WHERE status = 2 AND concurrency_key = ANY($1) GROUP BY concurrency_key",
                    )
                    .await?,
                    &[&keys],
                )
                .await
                .map_err(db_err)?
                .into_iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect();
        }
        // Each class's jobs, in lease order, to its least loaded worker
        // with a free slot (ties: the earlier worker).
        let mut grant_ids: Vec<i64> = Vec::new();
        let mut grant_workers: Vec<String> = Vec::new();
        for (members, jobs) in by_class {
            let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(i64, usize)>> = members
                .iter()
                .filter(|i| free[**i] > 0)
                .map(|i| std::cmp::Reverse((load[*i], *i)))
                .collect();
            for (id, k, max) in jobs {
                let Some(std::cmp::Reverse((l, i))) = heap.pop() else {
                    break;
                };
                if !k.is_empty() {
                    let n = running.entry(k).or_insert(0);
                    if *n >= i64::from(max) {
                        heap.push(std::cmp::Reverse((l, i)));
                        continue;
                    }
                    *n += 1;
                }
                grant_ids.push(id);
                grant_workers.push(candidates[i].id.clone());
                free[i] -= 1;
                load[i] += 1;
                if free[i] > 0 {
                    heap.push(std::cmp::Reverse((l + 1, i)));
                }
            }
        }
        if grant_ids.is_empty() {
            return Ok(false);
        }
        let leases: Vec<String> = grant_ids
            .iter()
            .map(|_| uuid::Uuid::now_v7().to_string())
            .collect();
        let timeout = i64::try_from(self.cfg.job_timeout.as_millis()).unwrap_or(i64::MAX / 4);
        let grant_sql = format!(
            "UPDATE jobs j SET status = 2, worker_id = g.worker, lease_id = g.lease,
                            attempt = j.attempt + 1, started_at_ms = agq_now_ms(),
                            lease_expires_at_ms = agq_now_ms() + $4, current_task = 0,
                            progress_percent = 0
                     FROM unnest($1::bigint[], $2::text[], $3::text[]) AS g(id, worker, lease),
                          actions a
                     WHERE j.id = g.id AND a.action_id = j.action_id
                     RETURNING {}, a.traceparent, j.lease_id, j.lease_expires_at_ms, j.ready_at_ms,
                               (SELECT {} FROM plan_versions pv
                                WHERE pv.plan_id = j.plan_id AND pv.version = j.plan_version)",
            rows::JOB_COLS,
            rows::PLAN_STAMP
        );
        let granted = tx
            .query(
                &cached(&tx, &grant_sql).await?,
                &[&grant_ids, &grant_workers, &leases, &timeout],
            )
            .await
            .map_err(db_err)?;
        let mut out = Vec::with_capacity(granted.len());
        let mut unreadable = Vec::new();
        for r in &granted {
            let job = rows::job(r)?;
            let stamp: Option<String> = r.get(24);
            let plan = match self
                .plan_version(&tx, &job.plan_id, job.plan_version, stamp.as_deref())
                .await
            {
                Ok(Some(plan)) => plan,
                // A plan version that cannot be read (a body that does not
                // decode, a row gone) would fail this grant, and every
                // later one that claims the job: the replica would lease
                // nothing more. The job alone is dead instead.
                Ok(None) | Err(Error::Internal(_)) => {
                    let id: i64 = r.get(18);
                    let why = format!(
                        "its plan {} version {} cannot be read from the database",
                        job.plan_id, job.plan_version
                    );
                    tracing::error!(job_id = %job.job_id, "{why}: the job is dead");
                    self.end_attempt(&tx, id, None, &why, true, true).await?;
                    unreadable.push(job.action_id);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let traceparent: Option<String> = r.get(20);
            let lease_id: String = r.get(21);
            let expires_at_ms: i64 = r.get(22);
            let ready_at_ms: i64 = r.get(23);
            let now: i64 = r.get(19);
            out.push((
                JobLease {
                    lease_id,
                    attempt: job.attempt,
                    expires_at_ms,
                    traceparent: traceparent.map(Arc::from),
                    plan,
                    job,
                },
                (now - ready_at_ms).max(0),
            ));
        }
        // The leases count as in flight before they are committed: a
        // heartbeat with held leases that reads one of them from the
        // database (so after this commit) then finds it in flight, not
        // lost (see `pg_heartbeat`). A commit that fails takes them out.
        self.mark_in_flight(out.iter().map(|(l, _)| l), true);
        if let Err(e) = tx.commit().await {
            self.mark_in_flight(out.iter().map(|(l, _)| l), false);
            return Err(db_err(e));
        }
        let n = out.len();
        let mut actions = unreadable;
        {
            let mut local = lock(&self.local);
            let pushed = std::time::Instant::now();
            let window = self.cfg.stale_after();
            for (lease, waited_ms) in out {
                self.metrics.transition(JobStatus::Running);
                self.metrics
                    .enqueue_to_lease
                    .observe(waited_ms as f64 / 1000.0);
                actions.push(lease.job.action_id.clone());
                // A closed stream: the lease stays granted; the worker's
                // next heartbeat (held leases) or its grace re-queues it.
                let Some(l) = local.workers.get_mut(&lease.job.worker_id) else {
                    continue;
                };
                // Forgetting the old ones now and then (not at every push)
                // keeps the map at about the leases of the last window.
                if l.in_flight.len() >= 64 + 4 * l.max as usize {
                    l.in_flight
                        .retain(|_, at| pushed.duration_since(*at) < window);
                }
                l.in_flight.insert(lease.lease_id.clone(), pushed);
                if let Some(s) = &l.lease {
                    let _ = s.tx.send(lease);
                }
            }
        }
        self.granted
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        self.touch(actions.iter().map(String::as_str));
        Ok(n > 0)
    }

    /// Records `leases` as in flight to their workers connected here
    /// (`add`), or forgets them (not `add`: their grant did not commit).
    /// The push after the commit records them again, in case a new lease
    /// stream of the worker let them go in between.
    fn mark_in_flight<'a>(&self, leases: impl Iterator<Item = &'a JobLease>, add: bool) {
        let mut local = lock(&self.local);
        let now = std::time::Instant::now();
        for lease in leases {
            if let Some(l) = local.workers.get_mut(&lease.job.worker_id) {
                if add {
                    l.in_flight.insert(lease.lease_id.clone(), now);
                } else {
                    l.in_flight.remove(&lease.lease_id);
                }
            }
        }
    }
}
