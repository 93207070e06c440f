//! The read RPCs: the first byte picks the message, the rest is decoded
//! with prost and handed to the `Engine` call its service makes.
//!
//! - ListPlansRequest: a pattern the validating glob dialect refuses gets
//!   INVALID_ARGUMENT; a page is sorted, unique, at most page_size long,
//!   holds only ids the pattern matches, and a whole listing holds every
//!   fixture plan it matches; the next page starts after the last id.
//! - SearchJobsRequest / ListJobsRequest: filters, page sizes and page
//!   tokens (built as the JobService builds them).
//! - PeekQueueRequest: queue name and count.
//! - GetJobRequest: its id goes through GetJob, GetAction, GetPlan and
//!   GetWorker; a malformed id gets INVALID_ARGUMENT from each.
#![no_main]

use agq::{core::validate, error::Error, pb, store::jobs::JobFilter, time::ms_of};
use agq_fuzz::{harness, is_invalid, Harness, LISTED_PLANS, PLAN_ID};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn page_limit(n: u32) -> Option<usize> {
    match n {
        0 => Some(100),
        n if n <= 1000 => Some(n as usize),
        _ => None,
    }
}

fn list_plans(h: &Harness, req: pb::ListPlansRequest) {
    let pattern_ok = req.pattern.len() <= 256
        && !req.pattern.contains('\0')
        && (req.pattern.is_empty() || glob::Pattern::new(&req.pattern).is_ok());
    let res = h.rt.block_on(h.engine.list_plans(req.clone()));
    if !pattern_ok || page_limit(req.page_size).is_none() {
        assert!(is_invalid(&res), "a refused listing got {res:?}");
        return;
    }
    let Ok(page) = res else {
        // Only a page token the server did not issue may be refused.
        assert!(is_invalid(&res) && !req.page_token.is_empty(), "{res:?}");
        return;
    };
    let limit = page_limit(req.page_size).unwrap();
    assert!(page.plan_ids.len() <= limit, "page longer than page_size");
    assert!(
        page.plan_ids.windows(2).all(|w| w[0] < w[1]),
        "page not sorted and unique: {:?}",
        page.plan_ids
    );
    // One dialect: what the `glob` crate validates is what ListPlans
    // matches, brackets and `**` included (this target found `[!a]*`,
    // `[a-!]?` and `**/**/**/*a` answered by another engine before).
    let glob = (!req.pattern.is_empty()).then(|| glob::Pattern::new(&req.pattern).unwrap());
    let matches = |id: &str| glob.as_ref().is_none_or(|g| g.matches(id));
    for id in &page.plan_ids {
        assert!(
            matches(id),
            "ListPlans pattern {:?} returned {id:?}, which the validating glob does not match",
            req.pattern
        );
    }
    if glob.is_some() && req.page_token.is_empty() && page.next_page_token.is_empty() {
        // A whole listing: every fixture plan the pattern matches is in it.
        for id in LISTED_PLANS.iter().copied().chain([PLAN_ID]) {
            assert_eq!(
                page.plan_ids.iter().any(|p| p == id),
                matches(id),
                "ListPlans pattern {:?} and plan {id:?}",
                req.pattern
            );
        }
    }
    if !page.next_page_token.is_empty() {
        let next =
            h.rt.block_on(h.engine.list_plans(pb::ListPlansRequest {
                page_token: page.next_page_token.clone(),
                ..req
            }))
            .expect("the next page of a token the server issued");
        if let (Some(last), Some(first)) = (page.plan_ids.last(), next.plan_ids.first()) {
            assert!(first > last, "pages overlap: {last:?} then {first:?}");
        }
    }
}

fn search(h: &Harness, filter: JobFilter, page_size: u32, token: String) {
    let refused = page_limit(page_size).is_none()
        || filter
            .status
            .is_some_and(|s| pb::JobStatus::try_from(s).is_err())
        || filter
            .action_id
            .as_ref()
            .is_some_and(|a| validate::object_id("action_id", a).is_err())
        || filter
            .plan_id
            .as_ref()
            .is_some_and(|p| validate::object_id("plan_id", p).is_err());
    let res =
        h.rt.block_on(h.engine.search_jobs(filter, page_size, token));
    if refused {
        assert!(is_invalid(&res), "a refused search got {res:?}");
        return;
    }
    match res {
        Ok((ids, _)) => assert!(ids.len() <= page_limit(page_size).unwrap()),
        Err(Error::InvalidArgument(_) | Error::NotFound(_)) => {}
        Err(e) => panic!("search failed: {e:?}"),
    }
}

/// The JobService's timestamp filter: an out-of-range timestamp is refused.
fn time_filter(t: Option<prost_types::Timestamp>) -> Result<Option<i64>, ()> {
    t.map(|t| ms_of(&t).ok_or(())).transpose()
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let h = harness();
    match which % 5 {
        0 => {
            if let Ok(req) = pb::ListPlansRequest::decode(bytes) {
                list_plans(h, req);
            }
        }
        1 => {
            let Ok(r) = pb::SearchJobsRequest::decode(bytes) else {
                return;
            };
            let (Ok(after), Ok(before)) =
                (time_filter(r.created_after), time_filter(r.created_before))
            else {
                return;
            };
            let filter = JobFilter {
                action_id: None,
                status: (r.status != 0).then_some(r.status),
                plan_id: (!r.plan_id.is_empty()).then_some(r.plan_id),
                created_after_ms: after,
                created_before_ms: before,
            };
            search(h, filter, r.page_size, r.page_token);
        }
        2 => {
            let Ok(r) = pb::ListJobsRequest::decode(bytes) else {
                return;
            };
            if r.action_id.is_empty() {
                return;
            }
            let filter = JobFilter {
                action_id: Some(r.action_id),
                status: (r.status != 0).then_some(r.status),
                ..Default::default()
            };
            search(h, filter, r.page_size, r.page_token);
        }
        3 => {
            let Ok(r) = pb::PeekQueueRequest::decode(bytes) else {
                return;
            };
            let refused = r.count > 1000 || !["", "ready", "scheduled"].contains(&r.queue.as_str());
            let res = h.rt.block_on(h.engine.peek_queue(r.queue, r.count));
            if refused {
                assert!(is_invalid(&res), "a refused peek got {res:?}");
            } else {
                let ids = res.expect("peek");
                assert!(ids.len() <= if r.count == 0 { 10 } else { r.count as usize });
            }
        }
        _ => {
            let Ok(r) = pb::GetJobRequest::decode(bytes) else {
                return;
            };
            let id = r.job_id;
            let bad_object = validate::object_id("id", &id).is_err();
            let job = h.rt.block_on(h.engine.get_job(id.clone()));
            let action = h.rt.block_on(h.engine.get_action(id.clone()));
            let plan = h.rt.block_on(h.engine.get_plan(id.clone()));
            for (what, invalid) in [
                ("GetJob", is_invalid(&job)),
                ("GetAction", is_invalid(&action)),
                ("GetPlan", is_invalid(&plan)),
            ] {
                assert_eq!(invalid, bad_object, "{what} of {id:?}");
            }
            let worker = h.rt.block_on(h.engine.get_worker(id.clone()));
            assert_eq!(
                is_invalid(&worker),
                validate::worker_id(&id).is_err(),
                "GetWorker of {id:?}"
            );
        }
    }
});
