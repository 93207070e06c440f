//! The scheduler: where leases are granted and lost. After every batch of
//! operations that made a job ready or freed a slot, [`State::dispatch`]
//! matches the oldest ready jobs to fresh, ACTIVE, capable workers with a
//! free slot, least loaded first, and queues the leases for their streams.
//! Freshness is checked here, at every pick.

use std::{sync::Arc, time::Instant};

use rand::Rng;
use rusqlite::Connection;

use super::{
    sql::jobs,
    state::{Effect, FreshJob, Lease, PlanEntry, State, Waiting},
};
use crate::{
    core::model::{Job, JobLease, JobStatus, WorkerCommand, WorkerState},
    error::{Error, Result},
    time::{now_ms, rfc3339},
};

/// A lease being granted, for [`State::lease_out`].
struct NewLease<'a> {
    action_id: Arc<str>,
    /// The plan version the job runs.
    plan: Arc<PlanEntry>,
    worker_id: &'a str,
    lease_id: String,
    attempt: u32,
    /// Since when the job waited (the metric's start), ms.
    waiting_since_ms: i64,
    now_ms: i64,
    expires_at_ms: i64,
    results_stored: bool,
    /// The action's W3C `traceparent`, for the lease.
    traceparent: Option<Arc<str>>,
}

impl State {
    /// Grants leases until no ready job has an eligible worker. FIFO among
    /// ready jobs: the oldest job some eligible worker can run goes first
    /// (each plan version is matched on its own tools).
    ///
    /// Errors: storage errors (the batch is rolled back).
    pub(super) fn dispatch(&mut self, conn: &Connection) -> Result<()> {
        self.wants_dispatch = false;
        let now = Instant::now();
        loop {
            if self.ready.is_empty() || self.available.is_empty() {
                return Ok(());
            }
            let mut heads: Vec<(i64, Arc<PlanEntry>)> = self
                .ready_by_plan
                .values()
                .filter_map(|rows| rows.first())
                .filter_map(|r| self.ready.get(r).map(|w| (*r, w.plan.clone())))
                .collect();
            heads.sort_unstable_by_key(|(row, _)| *row);
            let mut granted = false;
            for (row, plan) in heads {
                if let Some(worker_id) = self.pick(&plan, now) {
                    self.grant(conn, row, &worker_id)?;
                    granted = true;
                    break;
                }
            }
            if !granted {
                return Ok(());
            }
        }
    }

    /// The best worker for a job of `plan` (a plan version): fresh,
    /// ACTIVE, lease stream open, every tool of the version, a free slot;
    /// least loaded first.
    fn pick(&self, plan: &PlanEntry, now: Instant) -> Option<String> {
        self.available
            .iter()
            .find(|(_, _, id)| {
                self.workers.get(id).is_some_and(|w| {
                    w.state == WorkerState::Active
                        && self.is_fresh(w, now)
                        && (w.leases.len() as u32) < w.max
                        && plan.runs_on(w)
                })
            })
            .map(|(_, _, id)| id.clone())
    }

    /// Grants the job at `row` to `worker_id`: commits the lease in the
    /// batch and queues it for the worker's lease stream.
    fn grant(&mut self, conn: &Connection, row: i64, worker_id: &str) -> Result<()> {
        let now_ms = now_ms();
        // A new job's row is known without reading it (see FreshJob).
        let cached = self.ready.get_mut(&row).and_then(|w| {
            let f = w.fresh.take()?;
            let view = jobs::inserted_view(
                f.job_id,
                &w.action_id,
                &w.plan.id,
                w.plan.plan.version,
                f.input,
                f.max_attempts,
                f.created_at_ms,
            );
            Some((view, f.traceparent))
        });
        let fresh = cached.is_some();
        let (job, traceparent) = match cached {
            Some((job, traceparent)) => (Some(job), traceparent),
            None => match jobs::get_by_row(conn, row, false)? {
                Some(job) => {
                    let traceparent = jobs::action_traceparent(conn, &job.action_id)?;
                    (Some(job), traceparent.map(Arc::from))
                }
                None => (None, None),
            },
        };
        let Some(job) = job else {
            self.dequeue(row);
            return Ok(());
        };
        let attempt = job.attempt + 1;
        let lease_id = uuid::Uuid::new_v4().to_string();
        let expires_at_ms = now_ms + self.cfg.job_timeout.as_millis() as i64;
        jobs::grant_lease(
            conn,
            row,
            worker_id,
            &lease_id,
            attempt,
            now_ms,
            expires_at_ms,
        )?;
        let Some(waiting) = self.dequeue(row) else {
            return Err(Error::Internal(format!("job row {row} was not ready")));
        };
        self.lease_out(
            row,
            job,
            NewLease {
                action_id: waiting.action_id,
                plan: waiting.plan,
                worker_id,
                lease_id,
                attempt,
                waiting_since_ms: waiting.since_ms,
                now_ms,
                expires_at_ms,
                results_stored: !fresh,
                traceparent,
            },
        );
        Ok(())
    }

