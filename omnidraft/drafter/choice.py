"""Which backend runs the drafter under ``--drafter-backend auto``: measured once per home and CPU.

A drafter token's cost decides whether drafting pays at all, and that cost differs by up to 6x
between backends on one CPU (eager bf16 is fast where the CPU has AMX and slow where it does not;
llama.cpp's quantized kernels are fast on both). So nothing is assumed: every backend this machine
has for the drafter drafts the same probe once (teacher-forced on the fp32 torch drafter's own greedy
continuation of a few short texts; the backends take turns text by text, so none is timed only right
after another), and the choice is the fastest one whose top-1 token agrees with
the fp32 drafter's on at least :data:`MIN_AGREEMENT` of the probe's positions (a backend that
disagrees more loses acceptance, not correctness: the target verifies every token).

Candidates: torch float32 and bfloat16 (int8 takes no adapter, so it is never chosen for you), the
drafter's ONNX export when ``omnidraft export`` wrote one, and, when the drafter is a builtin or a
.gguf file, its GGUF on llama.cpp (when llama-cpp-python is installed) and on the native forward
(when set-up built it). The result is kept in
``<home>/models/costs/drafter-backends/<drafter>.json`` and measured again when the CPU, the
installed versions or the set of candidates changes.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from omnidraft.console import notice
from omnidraft.errors import OmnidraftError
from omnidraft.fsutil import atomic_write_json

MIN_AGREEMENT = 0.95  # top-1 agreement with the fp32 drafter a backend needs to be chosen (docs/performance.md)
PROBE_TEXTS = (
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n",
    "The history of the printing press begins in the fifteenth century, when",
    "<|im_start|>user\nHow do I keep my houseplants alive in winter?<|im_end|>\n<|im_start|>assistant\n",
)
PROBE_TOKENS = 32  # per text: ~100 positions, a few seconds per backend
FORMAT = 1


@dataclass
class BackendMeasure:
    """One backend's probe: what ``auto`` compares."""

    backend: str  # "torch", "onnx", "llamacpp" or "native"
    dtype: str | None  # the torch dtype, the export's quantization, or None (the GGUF's own)
    ms_per_token: float  # median one-token step
    agreement: float  # top-1 agreement with the fp32 torch drafter on the probe

    @property
    def label(self) -> str:
        return self.backend + (f" {self.dtype}" if self.dtype else "")


@dataclass
class BackendChoice:
    chosen: BackendMeasure
    measures: list[BackendMeasure]
    host: str
    measured_at: float

    def why(self) -> str:
        """One line: what was chosen, at what cost, against what."""
        others = ", ".join(f"{m.label} {m.ms_per_token:.1f} ms ({m.agreement:.0%})"
                           for m in self.measures if m is not self.chosen)
        c = self.chosen
        return (f"drafter on {c.label}: {c.ms_per_token:.1f} ms/token, {c.agreement:.1%} top-1 agreement with fp32 "
                f"(fastest at >= {MIN_AGREEMENT:.0%}; measured on {self.host}{'; ' + others if others else ''})")


def cpu_model() -> str:
    """The CPU's model name, as ``lscpu`` reports it (Linux), else what Python knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def pick(measures: Sequence[BackendMeasure]) -> BackendMeasure:
    """The fastest backend that agrees enough with the fp32 drafter (fp32 torch agrees by definition)."""
    good = [m for m in measures if m.agreement >= MIN_AGREEMENT]
    if not good:
        raise OmnidraftError("no drafter backend agrees with the fp32 drafter; use --drafter-backend torch")
    return min(good, key=lambda m: m.ms_per_token)


# ------------------------------------------------------------------------------- measuring


def probe(lm, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[float], int]:
    """(seconds of each one-token step, top-1 agreements) of a DraftLM teacher-forced on ``continuation``
    after ``context``."""
    agree = 0
    times: list[float] = []
    with torch.inference_mode():
        lm.reset()
        logits = lm.logits_for(context)
        for token in continuation:
            agree += int(int(logits.argmax()) == token)
            start = time.perf_counter()
            logits = lm.step(token)
            times.append(time.perf_counter() - start)
    return times, agree


def greedy_continuations(lm, contexts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """The reference drafter's own greedy continuation of each context."""
    out = []
    with torch.inference_mode():
        for ids in contexts:
            lm.reset()
            logits, cont = lm.logits_for(ids), []
            for _ in range(n):
                cont.append(int(logits.argmax()))
                logits = lm.step(cont[-1])
            out.append(cont)
    return out


