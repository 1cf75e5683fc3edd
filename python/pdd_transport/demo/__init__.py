"""Pieces of the ``pdd-transport demo`` end-to-end run (issue 6). Today: the
dependency-free PNG plot of latency CDFs (:mod:`pdd_transport.demo.plot`)."""
