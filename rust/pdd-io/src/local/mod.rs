//! The local path: KV from Prefill to a receiver in the same datacenter (RelayDecode)
//! by one-sided UCX puts straight into the receiver's pool, with the grant rules of
//! the WAN path.
//!
//! Control stays on one authenticated control lane (`lane::connect` / `accept`,
//! HELLO + AUTH, optional TLS) that negotiated the `local_ucx` capability; the bytes
//! move by UCX, which picks the transport itself (shared memory / CMA on one host,
//! TCP across hosts, verbs where an RDMA NIC exists). On the control lane:
//!
//! 1. receiver -> sender LOCAL_ADDR: its UCX worker address (and its pool's memory
//!    kind); the sender creates its endpoint from it.
//! 2. per transfer, receiver -> sender KV_GRANT then LOCAL_GRANT: the receiver
//!    registers exactly the granted pages (one region per run of consecutive pool
//!    pages of a layer) and sends each region's address and packed remote key; pages
//!    of a pool in memory UCX allocated go under that allocation's key instead
//!    ([`shared`]: a sender on the same host maps it and copies into it itself).
//! 3. sender: puts each layer's pages into the regions, flushes, then LOCAL_DONE
//!    naming the layers and the page and byte counts; the receiver checks them
//!    against the grant (`pdd_core::kv::ReceiverState`, as for KV_PAGES blocks).
//! 4. receiver -> sender KV_DONE once every layer is in (or ABORT for the request);
//!    either way the receiver unmaps the regions (their keys stop working) and the
//!    sender destroys its unpacked keys.
//!
//! UCX is loaded at run time ([`ucx_ffi`]); [`ucx`] is its safe wrapper.

pub mod receiver;
pub mod sender;
pub mod shared;
pub mod ucx;
pub mod ucx_ffi;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pdd_core::wire::Frame;
use pdd_core::Error;
use tokio::io::ReadHalf;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use crate::codec::{CodecError, WireCodec};
use crate::lane::{self, ControlTx, LaneStream};
use crate::metrics::Metrics;

pub use ucx::library as ucx_library;
pub use ucx::version as ucx_version;
pub use ucx_ffi::add_fallback as add_ucx_fallback;

/// Whether UCX can be loaded here (`Err` says which library is missing).
pub fn ucx_available() -> Result<String, Error> {
    ucx::version()
}

/// Where a local-path transfer stands (both ends).
#[derive(Debug, Clone, PartialEq)]
pub enum LocalStatus {
    /// Granted, pages moving.
    InProgress,
    /// Every page of every layer is in the receiver's pool (bytes).
    Complete {
        /// Page bytes.
        bytes: u64,
    },
    /// Failed.
    Failed(Error),
}

/// Wait on a status channel until it is no longer in progress.
pub(crate) async fn wait_status(
    rx: tokio::sync::watch::Receiver<LocalStatus>,
) -> Result<u64, Error> {
    crate::status::wait_settled(rx, "endpoint").await
}

impl crate::status::Settles for LocalStatus {
    fn settled(&self) -> Option<Result<u64, Error>> {
        match self {
            LocalStatus::Complete { bytes } => Some(Ok(*bytes)),
            LocalStatus::Failed(e) => Some(Err(e.clone())),
            LocalStatus::InProgress => None,
        }
    }
}

/// A run of a grant layer's pages that are consecutive in the receiver's pool:
/// grant pages `grant_start..grant_start + count` are pool pages
/// `pool_start..pool_start + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First grant page.
    pub grant_start: u32,
    /// First pool page.
    pub pool_start: u32,
    /// Pages.
    pub count: u32,
}

