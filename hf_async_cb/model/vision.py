"""A vision-language model's prompts as the engine feeds them: the model's own merge of its image
features, read where it hands them to its language model.

Each family merges images its own way (placeholder tokens replaced by projected features, image
newlines, tiles, multimodal rotary positions). Rather than follow each, the call's batch runs once
through the model's forward, images included, as stock generate's first step runs it (the vision
tower batched over the call's rows, the position ids generate gives it), and stops where the
language model is entered: what the language model receives then (`inputs_embeds`, `position_ids`,
its mask) is what the prompt must feed. The rows' embeddings that differ from the plain token
embeddings become PromptEmbeds, and their rotary positions (Qwen2-VL's [t, h, w] and the shift they
leave) come along.

A mask the model builds itself is read too: where image tokens attend to the later tokens of
their image (Gemma 3's bidirectional blocks), each prompt keeps the last position each token sees
(PromptEmbeds.visible: such chunks run the reference attention with that mask, and never end inside
a block). Features the language model adds to its first layers' hidden states at the image positions
(Qwen3-VL's deepstack: `visual_pos_masks`, `deepstack_visual_embeds`) are kept per prompt too, and
handed to the language model by the steps that cover those positions (`deepstack_inputs`). Refused by
name: any other forward pattern, and other inputs the language model takes beyond the embeddings.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect

import numpy as np
import torch

from hf_async_cb.engine.prompt_embeds import PromptEmbeds, block_starts, checked_embeds, content_keys
from hf_async_cb.model.embeddings_path import input_embedding_weight
from hf_async_cb.model.aligned_mlp import aligned_mlps
from hf_async_cb.model.patch_embed import convolutions_as_gemms
from hf_async_cb.model.vision_attention import packed_vision_attention
from hf_async_cb.model.tower_norms import fused_tower_norms
from hf_async_cb.model.vision_rotary import fused_vision_rotary
from hf_async_cb.model.vision_dedupe import distinct_images
from hf_async_cb.model.vision_feature_cache import TowerOutputCache

# What the language model may receive besides the embeddings and positions without changing them.
_PLAIN_KWARGS = {"input_ids", "inputs_embeds", "position_ids", "attention_mask", "past_key_values", "cache",
                 "use_cache", "cache_position", "return_dict", "output_attentions", "output_hidden_states",
                 "output_router_logits", "logits_to_keep"}


class _Entered(Exception):
    """Raised by the hook on the language model: the merge is done, nothing more needs to run."""


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module the model hands its merged prompt embeddings to."""
    for path in ("model.language_model", "language_model", "model.text_model"):
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, torch.nn.Module):
            return module
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(decoder, torch.nn.Module) and decoder is not model:
        return decoder
    raise ValueError(f"{type(model).__name__}: its language model was not found (model.language_model, "
                     "model.model.language_model or get_decoder()), so its images cannot be merged.")


@torch.no_grad()
def merged_prompts(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   media: dict, towers: TowerOutputCache | None = None,
                   content: bool | None = True) -> list[PromptEmbeds | None]:
    """Per row of the left-padded batch: the embeddings (and rotary positions) its prompt feeds
    beyond its tokens', or None for a row that feeds its tokens alone. Identical rows (the same
    tokens and the same image features) share one object, so that they share their pages.
    `towers`: an engine's cache of the vision towers' outputs for images seen by earlier calls,
    checked against the model before it serves any (`content`: the weights' values read too, for
    writes that bump no version counter; a served request's merge reads the counters alone; None: the
    caller's engine checked them for this call already, Engine.check_caches)."""
    if towers is not None and content is not None:
        towers.check(model, content)
    received = _language_model_inputs(model, input_ids, attention_mask, media, towers)
    name = type(model).__name__
    extra = sorted(k for k, v in received.items() if k not in _PLAIN_KWARGS | _DEEPSTACK and v is not None)
    if extra:
        raise ValueError(f"{name}'s language model also takes {extra} beyond the prompt embeddings (e.g. features "
                         "added at several layers); the engine does not feed them: use batching='off'.")
    valid = attention_mask.bool()
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    sees = _visible(received.get("attention_mask"), valid, name, window)  # [B, L] or None: causal
    merged = received.get("inputs_embeds")
    if not isinstance(merged, torch.Tensor) or merged.shape[:2] != input_ids.shape:
        raise ValueError(f"{name}'s language model did not receive inputs_embeds [batch, length, hidden].")
    plain = model.get_input_embeddings()(input_ids)
    differs = (merged != plain.to(merged.dtype)).any(-1) & valid
    rope = _rotary_rows(received.get("position_ids"), valid)
    deepstack = _deepstack_rows(received, valid, name)
    rows: list[PromptEmbeds | None] = []
    seen: dict[tuple, list[PromptEmbeds]] = {}
    for b in range(input_ids.shape[0]):
        keep = valid[b]
        where = torch.nonzero(differs[b][keep]).flatten()
        values = merged[b][keep][where]
        row_rope = rope[:, b][:, keep].cpu().numpy() if rope is not None else None
        if row_rope is not None and (row_rope == torch.arange(row_rope.shape[1]).numpy()).all():
            row_rope = None  # the plain positions
        row_sees = None
        if sees is not None:
            row_sees = (sees[b][keep] - int((~keep).sum())).cpu().numpy()  # padded columns -> prompt positions
            if (row_sees == torch.arange(len(row_sees)).numpy()).all():
                row_sees = None
        row_deepstack = deepstack[b] if deepstack is not None else (None, None)
        if not len(where) and row_rope is None and row_sees is None and row_deepstack[0] is None:
            rows.append(None)
            continue
        embeds = PromptEmbeds(values, where.cpu().numpy(), rope=row_rope,
                              rope_delta=int(row_rope.max()) + 1 - row_rope.shape[1] if row_rope is not None else 0,
                              visible=row_sees, deepstack=row_deepstack[0], deepstack_positions=row_deepstack[1])
        same = (tuple(input_ids[b][keep].tolist()), tuple(embeds.positions.tolist()))
        twin = next((e for e in seen.get(same, ()) if _same(e, embeds)), None)
        if twin is None:
            seen.setdefault(same, []).append(embeds)
        rows.append(twin or embeds)
    _name_contents([e for group in seen.values() for e in group])
    return rows


