//! Agentic units: executables named by `--agentic-unit` (or found in
//! `--agentic-unit-dir`) that describe themselves. At start agw runs each
//! as `UNIT --describe` (no stdin, a minimal environment, at most 10 s and
//! 64 KiB of output) and reads a JSON object:
//!
//! ```json
//! {"name": "summarize", "version": "1.2.0", "description": "…",
//!  "inputs": [{"name": "file", "description": "…"}]}
//! ```
//!
//! (`inputs` may also be a list of names.) The unit is then advertised
//! under `name`, and a task whose command is that name runs it, in the
//! same sandbox as the tools.

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde::Deserialize;

use super::error::WorkerError;
use crate::core::{
    model::{AgenticUnit, AgenticUnitInput},
    validate,
};

/// Longest `--describe` may run.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes of a `--describe` answer read.
const DESCRIBE_MAX_BYTES: u64 = 64 * 1024;

#[derive(Deserialize)]
#[serde(untagged)]
enum InputSpec {
    Name(String),
    Full {
        name: String,
        #[serde(default)]
        description: String,
    },
}

#[derive(Deserialize)]
struct Describe {
    name: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    inputs: Vec<InputSpec>,
}

/// The units of `paths` and of the executable files of `dir`, each with
/// the absolute path of its executable, in name order.
///
/// # Errors
///
/// [`WorkerError::Config`] naming the unit: not an executable file, a
/// `--describe` that fails, times out or answers no valid description, a
/// name a task could not use, or two units with one name.
pub fn discover(
    paths: &[PathBuf],
    dir: Option<&Path>,
) -> Result<Vec<(AgenticUnit, PathBuf)>, WorkerError> {
    let mut files: Vec<PathBuf> = paths.to_vec();
    if let Some(dir) = dir {
        let entries = std::fs::read_dir(dir).map_err(|e| {
            WorkerError::Config(format!("--agentic-unit-dir {}: {e}", dir.display()))
        })?;
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| is_executable(p))
            .collect();
        found.sort();
        files.extend(found);
    }
    let mut units: Vec<(AgenticUnit, PathBuf)> = Vec::new();
    for file in files {
        let path = std::fs::canonicalize(&file)
            .map_err(|e| WorkerError::Config(format!("agentic unit {}: {e}", file.display())))?;
        if !is_executable(&path) {
            return Err(WorkerError::Config(format!(
                "agentic unit {} is not an executable file",
                file.display()
            )));
        }
        let unit = describe(&path)
            .map_err(|e| WorkerError::Config(format!("agentic unit {}: {e}", file.display())))?;
        if units.iter().any(|(u, _)| u.name == unit.name) {
            return Err(WorkerError::Config(format!(
                "two agentic units are named {:?}",
                unit.name
            )));
        }
        units.push((unit, path));
    }
    units.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    Ok(units)
}

/// Runs `path --describe` and reads its description, within
/// [`DESCRIBE_TIMEOUT`] in all: the unit runs in a process group of its
/// own, killed once the unit exits or the time is up, so a child it left
/// behind holding its stdout neither outlives it nor holds agw's start-up.
fn describe(path: &Path) -> Result<AgenticUnit, String> {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new(path)
        .arg("--describe")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("LANG", "C.UTF-8")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot run --describe: {e}"))?;
    let group = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    let kill_group = || {
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    };
    // Read on a thread of its own: a unit may print more than the pipe
    // holds before it exits, and a process it left behind may keep the
    // pipe open after it exited.
    let (read_tx, read_rx) = std::sync::mpsc::channel();
    if let Some(stdout) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let r = stdout.take(DESCRIBE_MAX_BYTES).read_to_end(&mut out);
            let _ = read_tx.send(r.map(|_| out));
        });
    }
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > DESCRIBE_TIMEOUT => {
                kill_group();
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "--describe ran longer than {} s",
                    DESCRIBE_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("waiting for --describe: {e}")),
        }
    };
    // What it left behind in its group goes with it.
    kill_group();
    let left = DESCRIBE_TIMEOUT.saturating_sub(started.elapsed());
    let out = match read_rx.recv_timeout(left) {
        Ok(r) => r.map_err(|e| format!("reading --describe: {e}"))?,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            return Err(format!(
                "--describe exited, but a process it started outside its group kept its \
                 output open for {} s",
                DESCRIBE_TIMEOUT.as_secs()
            ))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Vec::new(),
    };
    if !status.success() {
        return Err(format!("--describe exited with {status}"));
    }
    let d: Describe = serde_json::from_slice(&out)
        .map_err(|e| format!("--describe did not print a JSON description: {e}"))?;
    validate::command_name(&d.name).map_err(|e| format!("its name: {e}"))?;
    Ok(AgenticUnit {
        name: d.name,
        version: d.version,
        description: d.description,
        inputs: d
            .inputs
            .into_iter()
            .map(|i| match i {
                InputSpec::Name(name) => AgenticUnitInput {
                    name,
                    description: String::new(),
                },
                InputSpec::Full { name, description } => AgenticUnitInput { name, description },
            })
            .collect(),
    })
}

/// True when `p` is a regular file (following symlinks) with an execute bit.
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn reads_descriptions_and_refuses_bad_ones() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "u1",
            r#"echo '{"name":"summarize","version":"1.0","description":"Summarizes","inputs":["file",{"name":"lang","description":"ISO code"}]}'"#,
        );
        let units = discover(&[], Some(dir.path())).unwrap();
        assert_eq!(units.len(), 1);
        let u = &units[0].0;
        assert_eq!((u.name.as_str(), u.version.as_str()), ("summarize", "1.0"));
        assert_eq!(u.inputs[1].description, "ISO code");
        // A unit that leaves a child holding its stdout: read as soon as
        // the unit exits, and the child is killed with it.
        let held = tempfile::tempdir().unwrap();
        let pid_file = held.path().join("child.pid");
        let p = script(
            held.path(),
            "u",
            &format!(
                r#"sleep 30 &
echo $! > {f}
echo '{{"name":"lingers"}}'"#,
                f = pid_file.display()
            ),
        );
        let started = Instant::now();
        let units = discover(&[p], None).unwrap();
        assert_eq!(units[0].0.name, "lingers");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let child: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let gone = (0..200).any(|_| {
            let alive = std::fs::read_to_string(format!("/proc/{child}/stat"))
                .is_ok_and(|st| !st.contains(") Z "));
            if alive {
                std::thread::sleep(Duration::from_millis(10));
            }
            !alive
        });
        assert!(gone, "the unit's child {child} outlived it");
        for body in [
            "echo not json",
            "exit 3",
            r#"echo '{"name":"bad name"}'"#,
            r#"echo '{"version":"1"}'"#,
        ] {
            let bad = tempfile::tempdir().unwrap();
            let p = script(bad.path(), "u", body);
            assert!(discover(&[p], None).is_err(), "{body}");
        }
    }
}
