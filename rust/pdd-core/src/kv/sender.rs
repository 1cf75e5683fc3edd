//! The sender's side of one transfer: which `(layer, grant page)` went out, the
//! blocks that carry them, and the KV_DONE that closes it.
//!
//! An engine sends what it has computed when it has computed it: a whole layer
//! (`send_layer`), or any subset of a grant's pages on some layers (`send_pages`,
//! e.g. the pages one chunk of a chunked prefill filled), in any order, each
//! `(layer, page)` exactly once. A call that would repeat a page, or names one
//! outside the grant, fails and changes nothing, so the caller can correct it.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::kv::KvBlock;
use crate::wire::{KvDone, KvGrant};

/// One block to write, and which of the caller's pages it carries: the block's
/// `page_count` pages are `grant_pages[first..first + page_count]` of the call that
/// planned it (consecutive grant pages, so one KV_PAGES header names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedBlock {
    /// The block's header.
    pub block: KvBlock,
    /// Index into the call's `grant_pages` of the block's first page.
    pub first: usize,
}

/// The sender's side of one transfer.
#[derive(Debug, Clone)]
pub struct SenderTransfer {
    grant: KvGrant,
    /// Per (layer, grant page), layer-major: already planned into a block.
    sent: Vec<bool>,
    /// `(layer, page)` pairs not sent yet.
    unsent: u64,
    blocks: u32,
    bytes: u64,
    finished: bool,
}

impl SenderTransfer {
    /// Start sending into `grant`.
    pub fn new(grant: KvGrant) -> SenderTransfer {
        let cells = usize::from(grant.layer_count) * grant.page_count as usize;
        SenderTransfer {
            unsent: cells as u64,
            sent: vec![false; cells],
            grant,
            blocks: 0,
            bytes: 0,
            finished: false,
        }
    }

    /// The grant.
    pub fn grant(&self) -> &KvGrant {
        &self.grant
    }

