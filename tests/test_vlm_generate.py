"""Vision-language models on the engine: generate(pixel_values=..., batching=...) token-exact
against stock generate for every tiny family of tests/vlm_families.py, in both loops; families
whose attention the engine cannot reproduce are refused by name before any token.

Scenarios: one image per row (two rows with the same text and different images), rows with and
without images, several images in one row; then the prefix cache (identical rows share their
pages, different images never do, within a call or across calls), chunked prefill through the
image tokens and preemption."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("PIL")

import vlm_families as V  # noqa: E402  (tests/ is on sys.path: conftest.py)

import hf_async_cb  # noqa: E402
from hf_async_cb import BatchingConfig  # noqa: E402

MODES = ("sync", "async")
NEW = 6

# What the engine says, by name, for the families it refuses (and why: docs/models.md).
REFUSED = {
    "paligemma": r"cannot run on hf_async_cb",
    "mllama": r"cannot run on hf_async_cb: only layers",
}
if V.TRANSFORMERS_MINOR < (5, 24):
    # (seen on 5.17) the parity check refuses PaliGemma 2 there: the engine's logits differ from its text
    # forward's, where stock's own cached and uncached generate disagree too (docs/models.md)
    REFUSED["paligemma2"] = r"paligemma.*cannot run on hf_async_cb: its logits on the engine differ from its own forward"


def _running(names):
    """The families of `names` the engine runs with the installed transformers (the tests of how it
    runs them; test_family_matches_stock_or_is_refused_by_name asserts the others' refusal)."""
    return [n for n in names if (n[0] if isinstance(n, tuple) else n) not in REFUSED]


def _families():
    return [pytest.param(name, id=name) for name, fam in V.FAMILIES.items() if not fam.stock_broken]


_MODELS: dict = {}


def _model(name):
    if name not in _MODELS:
        model = V.build_model(name)
        model.generation_config.eos_token_id = None  # every row generates NEW tokens
        _MODELS[name] = model
    return _MODELS[name]


def _stock(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.mark.parametrize("name", _families())
def test_family_matches_stock_or_is_refused_by_name(name):
    model = _model(name)
    for scenario in V.scenarios_for(name):
        inputs = V.build_inputs(name, scenario)
        if name in REFUSED:
            for mode in MODES:
                with pytest.raises(ValueError, match=REFUSED[name]):
                    _stock(model, inputs, batching=mode)
            continue
        expected = _stock(model, inputs)
        for mode in MODES:
            assert torch.equal(_stock(model, inputs, batching=mode), expected), (scenario, mode)
    if name in REFUSED:  # its text alone still runs where its text model does
        return
    text_only = V.build_inputs(name, "mixed")["input_ids"][1:2] if "mixed" in V.scenarios_for(name) else None
    if text_only is not None:
        assert torch.equal(model.generate(input_ids=text_only, max_new_tokens=NEW, batching="sync"),
                           model.generate(input_ids=text_only, max_new_tokens=NEW))
    hf_async_cb.release(model)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "qwen3_vl", "gemma3"])
@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_shares_identical_rows_and_never_different_images(name, mode):
    """Rows 0 and 1 of "one_each" have the same tokens and different images; a copy of row 0 is
    added. Small pages: the copy takes row 0's pages from the cache, row 1 takes none of them past
    its image; a later call with other images (the same ids) is served nothing stale."""
    model = _model(name)
    config = BatchingConfig(page_size=4)
    hf_async_cb.release(model)
    for seed in (0, 1):
        inputs = V.build_inputs(name, "one_each", image_seed=seed)
        rows = inputs["input_ids"].shape[0]
        pixels, extra = _repeat_first_image(name, inputs)
        inputs = {k: (torch.cat([v, v[:1]]) if isinstance(v, torch.Tensor) and v.shape[0] == rows else v)
                  for k, v in inputs.items()}
        inputs.update(pixel_values=pixels, **extra)
        expected = _stock(model, inputs)
        assert torch.equal(expected[0], expected[3]) and not torch.equal(expected[0], expected[1])
        got = _stock(model, inputs, batching=mode, batching_config=config)
        assert torch.equal(got, expected), seed
        stats = hf_async_cb.prefix_cache_stats(model)
        assert stats["hit_tokens"] > 0
    hf_async_cb.release(model)


