//! Recurring schedules over the generated client: create, get, list,
//! pause, resume, delete; bad input refused with nothing stored; a
//! schedule every second submits exactly one action per second across a
//! server restart (the ticks missed while it was down are caught up); a
//! tick whose plan is gone records why; one schedule that cannot fire (a
//! stored row or plan the server cannot use) stops none of the others;
//! and the same across `kill -9` of a real `agq serve` process.

mod common;
mod process;

use std::{collections::BTreeSet, time::Duration};

use agq::{
    auth::Authenticator,
    pb::{self, ActionInput, CatchUp, SubmitPlanRequest},
};
use common::{eventually, fast_config, plan, store_tests, TestServer, TestStore};
use tonic::Code;

store_tests! {
    a_schedule_every_second_submits_one_action_per_second_across_a_restart,
    schedules_are_listed_got_and_deleted_and_bad_ones_store_nothing,
    a_tick_whose_plan_is_gone_records_why_and_the_schedule_goes_on,
    the_last_tick_of_a_schedule_fires_and_resuming_after_it_is_a_precondition_failure,
    a_classic_five_field_expression_numbers_days_of_the_week_as_crontab_does,
    a_schedule_whose_stored_row_cannot_be_used_is_paused_and_the_others_fire,
    a_schedule_whose_stored_inputs_do_not_parse_is_still_listed_and_got,
    a_client_cannot_take_the_action_id_of_a_future_tick,
    a_schedule_id_past_its_limit_is_invalid_in_every_call,
    schedules_with_large_inputs_are_listed_a_few_at_a_time,
}

async fn put_plan(s: &TestServer, id: &str) {
    s.plans()
        .await
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan(id, &["true"])),
            replace: false,
        })
        .await
        .expect("submit plan");
}

fn every_second(id: &str, plan_id: &str) -> pb::Schedule {
    pb::Schedule {
        schedule_id: id.into(),
        plan_id: plan_id.into(),
        cron: "* * * * * *".into(),
        inputs: vec![ActionInput {
            values: [("n".to_string(), "1".to_string())].into(),
        }],
        ..Default::default()
    }
}

async fn create(s: &TestServer, sch: pb::Schedule) -> Result<pb::Schedule, tonic::Status> {
    s.schedules()
        .await
        .create_schedule(pb::CreateScheduleRequest {
            schedule: Some(sch),
        })
        .await
        .map(|r| r.into_inner().schedule.unwrap())
}

async fn get(s: &TestServer, id: &str) -> pb::Schedule {
    s.schedules()
        .await
        .get_schedule(pb::GetScheduleRequest {
            schedule_id: id.into(),
        })
        .await
        .expect("get schedule")
        .into_inner()
        .schedule
        .unwrap()
}

/// A schedule's inputs are at most 1 MiB, and a page of schedules stops
/// at 3 MiB of inputs, whatever its page size: a page of 100 schedules of
/// 1 MiB would not fit a message, and clients take 4 MiB by default. A
/// schedule over the limit stores nothing.
async fn schedules_with_large_inputs_are_listed_a_few_at_a_time(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "p").await;
    // 15 inputs of 64 KiB and a one-byte key: 983,055 bytes.
    let large = |id: &str, n: usize| pb::Schedule {
        schedule_id: id.into(),
        plan_id: "p".into(),
        cron: "0 0 0 1 1 *".into(),
        inputs: (0..n)
            .map(|_| ActionInput {
                values: [("k".to_string(), "v".repeat(64 * 1024))].into(),
            })
            .collect(),
        ..Default::default()
    };
    let err = create(&s, large("too-large", 17)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("at most 1048576 bytes"), "{err:?}");
    for i in 0..9 {
        create(&s, large(&format!("s{i}"), 15))
            .await
            .expect("create");
    }
    let mut pages = Vec::new();
    let mut token = String::new();
    for _ in 0..5 {
        let page = s
            .schedules()
            .await
            .list_schedules(pb::ListSchedulesRequest {
                page_size: 100,
                page_token: token,
            })
            .await
            .expect("a page fits a message")
            .into_inner();
        pages.push(page.schedules.len());
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(pages, [3, 3, 3], "schedules per page");
    s.stop().await;
}

