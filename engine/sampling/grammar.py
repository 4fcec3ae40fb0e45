"""Constrained output through xgrammar: the json_schema, regex and ebnf sampling parameters.

Three parts, in the two processes that need them:
  - `check_grammar` runs in the caller's process (InputProcessor): it parses the grammar, which
    needs no tokenizer and takes well under a millisecond, so a bad schema, regex or EBNF raises
    a ValueError naming its field before anything of the call is queued.
  - `GrammarBackend` lives in the scheduler: the tokenizer's xgrammar view (TokenizerInfo) is
    built once, each distinct (kind, text) compiled once, and each constrained request gets its
    own GrammarMatcher in `req.grammar` when it arrives. Per sampled token the matcher accepts
    it, and a terminated matcher finishes the request.
  - `GrammarMasks` lives in the model runner's logits step: per step the matchers fill a token
    bitmask for the constrained sampling rows, applied to the logits before sampling.

NOTE: a mask needs its matcher to have accepted every token drawn before it. With overlap
scheduling the scheduler therefore reads a step that drew for a constrained request before it
plans the next one (`LaunchedStep.constrained`); batches without one stay fully overlapped.

xgrammar is imported on first use: an engine that never sees a grammar never pays for it.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.batch.req import Req
    from engine.sampling_params import SamplingParams
    from engine.server_args import ServerArgs
    from engine.tokenization import TokenizerOnDemand

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# distinct compiled grammars kept per engine (least recently used dropped first)
COMPILED_CACHE_SIZE = 1024
_VALIDATED_CACHE_SIZE = 1024
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def grammar_key(sp: SamplingParams) -> tuple[str, str] | None:
    """(field, text) of the request's grammar, or None for a free request (at most one is set)."""
    for name in GRAMMAR_FIELDS:
        text = getattr(sp, name)
        if text is not None:
            return name, text
    return None


def check_grammar(sp: SamplingParams, has_tokenizer: bool) -> None:
    """Caller's process: refuse a grammar that does not parse, naming the field."""
    key = grammar_key(sp)
    if key is None:
        return
    if not has_tokenizer:
        raise ValueError(
            f"{key[0]} needs the tokenizer to constrain tokens, but the engine was started with "
            "skip_tokenizer_init=True; start it without skip_tokenizer_init to use "
            "json_schema, regex or ebnf."
        )
    error = _parse_error(*key)
    if error is not None:
        raise ValueError(f"{key[0]} is not a valid {_WHAT[key[0]]}: {error}")


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}


@functools.lru_cache(maxsize=_VALIDATED_CACHE_SIZE)
def _parse_error(kind: str, text: str) -> str | None:
    try:
        _parse(kind, text)
    except Exception as e:  # xgrammar raises RuntimeError (and others) from C++
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return _CPP_PREFIX.sub("", lines[0] if lines else type(e).__name__)
    return None


def _parse(kind: str, text: str, any_whitespace: bool = True) -> Any:
    import xgrammar as xgr

    if kind == "json_schema":
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        # NOTE: xgrammar 0.2 lets a string with minLength/maxLength hold raw control characters,
        # which JSON forbids (json.loads refuses them); its other strings exclude them already
        ebnf = str(grammar)
        strict = ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
        return grammar if strict == ebnf else xgr.Grammar.from_ebnf(strict)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


class GrammarBackend:
    """The scheduler's grammars: compile cache, a matcher per constrained request, and feeding
    it the sampled tokens."""

    def __init__(self, args: ServerArgs, tokenizer: TokenizerOnDemand, vocab_size: int) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's, maybe padded)
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.compilations = 0  # distinct grammars compiled so far (for tests and stats)
        self._row: Any = None  # one bitmask row, for forced_tokens

    def attach(self, req: Req) -> None:
        """Give a constrained request its matcher (the request arrived in this process)."""
        import xgrammar as xgr

        key = grammar_key(req.sampling)
        compiled = self._compile(key)
        stops = sorted(req.sampling.stop_ids)
        req.grammar = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)

    def accept(self, req: Req, token: int) -> bool:
        """Feed a sampled token to the request's matcher; True when that finished the request.

        A terminated matcher ends the request as SGLang does: by length if the token was its
        last anyway, else stop on the matched token."""
        if not req.grammar.accept_token(token):
            # only a token the mask forbade gets here, e.g. a stop id min_new_tokens suppressed
            req.finish(
                {
                    "type": "abort",
                    "message": f"token {token} does not match the request's {grammar_key(req.sampling)[0]}",
                }
            )
            return True
        if req.grammar.is_terminated():
            n = len(req.output_ids)
            if n >= req.draw_limit:
                req.finish({"type": "length", "length": n})
            else:
                req.finish({"type": "stop", "matched": token})
            return True
        return False

    def forced_tokens(self, req: Req, limit: int) -> list[int]:
        """The tokens the request's grammar allows one way only from where its matcher stands,
        up to `limit` of them (speculative decoding's free drafts: a JSON key, punctuation).
        A token that would end the grammar is left to the model's draw. The matcher is left as
        it was found."""
        matcher, forced = req.grammar, []
        mask = self._mask_row()
        while len(forced) < limit and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask, 0)
            allowed = np.flatnonzero(
                np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
            )
            if len(allowed) != 1 or int(allowed[0]) >= self.vocab_size:
                break
            token = int(allowed[0])
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():  # (the model's draw ends it, as without speculation)
                matcher.rollback(1)
                break
            forced.append(token)
        if forced:
            matcher.rollback(len(forced))
        return forced

    def _mask_row(self) -> Any:
        if self._row is None:
            import xgrammar as xgr

            self._row = xgr.allocate_token_bitmask(1, self.vocab_size)
        return self._row

    def _compile(self, key: tuple[str, str]) -> Any:
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        any_whitespace = not self.args.constrained_json_disable_any_whitespace
        compiled = self._get_compiler().compile_grammar(_parse(*key, any_whitespace))
        self.compilations += 1
        self._compiled[key] = compiled
        if len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            if not self.tokenizer.available:
                raise ValueError("constrained output needs the tokenizer (skip_tokenizer_init)")
            tokenizer = self.tokenizer.get()
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
        return self._compiler


class GrammarMasks:
    """The model runner's half: each step, mask the logits rows of constrained requests with
    what their matchers allow next."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._bitmask: torch.Tensor | None = None  # host rows, reused every step

    def apply(self, reqs: list[Req], logits: torch.Tensor) -> bool:
        """Mask logits row i for reqs[i] if it is constrained; True when any row was."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return False
        import xgrammar as xgr

        bitmask = self._host_bitmask(len(reqs))
        fill = [i for i in rows if reqs[i].grammar.fill_next_token_bitmask(bitmask, i)]
        if fill:
            mask = bitmask[: len(reqs)]
            if logits.is_cuda:
                # NOTE: the pinned rows are refilled only after this step was read (the scheduler
                # reads a constrained step before planning the next), so the copy is done by then
                mask = mask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=fill)
        return True

    def _host_bitmask(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            mask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
            self._bitmask = mask.pin_memory() if self.device.type == "cuda" else mask
        return self._bitmask
