//! What the console's templates show, built from the API's messages:
//! rows of actions, jobs, workers and plans with their times as text, and
//! the overview's throughput samples.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{
    cli::view::{job_status_name, worker_state_name},
    metrics::{Metrics, StatusLabel},
    pb,
};

/// A `google.protobuf.Timestamp` as `2026-11-23 21:30:05 UTC`, or `—`.
pub fn when(ts: Option<&prost_types::Timestamp>) -> String {
    ts.and_then(|t| jiff::Timestamp::new(t.seconds, t.nanos).ok())
        .map(|t| t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| "—".into())
}

/// Milliseconds since `ts` (0 for a time in the future or none).
pub fn age_ms(ts: Option<&prost_types::Timestamp>, now_ms: i64) -> i64 {
    ts.and_then(crate::time::ms_of)
        .map_or(0, |t| now_ms.saturating_sub(t).max(0))
}

/// A duration in ms as `850 ms`, `12.5 s`, `4 min 10 s`, `3 h 5 min`.
pub fn span(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{} min {} s", ms / 60_000, (ms % 60_000) / 1000)
    } else {
        format!("{} h {} min", ms / 3_600_000, (ms % 3_600_000) / 60_000)
    }
}

/// One action with its counts and the widths of its progress bar.
#[derive(Debug, Serialize)]
pub struct ActionRow {
    pub action_id: String,
    pub plan_id: String,
    pub plan_version: u32,
    pub total: u32,
    pub pending: u32,
    pub running: u32,
    pub completed: u32,
    pub failed: u32,
    pub dead: u32,
    pub cancelled: u32,
    /// Finished jobs (completed + dead + cancelled) in percent of the total.
    pub percent: u32,
    /// Bar segments in percent of the bar's width.
    pub bar_completed: f64,
    pub bar_dead: f64,
    pub bar_cancelled: f64,
    pub bar_running: f64,
    pub open: bool,
    pub created: String,
    pub finished: String,
    /// Scheduling: priority, selector in effect ("" any worker), key and limit.
    pub priority: i32,
    pub worker_selector: String,
    pub concurrency_key: String,
    pub max_running: u32,
}

impl From<&pb::ActionStatus> for ActionRow {
    fn from(a: &pb::ActionStatus) -> Self {
        let total = a.total_jobs.max(1) as f64;
        let pct = |n: u32| (n as f64 * 100.0 / total * 10.0).round() / 10.0;
        let done = a.completed + a.dead + a.cancelled;
        ActionRow {
            priority: a.priority,
            worker_selector: a.worker_selector.clone(),
            concurrency_key: a.concurrency_key.clone(),
            max_running: a.max_running,
            action_id: a.action_id.clone(),
            plan_id: a.plan_id.clone(),
            plan_version: a.plan_version,
            total: a.total_jobs,
            pending: a.pending,
            running: a.running,
            completed: a.completed,
            failed: a.failed,
            dead: a.dead,
            cancelled: a.cancelled,
            percent: if a.total_jobs == 0 {
                100
            } else {
                // Floor: 100 % only when every job is finished.
                (u64::from(done) * 100 / u64::from(a.total_jobs)) as u32
            },
            bar_completed: pct(a.completed),
            bar_dead: pct(a.dead),
            bar_cancelled: pct(a.cancelled),
            bar_running: pct(a.running),
            open: done < a.total_jobs,
            created: when(a.created_at.as_ref()),
            finished: when(a.completed_jobs_at.as_ref()),
        }
    }
}

/// One job as a row of the action page.
#[derive(Debug, Serialize)]
pub struct JobRow {
    pub job_id: String,
    pub status: String,
    pub worker_id: String,
    pub attempt: u32,
    pub max_attempts: u32,
    pub waiting_reason: String,
    pub error: String,
    pub input: String,
    pub created: String,
}

impl From<&pb::Job> for JobRow {
    fn from(j: &pb::Job) -> Self {
        JobRow {
            job_id: j.job_id.clone(),
            status: job_status_name(j.status),
            worker_id: j.worker_id.clone(),
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            waiting_reason: j.waiting_reason.clone(),
            error: j.error.clone(),
            input: input_text(&j.input),
            created: when(j.created_at.as_ref()),
        }
    }
}

/// A job's input as `key=value key=value`, sorted by key, cut at 200 chars.
fn input_text(input: &std::collections::HashMap<String, String>) -> String {
    let sorted: BTreeMap<_, _> = input.iter().collect();
    let mut s = sorted
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    if s.chars().count() > 200 {
        s = s.chars().take(199).collect::<String>() + "…";
    }
    s
}