/// The runs of `dest_pages` (pool pages in grant order).
pub fn runs(dest_pages: &[u32]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for (i, &p) in dest_pages.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.pool_start.checked_add(r.count) == Some(p) => r.count += 1,
            _ => out.push(Run {
                grant_start: i as u32,
                pool_start: p,
                count: 1,
            }),
        }
    }
    out
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn now_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A control lane after its opening: a writer task (queued frames and, with a
/// heartbeat, PINGs) and the reading half, which (in [`Control::next`]) answers
/// PINGs itself. A lane whose session machine keeps its liveness has neither a
/// heartbeat nor a dead-peer bound here, and reads with [`Control::next_frame`].
pub(crate) struct Control {
    pub tx: ControlTx,
    pub cancel: CancellationToken,
    reader: FramedRead<ReadHalf<LaneStream>, WireCodec>,
    dead_after: Option<Duration>,
    death: Arc<Mutex<Option<Error>>>,
}

impl Control {
    pub fn start(
        stream: LaneStream,
        max_payload: u32,
        peer_max_payload: u32,
        heartbeat: Option<Duration>,
        dead_after: Option<Duration>,
        metrics: Arc<Metrics>,
        parent: &CancellationToken,
    ) -> Control {
        let cancel = parent.child_token();
        let (tx, rx) = lane::control_queue(lane::MAX_UNWRITTEN_CONTROL_FRAMES, cancel.clone());
        let socket = {
            use std::os::fd::AsRawFd;
            stream.tcp().as_raw_fd()
        };
        let (rd, wr) = tokio::io::split(stream);
        let reader = FramedRead::new(rd, WireCodec::new(max_payload, peer_max_payload));
        let writer = FramedWrite::new(wr, WireCodec::new(max_payload, peer_max_payload));
        let death = Arc::new(Mutex::new(None));
        let (wc, wd) = (cancel.clone(), death.clone());
        tokio::spawn(async move {
            let outcome =
                lane::control_writer(writer, socket, rx, wc.clone(), heartbeat, metrics, now_ns)
                    .await;
            if let Err(detail) = outcome {
                lock(&wd).get_or_insert(Error::ConnectionLost { detail });
                wc.cancel();
            }
        });
        Control {
            tx,
            cancel,
            reader,
            dead_after,
            death,
        }
    }

    /// The next frame that is not a PING or PONG, or why the lane ended.
    pub async fn next(&mut self) -> Result<Frame, Error> {
        loop {
            match self.next_frame().await? {
                Frame::Ping(p) => {
                    let _ = self.tx.send(Frame::Pong(p));
                }
                Frame::Pong(_) => {}
                f => return Ok(f),
            }
        }
    }

    /// The next frame, whatever it is, or why the lane ended (a frame that could not
    /// be decoded was answered with an ABORT saying why).
    pub async fn next_frame(&mut self) -> Result<Frame, Error> {
        let dead_after = self.dead_after;
        let reader = &mut self.reader;
        let read = async move {
            match dead_after {
                Some(d) => tokio::time::timeout(d, reader.next()).await,
                None => Ok(reader.next().await),
            }
        };
        let next = tokio::select! {
            _ = self.cancel.cancelled() => {
                return Err(lock(&self.death).clone().unwrap_or_else(|| {
                    if self.tx.overflowed() {
                        self.tx.overflow_error()
                    } else {
                        Error::Cancelled { detail: "session closed".into() }
                    }
                }));
            }
            n = read => n,
        };
        match next {
            Err(_) => Err(Error::ConnectionLost {
                detail: format!("peer silent for {:?}", dead_after.unwrap_or_default()),
            }),
            Ok(None) => Err(Error::ConnectionLost {
                detail: "peer closed the control lane".into(),
            }),
            Ok(Some(Err(CodecError::Io(e)))) => Err(Error::ConnectionLost {
                detail: format!("control lane: {e}"),
            }),
            Ok(Some(Err(CodecError::Protocol(e)))) => {
                let _ = self.tx.send(lane::abort_for(&e));
                Err(e)
            }
            Ok(Some(Ok(f))) => Ok(f),
        }
    }

    /// End the lane, telling the peer why (an ABORT for the connection).
    pub fn end(&self, why: &Error) {
        let _ = self.tx.send(lane::abort_for(why));
        lock(&self.death).get_or_insert_with(|| why.clone());
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_where_pool_pages_stop_being_consecutive() {
        let r = runs(&[4, 5, 6, 9, 1, 2]);
        assert_eq!(
            r,
            vec![
                Run {
                    grant_start: 0,
                    pool_start: 4,
                    count: 3
                },
                Run {
                    grant_start: 3,
                    pool_start: 9,
                    count: 1
                },
                Run {
                    grant_start: 4,
                    pool_start: 1,
                    count: 2
                },
            ]
        );
        assert_eq!(runs(&[u32::MAX, 0]).len(), 2);
    }
}
