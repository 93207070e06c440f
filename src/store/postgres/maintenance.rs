//! Maintenance in the clustered mode, run by one leader at a time: lease
//! expiry (with quarantine of workers whose leases keep timing out),
//! promotion of jobs whose backoff ended, stale workers declared DEAD,
//! leases of workers whose heartbeat stream dropped past the grace,
//! retention, forgetting departed workers and vanished replicas.
//!
//! The leader holds the row `leader('maintenance')` for its TTL
//! ([`leader_ttl_ms`]: 3 x the heartbeat interval, between 1 and 3 s) and
//! renews it every tick; when it stops renewing (killed, paused,
//! partitioned) another replica takes the row once it expired. Every
//! statement re-checks the state it changes, so a late leader (a paused
//! process that wakes up) changes nothing that another already handled.
//!
//! Every replica also refreshes its own `replicas` row and the health
//! gauge every second ([`replica_heartbeat`]).

use std::{sync::Arc, time::Duration};

use super::{db_err, workers::queue_end, PgEngine};
use crate::{core::model::WorkerState, error::Result, store::postgres::workers::LIVE};

/// How long the leader's row is valid without renewal, ms: 3 x the
/// heartbeat interval, between 1 s and 3 s, so that maintenance moves on
/// within about the time a worker takes to go stale (a killed leader's
/// workers are declared DEAD by its successor), and a renewal can miss a
/// tick or two without losing the row.
pub(super) fn leader_ttl_ms(engine: &PgEngine) -> i64 {
    let ttl =
        (engine.cfg.heartbeat_interval * 3).clamp(Duration::from_secs(1), Duration::from_secs(3));
    i64::try_from(ttl.as_millis()).unwrap_or(3_000)
}

/// A replica not seen for this long is forgotten, ms.
const REPLICA_GONE_MS: i64 = 60_000;

/// DEAD and UNREGISTERED workers are forgotten after this, ms (24 h).
const DEPARTED_RETENTION_MS: i64 = 24 * 3600 * 1000;

/// Undelivered commands are dropped after this, ms (1 h).
const COMMAND_RETENTION_MS: i64 = 3600 * 1000;

/// How often the leader folds the rows of the job counts
/// ([`PgEngine::fold_job_counts`]).
const FOLD_EVERY: Duration = Duration::from_secs(2);

/// Open actions (no finish time) the finish-stamp pass examines at most
/// ([`PgEngine::mark_finished`]): a window of this many, by `seq`, after
/// the previous pass's window, wrapping around at the end.
const FINISH_SCAN: i64 = 1000;

/// How many maintenance ticks pass between two drops of unused worker
/// selectors ([`PgEngine::drop_unused_selectors`]): 50 s at the default
/// heartbeat interval.
const SELECTOR_DROP_TICKS: u32 = 50;

/// The maintenance tick: half the heartbeat interval, between 50 ms and
/// 1 s.
fn tick(engine: &PgEngine) -> Duration {
    (engine.cfg.heartbeat_interval / 2).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// The maintenance loop: every tick, take or renew the leadership, and
/// when held, run one maintenance pass.
pub(super) async fn run(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    let period = tick(&engine);
    let mut last_fold: Option<std::time::Instant> = None;
    let mut last_selector_drop: Option<std::time::Instant> = None;
    // Where the next finish-stamp pass starts (`actions.seq`), in memory:
    // a replica that takes the leadership over starts from the beginning.
    let mut finish_cursor = 0;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        match engine.lead().await {
            Ok(Some(resumed_for_ms)) => {
                let mut r = engine.maintain(resumed_for_ms, &mut finish_cursor).await;
                if r.is_ok() && last_fold.is_none_or(|t| t.elapsed() >= FOLD_EVERY) {
                    r = engine.fold_job_counts().await;
                    last_fold = Some(std::time::Instant::now());
                }
                if r.is_ok()
                    && last_selector_drop
                        .is_none_or(|t| t.elapsed() >= period * SELECTOR_DROP_TICKS)
                {
                    r = engine.drop_unused_selectors().await;
                    last_selector_drop = Some(std::time::Instant::now());
                }
                if let Err(e) = engine.observe(r) {
                    tracing::warn!(error = %e, "maintenance pass failed");
                }
            }
            Ok(None) => {}
            Err(e) => {
                let _ = engine.observe::<()>(Err(e));
            }
        }
    }
}

