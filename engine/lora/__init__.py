"""LoRA adapters on the base model: PEFT folders read and checked (adapter.py), their weights
in fixed device buffers of `max_loras_per_batch` slots (pool.py), and the layers that add an
adapter's low-rank update to the base projection for each request's tokens (layer.py)."""

# the projections an adapter may target, by their Hugging Face names (NOTE: here, in a module
# without torch: ServerArgs checks lora_target_modules against it in the caller's process)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
