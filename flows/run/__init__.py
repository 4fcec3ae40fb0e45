"""A run, around its rows: checked against the world before anything costly starts
(preflight.py), its identity, which the fingerprint hashes (identity.py), its config's paths made
absolute for other processes (paths.py) and its engines' GPUs on a local cluster (gpus.py), its
locks (lock.py), the plan its steps hand on (plan.py); and in the command's process, Ctrl-C
(interrupts.py) and a temporary Prefect server (prefect_server.py)."""
