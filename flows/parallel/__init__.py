"""The generate step on Dask workers (`parallel.workers` > 1, or `parallel.address`): the rows
handed out in batches (handout.py) to parts, each an engine in a Dask worker that takes batches
as it frees up (parts.py), and the nested flow that runs them (generate.py); a local cluster's
workers load dask_worker.py first."""
