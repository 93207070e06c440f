//! `agq schedule create|get|list|pause|resume|delete`: recurring
//! schedules (ScheduleService).

use std::collections::HashMap;

use serde::Serialize;

use super::{
    action::{parse_inputs, parse_key_value},
    more_hint,
    plan::read_source,
    print_json,
    table::{emit, key_values, Table},
    time::rfc3339,
    CliError, Clients, OutputFormat, PageArgs,
};
use crate::pb::{self, CatchUp};

/// `agq schedule ...`
#[derive(Debug, clap::Subcommand)]
pub enum ScheduleCommand {
    /// Create a schedule: an Action of a Plan at every tick of a cron
    /// expression.
    Create(CreateArgs),
    /// Show one schedule.
    Get {
        /// Schedule id.
        schedule_id: String,
    },
    /// List schedules by id.
    List {
        /// Paging.
        #[command(flatten)]
        page: PageArgs,
    },
    /// Pause a schedule (its ticks are skipped until resumed).
    Pause {
        /// Schedule id.
        schedule_id: String,
    },
    /// Resume a paused schedule from its next tick.
    Resume {
        /// Schedule id.
        schedule_id: String,
    },
    /// Delete a schedule (its Actions stay).
    Delete {
        /// Schedule id.
        schedule_id: String,
    },
}

/// What a schedule does with ticks missed while the server was down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CatchUpArg {
    /// Every missed tick gets its Action (up to the 100 most recent).
    All,
    /// Only the latest missed tick gets an Action.
    Latest,
    /// Missed ticks are dropped (only a tick less than 60 s late fires).
    Skip,
}

/// Flags of `agq schedule create`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["inputs", "input"])))]
pub struct CreateArgs {
    /// Schedule id, [A-Za-z0-9._-]{1,100}; each tick's Action is `<id>-<unix seconds>`.
    pub schedule_id: String,
    /// The Plan each tick runs.
    #[arg(long, value_name = "PLAN_ID")]
    pub plan: String,
    /// Cron expression with seconds: 'sec min hour day-of-month month
    /// day-of-week [year]', e.g. '0 30 9 * * Mon-Fri'; a classic
    /// five-field expression runs at second 0, its days of the week
    /// numbered as in crontab (0 or 7 Sunday: '0 9 * * 1-5' is weekdays).
    #[arg(long)]
    pub cron: String,
    /// IANA time zone of the expression, e.g. Europe/Paris [default: UTC].
    #[arg(long, value_name = "ZONE")]
    pub time_zone: Option<String>,
    /// Inputs of each Action from a file (`-` reads stdin): a JSON array
    /// of objects, or one JSON object per line.
    #[arg(long, value_name = "FILE")]
    pub inputs: Option<String>,
    /// One input value, `key=value`; repeat to add keys to the single input.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub input: Vec<(String, String)>,
    /// Attempts per job, 1..=100 [server default: 3].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_attempts: Option<u32>,
    /// Priority of each Action, -1000..=1000 [default: 0].
    #[arg(long, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub priority: Option<i32>,
    /// Worker selector of each Action [default: the Plan's].
    #[arg(long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// Concurrency key of each Action.
    #[arg(long, value_name = "KEY", requires = "max_running")]
    pub concurrency_key: Option<String>,
    /// The limit of --concurrency-key, 1..=1000000.
    #[arg(long, value_name = "N", requires = "concurrency_key",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_running: Option<u32>,
    /// Ticks missed while the server was down.
    #[arg(long, value_enum, default_value_t = CatchUpArg::All)]
    pub catch_up: CatchUpArg,
}

