//! Input validation shared by every engine: ids, plans, plan patterns,
//! actions, worker registrations and reports. Every check returns
//! [`Error::InvalidArgument`] (or `ResourceExhausted` for a report over
//! the size cap) with a message naming the rule; engines call these before
//! they change anything.

use std::collections::HashMap;

use super::{
    engine::{ActionQuery, ActionRequest},
    model::{
        AgenticUnit, JobReport, JobStatus, Plan, Registration, Schedule, Scheduling,
        VerificationAnswer,
    },
    page::MAX_PAGE,
    selector::{Selector, MAX_SELECTOR_BYTES},
};
use crate::{
    config::EngineConfig,
    error::{Error, Result},
};

/// Most tasks in one plan.
pub const MAX_TASKS: usize = 100;
/// Most `permanent_exit_codes` of one task.
pub const MAX_PERMANENT_EXIT_CODES: usize = 32;
/// Most reports in one BatchUpdateJobs call.
pub const MAX_BATCH_REPORTS: usize = 1024;
/// Largest `timeout_secs` of a task (one day).
pub const MAX_TASK_TIMEOUT_SECS: u32 = 86_400;
/// Most arguments of one task.
pub const MAX_ARGS: usize = 256;
/// Largest single argument, in bytes.
pub const MAX_ARG_BYTES: usize = 64 * 1024;
/// Largest sum of the arguments of a plan's tasks, in bytes: a plan goes
/// whole into every lease of its jobs, beside the job's input (at most
/// [`MAX_INPUT_KEYS`] values of [`MAX_INPUT_VALUE_BYTES`]), and the lease
/// must fit the server's 16 MiB message limit.
pub const MAX_PLAN_ARGS_BYTES: usize = 4 * 1024 * 1024;
/// Most bytes of the previous attempt's error a lease carries
/// ([`crate::core::model::Job::error`]): the rest is cut, so the lease
/// fits a message whatever `--max-report-bytes` allowed the report.
pub const MAX_LEASE_ERROR_BYTES: usize = 64 * 1024;
/// Largest size of a schedule's inputs, in bytes as encoded ([`input_bytes`]:
/// keys, values and their framing): schedules are listed a page at a
/// time, whole.
pub const MAX_SCHEDULE_INPUT_BYTES: usize = 1024 * 1024;
/// Largest plan description, in bytes.
pub const MAX_DESCRIPTION_BYTES: usize = 4096;
/// Most values in one action input.
pub const MAX_INPUT_KEYS: usize = 64;
/// Largest input value, in bytes.
pub const MAX_INPUT_VALUE_BYTES: usize = 64 * 1024;
/// Most tools one worker may advertise.
pub const MAX_TOOLS: usize = 1024;
/// Most leases one worker may hold.
pub const MAX_CONCURRENT_JOBS: u32 = 1024;
/// Most attempts per job.
pub const MAX_ATTEMPTS: u32 = 100;
/// Most agentic units one worker may advertise.
pub const MAX_UNITS: usize = 256;
/// Most arguments of a verification challenge.
pub const MAX_CHALLENGE_ARGS: usize = 16;

/// Checks a verification challenge (VerifyWorker): a command name (a tool
/// or agentic unit) and at most [`MAX_CHALLENGE_ARGS`] arguments of at
/// most 256 bytes without NUL.
///
/// Errors: `InvalidArgument` naming the rule.
pub fn challenge(command: &str, args: &[String]) -> Result<()> {
    command_name(command).map_err(|e| Error::invalid(format!("tool: {e}")))?;
    if args.len() > MAX_CHALLENGE_ARGS {
        return Err(Error::invalid(format!(
            "at most {MAX_CHALLENGE_ARGS} args, got {}",
            args.len()
        )));
    }
    for a in args {
        if a.len() > 256 || a.contains('\0') {
            return Err(Error::invalid(
                "each arg is at most 256 bytes and has no NUL byte",
            ));
        }
    }
    Ok(())
}

/// Highest job priority; the lowest is its negation.
pub const MAX_PRIORITY: i32 = 1000;
/// Largest `max_running` of a concurrency key.
pub const MAX_RUNNING_LIMIT: u32 = 1_000_000;

/// Checks a job priority: -[`MAX_PRIORITY`]..=[`MAX_PRIORITY`].
///
/// Errors: `InvalidArgument`.
pub fn priority(p: i32) -> Result<()> {
    if !(-MAX_PRIORITY..=MAX_PRIORITY).contains(&p) {
        return Err(Error::invalid(format!(
            "priority must be in -{MAX_PRIORITY}..={MAX_PRIORITY}, got {p}"
        )));
    }
    Ok(())
}

/// Parses a worker selector ([`super::selector`]) and returns its
/// canonical text (empty for the empty selector), which is what the
/// engines store and parse again to schedule: like the text as written,
/// it must be at most [`MAX_SELECTOR_BYTES`] (requirements and set values
/// are joined by `, ` in it, so it can be longer than the text).
///
/// Errors: `InvalidArgument` naming what is malformed, or the canonical
/// text's length.
pub fn worker_selector(text: &str) -> Result<String> {
    let canonical = Selector::parse(text)?.to_string();
    if canonical.len() > MAX_SELECTOR_BYTES {
        return Err(Error::invalid(format!(
            "worker_selector is at most {MAX_SELECTOR_BYTES} bytes in canonical form \
             (requirements and set values joined by \", \"), got {} bytes",
            canonical.len()
        )));
    }
    Ok(canonical)
}

/// Checks an action's fleet-scheduling settings and returns them with
/// the selector in canonical form: the priority range, the selector, a
/// concurrency key `[A-Za-z0-9._:-]{1,128}` with `max_running` in
/// 1..=[`MAX_RUNNING_LIMIT`], or neither.
///
/// Errors: `InvalidArgument` naming the field.
pub fn scheduling(s: Scheduling) -> Result<Scheduling> {
    priority(s.priority)?;
    let worker_selector = worker_selector(&s.worker_selector)?;
    if s.concurrency_key.is_empty() {
        if s.max_running != 0 {
            return Err(Error::invalid(
                "max_running is the limit of a concurrency_key; set a concurrency_key too",
            ));
        }
    } else {
        if s.concurrency_key.len() > 128 || !id_chars(&s.concurrency_key, &['.', '_', ':', '-']) {
            return Err(Error::invalid(format!(
                "concurrency_key must match [A-Za-z0-9._:-]{{1,128}}, got {:?}",
                truncate(&s.concurrency_key, 140)
            )));
        }
        if s.max_running == 0 || s.max_running > MAX_RUNNING_LIMIT {
            return Err(Error::invalid(format!(
                "max_running must be in 1..={MAX_RUNNING_LIMIT} with a concurrency_key, got {}",
                s.max_running
            )));
        }
    }
    Ok(Scheduling {
        worker_selector,
        ..s
    })
}

