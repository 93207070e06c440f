//! `--watch` of `agq action status` and `agq action submit`: following an
//! Action over the `WatchAction` server stream until every job is terminal.
//!
//! - Where it goes: a progress bar on stderr when stdout and stderr are both
//!   terminals; otherwise one plain progress line on stdout every
//!   `--interval` seconds (and at the start, after a reconnect and at the
//!   end); with `--output json`, one JSON line per update.
//! - [`RateWindow`]: jobs finished per second over the last
//!   [`RATE_WINDOW`], and [`eta`] from it, not averaged since the start.
//! - Reconnecting: when the stream breaks or the server cannot be reached
//!   (a restart), the watch is opened again with capped exponential backoff
//!   ([`Backoff`]) for up to `--reconnect-for` seconds; `WatchAction` sends
//!   the current status first, so nothing is missed. Errors that another
//!   try cannot fix (`NOT_FOUND`, `UNAUTHENTICATED`, ...) end it at once.

use std::{
    collections::VecDeque,
    io::IsTerminal,
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressStyle};
use tonic::{Code, Status};

use super::{
    error::describe_status,
    table::{emit_line, visible_lines},
    time::{between, clock, human_duration, now_utc},
    view::{action_done, ActionView},
    CliError, Clients, OutputFormat,
};
use crate::{pb, worker::backoff::Backoff};

/// The span over which [`RateWindow`] measures jobs per second.
pub const RATE_WINDOW: Duration = Duration::from_secs(20);

/// The shortest span a rate is computed over: before, it is unknown.
const MIN_RATE_SPAN: Duration = Duration::from_secs(1);

/// First pause before reconnecting; it doubles up to [`RECONNECT_MAX_DELAY`].
const RECONNECT_FIRST_DELAY: Duration = Duration::from_millis(500);

/// Longest pause between two reconnect attempts.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(8);

/// The least time one reconnect attempt is given, even when the budget
/// is nearly spent.
const MIN_ATTEMPT: Duration = Duration::from_secs(1);

/// How often the progress bar's rate and ETA are refreshed.
const BAR_REFRESH: Duration = Duration::from_secs(1);

/// The `--watch` flags of `agq action status` and `agq action submit`.
#[derive(Debug, Clone, clap::Args)]
pub struct WatchArgs {
    /// Follow the Action live until every job is terminal: a progress bar
    /// (jobs/s, ETA) when stdout and stderr are terminals, else a progress
    /// line every --interval seconds (CI logs); one JSON line per update
    /// with --output json. Reconnects when the server restarts. Exits 1
    /// when any job ended dead or cancelled.
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// With --watch and no progress bar (stdout or stderr not a terminal):
    /// seconds between two progress lines, 1..=3600.
    #[arg(
        long,
        value_name = "SECS",
        env = "AGQ_WATCH_INTERVAL",
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub interval: u64,
    /// With --watch: how long to keep trying to reconnect, in seconds, when
    /// the stream breaks or the server cannot be reached (a restart), before
    /// giving up with exit code 1; 0 gives up at once.
    #[arg(
        long,
        value_name = "SECS",
        env = "AGQ_WATCH_RECONNECT_FOR",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(0..=86_400)
    )]
    pub reconnect_for: u64,
}

/// How a watch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchOptions {
    /// Time between two progress lines when stdout is not a terminal.
    pub interval: Duration,
    /// How long an interrupted watch keeps trying to reconnect; zero: not
    /// at all.
    pub reconnect_for: Duration,
}

impl Default for WatchOptions {
    /// A line every 5 s, reconnecting for up to 60 s: the flags' defaults.
    fn default() -> Self {
        WatchOptions {
            interval: Duration::from_secs(5),
            reconnect_for: Duration::from_secs(60),
        }
    }
}

impl From<&WatchArgs> for WatchOptions {
    fn from(a: &WatchArgs) -> Self {
        WatchOptions {
            interval: Duration::from_secs(a.interval.max(1)),
            reconnect_for: Duration::from_secs(a.reconnect_for),
        }
    }
}

/// Jobs finished (turned completed, dead or cancelled) per second over a
/// sliding window: the jobs that finished in the last `window` divided by
/// the window, or by the time since the first sample while the watch is
/// younger than that. Counts only grow here: a job retried and finished
/// again counts twice, as it was worked on twice.
#[derive(Debug, Clone)]
pub struct RateWindow {
    window: Duration,
    /// The finished count of the last sample, as the server reported it.
    last_finished: Option<u32>,
    /// Jobs seen finishing since the first sample.
    seen: u64,
    /// `(when, seen)` at each change, oldest first; the first one at or
    /// before the window's start is kept as the baseline.
    samples: VecDeque<(Instant, u64)>,
}

