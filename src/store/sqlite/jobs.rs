//! The job state machine of the SQLite engine: plans submitted (new
//! versions included) and deleted, actions fanned out into jobs, fenced
//! reports, cancel, retry and retention.

use std::{collections::HashMap, sync::Arc};

use rusqlite::Connection;

use super::{
    sql::{jobs, plans, retention},
    state::{FreshJob, PlanEntry, Sched, State, Waiting, FRESH_BYTES_MAX},
    writer::BatchConn,
};
use crate::{
    core::{
        model::{JobReport, JobStatus, Plan, Scheduling, SubmittedPlan, WorkerCommand},
        validate,
    },
    error::{Error, Result},
    time::now_ms,
};

/// A validated SubmitAction.
#[derive(Debug, Clone)]
pub(super) struct NewAction {
    /// Action id (generated when the client gave none).
    pub action_id: String,
    /// Plan to run.
    pub plan_id: String,
    /// One per input, in order.
    pub jobs: Vec<NewJob>,
    /// Scheduled start, ms; `None` runs now.
    pub run_at_ms: Option<i64>,
    /// Attempts per job.
    pub max_attempts: u32,
    /// W3C `traceparent` of the submission, sent with each lease.
    pub traceparent: Option<String>,
    /// Fleet scheduling settings (validated; an empty selector takes the
    /// plan's default).
    pub scheduling: Scheduling,
}

/// One job of a [`NewAction`], prepared before it reaches the writer thread
/// (the key and the JSON cost the single writer nothing).
#[derive(Debug, Clone)]
pub(super) struct NewJob {
    /// The random low half of its public id (`jobs::new_job_key`); the
    /// writer adds the row.
    pub key: i64,
    /// The input values.
    pub input: HashMap<String, String>,
    /// `input` as the JSON object stored in the row.
    pub input_json: String,
}

impl NewJob {
    /// A job with a new key for `input`.
    ///
    /// Errors: `Internal` if the input cannot be written as JSON (a map of
    /// strings always can).
    pub(super) fn new(input: HashMap<String, String>) -> Result<NewJob> {
        let input_json =
            serde_json::to_string(&input).map_err(|e| Error::Internal(e.to_string()))?;
        Ok(NewJob {
            key: jobs::new_job_key(),
            input,
            input_json,
        })
    }
}

/// Refuses to reopen an action that retention is deleting (some of its
/// jobs are gone already).
///
/// Errors: `FailedPrecondition` for such an action, storage errors.
fn refuse_if_expiring(conn: &Connection, action_id: &str) -> Result<()> {
    if retention::partly_deleted(conn, action_id)? {
        return Err(Error::precondition(format!(
            "action {action_id} is being deleted by retention (it finished longer ago than \
             --job-retention-secs); it cannot be retried"
        )));
    }
    Ok(())
}

impl State {
    /// Stores a validated plan (the PLAN.SUBMIT command): a new id as
    /// version 1; with `replace`, an existing id as its next version, or
    /// nothing when the content equals the latest version's. Queued jobs
    /// and leases keep the entry of the version they run, so they are not
    /// touched. Every check comes before the first SQL write.
    ///
    /// Errors: `AlreadyExists` (the id exists, no `replace`),
    /// `ResourceExhausted` (no version number left), storage errors.
    pub(super) fn submit_plan(
        &mut self,
        conn: &Connection,
        mut plan: Plan,
        replace: bool,
    ) -> Result<SubmittedPlan> {
        let now_ms = now_ms();
        match self.plans.get(&plan.plan_id) {
            None => {
                plan.version = 1;
                if !plans::insert(conn, &plan, now_ms)? {
                    return Err(Error::Internal(format!(
                        "plan {} is stored but not in memory",
                        plan.plan_id
                    )));
                }
            }
            Some(latest) if !replace => {
                return Err(Error::AlreadyExists(format!(
                    "plan {} already exists (version {}); submit it with replace to store a new version",
                    plan.plan_id, latest.plan.version
                )));
            }
            Some(latest) if latest.plan.same_content(&plan) => {
                return Ok(SubmittedPlan {
                    plan_id: plan.plan_id,
                    version: latest.plan.version,
                    created: false,
                });
            }
            Some(latest) => {
                plan.version = latest.plan.version.checked_add(1).ok_or_else(|| {
                    Error::ResourceExhausted(format!(
                        "plan {} has the most versions a plan can have; delete it or use another id",
                        plan.plan_id
                    ))
                })?;
                if !plans::add_version(conn, &plan, now_ms)? {
                    return Err(Error::Internal(format!(
                        "plan {} is in memory but not stored",
                        plan.plan_id
                    )));
                }
            }
        }
        let submitted = SubmittedPlan {
            plan_id: plan.plan_id.clone(),
            version: plan.version,
            created: true,
        };
        let entry = Arc::new(PlanEntry::new(plan));
        let verify = entry.plan.require_verified_tools;
        if let Some(old) = self.plans.insert(submitted.plan_id.clone(), entry) {
            // Open jobs may still run the replaced version: a retry of one
            // of them finds it here while they hold it.
            self.old_plans.insert(
                (submitted.plan_id.clone(), old.plan.version),
                Arc::downgrade(&old),
            );
        }
        if verify {
            // Challenge the workers that could run it but are not verified.
            let ids: Vec<String> = self.workers.keys().cloned().collect();
            for id in ids {
                self.challenge_missing(&id);
            }
        }
        Ok(submitted)
    }