/// One job in full: the job page.
#[derive(Debug, Serialize)]
pub struct JobDetail {
    #[serde(flatten)]
    pub row: JobRow,
    pub action_id: String,
    pub plan_id: String,
    pub plan_version: u32,
    pub inputs: Vec<(String, String)>,
    pub started: String,
    pub completed: String,
    pub ready: String,
    pub current_task: u32,
    pub progress_percent: u32,
    pub tasks: Vec<TaskRow>,
}

/// One task result of a job.
#[derive(Debug, Serialize)]
pub struct TaskRow {
    pub task_number: u32,
    pub command: String,
    pub exit_code: i32,
    pub duration: String,
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

impl From<&pb::Job> for JobDetail {
    fn from(j: &pb::Job) -> Self {
        JobDetail {
            row: JobRow::from(j),
            action_id: j.action_id.clone(),
            plan_id: j.plan_id.clone(),
            plan_version: j.plan_version,
            inputs: j
                .input
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>()
                .into_iter()
                .collect(),
            started: when(j.started_at.as_ref()),
            completed: when(j.completed_at.as_ref()),
            ready: when(j.ready_at.as_ref()),
            current_task: j.current_task,
            progress_percent: j.progress_percent,
            tasks: j
                .task_results
                .iter()
                .map(|t| TaskRow {
                    task_number: t.task_number,
                    command: t.command.clone(),
                    exit_code: t.exit_code,
                    duration: span(t.duration_ms as i64),
                    stdout: t.stdout.clone(),
                    stderr: t.stderr.clone(),
                    stdout_truncated: t.stdout_truncated,
                    stderr_truncated: t.stderr_truncated,
                })
                .collect(),
        }
    }
}

/// One worker row.
#[derive(Debug, Serialize)]
pub struct WorkerRow {
    pub worker_id: String,
    pub hostname: String,
    pub state: String,
    pub fresh: bool,
    pub connected: bool,
    pub sandboxed: bool,
    pub tools: String,
    pub tags: String,
    pub active_leases: u32,
    pub max_concurrent_jobs: u32,
    pub cpu: String,
    pub memory_mb: u64,
    pub completed_total: u64,
    pub failed_total: u64,
    pub heartbeat_age: String,
    /// The last heartbeat is older than the stale threshold.
    pub stale: bool,
    pub drainable: bool,
    pub forgettable: bool,
    /// Quarantined now, or to be on its next registration.
    pub releasable: bool,
    pub quarantine_reason: String,
}

impl WorkerRow {
    /// `w` as seen at `now_ms`, stale past `stale_ms`.
    pub fn new(w: &pb::Worker, now_ms: i64, stale_ms: i64) -> Self {
        let state = pb::WorkerState::try_from(w.state).ok();
        let age = age_ms(w.last_heartbeat_at.as_ref(), now_ms);
        let stats = w.stats.unwrap_or_default();
        let tags: BTreeMap<_, _> = w.tags.iter().collect();
        WorkerRow {
            worker_id: w.worker_id.clone(),
            hostname: w.hostname.clone(),
            state: worker_state_name(w.state),
            fresh: w.fresh,
            connected: w.connected,
            sandboxed: w.sandboxed,
            tools: w
                .capabilities
                .as_ref()
                .map(|c| c.tools.join(", "))
                .unwrap_or_default(),
            tags: tags
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", "),
            active_leases: w.active_leases,
            max_concurrent_jobs: w.max_concurrent_jobs,
            cpu: format!("{:.0} %", stats.cpu_usage_percent),
            memory_mb: stats.memory_mb,
            completed_total: stats.completed_jobs_total,
            failed_total: stats.failed_jobs_total,
            heartbeat_age: if w.last_heartbeat_at.is_some() {
                span(age)
            } else {
                "never".into()
            },
            stale: w.last_heartbeat_at.is_none() || age > stale_ms,
            drainable: state == Some(pb::WorkerState::Active),
            // ForgetWorker refuses a worker whose quarantine holds.
            forgettable: matches!(
                state,
                Some(pb::WorkerState::Dead | pb::WorkerState::Unregistered)
            ) && w.quarantine_reason.is_empty(),
            releasable: !w.quarantine_reason.is_empty()
                || state == Some(pb::WorkerState::Quarantined),
            quarantine_reason: w.quarantine_reason.clone(),
        }
    }
}

