"""gristmill's offline inference engine, with the public API of SGLang's offline Engine."""

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.server_args import ServerArgs

__all__ = ["Engine", "SamplingParams", "ServerArgs"]
