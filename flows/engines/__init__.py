"""The flows' side of the engine: which engine a run uses, a resident one or its own
(resident.py), the rows through it, at most max_in_flight at a time (generation.py), their
progress (progress.py), and `gristmill engine` start, status and stop (cli.py)."""
