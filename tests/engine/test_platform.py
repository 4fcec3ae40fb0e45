"""engine/platform.py answers torch.cuda.is_available() without importing torch: its answers
are torch's own (asked in a process of its own), and it reads a CUDA build's version file
without running torch's package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


PROBE = (
    "import sys; from engine.platform import cuda_available, driver_device_count, "
    "torch_cuda_version; print(cuda_available(), driver_device_count(), torch_cuda_version(), "
    "'torch' in sys.modules)"
)
TORCH = (
    "import torch; print(torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)"
)


@pytest.mark.parametrize("visible", [None, ""])
def test_the_probe_answers_as_torch_does_without_importing_it(visible):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    available, count, built, torch_loaded = _python(PROBE, **env).split()
    torch_available, torch_count, torch_built = _python(TORCH, **env).split()
    assert available == torch_available
    assert built == torch_built
    if torch_built != "None":  # a CPU build of torch counts no devices, whatever the driver
        assert count == torch_count
    assert torch_loaded == "False"


def test_server_args_settle_the_device_without_torch():
    code = (
        "import sys; from engine import ServerArgs, ModelConfig; "
        "a = ServerArgs.from_kwargs(model_path='demo/model'); "
        "m = ModelConfig.from_folder('demo/model', 'float32'); "
        "print(a.device, m.dtype_name, 'torch' in sys.modules)"
    )
    device, dtype, torch_loaded = _python(code).split()
    assert device == ("cuda" if _python(TORCH).split()[0] == "True" else "cpu")
    assert (dtype, torch_loaded) == ("float32", "False")


def test_a_cuda_build_is_read_from_its_version_file(tmp_path):
    """A stand-in torch whose package refuses to be imported: its version file alone answers."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the package must not be imported')\n")
    (fake / "version.py").write_text(
        "from typing import Optional\n__version__ = '9.9.9+cu128'\ncuda: Optional[str] = '12.8'\n"
    )
    code = "from engine.platform import torch_cuda_version; print(torch_cuda_version())"
    assert _python(f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {code}") == "12.8"
