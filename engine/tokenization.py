"""The tokenizer, shared by every process: loading it, and decoding tokens to text incrementally.

The caller tokenizes prompts with it, the scheduler decodes to find stop strings, and the
detokenizer turns each request's tokens into text deltas.

A byte-level tokenizer may split one character over several tokens; decoding such a prefix
yields U+FFFD. The decoder therefore only releases text once it does not end in an
incomplete character, and decodes each step with a few tokens of context before the new ones
(so tokenizers that drop a leading space at the start of a decode still get spaces right).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

    from engine.server_args import ServerArgs

_INCOMPLETE = "\ufffd"


def load_tokenizer(args: ServerArgs) -> PreTrainedTokenizerBase:
    """The engine's tokenizer (tokenizer_path), as every process loads it; ValueError naming the field."""
    # NOTE: imported here: transformers costs ~1 s to import, and the scheduler process, which
    # imports this module, needs a tokenizer only for requests with stop strings or a grammar
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            args.tokenizer_path, trust_remote_code=args.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a tokenizer from tokenizer_path {args.tokenizer_path!r}: {e}"
        ) from None
    # The engine holds each prompt to the context length itself (an error naming it, or
    # allow_auto_truncate); the tokenizer's own limit would only print transformers' "Token
    # indices sequence length is longer than ..." warning for every long row. Transformers'
    # "no limit" value leaves that check nothing to warn about, and nothing calls the tokenizer
    # with truncation or max-length padding, the only other readers of the limit.
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


# the tokenizer classes whose decode is tokenizer.json's, as the `tokenizers` library runs it
_GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
_SPECIAL_FIELDS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")  # fmt: skip


class TokenizerJsonDecoder:
    """A folder's tokenizer.json, for decoding only: what the detokenizer process needs.

    NOTE: exactly transformers' decode for the tokenizers it accepts (`for_folder`): a generic
    fast tokenizer whose decode is the `tokenizers` library's, with no clean-up of spaces, and
    every special token the config names already special in tokenizer.json (transformers would
    otherwise mark or add it). Anything else loads transformers' tokenizer instead. Loading it
    costs ~0.1 s; importing transformers (which imports torch) costs ~3 s of one core on a
    small machine, at every engine start.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def for_folder(cls, folder: str, trust_remote_code: bool) -> TokenizerJsonDecoder | None:
        """The decoder of `folder`, or None where only transformers' tokenizer decodes exactly."""
        path, config_path = Path(folder) / "tokenizer.json", Path(folder) / "tokenizer_config.json"
        if not (path.is_file() and config_path.is_file()):
            return None
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            return None  # transformers reports what is wrong with the folder
        if (
            config.get("tokenizer_class") not in _GENERIC_CLASSES
            or config.get("clean_up_tokenization_spaces")
            or (trust_remote_code and config.get("auto_map"))
        ):
            return None
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception:  # the library's own error type; transformers reports it
            return None
        added = tokenizer.get_added_tokens_decoder().values()
        if not _special_tokens(config) <= {t.content for t in added if t.special}:
            return None
        return cls(tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: object) -> str:
        # (spaces_between_special_tokens: a slow tokenizer's option, which fast ones ignore)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _special_tokens(config: dict) -> set[str]:
    """The special tokens a tokenizer_config.json names."""
    named: list = [config.get(f) for f in _SPECIAL_FIELDS]
    for field in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(field) or []
        named += list(extra.values() if isinstance(extra, dict) else extra)
    named += [t for t in (config.get("added_tokens_decoder") or {}).values() if t.get("special")]
    found = set()
    for token in named:
        content = token.get("content") if isinstance(token, dict) else token
        if content:
            found.add(content)
    return found


def load_decoder(args: ServerArgs) -> TokenizerJsonDecoder | PreTrainedTokenizerBase:
    """What the detokenizer decodes with: the folder's tokenizer.json where that decodes as
    transformers does (TokenizerJsonDecoder), else transformers' tokenizer."""
    light = TokenizerJsonDecoder.for_folder(args.tokenizer_path, args.trust_remote_code)
    return light if light is not None else load_tokenizer(args)


class TokenizerOnDemand:
    """The scheduler's tokenizer, loaded the first time a request needs it (stop strings, a grammar).

    NOTE: most runs never need it there, and loading it imports transformers (~1.5 s of one core
    on a small machine), which every engine start would otherwise pay; the caller's process
    has loaded the same files already, so a bad tokenizer_path never gets this far.
    """

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self._tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def available(self) -> bool:
        return not self.args.skip_tokenizer_init

    def get(self) -> PreTrainedTokenizerBase:
        if not self.available:
            raise ValueError(
                "this needs the tokenizer, but the engine has skip_tokenizer_init=True"
            )
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.args)
        return self._tokenizer


class IncrementalDecoder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.ids: list[int] = []
        self.text = ""  # everything released so far
        self._prefix = 0  # ids[_prefix:_read] were decoded last time, as context
        self._read = 0

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the newly completed text ('' while a character is incomplete)."""
        self.ids.extend(new_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of a request: release what is pending, incomplete characters included."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        context = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) <= len(context) or (full.endswith(_INCOMPLETE) and not final):
            return ""
        delta = full[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs) if ids else ""


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `stops`."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> str | None:
    """The stop string completed by the last `new_chars` characters of `text`, if any."""
    for stop in stops:
        if stop in text[max(0, len(text) - new_chars - len(stop) + 1) :]:
            return stop
    return None
