//! `--soak-secs N` (issue 8): AGQ under a steady load of half its measured
//! peak for N seconds, sampling the server's RSS, open files and database
//! size over time, so a leak (memory, descriptors, WAL that never shrinks)
//! shows as growth.
//!
//! The server runs as a child `agq serve` process (the `agq` binary next to
//! `agq-bench`, or `--agq-binary`), so the RSS and descriptors sampled are
//! its own; without such a binary it runs in-process and the figures are
//! the whole bench process's. The rate is `--soak-rate`, or half of the
//! end-to-end rate of a peak phase run first (`--jobs` jobs, closed loop).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    agq_load::{self, Fleet},
    harness::Harness,
    procstat,
    report::{self, PLAN},
    stats::{now_us, Recorder, Summary},
    BenchArgs, BenchError,
};

/// One sample of the soak.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    /// Seconds since the soak started.
    pub secs: f64,
    /// Server resident set size, bytes.
    pub rss: u64,
    /// Open file descriptors of the server.
    pub fds: u64,
    /// Bytes of the database, its WAL and shared-memory file.
    pub db_bytes: u64,
    /// Jobs completed so far.
    pub completed: u64,
}

/// Open file descriptors of `pid` (`None`: this process).
pub fn open_fds(pid: Option<u32>) -> u64 {
    let p = pid.map_or_else(|| "self".to_string(), |p| p.to_string());
    std::fs::read_dir(format!("/proc/{p}/fd")).map_or(0, |d| d.count() as u64)
}

/// Bytes of the SQLite database `db` with its `-wal` and `-shm` files.
pub fn db_bytes(db: &Path) -> u64 {
    ["", "-wal", "-shm"]
        .iter()
        .filter_map(|s| std::fs::metadata(format!("{}{s}", db.display())).ok())
        .map(|m| m.len())
        .sum()
}

/// The `agq` binary to run the server from: `--agq-binary`, else `agq`
/// next to this executable when it exists.
fn server_binary(args: &BenchArgs) -> Option<PathBuf> {
    if let Some(b) = &args.agq_binary {
        return Some(b.clone());
    }
    let sibling = std::env::current_exe().ok()?.with_file_name("agq");
    sibling.is_file().then_some(sibling)
}

