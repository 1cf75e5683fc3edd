//! A simulated network for the KV session machines: one `ReceiverEndpoint` and any
//! number of `SenderSession`s, each joined to it by a control lane and N data lanes,
//! on simulated time. This module plays `pdd-io`'s part: it moves frames and blocks
//! (with delays, per-lane reordering, stalls, resets, blackholes and corrupted
//! bytes), keeps the sender's log of which block went on which lane, lands blocks
//! where the receiver says (a model pool of tags, so a page that holds the wrong
//! data is seen), and runs the bounds that are pure I/O (a read stalled mid-block, a
//! write that makes no progress). Everything is decided by the machines; nothing
//! reads a clock, and a schedule with its seed replays exactly.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use pdd_core::kv::session::{
    LaneHandle, LaneKey, LaneSample, ReceiverEndpoint, ReceiverEvent, SenderEvent, SenderSession,
    SessionHandle, SessionTimers,
};
use pdd_core::kv::{BlockDisposition, KvBlock, TransferEvent};
use pdd_core::time::Timestamp;
use pdd_core::wire::{capability, Frame, KvGrant};
use pdd_core::Error;

pub fn ms(n: u64) -> Timestamp {
    Timestamp::from_nanos(n * 1_000_000)
}

pub fn dur(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// SplitMix64: every random choice of a schedule comes from its seed.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo))
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

pub const PAGE_BYTES: u32 = 16;
pub const POOL_LAYERS: u16 = 3;
pub const POOL_PAGES: u32 = 512;

/// What this build's KV endpoints offer, with or without lane failover.
pub fn caps(failover: bool) -> u64 {
    let base = capability::KV_STREAM | capability::EMPTY_GRANT;
    if failover {
        base | capability::LANE_FAILOVER
    } else {
        base
    }
}

/// The bounds every schedule runs under (short, so schedules are quick to run).
pub fn timers() -> SessionTimers {
    let mut t = SessionTimers::new(dur(100), dur(600));
    t.lane_end_bound = dur(200);
    t.peer_reason_grace = dur(50);
    t
}

pub const LANE_STALL_MS: u64 = 200;

/// One request: the receiver grants it, the sender sends it.
#[derive(Debug, Clone)]
pub struct Request {
    pub tx: usize,
    pub request_id: u64,
    /// Pool pages, in grant order (disjoint from every other request's).
    pub pages: Vec<u32>,
    pub layers: u16,
    pub deadline_ms: Option<u64>,
    pub grant_at_ms: u64,
    /// Grant pages per `send_pages` call (all layers each), in order.
    pub chunks: Vec<Vec<u32>>,
    /// Between the sender engine's calls.
    pub gap_ms: u64,
    /// The receiver's engine cancels it then.
    pub cancel_at_ms: Option<u64>,
    /// The sender's engine aborts it before this chunk.
    pub abort_before_chunk: Option<usize>,
}

#[derive(Debug, Clone)]
pub enum Chaos {
    /// Data lane `lane` (wire index) of sender `tx`'s connection stops moving bytes.
    Stall {
        tx: usize,
        lane: u16,
        at_ms: u64,
        for_ms: Option<u64>,
    },
    /// Every connection of sender `tx` is reset: what is in flight is lost. The
    /// sender notices after `tx_notice_ms`; the receiver after `rx_notice_ms`, or
    /// never (it must find out by itself).
    Reset {
        tx: usize,
        at_ms: u64,
        tx_notice_ms: u64,
        rx_notice_ms: Option<u64>,
    },
    /// Nothing of sender `tx`'s connection moves, either way, until `until_ms`
    /// (delayed, as TCP does, not lost) or ever.
    Blackhole {
        tx: usize,
        at_ms: u64,
        until_ms: Option<u64>,
    },
    /// The `nth` block sender `tx` places has a corrupted byte.
    Corrupt { tx: usize, nth: u64 },
}

#[derive(Debug, Clone)]
pub struct Link {
    pub control_ms: u64,
    pub jitter_ms: u64,
    /// Per data lane, its one-way delay (lanes differ: blocks overtake each other
    /// across lanes, and KV_DONE on the control lane overtakes blocks).
    pub lane_ms: Vec<u64>,
    /// Time to read one block's bytes.
    pub block_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Schedule {
    pub seed: u64,
    pub timers: SessionTimers,
    pub lanes: u16,
    pub failover: bool,
    /// Both ends offer `kv_resume`: a lost session keeps its transfers, and the
    /// sender resumes them.
    pub resume: bool,
    pub senders: usize,
    pub link: Link,
    pub requests: Vec<Request>,
    pub chaos: Vec<Chaos>,
    pub reconnect_ms: u64,
    /// How long the receiver's reader of a revoked lane takes to end.
    pub lane_end_ms: u64,
    pub max_block_pages: u64,
}

impl Schedule {
    /// One sender, `lanes` lanes, a quiet link, no requests yet.
    pub fn quiet(seed: u64, lanes: u16) -> Schedule {
        Schedule {
            seed,
            timers: timers(),
            lanes,
            failover: true,
            resume: false,
            senders: 1,
            link: Link {
                control_ms: 5,
                jitter_ms: 0,
                lane_ms: (0..lanes).map(|i| 5 + 3 * u64::from(i)).collect(),
                block_ms: 2,
            },
            requests: Vec::new(),
            chaos: Vec::new(),
            reconnect_ms: 20,
            lane_end_ms: 5,
            max_block_pages: 2,
        }
    }

    /// Add a request of `pages` pages on every pool layer to sender `tx`, sent in
    /// chunks of `chunk` pages, granted at `at_ms`.
    pub fn request(&mut self, tx: usize, pages: usize, chunk: usize, at_ms: u64) -> usize {
        let first: u32 = self.requests.iter().map(|r| r.pages.len() as u32).sum();
        let r = Request {
            tx,
            request_id: self.requests.len() as u64 + 1,
            pages: (first..first + pages as u32).collect(),
            layers: POOL_LAYERS,
            deadline_ms: None,
            grant_at_ms: at_ms,
            chunks: (0..pages as u32)
                .collect::<Vec<_>>()
                .chunks(chunk.max(1))
                .map(|c| c.to_vec())
                .collect(),
            gap_ms: 3,
            cancel_at_ms: None,
            abort_before_chunk: None,
        };
        self.requests.push(r);
        self.requests.len() - 1
    }

    /// A random schedule: 1-3 senders, 1-4 lanes, random requests, chunk orders,
    /// link delays and (when `chaos`) stalls, resets, blackholes, corruption,
    /// cancels, aborts and deadlines.
    pub fn random(seed: u64, chaos: bool) -> Schedule {
        let mut rng = Rng(seed);
        let lanes = rng.range(1, 5) as u16;
        let mut s = Schedule::quiet(seed, lanes);
        s.senders = rng.range(1, 4) as usize;
        s.failover = !chaos || rng.chance(75);
        s.resume = rng.chance(50);
        s.link.control_ms = rng.range(1, 30);
        s.link.jitter_ms = rng.below(20);
        s.link.lane_ms = (0..lanes).map(|_| rng.range(1, 60)).collect();
        s.link.block_ms = rng.range(1, 8);
        s.max_block_pages = rng.range(1, 5);
        s.reconnect_ms = rng.range(5, 100);
        s.lane_end_ms = rng.range(1, 50);
        let n = rng.range(1, 9) as usize;
        for _ in 0..n {
            let tx = rng.below(s.senders as u64) as usize;
            let pages = if rng.chance(10) {
                0
            } else {
                rng.range(1, 13) as usize
            };
            let at = rng.below(1_500);
            let r = s.request(tx, pages, rng.range(1, 6) as usize, at);
            let req = &mut s.requests[r];
            req.layers = rng.range(1, u64::from(POOL_LAYERS) + 1) as u16;
            // Chunk pages in a shuffled order.
            let mut order: Vec<u32> = (0..pages as u32).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let chunk = rng.range(1, 6) as usize;
            req.chunks = order.chunks(chunk).map(|c| c.to_vec()).collect();
            req.gap_ms = rng.below(40);
            if chaos {
                if rng.chance(15) {
                    req.deadline_ms = Some(rng.range(50, 3_000));
                }
                if rng.chance(8) {
                    req.cancel_at_ms = Some(at + rng.below(500));
                }
                if rng.chance(8) && !req.chunks.is_empty() {
                    req.abort_before_chunk = Some(rng.below(req.chunks.len() as u64) as usize);
                }
            }
        }
        if chaos {
            for _ in 0..rng.below(4) {
                let tx = rng.below(s.senders as u64) as usize;
                let at_ms = rng.below(2_500);
                let c = match rng.below(10) {
                    0..=3 => Chaos::Stall {
                        tx,
                        lane: rng.range(1, u64::from(lanes) + 1) as u16,
                        at_ms,
                        for_ms: if rng.chance(30) {
                            None
                        } else {
                            Some(rng.range(10, 1_500))
                        },
                    },
                    4..=5 => Chaos::Reset {
                        tx,
                        at_ms,
                        tx_notice_ms: rng.below(50),
                        rx_notice_ms: if rng.chance(30) {
                            None
                        } else {
                            Some(rng.below(50))
                        },
                    },
                    6..=7 => Chaos::Blackhole {
                        tx,
                        at_ms,
                        until_ms: if rng.chance(40) {
                            None
                        } else {
                            Some(at_ms + rng.range(10, 1_200))
                        },
                    },
                    _ => Chaos::Corrupt {
                        tx,
                        nth: rng.below(30),
                    },
                };
                s.chaos.push(c);
            }
        }
        s
    }
}

#[derive(Debug, Clone)]
struct Job {
    block: KvBlock,
    resent: bool,
    corrupt: bool,
}

#[derive(Debug)]
struct Busy {
    job: Job,
    /// `(pool layer, pool page)` per page of the block when it lands; `None`:
    /// read past (drained or a duplicate).
    target: Option<Vec<(u16, u32)>>,
    finish_at: Timestamp,
}

#[derive(Debug)]
struct LaneIo {
    handle: LaneHandle,
    /// Blocks in the pipe: when their header can reach the receiver.
    fifo: VecDeque<(Timestamp, Job)>,
    busy: Option<Busy>,
    stalled: bool,
    stalled_since: Option<Timestamp>,
    /// Bytes the receiver took off the lane (the sender's acknowledged bytes).
    acked: u64,
    /// The receiver's reader runs.
    reader: bool,
    /// The sender revoked it: nothing more is placed on it.
    stopped: bool,
    /// The sender's log: every job placed on this lane.
    log: Vec<Job>,
    last_ready: Timestamp,
    /// The sender's writer reported this lane's failure.
    write_failed: bool,
}

#[derive(Debug)]
struct ConnIo {
    tx: usize,
    rx: SessionHandle,
    lanes: Vec<LaneIo>,
    tx_alive: bool,
    rx_alive: bool,
    reset: bool,
    to_rx_last: Timestamp,
    to_tx_last: Timestamp,
}

pub struct TxSide {
    pub m: SenderSession,
    pub id: u64,
    secret: Option<[u8; 32]>,
    /// Current connection epoch (0: none yet).
    epoch: u64,
    pub log: Vec<(Timestamp, SenderEvent)>,
    blackhole: Option<Option<Timestamp>>,
    next_lane: usize,
    placed: u64,
    connecting: bool,
}

#[derive(Debug)]
enum Action {
    ToRx {
        conn: (usize, u64),
        frame: Frame,
    },
    ToTx {
        conn: (usize, u64),
        frame: Frame,
    },
    LaneStep {
        conn: (usize, u64),
        lane: usize,
    },
    MidBlockStall {
        conn: (usize, u64),
        lane: usize,
        since: Timestamp,
    },
    WriteStall {
        conn: (usize, u64),
        lane: usize,
        since: Timestamp,
    },
    Grant(usize),
    Send {
        req: usize,
        chunk: usize,
    },
    Finish(usize),
    Cancel(usize),
    Sample {
        conn: (usize, u64),
    },
    ChaosOn(usize),
    ChaosOff(usize),
    TxNotice {
        conn: (usize, u64),
    },
    RxNotice {
        conn: (usize, u64),
    },
    Connect(usize),
    ReaderEnd {
        conn: (usize, u64),
        lane: usize,
    },
    LaneClosed {
        conn: (usize, u64),
        lane: usize,
    },
}

/// Which grant page of which transfer a pool page holds, or garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Page {
        transfer: u64,
        layer: u16,
        page: u32,
    },
    Garbage,
}

