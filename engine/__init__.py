"""gristmill's offline inference engine, with the public API of SGLang's offline Engine.

Besides the Engine, the names here are what other code (the flows) may use of the engine:
its argument and sampling-parameter validators, the model-folder reader, and the tokenizer
loader, so that a config can be checked without starting an engine; and resident engines
(engine/resident/): started once, attached to by later runs.
"""

from engine.frontend.engine import Engine
from engine.model_config import ModelConfig
from engine.resident import ResidentEngine, resident_engines, start_resident, stop_resident
from engine.sampling_params import SamplingParams
from engine.server_args import ServerArgs
from engine.tokenization import load_tokenizer

__all__ = [
    "Engine",
    "ModelConfig",
    "ResidentEngine",
    "SamplingParams",
    "ServerArgs",
    "load_tokenizer",
    "resident_engines",
    "start_resident",
    "stop_resident",
]
