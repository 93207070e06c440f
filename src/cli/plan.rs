//! `agq plan submit|get|list|versions|delete`. `plan submit` reads the JSON form of
//! a Plan that `plan get -o json` prints ([`PlanView`]; proto3 JSON:
//! snake_case or lowerCamel field names, numbers or numeric strings for
//! integers, optionally wrapped as a `SubmitPlanRequest` `{"plan": {...}}`).

use std::{io::Read, path::Path};

use serde::{Deserialize, Deserializer, Serialize};

use super::{
    collect_pages, fetch_each, print_json,
    table::{emit, emit_line, Table},
    time::rfc3339,
    view::{one_line, PlanView},
    CliError, Clients, OutputFormat, PageArgs,
};
use crate::pb;

/// `agq plan ...`
#[derive(Debug, clap::Subcommand)]
pub enum PlanCommand {
    /// Store a Plan from a JSON file (`-` reads stdin).
    Submit {
        /// Store it as the next version when the id exists (jobs already
        /// created keep their version; an unchanged Plan stores nothing).
        #[arg(long)]
        replace: bool,
        /// JSON of the Plan message, e.g. examples/word-frequency.plan.json.
        file: String,
    },
    /// Show one Plan: its latest version, or `--version N`.
    Get {
        /// Plan id.
        plan_id: String,
        /// The version to show (1 is the first); the latest when omitted.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        version: Option<u32>,
    },
    /// List Plans, optionally those whose id matches a glob.
    List(PlanListArgs),
    /// List the versions of one Plan, newest first.
    Versions(PlanVersionsArgs),
    /// Delete a Plan with all its versions and its finished Actions and
    /// jobs (refused while pending, running or failed jobs use it).
    Delete {
        /// Plan id.
        plan_id: String,
    },
}

/// Flags of `agq plan list`.
#[derive(Debug, clap::Args)]
pub struct PlanListArgs {
    /// Glob over plan ids (`*`, `?`, `[a-z]`, `[!a-z]` negation; see
    /// docs/cli.md for the dialect); all plans when omitted.
    pub pattern: Option<String>,
    /// Paging.
    #[command(flatten)]
    pub page: PageArgs,
}

/// Flags of `agq plan versions`.
#[derive(Debug, clap::Args)]
pub struct PlanVersionsArgs {
    /// Plan id.
    pub plan_id: String,
    /// Paging.
    #[command(flatten)]
    pub page: PageArgs,
}

impl From<PlanView> for pb::Plan {
    fn from(p: PlanView) -> Self {
        pb::Plan {
            plan_id: p.plan_id,
            plan_description: p.plan_description,
            tasks: p
                .tasks
                .into_iter()
                .map(|t| pb::Task {
                    task_number: t.task_number,
                    command: t.command,
                    args: t.args,
                    timeout_secs: t.timeout_secs,
                    input_from_task: t.input_from_task,
                    allow_option_values: t.allow_option_values,
                    permanent_exit_codes: t.permanent_exit_codes,
                })
                .collect(),
            require_sandbox: p.require_sandbox,
            // Read-only: the server sets it.
            version: 0,
            worker_selector: p.worker_selector,
            require_verified_tools: p.require_verified_tools,
        }
    }
}

/// A proto3 JSON integer: a number or a string of digits.
#[derive(Deserialize)]
#[serde(untagged)]
enum JsonU32 {
    Num(u32),
    Text(String),
}

impl JsonU32 {
    fn get<E: serde::de::Error>(self) -> Result<u32, E> {
        match self {
            JsonU32::Num(n) => Ok(n),
            JsonU32::Text(s) => s
                .trim()
                .parse()
                .map_err(|_| E::custom(format!("{s:?} is not an unsigned 32-bit integer"))),
        }
    }
}

/// A proto3 JSON `uint32`: a number or a numeric string.
pub(super) fn lenient_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    JsonU32::deserialize(d)?.get()
}

