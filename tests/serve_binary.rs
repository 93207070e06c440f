//! The `agq serve` binary: secure by default, clean exit on SIGTERM, and
//! state that survives a restart of the process.

mod process;

use std::time::Duration;

use process::{Serve, WAIT};

#[test]
fn refuses_a_public_listen_address_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let exited = Serve::new(dir.path().join("agq.db"))
        .listen("0.0.0.0:0")
        .spawn()
        .err()
        .expect("agq serve started on 0.0.0.0 without auth");
    assert!(exited.status.is_some_and(|st| !st.success()), "{exited:?}");
    let err = exited.log;
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
    let exited = Serve::new(dir.path().join("agq.db"))
        .args(["--auth-file".as_ref(), auth.as_os_str()])
        .spawn()
        .err()
        .expect("agq serve started with a bad auth file");
    assert!(exited.status.is_some_and(|st| !st.success()), "{exited:?}");
    let err = exited.log;
    assert!(err.contains("at least 16 characters"), "{err}");
    assert!(
        !err.contains("tiny-secret"),
        "the token leaked into the message: {err}"
    );
    // A file that is not valid TOML: the error names the place, never the
    // line's text.
    for line in [
        "token = s3cr3t-admin-token-ABCDEFGH",
        "token = \"s3cr3t-admin-token-ABCD\\qEFGH\"",
    ] {
        std::fs::write(&auth, format!("[[tokens]]\n{line}\nrole = \"admin\"\n")).unwrap();
        let exited = Serve::new(dir.path().join("agq.db"))
            .args(["--auth-file".as_ref(), auth.as_os_str()])
            .spawn()
            .err()
            .expect("agq serve started with an auth file that is not TOML");
        assert!(exited.status.is_some_and(|st| !st.success()), "{exited:?}");
        let err = exited.log;
        assert!(
            err.contains("is invalid") && err.contains("line 2"),
            "{err}"
        );
        assert!(
            !err.contains("s3cr3t"),
            "the token leaked into the message: {err}"
        );
    }
}

#[test]
fn sigterm_closes_the_database_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    // The default log level: "database closed" is an info line.
    let mut server = Serve::new(dir.path().join("data/agq.db"))
        .env("AGQ_HEARTBEAT_INTERVAL_SECS", "5")
        .env_remove("RUST_LOG")
        .spawn()
        .unwrap_or_else(|e| panic!("agq serve did not start: {e:?}"));
    assert!(server.addr.starts_with("127.0.0.1:"), "{}", server.addr);
    std::thread::sleep(Duration::from_millis(200));
    server.signal(nix::sys::signal::Signal::SIGTERM);
    let status = server.wait_exit(WAIT);
    assert!(status.success(), "exit status {status:?}");
    let err = server.log();
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

#[test]
fn a_second_server_on_the_same_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agq.db");
    let mut first = Serve::new(&db)
        .spawn()
        .unwrap_or_else(|e| panic!("agq serve did not start: {e:?}"));
    let exited = Serve::new(&db)
        .spawn()
        .err()
        .expect("a second agq serve started on the same database");
    assert!(exited.status.is_some_and(|st| !st.success()), "{exited:?}");
    let err = exited.log;
    assert!(
        err.contains("is in use by process ") && err.contains("only one agq serve"),
        "{err}"
    );
    // Once the first has stopped, the database is free again.
    first.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(first.wait_exit(WAIT).success());
    let again = Serve::new(&db)
        .spawn()
        .unwrap_or_else(|e| panic!("agq serve did not start after the first stopped: {e:?}"));
    drop(again);
}

#[test]
fn a_half_sent_console_request_does_not_hold_the_shutdown() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut server = Serve::new(dir.path().join("agq.db"))
        .args(["--shutdown-grace-secs", "1"])
        .env("RUST_LOG", "info")
        .spawn()
        .unwrap_or_else(|e| panic!("agq serve did not start: {e:?}"));
    // Printed on stdout after the gRPC address (the metrics address first).
    let console = (0..5)
        .filter_map(|_| server.proc.next_line(WAIT))
        .find_map(|l| {
            l.strip_prefix("console on http://")
                .map(|a| a.trim_end_matches('/').trim().to_string())
        })
        .expect("the console address on stdout");
    // Half a request, never finished.
    let mut conn = std::net::TcpStream::connect(&console).unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let asked = std::time::Instant::now();
    server.signal(nix::sys::signal::Signal::SIGTERM);
    let status = server.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "exit status {status:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(8),
        "exited after {:?}",
        asked.elapsed()
    );
    assert!(server.log().contains("database closed"), "{}", server.log());
    drop(conn);
}
