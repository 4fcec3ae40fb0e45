"""The flows gristmill ships, by the name a config's `flow` field gives."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlowEntry:
    module: str
    flow_name: str
    config_name: str
    # the module's function that checks a config before its run folder is locked: config ->
    # (what the checks learned, the run's identity); None: a batch run's (flows/run/lock.py)
    checks_name: str | None = None

    @property
    def entrypoint(self) -> str:
        """As prefect.yaml names it: path/to/file.py:function."""
        return f"{self.module.replace('.', '/')}.py:{self.flow_name}"

    def flow(self) -> Any:
        return getattr(importlib.import_module(self.module), self.flow_name)

    def config_class(self) -> Any:
        return getattr(importlib.import_module(self.module), self.config_name)

    def checks(self) -> Any:
        return getattr(importlib.import_module(self.module), self.checks_name)


FLOWS = {
    "generate": FlowEntry("flows.pipeline", "generate_batch", "RunConfig"),
    "annotate": FlowEntry("flows.annotate", "annotate", "AnnotateConfig"),
    "synthesize": FlowEntry("flows.synthesize", "synthesize", "SynthesizeConfig"),
    "evaluate": FlowEntry("flows.evaluate", "evaluate", "EvaluateConfig"),
    "openai_batch": FlowEntry(
        "flows.openai_batch", "openai_batch", "OpenAIBatchConfig", checks_name="check_batch"
    ),
}
