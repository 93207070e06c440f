//! ActionService/SubmitAction: a `SubmitActionRequest` decoded from the
//! fuzzer's bytes goes through `Engine::submit_action`, the call the
//! service makes (id, input, limit, max_attempts and run_at validation,
//! then the write). A request one of the pure checks refuses must get
//! INVALID_ARGUMENT; an accepted one must create one job per input, each
//! reading back with its input unchanged, rendering the plan's arguments
//! exactly when the input has every variable they use (the worker's
//! templating), and cancellable.
#![no_main]

use agq::{core::validate, error::Error, pb, time::ms_of, worker::template};
use agq_fuzz::{check_render, fixture_plan, harness, is_invalid, FIXTURE_VARIABLES, PLAN_ID};
use libfuzzer_sys::fuzz_target;
use prost::Message;

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
        || req.run_at.as_ref().is_some_and(|t| ms_of(t).is_none())
}

fuzz_target!(|data: &[u8]| {
    let Ok(req) = pb::SubmitActionRequest::decode(data) else {
        return;
    };
    let h = harness();
    let refused = refused_by_pure_checks(&req, h.engine.config().max_inputs_per_action);
    let res = h.rt.block_on(h.engine.submit_action(req.clone()));
    if refused {
        assert!(is_invalid(&res), "a refused action got {res:?}");
        return;
    }
    let (action_id, job_ids) = match res {
        Ok(ok) => ok,
        Err(Error::NotFound(_) | Error::AlreadyExists(_)) => return,
        // Rules may only be added to the engine, never dropped.
        Err(Error::InvalidArgument(_)) => return,
        Err(e) => panic!("an action that passed validation failed: {e:?}"),
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
        let job =
            h.rt.block_on(h.engine.get_job(job_id.clone()))
                .expect("read back a new job");
        assert_eq!(job.input, input.values, "the stored input differs");
        assert_eq!(job.action_id, action_id);
        assert_eq!(job.plan_id, req.plan_id);
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
        let job =
            h.rt.block_on(h.engine.cancel_job(job_id.clone()))
                .expect("cancel a new job");
        assert_eq!(job.status, pb::JobStatus::Cancelled as i32);
    }
    let status =
        h.rt.block_on(h.engine.get_action(action_id))
            .expect("read back the action");
    assert_eq!(status.total_jobs as usize, job_ids.len());
    assert_eq!(status.cancelled as usize, job_ids.len());
});