    /// The worker a new job of `plan` (a plan version) goes to at once,
    /// in the operation that submits it, when nothing older waits in the
    /// ready queue (so FIFO holds) and a worker is eligible. `None`: it is
    /// queued.
    pub(super) fn place_at_once(&self, plan: &PlanEntry) -> Option<String> {
        if !self.ready.is_empty() || self.available.is_empty() {
            return None;
        }
        self.pick(plan, Instant::now())
    }

    /// Inserts a new job already leased to `worker_id` (see
    /// [`State::place_at_once`]) and queues its lease like [`Self::grant`]:
    /// one INSERT instead of an INSERT and an UPDATE. `plan` is the plan
    /// version the job runs. Returns its row.
    ///
    /// Errors: storage errors only.
    pub(super) fn insert_leased(
        &mut self,
        conn: &Connection,
        job: FreshJob,
        input_json: &str,
        action_id: Arc<str>,
        plan: Arc<PlanEntry>,
        worker_id: &str,
    ) -> Result<i64> {
        let lease_id = uuid::Uuid::new_v4().to_string();
        let expires_at_ms = job.created_at_ms + self.cfg.job_timeout.as_millis() as i64;
        let row = jobs::insert_job(
            conn,
            &job.job_id,
            &action_id,
            &plan.id,
            plan.plan.version,
            input_json,
            job.max_attempts,
            job.created_at_ms,
            job.created_at_ms,
            Some(jobs::FirstLease {
                worker_id,
                lease_id: &lease_id,
                expires_at_ms,
            }),
        )?;
        let now_ms = job.created_at_ms;
        let traceparent = job.traceparent.clone();
        let view = jobs::inserted_view(
            job.job_id,
            &action_id,
            &plan.id,
            plan.plan.version,
            job.input,
            job.max_attempts,
            now_ms,
        );
        self.lease_out(
            row,
            view,
            NewLease {
                action_id,
                plan,
                worker_id,
                lease_id,
                attempt: 1,
                waiting_since_ms: now_ms,
                now_ms,
                expires_at_ms,
                results_stored: false,
                traceparent,
            },
        );
        Ok(row)
    }

    /// Records a lease granted in this batch (the row already says so) and
    /// queues it, with the tasks of the job's plan version, for the
    /// holder's lease stream; `job` is the row as it was before the grant.
    fn lease_out(&mut self, row: i64, mut job: Job, l: NewLease<'_>) {
        let worker_id = l.worker_id;
        self.metrics.lease_waited(l.now_ms - l.waiting_since_ms);
        self.metrics.transition(JobStatus::Running);
        self.lease_seq += 1;
        let seq = self.lease_seq;
        job.status = JobStatus::Running;
        job.attempt = l.attempt;
        job.started_at_ms = Some(l.now_ms);
        job.worker_id = worker_id.to_string();
        job.current_task = 0;
        job.progress_percent = 0;
        self.lease_by_job.insert(job.job_id.clone(), row);
        self.leases.insert(
            row,
            Lease {
                lease_id: l.lease_id.clone(),
                worker_id: worker_id.to_string(),
                job_id: job.job_id.clone(),
                action_id: l.action_id.clone(),
                plan: l.plan.clone(),
                attempt: l.attempt,
                max_attempts: job.max_attempts,
                expires_at_ms: l.expires_at_ms,
                granted_at_ms: l.now_ms,
                stream_id: self
                    .workers
                    .get(worker_id)
                    .and_then(|w| w.lease_stream.as_ref())
                    .map_or(0, |s| s.id),
                results_stored: l.results_stored,
            },
        );
        self.touch(&l.action_id);
        if let Some(w) = self.workers.get_mut(worker_id) {
            w.leases.insert(row);
            w.last_lease_seq = seq;
            if let Some(slot) = &w.lease_stream {
                let lease = JobLease {
                    lease_id: l.lease_id,
                    job,
                    plan: l.plan.plan.clone(),
                    attempt: l.attempt,
                    expires_at_ms: l.expires_at_ms,
                    traceparent: l.traceparent,
                };
                self.outbox
                    .push(Effect::Lease(slot.tx.clone(), Box::new(lease)));
            }
        }
        self.refresh_available(worker_id);
    }

