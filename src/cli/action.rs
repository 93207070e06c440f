//! `agq action submit|status|list|cancel|retry`: fanning a Plan out over inputs (a JSON
//! file, `--input key=value` pairs, or one job per file matched by
//! `--files`), and watching an Action to its end (`--watch`, see
//! [`super::watch`]); listing Actions newest first, and cancelling or
//! retrying all of an Action's jobs at once.

use std::{
    collections::{BTreeSet, HashMap},
    path::{Path, PathBuf},
    time::SystemTime,
};

use serde::Serialize;

use super::{
    plan::read_source,
    print_json,
    table::{emit, emit_line, key_values},
    time::{parse_time, to_timestamp},
    view::{ActionChangeView, ActionPage, ActionStateArg, ActionView, RetryStatusArg},
    watch::{watch, WatchArgs, WatchOptions},
    CliError, Clients, OutputFormat,
};
use crate::pb;

/// `agq action ...`
#[derive(Debug, clap::Subcommand)]
pub enum ActionCommand {
    /// Create one job per input of a Plan.
    Submit(SubmitArgs),
    /// Show an Action's job counts; --watch follows it to the end.
    Status {
        /// Action id.
        action_id: String,
        /// --watch and its settings.
        #[command(flatten)]
        follow: WatchArgs,
    },
    /// List Actions, newest first, with their job counts.
    List {
        /// Only Actions of this Plan.
        #[arg(long, value_name = "PLAN_ID")]
        plan: Option<String>,
        /// Only open Actions (a job pending, running or failed), finished
        /// ones (every job completed, dead or cancelled), or those with a
        /// dead job.
        #[arg(long, value_enum)]
        state: Option<ActionStateArg>,
        /// Only Actions created at or after this time (RFC 3339, or "2h ago").
        #[arg(long, value_name = "TIME", value_parser = parse_time)]
        since: Option<SystemTime>,
        /// Only Actions created before this time (RFC 3339, or "2h ago").
        #[arg(long, value_name = "TIME", value_parser = parse_time)]
        until: Option<SystemTime>,
        /// Actions per page, 1..=1000 [server default: 100].
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: Option<u32>,
        /// Token of the page to fetch (printed after a partial page).
        #[arg(long)]
        page_token: Option<String>,
    },
    /// Cancel every pending, running or failed job of an Action at once
    /// (running ones are killed on their workers).
    Cancel {
        /// Action id.
        action_id: String,
    },
    /// Put the Action's failed and dead jobs (or only those in --status)
    /// back to pending with a fresh attempt budget, at once.
    Retry {
        /// Action id.
        action_id: String,
        /// Only jobs in this status.
        #[arg(long, value_enum)]
        status: Option<RetryStatusArg>,
    },
}

/// Flags of `agq action submit`. Exactly one input source is required.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("source")
        .required(true)
        .args(["inputs", "input", "files"]),
))]
pub struct SubmitArgs {
    /// The Plan to run.
    #[arg(long, value_name = "PLAN_ID")]
    pub plan: String,
    /// Inputs from a file (`-` reads stdin): a JSON array of objects, or
    /// one JSON object per line. Values must be strings (numbers and
    /// booleans are turned into text).
    #[arg(long, value_name = "FILE")]
    pub inputs: Option<String>,
    /// One input value, `key=value`; repeat to add keys to the same single
    /// input (one job).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub input: Vec<(String, String)>,
    /// One job per file matching these globs, with input `file` = the
    /// file's absolute path. Quote globs to let agq expand them.
    #[arg(long, value_name = "GLOB", num_args = 1..)]
    pub files: Vec<String>,
    /// Id for the Action, [A-Za-z0-9._-]{1,128} [default: the server makes one].
    #[arg(long)]
    pub action_id: Option<String>,
    /// Attempts per job before it goes dead, 1..=100 [server default: 3].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_attempts: Option<u32>,
    /// Run the jobs no earlier than this: RFC 3339 (2025-01-31T12:00:00Z,
    /// with any offset) or +DURATION from now (+10m).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub run_at: Option<SystemTime>,
    /// Priority of the jobs, -1000..=1000 [server default: 0]: higher
    /// leases first; actions of equal priority take turns.
    #[arg(long, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub priority: Option<i32>,
    /// Run only on workers whose tags match this label selector, e.g.
    /// 'gpu=true,region in (eu,us),!spot' [default: the Plan's selector].
    #[arg(long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// Concurrency key: at most --max-running jobs of all Actions with
    /// this key run at once across the fleet.
    #[arg(long, value_name = "KEY", requires = "max_running")]
    pub concurrency_key: Option<String>,
    /// The limit of --concurrency-key, 1..=1000000.
    #[arg(long, value_name = "N", requires = "concurrency_key",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_running: Option<u32>,
    /// --watch (after submitting, follow the Action like `action status
    /// --watch`) and its settings.
    #[command(flatten)]
    pub follow: WatchArgs,
}

