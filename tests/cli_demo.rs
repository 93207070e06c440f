//! `agq demo` end to end: the built `agq` starts its own server and real
//! `agw` processes (from the same target directory), and every file's top
//! words must equal the shell pipeline's.

mod cli_support;

use cli_support::{run_agq, sample_text, shell_top_words, write_file};

/// The top-word lines the demo printed under `── FILE`.
fn demo_section(stdout: &str, file: &str) -> Vec<String> {
    let header = format!("── {file}  (");
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with(&header));
    assert!(
        lines.next().is_some(),
        "no section for {file} in:\n{stdout}"
    );
    lines
        .take_while(|l| l.starts_with("   "))
        .map(|l| l.trim().to_owned())
        .collect()
}

#[test]
fn demo_counts_words_like_the_shell_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let mut files: Vec<String> = (0..4)
        .map(|i| write_file(dir.path(), &format!("text-{i}.txt"), &sample_text(i)))
        .collect();
    files.push(write_file(dir.path(), "empty.txt", ""));
    let mut args = vec!["demo", "--workers", "2"];
    args.extend(files.iter().map(String::as_str));
    let run = run_agq(&args, None, &[]);
    run.assert_ok();
    for f in &files[..4] {
        let expected: Vec<String> = shell_top_words(f)
            .lines()
            .map(|l| l.trim().to_owned())
            .collect();
        assert!(!expected.is_empty());
        assert_eq!(demo_section(&run.stdout, f), expected, "{f}");
    }
    assert!(run.stdout.contains("(no words)"), "{}", run.stdout);
    for needle in [
        "worker demo-1 registered",
        "worker demo-2 registered",
        "jobs       5",
        "completed  5",
        "failed     0",
        "wall time",
        "jobs/s",
        "stopped 2 workers",
    ] {
        assert!(
            run.stdout.contains(needle),
            "{needle:?} in:\n{}",
            run.stdout
        );
    }
}

#[test]
fn demo_reuses_a_database_and_walks_directories() {
    let dir = tempfile::tempdir().unwrap();
    let texts = dir.path().join("texts");
    std::fs::create_dir_all(texts.join("nested")).unwrap();
    let a = write_file(&texts, "a.txt", &sample_text(7));
    let b = write_file(&texts.join("nested"), "b.txt", &sample_text(8));
    let db = dir.path().join("demo.db");
    for _ in 0..2 {
        let run = run_agq(
            &[
                "demo",
                "--workers",
                "1",
                "--db",
                db.to_str().unwrap(),
                texts.to_str().unwrap(),
            ],
            None,
            &[],
        );
        run.assert_ok();
        assert_eq!(
            demo_section(&run.stdout, &a),
            shell_top_words(&a)
                .lines()
                .map(|l| l.trim().to_owned())
                .collect::<Vec<_>>()
        );
        assert!(
            run.stdout.contains(&format!("── {b}  (demo-1)")),
            "{}",
            run.stdout
        );
        assert!(run.stdout.contains("completed  2"), "{}", run.stdout);
    }
    assert!(db.is_file());
}

#[test]
fn demo_rejects_missing_files() {
    run_agq(&["demo", "/nonexistent/file.txt"], None, &[])
        .assert_err(1, "agq: /nonexistent/file.txt: no such file or directory");
    let dir = tempfile::tempdir().unwrap();
    run_agq(&["demo", dir.path().to_str().unwrap()], None, &[])
        .assert_err(1, "no regular files under");
}

#[test]
fn demo_stops_its_workers_when_terminated() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    for i in 0..300 {
        write_file(dir.path(), &format!("f{i:03}.txt"), &sample_text(i));
    }
    let mut child = cli_support::clean_command(cli_support::AGQ)
        .args(["demo", "--workers", "2", dir.path().to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut pids = Vec::new();
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("worker demo-") {
            let pid: i32 = rest
                .split("(pid ")
                .nth(1)
                .and_then(|p| p.trim_end_matches(')').parse().ok())
                .unwrap_or_else(|| panic!("no pid in {line:?}"));
            pids.push(pid);
            if pids.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(pids.len(), 2);
    let agq = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(agq, nix::sys::signal::Signal::SIGTERM).unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    // Either the signal cut the run short, or the run won the race.
    assert!(
        (status.code() == Some(1) && stderr.contains("interrupted by SIGTERM")) || status.success(),
        "{status:?} {stderr} {rest:?}"
    );
    for pid in pids {
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
        assert!(!alive, "worker pid {pid} outlived agq demo");
    }
}
