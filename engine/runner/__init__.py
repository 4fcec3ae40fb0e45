"""The scheduler process's device side: the model runner (weights, KV pool tensors, one forward
and the one logits step per scheduler step), decode CUDA graphs, the weight loader, and the
embedding runner. The scheduler calls it once per step and gets tokens back."""