fn id_chars(s: &str, extra: &[char]) -> bool {
    s.chars()
        .all(|c| c.is_ascii_alphanumeric() || extra.contains(&c))
}

/// Refuses client-written text with a NUL byte, which neither store can
/// keep alike (PostgreSQL `text` and `jsonb` cannot hold one). `what`
/// names the field in the message.
///
/// Errors: `InvalidArgument`.
fn no_nul(what: &str, s: &str) -> Result<()> {
    if s.contains('\0') {
        return Err(Error::invalid(format!(
            "{what} must not contain a NUL byte"
        )));
    }
    Ok(())
}

/// Refuses an opaque identifier (a lease or challenge id) with a NUL or
/// another control character; `what` names the field in the message.
///
/// Errors: `InvalidArgument`.
fn no_control(what: &str, s: &str) -> Result<()> {
    if s.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{what} must not contain a NUL byte or control characters, got {:?}",
            truncate(s, 64)
        )));
    }
    Ok(())
}

/// Reported free text as stored: each NUL byte (which PostgreSQL `text`
/// and `jsonb` cannot hold) replaced by U+FFFD, on every store alike.
/// Reports are never refused for their text: a worker's outcome must land.
pub fn reported_text(s: &mut String) {
    if s.contains('\0') {
        *s = s.replace('\0', "\u{FFFD}");
    }
}

/// Checks the filters of an action listing: the plan id when given, and
/// that a time range given at both ends is not empty. (Page size and token
/// are checked by [`super::page`].)
///
/// Errors: `InvalidArgument` naming the field.
pub fn action_query(q: &ActionQuery) -> Result<()> {
    if let Some(p) = &q.plan_id {
        object_id("plan_id", p)?;
    }
    created_range(q.created_after_ms, q.created_before_ms)
}

/// Checks a creation-time filter (ListActions, SearchJobs): `after`
/// (inclusive) must be before `before` (exclusive) when both are set; ms.
///
/// Errors: `InvalidArgument` for an empty range.
pub fn created_range(after_ms: Option<i64>, before_ms: Option<i64>) -> Result<()> {
    if let (Some(a), Some(b)) = (after_ms, before_ms) {
        if a >= b {
            return Err(Error::invalid(
                "created_after must be before created_before (the range is empty)",
            ));
        }
    }
    Ok(())
}

/// Checks a progress report's numbers: `current_task` (1-based; 0 before
/// the first task) at most [`MAX_TASKS`], `progress_percent` at most 100.
///
/// Errors: `InvalidArgument` naming the field.
pub fn progress(current_task: u32, progress_percent: u32) -> Result<()> {
    if current_task as usize > MAX_TASKS {
        return Err(Error::invalid(format!(
            "current_task must be in 0..={MAX_TASKS}"
        )));
    }
    if progress_percent > 100 {
        return Err(Error::invalid("progress_percent must be in 0..=100"));
    }
    Ok(())
}

/// The highest task number a worker's report names: its `current_task`,
/// its task results' `task_number`s and how many results it holds.
pub fn reported_tasks(req: &JobReport) -> u32 {
    let results = req.task_results.iter().map(|r| r.task_number).max();
    let count = u32::try_from(req.task_results.len()).unwrap_or(u32::MAX);
    req.current_task.max(results.unwrap_or(0)).max(count)
}

/// Checks a report against the plan version its job runs, of
/// `task_count` tasks: `current_task` at most `task_count`, at most
/// `task_count` task results, each numbering a task of the plan
/// (1..=`task_count`).
///
/// Errors: `InvalidArgument` naming the field.
pub fn report_in_plan(req: &JobReport, task_count: usize) -> Result<()> {
    let n = u32::try_from(task_count).unwrap_or(u32::MAX);
    if req.current_task > n {
        return Err(Error::invalid(format!(
            "current_task {} is past the plan's {n} tasks",
            req.current_task
        )));
    }
    if req.task_results.len() > task_count {
        return Err(Error::invalid(format!(
            "{} task results for a plan of {n} tasks",
            req.task_results.len()
        )));
    }
    if let Some((i, r)) = req
        .task_results
        .iter()
        .enumerate()
        .find(|(_, r)| r.task_number == 0 || r.task_number > n)
    {
        return Err(Error::invalid(format!(
            "task_results[{i}].task_number is {}; the plan's tasks are 1..={n}",
            r.task_number
        )));
    }
    Ok(())
}

/// Checks the status filter of a RetryAction: failed, dead or none (both).
///
/// Errors: `InvalidArgument` for any other status.
pub fn retry_filter(status: Option<JobStatus>) -> Result<()> {
    match status {
        None | Some(JobStatus::Failed | JobStatus::Dead) => Ok(()),
        Some(s) => Err(Error::invalid(format!(
            "status must be JOB_STATUS_FAILED, JOB_STATUS_DEAD or unspecified (both), not {}",
            s.name()
        ))),
    }
}

/// Checks an id of plans, actions and jobs: `[A-Za-z0-9._-]{1,128}`, not
/// "." or ".." (path-like ids are refused). `what` names the field in the
/// message.
pub fn object_id(what: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > 128 || !id_chars(id, &['.', '_', '-']) {
        return Err(Error::invalid(format!(
            "{what} must match [A-Za-z0-9._-]{{1,128}}, got {:?}",
            truncate(id, 64)
        )));
    }
    if id == "." || id == ".." {
        return Err(Error::invalid(format!(
            "{what} must not be \".\" or \"..\" (path-like ids are refused)"
        )));
    }
    Ok(())
}

/// Longest schedule id, in bytes: a tick's action id appends
/// `-<unix seconds>` to it and must stay within an object id's 128.
pub const MAX_SCHEDULE_ID_BYTES: usize = 100;

/// Checks a schedule id, `[A-Za-z0-9._-]{1,100}`, not "." or "..": at
/// create and in every call that names a schedule, so an id no schedule
/// can have is refused alike everywhere.
///
/// Errors: `InvalidArgument` giving the rule.
pub fn schedule_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_SCHEDULE_ID_BYTES || !id_chars(id, &['.', '_', '-']) {
        return Err(Error::invalid(format!(
            "schedule_id must match [A-Za-z0-9._-]{{1,{MAX_SCHEDULE_ID_BYTES}}}, got {:?} ({} bytes)",
            truncate(id, 64),
            id.len()
        )));
    }
    object_id("schedule_id", id)
}