    /// Deletes a plan with all its versions and its finished history (the
    /// PLAN.DELETE command).
    ///
    /// Errors: `NotFound`; `FailedPrecondition` while pending, running or
    /// retrying jobs use any version of it; storage errors.
    pub(super) fn delete_plan(&mut self, conn: &Connection, plan_id: &str) -> Result<()> {
        if !self.plans.contains_key(plan_id) {
            return Err(Error::not_found(format!("plan {plan_id} not found")));
        }
        if self.plan_in_use(plan_id) {
            return Err(Error::precondition(format!(
                "plan {plan_id} is used by pending or running jobs; cancel them or wait until they finish"
            )));
        }
        // Its jobs (all finished) go with it.
        let deleted = jobs::count_by_status_of_plan(conn, plan_id)?;
        plans::delete(conn, plan_id)?;
        for (status, n) in deleted {
            self.job_counts[status as usize] -= n;
        }
        self.plans.remove(plan_id);
        self.old_plans.retain(|(id, _), _| id != plan_id);
        Ok(())
    }

    /// Creates the action and one pending job per input (the
    /// ACTION.SUBMIT command), all running the plan's latest version.
    /// Returns the job ids. Every check comes before the
    /// first SQL write, so it runs without a savepoint
    /// (`Writer::write_direct`): keep it that way.
    ///
    /// Errors: `NotFound` (plan), `AlreadyExists` (action id), storage errors.
    pub(super) fn submit_action(
        &mut self,
        conn: &Connection,
        mut a: NewAction,
    ) -> Result<Vec<String>> {
        let Some(plan) = self.plans.get(&a.plan_id).cloned() else {
            return Err(Error::not_found(format!("plan {} not found", a.plan_id)));
        };
        let now_ms = now_ms();
        let ready_at = a.run_at_ms.unwrap_or(now_ms).max(now_ms);
        let total = a.jobs.len() as u32;
        let version = plan.plan.version;
        if a.scheduling.worker_selector.is_empty() {
            a.scheduling
                .worker_selector
                .clone_from(&plan.plan.worker_selector);
        }
        let sched = Arc::new(Sched::new(&a.scheduling)?);
        let (first_row, last_row) = jobs::next_rows(self.last_job_row, now_ms, total);
        if !jobs::insert_action(
            conn,
            &a.action_id,
            &a.plan_id,
            version,
            total,
            a.max_attempts,
            a.run_at_ms,
            a.traceparent.as_deref(),
            &a.scheduling,
            now_ms,
            (first_row, last_row),
        )? {
            return Err(Error::AlreadyExists(format!(
                "action {} already exists",
                a.action_id
            )));
        }
        self.last_job_row = last_row;
        let action_id = self.intern_action(&a.action_id);
        let runs_now = ready_at <= now_ms;
        let traceparent: Option<Arc<str>> = a.traceparent.take().map(Arc::from);
        let mut ids = Vec::with_capacity(a.jobs.len());
        let mut inserter = jobs::JobInserter::new(
            conn,
            jobs::ActionColumns {
                action_id: &a.action_id,
                plan_id: &a.plan_id,
                plan_version: version,
                max_attempts: a.max_attempts,
                priority: sched.priority,
                now_ms,
                ready_at_ms: ready_at,
                lease_expires_at_ms: now_ms + self.cfg.job_timeout.as_millis() as i64,
            },
        );
        for (
            row,
            NewJob {
                key,
                input,
                input_json,
            },
        ) in (first_row..).zip(std::mem::take(&mut a.jobs))
        {
            let job_id = jobs::public_job_id(row, key);
            ids.push(job_id.clone());
            let fresh = FreshJob {
                job_id,
                input,
                max_attempts: a.max_attempts,
                created_at_ms: now_ms,
                traceparent: traceparent.clone(),
            };
            // Straight to an idle worker while nothing older waits: the row
            // is inserted leased (no second write to grant it).
            if let Some(worker_id) = runs_now
                .then(|| self.place_at_once(&plan, &sched))
                .flatten()
            {
                self.insert_leased(
                    &mut inserter,
                    row,
                    key,
                    fresh,
                    &input_json,
                    action_id.clone(),
                    plan.clone(),
                    sched.clone(),
                    &worker_id,
                )?;
                continue;
            }
            inserter.insert(row, key, &input_json, None)?;
            self.moved(None, Some(JobStatus::Pending));
            // Jobs that go straight to the ready queue keep their row in
            // memory for their first lease while the kept rows weigh less
            // than the budget.
            let keep = runs_now && {
                let weight = fresh.weight();
                let fits = self.fresh_bytes + weight <= FRESH_BYTES_MAX;
                if fits {
                    self.fresh_bytes += weight;
                }
                fits
            };
            let waiting = Waiting {
                plan: plan.clone(),
                action_id: action_id.clone(),
                sched: sched.clone(),
                since_ms: ready_at,
                status: JobStatus::Pending,
                fresh: keep.then(|| Box::new(fresh)),
            };
            self.enqueue(row, waiting, now_ms);
        }
        for _ in 0..total {
            self.metrics.transition(JobStatus::Pending);
        }
        self.touch(&action_id);
        Ok(ids)
    }