/// An optional proto3 JSON `uint32` (see [`lenient_u32`]).
pub(super) fn lenient_opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    match Option::<JsonU32>::deserialize(d)? {
        None => Ok(None),
        Some(v) => v.get().map(Some),
    }
}

/// Parses a Plan from JSON text: a Plan object, or `{"plan": {...}}`.
///
/// # Errors
///
/// [`CliError::Input`] naming the problem (with line and column when the
/// JSON itself is malformed).
pub fn parse_plan(text: &str, source: &str) -> Result<pb::Plan, CliError> {
    let bad = |e: serde_json::Error| CliError::Input(format!("{source}: not a valid Plan: {e}"));
    let value: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
    let plan: PlanView = match value {
        serde_json::Value::Object(mut m) if m.len() == 1 && m.contains_key("plan") => {
            let inner = m.remove("plan").unwrap_or_default();
            serde_json::from_value(inner).map_err(bad)?
        }
        _ => serde_json::from_str(text).map_err(bad)?,
    };
    Ok(plan.into())
}

/// Reads a file, or stdin for `-`.
///
/// # Errors
///
/// [`CliError::Input`] when it cannot be read.
pub fn read_source(file: &str) -> Result<String, CliError> {
    if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Input(format!("cannot read stdin: {e}")))?;
        Ok(s)
    } else {
        std::fs::read_to_string(Path::new(file))
            .map_err(|e| CliError::Input(format!("cannot read {file}: {e}")))
    }
}

/// One line of `plan list`.
#[derive(Debug, Clone, Serialize)]
pub struct PlanSummary {
    /// Id.
    pub plan_id: String,
    /// Latest version.
    pub version: u32,
    /// Description.
    pub plan_description: String,
    /// Number of tasks.
    pub task_count: usize,
    /// The commands, `cat | tr | sort`.
    pub commands: String,
}

/// One line of `plan versions`.
#[derive(Debug, Clone, Serialize)]
pub struct VersionLine {
    /// The version.
    pub version: u32,
    /// Its description.
    pub plan_description: String,
    /// Number of its tasks.
    pub task_count: u32,
    /// When it was stored (RFC 3339).
    pub created_at: Option<String>,
}

/// A page of a plan's versions.
#[derive(Debug, Clone, Serialize)]
pub struct VersionPage {
    /// The plan.
    pub plan_id: String,
    /// Its versions, newest first.
    pub versions: Vec<VersionLine>,
    /// Token of the next page; empty on the last page.
    pub next_page_token: String,
}

/// A page of plans.
#[derive(Debug, Clone, Serialize)]
pub struct PlanPage {
    /// The plans, ascending by id.
    pub plans: Vec<PlanSummary>,
    /// Token of the next page; empty on the last page.
    pub next_page_token: String,
}

