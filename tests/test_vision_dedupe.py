"""The merge's vision towers encode each distinct image of a call once (model/vision_dedupe.py), and
none an earlier call encoded (model/vision_feature_cache.py); their outputs are the full forward's,
whatever the images."""

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from hf_async_cb.model.vision_dedupe import distinct_images
from hf_async_cb.model.vision_feature_cache import TowerOutputCache


class Tower(torch.nn.Module):
    """A packed-patch tower: per patch a linear map, per merged token (2 x 2 patches) their sum,
    and per-token "deepstack" features; records how many images each call encodes."""

    spatial_merge_size = 2

    def __init__(self, kind="output"):
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.kind = kind
        self.calls: list[int] = []

    def forward(self, hidden_states, grid_thw, **kwargs):
        self.calls.append(int(grid_thw.shape[0]))
        per_patch = self.proj(hidden_states)
        merged = per_patch.reshape(-1, 4, per_patch.shape[-1]).sum(1)
        if self.kind == "output":
            return BaseModelOutputWithPooling(last_hidden_state=per_patch, pooler_output=merged)
        if self.kind == "tuple":
            return merged, [merged + 1, merged * 2]
        return merged.sum()  # (not per image)


class SummingTower(Tower):
    """Its output is one sum over every image: not per image."""

    def __init__(self):
        super().__init__("sum")


class BatchedTower(torch.nn.Module):
    """A tower over a batch of images [n, 3, 4, 4] with a per-image mask: per image tokens, a pooled
    vector and the hidden states of each layer; records how many images each call encodes."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 5)
        self.calls: list[int] = []

    def forward(self, pixel_values, patch_attention_mask=None, output_hidden_states=False):
        self.calls.append(int(pixel_values.shape[0]))
        tokens = self.proj(pixel_values.flatten(2).transpose(1, 2))  # [n, 16, 5]
        if patch_attention_mask is not None:
            tokens = tokens * patch_attention_mask[..., None]
        return BaseModelOutputWithPooling(last_hidden_state=tokens, pooler_output=tokens.mean(1),
                                          hidden_states=(tokens, tokens * 2) if output_hidden_states else None)


class Model(torch.nn.Module):
    def __init__(self, kind="output"):
        super().__init__()
        self.visual = {"sum": SummingTower, "batched": BatchedTower}.get(kind, lambda: Tower(kind))()


def _images(*grids_and_seeds):
    """Packed patches [sum t*h*w, 6] and grids [n, 3] of images given as ((t, h, w), seed)."""
    patches = [torch.randn(t * h * w, 6, generator=torch.Generator().manual_seed(seed)) for (t, h, w), seed in
               grids_and_seeds]
    return torch.cat(patches), torch.tensor([g for g, _ in grids_and_seeds])


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["output", "tuple"])
def test_each_distinct_image_is_encoded_once_and_the_outputs_are_the_full_forwards(kind):
    model = Model(kind)
    pixels, grid = _images(((1, 2, 4), 0), ((1, 4, 2), 1), ((1, 2, 4), 0), ((1, 2, 2), 2), ((1, 4, 2), 1))
    with torch.no_grad():
        expected = model.visual(pixels, grid)
        with distinct_images(model):
            got = model.visual(pixels, grid_thw=grid)
    assert model.visual.calls == [5, 3]
    assert _equal(got, expected)
    assert "forward" not in vars(model.visual)


def test_images_one_element_apart_stay_apart():
    model = Model()
    pixels, grid = _images(((1, 4, 4), 0), ((1, 4, 4), 0), ((1, 4, 4), 0))
    pixels[16 + 5, 3] += 1e-3  # the second image, one element of one patch
    with torch.no_grad():
        expected = model.visual(pixels, grid)
        with distinct_images(model):
            got = model.visual(pixels, grid)
    assert model.visual.calls == [3, 2]  # the first and third are one image
    assert _equal(got, expected)


def test_the_same_patches_under_another_grid_are_another_image():
    model = Model()
    pixels, grid = _images(((1, 2, 4), 0), ((1, 2, 4), 0))
    grid[1] = torch.tensor([1, 4, 2])
    with torch.no_grad(), distinct_images(model):
        model.visual(pixels, grid)
    assert model.visual.calls == [2]


def test_an_output_not_laid_out_per_image_runs_every_image():
    model = Model("sum")
    pixels, grid = _images(((1, 2, 2), 0), ((1, 2, 2), 0))
    with torch.no_grad():
        expected = model.visual(pixels, grid)
        with distinct_images(model):
            got = model.visual(pixels, grid)
        with distinct_images(model):
            again = model.visual(pixels, grid)
    # Copies of one image: every image runs (one image cannot show per-image outputs), and the output
    # is found not per image, so in a later call the class is not tried again.
    assert model.visual.calls == [2, 2, 2]
    assert torch.equal(got, expected) and torch.equal(again, expected)


def test_a_batch_of_images_with_what_comes_with_each():
    """A tower over a batch of images: equal images with equal masks are encoded once, an equal
    image under another mask is another input; every output (tokens, pooled, each layer's states)
    is the full forward's."""
    model = Model("batched")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 4, generator=g), torch.randn(3, 4, 4, generator=g)
    pixels = torch.stack([a, b, a, a, b])
    masks = torch.ones(5, 16)
    masks[3, 5] = 0  # image a again, partly masked
    with torch.no_grad():
        expected = model.visual(pixels, patch_attention_mask=masks, output_hidden_states=True)
        with distinct_images(model):
            got = model.visual(pixels, masks, output_hidden_states=True)
    assert model.visual.calls == [5, 3]
    assert _equal(got, expected)


