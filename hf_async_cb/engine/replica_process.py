"""A data-parallel replica in a process of its own: an Engine on one device, fed over a pipe.

Why processes: a replica's host work per step (scheduling, building the step, reading back its
tokens) is Python, under the interpreter's lock. Replicas in threads of one process share that
lock, so the host work of all of them is serialised: with a small model whose GPU step is short
(Llama-3.2-1B at 64 requests: ~1.5 ms of GPU against ~0.6 ms of host per step, docs/benchmarks.md)
eight replicas need ~4.6 ms of host time per 1.5 ms step, and most GPUs idle. A process per
replica has its own interpreter, so the host work runs in parallel, one core each.

The model reaches the worker as a spawn argument, through torch.multiprocessing's pickler: CPU
tensors through shared memory, CUDA tensors as IPC handles (no copy on their own device; the
worker copies them to its device). The worker then builds its Engine, answers "ready", and serves
Engine.generate calls until told to close. An exception in the worker comes back and is raised in
the caller with the worker's traceback; a worker that dies (killed, out of memory) is reported,
never waited on forever.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

from hf_async_cb.config import BatchingConfig
from hf_async_cb.model.fusion import hook_module

_POLL_S = 0.5  # how often a waiting caller checks that the worker is alive


class ReplicaError(RuntimeError):
    """A replica's worker process failed (died, or an error that could not be sent back as itself)."""


