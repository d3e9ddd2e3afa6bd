"""The CUDA-graph decode path, run on the CPU through its eager stand-in: padding to buckets, the
trash slot, static buffers and carry-over through them must leave every token as stock's."""

import copy

import pytest
import torch
from models import generated_rows, random_prompts, stock_generate, tiny_model
from transformers import LogitsProcessorList

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.engine.cuda_graphs import DecodeGraphs
from hf_async_cb.engine.graph_keys import GraphKey
from hf_async_cb.engine.requests import Request, SamplingParams
from hf_async_cb.engine.step_plan import ScheduledChunk, StepPlan


def expected_rows(model, prompts, new):
    out = stock_generate(model, prompts, max_new_tokens=new, eos_token_id=[2], pad_token_id=0)
    return generated_rows(out, max(map(len, prompts)), pad=0, eos=(2,))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("family, batch, pages", [
    ("llama", 5, None),     # 5 rows padded to 8
    ("gpt2", 13, None),     # 13 -> 16, learned positions
    ("mistral", 9, None),   # sliding window inside the graph
    ("llama", 12, 40),      # preemption changes the batch between graph steps
])
def test_graph_path_matches_stock(family, batch, pages, mode):
    model = tiny_model(family)
    prompts = random_prompts(batch, 3, 70, seed=batch)
    engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=True, page_size=4, num_pages=pages,
                                          max_batch_tokens=64))
    outs = engine.generate(prompts, max_new_tokens=16, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 16)
    assert engine.graphs.num_replays > 0 and len(engine.graphs) > 0
    assert engine.graphs.num_prefill_graphs > 0  # chunked prefill and mixed steps replay graphs too
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_graph_buckets():
    model = tiny_model("llama")
    engine = Engine(model, BatchingConfig(mode="sync", cuda_graphs=True, max_running_requests=20))
    prompts = random_prompts(3, 60, 70, seed=1)
    outs = engine.generate(prompts, max_new_tokens=10, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 10)
    keys = set(engine.graphs._graphs)
    # The prompts' ~200 tokens in one step padded to 256: a padding request of ~60 tokens, on the trash
    # page; its context bucket a power of 4 (the decodes' a power of 2).
    assert GraphKey(4, 256, 256) in keys
    assert keys <= {GraphKey(4, 64), GraphKey(4, 128), GraphKey(4, 256, 256)}, keys
    assert engine.graphs.max_batch == 32
    # The step's inputs are one uploaded buffer, so a graph loads them with one copy.
    for graph in engine.graphs._graphs.values():
        flat = graph.ints.flat.untyped_storage().data_ptr()
        assert all(view.untyped_storage().data_ptr() == flat for view in graph.ints.views)


def test_plain_plans_skip_the_row_checks_and_any_other_row_still_counts():
    """key_for looks at rows only when a plan is not plain; then one row with a processor of its
    own (even an empty list), kept scores or an unseeded draw keeps the step from a graph."""
    graphs = DecodeGraphs(None, 8, is_cuda=False, prefill=True)

    def request(**options):
        return Request([3] * 5, SamplingParams(**options))

    def plan(*requests):
        return StepPlan([ScheduledChunk(r, 4, 1, True) for r in requests], [])

    plain = [request() for _ in range(3)]
    assert plan(*plain).plain and graphs.key_for(plan(*plain)) == GraphKey(4, 64)
    processor, keeps = request(), request()
    processor.logits_processor = LogitsProcessorList()
    keeps.keep_scores = True
    for other in (processor, keeps, request(do_sample=True)):
        assert not plan(*plain, other).plain and graphs.key_for(plan(*plain, other)) is None
    assert graphs.eager == {"row_options": 3}
    assert graphs.key_for(plan(*plain, request(do_sample=True, seed=3))) == GraphKey(4, 64, sampled=True)


