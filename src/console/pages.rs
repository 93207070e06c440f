//! The console's pages (static shells), their fragments (the live regions,
//! rendered from the API) and its buttons (POSTs that call the API).

use std::sync::Arc;

use axum::{
    extract::{Path, Query, RawQuery, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};
use minijinja::context;
use serde::Deserialize;

use super::{
    grpc,
    view::{ActionRow, Diagram, JobDetail, JobRow, Sample, Throughput, WorkerRow},
    Console, Refusal, PAGE_SIZE,
};
use crate::pb::{
    self, action_service_server::ActionService, job_service_server::JobService,
    plan_service_server::PlanService, queue_service_server::QueueService,
    worker_service_server::WorkerService,
};

type Con = State<Arc<Console>>;
type Page = Result<Response, Refusal>;

/// A page's static shell: the navigation, the token field, the alert area
/// and a live region that loads `fragment` (with the page's own query).
fn shell(c: &Console, title: &str, nav: &str, fragment: String, query: Option<String>) -> Page {
    shell_with(c, title, nav, fragment, query, &[])
}

/// A button of a page's shell: a POST to `url` (the API decides whether
/// it is allowed now and for this token).
struct Button {
    id: &'static str,
    label: &'static str,
    url: String,
    confirm: Option<&'static str>,
    danger: bool,
}

/// [`shell`] with buttons above the live region. The buttons are part of
/// the static page, so a refresh never moves the keyboard focus, and they
/// are there even when the data cannot be shown (no token yet).
fn shell_with(
    c: &Console,
    title: &str,
    nav: &str,
    fragment: String,
    query: Option<String>,
    buttons: &[Button],
) -> Page {
    let fragment = match query {
        Some(q) if !q.is_empty() => format!("{fragment}?{q}"),
        _ => fragment,
    };
    let buttons: Vec<_> = buttons
        .iter()
        .map(|b| {
            context! {
                id => b.id, label => b.label, url => b.url, confirm => b.confirm,
                class => if b.danger { "danger" } else { "" },
            }
        })
        .collect();
    c.render(
        "shell.html",
        context! { title, nav, fragment, buttons, auth_on => !c.auth.is_disabled() },
    )
}

/// `GET /`: the overview.
pub async fn overview_page(State(c): Con) -> Page {
    shell(
        &c,
        "Overview",
        "overview",
        "/fragments/overview".into(),
        None,
    )
}

/// `GET /actions`: the list of actions.
pub async fn actions_page(State(c): Con, RawQuery(q): RawQuery) -> Page {
    shell(&c, "Actions", "actions", "/fragments/actions".into(), q)
}

/// Refuses with 404 a path id that no plan, action or job can have: the
/// page would show it as its title, so a link could put any words there.
fn known_form(what: &'static str, id: &str) -> Result<(), Refusal> {
    crate::core::validate::object_id(what, id)
        .map_err(|_| Refusal::new(StatusCode::NOT_FOUND, "no such page"))
}

/// `GET /actions/{id}`: one action and its jobs; 404 for an id no action
/// can have.
pub async fn action_page(State(c): Con, Path(id): Path<String>, RawQuery(q): RawQuery) -> Page {
    known_form("action_id", &id)?;
    let title = format!("Action {id}");
    let path = enc(&id);
    let buttons = [
        Button {
            id: "retry-action",
            label: "Retry dead jobs",
            url: format!("/api/actions/{path}/retry?status=dead"),
            confirm: None,
            danger: false,
        },
        Button {
            id: "retry-failed",
            label: "Retry failed jobs now",
            url: format!("/api/actions/{path}/retry?status=failed"),
            confirm: None,
            danger: false,
        },
        Button {
            id: "cancel-action",
            label: "Cancel action",
            url: format!("/api/actions/{path}/cancel"),
            confirm: Some("Cancel every open job of this action?"),
            danger: true,
        },
    ];
    let fragment = format!("/fragments/actions/{path}");
    shell_with(&c, &title, "actions", fragment, q, &buttons)
}

/// `GET /jobs/{id}`: one job; 404 for an id no job can have.
pub async fn job_page(State(c): Con, Path(id): Path<String>) -> Page {
    known_form("job_id", &id)?;
    let title = format!("Job {id}");
    let path = enc(&id);
    let buttons = [
        Button {
            id: "retry-job",
            label: "Retry job",
            url: format!("/api/jobs/{path}/retry"),
            confirm: None,
            danger: false,
        },
        Button {
            id: "cancel-job",
            label: "Cancel job",
            url: format!("/api/jobs/{path}/cancel"),
            confirm: Some("Cancel this job?"),
            danger: true,
        },
    ];
    let fragment = format!("/fragments/jobs/{path}");
    shell_with(&c, &title, "actions", fragment, None, &buttons)
}

/// `GET /workers`: the fleet.
pub async fn workers_page(State(c): Con) -> Page {
    shell(&c, "Workers", "workers", "/fragments/workers".into(), None)
}

/// `GET /plans`: the plans.
pub async fn plans_page(State(c): Con, RawQuery(q): RawQuery) -> Page {
    shell(&c, "Plans", "plans", "/fragments/plans".into(), q)
}

/// `GET /plans/{id}`: one plan as a pipeline diagram; 404 for an id no
/// plan can have.
pub async fn plan_page(State(c): Con, Path(id): Path<String>, RawQuery(q): RawQuery) -> Page {
    known_form("plan_id", &id)?;
    let title = format!("Plan {id}");
    shell(
        &c,
        &title,
        "plans",
        format!("/fragments/plans/{}", enc(&id)),
        q,
    )
}

/// What a path segment keeps as it is: RFC 3986's unreserved characters.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// A path segment, percent-encoded.
fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, SEGMENT).to_string()
}

