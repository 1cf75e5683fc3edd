"""Pieces of the ``pdd-transport demo`` end-to-end run: the driver
(:mod:`~pdd_transport.demo.run`), the role processes (:mod:`~pdd_transport.demo.node`),
the workload (:mod:`~pdd_transport.demo.workload`), the TTFT plot drawn with matplotlib
(:mod:`~pdd_transport.demo.plot`) and the figures file the documents quote
(:mod:`~pdd_transport.demo.figures`)."""
