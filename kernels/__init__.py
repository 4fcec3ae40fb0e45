"""Triton kernels of the GPU fast path, each beside a plain-PyTorch reference of the same function.

Tests run every kernel on the CPU under TRITON_INTERPRET=1 and on the GPU (-m gpu).
"""

from kernels.interpreter import (
    fix_interpreter_float8_casts,
    fix_interpreter_loop_bounds,
    fix_interpreter_nested_calls,
)

fix_interpreter_loop_bounds()
fix_interpreter_float8_casts()
fix_interpreter_nested_calls()
