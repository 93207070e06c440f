//! The worker's `{{name}}` templating (`agq::worker::template`), on what a
//! worker receives: a `JobLease` decoded from the fuzzer's bytes, every
//! task's arguments rendered with the job's input as `agw` does before it
//! runs anything.
#![no_main]

use agq::{pb, worker::template};
use agq_fuzz::check_render;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(lease) = pb::JobLease::decode(data) else {
        return;
    };
    let input = lease.job.map(|j| j.input).unwrap_or_default();
    let Some(plan) = lease.plan else {
        return;
    };
    for task in &plan.tasks {
        for arg in &task.args {
            check_render(arg, &input);
        }
        // render_all is render over every argument, stopping at the first error.
        let all = template::render_all(&task.args, &input);
        let one_by_one: Result<Vec<String>, _> = task
            .args
            .iter()
            .map(|a| template::render(a, &input))
            .collect();
        assert_eq!(all, one_by_one);
    }
});