/// Parses `key=value`.
pub(crate) fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not key=value")),
    }
}

/// One input object as a string map: values must be strings, numbers or
/// booleans; `{"values": {...}}` (the ActionInput message) is unwrapped.
fn to_input(
    v: serde_json::Value,
    n: usize,
    source: &str,
) -> Result<HashMap<String, String>, CliError> {
    let bad = |why: String| CliError::Input(format!("{source}: input #{n}: {why}"));
    let serde_json::Value::Object(mut m) = v else {
        return Err(bad(format!(
            "expected a JSON object of string values, got {}",
            json_kind(&v)
        )));
    };
    if m.len() == 1 && matches!(m.get("values"), Some(serde_json::Value::Object(_))) {
        if let Some(serde_json::Value::Object(inner)) = m.remove("values") {
            m = inner;
        }
    }
    m.into_iter()
        .map(|(k, v)| {
            let text = match v {
                serde_json::Value::String(s) => s,
                serde_json::Value::Number(x) => x.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                other => {
                    return Err(bad(format!(
                        "the value of {k:?} must be a string, got {}",
                        json_kind(&other)
                    )))
                }
            };
            Ok((k, text))
        })
        .collect()
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Parses action inputs: a JSON array of objects, or JSON lines (one object
/// per line; any whitespace between objects works). Arrays on lines are
/// flattened.
///
/// # Errors
///
/// [`CliError::Input`] with the position of malformed JSON or the number of
/// the offending input; also when there is no input at all.
pub fn parse_inputs(text: &str, source: &str) -> Result<Vec<HashMap<String, String>>, CliError> {
    let mut inputs = Vec::new();
    for value in serde_json::Deserializer::from_str(text).into_iter::<serde_json::Value>() {
        let value = value.map_err(|e| CliError::Input(format!("{source}: invalid JSON: {e}")))?;
        match value {
            serde_json::Value::Array(items) => {
                for item in items {
                    let n = inputs.len() + 1;
                    inputs.push(to_input(item, n, source)?);
                }
            }
            other => {
                let n = inputs.len() + 1;
                inputs.push(to_input(other, n, source)?);
            }
        }
    }
    if inputs.is_empty() {
        return Err(CliError::Input(format!("{source}: holds no inputs")));
    }
    Ok(inputs)
}

/// The regular files matching `patterns`, as absolute UTF-8 paths, in
/// pattern order then name order, without duplicates. A pattern that names
/// an existing file is taken literally.
///
/// # Errors
///
/// [`CliError::Input`] for a pattern that matches no file or a path that
/// is not UTF-8.
pub fn expand_files(patterns: &[String]) -> Result<Vec<String>, CliError> {
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for pattern in patterns {
        // A path that exists is taken as it is (the shell may have expanded
        // the glob already, and names may hold `[` or `*`).
        let matched: Vec<PathBuf> = if Path::new(pattern).is_file() {
            vec![PathBuf::from(pattern)]
        } else {
            match glob::glob(pattern) {
                Ok(paths) => paths
                    .filter_map(Result::ok)
                    .filter(|p| p.is_file())
                    .collect(),
                Err(_) => Vec::new(),
            }
        };
        if matched.is_empty() {
            return Err(CliError::Input(format!(
                "--files {pattern:?} matches no regular file"
            )));
        }
        for p in matched {
            let abs = std::path::absolute(&p)
                .map_err(|e| CliError::Input(format!("{}: {e}", p.display())))?;
            let text = abs.to_str().ok_or_else(|| {
                CliError::Input(format!("{}: the path is not UTF-8", abs.display()))
            })?;
            if seen.insert(text.to_owned()) {
                files.push(text.to_owned());
            }
        }
    }
    Ok(files)
}

/// What `action submit` prints.
#[derive(Debug, Clone, Serialize)]
pub struct SubmitView {
    /// Id of the Action.
    pub action_id: String,
    /// The Plan.
    pub plan_id: String,
    /// Jobs created.
    pub jobs_created: u32,
    /// Their ids in input order.
    pub job_ids: Vec<String>,
}

/// The inputs `args` describe.
///
/// # Errors
///
/// [`CliError::Input`] as [`parse_inputs`] and [`expand_files`].
pub fn inputs_of(args: &SubmitArgs) -> Result<Vec<pb::ActionInput>, CliError> {
    let maps = if let Some(file) = &args.inputs {
        let source = if file == "-" { "stdin" } else { file.as_str() };
        parse_inputs(&read_source(file)?, source)?
    } else if !args.input.is_empty() {
        vec![args.input.iter().cloned().collect()]
    } else {
        expand_files(&args.files)?
            .into_iter()
            .map(|f| HashMap::from([("file".to_owned(), f)]))
            .collect()
    };
    Ok(maps
        .into_iter()
        .map(|values| pb::ActionInput { values })
        .collect())
}

/// Runs one `action` subcommand.
///
/// # Errors
///
/// See [`super::run`]; `--watch` also fails with [`CliError::Failed`] when
/// the Action ends with dead or cancelled jobs.
pub async fn run(c: &Clients, out: OutputFormat, cmd: ActionCommand) -> Result<(), CliError> {
    match cmd {
        ActionCommand::Submit(args) => {
            let inputs = inputs_of(&args)?;
            let resp = c
                .action
                .clone()
                .submit_action(pb::SubmitActionRequest {
                    action_id: args.action_id.clone().unwrap_or_default(),
                    plan_id: args.plan.clone(),
                    inputs,
                    run_at: args.run_at.map(to_timestamp),
                    max_attempts: args.max_attempts.unwrap_or(0),
                    priority: args.priority.unwrap_or(0),
                    worker_selector: args.selector.clone().unwrap_or_default(),
                    concurrency_key: args.concurrency_key.clone().unwrap_or_default(),
                    max_running: args.max_running.unwrap_or(0),
                })
                .await?
                .into_inner();
            let view = SubmitView {
                action_id: resp.action_id.clone(),
                plan_id: args.plan.clone(),
                jobs_created: resp.jobs_created,
                job_ids: resp.job_ids,
            };
            match out {
                OutputFormat::Json if args.follow.watch => emit_line(&compact(&view)?)?,
                OutputFormat::Json => print_json(&view)?,
                OutputFormat::Table => {
                    let mut pairs = vec![
                        ("action", view.action_id.clone()),
                        ("plan", view.plan_id.clone()),
                        ("jobs", view.jobs_created.to_string()),
                    ];
                    if view.job_ids.len() <= 20 {
                        pairs.push(("job ids", view.job_ids.join("\n")));
                    } else {
                        pairs.push(("job ids", format!("agq job list {}", view.action_id)));
                    }
                    emit(&key_values(&pairs))?;
                }
            }
            if args.follow.watch {
                if out == OutputFormat::Table {
                    emit_line("")?;
                }
                finish_watch(c, &view.action_id, out, (&args.follow).into()).await?;
            }
            Ok(())
        }
        ActionCommand::Status { action_id, follow } => {
            if follow.watch {
                return finish_watch(c, &action_id, out, (&follow).into()).await;
            }
            let a = c
                .action
                .clone()
                .get_action(pb::GetActionRequest { action_id })
                .await?
                .into_inner()
                .action
                .unwrap_or_default();
            let view = ActionView::from(&a);
            match out {
                OutputFormat::Json => print_json(&view),
                OutputFormat::Table => emit(&view.table()),
            }
        }
        ActionCommand::List {
            plan,
            state,
            since,
            until,
            limit,
            page_token,
        } => {
            let r = c
                .action
                .clone()
                .list_actions(pb::ListActionsRequest {
                    plan_id: plan.unwrap_or_default(),
                    state: state.map_or(0, |s| pb::ActionState::from(s) as i32),
                    created_after: since.map(to_timestamp),
                    created_before: until.map(to_timestamp),
                    page_size: limit.unwrap_or(0),
                    page_token: page_token.unwrap_or_default(),
                })
                .await?
                .into_inner();
            let page = ActionPage {
                actions: r.actions.iter().map(ActionView::from).collect(),
                next_page_token: r.next_page_token,
            };
            match out {
                OutputFormat::Json => print_json(&page),
                OutputFormat::Table => {
                    emit(&page.table())?;
                    if !page.next_page_token.is_empty() {
                        super::to_stderr(format_args!(
                            "more results: pass --page-token {}",
                            page.next_page_token
                        ));
                    }
                    Ok(())
                }
            }
        }
        ActionCommand::Cancel { action_id } => cancel_action(c, out, action_id).await,
        ActionCommand::Retry { action_id, status } => retry_action(c, out, action_id, status).await,
    }
}

/// Cancels every open job of `action_id` (CancelAction) and prints the
/// count and the Action.
///
/// # Errors
///
/// See [`super::run`].
pub async fn cancel_action(
    c: &Clients,
    out: OutputFormat,
    action_id: String,
) -> Result<(), CliError> {
    let r = c
        .action
        .clone()
        .cancel_action(pb::CancelActionRequest { action_id })
        .await?
        .into_inner();
    show_change("cancelled", r.cancelled, r.action.unwrap_or_default(), out)
}

/// Retries the failed and dead jobs of `action_id` (only `status` when
/// given) with RetryAction and prints the count and the Action.
///
/// # Errors
///
/// See [`super::run`].
pub async fn retry_action(
    c: &Clients,
    out: OutputFormat,
    action_id: String,
    status: Option<RetryStatusArg>,
) -> Result<(), CliError> {
    let r = c
        .action
        .clone()
        .retry_action(pb::RetryActionRequest {
            action_id,
            status: status.map_or(0, |s| pb::JobStatus::from(s) as i32),
        })
        .await?
        .into_inner();
    show_change("retried", r.retried, r.action.unwrap_or_default(), out)
}

/// Prints how many jobs a bulk change touched and the Action after it.
///
/// # Errors
///
/// [`CliError::Output`] when printing fails.
pub fn show_change(
    change: &str,
    jobs: u32,
    action: pb::ActionStatus,
    out: OutputFormat,
) -> Result<(), CliError> {
    let view = ActionChangeView {
        change: change.into(),
        jobs,
        action: ActionView::from(&action),
    };
    match out {
        OutputFormat::Json => print_json(&view),
        OutputFormat::Table => emit(&view.table()),
    }
}

/// One-line JSON.
fn compact<T: Serialize>(v: &T) -> Result<String, CliError> {
    serde_json::to_string(v).map_err(|e| CliError::Output(e.to_string()))
}

/// Watches to the end, prints the final status (table mode) and turns dead
/// or cancelled jobs into [`CliError::Failed`].
async fn finish_watch(
    c: &Clients,
    action_id: &str,
    out: OutputFormat,
    opts: WatchOptions,
) -> Result<(), CliError> {
    let last = watch(c, action_id, out, opts).await?;
    if out == OutputFormat::Table {
        emit(&ActionView::from(&last).table())?;
    }
    if last.dead + last.cancelled > 0 {
        return Err(CliError::Failed(format!(
            "action {} finished with {} dead and {} cancelled of {} jobs",
            last.action_id, last.dead, last.cancelled, last.total_jobs
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_json_array_and_lines() {
        let arr = parse_inputs(r#"[{"file":"a"},{"values":{"file":"b","n":3}}]"#, "x").unwrap();
        assert_eq!(arr.len(), 2);
        assert_eq!(arr[1]["file"], "b");
        assert_eq!(arr[1]["n"], "3");
        let lines =
            parse_inputs("{\"file\":\"a\"}\n\n{\"file\":\"b\",\"ok\":true}\n", "x").unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["ok"], "true");
    }

    #[test]
    fn rejects_bad_inputs() {
        let e = parse_inputs("{\"file\":\"a\"}\n{\"file\":[1]}\n", "in.jsonl").unwrap_err();
        assert_eq!(
            e.to_string(),
            "in.jsonl: input #2: the value of \"file\" must be a string, got an array"
        );
        assert!(parse_inputs("", "x")
            .unwrap_err()
            .to_string()
            .contains("no inputs"));
        assert!(parse_inputs("[1]", "x").is_err());
        assert!(parse_inputs("{\"a\":", "x")
            .unwrap_err()
            .to_string()
            .contains("invalid JSON"));
    }

    #[test]
    fn expands_globs_to_absolute_files() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.txt", "a.txt", "c.md"] {
            std::fs::write(dir.path().join(name), "x").unwrap();
        }
        std::fs::create_dir(dir.path().join("sub.txt")).unwrap();
        let pattern = format!("{}/*.txt", dir.path().display());
        let files = expand_files(&[pattern.clone(), pattern]).unwrap();
        assert_eq!(files.len(), 2);
        assert!(files[0].ends_with("/a.txt") && files[1].ends_with("/b.txt"));
        assert!(Path::new(&files[0]).is_absolute());
        let e = expand_files(&[format!("{}/*.none", dir.path().display())]).unwrap_err();
        assert!(e.to_string().contains("matches no regular file"));
    }

    #[test]
    fn key_value_flags() {
        assert_eq!(
            parse_key_value("file=/a=b").unwrap(),
            ("file".into(), "/a=b".into())
        );
        assert!(parse_key_value("novalue").is_err());
        assert!(parse_key_value("=x").is_err());
    }
}
