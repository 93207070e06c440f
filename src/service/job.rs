//! `agq.v1.JobService`: the JOB.STATUS, JOB.LIST, JOBS.SEARCH and JOB.RETRY
//! commands of the specification, and CancelJob.

use tonic::{Request, Response, Status};

use super::{
    convert::{list_jobs_query, search_jobs_query},
    rpc,
};
use crate::{
    auth::{identity, require_client},
    core::SharedEngine,
    pb::{self, job_service_server::JobService},
};

/// The JobService implementation.
pub struct JobApi {
    /// The engine.
    pub engine: SharedEngine,
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
            Ok(pb::GetJobResponse {
                job: Some(job.into()),
            })
        })
        .await
    }

    async fn list_jobs(
        &self,
        req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        rpc(&self.engine, "JobService/ListJobs", async {
            require_client(&identity(&req))?;
            let page = self
                .engine
                .search_jobs(list_jobs_query(req.into_inner())?)
                .await?;
            Ok(pb::ListJobsResponse {
                job_ids: page.items,
                next_page_token: page.next_page_token,
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
            let page = self
                .engine
                .search_jobs(search_jobs_query(req.into_inner())?)
                .await?;
            Ok(pb::SearchJobsResponse {
                job_ids: page.items,
                next_page_token: page.next_page_token,
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
            let req = req.into_inner();
            let job = self.engine.retry_job(req.job_id, req.priority).await?;
            Ok(pb::RetryJobResponse {
                job: Some(job.into()),
            })
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
            Ok(pb::CancelJobResponse {
                job: Some(job.into()),
            })
        })
        .await
    }
}