@dataclass
class Candidate:
    """A backend that can be tried: its name, dtype and how to load its DraftLM."""

    backend: str
    dtype: str | None
    load: Callable[[], object]


def measure(reference, candidates: Sequence[Candidate], tokenizer, progress: Callable[[str], None] = lambda _: None,
            ) -> list[BackendMeasure]:
    """Probe the fp32 torch ``reference`` and every candidate, all loaded at once and taken in turn text by
    text, the order reversed every other text: a backend timed only right after another (whose threads
    may still spin, or whose memory the caches still hold) would be charged for it."""
    contexts = [list(tokenizer(text)["input_ids"]) for text in PROBE_TEXTS]
    continuations = greedy_continuations(reference, contexts, PROBE_TOKENS)
    lms = [("torch", "float32", reference)]
    for cand in candidates:
        progress(f"{cand.backend} {cand.dtype or ''}".strip())
        lms.append((cand.backend, cand.dtype, cand.load()))
    times: list[list[float]] = [[] for _ in lms]
    agree = [0] * len(lms)
    for i, (context, continuation) in enumerate(zip(contexts, continuations, strict=True)):
        order = range(len(lms)) if i % 2 == 0 else reversed(range(len(lms)))
        for j in order:
            steps, agreed = probe(lms[j][2], context, continuation)
            times[j] += steps
            agree[j] += agreed
    total = sum(len(c) for c in continuations)
    measures = [BackendMeasure(backend, dtype, round(1000 * statistics.median(t), 2),
                               1.0 if j == 0 else round(a / max(total, 1), 4))
                for j, ((backend, dtype, _), t, a) in enumerate(zip(lms, times, agree, strict=True))]
    for _, _, lm in lms[1:]:
        close = getattr(getattr(lm, "engine", None), "close", None)
        if close is not None:
            close()
    return measures


# ------------------------------------------------------------------------------- the record


def record_path(drafter_slug: str, home=None) -> Path:
    from omnidraft import models

    return models.models_dir(home) / "costs" / "drafter-backends" / f"{drafter_slug}.json"


def fingerprint(candidates: Sequence[tuple[str, str | None]]) -> dict:
    """What a measurement depends on: when any of it changes, it is taken again. The native drafter's
    kernel is omnidraft's own code, so its build counts like a package version (a rebuilt kernel steps at
    another speed, and may agree otherwise)."""
    key = {"format": FORMAT, "host": cpu_model(), "torch": torch.__version__, "onnxruntime": _version("onnxruntime"),
           "llama_cpp_python": _version("llama_cpp_python"), "candidates": sorted(f"{b} {d}" for b, d in candidates)}
    if any(backend == "native" for backend, _ in candidates):
        from omnidraft import kernels

        key["native_kernel"] = kernels.build_dir("qdraft").name
    return key


def load_choice(path: Path, expected: dict) -> BackendChoice | None:
    """The kept choice if it was measured under ``expected``, else None (also for an unreadable file)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("fingerprint") != expected:
            return None
        measures = [BackendMeasure(**m) for m in doc["measures"]]
        chosen = next(m for m in measures if m.label == doc["chosen"])
        return BackendChoice(chosen, measures, str(doc["fingerprint"]["host"]), float(doc["measured_at"]))
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None


def save_choice(path: Path, choice: BackendChoice, key: dict) -> None:
    doc = {"fingerprint": key, "chosen": choice.chosen.label, "measured_at": choice.measured_at,
           "measures": [asdict(m) for m in choice.measures]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, doc)
    except (OSError, OmnidraftError) as exc:  # a read-only home: measured again next time
        notice(f"cannot keep the drafter backend choice ({exc})")
