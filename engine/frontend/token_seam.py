"""Whether a prompt cut into a known prefix and a rest tokenizes as the two parts do.

`tokenizer.encode(prefix + rest)` equals `encode(prefix) + encode(rest, add_special_tokens=False)`
exactly when no stage of the tokenizer joins the two parts across the cut (the seam). An HF fast
tokenizer (the `tokenizers` library) encodes a text in four stages:

1. added tokens (`<|im_start|>`, ...) are cut out of the raw text, leftmost-longest (tokens marked
   `normalized` in a second pass over the normalized text between the first pass's tokens);
2. each piece between them is normalized;
3. the pre-tokenizer splits each piece into pre-tokens; the model never makes a token across one
   of these splits, and tokenizes each pre-token on its own;
4. the post-processor adds the special tokens.

So the cut is exact when no added token straddles it (1), the normalizer maps each side on its own
(2), the pre-tokenizer splits the joined text at the cut and as it splits each side (3), and the
post-processor adds special tokens only in front, the same ones for any text (4).
`SeamRules.for_tokenizer` admits only tokenizers whose components it knows (anything else, e.g. a
Metaspace "▁" prepended at a text's start, or BERT's [SEP] at its end, gets no rules: its prompts
are tokenized whole), and `SeamRules.joins` checks one prompt's seam on a window of a few dozen
characters around it.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_NORMAL_FORMS = {"NFC": "NFD", "NFD": "NFD", "NFKC": "NFKD", "NFKD": "NFKD"}  # (its decomposition)
# pre-tokenizers that split by local rules (a character class, a run of one): no state but the
# position they restart from. Metaspace (a "▁" prepended at a text's start) is not one of them.
_LOCAL_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace",
                         "WhitespaceSplit"}  # fmt: skip
# a rest's first non-whitespace run must start within this many characters, and counts at most
# this many in the window (a longer run only matters if it joins the prefix: then no split shows)
HEAD_CHARS = 64
_TAIL_CHARS = 32  # the window starts at least this far before the seam, at a pre-token's start
_SPACE, _INK = re.compile(r"\s"), re.compile(r"\S")
_WINDOWS_KEPT = 4096  # window answers remembered (SeamRules.joins)


@dataclass(frozen=True)
class PrefixTail:
    """What the seam check needs to know of a registered prefix, computed once."""

    ends_with_added: bool  # an added token ends the prefix: the seam is a hard cut in stage 1
    last_char: str
    edge: str  # the prefix's last (longest added token - 1) characters: what a token could straddle
    text: str  # the (normalized) end of its last piece, from a pre-token's start: the window's left
    pieces: tuple[tuple[int, int], ...]  # the pre-tokens of `text`, as (start, end) in it


class SeamRules:
    """The seam checks for one fast tokenizer whose components all keep the two sides apart."""

    def __init__(self, backend: Tokenizer, added: list, nfd: str | None) -> None:
        self._normalizer = backend.normalizer
        self._pre_tokenizer = backend.pre_tokenizer
        self._nfd = nfd  # the decomposition of the normalizer's form (None: no normalizer)
        # stage 1's two passes: tokens matched on the raw text, then `normalized` ones
        raw = [t.content for t in added if not t.normalized]
        normalized = [t.content for t in added if t.normalized]
        self._raw, self._normalized = _alternation(raw), _alternation(normalized)
        self._any = _alternation(raw + normalized, lookahead=True)  # every start, overlapping
        self._longest = max((len(t.content) for t in added), default=0)
        # NOTE: a window's answer depends on the prefix's tail and the rest's head alone: rows
        # of one template start their items after the same words, so most rows ask again
        self._windows: dict[tuple[PrefixTail, str], bool] = {}

    @classmethod
    def for_tokenizer(cls, backend: Tokenizer) -> SeamRules | str:
        """The rules of `backend`, or why a prompt can never be cut for it."""
        model = type(backend.model).__name__
        if getattr(backend.model, "dropout", None):
            return f"{model} dropout draws different tokens per encode"
        try:  # (a custom Python component cannot be serialized)
            normalizer, pre_tokenizer, post_processor = (
                _state(backend.normalizer),
                _state(backend.pre_tokenizer),
                _state(backend.post_processor),
            )
        except Exception as e:
            return f"its components cannot be read: {e}"
        nfd, why = _normalizer_form(normalizer)
        why = (
            why or _pre_tokenizer_problem(pre_tokenizer) or _post_processor_problem(post_processor)
        )
        if why:
            return why
        added = [t for t in backend.get_added_tokens_decoder().values() if t.content]
        flagged = [t.content for t in added if t.lstrip or t.rstrip or t.single_word]
        if flagged:  # they take in spaces, or look at characters, across the cut
            return f"added tokens {flagged[:3]} strip spaces or match single words"
        if nfd and any(t.normalized for t in added):
            return "added tokens are matched on normalized text"
        return cls(backend, added, nfd)

    # ------------------------------------------------------------------ a prefix
    def tail(self, prefix: str) -> PrefixTail:
        """What the seam check needs of `prefix` (non-empty), found once at its registration."""
        last_end = self._last_added_end(prefix)
        piece = self._normalize(prefix[last_end:])
        spans = self._pre_tokenize(piece)
        # NOTE: the window restarts the pre-tokenizer at a pre-token's start, two pre-tokens and
        # _TAIL_CHARS before the seam (where the piece has them). The admitted pre-tokenizers split
        # left to right, never look behind (their regexes are checked), and decide a split from
        # the characters up to a few past it (a class run's end, a one-character lookahead): a
        # split the prefix makes before the window is one the whole text makes too. `joins` also
        # asks the window's splits before the seam to be the prefix's own.
        k, start = len(spans), len(piece)
        while k > 0 and (len(spans) - k < 2 or len(piece) - start < _TAIL_CHARS):
            k -= 1
            start = spans[k][0]
        pieces = tuple((s - start, e - start) for s, e in spans[k:])
        edge = prefix[max(0, len(prefix) - self._longest + 1) :] if self._longest > 1 else ""
        return PrefixTail(
            ends_with_added=last_end == len(prefix),
            last_char=prefix[-1],
            edge=edge,
            text=piece[start:],
            pieces=pieces,
        )

    # ------------------------------------------------------------------ a prompt
    def joins(self, tail: PrefixTail, rest: str) -> bool:
        """Whether `prefix + rest` tokenizes as the prefix's ids, then the rest's (no specials)."""
        if not rest:
            return True
        if self._longest > 1 and self._straddles(tail.edge, rest):
            return False
        first = self._first_added(rest)  # where stage 1 ends the rest's first piece (None: later)
        if tail.ends_with_added or first == 0:
            return True  # each side's piece ends at the cut in the whole text too
        if self._nfd is not None and not self._seam_stays_normal(tail.last_char, rest[0]):
            return False
        head = _head(rest, first)
        if head is None or (self._nfd is not None and head[1]):
            return False  # (a run cut mid-way could cut a combining sequence for the normalizer)
        known = self._windows.get((tail, head[0]))
        if known is None:
            if len(self._windows) >= _WINDOWS_KEPT:
                self._windows.clear()
            known = self._windows[(tail, head[0])] = self._window_joins(tail, head[0])
        return known

    def _window_joins(self, tail: PrefixTail, head: str) -> bool:
        """Whether the pre-tokenizer splits the prefix's tail + the rest's head at the seam,
        and before it as the prefix alone."""
        text = tail.text + self._normalize(head)
        seam = len(tail.text)
        pieces = self._pre_tokenize(text)
        if any(s < seam < e for s, e in pieces):
            return False
        # the window's splits before the seam must be the prefix's own
        return tuple(p for p in pieces if p[1] <= seam) == tail.pieces

    # ------------------------------------------------------------------ stages
    def _straddles(self, edge: str, rest: str) -> bool:
        """Whether an added token's text runs across the cut (stage 1 would match it whole)."""
        text = edge + rest[: self._longest - 1]
        cut = len(edge)
        # (the longest token at each start: a shorter one crosses only where the longest does)
        return any(m.start() < cut < m.start() + len(m.group(1)) for m in self._any.finditer(text))

    def _first_added(self, rest: str) -> int | None:
        """Where stage 1's first added token starts in `rest`, if within the longest head the
        window takes (2 * HEAD_CHARS); None if later or never."""
        reach = 2 * HEAD_CHARS
        raw = self._raw.search(rest, 0, reach + self._longest) if self._raw else None
        gap_end = raw.start() if raw else min(len(rest), reach + self._longest)
        found = raw.start() if raw and raw.start() < reach else None
        if self._normalized:  # pass two: within the first pass's first gap
            norm = self._normalized.search(rest, 0, gap_end)
            if norm and norm.start() < reach:
                found = norm.start()
        return found

    def _last_added_end(self, prefix: str) -> int:
        """Where the text after stage 1's last added token in `prefix` starts (0: no token)."""
        end, start = 0, 0
        spans = list(self._raw.finditer(prefix)) if self._raw else []
        for m in [*spans, None]:
            gap_end = m.start() if m else len(prefix)
            if self._normalized:
                for n in self._normalized.finditer(prefix, start, gap_end):
                    end = n.end()
            if m:
                end = start = m.end()
        return end

    def _seam_stays_normal(self, before: str, after: str) -> bool:
        """Whether normalizing maps the characters at the cut each on its own: `after` starts a
        new combining sequence and does not compose with `before` (Hangul jamo do)."""
        if unicodedata.category(after) == "Cn":  # unknown to Python's table: its class unknown
            return False
        if unicodedata.combining(unicodedata.normalize(self._nfd, after)[0]):
            return False
        joined = self._normalizer.normalize_str(before + after)
        return joined == self._normalize(before) + self._normalize(after)

    def _normalize(self, text: str) -> str:
        return self._normalizer.normalize_str(text) if self._nfd is not None else text

    def _pre_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [span for _, span in self._pre_tokenizer.pre_tokenize_str(text)]


