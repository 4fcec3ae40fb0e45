"""The detokenizer process: token ids in, text deltas out, stop strings trimmed.

A streamed delta never ends inside a possible stop string: text that could still grow into
one is held back until it either completes (and is trimmed) or turns out to be ordinary text.
So the deltas of a stream, joined, always equal the final text.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq

from engine.runtime.ipc import ChildConfig, pull_socket, recv_all
from engine.runtime.messages import DecodeSpec, Ready, ReqOutput
from engine.tokenization import IncrementalDecoder, load_decoder, stop_prefix_len

logger = logging.getLogger(__name__)

_DEFAULT_SPEC = DecodeSpec(
    skip_special_tokens=True, spaces_between_special_tokens=True, stop=(), no_stop_trim=False
)


@dataclass
class _Stream:
    decoder: IncrementalDecoder
    spec: DecodeSpec
    sent: int = 0  # characters of decoder.text already sent


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}

    def process(self, out: ReqOutput) -> ReqOutput:
        """Fill `out.text` with the text that is final since this request's previous output."""
        stream = self.streams.get(out.rid)
        if stream is None:
            spec = out.decode or _DEFAULT_SPEC
            decoder = IncrementalDecoder(
                self.tokenizer, spec.skip_special_tokens, spec.spaces_between_special_tokens
            )
            stream = self.streams[out.rid] = _Stream(decoder, spec)
        reason, spec = out.finish_reason, stream.spec
        matched = reason.get("matched") if reason and reason.get("type") == "stop" else None
        ids = out.new_ids
        if isinstance(matched, int) and not spec.no_stop_trim and ids:
            ids = ids[:-1]  # the stop token is not part of the text
        stream.decoder.push(ids)
        if reason is None:
            text = stream.decoder.text
            end = max(stream.sent, len(text) - stop_prefix_len(text, spec.stop))
        else:
            stream.decoder.flush()
            text = stream.decoder.text
            if isinstance(matched, str) and not spec.no_stop_trim and matched in text:
                text = text[: text.index(matched)]
            end = max(stream.sent, len(text))
            del self.streams[out.rid]
        out.text = text[stream.sent : end]
        stream.sent = end
        return out


class DetokenizerProcess:
    def __init__(
        self,
        config: ChildConfig,
        ctx: zmq.Context,
        to_tokenizer: zmq.Socket,
        send_lock: threading.Lock,
    ) -> None:
        self.inbox = pull_socket(ctx, config.endpoints.detokenizer)
        self.to_tokenizer = to_tokenizer
        self.send_lock = send_lock
        args = config.args
        self.detokenizer = Detokenizer(None if args.skip_tokenizer_init else load_decoder(args))
        with send_lock:
            to_tokenizer.send_pyobj(Ready("detokenizer", {}))

    def run(self) -> None:
        while True:
            for batch in recv_all(self.inbox, 1000):
                if self.detokenizer.tokenizer is not None:
                    batch.outputs = [self.detokenizer.process(o) for o in batch.outputs]
                with self.send_lock:
                    self.to_tokenizer.send_pyobj(batch)
