//! Every `agq` client subcommand, run as the built binary against a real
//! `agq serve` process (and real `agw` workers where jobs must finish).
//! `--output json` is parsed and checked for real values; errors must print
//! the server's code and message and exit 1, usage errors exit 2.

mod cli_support;

use std::collections::BTreeSet;

use cli_support::{examples_dir, run_agq, sample_text, shell_top_words, write_file, Server};
use serde_json::Value;

fn example_plan() -> String {
    examples_dir()
        .join("word-frequency.plan.json")
        .to_str()
        .unwrap()
        .to_owned()
}

fn ids(v: &Value, list: &str, key: &str) -> Vec<String> {
    v[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list} in {v}"))
        .iter()
        .map(|x| x[key].as_str().unwrap().to_owned())
        .collect()
}

fn is_rfc3339(v: &Value) -> bool {
    v.as_str()
        .is_some_and(|s| humantime::parse_rfc3339(s).is_ok())
}

#[test]
fn help_lists_every_command_and_usage_errors_exit_2() {
    let help = run_agq(&["--help"], None, &[]);
    help.assert_ok();
    for cmd in [
        "serve", "plan", "action", "job", "worker", "queue", "metrics", "demo",
    ] {
        assert!(
            help.stdout.contains(cmd),
            "{cmd} missing from {}",
            help.stdout
        );
    }
    assert!(help.stdout.contains("--server"));
    run_agq(&["serve", "--help"], None, &[]).assert_ok();
    run_agq(&["plan"], None, &[]).assert_err(2, "Usage");
    run_agq(&["plan", "get"], None, &[]).assert_err(2, "PLAN_ID");
    run_agq(&["job", "list", "a", "--status", "nope"], None, &[]).assert_err(2, "invalid value");
    run_agq(&["-o", "yaml", "plan", "list"], None, &[]).assert_err(2, "invalid value");
    run_agq(&["--timeout", "0s", "plan", "list"], None, &[])
        .assert_err(2, "a zero deadline fails every call");
    run_agq(&["--timeout", "soon", "plan", "list"], None, &[]).assert_err(2, "invalid value");
    // A wait no clock can add is refused before any connection.
    run_agq(
        &[
            "--server",
            "http://127.0.0.1:1",
            "worker",
            "verify",
            "w",
            "sort",
            "--wait-secs",
            "18446744073709551615",
        ],
        None,
        &[],
    )
    .assert_err(2, "is not in 0..=86400");
    // Only pending, running and failed jobs can be cancelled: another
    // status is a usage error, refused before any connection.
    for status in ["completed", "dead", "cancelled"] {
        run_agq(
            &[
                "--server",
                "http://127.0.0.1:1",
                "job",
                "cancel",
                "--action",
                "a",
                "--status",
                status,
            ],
            None,
            &[],
        )
        .assert_err(2, &format!("invalid value '{status}' for '--status"));
    }
}

