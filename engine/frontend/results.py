"""What a caller receives: the channel its results arrive on, what it has received so far for
each request, and the result dicts built from that (SGLang's `text` / `output_ids` /
`meta_info`, or `embedding` for encode()).

The tokenizer manager's receiver thread applies each ReqOutput to its request's state and puts
a chunk or a final result on the caller's Channel; the caller's thread or event loop takes
them off with `wait_all` / `stream` (or their async twins in the tokenizer manager).
"""

from __future__ import annotations

import asyncio
import queue
import time
from typing import TYPE_CHECKING, Any

from engine.runtime.messages import ReqOutput, TokenizedRequest

if TYPE_CHECKING:  # transformers loads in ~1 s; only the annotations need it here
    from transformers import PreTrainedTokenizerBase

    from engine.frontend.dp_balance import Route


class Channel:
    """Where a call's results arrive: (index, kind, payload) items, kind in 'chunk', 'final', 'error'."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.queue: asyncio.Queue | queue.Queue = asyncio.Queue() if loop else queue.Queue()

    def put(self, item: tuple[int, str, Any]) -> None:
        if self.loop is None:
            self.queue.put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def get(self) -> tuple[int, str, Any]:
        return self.queue.get()

    async def aget(self) -> tuple[int, str, Any]:
        return await self.queue.get()


class ReqState:
    """What the caller has received so far for one request."""

    def __init__(
        self, request: TokenizedRequest, index: int, channel: Channel, text_in_logprobs: bool
    ) -> None:
        self.request = request
        self.index = index
        self.channel = channel
        self.text_in_logprobs = text_in_logprobs
        self.text = ""
        self.output_ids: list[int] = []
        self.finish_reason: dict | None = None
        self.completion_tokens = 0
        # the scheduler's count: a session turn's prompt is its history and its own input
        self.prompt_tokens = request.prompt_len
        self.cached_tokens = 0
        self.spec: tuple[int, int, int] | None = None  # speculative decoding's counts
        self.input_logprobs: list = []
        self.input_top_logprobs: list = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list = []
        self.created = time.perf_counter()
        self.finished_at: float | None = None
        self.route: Route | None = None  # the data-parallel group it went to, set when sent

    @property
    def rid(self) -> str:
        return self.request.rid

    def apply(self, out: ReqOutput) -> None:
        self.text += out.text
        self.output_ids += out.new_ids
        self.completion_tokens = out.completion_tokens
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        self.spec = out.spec
        self.output_logprobs += out.output_logprobs
        self.output_top_logprobs += out.output_top_logprobs
        if out.input_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = (
                out.input_logprobs,
                out.input_top_logprobs,
            )
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.finished_at = time.perf_counter()

    def deliver(self, out: ReqOutput, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """Apply `out`, then put what the caller should see now on its channel: every chunk of a
        stream, or the whole result once the request has finished."""
        self.apply(out)
        finished = out.finish_reason is not None
        if self.request.stream:
            chunk = {
                "text": out.text,
                "output_ids": list(out.new_ids),
                "meta_info": meta_info(self, tokenizer),
            }
            self.channel.put((self.index, "final" if finished else "chunk", chunk))
        elif finished:
            result = {
                "text": self.text,
                "output_ids": self.output_ids,
                "meta_info": meta_info(self, tokenizer),
            }
            if out.embedding is not None:  # encode(): the embedding instead of text
                result = {"embedding": out.embedding, "meta_info": result["meta_info"]}
            if out.label_logprobs is not None:  # score(): read by engine.frontend.score
                result["label_logprobs"] = out.label_logprobs
            self.channel.put((self.index, "final", result))


def meta_info(state: ReqState, tokenizer: PreTrainedTokenizerBase | None) -> dict[str, Any]:
    """SGLang's meta_info of a request as far as it has got."""
    request = state.request
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": state.finish_reason,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens,
        "e2e_latency": (state.finished_at or time.perf_counter()) - state.created,
    }
    if state.spec is not None:  # speculative decoding: SGLang's spec_verify_ct, and the rest
        verify_ct, drafted, accepted = state.spec
        meta["spec_verify_ct"] = verify_ct
        meta["spec_draft_token_num"] = drafted
        meta["spec_accept_token_num"] = accepted
        meta["spec_accept_rate"] = accepted / drafted if drafted else 0.0
        # tokens per verify step: its accepted drafts and the target's own token
        meta["spec_accept_length"] = (accepted + verify_ct) / verify_ct if verify_ct else 0.0
    if request.return_logprob:
        decode = tokenizer.decode if state.text_in_logprobs and tokenizer is not None else None
        start = request.input_logprob_start
        meta["input_token_logprobs"] = _triples(
            state.input_logprobs, request.input_ids[start:].tolist(), decode
        )
        meta["output_token_logprobs"] = _triples(state.output_logprobs, state.output_ids, decode)
        if request.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if t is None else _triples(*t, decode) for t in state.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [_triples(*t, decode) for t in state.output_top_logprobs]
    return meta


def _triples(values: list, ids: list[int], decode: Any) -> list[tuple]:
    """SGLang's (logprob, token_id, text-or-None) per position."""
    return [(v, t, decode([t]) if decode else None) for v, t in zip(values, ids)]


def take(index: int, kind: str, payload: Any) -> dict[int, dict]:
    """A channel item for wait_all: {index: result} once final; raises an error item."""
    if kind == "error":
        raise payload
    return {index: payload} if kind == "final" else {}


def chunk(index: int, kind: str, payload: Any, live: set[int], with_index: bool) -> dict:
    """A channel item for a stream: the chunk (tagged with its index in a batch); raises an error item."""
    if kind == "error":
        raise payload
    if kind == "final":
        live.discard(index)
    return {**payload, "index": index} if with_index else payload
