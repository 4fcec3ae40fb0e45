"""Multimodal helpers of the scheduler process: pure numpy, no transformers or PIL."""
