"""Qwen2.5-VL: the Qwen2 decoder with multimodal RoPE, fed image embeddings by a vision tower.

A prefill with images: the runner (engine/runner/image_embedder.py) has the vision tower encode the
images whose tokens the step prefills (`encode_images`, engine/models/qwen2_5_vl_vision.py) and
hands the model an ImageBatch: which of the batch's token rows are image tokens, their
embeddings, and every token's three M-RoPE positions. The model embeds the tokens, puts the
image embeddings in their rows, and runs the Qwen2 decoder.

A decode step is the text model's, CUDA graphs included: a generated token's three positions
are equal (its sequence index plus the request's rope delta), so it takes plain RoPE; the model
keeps each request row's delta, written by the request's prefill, and adds it on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from engine.batch.forward_batch import ForwardMode
from engine.layers.rotary import MRotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer

if TYPE_CHECKING:
    from engine.batch.forward_batch import ForwardBatch

# the vision tower's tensors in checkpoints: older ones and transformers 5's own names
_VISION_PREFIXES = ("model.visual.", "visual.")
_TEXT_PREFIX = "model.language_model."  # (transformers 5) -> "model."


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.visual = Qwen2_5_VisionTransformer(config.vision_config)
        # NOTE: each request row's rope delta, written by its prefill, read by its decode steps
        # (a graph replay reads it in place); sized by set_request_rows before the first step
        self.register_buffer("rope_deltas", torch.zeros(1, dtype=torch.int64), persistent=False)

    def make_rotary(self, config: ModelConfig) -> MRotaryEmbedding:
        if config.mrope_section is None:
            raise ValueError(
                "config.json has no mrope_section (rope_scaling / rope_parameters): "
                "Qwen2.5-VL needs its multimodal RoPE sections"
            )
        return MRotaryEmbedding(
            config.head_dim, config.context_length, config.rope_theta, config.rope_scaling,
            config.mrope_section,
        )  # fmt: skip

    def set_request_rows(self, rows: int) -> None:
        """Room for the rope delta of every request row of the request->slot table."""
        self.rope_deltas = torch.zeros(rows, dtype=torch.int64, device=self.rope_deltas.device)

    # ------------------------------------------------------------------ forward
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches of one or more images -> one embedding per image token, in image order."""
        return self.visual(pixel_values.to(self.embed_tokens.weight.dtype), grid_thw)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        images = batch.images
        if batch.mode is ForwardMode.DECODE:
            positions = positions + self.rope_deltas[batch.req_pool_indices]
            return self.decode_layers(self.embed_tokens(input_ids), positions, batch)
        if images is None:  # a text-only prefill built without the runner (warm-up)
            return self.decode_layers(self.embed_tokens(input_ids), positions, batch)
        self.rope_deltas[batch.req_pool_indices] = images.rope_deltas
        # image tokens arrive as their prefix-cache ids, past the vocabulary: their rows are
        # replaced below, so any id in range will do for the lookup
        x = self.embed_tokens(input_ids.clamp(max=self.config.vocab_size - 1))
        x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        return self.decode_layers(x, images.rope_positions, batch)

    # ------------------------------------------------------------------ weights
    def text_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in super().text_parameters().items() if not n.startswith("visual.")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: list[tuple[str, torch.Tensor]] = []

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            """The decoder's tensors, streamed on; the vision tower's set aside (it is small)."""
            for name, tensor in weights:
                prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    vision.append((name[len(prefix) :], tensor))
                elif name.startswith(_TEXT_PREFIX):
                    yield "model." + name[len(_TEXT_PREFIX) :], tensor
                else:
                    yield name, tensor

        super().load_weights(text_weights())
        loaded = self.visual.load_weights(vision)
        missing = sorted(n for n, _ in self.visual.named_parameters() if n not in loaded)
        if missing:
            raise ValueError(
                f"the checkpoint is missing vision weights: visual.{', visual.'.join(missing[:8])}"
            )
