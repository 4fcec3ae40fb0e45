"""gristmill's benchmarks: the throughput benchmark (`python -m bench`, bench/throughput.py) and
the measurements behind docs/performance.md, each `python -m bench.<name>` (bench/README.md is
the index).

The top of the import graph: a benchmark may import engine/, flows/ and kernels/ (internals
included), and none of them imports bench/ (tests/test_architecture.py).
"""