fn mb(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

fn print_sample(s: &Sample) {
    println!(
        "  {:>7.0} {:>9.1} {:>5} {:>11.1} {:>12}",
        s.secs,
        mb(s.rss),
        s.fds,
        mb(s.db_bytes),
        s.completed
    );
}

/// Runs the soak for `secs` seconds and prints the samples and a summary.
/// Returns false when a job did not complete or a call failed.
///
/// Errors: setup failures, a failed SubmitAction.
pub async fn run(args: &BenchArgs, secs: u64) -> Result<bool, BenchError> {
    let binary = server_binary(args);
    let h = report::start_agq(args, binary.as_deref()).await?;
    let pid = h.pid();
    println!(
        "soak: AGQ {}",
        match &binary {
            Some(b) => format!(
                "as a child process ({} serve): its own RSS and fds",
                b.display()
            ),
            None => "in-process (no agq binary found): RSS and fds are the whole bench's".into(),
        }
    );
    let (worker_channels, submit_channels) = report::load_channels(args, &h).await?;
    let rec = Arc::new(Recorder::default());
    let spec = args.worker_spec(args.slots);
    let fleet = Fleet::start(&worker_channels, args.workers, "soak", spec, rec.clone()).await?;
    let result = soak(args, &h, pid, &submit_channels, &rec, secs).await;
    fleet.stop().await;
    drop(worker_channels);
    drop(submit_channels);
    let stopped = h.stop().await;
    let ok = result?;
    stopped?;
    Ok(ok)
}

async fn soak(
    args: &BenchArgs,
    h: &Harness,
    pid: Option<u32>,
    submit_channels: &[tonic::transport::Channel],
    rec: &Arc<Recorder>,
    secs: u64,
) -> Result<bool, BenchError> {
    let rate = match args.soak_rate {
        Some(r) => r,
        None => {
            let peak =
                report::agq_phase(args, h, submit_channels, rec, args.jobs as u64, None).await?;
            println!(
                "soak: peak end-to-end {:.0} jobs/s ({} jobs, closed loop); soaking at half of it",
                peak.e2e_rate(),
                peak.completed
            );
            peak.e2e_rate() / 2.0
        }
    };
    let k = args.per_action as usize;
    let actions = ((rate * secs as f64) as usize / k).max(1);
    let jobs = (actions * k) as u64;
    println!(
        "soak: {jobs} jobs at {rate:.0} jobs/s for {secs} s, W={} workers x {} slots, actions of {k}, sample every {} s",
        args.workers, args.slots, args.soak_sample_secs
    );
    println!(
        "  {:>7} {:>9} {:>5} {:>11} {:>12}",
        "secs", "rss MB", "fds", "db MB", "completed"
    );
    rec.reset(jobs);
    let db = h.db_path();
    let start = Instant::now();
    let t0 = now_us();
    let submit = tokio::spawn(agq_load::submit_paced(
        submit_channels[0].clone(),
        PLAN,
        actions,
        k,
        rate,
        args.payload(),
    ));
    let take = || Sample {
        secs: start.elapsed().as_secs_f64(),
        rss: procstat::rss(pid),
        fds: open_fds(pid),
        db_bytes: db_bytes(&db),
        completed: rec.completed(),
    };
    let mut samples = vec![take()];
    print_sample(&samples[0]);
    let every = Duration::from_secs(args.soak_sample_secs.max(1));
    let deadline = start + Duration::from_secs(secs) + args.timeout();
    let mut next = start + every;
    while rec.completed() < jobs && Instant::now() < deadline {
        let wait = next.saturating_duration_since(Instant::now());
        let _ = tokio::time::timeout(wait, rec.done.notified()).await;
        if Instant::now() >= next {
            let s = take();
            print_sample(&s);
            samples.push(s);
            next += every;
        }
    }
    let last = take();
    print_sample(&last);
    samples.push(last);
    let submitted = submit
        .await
        .map_err(|e| BenchError::Failed(format!("submit task: {e}")))?;
    let r = rec.take();
    let lease = Summary::of(&r.enqueue_to_lease);
    let elapsed = r.last_done_us.saturating_sub(t0) as f64 / 1e6;
    let first = samples[0];
    // Growth after warm-up: from the first sample past 60 s (or the first)
    // to the last.
    let warm = samples
        .iter()
        .find(|s| s.secs >= 60.0)
        .copied()
        .unwrap_or(first);
    let max_rss = samples.iter().map(|s| s.rss).max().unwrap_or(0);
    println!(
        "soak: {} of {jobs} jobs completed in {elapsed:.1} s ({:.0} jobs/s), {} errors{}",
        r.completed,
        if elapsed > 0.0 {
            r.completed as f64 / elapsed
        } else {
            0.0
        },
        r.errors,
        r.last_error
            .as_deref()
            .map(|e| format!(" (last: {e})"))
            .unwrap_or_default()
    );
    println!(
        "soak: enqueue-to-lease p50/p99/max {:.2}/{:.2}/{:.1} ms",
        lease.p50, lease.p99, lease.max
    );
    println!(
        "soak: RSS {:.1} MB at start, {:.1} MB at {:.0} s, {:.1} MB at the end (max {:.1} MB); fds {} -> {}; database {:.1} -> {:.1} MB ({:.0} bytes per job)",
        mb(first.rss),
        mb(warm.rss),
        warm.secs,
        mb(last.rss),
        mb(max_rss),
        first.fds,
        last.fds,
        mb(first.db_bytes),
        mb(last.db_bytes),
        last.db_bytes.saturating_sub(first.db_bytes) as f64 / r.completed.max(1) as f64
    );
    let ok = submitted.is_ok() && r.completed >= jobs && r.errors == 0;
    if let Err(e) = submitted {
        println!("soak: FAILED: {e}");
    }
    Ok(ok)
}
