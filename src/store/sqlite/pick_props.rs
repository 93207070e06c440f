//! Property test of the pick: for random fleets (tools, tags, slots,
//! states, freshness, open streams), random actions (tools, priorities,
//! selectors, concurrency keys) and random completions, every lease the
//! dispatcher grants is checked against an independent model of the
//! rules, grant by grant:
//!
//! - the worker is ACTIVE, fresh, has its lease stream open, a free slot,
//!   every tool of the job's plan and tags matching the job's selector;
//! - the job's concurrency key is under its limit;
//! - the job is the oldest ready one of its action at its priority;
//! - no placeable job of a higher priority was passed over, except on the
//!   starvation guard's turn, where the job is the oldest ready one that a
//!   worker can take (among the oldest of each action and priority);
//! - when the dispatcher stops, no ready job is placeable.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use proptest::prelude::*;
use rusqlite::Connection;
use tokio::sync::mpsc;

use super::{
    jobs::{NewAction, NewJob},
    sql,
    state::{Effect, State},
    writer::BatchConn,
};
use crate::{
    config::{EngineConfig, SyncMode},
    core::{
        model::{
            JobReport, JobStatus, Plan, Registration, Scheduling, Task, WorkerCapabilities,
            WorkerState,
        },
        selector::Selector,
        validate,
        watch::Watchers,
    },
    metrics::Metrics,
};

const TOOLS: [&str; 3] = ["a", "b", "c"];
const SELECTORS: [&str; 5] = [
    "",
    "gpu=true",
    "region in (eu, us)",
    "!spot",
    "gpu=true, region=eu",
];

#[derive(Debug, Clone)]
struct WorkerSpec {
    tools: u8,
    gpu: bool,
    region: u8,
    spot: bool,
    max: u32,
    /// 0, 1: ACTIVE; 2: DRAINING; 3: QUARANTINED.
    state: u8,
    fresh: bool,
    stream: bool,
}

#[derive(Debug, Clone)]
struct ActionSpec {
    tools: u8,
    priority: i32,
    selector: usize,
    /// 0: no key; 1, 2: key k1, k2.
    key: u8,
    max_running: u32,
    jobs: usize,
}

fn worker_spec() -> impl Strategy<Value = WorkerSpec> {
    (
        1u8..8,
        any::<bool>(),
        0u8..3,
        any::<bool>(),
        1u32..=3,
        0u8..4,
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.9),
    )
        .prop_map(
            |(tools, gpu, region, spot, max, state, fresh, stream)| WorkerSpec {
                tools,
                gpu,
                region,
                spot,
                max,
                state,
                fresh,
                stream,
            },
        )
}

fn action_spec() -> impl Strategy<Value = ActionSpec> {
    (
        1u8..8,
        -2i32..=2,
        0..SELECTORS.len(),
        0u8..3,
        1u32..=3,
        1usize..=6,
    )
        .prop_map(
            |(tools, priority, selector, key, max_running, jobs)| ActionSpec {
                tools,
                priority,
                selector,
                key,
                max_running,
                jobs,
            },
        )
}

fn tools_of(mask: u8) -> Vec<String> {
    TOOLS
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, t)| t.to_string())
        .collect()
}

/// A ready job as the model sees it.
#[derive(Debug, Clone)]
struct JobM {
    row: i64,
    job_id: String,
    action: String,
    priority: i32,
    tools: Vec<String>,
    selector: Selector,
    key: Option<(String, u32)>,
}

/// A worker as the model sees it.
#[derive(Debug, Clone)]
struct WorkerM {
    /// ACTIVE, fresh and its lease stream open.
    eligible: bool,
    tools: HashSet<String>,
    tags: HashMap<String, String>,
    free: u32,
}

#[derive(Debug, Clone)]
struct Model {
    ready: BTreeMap<i64, JobM>,
    workers: HashMap<String, WorkerM>,
    running: HashMap<String, u32>,
}

impl Model {
    fn fits(&self, j: &JobM, w: &WorkerM) -> bool {
        w.eligible
            && w.free > 0
            && j.tools.iter().all(|t| w.tools.contains(t))
            && j.selector.matches(&w.tags)
    }

    fn under_limit(&self, j: &JobM) -> bool {
        j.key
            .as_ref()
            .is_none_or(|(k, max)| self.running.get(k).copied().unwrap_or(0) < *max)
    }

    fn placeable(&self, j: &JobM) -> bool {
        self.under_limit(j) && self.workers.values().any(|w| self.fits(j, w))
    }
}

