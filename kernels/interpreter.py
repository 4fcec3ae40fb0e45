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


def fix_interpreter_float8_casts() -> None:
    """Make the Triton interpreter's casts to and from float8 (e4m3fn, e5m2) exact, as torch's.

    The interpreter converts floats bit by bit (``_convert_float``, triton 3.9). Loads, stores
    and casts of float8 *to* float32 / bfloat16 are right for every finite value, but a cast
    *to* float8 is not: it rounds a tie away from zero instead of to even, loses the carry when
    rounding overflows the mantissa (e4m3fn -7.75 becomes -4, e5m2 -121.5 becomes -64), and
    flushes or misplaces subnormals; float8_e5m2 -> float16 also drops subnormals. The GPU
    rounds to nearest even (``cvt.rn``), as torch does, so the float8 store kernel could not be
    tested against a PyTorch reference. This routes every conversion that has a float8 side
    through torch's cast (round to nearest even; the kernels clamp to the finite range first,
    so saturation never comes into it). Other conversions and rounding modes are left alone.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_convert_float", None)
    if orig is None or getattr(orig, "_float8_fix", False):
        return
    float8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    wide = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16, tl.float32: torch.float32}
    # every type here travels through numpy as raw bits of its width (bf16 and fp8 as uints)
    types = {**float8, **wide, tl.float64: torch.float64}
    bits = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32),
            64: (np.int64, torch.int64)}  # fmt: skip
    rtne = (None, interpreter._ir.ROUNDING_MODE.RTNE)

    def patched(input, input_dtype, output_dtype, rounding_mode):
        if (
            (input_dtype in float8 or output_dtype in float8)
            and input_dtype in types
            and output_dtype in types
            and rounding_mode in rtne
        ):
            np_in, torch_in = bits[input_dtype.primitive_bitwidth]
            np_out, torch_out = bits[output_dtype.primitive_bitwidth]
            raw = np.array(input, copy=True).reshape(-1).view(np_in)
            src = torch.from_numpy(raw).view(torch_in).view(types[input_dtype])
            out = src.to(types[output_dtype]).view(torch_out).numpy()
            unsigned = np.dtype(f"uint{output_dtype.primitive_bitwidth}")
            return out.view(unsigned).reshape(np.shape(input))
        return orig(input, input_dtype, output_dtype, rounding_mode)

    patched._float8_fix = True
    interpreter._convert_float = patched


def fix_interpreter_nested_calls() -> None:
    """Patch triton.language once per kernel launch, not at every call of a @triton.jit helper.

    The interpreter re-patches every builtin of triton.language (hundreds of attributes) each
    time a kernel calls a jit helper (``InterpretedFunction.__call__``), even a one-line one such
    as ``tl.cdiv``; in the CPU test suite that was over a quarter of the interpreter's time.
    Nothing restores those patches until the launch ends (the launch's own scope puts back what
    was there before it), so a helper whose language modules the launch has patched already
    finds them patched: such a call is skipped, and each launch starts afresh.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    orig_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if None in (orig_patch, executor, scope_type) or getattr(orig_patch, "_once_fix", False):
        return
    launch: list[set[tuple[int, ...]]] = []  # the language modules patched in this launch

    def patch_lang(fn):
        key = tuple(
            sorted(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        )
        if launch and key in launch[-1]:
            return scope_type()  # patched already, and stays so until the launch ends
        scope = orig_patch(fn)
        if launch:
            launch[-1].add(key)
        return scope

    orig_call = executor.__call__

    def call(self, *args, **kwargs):
        launch.append(set())
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            launch.pop()

    patch_lang._once_fix = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = call
