//! KV transfer bookkeeping, sans-IO: which pool pages a grant covers, which blocks
//! may be written where, when a layer and a transfer are complete.
//!
//! The receiver owns a pool of `layers x pages` pages of `page_bytes` each. For each
//! transfer it grants the sender `page_count` pages (pool pages it chose, in order)
//! on `layer_count` layers; the sender only ever names pages `0..page_count` of the
//! grant. [`ReceiverState`] turns a block header from the wire into the pool pages to
//! write, refusing anything outside the grant, anything already written, and any
//! overlap with another live grant. It never sees the bytes: the I/O crate lands
//! them, checks the CRC, then reports back with [`ReceiverState::finish_block`].

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::wire::{KvDone, KvGrant, KvPages, LocalDone, KV_PAGES_FIXED_LEN};

pub mod layout;
pub mod request_key;
mod sender;
pub mod session;
mod units;

pub use request_key::request_id_of;
pub use sender::{PlannedBlock, SenderTransfer};
pub use units::GrantUnits;

/// The fixed part of a KV_PAGES frame: where its data goes, relative to the grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvBlock {
    /// Transfer (grant) the block belongs to.
    pub transfer_id: u64,
    /// First layer, relative to the grant.
    pub layer_start: u16,
    /// Layers in the block (>= 1).
    pub layer_count: u16,
    /// First page, relative to the grant.
    pub page_start: u32,
    /// Pages per layer in the block (>= 1).
    pub page_count: u32,
    /// Bytes per page.
    pub page_bytes: u32,
}

impl KvBlock {
    /// Parse the 24 fixed bytes of a KV_PAGES payload whose header announced
    /// `payload_len`; checks counts, range overflow and that the data length is
    /// exactly `layer_count * page_count * page_bytes`.
    pub fn parse(fixed: &[u8; KV_PAGES_FIXED_LEN], payload_len: u32) -> Result<KvBlock> {
        let block = KvBlock::fields(fixed);
        let data_len = u64::from(payload_len)
            .checked_sub(KV_PAGES_FIXED_LEN as u64)
            .ok_or(Error::Truncated {
                kind: crate::wire::FrameKind::KvPages,
                field: "page_bytes",
            })?;
        block
            .check(data_len)
            .map_err(|detail| Error::InvalidField {
                kind: crate::wire::FrameKind::KvPages,
                field: "data",
                detail,
            })?;
        Ok(block)
    }

    /// A KV_PAGES_Z's block, from its first 24 payload bytes and its payload length
    /// (checked against what the block's pages can take: nothing beyond them is read).
    pub fn parse_z(fixed: &[u8; KV_PAGES_FIXED_LEN], payload_len: u32) -> Result<KvBlock> {
        let block = KvBlock::fields(fixed);
        let invalid = |field, detail| Error::InvalidField {
            kind: crate::wire::FrameKind::KvPagesZ,
            field,
            detail,
        };
        let (min, max) = crate::wire::z_payload_bounds(&block).map_err(|(f, d)| invalid(f, d))?;
        if !(min..=max).contains(&u64::from(payload_len)) {
            return Err(invalid(
                "data",
                format!("payload of {payload_len} bytes outside {min}..={max} for its block"),
            ));
        }
        Ok(block)
    }

    /// The block's fields as they are (unchecked).
    pub(crate) fn fields(fixed: &[u8; KV_PAGES_FIXED_LEN]) -> KvBlock {
        let u16_at = |o: usize| u16::from_le_bytes([fixed[o], fixed[o + 1]]);
        let u32_at =
            |o: usize| u32::from_le_bytes([fixed[o], fixed[o + 1], fixed[o + 2], fixed[o + 3]]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&fixed[0..8]);
        KvBlock {
            transfer_id: u64::from_le_bytes(id),
            layer_start: u16_at(8),
            layer_count: u16_at(10),
            page_start: u32_at(12),
            page_count: u32_at(16),
            page_bytes: u32_at(20),
        }
    }

