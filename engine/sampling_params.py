"""Per-request sampling parameters, validated with SGLang's rules before anything is queued."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# A temperature below this samples greedily, as in SGLang.
_GREEDY_EPS = 1e-6


@dataclass
class SamplingParams:
    # None: as many as the context leaves after the prompt (SGLang's scheduler does the same);
    # the caller's InputProcessor settles it once the prompt is tokenized
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    # Filled by the engine: the union of stop_token_ids and the model's EOS ids (unless ignore_eos).
    stop_ids: frozenset[int] = field(default=frozenset(), repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; unknown keys and wrong types raise ValueError naming the key."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}.")
        allowed = _USER_FIELDS
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(
                f"Unknown sampling parameter(s): {', '.join(map(repr, unknown))}. "
                f"Allowed: {', '.join(sorted(allowed))}."
            )
        for key, value in params.items():
            _check_type(key, value, allowed[key])
        sp = cls(**params)
        sp.verify()
        return sp

    # ------------------------------------------------------------------ validation
    def verify(self) -> None:
        """SGLang's rules; every message names the field, the allowed range and the value."""
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(
                f"temperature must be non-negative and finite, got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}."
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        most = self.max_new_tokens if self.max_new_tokens is not None else math.inf
        if not 0 <= self.min_new_tokens <= most:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}."
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if sum(g is not None for g in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}.")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}."
            )
        self._refuse_unbuilt()

    def _refuse_unbuilt(self) -> None:
        """Refuse, by name, what this version does not do yet, rather than silently ignore it."""
        unbuilt = {
            "structural_tag": self.structural_tag is not None,
        }
        used = [name for name, on in unbuilt.items() if on]
        if used:
            raise ValueError(
                f"Sampling parameter(s) {', '.join(used)} are not supported by this engine version yet."
            )

    def verify_vocab(self, vocab_size: int) -> None:
        for key, bias in (self.logit_bias or {}).items():
            token = _token_id(key)
            if token is None or not 0 <= token < vocab_size:
                raise ValueError(
                    f"logit_bias keys must be token ids in [0, {vocab_size}) (as str or int), got {key!r}."
                )
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not math.isfinite(bias)
            ):
                raise ValueError(
                    f"logit_bias values must be finite numbers, got {bias!r} for {key!r}."
                )
        if self.stop_token_ids is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be < vocab size {vocab_size}, got {self.stop_token_ids}."
            )

    # ------------------------------------------------------------------ derived values
    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def with_stop_ids(self, eos_ids: frozenset[int]) -> SamplingParams:
        ids = frozenset(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids |= eos_ids
        return dataclasses.replace(self, stop_ids=ids)


# Types a user may pass per field (bool is rejected where a number is expected).
_NUM = (int, float)
_USER_FIELDS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int, type(None)),
    "min_new_tokens": (int,),
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": (int,),
    "min_p": _NUM,
    "frequency_penalty": _NUM,
    "presence_penalty": _NUM,
    "repetition_penalty": _NUM,
    "stop": (str, list, type(None)),
    "stop_token_ids": (list, type(None)),
    "ignore_eos": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "no_stop_trim": (bool,),
    "n": (int,),
    "sampling_seed": (int, type(None)),
    "json_schema": (str, type(None)),
    "regex": (str, type(None)),
    "ebnf": (str, type(None)),
    "structural_tag": (str, type(None)),
    "logit_bias": (dict, type(None)),
    "custom_params": (dict, type(None)),
    "stream_interval": (int, type(None)),
}


def _token_id(key: Any) -> int | None:
    """A logit_bias key: a token id as int or decimal str (SGLang's JSON form)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return None


def _check_type(key: str, value: Any, types: tuple[type, ...]) -> None:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if ok and key == "stop_token_ids" and value is not None:
        ok = all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if ok and key == "stop" and isinstance(value, list):
        ok = all(isinstance(s, str) for s in value)
    if not ok:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ValueError(
            f"sampling parameter {key!r} must be {names}, got {value!r} ({type(value).__name__})."
        )