def test_a_bucket_that_keeps_missing_takes_the_place_of_the_least_replayed_one():
    """At the cap, a prefill bucket whose steps ran eagerly `evict_after` times takes the place of the
    captured prefill bucket replayed least (where that one was replayed fewer times); a place changes
    hands at most once per `evict_after` eager steps; decode buckets keep theirs; 0 turns it off."""
    def prefill(tokens):
        return StepPlan([ScheduledChunk(Request([3] * tokens, SamplingParams()), 0, tokens, True)], [])

    graphs = DecodeGraphs(None, 64, is_cuda=False, prefill=True, max_prefill_graphs=2)
    graphs.evict_after = 3
    a, b, c = (graphs.key_for(prefill(n)) for n in (10, 40, 400))
    decode = GraphKey(4, 64)
    for key in (a, b, decode):
        graphs._graphs[key] = None
    graphs.num_prefill_graphs = 2
    graphs._replays.update({a: 10, b: 2})
    assert [graphs.key_for(prefill(400)) for _ in range(2)] == [None, None]  # two eager steps
    assert graphs.key_for(prefill(400)) == c and graphs.num_evicted == 1  # the third: b's place
    assert set(graphs._graphs) == {a, decode} and graphs.num_prefill_graphs == 1
    graphs._graphs[c] = None
    graphs.num_prefill_graphs = 2
    # b comes back (too large a step for a's bucket, too small for c's): c, replayed least, gives its place
    assert [graphs.key_for(prefill(40)) for _ in range(3)] == [None, None, b] and c not in graphs._graphs
    graphs.evict_after = 0
    graphs._graphs[b] = None
    graphs.num_prefill_graphs = 2
    assert all(graphs.key_for(prefill(400)) is None for _ in range(10)) and graphs.num_evicted == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_places_changing_hands_keep_stock_tokens(mode):
    """A call of short prompts takes the only prefill place; the next call's longer prompts (another
    context bucket) miss it until their bucket takes the place: a graph dropped and another captured
    mid-call (on CUDA, real captures), every token stock's."""
    model = tiny_model("llama")
    calls = [(random_prompts(4, 3, 8, seed=11), 4), (random_prompts(10, 50, 60, seed=12), 10)]
    expected = [expected_rows(model, prompts, new) for prompts, new in calls]
    if torch.cuda.is_available():
        model = copy.deepcopy(model).cuda()
    engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=True, page_size=4, max_batch_tokens=48,
                                          max_running_requests=4))
    engine.graphs.max_prefill_graphs = 1
    engine.graphs.evict_after = 1
    got = [[o.output_token_ids for o in engine.generate(prompts, max_new_tokens=new, eos_token_ids=(2,))]
           for prompts, new in calls]
    assert got == expected
    assert engine.graphs.num_evicted > 0 and engine.graphs.num_prefill_graphs == 1
    engine.close()


def test_prefill_graphs_are_capped():
    model = tiny_model("llama")
    prompts = random_prompts(9, 3, 70, seed=2)
    engine = Engine(model, BatchingConfig(mode="async", cuda_graphs=True, page_size=4, max_batch_tokens=48))
    engine.graphs.max_prefill_graphs = 2
    outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 12)
    assert engine.graphs.num_prefill_graphs == 2
    assert sum(key.tokens > 0 for key in engine.graphs._graphs) == 2


def test_mixed_steps_of_a_drifting_request_count_share_buckets():
    """A serving load's mixed steps (decodes beside one prefill chunk) keep changing their request
    count: prefill/mixed buckets pad the requests to a power of 4, so 17 to 63 requests share one
    bucket; decode steps keep powers of two. Within the graphs' row limit only."""
    graphs = DecodeGraphs(None, 64, is_cuda=False, prefill=True)

    def mixed(decodes, prefill):
        chunks = [ScheduledChunk(Request([3] * 300, SamplingParams()), 200, 1, True) for _ in range(decodes)]
        return StepPlan(chunks + [ScheduledChunk(Request([3] * 300, SamplingParams()), 0, prefill, True)], [])

    # (context: 300 + 20 new tokens at most, within 1024: PREFILL_CONTEXT_REACH)
    assert {graphs.key_for(mixed(n, 40)) for n in (16, 30, 62)} == {GraphKey(64, 1024, 128)}
    assert graphs.key_for(mixed(3, 40)).batch == 16  # 4 requests and 44 tokens: the padding needs a request
    assert graphs.key_for(mixed(100, 40)) == GraphKey(128, 1024, 256)  # 4**4 is over 2 x 64 rows: a power of 2
    decode = StepPlan([ScheduledChunk(Request([3] * 300, SamplingParams()), 200, 1, True) for _ in range(17)], [])
    assert graphs.key_for(decode) == GraphKey(32, 256)