def _repeat_first_image(name, inputs):
    """pixel_values (and its companions) with row 0's image again for an added fourth row."""
    pixels = inputs["pixel_values"]
    if name in ("qwen2_vl", "qwen3_vl"):  # flattened patches: row 0's are the first grid's
        grid = inputs["image_grid_thw"]
        first = int(grid[0].prod())
        return torch.cat([pixels, pixels[:first]]), {"image_grid_thw": torch.cat([grid, grid[:1]])}
    return torch.cat([pixels, pixels[:1]]), {}


@pytest.mark.parametrize("name", _running(["llava_next", "qwen2_5_vl", "qwen3_vl", "gemma3", "paligemma2"]))
@pytest.mark.parametrize("mode", MODES)
def test_image_tokens_split_across_chunks_and_preempted(name, mode):
    """A step budget smaller than an image: chunks end inside its tokens, except where the image's
    tokens see each other (Gemma 3): there a chunk never ends inside the image."""
    model = _model(name)
    inputs = V.build_inputs(name, "two_images")
    expected = _stock(model, inputs)
    config = BatchingConfig(max_batch_tokens=7, page_size=4, num_pages=2 * (inputs["input_ids"].shape[1] + NEW) // 4)
    assert torch.equal(_stock(model, inputs, batching=mode, batching_config=config), expected)
    hf_async_cb.release(model)


@pytest.mark.parametrize("name", ["llava", "qwen3_vl", "gemma3"])
def test_the_same_images_in_a_later_call_come_from_the_cache(name):
    """Image embeddings are keyed by their content: a later call with the same images and text takes
    every full page of its prompts from the cache; one with other images (the same ids) none past
    their first image, and both give stock's tokens."""
    model = _model(name)
    hf_async_cb.release(model)
    config = BatchingConfig(page_size=4)
    inputs = V.build_inputs(name, "one_each")
    expected = _stock(model, inputs)
    assert torch.equal(_stock(model, inputs, batching="sync", batching_config=config), expected)
    before = hf_async_cb.prefix_cache_stats(model)
    assert torch.equal(_stock(model, inputs, batching="async", batching_config=config), expected)
    lengths = inputs["attention_mask"].sum(1).tolist()
    after = hf_async_cb.prefix_cache_stats(model)
    # every full page before each row's last token; a row of whole pages takes its last one as a copy
    # too (feeding its last token alone), unless that token sits in a block seeing the tokens before it
    copied = after["copied_pages"] - before["copied_pages"]
    assert copied <= sum(n % 4 == 0 for n in lengths)
    assert after["hit_tokens"] - before["hit_tokens"] == sum((n - 1) // 4 * 4 for n in lengths) + 3 * copied
    other = V.build_inputs(name, "one_each", image_seed=5)
    assert torch.equal(other["input_ids"], inputs["input_ids"])
    before = hf_async_cb.prefix_cache_stats(model)["hit_tokens"]
    assert torch.equal(_stock(model, other, batching="sync", batching_config=config), _stock(model, other))
    first_image = [int(row.tolist().index(t)) for row, t in zip(other["input_ids"], [_image_token(model)] * 3)]
    pads = (1 - other["attention_mask"]).sum(1).tolist()
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] - before <= sum((f - p) // 4 * 4 for f, p in
                                                                                zip(first_image, pads))
    hf_async_cb.release(model)


def _one_image_prompts(name, texts, seed=1):
    """A batch of `texts` ("{img}" where the image goes), each with the same image."""
    fam = V.FAMILIES[name]
    image = V.make_image(seed, fam.image_size or (48, 64))
    images = [[image]] * len(texts) if fam.nested_images else [image] * len(texts)
    out = dict(V._processor(name)(text=[t.replace("{img}", fam.image_marker) for t in texts], images=images,
                                  padding=True, padding_side="left", return_tensors="pt", **fam.processor_kwargs))
    out.pop("labels", None)
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in out.items()}


