"""What a client and a resident engine say to each other over its socket (pickled tuples).

    client -> engine   (op, call_id, payload)
                       op: "generate" (Engine.generate's keyword arguments), "abort" (the call to
                       drop), "info", "flush_cache", "chat_template" ((conversations, keyword
                       arguments) of the engine tokenizer's apply_chat_template), "call"
                       ((method, keyword arguments) of an Engine method in ENGINE_METHODS)
    engine -> client   ("result", call_id, value) or ("error", call_id, kind, message)

An error crosses as its kind and message and is raised again in the client as the same kind,
for the kinds callers tell apart: a ValueError is a request refused before it ran (the flows
turn it into an error row and go on), a TypeError a wrong call, anything else a RuntimeError.
"""

from __future__ import annotations

GENERATE, ABORT, INFO, FLUSH_CACHE = "generate", "abort", "info", "flush_cache"
CHAT_TEMPLATE = "chat_template"
CALL = "call"
# the Engine's management methods a client may call on a resident engine (as Engine has them)
ENGINE_METHODS = frozenset({
    "update_weights_from_disk", "get_weights_by_name", "load_lora_adapter", "unload_lora_adapter",
    "open_session", "close_session", "start_profile", "stop_profile",
})  # fmt: skip
RESULT, ERROR = "result", "error"

_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def error_reply(call_id: int, error: BaseException) -> tuple:
    kind = type(error).__name__ if type(error).__name__ in _KINDS else "RuntimeError"
    return (ERROR, call_id, kind, str(error) or type(error).__name__)


def raised(kind: str, message: str) -> Exception:
    return _KINDS.get(kind, RuntimeError)(message)
