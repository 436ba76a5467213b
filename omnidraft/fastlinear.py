"""Faster fp32 Linear layers for the shapes speculative decoding produces on a CPU.

Verifying k drafted tokens runs every Linear on a skinny input (2 <= rows <= ~16). On some CPUs
torch's ``F.linear`` (x @ W^T) handles that shape badly: a few rows can cost several times one
row, although the weights are read once either way. Computing the same product as (W @ x^T)^T
streams the weights through once, as in the one-row case. The drafter's hot path is the one-row
case, where ``x @ W_t`` with a transposed copy of the LM head can beat ``F.linear``.

A short prompt's read (a chat turn: up to SKINNY_MAX_ROWS rows) is skinny too, and may run the native
one-pass kernel in passes of at most 16 rows (:func:`_in_passes`).

Which kernel wins depends on the CPU (on one, F.linear is the fastest for two rows; on another a
one-column product runs as a single-threaded GEMV and two rows are faster than one; the measured
cases are in NOTES.md and docs/performance.md). So each (weight shape, row class) pair picks its
kernel by timing the candidates once (:func:`_choose`): on first use, or up front in a target's
``warm_up``; a one-row input may also run as two identical rows. :func:`keep_choices_at` keeps the
choices in a file per machine, so that a later process (a one-shot ``omnidraft generate``) does not
time them again on its first requests.

Same dtype, same weights, only the order of floating-point additions changes — as it does between
any two GEMM kernels. The fast paths are active only inside :func:`enabled` (the decode engine
turns it on), so a model shared with plain transformers ``generate`` runs stock there.
"""

from __future__ import annotations

import itertools

import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from omnidraft import kernels

SKINNY_MAX_ROWS = 64  # above this a regular GEMM is as good (prefill)
_state = threading.local()


@contextmanager
def enabled() -> Iterator[None]:
    previous = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = previous


def active() -> bool:
    """Whether this thread is inside :func:`enabled` (the decode engine's forwards)."""
    return getattr(_state, "on", False)