@pytest.mark.parametrize("name, calls", _running([
    ("paligemma2", [["{img}w1 w2 w3 w4 w5"], ["{img}w1 w2 w3 w4 w6"]]),  # the whole prompt one block
    ("paligemma2", [["{img}w1 w2 w3 w4 w5", "{img}w1 w2 w3 w4 w6"]]),
    ("paligemma2", [["{img}w1 w2 w3 w4"], ["{img}w1 w2 w3 w4"]]),
    ("gemma3", [["w1 w2 {img}"], ["w1 w2 {img}"]]),  # the image's block ends the prompt
    ("gemma3", [["w1 {img} w2 w3", "w1 {img} w2 w4"], ["w1 {img} w2 w3"]]),
]))
@pytest.mark.parametrize("page_size", [4, 16])
def test_a_cached_prefix_never_ends_inside_a_bidirectional_block(name, calls, page_size):
    """A token of a bidirectional block sees the block's later tokens, so a page's K/V there depend on
    tokens past the page: the cache gives a prefix only where it holds whole blocks (PaliGemma's
    prompt, Gemma 3's image), and a chunk never starts inside a block. Stock's tokens, within a call
    and across calls."""
    model = _model(name)
    hf_async_cb.release(model)
    config = BatchingConfig(page_size=page_size)
    for i, texts in enumerate(calls):
        inputs = _one_image_prompts(name, texts)
        assert torch.equal(_stock(model, inputs, batching=MODES[i % 2], batching_config=config), _stock(model, inputs))
    hf_async_cb.release(model)


@pytest.mark.skipif("paligemma2" in REFUSED, reason="PaliGemma 2 is refused with this transformers (asserted above)")
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_copies_never_share_a_page_inside_a_bidirectional_block(prefix_caching):
    """num_return_sequences copies take their leader's prompt pages: not where the page ends inside a
    block (PaliGemma's prompt), whose last tokens, fed alone, would not see the whole block."""
    model = _model("paligemma2")
    hf_async_cb.release(model)
    inputs = _one_image_prompts("paligemma2", ["{img}" + " ".join(f"w{i}" for i in range(1, 17))])  # 33 tokens
    kwargs = dict(max_new_tokens=NEW, do_sample=True, top_k=1, num_return_sequences=3)  # (top-k 1: stock's tokens)
    expected = model.generate(**inputs, **kwargs)
    got = model.generate(**inputs, **kwargs, batching="sync", batching_config=BatchingConfig(prefix_caching=prefix_caching))
    assert torch.equal(got, expected)
    hf_async_cb.release(model)


def _image_token(model):
    config = model.config
    return getattr(config, "image_token_id", None) or getattr(config, "image_token_index")


def _outermost_tower(model):
    """The first module whose forward takes a batch of images or packed patches with their grids."""
    import inspect

    def takes_images(m):
        names = list(inspect.signature(type(m).forward).parameters)
        return names[1:2] == ["pixel_values"] or names[1:3] == ["hidden_states", "grid_thw"]

    return next(m for m in model.modules() if takes_images(m))


def _images_in(forward, self, args, kwargs) -> int:
    """How many images a tower's forward was given (its grids', else its pixel batch's first dimension)."""
    import inspect

    given = inspect.signature(forward).bind(self, *args, **kwargs).arguments
    return int(given["grid_thw"].shape[0] if "grid_thw" in given else given["pixel_values"].shape[0])