impl RateWindow {
    /// An empty window of `window`.
    pub fn new(window: Duration) -> Self {
        RateWindow {
            window,
            last_finished: None,
            seen: 0,
            samples: VecDeque::new(),
        }
    }

    /// Records that `finished` jobs of the Action were terminal at `at`
    /// (`at` never earlier than the previous call's).
    pub fn record(&mut self, at: Instant, finished: u32) {
        let grew = match self.last_finished {
            None => {
                self.samples.push_back((at, 0));
                0
            }
            Some(before) => finished.saturating_sub(before),
        };
        self.last_finished = Some(finished);
        if grew == 0 {
            return;
        }
        self.seen += u64::from(grew);
        self.samples.push_back((at, self.seen));
        // Keep one sample at or before the window's start as the baseline.
        if let Some(start) = at.checked_sub(self.window) {
            while self.samples.get(1).is_some_and(|(t, _)| *t <= start) {
                self.samples.pop_front();
            }
        }
    }

    /// Jobs finished per second at `now`; `None` before [`MIN_RATE_SPAN`]
    /// has been observed.
    pub fn per_sec(&self, now: Instant) -> Option<f64> {
        let (first_at, _) = *self.samples.front()?;
        let start = now
            .checked_sub(self.window)
            .filter(|s| *s > first_at)
            .unwrap_or(first_at);
        let span = now.saturating_duration_since(start);
        if span < MIN_RATE_SPAN {
            return None;
        }
        // The count is a step function: at `start` it is the last sample's.
        let base = self
            .samples
            .iter()
            .take_while(|(t, _)| *t <= start)
            .last()
            .map_or(0, |(_, n)| *n);
        let done = self.seen.saturating_sub(base);
        Some(done as f64 / span.as_secs_f64())
    }
}

/// The time `remaining` jobs take at `per_sec` jobs per second: zero when
/// none remain, `None` when the rate is unknown or zero.
pub fn eta(remaining: u32, per_sec: Option<f64>) -> Option<Duration> {
    if remaining == 0 {
        return Some(Duration::ZERO);
    }
    let rate = per_sec.filter(|r| r.is_finite() && *r > 0.0)?;
    Duration::try_from_secs_f64((f64::from(remaining) / rate).ceil()).ok()
}

/// Jobs that are terminal: completed, dead or cancelled.
pub fn finished(a: &pb::ActionStatus) -> u32 {
    a.completed + a.dead + a.cancelled
}

/// `14.2 jobs/s` (more decimals below 10, none from 100); `- jobs/s` when
/// unknown.
pub fn rate_text(per_sec: Option<f64>) -> String {
    match per_sec {
        None => "- jobs/s".into(),
        Some(r) if r >= 100.0 => format!("{r:.0} jobs/s"),
        Some(r) if r >= 10.0 => format!("{r:.1} jobs/s"),
        Some(r) => format!("{r:.2} jobs/s"),
    }
}

/// `ETA 6s`, `ETA 2m05s`; `ETA -` when unknown.
pub fn eta_text(eta: Option<Duration>) -> String {
    match eta {
        Some(d) => format!("ETA {}", clock(d)),
        None => "ETA -".into(),
    }
}

/// The job counts, dead always apart from completed:
/// `completed 120{sep}dead 3{sep}running 8{sep}pending 69`, then
/// `retrying N` (failed, waiting for another attempt) and `cancelled N`
/// when not zero.
pub fn counts_text(a: &pb::ActionStatus, sep: &str) -> String {
    let mut parts = vec![
        format!("completed {}", a.completed),
        format!("dead {}", a.dead),
        format!("running {}", a.running),
        format!("pending {}", a.pending),
    ];
    for (n, name) in [(a.failed, "retrying"), (a.cancelled, "cancelled")] {
        if n > 0 {
            parts.push(format!("{name} {n}"));
        }
    }
    parts.join(sep)
}

/// The rate and the ETA: `14.2 jobs/s · ETA 6s`.
pub fn rate_and_eta(a: &pb::ActionStatus, per_sec: Option<f64>) -> String {
    let remaining = a.total_jobs.saturating_sub(finished(a));
    format!(
        "{} · {}",
        rate_text(per_sec),
        eta_text(eta(remaining, per_sec))
    )
}

