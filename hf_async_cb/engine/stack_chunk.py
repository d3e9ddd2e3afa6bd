"""Run a function above a frame that opens a large chunk of CPython's frame stack, so that the calls it
makes stay inside that chunk: the engine's step loops, and the test suite's session.

Why: CPython 3.11 and 3.12 keep Python frames in chunks of 16 KiB and free a chunk as soon as the frame
at its start returns (python/cpython#142183; later releases cache one chunk). A loop whose calls cross a
chunk's end then maps and unmaps 16 KiB, and faults its pages in, on every such call. Whether a loop
does depends on the stack depth it is called at, so on the caller: a plain script's 32 x 200-token
generate on a tiny CPU model crossed about 15,000 times (strace), and in the test suite the Triton
interpreter's kernels spent a third of tests/test_elementwise.py's time in the system (35 of 91 s).
A frame of about 130 KiB needs a chunk of 256 KiB (a chunk holds its first frame and 8,000 bytes more,
in powers of two from 16 KiB), which leaves about 124 KiB above it, several hundred frames: the loop's
stay inside. Its cost: the chunk's map and about 35 page faults per call.
"""

from __future__ import annotations

import types

_LOCALS = 16_500  # local variables of the opening frame (8 bytes each on 64-bit)


def _call(fn, *args):
    return fn(*args)


def _opening_function():
    # CPython sizes a frame by its local variables (and evaluation stack): _call's code with _LOCALS
    # more local names, never used (19 ms to build, where compiling their source took 170).
    code = _call.__code__
    names = code.co_varnames + tuple(f"_unused{i}" for i in range(_LOCALS))
    named = {"co_name": "above_a_large_stack_chunk"} | ({"co_qualname": "above_a_large_stack_chunk"}
                                                        if hasattr(code, "co_qualname") else {})
    code = code.replace(co_varnames=names, co_nlocals=len(names), **named)  # (tracebacks show this name)
    fn = types.FunctionType(code, globals(), "above_a_large_stack_chunk")
    fn.__doc__ = "fn(*args), run above a frame that opens a 256 KiB chunk of CPython's frame stack."
    return fn


above_a_large_stack_chunk = _opening_function()
