"""Benchmarks (pytest-benchmark). A package so that its modules may share basenames
with tests/ (test_bench_stream.py is in both) in one pytest run."""