/// `{now} action {id} {finished}/{total} finished ({percent} %): {counts}`,
/// the start of every progress line.
fn line_head(now: &str, a: &pb::ActionStatus) -> String {
    let done = finished(a);
    let percent = if a.total_jobs == 0 {
        100
    } else {
        u64::from(done.min(a.total_jobs)) * 100 / u64::from(a.total_jobs)
    };
    format!(
        "{now} action {} {done}/{} finished ({percent} %): {}",
        a.action_id,
        a.total_jobs,
        counts_text(a, ", ")
    )
}

/// A progress line (no escapes, for logs):
/// `2025-01-31T12:00:05Z action A 123/200 finished (61 %): completed 120,
/// dead 3, running 8, pending 69 · 14.2 jobs/s · ETA 6s`, on one line.
pub fn progress_line(now: &str, a: &pb::ActionStatus, per_sec: Option<f64>) -> String {
    format!("{} · {}", line_head(now, a), rate_and_eta(a, per_sec))
}

/// The last progress line, once every job is terminal: the counts and how
/// long the Action took from its submission to its last job's end
/// (`· done in 2m05s`; `· done` when the server did not say).
pub fn final_line(now: &str, a: &pb::ActionStatus) -> String {
    match between(a.created_at.as_ref(), a.completed_jobs_at.as_ref()) {
        Some(took) => format!("{} · done in {}", line_head(now, a), human_duration(took)),
        None => format!("{} · done", line_head(now, a)),
    }
}

/// A progress bar for `total` jobs on stderr, on two lines so that the
/// bar keeps its width on a narrow terminal:
///
/// ```text
/// ⠙ 00:00:14 [=============>        ] 123/200 jobs · 14.2 jobs/s · ETA 6s
///   completed 120 · dead 3 · running 8 · pending 69
/// ```
///
/// The rate and the ETA are its prefix, the counts its message
/// ([`update_bar`]).
pub fn progress_bar(total: u32) -> ProgressBar {
    let bar = ProgressBar::new(u64::from(total));
    let style = ProgressStyle::with_template(
        "{spinner:.green} {elapsed_precise} [{wide_bar:.cyan/blue}] {pos}/{len} jobs · {prefix}\n  {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Moves `bar` to the terminal jobs of `a` and shows the rate and the ETA
/// beside it, the counts (dead apart from completed) under it.
pub fn update_bar(bar: &ProgressBar, a: &pb::ActionStatus, per_sec: Option<f64>) {
    bar.set_length(u64::from(a.total_jobs));
    bar.set_position(u64::from(finished(a)));
    bar.set_prefix(rate_and_eta(a, per_sec));
    bar.set_message(counts_text(a, " · "));
}

/// True for the errors that another try may fix: the server unreachable,
/// restarting or overloaded, a stream cut. Not for `NOT_FOUND`,
/// `UNAUTHENTICATED`, `PERMISSION_DENIED`, `INVALID_ARGUMENT` and the like.
pub fn is_retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Aborted
    )
}

/// Where progress goes.
enum Display {
    /// A progress bar on stderr (stdout and stderr are terminals).
    Bar(ProgressBar),
    /// Plain lines on stdout, one per interval.
    Lines,
    /// One JSON line per update on stdout.
    Json,
}

impl Display {
    /// The display for `out` on this process's stdout and stderr.
    fn new(out: OutputFormat) -> Self {
        match out {
            OutputFormat::Json => Display::Json,
            OutputFormat::Table
                if std::io::stdout().is_terminal() && std::io::stderr().is_terminal() =>
            {
                Display::Bar(progress_bar(0))
            }
            OutputFormat::Table => Display::Lines,
        }
    }

    /// How often [`Display::tick`] should run.
    fn period(&self, opts: &WatchOptions) -> Duration {
        match self {
            Display::Bar(_) => BAR_REFRESH,
            Display::Lines => opts.interval,
            // Nothing to refresh; a long period keeps the timer quiet.
            Display::Json => Duration::from_secs(3600),
        }
    }

    /// Shows a new status; `first` for the first message of a stream.
    fn update(
        &self,
        a: &pb::ActionStatus,
        per_sec: Option<f64>,
        first: bool,
    ) -> Result<(), CliError> {
        match self {
            Display::Bar(bar) => {
                update_bar(bar, a, per_sec);
                Ok(())
            }
            Display::Lines if first && !action_done(a) => {
                emit_line(&progress_line(&now_utc(), a, per_sec))
            }
            Display::Lines => Ok(()),
            Display::Json => emit_line(&compact(&ActionView::from(a))?),
        }
    }

