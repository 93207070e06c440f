//! The scheduler: where leases are granted and lost. After every batch of
//! operations that made a job ready or freed a slot, [`State::dispatch`]
//! matches ready jobs to fresh, ACTIVE, capable workers with a free slot,
//! least loaded first, and queues the leases for their streams.
//! Freshness is checked here, at every pick.
//!
//! The pick order (fleet scheduling):
//! 1. Higher priority first.
//! 2. Among the actions of one priority, round robin: the action served
//!    longest ago goes next (a new action counts as never served), so one
//!    huge action does not monopolise the fleet.
//! 3. Within an action, submission (FIFO) order.
//! 4. The starvation guard: every `starvation_guard_every` leases, the
//!    oldest ready job a worker can take goes first, whatever its
//!    priority (until one is placed, every lease tries it first); a job
//!    no worker can take now is passed over, not waited for.
//!
//! A job is placeable when its concurrency key (if any) runs fewer than
//! its action's `max_running` jobs and some worker is fresh, ACTIVE, has a
//! free slot, every tool of the job's plan version, the sandbox if the
//! plan requires it, and tags that match the job's worker selector.

use std::{collections::HashSet, sync::Arc, time::Instant};

use rusqlite::Connection;

use super::{
    sql::jobs,
    state::{Effect, FreshJob, GroupKey, Lease, PlanEntry, Sched, State, Waiting},
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
    /// The job's scheduling settings.
    sched: Arc<Sched>,
    worker_id: &'a str,
    lease_id: String,
    attempt: u32,
    /// Since when the job waited (the metric's start), ms.
    waiting_since_ms: i64,
    now_ms: i64,
    expires_at_ms: i64,
    /// The action's W3C `traceparent`, for the lease.
    traceparent: Option<Arc<str>>,
}

impl State {
    /// Grants leases until no ready job has an eligible worker, in the
    /// pick order of the module docs.
    ///
    /// Errors: storage errors (the batch is rolled back).
    pub(super) fn dispatch(&mut self, conn: &Connection) -> Result<()> {
        self.wants_dispatch = false;
        let now = Instant::now();
        // Groups found unplaceable in this call stay so until it returns:
        // granting only takes slots and raises running counts.
        let mut blocked: HashSet<GroupKey> = HashSet::new();
        let mut granter = jobs::LeaseGranter::new(conn);
        loop {
            if self.ready.is_empty() || self.available.is_empty() {
                return Ok(());
            }
            let every = self.cfg.starvation_guard_every;
            let mut chosen = None;
            if every > 0 && self.since_guard + 1 >= every {
                chosen = self
                    .oldest_placeable(&mut blocked, now)
                    .map(|(row, worker)| (row, worker, true));
            }
            if chosen.is_none() {
                for (_, key) in &self.order {
                    if blocked.contains(key) {
                        continue;
                    }
                    let Some(&row) = self.groups.get(key).and_then(|g| g.rows.first()) else {
                        continue;
                    };
                    let Some(w) = self.ready.get(&row) else {
                        continue;
                    };
                    match self.placement(w, now) {
                        Some(worker) => {
                            chosen = Some((row, worker, false));
                            break;
                        }
                        None => {
                            blocked.insert(key.clone());
                        }
                    }
                }
            }
            let Some((row, worker_id, guard)) = chosen else {
                return Ok(());
            };
            self.since_guard = if guard { 0 } else { self.since_guard + 1 };
            self.grant(conn, &mut granter, row, &worker_id)?;
        }
    }

    /// The starvation guard's pick: the oldest ready job a worker can take
    /// now, with that worker. The oldest ready job first (the usual case);
    /// when it cannot be placed (a tool no fresh worker has, a selector no
    /// worker matches), the heads of the other groups oldest first, so
    /// that one job nobody can run does not turn the guard off. Groups
    /// found unplaceable join `blocked`.
    fn oldest_placeable(
        &self,
        blocked: &mut HashSet<GroupKey>,
        now: Instant,
    ) -> Option<(i64, String)> {
        let (&row, w) = self.ready.first_key_value()?;
        let key: GroupKey = (w.action_id.clone(), w.sched.priority);
        if !blocked.contains(&key) {
            if let Some(worker) = self.placement(w, now) {
                return Some((row, worker));
            }
            blocked.insert(key);
        }
        let mut heads: Vec<(i64, &GroupKey)> = self
            .groups
            .iter()
            .filter(|(key, _)| !blocked.contains(*key))
            .filter_map(|(key, g)| g.rows.first().map(|&row| (row, key)))
            .collect();
        heads.sort_unstable_by_key(|&(row, _)| row);
        for (row, key) in heads {
            let Some(w) = self.ready.get(&row) else {
                continue;
            };
            match self.placement(w, now) {
                Some(worker) => return Some((row, worker)),
                None => {
                    blocked.insert(key.clone());
                }
            }
        }
        None
    }

