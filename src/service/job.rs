//! `agq.v1.JobService` (seed: JOB.STATUS, JOB.LIST, JOBS.SEARCH, JOB.RETRY; CancelJob is new).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::rpc;
use crate::{
    auth::{identity, require_client},
    core::Engine,
    error::Error,
    pb::{self, job_service_server::JobService},
    store::jobs::JobFilter,
    time::ms_of,
};

/// The JobService implementation.
pub struct JobApi {
    /// The core.
    pub engine: Arc<Engine>,
}

fn status_filter(s: i32) -> Option<i32> {
    (s != pb::JobStatus::Unspecified as i32).then_some(s)
}

fn time_filter(what: &str, t: Option<prost_types::Timestamp>) -> Result<Option<i64>, Error> {
    t.map(|t| ms_of(&t).ok_or_else(|| Error::invalid(format!("{what} is not a valid timestamp"))))
        .transpose()
}

#[tonic::async_trait]
impl JobService for JobApi {
    async fn get_job(
        &self,
        req: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::GetJobResponse>, Status> {
        rpc(&self.engine, "JobService/GetJob", async {
            require_client(&identity(&req))?;
            let job = self.engine.get_job(req.into_inner().job_id).await?;
            Ok(pb::GetJobResponse { job: Some(job) })
        })
        .await
    }

    async fn list_jobs(
        &self,
        req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        rpc(&self.engine, "JobService/ListJobs", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            if r.action_id.is_empty() {
                return Err(Error::invalid("action_id is required").into());
            }
            let filter = JobFilter {
                action_id: Some(r.action_id),
                status: status_filter(r.status),
                ..Default::default()
            };
            let (job_ids, next_page_token) = self
                .engine
                .search_jobs(filter, r.page_size, r.page_token)
                .await?;
            Ok(pb::ListJobsResponse {
                job_ids,
                next_page_token,
            })
        })
        .await
    }

    async fn search_jobs(
        &self,
        req: Request<pb::SearchJobsRequest>,
    ) -> Result<Response<pb::SearchJobsResponse>, Status> {
        rpc(&self.engine, "JobService/SearchJobs", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let filter = JobFilter {
                action_id: None,
                status: status_filter(r.status),
                plan_id: (!r.plan_id.is_empty()).then_some(r.plan_id),
                created_after_ms: time_filter("created_after", r.created_after)?,
                created_before_ms: time_filter("created_before", r.created_before)?,
            };
            let (job_ids, next_page_token) = self
                .engine
                .search_jobs(filter, r.page_size, r.page_token)
                .await?;
            Ok(pb::SearchJobsResponse {
                job_ids,
                next_page_token,
            })
        })
        .await
    }

    async fn retry_job(
        &self,
        req: Request<pb::RetryJobRequest>,
    ) -> Result<Response<pb::RetryJobResponse>, Status> {
        rpc(&self.engine, "JobService/RetryJob", async {
            require_client(&identity(&req))?;
            let job = self.engine.retry_job(req.into_inner().job_id).await?;
            Ok(pb::RetryJobResponse { job: Some(job) })
        })
        .await
    }

    async fn cancel_job(
        &self,
        req: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        rpc(&self.engine, "JobService/CancelJob", async {
            require_client(&identity(&req))?;
            let job = self.engine.cancel_job(req.into_inner().job_id).await?;
            Ok(pb::CancelJobResponse { job: Some(job) })
        })
        .await
    }
}
