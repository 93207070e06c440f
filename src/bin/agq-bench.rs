//! `agq-bench`: AGQ against the Redis-list queue it replaces (issue 7).
//! Starts AGQ in-process and (when installed) a `redis-server`, drives both
//! with simulated workers and clients, prints the figures and the ratios.
//! See `agq::bench` and BENCHMARKS.md.

use std::process::ExitCode;

use clap::Parser;

/// Benchmark AGQ against the seed's Redis-list design, in one run.
#[derive(Debug, Parser)]
#[command(name = "agq-bench", version, about)]
struct Cli {
    #[command(flatten)]
    args: agq::bench::BenchArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("AGQ_BENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    ExitCode::from(agq::bench::main(cli.args) as u8)
}
