//! Group commit of completion reports. Concurrent completions on one
//! replica (UpdateJob calls and the items of BatchUpdateJobs calls, from
//! any of its workers) are applied as one fenced statement per batch,
//! `UPDATE jobs … FROM unnest(…)`, each row re-checking `lease_id`,
//! `worker_id` and `status = running` like a single report: one commit
//! (one WAL flush) for many reports instead of one each. Up to
//! [`IN_FLIGHT`] batches run at once; reports that arrive meanwhile make
//! the next batch larger. A report the statement did not apply (its lease
//! is gone, it repeats one already applied, or it names more tasks than
//! the job's plan has) is answered `false` and
//! its caller takes the single-report path, which says precisely why.
//!
//! The statement locks the batch's job rows by row id ascending (a locking
//! `SELECT … ORDER BY j.id FOR UPDATE` before the `UPDATE`), the engine's
//! one order for job row locks (see [`super::jobs`]): in arrival order it
//! could wait in a circle on a CancelAction (which locks by id) or on
//! another batch, and PostgreSQL would abort one of them.

use std::{collections::HashSet, sync::Arc};

use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{cached, db_err, PgEngine};
use crate::{
    core::model::JobStatus,
    error::{Error, Result},
};

/// Batches of completions in flight at once (each holds one pooled
/// connection for one statement).
const IN_FLIGHT: usize = 4;

/// Most reports in one statement.
const MAX_BATCH: usize = 1024;

/// Queued reports the channel holds before senders wait.
pub(super) const QUEUE: usize = 16 * 1024;

/// One completion report waiting for its batch.
pub(super) struct Completion {
    pub job_id: String,
    pub lease_id: String,
    pub worker_id: String,
    /// Encoded task results (`None`: keep what progress reports stored).
    pub results: Option<String>,
    /// The highest task number the report names
    /// ([`crate::core::validate::reported_tasks`]): applied only when the
    /// job's plan version has that many tasks.
    pub tasks: u32,
    /// Whether the batch applied it.
    pub reply: oneshot::Sender<Result<bool>>,
}

/// The batcher: takes what is queued, up to [`MAX_BATCH`], once a slot of
/// [`IN_FLIGHT`] is free, until the engine stops.
pub(super) async fn run(engine: Arc<PgEngine>, mut rx: mpsc::Receiver<Completion>) {
    let mut stop = engine.stopping();
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let first = tokio::select! {
            _ = stop.changed() => return,
            c = rx.recv() => match c {
                Some(c) => c,
                None => return,
            },
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(c) => batch.push(c),
                Err(_) => break,
            }
        }
        let engine = engine.clone();
        tokio::spawn(async move {
            engine.apply(batch).await;
            drop(permit);
        });
    }
}

/// The same error again, for each report of a failed batch.
fn share(e: &Error) -> Error {
    match e {
        Error::StoreUnavailable(cause) => Error::StoreUnavailable(cause),
        Error::StoreBusy(s) => Error::StoreBusy(s.clone()),
        Error::Storage { detail, fault } => Error::Storage {
            detail: detail.clone(),
            fault: *fault,
        },
        Error::Unavailable => Error::Unavailable,
        other => Error::Internal(other.to_string()),
    }
}

impl PgEngine {
    /// Queues a completion and waits for its batch: true when it was
    /// applied, false when its caller must take the single-report path.
    ///
    /// Errors: storage errors of the batch; [`Error::Unavailable`] when
    /// the engine is stopping.
    pub(super) async fn complete_grouped(
        &self,
        job_id: &str,
        lease_id: &str,
        worker_id: &str,
        results: Option<String>,
        tasks: u32,
    ) -> Result<bool> {
        let (reply, answer) = oneshot::channel();
        let stopping = || Error::Unavailable;
        self.completions
            .send(Completion {
                job_id: job_id.to_string(),
                lease_id: lease_id.to_string(),
                worker_id: worker_id.to_string(),
                results,
                tasks,
                reply,
            })
            .await
            .map_err(|_| stopping())?;
        answer.await.map_err(|_| stopping())?
    }