/// The whole simulation.
pub struct Sim {
    pub now: Timestamp,
    pub rx: ReceiverEndpoint,
    pub txs: Vec<TxSide>,
    pub sched: Schedule,
    rng: Rng,
    actions: BTreeMap<(Timestamp, u64), Action>,
    seq: u64,
    conns: HashMap<(usize, u64), ConnIo>,
    pool: HashMap<(u16, u32), Tag>,
    /// Receiver grants: transfer id -> (request index, grant).
    pub granted: HashMap<u64, (usize, KvGrant)>,
    pub refused: HashSet<usize>,
    /// Transfer ids the sender engine took, by request index.
    pub taken: HashMap<usize, u64>,
    pub finished: HashSet<u64>,
    pub rx_log: Vec<(Timestamp, ReceiverEvent)>,
    /// Receiver-side session ends: (when, instance, error, violation).
    pub rx_sessions_ended: Vec<(Timestamp, SessionHandle, Error, bool)>,
    /// Problems the harness saw on the way (a block on a dead lane, ...).
    pub problems: Vec<String>,
    pub steps: u64,
    /// The sender I/O's log for transfer resume: every block planned, by transfer
    /// (sent, or kept while its transfer was suspended).
    resume_log: HashMap<u64, Vec<Job>>,
    /// Blocks placed on a lane, resent ones included (what crossed the wire).
    pub blocks_placed: u64,
    pub blocks_resent: u64,
}

/// Simulated-time ceiling: a schedule still running past it hangs.
pub const SIM_BOUND_MS: u64 = 60_000;

