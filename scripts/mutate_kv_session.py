#!/usr/bin/env python3
"""Mutation audit of the KV session machines (pdd-core/src/kv/session/): each check,
broken on purpose once, must fail a test of pdd-core's session suites.

Every mutant replaces one exact snippet of the machine's source (it must occur once),
builds pdd-core's tests, runs `--lib`, `kv_session_sim` and `kv_session_adversarial`,
names the tests that failed and how long the run took, and restores the source (also
when interrupted). A mutant whose snippet is gone (the code moved) is reported
`pattern`, never counted as killed. From the repository root:

    python3 scripts/mutate_kv_session.py            # all (about 25 s each here)
    python3 scripts/mutate_kv_session.py R01 S32    # some
    python3 scripts/mutate_kv_session.py --json out.json

Results of the last full run: docs/testing.md, "Mutation audit of the KV session".
Not run by CI (an hour on two cores); run it after changing the machines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

R = "rust/pdd-core/src/kv/session/receiver.rs"
S = "rust/pdd-core/src/kv/session/sender.rs"
M = "rust/pdd-core/src/kv/session/mod.rs"
RL = "rust/pdd-core/src/kv/session/receiver_lanes.rs"  # the receiver's lanes, a child of R
W = "rust/pdd-core/src/wire/text.rs"  # the one cut of wire text, used by every ABORT
SN = "rust/pdd-core/src/kv/session/sender_notices.rs"  # the sender's request notices, a child of S

# (id and what the mutant breaks, file, the snippet, its replacement)
MUTANTS: list[tuple[str, str, str, str]] = [
# --- receiver: lane keys and admission
("R01 lane_key: another TLS identity accepted", R, "(_, Some((_, owner))) if owner != identity =>", "(_, Some((_, owner))) if owner != identity && false =>"),
("R02 lane_key: no session bound", R, "(false, None) if self.live.len() >= self.max_sessions =>", "(false, None) if false =>"),
("R03 lane_key: a live id may be opened again", R, "(false, Some(_)) => Err(Error::AuthFailed {\n                detail: \"that session is live: a reconnect must resume it with its secret\",\n            }),", "(false, Some(_)) => Ok(LaneKey::Root),"),
("R04 lane_key: resumption proves the root key", R, "(true, Some((secret, _))) => Ok(LaneKey::Session(secret)),", "(true, Some((_secret, _))) => Ok(LaneKey::Root),"),
("R05 lane_key: resuming no session allowed", R, "(true, None) if lane == 0 => Err(Error::AuthFailed {\n                detail: \"no live session to resume\",\n            }),", "(true, None) if lane == 0 => Ok(LaneKey::Root),"),
("R06 lane_key: data lane without a session allowed", R, "(true, None) => Err(Error::ConnectionLost {\n                detail: format!(\"data lane {lane} for session {id} which has no control lane\"),\n            }),", "(true, None) => Ok(LaneKey::Root),"),
("R07 open_session: a closed receiver opens sessions", R, "        if self.closed {\n            return Err(Error::Cancelled {", "        if false {\n            return Err(Error::Cancelled {"),
("R08 open_session: a resumption of no session opens one", R, "None => !resume,", "None => true,"),
("R09 open_session: resumption without the live secret", R, "Some(h) => resume && self.sessions.get(&h.generation).map(|s| s.secret) == Some(secret),", "Some(h) => resume && self.sessions.get(&h.generation).is_some(),"),
("R10 open_session: no session bound", R, "if current.is_none() && self.live.len() >= self.max_sessions {", "if false {"),
("R11 open_session: the replaced instance is not ended", R, "            self.end_session(old, error, false, false);\n        }\n        let generation", "            let _ = (old, error);\n        }\n        let generation"),
("R12 join_lane: any secret joins", R, ".filter(|s| s.secret == secret && !s.local())", ".filter(|s| !s.local())"),
("R13 join_lane: data lanes on a local session", R, ".filter(|s| s.secret == secret && !s.local())", ".filter(|s| s.secret == secret)"),
("R14 join_lane: no lane bound", R, "if session.live_lanes.len() as u64 >= MAX_LANES_PER_SESSION {", "if false {"),
("R15 join_lane: a replaced lane is not marked revoked", R, "            if let Some(st) = session.live_lanes.get_mut(&old) {\n                st.revoked = true;\n            }", "            let _ = old;"),
("R16 join_lane: a replaced lane is not stopped", R, "            self.events.push_back(ReceiverEvent::StopLane {\n                lane: LaneHandle {\n                    instance: old,\n                    ..handle\n                },\n            });", ""),
("R17 lane_down: LANE_REVOKED never sent", R, "for _ in 0..st.answers {", "for _ in 0..0 {"),
("R18 lane_down: the lane-end bound not disarmed", R, "        self.queue\n            .clear(Timer::LaneEnd(lane.session.generation, lane.instance));\n        for _ in", "        for _ in"),
("R19 begin_block: a block of an ended session drained", R, "            return Err(Error::ConnectionLost {\n                detail: format!(\"session {} ended\", session.id),\n            });", "            return Ok(BlockDisposition::Drain);"),
("R20 begin_block: RESENT without failover accepted", R, "if resent && s.capabilities & capability::LANE_FAILOVER == 0 {", "if false {"),
("R21 begin_block: a violation does not end the session", R, "            Err(e) => {\n                self.end_session(session, e.clone(), true, true);\n                Err(e)\n            }\n        }\n    }\n\n    /// A block begun with `Land` has landed", "            Err(e) => Err(e),\n        }\n    }\n\n    /// A block begun with `Land` has landed"),
("R22 block_cut: never abandoned", R, "        if revoked {\n            self.state.abandon_block(block);", "        if false {\n            self.state.abandon_block(block);"),
("R23 block_cut: always abandoned", R, "        if revoked {\n            self.state.abandon_block(block);", "        if true {\n            self.state.abandon_block(block);"),
("R24 lane_failed: a lost lane ends the session", R, "if !matches!(error, Error::ConnectionLost { .. }) {\n            self.end_session(lane.session, error, true, true);", "if true {\n            self.end_session(lane.session, error, true, true);"),
("R25 lane_failed: a protocol error keeps the session", R, "if !matches!(error, Error::ConnectionLost { .. }) {\n            self.end_session(lane.session, error, true, true);", "if false {\n            self.end_session(lane.session, error, true, true);"),
("R26 handle_frame: a frame does not prove the peer alive", R, "        self.arm_dead(session.generation, now);\n        match frame {", "        match frame {"),
("R27 handle_frame: KV_DONE taken on a local session", R, "Frame::KvDone(done) if !local =>", "Frame::KvDone(done) =>"),
("R28 handle_frame: no bound after KV_DONE", R, "                                self.queue.set(Timer::Tail(done.transfer_id), at);", "                                let _ = at;"),
("R29 handle_frame: a KV_DONE violation keeps the session", R, "                    Err(e) => self.end_session(session, e, true, true),\n                }\n            }\n            Frame::LocalDone", "                    Err(_) => {}\n                }\n            }\n            Frame::LocalDone"),
("R30 handle_frame: LOCAL_DONE taken on a WAN session", R, "Frame::LocalDone(done) if local =>", "Frame::LocalDone(done) =>"),
("R31 handle_frame: a LOCAL_DONE violation keeps the session", R, "                    Ok(events) => self.publish(events),\n                    Err(e) => self.end_session(session, e, true, true),", "                    Ok(events) => self.publish(events),\n                    Err(_) => {}"),
("R32 handle_frame: PING not answered", R, "                self.transmit.push_back((session, Frame::Pong(p)));", "                let _ = p;"),
("R33 handle_frame: RTT not measured from our PING", R, "let rtt = Duration::from_nanos(now.as_nanos().saturating_sub(p.sent_at_ns));\n                self.events.push_back(ReceiverEvent::Rtt { session, rtt });", "let rtt = Duration::from_nanos(now.as_nanos());\n                let _ = p;\n                self.events.push_back(ReceiverEvent::Rtt { session, rtt });"),
("R34 handle_frame: PREFIX_QUERY taken on a local session", R, "Frame::PrefixQuery(query) if !local =>", "Frame::PrefixQuery(query) =>"),
("R35 handle_frame: ABORT 0 taken as a request's", R, "Frame::Abort(a) if a.request_id == 0 => {", "Frame::Abort(a) if false => {"),
("R36 handle_frame: ABORT of a request reaches other sessions", R, "                    .transfers_of(session)\n                    .into_iter()\n                    .filter(|&id| self.state.request_of(id) == Some(a.request_id))", "                    .transfers\n                    .keys()\n                    .copied()\n                    .filter(|&id| self.state.request_of(id) == Some(a.request_id))"),
("R37 handle_frame: ABORT of a request fails every request", R, ".filter(|&id| self.state.request_of(id) == Some(a.request_id))", ".filter(|&id| self.state.request_of(id).is_some())"),
("R38 handle_frame: LANE_REVOKE without failover taken", R, "Frame::LaneRevoke(r) if failover && !local =>", "Frame::LaneRevoke(r) if !local =>"),
("R39 handle_frame: an unexpected frame ends silently", R, "                self.end_session(session, e, true, false);\n            }\n        }\n    }\n\n    /// Reserve pages", "                self.end_session(session, e, false, false);\n            }\n        }\n    }\n\n    /// Reserve pages"),
("R40 revoke: an unknown lane never answered", R, "            self.transmit\n                .push_back((session, Frame::LaneRevoked(LaneRevoke { lane })));\n            return;", "            return;"),
("R41 revoke: a lane stopped once per LANE_REVOKE", R, "        if st.answers == 1 {", "        if true {"),
("R42 revoke: no bound on the lane's end", R, "            self.queue.set(\n                Timer::LaneEnd(session.generation, instance),\n                now.saturating_add(bound),\n            );", "            let _ = (bound, now);"),
("R43 revoke: a lane stopped is not marked revoked", R, "        st.revoked = true;\n        st.answers += 1;", "        st.answers += 1;"),
("R44 reserve: an empty grant to a peer without the capability", R, "if pages.is_empty() && caps & capability::EMPTY_GRANT == 0 {", "if false {"),
("R45 reserve: two live grants of one request to one session", R, "        if self\n            .transfers_of(session)\n            .into_iter()\n            .any(|id| self.state.request_of(id) == Some(request_id))\n        {", "        if false {"),
("R46 reserve: an id in use is not drawn again", R, "            if !self.state.id_in_use(id) {\n                break id;", "            if true {\n                break id;"),
("R47 reserve: a repeating id source refused too early", R, "if draws == ID_DRAWS {", "if draws == 1 {"),
("R48 announce: announced twice", R, "        if meta.announced {\n            return Err", "        if false {\n            return Err"),
("R49 announce: no deadline", R, "            self.queue\n                .set(Timer::Deadline(transfer_id), now.saturating_add(d));", "            let _ = (d, now);"),
("R50 publish: the peer told of a transfer it never heard of", R, ".filter(|m| m.announced && self.sessions.contains_key(&m.owner.generation))", ".filter(|m| self.sessions.contains_key(&m.owner.generation))"),
("R51 publish: the peer told of its own ABORT", R, ") if !matches!(error, Error::PeerAborted { .. } | Error::Refused { .. }) => {", ") if !matches!(error, Error::Refused { .. }) => {"),
("R52 publish: a deadline outlives its transfer", R, "                self.queue.clear(Timer::Deadline(id));\n                self.queue.clear(Timer::Tail(id));", "                self.queue.clear(Timer::Tail(id));"),
("R53 publish: a tail bound outlives its transfer", R, "                self.queue.clear(Timer::Deadline(id));\n                self.queue.clear(Timer::Tail(id));", "                self.queue.clear(Timer::Deadline(id));"),
("R54 publish: no KV_DONE for a complete transfer", R, "                        Some(owner),\n                    ) => self.transmit.push_back((\n                        owner,\n                        Frame::KvDone(KvDone {", "                        Some(owner),\n                    ) if false => self.transmit.push_back((\n                        owner,\n                        Frame::KvDone(KvDone {"),
("R55 end_session: the peer never told why", R, "        if tell_peer {\n            self.transmit.push_back((\n                session,\n                Frame::Abort(abort_for(0, &error, MAX_ABORT_MESSAGE_LEN)),", "        if false {\n            self.transmit.push_back((\n                session,\n                Frame::Abort(abort_for(0, &error, MAX_ABORT_MESSAGE_LEN)),"),
("R56 end_session: its PINGs go on", R, "        self.queue.clear(Timer::Ping(session.generation));\n        self.queue.clear(Timer::Dead(session.generation));", "        self.queue.clear(Timer::Dead(session.generation));"),
("R57 end_session: its dead-peer bound goes on", R, "        self.queue.clear(Timer::Ping(session.generation));\n        self.queue.clear(Timer::Dead(session.generation));", "        self.queue.clear(Timer::Ping(session.generation));"),
("R58 end_session: its transfers outlive it", R, "        let mut ids = self.transfers_of(session);\n        ids.sort_unstable();\n        for id in ids {\n            let events = self.state.fail(id, error.clone());\n            self.publish(events);\n        }\n    }\n}", "        let _ = error;\n    }\n}"),
("R59 end_session: its lane bounds go on", R, "        for &instance in s.live_lanes.keys() {\n            self.queue\n                .clear(Timer::LaneEnd(session.generation, instance));\n        }", ""),
("R60 close: peers not told", R, "            self.transmit.push_back((\n                session,\n                Frame::Abort(abort_with(\n                    0,\n                    AbortReason::Shutdown,", "            self.events.push_back(ReceiverEvent::Rtt { session, rtt: Duration::ZERO });\n            drop((\n                session,\n                Frame::Abort(abort_with(\n                    0,\n                    AbortReason::Shutdown,"),
("R61 close: sessions open after it", R, "        self.closed = true;\n        let error = Error::Cancelled {\n            detail: \"receiver closed\".into(),", "        let error = Error::Cancelled {\n            detail: \"receiver closed\".into(),"),
("R62 timeout: one PING only", R, "                    self.transmit.push_back((h, Frame::Ping(ping)));\n                    self.queue.set(\n                        Timer::Ping(generation),\n                        now.saturating_add(self.timers.heartbeat),\n                    );", "                    self.transmit.push_back((h, Frame::Ping(ping)));"),
("R63 timeout: a silent peer is not dead", R, "                    self.end_session(h, e, false, false);\n                }\n                Timer::Deadline(id) => {", "                    let _ = (h, e);\n                }\n                Timer::Deadline(id) => {"),
("R64 timeout: a deadline does not fail", R, "                    let events = self.state.fail(id, Error::DeadlineExceeded { what });\n                    self.publish(events);\n                }\n                Timer::Tail(id) => {", "                    let _ = what;\n                }\n                Timer::Tail(id) => {"),
("R65 timeout: the tail bound never fails", R, "if now_progress.is_some() && now_progress == m.tail {", "if false {"),
("R66 timeout: the tail bound fails despite progress", R, "if now_progress.is_some() && now_progress == m.tail {", "if now_progress.is_some() {"),
("R67 timeout: a revoked lane that does not end keeps the session", R, "                    let h = s.handle;\n                    self.end_session(h, e, true, false);", "                    let _ = (s.handle, e);"),
("R68 fail_transfer: says it failed what had ended", R, "        let any = !events.is_empty();", "        let any = true;"),
# --- sender
("S01 new: a stall bound not below dead_after", S, "if lane_stall.is_zero() || lane_stall >= timers.dead_after {", "if lane_stall.is_zero() {"),
("S02 connected: a closed sender connects", S, "        if self.closed {\n            return Err(Error::Cancelled {\n                detail: \"sender closed\".into(),\n            });\n        }\n        self.end(", "        self.end("),
("S03 connected: the replaced connection does not end", S, "        self.end(\n            Error::ConnectionLost {\n                detail: \"replaced by a new connection\".into(),\n            },\n            false,\n        );", ""),
("S04 handle_frame: a frame does not prove the receiver alive", S, "        self.queue\n            .set(Timer::Dead, now.saturating_add(self.timers.dead_after));\n        match frame {", "        match frame {"),
("S05 KV_GRANT: a transfer id granted twice", S, '                if self.transfers.contains_key(&id)\n                    || self.half.contains_key(&id)\n                    || self.grants.values().any(|o| o.transfer_id == id)\n                {', '                if self.half.contains_key(&id) {'),
("S06 KV_GRANT: the engine not told", S, "                self.events\n                    .push_back(SenderEvent::GrantArrived { request_id });", "                let _ = request_id;"),
("S07 LANE_REVOKED taken without failover", S, "Frame::LaneRevoked(r) if failover => {", "Frame::LaneRevoked(r) => {"),
("S08 LANE_REVOKED: any lane's releases the revoked one", S, "                if conn.revoking != Some(r.lane) {\n                    return;\n                }", "                if conn.revoking.is_none() {\n                    return;\n                }"),
("S09 LANE_REVOKED: stall clocks not restarted", S, "                for l in &mut conn.lanes {\n                    l.since = now;\n                }", ""),
("S10 LANE_REVOKED: the revocation bound not disarmed", S, "                self.queue.clear(Timer::RevokeBound);\n                let mut resend", "                let mut resend"),
("S11 ABORT 0 taken as a request's", S, "Frame::Abort(a) if a.request_id == 0 => self.end(peer_aborted(&a), false),", "Frame::Abort(a) if false => self.end(peer_aborted(&a), false),"),
("S12 ABORT of a request: its pending grant stays", S, "                self.grants.retain(|_, g| g.request_id != a.request_id);", ""),
("S13 ABORT of a request fails every request", S, "                    .filter(|(_, o)| o.transfer.grant().request_id == a.request_id)", ""),
("S14 PING not answered", S, "Frame::Ping(p) => self.transmit.push_back(Frame::Pong(p)),", "Frame::Ping(_) => {}"),
("S15 RTT not measured from our PING", S, "let rtt = Duration::from_nanos(now.as_nanos().saturating_sub(p.sent_at_ns));\n                self.events.push_back(SenderEvent::Rtt(rtt));", "let _ = p;\n                self.events.push_back(SenderEvent::Rtt(Duration::from_nanos(now.as_nanos())));"),
("S16 an unexpected frame ends silently", S, "                self.end(e, true);\n            }\n        }\n    }\n\n    /// The receiver's KV_DONE", "                self.end(e, false);\n            }\n        }\n    }\n\n    /// The receiver's KV_DONE"),
("S17 KV_DONE before our finish completes", S, "            None => Some(\"the receiver confirmed it before we finished sending it\".to_string()),", "            None => None,"),
("S18 KV_DONE with other counts completes", S, "            Some(mine) if (mine.chunk_count, mine.byte_count) != (d.chunk_count, d.byte_count) => {", "            Some(mine) if false && mine.chunk_count != d.chunk_count => {"),
("S19 a refused KV_DONE not answered", S, "                self.transmit.push_back(Frame::Abort(abort_for(\n                    request_id,\n                    &e,\n                    MAX_TRANSFER_ABORT_MESSAGE,\n                )));", ""),
("S20 data_lane_failed: a revoked lane's failure ends the session", S, "        if revoked || conn.failed.is_some() {", "        if conn.failed.is_some() {"),
("S21 data_lane_failed: the last failure wins", S, "        if revoked || conn.failed.is_some() {", "        if revoked {"),
("S22 data_lane_failed: no grace", S, "            now.saturating_add(self.timers.peer_reason_grace),", "            now,"),
("S23 lane_samples: revokes without failover", S, "        if conn.capabilities & capability::LANE_FAILOVER == 0 || conn.revoking.is_some() {", "        if conn.revoking.is_some() {"),
("S24 lane_samples: two revocations at once", S, "        if conn.capabilities & capability::LANE_FAILOVER == 0 || conn.revoking.is_some() {", "        if conn.capabilities & capability::LANE_FAILOVER == 0 {"),
("S25 lane_samples: an idle lane counts as stalled", S, "            if !s.loaded || s.progress != watch.progress {", "            if s.progress != watch.progress {"),
("S26 lane_samples: a moving lane counts as stalled", S, "            if !s.loaded || s.progress != watch.progress {", "            if !s.loaded {"),
("S27 lane_samples: stalled one bound late", S, "s.loaded && now.saturating_duration_since(watch.since) >= stall;", "s.loaded && now.saturating_duration_since(watch.since) > stall;"),
("S28 lane_samples: revokes when the whole line stalls", S, "let (Some(i), true) = (stalled, healthy > 0) else {", "let (Some(i), true) = (stalled, true) else {"),
("S29 lane_samples: no bound on LANE_REVOKED", S, "        self.queue.set(\n            Timer::RevokeBound,\n            now.saturating_add(self.timers.dead_after),\n        );", ""),
("S30 lane_samples: the revoked lane stays alive", S, "        conn.lanes[i].dead = true;", ""),
("S32 finish: our counts forgotten", S, '        if !local {\n            o.done = Some(done.clone());', '        if !local {\n            let _ = &o.done;'),
("S33 abort: the receiver not told", S, "        self.transmit.push_back(Frame::Abort(message));\n        self.fail(transfer_id, Error::Cancelled { detail });", "        drop(message);\n        self.fail(transfer_id, Error::Cancelled { detail });"),
("S34 close: a new connection after it", S, "        self.closed = true;\n        let e = Error::Cancelled {\n            detail: \"sender closed\".into(),", "        let e = Error::Cancelled {\n            detail: \"sender closed\".into(),"),
("S35 timeout: one PING only", S, "                    self.transmit.push_back(Frame::Ping(ping));\n                    self.queue\n                        .set(Timer::Ping, now.saturating_add(self.timers.heartbeat));", "                    self.transmit.push_back(Frame::Ping(ping));"),
("S36 timeout: a silent receiver is not dead", S, "                        detail: format!(\"receiver silent for {:?}\", self.timers.dead_after),\n                    };\n                    self.end(e, false);", "                        detail: format!(\"receiver silent for {:?}\", self.timers.dead_after),\n                    };\n                    let _ = e;"),
("S37 timeout: an unconfirmed revocation keeps the session", S, "                            self.timers.dead_after\n                        ),\n                    };\n                    self.end(e, false);", "                            self.timers.dead_after\n                        ),\n                    };\n                    let _ = e;"),
("S38 timeout: a failed lane never ends the session", S, "                    let e = conn.failed.take().unwrap_or(Error::ConnectionLost {\n                        detail: \"a data lane failed\".into(),\n                    });\n                    self.end(e, false);", "                    let _ = conn.failed.take();"),
("S39 end: grants of a dead connection stay", S, '        self.grants.clear();\n        self.half.clear();', '        self.half.clear();'),
("S40 end: the receiver never told why", S, "        if tell_peer {\n            self.transmit\n                .push_back(Frame::Abort(abort_for(0, &error, MAX_ABORT_MESSAGE_LEN)));", "        if false {\n            self.transmit\n                .push_back(Frame::Abort(abort_for(0, &error, MAX_ABORT_MESSAGE_LEN)));"),
("S41 end: timers go on", S, "        for t in [Timer::Ping, Timer::Dead, Timer::RevokeBound, Timer::Grace] {\n            self.queue.clear(t);\n        }", ""),
("S42 end: transfers outlive the connection", S, "        for id in self.transfers_in_progress() {\n            self.fail(id, error.clone());\n        }\n    }\n}", "        let _ = error;\n    }\n}"),
# --- shared
("M01 timers: setting a key again keeps the old instant", M, "        if let Some(old) = self.at.insert(key, when) {\n            self.order.remove(&(old, key));\n        }", "        self.at.insert(key, when);"),
("M02 timers: a timer fires before it is due", M, "        if when > now {\n            return None;\n        }", "        if when > now.saturating_add(Duration::from_millis(1)) {\n            return None;\n        }"),
("M03 timers: zero bounds accepted", M, "            if d.is_zero() {", "            if d.is_zero() && false {"),
("D01 receiver: no LANE_DELIVERED with the PONG", R, "                if let Some(d) = self.delivered(session) {", "                if let Some(d) = self.delivered(session).filter(|_| false) {"),
("D03 receiver: blocks not counted", R, "            st.delivered = st\n                .delivered\n                .saturating_add(", "            st.delivered = 0 * st\n                .delivered\n                .saturating_add("),
("D04 receiver: reported without the capability", R, "if s.local() || s.capabilities & capability::LANE_DELIVERY == 0 {", "if s.local() {"),
("D05 sender: the receiver's counts ignored", S, "if let Some(read) = watch.delivered.filter(|_| delivery) {", "if let Some(read) = watch.delivered.filter(|_| false) {"),
("D06 sender: nothing owed never resets the count's clock", S, "if !owed || read != watch.read_seen {", "if read != watch.read_seen {"),
("D07 sender: no two-heartbeat floor", S, "let read_stall = stall.max(self.timers.heartbeat.saturating_mul(2));", "let read_stall = stall;"),
("D08 sender: LANE_DELIVERED without the capability", S, "Frame::LaneDelivered(d) if delivery => {", "Frame::LaneDelivered(d) => {"),
("D09 wire: a lane named twice accepted", "rust/pdd-core/src/wire/frame/mod.rs", "        if !seen.insert(lane) {", "        if !seen.insert(lane) && false {"),
("M04 abort messages cut inside a character", W, "    while !s.is_char_boundary(end) {\n        end -= 1;\n    }", "    while end > 1 && !s.is_char_boundary(end) {\n        end -= 2;\n    }"),
("L01 local KV_GRANT takeable before its LOCAL_GRANT", S, "if local && g.page_count > 0 {", "if false {"),
("L02 local: a transfer id half-granted granted again", S, "                    || self.half.contains_key(&id)\n", ""),
("L03 LOCAL_GRANT taken on a WAN session", S, "Frame::LocalGrant(l) if local => {", "Frame::LocalGrant(l) => {"),
("L04 a refused grant's LOCAL_GRANT not dropped", S, "if self.refused.remove(&l.transfer_id) {", "if false {"),
("L05 LOCAL_GRANT without KV_GRANT ignored", S, "                        detail: \"LOCAL_GRANT without its KV_GRANT\".into(),\n                    };\n                    self.end(e, true);", "                        detail: \"LOCAL_GRANT without its KV_GRANT\".into(),\n                    };\n                    let _ = e;"),
("L06 a LOCAL_GRANT that does not cover its grant accepted", S, "                if let Err(e) = check_cover(&g, &l) {\n                    self.end(e, true);\n                    return;\n                }", ""),
("L07 receiver ABORT keeps the half-arrived grant", S, "                self.half.retain(|_, g| g.request_id != a.request_id);\n", ""),
("L08 a refused half grant's LOCAL_GRANT ends the session", S, "                    self.half.remove(id);\n                    self.refused.insert(*id);", "                    self.half.remove(id);"),
("L09 a refused grant not answered", S, "        if found {\n            self.transmit.push_back(Frame::Abort(abort_for(", "        if false {\n            self.transmit.push_back(Frame::Abort(abort_for("),
("L10 an empty local grant gets no notice", S, "        if g.page_count > 0 {\n            return Ok(o.done.clone());\n        }", "        if true {\n            return Ok(o.done.clone());\n        }"),
("L11 KV_DONE sent on the local path", S, "        if !local {\n            o.done = Some(done.clone());", "        if true {\n            o.done = Some(done.clone());"),
("L12 a layer announced before its pages all went", S, "                o.transfer.layer_sent(l) && o.announced.get(usize::from(l)) == Some(&false)", "                o.announced.get(usize::from(l)) == Some(&false)"),
("L13 a layer announced twice", S, "                o.transfer.layer_sent(l) && o.announced.get(usize::from(l)) == Some(&false)", "                o.transfer.layer_sent(l)"),
("L14 one notice per layer, not per run", S, "for run in fresh.chunk_by(|a, b| *a + 1 == *b) {", "for run in fresh.chunk_by(|_, _| false) {"),
("L15 the expected confirmation set before every layer was announced", S, "if o.announced.iter().all(|&a| a) && o.done.is_none() {", "if o.done.is_none() {"),
("L16 a failed put not told to the receiver", S, "        let request_id = o.transfer.grant().request_id;\n        self.transmit.push_back(Frame::Abort(abort_for(\n            request_id,\n            &error,", "        let request_id = o.transfer.grant().request_id;\n        self.events.push_back(SenderEvent::GrantArrived { request_id });\n        drop(Frame::Abort(abort_for(\n            request_id,\n            &error,"),
("L17 a dead connection's half grants stay", S, "        self.half.clear();\n", ""),
("L18 check_cover: a gap or overlap accepted", S, "            if u64::from(start) != next {", "            if false {"),
("L19 check_cover: a layer short accepted", S, "        if next != u64::from(grant.page_count) {", "        if false {"),
("L20 check_cover: a region outside the layers ignored", S, "        let slot = by_layer\n            .get_mut(usize::from(r.layer))\n            .ok_or_else(|| bad(format!(\"layer {} outside the grant\", r.layer)))?;\n        slot.push((r.page_start, r.page_count));", "        if let Some(slot) = by_layer.get_mut(usize::from(r.layer)) {\n            slot.push((r.page_start, r.page_count));\n        }"),
("L21 pending_grant misses half grants", S, "            .or_else(|| self.half.values().find(|g| g.request_id == request_id))", ""),
("L22 a refused grant on a WAN session not removed", S, "        let found = match self.grants.remove(&request_id) {\n            Some(_) => true,", "        let found = match self.grants.get(&request_id) {\n            Some(_) => true,"),
("L23 a dead connection's refused grants excuse LOCAL_GRANTs on the next", S, "        self.refused.clear();\n", ""),
# --- request notices (capability refusal, ABORT refused for a request)
("N01 sender: a refusal not remembered", S, "                    self.refusals.note(a.request_id, &a.message);", ""),
("N02 sender: a new grant does not supersede a refusal", S, "                self.refusals.forget(&request_id);", ""),
("N03 sender: a grant of a declined request taken", S, "                if let Some(reason) = self.declined.get(&request_id) {", "                if let Some(reason) = self.declined.get(&request_id).filter(|_| false) {"),
("N04 sender: a declined grant's LOCAL_GRANT not dropped", S, "                        self.drop_local_grant(id);", ""),
("N05 sender: the dropped-LOCAL_GRANT set unbounded", SN, "        if self.refused.len() >= MAX_REFUSALS {", "        if false {"),
("N06 decline: the grant not taken stays", SN, "        self.grants.remove(&request_id);\n", ""),
("N07 decline: a transfer in progress goes on", SN, "            self.fail(id, e);", "            let _ = (id, e);"),
("N08 decline: request 0 accepted", SN, "        no_request_zero(request_id)?;", ""),
("N09 receiver: a decline not remembered", R, "                    self.declined.note((session.id, a.request_id), &a.message);", ""),
("N10 reserve: a declined request granted", R, "        if let Some(reason) = self.declined.get(&(peer, request_id)) {", "        if let Some(reason) = self.declined.get(&(peer, request_id)).filter(|_| false) {"),
("N11 refuse: told before a grant without the capability", R, "        let told = announced || caps & capability::REFUSAL != 0;", "        let told = true;"),
("N12 refuse: a capable peer not told before a grant", R, "        let told = announced || caps & capability::REFUSAL != 0;", "        let told = announced;"),
("N13 refuse: the transfers go on", R, "            let events = self.state.fail(id, e);\n            self.publish(events);\n        }\n        Ok(told)", "            let _ = (id, e);\n        }\n        Ok(told)"),
("N14 refuse: request 0 accepted", R, "        no_request_zero(request_id)?;\n        let session = self.session(peer)", "        let session = self.session(peer)"),
("N15 notices unbounded", M, "        while self.order.len() > MAX_REFUSALS {", "        while self.order.len() > usize::MAX - 1 {"),
("N16 reasons not cut", M, "        let reason = crate::wire::text::cut(reason, MAX_REFUSAL_REASON).to_string();", "        let reason = reason.to_string();"),
]

# The receiver's lane handling moved to its child module: a snippet of R found there.
MUTANTS = [(n, RL if p == R and o not in open(R).read() else p, o, r) for n, p, o, r in MUTANTS]

TESTS = ["-p", "pdd-core", "--lib", "--test", "kv_session_sim", "--test", "kv_session_adversarial", "--test",
         "kv_session_refusal"]


def run(only: list[str]) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    for name, path, old, new in MUTANTS:
        mid = name.split()[0]
        if only and mid not in only:
            continue
        with open(path) as f:
            src = f.read()
        if src.count(old) != 1:
            print(f"{mid}: pattern found {src.count(old)} times", flush=True)
            results.append({"id": mid, "what": name, "status": "pattern"})
            continue
        with open(path, "w") as f:
            f.write(src.replace(old, new))
        try:
            built = subprocess.run(["cargo", "test", *TESTS, "--no-run"], capture_output=True, text=True,
                                   timeout=900)
            if built.returncode != 0:
                err = [ln for ln in built.stderr.splitlines() if ln.startswith("error")][:2]
                print(f"{mid}: build failed {err}", flush=True)
                results.append({"id": mid, "what": name, "status": "build", "error": err})
                continue
            t0 = time.monotonic()
            ran = subprocess.run(["timeout", "300", "cargo", "test", *TESTS, "--no-fail-fast"], capture_output=True,
                                 text=True)
            took = round(time.monotonic() - t0, 1)
            failed = re.findall(r"^test (\S+) \.\.\. FAILED", ran.stdout, re.M)
            status = "killed" if failed or ran.returncode != 0 else "SURVIVED"
            print(f"{mid}: {status} in {took} s {failed}", flush=True)
            results.append({"id": mid, "what": name, "status": status, "seconds": took, "failed": failed})
        finally:
            with open(path, "w") as f:
                f.write(src)
    return results


def main(argv: list[str]) -> int:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    results = run(argv)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if r["status"] != "killed"]
    print(f"{len(results) - len(bad)} of {len(results)} killed; not killed: {[r['id'] for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