    /// The 24 fixed bytes, as on the wire.
    pub fn to_fixed(&self) -> [u8; KV_PAGES_FIXED_LEN] {
        let mut b = [0u8; KV_PAGES_FIXED_LEN];
        b[0..8].copy_from_slice(&self.transfer_id.to_le_bytes());
        b[8..10].copy_from_slice(&self.layer_start.to_le_bytes());
        b[10..12].copy_from_slice(&self.layer_count.to_le_bytes());
        b[12..16].copy_from_slice(&self.page_start.to_le_bytes());
        b[16..20].copy_from_slice(&self.page_count.to_le_bytes());
        b[20..24].copy_from_slice(&self.page_bytes.to_le_bytes());
        b
    }

    /// Bytes of page data the block carries (checked at construction).
    pub fn data_len(&self) -> u64 {
        u64::from(self.layer_count) * u64::from(self.page_count) * u64::from(self.page_bytes)
    }

    /// The block header of a decoded KV_PAGES frame.
    pub fn of(frame: &KvPages) -> KvBlock {
        KvBlock {
            transfer_id: frame.transfer_id,
            layer_start: frame.layer_start,
            layer_count: frame.layer_count,
            page_start: frame.page_start,
            page_count: frame.page_count,
            page_bytes: frame.page_bytes,
        }
    }

    pub(crate) fn check(&self, data_len: u64) -> std::result::Result<(), String> {
        if self.layer_count == 0 || self.page_count == 0 || self.page_bytes == 0 {
            return Err("layer_count, page_count and page_bytes must be >= 1".into());
        }
        if self.layer_start.checked_add(self.layer_count - 1).is_none() {
            return Err("layer range overflows u16".into());
        }
        if self.page_start.checked_add(self.page_count - 1).is_none() {
            return Err("page range overflows u32".into());
        }
        let want = u64::from(self.layer_count)
            .checked_mul(u64::from(self.page_count))
            .and_then(|n| n.checked_mul(u64::from(self.page_bytes)));
        match want {
            Some(w) if w == data_len => Ok(()),
            Some(w) => Err(format!("{data_len} data bytes, header fields say {w}")),
            None => Err("layer_count * page_count * page_bytes overflows".into()),
        }
    }
}

/// What happened to a transfer, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferEvent {
    /// Every page of one layer has landed and passed its checksum.
    LayerComplete {
        /// The transfer.
        transfer_id: u64,
        /// Its request.
        request_id: u64,
        /// The layer (pool layer index: the grant's `first_layer` plus the grant
        /// layer).
        layer: u16,
    },
    /// Every page of every layer has landed and the sender's KV_DONE agrees.
    Complete {
        /// The transfer.
        transfer_id: u64,
        /// Its request.
        request_id: u64,
        /// Page bytes received.
        bytes: u64,
        /// KV_PAGES blocks received.
        blocks: u32,
    },
    /// The transfer failed; its pages hold undefined data and are released once no
    /// block is still landing in them.
    Failed {
        /// The transfer.
        transfer_id: u64,
        /// Its request.
        request_id: u64,
        /// Why.
        error: Error,
    },
}

const PAGE_PENDING: u8 = 0;
const PAGE_IN_FLIGHT: u8 = 1;
const PAGE_LANDED: u8 = 2;

/// One live inbound transfer.
#[derive(Debug)]
struct Inbound {
    grant: KvGrant,
    /// The session the transfer was granted to: blocks and KV_DONE from any other
    /// session are refused as if the transfer did not exist.
    owner: u64,
    /// Pool unit of each grant page (a unit is the grant's `page_bytes`; for a grant
    /// of whole pages, the pool page).
    dest_units: Vec<u32>,
    /// Pool pages the grant's units touch, each once: what it holds.
    held_pages: Vec<u32>,
    /// Pool layer of grant layer 0.
    first_layer: u16,
    /// Per (layer, grant page), layer-major: pending, in flight, landed.
    page_state: Vec<u8>,
    landed_per_layer: Vec<u32>,
    landed_total: u64,
    blocks: u32,
    bytes: u64,
    sender_done: Option<KvDone>,
    /// Blocks begun but not finished: their pages are being written right now.
    in_flight: u32,
}

/// Where one block's pages go: pool layer and pool unit for each page of the block,
/// layer-major, in the order the block's data carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTarget {
    /// `(pool_layer, pool_unit)` per page of the block: the page lands at byte offset
    /// `pool_unit * page_bytes` of the pool layer's buffer (for a grant of whole
    /// pages, the unit is the pool page).
    pub pages: Vec<(u16, u32)>,
    /// Bytes per page: the grant's unit.
    pub page_bytes: u32,
}