    /// Applies one batch and answers each of its reports.
    async fn apply(&self, batch: Vec<Completion>) {
        match self.apply_statement(&batch).await {
            Ok(applied) => {
                for c in batch {
                    let done = applied.contains(&(c.job_id, c.lease_id));
                    let _ = c.reply.send(Ok(done));
                }
            }
            Err(e) => {
                let _ = self.observe::<()>(Err(share(&e)));
                for c in batch {
                    let _ = c.reply.send(Err(share(&e)));
                }
            }
        }
    }

    /// The batch's statement; returns the (job, lease) pairs it completed.
    ///
    /// Errors: storage errors.
    async fn apply_statement(&self, batch: &[Completion]) -> Result<HashSet<(String, String)>> {
        let ids: Vec<&str> = batch.iter().map(|c| c.job_id.as_str()).collect();
        let leases: Vec<&str> = batch.iter().map(|c| c.lease_id.as_str()).collect();
        let workers: Vec<&str> = batch.iter().map(|c| c.worker_id.as_str()).collect();
        let results: Vec<Option<&str>> = batch.iter().map(|c| c.results.as_deref()).collect();
        let tasks: Vec<i32> = batch
            .iter()
            .map(|c| i32::try_from(c.tasks).unwrap_or(i32::MAX))
            .collect();
        let c = self.client().await?;
        let rows = c
            .query(
                &cached(
                    &c,
                    // Lock order: job row id ascending (see super::jobs).
                    // An `UPDATE … FROM unnest(…)` alone locks in the
                    // order its join meets the rows (the reports'), so the
                    // rows are locked first, sorted; the UPDATE then only
                    // takes locks this transaction holds, and re-checks
                    // the fence on the rows as locked.
                    "WITH locked AS (
                         SELECT j.id, u.lease_id, u.worker_id, u.results
                         FROM jobs j
                         JOIN unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int4[])
                              AS u(job_id, lease_id, results, worker_id, tasks)
                           ON j.job_id = u.job_id
                         WHERE j.status = 2 AND j.lease_id = u.lease_id
                           AND j.worker_id = u.worker_id
                           AND u.tasks <= (SELECT pv.task_count FROM plan_versions pv
                                           WHERE pv.plan_id = j.plan_id
                                             AND pv.version = j.plan_version)
                         ORDER BY j.id FOR UPDATE OF j)
                     UPDATE jobs j SET status = 3, completed_at_ms = agq_now_ms(),
                            lease_expires_at_ms = NULL,
                            task_results = coalesce(l.results, j.task_results)
                     FROM locked l
                     WHERE j.id = l.id AND j.status = 2 AND j.lease_id = l.lease_id
                       AND j.worker_id = l.worker_id
                     RETURNING j.job_id, j.lease_id, j.action_id, j.worker_id,
                               j.started_at_ms, j.completed_at_ms",
                )
                .await?,
                &[&ids, &leases, &results, &workers, &tasks],
            )
            .await
            .map_err(db_err)?;
        let mut applied = HashSet::with_capacity(rows.len());
        let mut actions = Vec::with_capacity(rows.len());
        let mut freed = HashSet::new();
        for r in &rows {
            applied.insert((r.get::<_, String>(0), r.get::<_, String>(1)));
            actions.push(r.get::<_, String>(2));
            freed.insert(r.get::<_, String>(3));
            let (s, e): (Option<i64>, Option<i64>) = (r.get(4), r.get(5));
            self.metrics.transition(JobStatus::Completed);
            if let (Some(s), Some(e)) = (s, e) {
                self.metrics
                    .job_duration
                    .observe((e - s).max(0) as f64 / 1000.0);
            }
        }
        if !rows.is_empty() {
            self.touch(actions.iter().map(String::as_str));
            for w in &freed {
                self.slot_freed(w);
            }
        }
        Ok(applied)
    }
}