/// The model of the state right now (before a dispatch).
fn snapshot(state: &State, conn: &Connection) -> Model {
    let now = Instant::now();
    let rows: Vec<i64> = state.ready.keys().copied().collect();
    let ids = sql::jobs::job_ids(conn, &rows).unwrap();
    let ready = rows
        .iter()
        .zip(ids)
        .map(|(row, job_id)| {
            let w = &state.ready[row];
            let j = JobM {
                row: *row,
                job_id,
                action: w.action_id.to_string(),
                priority: w.sched.priority,
                tools: w.plan.tools.clone(),
                selector: w.sched.selector.clone(),
                key: w.sched.limit.as_ref().map(|(k, max)| (k.to_string(), *max)),
            };
            (*row, j)
        })
        .collect();
    let workers = state
        .workers
        .iter()
        .map(|(id, w)| {
            let m = WorkerM {
                eligible: w.state == WorkerState::Active
                    && state.is_fresh(w, now)
                    && w.suspect_since.is_none()
                    && w.lease_stream.is_some(),
                tools: w.tools.iter().cloned().collect(),
                tags: w.info.tags.clone(),
                free: w.max.saturating_sub(w.leases.len() as u32),
            };
            (id.clone(), m)
        })
        .collect();
    let mut running = HashMap::new();
    for l in state.leases.values() {
        if let Some((k, _)) = &l.sched.limit {
            *running.entry(k.to_string()).or_default() += 1;
        }
    }
    Model {
        ready,
        workers,
        running,
    }
}

/// Dispatches and checks every grant against the model; returns the
/// grants as (job id, worker id, lease id).
fn dispatch_checked(
    state: &mut State,
    conn: &Connection,
    every: u32,
    since_guard: &mut u32,
) -> Result<Vec<(String, String, String)>, TestCaseError> {
    let mut m = snapshot(state, conn);
    state.dispatch(conn).unwrap();
    let grants: Vec<(String, String, String)> = state
        .outbox
        .drain(..)
        .filter_map(|e| match e {
            Effect::Lease(_, l) => Some((l.job.job_id.clone(), l.job.worker_id, l.lease_id)),
            Effect::Heartbeat(..) => None,
        })
        .collect();
    for (job_id, worker_id, _) in &grants {
        let j = m
            .ready
            .values()
            .find(|j| &j.job_id == job_id)
            .cloned()
            .ok_or_else(|| TestCaseError::fail(format!("{job_id} was not ready")))?;
        let w = m.workers[worker_id].clone();
        prop_assert!(m.fits(&j, &w), "{job_id} went to unfit worker {worker_id}");
        prop_assert!(m.under_limit(&j), "{job_id} exceeds its concurrency key");
        let head = m
            .ready
            .values()
            .find(|o| o.action == j.action && o.priority == j.priority)
            .unwrap();
        prop_assert_eq!(head.row, j.row, "not the oldest of its action and priority");
        // The guard's pick: the oldest job, among the oldest of each
        // action and priority, that a worker can take.
        let oldest = m
            .ready
            .values()
            .find(|o| {
                m.placeable(o)
                    && m.ready
                        .values()
                        .find(|x| x.action == o.action && x.priority == o.priority)
                        .is_some_and(|x| x.row == o.row)
            })
            .cloned();
        if let Some(oldest) = oldest.filter(|_| every > 0 && *since_guard + 1 >= every) {
            prop_assert_eq!(&j.job_id, &oldest.job_id, "the guard's turn");
            *since_guard = 0;
        } else {
            let better = m
                .ready
                .values()
                .find(|o| o.priority > j.priority && m.placeable(o));
            prop_assert!(
                better.is_none(),
                "{job_id} (priority {}) went before placeable {:?}",
                j.priority,
                better
            );
            *since_guard += 1;
        }
        m.ready.remove(&j.row);
        m.workers.get_mut(worker_id).unwrap().free -= 1;
        if let Some((k, _)) = &j.key {
            *m.running.entry(k.clone()).or_default() += 1;
        }
    }
    let left = m.ready.values().find(|j| m.placeable(j));
    prop_assert!(left.is_none(), "the dispatcher stopped before {left:?}");
    Ok(grants)
}

