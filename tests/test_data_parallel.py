"""Data-parallel replicas (two and three CPU replicas here) against one Engine: the same tokens,
greedy and seeded-sampled, whatever replica a request lands on; outputs in prompt order; work
balanced by load."""

import pytest
import torch
from models import random_prompts, tiny_model

from hf_async_cb import BatchingConfig, DataParallel, Engine, SamplingParams
from hf_async_cb.engine.data_parallel import balance

PROMPTS = random_prompts(9, 3, 40, seed=21)


class RaisesKeyError:
    """A logits processor that fails on its request's third step (top level: it pickles)."""

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] > 2 + 3:
            raise KeyError("no such entry")
        return scores


def _tokens(outputs):
    return [o.output_token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_replicas_give_one_engines_tokens_in_prompt_order(mode):
    model = tiny_model("llama")
    expected = _tokens(Engine(model, BatchingConfig(mode=mode)).generate(PROMPTS, max_new_tokens=8))
    with DataParallel(model, devices=["cpu", "cpu"], config=BatchingConfig(mode=mode)) as dp:
        assert dp.engines[0].model is model and dp.engines[1].model is not model
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=8)) == expected
        assert all(dp.last_assignment) and sorted(sum(dp.last_assignment, [])) == list(range(len(PROMPTS)))


def test_sampled_tokens_do_not_depend_on_the_replica():
    """With an engine seed: one Engine, two replicas and three replicas draw the same tokens;
    without one, torch's generator decides, as for one Engine."""
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=8, do_sample=True, temperature=1.3, top_k=50)
    config = BatchingConfig(seed=7)
    single = _tokens(Engine(model, config).generate(PROMPTS, params))
    for devices in (["cpu"] * 2, ["cpu"] * 3):
        with DataParallel(model, devices=devices, config=config) as dp:
            assert _tokens(dp.generate(PROMPTS, params)) == single
    torch.manual_seed(3)
    unseeded_single = _tokens(Engine(model).generate(PROMPTS, params))
    torch.manual_seed(3)
    with DataParallel(model, devices=["cpu"] * 2) as dp:
        assert _tokens(dp.generate(PROMPTS, params)) == unseeded_single