/// The schedule an action id of the form `<schedule_id>-<unix seconds>`
/// (10 digits or more, no leading zero) names, the form of a schedule's
/// tick: a client may not submit such an id while that schedule exists,
/// or it could take a tick's id ahead of it and so suppress the tick.
pub fn tick_schedule(action_id: &str) -> Option<&str> {
    let (schedule_id, secs) = action_id.rsplit_once('-')?;
    (!schedule_id.is_empty()
        && secs.len() >= 10
        && !secs.starts_with('0')
        && secs.bytes().all(|b| b.is_ascii_digit()))
    .then_some(schedule_id)
}

/// Among `action_ids` (ids that start with `<schedule_id>-`), the first
/// that a tick of schedule `schedule_id` at or after `now_ms` would take
/// ([`tick_schedule`]): a schedule is refused while one exists, or that
/// tick would find its id taken and never be submitted.
pub fn taken_tick_id<'a>(
    schedule_id: &str,
    now_ms: i64,
    action_ids: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    action_ids.into_iter().find(|id| {
        tick_schedule(id) == Some(schedule_id)
            && id
                .rsplit_once('-')
                .and_then(|(_, secs)| secs.parse::<i64>().ok())
                .is_some_and(|secs| secs.saturating_mul(1000) >= now_ms - 999)
    })
}

/// The refusal of a schedule whose future tick's action id `action_id`
/// an existing action already has ([`taken_tick_id`]).
pub fn tick_id_taken(schedule_id: &str, action_id: &str) -> Error {
    Error::precondition(format!(
        "action {action_id} exists and has the id of a future tick of schedule          {schedule_id:?} (<schedule_id>-<unix seconds>), which would then never be submitted:          delete that action or choose another schedule id"
    ))
}

/// The refusal of a client's action id reserved for the ticks of
/// schedule `schedule_id` (see [`tick_schedule`]).
pub fn reserved_for_ticks(action_id: &str, schedule_id: &str) -> Error {
    Error::invalid(format!(
        "action_id {action_id:?} is reserved for the ticks of schedule {schedule_id:?} \
         (<schedule_id>-<unix seconds>): choose another"
    ))
}

/// Bytes a task result counts for besides its text: its numbers, flags
/// and framing.
const TASK_RESULT_FIXED_BYTES: usize = 32;

/// Checks the size of a worker report: its task results (their text plus
/// [`TASK_RESULT_FIXED_BYTES`] each) and the error text together at most
/// `max` bytes.
///
/// Errors: [`Error::ResourceExhausted`] naming the size and the limit.
pub fn report_size(req: &JobReport, max: usize) -> Result<()> {
    let size: usize = req
        .task_results
        .iter()
        .map(|r| r.command.len() + r.stdout.len() + r.stderr.len() + TASK_RESULT_FIXED_BYTES)
        .sum::<usize>()
        + req.error.len();
    if size > max {
        return Err(Error::ResourceExhausted(format!(
            "the report of job {} holds {size} bytes of task results and error; this server stores at most {max} (--max-report-bytes): send it again with outputs truncated",
            truncate(&req.job_id, 64)
        )));
    }
    Ok(())
}

/// Checks a worker id: `[A-Za-z0-9_-]{1,64}`.
pub fn worker_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > 64 || !id_chars(id, &['_', '-']) {
        return Err(Error::invalid(format!(
            "worker_id must match [A-Za-z0-9_-]{{1,64}}, got {:?}",
            truncate(id, 80)
        )));
    }
    Ok(())
}

/// Checks a bare executable name: `[A-Za-z0-9._+-]{1,128}`, not "." or
/// "..", not starting with "-". This excludes "/", whitespace, NUL and
/// every shell metacharacter.
pub fn command_name(cmd: &str) -> Result<()> {
    let ok = !cmd.is_empty()
        && cmd.len() <= 128
        && cmd != "."
        && cmd != ".."
        && !cmd.starts_with('-')
        && id_chars(cmd, &['.', '_', '-', '+']);
    if !ok {
        return Err(Error::invalid(format!(
            "command must be a bare executable name ([A-Za-z0-9._+-], no '/', whitespace or shell syntax), got {:?}",
            truncate(cmd, 64)
        )));
    }
    Ok(())
}

/// The longest prefix of `s` of at most `max` bytes that ends on a
/// character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The bytes `inputs` take in a message (a `repeated ActionInput`, each a
/// map of strings), framing included: exact, or a little more where the
/// encoding leaves an empty key or value out, so a page whose budget
/// counts by it stays within the budget on the wire.
pub fn input_bytes(inputs: &[HashMap<String, String>]) -> usize {
    use prost::encoding::encoded_len_varint;
    // A length-delimited field of one-byte tag.
    let field = |len: usize| 1 + encoded_len_varint(len as u64) + len;
    inputs
        .iter()
        .map(|i| {
            field(
                i.iter()
                    .map(|(k, v)| field(field(k.len()) + field(v.len())))
                    .sum(),
            )
        })
        .sum()
}

