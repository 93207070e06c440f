//! LISTEN/NOTIFY: one connection per replica, outside the pool, listens on
//! [`READY_CHANNEL`], [`COMMAND_CHANNEL`], [`WATCH_CHANNEL`] and
//! [`VERIFY_CHANNEL`] and wakes the dispatcher, the command pump, the
//! WatchAction subscribers and the challenge loop. A
//! lost connection is re-opened with backoff; after each (re)connect
//! everything is woken once (a full fetch), since notifications sent
//! meanwhile are lost. A connection that went silent (a half-open TCP
//! connection, a stalled server process) reports no error: the listener
//! probes it every [`PROBE_EVERY`] and re-opens it when it does not answer
//! within [`PROBE_TIMEOUT`]. The watch notifier sends the actions this
//! replica changed, batched.

use std::{collections::HashSet, sync::Arc, time::Duration};

use futures_util::StreamExt;
use tokio_postgres::AsyncMessage;

use super::{
    lock, notify_names, wait, PgEngine, COMMAND_CHANNEL, READY_CHANNEL, VERIFY_CHANNEL,
    WATCH_CHANNEL,
};

/// How often the listener checks that its connection still answers (its
/// `LISTEN` statement again, which changes nothing on a session that
/// listens already): notifications arrive only on a live connection,
/// and one that went silent never reports an error, so without the probe
/// the replica would never hear another notification (watchers of changes
/// made on other replicas would wait forever).
const PROBE_EVERY: Duration = Duration::from_secs(2);

/// How long the listener's probe, and its connect and `LISTEN`, may take
/// before the connection is given up and opened anew.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The listener loop.
pub(super) async fn run(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    let mut backoff = Duration::from_millis(100);
    loop {
        if *stop.borrow() {
            return;
        }
        // A server that accepts the connection and then says nothing
        // would hold the listener here for good.
        match tokio::time::timeout(PROBE_TIMEOUT, engine.pg_config.connect(engine.tls.clone()))
            .await
        {
            Ok(Ok((client, mut connection))) => {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let pump = tokio::spawn(async move {
                    let mut messages =
                        futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(m) = messages.next().await {
                        match m {
                            Ok(AsyncMessage::Notification(n)) => {
                                if tx.send(n).is_err() {
                                    return;
                                }
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "PostgreSQL listener connection lost");
                                return;
                            }
                        }
                    }
                });
                let listen = format!(
                    "LISTEN {READY_CHANNEL}; LISTEN {COMMAND_CHANNEL}; LISTEN {WATCH_CHANNEL}; \
                     LISTEN {VERIFY_CHANNEL}"
                );
                let listened =
                    tokio::time::timeout(PROBE_TIMEOUT, client.batch_execute(&listen)).await;
                match listened {
                    Ok(Ok(())) => {
                        backoff = Duration::from_millis(100);
                        // Whatever was notified while not listening: fetch it all.
                        engine.dispatch_wake.notify_one();
                        engine.commands_wake.notify_one();
                        engine.watchers.notify_all();
                        engine.verify_wake.notify_one();
                        let mut probe = tokio::time::interval(PROBE_EVERY);
                        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        probe.tick().await;
                        loop {
                            tokio::select! {
                                n = rx.recv() => match n {
                                    Some(n) => engine.notified(n.channel(), n.payload()),
                                    None => break,
                                },
                                // Notifications that arrive meanwhile wait in `rx`.
                                _ = probe.tick() => if !answers(&client, &listen).await {
                                    break;
                                },
                                _ = stop.changed() => {
                                    pump.abort();
                                    return;
                                }
                            }
                        }
                    }
                    Ok(Err(e)) => tracing::warn!(error = %e, "LISTEN failed"),
                    Err(_) => tracing::warn!("LISTEN did not answer within {PROBE_TIMEOUT:?}"),
                }
                // The connection is given up: closed here, not left to a
                // server that may never answer again.
                pump.abort();
                drop(client);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "PostgreSQL listener cannot connect");
            }
            Err(_) => {
                tracing::warn!(
                    "PostgreSQL listener connection not opened within {PROBE_TIMEOUT:?}"
                );
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Whether the listener's connection answers `listen` (its `LISTEN`
/// statement again) within [`PROBE_TIMEOUT`]; a connection that does not
/// is given up.
async fn answers(client: &tokio_postgres::Client, listen: &str) -> bool {
    match tokio::time::timeout(PROBE_TIMEOUT, client.batch_execute(listen)).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "PostgreSQL listener connection failed its probe; reconnecting");
            false
        }
        Err(_) => {
            tracing::warn!(
                "PostgreSQL listener connection did not answer within {PROBE_TIMEOUT:?}; reconnecting"
            );
            false
        }
    }
}

impl PgEngine {
    /// Acts on one notification.
    fn notified(&self, channel: &str, payload: &str) {
        match channel {
            READY_CHANNEL => self.dispatch_wake.notify_one(),
            COMMAND_CHANNEL => {
                let local = lock(&self.local);
                if payload.split(',').any(|w| local.workers.contains_key(w)) {
                    drop(local);
                    self.commands_wake.notify_one();
                    // A command may have freed a slot (a cancel).
                    self.dispatch_wake.notify_one();
                }
            }
            WATCH_CHANNEL => {
                if payload == "*" {
                    self.watchers.notify_all();
                } else {
                    let mut ids: HashSet<Arc<str>> = payload.split(',').map(Arc::from).collect();
                    self.watchers.notify(&mut ids);
                }
            }
            VERIFY_CHANNEL => self.verify_wake.notify_one(),
            _ => {}
        }
    }
}

/// Sends the actions this replica changed on [`WATCH_CHANNEL`], at most
/// every 10 ms: watchers on every replica (this one included) are woken
/// by it. Actions whose notification could not be sent (no connection,
/// the database unreachable) are kept and sent again at the next wake or
/// within a second, until it goes out: watchers on other replicas learn
/// of the change only through it.
pub(super) async fn watch_notifier(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    while wait(&engine.watch_wake, Duration::from_secs(1), &mut stop).await {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let touched: Vec<String> = lock(&engine.local).touched.drain().collect();
        if touched.is_empty() {
            continue;
        }
        let sent = async {
            let c = engine.client().await?;
            if touched.len() > 200 {
                notify_names(&c, WATCH_CHANNEL, &["*".to_string()]).await
            } else {
                notify_names(&c, WATCH_CHANNEL, &touched).await
            }
        }
        .await;
        if let Err(e) = sent {
            tracing::debug!(error = %e, "watch notification not sent; retrying");
            // Local subscribers learn of it now; those of other replicas
            // when it is sent again (a payload sent before the failure is
            // sent twice, which only wakes its watchers once more).
            engine.watchers.notify_all();
            lock(&engine.local).touched.extend(touched);
        }
    }
}
