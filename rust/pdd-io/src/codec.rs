//! `tokio_util::codec` adapter over the sans-IO frame codec of `pdd-core`, so a
//! `TcpStream` becomes a `Stream`/`Sink` of [`Frame`]s.

use bytes::BytesMut;
use pdd_core::wire::{encode_frame, Frame, FrameDecoder, DEFAULT_MAX_PAYLOAD};
use tokio_util::codec::{Decoder, Encoder};

/// Errors of a framed connection: the socket's, or the protocol's.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The socket failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol (or we were asked to send an invalid frame).
    #[error(transparent)]
    Protocol(#[from] pdd_core::Error),
}

/// Frames in both directions; `recv_max` bounds what we accept, `send_max` what the
/// peer said it accepts (from its HELLO).
#[derive(Debug, Clone)]
pub struct WireCodec {
    decoder: FrameDecoder,
    send_max: u32,
}

impl Default for WireCodec {
    fn default() -> Self {
        WireCodec::new(DEFAULT_MAX_PAYLOAD, DEFAULT_MAX_PAYLOAD)
    }
}

impl WireCodec {
    /// A codec with the given receive and send payload limits.
    pub fn new(recv_max: u32, send_max: u32) -> Self {
        WireCodec {
            decoder: FrameDecoder::new(recv_max),
            send_max,
        }
    }

    /// Raise or lower the send limit once the peer's HELLO is known.
    pub fn set_send_max(&mut self, send_max: u32) {
        self.send_max = send_max;
    }
}

impl Decoder for WireCodec {
    type Item = Frame;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, CodecError> {
        Ok(self.decoder.decode(src)?)
    }
}

impl Encoder<&Frame> for WireCodec {
    type Error = CodecError;

    fn encode(&mut self, frame: &Frame, dst: &mut BytesMut) -> Result<(), CodecError> {
        Ok(encode_frame(frame, self.send_max, dst)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::{SinkExt, StreamExt};
    use pdd_core::wire::{Handoff, Ping};
    use tokio::io::AsyncWriteExt;
    use tokio_util::codec::{FramedRead, FramedWrite};

    #[tokio::test]
    async fn frames_cross_a_stream_in_order() {
        let (a, b) = tokio::io::duplex(64);
        let mut tx = FramedWrite::new(a, WireCodec::default());
        let mut rx = FramedRead::new(b, WireCodec::default());
        let sent = vec![
            Frame::Ping(Ping {
                nonce: 1,
                sent_at_ns: 2,
            }),
            Frame::Handoff(Handoff {
                request_id: 9,
                seq: 0,
                first_position: 100,
                token_ids: (0..100).map(|i| i * 1291 % 129_280).collect(),
                final_: true,
            }),
        ];
        let writer = tokio::spawn(async move {
            for f in &sent {
                tx.send(f).await.unwrap();
            }
            sent
        });
        let mut got = Vec::new();
        while got.len() < 2 {
            got.push(rx.next().await.unwrap().unwrap());
        }
        assert_eq!(got, writer.await.unwrap());
    }

    #[tokio::test]
    async fn garbage_is_a_protocol_error_not_a_hang() {
        let (mut a, b) = tokio::io::duplex(64);
        let mut rx = FramedRead::new(b, WireCodec::default());
        a.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        match rx.next().await {
            Some(Err(CodecError::Protocol(e))) => assert_eq!(e.reason(), "bad_magic"),
            other => panic!("expected bad_magic, got {other:?}"),
        }
    }
}