/// Validates a plan by every rule of the PLAN.SUBMIT command: id syntax,
/// description size, 1..=100 tasks numbered 1..=n, bare commands, bounded
/// args, `timeout_secs` in 1..=86400, `input_from_task` naming an earlier task.
pub fn plan(plan: &Plan) -> Result<()> {
    object_id("plan_id", &plan.plan_id)?;
    if plan.plan_description.len() > MAX_DESCRIPTION_BYTES {
        return Err(Error::invalid(format!(
            "plan_description is {} bytes; at most {MAX_DESCRIPTION_BYTES} allowed",
            plan.plan_description.len()
        )));
    }
    no_nul("plan_description", &plan.plan_description)?;
    Selector::parse(&plan.worker_selector)?;
    if plan.tasks.is_empty() {
        return Err(Error::invalid("a plan needs at least one task"));
    }
    if plan.tasks.len() > MAX_TASKS {
        return Err(Error::invalid(format!(
            "a plan has at most {MAX_TASKS} tasks, got {}",
            plan.tasks.len()
        )));
    }
    for (i, task) in plan.tasks.iter().enumerate() {
        let n = i as u32 + 1;
        if task.task_number != n {
            return Err(Error::invalid(format!(
                "task_number must be 1-based and contiguous: task at position {n} has task_number {}",
                task.task_number
            )));
        }
        command_name(&task.command).map_err(|e| Error::invalid(format!("task {n}: {e}")))?;
        if task.args.len() > MAX_ARGS {
            return Err(Error::invalid(format!(
                "task {n}: at most {MAX_ARGS} args, got {}",
                task.args.len()
            )));
        }
        for (j, arg) in task.args.iter().enumerate() {
            if arg.len() > MAX_ARG_BYTES {
                return Err(Error::invalid(format!(
                    "task {n}: arg {j} is {} bytes; at most {MAX_ARG_BYTES} allowed",
                    arg.len()
                )));
            }
            if arg.contains('\0') {
                return Err(Error::invalid(format!(
                    "task {n}: arg {j} contains a NUL byte"
                )));
            }
        }
        if task.timeout_secs == 0 || task.timeout_secs > MAX_TASK_TIMEOUT_SECS {
            return Err(Error::invalid(format!(
                "task {n}: timeout_secs must be in 1..={MAX_TASK_TIMEOUT_SECS}, got {}",
                task.timeout_secs
            )));
        }
        if task.permanent_exit_codes.len() > MAX_PERMANENT_EXIT_CODES {
            return Err(Error::invalid(format!(
                "task {n}: at most {MAX_PERMANENT_EXIT_CODES} permanent_exit_codes, got {}",
                task.permanent_exit_codes.len()
            )));
        }
        for (j, code) in task.permanent_exit_codes.iter().enumerate() {
            if !(1..=255).contains(code) {
                return Err(Error::invalid(format!(
                    "task {n}: permanent_exit_codes must be in 1..=255 (0 is success), got {code}"
                )));
            }
            if task.permanent_exit_codes[..j].contains(code) {
                return Err(Error::invalid(format!(
                    "task {n}: permanent_exit_codes lists {code} twice"
                )));
            }
        }
        if let Some(from) = task.input_from_task {
            if from == 0 || from >= n {
                return Err(Error::invalid(format!(
                    "task {n}: input_from_task must name an earlier task (1..={}), got {from}",
                    n - 1
                )));
            }
        }
    }
    let args_bytes: usize = plan
        .tasks
        .iter()
        .flat_map(|t| &t.args)
        .map(String::len)
        .sum();
    if args_bytes > MAX_PLAN_ARGS_BYTES {
        return Err(Error::invalid(format!(
            "the tasks' args are {args_bytes} bytes in all; at most {MAX_PLAN_ARGS_BYTES} \
             allowed (the plan goes into every lease of its jobs)"
        )));
    }
    Ok(())
}

/// Checks that a run of `plan` within its tasks' timeouts fits a whole job
/// attempt: no task's timeout, and not their sum (the tasks run one after
/// another), is longer than `job_timeout`. A plan past it could have its
/// lease expire during a run that breaks no task's timeout, and such
/// expiries fail the attempt and count towards the worker's quarantine
/// instead of ending in a task's own, clearer, timeout.
///
/// Errors: `InvalidArgument` naming the task and its timeout, or the sum,
/// and `job_timeout`.
pub fn task_timeouts(plan: &Plan, job_timeout: std::time::Duration) -> Result<()> {
    for t in &plan.tasks {
        if u64::from(t.timeout_secs) > job_timeout.as_secs() {
            return Err(Error::invalid(format!(
                "task {}: timeout_secs {} is longer than the server's job timeout ({} s, \
                 --job-timeout-secs): the lease would expire first",
                t.task_number,
                t.timeout_secs,
                job_timeout.as_secs()
            )));
        }
    }
    let total: u64 = plan.tasks.iter().map(|t| u64::from(t.timeout_secs)).sum();
    if total > job_timeout.as_secs() {
        return Err(Error::invalid(format!(
            "the tasks' timeout_secs add up to {total} s (they run one after another), longer \
             than the server's job timeout ({} s, --job-timeout-secs): a run within them could \
             outlive its lease; lower them or raise --job-timeout-secs",
            job_timeout.as_secs()
        )));
    }
    Ok(())
}

/// The distinct tools (commands) a plan needs, sorted.
pub fn plan_tools(plan: &Plan) -> Vec<String> {
    let mut tools: Vec<String> = plan.tasks.iter().map(|t| t.command.clone()).collect();
    tools.sort();
    tools.dedup();
    tools
}

/// Checks one action input: at most 64 values, keys `[A-Za-z0-9._-]{1,128}`,
/// values at most 64 KiB without NUL bytes. `index` names the input.
pub fn action_input(index: usize, values: &HashMap<String, String>) -> Result<()> {
    if values.len() > MAX_INPUT_KEYS {
        return Err(Error::invalid(format!(
            "inputs[{index}] has {} values; at most {MAX_INPUT_KEYS} allowed",
            values.len()
        )));
    }
    for (k, v) in values {
        if k.is_empty() || k.len() > 128 || !id_chars(k, &['.', '_', '-']) {
            return Err(Error::invalid(format!(
                "inputs[{index}]: key {:?} must match [A-Za-z0-9._-]{{1,128}}",
                truncate(k, 64)
            )));
        }
        if v.len() > MAX_INPUT_VALUE_BYTES {
            return Err(Error::invalid(format!(
                "inputs[{index}].{k} is {} bytes; at most {MAX_INPUT_VALUE_BYTES} allowed",
                v.len()
            )));
        }
        if v.contains('\0') {
            return Err(Error::invalid(format!(
                "inputs[{index}].{k} contains a NUL byte"
            )));
        }
    }
    Ok(())
}

fn short_text(what: &str, s: &str, min: usize, max: usize) -> Result<()> {
    if s.len() < min || s.len() > max || s.chars().any(|c| !c.is_ascii_graphic() && c != ' ') {
        return Err(Error::invalid(format!(
            "{what} must be {min}..={max} bytes of printable ASCII, got {:?}",
            truncate(s, 64)
        )));
    }
    Ok(())
}