def test_prefill_buckets_share_contexts_within_a_power_of_four():
    """A prefill/mixed bucket's context grows by powers of 4 from 64 (its block table is only read as
    far as each request's own length), so steps over contexts of 257 to 1024 keys share one bucket,
    and it holds what the step's requests may yet reach (prompt and new tokens, up to
    PREFILL_CONTEXT_REACH keys); decode buckets keep powers of two (their split count depends on the
    context)."""
    from hf_async_cb.engine.graph_keys import prefill_context_bucket

    assert [prefill_context_bucket(n) for n in (1, 64, 65, 256, 257, 1024, 1025, 4096, 4097)] == [
        64, 64, 256, 256, 1024, 1024, 4096, 4096, 16384]
    assert [prefill_context_bucket(n, step=1) for n in (64, 65, 129, 1025)] == [64, 128, 256, 2048]
    graphs = DecodeGraphs(None, 64, is_cuda=False, prefill=True)

    def mixed(context):
        decodes = [ScheduledChunk(Request([3] * context, SamplingParams()), context - 1, 1, True) for _ in range(5)]
        return StepPlan(decodes + [ScheduledChunk(Request([3] * 40, SamplingParams()), 0, 40, True)], [])

    assert {graphs.key_for(mixed(n)) for n in (300, 600, 1000)} == {GraphKey(16, 1024, 64)}

    def prefill(new_tokens):  # 40 prompt tokens, and room for this many new ones
        return StepPlan([ScheduledChunk(Request([3] * 40, SamplingParams(max_new_tokens=new_tokens)), 0, 40, True)], [])

    assert [graphs.key_for(prefill(n)).context for n in (10, 200, 2000, 50_000)] == [64, 256, 4096, 4096]
    decodes = [graphs.key_for(StepPlan([ScheduledChunk(Request([3] * n, SamplingParams()), n - 1, 1, True)], []))
               for n in (300, 600)]
    assert decodes == [GraphKey(1, 512), GraphKey(1, 1024)]


def test_at_the_cap_a_step_replays_the_smallest_captured_bucket_that_holds_it():
    """With every prefill bucket taken, a step of a new bucket pads up into a captured one: enough
    requests (each padding request needs a token), tokens and context; the same kind (tall,
    sampled); not far larger than its own bucket. Else it runs eagerly."""
    graphs = DecodeGraphs(None, 64, is_cuda=False, prefill=True, tall_query_len=64, max_prefill_graphs=0)

    def plan(*chunks):  # (cached start, own tokens) per request
        return StepPlan([ScheduledChunk(Request([3] * (s + n), SamplingParams()), s, n, True) for s, n in chunks], [])

    step = plan((1025, 5), (300, 1), (40, 1))  # 7 tokens, 3 requests, context 1030: bucket (4, 4096, 8)
    assert graphs.key_for(step) is None  # nothing captured
    for key in [GraphKey(4, 1024, 8), GraphKey(8, 2048, 16), GraphKey(8, 2048, 32), GraphKey(16, 2048, 512),
                GraphKey(8, 2048, 16, tall=True), GraphKey(8, 2048, 16, sampled=True), GraphKey(16, 256, 64),
                GraphKey(2, 4096, 8)]:
        graphs._graphs[key] = None
    # (4, 1024, 8): context too short; (2, ...): too few requests; (16, 256, 64): context too short.
    assert graphs.key_for(step) == GraphKey(8, 2048, 16) and graphs.num_padded_up == 1
    assert graphs.key_for(plan((1025, 5), (300, 1), (40, 1), (5, 9))) == GraphKey(8, 2048, 32)  # 16 tokens + 4 pads > 16
    assert graphs.key_for(plan((10, 70), (5, 1))) is None  # tall: only tall buckets, and (8, 2048, 16) is too small
    assert graphs.key_for(plan((10, 40), (5, 40), (5, 40))) is None  # 512 tokens: over twice its own bucket (128)
    graphs._graphs[GraphKey(4, 1024, 8)] = None
    assert graphs.key_for(plan((500, 4), (300, 1), (40, 1))) == GraphKey(4, 1024, 8)  # the smallest that holds it
    exact = GraphKey(4, 1024, 8)  # a step whose own bucket is captured takes it
    assert graphs.key_for(plan((900, 4), (300, 1), (40, 1))) == exact


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_steps_padded_up_into_captured_buckets_replay_stock_tokens(mode):
    """Capped at two prefill buckets, the later mixed steps of other buckets replay the captured
    ones with more padding (requests on the trash page, a longer last padding request), and every
    token is stock's."""
    model = tiny_model("llama")
    prompts = random_prompts(12, 3, 40, seed=8)
    engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=True, page_size=4, max_batch_tokens=48,
                                          max_running_requests=5))
    engine.graphs.max_prefill_graphs = 2
    outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 12)
    assert engine.graphs.num_prefill_graphs == 2 and engine.graphs.num_padded_up > 0