impl Sim {
    pub fn new(sched: Schedule) -> Sim {
        let rx = ReceiverEndpoint::new(POOL_LAYERS, POOL_PAGES, PAGE_BYTES, sched.timers)
            .expect("receiver");
        let txs = (0..sched.senders)
            .map(|i| TxSide {
                m: SenderSession::new(sched.timers, dur(LANE_STALL_MS)).expect("sender"),
                id: 1000 + i as u64,
                secret: None,
                epoch: 0,
                log: Vec::new(),
                blackhole: None,
                next_lane: 0,
                placed: 0,
                connecting: false,
            })
            .collect();
        let mut sim = Sim {
            now: Timestamp::ZERO,
            rx,
            txs,
            rng: Rng(sched.seed ^ 0x5eed),
            sched,
            actions: BTreeMap::new(),
            seq: 0,
            conns: HashMap::new(),
            pool: HashMap::new(),
            granted: HashMap::new(),
            refused: HashSet::new(),
            taken: HashMap::new(),
            finished: HashSet::new(),
            rx_log: Vec::new(),
            rx_sessions_ended: Vec::new(),
            problems: Vec::new(),
            steps: 0,
            resume_log: HashMap::new(),
            blocks_placed: 0,
            blocks_resent: 0,
        };
        for tx in 0..sim.txs.len() {
            sim.at(Timestamp::ZERO, Action::Connect(tx));
        }
        for (i, r) in sim.sched.requests.clone().iter().enumerate() {
            sim.at(ms(r.grant_at_ms), Action::Grant(i));
            if let Some(c) = r.cancel_at_ms {
                sim.at(ms(c), Action::Cancel(i));
            }
        }
        for (i, c) in sim.sched.chaos.clone().iter().enumerate() {
            match c {
                Chaos::Stall { at_ms, for_ms, .. } => {
                    sim.at(ms(*at_ms), Action::ChaosOn(i));
                    if let Some(f) = for_ms {
                        sim.at(ms(at_ms + f), Action::ChaosOff(i));
                    }
                }
                Chaos::Reset { at_ms, .. } => sim.at(ms(*at_ms), Action::ChaosOn(i)),
                Chaos::Blackhole { at_ms, .. } => sim.at(ms(*at_ms), Action::ChaosOn(i)),
                Chaos::Corrupt { .. } => {}
            }
        }
        sim
    }

    fn at(&mut self, when: Timestamp, a: Action) {
        self.seq += 1;
        self.actions.insert((when.max(self.now), self.seq), a);
    }

    /// The next instant anything happens.
    fn next_time(&self) -> Option<Timestamp> {
        let mut t = self.actions.keys().next().map(|k| k.0);
        for c in std::iter::once(self.rx.poll_timeout())
            .chain(self.txs.iter().map(|tx| tx.m.poll_timeout()))
            .flatten()
        {
            t = Some(t.map_or(c, |t: Timestamp| t.min(c)));
        }
        t
    }

    /// Run until `until`, firing everything due in time order.
    pub fn run_until(&mut self, until: Timestamp) {
        while let Some(t) = self.next_time() {
            if t > until {
                break;
            }
            self.step(t);
        }
        self.now = self.now.max(until);
    }

    /// Run until every request is settled on both ends (or the ceiling), then
    /// `settle_ms` more.
    pub fn run(&mut self, settle_ms: u64) {
        let bound = ms(SIM_BOUND_MS);
        let quiet = ms(self.quiet_after());
        while let Some(t) = self.next_time() {
            if t > bound || (self.now >= quiet && self.settled()) {
                break;
            }
            self.step(t);
        }
        if !self.settled() {
            self.problems.push(format!(
                "not settled by {:?}: {:?}",
                self.now,
                self.unsettled()
            ));
        }
        let until = self.now.saturating_add(dur(settle_ms));
        self.run_until(until);
    }

    fn quiet_after(&self) -> u64 {
        let r = self
            .sched
            .requests
            .iter()
            .map(|r| r.grant_at_ms.max(r.cancel_at_ms.unwrap_or(0)))
            .max()
            .unwrap_or(0);
        let c = self
            .sched
            .chaos
            .iter()
            .map(|c| match c {
                Chaos::Stall { at_ms, for_ms, .. } => at_ms + for_ms.unwrap_or(0),
                Chaos::Reset { at_ms, .. } => *at_ms,
                Chaos::Blackhole {
                    at_ms, until_ms, ..
                } => until_ms.unwrap_or(*at_ms),
                Chaos::Corrupt { .. } => 0,
            })
            .max()
            .unwrap_or(0);
        r.max(c)
    }

    /// Requests not yet settled: granted but not ended on the receiver, or taken
    /// but not ended on the sender.
    pub fn unsettled(&self) -> Vec<usize> {
        let rx_ended = self.rx_terminal();
        let tx_ended = self.tx_terminal();
        let mut open = Vec::new();
        for (i, r) in self.sched.requests.iter().enumerate() {
            if self.refused.contains(&i) {
                continue;
            }
            let Some(tid) = self.tid_of(i) else {
                if self.now < ms(r.grant_at_ms) {
                    open.push(i);
                }
                continue;
            };
            if !rx_ended.contains_key(&tid) {
                open.push(i);
                continue;
            }
            if self.taken.contains_key(&i) && !tx_ended.contains_key(&tid) {
                open.push(i);
            }
        }
        open
    }

    pub fn settled(&self) -> bool {
        self.unsettled().is_empty()
    }

    pub fn tid_of(&self, req: usize) -> Option<u64> {
        self.granted
            .iter()
            .find(|(_, (r, _))| *r == req)
            .map(|(&t, _)| t)
    }

    /// Receiver terminal events by transfer: (when, event), the first one.
    pub fn rx_terminal(&self) -> HashMap<u64, (Timestamp, TransferEvent)> {
        let mut m = HashMap::new();
        for (t, e) in &self.rx_log {
            if let ReceiverEvent::Transfer(ev) = e {
                match ev {
                    TransferEvent::Complete { transfer_id, .. }
                    | TransferEvent::Failed { transfer_id, .. } => {
                        m.entry(*transfer_id).or_insert((*t, ev.clone()));
                    }
                    TransferEvent::LayerComplete { .. } => {}
                }
            }
        }
        m
    }

    /// Sender terminal events by transfer, the first one.
    pub fn tx_terminal(&self) -> HashMap<u64, (Timestamp, SenderEvent)> {
        let mut m = HashMap::new();
        for tx in &self.txs {
            for (t, e) in &tx.log {
                if let SenderEvent::TransferComplete { transfer_id, .. }
                | SenderEvent::TransferFailed { transfer_id, .. } = e
                {
                    m.entry(*transfer_id).or_insert((*t, e.clone()));
                }
            }
        }
        m
    }

    fn step(&mut self, t: Timestamp) {
        self.steps += 1;
        self.now = self.now.max(t);
        let now = self.now;
        if self.rx.poll_timeout().is_some_and(|d| d <= now) {
            self.rx.handle_timeout(now);
        }
        for i in 0..self.txs.len() {
            if self.txs[i].m.poll_timeout().is_some_and(|d| d <= now) {
                self.txs[i].m.handle_timeout(now);
            }
        }
        self.pump();
        while let Some((&(when, seq), _)) = self.actions.iter().next() {
            if when > now {
                break;
            }
            let a = self.actions.remove(&(when, seq)).expect("present");
            self.act(a);
            self.pump();
        }
    }

