"""EngineAPI (engine/api.py): an Engine and a ResidentEngine offer the same methods with the same
arguments, and build the same message for each call; every layer answers every management call
by its type. No engine starts here. (The calls themselves: test_resident_engine.py, test_lora.py,
test_sessions.py, test_weights_and_profile.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest

from engine import Engine, EngineAPI, ResidentEngine
from engine.resident.server import ResidentServer
from engine.runtime import messages
from engine.runtime.messages import ControlCall, GenerateArgs
from engine.scheduler.control import EmbeddingControls, GenerationControls

# what one of the two offers and the other does not, and why
ONLY_ENGINE = {
    "score": "a resident engine's socket carries generate() and encode(); scores run on an Engine",
    "async_score": "as score",
}
ONLY_RESIDENT = {
    "apply_chat_template": "renders in the resident engine's process, so that its client "
    "loads no tokenizer; an Engine lends its own (engine.tokenizer.apply_chat_template)",
}
# the method of a management call whose name is not the call's kind
METHOD = {messages.GetInfo: "get_server_info"}
CALLS = ControlCall.__subclasses__()


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)[1:]  # (without self)


def _method(call: type[ControlCall]) -> str:
    return METHOD.get(call, call.__new__(call).kind)


def test_engine_and_resident_engine_offer_the_same_methods():
    engine, resident = _public(Engine), _public(ResidentEngine)
    assert engine - resident == set(ONLY_ENGINE), "a method on Engine only"
    assert resident - engine == set(ONLY_RESIDENT), "a method on ResidentEngine only"
    assert engine & resident == _public(EngineAPI), "EngineAPI lists what both offer"


def test_both_satisfy_the_protocol():
    for cls in (Engine, ResidentEngine):
        assert EngineAPI in cls.__mro__  # (issubclass: not for a Protocol with a property)
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {cls.__abstractmethods__}"
    engine, resident = Engine.__new__(Engine), ResidentEngine.__new__(ResidentEngine)
    engine.tokenizer_manager = types.SimpleNamespace(tokenizer=None)
    resident._tokenizer = "a tokenizer"
    assert isinstance(engine, EngineAPI) and isinstance(resident, EngineAPI)
    assert not isinstance(object(), EngineAPI)


@pytest.mark.parametrize("name", sorted(_public(EngineAPI)))
def test_both_take_the_protocols_arguments(name):
    member = inspect.getattr_static(EngineAPI, name)
    if isinstance(member, property):
        for cls in (Engine, ResidentEngine):
            assert isinstance(inspect.getattr_static(cls, name), property)
        return
    expected = _parameters(getattr(EngineAPI, name))
    for cls in (Engine, ResidentEngine):
        assert _parameters(getattr(cls, name)) == expected, f"{cls.__name__}.{name}"
        assert inspect.iscoroutinefunction(getattr(cls, name)) == name.startswith("async_")


def test_every_management_call_is_a_method_with_its_fields_as_arguments():
    assert len(CALLS) == 10
    for call in CALLS:
        fields = [f.name for f in dataclasses.fields(call)]
        assert _parameters(getattr(EngineAPI, _method(call))) == fields, call.__name__
    assert [m for m in CALLS if m.waits_for_idle] == [messages.UpdateWeightsFromDisk]


def test_generate_args_are_generates_arguments():
    fields = [f.name for f in dataclasses.fields(GenerateArgs)]
    for name in ("generate", "async_generate"):
        assert _parameters(getattr(EngineAPI, name)) == [*fields[:-1], "unsupported"]


# each management method called as a user calls it, and the message it must build
USES = [
    ("flush_cache", (), {}, messages.FlushCache()),
    ("get_server_info", (), {}, messages.GetInfo()),
    ("update_weights_from_disk", ("/m",), {"load_format": "safetensors"},
     messages.UpdateWeightsFromDisk("/m", "safetensors")),
    ("get_weights_by_name", ("model.norm.weight",), {"truncate_size": 4},
     messages.GetWeightsByName("model.norm.weight", 4)),
    ("load_lora_adapter", ("qv", "/a"), {"pinned": True}, messages.LoadLoraAdapter("qv", "/a", True)),
    ("unload_lora_adapter", ("qv",), {}, messages.UnloadLoraAdapter("qv")),
    ("open_session", (), {"capacity_of_str_len": 100, "timeout": 2.0},
     messages.OpenSession(100, None, False, 2.0)),
    ("close_session", ("s",), {}, messages.CloseSession("s")),
    ("start_profile", (), {"output_dir": "/t", "num_steps": 2},
     messages.StartProfile(output_dir="/t", num_steps=2)),
    ("stop_profile", (), {}, messages.StopProfile()),
]  # fmt: skip


def _recording(cls: type) -> tuple[EngineAPI, list]:
    """An instance that keeps the messages it is given instead of running them."""
    sent: list = []
    engine = cls.__new__(cls)
    engine.run_control = lambda call: sent.append(call) or "answer"
    engine.run_generate = lambda args: sent.append(args) or "generated"
    return engine, sent


@pytest.mark.parametrize("cls", [Engine, ResidentEngine])
def test_both_build_the_same_messages(cls):
    assert {type(message) for *_, message in USES} == set(CALLS)
    engine, sent = _recording(cls)
    for name, args, kwargs, message in USES:
        assert getattr(engine, name)(*args, **kwargs) == "answer"
        assert sent.pop() == message
    assert engine.generate("hi", {"max_new_tokens": 1}, rid="r", bootstrap_host="h") == "generated"
    assert sent.pop() == GenerateArgs(
        "hi", {"max_new_tokens": 1}, rid="r", unsupported={"bootstrap_host": "h"}
    )


def test_every_layer_answers_every_management_call():
    handled = Engine.__dict__["run_control"].dispatcher.registry
    assert set(CALLS) <= set(handled), "Engine.run_control"
    for controls in (GenerationControls, EmbeddingControls):
        answers = controls(None, None, 0, 0).handlers
        assert set(answers) == set(CALLS), controls.__name__
    with pytest.raises(TypeError, match="an Engine does not serve str"):
        Engine.__new__(Engine).run_control("flush_cache")


def test_an_embedding_scheduler_refuses_what_it_does_not_serve():
    controls = EmbeddingControls(None, None, 0, 0)
    with pytest.raises(ValueError, match="sessions are for generation engines"):
        controls.answer(messages.OpenSession(10))
    with pytest.raises(ValueError, match="LoRA adapters serve generation engines"):
        controls.answer(messages.UnloadLoraAdapter("qv"))


def test_the_resident_server_runs_a_call_on_its_engine_by_type():
    server = ResidentServer.__new__(ResidentServer)
    server.engine, sent = _recording(Engine)
    server.info = lambda: {"resident": {}}
    assert server._control(messages.CloseSession("s")) == "answer"
    assert sent == [messages.CloseSession("s")]
    assert server._control(messages.GetInfo()) == {"resident": {}}  # with its own section
    with pytest.raises(TypeError, match="does not serve 'flush_cache'"):
        server._control("flush_cache")
