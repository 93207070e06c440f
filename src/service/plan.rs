//! `agq.v1.PlanService`: the PLAN.SUBMIT, PLAN.GET, PLAN.LIST and
//! PLAN.DELETE commands of the specification, with plan versions
//! (SubmitPlan's `replace`, GetPlan's `version`, ListPlanVersions).

use tonic::{Request, Response, Status};

use super::rpc;
use crate::{
    auth::{identity, require_client},
    core::{
        engine::{PlanQuery, PlanVersionQuery},
        SharedEngine,
    },
    error::Error,
    pb::{self, plan_service_server::PlanService},
};

/// The PlanService implementation.
pub struct PlanApi {
    /// The engine.
    pub engine: SharedEngine,
}

#[tonic::async_trait]
impl PlanService for PlanApi {
    async fn submit_plan(
        &self,
        req: Request<pb::SubmitPlanRequest>,
    ) -> Result<Response<pb::SubmitPlanResponse>, Status> {
        rpc(&self.engine, "PlanService/SubmitPlan", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let plan = r.plan.ok_or_else(|| Error::invalid("plan is required"))?;
            let stored = self.engine.submit_plan(plan.into(), r.replace).await?;
            Ok(pb::SubmitPlanResponse {
                plan_id: stored.plan_id,
                version: stored.version,
                created: stored.created,
            })
        })
        .await
    }

    async fn get_plan(
        &self,
        req: Request<pb::GetPlanRequest>,
    ) -> Result<Response<pb::GetPlanResponse>, Status> {
        rpc(&self.engine, "PlanService/GetPlan", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let version = (r.version != 0).then_some(r.version);
            let plan = self.engine.get_plan(r.plan_id, version).await?;
            Ok(pb::GetPlanResponse {
                plan: Some(pb::Plan::from(&plan)),
            })
        })
        .await
    }

    async fn list_plans(
        &self,
        req: Request<pb::ListPlansRequest>,
    ) -> Result<Response<pb::ListPlansResponse>, Status> {
        rpc(&self.engine, "PlanService/ListPlans", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let page = self
                .engine
                .list_plans(PlanQuery {
                    pattern: r.pattern,
                    page_size: r.page_size,
                    page_token: r.page_token,
                })
                .await?;
            Ok(pb::ListPlansResponse {
                plan_ids: page.items.iter().map(|p| p.plan_id.clone()).collect(),
                plans: page.items.into_iter().map(pb::PlanSummary::from).collect(),
                next_page_token: page.next_page_token,
            })
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

    async fn list_plan_versions(
        &self,
        req: Request<pb::ListPlanVersionsRequest>,
    ) -> Result<Response<pb::ListPlanVersionsResponse>, Status> {
        rpc(&self.engine, "PlanService/ListPlanVersions", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let page = self
                .engine
                .list_plan_versions(PlanVersionQuery {
                    plan_id: r.plan_id,
                    page_size: r.page_size,
                    page_token: r.page_token,
                })
                .await?;
            Ok(pb::ListPlanVersionsResponse {
                versions: page.items.into_iter().map(pb::PlanVersion::from).collect(),
                next_page_token: page.next_page_token,
            })
        })
        .await
    }
}
