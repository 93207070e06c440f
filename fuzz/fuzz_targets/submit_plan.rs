//! PlanService/SubmitPlan: a `SubmitPlanRequest` decoded from the fuzzer's
//! bytes goes through the service's path (the plan converted to
//! `core::model::Plan`, then `Engine::submit_plan`); `validate::plan` and
//! `validate::task_timeouts` (against the harness's job timeout) on the
//! converted plan are the oracle. What validation accepts is accepted
//! again after an encode/decode round trip (idempotent), reads back
//! unchanged through GetPlan (with the version the server gave it,
//! whatever version the request carried), is found by ListPlans and, when
//! it was a new plan, is deleted by DeletePlan; with `replace` on an
//! existing id it is stored as that id's next version (or not at all when
//! unchanged), and the fixture plans stay. What validation refuses (or a
//! request without a plan) the RPC refuses with INVALID_ARGUMENT.
#![no_main]

use agq::{
    core::{model::Plan, validate},
    pb,
};
use agq_fuzz::{code, harness, is_invalid};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::Code;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = pb::SubmitPlanRequest::decode(data) else {
        return;
    };
    let h = harness();
    // The oracle: the plan's own rules, then the server's (no task longer
    // than the job timeout).
    let valid = req.plan.clone().map(|p| {
        let p = Plan::from(p);
        validate::plan(&p).and_then(|()| validate::task_timeouts(&p, h.engine.config().job_timeout))
    });
    if let (Some(Ok(())), Some(p)) = (&valid, &req.plan) {
        let again = pb::Plan::decode(p.encode_to_vec().as_slice()).expect("re-decode");
        assert_eq!(&again, p);
        assert!(
            validate::plan(&Plan::from(again)).is_ok(),
            "validation is not idempotent"
        );
        let tools = validate::plan_tools(&Plan::from(p.clone()));
        assert!(
            tools.windows(2).all(|w| w[0] < w[1]),
            "tools not sorted/unique"
        );
        assert!(p.tasks.iter().all(|t| tools.contains(&t.command)));
    }
    let res = h.submit_plan(req.clone());
    match (&valid, code(&res)) {
        (None | Some(Err(_)), _) => assert!(is_invalid(&res), "refused plan got {res:?}"),
        (Some(Ok(())), Code::AlreadyExists) => {}
        (Some(Ok(())), Code::Ok) => {
            let p = req.plan.as_ref().unwrap();
            let stored = res.unwrap();
            let id = stored.plan_id.clone();
            assert_eq!(id, p.plan_id);
            assert!(stored.version >= 1, "version 0 stored");
            assert!(
                req.replace || (stored.created && stored.version == 1),
                "a plan without replace was stored as {stored:?}"
            );
            let got = h.get_plan(pb::GetPlanRequest {
                plan_id: id.clone(),
                version: stored.version,
            });
            let want = pb::Plan {
                version: stored.version,
                // Stored in canonical form.
                worker_selector: validate::worker_selector(&p.worker_selector)
                    .expect("a valid plan's selector parses"),
                ..p.clone()
            };
            assert_eq!(
                got.as_ref().ok().and_then(|g| g.plan.as_ref()),
                Some(&want),
                "the stored plan differs"
            );
            let latest = h.get_plan(pb::GetPlanRequest {
                plan_id: id.clone(),
                version: 0,
            });
            assert_eq!(latest.ok().and_then(|g| g.plan), Some(want), "latest");
            if stored.version > 1 || !stored.created {
                // A version of an existing plan (a fixture, maybe): kept.
                return;
            }
            let listed = h.list_plans(pb::ListPlansRequest {
                pattern: id.clone(),
                page_size: 0,
                page_token: String::new(),
            });
            let listed = listed.expect("list by the plan's own id");
            assert_eq!(listed.plan_ids, vec![id.clone()], "ListPlans by id");
            h.delete_plan(pb::DeletePlanRequest {
                plan_id: id.clone(),
            })
            .expect("delete the new plan");
            let gone = h.get_plan(pb::GetPlanRequest {
                plan_id: id,
                version: 0,
            });
            assert_eq!(code(&gone), Code::NotFound, "{gone:?}");
        }
        (Some(Ok(())), _) => panic!("a valid plan was refused: {res:?}"),
    }
});
