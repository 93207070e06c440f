//! ActionService/SubmitAction: a `SubmitActionRequest` decoded from the
//! fuzzer's bytes goes through the service's path: `convert::action_request`
//! (run_at to milliseconds), then `Engine::submit_action` (id, input,
//! limit, max_attempts, run_at and scheduling validation by
//! `validate::action`, then
//! the write). A request one of the pure checks refuses must get
//! INVALID_ARGUMENT; an accepted one must create one job per input, each
//! reading back with its input unchanged, rendering the plan's arguments
//! exactly when the input has every variable they use (the worker's
//! templating), and cancellable.
#![no_main]

use agq::{
    core::{model::Scheduling, validate},
    pb,
    service::convert::time_field,
    worker::template,
};
use agq_fuzz::{check_render, code, fixture_plan, harness, is_invalid, FIXTURE_VARIABLES, PLAN_ID};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::Code;

/// Jobs whose details are read back per accepted action (all are cancelled).
const CHECKED_JOBS: usize = 8;

fn refused_by_pure_checks(req: &pb::SubmitActionRequest, max_inputs: usize) -> bool {
    validate::object_id("plan_id", &req.plan_id).is_err()
        || (!req.action_id.is_empty() && validate::object_id("action_id", &req.action_id).is_err())
        || req.inputs.is_empty()
        || req.inputs.len() > max_inputs
        || req
            .inputs
            .iter()
            .enumerate()
            .any(|(i, input)| validate::action_input(i, &input.values).is_err())
        || req.max_attempts > validate::MAX_ATTEMPTS
        || time_field("run_at", req.run_at.clone()).is_err()
        || validate::scheduling(Scheduling {
            priority: req.priority,
            worker_selector: req.worker_selector.clone(),
            concurrency_key: req.concurrency_key.clone(),
            max_running: req.max_running,
        })
        .is_err()
}

fuzz_target!(|data: &[u8]| {
    let Ok(req) = pb::SubmitActionRequest::decode(data) else {
        return;
    };
    let h = harness();
    let refused = refused_by_pure_checks(&req, h.engine.config().max_inputs_per_action);
    let res = h.submit_action(req.clone());
    if refused {
        assert!(is_invalid(&res), "a refused action got {res:?}");
        return;
    }
    let (action_id, job_ids) = match code(&res) {
        Code::Ok => {
            let ok = res.unwrap();
            assert_eq!(ok.jobs_created as usize, ok.job_ids.len());
            (ok.action_id, ok.job_ids)
        }
        Code::NotFound | Code::AlreadyExists => return,
        // Rules may only be added to the engine, never dropped.
        Code::InvalidArgument => return,
        _ => panic!("an action that passed validation failed: {res:?}"),
    };
    if !req.action_id.is_empty() {
        assert_eq!(action_id, req.action_id);
    }
    assert_eq!(job_ids.len(), req.inputs.len(), "one job per input");
    let mut sorted = job_ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), job_ids.len(), "job ids are not unique");
    let plan = (req.plan_id == PLAN_ID).then(fixture_plan);
    for (job_id, input) in job_ids.iter().zip(&req.inputs).take(CHECKED_JOBS) {
        let job = h
            .get_job(pb::GetJobRequest {
                job_id: job_id.clone(),
            })
            .expect("read back a new job")
            .job
            .expect("GetJob returns the job");
        assert_eq!(job.input, input.values, "the stored input differs");
        assert_eq!(job.action_id, action_id);
        assert_eq!(job.plan_id, req.plan_id);
        assert_eq!(job.priority, req.priority, "the job's priority differs");
        let expected_attempts = if req.max_attempts == 0 {
            3
        } else {
            req.max_attempts
        };
        assert_eq!(job.max_attempts, expected_attempts);
        assert_eq!(job.status, pb::JobStatus::Pending as i32);
        if let Some(plan) = &plan {
            let has_all = FIXTURE_VARIABLES.iter().all(|v| job.input.contains_key(*v));
            let rendered: Result<Vec<_>, _> = plan
                .tasks
                .iter()
                .map(|t| template::render_all(&t.args, &job.input))
                .collect();
            assert_eq!(rendered.is_ok(), has_all, "templating of {:?}", job.input);
            for arg in plan.tasks.iter().flat_map(|t| &t.args) {
                check_render(arg, &job.input);
            }
        }
    }
    for job_id in &job_ids {
        let job = h
            .cancel_job(pb::CancelJobRequest {
                job_id: job_id.clone(),
            })
            .expect("cancel a new job")
            .job
            .expect("CancelJob returns the job");
        assert_eq!(job.status, pb::JobStatus::Cancelled as i32);
    }
    let status = h
        .get_action(pb::GetActionRequest { action_id })
        .expect("read back the action")
        .action
        .expect("GetAction returns the action");
    assert_eq!(status.total_jobs as usize, job_ids.len());
    assert_eq!(status.cancelled as usize, job_ids.len());
});