def test_large_prefill_steps_run_eagerly():
    """A prefill step of more than PREFILL_GRAPH_MAX_TOKENS tokens gets no graph (its GPU time
    dwarfs the launches a graph saves); one at the limit still does."""
    from hf_async_cb.engine.graph_keys import PREFILL_GRAPH_MAX_TOKENS

    graphs = DecodeGraphs(None, 8, is_cuda=False, prefill=True)

    def plan(tokens):
        return StepPlan([ScheduledChunk(Request([3] * tokens, SamplingParams()), 0, tokens, True)], [])

    assert graphs.key_for(plan(PREFILL_GRAPH_MAX_TOKENS - 8)) is not None
    assert graphs.key_for(plan(PREFILL_GRAPH_MAX_TOKENS + 1)) is None
    assert graphs.eager == {"too_large": 1}  # counted by why (the serving benchmark reports them)


def test_a_token_cap_keeps_larger_steps_eager():
    """max_tokens (an LLM.int8() model: its linears run their own forward, which no graph may hold,
    over 256 rows): decode and prefill buckets over it get no graph, those within it do."""
    graphs = DecodeGraphs(None, 512, is_cuda=False, prefill=True, max_tokens=256)

    def plan(*sizes):
        return StepPlan([ScheduledChunk(Request([3] * 40, SamplingParams()), 0 if n > 1 else 39, n, True)
                         for n in sizes], [])

    assert graphs.key_for(plan(*[1] * 256)).batch == 256
    assert graphs.key_for(plan(*[1] * 257)) is None  # a bucket of 512 rows
    assert graphs.key_for(plan(40, 40, 40)).tokens == 128
    assert graphs.key_for(plan(*[40] * 7)) is None  # 280 tokens: a bucket of 512
    assert DecodeGraphs(None, 512, is_cuda=False, prefill=True).key_for(plan(*[40] * 7)) is not None


def test_tall_query_steps_get_buckets_of_their_own():
    """The Triton attention's tile height follows the step's longest query, and a graph keeps the
    tile of its capture: a step with a long prefill chunk must not share a bucket with one of short
    chunks of the same token count."""
    graphs = DecodeGraphs(None, 8, is_cuda=False, prefill=True, tall_query_len=64)

    def plan(*sizes):
        return StepPlan([ScheduledChunk(Request([3] * 200, SamplingParams()), 0, n, True) for n in sizes], [])

    short, tall, decodes_and_tall = plan(40, 40, 40), plan(100, 10, 10), plan(1, 1, 118)
    assert {graphs.key_for(p).tokens for p in (short, tall, decodes_and_tall)} == {128}
    assert not graphs.key_for(short).tall and graphs.key_for(tall).tall and graphs.key_for(decodes_and_tall).tall
    assert graphs.key_for(plan(63)).tall is False and graphs.key_for(plan(64)).tall is True
    assert not DecodeGraphs(None, 8, is_cuda=False, prefill=True).key_for(tall).tall  # other backends: one kind


def test_tall_and_short_buckets_replay_stock_tokens():
    model = tiny_model("llama")
    prompts = random_prompts(1, 40, 41, seed=4) + random_prompts(8, 3, 12, seed=5)  # one tall step, then short ones
    engine = Engine(model, BatchingConfig(mode="async", cuda_graphs=True, page_size=4, max_batch_tokens=64,
                                          max_running_requests=4))
    engine.graphs.tall_query_len = 16
    outs = engine.generate(prompts, max_new_tokens=10, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 10)
    kinds = {key.tall for key in engine.graphs._graphs if key.tokens}
    assert kinds == {False, True}, engine.graphs._graphs.keys()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_seeded_sampling_replays_graphs_with_the_eager_tokens(mode):
    """Sampled and greedy requests (different warpers) share graph buckets, decode and prefill, and
    draw the very tokens of eager steps: a seeded draw depends on device tensors only."""
    from hf_async_cb import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts(7, 3, 40, seed=5)
    params = [SamplingParams(max_new_tokens=14, do_sample=True, top_k=k, top_p=p, temperature=t, min_p=m)
              for k, p, t, m in [(0, 1.0, 1.0, 0.0), (5, 1.0, 0.7, 0.0), (0, 0.8, 1.3, 0.0), (0, 1.0, 1.0, 0.1),
                                 (20, 0.9, 0.9, 0.05)]] + [SamplingParams(max_new_tokens=14)] * 2
    runs = []
    for graphs in (False, True):
        engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, seed=11, page_size=4,
                                              max_batch_tokens=48))
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        if graphs:
            keys = set(engine.graphs._graphs)
            assert engine.graphs.num_replays > 0
            assert any(k.sampled and k.tokens == 0 for k in keys) and any(k.sampled and k.tokens for k in keys)
    assert runs[0] == runs[1]


