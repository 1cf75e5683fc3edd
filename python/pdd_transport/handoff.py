"""Token-ID handoff for engines: RelayDecode (RLD) and MainDecode (MD) endpoints.

The protocol (One-Shot and Catch-Up, the guarantees, the timers) is described in
``docs/handoff.md``. This module is what an engine calls:

- :class:`RelayLink` on RLD: ``RelayLink.connect("md-host:7000")``; per request
  ``open``, ``offer`` after every decode step (it answers ``"keep_decoding"``,
  ``"last_token"`` or ``"refused"``), ``end_of_output``, ``set_load``; events
  :class:`StopDecoding`, :class:`HandoffFinished`, :class:`HandoffFailed`.
- :class:`MainLink` on MD: ``MainLink.listen("0.0.0.0:7000")``; per request ``open``,
  ``report_progress``; events :class:`Handoff` (token IDs to extend with, as a
  read-only numpy ``uint32`` array) and :class:`HandoffFailed`.
- :class:`HandoffPair`: both sides in one process on a manual clock, for engine tests;
  ``pair.relay`` and ``pair.main`` take the same calls as the connected ones.

Events come from ``next_event(timeout)`` (blocking, GIL released), ``poll_events()``
(non-blocking), ``await next_event_async()``, or :func:`iter_events`. Every call that
takes a lock or touches a socket releases the GIL. Errors are
:class:`pdd_transport.PddError` subclasses with a ``reason``; an error from an engine
call leaves the handoff unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, TypeAlias

from pdd_transport._native import (
    Handoff,
    HandoffFailed,
    HandoffFinished,
    HandoffPair,
    HandoffPolicy,
    HandoffTimers,
    MainLink,
    RelayLink,
    StopDecoding,
)

__all__ = [
    "Decision",
    "Handoff",
    "HandoffFailed",
    "HandoffFinished",
    "HandoffPair",
    "HandoffPolicy",
    "HandoffTimers",
    "MainEvent",
    "MainLink",
    "RelayEvent",
    "RelayLink",
    "StopDecoding",
    "iter_events",
]

Decision: TypeAlias = Literal["keep_decoding", "last_token", "refused"]
"""What :meth:`RelayLink.offer` answers."""

RelayEvent: TypeAlias = StopDecoding | HandoffFinished | HandoffFailed
"""Events RLD's engine receives."""

MainEvent: TypeAlias = Handoff | HandoffFailed
"""Events MD's engine receives."""


def iter_events(
    link: RelayLink | MainLink, *, timeout: float | None = None
) -> Iterator[RelayEvent | MainEvent]:
    """Yield events as they come; stop after ``timeout`` seconds without one (never,
    with ``None``) or once the link is closed."""
    while True:
        event = link.next_event(timeout)
        if event is None:
            return
        yield event
