"""The demo model's tokenizer: a small byte-level BPE trained on the generated corpus, offline.

Digits are split one per token before BPE (as Qwen and Llama 3 do), so "82" is always "8" "2"
and the model can learn arithmetic digit by digit. No BOS and no post-processor: encoding the
chat-template text gives exactly the ids the model was trained on, whether or not the caller
asks for special tokens to be added (the engine calls ``tokenizer.encode(prompt)``).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from demo import data

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
VOCAB_SIZE = 1024

# ChatML, as Qwen's instruct models use it; a system message is optional.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_tokenizer(seed: int, corpus_size: int = 4000) -> PreTrainedTokenizerFast:
    """Train the BPE on ``corpus_size`` generated training examples; deterministic for a seed."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(data.corpus(seed, corpus_size), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,  # what an assistant turn ends with, so generation stops there
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