def test_repetition_penalty_steps_replay_graphs_with_stock_tokens(monkeypatch):
    """Penalised rows (left-padded generate: the history prefix has a bucket of its own) replay
    graphs, next to unpenalised padding rows, and give stock's tokens."""
    from models import left_pad

    from hf_async_cb.engine import cuda_graphs

    keys = []
    step = cuda_graphs.DecodeGraphs.step
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "step", lambda self, key, *a: keys.append(key) or step(self, key, *a))
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(6, 2, 30, seed=33))
    for penalty in (1.3, 0.7):
        common = dict(attention_mask=mask, max_new_tokens=12, repetition_penalty=penalty, pad_token_id=0)
        expected = model.generate(ids, batching="off", **common)
        for mode in ("sync", "async"):
            got = model.generate(ids, batching=mode, **common,
                                 batching_config=BatchingConfig(page_size=4, max_batch_tokens=32, cuda_graphs=True))
            assert torch.equal(got, expected), (penalty, mode)
    penalties = {k.penalty for k in keys if k.penalty}
    assert {p[:2] for p in penalties} == {(True, False), (False, True)} and any(p[2] > 0 for p in penalties)
    assert any(k.tokens == 0 for k in keys if k.penalty) and any(k.tokens for k in keys if k.penalty)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_blocked_token_steps_replay_graphs_with_the_eager_tokens(mode):
    """min_new_tokens' EOS, suppress_tokens and begin_suppress_tokens (per request, with sampled rows
    beside): their (row, token) pairs padded to a bucket, the tokens those of eager steps."""
    from hf_async_cb import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts(6, 3, 30, seed=7)
    eos = (2, 3)
    params = [SamplingParams(max_new_tokens=12, min_new_tokens=m, suppress_tokens=s, begin_suppress_tokens=b,
                             eos_token_ids=eos, do_sample=d)
              for m, s, b, d in [(5, (), (), False), (0, (7, 8, 9), (), False), (3, (11,), tuple(range(20, 40)), True),
                                 (0, (), (), False), (8, (4,), (), True), (0, (), (), True)]]
    runs = []
    for graphs in (False, True):
        engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, seed=5, page_size=4, max_batch_tokens=40))
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        if graphs:
            assert any(k.blocked for k in engine.graphs._graphs) and engine.graphs.num_replays > 0
    assert runs[0] == runs[1]
    for out, p in zip(runs[0], params):
        assert not set(out[: p.min_new_tokens]) & set(eos) and not set(out) & set(p.suppress_tokens)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ngram_steps_replay_graphs_with_the_eager_tokens(mode):
    """Per-request n-gram sizes (and none) beside a penalty: stock's bans, in graph buckets."""
    from hf_async_cb import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts(5, 3, 30, seed=9)
    params = [SamplingParams(max_new_tokens=16, no_repeat_ngram_size=n, repetition_penalty=r, eos_token_ids=())
              for n, r in [(2, 1.0), (3, 1.2), (0, 1.0), (1, 1.0), (4, 0.9)]]
    runs = []
    for graphs in (False, True):
        engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, page_size=4, max_batch_tokens=40))
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        if graphs:
            assert any(k.penalty and k.penalty[3] == 4 for k in engine.graphs._graphs)
    assert runs[0] == runs[1]
    for prompt, out, p in zip(prompts, runs[0], params):
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=16, no_repeat_ngram_size=p.no_repeat_ngram_size,
                               repetition_penalty=p.repetition_penalty, eos_token_id=None, batching="off")
        assert out == stock[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_key_list_steps_replay_graphs_with_stock_tokens(mode):
    """bad_words_ids and sequence_bias (one- and multi-token keys, per request, and none), their
    key lists padded to the bucket with keys that never match: stock's tokens for each request."""
    from hf_async_cb import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts(5, 3, 30, seed=12)
    stock_runs = [model.generate(torch.tensor([p]), max_new_tokens=14, eos_token_id=None, batching="off")[0, len(p):]
                  for p in prompts]
    # Keys built from stock's own picks, so that they do change the tokens.
    picks = [t.tolist() for t in stock_runs]
    options = [dict(bad_words_ids=((picks[0][2],), tuple(picks[0][4:6]))),
               dict(sequence_bias=(((picks[1][1],), -4.0), (tuple(picks[1][3:6]), -9.0), ((7,), 1.5))),
               dict(),
               dict(bad_words_ids=((picks[3][0],),), sequence_bias=((tuple(picks[3][2:4]), -6.0),)),
               dict(repetition_penalty=1.2, bad_words_ids=(tuple(picks[4][1:3]),))]
    params = [SamplingParams(max_new_tokens=14, eos_token_ids=(), **o) for o in options]
    runs = []
    for graphs in (False, True):
        engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=graphs, page_size=4, max_batch_tokens=40))
        runs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        if graphs:
            assert any(k.penalty and k.penalty[4] and k.penalty[5] for k in engine.graphs._graphs)
    assert runs[0] == runs[1]
    for prompt, out, option, plain in zip(prompts, runs[0], options, picks):
        kwargs = {k: ([list(w) for w in v] if k == "bad_words_ids" else {tuple(key): b for key, b in v})
                  if k != "repetition_penalty" else v for k, v in option.items()}
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=14, eos_token_id=None, batching="off", **kwargs)
        assert out == stock[0, len(prompt):].tolist()
        assert option == {} or out != plain, "the option should change the tokens"


