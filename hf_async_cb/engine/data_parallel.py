"""Data-parallel replicas: one Engine per device for a model that fits on one, to fill several GPUs.

`DataParallel(model, devices=["cuda:0", "cuda:1", ...])` keeps a replica of the model on each
device (the model itself where it already is, copies elsewhere) and an Engine on each. A call
splits its prompts over the replicas by load (prompt plus new tokens, the longest first onto the
least loaded replica), runs the replicas at once, one thread each, and returns the outputs in
prompt order.

A request's tokens do not depend on the replica it lands on: sampled requests without a seed of
their own get theirs here, from the engine seed and their index in the call, exactly as one Engine
would give them (engine.seed_requests), so a DataParallel call and one Engine's call with the same
BatchingConfig.seed draw the same tokens. (With num_return_sequences > 1 the copies of a prompt
derive their seeds from the prompt's: still the same on any replica, but not one Engine's.)

Threads, not processes: each replica's loop launches its GPU work asynchronously and waits on
events with the GIL released, so replicas of a model whose steps are GPU-bound overlap; a small
model whose steps are bound by the host's scheduling shares one interpreter. (Not yet measured on
several GPUs.)
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from hf_async_cb.config import BatchingConfig
from hf_async_cb.engine.engine import Engine, _random_seed
from hf_async_cb.engine.requests import RequestOutput, SamplingParams, as_token_lists, params_per_prompt
from hf_async_cb.sampling.sampler import derive_seed


class DataParallel:
    """One Engine per device over replicas of `model` (see the module docstring).

    >>> dp = DataParallel(model, devices=["cuda:0", "cuda:1"])
    >>> outputs = dp.generate(prompts, max_new_tokens=256)
    """

    def __init__(self, model: torch.nn.Module, devices: Sequence[str | torch.device],
                 config: BatchingConfig | None = None, tokenizer=None) -> None:
        if not devices:
            raise ValueError("DataParallel needs at least one device.")
        self.config = config if config is not None else BatchingConfig()
        self.devices = [torch.device(d) for d in devices]
        home = next(model.parameters()).device
        self.engines: list[Engine] = []
        try:
            for i, device in enumerate(self.devices):
                same = device.type == home.type and (device.index is None or device.index == home.index)
                replica = model if same and not any(e.model is model for e in self.engines) \
                    else copy.deepcopy(model).to(device)
                self.engines.append(Engine(replica, self.config, tokenizer=tokenizer))
        except BaseException:
            self.close()
            raise
        self.last_assignment: list[list[int]] = []  # prompt indices per replica, of the last call

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, mode: str | None = None, logits_processor=None, stopping_criteria=None,
                 num_return_sequences: int = 1, **param_kwargs) -> list[RequestOutput]:
        """Engine.generate over the replicas, same arguments: outputs in prompt order (a prompt's
        `num_return_sequences` copies next to each other, all on one replica, sharing its prompt)."""
        prompts = as_token_lists(prompts)
        per_prompt = params_per_prompt(prompts, params, param_kwargs)
        per_prompt = self._seeded(per_prompt)
        assignment = balance([len(p) + sp.max_new_tokens for p, sp in zip(prompts, per_prompt)], len(self.engines))
        self.last_assignment = assignment

        def run(replica: int) -> list[RequestOutput]:
            chosen = assignment[replica]
            if not chosen:
                return []
            return self.engines[replica].generate([prompts[i] for i in chosen], [per_prompt[i] for i in chosen],
                                                  mode=mode, logits_processor=logits_processor,
                                                  stopping_criteria=stopping_criteria,
                                                  num_return_sequences=num_return_sequences)

        with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="hf_async_cb-dp") as pool:
            results = list(pool.map(run, range(len(self.engines))))  # raises the first replica's error
        n = num_return_sequences
        outputs: list[RequestOutput | None] = [None] * (len(prompts) * n)
        for chosen, outs in zip(assignment, results):
            for position, i in enumerate(chosen):
                outputs[i * n:(i + 1) * n] = outs[position * n:(position + 1) * n]
        return outputs

    def _seeded(self, per_prompt: list[SamplingParams]) -> list[SamplingParams]:
        """Each sampled prompt without a seed gets the one a single Engine would give it."""
        unseeded = [i for i, sp in enumerate(per_prompt) if sp.do_sample and sp.seed is None]
        if not unseeded:
            return per_prompt
        base = self.config.seed if self.config.seed is not None else _random_seed()
        seeded = list(per_prompt)
        for i in unseeded:
            seeded[i] = dataclasses.replace(per_prompt[i], seed=derive_seed(base, i))
        return seeded

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def __enter__(self) -> "DataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def balance(costs: Sequence[int], replicas: int) -> list[list[int]]:
    """Indices of `costs` per replica: the costliest first, each onto the least loaded replica
    (ties: the lowest replica); each replica's indices in ascending order."""
    heap = [(0, r) for r in range(replicas)]
    chosen: list[list[int]] = [[] for _ in range(replicas)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, r = heapq.heappop(heap)
        chosen[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return [sorted(c) for c in chosen]