# Towers that encode each distinct image once during the merge, and one that still encodes every copy
# (Pixtral packs its images into one sequence: its output is not per image).
ONCE = tuple(_running(("llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                       "glm4v", "gemma3", "paligemma2", "idefics3", "smolvlm", "internvl", "aya_vision")))
EVERY_COPY = ("mistral3",)


def _counting_tower(model, monkeypatch) -> list[int]:
    """How many images each forward of the model's vision tower is given, from now on."""
    import functools

    tower = _outermost_tower(model)
    seen: list[int] = []
    forward = type(tower).forward

    @functools.wraps(forward)
    def counting(self, *args, **kwargs):
        seen.append(_images_in(forward, self, args, kwargs))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tower), "forward", counting)
    return seen


@pytest.mark.parametrize("name", ONCE + EVERY_COPY)
@pytest.mark.parametrize("mode", MODES)
def test_a_repeated_image_is_encoded_once(name, mode, monkeypatch):
    """Every row of the call twice, image included (a GRPO group of two): stock's tokens, and the
    engine's merge hands the vision tower each distinct image once, where stock encodes every copy."""
    model = _model(name)
    inputs = V.build_inputs(name, "one_each")
    doubled = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    seen = _counting_tower(model, monkeypatch)
    expected = _stock(model, doubled)
    (every,) = seen  # stock: every copy, in one call
    for call in range(2):
        seen.clear()
        hf_async_cb.release(model)
        got = _stock(model, doubled, batching=mode)
        assert torch.equal(got, expected)
        if name in ONCE:
            assert seen == [every // 2], seen
        else:  # tried once in the process (the distinct images, then all of them), then not again
            assert seen[-1] == every and (call == 0 or seen == [every]), seen
    hf_async_cb.release(model)


@pytest.mark.parametrize("name, mode", [(name, MODES[i % 2]) for i, name in enumerate(EVERY_COPY + ONCE)])
def test_a_group_of_one_prompt_and_image_gives_stock_tokens(name, mode):
    """One prompt with its image repeated as every row (a GRPO group of one prompt): the tower's
    output for one image cannot show whether it is laid out per image (Pixtral packs its images into
    one sequence), so nothing is laid out from one image's output; stock's tokens in any order of
    calls (the same group again, from the engine's caches)."""
    model = _model(name)
    one = V.build_inputs(name, "one_each", only_row=0)
    group = {k: torch.cat([v] * 3) if isinstance(v, torch.Tensor) else v for k, v in one.items()}
    expected = _stock(model, group)
    hf_async_cb.release(model)
    for _ in range(2):
        assert torch.equal(_stock(model, group, batching=mode), expected)
    hf_async_cb.release(model)


@pytest.mark.parametrize("name, mode", [(name, MODES[(i + 1) % 2]) for i, name in enumerate(EVERY_COPY + ONCE)])
def test_a_call_under_inference_mode_gives_stock_tokens(name, mode):
    """Users often generate under torch.inference_mode(): the merge, the pool and the caches the engine keeps
    are made outside it (they outlive the call), and the later call reads them."""
    model = _model(name)
    inputs = V.build_inputs(name)
    with torch.inference_mode():
        expected = _stock(model, inputs)
        hf_async_cb.release(model)
        for _ in range(2):  # (the second call: its tower outputs and pages from the engine's caches)
            assert torch.equal(_stock(model, inputs, batching=mode), expected)
    hf_async_cb.release(model)


@pytest.mark.parametrize("name, mode", [(name, MODES[i % 2]) for i, name in enumerate(ONCE)])
def test_images_an_earlier_call_sent_are_not_encoded_again(name, mode, monkeypatch):
    """A later call that sends the same images again (an RL epoch, an evaluation rerun) takes the
    tower's outputs from the engine's cache (model/vision_feature_cache.py): stock's tokens, the
    tower not run. Other pixels are encoded; a tower weight written in place, or through `.data`,
    empties the cache."""
    model = _model(name)
    inputs = V.build_inputs(name, "one_each")
    other = dict(inputs, pixel_values=inputs["pixel_values"].flip(-1))
    seen = _counting_tower(model, monkeypatch)
    expected, expected_other = _stock(model, inputs), _stock(model, other)
    every = seen[0]
    hf_async_cb.release(model)
    weight = next(_outermost_tower(model).parameters())
    kept = weight.detach().clone()
    try:
        for call, (given, want, encoded) in enumerate([(inputs, expected, [every]), (inputs, expected, []),
                                                       (other, expected_other, [every]), (inputs, expected, [])]):
            seen.clear()
            assert torch.equal(_stock(model, given, batching=mode), want), call
            assert seen == encoded, (call, seen)
        assert hf_async_cb.prefix_cache_stats(model)["image_hits"] == 2 * every
        for write in (lambda: weight.mul_(1.5),  # in place: the cache must not serve the old outputs
                      lambda: weight.data.add_(0.25)):  # nor after a write no version counter sees (a weight sync)
            with torch.no_grad():
                write()
            seen.clear()
            changed = _stock(model, inputs)
            seen.clear()
            assert torch.equal(_stock(model, inputs, batching=mode), changed)
            assert seen == [every], seen
    finally:
        with torch.no_grad():
            weight.copy_(kept)
        hf_async_cb.release(model)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "qwen3_vl", "gemma3", "idefics3"])