/// An error written to a stderr nobody reads any more (`2>&1 | head`
/// that has exited) still ends the command with its own exit code (1),
/// not a panic's 101.
#[test]
fn a_closed_stderr_keeps_the_exit_code() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let status = cli_support::clean_command(cli_support::AGQ)
        .args(["--server", "http://127.0.0.1:1", "plan", "get", "p"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .status()
        .expect("run agq");
    assert_eq!(status.code(), Some(1), "{status:?}");
}

#[test]
fn plan_submit_get_list_delete() {
    let s = Server::start();
    let submitted = s.agq(&["plan", "submit", &example_plan()]);
    submitted.assert_ok();
    assert_eq!(
        submitted.stdout.trim(),
        "stored plan word-frequency version 1"
    );

    // stdin, lowerCamel names, wrapped as a SubmitPlanRequest, numbers as strings.
    let camel = r#"{"plan": {"planId": "camel-plan", "planDescription": "camel",
        "tasks": [{"taskNumber": 1, "command": "echo", "args": ["hi"], "timeoutSecs": "5"},
                  {"taskNumber": 2, "command": "wc", "args": ["-c"], "timeoutSecs": 5, "inputFromTask": 1}]}}"#;
    let r = s.agq_stdin(&["-o", "json", "plan", "submit", "-"], Some(camel));
    r.assert_ok();
    assert_eq!(r.json()["plan_id"], "camel-plan");

    s.agq(&["plan", "submit", &example_plan()])
        .assert_err(1, "agq: ALREADY_EXISTS: ");
    let bad = write_file(
        s.dir.path(),
        "bad.json",
        r#"{"plan_id": "bad", "tasks": [{"task_number": 1, "command": "cat | sort", "timeout_secs": 5}]}"#,
    );
    s.agq(&["plan", "submit", &bad])
        .assert_err(1, "agq: INVALID_ARGUMENT: ");
    let typo = write_file(s.dir.path(), "typo.json", r#"{"plan_id": "t", "taks": []}"#);
    s.agq(&["plan", "submit", &typo])
        .assert_err(1, "not a valid Plan: unknown field `taks`");
    s.agq(&["plan", "submit", "/nonexistent.json"])
        .assert_err(1, "cannot read /nonexistent.json");

    let p = s.json(&["plan", "get", "word-frequency"]);
    assert_eq!(p["plan_id"], "word-frequency");
    let tasks = p["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 7);
    assert_eq!(tasks[0]["command"], "cat");
    assert_eq!(tasks[0]["args"][0], "{{file}}");
    assert!(tasks[0].get("input_from_task").is_none());
    assert_eq!(tasks[1]["args"], serde_json::json!(["-cs", "A-Za-z", "\n"]));
    assert_eq!(tasks[6]["input_from_task"], 6);
    assert_eq!(tasks[6]["timeout_secs"], 60);

    // What `plan get -o json` prints can be submitted again.
    let mut copy = p.clone();
    copy["plan_id"] = "copy-plan".into();
    let copy_file = write_file(s.dir.path(), "copy.json", &copy.to_string());
    s.agq(&["plan", "submit", &copy_file]).assert_ok();
    assert_eq!(s.json(&["plan", "get", "copy-plan"])["tasks"], p["tasks"]);

    let table = s.agq(&["plan", "get", "word-frequency"]);
    table.assert_ok();
    assert!(
        table.stdout.contains("-cs A-Za-z $'\\n'"),
        "{}",
        table.stdout
    );
    assert!(table.stdout.contains("TASK  COMMAND"), "{}", table.stdout);

    let all = s.json(&["plan", "list"]);
    assert_eq!(
        ids(&all, "plans", "plan_id"),
        ["camel-plan", "copy-plan", "word-frequency"]
    );
    assert_eq!(all["plans"][2]["task_count"], 7);
    assert_eq!(all["next_page_token"], "");
    let matched = s.json(&["plan", "list", "c*"]);
    assert_eq!(
        ids(&matched, "plans", "plan_id"),
        ["camel-plan", "copy-plan"]
    );
    let page = s.json(&["plan", "list", "--page-size", "1"]);
    assert_eq!(ids(&page, "plans", "plan_id"), ["camel-plan"]);
    let token = page["next_page_token"].as_str().unwrap().to_owned();
    assert!(!token.is_empty());
    let next = s.json(&["plan", "list", "--page-size", "1", "--page-token", &token]);
    assert_eq!(ids(&next, "plans", "plan_id"), ["copy-plan"]);
    let every = s.json(&["plan", "list", "--page-size", "1", "--all"]);
    assert_eq!(ids(&every, "plans", "plan_id").len(), 3);
    let hinted = s.agq(&["plan", "list", "--page-size", "1"]);
    hinted.assert_ok();
    assert!(hinted.stderr.contains("--page-token"), "{}", hinted.stderr);
    assert!(hinted.stdout.starts_with("PLAN "), "{}", hinted.stdout);

    let del = s.json(&["plan", "delete", "camel-plan"]);
    assert_eq!(
        del,
        serde_json::json!({"plan_id": "camel-plan", "deleted": true})
    );
    // A job waiting for its run time keeps its Plan; once it is cancelled,
    // deleting the Plan removes its Action and jobs too (docs/cli.md).
    s.agq(&[
        "action",
        "submit",
        "--plan",
        "copy-plan",
        "--input",
        "file=/x",
        "--action-id",
        "copy-run",
        "--run-at",
        "+1h",
    ])
    .assert_ok();
    s.agq(&["plan", "delete", "copy-plan"])
        .assert_err(1, "agq: FAILED_PRECONDITION: ");
    s.agq(&["action", "cancel", "copy-run"]).assert_ok();
    let deleted = s.agq(&["plan", "delete", "copy-plan"]);
    deleted.assert_ok();
    assert_eq!(deleted.stdout.trim(), "deleted plan copy-plan");
    s.agq(&["action", "status", "copy-run"])
        .assert_err(1, "agq: NOT_FOUND: action copy-run not found");
    s.agq(&["action", "retry", "copy-run"])
        .assert_err(1, "agq: NOT_FOUND: ");
    s.agq(&["plan", "get", "camel-plan"])
        .assert_err(1, "agq: NOT_FOUND: ");
    s.agq(&["plan", "delete", "camel-plan"])
        .assert_err(1, "agq: NOT_FOUND: ");
}

/// `plan submit --replace`, `plan get --version`, `plan versions`, and the
/// version in `plan get`, `plan list` and `job status`.
#[test]
fn plan_versions_replace_get_and_list() {
    let s = Server::start();
    s.agq(&["plan", "submit", &example_plan()]).assert_ok();
    let mut v2 = s.json(&["plan", "get", "word-frequency"]);
    assert_eq!(v2["version"], 1);
    v2["plan_description"] = "version two".into();
    v2["tasks"].as_array_mut().unwrap().truncate(2);
    let v2_file = write_file(s.dir.path(), "v2.json", &v2.to_string());
    s.agq(&["plan", "submit", &v2_file])
        .assert_err(1, "agq: ALREADY_EXISTS: ");
    let stored = s.agq(&["plan", "submit", "--replace", &v2_file]);
    stored.assert_ok();
    assert_eq!(stored.stdout.trim(), "stored plan word-frequency version 2");
    let again = s.json(&["plan", "submit", "--replace", &v2_file]);
    assert_eq!(
        again,
        serde_json::json!({"plan_id": "word-frequency", "version": 2, "created": false})
    );
    let same = s.agq(&["plan", "submit", "--replace", &v2_file]);
    same.assert_ok();
    assert!(
        same.stdout.contains("unchanged (version 2)"),
        "{}",
        same.stdout
    );

    let latest = s.json(&["plan", "get", "word-frequency"]);
    assert_eq!(latest["version"], 2);
    assert_eq!(latest["tasks"].as_array().unwrap().len(), 2);
    let first = s.json(&["plan", "get", "word-frequency", "--version", "1"]);
    assert_eq!(first["version"], 1);
    assert_eq!(first["tasks"].as_array().unwrap().len(), 7);
    let table = s.agq(&["plan", "get", "word-frequency", "--version", "1"]);
    table.assert_ok();
    assert!(table.stdout.contains("version"), "{}", table.stdout);
    s.agq(&["plan", "get", "word-frequency", "--version", "3"])
        .assert_err(1, "agq: NOT_FOUND: plan word-frequency has no version 3");
    s.agq(&["plan", "get", "word-frequency", "--version", "0"])
        .assert_err(2, "invalid value");

    let list = s.json(&["plan", "list"]);
    assert_eq!(list["plans"][0]["version"], 2);
    assert_eq!(list["plans"][0]["task_count"], 2);
    let versions = s.json(&["plan", "versions", "word-frequency"]);
    assert_eq!(versions["plan_id"], "word-frequency");
    let rows: Vec<(u64, u64)> = versions["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            assert!(is_rfc3339(&v["created_at"]), "{v}");
            (
                v["version"].as_u64().unwrap(),
                v["task_count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(rows, [(2, 2), (1, 7)]);
    assert_eq!(versions["versions"][0]["plan_description"], "version two");
    let paged = s.json(&[
        "plan",
        "versions",
        "word-frequency",
        "--page-size",
        "1",
        "--all",
    ]);
    assert_eq!(paged["versions"].as_array().unwrap().len(), 2);
    let first_page = s.agq(&["plan", "versions", "word-frequency", "--page-size", "1"]);
    first_page.assert_ok();
    assert!(
        first_page.stdout.starts_with("VERSION "),
        "{}",
        first_page.stdout
    );
    assert!(
        first_page.stderr.contains("--page-token"),
        "{}",
        first_page.stderr
    );
    s.agq(&["plan", "versions", "nope"])
        .assert_err(1, "agq: NOT_FOUND: ");

    // A job shows the version it runs.
    let a = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "file=/etc/hostname",
    ]);
    let job_id = a["job_ids"][0].as_str().unwrap().to_owned();
    let j = s.json(&["job", "status", &job_id]);
    assert_eq!(j["plan_version"], 2);
    let t = s.agq(&["job", "status", &job_id]);
    t.assert_ok();
    assert!(
        t.stdout.contains("word-frequency (version 2)"),
        "{}",
        t.stdout
    );
}

#[test]
fn action_submit_sources_status_queue_and_job_listings() {
    // --run-at 2099 below: past the default horizon of 366 days.
    let s = Server::start_with(&["--max-run-at-ahead-secs", "3162240000"]);
    s.agq(&["plan", "submit", &example_plan()]).assert_ok();

    // JSON lines.
    let inputs = examples_dir().join("inputs.jsonl");
    let a = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--inputs",
        inputs.to_str().unwrap(),
    ]);
    assert_eq!(a["jobs_created"], 3);
    assert_eq!(a["plan_id"], "word-frequency");
    let first_job = a["job_ids"][0].as_str().unwrap().to_owned();
    let job = s.json(&["job", "status", &first_job]);
    assert_eq!(job["status"], "pending");
    assert_eq!(
        job["input"]["file"],
        "/usr/share/common-licenses/Apache-2.0"
    );
    assert_eq!(job["attempt"], 0);
    assert!(!job["waiting_reason"].as_str().unwrap().is_empty(), "{job}");
    assert!(is_rfc3339(&job["created_at"]), "{job}");
    assert!(job["completed_at"].is_null());

    // A JSON array in a file, and JSON lines on stdin.
    let arr = write_file(
        s.dir.path(),
        "in.json",
        r#"[{"file": "/a"}, {"values": {"file": "/b", "n": 2}}]"#,
    );
    let b = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--inputs",
        &arr,
    ]);
    assert_eq!(b["jobs_created"], 2);
    let second = s.json(&["job", "status", b["job_ids"][1].as_str().unwrap()]);
    assert_eq!(second["input"], serde_json::json!({"file": "/b", "n": "2"}));
    let r = s.agq_stdin(
        &[
            "-o",
            "json",
            "action",
            "submit",
            "--plan",
            "word-frequency",
            "--inputs",
            "-",
        ],
        Some("{\"file\": \"/c\"}\n{\"file\": \"/d\"}\n"),
    );
    r.assert_ok();
    assert_eq!(r.json()["jobs_created"], 2);

    // Repeated --input: one job with every key.
    let c = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "file=/x",
        "--input",
        "mode=a=b",
        "--action-id",
        "manual",
        "--max-attempts",
        "5",
    ]);
    assert_eq!(c["action_id"], "manual");
    assert_eq!(c["jobs_created"], 1);
    let manual = s.json(&["job", "status", c["job_ids"][0].as_str().unwrap()]);
    assert_eq!(
        manual["input"],
        serde_json::json!({"file": "/x", "mode": "a=b"})
    );
    assert_eq!(manual["max_attempts"], 5);

    // --files: one job per regular file, absolute paths.
    let data = s.dir.path().join("data");
    std::fs::create_dir_all(data.join("sub.txt")).unwrap();
    for name in ["one.txt", "two.txt", "three.txt", "skip.md"] {
        write_file(&data, name, "words");
    }
    let glob = format!("{}/*.txt", data.display());
    let f = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--files",
        &glob,
    ]);
    assert_eq!(f["jobs_created"], 3);
    let files: BTreeSet<String> = f["job_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| {
            s.json(&["job", "status", id.as_str().unwrap()])["input"]["file"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let expected: BTreeSet<String> = ["one.txt", "three.txt", "two.txt"]
        .iter()
        .map(|n| data.join(n).to_str().unwrap().to_owned())
        .collect();
    assert_eq!(files, expected);

    // action status.
    let st = s.json(&["action", "status", "manual"]);
    assert_eq!(st["action_id"], "manual");
    assert_eq!(st["total_jobs"], 1);
    assert_eq!(st["pending"], 1);
    assert_eq!(st["done"], false);
    assert!(is_rfc3339(&st["created_at"]));
    assert!(st["completed_jobs_at"].is_null());
    let table = s.agq(&["action", "status", "manual"]);
    table.assert_ok();
    assert!(table.stdout.contains("pending    1"), "{}", table.stdout);

    // Scheduled jobs: --run-at in the future, RFC 3339 with an offset or relative.
    let later = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "file=/later",
        "--run-at",
        "+1h",
    ]);
    let far = s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "file=/far",
        "--run-at",
        "2099-01-01T02:00:00+02:00",
    ]);
    let far_job = s.json(&["job", "status", far["job_ids"][0].as_str().unwrap()]);
    assert_eq!(far_job["ready_at"], "2099-01-01T00:00:00.000Z");
    let peek = s.json(&["queue", "peek", "scheduled"]);
    assert_eq!(
        ids(&peek, "jobs", "job_id"),
        [
            later["job_ids"][0].as_str().unwrap(),
            far["job_ids"][0].as_str().unwrap()
        ]
    );
    let ready = s.json(&["queue", "peek", "ready", "--count", "2"]);
    assert_eq!(
        ids(&ready, "jobs", "job_id"),
        [first_job.as_str(), a["job_ids"][1].as_str().unwrap()]
    );
    let peek_table = s.agq(&["queue", "peek"]);
    peek_table.assert_ok();
    assert!(
        peek_table.stdout.starts_with("JOB "),
        "{}",
        peek_table.stdout
    );
    let stats = s.json(&["queue", "stats"]);
    assert_eq!(stats["scheduled_length"], 2);
    assert_eq!(stats["ready_length"], 11);
    assert_eq!(stats["workers_total"], 0);
    let stats_table = s.agq(&["queue", "stats"]);
    stats_table.assert_ok();
    assert!(
        stats_table.stdout.contains("ready  "),
        "{}",
        stats_table.stdout
    );

    // job list / search with paging and filters.
    let action = a["action_id"].as_str().unwrap();
    let listed = s.json(&["job", "list", action]);
    assert_eq!(
        ids(&listed, "jobs", "job_id"),
        a["job_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect::<Vec<_>>()
    );
    assert_eq!(listed["jobs"][0]["status"], "pending");
    let page = s.json(&["job", "list", action, "--page-size", "2"]);
    assert_eq!(page["jobs"].as_array().unwrap().len(), 2);
    assert!(!page["next_page_token"].as_str().unwrap().is_empty());
    let all = s.json(&["job", "list", action, "--page-size", "2", "--all"]);
    assert_eq!(all["jobs"].as_array().unwrap().len(), 3);
    assert_eq!(all["next_page_token"], "");
    let none = s.json(&["job", "list", action, "--status", "completed"]);
    assert_eq!(none["jobs"].as_array().unwrap().len(), 0);
    s.agq(&["job", "list", "no-such-action"])
        .assert_err(1, "agq: NOT_FOUND: ");

    let found = s.json(&[
        "job",
        "search",
        "--status",
        "pending",
        "--plan",
        "word-frequency",
        "--after",
        "1h ago",
        "--before",
        "+1m",
        "--all",
    ]);
    assert_eq!(found["jobs"].as_array().unwrap().len(), 13);
    let old = s.json(&["job", "search", "--before", "2000-01-01T00:00:00Z"]);
    assert_eq!(old["jobs"].as_array().unwrap().len(), 0);
    let other = s.json(&["job", "search", "--plan", "other"]);
    assert_eq!(other["jobs"].as_array().unwrap().len(), 0);
    let search_table = s.agq(&["job", "search", "--status", "pending"]);
    search_table.assert_ok();
    assert!(
        search_table.stdout.contains("pending"),
        "{}",
        search_table.stdout
    );

    // cancel and retry.
    let cancelled = s.json(&["job", "cancel", &first_job]);
    assert_eq!(cancelled["status"], "cancelled");
    assert!(is_rfc3339(&cancelled["completed_at"]));
    s.agq(&["job", "cancel", &first_job])
        .assert_err(1, "agq: FAILED_PRECONDITION: ");
    s.agq(&["job", "retry", a["job_ids"][1].as_str().unwrap()])
        .assert_err(1, "agq: FAILED_PRECONDITION: ");
    let after = s.json(&["action", "status", action]);
    assert_eq!(after["cancelled"], 1);
    assert_eq!(after["pending"], 2);

    // Local and usage errors.
    s.agq(&["action", "submit", "--plan", "word-frequency"])
        .assert_err(2, "--inputs");
    s.agq(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "a=1",
        "--files",
        "x",
    ])
    .assert_err(2, "cannot be used with");
    s.agq(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "novalue",
    ])
    .assert_err(2, "is not key=value");
    s.agq(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        "a=1",
        "--run-at",
        "soon",
    ])
    .assert_err(2, "is not a time");
    s.agq(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--files",
        "/nonexistent/*.txt",
    ])
    .assert_err(1, "matches no regular file");
    let bad_inputs = write_file(
        s.dir.path(),
        "bad.jsonl",
        "{\"file\": \"/a\"}\n{\"file\": 1.5, \"x\": [1]}\n",
    );
    s.agq(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--inputs",
        &bad_inputs,
    ])
    .assert_err(
        1,
        "input #2: the value of \"x\" must be a string, got an array",
    );
    s.agq(&["action", "submit", "--plan", "nope", "--input", "a=1"])
        .assert_err(1, "agq: NOT_FOUND: ");
    s.agq(&["action", "status", "nope"])
        .assert_err(1, "agq: NOT_FOUND: ");
    s.agq(&["action", "status", "nope", "--watch"])
        .assert_err(1, "agq: NOT_FOUND: ");
}

