"""What a client and a resident engine say to each other over its socket (pickled tuples).

    client -> engine   (op, call_id, payload)
                       op: "generate" (a GenerateArgs: generate's arguments), "encode" (an
                       EncodeArgs: an embedding engine's encode), "abort" (the call to drop), "chat_template" ((conversations, keyword arguments) of the
                       engine tokenizer's apply_chat_template), "control" (a ControlCall: a
                       management call, which the engine runs on its Engine by its type)
    engine -> client   ("result", call_id, value) or ("error", call_id, kind, message)

GenerateArgs, EncodeArgs and the ControlCall types are the messages of
engine/runtime/messages.py.

An error crosses as its kind and message and is raised again in the client as the same kind,
for the kinds callers tell apart: a ValueError is a request refused before it ran (the flows
turn it into an error row and go on), a TypeError a wrong call, anything else a RuntimeError.
"""

from __future__ import annotations

# NOTE: bump when a message changes shape. A record keeps the version its engine speaks
# (registry.ResidentRecord.protocol); a client refuses an engine of another version, and the
# flows start their own engine beside it, so an upgrade never talks past a running old engine.
# 1: management calls by method name; 2: GenerateArgs and ControlCall messages; 3: encode.
VERSION = 3

GENERATE, ENCODE, ABORT = "generate", "encode", "abort"
CHAT_TEMPLATE, CONTROL = "chat_template", "control"
RESULT, ERROR = "result", "error"

_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def error_reply(call_id: int, error: BaseException) -> tuple:
    kind = type(error).__name__ if type(error).__name__ in _KINDS else "RuntimeError"
    return (ERROR, call_id, kind, str(error) or type(error).__name__)


def raised(kind: str, message: str) -> Exception:
    return _KINDS.get(kind, RuntimeError)(message)