@pytest.mark.parametrize("mode", MODES)
def test_served_requests_with_images_give_stock_tokens(name, mode):
    """Engine.add_request(prompt, media=...) while the loop serves: each request's images are merged
    on the loop thread before it is taken in; its tokens are stock generate's for that prompt alone,
    whatever else runs beside it (a text-only request, the same image twice: the second time from the
    engine's tower cache). A merge that fails ends that request alone, with its error."""
    model = _model(name)
    hf_async_cb.release(model)
    rows = [V.build_inputs(name, "mixed", only_row=r) for r in (0, 2)]  # a row with an image, alone
    full = V.build_inputs(name, "mixed")  # (some processors take no batch without images: row 1 from here)
    text = full["input_ids"][1][full["attention_mask"][1].bool()][None]
    rows.insert(1, dict(input_ids=text, attention_mask=torch.ones_like(text)))  # text alone: no media at all
    expected = [_stock(model, inputs)[0, inputs["input_ids"].shape[1]:].tolist() for inputs in rows]
    engine = hf_async_cb.Engine(model, BatchingConfig(mode=mode, page_size=4))
    engine.start()
    try:
        handles = []
        for inputs in rows + rows[:1]:
            media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            handles.append(engine.add_request(inputs["input_ids"][0].tolist(), max_new_tokens=NEW,
                                              media=media or None))
        broken = {k: v[..., :1] if k == "pixel_values" else v for k, v in rows[0].items()
                  if k not in ("input_ids", "attention_mask")}
        failing = engine.add_request(rows[0]["input_ids"][0].tolist(), max_new_tokens=NEW, media=broken)
        got = [h.result(timeout=120).output_token_ids for h in handles]
        with pytest.raises(RuntimeError):
            failing.result(timeout=120)
        after = engine.add_request(rows[2]["input_ids"][0].tolist(), max_new_tokens=NEW,
                                   media={k: v for k, v in rows[2].items() if k not in ("input_ids", "attention_mask")})
        assert after.result(timeout=120).output_token_ids == expected[2]  # the loop serves on
        assert engine.prefix_cache_stats()["image_hits"] >= 1, engine.prefix_cache_stats()  # (row 0's image again: not encoded again)
    finally:
        engine.shutdown(timeout=60)
        engine.close()
    assert got == expected + expected[:1]
    with pytest.raises(ValueError, match="embeds or media"):
        engine2 = hf_async_cb.Engine(model, BatchingConfig(mode=mode))
        engine2.start()
        try:
            engine2.add_request([1, 2, 3], max_new_tokens=2, media={}, embeds=hf_async_cb.PromptEmbeds(
                torch.zeros(1, model.config.get_text_config().hidden_size), [0]))
        finally:
            engine2.shutdown(timeout=60)
            engine2.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_served_image_after_a_tower_weight_write_is_encoded_again(mode, monkeypatch):
    """The serving loop checks the weights' counters before it takes new requests in, and the
    merges of their images trust that check: a tower weight written in place between two served
    requests with the same image (an optimizer step between rollouts) empties the tower cache, so
    the second is encoded again and gives the new weights' stock tokens."""
    model = _model("qwen2_vl")
    hf_async_cb.release(model)
    row = V.build_inputs("qwen2_vl", "mixed", only_row=0)
    media = {k: v for k, v in row.items() if k not in ("input_ids", "attention_mask")}
    prompt = row["input_ids"][0].tolist()
    weight = next(_outermost_tower(model).parameters())
    kept = weight.detach().clone()
    before = _stock(model, row)[0, len(prompt):].tolist()
    with torch.no_grad():
        weight.mul_(-8.0)
    after = _stock(model, row)[0, len(prompt):].tolist()  # (stock is refused while the engine serves)
    assert after != before
    with torch.no_grad():
        weight.copy_(kept)
    seen = _counting_tower(model, monkeypatch)
    engine = hf_async_cb.Engine(model, BatchingConfig(mode=mode, page_size=4))
    engine.start()
    try:
        for _ in range(2):  # the second from the cache
            assert engine.add_request(prompt, max_new_tokens=NEW, media=media).result(timeout=120).output_token_ids \
                == before
        assert seen == [1], seen
        with torch.no_grad():
            weight.mul_(-8.0)  # (the same write as above: the same weights)
        seen.clear()
        got = engine.add_request(prompt, max_new_tokens=NEW, media=media).result(timeout=120).output_token_ids
        assert seen == [1], seen
        assert got == after
    finally:
        engine.shutdown(timeout=60)
        engine.close()
        with torch.no_grad():
            weight.copy_(kept)


