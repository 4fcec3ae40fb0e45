"""Model building blocks (linear, norm, rotary, attention, embeddings) and the tensor-parallel
state they read. They run in the scheduler process, on CPU (PyTorch) or CUDA (Triton kernels)."""