    /// Drain every machine's outputs into the network.
    fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some((h, f)) = self.rx.poll_transmit(self.now) {
                moved = true;
                self.rx_send(h, f);
            }
            while let Some(e) = self.rx.poll_event() {
                moved = true;
                self.rx_event(e);
            }
            for i in 0..self.txs.len() {
                while let Some(f) = self.txs[i].m.poll_transmit(self.now) {
                    moved = true;
                    self.tx_send(i, f);
                }
                while let Some(e) = self.txs[i].m.poll_event() {
                    moved = true;
                    self.tx_event(i, e);
                }
            }
            if !moved {
                break;
            }
        }
    }

    /// When something sent now on `tx`'s path arrives (`None`: never).
    fn path_delay(&mut self, tx: usize, base_ms: u64) -> Option<Timestamp> {
        let jitter = self.rng.below(self.sched.link.jitter_ms + 1);
        let arrive = self.now.saturating_add(dur(base_ms + jitter));
        match self.txs[tx].blackhole {
            Some(None) => None,
            Some(Some(until)) if until > self.now => Some(arrive.max(until)),
            _ => Some(arrive),
        }
    }

    fn conn_of_rx(&self, h: SessionHandle) -> Option<(usize, u64)> {
        self.conns.iter().find(|(_, c)| c.rx == h).map(|(&k, _)| k)
    }

    fn rx_send(&mut self, h: SessionHandle, frame: Frame) {
        let Some(key) = self.conn_of_rx(h) else {
            return;
        };
        let Some(arrive) = self.path_delay(key.0, self.sched.link.control_ms) else {
            return;
        };
        let c = self.conns.get_mut(&key).expect("conn");
        if c.reset {
            return;
        }
        let arrive = arrive.max(c.to_tx_last);
        c.to_tx_last = arrive;
        self.at(arrive, Action::ToTx { conn: key, frame });
    }

    fn tx_send(&mut self, tx: usize, frame: Frame) {
        let key = (tx, self.txs[tx].epoch);
        if !self.conns.contains_key(&key) {
            return;
        }
        let Some(arrive) = self.path_delay(tx, self.sched.link.control_ms) else {
            return;
        };
        let c = self.conns.get_mut(&key).expect("conn");
        if c.reset {
            return;
        }
        let arrive = arrive.max(c.to_rx_last);
        c.to_rx_last = arrive;
        self.at(arrive, Action::ToRx { conn: key, frame });
    }

    fn rx_event(&mut self, e: ReceiverEvent) {
        self.rx_log.push((self.now, e.clone()));
        match e {
            ReceiverEvent::SessionEnded {
                session,
                error,
                violation,
            } => {
                self.rx_sessions_ended
                    .push((self.now, session, error, violation));
                let Some(key) = self.conn_of_rx(session) else {
                    return;
                };
                // pdd-io cancels the instance's lanes: their readers stop.
                for lane in 0..self.conns[&key].lanes.len() {
                    self.cut_reader(key, lane);
                }
                let c = self.conns.get_mut(&key).expect("conn");
                c.rx_alive = false;
                let (last, reset) = (c.to_tx_last, c.reset);
                // The sender sees the sockets close after what was sent before (a
                // reset connection carries nothing more).
                let at = self.path_delay(key.0, self.sched.link.control_ms);
                if let (Some(at), false) = (at, reset) {
                    self.at(at.max(last), Action::TxNotice { conn: key });
                }
            }
            ReceiverEvent::StopLane { lane } => {
                let key = self.conn_of_rx(lane.session);
                let idx =
                    key.and_then(|k| self.conns[&k].lanes.iter().position(|l| l.handle == lane));
                if let (Some(key), Some(idx)) = (key, idx) {
                    let at = self.now.saturating_add(dur(self.sched.lane_end_ms));
                    self.at(
                        at,
                        Action::ReaderEnd {
                            conn: key,
                            lane: idx,
                        },
                    );
                }
            }
            ReceiverEvent::SessionSuspended { session, .. } => {
                // pdd-io closes the instance's lanes, as for an end.
                let Some(key) = self.conn_of_rx(session) else {
                    return;
                };
                for lane in 0..self.conns[&key].lanes.len() {
                    self.cut_reader(key, lane);
                }
                let c = self.conns.get_mut(&key).expect("conn");
                c.rx_alive = false;
                let (last, reset) = (c.to_tx_last, c.reset);
                let at = self.path_delay(key.0, self.sched.link.control_ms);
                if let (Some(at), false) = (at, reset) {
                    self.at(at.max(last), Action::TxNotice { conn: key });
                }
            }
            ReceiverEvent::Transfer(_)
            | ReceiverEvent::Rtt { .. }
            | ReceiverEvent::PeerLayout { .. }
            | ReceiverEvent::SessionResumed { .. } => {}
            ReceiverEvent::PrefixQuery { .. } => {
                self.problems.push("a prefix query nobody sent".into());
            }
        }
    }

    fn tx_event(&mut self, tx: usize, e: SenderEvent) {
        self.txs[tx].log.push((self.now, e.clone()));
        let key = (tx, self.txs[tx].epoch);
        match e {
            SenderEvent::GrantArrived { request_id } => {
                let Some(req) = self
                    .sched
                    .requests
                    .iter()
                    .position(|r| r.tx == tx && r.request_id == request_id)
                else {
                    self.problems
                        .push(format!("a grant for unknown request {request_id}"));
                    return;
                };
                let Some(g) = self.txs[tx].m.take_grant(request_id) else {
                    self.problems
                        .push("an arrived grant could not be taken".into());
                    return;
                };
                self.taken.insert(req, g.transfer_id);
                let gap = dur(self.sched.requests[req].gap_ms);
                if self.sched.requests[req].chunks.is_empty() {
                    self.at(self.now.saturating_add(gap), Action::Finish(req));
                } else {
                    self.at(self.now.saturating_add(gap), Action::Send { req, chunk: 0 });
                }
            }
            SenderEvent::SessionEnded { .. } => {
                if let Some(c) = self.conns.get_mut(&key) {
                    c.tx_alive = false;
                    let (last, reset) = (c.to_rx_last, c.reset);
                    // A reset connection carries nothing more, its close included.
                    let at = self.path_delay(tx, self.sched.link.control_ms);
                    if let (Some(at), false) = (at, reset) {
                        self.at(at.max(last), Action::RxNotice { conn: key });
                    }
                }
                if !self.txs[tx].connecting {
                    self.txs[tx].connecting = true;
                    let at = self.now.saturating_add(dur(self.sched.reconnect_ms));
                    self.at(at, Action::Connect(tx));
                }
            }
            SenderEvent::StopLane { lane } => {
                if let Some(l) = self
                    .conns
                    .get_mut(&key)
                    .and_then(|c| c.lanes.get_mut(usize::from(lane) - 1))
                {
                    l.stopped = true;
                }
            }
            SenderEvent::LaneReleased { lane, resend } => {
                let Some(c) = self.conns.get_mut(&key) else {
                    return;
                };
                let jobs: Vec<Job> = std::mem::take(&mut c.lanes[usize::from(lane) - 1].log)
                    .into_iter()
                    .filter(|j| resend.contains(&j.block.transfer_id))
                    .collect();
                for mut j in jobs {
                    j.resent = true;
                    j.corrupt = false;
                    self.place(tx, j);
                }
            }
            SenderEvent::RegionsArrived { .. } => {
                self.problems.push("regions on a WAN session".into());
            }
            SenderEvent::TransferResumed { transfer_id, held } => {
                let jobs = self
                    .resume_log
                    .get(&transfer_id)
                    .cloned()
                    .unwrap_or_default();
                for mut j in jobs {
                    let b = j.block;
                    let all_held = (b.layer_start..b.layer_start + b.layer_count).all(|l| {
                        (b.page_start..b.page_start + b.page_count).all(|p| held.has(l, p))
                    });
                    if !all_held {
                        j.resent = true;
                        j.corrupt = false;
                        self.place(tx, j);
                    }
                }
            }
            SenderEvent::TransfersSuspended { .. } => {}
            SenderEvent::TransferComplete { .. }
            | SenderEvent::TransferFailed { .. }
            | SenderEvent::RequestAborted { .. }
            | SenderEvent::Rtt(_)
            | SenderEvent::PrefixReply(_)
            | SenderEvent::PeerLayout => {}
        }
    }

    /// Queue a block on the sender's next live lane, round robin.
    fn place(&mut self, tx: usize, mut job: Job) {
        let key = (tx, self.txs[tx].epoch);
        let n = self.sched.lanes as usize;
        let Some(c) = self.conns.get(&key) else {
            return;
        };
        let start = self.txs[tx].next_lane;
        let Some(idx) = (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| !c.lanes[i].stopped)
        else {
            self.problems.push("every lane is revoked".into());
            return;
        };
        self.txs[tx].next_lane = idx + 1;
        self.blocks_placed += 1;
        if job.resent {
            self.blocks_resent += 1;
        }
        let nth = self.txs[tx].placed;
        self.txs[tx].placed += 1;
        if !job.resent
            && self
                .sched
                .chaos
                .iter()
                .any(|c| matches!(c, Chaos::Corrupt { tx: t, nth: k } if *t == tx && *k == nth))
        {
            job.corrupt = true;
        }
        let base = self.sched.link.lane_ms[idx];
        let ready = self.path_delay(tx, base);
        let c = self.conns.get_mut(&key).expect("conn");
        let lane = &mut c.lanes[idx];
        lane.log.push(job.clone());
        if let Some(ready) = ready {
            let ready = ready.max(lane.last_ready);
            lane.last_ready = ready;
            lane.fifo.push_back((ready, job));
            self.at(
                ready,
                Action::LaneStep {
                    conn: key,
                    lane: idx,
                },
            );
        }
    }

    fn act(&mut self, a: Action) {
        let now = self.now;
        match a {
            Action::ToRx { conn, frame } => {
                let Some(c) = self.conns.get(&conn) else {
                    return;
                };
                if c.rx_alive && !c.reset {
                    let h = c.rx;
                    self.rx.handle_frame(h, frame, now);
                }
            }
            Action::ToTx { conn, frame } => {
                let Some(c) = self.conns.get(&conn) else {
                    return;
                };
                if c.tx_alive && !c.reset && self.txs[conn.0].epoch == conn.1 {
                    self.txs[conn.0].m.handle_frame(frame, now);
                }
            }
            Action::LaneStep { conn, lane } => self.lane_step(conn, lane),
            Action::MidBlockStall { conn, lane, since } => {
                // pdd-io's read bound inside a block: no byte for dead_after.
                let Some(l) = self.conns.get(&conn).map(|c| &c.lanes[lane]) else {
                    return;
                };
                if l.stalled && l.stalled_since == Some(since) && l.busy.is_some() && l.reader {
                    self.cut_reader(conn, lane);
                    self.lane_closed(conn, lane);
                }
            }
            Action::WriteStall { conn, lane, since } => {
                // pdd-io's write bound: a write that makes no progress for dead_after.
                let Some(l) = self.conns.get_mut(&conn).map(|c| &mut c.lanes[lane]) else {
                    return;
                };
                let loaded = l.busy.is_some() || !l.fifo.is_empty();
                if l.stalled && l.stalled_since == Some(since) && loaded && !l.write_failed {
                    l.write_failed = true;
                    if self.txs[conn.0].epoch == conn.1 {
                        let e = Error::ConnectionLost {
                            detail: "data lane stalled: no byte taken".into(),
                        };
                        self.txs[conn.0].m.data_lane_failed(lane as u16 + 1, e, now);
                    }
                }
            }
            Action::Grant(req) => {
                let r = self.sched.requests[req].clone();
                let id = self.txs[r.tx].id;
                let mut draw = self.rng.clone();
                let got = self.rx.grant(
                    id,
                    r.request_id,
                    &r.pages,
                    r.layers,
                    r.deadline_ms.map(dur),
                    now,
                    || draw.next(),
                );
                self.rng = draw;
                match got {
                    Ok(g) => {
                        self.granted.insert(g.transfer_id, (req, g));
                    }
                    Err(e) => {
                        if e.reason() != "connection_lost" {
                            self.problems.push(format!("grant refused: {e}"));
                        }
                        self.refused.insert(req);
                    }
                }
            }
            Action::Cancel(req) => {
                if let Some(tid) = self.tid_of(req) {
                    self.rx.fail_transfer(
                        tid,
                        Error::Cancelled {
                            detail: "cancelled by the receiver".into(),
                        },
                    );
                }
            }
            Action::Send { req, chunk } => {
                let Some(&tid) = self.taken.get(&req) else {
                    return;
                };
                let r = self.sched.requests[req].clone();
                if !self.txs[r.tx].m.in_progress(tid) {
                    return;
                }
                if r.abort_before_chunk == Some(chunk) {
                    self.txs[r.tx].m.abort(tid, "the engine gave up");
                    return;
                }
                let max = self.sched.max_block_pages * u64::from(PAGE_BYTES);
                match self.txs[r.tx]
                    .m
                    .send_pages(tid, 0..r.layers, &r.chunks[chunk], max)
                {
                    Ok(planned) => {
                        let suspended = self.txs[r.tx].m.is_suspended(tid);
                        for p in planned {
                            let job = Job {
                                block: p.block,
                                resent: false,
                                corrupt: false,
                            };
                            if self.sched.resume {
                                self.resume_log.entry(tid).or_default().push(job.clone());
                            }
                            // A suspended transfer's blocks wait for its KV_HELD.
                            if !suspended {
                                self.place(r.tx, job);
                            }
                        }
                    }
                    Err(e) => self.problems.push(format!("send_pages refused: {e}")),
                }
                let next = now.saturating_add(dur(r.gap_ms));
                if chunk + 1 < r.chunks.len() {
                    self.at(
                        next,
                        Action::Send {
                            req,
                            chunk: chunk + 1,
                        },
                    );
                } else {
                    self.at(next, Action::Finish(req));
                }
            }
            Action::Finish(req) => {
                let Some(&tid) = self.taken.get(&req) else {
                    return;
                };
                let tx = self.sched.requests[req].tx;
                if !self.txs[tx].m.in_progress(tid) {
                    return;
                }
                match self.txs[tx].m.finish(tid) {
                    Ok(_) => {
                        self.finished.insert(tid);
                    }
                    Err(e) => self.problems.push(format!("finish refused: {e}")),
                }
            }
            Action::Sample { conn } => {
                let (tx, epoch) = conn;
                if self.txs[tx].epoch != epoch {
                    return;
                }
                let Some(c) = self.conns.get(&conn) else {
                    return;
                };
                if !c.tx_alive {
                    return;
                }
                let samples: Vec<LaneSample> = c
                    .lanes
                    .iter()
                    .map(|l| LaneSample {
                        progress: l.acked,
                        loaded: l.busy.is_some() || !l.fifo.is_empty(),
                        sent: 0,
                    })
                    .collect();
                self.txs[tx].m.lane_samples(&samples, now);
                let next = now.saturating_add(dur(LANE_STALL_MS / 4));
                self.at(next, Action::Sample { conn });
            }
            Action::ChaosOn(i) => self.chaos(i, true),
            Action::ChaosOff(i) => self.chaos(i, false),
            Action::TxNotice { conn } => {
                let (tx, epoch) = conn;
                let alive = self.conns.get(&conn).is_some_and(|c| c.tx_alive);
                if alive && self.txs[tx].epoch == epoch {
                    self.txs[tx].m.close_session(
                        Error::ConnectionLost {
                            detail: "receiver closed the control lane".into(),
                        },
                        false,
                    );
                }
            }
            Action::RxNotice { conn } => {
                let Some(c) = self.conns.get(&conn) else {
                    return;
                };
                if c.rx_alive {
                    let h = c.rx;
                    for lane in 0..c.lanes.len() {
                        self.cut_reader(conn, lane);
                    }
                    self.rx.control_lost(
                        h,
                        Error::ConnectionLost {
                            detail: format!("peer {} closed the control lane", h.id),
                        },
                        now,
                    );
                }
            }
            Action::Connect(tx) => self.connect(tx),
            Action::LaneClosed { conn, lane } => {
                // The sender's writer sees the receiver close the lane; the machine
                // decides whether that matters (not on a revoked lane).
                let alive = self.conns.get(&conn).is_some_and(|c| c.tx_alive);
                if alive && self.txs[conn.0].epoch == conn.1 {
                    let e = Error::ConnectionLost {
                        detail: "data lane closed by the receiver".into(),
                    };
                    self.txs[conn.0].m.data_lane_failed(lane as u16 + 1, e, now);
                }
            }
            Action::ReaderEnd { conn, lane } => {
                let alive = self.conns.get(&conn).is_some_and(|c| c.lanes[lane].reader);
                if alive {
                    self.cut_reader(conn, lane);
                    self.lane_closed(conn, lane);
                }
            }
        }
    }

    /// The receiver's reader of a lane ends: a block it was in is cut off (the
    /// machine says abandoned or failed), the rest in its pipe is lost.
    fn cut_reader(&mut self, conn: (usize, u64), lane: usize) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let l = &mut c.lanes[lane];
        if !l.reader {
            return;
        }
        l.reader = false;
        l.fifo.clear();
        let handle = l.handle;
        if let Some(b) = l.busy.take() {
            if let Some(target) = b.target {
                for p in target {
                    self.pool.insert(p, Tag::Garbage);
                }
                self.rx.block_cut(&handle, &b.job.block);
            }
        }
        self.rx.lane_down(handle);
    }

    /// The sender sees a lane the receiver closed, a control delay later.
    fn lane_closed(&mut self, conn: (usize, u64), lane: usize) {
        if let Some(at) = self.path_delay(conn.0, self.sched.link.control_ms) {
            self.at(at, Action::LaneClosed { conn, lane });
        }
    }

    fn lane_step(&mut self, conn: (usize, u64), lane: usize) {
        let now = self.now;
        loop {
            let Some(c) = self.conns.get_mut(&conn) else {
                return;
            };
            if c.reset {
                return;
            }
            let l = &mut c.lanes[lane];
            if l.stalled || !l.reader {
                return;
            }
            let handle = l.handle;
            if let Some(b) = &l.busy {
                if b.finish_at > now {
                    let at = b.finish_at;
                    self.at(at, Action::LaneStep { conn, lane });
                    return;
                }
                let b = l.busy.take().expect("busy");
                l.acked += b.job.block.data_len();
                if let Some(target) = b.target {
                    let outcome = if b.job.corrupt {
                        for p in &target {
                            self.pool.insert(*p, Tag::Garbage);
                        }
                        Err(Error::ChecksumMismatch {
                            expected: 1,
                            computed: 2,
                        })
                    } else {
                        let blk = b.job.block;
                        let mut i = 0;
                        for layer in blk.layer_start..blk.layer_start + blk.layer_count {
                            for page in blk.page_start..blk.page_start + blk.page_count {
                                self.pool.insert(
                                    target[i],
                                    Tag::Page {
                                        transfer: blk.transfer_id,
                                        layer,
                                        page,
                                    },
                                );
                                i += 1;
                            }
                        }
                        Ok(())
                    };
                    self.rx.finish_block(&b.job.block, outcome);
                }
                continue;
            }
            let Some(&(ready, _)) = l.fifo.front() else {
                return;
            };
            if ready > now {
                self.at(ready, Action::LaneStep { conn, lane });
                return;
            }
            let (_, job) = l.fifo.pop_front().expect("front");
            let finish_at = now.saturating_add(dur(self.sched.link.block_ms));
            match self.rx.begin_block(&handle, &job.block, job.resent) {
                Ok(BlockDisposition::Land(t)) => {
                    let c = self.conns.get_mut(&conn).expect("conn");
                    c.lanes[lane].busy = Some(Busy {
                        job,
                        target: Some(t.pages),
                        finish_at,
                    });
                }
                Ok(BlockDisposition::Drain | BlockDisposition::Duplicate) => {
                    let c = self.conns.get_mut(&conn).expect("conn");
                    c.lanes[lane].busy = Some(Busy {
                        job,
                        target: None,
                        finish_at,
                    });
                }
                Err(_) => {
                    // The machine ended the session; its SessionEnded cuts the lane.
                    return;
                }
            }
        }
    }

    fn chaos(&mut self, i: usize, on: bool) {
        let c = self.sched.chaos[i].clone();
        match c {
            Chaos::Stall { tx, lane, .. } => {
                let key = (tx, self.txs[tx].epoch);
                let now = self.now;
                let dead_after = self.sched.timers.dead_after;
                let Some(conn) = self.conns.get_mut(&key) else {
                    return;
                };
                let idx = usize::from(lane) - 1;
                let l = &mut conn.lanes[idx];
                l.stalled = on;
                if on {
                    l.stalled_since = Some(now);
                    let at = now.saturating_add(dead_after);
                    self.at(
                        at,
                        Action::MidBlockStall {
                            conn: key,
                            lane: idx,
                            since: now,
                        },
                    );
                    self.at(
                        at,
                        Action::WriteStall {
                            conn: key,
                            lane: idx,
                            since: now,
                        },
                    );
                } else {
                    l.stalled_since = None;
                    self.at(
                        now,
                        Action::LaneStep {
                            conn: key,
                            lane: idx,
                        },
                    );
                }
            }
            Chaos::Reset {
                tx,
                tx_notice_ms,
                rx_notice_ms,
                ..
            } => {
                let key = (tx, self.txs[tx].epoch);
                let Some(conn) = self.conns.get_mut(&key) else {
                    return;
                };
                conn.reset = true;
                let now = self.now;
                self.at(
                    now.saturating_add(dur(tx_notice_ms)),
                    Action::TxNotice { conn: key },
                );
                // Its readers see the reset now, its control lane after the delay
                // (or never: it must find out by itself).
                if let Some(d) = rx_notice_ms {
                    for lane in 0..self.conns[&key].lanes.len() {
                        self.cut_reader(key, lane);
                    }
                    self.at(now.saturating_add(dur(d)), Action::RxNotice { conn: key });
                }
            }
            Chaos::Blackhole { tx, until_ms, .. } => {
                self.txs[tx].blackhole = Some(until_ms.map(ms));
            }
            Chaos::Corrupt { .. } => {}
        }
    }

    /// Open (or resume) sender `tx`'s session, as `pdd-io`'s connect does: the key
    /// the receiver asks for, then the control lane, then every data lane.
    fn connect(&mut self, tx: usize) {
        self.txs[tx].connecting = false;
        if self.txs[tx].m.is_connected() {
            return;
        }
        // Reconnect only while something may still need the session.
        if self.txs[tx].epoch > 0 && !self.work_pending(tx) {
            return;
        }
        match self.txs[tx].blackhole {
            Some(None) => return,
            Some(Some(until)) if until > self.now => {
                // Nothing gets through: try again once the path is back.
                self.txs[tx].connecting = true;
                self.at(until, Action::Connect(tx));
                return;
            }
            _ => {}
        }
        let id = self.txs[tx].id;
        let now = self.now;
        let resume = self.txs[tx].secret.is_some();
        let key = match self.rx.lane_key(id, resume, 0, None) {
            Err(Error::AuthFailed { .. }) if resume => self.rx.lane_key(id, false, 0, None),
            other => other,
        };
        let (resume, secret) = match key {
            Ok(LaneKey::Session(s)) => (true, s),
            Ok(LaneKey::Root) => {
                let mut s = [0u8; 32];
                s[..8].copy_from_slice(&self.rng.next().to_le_bytes());
                (false, s)
            }
            Err(_) => {
                self.txs[tx].connecting = true;
                let at = now.saturating_add(dur(self.sched.reconnect_ms));
                self.at(at, Action::Connect(tx));
                return;
            }
        };
        let caps = caps(self.sched.failover)
            | if self.sched.resume {
                capability::KV_RESUME
            } else {
                0
            };
        let h = match self.rx.open_session(id, resume, secret, None, caps, now) {
            Ok(h) => h,
            Err(e) => {
                self.problems.push(format!("open refused: {e}"));
                return;
            }
        };
        self.txs[tx].secret = Some(secret);
        let mut lanes = Vec::new();
        for lane in 1..=self.sched.lanes {
            match self.rx.join_lane(id, lane, secret) {
                Ok(handle) => lanes.push(LaneIo {
                    handle,
                    fifo: VecDeque::new(),
                    busy: None,
                    stalled: false,
                    stalled_since: None,
                    acked: 0,
                    reader: true,
                    stopped: false,
                    log: Vec::new(),
                    last_ready: now,
                    write_failed: false,
                }),
                Err(e) => {
                    self.problems.push(format!("lane refused: {e}"));
                    return;
                }
            }
        }
        self.txs[tx].epoch += 1;
        let key = (tx, self.txs[tx].epoch);
        self.conns.insert(
            key,
            ConnIo {
                tx,
                rx: h,
                lanes,
                tx_alive: true,
                rx_alive: true,
                reset: false,
                to_rx_last: now,
                to_tx_last: now,
            },
        );
        if resume {
            self.txs[tx]
                .m
                .resumed(caps, self.sched.lanes, now)
                .expect("resumed");
        } else {
            self.txs[tx]
                .m
                .connected(caps, self.sched.lanes, now)
                .expect("connected");
        }
        self.at(
            now.saturating_add(dur(LANE_STALL_MS / 4)),
            Action::Sample { conn: key },
        );
        // Lanes stalled by a schedule stay stalled on a new connection's lanes.
        for (i, c) in self.sched.chaos.clone().iter().enumerate() {
            if let Chaos::Stall {
                tx: t,
                at_ms,
                for_ms,
                ..
            } = c
            {
                let active = ms(*at_ms) <= now && for_ms.is_none_or(|f| now < ms(at_ms + f));
                if *t == tx && active {
                    self.chaos(i, true);
                }
            }
        }
    }

    fn work_pending(&self, tx: usize) -> bool {
        self.sched
            .requests
            .iter()
            .enumerate()
            .any(|(i, r)| r.tx == tx && self.unsettled().contains(&i))
    }

    // ---- checks ----

    /// Every invariant that holds under any schedule of honest peers. Returns the
    /// breaches (empty: all hold).
    pub fn check(&self) -> Vec<String> {
        let mut bad = self.problems.clone();
        let corrupting = self
            .sched
            .chaos
            .iter()
            .any(|c| matches!(c, Chaos::Corrupt { .. }));
        // Exactly one end per transfer, on each side; nothing after it.
        let mut rx_ends: HashMap<u64, usize> = HashMap::new();
        let mut ended_at: HashMap<u64, Timestamp> = HashMap::new();
        for (t, e) in &self.rx_log {
            if let ReceiverEvent::Transfer(ev) = e {
                match ev {
                    TransferEvent::LayerComplete { transfer_id, .. } => {
                        if ended_at.contains_key(transfer_id) {
                            bad.push(format!("LayerComplete after the end of {transfer_id}"));
                        }
                    }
                    TransferEvent::Complete { transfer_id, .. }
                    | TransferEvent::Failed { transfer_id, .. } => {
                        *rx_ends.entry(*transfer_id).or_default() += 1;
                        ended_at.entry(*transfer_id).or_insert(*t);
                    }
                }
            }
        }
        for (tid, n) in &rx_ends {
            if *n != 1 {
                bad.push(format!("transfer {tid} ended {n} times on the receiver"));
            }
            if !self.granted.contains_key(tid) {
                bad.push(format!("transfer {tid} ended but was never granted"));
            }
        }
        for tid in self.granted.keys() {
            if !rx_ends.contains_key(tid) {
                bad.push(format!("transfer {tid} never ended on the receiver"));
            }
        }
        let mut tx_ends: HashMap<u64, usize> = HashMap::new();
        for tx in &self.txs {
            for (_, e) in &tx.log {
                if let SenderEvent::TransferComplete { transfer_id, .. }
                | SenderEvent::TransferFailed { transfer_id, .. } = e
                {
                    *tx_ends.entry(*transfer_id).or_default() += 1;
                }
            }
        }
        for (req, tid) in &self.taken {
            match tx_ends.get(tid) {
                Some(1) => {}
                n => bad.push(format!(
                    "request {req} (transfer {tid}) ended {n:?} times on the sender"
                )),
            }
        }
        let rx_t = self.rx_terminal();
        let tx_t = self.tx_terminal();
        // A confirmation means what it says, on both ends.
        for (tid, (_, e)) in &tx_t {
            if let SenderEvent::TransferComplete { bytes, .. } = e {
                match rx_t.get(tid) {
                    Some((_, TransferEvent::Complete { bytes: b, .. })) if b == bytes => {}
                    other => bad.push(format!(
                        "the sender completed {tid} ({bytes} bytes), the receiver: {other:?}"
                    )),
                }
            }
        }
        for (tid, (_, e)) in &rx_t {
            match e {
                TransferEvent::Complete { .. } => {
                    let (_, g) = &self.granted[tid];
                    let req = &self.sched.requests[self.granted[tid].0];
                    if !self.finished.contains(tid) {
                        bad.push(format!(
                            "transfer {tid} completed before its sender finished"
                        ));
                    }
                    for layer in 0..g.layer_count {
                        for (gp, &pp) in req.pages.iter().enumerate() {
                            let want = Tag::Page {
                                transfer: *tid,
                                layer,
                                page: gp as u32,
                            };
                            let got = self.pool.get(&(layer, pp)).copied();
                            if got != Some(want) {
                                bad.push(format!(
                                    "transfer {tid} complete but layer {layer} page {pp} holds {got:?}"
                                ));
                            }
                        }
                    }
                }
                TransferEvent::Failed { error, .. } => {
                    if !honest_failure(error, corrupting) {
                        bad.push(format!(
                            "transfer {tid} failed for no honest reason: {error}"
                        ));
                    }
                }
                TransferEvent::LayerComplete { .. } => {}
            }
        }
        for (tid, (_, e)) in &tx_t {
            if let SenderEvent::TransferFailed { error, .. } = e {
                if !honest_failure(error, corrupting) {
                    bad.push(format!(
                        "the sender's {tid} failed for no honest reason: {error}"
                    ));
                }
            }
        }
        for (_, h, e, violation) in &self.rx_sessions_ended {
            if *violation || !honest_failure(e, corrupting) {
                bad.push(format!("session {h:?} ended for no honest reason: {e}"));
            }
        }
        for tx in &self.txs {
            for (_, e) in &tx.log {
                if let SenderEvent::SessionEnded { error } = e {
                    if !honest_failure(error, corrupting) {
                        bad.push(format!(
                            "a sender session ended for no honest reason: {error}"
                        ));
                    }
                }
            }
        }
        bad
    }

    /// After everything settled: nothing holds a page and nothing is live.
    pub fn check_quiet(&self) -> Vec<String> {
        let mut bad = Vec::new();
        let busy = self
            .conns
            .values()
            .any(|c| c.lanes.iter().any(|l| l.reader && l.busy.is_some()));
        if !busy && self.rx.state().pages_held() != 0 {
            bad.push(format!(
                "{} pages still held with no block in flight",
                self.rx.state().pages_held()
            ));
        }
        if self.rx.state().live_transfers() != 0 {
            bad.push(format!(
                "{} transfers still live",
                self.rx.state().live_transfers()
            ));
        }
        bad
    }

    /// Receiver events of one transfer.
    pub fn rx_events_of(&self, tid: u64) -> Vec<TransferEvent> {
        self.rx_log
            .iter()
            .filter_map(|(_, e)| match e {
                ReceiverEvent::Transfer(ev) => Some(ev.clone()),
                _ => None,
            })
            .filter(|ev| match ev {
                TransferEvent::LayerComplete { transfer_id, .. }
                | TransferEvent::Complete { transfer_id, .. }
                | TransferEvent::Failed { transfer_id, .. } => *transfer_id == tid,
            })
            .collect()
    }

    /// Metrics-like counts: (blocks resent, duplicates...) are not modelled; how
    /// many lanes the senders revoked.
    pub fn revocations(&self) -> usize {
        self.txs
            .iter()
            .flat_map(|t| &t.log)
            .filter(|(_, e)| matches!(e, SenderEvent::StopLane { .. }))
            .count()
    }

    pub fn sender_sessions_ended(&self, tx: usize) -> Vec<(Timestamp, Error)> {
        self.txs[tx]
            .log
            .iter()
            .filter_map(|(t, e)| match e {
                SenderEvent::SessionEnded { error } => Some((*t, error.clone())),
                _ => None,
            })
            .collect()
    }
}