/// How long a replica's refresh of its row ([`replica_heartbeat`]) may
/// take before the database counts as not answering (health NOT_SERVING):
/// a connection gone silent (a partition that drops packets, a stalled
/// server) reports no error, and the refresh would wait on it for good,
/// reporting SERVING meanwhile while every call hangs.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(5);

/// Refreshes this replica's row every second and the health it reports:
/// SERVING while the database answers, within [`REFRESH_TIMEOUT`].
pub(super) async fn replica_heartbeat(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    loop {
        let refresh = async {
            let c = engine.client().await?;
            let n = c
                .execute(
                    "UPDATE replicas SET last_seen_ms = agq_now_ms() WHERE replica_id = $1",
                    &[&engine.replica_id],
                )
                .await
                .map_err(db_err)?;
            if n == 0 {
                c.execute(
                    "INSERT INTO replicas (replica_id, hostname, started_at_ms, last_seen_ms)
                     VALUES ($1, '', agq_now_ms(), agq_now_ms()) ON CONFLICT DO NOTHING",
                    &[&engine.replica_id],
                )
                .await
                .map_err(db_err)?;
            }
            Ok::<(), crate::error::Error>(())
        };
        let up = match tokio::time::timeout(REFRESH_TIMEOUT, refresh).await {
            Ok(r) => r.is_ok(),
            Err(_) => {
                tracing::warn!(
                    "the PostgreSQL database did not answer within {REFRESH_TIMEOUT:?}; not serving"
                );
                false
            }
        };
        engine.metrics.store_up.set(i64::from(up));
        let _ = engine
            .health
            .send_if_modified(|h| std::mem::replace(h, up) != up);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Recurring schedules are fired by the leader's maintenance pass; this
/// loop only wakes it early when a schedule changes.
pub(super) async fn schedule_loop(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    while super::wait(&engine.schedules_wake, Duration::from_secs(3600), &mut stop).await {}
}

impl PgEngine {
    /// Takes or renews the leadership. While this replica holds it,
    /// returns how long maintenance has run since it last resumed, ms.
    ///
    /// Maintenance resumes when a replica takes the leader's row over
    /// after it had expired for longer than a tick ([`tick`]): a
    /// leader's successor normally takes it within a tick of its expiry,
    /// so a longer lapse means that no replica could maintain (every
    /// replica down, or the database unreachable), and then no worker
    /// could reach the cluster either. The row keeps the time
    /// (`resumed_at_ms`, migration 0006), so a change of leader right
    /// after does not forget it. The first leader of a new database
    /// starts maintenance as a resumption too: workers may have registered
    /// before it, and the database may have been down since.
    ///
    /// Errors: storage errors.
    async fn lead(&self) -> Result<Option<i64>> {
        let c = self.client().await?;
        let lapse_ms = i64::try_from(tick(self).as_millis()).unwrap_or(1_000);
        let held = c
            .query_opt(
                "INSERT INTO leader (name, holder, term, expires_at_ms, resumed_at_ms)
                 VALUES ('maintenance', $1, 1, agq_now_ms() + $2, agq_now_ms())
                 ON CONFLICT (name) DO UPDATE SET holder = $1,
                     term = leader.term + CASE WHEN leader.holder = $1 THEN 0 ELSE 1 END,
                     resumed_at_ms = CASE WHEN leader.expires_at_ms < agq_now_ms() - $3
                                          THEN agq_now_ms() ELSE leader.resumed_at_ms END,
                     expires_at_ms = agq_now_ms() + $2
                 WHERE leader.holder = $1 OR leader.expires_at_ms < agq_now_ms()
                 RETURNING agq_now_ms() - resumed_at_ms",
                &[&self.replica_id, &leader_ttl_ms(self), &lapse_ms],
            )
            .await
            .map_err(db_err)?;
        Ok(held.map(|r| r.get(0)))
    }

    /// One maintenance pass; `resumed_for_ms` is how long maintenance
    /// has run since it last resumed ([`PgEngine::lead`]) and
    /// `finish_cursor` where its finish-stamp pass starts
    /// ([`PgEngine::mark_finished`]), moved on by it.
    ///
    /// The passes that judge silence wait after a resumption, so that the
    /// workers get the time they would have had had the cluster kept
    /// running: stale heartbeats a stale window (3 x the interval), lease
    /// expiry and dropped streams the restart grace (the longer of
    /// `--lease-grace-ms` and the stale window), as the embedded engine
    /// gives the workers and leases it loads at start-up.
    ///
    /// Errors: storage errors.
    async fn maintain(&self, resumed_for_ms: i64, finish_cursor: &mut i64) -> Result<()> {
        let grace = i64::try_from(self.cfg.restart_grace().as_millis()).unwrap_or(i64::MAX / 4);
        self.promote_due().await?;
        if resumed_for_ms >= grace {
            self.expire_leases().await?;
        }
        if resumed_for_ms >= self.stale_ms() {
            self.declare_stale().await?;
        }
        if resumed_for_ms >= grace {
            self.lose_suspects().await?;
        }
        *finish_cursor = self.mark_finished(*finish_cursor).await?;
        self.expire_finished().await?;
        self.fire_schedules().await?;
        let c = self.client().await?;
        c.execute(
            // A quarantined worker's row is kept: only an admin ends it.
            "DELETE FROM workers WHERE state IN (3, 4) AND last_heartbeat_at_ms < agq_now_ms() - $1 \
             AND quarantine_reason = ''",
            &[&DEPARTED_RETENTION_MS],
        )
        .await
        .map_err(db_err)?;
        c.execute(
            "DELETE FROM worker_commands WHERE created_at_ms < agq_now_ms() - $1",
            &[&COMMAND_RETENTION_MS],
        )
        .await
        .map_err(db_err)?;
        c.execute(
            "DELETE FROM replicas WHERE last_seen_ms < agq_now_ms() - $1",
            &[&REPLICA_GONE_MS],
        )
        .await
        .map_err(db_err)?;
        Ok(())
    }

    /// Folds the rows of `job_counts` (one appended per status by each
    /// statement that moved jobs; migration 0002) into one per status,
    /// so a scrape sums a few seconds' rows at most; when they already are
    /// one per status (an idle cluster) it writes nothing. One statement: a
    /// scrape sees the rows before or after, the same sums. Rows of
    /// transactions still under way are not visible to it and stay for
    /// the next fold; a second leader's fold waits for this one's rows
    /// and finds them gone.
    ///
    /// Errors: storage errors.
    pub(super) async fn fold_job_counts(&self) -> Result<()> {
        let c = self.client().await?;
        let kept = c.execute(FOLD_JOB_COUNTS, &[]).await.map_err(db_err)?;
        tracing::trace!(statuses = kept, "job counts folded");
        Ok(())
    }

    /// Drops the worker selectors (`selectors`, which every dispatcher
    /// round reads whole) that no open job (pending, running, failed)
    /// uses any more, 1000 at most: the selectors of finished actions
    /// would otherwise pile up for good, each one more to read and match
    /// in every round of every replica. The empty selector stays.
    ///
    /// A submit or a retry that makes jobs with a selector open holds its
    /// row share-locked to its commit (`jobs::keep_selectors`). The drop
    /// first locks the candidates (`FOR UPDATE SKIP LOCKED`: a selector
    /// such a transaction holds is skipped), then deletes those that no
    /// open job uses in a statement of its own, whose snapshot sees every
    /// transaction that held one of them before: one checked in the first
    /// statement's snapshot only could be dropped under the jobs of a
    /// submit that committed in between, and those jobs would never be
    /// claimed. A transaction that asks for a selector the drop holds
    /// waits for it, and stores it again when it was dropped.
    ///
    /// Errors: storage errors.
    pub(super) async fn drop_unused_selectors(&self) -> Result<()> {
        let mut c = self.client().await?;
        let tx = c.transaction().await.map_err(db_err)?;
        let locked: Vec<String> = tx
            .query(SELECTOR_DROP_CANDIDATES, &[])
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        if locked.is_empty() {
            return Ok(());
        }
        let dropped = tx
            .execute(
                "DELETE FROM selectors s WHERE s.selector = ANY($1)
                 AND NOT EXISTS (SELECT 1 FROM jobs j
                                 WHERE j.worker_selector = s.selector AND j.worker_selector <> ''
                                       AND j.status IN (1, 2, 4))",
                &[&locked],
            )
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        tracing::debug!(dropped, "unused worker selectors dropped");
        Ok(())
    }

    /// Failed jobs whose backoff ended are pending again.
    async fn promote_due(&self) -> Result<()> {
        let c = self.client().await?;
        let rows = c
            .query(
                "WITH due AS (
                     UPDATE jobs SET status = 1, delayed = false
                     WHERE id IN (SELECT id FROM jobs WHERE status = 4 AND ready_at_ms <= agq_now_ms()
                                  ORDER BY ready_at_ms LIMIT 10000 FOR UPDATE SKIP LOCKED)
                     RETURNING action_id)
                 SELECT DISTINCT action_id FROM due",
                &[],
            )
            .await
            .map_err(db_err)?;
        if rows.is_empty() {
            return Ok(());
        }
        let actions: Vec<String> = rows.into_iter().map(|r| r.get(0)).collect();
        super::notify_names(&c, super::READY_CHANNEL, &[String::new()]).await?;
        self.touch(actions.iter().map(String::as_str));
        Ok(())
    }

    /// Running jobs past their lease's expiry fail their attempt; a worker
    /// with too many timeouts in the window is quarantined.
    ///
    /// The expiry and the quarantine commit together: were the quarantine
    /// a transaction of its own, a dispatch round between the two would
    /// see the worker ACTIVE with the slot just freed and lease it the
    /// retried job again. So the workers are locked first, in id order
    /// like the dispatcher's round (registrations and heartbeats lock one
    /// worker, then its jobs), and then their expired jobs with `SKIP
    /// LOCKED`: the transaction never waits for a job row while it holds a
    /// worker's. A job that expired after the first read is the next
    /// pass's.
    async fn expire_leases(&self) -> Result<()> {
        let mut client = self.client().await?;
        let holders = client
            .query(
                "SELECT DISTINCT worker_id FROM (
                     SELECT worker_id FROM jobs
                     WHERE status = 2 AND lease_expires_at_ms <= agq_now_ms()
                     ORDER BY lease_expires_at_ms LIMIT 1000) e",
                &[],
            )
            .await
            .map_err(db_err)?;
        if holders.is_empty() {
            return Ok(());
        }
        let workers: Vec<String> = holders
            .into_iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect();
        let tx = client.transaction().await.map_err(db_err)?;
        tx.query(
            "SELECT 1 FROM workers WHERE worker_id = ANY($1) ORDER BY worker_id FOR UPDATE",
            &[&workers],
        )
        .await
        .map_err(db_err)?;
        let expired: Vec<(i64, String, String)> = tx
            .query(
                "SELECT id, lease_id, worker_id FROM jobs
                 WHERE status = 2 AND lease_expires_at_ms <= agq_now_ms()
                   AND (worker_id = ANY($1) OR worker_id IS NULL)
                 ORDER BY lease_expires_at_ms LIMIT 1000 FOR UPDATE SKIP LOCKED",
                &[&workers],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| {
                let lease: Option<String> = r.get(1);
                let worker: Option<String> = r.get(2);
                (
                    r.get(0),
                    lease.unwrap_or_default(),
                    worker.unwrap_or_default(),
                )
            })
            .collect();
        if expired.is_empty() {
            return Ok(());
        }
        let secs = self.cfg.job_timeout.as_secs();
        let mut actions = Vec::new();
        let mut timed_out = Vec::new();
        for (id, lease, worker) in expired {
            let Some(e) = self
                .lose_lease(
                    &tx,
                    id,
                    (&lease, &worker),
                    &format!("job timed out: lease expired after {secs} s"),
                    "timeout",
                )
                .await?
            else {
                continue;
            };
            actions.push(e.action_id);
            timed_out.push(worker);
        }
        timed_out.sort();
        let mut quarantined = Vec::new();
        for worker in &timed_out {
            if let Some(reason) = self.count_timeout(&tx, worker).await? {
                quarantined.push((worker, reason));
            }
        }
        tx.commit().await.map_err(db_err)?;
        self.touch(actions.iter().map(String::as_str));
        for (id, reason) in quarantined {
            self.metrics.worker_quarantines.inc();
            tracing::warn!(worker_id = %id, reason, "worker quarantined");
        }
        Ok(())
    }

    /// Records a lease timeout of worker `id` (whose row `tx` holds);
    /// quarantines it when the window holds `quarantine_after_timeouts` of
    /// them, and then returns the reason. A timeout counts only while the
    /// worker keeps heartbeating (its last beat younger than 3 x the
    /// interval, its heartbeat stream open, not suspect): a lease that
    /// expired while its worker could not reach any replica (the cluster
    /// down, a dropped stream) says nothing of a hung worker. The beat's
    /// age is what tells after a full outage, when a replica that crashed
    /// left its streams marked open.
    async fn count_timeout(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        id: &str,
    ) -> Result<Option<String>> {
        let window = i64::try_from(self.cfg.quarantine_window.as_millis()).unwrap_or(i64::MAX / 4);
        let Some(r) = tx
            .query_opt(
                "UPDATE workers SET timeouts_ms = array_append(
                     ARRAY(SELECT t FROM unnest(timeouts_ms) AS t WHERE t > agq_now_ms() - $2),
                     agq_now_ms())
                 WHERE worker_id = $1 AND heartbeat_open AND suspect_since_ms IS NULL
                   AND last_heartbeat_at_ms >= agq_now_ms() - $3
                 RETURNING cardinality(timeouts_ms), state, agq_now_ms()",
                &[&id, &window, &self.stale_ms()],
            )
            .await
            .map_err(db_err)?
        else {
            return Ok(None);
        };
        let n: i32 = r.get(0);
        let state: i16 = r.get(1);
        let limit = self.cfg.quarantine_after_timeouts;
        if limit == 0 || (n as u32) < limit || state != WorkerState::Active as i16 {
            return Ok(None);
        }
        let reason = format!(
            "{n} leases hit the job timeout ({} s) within {} s, the last at {}; the worker \
             kept heartbeating (hung?). Investigate it, then `agq worker release {id}`",
            self.cfg.job_timeout.as_secs(),
            self.cfg.quarantine_window.as_secs(),
            crate::time::rfc3339(r.get(2))
        );
        tx.execute(
            "UPDATE workers SET state = $2, quarantine_reason = $3, timeouts_ms = '{}' WHERE worker_id = $1",
            &[&id, &(WorkerState::Quarantined as i16), &reason],
        )
        .await
        .map_err(db_err)?;
        Ok(Some(reason))
    }

    /// Live workers without a heartbeat for 3 x the interval are DEAD;
    /// their leases are re-queued and their streams ended.
    async fn declare_stale(&self) -> Result<()> {
        let stale = self.stale_ms();
        let c = self.client().await?;
        let ids: Vec<String> = c
            .query(
                "SELECT worker_id FROM workers
                 WHERE state = ANY($1) AND last_heartbeat_at_ms < agq_now_ms() - $2",
                &[&LIVE.to_vec(), &stale],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        drop(c);
        for id in ids {
            let mut client = self.client().await?;
            let tx = client.transaction().await.map_err(db_err)?;
            // Re-checked under the row lock: a heartbeat meanwhile wins.
            let n = tx
                .execute(
                    "UPDATE workers SET state = 3, heartbeat_open = false
                     WHERE worker_id = $1 AND state = ANY($2) AND last_heartbeat_at_ms < agq_now_ms() - $3",
                    &[&id, &LIVE.to_vec(), &stale],
                )
                .await
                .map_err(db_err)?;
            if n == 0 {
                continue;
            }
            let secs = self.cfg.stale_after().as_secs_f64();
            tracing::warn!(worker_id = %id, "no heartbeat for {secs:.1} s; worker is DEAD");
            let lost = self
                .lose_all_of(
                    &tx,
                    &id,
                    &format!("the worker sent no heartbeat for {secs:.1} s"),
                    "stale_heartbeat",
                )
                .await?;
            queue_end(
                &tx,
                &id,
                "no heartbeat for 3 x the interval: worker declared DEAD; register again",
            )
            .await?;
            self.commit_and_touch(tx, &lost).await?;
        }
        Ok(())
    }

    /// Leases of workers whose heartbeat stream dropped longer than the
    /// grace ago (and did not come back) are re-queued.
    async fn lose_suspects(&self) -> Result<()> {
        let grace = i64::try_from(self.cfg.lease_grace.as_millis()).unwrap_or(i64::MAX / 4);
        let c = self.client().await?;
        let ids: Vec<String> = c
            .query(
                "SELECT w.worker_id FROM workers w
                 WHERE w.state = ANY($1) AND NOT w.heartbeat_open
                   AND w.suspect_since_ms <= agq_now_ms() - $2
                   AND EXISTS (SELECT 1 FROM jobs j WHERE j.status = 2 AND j.worker_id = w.worker_id)",
                &[&LIVE.to_vec(), &grace],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        drop(c);
        for id in ids {
            let mut client = self.client().await?;
            let tx = client.transaction().await.map_err(db_err)?;
            let still = tx
                .query_opt(
                    "SELECT 1 FROM workers WHERE worker_id = $1 AND NOT heartbeat_open
                       AND suspect_since_ms <= agq_now_ms() - $2 FOR UPDATE",
                    &[&id, &grace],
                )
                .await
                .map_err(db_err)?;
            if still.is_none() {
                continue;
            }
            let lost = self
                .lose_all_of(
                    &tx,
                    &id,
                    "the worker's heartbeat stream dropped and it did not come back",
                    "stream_lost",
                )
                .await?;
            self.commit_and_touch(tx, &lost).await?;
        }
        Ok(())
    }

    /// Loses every running lease of worker `id` in `tx`; returns the
    /// actions of the jobs it changed, for the caller to touch once `tx`
    /// committed ([`PgEngine::commit_and_touch`]), never before.
    ///
    /// Errors: storage errors.
    async fn lose_all_of(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        id: &str,
        reason: &str,
        label: &str,
    ) -> Result<Vec<String>> {
        let mut actions = Vec::new();
        for (row, lease) in super::jobs::running_on(tx, id).await? {
            if let Some(e) = self
                .lose_lease(tx, row, (&lease, id), reason, label)
                .await?
            {
                actions.push(e.action_id);
            }
        }
        Ok(actions)
    }

    /// Stamps the finish time (its last job's end) of actions with no
    /// pending, running or failed job left, for retention and listings.
    /// A pass examines the [`FINISH_SCAN`] open actions (no finish time
    /// yet) that follow `after` in `seq` order and returns where the next
    /// pass starts: after the last one examined, or 0 (the beginning) when
    /// fewer were left. Open actions that stay open (scheduled far ahead,
    /// waiting for a tool no worker has) are passed over, so every
    /// finished action is stamped within a round over the open ones, with
    /// bounded work per pass.
    ///
    /// It runs at REPEATABLE READ: at READ COMMITTED an action reopened
    /// (RetryJob, RetryAction) while the statement waited for its row
    /// would be re-checked against the jobs as they were before the retry
    /// and stamped finished with its old finish time, and retention would
    /// then delete an action that runs. Such a conflict fails the pass
    /// with a serialization failure; the next pass starts where this one
    /// did and stamps what is still finished.
    ///
    /// Errors: storage errors other than that conflict.
    async fn mark_finished(&self, after: i64) -> Result<i64> {
        let mut c = self.client().await?;
        let tx = c
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .start()
            .await
            .map_err(db_err)?;
        let scanned = tx
            .query_one(
                "WITH scan AS (
                     SELECT action_id, seq FROM actions WHERE finished_at_ms IS NULL AND seq > $1
                     ORDER BY seq LIMIT $2),
                 marked AS (
                     UPDATE actions a SET finished_at_ms = coalesce(
                         (SELECT max(j.completed_at_ms) FROM jobs j WHERE j.action_id = a.action_id),
                         agq_now_ms())
                     WHERE a.action_id IN (SELECT action_id FROM scan)
                       AND NOT EXISTS (SELECT 1 FROM jobs j
                                       WHERE j.action_id = a.action_id AND j.status IN (1, 2, 4))
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM scan), (SELECT max(seq) FROM scan),
                        (SELECT count(*) FROM marked)",
                &[&after, &FINISH_SCAN],
            )
            .await
            .map_err(db_err);
        let r = match scanned {
            Ok(row) => tx.commit().await.map_err(db_err).map(|()| row),
            Err(e) => Err(e),
        };
        match r {
            Ok(row) => {
                let (n, last, marked): (i64, Option<i64>, i64) =
                    (row.get(0), row.get(1), row.get(2));
                tracing::trace!(after, examined = n, marked, "finish stamps");
                Ok(match last {
                    Some(last) if n >= FINISH_SCAN => last,
                    _ => 0,
                })
            }
            Err(crate::error::Error::StoreBusy(e)) => {
                tracing::debug!(error = %e, "finish stamps deferred to the next pass");
                Ok(after)
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes actions finished longer than the retention ago with their
    /// jobs (100 actions per pass). It checks again that such an action
    /// has no pending, running or failed job: a finish time is a cache of
    /// that fact, and a wrong one must never delete an open job.
    async fn expire_finished(&self) -> Result<()> {
        let Some(retention) = self.cfg.job_retention else {
            return Ok(());
        };
        let retention = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX / 4);
        let c = self.client().await?;
        let rows = c
            .query(
                "DELETE FROM actions WHERE action_id IN (
                     SELECT action_id FROM actions
                     WHERE finished_at_ms IS NOT NULL AND finished_at_ms < agq_now_ms() - $1
                       AND NOT EXISTS (SELECT 1 FROM jobs j
                                       WHERE j.action_id = actions.action_id AND j.status IN (1, 2, 4))
                     ORDER BY finished_at_ms LIMIT 100 FOR UPDATE SKIP LOCKED)
                 RETURNING action_id, total_jobs",
                &[&retention],
            )
            .await
            .map_err(db_err)?;
        if rows.is_empty() {
            return Ok(());
        }
        let mut jobs = 0u64;
        let ids: Vec<String> = rows
            .into_iter()
            .map(|r| {
                jobs += u64::try_from(r.get::<_, i32>(1)).unwrap_or(0);
                r.get(0)
            })
            .collect();
        self.metrics.expired_jobs.inc_by(jobs);
        tracing::debug!(
            actions = ids.len(),
            jobs,
            "retention deleted finished actions"
        );
        self.touch(ids.iter().map(String::as_str));
        Ok(())
    }
}

/// The statement that folds the appended job counts (`job_counts`, schema
/// 2) into one row per status, in one transaction: it takes the rows its
/// snapshot sees (`DELETE … RETURNING`) and inserts their sums, and writes
/// nothing when the rows already are one per status. Under READ
/// COMMITTED a second fold running at once waits for the rows the first
/// took, finds them gone and cannot see the first's sums, so the totals
/// stay exact. Public for the tests that run it beside the leader's.
pub const FOLD_JOB_COUNTS: &str = "WITH taken AS (
         DELETE FROM job_counts
         WHERE (SELECT count(*) > count(DISTINCT status) FROM job_counts)
         RETURNING status, n)
     INSERT INTO job_counts (status, n)
     SELECT status, sum(n)::bigint FROM taken GROUP BY status HAVING sum(n) <> 0";

/// The leader's first statement of a drop of unused worker selectors
/// (`drop_unused_selectors`): locks up to 1,000 selectors that no open job
/// (pending, running, in backoff) uses, skipping those a submit or retry
/// holds. The check is one probe of `jobs_open_by_selector` per selector
/// (migration 0005), whatever the backlog. Public for the test that
/// reads its plan.
pub const SELECTOR_DROP_CANDIDATES: &str = "SELECT s.selector FROM selectors s
     WHERE s.selector <> ''
       AND NOT EXISTS (SELECT 1 FROM jobs j
                       WHERE j.worker_selector = s.selector AND j.worker_selector <> ''
                             AND j.status IN (1, 2, 4))
     LIMIT 1000 FOR UPDATE OF s SKIP LOCKED";
