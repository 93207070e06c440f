//! `agq.v1.ActionService`: the ACTION.SUBMIT and ACTION.STATUS commands of
//! the specification, and WatchAction, a server stream of an action's
//! progress.

use std::pin::Pin;

use futures_util::Stream;
use tonic::{Request, Response, Status};

use super::{rpc, rpc_traced};
use crate::{
    auth::{identity, require_client},
    core::{model::ActionStatus, SharedEngine},
    pb::{self, action_service_server::ActionService},
    service::convert::{action_request, list_actions_query, status_filter},
    telemetry,
};

/// The ActionService implementation.
pub struct ActionApi {
    /// The engine.
    pub engine: SharedEngine,
    /// Resolves when the server shuts down; ends open watch streams.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
}

fn all_terminal(a: &ActionStatus) -> bool {
    a.completed + a.dead + a.cancelled >= a.total_jobs
}

#[tonic::async_trait]
impl ActionService for ActionApi {
    async fn submit_action(
        &self,
        req: Request<pb::SubmitActionRequest>,
    ) -> Result<Response<pb::SubmitActionResponse>, Status> {
        let remote = telemetry::extract(req.metadata());
        let passed_on = telemetry::traceparent_of(&remote);
        rpc_traced(&self.engine, "ActionService/SubmitAction", remote, async {
            require_client(&identity(&req))?;
            let mut action = action_request(req.into_inner())?;
            // The jobs' trace context: this RPC's span when spans are
            // exported, else the caller's context passed on unchanged.
            action.traceparent =
                telemetry::span_traceparent(&tracing::Span::current()).or(passed_on);
            let done = self.engine.submit_action(action).await?;
            Ok(pb::SubmitActionResponse {
                action_id: done.action_id,
                jobs_created: done.job_ids.len() as u32,
                job_ids: done.job_ids,
            })
        })
        .await
    }

    async fn get_action(
        &self,
        req: Request<pb::GetActionRequest>,
    ) -> Result<Response<pb::GetActionResponse>, Status> {
        rpc(&self.engine, "ActionService/GetAction", async {
            require_client(&identity(&req))?;
            let action = self.engine.get_action(req.into_inner().action_id).await?;
            Ok(pb::GetActionResponse {
                action: Some(action.into()),
            })
        })
        .await
    }

    async fn list_actions(
        &self,
        req: Request<pb::ListActionsRequest>,
    ) -> Result<Response<pb::ListActionsResponse>, Status> {
        rpc(&self.engine, "ActionService/ListActions", async {
            require_client(&identity(&req))?;
            let page = self
                .engine
                .list_actions(list_actions_query(req.into_inner())?)
                .await?;
            Ok(pb::ListActionsResponse {
                actions: page.items.into_iter().map(Into::into).collect(),
                next_page_token: page.next_page_token,
            })
        })
        .await
    }

    async fn cancel_action(
        &self,
        req: Request<pb::CancelActionRequest>,
    ) -> Result<Response<pb::CancelActionResponse>, Status> {
        rpc(&self.engine, "ActionService/CancelAction", async {
            require_client(&identity(&req))?;
            let (cancelled, action) = self
                .engine
                .cancel_action(req.into_inner().action_id)
                .await?;
            Ok(pb::CancelActionResponse {
                cancelled,
                action: Some(action.into()),
            })
        })
        .await
    }

    async fn retry_action(
        &self,
        req: Request<pb::RetryActionRequest>,
    ) -> Result<Response<pb::RetryActionResponse>, Status> {
        rpc(&self.engine, "ActionService/RetryAction", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let status = status_filter(r.status)?;
            let (retried, action) = self.engine.retry_action(r.action_id, status).await?;
            Ok(pb::RetryActionResponse {
                retried,
                action: Some(action.into()),
            })
        })
        .await
    }

    type WatchActionStream =
        Pin<Box<dyn Stream<Item = Result<pb::WatchActionResponse, Status>> + Send>>;

    async fn watch_action(
        &self,
        req: Request<pb::WatchActionRequest>,
    ) -> Result<Response<Self::WatchActionStream>, Status> {
        rpc(&self.engine, "ActionService/WatchAction", async {
            require_client(&identity(&req))?;
            let connection = req.remote_addr();
            let action_id = req.into_inner().action_id;
            // Fails with INVALID_ARGUMENT / RESOURCE_EXHAUSTED before
            // anything is registered; the subscription is given back when
            // this call fails or its stream ends (dropped with the task).
            let mut changes = self.engine.watch_action(&action_id, connection)?;
            changes.mark_seen();
            // Fails with NOT_FOUND before the stream starts.
            let first = self.engine.get_action(action_id.clone()).await?;
            let engine = self.engine.clone();
            let mut shutdown = self.shutdown.clone();
            let stream = async_stream(move |tx| async move {
                let mut current = first;
                loop {
                    let done = all_terminal(&current);
                    if tx.send(Ok(pb::WatchActionResponse { action: Some(current.clone().into()) })).await.is_err() || done {
                        return;
                    }
                    // A re-read that finds the action as it was last sent
                    // sends nothing.
                    loop {
                        let stopping = tokio::select! {
                            changed = changes.changed() => if changed.is_err() { return } else { false },
                            r = shutdown.wait_for(|s| *s) => r.is_ok(),
                            // The client went away: end now, not at the next change.
                            () = tx.closed() => return,
                        };
                        if stopping {
                            let _ = tx.send(Err(Status::unavailable("the server is shutting down"))).await;
                            return;
                        }
                        let read = || engine.get_action(action_id.clone());
                        match changes.current(read).await {
                            Ok(a) if a == current => {}
                            Ok(a) => {
                                current = a;
                                break;
                            }
                            Err(e) => {
                                let _ = tx.send(Err(e.into())).await;
                                return;
                            }
                        }
                    }
                }
            });
            Ok(stream)
        })
        .await
    }
}

/// A boxed stream fed by a task that gets the sender half of a channel.
fn async_stream<T, F, Fut>(f: F) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<Result<T, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
