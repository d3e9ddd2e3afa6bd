"""Data-parallel replicas: one Engine per device for a model that fits on one, to fill several GPUs.

`DataParallel(model, devices=["cuda:0", "cuda:1", ...])` runs an Engine on each device over a
replica of the model. A call spreads its prompts over the replicas by load (prompt plus new tokens,
the longest first onto the least loaded replica), runs the replicas at once and returns the outputs
in prompt order. Replicas are fed as they go (_Feeder): each holds at most its running-request limit
(plus a little headroom) and gets the costliest request left whenever one of its own finishes, so
early stops even out. Calls with num_return_sequences > 1, whose copies share their prompt's pages
on one replica, split the prompts once, up front (`balance`).

A request's tokens do not depend on the replica it lands on: sampled requests without a seed of
their own get theirs here, from the engine seed and their index in the call, exactly as one Engine
would give them (engine.seed_requests), so a DataParallel call and one Engine's call with the same
BatchingConfig.seed draw the same tokens; with num_return_sequences > 1 each replica seeds the
copies by their index in the whole call (Engine.generate's seed_indices).

Where the replicas run (`workers`):
- "processes" (the default for several CUDA devices): a process per replica
  (engine/replica_process.py), so that each replica's host work runs on a core of its own. Replicas
  in threads share one interpreter lock, and with a small model the host work of eight of them
  outlasts a GPU step. Each call's arguments are sent to the processes, so they must pickle.
- "threads" (the default otherwise): an Engine per replica in this process, each running its
  background loop during a call (the model itself where it already is, copies elsewhere). Cheap to
  start, and right when the GPU step is long against the host's work, or on the CPU.
Neither has been measured on several GPUs yet.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait
from typing import Sequence

import torch

from hf_async_cb.config import BatchingConfig
from hf_async_cb.engine.engine import Engine, _random_seed
from hf_async_cb.engine.eos import with_model_eos
from hf_async_cb.engine.replica_process import ProcessReplica
from hf_async_cb.engine.requests import RequestOutput, SamplingParams, as_token_lists, params_per_prompt
from hf_async_cb.model.kv_fingerprint import adapter_states, model_tensors
from hf_async_cb.model.numerics_key import numerics_key
from hf_async_cb.model.weight_kinds import content_sums
from hf_async_cb.sampling.sampler import derive_seed

logger = logging.getLogger(__name__)

STREAM_HEADROOM = 16  # requests a replica holds beyond what it runs, so that a freed slot refills at once
STREAM_POLL_S = 0.5  # how often a waiting call checks that its replicas are alive


class DataParallel:
    """One Engine per device over replicas of `model` (see the module docstring).

    >>> dp = DataParallel(model, devices=["cuda:0", "cuda:1"])
    >>> outputs = dp.generate(prompts, max_new_tokens=256)
    """

    def __init__(self, model: torch.nn.Module, devices: Sequence[str | torch.device],
                 config: BatchingConfig | None = None, tokenizer=None, *, workers: str | None = None) -> None:
        if isinstance(devices, (str, torch.device, int)):
            raise ValueError(f"DataParallel takes a list of devices, e.g. devices=['cuda:0', 'cuda:1'], got {devices!r}.")
        if not devices:
            raise ValueError("DataParallel needs at least one device.")
        self.config = config if config is not None else BatchingConfig()
        self.devices = [torch.device(d) for d in devices]
        for d in self.devices:
            if d.type not in ("cpu", "cuda"):
                raise ValueError(f"DataParallel runs replicas on CPU or CUDA devices, got {d}.")
        if workers is None:
            workers = "processes" if len(self.devices) > 1 and any(d.type == "cuda" for d in self.devices) \
                else "threads"
        if workers not in ("processes", "threads"):
            raise ValueError(f"DataParallel workers must be 'processes' or 'threads', got {workers!r}.")
        self.workers = workers
        self._calls = threading.Lock()  # one call at a time: a call owns the replicas (and their pipes)
        self._closed = False
        self.engines: list[Engine] = []  # the thread replicas' engines
        self.replicas: list[ProcessReplica] = []  # the process replicas
        self.model = model
        self.tokenizer = tokenizer
        self._start_replicas()
        self.last_assignment: list[list[int]] = []  # prompt indices per replica, of the last call
        self.weight_syncs = 0  # how many times the replicas took the model's new weights
        self.rebuilds = 0  # how many times they were made afresh (a change no weight copy carries)

    def _start_replicas(self) -> None:
        model, tokenizer = self.model, self.tokenizer
        try:
            if self.workers == "processes":
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
            self._stop_replicas()  # (not close(): a rebuild runs inside a call, which holds its lock)
            raise
        self._weights_seen = weights_fingerprint(model)
        self._state_seen = replica_state(model)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, mode: str | None = None, logits_processor=None, stopping_criteria=None,
                 num_return_sequences: int = 1, **param_kwargs) -> list[RequestOutput]:
        """Engine.generate over the replicas, same arguments: outputs in prompt order (a prompt's
        `num_return_sequences` copies next to each other, all on one replica, sharing its prompt).
        Calls from several threads take turns."""
        with self._calls:
            if self._closed:
                raise RuntimeError("this DataParallel is closed: build a new one.")
            self._follow_the_model()
            return self._generate(prompts, params, mode=mode, logits_processor=logits_processor,
                                  stopping_criteria=stopping_criteria, num_return_sequences=num_return_sequences,
                                  **param_kwargs)

    def _generate(self, prompts, params, *, mode, logits_processor, stopping_criteria, num_return_sequences,
                  **param_kwargs) -> list[RequestOutput]:
        prompts = as_token_lists(prompts)
        # The model's EOS ids as they are now (the replicas are copies, made when this was built).
        per_prompt = [with_model_eos(sp, self.model, self.tokenizer)
                      for sp in params_per_prompt(prompts, params, param_kwargs)]
        options = dict(mode=mode, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                       num_return_sequences=num_return_sequences)
        if num_return_sequences == 1:  # balanced as requests finish
            stream = self._stream if self.workers == "processes" else self._stream_threads
            return stream(prompts, self._seeded(per_prompt), options)
        # Copies share their prompt's pages on one replica: the prompts are split once, up front.
        # Each replica seeds the copies by their index in the whole call, as one Engine would.
        if any(sp.unseeded for sp in per_prompt):
            options["engine_seed"] = self.config.seed if self.config.seed is not None else _random_seed()
        assignment = balance([len(p) + sp.max_new_tokens for p, sp in zip(prompts, per_prompt)], len(self.devices))
        self.last_assignment = assignment
        calls = [([prompts[i] for i in chosen], [per_prompt[i] for i in chosen], chosen) for chosen in assignment]
        if self.workers == "processes":
            results = self._run_processes(calls, options)
        else:
            def run(replica: int) -> list[RequestOutput]:
                chosen_prompts, chosen_params, chosen = calls[replica]
                return self.engines[replica].generate(chosen_prompts, chosen_params, seed_indices=chosen,
                                                      **options) if chosen_prompts else []

            with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="hf_async_cb-dp") as pool:
                results = list(pool.map(run, range(len(self.engines))))  # raises the first replica's error
        n = num_return_sequences
        outputs: list[RequestOutput | None] = [None] * (len(prompts) * n)
        for chosen, outs in zip(assignment, results):
            for position, i in enumerate(chosen):
                outputs[i * n:(i + 1) * n] = outs[position * n:(position + 1) * n]
        return outputs

    def _stream(self, prompts: list[list[int]], per_prompt: list[SamplingParams], options: dict) -> list[RequestOutput]:
        """Process replicas, balanced as they go (_Feeder). Any failure cancels the call on every
        replica and is raised once they have all stopped."""
        feeder = _Feeder(prompts, per_prompt, len(self.replicas), self.config.max_running_requests + STREAM_HEADROOM)
        self.last_assignment = feeder.assignment
        replicas, held = self.replicas, feeder.held
        mode = options["mode"]
        options = {k: options[k] for k in ("logits_processor", "stopping_criteria")}  # add_request's
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        error: BaseException | None = None
        started = []
        try:
            for replica, batch in zip(replicas, feeder.first()):
                replica.send(("stream", mode, batch, options))
                started.append(replica)
            while sum(held) and error is None:
                ready = wait([replicas[r].connection for r in range(len(replicas)) if held[r]], STREAM_POLL_S)
                for r, replica in enumerate(replicas):
                    if replica.connection not in ready and held[r]:
                        replica.check_alive()
                    if replica.connection not in ready:
                        continue
                    kind, key, payload = replica.receive()
                    held[r] -= 1
                    if kind == "failed":
                        error = error or payload
                    else:
                        outputs[key] = payload
                    if feeder.pending and error is None:
                        replica.send(("add", [feeder.take(r)]))
        except BaseException as e:  # a replica died, or the caller was interrupted
            error = error or e
        finally:
            for replica in started:  # every started stream ends, cancelled if the call failed
                self._end_stream(replica, cancel=error is not None)
        if error is not None:
            raise error
        feeder.done()
        return outputs

    def _stream_threads(self, prompts: list[list[int]], per_prompt: list[SamplingParams],
                        options: dict) -> list[RequestOutput]:
        """Thread replicas, balanced as they go (_Feeder): each engine's background loop takes the
        call's requests as its own finish. Any failure cancels the call on every engine, then raises."""
        engines = self.engines
        feeder = _Feeder(prompts, per_prompt, len(engines), self.config.max_running_requests + STREAM_HEADROOM)
        self.last_assignment = feeder.assignment
        add = {k: options[k] for k in ("logits_processor", "stopping_criteria")}
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        finished: queue.SimpleQueue = queue.SimpleQueue()  # (prompt index, replica, handle), as they end
        waiting = 0
        error: BaseException | None = None
        started = []

        def submit(r: int, item: tuple) -> None:
            nonlocal waiting
            key, prompt, params = item
            handle = engines[r].add_request(prompt, params, **add)
            waiting += 1
            handle.add_done_callback(lambda h: finished.put((key, r, h)))

        try:
            for r, batch in enumerate(feeder.first()):
                engines[r].start(options["mode"])
                started.append(engines[r])
                for item in batch:
                    submit(r, item)
            while waiting and error is None:
                try:
                    key, r, handle = finished.get(timeout=STREAM_POLL_S)
                except queue.Empty:  # (a loop that died fails its requests, which ends them too)
                    continue
                waiting -= 1
                feeder.held[r] -= 1
                if handle.error is not None:  # the request's own error, as one Engine raises it
                    raise handle.error
                outputs[key] = handle.result()
                if feeder.pending:
                    submit(r, feeder.take(r))
        except BaseException as e:
            error = e
        finally:
            for engine in started:
                try:
                    engine.shutdown(cancel=error is not None)
                except Exception as e:  # noqa: BLE001 (raised below unless the call failed already)
                    error = error or e
        if error is not None:
            raise error
        feeder.done()
        return outputs

    @staticmethod
    def _end_stream(replica: ProcessReplica, cancel: bool) -> None:
        """Send ("end",) or ("abort",), then read until the replica's ("ended", None): what it still
        sends (outputs of cancelled requests) belongs to the failed call and is dropped."""
        try:
            replica.send(("abort",) if cancel else ("end",))
            while replica.receive()[0] != "ended":
                pass
        except Exception:  # noqa: BLE001 (a dead replica: nothing left to read; its error is the call's)
            pass

    def _run_processes(self, calls: list[tuple[list, list, list]], options: dict) -> list[list[RequestOutput]]:
        """Send each replica its share, then collect every answer before raising the first error, so
        that no answer is left in a pipe for the next call to read."""
        sent = []
        try:
            for replica, (prompts, params, chosen) in zip(self.replicas, calls):
                if prompts:
                    replica.submit(prompts, params, seed_indices=chosen, **options)
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
        unseeded = [i for i, sp in enumerate(per_prompt) if sp.unseeded]
        if not unseeded:
            return per_prompt
        base = self.config.seed if self.config.seed is not None else _random_seed()
        seeded = list(per_prompt)
        for i in unseeded:
            seeded[i] = dataclasses.replace(per_prompt[i], seed=derive_seed(base, i))
        return seeded

    def _follow_the_model(self) -> None:
        """Replicas are copies (on other devices, and fused wherever they run): when the model's
        weights changed since the last call (trained in place, or weights assigned), copy them into
        every replica first, so that a call always generates with the model as it is now, as one
        Engine on the model would (an RL loop of rollouts and training steps)."""
        if replica_state(self.model) != self._state_seen:
            # Module settings, adapter states or quantized weights' inner tensors changed: no copy of the
            # parameters carries those, so the replicas are made afresh from the model as it is now.
            logger.info("hf_async_cb: the model changed beyond its weights' values since its replicas were made; "
                        "making them afresh")
            self._stop_replicas()
            self._start_replicas()
            self.rebuilds += 1
            return
        seen = weights_fingerprint(self.model)
        if seen == self._weights_seen:
            return
        weights = _state_tensors(self.model)
        for engine in self.engines:
            if engine.model is not self.model:  # (the model's own engine reads its weights)
                copy_weights(engine.model, weights)
            engine.clear_prefix_cache()  # this pass sees `.data` writes, which version counters miss
        for replica in self.replicas:  # CUDA IPC / shared memory: no copy until each replica's own
            replica.send(("weights", weights))
        for replica in self.replicas:
            replica.result()
        self._weights_seen = weights_fingerprint(self.model)  # (sending CPU tensors may move them to shared memory)
        self.weight_syncs += 1

    def close(self) -> None:
        """Close every replica (idempotent). A call in flight on another thread ends first."""
        with self._calls:
            self._closed = True
            self._stop_replicas()

    def _stop_replicas(self) -> None:
        for engine in self.engines:
            engine.close()
        for replica in self.replicas:
            replica.close()
        self.engines, self.replicas = [], []

    def __enter__(self) -> "DataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a weight sync copies into a replica, in order: the parameters, then the buffers."""
    return [t.detach() for t in (*model.parameters(), *model.buffers())]


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter or buffer is replaced (its storage), written in place (its
    version counter), or written through `.data`, which bumps no version counter (EMA and
    hand-written optimiser code do): the sum of its bits (weight_kinds.content_sums). One pass over
    the weights per call, against a copy of them all to every replica when they changed."""
    params = _state_tensors(model)
    layout = tuple((p.data_ptr(), p._version, p.dtype, p.shape) for p in params)
    return layout, content_sums(params)


def replica_state(model: torch.nn.Module) -> tuple:
    """What a copy of the parameters and buffers does not carry to a replica: every module's own
    settings and the PEFT configs (model/numerics_key.py), the adapter layers' states, and the contents
    of the tensors held beyond the parameters and buffers (a quantized weight's inner data and scales,
    a custom module's tensor attributes)."""
    named = list(model.named_modules())
    modules = [m for _, m in named]
    plain = {id(t) for t in (*model.parameters(), *model.buffers())}
    held = [t for t in model_tensors(model, modules) if id(t) not in plain]
    return hash(numerics_key(model, named)), adapter_states(modules), content_sums(held)


@torch.no_grad()
def copy_weights(replica: torch.nn.Module, weights: list[torch.Tensor]) -> None:
    """Copy `weights` (the model's parameters and buffers, in order: _state_tensors) into the
    replica's in place: a replica's weights are views of its fused tensors, which see the new values
    without a rebuild."""
    params = _state_tensors(replica)
    if len(params) != len(weights) or any(p.shape != w.shape for p, w in zip(params, weights)):
        raise ValueError("the model's parameters no longer match its replicas' (a layer added, removed or "
                         "resized): build a new DataParallel.")
    for p, w in zip(params, weights):
        p.copy_(w)


class _Feeder:
    """Balance as requests finish: each replica holds at most `cap` of the call's requests (its
    running limit plus a little headroom, so that a freed slot refills at once); the first batches
    go costliest first onto the least loaded replica with room, and afterwards a replica gets the
    costliest request left whenever one of its own finishes. Early stops (EOS, stop strings) thus
    even out, where a static split would leave the replicas that drew short requests idle."""

    def __init__(self, prompts: list[list[int]], per_prompt: list[SamplingParams], replicas: int, cap: int) -> None:
        self.prompts, self.per_prompt, self.cap = prompts, per_prompt, cap
        self.costs = [len(p) + sp.max_new_tokens for p, sp in zip(prompts, per_prompt)]
        self.pending = sorted(range(len(prompts)), key=lambda i: self.costs[i])  # pop(): the costliest left
        self.held = [0] * replicas
        self.load = [0] * replicas
        self.assignment: list[list[int]] = [[] for _ in range(replicas)]

    def take(self, r: int) -> tuple:
        """The next request for replica r: (prompt index, prompt, params)."""
        i = self.pending.pop()
        self.held[r] += 1
        self.load[r] += self.costs[i]
        self.assignment[r].append(i)
        return i, self.prompts[i], self.per_prompt[i]

    def first(self) -> list[list[tuple]]:
        batches: list[list[tuple]] = [[] for _ in self.held]
        while self.pending and min(self.held) < self.cap:
            r = min((r for r in range(len(self.held)) if self.held[r] < self.cap), key=lambda r: (self.load[r], r))
            batches[r].append(self.take(r))
        return batches

    def done(self) -> None:
        for chosen in self.assignment:
            chosen.sort()


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