    /// Consecutive leases of one action per round-robin turn: the
    /// configured quantum, or (0) a quarter of the fleet's slots between 1
    /// and 64.
    pub(super) fn round_robin_quantum(&self) -> u32 {
        match self.cfg.round_robin_quantum {
            0 => (self.fleet_slots / 4).clamp(1, 64) as u32,
            q => q,
        }
    }

    /// The worker a waiting job goes to now, if any: its concurrency key
    /// is under its limit and [`Self::pick`] finds a worker.
    pub(super) fn placement(&self, w: &Waiting, now: Instant) -> Option<String> {
        if !self.under_limit(&w.sched) {
            return None;
        }
        self.pick(&w.plan, &w.sched, now)
    }

    /// True when a job with settings `sched` may start without exceeding
    /// its concurrency key's limit.
    fn under_limit(&self, sched: &Sched) -> bool {
        sched
            .limit
            .as_ref()
            .is_none_or(|(key, max)| self.running_by_key.get(key).copied().unwrap_or(0) < *max)
    }

    /// The best worker for a job of `plan` (a plan version) with
    /// settings `sched`: fresh, ACTIVE, lease stream open, every tool of
    /// the version, tags matching the selector, a free slot; least loaded
    /// first.
    fn pick(&self, plan: &PlanEntry, sched: &Sched, now: Instant) -> Option<String> {
        self.available
            .iter()
            .find(|(_, _, id)| {
                self.workers.get(&**id).is_some_and(|w| {
                    w.state == WorkerState::Active
                        && self.is_fresh(w, now)
                        && (w.leases.len() as u32) < w.max
                        // Its close event may still be queued behind this.
                        && w.lease_stream.as_ref().is_some_and(|s| !s.tx.is_closed())
                        && plan.runs_on(w)
                        && sched.admits(w)
                })
            })
            .map(|(_, _, id)| id.to_string())
    }

    /// Grants the job at `row` to `worker_id`: commits the lease in the
    /// batch and queues it for the worker's lease stream.
    fn grant(
        &mut self,
        conn: &Connection,
        granter: &mut jobs::LeaseGranter<'_>,
        row: i64,
        worker_id: &str,
    ) -> Result<()> {
        let now_ms = now_ms();
        // A new job's row is known without reading it (see FreshJob).
        let cached = self.take_fresh(row).map(|(f, w)| {
            let view = jobs::inserted_view(
                f.job_id,
                &w.action_id,
                &w.plan.id,
                w.plan.plan.version,
                f.input,
                f.max_attempts,
                f.created_at_ms,
                w.sched.priority,
            );
            (view, f.traceparent)
        });
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
        granter.grant(row, worker_id, &lease_id, attempt, now_ms, expires_at_ms)?;
        let Some(waiting) = self.dequeue(row) else {
            return Err(Error::Internal(format!("job row {row} was not ready")));
        };
        self.moved(Some(waiting.status), Some(JobStatus::Running));
        let group = (waiting.action_id.clone(), waiting.sched.priority);
        self.lease_out(
            row,
            job,
            NewLease {
                action_id: waiting.action_id,
                plan: waiting.plan,
                sched: waiting.sched,
                worker_id,
                lease_id,
                attempt,
                waiting_since_ms: waiting.since_ms,
                now_ms,
                expires_at_ms,
                traceparent,
            },
        );
        // At the end of its action's turn it goes behind the others of
        // its priority.
        let quantum = self.round_robin_quantum();
        if let Some(g) = self.groups.get_mut(&group) {
            g.turn += 1;
            if g.turn >= quantum {
                g.turn = 0;
                g.served = self.lease_seq;
            }
            self.refile(&group);
        }
        Ok(())
    }

    /// The worker a new job of `plan` (a plan version) with settings
    /// `sched` goes to at once, in the operation that submits it, when
    /// nothing waits in the ready queue (so the pick order holds), its
    /// concurrency key is under its limit and a worker is eligible.
    /// `None`: it is queued.
    pub(super) fn place_at_once(&self, plan: &PlanEntry, sched: &Sched) -> Option<String> {
        if !self.ready.is_empty() || self.available.is_empty() || !self.under_limit(sched) {
            return None;
        }
        self.pick(plan, sched, Instant::now())
    }

