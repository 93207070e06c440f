//! Executor tests that run real processes.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use super::*;
use crate::{
    pb::{Plan, Task},
    worker::tools::{ToolSet, DEFAULT_TOOLS},
};

fn executor(cap: usize) -> Executor {
    let tools = DEFAULT_TOOLS
        .iter()
        .copied()
        .chain(["sh", "yes", "tee", "awk", "sed", "xargs", "perl"]);
    Executor::new(Arc::new(ToolSet::from_env(tools)), cap)
}

fn task(n: u32, cmd: &str, args: &[&str], timeout: u32, from: Option<u32>) -> Task {
    Task {
        task_number: n,
        command: cmd.to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        timeout_secs: timeout,
        input_from_task: from,
        ..Default::default()
    }
}

fn plan(tasks: Vec<Task>) -> Plan {
    Plan {
        plan_id: "p".to_owned(),
        plan_description: String::new(),
        tasks,
        ..Default::default()
    }
}

fn input(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn run(ex: &Executor, plan: &Plan, input: &HashMap<String, String>) -> JobOutcome {
    let (_tx, rx) = abort_channel();
    ex.run(plan, input, rx, |_| {}).await
}

fn words_file(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("words.txt");
    let text = "pear\napple\nfig\napple\npear\napple\nkiwi\nfig\nbanana split\n\nünïcode\n";
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[tokio::test]
async fn pipeline_matches_shell() {
    let dir = tempfile::tempdir().unwrap();
    let file = words_file(&dir);
    let p = plan(vec![
        task(1, "sort", &["{{file}}"], 10, None),
        task(2, "uniq", &["-c"], 10, Some(1)),
        task(3, "sort", &["-rn"], 10, Some(2)),
    ]);
    let mut progress = Vec::new();
    let (_tx, rx) = abort_channel();
    let out = executor(DEFAULT_OUTPUT_CAP_BYTES)
        .run(&p, &input(&[("file", &file)]), rx, |s| progress.push(s))
        .await;
    assert!(out.success, "{}", out.error);
    let shell = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("sort '{file}' | uniq -c | sort -rn"))
        .output()
        .unwrap();
    assert_eq!(out.task_results.len(), 3);
    assert_eq!(
        out.task_results[2].stdout,
        String::from_utf8(shell.stdout).unwrap()
    );
    for (i, r) in out.task_results.iter().enumerate() {
        assert_eq!(r.task_number as usize, i + 1);
        assert_eq!(r.exit_code, 0);
        assert!(!r.stdout_truncated && !r.stderr_truncated);
    }
    assert_eq!(out.task_results[1].command, "uniq");
    let numbers: Vec<_> = progress.iter().map(|s| s.task_number).collect();
    assert_eq!(numbers, [1, 2, 3]);
    let percents: Vec<_> = progress.iter().map(|s| s.progress_percent).collect();
    assert_eq!(percents, [0, 33, 66]);
}

#[tokio::test]
async fn input_from_an_earlier_task_not_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let file = words_file(&dir);
    let p = plan(vec![
        task(1, "cat", &["{{file}}"], 10, None),
        task(2, "wc", &["-l"], 10, Some(1)),
        task(3, "tr", &["a-z", "A-Z"], 10, Some(1)),
        task(4, "head", &["-n", "2"], 10, Some(1)),
    ]);
    let out = run(
        &executor(DEFAULT_OUTPUT_CAP_BYTES),
        &p,
        &input(&[("file", &file)]),
    )
    .await;
    assert!(out.success, "{}", out.error);
    let content = std::fs::read_to_string(&file).unwrap();
    assert_eq!(out.task_results[1].stdout.trim(), "11");
    assert_eq!(out.task_results[2].stdout, content.to_ascii_uppercase());
    assert_eq!(out.task_results[3].stdout, "pear\napple\n");
}

#[tokio::test]
async fn no_input_means_empty_stdin() {
    let p = plan(vec![task(1, "wc", &["-c"], 10, None)]);
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    assert_eq!(out.task_results[0].stdout.trim(), "0");
}

#[tokio::test]
async fn timeout_kills_the_task() {
    let p = plan(vec![task(1, "sleep", &["30"], 1, None)]);
    let start = Instant::now();
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(!out.success);
    assert_eq!(out.error, "task 1 (sleep) timed out after 1 s");
    assert_eq!(out.task_results[0].exit_code, -1);
    assert!(out.task_results[0].duration_ms >= 1000);
}

