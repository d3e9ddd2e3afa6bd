"""Late admission (BatchingConfig(late_admission=True)): the async serving loop waits, after a step,
until a margin before the running step's expected end, then builds the next, taking in the requests
that arrive meanwhile at once; the wait never changes the tokens nor loses a request."""

import copy
import threading
import time

import pytest
from models import generated_rows, random_prompts, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine import late_admission
from hf_async_cb.engine.late_admission import StepCadence


def test_the_wait_ends_a_margin_before_the_running_step_is_expected_to_end():
    cadence = StepCadence()
    cadence.observe(0.0, steady=False)  # the first step: no interval yet
    assert cadence.delay(0.0) == 0.0
    cadence.observe(0.007, steady=True)  # (a return after an unsteady one: the start of the intervals)
    assert cadence.delay(0.007) == 0.0
    for k in range(2, 8):
        cadence.observe(0.007 * k, steady=True)
    assert cadence.step_s == pytest.approx(0.007)
    now = 0.007 * 7
    assert cadence.delay(now) == pytest.approx(0.007 - max(0.0015, 0.25 * 0.007))
    assert cadence.delay(now + 0.004) == pytest.approx(0.007 - 0.00175 - 0.004)
    assert cadence.delay(now + 0.01) == 0.0  # past the deadline: build now
    cadence.observe(now + 0.007, steady=False)  # idle or draining: forget the last return
    assert cadence.delay(now + 0.007) == 0.0


def test_steps_shorter_than_the_margin_are_not_waited_for():
    cadence = StepCadence()
    for k in range(10):
        cadence.observe(0.001 * k, steady=True)
    assert cadence.step_s == pytest.approx(0.001)
    assert cadence.delay(0.009) == 0.0


def test_a_long_step_does_not_stretch_the_waits_after_it():
    cadence = StepCadence()
    t = 0.0
    for interval in [0.007] * 6 + [0.2] + [0.007]:  # a long prefill chunk among decode steps
        t += interval
        cadence.observe(t, steady=True)
    assert cadence.step_s == pytest.approx(0.007)


def test_an_interval_in_which_the_device_ran_dry_empties_the_record():
    """The wait overshot (or steps run synchronously, as on the CPU): the interval holds the loop's own
    wait, not a step; the loop stops waiting until it has measured steps again."""
    cadence = StepCadence()
    for k in range(6):
        cadence.observe(0.007 * k, steady=True)
    cadence.observe(0.05, steady=True, idled=True)
    assert cadence.step_s is None and cadence.delay(0.05) == 0.0
    cadence.observe(0.057, steady=True)
    assert cadence.step_s == pytest.approx(0.007)


def test_each_kind_of_step_is_expected_to_last_as_its_own_kind_did():
    """A step with a prefill chunk lasts longer than a decode step, the more so the longer its chunk:
    the wait while one runs reads the steps of its own size (the shortest of them), not the decodes'
    median; a size never measured is not waited for."""
    from hf_async_cb.engine.late_admission import step_kind

    assert step_kind(tokens=32, chunks=32) == 0  # decode rows only
    assert step_kind(tokens=31 + 512, chunks=32) == step_kind(tokens=31 + 300, chunks=32) != step_kind(31 + 40, 32)
    cadence = StepCadence()
    t, prefill = 0.0, step_kind(31 + 512, 32)
    for interval, kind in [(0.007, 0)] * 5 + [(0.030, prefill), (0.007, 0), (0.026, prefill), (0.007, 0)]:
        t += interval
        cadence.observe(t, steady=True, kind=kind)
    assert cadence.step_s == pytest.approx(0.007) and cadence.expected_s(prefill) == pytest.approx(0.026)
    assert cadence.delay(t, kind=prefill) == pytest.approx(0.026 - 0.25 * 0.026)
    assert cadence.delay(t, kind=0) == pytest.approx(0.007 - 0.00175)
    assert cadence.delay(t, kind=step_kind(31 + 4000, 32)) == 0.0


def test_the_margin_grows_where_the_device_ran_dry_and_shrinks_back_while_it_does_not():
    cadence = StepCadence()
    t = 0.0
    for _ in range(4):
        t += 0.008
        cadence.observe(t, steady=True)
    shares = []
    for _ in range(4):  # the device ran dry four times in a row: the margin grows, up to its cap
        t += 0.008
        cadence.observe(t, steady=True, idled=True)
        shares.append(cadence.margin_share)
    assert shares == pytest.approx([0.375, 0.5625, 0.6, 0.6])
    t += 0.008
    cadence.observe(t, steady=True)  # (the first steady return after the idle one starts the intervals)
    for _ in range(200):
        t += 0.008
        cadence.observe(t, steady=True)
    assert cadence.margin_share == pytest.approx(0.25)  # back to its base
    assert cadence.delay(t) == pytest.approx(0.008 - 0.25 * 0.008)