/// A plan's tasks laid out as a pipeline diagram: one box per task, left to
/// right in task order, and an arrow for every `input_from_task` edge.
#[derive(Debug, Serialize)]
pub struct Diagram {
    pub width: u32,
    pub height: u32,
    pub nodes: Vec<Node>,
    pub edges: Vec<Edge>,
}

/// A task's box in a [`Diagram`].
#[derive(Debug, Serialize)]
pub struct Node {
    pub x: u32,
    pub y: u32,
    pub task_number: u32,
    pub label: String,
}

/// A stdout → stdin edge in a [`Diagram`], as an SVG path.
#[derive(Debug, Serialize)]
pub struct Edge {
    pub path: String,
    pub from: u32,
    pub to: u32,
}

const NODE_W: u32 = 150;
const NODE_H: u32 = 44;
const GAP: u32 = 40;

impl Diagram {
    /// The diagram of `tasks` (in task_number order).
    pub fn new(tasks: &[pb::Task]) -> Self {
        let n = tasks.len() as u32;
        let nodes: Vec<Node> = tasks
            .iter()
            .enumerate()
            .map(|(i, t)| Node {
                x: 10 + i as u32 * (NODE_W + GAP),
                y: 40,
                task_number: t.task_number,
                label: if t.command.chars().count() > 16 {
                    t.command.chars().take(15).collect::<String>() + "…"
                } else {
                    t.command.clone()
                },
            })
            .collect();
        let x_of = |task: u32| nodes.iter().find(|n| n.task_number == task).map(|n| n.x);
        let edges = tasks
            .iter()
            .filter_map(|t| {
                let from = t.input_from_task?;
                let (fx, tx) = (x_of(from)?, x_of(t.task_number)?);
                let (y, mid) = (40 + NODE_H / 2, 40 + NODE_H / 2);
                let path = if tx == fx + NODE_W + GAP {
                    // Neighbours: a straight arrow.
                    format!("M{} {y} L{} {y}", fx + NODE_W, tx - 4)
                } else {
                    // Further back: an arc over the boxes in between.
                    let (sx, ex) = (fx + NODE_W / 2, tx + NODE_W / 2);
                    let _ = mid;
                    format!("M{sx} 40 C{sx} 4, {ex} 4, {ex} 36")
                };
                Some(Edge {
                    path,
                    from,
                    to: t.task_number,
                })
            })
            .collect();
        Diagram {
            width: 20 + n.max(1) * (NODE_W + GAP) - GAP,
            height: 40 + NODE_H + 12,
            nodes,
            edges,
        }
    }
}

/// The metrics the overview charts, read at one instant.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub at_ms: i64,
    pub completed: u64,
    pub dead: u64,
    pub lease_sum_s: f64,
    pub lease_count: u64,
}

impl Sample {
    /// Reads the job counters and the enqueue-to-lease histogram now.
    pub fn take(m: &Metrics) -> Sample {
        let count = |s: &str| {
            m.jobs_total
                .get_or_create(&StatusLabel { status: s.into() })
                .get()
        };
        let (lease_sum_s, lease_count) = m.lease_wait();
        Sample {
            at_ms: crate::time::now_ms(),
            completed: count("completed"),
            dead: count("dead"),
            lease_sum_s,
            lease_count,
        }
    }
}

/// One bar of the overview's chart: an interval between two samples.
#[derive(Debug, Serialize)]
pub struct Bar {
    pub x: u32,
    pub y: u32,
    pub h: u32,
    pub label: String,
}

/// The overview's chart of the last minutes: completed jobs per second as
/// bars, with the peak and the mean enqueue-to-lease latency.
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub bars: Vec<Bar>,
    pub width: u32,
    pub minutes: f64,
    pub peak_per_s: String,
    pub last_per_s: String,
    pub dead_in_window: u64,
    pub mean_lease_ms: String,
    pub points: usize,
}

const CHART_H: u32 = 80;
const BAR_W: u32 = 8;

