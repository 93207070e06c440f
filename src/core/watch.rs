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

use crate::{
    core::model::ActionStatus,
    error::{Error, Result},
};

/// A watched action's channel and the status its subscribers last read
/// after a change, shared by all of them.
struct Watched {
    /// Bumped at each change of a job of the action.
    tx: watch::Sender<u64>,
    /// The status read after change number `.0`: a subscriber woken by
    /// that change (or an earlier one) takes it instead of reading the
    /// action again, so one change costs one read however many watch.
    last: SharedRead,
}

/// The status of an action as read after a given change ([`Watched::last`]).
type SharedRead = Arc<tokio::sync::Mutex<Option<(u64, ActionStatus)>>>;

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
    map: HashMap<String, Watched>,
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
        let watched = inner
            .map
            .entry(action_id.to_string())
            .or_insert_with(|| Watched {
                tx: watch::channel(0).0,
                last: SharedRead::default(),
            });
        let (rx, last) = (watched.tx.subscribe(), watched.last.clone());
        Ok(WatchSubscription {
            rx,
            last,
            woken_by: None,
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
            .is_some_and(|w| w.tx.receiver_count() <= 1)
        {
            inner.map.remove(action_id);
        }
    }

    /// Wakes every subscription (after a gap in change notifications,
    /// when any action may have changed).
    pub fn notify_all(&self) {
        let inner = self.lock();
        for w in inner.map.values() {
            w.tx.send_modify(|v| *v += 1);
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
            if let Some(w) = inner.map.get(&*a) {
                w.tx.send_modify(|v| *v += 1);
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
    /// The action's shared read ([`Watched::last`]).
    last: SharedRead,
    /// The change that last woke [`WatchSubscription::changed`]; `None`
    /// when its re-read period woke it instead (or before the first wait).
    woken_by: Option<u64>,
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
        let notified = match self.reread {
            None => self.rx.changed().await.map(|()| true),
            Some(period) => match tokio::time::timeout(period, self.rx.changed()).await {
                Ok(r) => r.map(|()| true),
                Err(_) => Ok(false),
            },
        }?;
        self.woken_by = notified.then(|| *self.rx.borrow_and_update());
        Ok(())
    }

    /// The action's status after the change that woke
    /// [`WatchSubscription::changed`]: read with `read`, or the status
    /// another subscription of the action read after that change or a
    /// later one (the first woken reads, the others wait for it and take
    /// its answer). A wake of the re-read period always reads.
    ///
    /// Errors: those of `read` (not shared: the next subscriber reads).
    pub async fn current<F, Fut>(&mut self, read: F) -> Result<ActionStatus>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<ActionStatus>>,
    {
        let Some(change) = self.woken_by else {
            return read().await;
        };
        let mut last = self.last.lock().await;
        if let Some((seen, status)) = &*last {
            if *seen >= change {
                return Ok(status.clone());
            }
        }
        let status = read().await?;
        *last = Some((change, status.clone()));
        Ok(status)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn status(action_id: &str, completed: u32) -> ActionStatus {
        ActionStatus {
            action_id: action_id.into(),
            completed,
            ..Default::default()
        }
    }

    /// One change of an action costs one read however many subscriptions
    /// watch it; the next change is read again; a subscription of another
    /// action reads its own.
    #[tokio::test]
    async fn one_change_is_read_once_for_every_subscriber() {
        let w = Arc::new(Watchers::default());
        let mut subs: Vec<WatchSubscription> =
            (0..50).map(|_| w.subscribe("a", None).unwrap()).collect();
        let mut other = w.subscribe("b", None).unwrap();
        let reads = Arc::new(AtomicUsize::new(0));
        for round in 1..=2u32 {
            let mut changed: HashSet<Arc<str>> = ["a".into(), "b".into()].into_iter().collect();
            w.notify(&mut changed);
            for sub in &mut subs {
                sub.changed().await.unwrap();
                let reads = reads.clone();
                let got = sub
                    .current(|| async move {
                        reads.fetch_add(1, Ordering::SeqCst);
                        Ok(status("a", round))
                    })
                    .await
                    .unwrap();
                assert_eq!(got, status("a", round));
            }
            assert_eq!(reads.load(Ordering::SeqCst), round as usize);
            other.changed().await.unwrap();
            let got = other
                .current(|| async { Ok(status("b", 7)) })
                .await
                .unwrap();
            assert_eq!(got, status("b", 7));
        }
    }

    /// A failed read is not shared: the next subscriber reads again.
    #[tokio::test]
    async fn a_failed_read_is_not_shared() {
        let w = Arc::new(Watchers::default());
        let mut one = w.subscribe("a", None).unwrap();
        let mut two = w.subscribe("a", None).unwrap();
        w.notify(&mut ["a".into()].into_iter().collect::<HashSet<Arc<str>>>());
        one.changed().await.unwrap();
        two.changed().await.unwrap();
        let failed = one.current(|| async { Err(Error::Unavailable) }).await;
        assert!(failed.is_err());
        let got = two.current(|| async { Ok(status("a", 1)) }).await.unwrap();
        assert_eq!(got, status("a", 1));
    }
}
