"""Per-request sampling parameters, validated with SGLang's rules before anything is queued.

Each parameter's range is a rule of the table `SamplingParams.rules()` (engine/rules.py), which
verify() checks and the flows' sampling section derives its form from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engine.rules import Rule, table

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

    @staticmethod
    def rules() -> dict[str, Rule]:
        """Every parameter a caller may pass, {name: Rule}: its types, default and range, as
        verify() checks them (engine/rules.py). Forms elsewhere (the flows' config) derive
        theirs from it, so they cannot disagree with the engine."""
        return dict(_TABLE)

    # ------------------------------------------------------------------ validation
    def verify(self) -> None:
        """SGLang's rules; every message names the field, the allowed range and the value."""
        for name in _RANGES:
            if name != "stop_token_ids":  # (below, after the rules between parameters)
                self._check_range(name)
        if sum(g is not None for g in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}.")
        self._check_range("stop_token_ids")
        self._refuse_unbuilt()

    def _check_range(self, name: str) -> None:
        rule, value = _TABLE[name], getattr(self, name)
        if value is None and rule.optional:
            return
        most = self.max_new_tokens if self.max_new_tokens is not None else math.inf
        if not rule.accepts(value) or (name == "min_new_tokens" and value > most):
            words = rule.words().format(max_new_tokens=self.max_new_tokens)
            raise ValueError(f"{name} must be {words}, got {value}.")

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
# SGLang's range of each parameter that has one, in the order verify() checks them (the message
# says `allowed`); its types come from _USER_FIELDS, its default from its field
_RANGES: dict[str, Rule] = {
    "temperature": Rule(("non-negative and finite",), minimum=0, finite=True),
    "top_p": Rule(("in (0, 1]",), minimum=0, maximum=1, exclusive_minimum=True),
    "min_p": Rule(("in [0, 1]",), minimum=0, maximum=1),
    "top_k": Rule(("-1 (disable)", "at least 1"), minimum=1, also=(-1,)),
    "frequency_penalty": Rule(("in [-2, 2]",), minimum=-2, maximum=2),
    "presence_penalty": Rule(("in [-2, 2]",), minimum=-2, maximum=2),
    "repetition_penalty": Rule(("in (0, 2]",), minimum=0, maximum=2, exclusive_minimum=True),
    "max_new_tokens": Rule(("at least 0",), minimum=0),
    # NOTE: and at most max_new_tokens, a rule between two parameters (verify checks it)
    "min_new_tokens": Rule(("in [0, max_new_tokens({max_new_tokens})]",), minimum=0),
    "n": Rule(("at least 1",), minimum=1),
    "stream_interval": Rule(("at least 1",), minimum=1),
    "stop_token_ids": Rule(("non-negative token ids",), items=Rule(types=(int,), minimum=0)),
}
# every parameter a caller may pass, in field order: what verify() checks, what rules() gives
_TABLE = table(SamplingParams, _RANGES, _USER_FIELDS)


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
