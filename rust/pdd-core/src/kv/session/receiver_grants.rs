//! The receiver's grants: reserving pool pages (or sub-page units) for a transfer,
//! and announcing it (KV_GRANT, and the local path's LOCAL_GRANT). A child of
//! `receiver`, so it works on the same endpoint's state.

use super::*;

impl ReceiverEndpoint {
    /// Reserve pages for a transfer of `request_id` to session `peer` and queue its
    /// KV_GRANT; with a deadline, the transfer fails `deadline_exceeded` if it is not
    /// complete in time. `random` draws transfer ids (unguessable where the peer is
    /// untrusted) until one is free.
    #[allow(clippy::too_many_arguments)]
    pub fn grant(
        &mut self,
        peer: u64,
        request_id: u64,
        pages: &[u32],
        layer_count: u16,
        deadline: Option<Duration>,
        now: Timestamp,
        random: impl FnMut() -> u64,
    ) -> Result<KvGrant> {
        let units = GrantUnits::default();
        self.grant_units(
            peer,
            request_id,
            pages,
            layer_count,
            units,
            deadline,
            now,
            random,
        )
    }

    /// [`grant`](Self::grant) of `pages` counted in `units` (sub-page units, a first
    /// pool layer: [`ReceiverState::grant_units_to`]).
    #[allow(clippy::too_many_arguments)]
    pub fn grant_units(
        &mut self,
        peer: u64,
        request_id: u64,
        pages: &[u32],
        layer_count: u16,
        units: GrantUnits,
        deadline: Option<Duration>,
        now: Timestamp,
        random: impl FnMut() -> u64,
    ) -> Result<KvGrant> {
        let grant = self.reserve_units(
            peer,
            request_id,
            pages,
            layer_count,
            units,
            deadline,
            random,
        )?;
        self.announce(grant.transfer_id, None, now)?;
        Ok(grant)
    }

    /// [`grant`](Self::grant) without queueing the KV_GRANT: for a path that must
    /// prepare something first (the local path registers the pages), then calls
    /// [`announce`](Self::announce). Until then the peer knows nothing of it: a
    /// failure sends no ABORT, and no deadline runs.
    pub fn reserve(
        &mut self,
        peer: u64,
        request_id: u64,
        pages: &[u32],
        layer_count: u16,
        deadline: Option<Duration>,
        random: impl FnMut() -> u64,
    ) -> Result<KvGrant> {
        let units = GrantUnits::default();
        self.reserve_units(
            peer,
            request_id,
            pages,
            layer_count,
            units,
            deadline,
            random,
        )
    }

    /// [`reserve`](Self::reserve) of `pages` counted in `units`
    /// ([`ReceiverState::grant_units_to`]).
    #[allow(clippy::too_many_arguments)]
    pub fn reserve_units(
        &mut self,
        peer: u64,
        request_id: u64,
        pages: &[u32],
        layer_count: u16,
        units: GrantUnits,
        deadline: Option<Duration>,
        mut random: impl FnMut() -> u64,
    ) -> Result<KvGrant> {
        let session = self.session(peer).ok_or_else(|| Error::ConnectionLost {
            detail: format!("peer {peer} is not connected"),
        })?;
        if let Some(reason) = self.declined.get(&(peer, request_id)) {
            return Err(Error::Refused {
                message: format!("peer {peer} declined request {request_id}: {reason}"),
            });
        }
        self.check_layout_known(session)?;
        let caps = self.capabilities(session).unwrap_or(0);
        if pages.is_empty() && caps & capability::EMPTY_GRANT == 0 {
            // An older sender would take a 0-page KV_GRANT as a protocol error.
            return Err(Error::InvalidArgument(format!(
                "peer {peer} does not accept an empty grant (capability empty_grant): \
                 grant at least one page"
            )));
        }
        // The sender finds its grant by request id: two live grants of one request to
        // one session would be ambiguous (and, with hashed string keys, a collision
        // must not mix two requests).
        if self
            .transfers_of(session)
            .into_iter()
            .any(|id| self.state.request_of(id) == Some(request_id))
        {
            return Err(Error::InvalidArgument(format!(
                "request {request_id} already has a live grant to peer {peer}"
            )));
        }
        let mut draws = 0;
        let transfer_id = loop {
            let id = random();
            if !self.state.id_in_use(id) {
                break id;
            }
            draws += 1;
            if draws == ID_DRAWS {
                return Err(Error::InvalidArgument(
                    "no free transfer id drawn: the id source repeats itself".into(),
                ));
            }
        };
        let deadline_ms =
            deadline.map_or(0, |d| d.as_millis().clamp(1, u128::from(u32::MAX)) as u32);
        let grant = self.state.grant_units_to(
            session.generation,
            transfer_id,
            request_id,
            pages,
            layer_count,
            deadline_ms,
            units,
        )?;
        self.transfers.insert(
            transfer_id,
            TransferMeta {
                owner: session,
                announced: false,
                deadline,
                tail: None,
            },
        );
        Ok(grant)
    }

    /// Queue the KV_GRANT of a transfer [`reserve`](Self::reserve)d, then `extra`
    /// (the local path's LOCAL_GRANT), and start its deadline. `Err` if it ended
    /// meanwhile (its session did).
    pub fn announce(
        &mut self,
        transfer_id: u64,
        extra: Option<Frame>,
        now: Timestamp,
    ) -> Result<()> {
        let (Some(meta), Some(grant)) = (
            self.transfers.get_mut(&transfer_id),
            self.state.grant_of(transfer_id),
        ) else {
            return Err(Error::ConnectionLost {
                detail: format!("transfer {transfer_id} ended before its grant was sent"),
            });
        };
        if meta.announced {
            return Err(Error::InvalidArgument(format!(
                "transfer {transfer_id} was announced already"
            )));
        }
        meta.announced = true;
        self.transmit
            .push_back((meta.owner, Frame::KvGrant(grant.clone())));
        if let Some(f) = extra {
            self.transmit.push_back((meta.owner, f));
        }
        if let Some(d) = meta.deadline {
            self.queue
                .set(Timer::Deadline(transfer_id), now.saturating_add(d));
        }
        Ok(())
    }
}