    /// Applies a worker's report on a leased job (the JOB.UPDATE command), fenced
    /// by the lease: only the holder, with the current lease id, may report.
    /// Every check comes before the first SQL write, so it runs without a
    /// savepoint (`Writer::write_direct`): keep it that way. A final report
    /// repeated after its outcome was recorded (the first reply was lost)
    /// is acknowledged again with the job's status, changing nothing.
    ///
    /// Errors: `NotFound` (job), `PermissionDenied` (another worker's lease),
    /// `FailedPrecondition` (stale lease id, job not running),
    /// `InvalidArgument` (status not RUNNING/COMPLETED/FAILED), storage errors.
    pub(super) fn update_job(
        &mut self,
        conn: &BatchConn<'_>,
        req: &JobReport,
        results: Option<&str>,
    ) -> Result<JobStatus> {
        // A job under lease is found in memory; only reports on other jobs
        // (rejected below) need the database to say what the job is.
        let leased = self
            .lease_by_job
            .get(req.job_id.as_str())
            .and_then(|row| self.leases.get(row).map(|l| (*row, l)));
        let (row, lease) = match leased {
            Some(found) => found,
            None => {
                let key = jobs::key_by_job_id(conn, &req.job_id)?
                    .ok_or_else(|| Error::not_found(format!("job {} not found", req.job_id)))?;
                // A repeat of the report that ended this attempt (its
                // reply was lost): acknowledged again, nothing changes.
                let same_lease = key.lease_id.as_deref() == Some(req.lease_id.as_str())
                    && key.worker_id.as_deref() == Some(req.worker_id.as_str());
                let repeated = match req.status {
                    Some(JobStatus::Completed) => key.status == JobStatus::Completed,
                    Some(JobStatus::Failed) => matches!(
                        key.status,
                        JobStatus::Failed | JobStatus::Dead | JobStatus::Pending
                    ),
                    _ => false,
                };
                if same_lease && repeated {
                    return Ok(key.status);
                }
                self.metrics.fencing_rejections.inc();
                let msg = format!(
                    "job {} is {} and holds no lease of worker {}; the report is rejected",
                    req.job_id,
                    key.status.name(),
                    req.worker_id
                );
                return Err(
                    if key.worker_id.as_deref() != Some(req.worker_id.as_str()) {
                        Error::PermissionDenied(msg)
                    } else {
                        Error::FailedPrecondition(msg)
                    },
                );
            }
        };
        if lease.worker_id != req.worker_id {
            self.metrics.fencing_rejections.inc();
            return Err(Error::PermissionDenied(format!(
                "job {} is leased to another worker, not {}",
                req.job_id, req.worker_id
            )));
        }
        if lease.lease_id != req.lease_id {
            self.metrics.fencing_rejections.inc();
            return Err(Error::precondition(format!(
                "stale lease {} for job {}: the current lease is newer (fencing)",
                req.lease_id, req.job_id
            )));
        }
        let status = req.status;
        validate::progress(req.current_task, req.progress_percent)?;
        validate::report_in_plan(req, lease.plan.plan.tasks.len())?;
        if req.permanent && status != Some(JobStatus::Failed) {
            return Err(Error::invalid(
                "permanent is for JOB_STATUS_FAILED reports only",
            ));
        }
        let now_ms = now_ms();
        // The outcome's statement runs first: when a fenced one changes
        // nothing (memory and database disagree), nothing else is written.
        // A completion carries its attempt instead, and counts only in
        // the attempt the job row runs (`jobs::complete`).
        let after =
            match status {
                Some(JobStatus::Running) => {
                    let fence = jobs::Fence {
                        lease_id: &lease.lease_id,
                        worker_id: &lease.worker_id,
                    };
                    let changed = jobs::set_progress(
                        conn,
                        row,
                        fence,
                        req.current_task,
                        req.progress_percent,
                        results,
                    )?;
                    self.fenced(changed, lease)?;
                    JobStatus::Running
                }
                Some(JobStatus::Completed) => {
                    let granted_at_ms = lease.granted_at_ms;
                    jobs::complete(conn, row, lease.attempt, now_ms, results)?;
                    self.moved(Some(JobStatus::Running), Some(JobStatus::Completed));
                    self.metrics.transition(JobStatus::Completed);
                    self.metrics
                        .job_duration
                        .observe((now_ms - granted_at_ms).max(0) as f64 / 1000.0);
                    if let Some(lease) = self.take_lease(row) {
                        self.touch(&lease.action_id);
                    }
                    JobStatus::Completed
                }
                Some(JobStatus::Failed) => {
                    let lease = lease.clone();
                    let error = if req.error.is_empty() {
                        "the worker reported failure".to_string()
                    } else {
                        req.error.clone()
                    };
                    let after = self.end_attempt(conn, row, &lease, &error, true, req.permanent)?;
                    jobs::set_task_results(conn, row, results)?;
                    self.metrics
                        .job_duration
                        .observe((now_ms - lease.granted_at_ms).max(0) as f64 / 1000.0);
                    self.metrics.requeue("job_failed");
                    after
                }
                _ => return Err(Error::invalid(
                    "status must be JOB_STATUS_RUNNING, JOB_STATUS_COMPLETED or JOB_STATUS_FAILED",
                )),
            };
        Ok(after)
    }