#[test]
fn jobs_run_on_real_workers_watch_status_workers_metrics() {
    let mut s = Server::start();
    s.start_worker("w1");
    s.start_worker("w2");
    s.agq(&["plan", "submit", &example_plan()]).assert_ok();
    let data = s.dir.path().join("texts");
    std::fs::create_dir(&data).unwrap();
    let files: Vec<String> = (0..3)
        .map(|i| write_file(&data, &format!("t{i}.txt"), &sample_text(i)))
        .collect();
    let glob = format!("{}/*.txt", data.display());
    s.json(&[
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--files",
        &glob,
        "--action-id",
        "e2e",
    ]);

    // --watch -o json: one JSON line per update, the last one done.
    let watched = s.agq(&["-o", "json", "action", "status", "e2e", "--watch"]);
    watched.assert_ok();
    let lines = watched.json_lines();
    assert!(!lines.is_empty());
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true, "{}", watched.stdout);
    assert_eq!(last["completed"], 3);
    assert_eq!(last["total_jobs"], 3);
    assert!(is_rfc3339(&last["completed_jobs_at"]));
    for l in &lines {
        assert_eq!(l["action_id"], "e2e");
    }
    // Table mode: the bar stays off a non-terminal stderr; the final status is printed.
    let table = s.agq(&["action", "status", "e2e", "-w"]);
    table.assert_ok();
    assert!(table.stdout.contains("completed  3"), "{}", table.stdout);
    assert!(table.stdout.contains("done       yes"), "{}", table.stdout);

    let listed = s.json(&["job", "list", "e2e", "--status", "completed"]);
    let job_ids = ids(&listed, "jobs", "job_id");
    assert_eq!(job_ids.len(), 3);
    let mut seen_files = BTreeSet::new();
    for id in &job_ids {
        let job = s.json(&["job", "status", id]);
        assert_eq!(job["status"], "completed");
        assert_eq!(job["attempt"], 1);
        assert!(
            ["w1", "w2"].contains(&job["worker_id"].as_str().unwrap()),
            "{job}"
        );
        assert!(is_rfc3339(&job["started_at"]) && is_rfc3339(&job["completed_at"]));
        let results = job["task_results"].as_array().unwrap();
        assert_eq!(results.len(), 7);
        for (i, r) in results.iter().enumerate() {
            assert_eq!(r["task_number"], i + 1);
            assert_eq!(r["exit_code"], 0);
            assert!(r["duration_ms"].is_u64());
        }
        assert_eq!(results[0]["command"], "cat");
        let file = job["input"]["file"].as_str().unwrap();
        seen_files.insert(file.to_owned());
        assert_eq!(
            results[6]["stdout"].as_str().unwrap(),
            shell_top_words(file),
            "top words of {file}"
        );
        let text = s.agq(&["job", "status", id]);
        text.assert_ok();
        for needle in [
            "status    completed",
            "attempts  1/3",
            "TASK  COMMAND  EXIT  DURATION  STDOUT",
            "stdout of task 7 (head):",
        ] {
            assert!(
                text.stdout.contains(needle),
                "{needle:?} in {}",
                text.stdout
            );
        }
        assert!(!text.stdout.contains("stdout of task 1 (cat)"));
        let full = s.agq(&["job", "status", id, "--full"]);
        full.assert_ok();
        assert!(
            full.stdout.contains("stdout of task 1 (cat):"),
            "{}",
            full.stdout
        );
    }
    assert_eq!(seen_files, files.iter().cloned().collect());

    // Workers.
    let workers = s.json(&["worker", "list"]);
    let wids = ids(&workers, "workers", "worker_id");
    assert_eq!(wids, ["w1", "w2"]);
    for w in workers["workers"].as_array().unwrap() {
        assert_eq!(w["state"], "active");
        assert_eq!(w["fresh"], true);
        assert_eq!(w["connected"], true);
        assert_eq!(w["max_concurrent_jobs"], 2);
        assert!(is_rfc3339(&w["last_heartbeat_at"]));
    }
    let w1 = s.json(&["worker", "get", "w1"]);
    assert!(
        w1["tools"].as_array().unwrap().contains(&"sort".into()),
        "{w1}"
    );
    assert!(!w1["hostname"].as_str().unwrap().is_empty());
    let w1_table = s.agq(&["worker", "get", "w1"]);
    w1_table.assert_ok();
    assert!(
        w1_table.stdout.contains("state           active"),
        "{}",
        w1_table.stdout
    );
    s.agq(&["worker", "get", "nope"])
        .assert_err(1, "agq: NOT_FOUND: ");
    let drained = s.json(&["worker", "drain", "w2"]);
    assert_eq!(drained["state"], "draining");
    // agw, told to drain with nothing to run, unregisters and exits.
    let active = s.json(&["worker", "list", "--state", "active"]);
    assert_eq!(ids(&active, "workers", "worker_id"), ["w1"]);
    s.wait_json(&["worker", "list", "--state", "unregistered"], |v| {
        v["workers"].as_array().is_some_and(|w| w.len() == 1)
    });
    let list_table = s.agq(&["worker", "list"]);
    list_table.assert_ok();
    assert!(
        list_table.stdout.starts_with("WORKER "),
        "{}",
        list_table.stdout
    );
    assert!(
        list_table.stdout.contains("unregistered"),
        "{}",
        list_table.stdout
    );
    s.agq(&["worker", "drain", "nope"])
        .assert_err(1, "agq: NOT_FOUND: ");

    // Metrics in both formats.
    let prom = s.agq(&["metrics"]);
    prom.assert_ok();
    assert!(prom.stdout.contains("# TYPE"), "{}", prom.stdout);
    let as_json = s.json(&["metrics"]);
    assert!(as_json.is_object() || as_json.is_array(), "{as_json}");
    let forced = s.agq(&["metrics", "--format", "json"]);
    forced.assert_ok();
    let keys = |v: &Value| -> Vec<String> {
        v.as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(keys(&forced.json()), keys(&as_json));
    let wrapped = s.json(&["metrics", "--format", "prometheus"]);
    assert_eq!(wrapped["format"], "prometheus");
    assert!(wrapped["body"].as_str().unwrap().contains("# TYPE"));
}