def test_balance_puts_the_longest_first_onto_the_least_loaded():
    costs = [10, 1, 1, 1, 9]
    chosen = balance(costs, 2)
    assert sorted(sum(chosen, [])) == list(range(5)) and 0 in chosen[0] and 4 in chosen[1]
    assert [sum(costs[i] for i in c) for c in chosen] == [11, 11]
    assert balance([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert balance([3], 3) == [[0], [], []]
    costs = list(range(1, 40))
    loads = [sum(costs[i] for i in c) for c in balance(costs, 4)]
    assert max(loads) - min(loads) <= max(costs)


def test_bad_arguments_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="at least one device"):
        DataParallel(model, devices=[])
    with pytest.raises(ValueError, match="a list of devices"):
        DataParallel(model, devices="cpu")
    with pytest.raises(ValueError, match="CPU or CUDA devices, got meta"):
        DataParallel(model, devices=["cpu", "meta"])
    with DataParallel(model, devices=["cpu"]) as dp:
        with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
            dp.generate(PROMPTS[:3], [SamplingParams(), SamplingParams()])


def test_copies_processors_and_stopping_criteria_pass_through():
    """num_return_sequences copies come back next to each other, in prompt order, and do not depend
    on the replica count; a stopping criterion applies on every replica."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=6, do_sample=True, temperature=1.3)
    config = BatchingConfig(seed=11)
    runs = []
    for devices in (["cpu"], ["cpu"] * 3):
        with DataParallel(model, devices=devices, config=config) as dp:
            outs = dp.generate(PROMPTS[:5], params, num_return_sequences=2)
            assert [o.prompt_token_ids for o in outs] == [p for p in PROMPTS[:5] for _ in range(2)]
            runs.append(_tokens(outs))
    assert runs[0] == runs[1]
    # ... and are one Engine's copies: seeded by their index in the whole call.
    assert _tokens(Engine(model, config).generate(PROMPTS[:5], params, num_return_sequences=2)) == runs[0]

    class HistoryOf42(StoppingCriteria):  # stops a request once its history (prompt + output) has 42 tokens
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 42, dtype=torch.bool)

    with DataParallel(model, devices=["cpu"] * 2) as dp:
        outs = dp.generate(PROMPTS[:4], max_new_tokens=8, eos_token_ids=(),
                           stopping_criteria=StoppingCriteriaList([HistoryOf42()]))
        for prompt, out in zip(PROMPTS[:4], outs):
            assert len(out.output_token_ids) == max(1, min(8, 42 - len(prompt)))


class HistoryOf42(object):
    """A stopping criterion defined at module level, so that it pickles to process replicas."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 42, dtype=torch.bool)


def test_process_replicas_give_one_engines_tokens():
    """workers="processes": an Engine per process, the model sent through shared memory; greedy and
    seeded-sampled tokens equal one Engine's, a stopping criterion reaches the workers, an error in a
    worker is raised here (and the next call still works), an argument that does not pickle is
    refused with the remedy, and a dead worker is reported, never waited on."""
    from transformers import StoppingCriteriaList

    from hf_async_cb.engine.replica_process import ReplicaError

    model = tiny_model("llama")
    config = BatchingConfig(seed=5)
    params = SamplingParams(max_new_tokens=6, do_sample=True, temperature=1.3, top_k=50)
    engine = Engine(model, config)
    greedy = _tokens(engine.generate(PROMPTS, max_new_tokens=8))
    sampled = _tokens(engine.generate(PROMPTS, params))
    stopped = _tokens(engine.generate(PROMPTS[:4], max_new_tokens=8,
                                      stopping_criteria=StoppingCriteriaList([HistoryOf42()])))
    engine.close()
    with DataParallel(model, devices=["cpu", "cpu"], config=config, workers="processes") as dp:
        assert dp.workers == "processes" and len(dp.replicas) == 2 and not dp.engines
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=8)) == greedy
        assert all(dp.last_assignment)
        assert _tokens(dp.generate(PROMPTS, params)) == sampled
        assert _tokens(dp.generate(PROMPTS[:4], max_new_tokens=8,
                                   stopping_criteria=StoppingCriteriaList([HistoryOf42()]))) == stopped
        with pytest.raises(ValueError, match="outside the vocabulary"):  # raised in a worker, sent back
            dp.generate([[1, 2, 3], [5, 10**6]], max_new_tokens=2)
        assert _tokens(dp.generate(PROMPTS[:2], max_new_tokens=8)) == greedy[:2]  # the pipes are in step
        with pytest.raises(ValueError, match="does not pickle"):
            dp.generate(PROMPTS[:2], max_new_tokens=2, stopping_criteria=[lambda ids, scores: False])
        assert _tokens(dp.generate(PROMPTS[:2], max_new_tokens=8)) == greedy[:2]
        dp.replicas[1]._process.kill()
        with pytest.raises(ReplicaError, match="died"):
            dp.generate(PROMPTS, max_new_tokens=2)
    with pytest.raises(ValueError, match="workers must be"):
        DataParallel(model, devices=["cpu"], workers="fibers")


