//! PlanService/SubmitPlan: a `SubmitPlanRequest` decoded from the fuzzer's
//! bytes goes through `validate::plan` and then `Engine::submit_plan`, the
//! call the service makes. What validation accepts is accepted again after
//! an encode/decode round trip (idempotent), reads back unchanged through
//! GetPlan, is found by ListPlans and is deleted by DeletePlan; what it
//! refuses the engine refuses with INVALID_ARGUMENT.
#![no_main]

use agq::{core::validate, error::Error, pb};
use agq_fuzz::{harness, is_invalid};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = pb::SubmitPlanRequest::decode(data) else {
        return;
    };
    let h = harness();
    let valid = req.plan.as_ref().map(validate::plan);
    if let (Some(Ok(())), Some(p)) = (&valid, &req.plan) {
        let again = pb::Plan::decode(p.encode_to_vec().as_slice()).expect("re-decode");
        assert_eq!(&again, p);
        assert!(
            validate::plan(&again).is_ok(),
            "validation is not idempotent"
        );
        let tools = validate::plan_tools(p);
        assert!(
            tools.windows(2).all(|w| w[0] < w[1]),
            "tools not sorted/unique"
        );
        assert!(p.tasks.iter().all(|t| tools.contains(&t.command)));
    }
    let res = h.rt.block_on(h.engine.submit_plan(req.plan.clone()));
    match (&valid, &res) {
        (None | Some(Err(_)), r) => assert!(is_invalid(r), "refused plan got {r:?}"),
        (Some(Ok(())), Err(Error::AlreadyExists(_))) => {}
        (Some(Ok(())), Ok(id)) => {
            let p = req.plan.as_ref().unwrap();
            assert_eq!(id, &p.plan_id);
            let got = h.rt.block_on(h.engine.get_plan(id.clone()));
            assert_eq!(got.as_ref().ok(), Some(p), "the stored plan differs");
            let listed = h.rt.block_on(h.engine.list_plans(pb::ListPlansRequest {
                pattern: id.clone(),
                page_size: 0,
                page_token: String::new(),
            }));
            let listed = listed.expect("list by the plan's own id");
            assert_eq!(listed.plan_ids, vec![id.clone()], "ListPlans by id");
            h.rt.block_on(h.engine.delete_plan(id.clone()))
                .expect("delete the new plan");
            let gone = h.rt.block_on(h.engine.get_plan(id.clone()));
            assert!(matches!(gone, Err(Error::NotFound(_))), "{gone:?}");
        }
        (Some(Ok(())), Err(e)) => panic!("a valid plan was refused: {e:?}"),
    }
});