/// Why a transfer or a session of honest peers may fail under chaos.
pub fn honest_failure(e: &Error, corrupting: bool) -> bool {
    match e {
        Error::ConnectionLost { .. } | Error::DeadlineExceeded { .. } | Error::Cancelled { .. } => {
            true
        }
        Error::ChecksumMismatch { .. } => corrupting,
        Error::PeerAborted { reason, .. } => {
            matches!(
                reason.name(),
                "cancelled" | "deadline_exceeded" | "shutdown"
            ) || (corrupting && reason.name() == "checksum_mismatch")
        }
        _ => false,
    }
}

// ---- driving one machine by hand ----

/// A receiver with the schedules' bounds and pool.
pub fn receiver() -> ReceiverEndpoint {
    ReceiverEndpoint::new(POOL_LAYERS, POOL_PAGES, PAGE_BYTES, timers()).expect("receiver")
}

/// The secret a test session `id` proves.
pub fn secret(id: u64) -> [u8; 32] {
    let mut s = [0u8; 32];
    s[..8].copy_from_slice(&id.to_le_bytes());
    s[31] = 0x5a;
    s
}

/// Open session `id` (its control lane) with `caps` at `now`.
pub fn open(rx: &mut ReceiverEndpoint, id: u64, caps: u64, now: Timestamp) -> SessionHandle {
    assert_eq!(rx.lane_key(id, false, 0, None).expect("key"), LaneKey::Root);
    rx.open_session(id, false, secret(id), None, caps, now)
        .expect("open")
}