/// The receiver's side: the pool's geometry, its live grants, which pool pages they
/// hold.
#[derive(Debug)]
pub struct ReceiverState {
    pool_layers: u16,
    pool_pages: u32,
    page_bytes: u32,
    /// Transfer holding each whole pool page (0 = free of whole-page grants).
    page_owner: Vec<u64>,
    /// Pages that sub-page grants hold in part, with their byte ranges.
    shared: units::SharedPages,
    /// Pool pages with an owner (kept so that reading it is O(1)).
    held: usize,
    live: HashMap<u64, Inbound>,
    /// Ended transfers that still have blocks landing: their pages stay held (so no
    /// new grant can hand them out while a lane still writes them) until the last
    /// in-flight block finishes. Value: (pool pages, blocks in flight, owner).
    draining: HashMap<u64, (Vec<u32>, u32, u64)>,
    /// Transfers that ended recently, with their owners: late blocks for them from
    /// their owner are drained, not fatal.
    recently_ended: VecDeque<(u64, u64)>,
    /// The same ids, for lookups in O(1): id -> owner.
    ended_owner: HashMap<u64, u64>,
    next_transfer_id: u64,
}

/// How many ended transfer ids are remembered so their late blocks can be drained.
const RECENTLY_ENDED: usize = 4096;

/// What to do with a block that arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockDisposition {
    /// Land the data at these pages, then call [`ReceiverState::finish_block`].
    Land(BlockTarget),
    /// The transfer already ended (failed or cancelled): read and discard the data.
    Drain,
    /// A RESENT block whose pages had all landed already (it landed before its
    /// first lane was revoked): read and discard the data, count it as a duplicate.
    /// Changes nothing.
    Duplicate,
}

