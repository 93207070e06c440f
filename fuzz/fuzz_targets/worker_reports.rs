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
//! - ReportJobs (a selector byte of 0xC0 or more): the next byte picks
//!   the caller's identity, the rest is up to 8 length-delimited
//!   ReportJobsRequests, sent in order on the service's own stream
//!   (`agq::service::report_stream`). The stream answers each request up
//!   to the first it refuses (a token that may not act for the stream's
//!   worker, another worker than the first request's, a refused batch:
//!   the answer is that status, with the code a model of the checks
//!   predicts) and ends there; an accepted request gets one result per
//!   report, each checked as BatchUpdateJobs' are; a job reported only at
//!   or after the refused request is left as it was.
#![no_main]

use std::collections::HashMap;

use agq::{
    auth::Identity,
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
        || r.lease_id.chars().any(char::is_control)
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

/// True when BatchUpdateJobs (and a ReportJobs request) refuses the
/// whole batch: a bad worker id, no reports or too many, a report naming
/// another worker.
fn batch_refused(worker_id: &str, requests: &[pb::UpdateJobRequest]) -> bool {
    validate::worker_id(worker_id).is_err()
        || requests.is_empty()
        || requests.len() > validate::MAX_BATCH_REPORTS
        || requests
            .iter()
            .any(|r| !r.worker_id.is_empty() && r.worker_id != worker_id)
}

/// Checks each report of an accepted batch of `worker_id` against its
/// result, as a client reads it.
fn check_batch(
    h: &Harness,
    worker_id: &str,
    requests: &mut [pb::UpdateJobRequest],
    real: &[Option<String>],
    results: &[pb::UpdateJobResult],
) {
    assert_eq!(results.len(), requests.len(), "one result per report");
    for ((r, job), res) in requests.iter_mut().zip(real).zip(results) {
        let res = &batch_result(res);
        if r.worker_id.is_empty() {
            r.worker_id = worker_id.to_string();
        }
        if r.worker_id == WORKER_ID || job.is_none() {
            check_outcome(h, r, job.as_ref(), res);
        }
    }
}

/// The identity a ReportJobs stream is opened with.
fn stream_identity(b: u8) -> Identity {
    match b % 5 {
        0 => Identity::Anonymous,
        1 => Identity::Worker(WORKER_ID.into()),
        2 => Identity::Worker("fuzz-other".into()),
        3 => Identity::WorkerPool("fuzz-".into()),
        _ => Identity::Client,
    }
}

/// The model of the role check: may `who` act for `worker_id`?
fn may_act(who: &Identity, worker_id: &str) -> bool {
    match who {
        Identity::Anonymous | Identity::Admin => true,
        Identity::Worker(w) => w == worker_id,
        Identity::WorkerPool(p) => worker_id.starts_with(p.as_str()),
        Identity::Client => false,
    }
}

/// The first request a ReportJobs stream must refuse, with its code.
fn first_refusal(who: &Identity, reqs: &[pb::ReportJobsRequest]) -> Option<(usize, Code)> {
    let mut bound: Option<&str> = None;
    for (i, m) in reqs.iter().enumerate() {
        match bound {
            Some(w) if w != m.worker_id => return Some((i, Code::InvalidArgument)),
            Some(_) => {}
            None => {
                if !may_act(who, &m.worker_id) {
                    return Some((i, Code::PermissionDenied));
                }
                bound = Some(&m.worker_id);
            }
        }
        if batch_refused(&m.worker_id, &m.requests) {
            return Some((i, Code::InvalidArgument));
        }
    }
    None
}

/// Most requests one ReportJobs input sends.
const MAX_STREAM_REQUESTS: usize = 8;

fn report_stream(h: &Harness, data: &[u8]) {
    let Some((&who, mut rest)) = data.split_first() else {
        return;
    };
    let who = stream_identity(who);
    let mut reqs = Vec::new();
    while !rest.is_empty() && reqs.len() < MAX_STREAM_REQUESTS {
        match pb::ReportJobsRequest::decode_length_delimited(&mut rest) {
            Ok(m) => reqs.push(m),
            Err(_) => break,
        }
    }
    if reqs.is_empty() {
        return;
    }
    let real: Vec<Vec<Option<String>>> = reqs
        .iter_mut()
        .map(|m| m.requests.iter_mut().map(|r| substitute(h, r)).collect())
        .collect();
    let refusal = first_refusal(&who, &reqs);
    let applied = refusal.map_or(reqs.len(), |(i, _)| i);
    // The running jobs reported only at or after the refusal, as they
    // were (a job that is not running may move on its own: a retry's
    // backoff ends, the dispatcher leases it again).
    let mut untouched: HashMap<String, pb::Job> = HashMap::new();
    for job_id in real[applied..].iter().flatten().flatten() {
        if !real[..applied]
            .iter()
            .flatten()
            .flatten()
            .any(|j| j == job_id)
        {
            let job = get_job(h, job_id);
            if job.status == JobStatus::Running as i32 {
                untouched.insert(job_id.clone(), job);
            }
        }
    }
    let answers = h.report_jobs(who, reqs.clone());
    let expected = refusal.map_or(reqs.len(), |(i, _)| i + 1);
    assert_eq!(
        answers.len(),
        expected,
        "{} requests, refusal {refusal:?}: {answers:?}",
        reqs.len()
    );
    for (i, answer) in answers.iter().enumerate() {
        match (refusal, answer) {
            (Some((k, want)), Err(s)) if k == i => {
                assert_eq!(s.code(), want, "request {i} refused with {s:?}")
            }
            (_, Ok(a)) if i < applied => {
                let m = &mut reqs[i];
                check_batch(h, &m.worker_id, &mut m.requests, &real[i], &a.results);
            }
            _ => panic!("request {i} (refusal {refusal:?}) answered {answer:?}"),
        }
    }
    for (job_id, before) in untouched {
        assert_eq!(
            get_job(h, &job_id),
            before,
            "a report read after the stream's refusal changed {job_id}"
        );
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
    if which >= 0xC0 {
        report_stream(h, bytes);
        return;
    }
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
            let refused = batch_refused(&b.worker_id, &b.requests);
            let res = h.batch_update_jobs(b.clone());
            if refused {
                assert!(is_invalid(&res), "a refused batch got {res:?}");
                return;
            }
            let results = res.expect("a well-formed batch").results;
            check_batch(h, &b.worker_id, &mut b.requests, &real, &results);
        }
    }
});
