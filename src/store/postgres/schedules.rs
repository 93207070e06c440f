//! Recurring schedules in the PostgreSQL engine: create, pause, resume,
//! delete, and the firing of due ticks by the maintenance leader. A tick's
//! action is inserted in the transaction that records the tick on the
//! schedule's locked row, so a tick fires exactly once whichever replica
//! leads, and a late leader finds the tick already recorded.

use deadpool_postgres::{GenericClient, Transaction};
use tokio_postgres::Row;

use super::{db_err, PgEngine};
use crate::{
    core::{
        cron::CronSchedule,
        engine::Page,
        model::{CatchUp, Schedule, Scheduling, MAX_CATCH_UP, SKIP_GRACE_MS},
        page,
        validate::{self, ValidAction},
    },
    error::{Error, Result},
    store::sqlite::sql::schedules::{catch_up_code, catch_up_of},
    time::rfc3339,
};

/// The columns [`schedule`] reads.
const COLS: &str = "schedule_id, plan_id, cron, time_zone, inputs, max_attempts, priority,
    worker_selector, concurrency_key, max_running, catch_up, next_run_ms, last_run_ms,
    last_action_id, runs, last_error, created_at_ms";

/// The schedule in a row selected with [`COLS`].
///
/// Errors: `Internal` for undecodable inputs.
fn schedule(r: &Row) -> Result<Schedule> {
    let s = schedule_view(r);
    match serde_json::from_str(r.get(4)) {
        Ok(inputs) => Ok(Schedule { inputs, ..s }),
        Err(e) => Err(Error::Internal(format!(
            "schedule {}: stored inputs do not parse: {e}",
            s.schedule_id
        ))),
    }
}

/// [`schedule`] for reading a schedule back (get, list): stored inputs
/// that do not parse leave `inputs` empty and say why in `last_error`
/// (unless it already says, as the firing that paused it does), so one
/// damaged row neither hides itself nor fails a listing of the others.
fn schedule_view(r: &Row) -> Schedule {
    let id: String = r.get(0);
    let last_error: String = r.get(15);
    let (inputs, last_error) = match serde_json::from_str(r.get(4)) {
        Ok(inputs) => (inputs, last_error),
        Err(e) if last_error.is_empty() => (
            Vec::new(),
            format!("internal error: schedule {id}: stored inputs do not parse: {e}"),
        ),
        Err(_) => (Vec::new(), last_error),
    };
    let next: Option<i64> = r.get(11);
    Schedule {
        plan_id: r.get(1),
        cron: r.get(2),
        time_zone: r.get(3),
        inputs,
        max_attempts: r.get::<_, i32>(5) as u32,
        scheduling: Scheduling {
            priority: r.get(6),
            worker_selector: r.get(7),
            concurrency_key: r.get(8),
            max_running: r.get::<_, i32>(9) as u32,
        },
        catch_up: catch_up_of(r.get(10)),
        paused: next.is_none(),
        next_run_at_ms: next,
        last_run_at_ms: r.get(12),
        last_action_id: r.get(13),
        runs: r.get::<_, i64>(14).max(0) as u64,
        last_error,
        created_at_ms: r.get(16),
        schedule_id: id,
    }
}

/// Schedule `id`, if stored (with empty inputs when the stored ones do
/// not parse: see [`schedule_view`]).
async fn get(c: &impl GenericClient, id: &str, lock: bool) -> Result<Option<Schedule>> {
    let sql = format!(
        "SELECT {COLS} FROM schedules WHERE schedule_id = $1{}",
        if lock { " FOR UPDATE" } else { "" }
    );
    Ok(c.query_opt(&sql, &[&id])
        .await
        .map_err(db_err)?
        .map(|r| schedule_view(&r)))
}