    /// Inserts a new job already leased to `worker_id` (see
    /// [`State::place_at_once`]) and queues its lease like [`Self::grant`]:
    /// one INSERT instead of an INSERT and an UPDATE, at `row` with key
    /// `key` (see `jobs::JobInserter::insert`). `plan` is the plan version
    /// the job runs.
    ///
    /// Errors: storage errors only.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert_leased(
        &mut self,
        inserter: &mut jobs::JobInserter<'_>,
        row: i64,
        key: i64,
        job: FreshJob,
        input_json: &str,
        action_id: Arc<str>,
        plan: Arc<PlanEntry>,
        sched: Arc<Sched>,
        worker_id: &str,
    ) -> Result<i64> {
        let lease_id = uuid::Uuid::new_v4().to_string();
        let expires_at_ms = inserter.columns().lease_expires_at_ms;
        inserter.insert(
            row,
            key,
            input_json,
            Some(jobs::FirstLease {
                worker_id,
                lease_id: &lease_id,
            }),
        )?;
        self.moved(None, Some(JobStatus::Running));
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
            sched.priority,
        );
        self.lease_out(
            row,
            view,
            NewLease {
                action_id,
                plan,
                sched,
                worker_id,
                lease_id,
                attempt: 1,
                waiting_since_ms: now_ms,
                now_ms,
                expires_at_ms,
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
        if let Some((key, _)) = &l.sched.limit {
            *self.running_by_key.entry(key.clone()).or_default() += 1;
        }
        self.leases.insert(
            row,
            Lease {
                lease_id: l.lease_id.clone(),
                worker_id: worker_id.to_string(),
                job_id: job.job_id.clone(),
                action_id: l.action_id.clone(),
                plan: l.plan.clone(),
                sched: l.sched,
                attempt: l.attempt,
                max_attempts: job.max_attempts,
                expires_at_ms: l.expires_at_ms,
                granted_at_ms: l.now_ms,
                stream_id: self
                    .workers
                    .get(worker_id)
                    .and_then(|w| w.lease_stream.as_ref())
                    .map_or(0, |s| s.id),
                acknowledged: false,
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
                WorkerCommand::CancelJob {
                    job_id: lease.job_id.clone(),
                    lease_id: lease.lease_id.clone(),
                },
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
                self.cfg.retry_backoff_ms(lease.attempt)
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
        self.moved(Some(JobStatus::Running), Some(status));
        self.metrics.transition(status);
        if !dead && ready_at <= now_ms {
            jobs::promote(conn, row)?;
            self.moved(Some(status), Some(JobStatus::Pending));
            status = JobStatus::Pending;
            self.metrics.transition(status);
        }
        self.release(row, &lease.worker_id);
        if !dead {
            let waiting = Waiting {
                plan: lease.plan.clone(),
                action_id: lease.action_id.clone(),
                sched: lease.sched.clone(),
                since_ms: ready_at,
                status,
                fresh: None,
            };
            self.enqueue(row, waiting, now_ms);
        }
        self.touch(&lease.action_id);
        Ok(status)
    }

    /// Turns a fenced statement that changed no row into an error: the
    /// database says the job no longer runs under `lease`, whatever memory
    /// says. Memory is wrong then, and an operation may already have
    /// changed it (the earlier leases of a worker it releases one by one),
    /// so the error is a storage one: the writer rolls the whole batch
    /// back and reloads the state from the database, and the caller gets
    /// `INTERNAL` (a retry then runs on the reloaded state).
    ///
    /// Errors: [`Error::Storage`] (without a fault of the environment).
    pub(super) fn fenced(&self, changed: bool, lease: &Lease) -> Result<()> {
        if changed {
            return Ok(());
        }
        self.metrics.fencing_rejections.inc();
        tracing::error!(
            job_id = %lease.job_id,
            lease_id = %lease.lease_id,
            worker_id = %lease.worker_id,
            "memory holds a lease the database does not; reloading the state"
        );
        Err(Error::Storage {
            detail: format!(
                "job {} does not run under lease {} of worker {} in the database (fencing); \
                 nothing is recorded",
                lease.job_id, lease.lease_id, lease.worker_id
            ),
            fault: None,
        })
    }

    /// Drops the lease of `row` from memory and frees the holder's slot.
    pub(super) fn release(&mut self, row: i64, worker_id: &str) {
        if let Some(lease) = self.leases.remove(&row) {
            self.forget_lease(&lease);
        }
        self.free_slot(row, worker_id);
    }

    /// Like [`Self::release`], for a lease known to be held: returns it
    /// (taken out of memory, not copied).
    pub(super) fn take_lease(&mut self, row: i64) -> Option<Lease> {
        let lease = self.leases.remove(&row)?;
        self.forget_lease(&lease);
        self.free_slot(row, &lease.worker_id);
        Some(lease)
    }

    /// Drops the indexes of `lease`, taken out of [`State::leases`].
    fn forget_lease(&mut self, lease: &Lease) {
        self.lease_by_job.remove(&lease.job_id);
        if let Some((key, _)) = &lease.sched.limit {
            if let Some(n) = self.running_by_key.get_mut(key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.running_by_key.remove(key);
                }
            }
        }
    }

    /// Frees the slot of `worker_id` that held the job at `row`.
    fn free_slot(&mut self, row: i64, worker_id: &str) {
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
                self.moved(Some(JobStatus::Failed), Some(JobStatus::Pending));
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
        let sched = &w.sched;
        let now = Instant::now();
        let selector = if sched.selector.is_empty() {
            String::new()
        } else {
            format!(" and matches worker selector `{}`", sched.selector)
        };
        let capable: Vec<_> = self
            .workers
            .values()
            .filter(|w| {
                w.state == WorkerState::Active
                    && self.is_fresh(w, now)
                    && w.lease_stream.is_some()
                    && plan.runs_on(w)
                    && sched.admits(w)
            })
            .collect();
        if capable.is_empty() && plan.plan.require_verified_tools {
            let unverified: Vec<&str> = self
                .workers
                .values()
                .filter(|w| {
                    w.state == WorkerState::Active
                        && self.is_fresh(w, now)
                        && w.lease_stream.is_some()
                        && (!plan.plan.require_sandbox || w.info.sandboxed)
                        && plan.tools.iter().all(|t| w.tools.contains(t))
                        && sched.admits(w)
                })
                .map(|w| w.info.worker_id.as_str())
                .collect();
            if !unverified.is_empty() {
                return format!(
                    "no fresh worker has passed a verification of [{}] (the plan sets require_verified_tools); \
                     {} worker(s) advertise them but are not verified ({}): the server challenges them; \
                     see agq worker get ID, or agq worker verify ID TOOL",
                    plan.tools.join(", "),
                    unverified.len(),
                    unverified.join(", ")
                );
            }
        }
        if capable.is_empty() {
            let sandbox = if plan.plan.require_sandbox {
                " and runs tasks in the kernel sandbox (the plan sets require_sandbox)"
            } else {
                ""
            };
            let quarantined = self
                .workers
                .values()
                .filter(|w| {
                    w.state == WorkerState::Quarantined && plan.runs_on(w) && sched.admits(w)
                })
                .count();
            let quarantined = if quarantined > 0 {
                format!(
                    " ({quarantined} worker(s) that could are quarantined: agq worker list --state quarantined)"
                )
            } else {
                String::new()
            };
            let hint = if selector.is_empty() {
                "start or repair a worker that advertises them"
            } else {
                "start a worker with matching tags (agw --tag KEY=VALUE) and those tools"
            };
            return format!(
                "no fresh worker has tools [{}]{sandbox}{selector}; {hint}{quarantined}",
                plan.tools.join(", ")
            );
        }
        if let Some((key, max)) = &sched.limit {
            let running = self.running_by_key.get(key).copied().unwrap_or(0);
            if running >= *max {
                return format!(
                    "concurrency limit of {key} reached ({running} running, max_running {max})"
                );
            }
        }
        if capable.iter().all(|w| w.leases.len() as u32 >= w.max) {
            let slots: u32 = capable.iter().map(|w| w.max).sum();
            return format!(
                "all {} capable workers are busy ({slots} of {slots} slots leased)",
                capable.len()
            );
        }
        let higher: usize = self
            .order
            .iter()
            .take_while(|((std::cmp::Reverse(p), _, _), _)| *p > sched.priority)
            .filter_map(|(_, key)| self.groups.get(key))
            .map(|g| g.rows.len())
            .sum();
        let earlier = self
            .groups
            .get(&(w.action_id.clone(), sched.priority))
            .map_or(0, |g| g.rows.range(..row).count());
        format!(
            "ready at priority {}; {higher} jobs of higher priority and {earlier} earlier jobs of its action wait ahead of it",
            sched.priority
        )
    }
}