#[tokio::test]
async fn a_task_that_ended_before_its_deadline_did_not_time_out_when_agw_was_held_past_it() {
    // agw stopped (SIGSTOP, a paused VM) or starved past a task's deadline
    // finds its end and the deadline at once: the task ended on its own.
    let p = plan(vec![task(1, "sleep", &["0.2"], 1, None)]);
    let ex = executor(DEFAULT_OUTPUT_CAP_BYTES);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let mut started_tx = Some(started_tx);
    let held = async {
        let _ = started_rx.await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The test's runtime has one thread: the executor is held too.
        std::thread::sleep(Duration::from_millis(1500));
    };
    let none = input(&[]);
    let (_abort, rx) = abort_channel();
    let job = ex.run(&p, &none, rx, |_| {
        if let Some(tx) = started_tx.take() {
            let _ = tx.send(());
        }
    });
    let (out, ()) = tokio::join!(job, held);
    assert!(
        out.task_results[0].duration_ms >= 1000,
        "the task did not run across the hold: {:?}",
        out.task_results
    );
    assert!(out.success, "{}", out.error);
    assert_eq!(out.task_results[0].exit_code, 0);
}

/// True when `pid` is gone or a zombie waiting for a reaper.
fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
    }
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() {
    // The shell starts a background sleep, prints its pid and waits: the
    // timeout must kill the child too, not only the shell.
    let p = plan(vec![task(
        1,
        "sh",
        &["-c", "sleep 30 & echo $!; wait"],
        1,
        None,
    )]);
    let start = Instant::now();
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(out.error, "task 1 (sh) timed out after 1 s");
    // The output written before the kill is kept.
    let child: i32 = out.task_results[0].stdout.trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !is_dead(child) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        is_dead(child),
        "background sleep {child} survived the timeout"
    );
}

#[tokio::test]
async fn background_children_die_with_their_task() {
    // The shell exits at once but leaves a sleep holding its stdout: the
    // task still ends at once, and the sleep is killed.
    let p = plan(vec![task(1, "sh", &["-c", "sleep 30 & echo $!"], 20, None)]);
    let start = Instant::now();
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    assert!(start.elapsed() < Duration::from_secs(5));
    let child: i32 = out.task_results[0].stdout.trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !is_dead(child) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(is_dead(child), "background sleep {child} outlived its task");
}

#[tokio::test]
async fn output_held_open_past_the_grace_is_flagged_cut() {
    // A process that left the task's group keeps its stdout open: reading
    // stops after the grace and the output says it may be incomplete; a
    // task whose output closed with it is not flagged.
    let p = plan(vec![
        task(
            1,
            "perl",
            &[
                "-MPOSIX",
                "-e",
                // The parent waits until the child left the group (else the
                // group's kill at the parent's exit could still reach it).
                "pipe(R, W) or die; if (fork == 0) { close R; POSIX::setsid(); close W; \
                 sleep 8; exit 0 } close W; my $x = <R>; print \"started\\n\"",
            ],
            20,
            None,
        ),
        task(2, "sh", &["-c", "echo done"], 20, None),
    ]);
    let start = Instant::now();
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "{:?}",
        start.elapsed()
    );
    let first = &out.task_results[0];
    assert_eq!(first.stdout, "started\n");
    assert!(first.stdout_truncated, "cut at the grace, not flagged");
    assert!(first.stderr_truncated, "stderr was held open too");
    assert!(!out.task_results[1].stdout_truncated);
}

#[tokio::test]
async fn unadvertised_command_is_refused_and_nothing_runs() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("marker");
    let p = plan(vec![
        task(1, "tee", &["{{out}}"], 10, None),
        task(2, "rm", &["-rf", "{{out}}"], 10, None),
    ]);
    let out = run(
        &executor(DEFAULT_OUTPUT_CAP_BYTES),
        &p,
        &input(&[("out", marker.to_str().unwrap())]),
    )
    .await;
    assert!(!out.success);
    assert!(
        out.error
            .contains("command \"rm\" is not advertised by this worker"),
        "{}",
        out.error
    );
    assert!(out.task_results.is_empty());
    assert!(!marker.exists(), "task 1 ran although task 2 was refused");
}

#[tokio::test]
async fn missing_template_variable_fails_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("marker");
    let p = plan(vec![
        task(1, "tee", &["{{out}}"], 10, None),
        task(2, "grep", &["{{pattern}}", "{{file}}"], 10, None),
    ]);
    let out = run(
        &executor(DEFAULT_OUTPUT_CAP_BYTES),
        &p,
        &input(&[("out", marker.to_str().unwrap())]),
    )
    .await;
    assert!(!out.success);
    assert_eq!(
        out.error,
        "task 2 (grep): job input has no value for template variable \"{{pattern}}\""
    );
    assert!(out.task_results.is_empty());
    assert!(!marker.exists());
}

