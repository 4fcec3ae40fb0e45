"""Everything that crosses a process boundary: small picklable dataclasses, no ad-hoc dicts.

tokenizer manager --Req / AbortReq / ControlReq--> scheduler --BatchOut--> detokenizer --BatchOut--> tokenizer manager
The scheduler also answers ControlReq and reports Ready directly to the tokenizer manager; any
child reports ChildError and forwards its log records (LogMsg) there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeSpec:
    """How a request's tokens become text; sent once, with the request's first output."""

    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: tuple[str, ...]
    no_stop_trim: bool


@dataclass
class ReqOutput:
    """One request's progress since its previous output."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # once, with the first output
    input_top_logprobs: list[tuple[list[float], list[int]] | None] | None = None
    decode: DecodeSpec | None = None  # first output only
    embedding: list[float] | None = None  # encode(): the result, with the final output
    label_logprobs: list[float] | None = None  # score(): with the final output
    text: str = ""  # filled by the detokenizer: new text since the previous output


@dataclass
class BatchOut:
    outputs: list[ReqOutput]


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request the scheduler answers with a ControlReply of the same id ('flush_cache', 'get_info', 'shutdown')."""

    kind: str
    id: int


@dataclass
class ControlReply:
    id: int
    value: Any


@dataclass
class Ready:
    """The scheduler (or detokenizer) finished starting; `info` describes its side."""

    role: str
    info: dict[str, Any]


@dataclass
class ChildError:
    """A child failed: at start-up (bad weights, say) or in its loop. It exits after sending this."""

    role: str
    exc_type: str
    message: str
    traceback: str


@dataclass
class LogMsg:
    """A log record of a child, replayed through the caller's logging."""

    record: dict[str, Any]