#[test]
fn failed_jobs_watch_exit_code_retry_and_dead() {
    let mut s = Server::start();
    s.start_worker("w1");
    let plan = r#"{"plan_id": "fails", "tasks": [
        {"task_number": 1, "command": "echo", "args": ["about to fail"], "timeout_secs": 5},
        {"task_number": 2, "command": "false", "timeout_secs": 5}]}"#;
    s.agq_stdin(&["plan", "submit", "-"], Some(plan))
        .assert_ok();
    let run = s.agq(&[
        "-o",
        "json",
        "action",
        "submit",
        "--plan",
        "fails",
        "--input",
        "n=1",
        "--max-attempts",
        "1",
        "--action-id",
        "doomed",
        "--watch",
    ]);
    run.assert_err(
        1,
        "agq: action doomed finished with 1 dead and 0 cancelled of 1 jobs",
    );
    let lines = run.json_lines();
    assert_eq!(lines[0]["action_id"], "doomed");
    assert_eq!(lines[0]["jobs_created"], 1);
    assert_eq!(lines.last().unwrap()["dead"], 1);
    let job_id = lines[0]["job_ids"][0].as_str().unwrap().to_owned();

    let dead = s.json(&["job", "status", &job_id]);
    assert_eq!(dead["status"], "dead");
    assert!(!dead["error"].as_str().unwrap().is_empty(), "{dead}");
    assert_eq!(dead["task_results"][1]["exit_code"], 1);
    assert_eq!(dead["task_results"][0]["stdout"], "about to fail\n");
    let table = s.agq(&["job", "status", &job_id]);
    table.assert_ok();
    assert!(table.stdout.contains("status    dead"), "{}", table.stdout);
    assert!(table.stdout.contains("error     "), "{}", table.stdout);
    let search = s.json(&["job", "search", "--status", "dead"]);
    assert_eq!(ids(&search, "jobs", "job_id"), [job_id.as_str()]);

    let retried = s.json(&["job", "retry", &job_id]);
    assert!(
        ["pending", "running", "failed", "dead"].contains(&retried["status"].as_str().unwrap()),
        "{retried}"
    );
    let again = s.wait_json(&["job", "status", &job_id], |j| {
        j["status"] == "dead" && j["attempt"].as_u64() >= Some(1)
    });
    assert_eq!(again["status"], "dead");
    let st = s.agq(&["action", "status", "doomed", "--watch"]);
    st.assert_err(1, "finished with 1 dead");
    assert!(st.stdout.contains("dead       1"), "{}", st.stdout);
}