@pytest.mark.parametrize("mode", MODES)
def test_served_media_is_checked_in_the_callers_thread_and_copied(mode):
    """Engine.add_request(media=...) refuses, before anything is queued, what generate() would refuse
    (a key the forward does not take, the prompt's own ids in media, NumPy arrays, anything but a
    dict, images for a text model), naming it; and merges the images as they were when it was called,
    though the caller overwrites its buffer before the loop takes the request in."""
    import threading

    from models import tiny_model

    model = _model("qwen2_vl")
    hf_async_cb.release(model)
    inputs = V.build_inputs("qwen2_vl", "mixed", only_row=0)
    prompt = inputs["input_ids"][0].tolist()
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    pixels = inputs["pixel_values"]
    other = dict(inputs, pixel_values=torch.randn(pixels.shape, generator=torch.Generator().manual_seed(0)) * 3)
    expected = _stock(model, inputs)[0, len(prompt):].tolist()
    assert _stock(model, other)[0, len(prompt):].tolist() != expected  # (so the test below can fail)
    engine = hf_async_cb.Engine(model, BatchingConfig(mode=mode, page_size=4))
    held, release = threading.Event(), threading.Event()  # (before the try: its finally sets release)
    engine.start()
    try:
        refused = [([media], "must be a dict"), (dict(media, input_ids=inputs["input_ids"]), "media holds"),
                   (dict(media, pixel_value=media["pixel_values"]), r"does not take \['pixel_value'\]"),
                   (dict(media, pixel_values=media["pixel_values"].numpy()), "NumPy"),
                   # (names in the forward's signature that are no inputs: its self, its **kwargs)
                   (dict(media, self=1), r"does not take \['self'\]"),
                   (dict(media, kwargs={}), r"does not take \['kwargs'\]")]
        for bad, message in refused:
            with pytest.raises(ValueError, match=message):
                engine.add_request(prompt, max_new_tokens=NEW, media=bad)
        with pytest.raises(ValueError, match="processor's input_ids"):  # (text: its placeholders unexpanded)
            engine.add_request("describe the image", max_new_tokens=NEW, media=media)

        def hold(request, token):  # the loop waits here, between its steps, until the buffer is overwritten
            if not held.is_set():
                held.set()
                release.wait(30)

        first = engine.add_request([5, 6, 7], max_new_tokens=2, on_token=hold)
        assert held.wait(60)
        buffer = media["pixel_values"].clone()
        handle = engine.add_request(prompt, max_new_tokens=NEW, media=dict(media, pixel_values=buffer))
        buffer.copy_(other["pixel_values"])  # the caller reuses its buffer before the loop took the request in
        release.set()
        first.result(timeout=120)
        assert handle.result(timeout=120).output_token_ids == expected
    finally:
        release.set()
        engine.shutdown(timeout=60)
        engine.close()
    text = tiny_model("llama")
    engine = hf_async_cb.Engine(text, BatchingConfig(mode=mode))
    engine.start()
    try:
        with pytest.raises(ValueError, match="takes no images"):
            engine.add_request([1, 2, 3], max_new_tokens=2, media=media)
    finally:
        engine.shutdown(timeout=60)
        engine.close()


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_a_fresh_models_second_call_reuses_its_first_calls_pages_and_tower_outputs(name, monkeypatch):
    """A fresh VLM's first call runs its vision tower for the first time, inside the call, and
    transformers then marks the tower (its output-capturing hooks installed): the mark is no change of
    the model's numerics, so the second call keeps the first call's cached pages. And a call of one
    image keeps that image's tower output, before any call showed how the tower lays out several
    images (a serving loop merges one request at a time): the same image alone again is not encoded."""
    from hf_async_cb.model import vision_dedupe

    monkeypatch.setattr(vision_dedupe, "_PER_IMAGE", set())  # (as in a fresh process)
    model = V.build_model(name)
    model.generation_config.eos_token_id = None
    inputs = V.build_inputs(name, "mixed", only_row=0)
    expected = _stock(model, inputs)
    try:
        for call in range(3):
            got = _stock(model, inputs, batching="sync", batching_config=BatchingConfig(page_size=4))
            assert torch.equal(got, expected), call
            stats = hf_async_cb.prefix_cache_stats(model)
            assert stats["clears"] == 0, (call, stats)
        assert stats["hit_tokens"] > 0
        engine = hf_async_cb.Engine(model, BatchingConfig(mode="sync", page_size=4))
        engine.start()
        try:
            prompt = inputs["input_ids"][0].tolist()
            media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            for _ in range(2):
                got = engine.add_request(prompt, max_new_tokens=NEW, media=media).result(timeout=120)
                assert got.output_token_ids == expected[0, len(prompt):].tolist()
            assert engine.tower_outputs.stats()["hits"] >= 1, engine.tower_outputs.stats()
        finally:
            engine.shutdown(timeout=60)
            engine.close()
    finally:
        hf_async_cb.release(model)