def _stock_rows(prompts, new):
    return generated_rows(stock_generate(tiny_model("llama"), prompts, max_new_tokens=new, eos_token_id=[2],
                                         pad_token_id=0), max(map(len, prompts)), pad=0, eos=(2,))


def test_served_requests_give_stock_tokens_with_the_loop_waiting_between_steps(monkeypatch):
    # Every step waited for (the CPU's steps are shorter than the GPU's the defaults are for), and a
    # margin of none: the loop holds each build a whole step's time, taking arrivals in meanwhile.
    original, observe = StepCadence.__init__, StepCadence.observe
    monkeypatch.setattr(late_admission.StepCadence, "__init__",
                        lambda self: original(self, min_step_s=0.0, margin_s=0.0, margin_share=0.0))
    # (the CPU's steps have always finished when the next is built: read as the device's intervals)
    monkeypatch.setattr(late_admission.StepCadence, "observe",
                        lambda self, now, steady, idled=False, kind=0, build_s=None: observe(self, now, steady, False, kind,
                                                                                            build_s))
    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode="async", max_batch_tokens=48,
                                                                       late_admission=True))
    engine.start()
    try:
        prompts = random_prompts(12, 1, 40, seed=5)
        expected = _stock_rows(prompts, 12)
        handles = []

        def produce():
            for p in prompts:
                handles.append(engine.add_request(p, max_new_tokens=12, eos_token_ids=(2,)))
                time.sleep(0.003)

        producer = threading.Thread(target=produce)
        producer.start()
        producer.join(30)
        assert [h.result(timeout=60).output_token_ids for h in handles] == expected
        assert engine._background._worker.late_waits > 0  # the wait path ran
    finally:
        engine.shutdown(cancel=True, timeout=30)
    assert engine.allocator.num_free == engine.allocator.num_pages


def _long_steps_engine(monkeypatch, long_steps):
    """An async serving engine whose cadence reads every step as 5 s long while long_steps[0] (a hold
    of ~3.75 s after each step), and one request keeping a step in flight; (engine, worker, request)."""
    observe = StepCadence.observe

    def read_steps(self, now, steady, idled=False, kind=0, build_s=None):
        observe(self, now, steady, False, kind, build_s)
        self._intervals.clear()
        if long_steps[0]:
            for k in range(12):  # (whatever kind of step runs)
                self._record(k).append(5.0)

    monkeypatch.setattr(late_admission.StepCadence, "observe", read_steps)
    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode="async", late_admission=True))
    engine.start()
    worker = engine._background._worker
    first = engine.add_request([5, 6, 7], max_new_tokens=200, eos_token_ids=())  # keeps a step in flight
    for _ in range(500):  # until a step returned with one in flight: the loop then waits ~3.75 s
        if worker.late_waits or first.done:
            break
        time.sleep(0.002)
    assert not first.done and worker.late_waits
    return engine, worker, first


def test_an_arrival_during_the_hold_is_taken_in_at_once_and_joins_the_step_built_at_its_end(monkeypatch):
    """The step after the running one cannot start before it ends: building it at an arrival gains that
    arrival nothing and shuts out the later ones. So the request is taken in at once (out of the
    intake, into the scheduler) while the build waits for the hold's end; a shutdown ends the hold."""
    long_steps = [True]
    engine, worker, first = _long_steps_engine(monkeypatch, long_steps)
    try:
        time.sleep(0.2)  # (well inside the hold)
        long_steps[0] = False  # the hold under way was set at 5 s; none after it
        hold = worker._hold_until
        assert hold is not None
        second = engine.add_request([8, 9], max_new_tokens=1, eos_token_ids=())
        for _ in range(250):
            if worker.intake.empty():
                break
            time.sleep(0.002)
        assert worker.intake.empty() and second.request in worker.scheduler.waiting  # taken in, not built
        assert second.request.num_computed == 0 and time.perf_counter() < hold
        second.result(timeout=30)
        assert time.perf_counter() >= hold  # built once the hold ended
    finally:
        started = time.perf_counter()
        engine.shutdown(cancel=True, timeout=30)
    assert time.perf_counter() - started < 2.0


def test_with_the_earlier_rule_an_arrival_cuts_the_wait_short(monkeypatch):
    """late_admission.ARRIVALS_END_THE_WAIT (the A/B's other arm): an arrival ends the wait and is built
    at once; what the bound measures is the cut wait, not a 3.75 s one."""
    monkeypatch.setattr(late_admission, "ARRIVALS_END_THE_WAIT", True)
    long_steps = [True]
    engine, worker, first = _long_steps_engine(monkeypatch, long_steps)
    try:
        time.sleep(0.2)
        long_steps[0] = False
        started = time.perf_counter()
        engine.add_request([8, 9], max_new_tokens=1, eos_token_ids=()).result(timeout=30)
        assert time.perf_counter() - started < 2.0
    finally:
        engine.shutdown(cancel=True, timeout=30)


