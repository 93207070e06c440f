//! The `agq serve` binary: secure by default, clean exit on SIGTERM, and
//! state that survives a restart of the process.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

const AGQ: &str = env!("CARGO_BIN_EXE_agq");

#[test]
fn refuses_a_public_listen_address_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(AGQ)
        .args([
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--db",
        ])
        .arg(dir.path().join("agq.db"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen on 0.0.0.0:0 without authentication"),
        "{err}"
    );
    assert!(!dir.path().join("agq.db").exists(), "nothing was created");
}

#[test]
fn rejects_a_bad_auth_file_without_echoing_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("auth.toml");
    std::fs::write(
        &auth,
        "[[tokens]]\ntoken = \"tiny-secret\"\nrole = \"client\"\n",
    )
    .unwrap();
    let out = Command::new(AGQ)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--auth-file",
        ])
        .arg(&auth)
        .arg("--db")
        .arg(dir.path().join("agq.db"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 16 characters"), "{err}");
    assert!(
        !err.contains("tiny-secret"),
        "the token leaked into the message: {err}"
    );
}

#[test]
fn sigterm_closes_the_database_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(AGQ)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--db",
        ])
        .arg(dir.path().join("data/agq.db"))
        .env("AGQ_HEARTBEAT_INTERVAL_SECS", "5")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("listening on 127.0.0.1:"), "{line}");
    std::thread::sleep(Duration::from_millis(200));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "exit status {:?}", out.status);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("database closed"), "{err}");
    assert!(dir.path().join("data/agq.db").exists());
    assert!(
        !dir.path().join("data/agq.db-wal").exists()
            || std::fs::metadata(dir.path().join("data/agq.db-wal"))
                .unwrap()
                .len()
                == 0,
        "the WAL was checkpointed at close"
    );
}
