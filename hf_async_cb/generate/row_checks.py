"""The caller's own logits processors and stopping criteria, run one row at a time.

The engine runs each request on its own, so generate() calls the caller's processors and criteria
on one request's row (a batch of one) every time that request takes a token; stock calls them once
per step on the whole batch. They give stock's tokens only if they treat every row alike and keep
no state from call to call. So that a difference is never silent (batches of more than one row):

1. Before any work, each is probed on copies of one row (the call's batch size, its first row):
   it must return one result per row (a criterion's single bool or 0-d tensor, the pre-4.39 form,
   is its verdict on the whole batch, which stock applies to every row: refused), all equal,
   unless the rows differ by torch's random draws (noise: sampling, not indexing; the probe runs
   under two seeds on a forked generator). One
   built for a batch size or treating rows by their index is refused.
2. The probe calls it twice more on the same input and seed: a different result, or state that
   changed again after a first call (a first call may set things up lazily), mean it keeps state
   from call to call (a step counter, a history it appends to), which the engine would advance
   once per row: refused. State is looked for in its attributes, a bound method's object's, and a
   function's closure cells and the module globals it names. The probe leaves all of them as
   they were.
3. During the run, a deterministic one is called on two copies of the request's row, and a call
   that treats them differently (index logic that starts later than the probe's prompt) fails
   the generate call with the reason.

Each probe that raises is left to the real calls (which fail their request with the error).
"""

from __future__ import annotations

import copy
import inspect

import torch

from hf_async_cb.model.weight_kinds import versions

_BIG = 1 << 20  # a tensor attribute larger than this is compared by identity and version only


def check_rows_alike(processors, criteria, input_ids: torch.Tensor, rows: int, vocab: int,
                     criteria_read_scores: bool = False) -> set[int]:
    """Probe the caller's `processors` and `criteria` (items 1 and 2 of the module docstring) on
    `rows` copies of `input_ids`' first row; a ValueError for one that stock's batch would see
    otherwise. Returns the ids of those found deterministic, which the run calls on two copies of
    each row (item 3)."""
    if rows <= 1:
        return set()
    g = torch.Generator().manual_seed(0)
    row_scores = torch.randn(1, vocab, generator=g).to(input_ids.device)
    ids = input_ids[:1].expand(rows, -1).clone()
    checked = set()
    for obj in processors:
        if _probe(obj, lambda: obj(ids, row_scores.expand(rows, -1).clone()), rows, vocab, "logits processor",
                  input_ids.device):
            checked.add(id(obj))
    steps = (row_scores, torch.randn(1, vocab, generator=g).to(input_ids.device))
    for obj in criteria:  # (handed two steps' scores, as stock hands them with output_scores, else None)
        given = steps if criteria_read_scores else None
        if _probe(obj, lambda: obj(ids, _copies(given, rows)), rows, None, "stopping criterion", input_ids.device):
            checked.add(id(obj))
    return checked


def _copies(scores, rows: int):
    """`rows` copies of a row's scores: a [1, V] tensor, a criterion's tuple of them, or None."""
    if scores is None:
        return None
    if isinstance(scores, tuple):
        return tuple(s.expand(rows, -1).clone() for s in scores)
    return scores.expand(rows, -1).clone()


def _probe(obj, call, rows: int, vocab: int | None, kind: str, device: torch.device) -> bool:
    """Whether `obj` is deterministic (checked in the run); raises for what the module refuses."""
    name = type(obj).__name__
    devices = [device] if device.type == "cuda" else []

    def seeded(seed: int):
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return call()

    before = _attributes(obj)
    try:
        try:
            first = seeded(0)
            settled = _attributes(obj)
            again = seeded(0)
            changed = not _same(settled, _attributes(obj))
            other_seed = seeded(1)
        except Exception:  # noqa: BLE001 (no conclusion; the real calls will tell)
            return False
    finally:
        _restore(obj, before)
    if first is None:
        raise ValueError(f"{kind} {name} returned None (it must return its result for the batch).")
    if vocab is None and (isinstance(first, bool) or isinstance(first, torch.Tensor) and first.dim() == 0):
        raise ValueError(f"{kind} {name} returned one value for a batch of {rows} rows (a bool or a 0-d tensor): "
                         "stock stops every row of the batch when it is True, while the engine checks each row on "
                         "its own, so rows would end at other steps than in stock. Return one bool per row (a "
                         "[batch] tensor, as transformers' own criteria do), use batching='off' for it, or "
                         "generate one row at a time.")
    first, again, other_seed = (_per_row(x, rows, vocab) for x in (first, again, other_seed))
    if first is None:
        raise ValueError(f"{kind} {name} did not return one result per row for a batch of {rows} (it was built "
                         "for one batch size?): the engine calls it one row at a time, so it would not give stock's "
                         "tokens. Use batching='off' for it.")
    if changed or not _same(first, again):
        raise ValueError(f"{kind} {name} keeps state from call to call (called twice on the same rows, "
                         f"{'its state changed' if changed else 'it gave another result'}): stock calls it once "
                         "per step for the whole batch, the engine once per row per step, so it would not give "
                         "stock's tokens. Use batching='off' for it, or generate one row at a time.")
    if _alike(first, first[:1].expand_as(first)):
        return True
    if not _same(first, other_seed):  # its rows follow the seed: noise it draws, not the rows' index
        return False
    raise ValueError(f"{kind} {name} treats the rows of a batch differently (called on {rows} copies of one row, "
                     f"it did not give {rows} equal results): the engine calls it one row at a time, so it would "
                     "not give stock's tokens. Use batching='off' for it.")


