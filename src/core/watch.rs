//! WatchAction subscriptions: one watch channel per watched action, woken
//! by the engine after each commit that changed a job of the action, and
//! the bounds on how many streams may be open (in all and per client
//! connection). Engine-neutral: every engine notifies through
//! [`Watchers::notify`].

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
};

use tokio::sync::watch;

use crate::error::{Error, Result};

/// Watch channels of actions someone streams with WatchAction, and the
/// bounds on how many streams may be open. Every subscription is a
/// [`WatchSubscription`] that gives its place back when dropped, so nothing
/// a WatchAction call registers outlives its stream.
pub struct Watchers {
    inner: Mutex<WatchersInner>,
    max_total: usize,
    max_per_connection: usize,
    gauge: prometheus_client::metrics::gauge::Gauge,
    reread: Option<std::time::Duration>,
}

#[derive(Default)]
struct WatchersInner {
    /// One channel per watched action, while it has a subscriber.
    map: HashMap<String, watch::Sender<u64>>,
    /// Open subscriptions.
    total: usize,
    /// Open subscriptions per client connection (its peer address).
    per_connection: HashMap<Option<std::net::SocketAddr>, usize>,
}

impl Default for Watchers {
    fn default() -> Self {
        Watchers::new(10_000, 100, Default::default())
    }
}

impl Watchers {
    /// Watchers allowing `max_total` open subscriptions in all and
    /// `max_per_connection` per client connection; `gauge` follows the
    /// number open (`agq_watch_streams`).
    pub fn new(
        max_total: usize,
        max_per_connection: usize,
        gauge: prometheus_client::metrics::gauge::Gauge,
    ) -> Self {
        Watchers {
            inner: Mutex::default(),
            max_total,
            max_per_connection,
            gauge,
            reread: None,
        }
    }

    /// The same, whose subscriptions also wake every `period` without a
    /// notification ([`WatchSubscription::changed`]): for an engine whose
    /// change notifications can be lost (another process's, sent after
    /// its commit), so a watcher re-reads its action at least that often.
    pub fn with_reread(mut self, period: std::time::Duration) -> Self {
        self.reread = Some(period);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchersInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A subscription that changes whenever a job of `action_id` (an id
    /// already validated) changes status, counted against the bounds for
    /// `connection` (the client's address; `None` when unknown).
    ///
    /// Errors: [`Error::ResourceExhausted`] when the total or
    /// the connection's bound is reached.
    pub fn subscribe(
        self: &Arc<Self>,
        action_id: &str,
        connection: Option<std::net::SocketAddr>,
    ) -> Result<WatchSubscription> {
        let mut inner = self.lock();
        if inner.total >= self.max_total {
            return Err(Error::ResourceExhausted(format!(
                "{} WatchAction streams are open, the most this server allows (--max-watch-streams); retry later",
                self.max_total
            )));
        }
        let n = inner.per_connection.entry(connection).or_default();
        if *n >= self.max_per_connection {
            let n = *n;
            if n == 0 {
                inner.per_connection.remove(&connection);
            }
            return Err(Error::ResourceExhausted(format!(
                "this connection has {n} WatchAction streams open, the most allowed per connection (--max-watch-streams-per-connection)"
            )));
        }
        *n += 1;
        inner.total += 1;
        self.gauge.set(inner.total as i64);
        let rx = inner
            .map
            .entry(action_id.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Ok(WatchSubscription {
            rx,
            reread: self.reread,
            action_id: action_id.to_string(),
            connection,
            owner: self.clone(),
        })
    }

    /// Open subscriptions.
    pub fn count(&self) -> usize {
        self.lock().total
    }

    fn release(&self, action_id: &str, connection: Option<std::net::SocketAddr>) {
        let mut inner = self.lock();
        inner.total = inner.total.saturating_sub(1);
        self.gauge.set(inner.total as i64);
        if let Some(n) = inner.per_connection.get_mut(&connection) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                inner.per_connection.remove(&connection);
            }
        }
        // The subscription being dropped still holds its receiver.
        if inner
            .map
            .get(action_id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            inner.map.remove(action_id);
        }
    }

    /// Wakes every subscription (after a gap in change notifications,
    /// when any action may have changed).
    pub fn notify_all(&self) {
        let inner = self.lock();
        for tx in inner.map.values() {
            tx.send_modify(|v| *v += 1);
        }
    }

    /// Wakes the subscribers of every action in `actions` and empties it.
    /// Engines call it after the commit that changed those actions' jobs.
    pub fn notify<S: std::hash::BuildHasher>(&self, actions: &mut HashSet<Arc<str>, S>) {
        if actions.is_empty() {
            return;
        }
        let inner = self.lock();
        if inner.map.is_empty() {
            actions.clear();
            return;
        }
        for a in actions.drain() {
            if let Some(tx) = inner.map.get(&*a) {
                tx.send_modify(|v| *v += 1);
            }
        }
    }
}

/// One WatchAction stream's subscription: changes whenever a job of its
/// action changes status. Dropping it (the stream ended, was cancelled, or
/// the call failed) gives its place back and forgets the action's channel
/// once nobody watches it.
pub struct WatchSubscription {
    rx: watch::Receiver<u64>,
    reread: Option<std::time::Duration>,
    action_id: String,
    connection: Option<std::net::SocketAddr>,
    owner: Arc<Watchers>,
}

impl WatchSubscription {
    /// Waits for the next change, or for the watchers' re-read period
    /// ([`Watchers::with_reread`]) to pass without one, after which the
    /// caller re-reads its action all the same. Errors when the channel is
    /// gone (never, while the subscription lives).
    pub async fn changed(&mut self) -> std::result::Result<(), watch::error::RecvError> {
        match self.reread {
            None => self.rx.changed().await,
            Some(period) => tokio::time::timeout(period, self.rx.changed())
                .await
                .unwrap_or(Ok(())),
        }
    }

    /// Marks the current value seen.
    pub fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }
}

impl Drop for WatchSubscription {
    fn drop(&mut self) {
        self.owner.release(&self.action_id, self.connection);
    }
}
