"""gristmill's flows: the engine's work as resumable Prefect flows, and the `gristmill` command.

At the top, what a user names: the command (cli.py), the config (config.py, engine_sections.py),
the flows by name (catalog.py), the steps every flow runs (pipeline.py) and the flows themselves
(annotate.py, synthesize.py, evaluate.py, openai_batch.py), each a deployment's entrypoint. Below
them, by concern, each folder using only those below it: parallel/ (generate on Dask workers)
over engines/ (which engine, the rows through it) over run/ (checks, identity, locks, the plan)
over inputs/ (the source, a row's image and prompt) and outputs/ (the checkpoint store, the
output row, the merge); openai_files/ (OpenAI batch files) over inputs/.
"""