/// Validates a registration (the WORKER.REGISTER command) and returns it
/// with defaults applied (max_concurrent_jobs 0 → 1, tools and unit names
/// sorted and deduplicated).
///
/// Errors: `InvalidArgument` for a field out of its rules, a name both a
/// tool and an agentic unit, or two descriptions of one agentic unit.
pub fn registration(mut req: Registration) -> Result<Registration> {
    worker_id(&req.worker_id)?;
    short_text("hostname", &req.hostname, 1, 255)?;
    short_text("platform", &req.platform, 0, 64)?;
    short_text("agw_version", &req.agw_version, 1, 64)?;
    if req.instance_id.len() > 64 || !id_chars(&req.instance_id, &['_', '-']) {
        return Err(Error::invalid(format!(
            "instance_id must match [A-Za-z0-9_-]{{0,64}}, got {:?}",
            truncate(&req.instance_id, 80)
        )));
    }
    if req.max_concurrent_jobs == 0 {
        req.max_concurrent_jobs = 1;
    }
    if req.max_concurrent_jobs > MAX_CONCURRENT_JOBS {
        return Err(Error::invalid(format!(
            "max_concurrent_jobs must be in 1..={MAX_CONCURRENT_JOBS}, got {}",
            req.max_concurrent_jobs
        )));
    }
    let caps = &mut req.capabilities;
    if caps.tools.len() > MAX_TOOLS || caps.agentic_units.len() > MAX_TOOLS {
        return Err(Error::invalid(format!(
            "at most {MAX_TOOLS} tools and agentic units"
        )));
    }
    for tool in &caps.tools {
        command_name(tool).map_err(|e| Error::invalid(format!("capabilities.tools: {e}")))?;
    }
    if caps.units.len() > MAX_UNITS {
        return Err(Error::invalid(format!("at most {MAX_UNITS} agentic units")));
    }
    // Two descriptions of one unit: which one runs is not the server's
    // guess to make.
    let mut described: Vec<&str> = caps.units.iter().map(|u| u.name.as_str()).collect();
    described.sort_unstable();
    if let Some(w) = described.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(format!(
            "capabilities.units: agentic unit {:?} is described twice",
            truncate(w[0], 64)
        )));
    }
    // A name in agentic_units without its description is a unit all the same.
    for name in std::mem::take(&mut caps.agentic_units) {
        if !caps.units.iter().any(|u| u.name == name) {
            caps.units.push(AgenticUnit {
                name,
                ..Default::default()
            });
        }
    }
    if caps.units.len() > MAX_UNITS {
        return Err(Error::invalid(format!("at most {MAX_UNITS} agentic units")));
    }
    for unit in &caps.units {
        command_name(&unit.name).map_err(|e| Error::invalid(format!("capabilities.units: {e}")))?;
        short_text("agentic unit version", &unit.version, 0, 64)?;
        if unit.description.len() > MAX_DESCRIPTION_BYTES {
            return Err(Error::invalid(format!(
                "agentic unit {}: description is at most {MAX_DESCRIPTION_BYTES} bytes",
                unit.name
            )));
        }
        no_nul(
            &format!("agentic unit {}: description", unit.name),
            &unit.description,
        )?;
        if unit.inputs.len() > 64 {
            return Err(Error::invalid(format!(
                "agentic unit {}: at most 64 inputs",
                unit.name
            )));
        }
        for input in &unit.inputs {
            short_text("agentic unit input name", &input.name, 1, 128)?;
            if input.description.len() > 1024 {
                return Err(Error::invalid(format!(
                    "agentic unit {}: input description is at most 1024 bytes",
                    unit.name
                )));
            }
            no_nul(
                &format!("agentic unit {}: input description", unit.name),
                &input.description,
            )?;
        }
        if caps.tools.contains(&unit.name) {
            return Err(Error::invalid(format!(
                "{:?} is both a tool and an agentic unit; a task's command must name one",
                unit.name
            )));
        }
    }
    caps.units.sort_by(|a, b| a.name.cmp(&b.name));
    caps.units.dedup_by(|a, b| a.name == b.name);
    caps.agentic_units = caps.units.iter().map(|u| u.name.clone()).collect();
    caps.tools.sort();
    caps.tools.dedup();
    if req.tags.len() > 64 {
        return Err(Error::invalid("at most 64 tags"));
    }
    for (k, v) in &req.tags {
        short_text("tag key", k, 1, 128)?;
        short_text("tag value", v, 0, 256)?;
    }
    Ok(req)
}

/// A glob over plan ids (the PLAN.LIST pattern): at most 256 bytes, no
/// NUL, valid glob syntax; `None` for the empty pattern (match all). One
/// dialect: the pattern that validates here is the one the engines match.
pub fn plan_pattern(pattern: &str) -> Result<Option<glob::Pattern>> {
    if pattern.len() > 256 || pattern.contains('\0') {
        return Err(Error::invalid(
            "pattern must be at most 256 bytes without NUL",
        ));
    }
    if pattern.is_empty() {
        return Ok(None);
    }
    glob::Pattern::new(pattern)
        .map(Some)
        .map_err(|e| Error::invalid(format!("bad glob pattern: {e}")))
}

/// A validated [`ActionRequest`]: the id made when none was given, the
/// attempts default applied.
#[derive(Debug, Clone)]
pub struct ValidAction {
    /// The action's id.
    pub action_id: String,
    /// Its plan.
    pub plan_id: String,
    /// One per job.
    pub inputs: Vec<HashMap<String, String>>,
    /// Scheduled start, ms.
    pub run_at_ms: Option<i64>,
    /// Attempts per job, 1..=[`MAX_ATTEMPTS`].
    pub max_attempts: u32,
    /// The submission's W3C `traceparent`, when well-formed.
    pub traceparent: Option<String>,
    /// Fleet scheduling settings, checked by [`scheduling`]; an empty
    /// selector is still to be replaced by the plan's default.
    pub scheduling: Scheduling,
}