def test_a_failed_capture_falls_back_to_eager_steps(monkeypatch, caplog):
    """A model op that cannot be captured must cost speed, never the generation."""
    from hf_async_cb.engine import captured_graph

    def failing_capture(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(captured_graph.CapturedGraph, "__init__", failing_capture)
    model = tiny_model("llama")
    prompts = random_prompts(6, 3, 40, seed=4)
    engine = Engine(model, BatchingConfig(mode="async", cuda_graphs=True, max_batch_tokens=64))
    with caplog.at_level("WARNING", logger="hf_async_cb.engine.cuda_graphs"):
        outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 12)
    assert engine.graphs.failed and engine.graphs.num_replays == 0 and len(engine.graphs) == 0
    assert sum("capture failed" in r.message for r in caplog.records) == 1  # warned once


def test_only_a_threads_first_capture_warms_up_and_a_failure_without_it_retries_with_it(monkeypatch):
    """The eager warm-up before a capture runs once per thread (its cuBLAS workspace on the capture
    stream); a later capture without it that fails (a kernel loading lazily inside the capture) is
    captured again with it, not given up."""
    from hf_async_cb.engine import captured_graph, cuda_graphs

    calls = []
    original = captured_graph.CapturedGraph.__init__

    def recording(self, *args, warm_up=True, **kwargs):
        calls.append(warm_up)
        if not warm_up and calls.count(False) == 2:  # the second capture without a warm-up fails
            raise RuntimeError("operation not permitted when stream is capturing")
        original(self, *args, warm_up=warm_up, **kwargs)

    monkeypatch.setattr(captured_graph.CapturedGraph, "__init__", recording)
    model = tiny_model("llama")
    prompts = random_prompts(6, 3, 40, seed=4)
    engine = Engine(model, BatchingConfig(mode="sync", cuda_graphs=True, max_batch_tokens=64))
    outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 12)
    graphs = engine.graphs
    assert len(graphs) >= 3 and not graphs.failed and graphs.num_warm_up_retries == 1
    assert calls[0] is True and calls.count(True) == 2  # the first capture, and the retry
    assert calls[calls.index(False, calls.index(False) + 1) + 1] is True  # right after the failure
    monkeypatch.setattr(cuda_graphs, "WARM_UP_EVERY_CAPTURE", True)
    calls.clear()
    engine.graphs.keep_for(("another arithmetic",))  # graphs dropped: captured again, each warmed up
    engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert calls and all(calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real capture needs CUDA")
def test_a_real_failed_capture_leaves_random_draws_working(monkeypatch):
    """A capture that raises midway (here: a host read inside it, as bitsandbytes' LLM.int8() does)
    must leave the process as it was: torch's CUDA generators otherwise stay marked as capturing and
    every later random draw raises, a model's init included."""
    from hf_async_cb.engine import captured_graph

    def host_read_inside(self, pool, stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            torch.rand(1, device="cuda")  # the generator is registered with the capture
            torch.zeros(1, device="cuda").item()  # not allowed while capturing

    monkeypatch.setattr(captured_graph.CapturedGraph, "_capture", host_read_inside)
    model = copy.deepcopy(tiny_model("llama"))  # (moved below: never the model other tests share)
    prompts = random_prompts(4, 3, 20, seed=6)
    expected = expected_rows(model, prompts, 6)
    engine = Engine(model.cuda(), BatchingConfig(mode="sync", cuda_graphs=True, max_batch_tokens=64))
    outs = engine.generate(prompts, max_new_tokens=6, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected
    assert engine.graphs.failed and len(engine.graphs) == 0
    engine.close()
    torch.randn(4, device="cuda")  # raised "Offset increment outside graph capture" before the repair
    monkeypatch.undo()
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph):  # and captures work again
        x.add_(torch.rand(1, device="cuda"))
    graph.replay()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real capture needs CUDA")
def test_a_capture_whose_end_fails_leaves_later_captures_working(monkeypatch):
    """A host read inside a capture invalidates it, and torch raises at its end before it tells the
    caching allocator the capture is over: the pool stayed 'recording', every later capture of the
    engine failed ("beginAllocateToPool: already recording to mempool_id") and its steps ran eagerly
    for good. The first decode capture here reads the host; a later call's batch size (another bucket)
    must be captured, and every token be stock's."""
    from hf_async_cb.engine import captured_graph

    real = captured_graph.CapturedGraph._record
    spoiled = []

    def first_reads_the_host(self, pool, stream):
        if not spoiled:
            spoiled.append(True)
            step = self._fn
            self._fn = lambda: (step(), torch.zeros(1, device="cuda").item())[0]
        return real(self, pool, stream)

    monkeypatch.setattr(captured_graph.CapturedGraph, "_record", first_reads_the_host)
    model = copy.deepcopy(tiny_model("llama"))
    calls = [random_prompts(4, 3, 20, seed=6), random_prompts(2, 3, 20, seed=7)]
    expected = [expected_rows(model, prompts, 6) for prompts in calls]
    engine = Engine(model.cuda(), BatchingConfig(mode="sync", cuda_graphs=True, max_batch_tokens=64))
    try:
        got = [[o.output_token_ids for o in engine.generate(prompts, max_new_tokens=6, eos_token_ids=(2,))]
               for prompts in calls]
        assert spoiled and engine.graphs.failed  # the first capture failed...
        assert len(engine.graphs) >= 1  # ...and a later one was captured
    finally:
        engine.close()
    assert got == expected


def test_a_closed_engine_frees_its_pool_without_the_garbage_collector():
    """On CUDA each engine's pool is most of the free memory: a reference cycle through the graphs
    would keep it until the next collection, and the next engine would find no room."""
    import gc
    import weakref

    model = tiny_model("llama")
    gc.disable()
    try:
        engine = Engine(model, BatchingConfig(mode="async", cuda_graphs=True, max_batch_tokens=64))
        engine.generate(random_prompts(5, 3, 30, seed=3), max_new_tokens=6)
        assert len(engine.graphs) > 0
        pool = weakref.ref(engine.cache.keys[0])
        holder = engine  # a caller still holding the closed engine does not hold its pool
        engine.close()
        assert pool() is None
        del engine, holder
    finally:
        gc.enable()


def test_the_pool_size_collects_garbage_only_while_a_pool_is_not_freed(monkeypatch):
    """Sizing a pool on CUDA runs the garbage collector (a tenth of a second and more with transformers
    loaded) for a dropped engine's pool still waiting in a reference cycle: only while some pool of
    the process is not freed, so not on a process's first build."""
    import gc

    from hf_async_cb.model.kv_cache import pools_alive

    from hf_async_cb.model.kv_cache import PagedKVCache

    gc.collect()
    before = pools_alive()
    engine = Engine(tiny_model("llama"), BatchingConfig(mode="sync"))
    assert pools_alive() == before + 1
    layout = engine.layout
    cycle = {"engine": engine}
    cycle["self"] = cycle  # dropped in a reference cycle after close(): its pool is freed by close()
    engine.close()
    del engine, cycle
    assert pools_alive() == before
    cycle = {"cache": PagedKVCache(layout, 2, 4, torch.float32, torch.device("cpu"))}
    cycle["self"] = cycle  # a pool dropped in a reference cycle unfreed: alive until collected
    del cycle
    assert pools_alive() == before + 1
    gc.collect()
    assert pools_alive() == before


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_steps_after_sampled_ones_replay_the_sampled_graphs_then_capture_their_own(mode, monkeypatch):
    """A greedy call after sampled ones replays the buckets' sampled graphs (every row drawn greedily)
    instead of capturing in its first steps, with stock's tokens; after LEND_SAMPLED_STEPS such replays
    a bucket captures its greedy graph, and the tokens stay stock's."""
    from hf_async_cb import SamplingParams
    from hf_async_cb.engine import cuda_graphs

    model = tiny_model("llama")
    prompts = random_prompts(5, 3, 30, seed=7)
    engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=True, seed=3, page_size=4, max_batch_tokens=48))
    sampled = [SamplingParams(max_new_tokens=12, do_sample=True, top_k=5, temperature=0.9)] * len(prompts)
    engine.generate(prompts, sampled)
    sampled_keys = set(engine.graphs._graphs)
    assert all(k.sampled for k in sampled_keys)

    outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))  # the same buckets, greedy
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 12)
    assert set(engine.graphs._graphs) == sampled_keys and engine.graphs.num_lent > 0

    monkeypatch.setattr(cuda_graphs, "LEND_SAMPLED_STEPS", 0)  # no more lending: the buckets capture their own
    monkeypatch.setattr(cuda_graphs, "LEND_LARGER_DECODE_STEPS", 0)
    outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 12)
    own = set(engine.graphs._graphs) - sampled_keys
    assert own and not any(k.sampled for k in own)


