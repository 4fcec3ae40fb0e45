"""Workarounds for Triton's CPU interpreter (TRITON_INTERPRET=1), applied once when it is in use."""

from __future__ import annotations

import os


def fix_interpreter_loop_bounds() -> None:
    """Let the Triton interpreter take run-time loop bounds under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts a loop bound with
    ``int(array)``, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted"), so
    any ``range(start, end)`` over loaded values fails on the CPU (triton-lang/triton#9171, fixed
    upstream by #9172 after triton 3.6.0). A ``while`` loop would dodge it but is not software
    pipelined on the GPU, so the interpreter is patched instead, and only when it is in use.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_index_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._index_fix = True
    interpreter._patch_lang_tensor = patched
