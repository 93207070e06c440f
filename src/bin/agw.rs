//! `agw`: the AGQ worker binary. Parses flags, starts logging, turns
//! SIGTERM/SIGINT into drain requests and runs [`agq::worker::run`].
//!
//! Exit codes: 0 after a drain, 130 after a second signal, 1 on a
//! configuration or registration error.

use std::process::ExitCode;

use agq::telemetry;
use agq::worker::{self, AgwArgs, Exit, LogFormat};
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};

fn main() -> ExitCode {
    // Before anything reads a secret: tasks running as this user must not
    // read /proc/<agw pid>/environ or mem (the token lives there).
    if let Err(e) = worker::sandbox::make_undumpable() {
        eprintln!("agw: cannot mark the process non-dumpable: {e}");
        return ExitCode::FAILURE;
    }
    // A task's descendant that leaves its process group and outlives its
    // parent comes back to agw, which kills it, instead of running on.
    if let Err(e) = worker::executor::adopt_orphans() {
        eprintln!("agw: cannot become the subreaper of its tasks: {e}");
        return ExitCode::FAILURE;
    }
    let args = AgwArgs::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("agw: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let endpoint = telemetry::endpoint(args.otlp_endpoint.as_deref());
    let tel = {
        let _rt = runtime.enter();
        telemetry::init(
            "agw",
            args.log_format == LogFormat::Json,
            endpoint.as_deref(),
        )
    };
    let tel = match tel {
        Ok(t) => t,
        Err(e) => {
            eprintln!("agw: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut term = signal(SignalKind::terminate())
            .map_err(|e| worker::WorkerError::Config(format!("SIGTERM handler: {e}")))?;
        let mut int = signal(SignalKind::interrupt())
            .map_err(|e| worker::WorkerError::Config(format!("SIGINT handler: {e}")))?;
        // A hangup or a quit would otherwise end agw without the sweep
        // that kills what its tasks left running: they stop it the same way.
        let mut hup = signal(SignalKind::hangup())
            .map_err(|e| worker::WorkerError::Config(format!("SIGHUP handler: {e}")))?;
        let mut quit = signal(SignalKind::quit())
            .map_err(|e| worker::WorkerError::Config(format!("SIGQUIT handler: {e}")))?;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                    _ = hup.recv() => {}
                    _ = quit.recv() => {}
                }
                if tx.send(()).await.is_err() {
                    break;
                }
            }
        });
        let cfg = args.into_config()?;
        worker::run(cfg, rx).await
    });
    // Before the runtime goes: the exporter sends the last spans on it.
    tel.shutdown();
    match result {
        Ok(Exit::Drained) => {
            // Do not wait for blocking threads (stats readers) to wind down.
            runtime.shutdown_background();
            ExitCode::SUCCESS
        }
        Ok(Exit::Forced) => std::process::exit(130),
        Err(e) => {
            eprintln!("agw: {e}");
            runtime.shutdown_background();
            ExitCode::FAILURE
        }
    }
}
