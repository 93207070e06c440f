//! Recurring schedules in the SQLite engine: create, pause, resume,
//! delete, and the firing of due ticks. A firing submits each tick's
//! action through [`State::submit_action`] and records the tick on the
//! schedule in the same transaction, so a tick fires exactly once.

use super::{
    jobs::{NewAction, NewJob},
    sql::{
        self,
        schedules::{self as store, Fired},
    },
    state::State,
};
use crate::{
    core::{
        cron::CronSchedule,
        model::{CatchUp, Schedule, MAX_CATCH_UP, SKIP_GRACE_MS},
        validate,
    },
    error::{Error, Result},
    time::{now_ms, rfc3339},
};

impl State {
    /// Stores a validated schedule with its first tick after now
    /// (CreateSchedule). Returns it as stored.
    ///
    /// Errors: `NotFound` (plan), `AlreadyExists` (id), `InvalidArgument`
    /// (the expression never fires), `FailedPrecondition` (an action has
    /// the id of one of its future ticks), storage errors.
    pub(super) fn create_schedule(
        &mut self,
        conn: &rusqlite::Connection,
        s: Schedule,
    ) -> Result<Schedule> {
        if !self.plans.contains_key(&s.plan_id) {
            return Err(Error::not_found(format!("plan {} not found", s.plan_id)));
        }
        let cron = CronSchedule::parse(&s.cron, &s.time_zone)?;
        let now = now_ms();
        let next = cron
            .next_after_ms(now)
            .ok_or_else(|| Error::invalid(format!("cron {:?} never fires again", s.cron)))?;
        // Action ids `<id>-<digits>` sort between `<id>-` and `<id>-:`.
        let (from, to) = (
            format!("{}-", s.schedule_id),
            format!("{}-:", s.schedule_id),
        );
        let ids: Vec<String> = conn
            .prepare_cached(
                "SELECT action_id FROM actions WHERE action_id > ?1 AND action_id < ?2",
            )?
            .query_map(rusqlite::params![from, to], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        if let Some(taken) =
            validate::taken_tick_id(&s.schedule_id, now, ids.iter().map(String::as_str))
        {
            return Err(validate::tick_id_taken(&s.schedule_id, taken));
        }
        if !store::insert(conn, &s, next)? {
            return Err(Error::AlreadyExists(format!(
                "schedule {} already exists",
                s.schedule_id
            )));
        }
        store::get(conn, &s.schedule_id)?
            .ok_or_else(|| Error::Internal(format!("schedule {} was not stored", s.schedule_id)))
    }

    /// Pauses or resumes (from the first tick after now) schedule `id`.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (resuming an expression
    /// that never fires again), storage errors.
    pub(super) fn set_schedule_paused(
        &mut self,
        conn: &rusqlite::Connection,
        id: &str,
        paused: bool,
    ) -> Result<Schedule> {
        let s = store::get(conn, id)?
            .ok_or_else(|| Error::not_found(format!("schedule {id} not found")))?;
        if s.paused == paused {
            return Ok(s);
        }
        let next = if paused {
            None
        } else {
            let cron = CronSchedule::read(&s.cron, &s.time_zone)?;
            Some(cron.next_after_ms(now_ms()).ok_or_else(|| {
                Error::precondition(format!(
                    "schedule {id}: cron {:?} never fires again",
                    s.cron
                ))
            })?)
        };
        store::set_next_run(conn, id, next)?;
        store::get(conn, id)?.ok_or_else(|| Error::Internal(format!("schedule {id} vanished")))
    }

    /// Deletes schedule `id`.
    ///
    /// Errors: `NotFound`, storage errors.
    pub(super) fn delete_schedule(&mut self, conn: &rusqlite::Connection, id: &str) -> Result<()> {
        if !store::delete(conn, id)? {
            return Err(Error::not_found(format!("schedule {id} not found")));
        }
        Ok(())
    }

    /// Fires every schedule due at `now_ms`: submits the actions of its
    /// due ticks by its catch-up policy and records the firing, all in
    /// this operation's transaction. A tick whose action cannot be
    /// submitted (its plan was deleted, say) is recorded in `last_error`
    /// and not retried; a schedule whose stored row cannot be used (or
    /// whose expression no longer reads) is paused with the reason in
    /// `last_error`. Either way the other schedules fire. Returns the
    /// number of actions submitted.
    ///
    /// Errors: storage errors (the whole firing is rolled back and
    /// retried by the next call).
    pub(super) fn fire_schedules(
        &mut self,
        conn: &rusqlite::Connection,
        now_ms: i64,
    ) -> Result<usize> {
        let mut submitted = 0;
        for s in store::due(conn, now_ms)? {
            let s = match s {
                Ok(s) => s,
                Err((rowid, e)) => {
                    // A stored row this code cannot use (inputs written by
                    // another version, say): it cannot fire until it is
                    // fixed, so pause it with the reason; the others fire.
                    let error = format!("paused: {e}");
                    tracing::warn!(error = %error, "schedule row cannot be used");
                    store::pause_unusable(conn, rowid, &error)?;
                    continue;
                }
            };
            let Some(from) = s.next_run_at_ms else {
                continue;
            };
            // Read, not parsed as new: the due ticks of an expression
            // whose last tick has passed still fire.
            let cron = match CronSchedule::read(&s.cron, &s.time_zone) {
                Ok(c) => c,
                Err(e) => {
                    // A zone gone from the system's database, say: pause it
                    // with the reason rather than retry every second.
                    let error = format!("paused: {e}");
                    store::record_firing(
                        conn,
                        &s.schedule_id,
                        &Fired {
                            next_run_ms: None,
                            last_run_ms: None,
                            last_action_id: None,
                            runs: 0,
                            error: &error,
                        },
                    )?;
                    continue;
                }
            };
            let (mut ticks, more) = cron.ticks_between(from, now_ms, MAX_CATCH_UP);
            let mut errors = Vec::new();
            match s.catch_up {
                CatchUp::All if more => errors.push(format!(
                    "ticks before {} were dropped: at most {MAX_CATCH_UP} missed ticks are caught up",
                    ticks.first().map_or_else(String::new, |t| rfc3339(*t))
                )),
                CatchUp::All => {}
                CatchUp::Latest | CatchUp::Skip => {
                    if ticks.len() > 1 || more {
                        errors.push(format!(
                            "missed ticks before {} were dropped (catch_up {})",
                            ticks.last().map_or_else(String::new, |t| rfc3339(*t)),
                            if s.catch_up == CatchUp::Skip { "skip" } else { "latest" }
                        ));
                    }
                    ticks = ticks.split_off(ticks.len().saturating_sub(1));
                    if s.catch_up == CatchUp::Skip
                        && ticks.first().is_some_and(|t| now_ms - t >= SKIP_GRACE_MS)
                    {
                        ticks.clear();
                    }
                }
            }
            let mut last: Option<(i64, String)> = None;
            let mut runs = 0;
            // Checked once, before any tick changes the state: a refusal
            // after a submitted tick would leave the state changed by an
            // operation that failed.
            let jobs = match s
                .inputs
                .iter()
                .map(|i| NewJob::new(i.clone()))
                .collect::<Result<Vec<_>>>()
            {
                Ok(jobs) => jobs,
                Err(e) => {
                    errors.push(format!("its inputs cannot be submitted: {e}"));
                    ticks.clear();
                    Vec::new()
                }
            };
            for tick in ticks {
                let action_id = format!("{}-{}", s.schedule_id, tick.div_euclid(1000));
                // Each tick's jobs get keys of their own.
                let jobs = jobs
                    .iter()
                    .map(|j| NewJob {
                        key: sql::jobs::new_job_key(),
                        ..j.clone()
                    })
                    .collect();
                let a = NewAction {
                    action_id: action_id.clone(),
                    plan_id: s.plan_id.clone(),
                    jobs,
                    run_at_ms: None,
                    max_attempts: s.max_attempts,
                    traceparent: None,
                    scheduling: s.scheduling.clone(),
                };
                match self.submit_action(conn, a) {
                    Ok(_) => {
                        runs += 1;
                        last = Some((tick, action_id));
                    }
                    // Storage failed under it (the state may have
                    // changed): the whole firing is rolled back.
                    Err(
                        e @ (Error::Storage { .. }
                        | Error::StoreBusy(_)
                        | Error::StoreUnavailable(_)
                        | Error::Unavailable),
                    ) => return Err(e),
                    // Refused before anything was written (every other
                    // error of `submit_action` is): recorded, not retried.
                    Err(e) => errors.push(format!("tick {}: {e}", rfc3339(tick))),
                }
            }
            submitted += runs;
            self.metrics.schedule_runs.inc_by(runs as u64);
            let error = errors.join("; ");
            store::record_firing(
                conn,
                &s.schedule_id,
                &Fired {
                    next_run_ms: cron.next_after_ms(now_ms),
                    last_run_ms: last.as_ref().map(|(t, _)| *t),
                    last_action_id: last.as_ref().map(|(_, id)| id.as_str()),
                    runs: runs as u64,
                    error: &error,
                },
            )?;
            if !error.is_empty() {
                tracing::warn!(schedule_id = %s.schedule_id, error = %error, "schedule tick not submitted");
            }
        }
        Ok(submitted)
    }
}