def test_a_step_of_a_bucket_not_captured_is_lent_the_smallest_larger_captured_one():
    """A decode step whose bucket is not captured replays the smallest captured decode bucket with
    as many rows or more (up to LEND_LARGER_MAX_BATCH), as long a context or longer and the same
    options (a greedy step may take a sampled one), LEND_LARGER_DECODE_STEPS times; then it gets its
    own bucket. Prefill steps below the cap are not lent (a warmed-up loop would capture them later)."""
    from hf_async_cb.engine import cuda_graphs

    graphs = DecodeGraphs(None, 256, is_cuda=False, prefill=True)

    def decode(rows, context, **options):
        return StepPlan([ScheduledChunk(Request([3] * context, SamplingParams(**options)), context - 1, 1, True)
                         for _ in range(rows)], [])

    assert graphs.key_for(decode(7, 300)) == GraphKey(8, 512)  # nothing captured
    for key in [GraphKey(64, 256), GraphKey(16, 1024, sampled=True), GraphKey(128, 512), GraphKey(32, 512, shared=True),
                GraphKey(32, 1024), GraphKey(16, 512, 64)]:
        graphs._graphs[key] = None
    # (64, 256): context too short; (128, 512): over the batch limit; shared and prefill buckets: other kernels.
    assert graphs.key_for(decode(7, 300)) == GraphKey(16, 1024, sampled=True)  # greedy rows draw greedily in it
    graphs._graphs[GraphKey(16, 512)] = None
    assert graphs.key_for(decode(7, 300)) == GraphKey(16, 512)
    assert graphs.key_for(decode(7, 300, do_sample=True, seed=1)) == GraphKey(16, 1024, sampled=True)
    assert graphs.key_for(decode(7, 300, do_sample=True, seed=1, repetition_penalty=1.2)).batch == 8  # other options
    assert graphs.key_for(decode(65, 300)) == GraphKey(128, 512)  # own bucket captured: its own
    assert graphs.num_lent_larger == 3
    for _ in range(cuda_graphs.LEND_LARGER_DECODE_STEPS - 2):
        graphs.key_for(decode(7, 300))
    assert graphs.key_for(decode(7, 300)) == GraphKey(8, 512)  # lent enough: captures its own

    prefill = StepPlan([ScheduledChunk(Request([3] * 20, SamplingParams()), 0, 20, True) for _ in range(3)], [])
    graphs._graphs[GraphKey(16, 512, 128)] = None
    assert graphs.key_for(prefill) == GraphKey(4, 64, 64)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_later_call_with_fewer_rows_captures_no_decode_graph_and_gives_stock_tokens(mode, monkeypatch):
    """After a call of 16 rows, a call of 3 (a new batch size, greedy after sampled) replays the larger
    captured decode bucket with more padding rows: no decode capture, every token stock's (its prefill
    step captures its own). With the lending off the same call captures a decode bucket."""
    from hf_async_cb import SamplingParams
    from hf_async_cb.engine import cuda_graphs

    model = tiny_model("llama")
    engine = Engine(model, BatchingConfig(mode=mode, cuda_graphs=True, seed=3, page_size=4, max_batch_tokens=256))
    wide = random_prompts(16, 10, 12, seed=4)
    engine.generate(wide, [SamplingParams(max_new_tokens=40, do_sample=True, top_k=5)] * len(wide))
    captured = set(engine.graphs._graphs)
    prompts = random_prompts(3, 10, 12, seed=5)
    outs = engine.generate(prompts, max_new_tokens=20, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 20)
    assert not [k for k in set(engine.graphs._graphs) - captured if not k.tokens]
    assert engine.graphs.num_lent_larger >= 19  # every decode step

    for name in ("LEND_LARGER_DECODE_STEPS", "LEND_SAMPLED_STEPS"):
        monkeypatch.setattr(cuda_graphs, name, 0)
    outs = engine.generate(prompts, max_new_tokens=20, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected_rows(model, prompts, 20)
    assert any(k.batch == 4 and not k.tokens for k in set(engine.graphs._graphs) - captured)