    /// Backoff before attempt `attempt + 1` after attempt `attempt` failed:
    /// base x 2^(attempt-1), capped, with up to 25% jitter either way.
    pub(super) fn backoff_ms(&self, attempt: u32) -> i64 {
        let base = self.cfg.retry_backoff_base.as_millis() as f64;
        if base <= 0.0 {
            return 0;
        }
        let max = self.cfg.retry_backoff_max.as_millis() as f64;
        let exp = base * 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
        let jitter = rand::rng().random_range(0.75..=1.25);
        (exp.min(max) * jitter) as i64
    }

    /// Ends the lease of the job at `row` as a failed attempt: the job waits
    /// out its backoff (Failed) while attempts remain, else goes Dead. The
    /// holder's slot is freed. `reason` goes to the job's error, `label` to
    /// the requeue metric. A still-connected holder is told to stop.
    ///
    /// Errors: storage errors.
    pub(super) fn lose_lease(
        &mut self,
        conn: &Connection,
        row: i64,
        reason: &str,
        label: &str,
    ) -> Result<()> {
        let Some(lease) = self.leases.get(&row).cloned() else {
            return Ok(());
        };
        self.end_attempt(conn, row, &lease, reason, false, false)?;
        self.metrics.requeue(label);
        if label != "job_failed" {
            self.command(
                &lease.worker_id,
                WorkerCommand::CancelJob(lease.job_id.clone()),
            );
        }
        tracing::info!(job_id = %lease.job_id, worker_id = %lease.worker_id, reason, "lease lost");
        Ok(())
    }

    /// Records a failed attempt of the leased job (reported or lost) and
    /// re-queues it with backoff or sends it to dead. Returns the job's
    /// status now: Failed (backing off), Pending (no backoff) or Dead.
    /// `reported`: the worker reported the failure (its lease id is kept
    /// to recognise a repeat of the report). `permanent`: the worker said
    /// retrying cannot help; the job goes to Dead whatever attempts are left.
    pub(super) fn end_attempt(
        &mut self,
        conn: &Connection,
        row: i64,
        lease: &Lease,
        error: &str,
        reported: bool,
        permanent: bool,
    ) -> Result<JobStatus> {
        let now_ms = now_ms();
        let dead = permanent || lease.attempt >= lease.max_attempts;
        let ready_at = now_ms
            + if dead {
                0
            } else {
                self.backoff_ms(lease.attempt)
            };
        let error = if permanent {
            format!(
                "attempt {} of {}: permanent failure, not retried: {error}",
                lease.attempt, lease.max_attempts
            )
        } else {
            format!(
                "attempt {} of {}: {error}",
                lease.attempt, lease.max_attempts
            )
        };
        let fence = jobs::Fence {
            lease_id: &lease.lease_id,
            worker_id: &lease.worker_id,
        };
        let changed =
            jobs::fail_attempt(conn, row, fence, dead, &error, ready_at, now_ms, reported)?;
        self.fenced(changed, lease)?;
        let mut status = if dead {
            JobStatus::Dead
        } else {
            JobStatus::Failed
        };
        self.metrics.transition(status);
        if !dead && ready_at <= now_ms {
            jobs::promote(conn, row)?;
            status = JobStatus::Pending;
            self.metrics.transition(status);
        }
        self.release(row, &lease.worker_id);
        if !dead {
            let waiting = Waiting {
                plan: lease.plan.clone(),
                action_id: lease.action_id.clone(),
                since_ms: ready_at,
                status,
                fresh: None,
            };
            self.enqueue(row, waiting, now_ms);
        }
        self.touch(&lease.action_id);
        Ok(status)
    }