#[test]
fn token_is_sent_as_bearer_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let auth = write_file(
        dir.path(),
        "auth.toml",
        "[[tokens]]\ntoken = \"client-token-0123456789\"\nrole = \"client\"\n",
    );
    let s = Server::start_with(&["--auth-file", &auth]);
    s.agq(&["plan", "list"])
        .assert_err(1, "agq: UNAUTHENTICATED: ");
    s.agq(&["--token", "wrong-token-0123456789", "plan", "list"])
        .assert_err(1, "agq: UNAUTHENTICATED: ");
    let ok = s.agq(&[
        "plan",
        "list",
        "--token",
        "client-token-0123456789",
        "-o",
        "json",
    ]);
    ok.assert_ok();
    assert_eq!(ok.json()["plans"], serde_json::json!([]));
    let url = s.url();
    let env = run_agq(
        &["-o", "json", "queue", "stats"],
        None,
        &[
            ("AGQ_SERVER", url.as_str()),
            ("AGQ_TOKEN", "client-token-0123456789"),
        ],
    );
    env.assert_ok();
    assert_eq!(env.json()["ready_length"], 0);
}

/// `--token-file` / `AGQ_TOKEN_FILE` read the token as agw does (trimmed;
/// an unreadable or empty file is an error naming the file, exit 1);
/// `--token` on the command line works with a warning, `AGQ_TOKEN`
/// silently; `--token` with `--token-file` is a usage error (exit 2). The
/// token never appears in what agq prints.
#[test]
fn token_file_env_token_and_the_command_line_warning() {
    const TOKEN: &str = "client-token-FILECHECK-0123456789";
    const WARNING: &str = "--token on the command line is visible to other local users";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let auth = write_file(
        d,
        "auth.toml",
        &format!("[[tokens]]\ntoken = \"{TOKEN}\"\nrole = \"client\"\n"),
    );
    let s = Server::start_with(&["--auth-file", &auth]);
    let url = s.url();
    let file = write_file(d, "token", &format!("\n  {TOKEN}  \n\n"));
    let empty = write_file(d, "empty", " \n\t\n");
    let missing = d.join("missing").to_str().unwrap().to_owned();
    let not_text = d.join("not-text");
    std::fs::write(&not_text, [TOKEN.as_bytes(), b"\xff\n"].concat()).unwrap();
    let not_text = not_text.to_str().unwrap().to_owned();
    let no_token = |r: &cli_support::Run| {
        assert!(
            !r.stdout.contains(TOKEN) && !r.stderr.contains(TOKEN),
            "the token was printed: {r:?}"
        );
    };
    let no_warning = |r: &cli_support::Run| {
        assert!(!r.stderr.contains("warning"), "unexpected warning: {r:?}");
    };

    // --token-file: trimmed, accepted by the server, no warning.
    let ok = s.agq(&["--token-file", &file, "-o", "json", "plan", "list"]);
    ok.assert_ok();
    assert_eq!(ok.json()["plans"], serde_json::json!([]));
    assert_eq!(ok.stderr, "", "{ok:?}");
    // After the subcommand too (a global flag).
    let after = s.agq(&["queue", "stats", "--token-file", &file]);
    after.assert_ok();
    no_warning(&after);
    // AGQ_TOKEN_FILE.
    let env_file = run_agq(
        &["-o", "json", "plan", "list"],
        None,
        &[("AGQ_SERVER", &url), ("AGQ_TOKEN_FILE", &file)],
    );
    env_file.assert_ok();
    assert_eq!(env_file.stderr, "", "{env_file:?}");

    // Unreadable and empty files: exit 1, the file named, nothing of the token.
    let r = s.agq(&["--token-file", &missing, "plan", "list"]);
    r.assert_err(1, &format!("agq: cannot read --token-file {missing}: "));
    let r = s.agq(&["--token-file", &empty, "plan", "list"]);
    r.assert_err(1, &format!("agq: --token-file {empty} is empty"));
    let r = s.agq(&["--token-file", &not_text, "plan", "list"]);
    r.assert_err(1, &format!("agq: cannot read --token-file {not_text}: "));
    no_token(&r);
    let r = run_agq(
        &["plan", "list"],
        None,
        &[("AGQ_SERVER", &url), ("AGQ_TOKEN_FILE", &missing)],
    );
    r.assert_err(1, &format!("agq: cannot read AGQ_TOKEN_FILE {missing}: "));
    let r = s.agq(&["--token-file", d.to_str().unwrap(), "plan", "list"]);
    r.assert_err(1, "agq: cannot read --token-file ");

    // --token on the command line: works, with one warning line on stderr.
    let cl = s.agq(&["--token", TOKEN, "-o", "json", "plan", "list"]);
    cl.assert_ok();
    assert_eq!(cl.json()["plans"], serde_json::json!([]));
    let warnings: Vec<&str> = cl.stderr.lines().collect();
    assert_eq!(warnings.len(), 1, "{cl:?}");
    assert!(warnings[0].starts_with("agq: warning: "), "{cl:?}");
    assert!(warnings[0].contains(WARNING), "{cl:?}");
    assert!(warnings[0].contains("--token-file"), "{cl:?}");
    assert!(warnings[0].contains("AGQ_TOKEN"), "{cl:?}");
    no_token(&cl);
    // The warning also comes with a failed call.
    let wrong = s.agq(&["--token", "wrong-token-0123456789", "plan", "list"]);
    wrong.assert_err(1, "agq: UNAUTHENTICATED: ");
    assert!(wrong.stderr.contains(WARNING), "{wrong:?}");

    // AGQ_TOKEN: works, silently.
    let env = run_agq(
        &["-o", "json", "plan", "list"],
        None,
        &[("AGQ_SERVER", &url), ("AGQ_TOKEN", TOKEN)],
    );
    env.assert_ok();
    assert_eq!(env.stderr, "", "{env:?}");

    // --token with --token-file: a usage error, whatever their order.
    for args in [
        &["--token", TOKEN, "--token-file", &file, "plan", "list"][..],
        &["--token-file", &file, "plan", "list", "--token", TOKEN][..],
    ] {
        let r = s.agq(args);
        r.assert_err(
            2,
            "'--token <TOKEN>' cannot be used with '--token-file <PATH>'",
        );
        no_token(&r);
        assert_eq!(r.stdout, "", "{r:?}");
    }
    // A flag overrides the other source's environment variable.
    let flag_file = run_agq(
        &["--token-file", &file, "plan", "list"],
        None,
        &[
            ("AGQ_SERVER", &url),
            ("AGQ_TOKEN", "wrong-token-0123456789"),
        ],
    );
    flag_file.assert_ok();
    no_warning(&flag_file);
    let flag_token = run_agq(
        &["--token", TOKEN, "plan", "list"],
        None,
        &[("AGQ_SERVER", &url), ("AGQ_TOKEN_FILE", &missing)],
    );
    flag_token.assert_ok();
    assert!(flag_token.stderr.contains(WARNING), "{flag_token:?}");
    // Both environment variables and no flag: which one was meant is unknown.
    let both_env = run_agq(
        &["plan", "list"],
        None,
        &[
            ("AGQ_SERVER", &url),
            ("AGQ_TOKEN", TOKEN),
            ("AGQ_TOKEN_FILE", &file),
        ],
    );
    both_env.assert_err(1, "agq: AGQ_TOKEN and AGQ_TOKEN_FILE are both set");
    no_token(&both_env);
    // An empty variable counts as unset.
    let empty_env = run_agq(
        &["plan", "list"],
        None,
        &[
            ("AGQ_SERVER", &url),
            ("AGQ_TOKEN", TOKEN),
            ("AGQ_TOKEN_FILE", ""),
        ],
    );
    empty_env.assert_ok();
    no_warning(&empty_env);
    // `agq serve` and `agq demo` ignore the client flags: no file is read.
    run_agq(&["serve", "--help"], None, &[("AGQ_TOKEN_FILE", &missing)]).assert_ok();
}

