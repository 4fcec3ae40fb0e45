"""The detokenizer process's entry point: `python -m engine.detokenizer detokenizer CONFIG`."""

import sys

from engine.detokenizer.detokenizer import DetokenizerProcess
from engine.runtime.child import run_child

sys.exit(run_child(sys.argv[1], sys.argv[2], DetokenizerProcess))
