//! The KV layout exchange on the receiver's side (capability `kv_layout`,
//! docs/protocol.md "KV layout"): our layout goes to each peer that negotiated it,
//! first, and the peer's is kept per session. Where both sides offered it (a side
//! offers it exactly when it has a layout), the session counts as up only once the
//! peer's KV_LAYOUT came: no grant goes to it before, so the engine always knows
//! the sender's layout when it plans a grant. A child of `receiver`, so it works on
//! the same endpoint's state.

use super::*;
use crate::wire::{check_kv_layout, KvLayout};

impl ReceiverEndpoint {
    /// Send `layout` (1 ..= 256 bytes, opaque here) to every peer that negotiates
    /// `kv_layout`. The I/O layer offers the capability exactly when it gives one.
    pub fn with_layout(mut self, layout: Option<Vec<u8>>) -> Result<ReceiverEndpoint> {
        if let Some(l) = &layout {
            check_kv_layout(l).map_err(|d| Error::InvalidArgument(format!("layout: {d}")))?;
        }
        self.layout = layout;
        Ok(self)
    }

    /// Our layout, if we were given one.
    pub fn layout(&self) -> Option<&[u8]> {
        self.layout.as_deref()
    }

    /// The layout the live session `peer` sent (its KV_LAYOUT). `None`: no such
    /// session, the peer has none or is older (`kv_layout` not negotiated), or it
    /// has not come yet ([`is_up`](Self::is_up) says which).
    pub fn peer_layout(&self, peer: u64) -> Option<&[u8]> {
        let generation = self.live.get(&peer)?;
        self.sessions.get(generation)?.peer_layout.as_deref()
    }

    /// Whether session `peer` is live and up: connected, and, where `kv_layout` was
    /// negotiated, its KV_LAYOUT has come.
    pub fn is_up(&self, peer: u64) -> bool {
        self.live
            .get(&peer)
            .and_then(|g| self.sessions.get(g))
            .is_some_and(|s| !Self::awaits_layout(s))
    }

    fn awaits_layout(s: &Session) -> bool {
        s.capabilities & capability::KV_LAYOUT != 0 && s.peer_layout.is_none()
    }

    /// A session opened: where `kv_layout` was negotiated, our KV_LAYOUT is its first
    /// control frame, and the peer's must come within the dead-peer bound.
    pub(super) fn layout_opened(&mut self, session: SessionHandle, now: Timestamp) {
        if self.capabilities(session).unwrap_or(0) & capability::KV_LAYOUT == 0 {
            return;
        }
        if let Some(l) = &self.layout {
            let frame = Frame::KvLayout(KvLayout {
                layout: l.clone().into(),
            });
            self.transmit.push_back((session, frame));
        }
        let at = now.saturating_add(self.timers.dead_after);
        self.queue.set(Timer::Layout(session.generation), at);
    }

    /// The peer's KV_LAYOUT: kept, unless the session did not negotiate
    /// `kv_layout`, already has one, or the blob is empty or too long (the decoder
    /// refuses those first): then the peer broke the protocol and the session ends
    /// (`invalid_field`, told to the peer).
    pub(super) fn peer_layout_frame(&mut self, session: SessionHandle, layout: &[u8]) {
        let Some(s) = self.sessions.get(&session.generation) else {
            return;
        };
        if let Some(e) = super::super::layout_frame_refusal(
            s.capabilities,
            s.peer_layout.is_some(),
            layout,
            "session",
        ) {
            self.end_session(session, e, true, false);
            return;
        }
        if let Some(s) = self.sessions.get_mut(&session.generation) {
            s.peer_layout = Some(layout.to_vec());
        }
        self.queue.clear(Timer::Layout(session.generation));
        self.events.push_back(ReceiverEvent::PeerLayout { session });
    }

    /// A grant needs the peer's layout first, where it negotiated one. Until then
    /// the peer is not up: `connection_lost`, as for a peer not connected yet, so a
    /// caller that retries a grant while the prefill side connects (the Puller)
    /// retries this too; the layout is the peer's first frame, so the wait is short.
    pub(super) fn check_layout_known(&self, session: SessionHandle) -> Result<()> {
        match self.sessions.get(&session.generation) {
            Some(s) if Self::awaits_layout(s) => Err(Error::ConnectionLost {
                detail: format!(
                    "peer {} is not up yet: its KV_LAYOUT has not arrived",
                    session.id
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The peer negotiated `kv_layout` and sent no KV_LAYOUT within the bound.
    pub(super) fn layout_overdue(&mut self, generation: u64) {
        let Some(h) = self.sessions.get(&generation).map(|s| s.handle) else {
            return;
        };
        let e = Error::DeadlineExceeded {
            what: format!(
                "peer {}'s KV_LAYOUT (it offered kv_layout) within {:?}",
                h.id, self.timers.dead_after
            ),
        };
        self.end_session(h, e, true, false);
    }
}