#[test]
fn connection_errors_are_clear() {
    run_agq(
        &["--server", "http://127.0.0.1:1", "plan", "list"],
        None,
        &[],
    )
    .assert_err(1, "agq: cannot connect to http://127.0.0.1:1");
    run_agq(&["--server", "127.0.0.1:6380", "plan", "list"], None, &[])
        .assert_err(1, "must start with http:// or https://");
    run_agq(
        &["--server", "https://127.0.0.1:1", "plan", "list"],
        None,
        &[],
    )
    .assert_err(1, "needs --tls-ca");
    run_agq(
        &[
            "--server",
            "http://127.0.0.1:1",
            "--tls-ca",
            "/x.pem",
            "plan",
            "list",
        ],
        None,
        &[],
    )
    .assert_err(1, "TLS flags need an https:// server URL");
}

/// A server that takes the connection but never answers: the call ends at
/// `--timeout` with `DEADLINE_EXCEEDED` naming the flag, not with a
/// `CANCELLED` that reads as if someone cancelled it.
#[test]
fn a_call_past_its_timeout_is_deadline_exceeded() {
    // Never accepted: the kernel completes the TCP handshake, nobody answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let start = std::time::Instant::now();
    let r = run_agq(
        &["--server", &url, "--timeout", "1s", "plan", "list"],
        None,
        &[],
    );
    r.assert_err(
        1,
        "agq: DEADLINE_EXCEEDED: no answer within --timeout 1s (AGQ_TIMEOUT)",
    );
    assert!(!r.stderr.contains("CANCELLED"), "{}", r.stderr);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    drop(silent);
}

#[test]
fn tls_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let script = format!(
        "set -e; cd {d}
         openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
           -keyout ca.key -out ca.pem -subj /CN=agq-test-ca \
           -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign
         openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
           -keyout server.key -out server.csr -subj /CN=agq.test
         printf 'subjectAltName=DNS:agq.test,IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' > ext.cnf
         openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
           -out server.pem -days 2 -extfile ext.cnf"
    );
    let made = std::process::Command::new("sh")
        .args(["-c", &script])
        .output();
    match made {
        Ok(out) if out.status.success() => {}
        other => {
            eprintln!("skipping the TLS test: openssl could not make certificates: {other:?}");
            return;
        }
    }
    let cert = format!("{d}/server.pem");
    let key = format!("{d}/server.key");
    let ca = format!("{d}/ca.pem");
    let s = Server::start_with(&["--tls-cert", &cert, "--tls-key", &key]);
    let https = format!("https://{}", s.addr);
    let ok = run_agq(
        &[
            "--server", &https, "--tls-ca", &ca, "-o", "json", "plan", "list",
        ],
        None,
        &[],
    );
    ok.assert_ok();
    assert_eq!(ok.json()["plans"], serde_json::json!([]));
    let port = s.addr.rsplit(':').next().unwrap();
    let named = format!("https://localhost:{port}");
    let by_name = run_agq(
        &[
            "--server",
            &named,
            "--tls-ca",
            &ca,
            "--tls-domain",
            "agq.test",
            "queue",
            "stats",
        ],
        None,
        &[],
    );
    // localhost may resolve to ::1 first; only a certificate problem is a failure.
    assert!(
        by_name.code == 0 || !by_name.stderr.contains("certificate"),
        "{by_name:?}"
    );
    let plain = run_agq(&["--server", &s.url(), "plan", "list"], None, &[]);
    assert_eq!(plain.code, 1, "{plain:?}");
}