/// Runs one `plan` subcommand.
///
/// # Errors
///
/// See [`super::run`].
pub async fn run(c: &Clients, out: OutputFormat, cmd: PlanCommand) -> Result<(), CliError> {
    match cmd {
        PlanCommand::Submit { replace, file } => {
            let source = if file == "-" { "stdin" } else { file.as_str() };
            let plan = parse_plan(&read_source(&file)?, source)?;
            let resp = c
                .plan
                .clone()
                .submit_plan(pb::SubmitPlanRequest {
                    plan: Some(plan),
                    replace,
                })
                .await?
                .into_inner();
            match out {
                OutputFormat::Json => print_json(&serde_json::json!({
                    "plan_id": resp.plan_id,
                    "version": resp.version,
                    "created": resp.created,
                })),
                OutputFormat::Table if resp.created => emit_line(&format!(
                    "stored plan {} version {}",
                    resp.plan_id, resp.version
                )),
                OutputFormat::Table => emit_line(&format!(
                    "plan {} is unchanged (version {}): nothing stored",
                    resp.plan_id, resp.version
                )),
            }
        }
        PlanCommand::Get { plan_id, version } => {
            let plan = get_plan_version(c, plan_id, version.unwrap_or(0)).await?;
            let view = PlanView::from(plan);
            match out {
                OutputFormat::Json => print_json(&view),
                OutputFormat::Table => emit(&view.table()),
            }
        }
        PlanCommand::List(args) => {
            let (ids, next_page_token) = list_ids(c, &args).await?;
            let plans = fetch_each(ids, |id| {
                let mut client = c.plan.clone();
                async move {
                    let p = client
                        .get_plan(pb::GetPlanRequest {
                            plan_id: id,
                            version: 0,
                        })
                        .await?
                        .into_inner()
                        .plan
                        .unwrap_or_default();
                    Ok(PlanSummary {
                        commands: p
                            .tasks
                            .iter()
                            .map(|t| t.command.as_str())
                            .collect::<Vec<_>>()
                            .join(" | "),
                        task_count: p.tasks.len(),
                        version: p.version,
                        plan_id: p.plan_id,
                        plan_description: p.plan_description,
                    })
                }
            })
            .await?;
            let page = PlanPage {
                plans,
                next_page_token,
            };
            match out {
                OutputFormat::Json => print_json(&page),
                OutputFormat::Table => {
                    let mut t = Table::new(["PLAN", "VERSION", "TASKS", "COMMANDS", "DESCRIPTION"]);
                    for p in &page.plans {
                        t.row([
                            p.plan_id.clone(),
                            p.version.to_string(),
                            p.task_count.to_string(),
                            one_line(&p.commands, 60),
                            one_line(&p.plan_description, 60),
                        ]);
                    }
                    emit(&t.render())?;
                    super::more_hint(&page.next_page_token);
                    Ok(())
                }
            }
        }
        PlanCommand::Versions(args) => {
            let page = list_versions(c, args).await?;
            match out {
                OutputFormat::Json => print_json(&page),
                OutputFormat::Table => {
                    let mut t = Table::new(["VERSION", "TASKS", "CREATED", "DESCRIPTION"]);
                    for v in &page.versions {
                        t.row([
                            v.version.to_string(),
                            v.task_count.to_string(),
                            v.created_at.clone().unwrap_or_else(|| "-".into()),
                            one_line(&v.plan_description, 60),
                        ]);
                    }
                    emit(&t.render())?;
                    super::more_hint(&page.next_page_token);
                    Ok(())
                }
            }
        }
        PlanCommand::Delete { plan_id } => {
            let resp = c
                .plan
                .clone()
                .delete_plan(pb::DeletePlanRequest {
                    plan_id: plan_id.clone(),
                })
                .await?
                .into_inner();
            match out {
                OutputFormat::Json => {
                    print_json(&serde_json::json!({ "plan_id": plan_id, "deleted": resp.deleted }))
                }
                OutputFormat::Table if resp.deleted => {
                    emit_line(&format!("deleted plan {plan_id}"))
                }
                OutputFormat::Table => emit_line(&format!("plan {plan_id} was not deleted")),
            }
        }
    }
}

/// Fetches the latest version of one Plan.
///
/// # Errors
///
/// The server's status (`NOT_FOUND`, `INVALID_ARGUMENT`).
pub async fn get_plan(c: &Clients, plan_id: String) -> Result<pb::Plan, CliError> {
    get_plan_version(c, plan_id, 0).await
}

/// Fetches version `version` of one Plan (0: the latest).
///
/// # Errors
///
/// The server's status (`NOT_FOUND` for an unknown plan or version,
/// `INVALID_ARGUMENT`).
pub async fn get_plan_version(
    c: &Clients,
    plan_id: String,
    version: u32,
) -> Result<pb::Plan, CliError> {
    c.plan
        .clone()
        .get_plan(pb::GetPlanRequest { plan_id, version })
        .await?
        .into_inner()
        .plan
        .ok_or_else(|| CliError::Input("the server returned no plan".into()))
}