    /// Cancels a pending or running job; the holder of a running one is
    /// told over its heartbeat stream. Returns the job's row.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (already terminal), storage errors.
    pub(super) fn cancel_job(&mut self, conn: &Connection, job_id: &str) -> Result<i64> {
        let key = jobs::key_by_job_id(conn, job_id)?
            .ok_or_else(|| Error::not_found(format!("job {job_id} not found")))?;
        match key.status {
            JobStatus::Pending | JobStatus::Failed | JobStatus::Running => {}
            s => {
                return Err(Error::precondition(format!(
                    "job {job_id} is {} and cannot be cancelled",
                    s.name()
                )))
            }
        }
        self.cancel_row(conn, key.row, job_id, now_ms())?;
        let action = self.intern_action(&key.action_id);
        self.touch(&action);
        Ok(key.row)
    }

    /// Cancels the open job at `row` (public id `job_id`): the row, the
    /// queues, and the lease, whose holder is told.
    fn cancel_row(&mut self, conn: &Connection, row: i64, job_id: &str, now_ms: i64) -> Result<()> {
        // An open job is leased, delayed (scheduled, or failed and waiting
        // out its backoff) or ready (pending).
        let from = if self.leases.contains_key(&row) {
            JobStatus::Running
        } else {
            self.delayed_jobs
                .get(&row)
                .map_or(JobStatus::Pending, |w| w.status)
        };
        jobs::cancel(conn, row, now_ms)?;
        self.moved(Some(from), Some(JobStatus::Cancelled));
        self.metrics.transition(JobStatus::Cancelled);
        self.dequeue(row);
        if let Some(lease) = self.leases.get(&row).cloned() {
            self.command(
                &lease.worker_id,
                WorkerCommand::CancelJob {
                    job_id: job_id.to_string(),
                    lease_id: lease.lease_id.clone(),
                },
            );
            self.release(row, &lease.worker_id);
        }
        Ok(())
    }