/// Takes the transaction-level lock of schedule id `schedule_id`'s tick
/// ids: CreateSchedule, which looks for actions with the id of a future
/// tick, and SubmitAction of an id of the tick form, which looks for the
/// schedule, take it first, so neither misses the other.
///
/// Errors: storage errors.
pub(super) async fn lock_tick_ids(c: &impl GenericClient, schedule_id: &str) -> Result<()> {
    c.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('agq schedule ticks ' || $1, 0))",
        &[&schedule_id],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

impl PgEngine {
    pub(super) async fn pg_create_schedule(&self, s: Schedule) -> Result<Schedule> {
        let mut client = self.client().await?;
        let c = client.transaction().await.map_err(db_err)?;
        // Taken by SubmitAction of an id of this schedule's form too: a
        // tick's id is either refused to the client or found here.
        lock_tick_ids(&c, &s.schedule_id).await?;
        let plan = c
            .query_opt("SELECT 1 FROM plans WHERE plan_id = $1", &[&s.plan_id])
            .await
            .map_err(db_err)?;
        if plan.is_none() {
            return Err(Error::not_found(format!("plan {} not found", s.plan_id)));
        }
        let cron = CronSchedule::parse(&s.cron, &s.time_zone)?;
        let now: i64 = c
            .query_one("SELECT agq_now_ms()", &[])
            .await
            .map_err(db_err)?
            .get(0);
        let next = cron
            .next_after_ms(now)
            .ok_or_else(|| Error::invalid(format!("cron {:?} never fires again", s.cron)))?;
        // Action ids `<id>-<digits>` sort between `<id>-` and `<id>-:`.
        let ids: Vec<String> = c
            .query(
                "SELECT action_id FROM actions WHERE action_id > $1 AND action_id < $2",
                &[
                    &format!("{}-", s.schedule_id),
                    &format!("{}-:", s.schedule_id),
                ],
            )
            .await
            .map_err(db_err)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if let Some(taken) =
            validate::taken_tick_id(&s.schedule_id, now, ids.iter().map(String::as_str))
        {
            return Err(validate::tick_id_taken(&s.schedule_id, taken));
        }
        let inputs =
            serde_json::to_string(&s.inputs).map_err(|e| Error::Internal(e.to_string()))?;
        let n = c
            .execute(
                "INSERT INTO schedules (schedule_id, plan_id, cron, time_zone, inputs, max_attempts,
                     priority, worker_selector, concurrency_key, max_running, catch_up, next_run_ms,
                     created_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
                 ON CONFLICT (schedule_id) DO NOTHING",
                &[
                    &s.schedule_id,
                    &s.plan_id,
                    &s.cron,
                    &s.time_zone,
                    &inputs,
                    &(s.max_attempts as i32),
                    &s.scheduling.priority,
                    &s.scheduling.worker_selector,
                    &s.scheduling.concurrency_key,
                    &(s.scheduling.max_running as i32),
                    &catch_up_code(s.catch_up),
                    &next,
                    &now,
                ],
            )
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(Error::AlreadyExists(format!(
                "schedule {} already exists",
                s.schedule_id
            )));
        }
        let stored = get(&c, &s.schedule_id, false)
            .await?
            .ok_or_else(|| Error::Internal(format!("schedule {} was not stored", s.schedule_id)))?;
        c.commit().await.map_err(db_err)?;
        Ok(stored)
    }

    pub(super) async fn pg_get_schedule(&self, id: &str) -> Result<Schedule> {
        let c = self.client().await?;
        get(&c, id, false)
            .await?
            .ok_or_else(|| Error::not_found(format!("schedule {id} not found")))
    }

    pub(super) async fn pg_list_schedules(
        &self,
        page_size: u32,
        page_token: String,
    ) -> Result<Page<Schedule>> {
        let limit = page::page_size(page_size)?;
        let after = page::decode_token("schedule", &page_token)?;
        let c = self.client().await?;
        let found = c
            .query(
                &format!(
                    "SELECT {COLS} FROM schedules WHERE ($1::text IS NULL OR schedule_id > $1)
                     ORDER BY schedule_id LIMIT $2"
                ),
                &[&after, &((limit + 1) as i64)],
            )
            .await
            .map_err(db_err)?
            .iter()
            .map(schedule_view)
            .collect::<Vec<_>>();
        let (items, next_page_token) = page::split_page_within(
            found,
            limit,
            "schedule",
            |s| s.schedule_id.clone(),
            |s| crate::core::validate::input_bytes(&s.inputs),
            page::PAGE_BYTES,
        );
        Ok(Page {
            items,
            next_page_token,
        })
    }

    pub(super) async fn pg_set_schedule_paused(&self, id: &str, paused: bool) -> Result<Schedule> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        let s = get(&tx, id, true)
            .await?
            .ok_or_else(|| Error::not_found(format!("schedule {id} not found")))?;
        if s.paused == paused {
            return Ok(s);
        }
        let next = if paused {
            None
        } else {
            let now: i64 = tx
                .query_one("SELECT agq_now_ms()", &[])
                .await
                .map_err(db_err)?
                .get(0);
            let cron = CronSchedule::read(&s.cron, &s.time_zone)?;
            Some(cron.next_after_ms(now).ok_or_else(|| {
                Error::precondition(format!(
                    "schedule {id}: cron {:?} never fires again",
                    s.cron
                ))
            })?)
        };
        tx.execute(
            "UPDATE schedules SET next_run_ms = $2 WHERE schedule_id = $1",
            &[&id, &next],
        )
        .await
        .map_err(db_err)?;
        let s = get(&tx, id, false)
            .await?
            .ok_or_else(|| Error::Internal(format!("schedule {id} vanished")))?;
        tx.commit().await.map_err(db_err)?;
        self.schedules_wake.notify_one();
        Ok(s)
    }

    pub(super) async fn pg_delete_schedule(&self, id: &str) -> Result<()> {
        let c = self.client().await?;
        let n = c
            .execute("DELETE FROM schedules WHERE schedule_id = $1", &[&id])
            .await
            .map_err(db_err)?;
        if n == 0 {
            return Err(Error::not_found(format!("schedule {id} not found")));
        }
        Ok(())
    }

    /// Fires every due schedule (the leader's maintenance pass), each in
    /// its own transaction with its row locked: the actions of its due
    /// ticks by its catch-up policy, and the record of the firing. A tick
    /// whose action cannot be submitted is recorded in `last_error` and
    /// not retried; a schedule whose stored row cannot be used (or whose
    /// expression no longer reads) is paused with the reason in
    /// `last_error`. A storage error rolls back that schedule's firing
    /// only (it is retried by the next pass); the others still fire.
    ///
    /// Errors: storage errors reading which schedules are due.
    pub(super) async fn fire_schedules(&self) -> Result<()> {
        let c = self.client().await?;
        let due: Vec<String> = c
            .query(
                "SELECT schedule_id FROM schedules WHERE next_run_ms <= agq_now_ms()
                 ORDER BY next_run_ms LIMIT 100",
                &[],
            )
            .await
            .map_err(db_err)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        drop(c);
        for id in due {
            if let Err(e) = self.fire_one(&id).await {
                tracing::warn!(schedule_id = %id, error = %e, "firing a schedule failed; retried by the next pass");
            }
        }
        Ok(())
    }

    async fn fire_one(&self, id: &str) -> Result<()> {
        let mut client = self.client().await?;
        let mut tx = client.transaction().await.map_err(db_err)?;
        let Some(r) = tx
            .query_opt(
                &format!(
                    "SELECT {COLS}, agq_now_ms() FROM schedules
                     WHERE schedule_id = $1 AND next_run_ms <= agq_now_ms() FOR UPDATE SKIP LOCKED"
                ),
                &[&id],
            )
            .await
            .map_err(db_err)?
        else {
            return Ok(());
        };
        let s = match schedule(&r) {
            Ok(s) => s,
            Err(e) => {
                // A stored row this code cannot use (inputs written by
                // another version, say): it cannot fire until it is fixed,
                // so pause it with the reason.
                let error = format!("paused: {e}");
                tracing::warn!(schedule_id = %id, error = %error, "schedule row cannot be used");
                record(&tx, id, None, None, 0, error).await?;
                return tx.commit().await.map_err(db_err);
            }
        };
        let now: i64 = r.get(17);
        let Some(from) = s.next_run_at_ms else {
            return Ok(());
        };
        // Read, not parsed as new: the due ticks of an expression whose
        // last tick has passed still fire.
        let cron = match CronSchedule::read(&s.cron, &s.time_zone) {
            Ok(c) => c,
            Err(e) => {
                record(&tx, id, None, None, 0, format!("paused: {e}")).await?;
                return tx.commit().await.map_err(db_err);
            }
        };
        let (mut ticks, more) = cron.ticks_between(from, now, MAX_CATCH_UP);
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
                        if s.catch_up == CatchUp::Skip {
                            "skip"
                        } else {
                            "latest"
                        }
                    ));
                }
                ticks = ticks.split_off(ticks.len().saturating_sub(1));
                if s.catch_up == CatchUp::Skip
                    && ticks.first().is_some_and(|t| now - t >= SKIP_GRACE_MS)
                {
                    ticks.clear();
                }
            }
        }
        let mut last = None;
        let mut runs = 0i64;
        let mut actions = Vec::new();
        for tick in ticks {
            let action_id = format!("{}-{}", s.schedule_id, tick.div_euclid(1000));
            let v = ValidAction {
                action_id: action_id.clone(),
                plan_id: s.plan_id.clone(),
                inputs: s.inputs.clone(),
                run_at_ms: None,
                max_attempts: s.max_attempts,
                traceparent: None,
                scheduling: s.scheduling.clone(),
            };
            // A savepoint per tick: a refused tick leaves the others.
            let sp = tx.savepoint(format!("tick{runs}")).await.map_err(db_err)?;
            match self.insert_action(&sp, &v).await {
                Ok(_) => {
                    sp.commit().await.map_err(db_err)?;
                    runs += 1;
                    actions.push(action_id.clone());
                    last = Some((tick, action_id));
                }
                // The database failed: this firing is rolled back and
                // retried by the next pass.
                Err(
                    e @ (Error::Storage { .. }
                    | Error::StoreBusy(_)
                    | Error::StoreUnavailable(_)
                    | Error::Unavailable),
                ) => return Err(e),
                // Refused (its plan is gone, or its stored version cannot
                // be used, say): recorded, not retried.
                Err(e) => {
                    sp.rollback().await.map_err(db_err)?;
                    errors.push(format!("tick {}: {e}", rfc3339(tick)));
                }
            }
        }
        let error = errors.join("; ");
        record(&tx, id, cron.next_after_ms(now), last, runs, error.clone()).await?;
        tx.commit().await.map_err(db_err)?;
        self.metrics.schedule_runs.inc_by(runs as u64);
        self.touch(actions.iter().map(String::as_str));
        if !error.is_empty() {
            tracing::warn!(schedule_id = %id, error = %error, "schedule tick not submitted");
        }
        Ok(())
    }
}

/// Records a firing of schedule `id`: its next tick, the last tick fired
/// and its action, how many ran, and the errors of refused ticks.
///
/// Errors: storage errors.
async fn record(
    tx: &Transaction<'_>,
    id: &str,
    next: Option<i64>,
    last: Option<(i64, String)>,
    runs: i64,
    error: String,
) -> Result<()> {
    tx.execute(
        "UPDATE schedules SET next_run_ms = $2, last_run_ms = coalesce($3, last_run_ms),
                last_action_id = coalesce($4, last_action_id), runs = runs + $5, last_error = $6
         WHERE schedule_id = $1",
        &[
            &id,
            &next,
            &last.as_ref().map(|(t, _)| *t),
            &last.as_ref().map(|(_, a)| a.clone()),
            &runs,
            &error,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}