/// A schedule as `schedule get` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct ScheduleView {
    /// Id.
    pub schedule_id: String,
    /// Plan.
    pub plan_id: String,
    /// Cron expression.
    pub cron: String,
    /// Time zone; empty: UTC.
    pub time_zone: String,
    /// Jobs per Action.
    pub inputs: usize,
    /// all, latest or skip.
    pub catch_up: String,
    /// Paused.
    pub paused: bool,
    /// Next tick.
    pub next_run_at: Option<String>,
    /// Tick of the last Action.
    pub last_run_at: Option<String>,
    /// Last Action.
    pub last_action_id: String,
    /// Actions submitted.
    pub runs: u64,
    /// Why the last tick submitted nothing.
    pub last_error: String,
    /// Priority of the Actions.
    pub priority: i32,
    /// Worker selector of the Actions.
    pub worker_selector: String,
    /// Concurrency key and limit of the Actions.
    pub concurrency_key: String,
    /// Its limit.
    pub max_running: u32,
}

fn catch_up_name(c: i32) -> String {
    match CatchUp::try_from(c) {
        Ok(CatchUp::Latest) => "latest",
        Ok(CatchUp::Skip) => "skip",
        _ => "all",
    }
    .into()
}

impl From<pb::Schedule> for ScheduleView {
    fn from(s: pb::Schedule) -> Self {
        ScheduleView {
            catch_up: catch_up_name(s.catch_up),
            next_run_at: rfc3339(s.next_run_at.as_ref()),
            last_run_at: rfc3339(s.last_run_at.as_ref()),
            inputs: s.inputs.len(),
            schedule_id: s.schedule_id,
            plan_id: s.plan_id,
            cron: s.cron,
            time_zone: s.time_zone,
            paused: s.paused,
            last_action_id: s.last_action_id,
            runs: s.runs,
            last_error: s.last_error,
            priority: s.priority,
            worker_selector: s.worker_selector,
            concurrency_key: s.concurrency_key,
            max_running: s.max_running,
        }
    }
}

impl ScheduleView {
    /// `key value` lines.
    pub fn table(&self) -> String {
        let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        key_values(&[
            ("schedule", self.schedule_id.clone()),
            ("plan", self.plan_id.clone()),
            (
                "cron",
                format!(
                    "{} ({})",
                    self.cron,
                    if self.time_zone.is_empty() {
                        "UTC"
                    } else {
                        &self.time_zone
                    }
                ),
            ),
            ("jobs per action", self.inputs.to_string()),
            ("catch up", self.catch_up.clone()),
            ("paused", if self.paused { "yes" } else { "no" }.into()),
            ("next run", dash(&self.next_run_at)),
            ("last run", dash(&self.last_run_at)),
            (
                "last action",
                if self.last_action_id.is_empty() {
                    "-".into()
                } else {
                    self.last_action_id.clone()
                },
            ),
            ("runs", self.runs.to_string()),
            ("priority", self.priority.to_string()),
            (
                "workers",
                if self.worker_selector.is_empty() {
                    "the plan's selector, or any".into()
                } else {
                    format!("matching {}", self.worker_selector)
                },
            ),
            (
                "concurrency",
                if self.concurrency_key.is_empty() {
                    "unlimited".into()
                } else {
                    format!(
                        "{} (max_running {})",
                        self.concurrency_key, self.max_running
                    )
                },
            ),
            (
                "last error",
                if self.last_error.is_empty() {
                    "-".into()
                } else {
                    self.last_error.clone()
                },
            ),
        ])
    }
}

fn show(s: pb::Schedule, out: OutputFormat) -> Result<(), CliError> {
    let v = ScheduleView::from(s);
    match out {
        OutputFormat::Json => print_json(&v),
        OutputFormat::Table => emit(&v.table()),
    }
}

fn inputs_of(args: &CreateArgs) -> Result<Vec<pb::ActionInput>, CliError> {
    let maps: Vec<HashMap<String, String>> = match &args.inputs {
        Some(file) => {
            let source = if file == "-" { "stdin" } else { file.as_str() };
            parse_inputs(&read_source(file)?, source)?
        }
        None => vec![args.input.iter().cloned().collect()],
    };
    Ok(maps
        .into_iter()
        .map(|values| pb::ActionInput { values })
        .collect())
}

