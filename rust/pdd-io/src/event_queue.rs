//! A queue of engine-facing events that a blocking thread, a poller and an async task
//! can all consume (the handoff links' events).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// A multi-producer queue that a blocking thread ([`EventQueue::pop_blocking`]), a
/// poller ([`EventQueue::try_pop`]) and an async task ([`EventQueue::pop`]) can all
/// consume. Closing it wakes every waiter.
#[derive(Debug)]
pub struct EventQueue<T> {
    items: Mutex<(VecDeque<T>, bool)>,
    cond: Condvar,
    notify: Notify,
}

impl<T> Default for EventQueue<T> {
    fn default() -> Self {
        EventQueue {
            items: Mutex::new((VecDeque::new(), false)),
            cond: Condvar::new(),
            notify: Notify::new(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of our locks leaves plain data behind; carry on.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> EventQueue<T> {
    /// Append events and wake waiters.
    pub fn push_all(&self, items: impl IntoIterator<Item = T>) {
        let mut q = lock(&self.items);
        let before = q.0.len();
        q.0.extend(items);
        let added = q.0.len() > before;
        drop(q);
        if added {
            self.cond.notify_all();
            self.notify.notify_waiters();
            self.notify.notify_one();
        }
    }

    /// Close: no more events; waiters return what is left, then `None`.
    pub fn close(&self) {
        lock(&self.items).1 = true;
        self.cond.notify_all();
        self.notify.notify_waiters();
        self.notify.notify_one();
    }

    /// Whether [`EventQueue::close`] was called.
    pub fn is_closed(&self) -> bool {
        lock(&self.items).1
    }

    /// Take the next event if there is one.
    pub fn try_pop(&self) -> Option<T> {
        lock(&self.items).0.pop_front()
    }

    /// Take every queued event.
    pub fn drain(&self) -> Vec<T> {
        lock(&self.items).0.drain(..).collect()
    }

    /// Events queued.
    pub fn len(&self) -> usize {
        lock(&self.items).0.len()
    }

    /// No event queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Busy-poll for up to `spin` on this thread: take the next event, calling
    /// `between` after each empty look (it may deliver events, e.g. by reading a
    /// socket; it returns whether it made progress). `None` if nothing came within
    /// `spin` or the queue closed.
    pub fn pop_spinning(&self, spin: Duration, mut between: impl FnMut() -> bool) -> Option<T> {
        let start = Instant::now();
        loop {
            if let Some(item) = self.try_pop() {
                return Some(item);
            }
            if !between() {
                if self.is_closed() || start.elapsed() >= spin {
                    return self.try_pop();
                }
                // Let a thread that shares this core run (the peer's engine thread
                // or an I/O thread, where there are fewer cores than threads): a
                // pure spin would hold it off until the scheduler's slice ends.
                std::thread::yield_now();
            }
        }
    }

    /// Wait at most `timeout` (forever with `None`) for the next event. `None` on
    /// timeout, or once closed and empty.
    pub fn pop_blocking(&self, timeout: Option<Duration>) -> Option<T> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = lock(&self.items);
        loop {
            if let Some(item) = q.0.pop_front() {
                return Some(item);
            }
            if q.1 {
                return None;
            }
            match deadline {
                None => q = self.cond.wait(q).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    q = self
                        .cond
                        .wait_timeout(q, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }

    /// Wait for the next event; `None` once closed and empty.
    pub async fn pop(&self) -> Option<T> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut q = lock(&self.items);
                if let Some(item) = q.0.pop_front() {
                    return Some(item);
                }
                if q.1 {
                    return None;
                }
            }
            notified.await;
        }
    }
}