/// One page of a plan's versions, or every page with `--all`.
async fn list_versions(c: &Clients, args: PlanVersionsArgs) -> Result<VersionPage, CliError> {
    let mut versions = Vec::new();
    let mut page_token = args.page.page_token.clone().unwrap_or_default();
    let page_size = args
        .page
        .page_size
        .unwrap_or(if args.page.all { 1000 } else { 0 });
    loop {
        let r = c
            .plan
            .clone()
            .list_plan_versions(pb::ListPlanVersionsRequest {
                plan_id: args.plan_id.clone(),
                page_size,
                page_token,
            })
            .await?
            .into_inner();
        versions.extend(r.versions.into_iter().map(|v| VersionLine {
            version: v.version,
            plan_description: v.plan_description,
            task_count: v.task_count,
            created_at: rfc3339(v.created_at.as_ref()),
        }));
        page_token = r.next_page_token;
        if !args.page.all || page_token.is_empty() {
            return Ok(VersionPage {
                plan_id: args.plan_id,
                versions,
                next_page_token: page_token,
            });
        }
    }
}

/// The plan ids of one page, or of every page with `--all`.
async fn list_ids(c: &Clients, args: &PlanListArgs) -> Result<(Vec<String>, String), CliError> {
    let pattern = args.pattern.clone().unwrap_or_default();
    collect_pages(&args.page, |page_size, page_token| {
        let mut client = c.plan.clone();
        let pattern = pattern.clone();
        async move {
            let r = client
                .list_plans(pb::ListPlansRequest {
                    pattern,
                    page_size,
                    page_token,
                })
                .await?
                .into_inner();
            Ok((r.plan_ids, r.next_page_token))
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_snake_and_camel_case() {
        let snake = r#"{"plan_id":"p","plan_description":"d","tasks":[
            {"task_number":1,"command":"cat","args":["{{file}}"],"timeout_secs":60},
            {"task_number":2,"command":"sort","timeout_secs":"60","input_from_task":1}]}"#;
        let camel = r#"{"plan":{"planId":"p","planDescription":"d","tasks":[
            {"taskNumber":1,"command":"cat","args":["{{file}}"],"timeoutSecs":60,"inputFromTask":null},
            {"taskNumber":"2","command":"sort","timeoutSecs":60,"inputFromTask":"1"}]}}"#;
        let a = parse_plan(snake, "a").unwrap();
        let b = parse_plan(camel, "b").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.tasks[1].input_from_task, Some(1));
        assert_eq!(a.tasks[0].input_from_task, None);
        assert_eq!(a.tasks[1].timeout_secs, 60);
    }

    /// What `plan get -o json` prints, `plan submit` reads back as the
    /// same Plan (one type serves both).
    #[test]
    fn a_printed_plan_reads_back_as_the_same_plan() {
        let p = parse_plan(
            r#"{"plan_id":"p","plan_description":"d","tasks":[
                {"task_number":1,"command":"cat","args":["{{file}}"],"timeout_secs":60},
                {"task_number":2,"command":"sort","timeout_secs":5,"input_from_task":1}]}"#,
            "a",
        )
        .unwrap();
        let printed = serde_json::to_string(&PlanView::from(p.clone())).unwrap();
        assert_eq!(parse_plan(&printed, "printed").unwrap(), p);
    }

    #[test]
    fn rejects_unknown_fields_and_bad_numbers() {
        let e = parse_plan(r#"{"plan_id":"p","taks":[]}"#, "f.json").unwrap_err();
        assert!(e.to_string().contains("unknown field `taks`"), "{e}");
        let e = parse_plan(
            r#"{"plan_id":"p","tasks":[{"task_number":"x","command":"cat"}]}"#,
            "f.json",
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("f.json: not a valid Plan"), "{e}");
        assert!(parse_plan("{", "f.json").is_err());
    }
}
