"""Prompts to token ids in the caller, a long instruction that many prompts share tokenized once.

Flows send thousands of prompts that start with the same instruction (a system prompt or few-shot
examples of 2-5 KB) and end with a short per-row item. Tokenizing each whole prompt costs about a
millisecond of the caller's CPU per prompt, nearly all of it on the instruction.

`PromptTokens` finds such instructions itself: a prompt that shares at least MIN_PREFIX_CHARS
leading characters with one of the last few prompts registers that shared start, cut back to a
point where the tokenizer splits, with its ids (a small LRU of MAX_PREFIXES). A later prompt that
starts with a registered prefix is encoded as the prefix's ids + the rest's, where
`SeamRules.joins` (token_seam.py) shows the cut to be exact; any other prompt is tokenized whole.
Lists are encoded in batch calls of the fast tokenizer, rests and whole prompts apart.

NOTE: the ids are always exactly `tokenizer.encode(prompt)`. Prompts are cut only for a plain HF
fast tokenizer whose components token_seam.py admits, and a registration first checks the cut on
the prompt that registered it against the whole prompt's ids: a mismatch turns cutting off.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.frontend.token_seam import PrefixTail, SeamRules

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MIN_PREFIX_CHARS = 256  # a shared start shorter than this is not worth a registration
MAX_PREFIXES = 8
RECENT_PROMPTS = 4  # unmatched prompts a new one is compared with
_CUT_TRIES = 8  # cut points tried, from the shared start's end backwards
_CUT_WINDOW = 256  # characters at the shared start's end pre-tokenized for cut points
_BACKOFF_PROMPTS = 32  # prompts not compared after a registration that found no cut
# typical starts of a row's item, to choose among cut points (only a choice: each row is checked)
_PROBES = ("a", " a", "A", " A", "1", " 1", "\n", "\n\n", " ", "-", " -", '"', " (", ":")
# the methods between tokenizer.encode and its backend's encode_batch
_ENCODE_METHODS = ("encode", "encode_plus", "_encode_plus", "_batch_encode_plus", "__call__",
                   "_call_one")  # fmt: skip


@dataclass
class PromptTokenStats:
    split: int = 0  # prompts encoded as a registered prefix's ids + their rest's
    whole: int = 0  # prompts tokenized whole
    registered: int = 0  # prefixes registered


@dataclass(frozen=True)
class _Prefix:
    text: str
    ids: list[int]  # tokenizer.encode(text): with the special tokens it starts with
    tail: PrefixTail


class PromptTokens:
    """The caller's prompt tokenizer: `encode_batch(prompts)[i] == tokenizer.encode(prompts[i])`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.stats = PromptTokenStats()
        self._backend = _plain_backend(tokenizer)  # None: tokenizer.encode, one prompt at a time
        self._rules: SeamRules | None = None
        self.refused: str | None = None  # why no prompt is ever cut for this tokenizer
        self._vocab_size = -1
        self._prefixes: OrderedDict[str, _Prefix] = OrderedDict()  # least recently used first
        self._recent: deque[str] = deque(maxlen=RECENT_PROMPTS)
        self._backoff = 0
        self._lock = threading.Lock()  # (generate may be called from several threads)
        if self._backend is None:
            self.refused = "not a plain HF fast tokenizer"
        else:
            self._load_rules()

    def encode(self, prompt: str) -> list[int]:
        return self.encode_batch([prompt])[0]

    def encode_batch(self, prompts: list[str]) -> list[list[int]]:
        if self._backend is None or self.tokenizer.split_special_tokens:
            self.stats.whole += len(prompts)
            return [self.tokenizer.encode(p) for p in prompts]
        out: list[Any] = [None] * len(prompts)
        cut: list[tuple[int, _Prefix]] = []
        whole: list[int] = []
        with self._lock:
            if self._backend.get_vocab_size(with_added_tokens=True) != self._vocab_size:
                self._load_rules()  # tokens were added: stage 1's matchers are new
            for i, prompt in enumerate(prompts):
                plan = self._plan(prompt)
                if isinstance(plan, _Prefix):
                    cut.append((i, plan))
                elif plan is None:
                    whole.append(i)
                else:
                    out[i] = plan  # (the registering prompt, tokenized whole to check the cut)
            self.stats.split += len(cut)
            self.stats.whole += len(prompts) - len(cut)
        rests = [prompts[i][len(p.text) :] for i, p in cut]
        rest_ids = iter(self._encode([r for r in rests if r], specials=False))
        for (i, prefix), rest in zip(cut, rests):
            out[i] = prefix.ids + next(rest_ids) if rest else list(prefix.ids)
        for i, ids in zip(whole, self._encode([prompts[i] for i in whole], specials=True)):
            out[i] = ids
        return out

    # ------------------------------------------------------------------ prefixes
    def _plan(self, prompt: str) -> _Prefix | list[int] | None:
        """The registered prefix to cut `prompt` after, its ids if a registration tokenized it
        whole, or None: tokenize it whole."""
        if self._rules is None:
            return None
        prefix = None
        for p in self._prefixes.values():  # the longest registered prefix it starts with
            if (prefix is None or len(p.text) > len(prefix.text)) and prompt.startswith(p.text):
                prefix = p
        if prefix is not None:
            self._prefixes.move_to_end(prefix.text)
            return prefix if self._rules.joins(prefix.tail, prompt[len(prefix.text) :]) else None
        if len(prompt) < MIN_PREFIX_CHARS:
            return None
        if self._backoff:
            self._backoff -= 1
            return None
        for other in self._recent:
            shared = _shared_length(prompt, other)
            if shared >= MIN_PREFIX_CHARS:
                return self._register(prompt, other, shared)
        self._recent.append(prompt)
        return None

    def _register(self, prompt: str, other: str, shared: int) -> list[int] | None:
        """Register a prefix of `prompt[:shared]` that both prompts can be cut after; `prompt`'s
        ids (tokenized whole, to check the cut against) if one was."""
        rules = self._rules
        assert rules is not None
        best: tuple[int, int, PrefixTail] | None = None  # (probes that join, cut, tail)
        for cut in self._cut_points(prompt, shared):
            tail = rules.tail(prompt[:cut])
            if rules.joins(tail, prompt[cut:]) and rules.joins(tail, other[cut:]):
                # NOTE: the cut is chosen for the rows to come, not only these two: the one that
                # most typical starts of an item join (a cut after a space joins few: the space
                # belongs to the next word), the longest of those
                score = sum(rules.joins(tail, probe) for probe in _PROBES)
                if best is None or score > best[0]:
                    best = (score, cut, tail)
        if best is not None:
            _, cut, tail = best
            prefix = prompt[:cut]
            ids, plain = self._encode([prefix], specials=True)[0], self._encode([prefix])[0]
            whole = self._encode([prompt], specials=True)[0]
            rest = self._encode([prompt[cut:]])[0] if cut < len(prompt) else []
            front = len(ids) - len(plain)
            if front < 0 or ids[front:] != plain:
                self._refuse("the post-processor adds special tokens after the text")
            elif ids + rest != whole:
                # NOTE: token_seam.py's rules do not hold for this tokenizer: never cut again
                self._refuse(f"a cut after {cut} characters changed the prompt's tokens")
            else:
                self._prefixes[prefix] = _Prefix(prefix, ids, tail)
                if len(self._prefixes) > MAX_PREFIXES:
                    self._prefixes.popitem(last=False)
                self.stats.registered += 1
            return whole
        self._backoff = _BACKOFF_PROMPTS
        return None

    def _cut_points(self, prompt: str, shared: int) -> list[int]:
        """Where the shared start could end: its end, then the starts of its last pre-tokens."""
        assert self._backend is not None
        start = max(MIN_PREFIX_CHARS, shared - _CUT_WINDOW)
        pieces = self._backend.pre_tokenizer.pre_tokenize_str(prompt[start:shared])
        cuts = [shared] + [start + s for _, (s, _) in reversed(pieces) if s > 0]
        return sorted(set(cuts), reverse=True)[:_CUT_TRIES]

    # ------------------------------------------------------------------ the tokenizer
    def _encode(self, texts: list[str], specials: bool = False) -> list[list[int]]:
        """The backend's ids of `texts`, as tokenizer.encode gives them."""
        backend = self._backend
        assert backend is not None
        if not texts:
            return []
        # NOTE: what transformers sets before each encode of its own: special tokens matched as
        # such (split_special_tokens is False here), no truncation, no padding
        if backend.encode_special_tokens:
            backend.encode_special_tokens = False
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        if len(texts) == 1:
            return [backend.encode(texts[0], add_special_tokens=specials).ids]
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=specials)]

    def _load_rules(self) -> None:
        assert self._backend is not None
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._prefixes.clear()
        self._recent.clear()
        rules = SeamRules.for_tokenizer(self._backend)
        self._rules, self.refused = (None, rules) if isinstance(rules, str) else (rules, None)
        if self.refused:
            logger.debug("prompts are tokenized whole: %s", self.refused)

    def _refuse(self, why: str) -> None:
        logger.warning("shared prompt prefixes are no longer tokenized apart: %s", why)
        self._rules, self.refused = None, why
        self._prefixes.clear()


def _plain_backend(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers` backend of a fast tokenizer whose encode is its backend's, unchanged by
    its class (a subclass that overrides how text is encoded gets None)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    from transformers import PreTrainedTokenizerFast  # (loaded already: it made `tokenizer`)

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    for name in _ENCODE_METHODS:
        if getattr(cls, name, None) is not getattr(PreTrainedTokenizerFast, name, None):
            return None
    return backend


def _shared_length(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share, if at least MIN_PREFIX_CHARS (else 0)."""
    if a[:MIN_PREFIX_CHARS] != b[:MIN_PREFIX_CHARS] or min(len(a), len(b)) < MIN_PREFIX_CHARS:
        return 0
    low, high = MIN_PREFIX_CHARS, min(len(a), len(b))  # a[:low] == b[:low]
    while low < high:  # (slices compared in C: O(length) in all, no Python loop per character)
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low