def test_per_patch_inputs_of_the_callers_own_leave_the_images_as_they_are():
    model = Model()
    pixels, grid = _images(((1, 2, 2), 0), ((1, 2, 2), 0))
    with torch.no_grad(), distinct_images(model):
        model.visual(pixels, grid, position_ids=torch.arange(8))
    assert model.visual.calls == [2]


# --- across calls: an engine's TowerOutputCache (model/vision_feature_cache.py) ------------------------------

def test_images_an_earlier_call_encoded_come_from_the_cache():
    """A later call's images seen before are taken from the cache: the tower encodes only the new
    ones, and every output is the full forward's."""
    model = Model()
    cache = TowerOutputCache(1 << 20)
    first, first_grid = _images(((1, 2, 4), 0), ((1, 4, 2), 1))
    later, later_grid = _images(((1, 4, 2), 1), ((1, 2, 2), 2), ((1, 2, 4), 0), ((1, 4, 2), 1))
    with torch.no_grad():
        expected = model.visual(later, later_grid)
        with distinct_images(model, cache):
            model.visual(first, first_grid)
        with distinct_images(model, cache):
            got = model.visual(later, later_grid)
        with distinct_images(model, cache):
            again = model.visual(later, later_grid)
    assert model.visual.calls == [4, 2, 1]  # (the third call: every image cached, the tower not run)
    assert _equal(got, expected) and _equal(again, expected)
    assert (cache.hits, cache.misses, len(cache)) == (2 + 3, 2 + 1, 3)


def test_a_call_with_other_arguments_is_not_served_from_the_cache():
    model = Model("batched")
    cache = TowerOutputCache(1 << 20)
    pixels = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with distinct_images(model, cache):
            model.visual(pixels)
        with distinct_images(model, cache):
            got = model.visual(pixels, output_hidden_states=True)  # another call: its own entries
        assert _equal(got, model.visual(pixels, output_hidden_states=True))
    assert model.visual.calls == [2, 2, 2]


def test_the_cache_keeps_its_bound_and_empties_when_the_weights_change():
    model = Model("batched")
    per_image = 16 * 5 * 4 + 5 * 4  # tokens and pooled, fp32
    cache = TowerOutputCache(2 * per_image)
    pixels = torch.randn(3, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache.check(model)
        with distinct_images(model, cache):
            model.visual(pixels)
        assert (len(cache), cache.bytes, cache.evictions) == (2, 2 * per_image, 1)
        with distinct_images(model, cache):
            model.visual(pixels[1:])  # the two kept (least recently used first out)
        assert model.visual.calls == [3]
        model.visual.proj.weight.mul_(2)  # in place: its version counter moves
        cache.check(model)
        assert len(cache) == 0
        with distinct_images(model, cache):
            got = model.visual(pixels[1:])
        assert _equal(got, model.visual(pixels[1:]))
    assert model.visual.calls == [3, 2, 2]
    tiny = TowerOutputCache(per_image - 1)  # smaller than one image: nothing kept, nothing wrong
    with torch.no_grad(), distinct_images(model, tiny):
        assert _equal(model.visual(pixels), model.visual(pixels)) and len(tiny) == 0


class PackingTower(torch.nn.Module):
    """Its images packed into one sequence ([1, patches of every image, 5], as Pixtral's): one
    image's output has one row, as a per-image output would."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 5)
        self.calls: list[int] = []

    def forward(self, pixel_values, image_sizes=None):
        self.calls.append(int(pixel_values.shape[0]))
        return BaseModelOutputWithPooling(last_hidden_state=self.proj(pixel_values.flatten(2).transpose(1, 2)).reshape(
            1, -1, 5))


@pytest.mark.parametrize("cached", [False, True])
def test_one_image_never_passes_for_an_output_laid_out_per_image(cached):
    """Copies of one image, or one image beside a cached one, before the tower showed per-image
    outputs over two images: every image runs, as stock. A packing tower is then found out and left
    alone; the outputs are always the full forward's. (The cache keeps only the call of one image
    alone, as a whole, for a later call of that image alone.)"""
    model = torch.nn.Module()
    model.visual = PackingTower()
    cache = TowerOutputCache(1 << 20) if cached else None
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 4, generator=g), torch.randn(3, 4, 4, generator=g)
    sizes = torch.tensor([[4, 4]] * 2)
    with torch.no_grad():
        with distinct_images(model, cache):
            alone = model.visual(a[None], sizes[:1])
            twice = model.visual(torch.stack([a, a]), sizes)
        with distinct_images(model, cache):
            pair = model.visual(torch.stack([a, b]), sizes)
        assert _equal(alone, model.visual(a[None], sizes[:1]))
        assert _equal(twice, model.visual(torch.stack([a, a]), sizes))
        assert _equal(pair, model.visual(torch.stack([a, b]), sizes))
    assert model.visual.calls[:3] == [1, 2, 2]
    assert cache is None or [key[-1] for key in cache._entries] == ["alone"]