/// Issue 8: no token and no input value appears in the server's or the
/// worker's log at the default level, through a whole job's life with
/// client, worker and wrong tokens.
#[test]
fn tokens_and_input_values_stay_out_of_the_logs() {
    const CLIENT: &str = "client-token-LOGCHECK-0123456789";
    const WORKER: &str = "worker-token-LOGCHECK-0123456789";
    const WRONG: &str = "wrong-token-LOGCHECK-0123456789";
    const MARK: &str = "VALUEMARK7731";
    let dir = tempfile::tempdir().unwrap();
    let auth = write_file(
        dir.path(),
        "auth.toml",
        &format!(
            "[[tokens]]\ntoken = \"{CLIENT}\"\nrole = \"client\"\n\n\
             [[tokens]]\ntoken = \"{WORKER}\"\nrole = \"worker\"\nworker_id = \"lw1\"\n"
        ),
    );
    let mut s = Server::start_at_default_log_level(&["--auth-file", &auth]);
    // In the session's directory, which the worker's tasks may read.
    let input = write_file(s.dir.path(), &format!("input-{MARK}.txt"), "b a b\n");
    s.agq(&["--token", WRONG, "plan", "list"])
        .assert_err(1, "UNAUTHENTICATED");
    s.agq(&["--token", CLIENT, "plan", "submit", &example_plan()])
        .assert_ok();
    s.start_worker_env("lw1", &[], &[("AGW_TOKEN", WORKER)]);
    let submitted = s.json(&[
        "--token",
        CLIENT,
        "action",
        "submit",
        "--plan",
        "word-frequency",
        "--input",
        &format!("file={input}"),
        "--input",
        &format!("note={MARK}"),
    ]);
    let job_id = submitted["job_ids"][0].as_str().unwrap().to_owned();
    let done = s.wait_json(&["--token", CLIENT, "job", "status", &job_id], |j| {
        j["status"] == "completed"
    });
    assert_eq!(done["input"]["note"], MARK, "the job carried the value");
    // What each log is known to say at this level: the server logs the
    // worker's registration, agw the job it ran.
    let logs = [
        ("agq serve", "lw1", s.log()),
        (
            "agw",
            job_id.as_str(),
            std::fs::read_to_string(s.dir.path().join("lw1.log")).unwrap(),
        ),
    ];
    drop(s);
    for (who, said, log) in &logs {
        assert!(log.contains(said), "{who}'s log lacks {said}:\n{log}");
        for secret in [CLIENT, WORKER, WRONG, MARK] {
            assert!(!log.contains(secret), "{who}'s log holds {secret}:\n{log}");
        }
    }
}

#[test]
fn action_list_cancel_retry_and_bulk_job_commands() {
    let s = Server::start();
    s.agq(&["plan", "submit", &example_plan()]).assert_ok();
    // No worker runs: every job stays pending.
    for id in ["older", "newer"] {
        s.agq(&[
            "action",
            "submit",
            "--plan",
            "word-frequency",
            "--input",
            "file=/a",
            "--action-id",
            id,
        ])
        .assert_ok();
    }
    let all = s.json(&["action", "list"]);
    assert_eq!(ids(&all, "actions", "action_id"), ["newer", "older"]);
    assert_eq!(all["actions"][0]["pending"], 1);
    assert_eq!(all["next_page_token"], "");
    let first = s.json(&["action", "list", "--limit", "1"]);
    assert_eq!(ids(&first, "actions", "action_id"), ["newer"]);
    let token = first["next_page_token"].as_str().unwrap().to_owned();
    assert!(!token.is_empty());
    let second = s.json(&["action", "list", "--limit", "1", "--page-token", &token]);
    assert_eq!(ids(&second, "actions", "action_id"), ["older"]);
    let table = s.agq(&["action", "list", "--limit", "1"]);
    table.assert_ok();
    assert!(table.stdout.contains("ACTION"), "{}", table.stdout);
    assert!(table.stdout.contains("newer"), "{}", table.stdout);
    assert!(table.stderr.contains("--page-token"), "{}", table.stderr);

    // The bulk forms: cancel the pending jobs of one action, retry none.
    let cancelled = s.json(&["job", "cancel", "--action", "older", "--status", "pending"]);
    assert_eq!(cancelled["change"], "cancelled");
    assert_eq!(cancelled["jobs"], 1);
    assert_eq!(cancelled["action"]["cancelled"], 1);
    let retried = s.json(&["job", "retry", "--action", "older", "--status", "dead"]);
    assert_eq!(retried["jobs"], 0);
    let finished = s.json(&["action", "list", "--state", "finished"]);
    assert_eq!(ids(&finished, "actions", "action_id"), ["older"]);
    let open = s.json(&[
        "action",
        "list",
        "--plan",
        "word-frequency",
        "--state",
        "open",
        "--since",
        "1h ago",
    ]);
    assert_eq!(ids(&open, "actions", "action_id"), ["newer"]);
    let none = s.json(&["action", "list", "--until", "2001-01-01T00:00:00Z"]);
    assert_eq!(ids(&none, "actions", "action_id"), Vec::<String>::new());
    let c = s.json(&["action", "cancel", "newer"]);
    assert_eq!(
        (c["jobs"].as_u64(), c["action"]["done"].as_bool()),
        (Some(1), Some(true))
    );
    let r = s.json(&["action", "retry", "newer", "--status", "failed"]);
    assert_eq!(r["change"], "retried");
    assert_eq!(r["jobs"], 0);
    s.agq(&["action", "cancel", "nope"])
        .assert_err(1, "agq: NOT_FOUND: ");
    s.agq(&[
        "job",
        "cancel",
        "--action",
        "older",
        "--status",
        "completed",
    ])
    .assert_err(2, "[possible values: pending, running, failed]");
    s.agq(&["job", "retry"]).assert_err(2, "Usage");
}

