"""engine/stack_chunk.py: a loop run above the large frame never maps a chunk of CPython's frame stack
per call, at any stack depth of its caller; without it, on CPython before 3.13, some depth does (the
cause it works around: python/cpython#142183). Counted as the process's minor page faults: a chunk
mapped afresh faults its first page in."""

import resource
import sys
import threading
import types

from hf_async_cb.engine.stack_chunk import above_a_large_stack_chunk

CALLS = 2000


def _small_leaf(i):
    return i + 1


# The leaf with 300 more local names, never used: a frame of about 2.4 KB, wider than one step of depth,
# so that some depth lands where the loop's frame fits its chunk and the leaf's does not.
_leaf = types.FunctionType(_small_leaf.__code__.replace(
    co_varnames=("i",) + tuple(f"unused{k}" for k in range(300)), co_nlocals=301), globals())


def _loop():
    for i in range(CALLS):
        _leaf(i)


def _faults_at_depth(depth: int, run) -> int:
    if depth:
        return _faults_at_depth(depth - 1, run)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _worst(run) -> int:
    """The most faults `run` makes over 400 stack depths (more than one 16 KiB chunk of frames, so some
    depth puts the loop's frame last in its chunk), in a thread of its own: its frame stack starts
    empty (the suite's own session runs above the large frame: conftest.py)."""
    worst = []
    thread = threading.Thread(target=lambda: worst.append(max(_faults_at_depth(d, run) for d in range(400))))
    thread.start()
    thread.join()
    return worst[0]


def test_a_loop_above_the_large_frame_maps_nothing_per_call():
    assert _worst(lambda: above_a_large_stack_chunk(_loop)) < CALLS // 10
    if sys.version_info < (3, 13):  # (the cause, where CPython has it)
        assert _worst(_loop) >= CALLS


def test_it_returns_what_the_function_returns_and_raises_what_it_raises():
    assert above_a_large_stack_chunk(divmod, 7, 2) == (3, 1)
    try:
        above_a_large_stack_chunk(divmod, 1, 0)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the function's exception was not raised")


def test_this_suite_runs_above_the_large_frame():
    """conftest.py's session loop (without it the suite's interpreted kernels ran up to 2x slower)."""
    frame, names = sys._getframe(), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    assert "above_a_large_stack_chunk" in names