def test_scaling_benchmark_runs_on_the_cpu(capsys):
    """benchmarks/data_parallel_scaling.py, the GPU scaling table, as a CPU smoke run: both kinds of
    replica, every request generated."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "data_parallel_scaling.py"
    spec = importlib.util.spec_from_file_location("data_parallel_scaling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--cpu", "--gpus", "2", "--requests-per-gpu", "3", "--new", "4"])
    assert [(r["devices"], r["workers"]) for r in rows] == [(2, "processes"), (2, "threads")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "| 2 | processes |" in capsys.readouterr().out


def test_calls_from_several_threads_take_turns():
    """Two threads calling one process-replica DataParallel at once: each gets its own outputs."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_model("llama")
    with Engine(model) as engine:
        expected = [_tokens(engine.generate(PROMPTS[i::2], max_new_tokens=5)) for i in range(2)]
    with DataParallel(model, devices=["cpu", "cpu"], workers="processes") as dp:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda i: _tokens(dp.generate(PROMPTS[i::2], max_new_tokens=5)), range(2)))
    assert got == expected


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_replicas_refill_as_requests_finish_and_recover_from_an_error(workers):
    """More requests than the replicas hold at once (max_running_requests=1 + the headroom): each
    gets the next request when one of its own ends, with mixed lengths, and the outputs are one
    Engine's, in prompt order; a bad prompt fails the call with the engine's error, and the next
    call runs normally."""
    from hf_async_cb.engine.data_parallel import STREAM_HEADROOM

    model = tiny_model("llama")
    config = BatchingConfig(max_running_requests=1)
    prompts = random_prompts(2 * (1 + STREAM_HEADROOM) + 6, 2, 12, seed=4)
    params = [SamplingParams(max_new_tokens=1 + (i * 7) % 9) for i in range(len(prompts))]
    with Engine(model, config) as engine:
        expected = _tokens(engine.generate(prompts, params))
    with DataParallel(model, devices=["cpu", "cpu"], config=config, workers=workers) as dp:
        assert _tokens(dp.generate(prompts, params)) == expected
        assert sorted(sum(dp.last_assignment, [])) == list(range(len(prompts)))
        assert all(len(chosen) > 1 + STREAM_HEADROOM for chosen in dp.last_assignment)  # both were refilled
        with pytest.raises(ValueError, match="outside the vocabulary"):
            dp.generate([[1, 2, 3], [5, 10**6]], max_new_tokens=2)
        assert _tokens(dp.generate(prompts, params)) == expected


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_replicas_follow_the_model_when_it_is_trained(workers):
    """An RL loop: rollouts, a training step on the model, rollouts. Replicas are copies (other
    devices, fused tensors), so a call after the model's weights changed first copies them into
    every replica: the tokens are those of one Engine on the trained model. Unchanged weights are
    not copied again."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    config = BatchingConfig(fuse_projections=True)
    with DataParallel(model, devices=["cpu", "cpu"], config=config, workers=workers) as dp:
        before = _tokens(dp.generate(PROMPTS, max_new_tokens=6))
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == before and dp.weight_syncs == 0
        optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
        ids = torch.tensor([PROMPTS[0]])
        model.train()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        model.eval()
        expected = _tokens(Engine(copy.deepcopy(model), config).generate(PROMPTS, max_new_tokens=6))
        assert expected != before  # the step changed the greedy tokens
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected and dp.weight_syncs == 1
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected and dp.weight_syncs == 1
        for p in model.parameters():  # written through .data (EMA-style code): no version counter moves
            p.data.mul_(1.25)
        expected = _tokens(Engine(copy.deepcopy(model), config).generate(PROMPTS, max_new_tokens=6))
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected and dp.weight_syncs == 2


def _set_eps(model):
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = 0.5


def _torchao_inner_write(model):
    for m in model.modules():
        qdata = getattr(getattr(m, "weight", None), "qdata", None)
        if qdata is not None:
            qdata.mul_(-1)


CHANGES_BEYOND_PARAMETERS = {
    "a buffer written in place (rotary inv_freq)": lambda model: model.model.rotary_emb.inv_freq.mul_(0.3),
    "a module setting (RMSNorm eps)": _set_eps,
}


@pytest.mark.parametrize("change", list(CHANGES_BEYOND_PARAMETERS))
@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_replicas_follow_changes_beyond_the_parameters(workers, change):
    """Buffers are copied with the parameters; module settings, adapter states and quantized weights'
    inner tensors, which no copy of them carries, make the replicas afresh: every row is the changed
    model's, whichever replica it lands on."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    with DataParallel(model, devices=["cpu", "cpu"], workers=workers) as dp:
        before = _tokens(dp.generate(PROMPTS, max_new_tokens=6))
        with torch.no_grad():
            CHANGES_BEYOND_PARAMETERS[change](model)
        expected = _tokens(Engine(copy.deepcopy(model)).generate(PROMPTS, max_new_tokens=6))
        assert expected != before
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected


def test_replicas_follow_an_adapter_switch_and_a_quantized_weights_inner_write():
    import copy

    import peft
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    wrapper = peft.get_peft_model(copy.deepcopy(tiny_model("llama")), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    wrapper.add_adapter("b", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model = wrapper.get_base_model()  # (its adapter layers stay in it)
    with DataParallel(model, devices=["cpu", "cpu"]) as dp:
        before = _tokens(dp.generate(PROMPTS, max_new_tokens=6))
        wrapper.set_adapter("b")
        expected = _tokens(Engine(copy.deepcopy(model)).generate(PROMPTS, max_new_tokens=6))
        assert expected != before
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected and dp.rebuilds == 1
    quantized = copy.deepcopy(tiny_model("llama"))
    quantize_(quantized, Int8WeightOnlyConfig())
    with DataParallel(quantized, devices=["cpu", "cpu"]) as dp:
        before = _tokens(dp.generate(PROMPTS, max_new_tokens=6))
        with torch.no_grad():
            _torchao_inner_write(quantized)
        expected = _tokens(Engine(copy.deepcopy(quantized)).generate(PROMPTS, max_new_tokens=6))
        assert expected != before
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_errors_keep_their_type_and_a_closed_one_says_so(workers):
    """A request's own error (here a logits processor's KeyError) is raised as one Engine raises it,
    not wrapped; a call after close() is a clear error; close() during a call on another thread
    lets the call end first."""
    import threading

    model = tiny_model("llama")
    prompts = [[5, 6]] * 4
    with pytest.raises(KeyError, match="no such entry"):
        Engine(model).generate(prompts, max_new_tokens=6, logits_processor=RaisesKeyError())
    dp = DataParallel(model, devices=["cpu", "cpu"], workers=workers)
    with pytest.raises(KeyError, match="no such entry"):
        dp.generate(prompts, max_new_tokens=6, logits_processor=RaisesKeyError())
    expected = _tokens(Engine(model).generate(PROMPTS, max_new_tokens=30))
    results = []
    call = threading.Thread(target=lambda: results.append(_tokens(dp.generate(PROMPTS, max_new_tokens=30))))
    call.start()
    while not dp._calls.locked() and call.is_alive():
        pass
    dp.close()  # waits for the call in flight
    call.join(60)
    assert results == [expected]
    with pytest.raises(RuntimeError, match="closed"):
        dp.generate(PROMPTS, max_new_tokens=3)
    dp.close()  # again: nothing to do


def test_process_replicas_take_a_model_once_asked_for_hidden_states():
    """Asking a model for hidden states installs transformers' capturing hooks on it for good
    (closures, which do not pickle): sending it to the workers failed ("Can't pickle local object
    'install_output_capuring_hook.<locals>.output_capturing_hook'"). The workers get it without them,
    and the model keeps its own."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]), output_hidden_states=True)
    hooks = {name: (list(m._forward_hooks), list(m._forward_pre_hooks)) for name, m in model.named_modules()}
    engine = Engine(model, BatchingConfig())
    expected = _tokens(engine.generate(PROMPTS, max_new_tokens=6))
    engine.close()
    with DataParallel(model, devices=["cpu", "cpu"], workers="processes") as dp:
        assert _tokens(dp.generate(PROMPTS, max_new_tokens=6)) == expected
    assert {name: (list(m._forward_hooks), list(m._forward_pre_hooks)) for name, m in model.named_modules()} == hooks
    with torch.no_grad():
        assert len(model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states) == \
            model.config.num_hidden_layers + 1


def test_a_replica_rebuild_that_fails_raises_instead_of_hanging(monkeypatch):
    """Making the replicas afresh runs inside a call, which holds the call lock: a failure there must
    stop the replicas and raise, not wait for that lock (close() takes it)."""
    import copy
    import threading

    model = copy.deepcopy(tiny_model("llama"))
    dp = DataParallel(model, devices=["cpu", "cpu"])
    dp.generate(PROMPTS[:2], max_new_tokens=2)
    _set_eps(model)

    def fail(*args, **kwargs):
        raise RuntimeError("no room for a replica")

    monkeypatch.setattr("hf_async_cb.engine.data_parallel.Engine", fail)
    raised = []
    call = threading.Thread(target=lambda: raised.append(pytest.raises(RuntimeError, dp.generate, PROMPTS[:2],
                                                                       max_new_tokens=2)), daemon=True)
    call.start()
    call.join(timeout=60)
    assert not call.is_alive() and raised and "no room for a replica" in str(raised[0].value)
    dp.close()