    /// Blocks covering every page of `layer`, each at most `max_block_bytes` (but at
    /// least one page). A layer, or any page of it, cannot be sent twice. A layer of
    /// an empty grant (0 pages) is no blocks.
    pub fn send_layer(&mut self, layer: u16, max_block_bytes: u64) -> Result<Vec<KvBlock>> {
        let all: Vec<u32> = (0..self.grant.page_count).collect();
        let end = layer.checked_add(1).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "layer {layer} outside the grant's {} layers",
                self.grant.layer_count
            ))
        })?;
        Ok(self
            .send_pages(layer..end, &all, max_block_bytes)?
            .into_iter()
            .map(|p| p.block)
            .collect())
    }

    /// Blocks carrying grant pages `grant_pages` (in the caller's order) on every
    /// layer of `layers`, each at most `max_block_bytes` (but at least one page).
    /// Consecutive runs of grant pages share a block; each block carries one layer.
    /// Fails, changing nothing, if the transfer is finished, a layer or page is
    /// outside the grant, a page repeats within the call, or any `(layer, page)` was
    /// already sent.
    pub fn send_pages(
        &mut self,
        layers: Range<u16>,
        grant_pages: &[u32],
        max_block_bytes: u64,
    ) -> Result<Vec<PlannedBlock>> {
        let g = &self.grant;
        if self.finished {
            return Err(Error::InvalidArgument(format!(
                "transfer {} is already finished",
                g.transfer_id
            )));
        }
        if layers.is_empty() || layers.end > g.layer_count {
            return Err(Error::InvalidArgument(format!(
                "layers {}..{} outside the grant's {} layers",
                layers.start, layers.end, g.layer_count
            )));
        }
        // An empty grant (the receiver needs nothing) is sent as no pages; any other
        // grant needs at least one per call.
        if grant_pages.is_empty() && g.page_count > 0 {
            return Err(Error::InvalidArgument("no pages to send".into()));
        }
        let pages = g.page_count as usize;
        let mut seen = vec![false; pages];
        for &p in grant_pages {
            let Some(s) = seen.get_mut(p as usize) else {
                return Err(Error::InvalidArgument(format!(
                    "grant page {p} outside the grant's {} pages",
                    g.page_count
                )));
            };
            if *s {
                return Err(Error::InvalidArgument(format!(
                    "grant page {p} appears twice in one call"
                )));
            }
            *s = true;
        }
        for layer in layers.clone() {
            let row = usize::from(layer) * pages;
            if let Some(&p) = grant_pages.iter().find(|&&p| self.sent[row + p as usize]) {
                return Err(Error::InvalidArgument(format!(
                    "layer {layer} page {p} of transfer {} was already sent",
                    g.transfer_id
                )));
            }
        }
        let per_block = (max_block_bytes / u64::from(g.page_bytes)).clamp(1, u64::from(u32::MAX));
        let mut out = Vec::new();
        for layer in layers {
            let row = usize::from(layer) * pages;
            let mut i = 0;
            while i < grant_pages.len() {
                // The longest run of consecutive grant pages from i, up to one block.
                let mut n = 1;
                while i + n < grant_pages.len()
                    && (n as u64) < per_block
                    && grant_pages[i + n] == grant_pages[i + n - 1] + 1
                {
                    n += 1;
                }
                for &p in &grant_pages[i..i + n] {
                    self.sent[row + p as usize] = true;
                }
                out.push(PlannedBlock {
                    block: KvBlock {
                        transfer_id: g.transfer_id,
                        layer_start: layer,
                        layer_count: 1,
                        page_start: grant_pages[i],
                        page_count: n as u32,
                        page_bytes: g.page_bytes,
                    },
                    first: i,
                });
                i += n;
            }
        }
        let cells = out
            .iter()
            .map(|b| u64::from(b.block.page_count))
            .sum::<u64>();
        self.unsent -= cells;
        self.blocks += out.len() as u32;
        self.bytes += cells * u64::from(g.page_bytes);
        Ok(out)
    }

    /// `(layer, page)` pairs not sent yet.
    pub fn pages_unsent(&self) -> u64 {
        self.unsent
    }

    /// Whether any page was sent.
    pub fn started(&self) -> bool {
        self.blocks > 0
    }

    /// Whether every page of grant layer `layer` was sent (false outside the grant;
    /// true for every layer of an empty grant, which has no page to send). A path
    /// that announces whole layers (the local path's LOCAL_DONE) announces a layer
    /// once this holds and the writes planned for it are done.
    pub fn layer_sent(&self, layer: u16) -> bool {
        if layer >= self.grant.layer_count {
            return false;
        }
        let pages = self.grant.page_count as usize;
        let row = usize::from(layer) * pages;
        self.sent[row..row + pages].iter().all(|&s| s)
    }

    /// The KV_DONE that closes the transfer, once every page of every layer was sent.
    pub fn finish(&mut self) -> Result<KvDone> {
        if self.finished {
            return Err(Error::InvalidArgument(format!(
                "transfer {} is already finished",
                self.grant.transfer_id
            )));
        }
        if self.unsent > 0 {
            return Err(Error::InvalidArgument(format!(
                "{} of the grant's {} (layer, page) pairs not sent yet",
                self.unsent,
                self.sent.len()
            )));
        }
        self.finished = true;
        Ok(KvDone {
            transfer_id: self.grant.transfer_id,
            chunk_count: self.blocks,
            byte_count: self.bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockDisposition, ReceiverState, TransferEvent};

    fn grant(rx: &mut ReceiverState, pages: &[u32], layers: u16) -> KvGrant {
        rx.grant(5, pages, layers, 0).unwrap()
    }

    #[test]
    fn pages_in_any_order_and_subsets_complete_the_transfer() {
        let mut rx = ReceiverState::new(2, 32, 4).unwrap();
        let g = grant(&mut rx, &[10, 11, 12, 13, 20, 21], 2);
        let mut tx = SenderTransfer::new(g.clone());
        // Chunk 1 filled grant pages 4, 0, 1 (out of order); chunk 2 the rest.
        let mut planned = tx.send_pages(0..2, &[4, 0, 1], 1 << 20).unwrap();
        assert!(tx.started());
        assert_eq!(tx.pages_unsent(), 6);
        // Runs: [4], [0, 1] per layer.
        assert_eq!(planned.len(), 4);
        assert_eq!(planned[1].block.page_start, 0);
        assert_eq!(planned[1].block.page_count, 2);
        assert_eq!(planned[1].first, 1);
        assert!(tx.finish().is_err(), "finish before every page is sent");
        planned.extend(tx.send_pages(1..2, &[2, 3, 5], 1 << 20).unwrap());
        planned.extend(tx.send_pages(0..1, &[5, 3, 2], 1 << 20).unwrap());
        assert_eq!(tx.pages_unsent(), 0);
        let mut events = Vec::new();
        for p in &planned {
            let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &p.block, false) else {
                panic!("block refused: {p:?}");
            };
            events.extend(rx.finish_block(&p.block, Ok(())));
        }
        let done = tx.finish().unwrap();
        assert_eq!(done.chunk_count as usize, planned.len());
        assert_eq!(done.byte_count, 2 * 6 * 4);
        events.extend(rx.sender_done(0, &done).unwrap());
        assert!(matches!(
            events.last(),
            Some(TransferEvent::Complete { bytes: 48, .. })
        ));
        assert_eq!(rx.pages_held(), 0);
    }

    #[test]
    fn a_repeated_or_foreign_page_is_refused_and_changes_nothing() {
        let mut rx = ReceiverState::new(2, 16, 4).unwrap();
        let g = grant(&mut rx, &[1, 2, 3, 4], 2);
        let mut tx = SenderTransfer::new(g);
        tx.send_pages(0..1, &[2], 64).unwrap();
        let before = tx.pages_unsent();
        for (layers, pages) in [
            (0..1, vec![2u32]), // sent already
            (0..2, vec![1, 2]), // layer 0 page 2 sent already
            (0..1, vec![3, 3]), // twice in one call
            (0..1, vec![4]),    // outside the grant's 4 pages
            (1..3, vec![0]),    // layer 2 outside the grant
            (1..1, vec![0]),    // no layer
            (0..1, vec![]),     // no page
        ] {
            assert!(
                tx.send_pages(layers.clone(), &pages, 64).is_err(),
                "{layers:?} {pages:?}"
            );
            assert_eq!(tx.pages_unsent(), before, "a refused call changed state");
        }
        // The refused pages of layer 1 are still sendable.
        assert_eq!(tx.send_pages(0..2, &[1], 64).unwrap().len(), 2);
    }

    #[test]
    fn a_layer_is_sent_once_every_page_of_it_was() {
        let mut rx = ReceiverState::new(2, 16, 4).unwrap();
        let mut tx = SenderTransfer::new(grant(&mut rx, &[1, 2, 3], 2));
        tx.send_pages(0..2, &[2, 0], 64).unwrap();
        assert!(!tx.layer_sent(0) && !tx.layer_sent(1));
        tx.send_pages(1..2, &[1], 64).unwrap();
        assert!(!tx.layer_sent(0) && tx.layer_sent(1));
        assert!(!tx.layer_sent(2), "outside the grant");
        // An empty grant's layers have nothing to send.
        let empty = SenderTransfer::new(grant(&mut rx, &[], 2));
        assert!(empty.layer_sent(0) && empty.layer_sent(1) && !empty.layer_sent(2));
    }

    #[test]
    fn runs_split_at_the_block_bound() {
        let mut rx = ReceiverState::new(1, 16, 4).unwrap();
        let g = grant(&mut rx, &(0..10).collect::<Vec<_>>(), 1);
        let mut tx = SenderTransfer::new(g);
        let planned = tx
            .send_pages(0..1, &(0..10).collect::<Vec<_>>(), 12)
            .unwrap();
        let counts: Vec<u32> = planned.iter().map(|p| p.block.page_count).collect();
        assert_eq!(counts, vec![3, 3, 3, 1]);
        let firsts: Vec<usize> = planned.iter().map(|p| p.first).collect();
        assert_eq!(firsts, vec![0, 3, 6, 9]);
    }
}