/// Ids of every action of `plan_id`.
async fn actions_of(s: &TestServer, plan_id: &str) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token = String::new();
    for _ in 0..100 {
        let page = s
            .actions()
            .await
            .list_actions(pb::ListActionsRequest {
                plan_id: plan_id.into(),
                page_size: 1000,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        ids.extend(page.actions.into_iter().map(|a| a.action_id));
        if page.next_page_token.is_empty() {
            return ids;
        }
        token = page.next_page_token;
    }
    panic!("too many pages");
}

/// The ticks (seconds) of `schedule_id`'s actions among `ids`.
fn ticks(schedule_id: &str, ids: &[String]) -> Vec<i64> {
    let prefix = format!("{schedule_id}-");
    let mut t: Vec<i64> = ids
        .iter()
        .map(|id| {
            id.strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{id} is not an action of {schedule_id}"))
                .parse()
                .unwrap()
        })
        .collect();
    t.sort();
    t
}

async fn a_schedule_every_second_submits_one_action_per_second_across_a_restart(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let s = TestServer::start_store(store, &db, fast_config()).await;
    let backing = s.backing.clone();
    put_plan(&s, "tick").await;
    let created = create(&s, every_second("every-second", "tick"))
        .await
        .unwrap();
    assert!(created.next_run_at.is_some());
    assert_eq!(
        created.catch_up,
        CatchUp::Unspecified as i32 + 1,
        "ALL by default"
    );
    eventually(10, "two ticks fired", || async {
        get(&s, "every-second").await.runs >= 2
    })
    .await;
    let addr = s.addr;
    s.stop().await;
    // Down for about two seconds: its ticks are caught up at start.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let s = TestServer::start_on_with(
        &backing,
        fast_config(),
        Authenticator::default(),
        Some(addr),
    )
    .await;
    eventually(10, "ticks after the restart", || async {
        get(&s, "every-second").await.runs >= 7
    })
    .await;
    let paused = s
        .schedules()
        .await
        .pause_schedule(pb::PauseScheduleRequest {
            schedule_id: "every-second".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .schedule
        .unwrap();
    assert!(paused.paused && paused.next_run_at.is_none());
    let ids = actions_of(&s, "tick").await;
    let t = ticks("every-second", &ids);
    let (first, last) = (t[0], *t.last().unwrap());
    assert_eq!(
        t,
        (first..=last).collect::<Vec<_>>(),
        "exactly one action per second, none missing, none twice"
    );
    assert_eq!(paused.runs as usize, t.len());
    assert_eq!(
        paused.last_action_id,
        format!("every-second-{last}"),
        "the last tick is recorded with its action"
    );
    assert!(last - first >= 5, "{t:?}");
    assert!(paused.last_error.is_empty(), "{}", paused.last_error);

    // Paused: nothing more fires, and resuming does not catch up the pause.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(actions_of(&s, "tick").await.len(), t.len());
    let resumed = s
        .schedules()
        .await
        .resume_schedule(pb::ResumeScheduleRequest {
            schedule_id: "every-second".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .schedule
        .unwrap();
    assert!(!resumed.paused);
    eventually(10, "a tick after resuming", || async {
        get(&s, "every-second").await.runs > paused.runs
    })
    .await;
    let after = ticks("every-second", &actions_of(&s, "tick").await);
    assert!(
        after[t.len()] >= last + 2,
        "the paused ticks were not caught up: {after:?}"
    );
    // This process submitted the caught-up ticks and the later ones.
    let counted = common::metric(&s, "agq_schedule_runs_total").await as usize;
    assert!(
        counted > 2 && counted < after.len(),
        "{counted} of {}",
        after.len()
    );
}

async fn schedules_are_listed_got_and_deleted_and_bad_ones_store_nothing(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "p").await;
    let daily = pb::Schedule {
        cron: "0 30 9 * * Mon-Fri".into(),
        time_zone: "europe/paris".into(),
        priority: 5,
        worker_selector: "region in (eu)".into(),
        catch_up: CatchUp::Latest as i32,
        ..every_second("daily", "p")
    };
    let stored = create(&s, daily).await.unwrap();
    assert_eq!(stored.worker_selector, "region in (eu)");
    assert_eq!(
        stored.time_zone, "Europe/Paris",
        "as the database spells it"
    );
    assert_eq!(stored.max_attempts, 3, "the default applied");
    assert_eq!(stored.catch_up, CatchUp::Latest as i32);
    let next = stored.next_run_at.unwrap().seconds;
    assert!(next > 0);
    create(
        &s,
        pb::Schedule {
            cron: "*/15 * * * *".into(),
            ..every_second("classic", "p")
        },
    )
    .await
    .unwrap();

    let err = create(&s, every_second("daily", "p")).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let bad = [
        (
            pb::Schedule {
                cron: "* * *".into(),
                ..every_second("b1", "p")
            },
            Code::InvalidArgument,
        ),
        (
            pb::Schedule {
                cron: "99 * * * * *".into(),
                ..every_second("b2", "p")
            },
            Code::InvalidArgument,
        ),
        (
            pb::Schedule {
                time_zone: "Mars/Olympus".into(),
                ..every_second("b3", "p")
            },
            Code::InvalidArgument,
        ),
        (
            pb::Schedule {
                inputs: vec![],
                ..every_second("b4", "p")
            },
            Code::InvalidArgument,
        ),
        (
            pb::Schedule {
                worker_selector: "a in (".into(),
                ..every_second("b5", "p")
            },
            Code::InvalidArgument,
        ),
        (
            pb::Schedule {
                catch_up: 42,
                ..every_second("b6", "p")
            },
            Code::InvalidArgument,
        ),
        (every_second(&"x".repeat(101), "p"), Code::InvalidArgument),
        (every_second("bad id", "p"), Code::InvalidArgument),
        (every_second("b7", "no-such-plan"), Code::NotFound),
    ];
    for (sch, code) in bad {
        let id = sch.schedule_id.clone();
        let err = create(&s, sch).await.unwrap_err();
        assert_eq!(err.code(), code, "{id}: {err:?}");
    }
    let listed = s
        .schedules()
        .await
        .list_schedules(pb::ListSchedulesRequest {
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.schedules.len(), 1);
    assert_eq!(listed.schedules[0].schedule_id, "classic");
    let rest = s
        .schedules()
        .await
        .list_schedules(pb::ListSchedulesRequest {
            page_size: 10,
            page_token: listed.next_page_token,
        })
        .await
        .unwrap()
        .into_inner();
    let ids: BTreeSet<_> = rest
        .schedules
        .iter()
        .map(|s| s.schedule_id.as_str())
        .collect();
    assert_eq!(
        ids,
        BTreeSet::from(["daily"]),
        "nothing of the refused ones"
    );
    assert!(rest.next_page_token.is_empty());

    s.schedules()
        .await
        .delete_schedule(pb::DeleteScheduleRequest {
            schedule_id: "daily".into(),
        })
        .await
        .unwrap();
    let err = s
        .schedules()
        .await
        .get_schedule(pb::GetScheduleRequest {
            schedule_id: "daily".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = s
        .schedules()
        .await
        .delete_schedule(pb::DeleteScheduleRequest {
            schedule_id: "daily".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

async fn a_tick_whose_plan_is_gone_records_why_and_the_schedule_goes_on(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "doomed").await;
    create(&s, every_second("orphan", "doomed")).await.unwrap();
    // The plan goes before the first tick can use it (no job is open yet,
    // so the delete is allowed).
    s.plans()
        .await
        .delete_plan(pb::DeletePlanRequest {
            plan_id: "doomed".into(),
        })
        .await
        .unwrap();
    eventually(10, "a failed tick recorded", || async {
        !get(&s, "orphan").await.last_error.is_empty()
    })
    .await;
    let sch = get(&s, "orphan").await;
    assert!(
        sch.last_error.contains("plan doomed not found"),
        "{}",
        sch.last_error
    );
    assert_eq!(sch.runs, 0);
    assert!(
        !sch.paused && sch.next_run_at.is_some(),
        "it keeps its schedule"
    );
    // Once the plan is back, ticks submit again.
    put_plan(&s, "doomed").await;
    eventually(10, "a tick submits again", || async {
        let sch = get(&s, "orphan").await;
        sch.runs >= 1 && sch.last_error.is_empty()
    })
    .await;
}

/// A 7-field expression (with a year) that fires once, at the whole
/// second `secs` seconds from now (UTC), and the tick's seconds since the
/// epoch.
fn once_in(secs: u64) -> (String, i64) {
    let at = std::time::SystemTime::now() + Duration::from_secs(secs);
    let tick = at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    // "2026-11-27T16:40:03Z"
    let text = humantime::format_rfc3339_seconds(at).to_string();
    let num = |r: std::ops::Range<usize>| text[r].parse::<u32>().unwrap();
    let cron = format!(
        "{} {} {} {} {} * {}",
        num(17..19),
        num(14..16),
        num(11..13),
        num(8..10),
        num(5..7),
        num(0..4)
    );
    (cron, tick)
}

/// A schedule whose expression fires only once (a year field) submits
/// that tick's action: the tick is due when its expression has no tick
/// after now any more, which must not stop it from firing. Resuming such
/// a schedule after its last tick is FAILED_PRECONDITION (the request is
/// fine; the schedule has nothing left to run), and changes nothing.
async fn the_last_tick_of_a_schedule_fires_and_resuming_after_it_is_a_precondition_failure(
    store: TestStore,
) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "once").await;
    let (cron, tick) = once_in(2);
    let created = create(
        &s,
        pb::Schedule {
            cron: cron.clone(),
            ..every_second("once", "once")
        },
    )
    .await
    .unwrap();
    assert_eq!(created.next_run_at.as_ref().map(|t| t.seconds), Some(tick));
    eventually(10, "the only tick fired or failed", || async {
        let sch = get(&s, "once").await;
        sch.runs > 0 || !sch.last_error.is_empty()
    })
    .await;
    let sch = get(&s, "once").await;
    assert_eq!(
        (
            sch.runs,
            sch.last_error.as_str(),
            sch.last_action_id.as_str()
        ),
        (1, "", format!("once-{tick}").as_str()),
        "cron {cron:?}: the last tick submits its action"
    );
    assert_eq!(ticks("once", &actions_of(&s, "once").await), vec![tick]);

    // Paused before its only tick, resumed after it: nothing left to run.
    let (cron, tick) = once_in(2);
    create(
        &s,
        pb::Schedule {
            cron,
            ..every_second("missed", "once")
        },
    )
    .await
    .unwrap();
    let schedules = s.schedules().await;
    schedules
        .clone()
        .pause_schedule(pb::PauseScheduleRequest {
            schedule_id: "missed".into(),
        })
        .await
        .unwrap();
    let after_tick = std::time::UNIX_EPOCH + Duration::from_secs(tick as u64 + 1);
    if let Ok(wait) = after_tick.duration_since(std::time::SystemTime::now()) {
        tokio::time::sleep(wait).await;
    }
    let e = schedules
        .clone()
        .resume_schedule(pb::ResumeScheduleRequest {
            schedule_id: "missed".into(),
        })
        .await
        .expect_err("resumed a schedule that never fires again");
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("never fires again"), "{}", e.message());
    let sch = get(&s, "missed").await;
    assert!(sch.paused && sch.next_run_at.is_none() && sch.runs == 0);
}

/// The day of the week of `t` (UTC): 0 Sunday .. 6 Saturday.
fn weekday(t: &prost_types::Timestamp) -> i64 {
    // 1970-01-01 was a Thursday.
    (t.seconds.div_euclid(86_400) + 4).rem_euclid(7)
}

/// A classic five-field expression (`min hour dom month dow`) reads its
/// day of the week as crontab(5) does: 0 or 7 Sunday, 1 Monday .. 6
/// Saturday, in numbers, ranges, lists and steps; names are names. The
/// six- and seven-field forms keep their own numbering (1 Sunday .. 7
/// Saturday).
async fn a_classic_five_field_expression_numbers_days_of_the_week_as_crontab_does(
    store: TestStore,
) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "dow").await;
    // (expression, the days of the week it fires on, 0 = Sunday)
    let cases: &[(&str, &[i64])] = &[
        ("0 9 * * 1", &[1]),
        ("0 9 * * 5", &[5]),
        ("0 9 * * 0", &[0]),
        ("0 9 * * 7", &[0]),
        ("0 9 * * 6", &[6]),
        ("0 9 * * 1-5", &[1, 2, 3, 4, 5]),
        ("0 9 * * 5-7", &[5, 6, 0]),
        ("0 9 * * 0,3", &[0, 3]),
        ("0 9 * * */3", &[0, 3, 6]),
        ("0 9 * * 1-5/2", &[1, 3, 5]),
        ("0 9 * * Mon", &[1]),
        ("0 9 * * Sat,Sun", &[6, 0]),
        ("0 9 * * *", &[0, 1, 2, 3, 4, 5, 6]),
        ("0 0 9 * * Mon", &[1]),
        ("0 0 9 * * 2", &[1]),
        ("0 0 9 * * 1", &[0]),
    ];
    for (i, (cron, days)) in cases.iter().enumerate() {
        let id = format!("dow{i}");
        let created = create(
            &s,
            pb::Schedule {
                cron: cron.to_string(),
                ..every_second(&id, "dow")
            },
        )
        .await
        .unwrap_or_else(|e| panic!("cron {cron:?}: {e:?}"));
        // Its first tick (after now) falls on one of these days at 09:00.
        let first = created.next_run_at.unwrap();
        s.schedules()
            .await
            .delete_schedule(pb::DeleteScheduleRequest {
                schedule_id: id.clone(),
            })
            .await
            .unwrap();
        assert!(
            days.contains(&weekday(&first)),
            "cron {cron:?}: next tick {first:?} is on day {} (0 = Sunday), not one of {days:?}",
            weekday(&first)
        );
        assert_eq!(first.seconds.rem_euclid(86_400), 9 * 3600, "cron {cron:?}");
    }
    for bad in ["0 9 * * 8", "0 9 * * 3-1", "0 9 * * 1/0", "0 9 * * Mon-5"] {
        let e = create(
            &s,
            pb::Schedule {
                cron: bad.into(),
                ..every_second("bad", "dow")
            },
        )
        .await
        .expect_err(bad);
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}: {}", e.message());
    }
}

/// `next_run_ms` and `last_error` of schedule `id`, read from the database
/// (the row need not decode).
async fn stored_state(s: &TestServer, id: &str) -> (Option<i64>, String) {
    let sql = "SELECT next_run_ms, last_error FROM schedules WHERE schedule_id = ";
    match &s.backing.store {
        agq::config::Store::Postgres(url) => {
            let r = common::pg::connect(url)
                .await
                .query_one(&format!("{sql}$1"), &[&id])
                .await
                .unwrap();
            (r.get(0), r.get(1))
        }
        _ => {
            let conn = rusqlite::Connection::open(&s.db).unwrap();
            conn.busy_timeout(Duration::from_secs(10)).unwrap();
            conn.query_row(&format!("{sql}?1"), [id], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
        }
    }
}

/// A schedule whose stored row the server cannot use (its inputs do not
/// parse: written by another version, or damaged) is paused with the
/// reason in `last_error`; it stops neither the other schedules due in
/// the same pass nor the later ones.
async fn a_schedule_whose_stored_row_cannot_be_used_is_paused_and_the_others_fire(
    store: TestStore,
) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "p").await;
    create(&s, every_second("broken", "p")).await.unwrap();
    // Its inputs no longer parse, and it is due first.
    s.exec_sql(
        "UPDATE schedules SET inputs = '{not json', next_run_ms = next_run_ms - 1000
         WHERE schedule_id = 'broken'",
    )
    .await;
    create(&s, every_second("healthy", "p")).await.unwrap();
    eventually(
        10,
        "the healthy schedule fires beside the broken one",
        || async { get(&s, "healthy").await.runs >= 2 },
    )
    .await;
    let healthy = get(&s, "healthy").await;
    assert!(healthy.last_error.is_empty(), "{}", healthy.last_error);
    assert!(
        ticks("healthy", &actions_of(&s, "p").await).len() >= 2,
        "only the healthy schedule submitted actions"
    );
    eventually(10, "the broken schedule is paused", || async {
        stored_state(&s, "broken").await.0.is_none()
    })
    .await;
    let (_, error) = stored_state(&s, "broken").await;
    assert!(
        error.starts_with("paused: ") && error.contains("stored inputs do not parse"),
        "{error}"
    );
    // It can be deleted, and the healthy one goes on.
    s.schedules()
        .await
        .delete_schedule(pb::DeleteScheduleRequest {
            schedule_id: "broken".into(),
        })
        .await
        .unwrap();
    let runs = get(&s, "healthy").await.runs;
    eventually(10, "the healthy schedule keeps firing", || async {
        get(&s, "healthy").await.runs > runs
    })
    .await;
    s.stop().await;
}

/// A schedule whose stored inputs do not parse does not fail ListSchedules
/// for the others, and GetSchedule shows it, paused, with empty inputs and
/// why in `last_error`; it can be paused, resumed (it is paused again with
/// the reason at its next tick) and deleted.
async fn a_schedule_whose_stored_inputs_do_not_parse_is_still_listed_and_got(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "p").await;
    create(&s, every_second("broken", "p")).await.unwrap();
    create(&s, every_second("healthy", "p")).await.unwrap();
    s.exec_sql("UPDATE schedules SET inputs = '{not json' WHERE schedule_id = 'broken'")
        .await;
    let listed = s
        .schedules()
        .await
        .list_schedules(pb::ListSchedulesRequest::default())
        .await
        .expect("a listing beside a damaged row")
        .into_inner()
        .schedules;
    let ids: Vec<&str> = listed.iter().map(|s| s.schedule_id.as_str()).collect();
    assert_eq!(ids, ["broken", "healthy"]);
    assert_eq!(listed[1].inputs.len(), 1, "the healthy one is whole");
    eventually(10, "the broken schedule is paused", || async {
        get(&s, "broken").await.paused
    })
    .await;
    let broken = get(&s, "broken").await;
    assert!(broken.inputs.is_empty());
    assert!(
        broken.last_error.starts_with("paused: ")
            && broken.last_error.contains("stored inputs do not parse"),
        "{}",
        broken.last_error
    );
    let resumed = s
        .schedules()
        .await
        .resume_schedule(pb::ResumeScheduleRequest {
            schedule_id: "broken".into(),
        })
        .await
        .expect("resume")
        .into_inner()
        .schedule
        .unwrap();
    assert!(!resumed.paused);
    eventually(10, "paused again at its next tick", || async {
        get(&s, "broken").await.paused
    })
    .await;
    s.schedules()
        .await
        .delete_schedule(pb::DeleteScheduleRequest {
            schedule_id: "broken".into(),
        })
        .await
        .unwrap();
    s.stop().await;
}

