"""Token sampling: seeded, batch-independent draws with SGLang's filtering semantics."""

from engine.sampling.sampler import SamplingBatch, sample, seeded_uniform

__all__ = ["SamplingBatch", "sample", "seeded_uniform"]
