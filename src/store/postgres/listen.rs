//! LISTEN/NOTIFY: one connection per replica, outside the pool, listens on
//! [`READY_CHANNEL`], [`COMMAND_CHANNEL`], [`WATCH_CHANNEL`] and
//! [`VERIFY_CHANNEL`] and wakes the dispatcher, the command pump, the
//! WatchAction subscribers and the challenge loop. A
//! lost connection is re-opened with backoff; after each (re)connect
//! everything is woken once (a full fetch), since notifications sent
//! meanwhile are lost. The watch notifier sends the actions this replica
//! changed, batched.

use std::{collections::HashSet, sync::Arc, time::Duration};

use futures_util::StreamExt;
use tokio_postgres::AsyncMessage;

use super::{
    lock, notify_names, wait, PgEngine, COMMAND_CHANNEL, READY_CHANNEL, VERIFY_CHANNEL,
    WATCH_CHANNEL,
};

/// The listener loop.
pub(super) async fn run(engine: Arc<PgEngine>) {
    let mut stop = engine.stopping();
    let mut backoff = Duration::from_millis(100);
    loop {
        if *stop.borrow() {
            return;
        }
        match engine.pg_config.connect(engine.tls.clone()).await {
            Ok((client, mut connection)) => {
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
                let listened = client
                    .batch_execute(&format!(
                        "LISTEN {READY_CHANNEL}; LISTEN {COMMAND_CHANNEL}; LISTEN {WATCH_CHANNEL}; \
                         LISTEN {VERIFY_CHANNEL}"
                    ))
                    .await;
                if let Err(e) = listened {
                    tracing::warn!(error = %e, "LISTEN failed");
                    pump.abort();
                } else {
                    backoff = Duration::from_millis(100);
                    // Whatever was notified while not listening: fetch it all.
                    engine.dispatch_wake.notify_one();
                    engine.commands_wake.notify_one();
                    engine.watchers.notify_all();
                    engine.verify_wake.notify_one();
                    loop {
                        tokio::select! {
                            n = rx.recv() => match n {
                                Some(n) => engine.notified(n.channel(), n.payload()),
                                None => break,
                            },
                            _ = stop.changed() => {
                                pump.abort();
                                return;
                            }
                        }
                    }
                }
                drop(client);
            }
            Err(e) => {
                tracing::warn!(error = %e, "PostgreSQL listener cannot connect");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
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