/// On PostgreSQL a tick whose action cannot be submitted for a reason
/// other than the database (its plan's stored version does not decode)
/// records why in `last_error` and the schedule goes on; the other
/// schedules still fire. (On SQLite the plans are loaded at start.)
#[tokio::test]
async fn postgres_a_tick_whose_stored_plan_cannot_be_used_records_why_and_the_others_fire() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(
        TestStore::Postgres,
        &dir.path().join("agq.db"),
        fast_config(),
    )
    .await;
    put_plan(&s, "p").await;
    put_plan(&s, "undecodable").await;
    create(&s, every_second("bad-plan", "undecodable"))
        .await
        .unwrap();
    s.exec_sql(
        "UPDATE plan_versions SET body = '\\xffffffff'::bytea WHERE plan_id = 'undecodable';
         UPDATE schedules SET next_run_ms = next_run_ms - 1000 WHERE schedule_id = 'bad-plan'",
    )
    .await;
    create(&s, every_second("healthy", "p")).await.unwrap();
    eventually(
        10,
        "the healthy schedule fires beside the other",
        || async { get(&s, "healthy").await.runs >= 2 },
    )
    .await;
    eventually(10, "the refused tick is recorded", || async {
        !get(&s, "bad-plan").await.last_error.is_empty()
    })
    .await;
    let bad = get(&s, "bad-plan").await;
    assert!(
        bad.last_error.contains("stored plan does not decode"),
        "{}",
        bad.last_error
    );
    assert_eq!(bad.runs, 0);
    assert!(!bad.paused, "it keeps its schedule");
    assert!(actions_of(&s, "undecodable").await.is_empty());
    s.stop().await;
}

