//! `agq.v1.QueueService`: the QUEUE.STATS, QUEUE.PEEK and METRICS commands
//! of the specification.

use tonic::{Request, Response, Status};

use super::rpc;
use crate::{
    auth::{identity, require_client},
    core::{engine::QueueName, SharedEngine},
    error::Error,
    pb::{self, queue_service_server::QueueService},
};

/// The QueueService implementation.
pub struct QueueApi {
    /// The engine.
    pub engine: SharedEngine,
}

#[tonic::async_trait]
impl QueueService for QueueApi {
    async fn get_queue_stats(
        &self,
        req: Request<pb::GetQueueStatsRequest>,
    ) -> Result<Response<pb::GetQueueStatsResponse>, Status> {
        rpc(&self.engine, "QueueService/GetQueueStats", async {
            require_client(&identity(&req))?;
            Ok(self.engine.queue_stats().await?.into())
        })
        .await
    }

    async fn peek_queue(
        &self,
        req: Request<pb::PeekQueueRequest>,
    ) -> Result<Response<pb::PeekQueueResponse>, Status> {
        rpc(&self.engine, "QueueService/PeekQueue", async {
            require_client(&identity(&req))?;
            let r = req.into_inner();
            let queue = match r.queue.as_str() {
                "" | "ready" => QueueName::Ready,
                "scheduled" => QueueName::Scheduled,
                q => {
                    return Err(Error::invalid(format!(
                        "queue must be \"ready\" or \"scheduled\", got {q:?}"
                    ))
                    .into())
                }
            };
            let job_ids = self.engine.peek_queue(queue, r.count).await?;
            Ok(pb::PeekQueueResponse { job_ids })
        })
        .await
    }

    async fn get_metrics(
        &self,
        req: Request<pb::GetMetricsRequest>,
    ) -> Result<Response<pb::GetMetricsResponse>, Status> {
        rpc(&self.engine, "QueueService/GetMetrics", async {
            require_client(&identity(&req))?;
            let format = req.into_inner().format;
            let text = self.engine.metrics_text().await?;
            let body = match format.as_str() {
                "" | "prometheus" => text,
                "json" => prometheus_text_to_json(&text),
                f => {
                    return Err(Error::invalid(format!(
                        "format must be \"prometheus\" or \"json\", got {f:?}"
                    ))
                    .into())
                }
            };
            Ok(pb::GetMetricsResponse { body })
        })
        .await
    }
}

/// The samples of a Prometheus text exposition as a JSON array of
/// `{"name", "labels", "value"}` objects.
fn prometheus_text_to_json(text: &str) -> String {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = match value.parse() {
            Ok(v) => v,
            Err(_) => continue,
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = serde_json::Map::new();
        for pair in split_labels(labels) {
            if let Some((k, v)) = pair.split_once('=') {
                map.insert(
                    k.to_string(),
                    serde_json::Value::String(v.trim_matches('"').to_string()),
                );
            }
        }
        samples.push(serde_json::json!({ "name": name, "labels": map, "value": value }));
    }
    serde_json::Value::Array(samples).to_string()
}

fn split_labels(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}
