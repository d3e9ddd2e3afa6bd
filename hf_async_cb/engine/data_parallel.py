"""Data-parallel replicas: one Engine per device for a model that fits on one, to fill several GPUs.

`DataParallel(model, devices=["cuda:0", "cuda:1", ...])` runs an Engine on each device over a
replica of the model. A call splits its prompts over the replicas by load (prompt plus new tokens,
the longest first onto the least loaded replica), runs the replicas at once and returns the outputs
in prompt order.

A request's tokens do not depend on the replica it lands on: sampled requests without a seed of
their own get theirs here, from the engine seed and their index in the call, exactly as one Engine
would give them (engine.seed_requests), so a DataParallel call and one Engine's call with the same
BatchingConfig.seed draw the same tokens. (With num_return_sequences > 1 the copies of a prompt
derive their seeds from the prompt's: still the same on any replica, but not one Engine's.)

Where the replicas run (`workers`):
- "processes" (the default for several CUDA devices): a process per replica
  (engine/replica_process.py), so that each replica's host work runs on a core of its own. Replicas
  in threads share one interpreter lock, and with a small model the host work of eight of them
  outlasts a GPU step. Each call's arguments are sent to the processes, so they must pickle.
- "threads" (the default otherwise): an Engine per replica in this process, a thread each per call
  (the model itself where it already is, copies elsewhere). Cheap to start, and right when the GPU
  step is long against the host's work, or on the CPU.
Neither has been measured on several GPUs yet.
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
from hf_async_cb.engine.replica_process import ProcessReplica
from hf_async_cb.engine.requests import RequestOutput, SamplingParams, as_token_lists, params_per_prompt
from hf_async_cb.sampling.sampler import derive_seed


class DataParallel:
    """One Engine per device over replicas of `model` (see the module docstring).

    >>> dp = DataParallel(model, devices=["cuda:0", "cuda:1"])
    >>> outputs = dp.generate(prompts, max_new_tokens=256)
    """

    def __init__(self, model: torch.nn.Module, devices: Sequence[str | torch.device],
                 config: BatchingConfig | None = None, tokenizer=None, *, workers: str | None = None) -> None:
        if not devices:
            raise ValueError("DataParallel needs at least one device.")
        self.config = config if config is not None else BatchingConfig()
        self.devices = [torch.device(d) for d in devices]
        if workers is None:
            workers = "processes" if len(self.devices) > 1 and any(d.type == "cuda" for d in self.devices) \
                else "threads"
        if workers not in ("processes", "threads"):
            raise ValueError(f"DataParallel workers must be 'processes' or 'threads', got {workers!r}.")
        self.workers = workers
        self.engines: list[Engine] = []  # the thread replicas' engines
        self.replicas: list[ProcessReplica] = []  # the process replicas
        try:
            if workers == "processes":
                self.replicas = [ProcessReplica(model, device, self.config, tokenizer) for device in self.devices]
                for replica in self.replicas:  # the processes start together, then each is waited for
                    replica.wait_ready()
            else:
                home = next(model.parameters()).device
                for device in self.devices:
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
        assignment = balance([len(p) + sp.max_new_tokens for p, sp in zip(prompts, per_prompt)], len(self.devices))
        self.last_assignment = assignment
        options = dict(mode=mode, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                       num_return_sequences=num_return_sequences)
        calls = [([prompts[i] for i in chosen], [per_prompt[i] for i in chosen]) for chosen in assignment]
        if self.workers == "processes":
            results = self._run_processes(calls, options)
        else:
            def run(replica: int) -> list[RequestOutput]:
                return self.engines[replica].generate(*calls[replica], **options) if calls[replica][0] else []

            with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="hf_async_cb-dp") as pool:
                results = list(pool.map(run, range(len(self.engines))))  # raises the first replica's error
        n = num_return_sequences
        outputs: list[RequestOutput | None] = [None] * (len(prompts) * n)
        for chosen, outs in zip(assignment, results):
            for position, i in enumerate(chosen):
                outputs[i * n:(i + 1) * n] = outs[position * n:(position + 1) * n]
        return outputs

    def _run_processes(self, calls: list[tuple[list, list]], options: dict) -> list[list[RequestOutput]]:
        """Send each replica its share, then collect every answer before raising the first error, so
        that no answer is left in a pipe for the next call to read."""
        sent = []
        try:
            for replica, (prompts, params) in zip(self.replicas, calls):
                if prompts:
                    replica.submit(prompts, params, **options)
                sent.append(bool(prompts))
        except BaseException:  # (arguments that do not pickle: nothing of them was sent) drain the others
            for replica, busy in zip(self.replicas, sent):
                if busy:
                    try:
                        replica.result()
                    except Exception:  # noqa: BLE001 (the first error is the one raised)
                        pass
            raise
        results, error = [], None
        for replica, busy in zip(self.replicas, sent):
            try:
                results.append(replica.result() if busy else [])
            except Exception as e:  # noqa: BLE001 (raised below, once every replica has answered)
                results.append([])
                error = error or e
        if error is not None:
            raise error
        return results

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
        for replica in self.replicas:
            replica.close()
        self.replicas = []

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
