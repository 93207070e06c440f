//! `agq.v1.ScheduleService`: recurring schedules (an AGQ addition; the
//! firing itself is the engine's, see `crate::store::sqlite::schedules`).

use tonic::{Request, Response, Status};

use super::{convert, rpc};
use crate::{
    auth::{identity, require_client},
    core::SharedEngine,
    error::Error,
    pb::{self, schedule_service_server::ScheduleService},
};

/// The ScheduleService implementation.
pub struct ScheduleApi {
    /// The engine.
    pub engine: SharedEngine,
}

#[tonic::async_trait]
impl ScheduleService for ScheduleApi {
    async fn create_schedule(
        &self,
        req: Request<pb::CreateScheduleRequest>,
    ) -> Result<Response<pb::CreateScheduleResponse>, Status> {
        rpc(&self.engine, "ScheduleService/CreateSchedule", async {
            require_client(&identity(&req))?;
            let s = req
                .into_inner()
                .schedule
                .ok_or_else(|| Error::invalid("schedule is required"))?;
            let stored = self
                .engine
                .create_schedule(convert::schedule_request(s)?)
                .await?;
            Ok(pb::CreateScheduleResponse {
                schedule: Some(stored.into()),
            })
        })
        .await
    }

    async fn get_schedule(
        &self,
        req: Request<pb::GetScheduleRequest>,
    ) -> Result<Response<pb::GetScheduleResponse>, Status> {
        rpc(&self.engine, "ScheduleService/GetSchedule", async {
            require_client(&identity(&req))?;
            let s = self
                .engine
                .get_schedule(req.into_inner().schedule_id)
                .await?;
            Ok(pb::GetScheduleResponse {
                schedule: Some(s.into()),
            })
        })
        .await
    }

    async fn list_schedules(
        &self,
        req: Request<pb::ListSchedulesRequest>,
    ) -> Result<Response<pb::ListSchedulesResponse>, Status> {
        rpc(&self.engine, "ScheduleService/ListSchedules", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let page = self
                .engine
                .list_schedules(r.page_size, r.page_token)
                .await?;
            Ok(pb::ListSchedulesResponse {
                schedules: page.items.into_iter().map(pb::Schedule::from).collect(),
                next_page_token: page.next_page_token,
            })
        })
        .await
    }

    async fn pause_schedule(
        &self,
        req: Request<pb::PauseScheduleRequest>,
    ) -> Result<Response<pb::PauseScheduleResponse>, Status> {
        rpc(&self.engine, "ScheduleService/PauseSchedule", async {
            require_client(&identity(&req))?;
            let s = self
                .engine
                .set_schedule_paused(req.into_inner().schedule_id, true)
                .await?;
            Ok(pb::PauseScheduleResponse {
                schedule: Some(s.into()),
            })
        })
        .await
    }

    async fn resume_schedule(
        &self,
        req: Request<pb::ResumeScheduleRequest>,
    ) -> Result<Response<pb::ResumeScheduleResponse>, Status> {
        rpc(&self.engine, "ScheduleService/ResumeSchedule", async {
            require_client(&identity(&req))?;
            let s = self
                .engine
                .set_schedule_paused(req.into_inner().schedule_id, false)
                .await?;
            Ok(pb::ResumeScheduleResponse {
                schedule: Some(s.into()),
            })
        })
        .await
    }

    async fn delete_schedule(
        &self,
        req: Request<pb::DeleteScheduleRequest>,
    ) -> Result<Response<pb::DeleteScheduleResponse>, Status> {
        rpc(&self.engine, "ScheduleService/DeleteSchedule", async {
            require_client(&identity(&req))?;
            self.engine
                .delete_schedule(req.into_inner().schedule_id)
                .await?;
            Ok(pb::DeleteScheduleResponse {})
        })
        .await
    }
}