@torch.no_grad()
def media_embeds(model: torch.nn.Module, request, *, media: dict, refusal: str | None, cache,
                 towers: TowerOutputCache | None = None, ready=None) -> None:
    """A served request's images, merged on the loop thread before it is taken in
    (Engine.add_request(media=...)): its embeds are the model's own merge of this one prompt, as
    generate() merges each row of a batch (`refusal`, `cache`: as checked_embeds takes them;
    `towers`: as merged_prompts takes it, checked by the loop against the weights' counters just
    before it took the request in; `ready`: a CUDA event after the media's copies, waited for on
    this thread's stream)."""
    device = input_embedding_weight(model).device
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)
    ids = torch.tensor([request.prompt_token_ids], device=device)
    given = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in media.items()}
    (row,) = merged_prompts(model, ids, torch.ones_like(ids), given, towers, content=None)
    if row is not None:
        request.embeds = checked_embeds(row, ids.shape[1], model.get_input_embeddings(), refusal, cache)


def _name_contents(embeds: list[PromptEmbeds]) -> None:
    """Key each row's image embeddings by their content (and where they sit, and the blocks their
    tokens see), so that the prefix cache serves the same image after the same text in later calls
    and other rows too, and never another image."""
    keys = content_keys([e.values for e in embeds])
    for e, key in zip(embeds, keys):
        where = e.positions.tobytes() + (e.visible.tobytes() if e.visible is not None else b"")
        e.key = key + hashlib.blake2b(where, digest_size=16).digest()


_DEEPSTACK = {"visual_pos_masks", "deepstack_visual_embeds"}


def _deepstack_rows(received: dict, valid: torch.Tensor, name: str) -> list | None:
    """Per row: (per layer [D, hidden] features, [D] prompt positions) of the deepstack features the
    language model received (Qwen3-VL), or (None, None) for a row without any; None when it received
    none. Its features follow the mask's positions in row-major order, as it adds them."""
    mask, layers = received.get("visual_pos_masks"), received.get("deepstack_visual_embeds")
    if mask is None or layers is None:
        return None
    if mask.dim() == 3:
        mask = mask[..., 0]
    if not (isinstance(layers, (list, tuple)) and mask.shape == valid.shape
            and all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == int(mask.sum()) for t in layers)):
        raise ValueError(f"{name}'s deepstack features are not [image positions, hidden] per layer over a [batch, "
                         "length] mask: use batching='off'.")
    rows, first = [], 0
    for b in range(mask.shape[0]):
        count = int(mask[b].sum())
        if not count:
            rows.append((None, None))
            continue
        positions = torch.nonzero(mask[b][valid[b]]).flatten().cpu().numpy()
        if len(positions) != count:
            raise ValueError(f"{name} adds deepstack features at padded positions: use batching='off'.")
        rows.append(([t[first:first + count] for t in layers], positions))
        first += count
    return rows


@contextlib.contextmanager
def deepstack_inputs(model: torch.nn.Module, deepstack, input_ids: torch.Tensor):
    """While a step runs: its deepstack features (StepInputs.deepstack: stream indices and per layer
    the features there) handed to the language model as the model hands them when it merges images
    itself (`visual_pos_masks` [1, T], `deepstack_visual_embeds`)."""
    where, layers = deepstack
    mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    mask[0, torch.from_numpy(where).to(input_ids.device)] = True

    def give(module, args, kwargs):
        kwargs.update(visual_pos_masks=mask, deepstack_visual_embeds=layers)
        return args, kwargs

    handle = language_model(model).register_forward_pre_hook(give, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _language_model_inputs(model, input_ids, attention_mask, media, towers) -> dict:
    received: dict = {}

    def stop(module, args, kwargs):
        if args:
            received["inputs_embeds"] = args[0]
        received.update(kwargs)
        raise _Entered

    handle = language_model(model).register_forward_pre_hook(stop, with_kwargs=True)
    try:
        # One attention call per window length, not per window; patches embedded by a GEMM, not a
        # convolution cuDNN runs slowly; MLPs of a misaligned width padded for cuBLAS's fast kernels;
        # the rotary embedding and the RMSNorms in one kernel each; each distinct image encoded once.
        with (packed_vision_attention(model), convolutions_as_gemms(model), aligned_mlps(model),
              fused_vision_rotary(model), fused_tower_norms(model, language_model(model)),
              distinct_images(model, towers)):
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **media,
                  **_generation_positions(model, input_ids, attention_mask, media))
    except _Entered:
        pass
    finally:
        handle.remove()
    if not received:
        raise ValueError(f"{type(model).__name__}'s forward never reached its language model.")
    return received


