//! The dual-path send: one request's KV, layer by layer, to RelayDecode over the local
//! path and to MainDecode over the WAN path at once.
//!
//! Each side is one tokio task fed by a channel: the engine queues a layer on both
//! sides and returns at once; a side waits for its own grant, puts or streams each
//! layer through the same engine-facing calls a single-path send uses
//! ([`OutboundTransfer`] or [`LocalOutbound`]: `send_layer`, `finish`, `wait`), and
//! settles its own outcome. Nothing one side meets (its grant late or refused, its
//! line lost, its receiver gone) stops, slows or fails the other; a side that fails
//! aborts its own transfer with the reason, so its receiver frees the pages at once.
//! No thread per transfer: both sides are tasks on the library's runtime.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdd_core::Error;
use tokio::sync::{mpsc, watch};

use crate::local::sender::LocalOutbound;
use crate::sender::OutboundTransfer;

/// One side's sender handle: either path's, the same calls (RelayDecode's side runs
/// on the WAN path's TCP lanes where UCX is unavailable).
#[derive(Clone)]
pub enum SideHandle {
    /// A grant on the WAN path (TCP lanes).
    Wan(Arc<OutboundTransfer>),
    /// A grant on the local path (UCX puts).
    Local(Arc<LocalOutbound>),
}

impl SideHandle {
    fn page_count(&self) -> u32 {
        match self {
            SideHandle::Wan(t) => t.grant().page_count,
            SideHandle::Local(t) => t.grant().page_count,
        }
    }

    fn layer_count(&self) -> u16 {
        match self {
            SideHandle::Wan(t) => t.grant().layer_count,
            SideHandle::Local(t) => t.grant().layer_count,
        }
    }

    async fn send_layer(&self, layer: u16, src_pages: &[u32]) -> Result<(), Error> {
        match self {
            SideHandle::Wan(t) => t.send_layer(layer, layer, src_pages).await,
            SideHandle::Local(t) => t.send_layer(layer, layer, src_pages).await,
        }
    }

    async fn finish(&self) -> Result<(), Error> {
        match self {
            SideHandle::Wan(t) => t.finish().await,
            SideHandle::Local(t) => t.finish().await,
        }
    }

    async fn wait(&self) -> Result<u64, Error> {
        match self {
            SideHandle::Wan(t) => t.wait().await,
            SideHandle::Local(t) => t.wait().await,
        }
    }

    fn abort(&self, reason: &str) -> bool {
        match self {
            SideHandle::Wan(t) => t.abort(reason),
            SideHandle::Local(t) => t.abort(reason),
        }
    }
}

/// A side's grant: ready, or a wait for it (its sender's `wait_grant`).
pub type GrantWait = Pin<Box<dyn Future<Output = Result<SideHandle, Error>> + Send>>;

/// How one side ended.
#[derive(Clone, Debug)]
pub struct SideOutcome {
    /// Bytes the receiver confirmed, or why the side failed.
    pub result: Result<u64, Error>,
    /// From the dual send's start to the side's end.
    pub elapsed: Duration,
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Layer(u16),
    Finish,
}

struct Side {
    steps: mpsc::UnboundedSender<Step>,
    outcome: watch::Receiver<Option<SideOutcome>>,
}

/// Both sides of one request's dual-path send.
pub struct DualSend {
    local: Option<Side>,
    wan: Option<Side>,
    started: Instant,
}

