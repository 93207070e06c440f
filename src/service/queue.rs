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

/// The samples of a Prometheus (or OpenMetrics) text exposition as a JSON
/// array of `{"name", "labels", "value"}` objects, label values unescaped
/// (`\\`, `\"` and `\n` of the exposition format). Comment lines, and
/// lines that are not a sample, are skipped.
fn prometheus_text_to_json(text: &str) -> String {
    let samples: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(parse_sample)
        .map(|s| {
            let labels: serde_json::Map<String, serde_json::Value> = s
                .labels
                .into_iter()
                .map(|(k, v)| (k, serde_json::Value::String(v)))
                .collect();
            serde_json::json!({ "name": s.name, "labels": labels, "value": s.value })
        })
        .collect();
    serde_json::Value::Array(samples).to_string()
}

/// One sample of a text exposition.
struct Sample<'a> {
    /// The metric's name, with its suffix (`_total`, `_bucket`, ...).
    name: &'a str,
    /// The labels in order, their values unescaped.
    labels: Vec<(String, String)>,
    /// The value.
    value: f64,
}

/// The sample of one line, `name{key="value",...} value [timestamp]`;
/// None for a blank or malformed line.
fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        rest = body;
        loop {
            rest = rest.trim_start_matches([' ', ',']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = rest.split_once('=')?;
            let (value, after) = quoted(after.trim_start())?;
            labels.push((key.trim().to_string(), value));
            rest = after;
        }
    }
    let value = rest.split_ascii_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The label value at the start of `s` (`"..."`, with the escapes `\\`,
/// `\"` and `\n`) unescaped, and the text after its closing quote.
fn quoted(s: &str) -> Option<(String, &str)> {
    let mut chars = s.strip_prefix('"')?.char_indices();
    let mut value = String::new();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &s[1 + i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                e @ ('\\' | '"') => value.push(e),
                // not an escape of the format: kept as written
                e => {
                    value.push('\\');
                    value.push(e);
                }
            },
            c => value.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_unescaped_and_split_only_outside_quotes() {
        let text = "# HELP m x\n\
                    m{a=\"x\\\"y,q=a\\\\\",b=\"1\\n2 }\"} 3\n\
                    plain 4.5 1700000000\n\
                    empty{} 1\n\
                    broken{a=\"open 1\n";
        let v: serde_json::Value = serde_json::from_str(&prometheus_text_to_json(text)).unwrap();
        assert_eq!(
            v,
            serde_json::json!([
                {"name": "m", "labels": {"a": "x\"y,q=a\\", "b": "1\n2 }"}, "value": 3.0},
                {"name": "plain", "labels": {}, "value": 4.5},
                {"name": "empty", "labels": {}, "value": 1.0},
            ])
        );
    }
}