def test_the_serving_benchmark_with_images_runs_on_the_cpu(tmp_path):
    """benchmarks/vlm_serving.py on its tiny shape: every request of both loops finishes with its tokens."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import vlm_serving

    out = tmp_path / "serving.json"
    assert vlm_serving.main(["--shape", "tiny", "--device", "cpu", "--requests", "4", "--rate", "inf", "--new", "4",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("sync", "async"):
        assert report[mode]["requests"] == 4 and report[mode]["failed"] == 0
        assert report[mode]["output_tokens"] == 16


def test_the_merge_cost_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/vlm_merge_cost.py on the tiny shape: each merge timed, one profiled through the
    engine's own media_embeds (which it puts back afterwards)."""
    import json
    import sys
    from pathlib import Path

    from hf_async_cb.engine import serving_api

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import vlm_merge_cost

    real = serving_api.media_embeds
    out = tmp_path / "merge.json"
    assert vlm_merge_cost.main(["--shape", "tiny", "--device", "cpu", "--merges", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["merge_ms"]) == 2 and all(ms > 0 for ms in report["merge_ms"])
    assert "media_embeds" in report["profile"]
    assert serving_api.media_embeds is real


@pytest.mark.parametrize("name", _running(["gemma3", "paligemma2", "llava"]))
def test_inputs_embeds_run_where_stock_takes_them_and_are_refused_where_it_does_not(name):
    """Gemma 3's and PaliGemma's generate take no inputs_embeds (their masks come from the ids):
    stock refuses them, and so does the engine, by name; LLaVA's run, with stock's tokens."""
    model = _model(name)
    inputs = V.build_inputs(name, "one_each")
    with torch.no_grad():
        embeds = model.get_input_embeddings()(inputs["input_ids"])
    kwargs = dict(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], max_new_tokens=NEW, do_sample=False)
    try:
        expected = model.generate(**kwargs)
    except ValueError:
        for mode in MODES:
            with pytest.raises(ValueError, match="takes no inputs_embeds in generate"):
                model.generate(**kwargs, batching=mode)
        assert name != "llava"
        return
    for mode in MODES:
        assert torch.equal(model.generate(**kwargs, batching=mode), expected)
    hf_async_cb.release(model)