impl DualSend {
    /// Start the sides given (at least one) on `runtime`. Each gets the last
    /// `page_count` pages of `pages` (the request's pages on P, prompt order) that its
    /// grant covers: every page for RelayDecode, only the pages MainDecode lacks for
    /// MainDecode (its grant follows the prefix handshake). `step_timeout` bounds each
    /// of a side's waits (its grant, each layer, its confirmation).
    pub fn start(
        runtime: &tokio::runtime::Handle,
        local: Option<GrantWait>,
        wan: Option<GrantWait>,
        pages: Vec<u32>,
        step_timeout: Duration,
    ) -> Result<DualSend, Error> {
        if local.is_none() && wan.is_none() {
            return Err(Error::InvalidArgument(
                "a dual send needs at least one side".into(),
            ));
        }
        let started = Instant::now();
        let pages = Arc::new(pages);
        let spawn = |name: &'static str, grant: GrantWait| {
            let (steps, queued) = mpsc::unbounded_channel();
            let (settle, outcome) = watch::channel(None);
            runtime.spawn(run_side(
                name,
                grant,
                pages.clone(),
                step_timeout,
                queued,
                settle,
                started,
            ));
            Side { steps, outcome }
        };
        Ok(DualSend {
            local: local.map(|g| spawn("local", g)),
            wan: wan.map(|g| spawn("wan", g)),
            started,
        })
    }

    fn sides(&self) -> impl Iterator<Item = &Side> {
        self.local.iter().chain(self.wan.iter())
    }

    /// Queue `layer` on both sides; returns at once. A side whose grant has fewer
    /// layers skips the ones past it; a side that ended ignores it.
    pub fn send_layer(&self, layer: u16) {
        for s in self.sides() {
            let _ = s.steps.send(Step::Layer(layer));
        }
    }

    /// Every layer was queued: each side finishes once its layers went.
    pub fn finish(&self) {
        for s in self.sides() {
            let _ = s.steps.send(Step::Finish);
        }
    }

    /// Each side's outcome once both ended (`None` for a side not asked for). Bounded
    /// by the sides' own step timeouts; callers may bound it further.
    pub async fn wait(&self) -> (Option<SideOutcome>, Option<SideOutcome>) {
        async fn settled(side: Option<&Side>) -> Option<SideOutcome> {
            let mut rx = side?.outcome.clone();
            let done = rx.wait_for(|o| o.is_some()).await;
            match done {
                Ok(o) => o.clone(),
                // The task ended without settling (the runtime shut down under it).
                Err(_) => Some(SideOutcome {
                    result: Err(Error::Cancelled {
                        detail: "the side's task ended".into(),
                    }),
                    elapsed: Duration::ZERO,
                }),
            }
        }
        tokio::join!(settled(self.local.as_ref()), settled(self.wan.as_ref()))
    }

    /// Each side's outcome if it ended already, without waiting (`None` when not
    /// asked for or still running).
    pub fn poll(&self) -> (Option<SideOutcome>, Option<SideOutcome>) {
        let now = |s: Option<&Side>| s.and_then(|s| s.outcome.borrow().clone());
        (now(self.local.as_ref()), now(self.wan.as_ref()))
    }

    /// Which sides were asked for: `(local, wan)`.
    pub fn sides_asked(&self) -> (bool, bool) {
        (self.local.is_some(), self.wan.is_some())
    }

    /// Since the dual send started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

async fn bounded<T>(
    step_timeout: Duration,
    what: impl FnOnce() -> String,
    f: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(step_timeout, f)
        .await
        .unwrap_or_else(|_| Err(Error::DeadlineExceeded { what: what() }))
}

async fn run_side(
    name: &'static str,
    grant: GrantWait,
    pages: Arc<Vec<u32>>,
    step_timeout: Duration,
    mut steps: mpsc::UnboundedReceiver<Step>,
    settle: watch::Sender<Option<SideOutcome>>,
    started: Instant,
) {
    let mut handle: Option<SideHandle> = None;
    let result = async {
        let out = bounded(step_timeout, || format!("the {name} side's grant"), grant).await?;
        handle = Some(out.clone());
        let covered = out.page_count() as usize;
        if covered > pages.len() {
            return Err(Error::InvalidArgument(format!(
                "the {name} grant covers {covered} pages, the request has {}",
                pages.len()
            )));
        }
        let src = &pages[pages.len() - covered..];
        loop {
            // A DualSend dropped before finish(): the transfer is given up.
            let Some(step) = steps.recv().await else {
                return Err(Error::Cancelled {
                    detail: format!("the {name} side was dropped before finish"),
                });
            };
            match step {
                Step::Layer(layer) if layer < out.layer_count() => {
                    bounded(
                        step_timeout,
                        || format!("layer {layer} on the {name} side"),
                        out.send_layer(layer, src),
                    )
                    .await?;
                }
                // A grant of fewer layers than the other side's.
                Step::Layer(_) => {}
                Step::Finish => break,
            }
        }
        out.finish().await?;
        bounded(
            step_timeout,
            || format!("the {name} receiver's confirmation"),
            out.wait(),
        )
        .await
    }
    .await;
    if let (Err(e), Some(out)) = (&result, &handle) {
        // The receiver frees the pages now rather than at its deadline.
        out.abort(&e.to_string());
    }
    let _ = settle.send(Some(SideOutcome {
        result,
        elapsed: started.elapsed(),
    }));
}