impl Throughput {
    /// The chart of consecutive `samples` (oldest first) and the current
    /// reading `now`, with room for `capacity` bars: the newest bar is at
    /// the right edge, so the time axis does not stretch while it fills.
    pub fn new(samples: &[Sample], now: Sample, capacity: usize) -> Self {
        let mut all: Vec<Sample> = samples.to_vec();
        all.push(now);
        let rates: Vec<(f64, i64)> = all
            .windows(2)
            .map(|w| {
                let dt = (w[1].at_ms - w[0].at_ms).max(1) as f64 / 1000.0;
                (
                    w[1].completed.saturating_sub(w[0].completed) as f64 / dt,
                    w[1].at_ms,
                )
            })
            .collect();
        let peak = rates.iter().map(|r| r.0).fold(0.0_f64, f64::max);
        let slots = capacity.max(rates.len()) as u32;
        let first_slot = slots - rates.len() as u32;
        let bars = rates
            .iter()
            .enumerate()
            .map(|(i, (r, at))| {
                let h = if peak > 0.0 {
                    ((r / peak) * f64::from(CHART_H)).round() as u32
                } else {
                    0
                };
                Bar {
                    x: (first_slot + i as u32) * BAR_W,
                    y: CHART_H - h,
                    h,
                    label: format!(
                        "{:.1} jobs/s until {}",
                        r,
                        when(Some(&crate::time::ts(*at)))
                    ),
                }
            })
            .collect();
        let first = all[0];
        let lease_n = now.lease_count.saturating_sub(first.lease_count);
        let lease_sum = (now.lease_sum_s - first.lease_sum_s).max(0.0);
        Throughput {
            width: slots.max(1) * BAR_W,
            minutes: ((now.at_ms - first.at_ms).max(0) as f64 / 60_000.0 * 10.0).round() / 10.0,
            peak_per_s: format!("{peak:.1}"),
            last_per_s: format!("{:.1}", rates.last().map_or(0.0, |r| r.0)),
            dead_in_window: now.dead.saturating_sub(first.dead),
            mean_lease_ms: if lease_n == 0 {
                "—".into()
            } else {
                format!("{:.1} ms", lease_sum / lease_n as f64 * 1000.0)
            },
            bars,
            points: rates.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_floored_and_segments_add_up() {
        let a = pb::ActionStatus {
            total_jobs: 3,
            completed: 2,
            dead: 0,
            pending: 1,
            ..Default::default()
        };
        let r = ActionRow::from(&a);
        assert_eq!(r.percent, 66);
        assert!(r.open);
        assert!((r.bar_completed - 66.7).abs() < 0.01);
        let done = pb::ActionStatus {
            total_jobs: 200,
            completed: 199,
            dead: 1,
            ..Default::default()
        };
        let r = ActionRow::from(&done);
        assert_eq!((r.percent, r.open, r.bar_dead), (100, false, 0.5));
    }

    #[test]
    fn spans_read_like_people_write_them() {
        assert_eq!(span(850), "850 ms");
        assert_eq!(span(12_500), "12.5 s");
        assert_eq!(span(250_000), "4 min 10 s");
        assert_eq!(span(11_100_000), "3 h 5 min");
        assert_eq!(span(-5), "0 ms");
    }

    #[test]
    fn throughput_of_samples() {
        let s = |at_ms, completed, lease_count, lease_sum_s| Sample {
            at_ms,
            completed,
            dead: 0,
            lease_sum_s,
            lease_count,
        };
        let t = Throughput::new(
            &[s(0, 0, 0, 0.0), s(5000, 50, 10, 0.02)],
            s(10_000, 150, 20, 0.04),
            4,
        );
        assert_eq!(t.points, 2);
        assert_eq!(t.peak_per_s, "20.0");
        assert_eq!(t.last_per_s, "20.0");
        assert_eq!(t.bars[0].h, CHART_H / 2);
        assert_eq!(
            (t.width, t.bars[0].x, t.bars[1].x),
            (32, 16, 24),
            "newest at the right"
        );
        assert_eq!(t.mean_lease_ms, "2.0 ms");
        let empty = Throughput::new(&[], s(1, 0, 0, 0.0), 4);
        assert_eq!((empty.points, empty.mean_lease_ms.as_str()), (0, "—"));
    }

    #[test]
    fn diagram_draws_one_edge_per_input_from_task() {
        let task = |n, from| pb::Task {
            task_number: n,
            command: "cat".into(),
            input_from_task: from,
            ..Default::default()
        };
        let d = Diagram::new(&[task(1, None), task(2, Some(1)), task(3, Some(1))]);
        assert_eq!(d.nodes.len(), 3);
        let edges: Vec<_> = d.edges.iter().map(|e| (e.from, e.to)).collect();
        assert_eq!(edges, vec![(1, 2), (1, 3)]);
        assert!(d.edges[0].path.contains('L'), "neighbours: straight");
        assert!(d.edges[1].path.contains('C'), "skipping one: an arc");
    }
}
