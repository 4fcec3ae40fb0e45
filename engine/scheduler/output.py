"""What the scheduler sends on for each request that advanced: a ReqOutput with the tokens (and
logprobs) new since the last one it sent, once finished or, for streams, every
`stream_interval` tokens. The detokenizer adds the text and passes it to the caller."""

from __future__ import annotations

from engine.batch.req import Req
from engine.runtime.messages import DecodeSpec, ReqOutput


def outputs_to_send(reqs: list[Req], stream_interval: int) -> list[ReqOutput]:
    return [
        _output(r)
        for r in reqs
        if r.finish_reason is not None or (r.stream and _due(r, stream_interval))
    ]


def _due(req: Req, stream_interval: int) -> bool:
    interval = req.sampling.stream_interval or stream_interval
    return len(req.output_ids) - req.sent_len >= interval


def _output(req: Req) -> ReqOutput:
    start, first = req.sent_len, not req.sent_first
    sp = req.sampling
    out = ReqOutput(
        rid=req.request.rid,
        new_ids=req.output_ids[start:],
        finish_reason=req.finish_reason,
        prompt_tokens=req.prompt_len,
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        output_logprobs=req.output_logprobs[start:],
        output_top_logprobs=req.output_top_logprobs[start:],
        embedding=req.embedding,
        label_logprobs=req.label_logprobs,
    )
    if req.spec is not None:
        out.spec = (req.spec.verify_ct, req.spec.drafted, req.spec.accepted)
    if first:
        out.decode = DecodeSpec(
            sp.skip_special_tokens, sp.spaces_between_special_tokens, sp.stop_strings,
            sp.no_stop_trim,
        )  # fmt: skip
        if req.request.return_logprob:
            out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
    req.sent_len, req.sent_first = len(req.output_ids), True
    return out