/// Validates a SubmitAction (the ACTION.SUBMIT command) at `now_ms`: ids,
/// 1..=`max_inputs_per_action` inputs each by [`action_input`],
/// `max_attempts` in 0..=[`MAX_ATTEMPTS`] (0: 3), `run_at` no further
/// ahead than `max_run_at_ahead`, the scheduling settings by
/// [`scheduling`]. An empty action id gets a new UUIDv7.
pub fn action(req: ActionRequest, cfg: &EngineConfig, now_ms: i64) -> Result<ValidAction> {
    object_id("plan_id", &req.plan_id)?;
    let action_id = if req.action_id.is_empty() {
        uuid::Uuid::now_v7().to_string()
    } else {
        object_id("action_id", &req.action_id)?;
        req.action_id
    };
    if req.inputs.is_empty() {
        return Err(Error::invalid("an action needs at least one input"));
    }
    let max = cfg.max_inputs_per_action;
    if req.inputs.len() > max {
        return Err(Error::invalid(format!(
            "an action has at most {max} inputs (max_inputs_per_action), got {}",
            req.inputs.len()
        )));
    }
    for (i, input) in req.inputs.iter().enumerate() {
        action_input(i, input)?;
    }
    let max_attempts = match req.max_attempts {
        0 => 3,
        n if n <= MAX_ATTEMPTS => n,
        n => {
            return Err(Error::invalid(format!(
                "max_attempts must be in 1..={MAX_ATTEMPTS}, got {n}"
            )))
        }
    };
    if let Some(ms) = req.run_at_ms {
        let ahead = i64::try_from(cfg.max_run_at_ahead.as_millis()).unwrap_or(i64::MAX);
        if ms > now_ms.saturating_add(ahead) {
            return Err(Error::invalid(format!(
                "run_at is more than {} s ahead (--max-run-at-ahead-secs); schedule it nearer",
                cfg.max_run_at_ahead.as_secs()
            )));
        }
    }
    let scheduling = scheduling(Scheduling {
        priority: req.priority,
        worker_selector: req.worker_selector,
        concurrency_key: req.concurrency_key,
        max_running: req.max_running,
    })?;
    Ok(ValidAction {
        action_id,
        plan_id: req.plan_id,
        inputs: req.inputs,
        run_at_ms: req.run_at_ms,
        max_attempts,
        traceparent: req.traceparent.filter(|t| traceparent(t)),
        scheduling,
    })
}

/// True for a well-formed W3C `traceparent` value: `version-traceid-spanid-flags`
/// in lowercase hex (2, 32, 16 and 2 digits), version not `ff`, ids not all
/// zeros. Only the 55 bytes of version 00 are taken; tracing never fails a
/// request, so callers drop what this refuses.
pub fn traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    matches!(parts.as_slice(), [v, t, s, f]
        if hex(v, 2) && *v != "ff" && hex(t, 32) && nonzero(t) && hex(s, 16) && nonzero(s) && hex(f, 2))
}

/// Validates a worker's report (the JOB.UPDATE command) before the lease
/// is checked and normalises its text: ids, a lease id of 1..=64 bytes
/// without control characters, at most [`MAX_TASKS`] task results, and
/// the size cap ([`report_size`], on the text as sent). Then each NUL of
/// what the worker reports about the tasks (their command, stdout and
/// stderr, and the error text) becomes U+FFFD ([`reported_text`]): never
/// refused, so a task that prints NUL bytes still ends. The status and
/// progress are checked after fencing, by the engine.
///
/// Errors: `InvalidArgument`, `ResourceExhausted` (over `max_bytes`).
pub fn report(req: &mut JobReport, max_bytes: usize) -> Result<()> {
    object_id("job_id", &req.job_id)?;
    worker_id(&req.worker_id)?;
    if req.lease_id.is_empty() || req.lease_id.len() > 64 {
        return Err(Error::invalid("lease_id is required (at most 64 bytes)"));
    }
    no_control("lease_id", &req.lease_id)?;
    if req.task_results.len() > MAX_TASKS {
        return Err(Error::invalid(format!("at most {MAX_TASKS} task results")));
    }
    report_size(req, max_bytes)?;
    for r in &mut req.task_results {
        reported_text(&mut r.command);
        reported_text(&mut r.stdout);
        reported_text(&mut r.stderr);
    }
    reported_text(&mut req.error);
    Ok(())
}

/// Validates a worker's answer to a verification challenge and
/// normalises its text: a challenge id without control characters (an
/// answer to no pending challenge is then ignored by the engine), and
/// each NUL of its output and error replaced by U+FFFD
/// ([`reported_text`]), as in [`report`].
///
/// Errors: `InvalidArgument` naming `verification.challenge_id`.
pub fn verification_answer(mut a: VerificationAnswer) -> Result<VerificationAnswer> {
    no_control("verification.challenge_id", &a.challenge_id)?;
    reported_text(&mut a.output);
    reported_text(&mut a.error);
    Ok(a)
}

/// Validates a batch of reports of worker `worker_id` (BatchUpdateJobs):
/// 1..=[`MAX_BATCH_REPORTS`] reports, each naming that worker or none
/// (filled in). Each report is validated on its own when applied.
pub fn batch(worker: &str, mut reports: Vec<JobReport>) -> Result<Vec<JobReport>> {
    worker_id(worker)?;
    if reports.is_empty() || reports.len() > MAX_BATCH_REPORTS {
        return Err(Error::invalid(format!(
            "a batch carries 1..={MAX_BATCH_REPORTS} reports, got {}",
            reports.len()
        )));
    }
    for (i, r) in reports.iter_mut().enumerate() {
        if r.worker_id.is_empty() {
            r.worker_id = worker.to_string();
        } else if r.worker_id != worker {
            return Err(Error::invalid(format!(
                "report {i} names worker {:?}, not the batch's worker {worker}",
                r.worker_id
            )));
        }
    }
    Ok(reports)
}

/// The count of a QUEUE.PEEK: 0 means 10, at most [`MAX_PAGE`].
pub fn peek_count(count: u32) -> Result<usize> {
    match count {
        0 => Ok(10),
        n if n <= MAX_PAGE => Ok(n as usize),
        n => Err(Error::invalid(format!(
            "count must be at most {MAX_PAGE}, got {n}"
        ))),
    }
}

