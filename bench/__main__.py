"""`python -m bench ARGS`: the throughput benchmark (bench/throughput.py), its table printed."""

from bench.throughput import main

main()