def _per_row(result, rows: int, vocab: int | None) -> torch.Tensor | None:
    """`result` as [rows, ...] (a criterion's bool or 0-d result broadcast), or None for another shape."""
    if vocab is None and isinstance(result, bool):
        result = torch.tensor(result)
    if not isinstance(result, torch.Tensor):
        return None
    if vocab is None:
        if result.dim() == 0:
            return result.expand(rows)
        return result if tuple(result.shape) == (rows,) else None
    return result if tuple(result.shape) == (rows, vocab) else None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()) if a.dtype.is_floating_point \
            else torch.equal(a, b)
    if isinstance(a, _Big) or isinstance(b, _Big):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (no equality: the same object or not)
        return False


# Copies of one row may differ by rounding where a result comes from batched arithmetic (a processor
# that runs the model: a GEMM's blocking depends on the batch, bf16 rounds at 2^-8 of a value);
# treating rows by their index changes scores by whole amounts (a mask, a bias, a penalty).
_ROUNDING = 1e-2


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Results for copies of one row that are the same up to batched arithmetic's rounding: within
    `_ROUNDING` of each value and of the largest finite one; infinities and NaNs where the other has
    them; anything not floating-point equal."""
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    finite = a.detach()[torch.isfinite(a.detach())]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return bool(torch.isclose(a, b, rtol=_ROUNDING, atol=_ROUNDING * scale, equal_nan=True).all())


class _Big:
    """A large tensor attribute: its identity and version (an in-place write bumps it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t, versions([t])

    def __eq__(self, other) -> bool:
        return isinstance(other, _Big) and other.t is self.t and other.version == self.version


def _snapshot(value, depth: int = 0):
    """A copy of one attribute to compare and restore: small tensors cloned, containers copied one
    level down (two for containers of containers), anything else kept as it is."""
    if isinstance(value, torch.Tensor):
        return _Big(value) if value.numel() > _BIG else value.detach().clone()
    if depth < 2 and isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v, depth + 1) for v in value) if type(value) in (list, tuple) \
            else copy.copy(value)
    if depth < 2 and isinstance(value, dict):
        return {k: _snapshot(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (set, bytearray)):
        return copy.copy(value)
    return value


def _places(obj) -> dict:
    """Where `obj` can keep state between calls, each as (getter, setter): its attributes; for a
    bound method, its object's; for a function (a plain one, or a method's), the contents of its
    closure's cells and the module globals it names that are data (a counter in a closure or a
    global would escape a look at attributes alone)."""
    places = {}

    def attributes(holder, tag):
        if hasattr(holder, "__dict__"):
            d = vars(holder)
            for key in list(d):
                places[(tag, key)] = (lambda d=d, k=key: d[k], lambda v, d=d, k=key: d.__setitem__(k, v))

    attributes(obj, "attribute")
    fn = obj
    if inspect.ismethod(obj):
        attributes(obj.__self__, "object's attribute")
        fn = obj.__func__
    if inspect.isfunction(fn):
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if not _is_code_or_module(value):
                places[("closure", i)] = (lambda c=cell: c.cell_contents,
                                          lambda v, c=cell: setattr(c, "cell_contents", v))
        names = fn.__globals__
        for name in fn.__code__.co_names:
            if name in names and not _is_code_or_module(names[name]):
                places[("global", name)] = (lambda n=name: names[n], lambda v, n=name: names.__setitem__(n, v))
    return places


def _is_code_or_module(value) -> bool:
    return inspect.ismodule(value) or inspect.isroutine(value) or inspect.isclass(value)


def _attributes(obj) -> dict:
    """A snapshot of every place `obj` keeps state (_places), to compare and restore."""
    return {key: _snapshot(get()) for key, (get, _) in _places(obj).items()}


def _restore(obj, saved: dict) -> None:
    """Put `obj`'s state back as `saved` holds it (attributes the calls added removed)."""
    places = _places(obj)
    for key in [k for k in places if k not in saved and k[0] in ("attribute", "object's attribute")]:
        vars(obj if key[0] == "attribute" else obj.__self__).pop(key[1], None)  # (added by the calls)
    for key, value in saved.items():
        if key not in places:
            continue
        get, put = places[key]
        current = get()
        if isinstance(value, _Big):
            put(value.t)  # (an in-place write to a large tensor is not undone)
        elif isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and current.shape == value.shape \
                and current.dtype == value.dtype and not _same(current, value):
            with torch.no_grad():
                current.copy_(value)  # in place: other references to the tensor see it restored too
        elif not _same(current, value):
            put(value)


class RowChecked:
    """A deterministic processor or criterion of the caller's, called on two copies of a request's
    row: equal results pass on as the row's, different ones fail the call (module docstring, 3)."""

    def __init__(self, obj, kind: str) -> None:
        self.obj, self.kind = obj, kind

    def __call__(self, input_ids: torch.Tensor, scores):  # (two parameters, as stock's lists call processors
        ids = input_ids.expand(2, -1)                      # without kwargs; scores: a processor's [1, V], or a
        pair = self.obj(ids, _copies(scores, 2))           # criterion's tuple of them or None)
        vocab = scores.shape[-1] if isinstance(scores, torch.Tensor) else None
        rows = _per_row(pair, 2, vocab)
        if rows is None or not _alike(rows[:1], rows[1:]):
            raise ValueError(
                f"{self.kind} {type(self.obj).__name__} treated two copies of one row differently at row length "
                f"{input_ids.shape[-1]} (or did not return one result per row): it treats the rows of a batch by "
                "their index, which the engine, calling it one row at a time, does not reproduce. Use "
                "batching='off' for it.")
        return rows[:1]

    def __getattr__(self, name: str):
        if name == "obj":  # (not set yet: a copy in progress)
            raise AttributeError(name)
        return getattr(self.obj, name)