Kernel = Callable[[torch.nn.Linear, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, weight, rows x in) -> rows x out


def _f_linear(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    return F.linear(flat, weight)


def _weights_first(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, flat.t()).t().contiguous()


def _transposed(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    return flat @ _transposed_weight(layer)


def _transposed_weight(layer: torch.nn.Linear) -> torch.Tensor | None:
    """The layer's transposed copy of its weight (None: it keeps none), remade whenever the weight
    changed since it was made: a dtype conversion or a copy gives the weight new storage, a merged
    adapter bumps its version, and a stale copy would compute with the old weights."""
    if not layer._omnidraft_keeps_t:
        return None
    weight = layer.weight
    key = (weight.data_ptr(), weight.dtype, weight._version)
    if getattr(layer, "_omnidraft_wt_key", None) != key:
        layer._omnidraft_wt = weight.detach().t().contiguous()
        layer._omnidraft_wt_key = key
    return layer._omnidraft_wt


def _two_rows(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """One row computed as two: torch may send a one-column product to a GEMV that runs
    single-threaded, while a two-column product uses every core."""
    return torch.mm(weight, torch.cat([flat, flat]).t())[:, :1].t().contiguous()


def _native(tiled: bool) -> Kernel:
    """The one-pass kernel of ``omnidraft.kernels`` in one of its two layouts (same bits)."""
    def run(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return kernels.linear_rows()(flat.contiguous(), weight.contiguous(), tiled)
    run.__name__ = f"_native_{'tiled' if tiled else 'rowwise'}"
    return run


def _native_512(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The AVX-512 build of the one-pass kernel (same bits as the other two)."""
    return kernels.linear_rows_512()(flat.contiguous(), weight.contiguous())


_NATIVE = (_native(True), _native(False))
_NATIVE_MAX_ROWS = 16


def _in_passes(kernel: Kernel) -> Kernel:
    """``kernel`` (a native one, at most _NATIVE_MAX_ROWS rows a pass) over a short prompt's read in
    even passes (17 rows: 9 + 8). Why: torch's GEMMs can handle a few dozen rows about as badly as a
    verify's few (docs/performance.md), while a native pass reads the weights once for up to 16 rows;
    towards 64 rows a GEMM catches up, and the timing keeps whichever is faster. Each row keeps the
    native kernel's bits (they do not depend on the other rows of a pass)."""
    def run(layer: torch.nn.Linear, weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        rows = flat.shape[0]
        size = -(-rows // -(-rows // _NATIVE_MAX_ROWS))  # ceil(rows / passes), passes = ceil(rows / 16)
        return torch.cat([kernel(layer, weight, flat[i: i + size]) for i in range(0, rows, size)])
    run.__name__ = f"{kernel.__name__}_passes"
    return run


_IN_PASSES = {kernel: _in_passes(kernel) for kernel in (*_NATIVE, _native_512)}


def _native_kernels() -> list[Kernel]:
    """The native kernels built and loadable here (every one gives a row the same bits)."""
    return ([*_NATIVE] if kernels.linear_rows() is not None else []) + (
        [_native_512] if kernels.linear_rows_512() is not None else [])
_PROMPT_CLASS = 32  # prompt reads of 17..32 rows share a choice, 33..SKINNY_MAX_ROWS another
PROMPT_CLASSES = (_PROMPT_CLASS, SKINNY_MAX_ROWS)  # the row classes above a verify's (see rows_class)
_COLD_BYTES = 128 * 2**20  # more than a CPU's last-level cache: weights read from memory, as in a decode step


def _candidates(layer: torch.nn.Linear, flat: torch.Tensor, has_t: bool) -> list[Kernel]:
    rows = flat.shape[0]
    out = [_f_linear, _weights_first] + ([_transposed] if has_t else []) + ([_two_rows] if rows == 1 else [])
    if flat.dtype == torch.float32:
        out += _native_kernels() if rows <= _NATIVE_MAX_ROWS else [_IN_PASSES[k] for k in _native_kernels()]
    return out


def _timing_weights(layer: torch.nn.Linear, has_t: bool) -> list[torch.Tensor]:
    """Weights to time the candidates on, so that each call reads its weights from memory as a
    decode step does (a model's weights do not fit in cache; timed hot, a compute-bound kernel looks
    as fast as a memory-bound one, and the slower kernel would be chosen). A weight larger than the
    cache is its own cold copy, and one larger than ``_COLD_BYTES`` (a large vocabulary's LM head:
    671 MB for Gemma 3's) is timed on its leading rows up to that size, which stream from memory at
    the same rate per row at a fraction of the timing's cost. A smaller one is timed on enough
    same-shaped copies, in turn, that each call finds its copy evicted. A layer with a transposed copy
    (its kernel reads that copy whole), and a weight under 1 MiB (its cost is small whatever the
    kernel), are timed on their own weight."""
    weight = layer.weight
    row_bytes = weight.shape[1] * weight.element_size()
    size = weight.shape[0] * row_bytes
    if has_t or size < 2**20 or _COLD_BYTES // 2 <= size <= _COLD_BYTES:
        return [weight]
    if size > _COLD_BYTES:
        return [weight[: _COLD_BYTES // row_bytes]]  # leading rows: a contiguous view, nothing copied
    return [torch.ones_like(weight) for _ in range(min(64, -(-_COLD_BYTES // size)))]


CANDIDATES = 2  # the candidate set's version (2: native passes for prompt reads): choices kept under another were
# timed without some candidate, so they are timed again
_CHOICE: dict[tuple, Kernel] = {}  # (out, in, rows, dtype, has transposed copy) -> fastest
_kept: dict = {}  # "path" and "machine" of the file the choices are kept in (see keep_choices_at)


def _kernels_by_name() -> dict[str, Kernel]:
    return {k.__name__: k for k in (_f_linear, _weights_first, _transposed, _two_rows, *_NATIVE, _native_512,
                                    *_IN_PASSES.values())}


def rows_class(rows: int) -> int:
    """The row count a choice is timed and kept for: each count a verify makes (up to the native
    kernel's) has its own, while a short prompt's read (up to SKINNY_MAX_ROWS rows, one per distinct
    prompt length) shares one of two classes, so that a chat's turns do not each time kernels anew."""
    if rows <= _NATIVE_MAX_ROWS:
        return rows
    return _PROMPT_CLASS if rows <= _PROMPT_CLASS else SKINNY_MAX_ROWS


def _key(weight_shape: torch.Size, rows: int, dtype: torch.dtype, has_t: bool) -> tuple:
    """What a choice depends on within one machine: the product's shape and dtype, its row class, and
    the threads it runs on (a server pinned to one core and a two-thread bench of the same home pick
    different kernels: a multi-row product that splits well over two threads can lose on one)."""
    return (*weight_shape, rows_class(rows), dtype, has_t, torch.get_num_threads())


def _distinct_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """One fast-path Linear of each (weight shape, dtype, transposed copy) in ``model``: a choice
    depends on nothing else, so timing one times them all."""
    layers: dict[tuple, torch.nn.Linear] = {}
    for m in model.modules():
        if hasattr(m, "_omnidraft_keeps_t"):
            layers.setdefault((*m.weight.shape, m.weight.dtype, m._omnidraft_keeps_t), m)
    return list(layers.values())


def untimed(model: torch.nn.Module, rows: Iterable[int]) -> list[tuple[torch.nn.Linear, int]]:
    """(layer, row count) pairs of ``model`` whose kernel is not chosen yet, in this process or in
    the kept file: what :func:`prepare` still has to time, layer by layer."""
    return [(m, r) for m in _distinct_layers(model) for r in dict.fromkeys(rows_class(r) for r in rows)
            if _key(m.weight.shape, r, m.weight.dtype, m._omnidraft_keeps_t) not in _CHOICE]


def prepare(model: torch.nn.Module, rows: Iterable[int], progress: bool = False) -> int:
    """Choose now the kernel of every fast-path Linear of ``model`` for each of ``rows`` not chosen
    yet; returns how many choices were timed. Each distinct weight shape is timed once per row class,
    on inputs of that many rows, with its cold copies made once for all of them. Left to first use
    instead, each new row count costs the forward that meets it ~1-2 s: in a first run's benchmark,
    the cost of timing and not of the loop."""
    todo = untimed(model, rows)
    if not todo:
        return 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc="timing kernels (once per machine)", unit="shape",
               disable=not progress, leave=False)
    with torch.inference_mode():
        for layer, pairs in itertools.groupby(todo, key=lambda pair: pair[0]):
            has_t = _transposed_weight(layer) is not None
            weights = _timing_weights(layer, has_t)
            for _, r in pairs:
                flat = torch.randn(r, layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)
                _CHOICE[_key(layer.weight.shape, r, flat.dtype, has_t)] = _time_candidates(layer, flat, has_t, weights)
                bar.update()
            del weights  # before the next shape's copies are made: one shape's 128 MB at a time
    bar.close()
    _save_choices()
    return len(todo)


def _key_text(key: tuple) -> str:
    out, inp, rows, dtype, has_t, threads = key
    return f"{out},{inp},{rows},{str(dtype).removeprefix('torch.')},{int(has_t)},{threads}"


def keep_choices_at(path, machine: str) -> None:
    """Use the kernel choices timed earlier on ``machine`` (kept in ``path``), and keep new ones there.

    ``machine`` names what a choice depends on (CPU model, torch version, the native kernel's build);
    a file measured on another one is ignored and rewritten. An unreadable file is ignored too: the
    choices are timed again, which is all it costs."""
    import json

    machine = f"{machine}; candidates {CANDIDATES}"
    _kept.update(path=path, machine=machine)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(doc, dict) or doc.get("machine") != machine or not isinstance(doc.get("choices"), dict):
        return
    names = _kernels_by_name()
    native = {k: k for k in (*_NATIVE, _native_512)} | {passes: k for k, passes in _IN_PASSES.items()}
    for text, name in doc["choices"].items():
        try:
            out, inp, rows, dtype, has_t, threads = str(text).split(",")
            key = (int(out), int(inp), int(rows), getattr(torch, dtype), bool(int(has_t)), int(threads))
        except (ValueError, AttributeError):
            continue
        kernel = names.get(name)
        if kernel is not None and isinstance(key[3], torch.dtype) and (
                kernel not in native or native[kernel] in _native_kernels()):
            _CHOICE.setdefault(key, kernel)


def _save_choices() -> None:
    if not _kept:
        return
    from omnidraft.errors import OmnidraftError
    from omnidraft.fsutil import atomic_write_json

    doc = {"machine": _kept["machine"], "choices": {_key_text(k): v.__name__ for k, v in _CHOICE.items()}}
    try:
        _kept["path"].parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(_kept["path"], doc)
    except (OSError, OmnidraftError):  # a read-only home: timed again next time
        _kept.clear()


def _choose(layer: torch.nn.Linear, flat: torch.Tensor) -> Kernel:
    """The fastest kernel for this weight shape and row class, timed once per machine with the
    weights cold (:func:`_time_candidates`; paid on the first read of each row class, or in a
    target's ``warm_up``)."""
    has_t = _transposed_weight(layer) is not None
    key = _key(layer.weight.shape, flat.shape[0], flat.dtype, has_t)
    kernel = _CHOICE.get(key)
    if kernel is None:
        kernel = _CHOICE[key] = _time_candidates(layer, flat, has_t, _timing_weights(layer, has_t))
        _save_choices()
    return kernel


_WARM_ROWS = 4096  # weight rows of a candidate's untimed first call
_DROP_AFTER_FIRST = 1.3  # a candidate this much slower than the best in the first round is not timed again


def _time_candidates(layer: torch.nn.Linear, flat: torch.Tensor, has_t: bool, weights: list[torch.Tensor]) -> Kernel:
    """Best of 3 rounds after a warm-up, interleaved so that a noisy moment does not pick one
    kernel's time. After the first round only the candidates within ``_DROP_AFTER_FIRST`` of the best
    are timed again: a clear loser needs no second look, and each round reads the weights from
    memory once per candidate (~1 s a round for a 262k-token LM head), so this halves a warm-up."""
    candidates = _candidates(layer, flat, has_t)
    for candidate in candidates:  # warm-up (lazy set-up, thread pools): a slice of the weight does
        candidate(layer, weights[0][:_WARM_ROWS], flat)
    timings = [float("inf")] * len(candidates)
    timed = range(len(candidates))
    for _ in range(3):
        for i in timed:
            start = time.perf_counter()
            for weight in weights:
                candidates[i](layer, weight, flat)
            timings[i] = min(timings[i], time.perf_counter() - start)
        timed = [i for i in timed if timings[i] <= _DROP_AFTER_FIRST * min(timings)]
    return candidates[timings.index(min(timings))]


def _skinny_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not getattr(_state, "on", False) or x.dtype != self.weight.dtype or not 1 <= rows <= SKINNY_MAX_ROWS:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(-1, x.shape[-1])
    out = _choose(self, flat)(self, self.weight, flat)
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def install(model: torch.nn.Module, transposed_head: bool = False) -> torch.nn.Module:
    """Route the model's float Linear layers through the fast paths (idempotent).

    ``transposed_head`` keeps a transposed copy of the LM head for the one-row case: worth its
    memory for a drafter (113 MB for SmolLM2), which decodes one row at a time.
    """
    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module._omnidraft_wt = None  # made on first use by _transposed_weight
            module._omnidraft_keeps_t = transposed_head and module is head
            module.forward = types.MethodType(_skinny_forward, module)
    return model
