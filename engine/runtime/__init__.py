"""The multi-process runtime: the scheduler and detokenizer subprocesses and what travels between them."""
