//! The KV layout exchange on the sender's side (capability `kv_layout`,
//! docs/protocol.md "KV layout"): our layout goes first on each connection that
//! negotiated it, and the receiver's is kept for the connection. The receiver sends
//! its KV_LAYOUT before anything else, so a KV_GRANT that overtakes it breaks the
//! protocol: every grant a sender takes was planned knowing both layouts. A child
//! of `sender`, so it works on the same session's state.

use super::*;
use crate::wire::{check_kv_layout, KvLayout};

impl SenderSession {
    /// Send `layout` (1 ..= 256 bytes, opaque here) on every connection that
    /// negotiates `kv_layout`. The I/O layer offers the capability exactly when it
    /// gives one.
    pub fn with_layout(mut self, layout: Option<Vec<u8>>) -> Result<SenderSession> {
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

    /// The receiver's layout on the live connection (its KV_LAYOUT). `None`: no
    /// connection, the receiver has none or is older (`kv_layout` not negotiated),
    /// or it has not come yet ([`is_up`](Self::is_up) says which).
    pub fn peer_layout(&self) -> Option<&[u8]> {
        self.conn.as_ref()?.peer_layout.as_deref()
    }

    /// Whether a connection is live and up: where `kv_layout` was negotiated, the
    /// receiver's KV_LAYOUT has come.
    pub fn is_up(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !Self::awaits_layout(c))
    }

    fn awaits_layout(c: &Conn) -> bool {
        c.capabilities & capability::KV_LAYOUT != 0 && c.peer_layout.is_none()
    }

    /// A connection opened: where `kv_layout` was negotiated, our KV_LAYOUT is its
    /// first control frame (before any KV_DONE, LOCAL_DONE or data).
    pub(super) fn layout_connected(&mut self) {
        let negotiated = self
            .conn
            .as_ref()
            .is_some_and(|c| c.capabilities & capability::KV_LAYOUT != 0);
        if let (true, Some(l)) = (negotiated, &self.layout) {
            let frame = Frame::KvLayout(KvLayout {
                layout: l.clone().into(),
            });
            self.transmit.push_back(frame);
        }
    }

    /// A KV_GRANT came while the receiver's KV_LAYOUT is still awaited: the
    /// receiver broke the protocol (it sends its layout first) and the session
    /// ends (`invalid_field`, told to the receiver). True if so.
    pub(super) fn grant_before_layout(&mut self) -> bool {
        if !self.conn.as_ref().is_some_and(Self::awaits_layout) {
            return false;
        }
        let e = Error::InvalidField {
            kind: FrameKind::KvGrant,
            field: "kind",
            detail: "a KV_GRANT before the receiver's KV_LAYOUT (kv_layout)".into(),
        };
        self.end(e, true);
        true
    }

    /// The receiver's KV_LAYOUT: kept, unless the connection did not negotiate
    /// `kv_layout`, already has one, or the blob is empty or too long (the decoder
    /// refuses those first): then the receiver broke the protocol and the session
    /// ends (`invalid_field`, told to the receiver).
    pub(super) fn peer_layout_frame(&mut self, layout: &[u8]) {
        let Some(c) = &self.conn else {
            return;
        };
        if let Some(e) = super::super::layout_frame_refusal(
            c.capabilities,
            c.peer_layout.is_some(),
            layout,
            "connection",
        ) {
            self.end(e, true);
            return;
        }
        if let Some(c) = &mut self.conn {
            c.peer_layout = Some(layout.to_vec());
        }
        self.events.push_back(SenderEvent::PeerLayout);
    }
}
