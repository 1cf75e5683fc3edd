"""Benchmarks run by ``pdd-transport bench ...``.

:mod:`pdd_transport.bench.stream` measures KV streaming between two processes against
baselines (iperf3, pyzmq PUSH/PULL, a plain Python socket) measured in the same run;
:mod:`pdd_transport.bench.peer` is its receiving process. See ``docs/benchmarks.md``.
"""

from __future__ import annotations
