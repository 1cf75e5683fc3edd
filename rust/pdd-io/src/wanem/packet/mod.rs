//! `wanem::packet`: a packet-level WAN emulator between two TUN devices.
//!
//! The stream proxy of the parent module relays bytes, so each side's TCP runs over
//! loopback and never sees the line's RTT or loss. Here the two ends live in their
//! own network namespaces, each with a TUN device; the emulator reads every IP packet
//! one end sends and writes it, after the line model, into the other end's device,
//! so both TCP stacks see the delay, the jitter, the loss, the queue and the rate.
//!
//! [`model`] is the per-packet line (sans I/O, seeded, tested on simulated time);
//! [`tun`] moves the packets. Creating the namespaces and devices is the caller's
//! (the Python `pdd_transport.wanem.PacketWan` does it with `ip`); see `docs/wanem.md`.

pub mod model;
pub mod tun;

pub use model::{
    DelayLine, DropReason, GilbertElliott, LinkModel, PacketProfile, Verdict, MAX_PACKET_DELAY,
};
pub use tun::{End, PacketEmulator, PacketEmulatorConfig, PacketStats, MAX_HELD_PACKETS};