def test_on_the_cpu_where_steps_run_synchronously_the_loop_never_waits(monkeypatch):
    """Each step has finished when the next is built: the loop reads no step duration and serves as
    without late admission (it once waited most of each step, as its own waits lengthened the
    intervals), even with no minimum step and no margin."""
    original = StepCadence.__init__
    monkeypatch.setattr(late_admission.StepCadence, "__init__",
                        lambda self: original(self, min_step_s=0.0, margin_s=0.0, margin_share=0.0))
    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode="async", late_admission=True))
    engine.start()
    try:
        prompts = random_prompts(6, 20, 40, seed=9)
        handles = [engine.add_request(p, max_new_tokens=24, eos_token_ids=(2,)) for p in prompts]
        assert [h.result(timeout=60).output_token_ids for h in handles] == _stock_rows(prompts, 24)
        assert engine._background._worker.late_waits == 0
    finally:
        engine.shutdown(cancel=True, timeout=30)


def test_no_wait_while_requests_queue_for_room(monkeypatch):
    """With requests waiting for room (here the running-request limit), an arrival would queue behind
    them: the loop builds each step at once. Every wait is made 3.75 s long here, so one wait would
    hold the running request far past the bound below."""
    observe = StepCadence.observe

    def read_long_steps(self, now, steady, idled=False, kind=0, build_s=None):
        observe(self, now, steady, False, kind, build_s)
        self._intervals.clear()
        for k in range(12):
            self._record(k).append(5.0)

    monkeypatch.setattr(late_admission.StepCadence, "observe", read_long_steps)
    engine = Engine(copy.deepcopy(tiny_model("llama")), BatchingConfig(mode="async", max_running_requests=1))
    assert engine.config.late_admission  # (the default)
    engine.start()
    try:
        running = engine.add_request([5, 6, 7], max_new_tokens=24, eos_token_ids=())
        queued = engine.add_request([8, 9], max_new_tokens=2, eos_token_ids=())
        started = time.perf_counter()
        assert len(running.result(timeout=30).output_token_ids) == 24
        # (Once the queued request is taken in, as the running one's last token is sampled, nothing
        # queues and the loop may wait: the bound is what tells a wait while it queued.)
        assert time.perf_counter() - started < 3.0
        assert not queued.done or queued.result().output_token_ids
    finally:
        engine.shutdown(cancel=True, timeout=30)


def test_short_builds_narrow_the_margin_down_to_its_floor_and_an_idle_device_widens_it_again():
    """The margin's base is a quarter of the step where nothing is known of the host's builds; twice
    their median where that is less (what an arrival in the margin pays: a step), not below
    `min_share` (a quarter by default: builds lower nothing until a floor is measured on the device);
    a device that ran dry still grows it from there."""
    assert StepCadence().min_share == 0.25
    cadence = StepCadence(min_share=0.08)
    t = 0.0
    for _ in range(8):
        t += 0.016
        cadence.observe(t, steady=True)
    assert cadence.delay(t) == pytest.approx(0.016 * 0.75)  # no builds known: a quarter of the step
    for _ in range(16):
        t += 0.016
        cadence.observe(t, steady=True, build_s=0.0015)
    assert cadence.delay(t) == pytest.approx(0.016 - 0.003)  # twice the builds' median
    for _ in range(16):
        t += 0.016
        cadence.observe(t, steady=True, build_s=0.0002)
    assert cadence.delay(t) == pytest.approx(0.016 - 0.0015)  # (at least margin_s: 1.5 ms)
    for _ in range(8):
        t += 0.030
        cadence.observe(t, steady=True, build_s=0.0002)
    assert cadence.delay(t) == pytest.approx(0.030 * (1 - 0.08))  # the floor: min_share of the step
    t += 0.030
    cadence.observe(t, steady=True, idled=True, build_s=0.0002)
    t += 0.030
    cadence.observe(t, steady=True, build_s=0.0002)
    grown = 0.25 * 1.5 * 0.97  # (grown by half, then one steady step's recovery)
    assert cadence.delay(t) == pytest.approx(0.030 * (1 - (0.08 + grown - 0.25)))  # the growth kept on the floor
    for _ in range(16):
        t += 0.016
        cadence.observe(t, steady=True, build_s=0.02)  # builds longer than the step: the base, no more
    assert cadence.step_s == pytest.approx(0.016) and cadence.delay(t) <= 0.016 * 0.75 + 1e-9