/// The server process is killed with SIGKILL between ticks and started
/// again on the same database: every second still has exactly one action.
// SQLite only: it kills a real `agq serve` on its database file (tests/cluster.rs
// kills replicas on PostgreSQL).
#[tokio::test]
async fn ticks_fire_exactly_once_across_a_kill_9() {
    use agq::pb::{
        action_service_client::ActionServiceClient, plan_service_client::PlanServiceClient,
        schedule_service_client::ScheduleServiceClient,
    };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let serve = || {
        process::Serve::new(&db)
            .args(["--heartbeat-interval-ms", "200"])
            .kill_on_drop()
            .spawn()
            .expect("agq serve started")
    };
    let mut first = serve();
    let url = first.url();
    let ch = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    PlanServiceClient::new(ch.clone())
        .submit_plan(SubmitPlanRequest {
            plan: Some(plan("tick", &["true"])),
            replace: false,
        })
        .await
        .unwrap();
    ScheduleServiceClient::new(ch.clone())
        .create_schedule(pb::CreateScheduleRequest {
            schedule: Some(every_second("crashy", "tick")),
        })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2600)).await;
    first.kill();
    drop(first);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = serve();
    let ch = tonic::transport::Channel::from_shared(second.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut schedules = ScheduleServiceClient::new(ch.clone());
    let mut runs = 0;
    for _ in 0..100 {
        runs = schedules
            .get_schedule(pb::GetScheduleRequest {
                schedule_id: "crashy".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .schedule
            .unwrap()
            .runs;
        if runs >= 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(runs >= 7, "only {runs} ticks fired");
    let paused = schedules
        .pause_schedule(pb::PauseScheduleRequest {
            schedule_id: "crashy".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .schedule
        .unwrap();
    let listed = ActionServiceClient::new(ch)
        .list_actions(pb::ListActionsRequest {
            plan_id: "tick".into(),
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<String> = listed.actions.into_iter().map(|a| a.action_id).collect();
    let t = ticks("crashy", &ids);
    let (lo, hi) = (t[0], *t.last().unwrap());
    assert_eq!(
        t,
        (lo..=hi).collect::<Vec<_>>(),
        "one action per second across the kill, none missing, none twice"
    );
    assert_eq!(
        paused.runs as usize,
        t.len(),
        "the recorded runs are the actions"
    );
}

/// A client cannot submit an action under the id of a future tick of an
/// existing schedule (`<schedule_id>-<unix seconds>`): it would take the
/// tick's id ahead of it, and the tick would be refused. The refusal is
/// INVALID_ARGUMENT and stores nothing; ids of other forms, and of that
/// form for no existing schedule, are taken as before.
async fn a_client_cannot_take_the_action_id_of_a_future_tick(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "p").await;
    let mut nightly = every_second("nightly", "p");
    nightly.cron = "0 0 3 * * *".into();
    create(&s, nightly).await.expect("create the schedule");
    let tick = format!("nightly-{}", 2_000_000_000);
    let st = submit_as(&s, &tick).await.expect_err("a future tick's id");
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    assert!(
        st.message()
            .contains("reserved for the ticks of schedule \"nightly\""),
        "{st:?}"
    );
    let missing = s
        .actions()
        .await
        .get_action(pb::GetActionRequest {
            action_id: tick.clone(),
        })
        .await
        .expect_err("nothing stored");
    assert_eq!(missing.code(), tonic::Code::NotFound);
    for free in ["nightly-2024", "other-2000000000", "nightly"] {
        submit_as(&s, free)
            .await
            .unwrap_or_else(|e| panic!("{free}: {e:?}"));
    }
    // Nor by submitting it before the schedule exists: the schedule is
    // refused then (its tick would find the id taken and never be
    // submitted). An action with the id of a past tick is no obstacle.
    submit_as(&s, "late-2000000000")
        .await
        .expect("no schedule yet");
    submit_as(&s, "past-1600000000")
        .await
        .expect("no schedule yet");
    let mut late = every_second("late", "p");
    late.cron = "0 0 3 * * *".into();
    let st = create(&s, late)
        .await
        .expect_err("a future tick's id is taken");
    assert_eq!(st.code(), tonic::Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("late-2000000000"), "{st:?}");
    let gone = s
        .schedules()
        .await
        .get_schedule(pb::GetScheduleRequest {
            schedule_id: "late".into(),
        })
        .await
        .expect_err("nothing stored");
    assert_eq!(gone.code(), tonic::Code::NotFound);
    create(&s, every_second("past", "p"))
        .await
        .expect("a past tick's id is no obstacle");
    s.stop().await;
}

/// Submits an action of one empty input on plan `p` under `action_id`.
async fn submit_as(
    s: &TestServer,
    action_id: &str,
) -> Result<tonic::Response<pb::SubmitActionResponse>, tonic::Status> {
    s.actions()
        .await
        .submit_action(pb::SubmitActionRequest {
            action_id: action_id.into(),
            plan_id: "p".into(),
            inputs: vec![ActionInput::default()],
            ..Default::default()
        })
        .await
}

/// A schedule id is at most 100 bytes (the tick's action id appends
/// `-<unix seconds>` to it): one of 101 to 128 bytes, which no schedule can
/// have, is INVALID_ARGUMENT in every call that names a schedule, as at
/// create, not NOT_FOUND, and the message gives the schedule id's rule.
async fn a_schedule_id_past_its_limit_is_invalid_in_every_call(store: TestStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_store(store, &dir.path().join("agq.db"), fast_config()).await;
    put_plan(&s, "p").await;
    create(&s, every_second(&"x".repeat(100), "p"))
        .await
        .expect("100 bytes is the limit");
    for len in [101, 128] {
        let id = "x".repeat(len);
        let mut c = s.schedules().await;
        let answers = [
            create(&s, every_second(&id, "p")).await.map(|_| ()),
            c.get_schedule(pb::GetScheduleRequest {
                schedule_id: id.clone(),
            })
            .await
            .map(|_| ()),
            c.pause_schedule(pb::PauseScheduleRequest {
                schedule_id: id.clone(),
            })
            .await
            .map(|_| ()),
            c.resume_schedule(pb::ResumeScheduleRequest {
                schedule_id: id.clone(),
            })
            .await
            .map(|_| ()),
            c.delete_schedule(pb::DeleteScheduleRequest {
                schedule_id: id.clone(),
            })
            .await
            .map(|_| ()),
        ];
        for (call, answer) in ["create", "get", "pause", "resume", "delete"]
            .iter()
            .zip(answers)
        {
            let err = answer.expect_err(call);
            assert_eq!(err.code(), Code::InvalidArgument, "{call} {len}: {err:?}");
            assert!(err.message().contains("{1,100}"), "{call} {len}: {err:?}");
        }
    }
    for call in ["get", "delete"] {
        let mut c = s.schedules().await;
        let err = match call {
            "get" => c
                .get_schedule(pb::GetScheduleRequest {
                    schedule_id: String::new(),
                })
                .await
                .map(|_| ()),
            _ => c
                .delete_schedule(pb::DeleteScheduleRequest {
                    schedule_id: String::new(),
                })
                .await
                .map(|_| ()),
        }
        .expect_err("empty id");
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("{1,100}"), "{call}: {err:?}");
    }
    let listed = s
        .schedules()
        .await
        .list_schedules(pb::ListSchedulesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .schedules;
    assert_eq!(listed.len(), 1, "only the 100-byte one");
}