    /// The periodic refresh: the bar's rate and ETA, or the next line.
    fn tick(&self, a: &pb::ActionStatus, per_sec: Option<f64>) -> Result<(), CliError> {
        match self {
            Display::Bar(bar) => {
                update_bar(bar, a, per_sec);
                Ok(())
            }
            Display::Lines => emit_line(&progress_line(&now_utc(), a, per_sec)),
            Display::Json => Ok(()),
        }
    }

    /// The end: the bar goes away; the final line.
    fn finish(&self, last: Option<&pb::ActionStatus>) -> Result<(), CliError> {
        match (self, last) {
            (Display::Bar(bar), _) => {
                bar.finish_and_clear();
                Ok(())
            }
            (Display::Lines, Some(a)) if action_done(a) => emit_line(&final_line(&now_utc(), a)),
            _ => Ok(()),
        }
    }

    /// A message about the connection, on stderr (above the bar).
    fn notice(&self, text: &str) {
        match self {
            Display::Bar(bar) => bar.println(format!("agq: {}", visible_lines(text))),
            _ => super::to_stderr(format_args!("agq: {}", visible_lines(text))),
        }
    }
}

/// One-line JSON.
fn compact<T: serde::Serialize>(v: &T) -> Result<String, CliError> {
    serde_json::to_string(v).map_err(|e| CliError::Output(e.to_string()))
}

/// An interruption being recovered from: when it began and the pauses.
struct Outage {
    since: Instant,
    attempts: u32,
    backoff: Backoff,
}

/// Why a stream stopped before every job was terminal.
enum Interrupted {
    /// The server or the transport returned this status.
    Status(Status),
    /// The stream ended without an error.
    Ended,
}

impl Interrupted {
    /// Text for notices.
    fn describe(&self) -> String {
        match self {
            Interrupted::Status(s) => describe_status(s),
            Interrupted::Ended => "the stream ended early".into(),
        }
    }
}

/// Follows `action_id` over `WatchAction` until every job is terminal,
/// showing progress as [`Display`] chooses for `out`, reconnecting as
/// `opts` allows. Returns the last status.
///
/// # Errors
///
/// A status that another try cannot fix (`NOT_FOUND`, say) at once; the
/// interruption's status when `opts.reconnect_for` is zero;
/// [`CliError::Failed`] when the server stayed unreachable for
/// `opts.reconnect_for`, or the stream ended early and no reconnect is
/// allowed; [`CliError::BrokenPipe`] when stdout closed.
pub async fn watch(
    c: &Clients,
    action_id: &str,
    out: OutputFormat,
    opts: WatchOptions,
) -> Result<pb::ActionStatus, CliError> {
    let display = Display::new(out);
    let mut last: Option<pb::ActionStatus> = None;
    let result = follow(c, action_id, &display, &opts, &mut last).await;
    let finished = display.finish(last.as_ref());
    let last = result?;
    finished?;
    Ok(last)
}