/// Validates a new schedule (CreateSchedule) at `now_ms` and returns it
/// normalised: its id `[A-Za-z0-9._-]{1,100}` (so that `<id>-<tick>` is an
/// action id), the cron expression and time zone
/// ([`super::cron::CronSchedule::parse`]), and the action every tick
/// submits by the rules of [`action`] (inputs, `max_attempts` with its
/// default, scheduling settings with the selector in canonical form). The
/// read-only fields are cleared.
///
/// Errors: `InvalidArgument` naming the rule.
pub fn schedule(s: Schedule, cfg: &EngineConfig, now_ms: i64) -> Result<Schedule> {
    schedule_id(&s.schedule_id)?;
    if s.time_zone.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(Error::invalid(format!(
            "time_zone must be an IANA name of printable ASCII (e.g. Europe/Paris), got {:?}",
            truncate(&s.time_zone, 64)
        )));
    }
    let parsed = super::cron::CronSchedule::parse(&s.cron, &s.time_zone)?;
    // Stored as the time zone database spells it (`utc` reads as `UTC`);
    // none stays none (UTC).
    let time_zone = if s.time_zone.is_empty() {
        String::new()
    } else {
        parsed.zone_name().to_string()
    };
    let v = action(
        ActionRequest {
            action_id: format!("{}-{}", s.schedule_id, now_ms / 1000),
            plan_id: s.plan_id,
            inputs: s.inputs,
            run_at_ms: None,
            max_attempts: s.max_attempts,
            traceparent: None,
            priority: s.scheduling.priority,
            worker_selector: s.scheduling.worker_selector,
            concurrency_key: s.scheduling.concurrency_key,
            max_running: s.scheduling.max_running,
        },
        cfg,
        now_ms,
    )?;
    let bytes = input_bytes(&v.inputs);
    if bytes > MAX_SCHEDULE_INPUT_BYTES {
        return Err(Error::invalid(format!(
            "a schedule's inputs are at most {MAX_SCHEDULE_INPUT_BYTES} bytes encoded (keys, \
             values and their framing), got {bytes}"
        )));
    }
    Ok(Schedule {
        schedule_id: s.schedule_id,
        plan_id: v.plan_id,
        cron: s.cron,
        time_zone,
        inputs: v.inputs,
        max_attempts: v.max_attempts,
        scheduling: v.scheduling,
        catch_up: s.catch_up,
        created_at_ms: now_ms,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::Task;

    fn registering(tools: &[&str], names: &[&str], described: &[&str]) -> Result<Registration> {
        registration(Registration {
            worker_id: "w1".into(),
            hostname: "h".into(),
            agw_version: "1".into(),
            capabilities: crate::core::model::WorkerCapabilities {
                tools: tools.iter().map(|t| t.to_string()).collect(),
                agentic_units: names.iter().map(|t| t.to_string()).collect(),
                units: described
                    .iter()
                    .map(|n| AgenticUnit {
                        name: n.to_string(),
                        ..Default::default()
                    })
                    .collect(),
            },
            ..Default::default()
        })
    }

    #[test]
    fn a_name_listed_twice_counts_once_and_a_unit_described_twice_is_refused() {
        let r = registering(&["sort", "jq", "sort"], &["u", "u", "v"], &["v"]).unwrap();
        assert_eq!(r.capabilities.tools, ["jq", "sort"]);
        assert_eq!(r.capabilities.agentic_units, ["u", "v"]);
        assert_eq!(r.capabilities.units.len(), 2);
        let e = registering(&["sort"], &[], &["u", "v", "u"]).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("\"u\" is described twice")),
            "{e:?}"
        );
        let e = registering(&["u"], &["u"], &[]).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("both a tool")),
            "{e:?}"
        );
    }

    #[test]
    fn only_the_form_of_a_tick_is_reserved_for_ticks() {
        assert_eq!(tick_schedule("nightly-1795818182"), Some("nightly"));
        assert_eq!(tick_schedule("a-b-17958181820"), Some("a-b"));
        // No tick has fewer than 10 digits, a leading zero or no schedule.
        for id in [
            "report-2024",
            "s1-0000000001",
            "-1795818182",
            "s1-179581818x",
            "plain",
        ] {
            assert_eq!(tick_schedule(id), None, "{id}");
        }
    }

    fn task(n: u32, cmd: &str) -> Task {
        Task {
            task_number: n,
            command: cmd.into(),
            args: vec![],
            timeout_secs: 10,
            input_from_task: None,
            ..Default::default()
        }
    }

    /// A plan whose tasks' args reach [`MAX_PLAN_ARGS_BYTES`], with the
    /// largest description.
    fn largest_plan(tasks: usize) -> Plan {
        Plan {
            plan_id: "p".repeat(128),
            plan_description: "d".repeat(MAX_DESCRIPTION_BYTES),
            tasks: (1..=tasks as u32)
                .map(|n| Task {
                    args: vec!["a".repeat(MAX_ARG_BYTES)],
                    ..task(n, &"c".repeat(64))
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_plan_too_large_for_its_leases_is_refused() {
        let fits = MAX_PLAN_ARGS_BYTES / MAX_ARG_BYTES;
        assert!(plan(&largest_plan(fits)).is_ok());
        let e = plan(&largest_plan(fits + 1)).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("args are 4259840 bytes in all")),
            "{e:?}"
        );
    }

    /// The lease of the largest plan and the largest input, with the
    /// error a job may carry from its last attempt (a report of the
    /// largest size `--max-report-bytes` allows), fits the largest message
    /// the server sends: the error is cut to [`MAX_LEASE_ERROR_BYTES`].
    #[test]
    fn the_largest_lease_fits_a_message() {
        use prost::Message;
        let p = largest_plan(MAX_PLAN_ARGS_BYTES / MAX_ARG_BYTES);
        plan(&p).unwrap();
        let lease = crate::core::model::JobLease {
            lease_id: uuid::Uuid::now_v7().to_string(),
            job: crate::core::model::Job {
                job_id: uuid::Uuid::now_v7().to_string(),
                action_id: "a".repeat(128),
                plan_id: p.plan_id.clone(),
                input: (0..MAX_INPUT_KEYS)
                    .map(|i| (format!("{i:0>128}"), "v".repeat(MAX_INPUT_VALUE_BYTES)))
                    .collect(),
                plan_version: 1,
                status: crate::core::model::JobStatus::Running,
                attempt: MAX_ATTEMPTS,
                max_attempts: MAX_ATTEMPTS,
                created_at_ms: 0,
                started_at_ms: Some(0),
                completed_at_ms: None,
                worker_id: "w".repeat(64),
                task_results: Vec::new(),
                // 16 MiB of 3-byte characters after two of 1 byte: the
                // cut must fall on a character boundary.
                error: format!("ee{}", "\u{2603}".repeat((16 << 20) / 3)),
                waiting_reason: String::new(),
                current_task: 0,
                progress_percent: 0,
                ready_at_ms: None,
                priority: 0,
            },
            plan: std::sync::Arc::new(p),
            attempt: MAX_ATTEMPTS,
            expires_at_ms: 0,
            traceparent: Some("t".repeat(55).into()),
        };
        let lease = crate::pb::JobLease::from(lease);
        let error = &lease.job.as_ref().unwrap().error;
        assert_eq!(error.len(), MAX_LEASE_ERROR_BYTES - 2);
        assert!(lease.encoded_len() <= crate::server::MAX_MESSAGE_BYTES);
    }

    /// `input_bytes` is at least the encoded size of the inputs (exactly
    /// that when no key or value is empty), for inputs without values,
    /// with empty strings, and with long ones (multi-byte lengths).
    #[test]
    fn input_bytes_counts_what_the_wire_holds() {
        use prost::Message;
        let cases: Vec<Vec<HashMap<String, String>>> = vec![
            vec![HashMap::new(); 10_000],
            vec![[("a", ""), ("b", ""), ("c", "")]
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()],
            vec![HashMap::from([("k".repeat(200), "v".repeat(70_000))]); 3],
            vec![HashMap::from([("file".into(), "/data/a.txt".into())])],
        ];
        for inputs in cases {
            let wire: Vec<crate::pb::ActionInput> = inputs
                .iter()
                .map(|i| crate::pb::ActionInput { values: i.clone() })
                .collect();
            let encoded: usize = wire
                .iter()
                .map(|i| prost::encoding::message::encoded_len(1, i))
                .sum();
            let counted = input_bytes(&inputs);
            assert!(counted >= encoded, "{counted} < {encoded}");
            let empty = inputs
                .iter()
                .flatten()
                .any(|(k, v)| k.is_empty() || v.is_empty());
            if !empty {
                assert_eq!(counted, encoded);
            }
            assert!(wire
                .iter()
                .all(|i| i.encoded_len() > 0 || i.values.is_empty()));
        }
    }

    #[test]
    fn commands() {
        for ok in ["sort", "jq", "md5sum", "python3.11", "g++", "x-y_z"] {
            assert!(command_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "/bin/sh", "ls -l", "a;b", "$(x)", "a|b", "..", "-rf", "a\0b", "é",
        ] {
            assert!(command_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn input_from_task_must_point_back() {
        let mut p = Plan {
            plan_id: "p".into(),
            plan_description: String::new(),
            tasks: vec![task(1, "cat"), task(2, "sort")],
            ..Default::default()
        };
        p.tasks[1].input_from_task = Some(1);
        assert!(plan(&p).is_ok());
        p.tasks[1].input_from_task = Some(2);
        assert!(plan(&p).is_err());
        p.tasks[1].input_from_task = Some(3);
        assert!(plan(&p).is_err());
        p.tasks[1].input_from_task = Some(0);
        assert!(plan(&p).is_err());
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn any_text() -> impl Strategy<Value = String> {
            prop_oneof![
                "[A-Za-z0-9._+-]{0,12}",
                "\\PC{0,20}",
                Just("/bin/sh".to_string()),
                Just("a;b".to_string()),
                Just("a\0b".to_string()),
                Just("..".to_string()),
            ]
        }

        fn any_task() -> impl Strategy<Value = Task> {
            (
                0u32..6,
                any_text(),
                prop::collection::vec(any_text(), 0..3),
                0u32..100_000,
                prop::option::of(0u32..6),
            )
                .prop_map(|(n, command, args, timeout_secs, input_from_task)| Task {
                    task_number: n,
                    command,
                    args,
                    timeout_secs,
                    input_from_task,
                    ..Default::default()
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Validation never panics, and whatever it accepts keeps every rule.
            #[test]
            fn plan_validation_accepts_only_valid_plans(
                plan_id in any_text(),
                tasks in prop::collection::vec(any_task(), 0..6),
            ) {
                let p = Plan { plan_id, plan_description: String::new(), tasks, ..Default::default() };
                if plan(&p).is_ok() {
                    prop_assert!(!p.tasks.is_empty() && p.tasks.len() <= MAX_TASKS);
                    for (i, t) in p.tasks.iter().enumerate() {
                        prop_assert_eq!(t.task_number as usize, i + 1);
                        prop_assert!(!t.command.is_empty());
                        prop_assert!(t.command.chars().all(|c| c.is_ascii_alphanumeric() || "._+-".contains(c)));
                        prop_assert!(t.timeout_secs >= 1 && t.timeout_secs <= MAX_TASK_TIMEOUT_SECS);
                        if let Some(f) = t.input_from_task {
                            prop_assert!(f >= 1 && f < t.task_number);
                        }
                    }
                }
            }

            /// Action input validation never panics and bounds what it accepts.
            #[test]
            fn action_input_validation_bounds_inputs(
                values in prop::collection::hash_map(any_text(), any_text(), 0..8),
            ) {
                if action_input(0, &values).is_ok() {
                    for (k, v) in &values {
                        prop_assert!(!k.is_empty() && k.len() <= 128);
                        prop_assert!(!v.contains('\0'));
                    }
                }
            }
        }
    }

    #[test]
    fn reported_text_keeps_no_nul_and_is_never_refused() {
        let mut r = JobReport {
            job_id: "j".into(),
            worker_id: "w".into(),
            lease_id: "l".into(),
            error: "a\0b".into(),
            task_results: vec![crate::core::model::TaskResult {
                command: "find\0".into(),
                stdout: "./a\0./b\0".into(),
                stderr: "\0".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        report(&mut r, 1 << 20).unwrap();
        assert_eq!(r.error, "a\u{FFFD}b");
        let t = &r.task_results[0];
        assert_eq!(t.command, "find\u{FFFD}");
        assert_eq!(t.stdout, "./a\u{FFFD}./b\u{FFFD}");
        assert_eq!(t.stderr, "\u{FFFD}");
        // the size cap counts the text as sent
        let mut r = JobReport {
            error: "\0".repeat(100),
            ..r
        };
        r.task_results.clear();
        report(&mut r, 100).unwrap();
        assert_eq!(r.error.len(), 300);

        let a = verification_answer(VerificationAnswer {
            challenge_id: "c".into(),
            output: "o\0".into(),
            error: "\0e".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (a.output.as_str(), a.error.as_str()),
            ("o\u{FFFD}", "\u{FFFD}e")
        );
    }

    #[test]
    fn identifiers_and_client_text_with_nul_are_refused() {
        for lease in ["x\0", "x\n", "\u{7f}"] {
            let mut r = JobReport {
                job_id: "j".into(),
                worker_id: "w".into(),
                lease_id: lease.into(),
                ..Default::default()
            };
            let e = report(&mut r, 1 << 20).unwrap_err();
            assert!(e.to_string().contains("lease_id"), "{e}");
        }
        let e = verification_answer(VerificationAnswer {
            challenge_id: "c\0".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("challenge_id"), "{e}");
        let p = Plan {
            plan_id: "p".into(),
            plan_description: "a\0b".into(),
            tasks: vec![task(1, "cat")],
            ..Default::default()
        };
        let e = plan(&p).unwrap_err();
        assert!(e.to_string().contains("plan_description"), "{e}");
    }

    #[test]
    fn traceparent_format() {
        assert!(traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(!traceparent(bad), "{bad:?} accepted");
        }
    }
}