    /// Cancels every pending, running or failed job of `action_id`, each
    /// as [`State::cancel_job`] does. Returns how many.
    ///
    /// Errors: `NotFound` (action), storage errors.
    pub(super) fn cancel_action(&mut self, conn: &Connection, action_id: &str) -> Result<u32> {
        if !jobs::action_exists(conn, action_id)? {
            return Err(Error::not_found(format!("action {action_id} not found")));
        }
        let open = jobs::jobs_of_action(
            conn,
            action_id,
            &[JobStatus::Pending, JobStatus::Running, JobStatus::Failed],
        )?;
        let now_ms = now_ms();
        for (row, job_id, _) in &open {
            self.cancel_row(conn, *row, job_id, now_ms)?;
        }
        if !open.is_empty() {
            let action = self.intern_action(action_id);
            self.touch(&action);
        }
        Ok(open.len() as u32)
    }

    /// Puts every failed and dead job of `action_id` (of `status` only,
    /// when given: failed or dead) back to pending, each as
    /// [`State::retry_job`] does (on the action's plan version). Returns
    /// how many.
    ///
    /// Errors: `NotFound` (action), `FailedPrecondition` (a job matches but
    /// the plan is gone, or retention is deleting the action; nothing
    /// changes), storage errors.
    pub(super) fn retry_action(
        &mut self,
        conn: &Connection,
        action_id: &str,
        status: Option<JobStatus>,
    ) -> Result<u32> {
        let (plan_id, version) = jobs::action_plan(conn, action_id)?
            .ok_or_else(|| Error::not_found(format!("action {action_id} not found")))?;
        let statuses = match status {
            Some(s) => vec![s],
            None => vec![JobStatus::Failed, JobStatus::Dead],
        };
        let matching = jobs::jobs_of_action(conn, action_id, &statuses)?;
        if matching.is_empty() {
            return Ok(0);
        }
        refuse_if_expiring(conn, action_id)?;
        let plan = self.retry_plan(conn, &plan_id, version)?;
        let sched = self.action_sched(conn, action_id)?;
        let now_ms = now_ms();
        let action = self.intern_action(action_id);
        for (row, _, priority) in &matching {
            let sched = if *priority == sched.priority {
                sched.clone()
            } else {
                Arc::new(sched.with_priority(*priority))
            };
            self.retry_row(conn, *row, plan.clone(), sched, action.clone(), now_ms)?;
        }
        // The action is open again: clear its finish time.
        retention::mark_open(conn, &action)?;
        self.touch(&action);
        Ok(matching.len() as u32)
    }

    /// The scheduling settings of action `action_id`, read back for a
    /// retry (at the action's priority).
    ///
    /// Errors: `NotFound` (no such action), `Internal` (an undecodable
    /// selector), storage errors.
    fn action_sched(&mut self, conn: &Connection, action_id: &str) -> Result<Arc<Sched>> {
        let s = jobs::action_scheduling(conn, action_id)?
            .ok_or_else(|| Error::not_found(format!("action {action_id} not found")))?;
        Ok(Arc::new(Sched::new(&s)?))
    }