def test_a_call_with_images_reads_the_weights_contents_once(monkeypatch):
    """The images' merge and the engine's cache check share one reading of the weights (Engine.check_caches
    before the merge): one content pass per call, not two."""
    from hf_async_cb.model import kv_fingerprint

    model = _model("qwen2_5_vl")
    inputs = V.build_inputs("qwen2_5_vl", "one_each")
    expected = _stock(model, inputs)
    assert torch.equal(_stock(model, inputs, batching="sync"), expected)  # (the runtime built: its checks read too)
    reads = []
    sums = kv_fingerprint.content_sums
    monkeypatch.setattr(kv_fingerprint, "content_sums", lambda tensors: reads.append(len(tensors)) or sums(tensors))
    for _ in range(2):
        reads.clear()
        assert torch.equal(_stock(model, inputs, batching="sync"), expected)
        assert len(reads) == 1, reads
    hf_async_cb.release(model)


# The families whose processors return mm_token_type_ids (the image/video/text type of each token) for their
# multimodal rotary positions.
MM_TOKEN_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v")


@pytest.mark.parametrize("name", MM_TOKEN_TYPES)
def test_inputs_without_mm_token_type_ids_run_as_stock_runs_them(name):
    """Inputs built by hand or by an older processor (input_ids, attention_mask, pixel_values,
    image_grid_thw, no mm_token_type_ids): stock generate runs them (its generation positions fall
    back to the plain ones without the token types), so the engine's merge does too, with stock's
    tokens in both loops: rows with and without images, several images in a row; and a served
    request (Engine.add_request(media=...)) likewise."""
    model = _model(name)
    hf_async_cb.release(model)
    for scenario in ("mixed", "two_images"):
        inputs = V.build_inputs(name, scenario)
        assert inputs.pop("mm_token_type_ids") is not None
        try:
            expected = _stock(model, inputs)
        except ValueError as error:  # (none in the installed transformers: were stock to refuse, so must we)
            for mode in MODES:
                with pytest.raises(ValueError, match=re.escape(str(error)[:60])):
                    _stock(model, inputs, batching=mode)
            continue
        for mode in MODES:
            assert torch.equal(_stock(model, inputs, batching=mode), expected), (scenario, mode)
    hf_async_cb.release(model)
    if name != "qwen2_vl":
        return
    row = V.build_inputs(name, "mixed", only_row=0)
    del row["mm_token_type_ids"]
    expected = _stock(model, row)[0, row["input_ids"].shape[1]:].tolist()
    for mode in MODES:
        engine = hf_async_cb.Engine(model, BatchingConfig(mode=mode, page_size=4))
        engine.start()
        try:
            media = {k: v for k, v in row.items() if k not in ("input_ids", "attention_mask")}
            handle = engine.add_request(row["input_ids"][0].tolist(), max_new_tokens=NEW, media=media)
            assert handle.result(timeout=120).output_token_ids == expected, mode
        finally:
            engine.shutdown(timeout=60)
            engine.close()
