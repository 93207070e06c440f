//! CPU time and memory of the bench process, of its server threads and of
//! the Redis child, read from `/proc` (Linux) and `getrusage`.
//!
//! AGQ runs in-process on its own named threads (`agq-srv` runtime threads,
//! the `agq-writer` thread, r2d2's pool threads), so its CPU can be told
//! apart from the simulated clients' by summing per-thread times. Memory
//! cannot be split by thread: the peak RSS printed for AGQ is that of the
//! whole process (server and clients), an upper bound of the server's.

use std::{fs, time::Duration};

/// Thread-name prefixes that belong to the in-process AGQ server.
pub const SERVER_THREADS: &[&str] = &["agq-srv", "agq-writer", "agq-checkpoint", "r2d2"];

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// (comm, utime + stime) of one `/proc/.../stat` file.
fn parse_stat(text: &str) -> Option<(String, Duration)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = text.get(close + 2..)?.split_whitespace().collect();
    // Fields after the comm start at field 3 (state); utime is 14, stime 15.
    let utime: u64 = rest.get(11)?.parse().ok()?;
    let stime: u64 = rest.get(12)?.parse().ok()?;
    let secs = (utime + stime) as f64 / clock_ticks();
    Some((comm, Duration::from_secs_f64(secs)))
}

/// CPU time (user + system) of the live threads of this process whose name
/// starts with one of `prefixes`.
pub fn threads_cpu(prefixes: &[&str]) -> Duration {
    let Ok(dir) = fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let mut total = Duration::ZERO;
    for entry in dir.flatten() {
        let Ok(text) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((comm, cpu)) = parse_stat(&text) {
            if prefixes.iter().any(|p| comm.starts_with(p)) {
                total += cpu;
            }
        }
    }
    total
}

/// CPU time (user + system) of the whole process so far, from `getrusage`.
pub fn process_cpu() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU time (user + system) of process `pid`.
pub fn pid_cpu(pid: u32) -> Duration {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| parse_stat(&t))
        .map(|(_, d)| d)
        .unwrap_or_default()
}

fn status_kb(pid: &str, field: &str) -> u64 {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return 0;
    };
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Peak resident set size (VmHWM) of `pid` (`None`: this process), bytes.
pub fn peak_rss(pid: Option<u32>) -> u64 {
    let p = pid.map_or_else(|| "self".to_string(), |p| p.to_string());
    status_kb(&p, "VmHWM:") * 1024
}

/// Current resident set size (VmRSS) of `pid` (`None`: this process), bytes.
pub fn rss(pid: Option<u32>) -> u64 {
    let p = pid.map_or_else(|| "self".to_string(), |p| p.to_string());
    status_kb(&p, "VmRSS:") * 1024
}

/// Resets this process's peak RSS to its current RSS (Linux >= 4.0), so the
/// next [`peak_rss`] covers one phase only. Returns false when not possible.
pub fn reset_peak_rss() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A CPU reading of the server threads, the whole process and (optionally)
/// a child process, taken at one moment.
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    server: Duration,
    writer: Duration,
    process: Duration,
    child: Option<(u32, Duration)>,
}

impl CpuMark {
    /// Reads the clocks now; `child` is a process whose CPU to follow too.
    pub fn now(child: Option<u32>) -> CpuMark {
        CpuMark {
            server: threads_cpu(SERVER_THREADS),
            writer: threads_cpu(&["agq-writer"]),
            process: process_cpu(),
            child: child.map(|p| (p, pid_cpu(p))),
        }
    }

    /// CPU seconds of the store's writer thread since this mark.
    pub fn writer_since(&self) -> f64 {
        threads_cpu(&["agq-writer"])
            .saturating_sub(self.writer)
            .as_secs_f64()
    }

    /// CPU seconds since this mark: (server threads, whole process, child).
    pub fn since(&self) -> (f64, f64, f64) {
        let now = CpuMark::now(self.child.map(|(p, _)| p));
        let child = match (self.child, now.child) {
            (Some((_, a)), Some((_, b))) => b.saturating_sub(a).as_secs_f64(),
            _ => 0.0,
        };
        (
            now.server.saturating_sub(self.server).as_secs_f64(),
            now.process.saturating_sub(self.process).as_secs_f64(),
            child,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_stat_line_with_spaces_in_the_name() {
        let line = "42 (agq srv) x) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        let (comm, cpu) = parse_stat(line).unwrap();
        assert_eq!(comm, "agq srv) x");
        let want = 300.0 / clock_ticks();
        assert!((cpu.as_secs_f64() - want).abs() < 1e-6);
    }

    #[test]
    fn reads_this_process() {
        assert!(peak_rss(None) > 0);
        assert!(rss(None) > 0);
        let _ = process_cpu();
    }
}