/// The value of proto enum `E` whose name is `PREFIX` + `name` in upper
/// case (`dead` → `JOB_STATUS_DEAD`): the short lower-case names the CLI
/// prints and the console's links carry. Empty and `all` are the
/// unspecified value (no filter).
///
/// Errors: 400 naming the parameter for any other name.
fn short_name<E: Default>(
    what: &str,
    prefix: &str,
    name: &str,
    from_str_name: fn(&str) -> Option<E>,
) -> Result<E, Refusal> {
    if name.is_empty() || name == "all" {
        return Ok(E::default());
    }
    from_str_name(&format!("{prefix}{}", name.to_ascii_uppercase())).ok_or_else(|| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("Invalid request. unknown {what} {name:?}"),
        )
    })
}

/// `GET /fragments/overview`: queue depths, throughput and latency of the
/// last minutes, workers by state and freshness, recent dead jobs.
pub async fn overview(State(c): Con, headers: HeaderMap) -> Page {
    let id = c.caller(&headers)?;
    let q = c
        .queue
        .get_queue_stats(grpc(&id, pb::GetQueueStatsRequest {}))
        .await?
        .into_inner();
    let workers = all_workers(&c, &id).await?;
    let mut by_state = std::collections::BTreeMap::<String, (u32, u32)>::new();
    for w in &workers {
        let e = by_state
            .entry(crate::cli::view::worker_state_name(w.state))
            .or_default();
        if w.fresh {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    let dead_ids = c
        .jobs
        .search_jobs(grpc(
            &id,
            pb::SearchJobsRequest {
                status: pb::JobStatus::Dead as i32,
                page_size: 10,
                ..Default::default()
            },
        ))
        .await?
        .into_inner()
        .job_ids;
    let dead = jobs_of(&c, &id, dead_ids).await?;
    let samples: Vec<Sample> = c
        .samples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .copied()
        .collect();
    let now = Sample::take(c.engine.metrics());
    let chart = Throughput::new(&samples, now, super::SAMPLES_KEPT);
    c.render(
        "overview.html",
        context! {
            q => context! {
                ready => q.ready_length, scheduled => q.scheduled_length,
                running => q.running_length, oldest_ready_age_secs => q.oldest_ready_age_secs,
                next_scheduled_due_in_secs => q.next_scheduled_due_in_secs,
                workers_total => q.workers_total, workers_active => q.workers_active,
                workers_idle => q.workers_idle, workers_stale => q.workers_stale,
                workers_draining => q.workers_draining,
                workers_quarantined => q.workers_quarantined,
            },
            by_state => by_state.into_iter().map(|(s, (fresh, stale))| context!{ state => s, fresh, stale }).collect::<Vec<_>>(),
            dead,
            chart,
            stale_after => super::view::span(stale_ms(&c)),
        },
    )
}

/// Three heartbeat intervals, in ms: a worker silent longer is stale.
fn stale_ms(c: &Console) -> i64 {
    (c.engine.config().heartbeat_interval.as_millis() as i64).saturating_mul(3)
}

/// Fetches the jobs `ids` (at most one page) as rows.
async fn jobs_of(
    c: &Console,
    id: &crate::auth::Identity,
    ids: Vec<String>,
) -> Result<Vec<JobRow>, Refusal> {
    let mut rows = Vec::with_capacity(ids.len());
    for job_id in ids.into_iter().take(PAGE_SIZE as usize) {
        match c.jobs.get_job(grpc(id, pb::GetJobRequest { job_id })).await {
            Ok(r) => {
                if let Some(j) = r.into_inner().job {
                    rows.push(JobRow::from(&j));
                }
            }
            // Deleted between the listing and now (retention): skip it.
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return Err(s.into()),
        }
    }
    Ok(rows)
}

/// Filters of the actions list.
#[derive(Debug, Deserialize, Default)]
pub struct ActionsQuery {
    #[serde(default)]
    plan: String,
    /// `open`, `finished`, `has_dead` or empty (all).
    #[serde(default)]
    state: String,
    #[serde(default)]
    page_token: String,
}

/// `GET /fragments/actions`: actions, newest first, one page.
pub async fn actions(State(c): Con, headers: HeaderMap, Query(f): Query<ActionsQuery>) -> Page {
    let id = c.caller(&headers)?;
    let state = short_name(
        "action state",
        "ACTION_STATE_",
        &f.state,
        pb::ActionState::from_str_name,
    )?;
    let r = c
        .actions
        .list_actions(grpc(
            &id,
            pb::ListActionsRequest {
                plan_id: f.plan.clone(),
                state: state as i32,
                page_size: PAGE_SIZE,
                page_token: f.page_token.clone(),
                ..Default::default()
            },
        ))
        .await?
        .into_inner();
    let rows: Vec<ActionRow> = r.actions.iter().map(ActionRow::from).collect();
    c.render(
        "actions.html",
        context! {
            rows,
            plan => f.plan, state => f.state,
            next => r.next_page_token, paged => !f.page_token.is_empty(),
        },
    )
}

/// Filters of an action's jobs.
#[derive(Debug, Deserialize, Default)]
pub struct JobsQuery {
    /// A job status name (`dead`) or empty (all).
    #[serde(default)]
    status: String,
    #[serde(default)]
    page_token: String,
}

/// A job status from its short name (`dead`); empty is "any".
///
/// Errors: 400 for an unknown name.
fn status_of(name: &str) -> Result<pb::JobStatus, Refusal> {
    short_name(
        "job status",
        "JOB_STATUS_",
        name,
        pb::JobStatus::from_str_name,
    )
}

/// `GET /fragments/actions/{id}`: an action's counts and one page of its
/// jobs (status, worker, attempts, waiting reason).
pub async fn action(
    State(c): Con,
    headers: HeaderMap,
    Path(action_id): Path<String>,
    Query(f): Query<JobsQuery>,
) -> Page {
    let id = c.caller(&headers)?;
    let status = status_of(&f.status)?;
    let a = c
        .actions
        .get_action(grpc(
            &id,
            pb::GetActionRequest {
                action_id: action_id.clone(),
            },
        ))
        .await?
        .into_inner()
        .action
        .unwrap_or_default();
    let page = c
        .jobs
        .list_jobs(grpc(
            &id,
            pb::ListJobsRequest {
                action_id: action_id.clone(),
                status: status as i32,
                page_size: PAGE_SIZE,
                page_token: f.page_token.clone(),
            },
        ))
        .await?
        .into_inner();
    let jobs = jobs_of(&c, &id, page.job_ids).await?;
    c.render(
        "action.html",
        context! {
            a => ActionRow::from(&a),
            action_path => enc(&action_id),
            jobs, status => f.status,
            next => page.next_page_token, paged => !f.page_token.is_empty(),
        },
    )
}

/// `GET /fragments/jobs/{id}`: a job in full.
pub async fn job(State(c): Con, headers: HeaderMap, Path(job_id): Path<String>) -> Page {
    let id = c.caller(&headers)?;
    let j = c
        .jobs
        .get_job(grpc(&id, pb::GetJobRequest { job_id }))
        .await?
        .into_inner()
        .job
        .unwrap_or_default();
    let terminal = matches!(
        pb::JobStatus::try_from(j.status),
        Ok(pb::JobStatus::Completed | pb::JobStatus::Dead | pb::JobStatus::Cancelled)
    );
    let mut page = c.render(
        "job.html",
        context! { j => JobDetail::from(&j), job_path => enc(&j.job_id), action_path => enc(&j.action_id) },
    )?;
    if terminal {
        // htmx's "stop polling" status: a finished job does not change by
        // itself, and its output may be megabytes. The page still reloads
        // after its own buttons (the agq-refresh event).
        *page.status_mut() = StatusCode::from_u16(286).unwrap_or(StatusCode::OK);
    }
    Ok(page)
}

/// Every worker, read a page after another as `id` (each page has at
/// least one, so this ends).
async fn all_workers(c: &Console, id: &crate::auth::Identity) -> Result<Vec<pb::Worker>, Refusal> {
    let mut all = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = c
            .workers
            .list_workers(grpc(
                id,
                pb::ListWorkersRequest {
                    page_token,
                    ..Default::default()
                },
            ))
            .await?
            .into_inner();
        all.extend(page.workers);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}

/// `GET /fragments/workers`: every worker with its tools, tags, load and
/// heartbeat age against the stale threshold.
pub async fn workers(State(c): Con, headers: HeaderMap) -> Page {
    let id = c.caller(&headers)?;
    let list = all_workers(&c, &id).await?;
    let now = crate::time::now_ms();
    let stale = stale_ms(&c);
    let rows: Vec<WorkerRow> = list.iter().map(|w| WorkerRow::new(w, now, stale)).collect();
    c.render(
        "workers.html",
        context! { rows, stale_after => super::view::span(stale) },
    )
}

/// Paging of the plans list.
#[derive(Debug, Deserialize, Default)]
pub struct PlansQuery {
    #[serde(default)]
    page_token: String,
}

/// `GET /fragments/plans`: plans with their latest version and
/// description, one page (ListPlans alone: no plan is fetched).
pub async fn plans(State(c): Con, headers: HeaderMap, Query(f): Query<PlansQuery>) -> Page {
    let id = c.caller(&headers)?;
    let r = c
        .plans
        .list_plans(grpc(
            &id,
            pb::ListPlansRequest {
                pattern: String::new(),
                page_size: PAGE_SIZE,
                page_token: f.page_token.clone(),
            },
        ))
        .await?
        .into_inner();
    let rows: Vec<_> = r
        .plans
        .iter()
        .map(|p| {
            context! {
                plan_id => p.plan_id.clone(), path => enc(&p.plan_id),
                description => p.plan_description.clone(), version => p.version,
                updated => super::view::when(p.updated_at.as_ref()),
            }
        })
        .collect();
    c.render(
        "plans.html",
        context! { rows, next => r.next_page_token, paged => !f.page_token.is_empty() },
    )
}

/// Which version of a plan its page shows.
#[derive(Debug, Deserialize, Default)]
pub struct PlanQuery {
    /// A version number; absent or 0: the latest.
    #[serde(default)]
    version: u32,
}

/// `GET /fragments/plans/{id}[?version=N]`: a plan version's tasks, its
/// pipeline diagram, and the plan's versions (newest first, one page).
pub async fn plan(
    State(c): Con,
    headers: HeaderMap,
    Path(plan_id): Path<String>,
    Query(f): Query<PlanQuery>,
) -> Page {
    let id = c.caller(&headers)?;
    let p = c
        .plans
        .get_plan(grpc(
            &id,
            pb::GetPlanRequest {
                plan_id: plan_id.clone(),
                version: f.version,
            },
        ))
        .await?
        .into_inner()
        .plan
        .unwrap_or_default();
    let versions = c
        .plans
        .list_plan_versions(grpc(
            &id,
            pb::ListPlanVersionsRequest {
                plan_id: plan_id.clone(),
                page_size: PAGE_SIZE,
                page_token: String::new(),
            },
        ))
        .await?
        .into_inner();
    let versions: Vec<_> = versions
        .versions
        .iter()
        .map(|v| {
            context! {
                version => v.version, description => v.plan_description.clone(),
                tasks => v.task_count, created => super::view::when(v.created_at.as_ref()),
            }
        })
        .collect();
    let tasks: Vec<_> = p
        .tasks
        .iter()
        .map(|t| {
            context! {
                task_number => t.task_number, command => t.command.clone(),
                args => shlex::try_join(t.args.iter().map(String::as_str)).unwrap_or_else(|_| t.args.join(" ")),
                timeout_secs => t.timeout_secs, input_from_task => t.input_from_task,
                permanent_exit_codes => t.permanent_exit_codes.iter().map(i32::to_string).collect::<Vec<_>>().join(", "),
            }
        })
        .collect();
    c.render(
        "plan.html",
        context! {
            plan_id => p.plan_id.clone(), path => enc(&p.plan_id), version => p.version,
            description => p.plan_description.clone(),
            require_sandbox => p.require_sandbox, tasks, diagram => Diagram::new(&p.tasks),
            versions,
        },
    )
}

/// A button's answer: a short message for the alert area, and an
/// `agq-refresh` event that makes the live region reload at once.
fn done(message: String) -> Response {
    (
        [
            ("hx-trigger", "agq-refresh"),
            ("content-type", "text/plain; charset=utf-8"),
        ],
        message,
    )
        .into_response()
}

/// `1 job`, `3 jobs`.
fn jobs(n: u32) -> String {
    format!("{n} job{}", if n == 1 { "" } else { "s" })
}

/// Which jobs an action's retry button retries.
#[derive(Debug, Deserialize, Default)]
pub struct RetryQuery {
    /// `dead` or `failed`; empty retries both (the API's default).
    #[serde(default)]
    status: String,
}

/// `POST /api/actions/{id}/retry[?status=dead|failed]`: RetryAction.
pub async fn retry_action(
    State(c): Con,
    headers: HeaderMap,
    Path(action_id): Path<String>,
    Query(f): Query<RetryQuery>,
) -> Page {
    let id = c.caller(&headers)?;
    let status = status_of(&f.status)?;
    let r = c
        .actions
        .retry_action(grpc(
            &id,
            pb::RetryActionRequest {
                action_id,
                status: status as i32,
            },
        ))
        .await?
        .into_inner();
    Ok(done(format!("Retried {}.", jobs(r.retried))))
}

/// `POST /api/actions/{id}/cancel`: CancelAction.
pub async fn cancel_action(
    State(c): Con,
    headers: HeaderMap,
    Path(action_id): Path<String>,
) -> Page {
    let id = c.caller(&headers)?;
    let r = c
        .actions
        .cancel_action(grpc(&id, pb::CancelActionRequest { action_id }))
        .await?
        .into_inner();
    Ok(done(format!("Cancelled {}.", jobs(r.cancelled))))
}

/// `POST /api/jobs/{id}/retry`: RetryJob.
pub async fn retry_job(State(c): Con, headers: HeaderMap, Path(job_id): Path<String>) -> Page {
    let id = c.caller(&headers)?;
    c.jobs
        .retry_job(grpc(
            &id,
            pb::RetryJobRequest {
                job_id: job_id.clone(),
                priority: None,
            },
        ))
        .await?;
    Ok(done(format!("Job {job_id} is pending again.")))
}

/// `POST /api/jobs/{id}/cancel`: CancelJob.
pub async fn cancel_job(State(c): Con, headers: HeaderMap, Path(job_id): Path<String>) -> Page {
    let id = c.caller(&headers)?;
    c.jobs
        .cancel_job(grpc(
            &id,
            pb::CancelJobRequest {
                job_id: job_id.clone(),
            },
        ))
        .await?;
    Ok(done(format!("Job {job_id} is cancelled.")))
}

/// `POST /api/workers/{id}/drain`: DrainWorker (admin or the worker's token).
pub async fn drain_worker(
    State(c): Con,
    headers: HeaderMap,
    Path(worker_id): Path<String>,
) -> Page {
    let id = c.caller(&headers)?;
    c.workers
        .drain_worker(grpc(
            &id,
            pb::DrainWorkerRequest {
                worker_id: worker_id.clone(),
            },
        ))
        .await?;
    Ok(done(format!(
        "Worker {worker_id} is draining: it finishes its jobs and takes no new ones."
    )))
}

/// `POST /api/workers/{id}/release`: ReleaseWorker (admin only).
pub async fn release_worker(
    State(c): Con,
    headers: HeaderMap,
    Path(worker_id): Path<String>,
) -> Page {
    let id = c.caller(&headers)?;
    c.workers
        .release_worker(grpc(
            &id,
            pb::ReleaseWorkerRequest {
                worker_id: worker_id.clone(),
            },
        ))
        .await?;
    Ok(done(format!(
        "Worker {worker_id} is released from quarantine and takes leases again."
    )))
}

/// `POST /api/workers/{id}/forget`: ForgetWorker (dead or unregistered
/// workers only).
pub async fn forget_worker(
    State(c): Con,
    headers: HeaderMap,
    Path(worker_id): Path<String>,
) -> Page {
    let id = c.caller(&headers)?;
    c.workers
        .forget_worker(grpc(
            &id,
            pb::ForgetWorkerRequest {
                worker_id: worker_id.clone(),
            },
        ))
        .await?;
    Ok(done(format!("Worker {worker_id} is forgotten.")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_keep_unreserved_characters_only() {
        assert_eq!(enc("browser-200_v1.~x"), "browser-200_v1.~x");
        assert_eq!(enc("a b/c?d#é"), "a%20b%2Fc%3Fd%23%C3%A9");
    }

    #[test]
    fn short_names_are_the_cli_names() {
        assert_eq!(status_of("dead").unwrap(), pb::JobStatus::Dead);
        assert_eq!(status_of("").unwrap(), pb::JobStatus::Unspecified);
        assert_eq!(status_of("all").unwrap(), pb::JobStatus::Unspecified);
        let err = status_of("zombie").unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        let state = short_name(
            "action state",
            "ACTION_STATE_",
            "has_dead",
            pb::ActionState::from_str_name,
        );
        assert_eq!(state.unwrap(), pb::ActionState::HasDead);
        assert_eq!(jobs(1), "1 job");
        assert_eq!(jobs(0), "0 jobs");
    }
}