/// Runs one `schedule` subcommand.
///
/// # Errors
///
/// See [`super::run`].
pub async fn run(c: &Clients, out: OutputFormat, cmd: ScheduleCommand) -> Result<(), CliError> {
    let mut client = c.schedule.clone();
    match cmd {
        ScheduleCommand::Create(args) => {
            let schedule = pb::Schedule {
                schedule_id: args.schedule_id.clone(),
                plan_id: args.plan.clone(),
                cron: args.cron.clone(),
                time_zone: args.time_zone.clone().unwrap_or_default(),
                inputs: inputs_of(&args)?,
                max_attempts: args.max_attempts.unwrap_or(0),
                priority: args.priority.unwrap_or(0),
                worker_selector: args.selector.clone().unwrap_or_default(),
                concurrency_key: args.concurrency_key.clone().unwrap_or_default(),
                max_running: args.max_running.unwrap_or(0),
                catch_up: match args.catch_up {
                    CatchUpArg::All => CatchUp::All,
                    CatchUpArg::Latest => CatchUp::Latest,
                    CatchUpArg::Skip => CatchUp::Skip,
                } as i32,
                ..Default::default()
            };
            let s = client
                .create_schedule(pb::CreateScheduleRequest {
                    schedule: Some(schedule),
                })
                .await?
                .into_inner()
                .schedule
                .unwrap_or_default();
            show(s, out)
        }
        ScheduleCommand::Get { schedule_id } => {
            let s = client
                .get_schedule(pb::GetScheduleRequest { schedule_id })
                .await?
                .into_inner()
                .schedule
                .unwrap_or_default();
            show(s, out)
        }
        ScheduleCommand::Pause { schedule_id } => {
            let s = client
                .pause_schedule(pb::PauseScheduleRequest { schedule_id })
                .await?
                .into_inner()
                .schedule
                .unwrap_or_default();
            show(s, out)
        }
        ScheduleCommand::Resume { schedule_id } => {
            let s = client
                .resume_schedule(pb::ResumeScheduleRequest { schedule_id })
                .await?
                .into_inner()
                .schedule
                .unwrap_or_default();
            show(s, out)
        }
        ScheduleCommand::Delete { schedule_id } => {
            client
                .delete_schedule(pb::DeleteScheduleRequest {
                    schedule_id: schedule_id.clone(),
                })
                .await?;
            match out {
                OutputFormat::Json => print_json(&serde_json::json!({ "deleted": schedule_id })),
                OutputFormat::Table => emit(&format!("deleted schedule {schedule_id}\n")),
            }
        }
        ScheduleCommand::List { page } => {
            let mut schedules = Vec::new();
            let mut token = page.page_token.clone().unwrap_or_default();
            let size = page.page_size.unwrap_or(if page.all { 1000 } else { 0 });
            loop {
                let r = client
                    .list_schedules(pb::ListSchedulesRequest {
                        page_size: size,
                        page_token: token,
                    })
                    .await?
                    .into_inner();
                schedules.extend(r.schedules.into_iter().map(ScheduleView::from));
                token = r.next_page_token;
                if !page.all || token.is_empty() {
                    break;
                }
            }
            match out {
                OutputFormat::Json => print_json(&serde_json::json!({
                    "schedules": schedules,
                    "next_page_token": token,
                })),
                OutputFormat::Table => {
                    let mut t = Table::new([
                        "SCHEDULE", "PLAN", "CRON", "ZONE", "NEXT RUN", "RUNS", "STATE",
                    ]);
                    for s in &schedules {
                        t.row([
                            s.schedule_id.clone(),
                            s.plan_id.clone(),
                            s.cron.clone(),
                            if s.time_zone.is_empty() {
                                "UTC".into()
                            } else {
                                s.time_zone.clone()
                            },
                            s.next_run_at.clone().unwrap_or_else(|| "-".into()),
                            s.runs.to_string(),
                            if s.paused {
                                "paused".into()
                            } else if !s.last_error.is_empty() {
                                "active, last tick failed".into()
                            } else {
                                "active".into()
                            },
                        ]);
                    }
                    emit(&t.render())?;
                    more_hint(&token);
                    Ok(())
                }
            }
        }
    }
}
