"""`python -m bench ARGS`: the throughput benchmark (bench/throughput.py), its table printed;
`python -m bench --preset trtllm ARGS`: TensorRT-LLM's published shapes (bench/trtllm.py)."""

import sys

if sys.argv[1:3] == ["--preset", "trtllm"]:
    from bench.trtllm import main

    main(sys.argv[3:])
elif "--preset" in sys.argv[1:]:
    sys.exit("python -m bench: --preset takes one value, trtllm, and comes first")
else:
    from bench.throughput import main

    main()
