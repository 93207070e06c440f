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

/// Runs `path --describe` and reads its description.
fn describe(path: &Path) -> Result<AgenticUnit, String> {
    let mut child = Command::new(path)
        .arg("--describe")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("LANG", "C.UTF-8")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run --describe: {e}"))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > DESCRIBE_TIMEOUT => {
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
    let mut out = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        stdout
            .take(DESCRIBE_MAX_BYTES)
            .read_to_end(&mut out)
            .map_err(|e| format!("reading --describe: {e}"))?;
    }
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
