//! The dispatcher of one replica: it claims ready jobs for the workers
//! whose streams this replica holds and pushes the leases after the
//! commit. A claim is one transaction per worker: lock the worker's row
//! (still ACTIVE, still owned by this replica at the same `conn_epoch`),
//! pick up to its free slots of ready jobs it can run in lease order
//! (`priority DESC, id`, matching the partial index `jobs_claim`) with
//! `FOR UPDATE SKIP LOCKED` so replicas never wait on each other's rows,
//! hold concurrency keys under a transaction-level advisory lock while
//! counting their running jobs, and grant them in one `UPDATE … FROM
//! unnest(…)`. It wakes on `NOTIFY agq_ready`, a freed slot, a stream
//! opened here, and polls every [`POLL_INTERVAL`] so that a lost
//! notification only delays.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use super::{db_err, lock, rows, wait, PgEngine, POLL_INTERVAL};
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

/// The dispatcher loop.
pub(super) async fn run(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    while wait(&engine.dispatch_wake, POLL_INTERVAL, &mut stop).await {
        // Rounds repeat while some worker filled all its free slots: more
        // jobs may be ready.
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
    /// One round over the local workers; true when another round may
    /// lease more.
    ///
    /// Errors: storage errors.
    async fn dispatch_round(&self) -> Result<bool> {
        let candidates: Vec<Candidate> = {
            let local = lock(&self.local);
            local
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
                .collect()
        };
        if candidates.is_empty() {
            return Ok(false);
        }
        let c = self.client().await?;
        let ready: bool = c
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM jobs WHERE status = 1 AND ready_at_ms <= agq_now_ms())",
                &[],
            )
            .await
            .map_err(db_err)?
            .get(0);
        if !ready {
            return Ok(false);
        }
        let selectors: Vec<(String, Option<Selector>)> = c
            .query("SELECT selector FROM selectors", &[])
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| {
                let text: String = r.get(0);
                let parsed = Selector::parse(&text).ok();
                (text, parsed)
            })
            .collect();
        // Least loaded first: the ready jobs (at most the free slots) are
        // shared out one at a time to the worker with the fewest leases,
        // and each worker then claims its share in one transaction.
        let ids: Vec<String> = candidates.iter().map(|w| w.id.clone()).collect();
        let loads: HashMap<String, i64> = c
            .query(
                "SELECT worker_id, count(*) FROM jobs WHERE status = 2 AND worker_id = ANY($1)
                 GROUP BY worker_id",
                &[&ids],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let free: Vec<i64> = candidates
            .iter()
            .map(|w| (i64::from(w.max) - loads.get(&w.id).copied().unwrap_or(0)).max(0))
            .collect();
        let total_free: i64 = free.iter().sum();
        if total_free == 0 {
            return Ok(false);
        }
        let ready: i64 = c
            .query_one(
                "SELECT count(*) FROM (SELECT 1 FROM jobs WHERE status = 1
                     AND ready_at_ms <= agq_now_ms() LIMIT $1) r",
                &[&total_free],
            )
            .await
            .map_err(db_err)?
            .get(0);
        drop(c);
        let shares = share_out(&candidates, &loads, &free, ready);
        let matching = |w: &Candidate| -> Vec<String> {
            selectors
                .iter()
                .filter(|(_, s)| s.as_ref().is_some_and(|s| s.matches(&w.tags)))
                .map(|(t, _)| t.clone())
                .collect()
        };
        let mut granted_total = 0i64;
        let mut left = free.clone();
        for (i, (w, share)) in candidates.iter().zip(shares).enumerate() {
            if share == 0 {
                continue;
            }
            let (granted, _) = self.claim(w, &matching(w), share).await?;
            granted_total += granted as i64;
            left[i] -= granted as i64;
        }
        // Shares a worker could not use (jobs it cannot run) go to the
        // others, least loaded first.
        let mut order: Vec<usize> = (0..candidates.len()).filter(|i| left[*i] > 0).collect();
        order.sort_by_key(|i| {
            let w = &candidates[*i];
            (
                loads.get(&w.id).copied().unwrap_or(0) + free[*i] - left[*i],
                *i,
            )
        });
        for i in order {
            let rest = ready - granted_total;
            if rest <= 0 {
                break;
            }
            let w = &candidates[i];
            let share = usize::try_from(rest.min(left[i])).unwrap_or(0);
            let (granted, _) = self.claim(w, &matching(w), share).await?;
            granted_total += granted as i64;
        }
        Ok(granted_total > 0)
    }

    /// Claims up to `share` of the free slots of worker `w` and pushes
    /// the leases. Returns (granted, slots it could take).
    ///
    /// Errors: storage errors.
    async fn claim(
        &self,
        w: &Candidate,
        selectors: &[String],
        share: usize,
    ) -> Result<(usize, usize)> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let Some(r) = tx
            .query_opt(
                "SELECT w.state, w.conn_epoch, w.replica_id,
                        (SELECT count(*) FROM jobs r WHERE r.status = 2 AND r.worker_id = w.worker_id),
                        ARRAY(SELECT v.tool FROM worker_verifications v
                              WHERE v.worker_id = w.worker_id AND v.passed),
                        w.last_heartbeat_at_ms > agq_now_ms() - $2
                 FROM workers w WHERE w.worker_id = $1 FOR UPDATE",
                &[&w.id, &self.stale_ms()],
            )
            .await
            .map_err(db_err)?
        else {
            return Ok((0, 0));
        };
        let state: i16 = r.get(0);
        let epoch: i64 = r.get(1);
        let owner: Option<String> = r.get(2);
        if owner.as_deref() != Some(self.replica_id.as_str()) || epoch != w.epoch {
            // Another replica (or a newer stream here) holds the worker.
            let mut local = lock(&self.local);
            if let Some(l) = local.workers.get_mut(&w.id) {
                if l.epoch == w.epoch {
                    l.epoch = -1;
                }
            }
            return Ok((0, 0));
        }
        // Only ACTIVE and fresh (a heartbeat, or the registration, within
        // 3 x the interval, by the database's clock).
        if state != WorkerState::Active as i16 || !r.get::<_, bool>(5) {
            return Ok((0, 0));
        }
        let running = usize::try_from(r.get::<_, i64>(3)).unwrap_or(usize::MAX);
        let free = (w.max as usize).saturating_sub(running).min(share);
        if free == 0 {
            return Ok((0, 0));
        }
        let verified: Vec<String> = r.get(4);
        let found = tx
            .query(
                "SELECT j.id, j.concurrency_key, j.max_running FROM jobs j
                 JOIN plan_versions pv ON pv.plan_id = j.plan_id AND pv.version = j.plan_version
                 WHERE j.status = 1 AND j.ready_at_ms <= agq_now_ms()
                   AND pv.tools <@ $1 AND (NOT pv.require_sandbox OR $2)
                   AND (NOT pv.require_verified OR pv.tools <@ $3)
                   AND j.worker_selector = ANY($4)
                 ORDER BY j.priority DESC, j.id
                 LIMIT $5 FOR UPDATE OF j SKIP LOCKED",
                &[
                    &w.tools,
                    &w.sandboxed,
                    &verified,
                    &selectors,
                    &((free + 32) as i64),
                ],
            )
            .await
            .map_err(db_err)?;
        let mut keys: Vec<String> = found
            .iter()
            .map(|r| r.get::<_, String>(1))
            .filter(|k| !k.is_empty())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        keys.sort();
        // Concurrency keys: every replica counts a key's running jobs under
        // the same advisory lock (taken in key order: no deadlock), so two
        // claims never both see room for the last slot.
        let mut room: HashMap<String, i64> = HashMap::new();
        if !keys.is_empty() {
            for k in &keys {
                tx.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended('agq concurrency key ' || $1, 0))",
                    &[k],
                )
                .await
                .map_err(db_err)?;
            }
            let counts: HashMap<String, i64> = tx
                .query(
                    "SELECT concurrency_key, count(*) FROM jobs
                     WHERE status = 2 AND concurrency_key = ANY($1) GROUP BY concurrency_key",
                    &[&keys],
                )
                .await
                .map_err(db_err)?
                .into_iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect();
            for r in &found {
                let k: String = r.get(1);
                if !k.is_empty() && !room.contains_key(&k) {
                    let max = i64::from(r.get::<_, i32>(2));
                    room.insert(k.clone(), max - counts.get(&k).copied().unwrap_or(0));
                }
            }
        }
        let mut ids = Vec::new();
        for r in &found {
            if ids.len() == free {
                break;
            }
            let k: String = r.get(1);
            if !k.is_empty() {
                let left = room.entry(k).or_insert(0);
                if *left <= 0 {
                    continue;
                }
                *left -= 1;
            }
            ids.push(r.get::<_, i64>(0));
        }
        if ids.is_empty() {
            return Ok((0, free));
        }
        let leases: Vec<String> = ids
            .iter()
            .map(|_| uuid::Uuid::now_v7().to_string())
            .collect();
        let timeout = i64::try_from(self.cfg.job_timeout.as_millis()).unwrap_or(i64::MAX / 4);
        let granted = tx
            .query(
                &format!(
                    "UPDATE jobs j SET status = 2, worker_id = $2, lease_id = g.lease,
                            attempt = j.attempt + 1, started_at_ms = agq_now_ms(),
                            lease_expires_at_ms = agq_now_ms() + $4, current_task = 0,
                            progress_percent = 0
                     FROM unnest($1::bigint[], $3::text[]) AS g(id, lease), actions a
                     WHERE j.id = g.id AND a.action_id = j.action_id
                     RETURNING {}, a.traceparent, j.lease_id, j.lease_expires_at_ms, j.ready_at_ms",
                    rows::JOB_COLS
                ),
                &[&ids, &w.id, &leases, &timeout],
            )
            .await
            .map_err(db_err)?;
        let mut out = Vec::with_capacity(granted.len());
        for r in &granted {
            let job = rows::job(r)?;
            let plan = self
                .plan_version(&tx, &job.plan_id, job.plan_version)
                .await?
                .ok_or_else(|| Error::Internal(format!("plan {} vanished", job.plan_id)))?;
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
        tx.commit().await.map_err(db_err)?;
        let n = out.len();
        let mut actions = Vec::with_capacity(n);
        {
            let mut local = lock(&self.local);
            let slot = local.workers.get_mut(&w.id);
            let (tx, in_flight) = match slot {
                Some(l) => (
                    l.lease.as_ref().map(|s| s.tx.clone()),
                    Some(&mut l.in_flight),
                ),
                None => (None, None),
            };
            let mut in_flight = in_flight;
            for (lease, waited_ms) in out {
                self.metrics.transition(JobStatus::Running);
                self.metrics
                    .enqueue_to_lease
                    .observe(waited_ms as f64 / 1000.0);
                actions.push(lease.job.action_id.clone());
                if let Some(f) = in_flight.as_deref_mut() {
                    f.insert(lease.lease_id.clone());
                }
                // A closed stream: the lease stays granted; the worker's
                // next heartbeat (held leases) or its grace re-queues it.
                if let Some(tx) = &tx {
                    let _ = tx.send(lease);
                }
            }
        }
        self.granted
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        self.touch(actions.iter().map(String::as_str));
        Ok((n, free))
    }
}

/// Shares `ready` jobs out over `workers` one at a time, each to the
/// worker with the fewest leases (its current `loads` plus its share so
/// far) among those with a free slot left; ties go to the earlier
/// worker. Returns each worker's share.
fn share_out(
    workers: &[Candidate],
    loads: &HashMap<String, i64>,
    free: &[i64],
    ready: i64,
) -> Vec<usize> {
    let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(i64, usize)>> = workers
        .iter()
        .enumerate()
        .filter(|(i, _)| free[*i] > 0)
        .map(|(i, w)| std::cmp::Reverse((loads.get(&w.id).copied().unwrap_or(0), i)))
        .collect();
    let mut shares = vec![0usize; workers.len()];
    for _ in 0..ready.max(0) {
        let Some(std::cmp::Reverse((load, i))) = heap.pop() else {
            break;
        };
        shares[i] += 1;
        if (shares[i] as i64) < free[i] {
            heap.push(std::cmp::Reverse((load + 1, i)));
        }
    }
    shares
}
