//! The read RPCs: the first byte picks the message, the rest is decoded
//! with prost, converted as its service converts it (`service::convert`)
//! and handed to the `Engine` call its service makes; outcomes are
//! compared by gRPC code.
//!
//! - ListPlansRequest: a pattern the validating glob dialect refuses gets
//!   INVALID_ARGUMENT; a page is sorted, unique, at most page_size long,
//!   holds only ids the pattern matches, and a whole listing holds every
//!   fixture plan it matches; the next page starts after the last id.
//! - SearchJobsRequest / ListJobsRequest: filters (status, ids, created
//!   timestamps; ListJobs requires an action id), page sizes and page
//!   tokens (converted by `convert::search_jobs_query` / `list_jobs_query`
//!   as the JobService converts them).
//! - PeekQueueRequest: queue name and count.
//! - GetJobRequest: its id goes through GetJob, GetAction, GetPlan and
//!   GetWorker; a malformed id gets INVALID_ARGUMENT from each.
#![no_main]

use agq::{core::validate, pb, service::convert::time_field};
use agq_fuzz::{code, harness, is_invalid, Harness, LISTED_PLANS, PLAN_ID};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::{Code, Status};

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
    let res = h.list_plans(req.clone());
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
        let next = h
            .list_plans(pb::ListPlansRequest {
                page_token: page.next_page_token.clone(),
                ..req
            })
            .expect("the next page of a token the server issued");
        if let (Some(last), Some(first)) = (page.plan_ids.last(), next.plan_ids.first()) {
            assert!(first > last, "pages overlap: {last:?} then {first:?}");
        }
    }
}

/// The filters a SearchJobs or ListJobs request carries.
struct Filter<'a> {
    status: i32,
    action_id: Option<&'a str>,
    plan_id: Option<&'a str>,
    page_size: u32,
}

/// Checks one SearchJobs/ListJobs outcome: what a rule refuses (`refused`
/// covers the checks only one of the two RPCs has) gets INVALID_ARGUMENT,
/// a page is at most page_size long.
fn check_search(f: Filter, refused: bool, res: Result<Vec<String>, Status>) {
    let refused = refused
        || page_limit(f.page_size).is_none()
        || (f.status != 0 && pb::JobStatus::try_from(f.status).is_err())
        || f.action_id
            .is_some_and(|a| validate::object_id("action_id", a).is_err())
        || f.plan_id
            .is_some_and(|p| validate::object_id("plan_id", p).is_err());
    if refused {
        assert!(is_invalid(&res), "a refused search got {res:?}");
        return;
    }
    match (code(&res), res) {
        (_, Ok(ids)) => assert!(ids.len() <= page_limit(f.page_size).unwrap()),
        (Code::InvalidArgument | Code::NotFound, Err(_)) => {}
        (_, Err(e)) => panic!("search failed: {e:?}"),
    }
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
            // The JobService's timestamp filters: one out of range is refused.
            let bad_time = time_field("created_after", r.created_after).is_err()
                || time_field("created_before", r.created_before).is_err();
            let res = h.search_jobs(r.clone()).map(|p| p.job_ids);
            let filter = Filter {
                status: r.status,
                action_id: None,
                plan_id: (!r.plan_id.is_empty()).then_some(r.plan_id.as_str()),
                page_size: r.page_size,
            };
            check_search(filter, bad_time, res);
        }
        2 => {
            let Ok(r) = pb::ListJobsRequest::decode(bytes) else {
                return;
            };
            let res = h.list_jobs(r.clone()).map(|p| p.job_ids);
            let filter = Filter {
                status: r.status,
                action_id: Some(r.action_id.as_str()),
                plan_id: None,
                page_size: r.page_size,
            };
            // ListJobs requires an action id (validated by object_id too).
            check_search(filter, r.action_id.is_empty(), res);
        }
        3 => {
            let Ok(r) = pb::PeekQueueRequest::decode(bytes) else {
                return;
            };
            let refused = r.count > 1000 || !["", "ready", "scheduled"].contains(&r.queue.as_str());
            let res = h.peek_queue(r.clone());
            if refused {
                assert!(is_invalid(&res), "a refused peek got {res:?}");
            } else {
                let ids = res.expect("peek").job_ids;
                assert!(ids.len() <= if r.count == 0 { 10 } else { r.count as usize });
            }
        }
        _ => {
            let Ok(r) = pb::GetJobRequest::decode(bytes) else {
                return;
            };
            let id = r.job_id;
            let bad_object = validate::object_id("id", &id).is_err();
            let job = h.get_job(pb::GetJobRequest { job_id: id.clone() });
            let action = h.get_action(pb::GetActionRequest {
                action_id: id.clone(),
            });
            let plan = h.get_plan(pb::GetPlanRequest {
                plan_id: id.clone(),
                version: 0,
            });
            for (what, invalid) in [
                ("GetJob", is_invalid(&job)),
                ("GetAction", is_invalid(&action)),
                ("GetPlan", is_invalid(&plan)),
            ] {
                assert_eq!(invalid, bad_object, "{what} of {id:?}");
            }
            let worker = h.get_worker(pb::GetWorkerRequest {
                worker_id: id.clone(),
            });
            assert_eq!(
                is_invalid(&worker),
                validate::worker_id(&id).is_err(),
                "GetWorker of {id:?}"
            );
        }
    }
});
