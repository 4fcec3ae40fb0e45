"""A run's input: its rows read and checked (sources.py: a file, a folder of them or a Hugging
Face dataset; batches.py: one file a piece at a time, its bytes hashed as they pass; file.py:
one file whole, and the message that names a bad file's line; summary.py: what a run keeps of
its input without its rows; hf_datasets.py: Hugging Face datasets in and out), a row's image
(image_column.py: `prompt.image_column`) and a row's prompt (prompts.py)."""