    /// Turns a fenced statement that changed no row into a fencing
    /// rejection: the database says the job no longer runs under `lease`,
    /// whatever memory says. The batch is then rolled back and the state
    /// reloaded from the database.
    pub(super) fn fenced(&self, changed: bool, lease: &Lease) -> Result<()> {
        if changed {
            return Ok(());
        }
        self.metrics.fencing_rejections.inc();
        Err(Error::precondition(format!(
            "job {} does not run under lease {} of worker {} (fencing); nothing is recorded",
            lease.job_id, lease.lease_id, lease.worker_id
        )))
    }

    /// Drops the lease of `row` from memory and frees the holder's slot.
    pub(super) fn release(&mut self, row: i64, worker_id: &str) {
        if let Some(lease) = self.leases.remove(&row) {
            self.lease_by_job.remove(&lease.job_id);
        }
        if let Some(w) = self.workers.get_mut(worker_id) {
            w.leases.remove(&row);
        }
        self.refresh_available(worker_id);
        self.wants_dispatch = true;
    }

    /// Moves delayed jobs whose time has come to the ready queue
    /// (Failed ones become Pending). Returns how many moved.
    ///
    /// Errors: storage errors.
    pub(super) fn promote_due(&mut self, conn: &Connection, now_ms: i64) -> Result<usize> {
        let mut moved = 0;
        while let Some(&(due, row)) = self.delayed.first() {
            if due > now_ms {
                break;
            }
            self.delayed.pop_first();
            let Some(mut waiting) = self.delayed_jobs.remove(&row) else {
                continue;
            };
            if waiting.status == JobStatus::Failed {
                jobs::promote(conn, row)?;
                waiting.status = JobStatus::Pending;
                self.metrics.transition(JobStatus::Pending);
                self.touch(&waiting.action_id.clone());
            }
            self.enqueue(row, waiting, now_ms);
            moved += 1;
        }
        Ok(moved)
    }

    /// Why the pending or failed job at `row` is not running, in words a
    /// person can act on; empty when it is not waiting.
    pub(super) fn waiting_reason(&self, row: i64) -> String {
        if let Some(w) = self.delayed_jobs.get(&row) {
            return if w.status == JobStatus::Failed {
                format!(
                    "backing off until {} before the next attempt",
                    rfc3339(w.since_ms)
                )
            } else {
                format!("scheduled for {}", rfc3339(w.since_ms))
            };
        }
        let Some(w) = self.ready.get(&row) else {
            return String::new();
        };
        let plan = &w.plan;
        let now = Instant::now();
        let capable: Vec<_> = self
            .workers
            .values()
            .filter(|w| {
                w.state == WorkerState::Active
                    && self.is_fresh(w, now)
                    && w.lease_stream.is_some()
                    && plan.runs_on(w)
            })
            .collect();
        if capable.is_empty() {
            let sandbox = if plan.plan.require_sandbox {
                " and runs tasks in the kernel sandbox (the plan sets require_sandbox)"
            } else {
                ""
            };
            let quarantined = self
                .workers
                .values()
                .filter(|w| w.state == WorkerState::Quarantined && plan.runs_on(w))
                .count();
            let quarantined = if quarantined > 0 {
                format!(
                    " ({quarantined} worker(s) that could are quarantined: agq worker list --state quarantined)"
                )
            } else {
                String::new()
            };
            return format!(
                "no fresh worker has tools [{}]{sandbox}; start or repair a worker that advertises them{quarantined}",
                plan.tools.join(", ")
            );
        }
        if capable.iter().all(|w| w.leases.len() as u32 >= w.max) {
            let slots: u32 = capable.iter().map(|w| w.max).sum();
            return format!(
                "all {} capable workers are busy ({slots} of {slots} slots leased)",
                capable.len()
            );
        }
        let ahead = self.ready.range(..row).count();
        format!("ready; {ahead} jobs ahead in the queue")
    }
}
