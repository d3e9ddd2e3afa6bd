"""Forking the compile workers (kernels/compile_workers.forked_pool): a refused fork is tried again,
and two threads never fork at once. filelock, which transformers imports, hooks every fork of the
process and raises in one that starts while another thread's fork (or lock) is between states: two
precompiles starting their workers together made one of them fail whole on a GPU machine."""

import multiprocessing
import os
import threading
import time

import pytest

from hf_async_cb.kernels import compile_workers


def _forks(monkeypatch, refuse=(), hold=0.0):
    """os.fork counted; the calls numbered in `refuse` raise as filelock's hook does; a fork that starts
    while another is under way (held `hold` seconds) raises too."""
    seen = {"forks": 0, "overlapping": 0}
    fork = os.fork
    busy = threading.Lock()

    def forking():
        seen["forks"] += 1
        if seen["forks"] in refuse:
            raise RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership")
        if not busy.acquire(blocking=False):
            seen["overlapping"] += 1
            raise RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership")
        try:
            time.sleep(hold)
            return fork()
        finally:
            busy.release()

    monkeypatch.setattr(os, "fork", forking)
    return seen


def test_a_refused_fork_is_tried_again_and_the_workers_forked_before_it_stopped(monkeypatch):
    seen = _forks(monkeypatch, refuse={2, 3})  # the first pool's second worker, then the second pool's first
    before = set(multiprocessing.active_children())
    pool, first = compile_workers.forked_pool(2, None, (), abs, -7)
    try:
        assert first.result(timeout=60) == 7
        assert pool.submit(abs, -3).result(timeout=60) == 3
    finally:
        pool.shutdown(wait=True)
    assert seen["forks"] == 5  # 1 + refused, refused, then the third pool's two
    assert set(multiprocessing.active_children()) == before  # the first pool's forked worker did not stay


def test_refusals_past_the_attempts_raise(monkeypatch):
    monkeypatch.setattr(compile_workers, "FORK_ATTEMPTS", 2)
    _forks(monkeypatch, refuse={1, 2})
    with pytest.raises(RuntimeError, match="filelock"):
        compile_workers.forked_pool(1, None, (), abs, -1)


def test_two_threads_starting_pools_fork_one_at_a_time(monkeypatch):
    seen = _forks(monkeypatch, hold=0.02)
    results, pools = [], []

    def start():
        pool, first = compile_workers.forked_pool(3, None, (), abs, -2)
        pools.append(pool)
        results.append(first.result(timeout=60))

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pool in pools:
        pool.shutdown(wait=True)
    assert results == [2, 2, 2] and seen["forks"] == 9 and seen["overlapping"] == 0


def _compile_or_hang(name):
    """A compile worker's job in the stall tests: "hang" never returns (a worker deadlocked on a lock
    its fork copied held), anything else finishes at once."""
    if name == "hang":
        time.sleep(600)
    return compile_workers.Compiled(name, "", 0.0)


class _Listed:
    """What compile_in_workers reads of a variant, for workers that never compile."""

    def __init__(self, name):
        self.name, self.kernel = name, None

    def pickled(self):
        return self.name

    def describe(self):
        return f"{self.name} variant"


def test_stalled_workers_are_stopped_and_their_variants_reported_left(monkeypatch, caplog):
    """A worker that never finishes (a cold machine's first call once hung so for minutes) costs
    STALL_SECONDS, not the call: the workers are killed and what they did not finish comes back as
    failed, for this process to compile as it loads it."""
    monkeypatch.setattr(compile_workers, "STALL_SECONDS", 4.0)
    monkeypatch.setattr(compile_workers, "_compile", _compile_or_hang)
    monkeypatch.setattr(compile_workers, "_warm_up_compiler", lambda target: None)
    monkeypatch.setattr(compile_workers, "settle_cache_keys", lambda kernels: None)
    before = set(multiprocessing.active_children())
    start = time.perf_counter()
    reports = compile_workers.compile_in_workers([_Listed("a"), _Listed("hang"), _Listed("b")], target=None, workers=2)
    assert time.perf_counter() - start < 20
    assert sorted((c.name, c.error is None) for c in reports) == [("a", True), ("b", True), ("hang", False)]
    assert "stalled" in next(c.error for c in reports if c.name == "hang")
    assert "finished nothing for 4 s" in caplog.text
    assert set(multiprocessing.active_children()) == before  # the hung worker was killed


def test_workers_that_finish_are_waited_for_whatever_the_stall_limit(monkeypatch):
    """The limit is between finished compiles, not on the whole: jobs that each finish within it all
    come back, however long they take together."""
    pool, first = compile_workers.forked_pool(1, None, (), time.sleep, 0.3)
    futures = {first: "first"} | {pool.submit(time.sleep, 0.3): i for i in range(3)}
    try:
        results, left = compile_workers.finished_in_time(futures, stall=0.9)
    finally:
        pool.shutdown(wait=True)
    assert results == [None] * 4 and left == []