def _head(rest: str, first_added: int | None) -> tuple[str, bool] | None:
    """The start of `rest` the window needs: through its first non-whitespace run (at most
    HEAD_CHARS of it), or its whole first piece where that ends sooner; and whether the run was
    cut short. None: no non-whitespace within HEAD_CHARS."""
    limit = len(rest) if first_added is None else first_added
    ink = _INK.search(rest, 0, min(limit, HEAD_CHARS))
    if ink is None:
        # all whitespace up to the piece's end (then the window holds the whole piece), or too long
        return (rest[:limit], False) if limit <= HEAD_CHARS else None
    space = _SPACE.search(rest, ink.start(), min(limit, ink.start() + HEAD_CHARS))
    end = space.start() if space else min(limit, ink.start() + HEAD_CHARS)
    return rest[:end], end < limit and not rest[end].isspace()


def _alternation(contents: list[str], lookahead: bool = False) -> re.Pattern | None:
    """A regex of `contents`, longest first: leftmost-longest, as stage 1's matcher."""
    if not contents:
        return None
    body = "|".join(re.escape(c) for c in sorted(set(contents), key=len, reverse=True))
    return re.compile(f"(?=({body}))" if lookahead else body)


def _state(component: object) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_form(state: dict | None) -> tuple[str | None, str | None]:
    """(the decomposition its forms use, None) for no normalizer or Unicode normal forms only, or
    (None, why not)."""
    if state is None:
        return None, None
    parts = state["normalizers"] if state["type"] == "Sequence" else [state]
    kinds = {p.get("type") for p in parts}
    if not kinds or not kinds <= set(_NORMAL_FORMS):
        return None, f"normalizer {sorted(map(str, kinds))} may join text across a cut"
    return ("NFKD" if kinds & {"NFKC", "NFKD"} else "NFD"), None


