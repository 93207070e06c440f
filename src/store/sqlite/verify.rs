//! Capability verification (WORKER.VERIFY) in the SQLite engine: the
//! server challenges a worker over its heartbeat stream to run one of its
//! tools or agentic units with fixed arguments, and records the answer.
//! A Plan with `require_verified_tools` runs only on workers that passed
//! a verification of each of its commands ([`super::state::PlanEntry::runs_on`]);
//! the server challenges such workers itself when their heartbeat stream
//! opens and when such a Plan is stored.

use rusqlite::Connection;

use super::{
    sql::workers as wstore,
    state::{PlanEntry, State},
};
use crate::{
    core::model::{Verification, VerificationAnswer, WorkerCommand, MAX_VERIFY_OUTPUT},
    error::{Error, Result},
    time::now_ms,
};

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

impl State {
    /// Sends worker `worker_id` again, on its heartbeat stream, the
    /// challenges it has not answered: one sent on an earlier stream may
    /// have been lost with it. Same challenge ids: an answer to either copy
    /// settles the challenge, a second answer is ignored.
    pub(super) fn resend_pending(&mut self, worker_id: &str) {
        let Some(w) = self.workers.get(worker_id) else {
            return;
        };
        let again: Vec<WorkerCommand> = w
            .pending
            .values()
            .map(|v| WorkerCommand::Verify {
                challenge_id: v.challenge_id.clone(),
                command: v.tool.clone(),
                args: v.args.clone(),
            })
            .collect();
        for cmd in again {
            self.command(worker_id, cmd);
        }
    }

    /// The arguments of a challenge that names none: `--describe` for an
    /// agentic unit of worker `worker_id`, `--version` for a tool.
    fn default_challenge_args(&self, worker_id: &str, command: &str) -> Vec<String> {
        let unit = self
            .workers
            .get(worker_id)
            .is_some_and(|w| w.info.capabilities.units.iter().any(|u| u.name == command));
        vec![if unit { "--describe" } else { "--version" }.to_string()]
    }

    /// Sends worker `worker_id` a challenge to run `command` with `args`
    /// (replacing a pending challenge of the same command) and returns the
    /// pending verification; `None` when the worker has no heartbeat
    /// stream.
    fn challenge(
        &mut self,
        worker_id: &str,
        command: &str,
        args: Vec<String>,
    ) -> Option<Verification> {
        let w = self.workers.get_mut(worker_id)?;
        w.heartbeat.as_ref()?;
        w.pending.retain(|_, v| v.tool != command);
        let v = Verification {
            tool: command.to_string(),
            args: args.clone(),
            challenge_id: uuid::Uuid::new_v4().to_string(),
            requested_at_ms: now_ms(),
            answered_at_ms: None,
            passed: false,
            exit_code: -1,
            output: String::new(),
            error: String::new(),
        };
        w.pending.insert(v.challenge_id.clone(), v.clone());
        self.command(
            worker_id,
            WorkerCommand::Verify {
                challenge_id: v.challenge_id.clone(),
                command: command.to_string(),
                args,
            },
        );
        tracing::info!(worker_id, command, challenge_id = %v.challenge_id, "capability challenge sent");
        Some(v)
    }

    /// Challenges worker `worker_id` (VerifyWorker) to run `command` with
    /// `args` (empty: the default arguments).
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (not live, command not
    /// advertised, no heartbeat stream).
    pub(super) fn verify_worker(
        &mut self,
        worker_id: &str,
        command: &str,
        args: Vec<String>,
    ) -> Result<Verification> {
        let w = self
            .workers
            .get(worker_id)
            .ok_or_else(|| Error::not_found(format!("worker {worker_id} is not registered")))?;
        if !w.state.is_live() {
            return Err(Error::precondition(format!(
                "worker {worker_id} is {}; only a live worker can be challenged",
                w.state.name()
            )));
        }
        if !w.tools.contains(command) {
            return Err(Error::precondition(format!(
                "worker {worker_id} does not advertise {command:?} (neither a tool nor an agentic unit)"
            )));
        }
        let args = if args.is_empty() {
            self.default_challenge_args(worker_id, command)
        } else {
            args
        };
        self.challenge(worker_id, command, args).ok_or_else(|| {
            Error::precondition(format!(
                "worker {worker_id} has no heartbeat stream open to send the challenge on"
            ))
        })
    }

    /// Records worker `worker_id`'s answer to one of its challenges; an
    /// answer to no pending challenge (a stale or forged id) is ignored.
    ///
    /// Errors: storage errors.
    pub(super) fn answer_verification(
        &mut self,
        conn: &Connection,
        worker_id: &str,
        a: VerificationAnswer,
    ) -> Result<()> {
        let Some(w) = self.workers.get_mut(worker_id) else {
            return Ok(());
        };
        let Some(mut v) = w.pending.remove(&a.challenge_id) else {
            tracing::debug!(worker_id, challenge_id = %a.challenge_id, "answer to no pending challenge: ignored");
            return Ok(());
        };
        v.answered_at_ms = Some(now_ms());
        v.exit_code = a.exit_code;
        v.passed = a.exit_code == 0;
        v.output = cut(a.output, MAX_VERIFY_OUTPUT);
        v.error = if v.passed {
            String::new()
        } else if a.error.is_empty() {
            format!("exited with code {}", a.exit_code)
        } else {
            cut(a.error, MAX_VERIFY_OUTPUT)
        };
        wstore::put_verification(conn, worker_id, &v)?;
        tracing::info!(worker_id, command = %v.tool, passed = v.passed, "capability verification answered");
        w.verified.insert(v.tool.clone(), v);
        self.wants_dispatch = true;
        Ok(())
    }

    /// Challenges worker `worker_id` on every command it advertises that a
    /// plan version with `require_verified_tools` needs and that it has
    /// neither passed, failed nor a pending challenge for (a failed
    /// verification is not retried by itself: `agq worker verify` retries
    /// it). The versions are the latest of each plan and the older ones
    /// open jobs still run ([`State::old_plans`]): a job keeps its
    /// version's requirement after the plan is replaced by one without it.
    pub(super) fn challenge_missing(&mut self, worker_id: &str) {
        let Some(w) = self.workers.get(worker_id) else {
            return;
        };
        if !w.state.is_live() || w.heartbeat.is_none() {
            return;
        }
        let in_use: Vec<std::sync::Arc<PlanEntry>> = self
            .old_plans
            .values()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        let mut needed: Vec<String> = self
            .plans
            .values()
            .chain(in_use.iter())
            .filter(|p| p.plan.require_verified_tools)
            .flat_map(|p| p.tools.iter())
            .filter(|t| {
                w.tools.contains(*t)
                    && !w.verified.contains_key(*t)
                    && !w.pending.values().any(|v| &v.tool == *t)
            })
            .cloned()
            .collect();
        needed.sort();
        needed.dedup();
        for command in needed {
            let args = self.default_challenge_args(worker_id, &command);
            self.challenge(worker_id, &command, args);
        }
    }
}
