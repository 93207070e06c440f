//! `--backlog N`: does a deep queue slow leasing down? For a backlog of
//! 1,000 and of N pending jobs, AGQ is filled first (no worker connected),
//! then W one-slot workers connect and drain it. Measured per lease: from
//! a worker's completion report (its slot freed) to its next lease, over
//! the same number of leases for both sizes; also the completion ack, the
//! drain rate, the fill rate, and memory.

use std::{sync::Arc, time::Duration};

use super::{
    agq_load::{self, Fleet},
    harness::Harness,
    procstat::{self, CpuMark},
    report::{load_channels, verdict, wait_done, PLAN},
    stats::{now_us, Recorder, Summary},
    BenchArgs, BenchError,
};

/// The small backlog the large one is compared with.
pub const SMALL: usize = 1000;

/// Figures of one backlog size.
#[derive(Debug, Clone, Default)]
struct Result1 {
    pending: usize,
    fill_secs: f64,
    slot_to_lease: Summary,
    ack: Summary,
    drain_rate: f64,
    rss_after_fill: u64,
    server_cpu_per_lease_us: f64,
    completed: u64,
    target: u64,
}

async fn one(args: &BenchArgs, pending: usize, sample: usize) -> Result<Result1, BenchError> {
    let mut cfg = args.engine_config();
    cfg.max_inputs_per_action = 10_000;
    let h = Harness::start(&args.base_dir(), cfg, args.synchronous, args.server_threads).await?;
    let result = async {
        let (worker_channels, submit_channels) = load_channels(args, &h).await?;
        let k = pending.min(10_000);
        let actions = pending.div_ceil(k);
        let t = now_us();
        agq_load::submit_closed_loop(
            &submit_channels,
            args.clients,
            PLAN,
            actions,
            k,
            args.payload(),
        )
        .await?;
        let fill_secs = (now_us() - t) as f64 / 1e6;
        let rss_after_fill = procstat::rss(None);
        // Let the WAL checkpoint of the fill settle before measuring.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rec = Arc::new(Recorder::default());
        let target = sample.min(actions * k) as u64;
        rec.reset(target);
        let mark = CpuMark::now(None);
        let t0 = now_us();
        let spec = args.worker_spec(1);
        let fleet =
            Fleet::start(&worker_channels, args.workers, "drain", spec, rec.clone()).await?;
        let finished = wait_done(&rec, target, args.timeout()).await;
        let (server_cpu, _, _) = mark.since();
        let r = rec.take();
        fleet.stop().await;
        if !finished {
            println!(
                "  backlog {pending}: only {} of {target} leases completed in time",
                r.completed
            );
        }
        let secs = (r.last_done_us.saturating_sub(t0)) as f64 / 1e6;
        Ok::<_, BenchError>(Result1 {
            pending: actions * k,
            fill_secs,
            slot_to_lease: Summary::of(&r.slot_to_lease),
            ack: Summary::of(&r.completion_ack),
            drain_rate: if secs > 0.0 {
                r.completed as f64 / secs
            } else {
                0.0
            },
            rss_after_fill,
            server_cpu_per_lease_us: if r.completed > 0 {
                server_cpu * 1e6 / r.completed as f64
            } else {
                0.0
            },
            completed: r.completed.min(target),
            target,
        })
    }
    .await;
    let stopped = h.stop().await;
    let r = result?;
    stopped?;
    Ok(r)
}

/// Runs the backlog mode for `n` pending jobs. Returns false when the
/// sample did not complete.
pub async fn run(args: &BenchArgs, n: usize) -> Result<bool, BenchError> {
    let sample = args.backlog_sample.clamp(1, SMALL);
    println!(
        "backlog: {SMALL} vs {n} pending jobs, then W={} one-slot workers drain {sample} of them \
         (payload {} B)",
        args.workers, args.payload_bytes
    );
    let small = one(args, SMALL, sample).await?;
    let large = one(args, n, sample).await?;
    println!(
        "  {:<38} {:>14} {:>14} {:>10}",
        "",
        format!("{} pending", small.pending),
        format!("{} pending", large.pending),
        "large/small"
    );
    let line = |name: &str, a: String, b: String, r: String| {
        println!("  {name:<38} {a:>14} {b:>14} {r:>10}");
    };
    let ratio = |a: f64, b: f64| {
        if a > 0.0 {
            format!("{:.2}x", b / a)
        } else {
            "-".into()
        }
    };
    let lat = |s: &Summary| format!("{:.2}/{:.2}/{:.1}", s.p50, s.p99, s.max);
    line(
        "fill (submit) throughput (jobs/s)",
        format!("{:.0}", small.pending as f64 / small.fill_secs.max(1e-9)),
        format!("{:.0}", large.pending as f64 / large.fill_secs.max(1e-9)),
        String::new(),
    );
    line(
        "process RSS after fill (MB)",
        format!("{:.0}", small.rss_after_fill as f64 / 1048576.0),
        format!("{:.0}", large.rss_after_fill as f64 / 1048576.0),
        String::new(),
    );
    line(
        "slot freed -> next lease p50/p99/max",
        lat(&small.slot_to_lease),
        lat(&large.slot_to_lease),
        ratio(small.slot_to_lease.p99, large.slot_to_lease.p99) + " p99",
    );
    line(
        "completion ack p50/p99/max (ms)",
        lat(&small.ack),
        lat(&large.ack),
        ratio(small.ack.p99, large.ack.p99) + " p99",
    );
    line(
        "drain throughput (jobs/s)",
        format!("{:.0}", small.drain_rate),
        format!("{:.0}", large.drain_rate),
        ratio(small.drain_rate, large.drain_rate),
    );
    line(
        "server CPU per lease (µs)",
        format!("{:.0}", small.server_cpu_per_lease_us),
        format!("{:.0}", large.server_cpu_per_lease_us),
        ratio(small.server_cpu_per_lease_us, large.server_cpu_per_lease_us),
    );
    let (a, b) = (small.slot_to_lease.p99, large.slot_to_lease.p99);
    println!("bars (issue 7):");
    println!(
        "  lease latency with {} pending within 2 x of {}: p99 {b:.2} vs {a:.2} ms -> {}",
        large.pending,
        small.pending,
        verdict(a > 0.0 && b <= 2.0 * a)
    );
    Ok(small.completed >= small.target && large.completed >= large.target)
}