/// The loop of [`watch`]: opens the stream, shows every message, and on an
/// interruption pauses and opens it again until the budget is spent.
/// `last` keeps the latest status for the caller's final display.
async fn follow(
    c: &Clients,
    action_id: &str,
    display: &Display,
    opts: &WatchOptions,
    last: &mut Option<pb::ActionStatus>,
) -> Result<pb::ActionStatus, CliError> {
    let mut rate = RateWindow::new(RATE_WINDOW);
    let mut outage: Option<Outage> = None;
    let period = display.period(opts);
    loop {
        let opened = match &outage {
            // Never wait past the reconnect budget for one attempt.
            Some(o) => {
                let left = opts.reconnect_for.saturating_sub(o.since.elapsed());
                match tokio::time::timeout(left.max(MIN_ATTEMPT), open(c, action_id)).await {
                    Ok(r) => r,
                    Err(_) => Err(Status::deadline_exceeded("no answer to WatchAction")),
                }
            }
            None => open(c, action_id).await,
        };
        let interrupted = match opened {
            Err(status) => Interrupted::Status(status),
            Ok(mut stream) => {
                let mut ticks =
                    tokio::time::interval_at(tokio::time::Instant::now() + period, period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut first = true;
                loop {
                    tokio::select! {
                        msg = stream.message() => match msg {
                            Ok(Some(msg)) => {
                                let Some(a) = msg.action else { continue };
                                let now = Instant::now();
                                rate.record(now, finished(&a));
                                if let Some(o) = outage.take() {
                                    display.notice(&format!(
                                        "reconnected after {}; watching action {action_id} again",
                                        human_duration(o.since.elapsed())
                                    ));
                                }
                                display.update(&a, rate.per_sec(now), first)?;
                                first = false;
                                let done = action_done(&a);
                                *last = Some(a.clone());
                                if done {
                                    return Ok(a);
                                }
                            }
                            Ok(None) => break Interrupted::Ended,
                            Err(status) => break Interrupted::Status(status),
                        },
                        _ = ticks.tick() => {
                            if let Some(a) = last.as_ref() {
                                display.tick(a, rate.per_sec(Instant::now()))?;
                            }
                        }
                    }
                }
            }
        };
        if let Interrupted::Status(s) = &interrupted {
            if !is_retryable(s.code()) {
                return Err(into_error(interrupted, action_id));
            }
        }
        if opts.reconnect_for.is_zero() {
            return Err(into_error(interrupted, action_id));
        }
        let o = outage.get_or_insert_with(|| Outage {
            since: Instant::now(),
            attempts: 0,
            backoff: Backoff::new(RECONNECT_FIRST_DELAY, RECONNECT_MAX_DELAY),
        });
        let elapsed = o.since.elapsed();
        if elapsed >= opts.reconnect_for {
            return Err(CliError::Failed(format!(
                "gave up watching action {action_id}: no connection for {} (--reconnect-for {}): {}",
                human_duration(elapsed),
                opts.reconnect_for.as_secs(),
                interrupted.describe()
            )));
        }
        let left = opts.reconnect_for - elapsed;
        let pause = o.backoff.next_delay().min(left);
        o.attempts += 1;
        let what = if o.attempts == 1 {
            format!("lost the watch of action {action_id}")
        } else {
            format!("reconnect attempt {} failed", o.attempts - 1)
        };
        display.notice(&format!(
            "{what} ({}); reconnecting in {} (giving up in {})",
            interrupted.describe(),
            human_duration(pause),
            clock(left)
        ));
        tokio::time::sleep(pause).await;
    }
}

/// Opens the `WatchAction` stream of `action_id`.
async fn open(
    c: &Clients,
    action_id: &str,
) -> Result<tonic::Streaming<pb::WatchActionResponse>, Status> {
    c.action
        .clone()
        .watch_action(pb::WatchActionRequest {
            action_id: action_id.to_owned(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The error of an interruption that is not retried.
fn into_error(i: Interrupted, action_id: &str) -> CliError {
    match i {
        Interrupted::Status(s) => CliError::from(s),
        Interrupted::Ended => CliError::Failed(format!(
            "the watch of action {action_id} ended before every job was terminal"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(completed: u32, dead: u32, running: u32, pending: u32) -> pb::ActionStatus {
        pb::ActionStatus {
            action_id: "a1".into(),
            plan_id: "p".into(),
            total_jobs: completed + dead + running + pending,
            completed,
            dead,
            running,
            pending,
            ..Default::default()
        }
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn rate_is_unknown_until_a_second_has_passed() {
        let t0 = Instant::now();
        let mut r = RateWindow::new(Duration::from_secs(20));
        assert_eq!(r.per_sec(t0), None);
        r.record(t0, 5);
        assert_eq!(r.per_sec(t0 + secs(0.5)), None);
        r.record(t0 + secs(0.5), 8);
        // The 5 already finished at the start do not count.
        assert_eq!(r.per_sec(t0 + secs(1.0)), Some(3.0));
        assert_eq!(r.per_sec(t0 + secs(2.0)), Some(1.5));
    }

    #[test]
    fn rate_counts_only_the_last_window() {
        let t0 = Instant::now();
        let mut r = RateWindow::new(Duration::from_secs(10));
        r.record(t0, 0);
        // 100 jobs in the first 2 s, then 1 job/s.
        r.record(t0 + secs(2.0), 100);
        for i in 1..=20 {
            r.record(t0 + secs(2.0 + f64::from(i)), 100 + i);
        }
        let now = t0 + secs(22.0);
        // Window [12 s, 22 s]: at 12 s the count was 110, now 120.
        let rate = r.per_sec(now).unwrap();
        assert!((rate - 1.0).abs() < 1e-9, "{rate}");
        // Since the start it would have been 120 / 22 = 5.45 jobs/s.
        // Nothing more finishes: the rate decays to zero.
        let later = r.per_sec(now + secs(5.0)).unwrap();
        assert!((later - 0.5).abs() < 1e-9, "{later}");
        assert_eq!(r.per_sec(now + secs(10.0)), Some(0.0));
        // Old samples were dropped, the baseline kept.
        assert!(r.samples.len() <= 12, "{}", r.samples.len());
    }

    #[test]
    fn rate_ignores_repeats_and_counts_after_retries() {
        let t0 = Instant::now();
        let mut r = RateWindow::new(Duration::from_secs(10));
        r.record(t0, 4);
        r.record(t0 + secs(1.0), 4);
        r.record(t0 + secs(2.0), 6);
        // Two dead jobs retried: the finished count drops, then grows again.
        r.record(t0 + secs(3.0), 4);
        r.record(t0 + secs(4.0), 7);
        assert_eq!(r.per_sec(t0 + secs(5.0)), Some(1.0));
        assert_eq!(r.samples.len(), 3);
    }

    #[test]
    fn eta_from_rate() {
        assert_eq!(eta(0, None), Some(Duration::ZERO));
        assert_eq!(eta(10, None), None);
        assert_eq!(eta(10, Some(0.0)), None);
        assert_eq!(eta(10, Some(f64::NAN)), None);
        assert_eq!(eta(10, Some(4.0)), Some(Duration::from_secs(3)));
        assert_eq!(eta(69, Some(14.2)), Some(Duration::from_secs(5)));
        assert_eq!(eta(1, Some(1e-300)), None);
        assert_eq!(eta_text(Some(Duration::from_secs(125))), "ETA 2m05s");
        assert_eq!(eta_text(None), "ETA -");
    }

    #[test]
    fn rates_as_text() {
        assert_eq!(rate_text(None), "- jobs/s");
        assert_eq!(rate_text(Some(0.0)), "0.00 jobs/s");
        assert_eq!(rate_text(Some(0.456)), "0.46 jobs/s");
        assert_eq!(rate_text(Some(14.24)), "14.2 jobs/s");
        assert_eq!(rate_text(Some(1234.5)), "1234 jobs/s");
    }

    #[test]
    fn bar_shows_dead_apart_with_rate_and_eta() {
        let a = status(120, 3, 8, 69);
        assert_eq!(
            counts_text(&a, " · "),
            "completed 120 · dead 3 · running 8 · pending 69"
        );
        assert_eq!(rate_and_eta(&a, Some(14.2)), "14.2 jobs/s · ETA 6s");
        let mut b = status(1, 0, 0, 1);
        b.failed = 2;
        b.cancelled = 1;
        b.total_jobs = 5;
        assert_eq!(
            counts_text(&b, " · "),
            "completed 1 · dead 0 · running 0 · pending 1 · retrying 2 · cancelled 1"
        );
        assert_eq!(rate_and_eta(&b, None), "- jobs/s · ETA -");
    }

    #[test]
    fn progress_and_final_lines() {
        let a = status(120, 3, 8, 69);
        let line = progress_line("2025-01-31T12:00:05Z", &a, Some(14.2));
        assert_eq!(
            line,
            "2025-01-31T12:00:05Z action a1 123/200 finished (61 %): completed 120, dead 3, \
             running 8, pending 69 · 14.2 jobs/s · ETA 6s"
        );
        assert!(!line.contains('\x1b'));
        let mut end = status(197, 3, 0, 0);
        end.created_at = Some(prost_types::Timestamp {
            seconds: 1000,
            nanos: 0,
        });
        end.completed_jobs_at = Some(prost_types::Timestamp {
            seconds: 1125,
            nanos: 0,
        });
        assert_eq!(
            final_line("T", &end),
            "T action a1 200/200 finished (100 %): completed 197, dead 3, running 0, pending 0 \
             · done in 2m05s"
        );
        end.completed_jobs_at = None;
        assert!(final_line("T", &end).ends_with("pending 0 · done"));
        let zero = status(0, 0, 0, 0);
        assert!(progress_line("T", &zero, None).contains("0/0 finished (100 %)"));
    }

    #[test]
    fn only_transient_errors_are_retried() {
        for c in [
            Code::Unavailable,
            Code::Unknown,
            Code::Internal,
            Code::Cancelled,
        ] {
            assert!(is_retryable(c), "{c:?}");
        }
        for c in [
            Code::NotFound,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::Unimplemented,
        ] {
            assert!(!is_retryable(c), "{c:?}");
        }
    }
}