impl ReceiverState {
    /// A pool of `pool_layers x pool_pages` pages of `page_bytes` bytes.
    pub fn new(pool_layers: u16, pool_pages: u32, page_bytes: u32) -> Result<ReceiverState> {
        if pool_layers == 0 || pool_pages == 0 || page_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a pool needs >= 1 layer, page and byte per page".into(),
            ));
        }
        Ok(ReceiverState {
            pool_layers,
            pool_pages,
            page_bytes,
            page_owner: vec![0; pool_pages as usize],
            shared: units::SharedPages::default(),
            held: 0,
            live: HashMap::new(),
            draining: HashMap::new(),
            recently_ended: VecDeque::new(),
            ended_owner: HashMap::new(),
            next_transfer_id: 1,
        })
    }

    /// Pool geometry: `(layers, pages, page_bytes)`.
    pub fn geometry(&self) -> (u16, u32, u32) {
        (self.pool_layers, self.pool_pages, self.page_bytes)
    }

    /// Transfers in progress.
    pub fn live_transfers(&self) -> usize {
        self.live.len()
    }

    /// [`ReceiverState::grant_to`] owner 0 with the next sequential transfer id: for
    /// simulations and tests with one peer. A receiver facing a network grants with
    /// `grant_to`, naming the session and an unguessable id.
    pub fn grant(
        &mut self,
        request_id: u64,
        dest_pages: &[u32],
        layer_count: u16,
        deadline_ms: u32,
    ) -> Result<KvGrant> {
        let id = self.next_transfer_id;
        let grant = self.grant_to(0, id, request_id, dest_pages, layer_count, deadline_ms)?;
        self.next_transfer_id += 1;
        Ok(grant)
    }

    /// Whether `transfer_id` is live, draining or recently ended (and so may not name
    /// a new grant).
    pub fn id_in_use(&self, transfer_id: u64) -> bool {
        transfer_id == 0
            || self.live.contains_key(&transfer_id)
            || self.draining.contains_key(&transfer_id)
            || self.ended_owner.contains_key(&transfer_id)
    }

    /// Grant pool pages `dest_pages` (in grant order) on layers `0..layer_count` for a
    /// new transfer `transfer_id` of `request_id`, to session `owner`: only blocks
    /// and KV_DONE that arrive from that session count for it. Fails, changing
    /// nothing, if a page is out of the pool, repeated, or held by another live
    /// grant, or if `transfer_id` is 0 or in use ([`ReceiverState::id_in_use`]).
    /// [`ReceiverState::grant_units_to`] with the default [`GrantUnits`].
    ///
    /// An empty `dest_pages` is an empty grant (the receiver needs nothing): it holds
    /// no page, takes no block, and completes on a KV_DONE of 0 blocks and 0 bytes.
    /// Whether the peer may be sent one (capability `EMPTY_GRANT`) is the caller's
    /// check.
    pub fn grant_to(
        &mut self,
        owner: u64,
        transfer_id: u64,
        request_id: u64,
        dest_pages: &[u32],
        layer_count: u16,
        deadline_ms: u32,
    ) -> Result<KvGrant> {
        self.grant_units_to(
            owner,
            transfer_id,
            request_id,
            dest_pages,
            layer_count,
            deadline_ms,
            GrantUnits::default(),
        )
    }

    /// [`ReceiverState::grant_to`] in units of `units.unit_bytes` (a divisor of the
    /// pool's `page_bytes`) from pool layer `units.first_layer`: `dest_units` are pool
    /// units in grant order (unit `u` is byte offset `u * unit_bytes` of a layer's
    /// buffer), grant layer `i` is pool layer `first_layer + i`, and the KV_GRANT says
    /// `page_bytes` = the unit. The grant holds every pool page its units touch (on
    /// every layer): it fails, changing nothing, if a unit is out of the pool or
    /// repeated, or a page it touches is held by another live grant.
    #[allow(clippy::too_many_arguments)]
    pub fn grant_units_to(
        &mut self,
        owner: u64,
        transfer_id: u64,
        request_id: u64,
        dest_units: &[u32],
        layer_count: u16,
        deadline_ms: u32,
        units: GrantUnits,
    ) -> Result<KvGrant> {
        if self.id_in_use(transfer_id) {
            return Err(Error::InvalidArgument(format!(
                "transfer id {transfer_id} is 0 or in use"
            )));
        }
        let page_count = u32::try_from(dest_units.len())
            .map_err(|_| Error::InvalidArgument("too many pages in one grant".into()))?;
        let placed = units.place(
            self.pool_layers,
            self.pool_pages,
            self.page_bytes,
            dest_units,
            layer_count,
        )?;
        let busy = |p: u32, owner: u64| Error::PagesBusy {
            detail: format!("pool page {p} is held by live transfer {owner}"),
        };
        for &p in &placed.pool_pages {
            let owner = self.page_owner[p as usize];
            if owner != 0 {
                return Err(busy(p, owner));
            }
        }
        if placed.unit_bytes == self.page_bytes {
            if let Some(&p) = placed.pool_pages.iter().find(|&&p| self.shared.holds(p)) {
                return Err(busy(
                    p,
                    self.shared.overlap(p, 0, self.page_bytes).unwrap_or(0),
                ));
            }
            for &p in &placed.pool_pages {
                self.page_owner[p as usize] = transfer_id;
                self.held += 1;
            }
        } else {
            // Units of one pool page may belong to several live grants (the ranks of a
            // tensor-parallel prefill each fill their heads), never the same bytes.
            let wanted =
                units::SharedPages::ranges_of(dest_units, placed.unit_bytes, self.page_bytes);
            for &(p, start, end) in &wanted {
                if let Some(owner) = self.shared.overlap(p, start, end) {
                    return Err(busy(p, owner));
                }
            }
            self.held += self.shared.take(transfer_id, &wanted);
        }
        let grant = KvGrant {
            transfer_id,
            request_id,
            layer_count,
            page_count,
            page_bytes: placed.unit_bytes,
            deadline_ms,
        };
        let total = usize::from(layer_count) * dest_units.len();
        self.live.insert(
            transfer_id,
            Inbound {
                grant: grant.clone(),
                owner,
                dest_units: dest_units.to_vec(),
                held_pages: placed.pool_pages,
                first_layer: units.first_layer,
                page_state: vec![PAGE_PENDING; total],
                landed_per_layer: vec![0; usize::from(layer_count)],
                landed_total: 0,
                blocks: 0,
                bytes: 0,
                sender_done: None,
                in_flight: 0,
            },
        );
        Ok(grant)
    }

    /// A block header arrived: where may its data go? Marks its pages in flight, so
    /// no other lane may write them until [`ReceiverState::finish_block`].
    ///
    /// `owner` is the session the block arrived on. A block for a transfer granted
    /// to another session is an `UnknownTransfer` of this one, exactly as if no such
    /// transfer existed, and changes nothing.
    ///
    /// `resent`: the block carries the KV_PAGES flag RESENT (lane failover). A
    /// RESENT block whose pages have all landed is a [`BlockDisposition::Duplicate`];
    /// one whose pages are all pending lands as any other.
    ///
    /// Errors (the connection must be aborted with `grant_violation`): unknown
    /// transfer, block outside the grant, wrong page size, pages already landed (but
    /// for a whole RESENT block) or in flight, a RESENT block landed only in part.
    pub fn begin_block(
        &mut self,
        owner: u64,
        block: &KvBlock,
        resent: bool,
    ) -> Result<BlockDisposition> {
        let unknown = Error::UnknownTransfer {
            transfer_id: block.transfer_id,
        };
        let Some(t) = self
            .live
            .get_mut(&block.transfer_id)
            .filter(|t| t.owner == owner)
        else {
            if self
                .draining
                .get(&block.transfer_id)
                .is_some_and(|d| d.2 == owner)
                || self.ended_owner.get(&block.transfer_id) == Some(&owner)
            {
                return Ok(BlockDisposition::Drain);
            }
            return Err(unknown);
        };
        let violation = |detail: String| Error::GrantViolation {
            transfer_id: block.transfer_id,
            detail,
        };
        if block.page_bytes != t.grant.page_bytes {
            return Err(violation(format!(
                "page_bytes {} but the grant's are {}",
                block.page_bytes, t.grant.page_bytes
            )));
        }
        let layer_end = u32::from(block.layer_start) + u32::from(block.layer_count);
        let page_end = u64::from(block.page_start) + u64::from(block.page_count);
        if layer_end > u32::from(t.grant.layer_count) || page_end > u64::from(t.grant.page_count) {
            return Err(violation(format!(
                "layers {}..{layer_end} pages {}..{page_end} outside the grant of {} layers x {} pages",
                block.layer_start, block.page_start, t.grant.layer_count, t.grant.page_count
            )));
        }
        let per_layer = t.grant.page_count as usize;
        let states = || {
            (block.layer_start..block.layer_start + block.layer_count).flat_map(move |layer| {
                let base = usize::from(layer) * per_layer;
                (block.page_start..block.page_start + block.page_count)
                    .map(move |page| (layer, page, base + page as usize))
            })
        };
        if resent && states().all(|(_, _, i)| t.page_state[i] == PAGE_LANDED) {
            return Ok(BlockDisposition::Duplicate);
        }
        if let Some((layer, page, _)) = states().find(|&(_, _, i)| t.page_state[i] != PAGE_PENDING)
        {
            return Err(violation(format!(
                "layer {layer} page {page} written twice"
            )));
        }
        let mut pages =
            Vec::with_capacity(usize::from(block.layer_count) * block.page_count as usize);
        for layer in block.layer_start..block.layer_start + block.layer_count {
            let base = usize::from(layer) * per_layer;
            for page in block.page_start..block.page_start + block.page_count {
                t.page_state[base + page as usize] = PAGE_IN_FLIGHT;
                pages.push((t.first_layer + layer, t.dest_units[page as usize]));
            }
        }
        t.in_flight += 1;
        Ok(BlockDisposition::Land(BlockTarget {
            pages,
            page_bytes: block.page_bytes,
        }))
    }

    /// The data of a block begun with [`ReceiverState::begin_block`] has landed
    /// (`Ok`) or failed (`Err`: checksum mismatch, connection lost mid-block). A
    /// failed block fails its transfer: its pages hold unverified bytes.
    ///
    /// Every `begin_block` that returned `Land` must be followed by exactly one
    /// `finish_block` for that block, also when the transfer failed meanwhile: until
    /// then the transfer's pages stay held.
    pub fn finish_block(&mut self, block: &KvBlock, outcome: Result<()>) -> Vec<TransferEvent> {
        let Some(t) = self.live.get_mut(&block.transfer_id) else {
            if let Some((_, in_flight, _)) = self.draining.get_mut(&block.transfer_id) {
                *in_flight -= 1;
                if *in_flight == 0 {
                    if let Some((pages, _, _)) = self.draining.remove(&block.transfer_id) {
                        self.release_pages(block.transfer_id, &pages);
                    }
                }
            }
            return Vec::new();
        };
        t.in_flight -= 1;
        if let Err(error) = outcome {
            return self.end(block.transfer_id, Some(error));
        }
        let per_layer = t.grant.page_count as usize;
        let mut events = Vec::new();
        for layer in block.layer_start..block.layer_start + block.layer_count {
            let base = usize::from(layer) * per_layer;
            for page in block.page_start..block.page_start + block.page_count {
                t.page_state[base + page as usize] = PAGE_LANDED;
            }
            let landed = &mut t.landed_per_layer[usize::from(layer)];
            *landed += block.page_count;
            if *landed == t.grant.page_count {
                events.push(TransferEvent::LayerComplete {
                    transfer_id: t.grant.transfer_id,
                    request_id: t.grant.request_id,
                    layer: t.first_layer + layer,
                });
            }
        }
        t.landed_total += u64::from(block.layer_count) * u64::from(block.page_count);
        t.blocks += 1;
        t.bytes += block.data_len();
        events.extend(self.try_complete(block.transfer_id));
        events
    }

    /// A block begun with `Land` will never finish: the lane carrying it was revoked
    /// (lane failover) and its reader has ended, so no byte of it can land any more.
    /// Its pages go back to pending, for the sender to send again (flagged RESENT);
    /// the transfer goes on, and no event is reported. For a transfer that ended
    /// meanwhile, the same release as [`ReceiverState::finish_block`].
    pub fn abandon_block(&mut self, block: &KvBlock) {
        let Some(t) = self.live.get_mut(&block.transfer_id) else {
            // Ended meanwhile: nothing to report, only the pages' release.
            let _ = self.finish_block(block, Ok(()));
            return;
        };
        t.in_flight -= 1;
        let per_layer = t.grant.page_count as usize;
        for layer in block.layer_start..block.layer_start + block.layer_count {
            let base = usize::from(layer) * per_layer;
            for page in block.page_start..block.page_start + block.page_count {
                t.page_state[base + page as usize] = PAGE_PENDING;
            }
        }
    }

    /// The sender's KV_DONE arrived on session `owner` (it may overtake data still
    /// on other lanes). From any session but the grant's, it is an
    /// `UnknownTransfer` and changes nothing.
    pub fn sender_done(&mut self, owner: u64, done: &KvDone) -> Result<Vec<TransferEvent>> {
        let Some(t) = self
            .live
            .get_mut(&done.transfer_id)
            .filter(|t| t.owner == owner)
        else {
            if self.ended_owner.get(&done.transfer_id) == Some(&owner) {
                return Ok(Vec::new());
            }
            return Err(Error::UnknownTransfer {
                transfer_id: done.transfer_id,
            });
        };
        if t.sender_done.is_some() {
            return Err(Error::GrantViolation {
                transfer_id: done.transfer_id,
                detail: "KV_DONE sent twice".into(),
            });
        }
        t.sender_done = Some(done.clone());
        Ok(self.try_complete(done.transfer_id))
    }

    /// A one-sided path's completion notice (the local path's LOCAL_DONE) arrived on
    /// session `owner`: the sender wrote every page of grant layers
    /// `layer_start..layer_start + layer_count` into the pool itself (the bytes are
    /// there already, no block carried them) and says how many pages and bytes that
    /// was. Each notice counts as one block; the notice that brings the last layer in
    /// is also the sender's KV_DONE (`chunk_count` = notices, `byte_count` = bytes).
    ///
    /// An empty grant has no page to write: its one notice names every grant layer
    /// with 0 pages and 0 bytes and completes it, as a KV_DONE of 0 blocks would.
    ///
    /// Errors (the session must end with `grant_violation`): a transfer this session
    /// was not granted (a late notice of its own ended transfer is ignored), layers
    /// outside the grant, a layer announced twice, an empty grant's notice not naming
    /// exactly its layers. Counts other than the layers' pages and bytes fail the
    /// transfer (`transfer_incomplete`, an event) and are not an error.
    pub fn layers_written(&mut self, owner: u64, notice: &LocalDone) -> Result<Vec<TransferEvent>> {
        let tid = notice.transfer_id;
        let Some(t) = self.live.get_mut(&tid).filter(|t| t.owner == owner) else {
            if self.ended_owner.get(&tid) == Some(&owner) {
                return Ok(Vec::new());
            }
            return Err(Error::UnknownTransfer { transfer_id: tid });
        };
        let violation = |detail: String| Error::GrantViolation {
            transfer_id: tid,
            detail,
        };
        let g = &t.grant;
        let layer_end = u32::from(notice.layer_start) + u32::from(notice.layer_count);
        if notice.layer_count == 0 || layer_end > u32::from(g.layer_count) {
            return Err(violation(format!(
                "layers {}..{layer_end} outside the grant's {}",
                notice.layer_start, g.layer_count
            )));
        }
        if g.page_count == 0 && (notice.layer_start, notice.layer_count) != (0, g.layer_count) {
            return Err(violation(format!(
                "an empty grant's notice names layers {}..{layer_end}, not all {}",
                notice.layer_start, g.layer_count
            )));
        }
        let pages = u64::from(notice.layer_count) * u64::from(g.page_count);
        let bytes = pages * u64::from(g.page_bytes);
        if notice.page_count != pages || notice.byte_count != bytes {
            let detail = format!(
                "notice for {} layers says {} pages / {} bytes; the grant's are {pages} / {bytes}",
                notice.layer_count, notice.page_count, notice.byte_count
            );
            return Ok(self.end(
                tid,
                Some(Error::TransferIncomplete {
                    transfer_id: tid,
                    detail,
                }),
            ));
        }
        let per_layer = g.page_count as usize;
        let layers = notice.layer_start..notice.layer_start + notice.layer_count;
        if let Some(layer) = layers.clone().find(|&l| {
            let base = usize::from(l) * per_layer;
            t.page_state[base..base + per_layer]
                .iter()
                .any(|&s| s != PAGE_PENDING)
        }) {
            return Err(violation(format!("layer {layer} announced twice")));
        }
        let mut events = Vec::new();
        if per_layer > 0 {
            for layer in layers {
                let base = usize::from(layer) * per_layer;
                t.page_state[base..base + per_layer].fill(PAGE_LANDED);
                t.landed_per_layer[usize::from(layer)] = g.page_count;
                events.push(TransferEvent::LayerComplete {
                    transfer_id: tid,
                    request_id: g.request_id,
                    layer: t.first_layer + layer,
                });
            }
            t.landed_total += pages;
            t.blocks += 1;
            t.bytes += bytes;
        }
        if t.landed_total == t.page_state.len() as u64 {
            let done = KvDone {
                transfer_id: tid,
                chunk_count: t.blocks,
                byte_count: t.bytes,
            };
            events.extend(self.sender_done(owner, &done)?);
        }
        Ok(events)
    }

    /// End a live transfer from outside (deadline, cancel, connection lost).
    pub fn fail(&mut self, transfer_id: u64, error: Error) -> Vec<TransferEvent> {
        self.end(transfer_id, Some(error))
    }

    /// Fail every live transfer (the peer is gone).
    pub fn fail_all(&mut self, error: &Error) -> Vec<TransferEvent> {
        let ids: Vec<u64> = self.live.keys().copied().collect();
        ids.into_iter()
            .flat_map(|id| self.end(id, Some(error.clone())))
            .collect()
    }

    /// Ids of live transfers.
    pub fn live_ids(&self) -> Vec<u64> {
        self.live.keys().copied().collect()
    }

    /// Progress of a live transfer: pages landed plus blocks being written now. A
    /// value that stops changing means nothing of the transfer is moving.
    pub fn progress_of(&self, transfer_id: u64) -> Option<u64> {
        self.live
            .get(&transfer_id)
            .map(|t| t.landed_total + u64::from(t.in_flight) + (u64::from(t.blocks) << 32))
    }

    /// The request of a live transfer.
    pub fn request_of(&self, transfer_id: u64) -> Option<u64> {
        self.live.get(&transfer_id).map(|t| t.grant.request_id)
    }

    /// The grant of a live transfer.
    pub fn grant_of(&self, transfer_id: u64) -> Option<&KvGrant> {
        self.live.get(&transfer_id).map(|t| &t.grant)
    }

    /// Session `from`'s transfers (live, draining, recently ended) belong to session
    /// `to` from now on (a resumed session: transfer resume). Blocks of them from
    /// `from` are refused as another session's from here.
    pub fn reassign_owner(&mut self, from: u64, to: u64) {
        for t in self.live.values_mut().filter(|t| t.owner == from) {
            t.owner = to;
        }
        for d in self.draining.values_mut().filter(|d| d.2 == from) {
            d.2 = to;
        }
        for (id, owner) in self.recently_ended.iter_mut().filter(|(_, o)| *o == from) {
            *owner = to;
            self.ended_owner.insert(*id, to);
        }
    }

    /// What a live transfer holds, for a KV_HELD: whether the sender's KV_DONE came,
    /// and one bit per (grant layer, grant page), layer-major, least significant bit
    /// first, set where the page landed and was verified (a page in flight is not).
    pub fn landed_bitmap(&self, transfer_id: u64) -> Option<(bool, Vec<u8>)> {
        let t = self.live.get(&transfer_id)?;
        let mut bits = vec![0u8; t.page_state.len().div_ceil(8)];
        for (i, &state) in t.page_state.iter().enumerate() {
            if state == PAGE_LANDED {
                bits[i / 8] |= 1 << (i % 8);
            }
        }
        Some((t.sender_done.is_some(), bits))
    }

    fn release_pages(&mut self, transfer_id: u64, pages: &[u32]) {
        for &p in pages {
            if self.page_owner[p as usize] == transfer_id {
                self.page_owner[p as usize] = 0;
                self.held -= 1;
            } else if self.shared.release(transfer_id, p) {
                self.held -= 1;
            }
        }
    }

    /// Pool pages held by live or draining transfers.
    pub fn pages_held(&self) -> usize {
        debug_assert_eq!(
            self.held,
            self.page_owner.iter().filter(|&&o| o != 0).count() + self.shared.len()
        );
        self.held
    }

    fn try_complete(&mut self, transfer_id: u64) -> Vec<TransferEvent> {
        let Some(t) = self.live.get(&transfer_id) else {
            return Vec::new();
        };
        let total = t.page_state.len() as u64;
        let Some(done) = &t.sender_done else {
            return Vec::new();
        };
        if t.landed_total < total {
            if done.byte_count <= t.bytes && done.chunk_count <= t.blocks {
                // The sender says it is done, but pages are missing and nothing more is
                // coming.
                let detail = format!("sender finished after {} of {total} pages", t.landed_total);
                return self.end(
                    transfer_id,
                    Some(Error::TransferIncomplete {
                        transfer_id,
                        detail,
                    }),
                );
            }
            return Vec::new();
        }
        if done.byte_count != t.bytes || done.chunk_count != t.blocks {
            let detail = format!(
                "sender reports {} blocks / {} bytes, received {} / {}",
                done.chunk_count, done.byte_count, t.blocks, t.bytes
            );
            return self.end(
                transfer_id,
                Some(Error::TransferIncomplete {
                    transfer_id,
                    detail,
                }),
            );
        }
        self.end(transfer_id, None)
    }

    fn end(&mut self, transfer_id: u64, error: Option<Error>) -> Vec<TransferEvent> {
        let Some(t) = self.live.remove(&transfer_id) else {
            return Vec::new();
        };
        if t.in_flight > 0 {
            self.draining
                .insert(transfer_id, (t.held_pages.clone(), t.in_flight, t.owner));
        } else {
            self.release_pages(transfer_id, &t.held_pages);
        }
        if self.recently_ended.len() == RECENTLY_ENDED {
            if let Some((old, _)) = self.recently_ended.pop_front() {
                self.ended_owner.remove(&old);
            }
        }
        self.recently_ended.push_back((transfer_id, t.owner));
        self.ended_owner.insert(transfer_id, t.owner);
        let request_id = t.grant.request_id;
        vec![match error {
            None => TransferEvent::Complete {
                transfer_id,
                request_id,
                bytes: t.bytes,
                blocks: t.blocks,
            },
            Some(error) => TransferEvent::Failed {
                transfer_id,
                request_id,
                error,
            },
        }]
    }
}

#[cfg(test)]
mod tests;
