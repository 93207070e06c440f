//! `agq-bench`: AGQ against a Redis-list job queue and BullMQ, on the same
//! machine. Starts AGQ in-process and (when installed) a `redis-server` for
//! each peer, drives them with simulated workers and clients (BullMQ's from
//! its Node.js harness), prints the figures and the ratios.
//! Its global allocator tags each heap block with the side (server or
//! clients) that allocated it. See the `agq_bench` library and BENCHMARKS.md.

use std::process::ExitCode;

use clap::Parser;

/// Tells the server's heap from the simulated clients' (see `agq_bench::heap`).
#[global_allocator]
static ALLOC: agq_bench::heap::Tagged = agq_bench::heap::Tagged;

/// Benchmark AGQ against a Redis-list job queue (LPUSH/BRPOP) and BullMQ, in one run.
#[derive(Debug, Parser)]
#[command(name = "agq-bench", version, about)]
struct Cli {
    #[command(flatten)]
    args: agq_bench::BenchArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    agq_bench::init_logging();
    ExitCode::from(agq_bench::main(cli.args) as u8)
}
