//! `agq-bench`: AGQ against the Redis-list queue it replaces (issue 7).
//! Starts AGQ in-process and (when installed) a `redis-server`, drives both
//! with simulated workers and clients, prints the figures and the ratios.
//! See `agq_bench` and BENCHMARKS.md.

use std::process::ExitCode;

use clap::Parser;

/// Tells the server's heap from the simulated clients' (see `agq_bench::heap`).
#[global_allocator]
static ALLOC: agq_bench::heap::Tagged = agq_bench::heap::Tagged;

/// Benchmark AGQ against the seed's Redis-list design, in one run.
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
