"""Benchmarks run by ``pdd-transport bench ...``; ``pdd_transport.cli`` only parses
their arguments.

:mod:`pdd_transport.bench.handoff` measures the token-ID handoff (frame size against
the KV it replaces, round trips against pyzmq, handoffs through the WAN emulator; see
``docs/handoff.md``); :mod:`pdd_transport.bench.radix` the radix prefix cache on a
generated agentic workload (``docs/radix.md``); :mod:`pdd_transport.bench.stream` KV
streaming between two processes against baselines (iperf3, pyzmq PUSH/PULL, a plain
Python socket) measured in the same run, with :mod:`pdd_transport.bench.peer` its
receiving process; :mod:`pdd_transport.bench.soak` concurrent KV transfers and
handoffs through wanem for a bounded time, every page and token checked
(``docs/benchmarks.md``).
"""

from __future__ import annotations