def _pre_tokenizer_problem(state: dict | None) -> str | None:
    if state is None:
        return "no pre-tokenizer: the whole text is one pre-token"
    parts = state["pretokenizers"] if state["type"] == "Sequence" else [state]
    for part in parts:
        kind = part.get("type")
        if kind not in _LOCAL_PRE_TOKENIZERS:
            return f"pre-tokenizer {kind} is not split by local rules"
        if kind == "ByteLevel" and part.get("add_prefix_space"):
            return "ByteLevel pre-tokenizer adds a space at the text's start"
        if kind == "Split":
            pattern = part.get("pattern", {})
            if part.get("invert") or not _is_local_pattern(pattern.get("Regex", "")):
                return f"Split pattern {pattern} looks behind, anchors or is inverted"
    return None


def _post_processor_problem(state: dict | None) -> str | None:
    """None where the post-processor adds special tokens only before the text."""
    if state is None:
        return None
    parts = state["processors"] if state["type"] == "Sequence" else [state]
    for part in parts:
        kind = part.get("type")
        if kind == "TemplateProcessing":
            single = part.get("single", [])
            at = next((i for i, p in enumerate(single) if "Sequence" in p), len(single))
            if at != len(single) - 1:
                return "the post-processor's template adds special tokens after the text"
        elif kind != "ByteLevel":  # (ByteLevel only trims offsets)
            return f"post-processor {kind} adds special tokens around the text"
    return None


def _is_local_pattern(pattern: str) -> bool:
    """Whether a Split regex has no lookbehind and no anchor (`^`, `$`, `\\b`, `\\A`, ...): then a
    scan restarted at a split point finds what the whole text's scan finds after it."""
    i, depth = 0, 0  # depth: nesting of [...] classes, where ^ and $ are literal or negation
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if depth == 0 and pattern[i + 1 : i + 2] in ("b", "B", "A", "G", "z", "Z", "K"):
                return False
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if pattern[i : i + 1] == "^":
                i += 1
            if pattern[i : i + 1] == "]":  # a literal ] first in a class
                i += 1
            continue
        if depth:
            depth -= c == "]"
        elif c in "^$" or pattern.startswith(("(?<=", "(?<!"), i):
            return False
        i += 1
    return True
