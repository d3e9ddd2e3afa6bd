"""Tiny random models of each tested family, and the stock-generate oracle."""

from __future__ import annotations

import functools
import threading

import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
    # A window shorter than the prompts, so that sliding-window attention is exercised.
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=24),
    "phi3": lambda: transformers.Phi3Config(**{**COMMON, "num_key_value_heads": 4}),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                            bos_token_id=1, eos_token_id=2, pad_token_id=0),
}
FAMILIES = tuple(CONFIGS)


def started_thread(fn) -> tuple[threading.Thread, dict]:
    """fn() on a daemon thread, started: (the thread, a box that gets "value" or "error")."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


class Gate:
    """A logits processor holding the first step that has generated a token past `width` prompt
    columns (the model held by its call meanwhile) until `release` is set (30 s at most)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.width and not self.inside.is_set():
            self.inside.set()
            self.release.wait(30)
        return scores


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A deterministic fp32 CPU model (one per family and seed, shared: copy it to change it); weights scaled up so that greedy picks are far from ties."""
    torch.manual_seed(seed)
    config = CONFIGS[family]()
    return scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def scaled(model: torch.nn.Module, factor: float = 4.0) -> torch.nn.Module:
    """`model` with its matrices scaled up (in place): attention far from uniform, greedy picks far
    from ties."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(factor)
    return model


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def stock_generate(model, prompts, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(prompts)
    return model.generate(ids, attention_mask=mask, batching="off", **kwargs)


def generated_rows(sequences: torch.Tensor, prompt_width: int, pad: int, eos: tuple[int, ...]) -> list[list[int]]:
    """Strip the prompt and stock's trailing padding: the tokens each row really generated."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        out = []
        for tok in row:
            out.append(tok)
            if tok in eos:
                break
        rows.append(out)
    return rows


def hqq_in_place(model: torch.nn.Module, quantize, nbits: int = 4, group_size: int = 64) -> torch.nn.Module:
    """`model`'s decoder projections replaced by HQQ's own HQQLinear (`quantize`: hqq.core.quantize), in
    its dtype and on its device: how HQQ is applied where transformers has no HqqConfig loading path
    (5.24). The tests' and the GPU benchmarks' one way of building an HQQ model."""
    settings = quantize.BaseQuantizeConfig(nbits=nbits, group_size=group_size)
    dtype, device = model.dtype, str(next(model.parameters()).device)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, quantize.HQQLinear(child, settings, compute_dtype=dtype, device=device))
    return model
