"""What a run writes: the checkpoint store of shards, output.parquet and the run's files
(store.py), the output row's columns and types (rows.py), and the shards merged back in input
order (merge.py)."""