def _serve(conn: Connection, model: torch.nn.Module, device: torch.device, config: BatchingConfig, tokenizer) -> None:
    """The worker's main: build the engine, then serve ("generate", args, kwargs) until ("close",)."""
    from hf_async_cb.engine.engine import Engine

    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        engine = Engine(model.to(device), config, tokenizer=tokenizer)
        del model
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 (sent back to the caller)
        conn.send(("error", _portable(e)))
        return
    try:
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            if message[0] == "stream":
                _stream(conn, engine, *message[1:])
                continue
            if message[0] == "weights":  # the model's new weights (DataParallel._follow_the_model)
                try:
                    from hf_async_cb.engine.data_parallel import copy_weights

                    copy_weights(engine.model, message[1])
                    engine.clear_prefix_cache()  # K/V cached under the old weights
                    conn.send(("ok", None))
                except BaseException as e:  # noqa: BLE001 (sent back to the caller)
                    conn.send(("error", _portable(e)))
                continue
            _, args, kwargs = message
            try:
                conn.send(("ok", engine.generate(*args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 (sent back to the caller)
                conn.send(("error", _portable(e)))
    except EOFError:  # the caller is gone
        pass
    finally:
        engine.close()


def _stream(conn: Connection, engine, mode: str | None, batch: list, options: dict) -> None:
    """A streamed call: the engine's background loop takes requests as ("add", [(key, prompt,
    params), ...]) messages arrive, so the caller can keep every replica full while it has work;
    each request's output goes back as ("done", key, output) the moment it finishes (("failed", key,
    error) if it could not run). ("end",) waits for what is running and ends the call, ("abort",)
    cancels it; either way ("ended", None) comes last."""
    finished: queue.SimpleQueue = queue.SimpleQueue()  # (key, handle) as requests end; None: the call ended
    lock = threading.Lock()  # over the pipe's sending end

    def send(message) -> None:
        with lock:
            conn.send(message)

    def add(items) -> None:
        for key, prompt, params in items:
            try:
                handle = engine.add_request(prompt, params, **options)
            except Exception as e:  # noqa: BLE001 (sent back to the caller)
                send(("failed", key, _portable(e)))
                continue
            handle.add_done_callback(lambda h, key=key: finished.put((key, h)))

    def watch() -> None:  # sends each finished request's output as it ends, until the call has ended
        while (item := finished.get()) is not None:
            key, handle = item
            if handle.error is not None:  # a request whose processor or criterion raised: its own error
                send(("failed", key, _portable(handle.error)))
            else:
                send(("done", key, handle.result()))

    engine.start(mode)
    watcher = threading.Thread(target=watch, name="hf_async_cb-replica-watch", daemon=True)
    watcher.start()
    try:
        add(batch)
        while True:
            message = conn.recv()
            if message[0] == "add":
                add(message[1])
            elif message[0] == "abort":
                engine.shutdown(cancel=True)  # what is queued or running ends ABORTED
                break
            else:  # "end": the caller sends it once nothing of its is outstanding here
                break
    finally:
        engine.shutdown(cancel=True)  # every request has ended, its callback run, when this returns
        finished.put(None)
        watcher.join()
        try:
            send(("ended", None))
        except OSError:  # the caller is gone
            pass


def _portable(error: BaseException):
    """The exception itself if it pickles (with the worker's traceback attached), else a
    ReplicaError carrying its text."""
    text = "".join(traceback.format_exception(error))
    try:
        error.worker_traceback = text
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001
        return ReplicaError(f"{type(error).__name__}: {error}\n\nin the replica:\n{text}")


@contextlib.contextmanager
def _without_capturing_hooks(model: torch.nn.Module) -> Iterator[None]:
    """The model without the forward hooks transformers installs for good the first time hidden
    states or attentions are asked of it (closures: they do not pickle, and a model once asked for
    them could not be sent to a worker), and marked as without them, so that the worker's copy
    installs its own if it needs them; all put back afterwards."""
    emptied, marked = [], []  # (each table's items as they were, in their order)
    for module in model.modules():
        for table in (module._forward_hooks, module._forward_pre_hooks):
            capturing = [key for key, hook in table.items() if hook_module(hook) == _CAPTURING_MODULE]
            if capturing:
                emptied.append((table, list(table.items())))
                for key in capturing:
                    del table[key]
        if module.__dict__.get("_output_capturing_hooks_installed"):
            marked.append(module)
            module._output_capturing_hooks_installed = False
    try:
        yield
    finally:
        for table, items in emptied:
            table.clear()
            table.update(items)
        for module in marked:
            module._output_capturing_hooks_installed = True


_CAPTURING_MODULE = "transformers.utils.output_capturing"


class ProcessReplica:
    """One worker process running an Engine on `device`; see the module docstring."""

    def __init__(self, model: torch.nn.Module, device: torch.device, config: BatchingConfig, tokenizer=None) -> None:
        self.device = device
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, model, device, config, tokenizer),
                                        name=f"hf_async_cb-replica-{device}", daemon=True)
        with _without_capturing_hooks(model):  # (the spawn pickles the model inside start())
            self._process.start()
        child.close()
        self._ready = False

    def wait_ready(self) -> None:
        """Block until the worker's Engine is built; raise its error if it failed."""
        if not self._ready:
            self._receive()
            self._ready = True

    def submit(self, *args, **kwargs) -> None:
        """Send one Engine.generate call (its arguments must pickle: logits processors and stopping
        criteria defined at a module's top level do; lambdas and local classes do not)."""
        self.send(("generate", args, kwargs))

    def result(self):
        """The submitted call's outputs (its error raised here)."""
        return self._receive()

    def send(self, message) -> None:
        try:
            self._conn.send(message)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"DataParallel with process replicas sends each call's arguments to the replica "
                             f"processes, and one of them does not pickle ({e}); define logits processors and "
                             "stopping criteria at a module's top level, or use workers='threads'.") from e
        except (BrokenPipeError, EOFError, OSError) as e:
            raise self._died() from e

    @property
    def connection(self) -> Connection:
        """The pipe's end, for multiprocessing.connection.wait over several replicas."""
        return self._conn

    def check_alive(self) -> None:
        """Raise ReplicaError if the worker has died."""
        if not self._process.is_alive():
            raise self._died()

    def receive(self) -> tuple:
        """The next message, as (kind, ...); waits, checking that the worker is alive."""
        while not self._conn.poll(_POLL_S):
            if not self._process.is_alive():
                raise self._died()
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died() from e

    def _receive(self):
        kind, payload = self.receive()
        if kind == "error":
            raise payload
        return payload

    def _died(self) -> ReplicaError:
        self._process.join(timeout=1)
        return ReplicaError(f"the replica process on {self.device} died (exit code {self._process.exitcode})")

    def close(self, timeout: float = 30.0) -> None:
        """Ask the worker to close its Engine and exit; terminate it if it does not within `timeout`."""
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
        self._conn.close()