#[tokio::test]
async fn output_is_capped_but_the_next_task_gets_all_of_it() {
    let p = plan(vec![
        task(1, "seq", &["1", "100000"], 10, None),
        task(2, "wc", &["-l"], 10, Some(1)),
        task(3, "sh", &["-c", "seq 1 100000 >&2"], 10, None),
    ]);
    let out = run(&executor(1000), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    let r1 = &out.task_results[0];
    assert_eq!(r1.stdout.len(), 1000);
    assert!(r1.stdout.starts_with("1\n2\n3\n"));
    assert!(r1.stdout_truncated);
    assert!(!r1.stderr_truncated);
    assert_eq!(out.task_results[1].stdout.trim(), "100000");
    assert!(!out.task_results[1].stdout_truncated);
    let r3 = &out.task_results[2];
    assert_eq!(r3.stderr.len(), 1000);
    assert!(r3.stderr_truncated);
    assert!(r3.stdout.is_empty());
}

#[tokio::test]
async fn a_large_output_does_not_block_the_task() {
    // 15 MB of stdout with a 100-byte cap: the rest is drained, not blocked
    // on, and the next task still gets all of it.
    let p = plan(vec![
        task(1, "seq", &["1", "2000000"], 20, None),
        task(2, "head", &["-n", "5"], 10, Some(1)),
    ]);
    let out = run(&executor(100), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    assert_eq!(out.task_results[1].stdout, "1\n2\n3\n4\n5\n");
}

#[tokio::test]
async fn truncation_keeps_utf8_whole() {
    // "é" is two bytes; a cap of 3 would cut the second one in half.
    let p = plan(vec![task(1, "printf", &["éé"], 10, None)]);
    let out = run(&executor(3), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    assert_eq!(out.task_results[0].stdout, "é");
    assert!(out.task_results[0].stdout_truncated);
}

#[tokio::test]
async fn output_that_is_not_utf8_stays_within_the_cap() {
    // Each 0xff byte decodes to U+FFFD, three bytes: 100 of them would be
    // 300 bytes of text.
    let p = plan(vec![task(
        1,
        "sh",
        &["-c", "head -c 100 /dev/zero | tr '\\0' '\\377'"],
        10,
        None,
    )]);
    let out = run(&executor(100), &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    let r = &out.task_results[0];
    assert!(r.stdout.len() <= 100, "{} bytes", r.stdout.len());
    assert_eq!(r.stdout, "\u{fffd}".repeat(33));
    assert!(r.stdout_truncated);
}

#[tokio::test]
async fn non_zero_exit_names_the_task_and_quotes_stderr() {
    let p = plan(vec![
        task(1, "echo", &["hello"], 10, None),
        task(2, "grep", &["nomatch"], 10, Some(1)),
        task(3, "echo", &["never"], 10, None),
    ]);
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(!out.success);
    assert_eq!(out.error, "task 2 (grep) exited with code 1");
    assert_eq!(out.task_results.len(), 2);
    assert_eq!(out.task_results[1].exit_code, 1);

    let p = plan(vec![task(1, "cat", &["/nonexistent/agw-test"], 10, None)]);
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(
        out.error
            .starts_with("task 1 (cat) exited with code 1: cat: "),
        "{}",
        out.error
    );
    assert!(out.error.contains("/nonexistent/agw-test"));
}

#[tokio::test]
async fn stderr_quote_is_bounded() {
    let p = plan(vec![task(
        1,
        "sh",
        &["-c", "seq 1 5000 >&2; exit 3"],
        10,
        None,
    )]);
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert!(out
        .error
        .starts_with("task 1 (sh) exited with code 3: 1\n2\n"));
    assert!(out.error.len() < ERROR_STDERR_QUOTE_BYTES + 100);
    assert!(out.error.ends_with('…'));
}

#[tokio::test]
async fn killed_by_signal_is_reported() {
    let p = plan(vec![task(1, "sh", &["-c", "kill -9 $$"], 10, None)]);
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert_eq!(out.error, "task 1 (sh) was killed by signal SIGKILL");
    assert_eq!(out.task_results[0].exit_code, -1);
}

#[tokio::test]
async fn abort_kills_the_running_task() {
    let ex = executor(DEFAULT_OUTPUT_CAP_BYTES);
    let p = plan(vec![
        task(1, "echo", &["one"], 10, None),
        task(2, "sleep", &["30"], 60, None),
        task(3, "echo", &["never"], 10, None),
    ]);
    let (tx, rx) = abort_channel();
    let start = Instant::now();
    let job = {
        let ex = ex.clone();
        tokio::spawn(async move { ex.run(&p, &HashMap::new(), rx, |_| {}).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ex.process_groups().len(), 1);
    tx.send_replace(Some(AbortReason::Cancelled));
    let out = job.await.unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(out.error, "cancelled");
    assert_eq!(out.aborted, Some(AbortReason::Cancelled));
    assert_eq!(out.task_results.len(), 2);
    assert!(ex.process_groups().is_empty());
}

#[tokio::test]
async fn input_from_a_later_task_is_rejected() {
    let p = plan(vec![
        task(1, "cat", &[], 10, Some(2)),
        task(2, "echo", &["x"], 10, None),
    ]);
    let out = run(&executor(DEFAULT_OUTPUT_CAP_BYTES), &p, &input(&[])).await;
    assert_eq!(
        out.error,
        "task 1 (cat): input_from_task 2 is not an earlier task"
    );
    assert!(out.task_results.is_empty());
}

/// Fitting the results to the budget after each task keeps what one fit
/// of all of them at the end keeps.
#[test]
fn fitting_as_tasks_end_keeps_what_one_fit_at_the_end_keeps() {
    let sizes = [
        [5000, 10],
        [200, 3000],
        [7000, 7000],
        [50, 0],
        [2500, 900],
        [12000, 1],
    ];
    let result = |n: usize, [out, err]: [usize; 2]| TaskResult {
        task_number: n as u32 + 1,
        stdout: "o".repeat(out),
        stderr: "e".repeat(err),
        ..Default::default()
    };
    for budget in [100, 4000, 9000, 20000, 40000, 100_000] {
        let mut at_once: Vec<TaskResult> = sizes
            .iter()
            .enumerate()
            .map(|(n, s)| result(n, *s))
            .collect();
        fit_to_budget(&mut at_once, budget);
        let mut as_they_end = Vec::new();
        for (n, s) in sizes.iter().enumerate() {
            as_they_end.push(result(n, *s));
            fit_to_budget(&mut as_they_end, budget);
        }
        assert_eq!(as_they_end, at_once, "budget {budget}");
    }
}

#[test]
fn fit_to_budget_cuts_the_largest_first() {
    let r = |out: usize, err: usize| TaskResult {
        stdout: "a".repeat(out),
        stderr: "b".repeat(err),
        ..Default::default()
    };
    let mut results = vec![r(10, 0), r(1000, 5), r(500, 0)];
    fit_to_budget(&mut results, 415);
    assert_eq!(results[0].stdout.len(), 10);
    assert_eq!(results[1].stderr.len(), 5);
    assert_eq!(results[1].stdout.len(), 200);
    assert_eq!(results[2].stdout.len(), 200);
    assert!(results[1].stdout_truncated && results[2].stdout_truncated);
    assert!(!results[0].stdout_truncated && !results[1].stderr_truncated);

    let mut small = vec![r(3, 3)];
    fit_to_budget(&mut small, 100);
    assert_eq!(small[0].stdout.len(), 3);
    assert!(!small[0].stdout_truncated);
}

/// A stdout that later tasks read goes to a file in the spill directory,
/// not the worker's memory: two later tasks each read all of it (each from
/// the start), and the file is gone once the job ended.
#[tokio::test]
async fn a_piped_output_is_spilled_to_a_file_and_removed_after_the_job() {
    let spill = tempfile::tempdir().unwrap();
    let ex = executor(100).with_spill_dir(spill.path().to_path_buf());
    let p = plan(vec![
        task(1, "head", &["-c", "50000000", "/dev/zero"], 30, None),
        task(2, "wc", &["-c"], 30, Some(1)),
        task(3, "wc", &["-c"], 30, Some(1)),
    ]);
    let out = run(&ex, &p, &input(&[])).await;
    assert!(out.success, "{}", out.error);
    assert_eq!(out.task_results[1].stdout.trim(), "50000000");
    assert_eq!(out.task_results[2].stdout.trim(), "50000000");
    assert!(out.task_results[0].stdout_truncated);
    let left: Vec<_> = std::fs::read_dir(spill.path()).unwrap().collect();
    assert!(left.is_empty(), "spill files left behind: {left:?}");
}

/// A spill file that cannot be created fails the task that needed it,
/// with the reason, before it runs.
#[tokio::test]
async fn a_spill_file_that_cannot_be_created_fails_the_job() {
    let spill = tempfile::tempdir().unwrap();
    let ex = executor(100).with_spill_dir(spill.path().join("missing"));
    let p = plan(vec![
        task(1, "seq", &["1", "3"], 10, None),
        task(2, "wc", &["-l"], 10, Some(1)),
    ]);
    let out = run(&ex, &p, &input(&[])).await;
    assert!(!out.success);
    assert!(
        out.error
            .starts_with("task 1 (seq) could not be started: cannot open its input or output file"),
        "{}",
        out.error
    );
    assert_eq!(out.task_results.len(), 1);
}