#[test]
fn worker_forget_removes_a_departed_worker_only() {
    let s = Server::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = s.url();
    rt.block_on(async {
        let mut w = agq::pb::worker_service_client::WorkerServiceClient::connect(url)
            .await
            .unwrap();
        for id in ["gone-w", "live-w"] {
            w.register_worker(agq::pb::RegisterWorkerRequest {
                worker_id: id.into(),
                hostname: "h".into(),
                agw_version: "test".into(),
                max_concurrent_jobs: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        w.unregister_worker(agq::pb::UnregisterWorkerRequest {
            worker_id: "gone-w".into(),
        })
        .await
        .unwrap();
    });
    s.agq(&["worker", "forget", "live-w"])
        .assert_err(1, "agq: FAILED_PRECONDITION: ");
    let r = s.agq(&["worker", "forget", "gone-w"]);
    r.assert_ok();
    assert_eq!(r.stdout.trim(), "worker gone-w forgotten");
    s.agq(&["worker", "get", "gone-w"])
        .assert_err(1, "agq: NOT_FOUND: ");
    s.agq(&["-o", "json", "worker", "forget", "gone-w"])
        .assert_err(1, "agq: NOT_FOUND: ");
    let listed = s.json(&["worker", "list"]);
    assert_eq!(ids(&listed, "workers", "worker_id"), ["live-w"]);
}

/// Text written by others (a task's stdout and stderr, the job's error, a
/// client's input values and plan description, a plan file's content)
/// reaches the operator's terminal as visible text: no escape sequence
/// (OSC 52 clipboard write, OSC 8 link, title change, screen clear), no
/// carriage return or backspace that overwrites what was printed, no BiDi
/// override. `-o json` keeps the exact text.
#[test]
fn untrusted_text_reaches_the_terminal_as_visible_text() {
    const OUT: &str = "out\r\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b]8;;http://evil.example/\x1b\\link\x1b]8;;\x1b\\\u{202e}gpj.exe";
    const ERR: &str = "err\x1b]0;owned\x07\x08\x08\u{9b}31m";
    const NOTE: &str = "\x1b[31mred\u{2066}";
    const DESCRIPTION: &str = "desc\x1b]0;title\x07\rfake";
    /// What no table output may hold: each would act on the terminal.
    fn assert_inert(run: &cli_support::Run) {
        run.assert_ok();
        for c in [
            '\x1b', '\x07', '\x08', '\r', '\u{9b}', '\u{202e}', '\u{2066}',
        ] {
            for (name, text) in [("stdout", &run.stdout), ("stderr", &run.stderr)] {
                assert!(
                    !text.contains(c),
                    "agq {:?}: {name} holds {c:?}: {text:?}",
                    run.args
                );
            }
        }
    }

    let mut s = Server::start();
    s.start_worker("w1");
    let plan = serde_json::json!({
        "plan_id": "hostile",
        "plan_description": DESCRIPTION,
        "tasks": [
            {"task_number": 1, "command": "echo", "args": [OUT], "timeout_secs": 10},
            {"task_number": 2, "command": "jq", "args": ["-n", "--arg", "m", ERR, "$m | halt_error"], "timeout_secs": 10}
        ]
    });
    s.agq_stdin(&["plan", "submit", "-"], Some(&plan.to_string()))
        .assert_ok();
    let note = format!("note={NOTE}");
    s.json(&[
        "action",
        "submit",
        "--plan",
        "hostile",
        "--input",
        &note,
        "--max-attempts",
        "1",
        "--action-id",
        "hostile-a",
    ]);
    s.wait_json(&["action", "status", "hostile-a"], |a| a["done"] == true);
    let listed = s.json(&["job", "list", "hostile-a"]);
    let job_id = ids(&listed, "jobs", "job_id").remove(0);

    // JSON keeps every byte.
    let job = s.json(&["job", "status", &job_id]);
    assert_eq!(job["status"], "dead", "{job}");
    assert_eq!(job["task_results"][0]["stdout"], format!("{OUT}\n"));
    assert_eq!(job["task_results"][1]["stderr"], ERR);
    assert!(job["error"].as_str().unwrap().contains(ERR), "{job}");
    assert_eq!(job["input"]["note"], NOTE);
    assert_eq!(
        s.json(&["plan", "get", "hostile"])["plan_description"],
        DESCRIPTION
    );

    // Tables show the characters.
    let status = s.agq(&["job", "status", &job_id, "--full"]);
    assert_inert(&status);
    for shown in [
        r"out\r\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b]8;;http://evil.example/\x1b\link",
        r"\u{202e}gpj.exe",
        r"err\x1b]0;owned\x07\x08\x08\x9b31m",
        r"note=\x1b[31mred\u{2066}",
    ] {
        assert!(
            status.stdout.contains(shown),
            "{shown} in {}",
            status.stdout
        );
    }
    for args in [
        &["job", "list", "hostile-a"][..],
        &["job", "search", "--status", "dead"],
        &["plan", "list"],
        &["plan", "get", "hostile"],
        &["plan", "versions", "hostile"],
    ] {
        let run = s.agq(args);
        assert_inert(&run);
    }
    let plans = s.agq(&["plan", "list"]);
    assert!(
        plans.stdout.contains(r"desc\x1b]0;title\x07\rfake"),
        "{}",
        plans.stdout
    );

    // Errors too: a plan file's unknown field is quoted on stderr.
    let bad = write_file(
        s.dir.path(),
        "bad.plan.json",
        r#"{"plan_id": "x", "\u001b]52;c;cHduZWQ=\u0007": 1}"#,
    );
    let run = s.agq(&["plan", "submit", &bad]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(!run.stderr.contains('\x1b'), "{:?}", run.stderr);
    assert!(
        run.stderr.contains(r"\x1b]52;c;cHduZWQ=\x07"),
        "{:?}",
        run.stderr
    );
}

/// `worker verify` waits up to `--wait-secs` for the worker's answer: an
/// answer that does not come in time is no success (exit 1, the pending
/// challenge printed and named on stderr); `--wait-secs 0` only sends the
/// challenge (exit 0); an answer in time that passed exits 0.
#[test]
fn worker_verify_exits_1_when_the_answer_does_not_come_in_time() {
    let mut s = Server::start();
    s.start_worker("verify-w");
    // agw answers after `sleep 5` ends: later than the one second waited.
    let r = s.agq(&[
        "worker",
        "verify",
        "verify-w",
        "sleep",
        "--wait-secs",
        "1",
        "--",
        "5",
    ]);
    r.assert_err(
        1,
        "agq: worker verify-w did not answer the verification of sleep within --wait-secs 1",
    );
    assert!(r.stdout.contains("sleep 5: pending"), "{}", r.stdout);
    let r = s.agq(&[
        "worker",
        "verify",
        "verify-w",
        "sleep",
        "--wait-secs",
        "0",
        "--",
        "5",
    ]);
    r.assert_ok();
    assert!(r.stdout.contains("sleep 5: pending"), "{}", r.stdout);
    let r = s.agq(&["worker", "verify", "verify-w", "sort", "--wait-secs", "30"]);
    r.assert_ok();
    assert!(
        r.stdout.contains("sort --version: passed at "),
        "{}",
        r.stdout
    );
}