    /// The entry of the plan version a retried job runs (the one it was
    /// created with).
    ///
    /// Errors: `FailedPrecondition` when the plan was deleted, storage
    /// errors.
    fn retry_plan(
        &mut self,
        conn: &Connection,
        plan_id: &str,
        version: u32,
    ) -> Result<Arc<PlanEntry>> {
        self.plan_version(conn, plan_id, version)?.ok_or_else(|| {
            Error::precondition(format!(
                "plan {plan_id} (version {version}) no longer exists"
            ))
        })
    }

    /// Puts the failed or dead job at `row` back to pending and in the
    /// ready queue, running `plan` at the priority of `sched`.
    fn retry_row(
        &mut self,
        conn: &Connection,
        row: i64,
        plan: Arc<PlanEntry>,
        sched: Arc<Sched>,
        action_id: Arc<str>,
        now_ms: i64,
    ) -> Result<()> {
        // A failed job waits out its backoff in the delayed queue; a dead
        // one is in no queue.
        let from = self
            .delayed_jobs
            .get(&row)
            .map_or(JobStatus::Dead, |w| w.status);
        jobs::retry(conn, row, now_ms, sched.priority)?;
        self.open_floor = self.open_floor.min(row);
        self.moved(Some(from), Some(JobStatus::Pending));
        self.metrics.transition(JobStatus::Pending);
        self.dequeue(row);
        let waiting = Waiting {
            plan,
            action_id,
            sched,
            since_ms: now_ms,
            status: JobStatus::Pending,
            fresh: None,
        };
        self.enqueue(row, waiting, now_ms);
        Ok(())
    }

    /// Puts a failed or dead job back to pending with a fresh attempt
    /// budget (the JOB.RETRY command), on the plan version it was created
    /// with, at `priority` when given (else its own). Returns the job's row.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` from any other status or
    /// while retention deletes its action, storage errors.
    pub(super) fn retry_job(
        &mut self,
        conn: &Connection,
        job_id: &str,
        priority: Option<i32>,
    ) -> Result<i64> {
        let key = jobs::key_by_job_id(conn, job_id)?
            .ok_or_else(|| Error::not_found(format!("job {job_id} not found")))?;
        if !matches!(key.status, JobStatus::Failed | JobStatus::Dead) {
            return Err(Error::precondition(format!(
                "job {job_id} is {}; only failed or dead jobs can be retried",
                key.status.name()
            )));
        }
        refuse_if_expiring(conn, &key.action_id)?;
        let plan = self.retry_plan(conn, &key.plan_id, key.plan_version)?;
        let sched = self.action_sched(conn, &key.action_id)?;
        let priority = priority.unwrap_or(key.priority);
        let sched = if priority == sched.priority {
            sched
        } else {
            Arc::new(sched.with_priority(priority))
        };
        let now_ms = now_ms();
        let action = self.intern_action(&key.action_id);
        self.retry_row(conn, key.row, plan, sched, action.clone(), now_ms)?;
        // The action is open again: clear its finish time.
        retention::mark_open(conn, &action)?;
        self.touch(&action);
        Ok(key.row)
    }

    /// Deletes finished actions whose last job ended before `cutoff_ms`
    /// (ms since the epoch), oldest first, with their jobs and task
    /// results: at most `limit` jobs in one call, so a large action goes
    /// over several calls. Watchers of a deleted action are woken (their
    /// next read is `NotFound`). Returns the number of jobs deleted, plus
    /// one per action row deleted: 0 means nothing (more) has expired.
    ///
    /// Errors: storage errors.
    pub(super) fn expire_finished(
        &mut self,
        conn: &Connection,
        cutoff_ms: i64,
        limit: usize,
    ) -> Result<usize> {
        let mut removed = 0;
        while removed < limit {
            let Some(action_id) = retention::oldest_expired(conn, cutoff_ms)? else {
                break;
            };
            let d = retention::delete_some(conn, &action_id, limit - removed)?;
            for status in d.statuses {
                self.moved(Some(status), None);
            }
            self.expired_in_batch += d.jobs as u64;
            removed += d.jobs;
            if !d.action {
                break;
            }
            removed += 1;
            self.touch(&Arc::from(action_id));
        }
        Ok(removed)
    }
}
