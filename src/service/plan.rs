//! `agq.v1.PlanService` (seed: PLAN.SUBMIT, PLAN.GET, PLAN.LIST, PLAN.DELETE).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::rpc;
use crate::{
    auth::{identity, require_client},
    core::Engine,
    pb::{self, plan_service_server::PlanService},
};

/// The PlanService implementation.
pub struct PlanApi {
    /// The core.
    pub engine: Arc<Engine>,
}

#[tonic::async_trait]
impl PlanService for PlanApi {
    async fn submit_plan(
        &self,
        req: Request<pb::SubmitPlanRequest>,
    ) -> Result<Response<pb::SubmitPlanResponse>, Status> {
        rpc(&self.engine, "PlanService/SubmitPlan", async {
            require_client(&identity(&req))?;
            let plan_id = self.engine.submit_plan(req.into_inner().plan).await?;
            Ok(pb::SubmitPlanResponse { plan_id })
        })
        .await
    }

    async fn get_plan(
        &self,
        req: Request<pb::GetPlanRequest>,
    ) -> Result<Response<pb::GetPlanResponse>, Status> {
        rpc(&self.engine, "PlanService/GetPlan", async {
            require_client(&identity(&req))?;
            let plan = self.engine.get_plan(req.into_inner().plan_id).await?;
            Ok(pb::GetPlanResponse { plan: Some(plan) })
        })
        .await
    }

    async fn list_plans(
        &self,
        req: Request<pb::ListPlansRequest>,
    ) -> Result<Response<pb::ListPlansResponse>, Status> {
        rpc(&self.engine, "PlanService/ListPlans", async {
            require_client(&identity(&req))?;
            Ok(self.engine.list_plans(req.into_inner()).await?)
        })
        .await
    }

    async fn delete_plan(
        &self,
        req: Request<pb::DeletePlanRequest>,
    ) -> Result<Response<pb::DeletePlanResponse>, Status> {
        rpc(&self.engine, "PlanService/DeletePlan", async {
            require_client(&identity(&req))?;
            self.engine.delete_plan(req.into_inner().plan_id).await?;
            Ok(pb::DeletePlanResponse { deleted: true })
        })
        .await
    }
}
