//! The worker RPCs that carry data: the first byte picks the message, the
//! rest is decoded with prost, converted as its service converts it
//! (`service::convert`: `Registration`, `JobReport`) and handed to the
//! `Engine` call its service makes; outcomes are compared by gRPC code.
//!
//! - RegisterWorkerRequest: `validate::registration` (on the converted
//!   `Registration`) is idempotent (its output validates to itself) and
//!   bounds what it accepts; the RPC refuses exactly what it refuses.
//! - UpdateJobRequest / BatchUpdateJobsRequest: a report refused by the
//!   request checks gets INVALID_ARGUMENT. Reports whose job_id is "JOB"
//!   (and lease_id "LEASE") are pointed at a lease the harness's worker
//!   really holds, so the fuzzer drives real running/completed/failed
//!   transitions with arbitrary task results, progress and errors; the
//!   status each accepted report returns is the job's status read back.
#![no_main]

use agq::{
    core::{model::Registration, validate},
    pb,
    pb::JobStatus,
};
use agq_fuzz::{
    batch_result, code, harness, is_invalid, Harness, JOB_MAGIC, LEASE_MAGIC, WORKER_ID,
};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::{Code, Status};

fn register(h: &Harness, req: pb::RegisterWorkerRequest) {
    let checked = validate::registration(Registration::from(req.clone()));
    if let Ok(r) = &checked {
        assert_eq!(
            validate::registration(r.clone()).ok().as_ref(),
            Some(r),
            "registration is not idempotent"
        );
        assert!((1..=validate::MAX_CONCURRENT_JOBS).contains(&r.max_concurrent_jobs));
        let tools = &r.capabilities.tools;
        assert!(
            tools.windows(2).all(|w| w[0] < w[1]),
            "tools not sorted/unique"
        );
    }
    let res = h.register_worker(req.clone());
    match (&checked, code(&res)) {
        (Err(_), _) => assert!(is_invalid(&res), "a refused registration got {res:?}"),
        (Ok(_), Code::Ok) => {
            let w = h
                .get_worker(pb::GetWorkerRequest {
                    worker_id: req.worker_id.clone(),
                })
                .expect("read back the worker")
                .worker
                .expect("GetWorker returns the worker");
            assert_eq!(w.worker_id, req.worker_id);
            h.unregister_worker(pb::UnregisterWorkerRequest {
                worker_id: req.worker_id,
            })
            .expect("unregister");
        }
        (Ok(_), Code::AlreadyExists) => {}
        (Ok(_), _) => panic!("a valid registration failed: {res:?}"),
    }
}

/// Points a report at a real lease when it asks for one (see the module doc).
fn substitute(h: &Harness, r: &mut pb::UpdateJobRequest) -> Option<String> {
    if r.job_id != JOB_MAGIC {
        return None;
    }
    let lease = h.held_lease()?;
    let job_id = lease.job.as_ref()?.job_id.clone();
    r.job_id = job_id.clone();
    if r.lease_id == LEASE_MAGIC {
        r.lease_id = lease.lease_id;
    }
    Some(job_id)
}

fn refused_by_request_checks(r: &pb::UpdateJobRequest) -> bool {
    validate::object_id("job_id", &r.job_id).is_err()
        || validate::worker_id(&r.worker_id).is_err()
        || r.lease_id.is_empty()
        || r.lease_id.len() > 64
        || r.task_results.len() > validate::MAX_TASKS
}

/// Checks one report's outcome; forgets the lease when its attempt ended.
fn check_outcome(
    h: &Harness,
    r: &pb::UpdateJobRequest,
    real: Option<&String>,
    res: &Result<JobStatus, Status>,
) {
    if refused_by_request_checks(r) {
        assert!(is_invalid(res), "a refused report got {res:?}");
        return;
    }
    let Some(job_id) = real else {
        // Not a job this harness created: nothing can be found or held.
        assert!(
            res.is_err(),
            "a report on an unknown job was accepted: {res:?}"
        );
        return;
    };
    match (res, code(res)) {
        (Ok(after), _) => {
            let reported = JobStatus::try_from(r.status).unwrap_or(JobStatus::Unspecified);
            let allowed: &[JobStatus] = match reported {
                JobStatus::Running => &[JobStatus::Running],
                JobStatus::Completed => &[JobStatus::Completed],
                // Failed: backing off before the next attempt.
                JobStatus::Failed => &[JobStatus::Failed, JobStatus::Pending, JobStatus::Dead],
                other => panic!("a report of status {other:?} was accepted"),
            };
            assert!(
                allowed.contains(after),
                "{reported:?} report left the job {after:?}"
            );
        }
        (
            Err(_),
            Code::InvalidArgument
            | Code::PermissionDenied
            | Code::FailedPrecondition
            | Code::NotFound,
        ) => {}
        (Err(e), _) => panic!("a report failed unexpectedly: {e:?}"),
    }
    // The harness keeps only leases whose attempt is still running.
    if get_job(h, job_id).status != JobStatus::Running as i32 {
        h.drop_lease(job_id);
    }
}

fn get_job(h: &Harness, job_id: &str) -> pb::Job {
    h.get_job(pb::GetJobRequest {
        job_id: job_id.to_string(),
    })
    .expect("read back a leased job")
    .job
    .expect("GetJob returns the job")
}

fn read_back(h: &Harness, job_id: &str, last: JobStatus) {
    let job = get_job(h, job_id);
    assert_eq!(
        job.status, last as i32,
        "report said {last:?}, job is {job:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let h = harness();
    match which % 3 {
        0 => {
            if let Ok(req) = pb::RegisterWorkerRequest::decode(bytes) {
                register(h, req);
            }
        }
        1 => {
            let Ok(mut r) = pb::UpdateJobRequest::decode(bytes) else {
                return;
            };
            let real = substitute(h, &mut r);
            let res = h
                .update_job(r.clone())
                .map(|ok| JobStatus::try_from(ok.status).expect("UpdateJob returns a job status"));
            check_outcome(h, &r, real.as_ref(), &res);
            if let (Some(job_id), Ok(after)) = (&real, &res) {
                read_back(h, job_id, *after);
            }
        }
        _ => {
            let Ok(mut b) = pb::BatchUpdateJobsRequest::decode(bytes) else {
                return;
            };
            let real: Vec<_> = b.requests.iter_mut().map(|r| substitute(h, r)).collect();
            let refused = validate::worker_id(&b.worker_id).is_err()
                || b.requests.is_empty()
                || b.requests.len() > validate::MAX_BATCH_REPORTS
                || b.requests
                    .iter()
                    .any(|r| !r.worker_id.is_empty() && r.worker_id != b.worker_id);
            let res = h.batch_update_jobs(b.clone());
            if refused {
                assert!(is_invalid(&res), "a refused batch got {res:?}");
                return;
            }
            let results = res.expect("a well-formed batch").results;
            assert_eq!(results.len(), b.requests.len(), "one result per report");
            for ((r, job), res) in b.requests.iter_mut().zip(&real).zip(&results) {
                let res = &batch_result(res);
                if r.worker_id.is_empty() {
                    r.worker_id = b.worker_id.clone();
                }
                if r.worker_id == WORKER_ID || job.is_none() {
                    check_outcome(h, r, job.as_ref(), res);
                }
            }
        }
    }
});
