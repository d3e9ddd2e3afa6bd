"""A bounded soak of the online API: hundreds of random requests from several threads, random
aborts, a pool small enough to preempt, CUDA-graph padding (its CPU stand-in). Checked against a
sync-mode rerun of the same requests: nothing lost, nothing duplicated, nothing changed, no page
or thread left behind."""

import copy
import random
import threading
import time

from models import tiny_model

from hf_async_cb import BatchingConfig, Engine, FinishReason, SamplingParams

N_REQUESTS = 1500


def random_workload(seed: int):
    rng = random.Random(seed)
    work = []
    for i in range(N_REQUESTS):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))]
        sampled = rng.random() < 0.4
        params = SamplingParams(max_new_tokens=rng.randint(1, 20), do_sample=sampled, temperature=0.9,
                                top_k=rng.choice([0, 20]), seed=i if sampled else None,
                                eos_token_ids=(rng.randrange(3, 256),) if rng.random() < 0.5 else ())
        work.append((prompt, params))
    return work


def test_soak_against_a_sync_rerun():
    work = random_workload(0)
    reference = Engine(tiny_model("llama"), BatchingConfig(mode="sync")).generate(
        [p for p, _ in work], [sp for _, sp in work])

    threads_before = threading.active_count()
    engine = Engine(copy.deepcopy(tiny_model("llama")),
                    BatchingConfig(mode="async", page_size=4, num_pages=64, max_batch_tokens=48,
                                   max_running_requests=24, cuda_graphs=True))
    engine.start()
    handles = [None] * N_REQUESTS
    rng = random.Random(1)

    def produce(indices):
        for i in indices:
            handles[i] = engine.add_request(*work[i])
            if rng.random() < 0.1:
                time.sleep(0.001)

    producers = [threading.Thread(target=produce, args=(range(k, N_REQUESTS, 3),)) for k in range(3)]
    for t in producers:
        t.start()
    for t in producers:
        t.join(30)
    aborted = set(random.Random(2).sample(range(N_REQUESTS), N_REQUESTS // 10))
    for i in aborted:
        engine.abort(handles[i])
    outputs = [h.result(timeout=120) for h in handles]
    engine.shutdown(timeout=30)

    assert len({o.request_id for o in outputs}) == N_REQUESTS
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        if out.finish_reason is FinishReason.ABORTED:
            assert i in aborted
            assert out.output_token_ids == ref.output_token_ids[: len(out.output_token_ids)]
        else:
            assert out.output_token_ids == ref.output_token_ids, f"request {i} changed"
            assert out.finish_reason == ref.finish_reason
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert not engine.scheduler.has_work
    assert threading.active_count() <= threads_before
    assert sum(o.num_preemptions for o in outputs) > 0, "the pool was meant to force preemption"
