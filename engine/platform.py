"""Whether this machine can run the engine on CUDA, answered without importing torch.

ServerArgs settles `device` (None: "cuda" when a GPU is usable, else "cpu") in every process
that checks engine arguments, the caller's included. Importing torch there to ask costs
seconds (more with its CUDA libraries), and a flow that attaches to a resident engine never
needs torch otherwise. So the question is answered as torch.cuda.is_available() would answer
it, from what torch's own answer rests on:

- the installed torch was built with CUDA (torch/version.py's `cuda`, read as a file), and
- the CUDA driver initialises and shows at least one device (libcuda's cuInit and
  cuDeviceGetCount, which honour CUDA_VISIBLE_DEVICES as torch does).

In a process that has imported torch already, torch answers. Anything the probe cannot read
falls back to torch as well. vLLM detects its platform without torch in the same spirit.

NOTE: one case reads differently: a driver too old for torch's CUDA build. torch then says
False and would run on the CPU; here the device is "cuda", and the engine's start fails on
the CUDA error, which names the problem rather than running a GPU job on the CPU unasked.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
import sys
from pathlib import Path


@functools.cache
def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where it can be helped."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    built = torch_cuda_version()
    if built is None:
        return False
    count = driver_device_count()
    if count is None:  # the driver could not be asked: let torch decide
        import torch

        return bool(torch.cuda.is_available())
    return count > 0


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built for (torch.version.cuda), or None."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        source = (Path(spec.origin).parent / "version.py").read_text()
        for node in ast.parse(source).body:
            # `cuda: Optional[str] = '12.8'` (or None), or a plain `cuda = ...`
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            elif isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == "cuda" for t in targets):
                version = ast.literal_eval(value)
                return version if isinstance(version, str) else None
    except (OSError, SyntaxError, ValueError):
        pass
    import torch  # a torch whose version file reads differently: ask it

    return torch.version.cuda


def driver_device_count() -> int | None:
    """CUDA devices the driver shows this process: 0 without a driver or when cuInit fails (as
    torch then reports no CUDA); None when the driver library loads but cannot be asked."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0  # no NVIDIA driver on this machine
    try:
        if libcuda.cuInit(0) != 0:  # e.g. CUDA_VISIBLE_DEVICES="" or a driver fault
            return 0
        count = ctypes.c_int(0)
        if libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except AttributeError:
        return None
