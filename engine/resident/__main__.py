"""`python -m engine.resident FOLDER`: a resident engine's process (engine/resident/server.py)."""

import sys

from engine.resident.server import main

sys.exit(main(sys.argv[1]))