/// Everything a receiver has to say now.
pub fn drain_rx(
    rx: &mut ReceiverEndpoint,
    now: Timestamp,
) -> (Vec<(SessionHandle, Frame)>, Vec<ReceiverEvent>) {
    let mut f = Vec::new();
    while let Some(x) = rx.poll_transmit(now) {
        f.push(x);
    }
    let mut e = Vec::new();
    while let Some(x) = rx.poll_event() {
        e.push(x);
    }
    (f, e)
}

/// Everything a sender has to say now.
pub fn drain_tx(tx: &mut SenderSession, now: Timestamp) -> (Vec<Frame>, Vec<SenderEvent>) {
    let mut f = Vec::new();
    while let Some(x) = tx.poll_transmit(now) {
        f.push(x);
    }
    let mut e = Vec::new();
    while let Some(x) = tx.poll_event() {
        e.push(x);
    }
    (f, e)
}

/// A sender connected at `now` with `lanes` data lanes.
pub fn sender(caps: u64, lanes: u16, now: Timestamp) -> SenderSession {
    let mut tx = SenderSession::new(timers(), dur(LANE_STALL_MS)).expect("sender");
    tx.connected(caps, lanes, now).expect("connected");
    tx
}

/// Land every planned block on the receiver through `lane` (no bytes: the pages
/// are the model's), returning the receiver's transfer events.
pub fn land_all(
    rx: &mut ReceiverEndpoint,
    lane: &LaneHandle,
    blocks: &[KvBlock],
) -> Vec<ReceiverEvent> {
    for b in blocks {
        match rx.begin_block(lane, b, false).expect("block refused") {
            BlockDisposition::Land(_) => rx.finish_block(b, Ok(())),
            other => panic!("block not landed: {other:?}"),
        }
    }
    let mut e = Vec::new();
    while let Some(x) = rx.poll_event() {
        e.push(x);
    }
    e
}

/// The ABORTs among `frames`, as (request, reason name).
pub fn aborts(frames: &[(SessionHandle, Frame)]) -> Vec<(u64, &'static str)> {
    frames
        .iter()
        .filter_map(|(_, f)| match f {
            Frame::Abort(a) => Some((a.request_id, a.reason.name())),
            _ => None,
        })
        .collect()
}

/// The terminal transfer events among `events`, as (transfer, reason or "complete").
pub fn ends(events: &[ReceiverEvent]) -> Vec<(u64, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            ReceiverEvent::Transfer(TransferEvent::Complete { transfer_id, .. }) => {
                Some((*transfer_id, "complete".to_string()))
            }
            ReceiverEvent::Transfer(TransferEvent::Failed {
                transfer_id, error, ..
            }) => Some((*transfer_id, error.reason().to_string())),
            _ => None,
        })
        .collect()
}

/// A sequential id source for grants.
pub fn ids() -> impl FnMut() -> u64 {
    let mut n = 0x1000u64;
    move || {
        n += 1;
        n
    }
}