def _generation_positions(model, input_ids, attention_mask, media) -> dict:
    """The position ids stock generate hands the model's first forward (`position_ids=`; nothing for
    a forward that takes none, as generate passes none there). A plain forward computes its own, and
    for some families they differ: without `mm_token_type_ids` (inputs built by hand or by an older
    processor), Qwen2-VL's, Qwen3-VL's and GLM-4V's forward refuses images with grids, where their
    generate (`_prepare_position_ids_for_generation`) falls back to the plain positions and runs."""
    prepare = getattr(model, "_prepare_position_ids_for_generation", None)
    if prepare is None or getattr(model.config, "is_encoder_decoder", False):
        return {}
    if "position_ids" not in set(inspect.signature(model.forward).parameters):
        return {}
    try:
        return {"position_ids": prepare(input_ids, {"attention_mask": attention_mask, **media})}
    except (AttributeError, TypeError):  # a model that opts out (raises AttributeError) or another signature
        return {}


def _rotary_rows(position_ids, valid: torch.Tensor) -> torch.Tensor | None:
    """[K, batch, length] positions as the language model got them (None: it computes plain ones). A
    leading row of text positions beside the [t, h, w] rows (Qwen2-VL in newer transformers) goes."""
    if position_ids is None:
        return None
    if position_ids.dim() == 2:
        position_ids = position_ids[None]
    elif position_ids.dim() == 3:
        position_ids = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
    else:
        raise ValueError(f"position ids of shape {tuple(position_ids.shape)} are not understood.")
    return position_ids.expand(-1, *valid.shape)  # (one row of positions for the whole batch, broadcast)


def _visible(mask, valid: torch.Tensor, name: str, window: int | None) -> torch.Tensor | None:
    """From the masks the model built itself: [B, L] the last column each query may see, where some
    see later tokens (a bidirectional block over each image: Gemma 3; over the whole prompt:
    PaliGemma); None when every mask is causal. Each mask must be what the engine's attention
    builds from it (model/step_metadata.py): the causal keys within the layer's window ("sliding" in
    the mask's name: the text config's `window`), and every key of the query's block whatever the
    window; anything else is refused by name, never run differently."""
    masks = mask.items() if isinstance(mask, dict) else [("", mask)]
    tensors = []
    for kind, m in masks:
        if m is None or (isinstance(m, torch.Tensor) and m.dim() <= 2):
            continue  # a padding mask: the language model is causal
        if not isinstance(m, torch.Tensor) or m.dim() != 4:
            raise ValueError(f"{name} builds an attention mask the engine cannot read ({type(m).__name__}).")
        length = valid.shape[1]
        tensors.append((str(kind), (m if m.dtype == torch.bool else m == 0)[:, 0, -length:, -length:]))
    if not tensors:
        return None
    columns = torch.arange(valid.shape[1], device=valid.device)
    q, k = columns[None, :, None], columns[None, None, :]
    pairs = valid[:, :, None] & valid[:, None, :]
    sees = torch.stack([torch.where(a & pairs & (k > q), k, q).amax(-1) for _, a in tensors]).amax(0)  # [B, L]
    first = torch.from_numpy(np.stack([block_starts(row) for row in sees.cpu().numpy()])).to(sees.device)  # [B, L]
    block = (k >= first[:, :, None]) & (k <= sees[:, :, None])
    for kind, allowed in tensors:
        causal = k <= q
        if "sliding" in kind and window:
            causal = causal & ((q - k) < window)
        if not torch.equal(allowed & pairs, (causal | block) & pairs):
            raise ValueError(
                f"{name} builds a {kind or 'attention'} mask the engine's attention does not express (tokens seeing "
                "later ones other than a block around them, or a window other than its own): use batching='off'.")
    if bool((sees == columns).all()):
        return None
    return sees


def _same(a: PromptEmbeds, b: PromptEmbeds) -> bool:
    for x, y in ((a.rope, b.rope), (a.visible, b.visible), (a.deepstack_positions, b.deepstack_positions)):
        if (x is None) != (y is None) or (x is not None and (x.shape != y.shape or not (x == y).all())):
            return False
    if a.deepstack is not None and not all(torch.equal(x, y) for x, y in zip(a.deepstack, b.deepstack)):
        return False
    return torch.equal(a.values, b.values)