fn run_case(
    fleet: Vec<WorkerSpec>,
    actions: Vec<ActionSpec>,
    every: u32,
    completions: Vec<Vec<usize>>,
) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let (conn, _pool) = sql::open(&dir.path().join("agq.db"), SyncMode::Normal).unwrap();
    let cfg = EngineConfig {
        heartbeat_interval: Duration::from_secs(10),
        starvation_guard_every: every,
        ..EngineConfig::default()
    };
    let mut state = State::new(cfg, Arc::new(Metrics::new()), Arc::new(Watchers::default()));
    state.load(&conn).unwrap();
    for mask in 1u8..8 {
        let plan = Plan {
            plan_id: format!("p{mask}"),
            tasks: tools_of(mask)
                .into_iter()
                .enumerate()
                .map(|(i, t)| Task {
                    task_number: i as u32 + 1,
                    command: t,
                    timeout_secs: 10,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        state.submit_plan(&conn, plan, false).unwrap();
    }
    for (i, spec) in fleet.iter().enumerate() {
        let mut tags = HashMap::new();
        if spec.gpu {
            tags.insert("gpu".to_string(), "true".to_string());
        }
        match spec.region {
            1 => tags.insert("region".into(), "eu".into()),
            2 => tags.insert("region".into(), "us".into()),
            _ => None,
        };
        if spec.spot {
            tags.insert("spot".into(), String::new());
        }
        let reg = validate::registration(Registration {
            worker_id: format!("w{i}"),
            hostname: "h".into(),
            agw_version: "prop".into(),
            capabilities: WorkerCapabilities {
                tools: tools_of(spec.tools),
                agentic_units: vec![],
                ..Default::default()
            },
            max_concurrent_jobs: spec.max,
            tags,
            ..Default::default()
        })
        .unwrap();
        state.register(&conn, reg).unwrap();
        let w = state.workers.get_mut(&format!("w{i}")).unwrap();
        w.state = match spec.state {
            2 => WorkerState::Draining,
            3 => WorkerState::Quarantined,
            _ => WorkerState::Active,
        };
        if !spec.fresh {
            w.last_heartbeat = Instant::now()
                .checked_sub(Duration::from_secs(60))
                .unwrap_or_else(Instant::now);
        }
    }
    // Every job is queued before any worker can take one.
    for (i, a) in actions.iter().enumerate() {
        let scheduling = validate::scheduling(Scheduling {
            priority: a.priority,
            worker_selector: SELECTORS[a.selector].into(),
            concurrency_key: match a.key {
                0 => String::new(),
                k => format!("k{k}"),
            },
            max_running: if a.key == 0 { 0 } else { a.max_running },
        })
        .unwrap();
        let jobs = (0..a.jobs)
            .map(|n| NewJob::new([("n".to_string(), n.to_string())].into()).unwrap())
            .collect();
        state
            .submit_action(
                &conn,
                NewAction {
                    action_id: format!("a{i}"),
                    plan_id: format!("p{}", a.tools),
                    jobs,
                    run_at_ms: None,
                    max_attempts: 3,
                    traceparent: None,
                    scheduling,
                },
            )
            .unwrap();
    }
    prop_assert!(state.outbox.is_empty(), "nothing is placed without streams");
    let mut streams = Vec::new();
    for (i, spec) in fleet.iter().enumerate() {
        if spec.stream {
            let (hb_tx, hb_rx) = mpsc::unbounded_channel();
            state.open_heartbeat(&format!("w{i}"), hb_tx).unwrap();
            let (tx, rx) = mpsc::unbounded_channel();
            state
                .open_lease_stream(&conn, &format!("w{i}"), tx)
                .unwrap();
            streams.push((hb_rx, rx));
        }
    }
    let mut since_guard = 0;
    let mut held = dispatch_checked(&mut state, &conn, every, &mut since_guard)?;
    for picks in completions {
        if held.is_empty() {
            break;
        }
        for p in picks {
            if held.is_empty() {
                break;
            }
            let (job_id, worker_id, lease_id) = held.remove(p % held.len());
            state
                .update_job(
                    &BatchConn::new(&conn),
                    &JobReport {
                        job_id,
                        worker_id,
                        lease_id,
                        status: Some(JobStatus::Completed),
                        ..Default::default()
                    },
                    None,
                )
                .unwrap();
        }
        state.outbox.clear();
        held.extend(dispatch_checked(
            &mut state,
            &conn,
            every,
            &mut since_guard,
        )?);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_grant_follows_the_rules(
        fleet in prop::collection::vec(worker_spec(), 1..7),
        actions in prop::collection::vec(action_spec(), 1..7),
        every in prop_oneof![Just(0u32), 1u32..5, Just(20)],
        completions in prop::collection::vec(prop::collection::vec(0usize..64, 1..4), 0..6),
    ) {
        run_case(fleet, actions, every, completions)?;
    }
}
