//! `agq`: the AGQ server (`agq serve`) and its command-line client.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use agq::{
    auth::Authenticator,
    cli::{demo::DemoArgs, ClientCommand, ClientOptions},
    config::{LogFormat, ServeArgs},
    server::{self, ServerOptions, TlsFiles},
    telemetry,
};

/// The server's heap: mimalloc (its 2.x line, without transparent huge
/// pages), which takes about a quarter off the server's CPU per job
/// against the system allocator (BENCHMARKS.md, sessions 8 and 14);
/// `agq-bench` runs its in-process server on it too. The crate's
/// `override` feature also makes it the process's C `malloc`, which
/// SQLite allocates from (session 15).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// AGQ: a durable gRPC job queue for fanning Unix pipelines out to workers.
#[derive(Debug, Parser)]
#[command(name = "agq", version, about)]
struct Cli {
    #[command(flatten)]
    client: ClientOptions,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the AGQ server.
    Serve(Box<ServeArgs>),
    #[command(flatten)]
    Client(ClientCommand),
    /// Run AGQ and two agw workers locally and count words in real files.
    Demo(DemoArgs),
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        _ = term.recv() => tracing::info!("SIGTERM received"),
    }
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let auth = match &args.auth_file {
        Some(path) => Authenticator::load(path).map_err(|e| e.to_string())?,
        None => Authenticator::default(),
    };
    if auth.is_disabled() && !args.listen.ip().is_loopback() && !args.insecure {
        return Err(format!(
            "refusing to listen on {} without authentication: pass --auth-file (AGQ_AUTH_FILE), \
             listen on a loopback address, or pass --insecure (AGQ_INSECURE=true) to accept the risk",
            args.listen
        ));
    }
    if auth.is_disabled() && !args.no_console && !args.console_listen.ip().is_loopback() {
        return Err(format!(
            "refusing to serve the console on {} without authentication: pass --auth-file \
             (AGQ_AUTH_FILE), a loopback --console-listen, or --no-console",
            args.console_listen
        ));
    }
    if auth.is_disabled() {
        tracing::warn!("no --auth-file: every caller is trusted");
    }
    if args.tls_cert.is_some() && !args.no_console && !args.console_listen.ip().is_loopback() {
        tracing::warn!(
            console = %args.console_listen,
            "the console speaks plain HTTP, not the gRPC port's TLS: its tokens travel in \
             clear text unless something in front of it terminates TLS (an ingress), or use \
             a loopback --console-listen and port-forward"
        );
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_listen)
        .await
        .map_err(|e| format!("cannot listen on {} for metrics: {e}", args.metrics_listen))?;
    let console_listener = if args.no_console {
        None
    } else {
        Some(
            tokio::net::TcpListener::bind(args.console_listen)
                .await
                .map_err(|e| {
                    format!(
                        "cannot listen on {} for the console: {e} (pass --console-listen ADDR or --no-console)",
                        args.console_listen
                    )
                })?,
        )
    };
    let caddr = console_listener
        .as_ref()
        .map(|l| l.local_addr().map_err(|e| e.to_string()))
        .transpose()?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let maddr = metrics_listener.local_addr().map_err(|e| e.to_string())?;
    let opts = ServerOptions {
        store_ca_file: args.store_ca_file.clone(),
        store: args.store.clone(),
        db: args.db.clone(),
        sqlite_synchronous: args.sqlite_synchronous,
        engine: args.engine_config(),
        auth,
        tls: args
            .tls_cert
            .clone()
            .zip(args.tls_key.clone())
            .map(|(cert, key)| TlsFiles {
                cert,
                key,
                client_ca: args.tls_client_ca.clone(),
            }),
        shutdown_grace: std::time::Duration::from_secs(args.shutdown_grace_secs),
        request_buffer_bytes: usize::try_from(args.request_buffer_mb)
            .unwrap_or(usize::MAX)
            .saturating_mul(1024 * 1024),
    };
    // The PostgreSQL URL may carry a password: only the SQLite path is logged.
    let db = match &args.store {
        agq::config::Store::Sqlite => args.db.display().to_string(),
        agq::config::Store::Postgres(_) => "postgresql".to_string(),
    };
    server::run(
        listener,
        Some(metrics_listener),
        console_listener,
        opts,
        shutdown_signal(),
        |_| {
            tracing::info!(grpc = %addr, metrics = %maddr, db, "agq serving");
            // Not println!: a closed stdout must not bring the server down.
            use std::io::Write;
            let mut out = std::io::stdout();
            let _ = writeln!(out, "listening on {addr}");
            let _ = writeln!(out, "metrics on http://{maddr}/metrics");
            if let Some(c) = caddr {
                let _ = writeln!(out, "console on http://{c}/");
            }
            let _ = out.flush();
        },
    )
    .await
    .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            agq::cli::to_stderr(format_args!("agq: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Serve(args) => {
            let endpoint = telemetry::endpoint(args.otlp_endpoint.as_deref());
            let json = args.log_format == LogFormat::Json;
            let tel = {
                let _rt = runtime.enter();
                telemetry::init("agq", json, endpoint.as_deref())
            };
            match tel {
                Ok(tel) => {
                    let r = runtime.block_on(serve(*args));
                    tel.shutdown();
                    r
                }
                Err(e) => Err(e),
            }
        }
        Command::Client(cmd) => client_exit(runtime.block_on(agq::cli::run(&cli.client, cmd))),
        Command::Demo(args) => {
            if std::env::var_os("RUST_LOG").is_some() {
                // Logs only: the demo exports no spans.
                let _ = telemetry::init("agq", false, None);
            }
            client_exit(runtime.block_on(agq::cli::demo::run(args)))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The message may quote the server, and through it anyone's
            // text: shown, never obeyed by the terminal.
            agq::cli::to_stderr(format_args!(
                "agq: {}",
                agq::cli::visible_lines(&e.to_string())
            ));
            ExitCode::FAILURE
        }
    }
}

/// Result of a client command or the demo: `Ok` also for a closed stdout
/// (`agq job list X | head`), which ends quietly.
fn client_exit(result: Result<(), agq::cli::CliError>) -> Result<(), String> {
    match result {
        Err(e) if e.is_silent() => Ok(()),
        other => other.map_err(|e| e.to_string()),
    }
}
