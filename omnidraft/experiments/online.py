"""Online distillation benchmark (issue 5): does the drafter get faster the more it is used?

A stream of prompts from one set goes through Algorithm 2 — decode, record, update the pair's LoRA
adapter every ``interval`` prompts — once per loss (L_DM; L_DM + λ·L_N-gram, eq. (3)). At
checkpoints along the stream a disjoint held-out slice of the same set is decoded for real with
each loss's adapter of that moment, interleaved per prompt with the target alone, as in
``omnidraft bench``: acceptance rate, tokens per target forward, speedup. Outputs results.json,
results.md (Table 1's shape: untrained vs each loss after the stream) and online.png (Figure 2's
shape: the curves over the stream). With ``shift_to`` the stream switches sets half-way and both
sets' held-out slices are tracked (Figure 5's shape).

One recorded stream serves every loss. Under greedy verification the emitted tokens are the
target's own greedy output and p at each position is the target's, whatever the drafter proposes
(the lossless property), so a record does not depend on the drafter; only q' does, and the loss
computes it at training time with the current adapter. The stream is therefore decoded once (with
speculative decoding and the recorder on) and each loss trains on the same records in the same
order, exactly what Algorithm 2 would feed it; every number in the tables comes from real
decoding of the held-out prompts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from omnidraft.adapter.store import LoadedAdapter
from omnidraft.bench.report import draft_policy
from omnidraft.bench.runner import PromptRun, our_mode, summarize
from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.train.config import TrainConfig
from omnidraft.train.distill import Distiller, learning_curve_point
from omnidraft.train.records import Record, Recorder, preimage_table, to_example

LOSSES = ("dm", "hybrid", "frozen")  # frozen: no distillation, only the acceptance head learns
LOSS_LABEL = {"none": "no training (SpD)", "dm": "L_DM (LoRA)", "hybrid": "L_DM + λ·L_N-gram (LoRA)",
              "dm+head": "L_DM (LoRA) + acceptance head", "hybrid+head": "L_DM + λ·L_N-gram (LoRA) + acceptance head",
              "frozen+head": "acceptance head only (drafter frozen)",
              "none+confidence": "no training, confidence stop (what the head replaces)"}


def modes_of(losses: Sequence[str], head: bool) -> list[str]:
    """Evaluated modes per trained loss: the adapter under the run's draft policy, and with the
    head stopping drafts (eq. (7)) when a head was trained. A frozen drafter only has the latter."""
    modes: list[str] = []
    for loss in losses:
        modes += ([loss] if loss != "frozen" else []) + ([f"{loss}+head"] if head or loss == "frozen" else [])
    return modes


@dataclass
class OnlinePlan:
    """What to stream and where to look."""

    stream: list[list[int]]  # prompt ids, in stream order
    held_out: dict[str, list[list[int]]]  # set name -> prompt ids (disjoint from the stream)
    checkpoints: list[int]  # prompts streamed at each evaluation (0 = before any training)
    interval: int
    losses: Sequence[str] = LOSSES
    stream_sets: list[str] = field(default_factory=list)  # the set each stream prompt came from


# ---- recording ---------------------------------------------------------------------------------
def records_meta(pipe, max_new_tokens: int, top_k: int) -> dict:
    """What a greedy record depends on: the target, the vocabulary intersection, budget and k."""
    return {"target": pipe.target_spec, "drafter": pipe.drafter_spec, "max_new_tokens": max_new_tokens,
            "top_k": top_k, "verify": "greedy"}


class RecordCache:
    """Records by prompt, on disk: a stream or a held-out slice is decoded once across runs.

    ``meta`` names what a record depends on (target, drafter vocabulary, token budget, k); a file
    written under other meta is ignored, never mixed in.
    """

    def __init__(self, path: Path | None, meta: dict) -> None:
        self.path, self.meta = path, meta
        self.records: dict[str, Record] = {}
        if path is not None and path.is_file():
            data = torch.load(path, weights_only=True)
            if data.get("meta") == meta:
                self.records = {key: Record(**row) for key, row in data["records"].items()}

    @staticmethod
    def key(ids: Sequence[int]) -> str:
        return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:24]

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        torch.save({"meta": self.meta, "records": {k: vars(r) for k, r in self.records.items()}}, tmp)
        tmp.replace(self.path)


def record_prompts(decoder: SpeculativeDecoder, prompts: Sequence[list[int]], config: DecodeConfig,
                   cache: RecordCache, desc: str = "record", progress: bool = True) -> list[Record]:
    """Each prompt's record: from the cache, or by decoding it with the recorder on."""
    from tqdm.auto import tqdm

    todo = [ids for ids in prompts if RecordCache.key(ids) not in cache.records]
    got: list[Record] = []
    recorder = Recorder(decoder.bridge.t2d >= 0, sink=got.append, top_k=cache.meta["top_k"])
    decoder.observers.append(recorder)
    try:
        for n, ids in enumerate(tqdm(todo, desc=desc, unit="prompt", disable=not progress or not todo), 1):
            decoder.generate(ids, config)
            cache.records[RecordCache.key(ids)] = got[-1]
            if n % 10 == 0:
                cache.save()  # a long recording survives an interruption
    finally:
        decoder.observers.remove(recorder)
        if todo:
            cache.save()
    return [cache.records[RecordCache.key(ids)] for ids in prompts]


# ---- training ----------------------------------------------------------------------------------
def train_along_stream(make_drafter: Callable[[], torch.nn.Module], dm_mask: torch.Tensor, examples: list,
                       config: TrainConfig, interval: int, checkpoints: Sequence[int],
                       progress: bool = True, desc: str = "train") -> tuple[dict[int, dict], list[dict]]:
    """Algorithm 2 over the recorded stream: an update every ``interval`` prompts; the adapter's
    state at each checkpoint, and one learning-curve point per update."""
    from tqdm.auto import tqdm

    distiller = Distiller(make_drafter(), dm_mask, config)
    states: dict[int, tuple[dict, dict | None]] = {}
    curve: list[dict] = []
    if 0 in checkpoints:
        states[0] = distiller.state(), distiller.head_state()
    buffer: list = []
    bar = tqdm(total=max(checkpoints), desc=desc, unit="prompt", disable=not progress)
    for i, example in enumerate(examples[: max(checkpoints)], 1):
        if example is not None:
            buffer.append(example)
        if i % interval == 0 or i in checkpoints:
            if buffer:
                point = learning_curve_point(distiller.update(buffer))
                curve.append(dict(point, prompts=i))
                bar.set_postfix_str(f"loss {point['loss']:.3f} top-1 {point['top1_agreement']:.2f}")
            buffer = []
        if i in checkpoints:
            states[i] = distiller.state(), distiller.head_state()
        bar.update(1)
    bar.close()
    return states, curve


# ---- evaluation --------------------------------------------------------------------------------
def evaluate(pipe, prompts: Sequence[list[int]], adapters: dict[str, tuple[LoadedAdapter | None, DecodeConfig]],
             config: DecodeConfig, progress: bool = True, desc: str = "evaluate") -> dict[str, list[PromptRun]]:
    """Every mode on every prompt, interleaved per prompt: the target alone, then the drafter with
    each mode's adapter (None: the untrained drafter) and decoding options. Merging an adapter
    happens outside the timing."""
    from tqdm.auto import tqdm

    slot = pipe.adapter_slot
    alone = our_mode(SpeculativeDecoder(pipe.decoder.target), replace(config, verify="greedy"))
    specs = {mode: our_mode(pipe.decoder, mode_config) for mode, (_, mode_config) in adapters.items()}
    runs: dict[str, list[PromptRun]] = {"target": [], **{m: [] for m in adapters}}
    bar = tqdm(total=len(prompts) * (1 + len(adapters)), desc=desc, unit="run", disable=not progress)
    for ids in prompts:
        runs["target"].append(alone(ids))
        bar.update(1)
        for mode, (adapter, _) in adapters.items():
            slot.use(adapter)
            runs[mode].append(specs[mode](ids))
            bar.update(1)
    slot.use(None)
    bar.close()
    return runs


def in_memory_adapter(state: tuple[dict, dict | None], config: TrainConfig, name: str) -> LoadedAdapter:
    lora_state, head_state = state
    return LoadedAdapter(Path(f"<{name}>"), lora_state, {}, config.scaling, head_state)


def checkpoint_modes(states: dict[str, dict], t: int, train: TrainConfig, decode: DecodeConfig,
                     modes: Sequence[str], head_k: int) -> dict[str, tuple[LoadedAdapter | None, DecodeConfig]]:
    """What to evaluate after ``t`` stream prompts: each mode's adapter and decoding options.
    Plain modes draft under the run's policy without the head; "+head" modes stop by the head, with
    up to ``head_k`` tokens. Before training, when heads are evaluated, the untrained drafter also
    runs with the confidence stop at ``head_k``: the rule the head replaces, at the same k."""
    plain = replace(decode, draft_stop=_headless(decode.draft_stop))
    if not t:
        out = {"none": (None, plain)}
        if any(m.endswith("+head") for m in modes) and plain.draft_stop != "confidence":
            out["none+confidence"] = (None, replace(decode, draft_stop="confidence", draft_len=head_k))
        return out
    out = {}
    for mode in modes:
        loss, _, head = mode.partition("+")
        lora_state, head_state = states[loss][t]
        adapter = in_memory_adapter((lora_state, head_state if head else None), train, f"{mode}@{t}")
        out[mode] = (adapter, replace(decode, draft_stop="head", draft_len=head_k) if head else plain)
    return out


def _headless(stop: str) -> str:
    """The run's own draft policy with the head out of it (auto means confidence without a head)."""
    return "confidence" if stop in ("auto", "head") else stop


def run_online(pipe, plan: OnlinePlan, decode: DecodeConfig, train: TrainConfig, records: RecordCache,
               progress: bool = True, head_k: int | None = None) -> dict:
    """The whole benchmark; returns the JSON-able result (see ``write_online``)."""
    from omnidraft import models

    bridge = pipe.decoder.bridge
    pipe.adapter_slot.use(None)
    stream = record_prompts(pipe.decoder, plan.stream, decode, records, "record stream", progress)
    preimages, _ = preimage_table(bridge)
    examples = [to_example(r, bridge, preimages) for r in stream]
    make_drafter = lambda: models.load(pipe.drafter_spec, dtype="float32", progress=False)[0]
    states: dict[str, dict[int, dict]] = {}
    curves: dict[str, list[dict]] = {}
    for loss in plan.losses:
        config = replace(train, distill=False, head=True) if loss == "frozen" else replace(train, loss=loss)
        states[loss], curves[loss] = train_along_stream(make_drafter, bridge.dm_mask, examples, config, plan.interval,
                                                        plan.checkpoints, progress, desc=f"train {loss}")
    warm = plan.stream[0][:16]
    short = replace(decode, max_new_tokens=8)
    evaluate(pipe, [warm], {"none": (None, short)}, short, progress=False)  # first calls are slow
    points = []
    modes = modes_of(plan.losses, train.head)
    for t in plan.checkpoints:
        adapters = checkpoint_modes(states, t, train, decode, modes, head_k or decode.draft_len)
        for set_name, prompts in plan.held_out.items():
            runs = evaluate(pipe, prompts, adapters, decode, progress, desc=f"evaluate {set_name} @{t}")
            points.append({"prompts_streamed": t, "set": set_name, "modes": summarize(runs, compare=list(runs))})
    return {"checkpoints": points, "train_curves": curves, "stream_sets": plan.stream_sets}


# ---- report ------------------------------------------------------------------------------------
def _rows_at(result: dict, t: int, set_name: str) -> dict:
    for p in result["checkpoints"]:
        if p["prompts_streamed"] == t and p["set"] == set_name:
            return p["modes"]
    return {}


def _modes(meta: dict) -> list[str]:
    return meta.get("modes") or list(meta["losses"])  # results written before the head: losses only


def _draft_policy(meta: dict) -> str:
    """The plain modes' draft policy, and the head's γ when "+head" modes were run."""
    plain = draft_policy(dict(meta, draft_stop=_headless(meta.get("draft_stop", "confidence"))))
    if any(m.endswith("+head") for m in _modes(meta)):
        k = meta.get("head_draft_len") or meta["draft_len"]
        return (f"{plain} (\"+ acceptance head\": k ≤ {k}, head stop γ = {meta.get('stop_gamma')}; "
                f"\"confidence stop\": k ≤ {k}, stop below {meta.get('draft_confidence')})")
    return plain


def _train_extras(train: dict) -> str:
    """Options that differ from Algorithm 2's one pass towards p itself, named only when set."""
    extras = [f"{train['epochs']} passes per update"] if train.get("epochs", 1) != 1 else []
    if train.get("target_temperature", 1.0) != 1.0:
        extras.append(f"p sharpened to T = {train['target_temperature']:g}")
    if train.get("divergence", "reverse-kl") != "reverse-kl":
        extras.append(f"{train['divergence']} at DM positions")
    if train.get("span_weight"):
        extras.append(f"straddling tokens' NLL × {train['span_weight']:g}")
    if train.get("head_replay"):
        extras.append(f"head re-fits on the previous {train['head_replay']} prompts")
    return "".join(f", {e}" for e in extras)


def markdown(result: dict, meta: dict) -> str:
    """Table 1's shape (before/after per loss) per held-out set, then every checkpoint."""
    lines = ["# omnidraft online distillation\n",
             f"drafter `{meta['drafter']}` → target `{meta['target']}`, stream {meta['stream']} × {meta['stream_n']} "
             f"(interval {meta['interval']}), held-out {', '.join(f'{k} × {v}' for k, v in meta['held_out'].items())}, "
             f"{meta['max_new_tokens']} new tokens, greedy, {_draft_policy(meta)}; LoRA rank {meta['train']['rank']}, lr {meta['train']['lr']}, "
             f"batch {meta['train']['batch_size']}, λ {meta['train']['lam']} ({meta['train']['ngram_weight']}){_train_extras(meta['train'])}\n"]
    last = max(p["prompts_streamed"] for p in result["checkpoints"])
    for set_name in meta["held_out"]:
        base = _rows_at(result, 0, set_name).get("none", {})
        lines += [f"\n## held-out {set_name}: after {last} stream prompts\n",
                  "| method | acceptance | Δ vs untrained | tokens/target fwd | speedup vs target (median) | Δ vs untrained | identical |",
                  "|---|---|---|---|---|---|---|"]
        untrained = _rows_at(result, 0, set_name)
        rows = [(m, untrained[m]) for m in ("none", "none+confidence") if m in untrained]
        rows += [(m, _rows_at(result, last, set_name).get(m, {})) for m in _modes(meta)]
        for mode, r in rows:
            if not r:
                continue
            lines.append(f"| {LOSS_LABEL[mode]} | {r['acceptance_rate']:.3f} | {_rel(r['acceptance_rate'], base.get('acceptance_rate'))} | "
                         f"{r['tokens_per_target_forward']:.2f} | {r['speedup_vs_target']:.2f}× | "
                         f"{_rel(r['speedup_vs_target'], base.get('speedup_vs_target'))} | {'yes' if r.get('identical_to_target') else 'NO'} |")
        lines += [f"\n### {set_name}: every checkpoint\n", "| prompts streamed | method | acceptance | tokens/target fwd | speedup (median) |", "|---|---|---|---|---|"]
        for p in result["checkpoints"]:
            if p["set"] != set_name:
                continue
            for mode, r in p["modes"].items():
                if mode != "target":
                    lines.append(f"| {p['prompts_streamed']} | {LOSS_LABEL[mode]} | {r['acceptance_rate']:.3f} | "
                                 f"{r['tokens_per_target_forward']:.2f} | {r['speedup_vs_target']:.2f}× |")
    return "\n".join(lines) + "\n"


def _rel(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "–"
    return f"{(value / base - 1) * 100:+.0f}%"


def plot(out_dir: Path, result: dict, meta: dict) -> Path:
    """online.png: acceptance, tokens per target forward and speedup over the stream (Figure 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(meta["held_out"])
    metrics = (("acceptance_rate", "acceptance rate"), ("tokens_per_target_forward", "tokens / target forward"),
               ("speedup_vs_target", "speedup vs target (median)"))
    fig, axes = plt.subplots(len(sets), 3, figsize=(13, 3.6 * len(sets)), squeeze=False)
    for row, set_name in enumerate(sets):
        base = _rows_at(result, 0, set_name).get("none", {})
        for col, (key, label) in enumerate(metrics):
            ax = axes[row][col]
            for mode in _modes(meta):
                xs, ys = [0], [base.get(key)]
                for p in result["checkpoints"]:
                    if p["set"] == set_name and mode in p["modes"]:
                        xs.append(p["prompts_streamed"])
                        ys.append(p["modes"][mode][key])
                ax.plot(xs, ys, marker="o", label=LOSS_LABEL[mode])
            ax.axhline(base.get(key) or 0, color="#999", ls="--", lw=0.8, label=LOSS_LABEL["none"])
            confident = _rows_at(result, 0, set_name).get("none+confidence")
            if confident:
                ax.axhline(confident[key], color="#555", ls=":", lw=1.0, label=LOSS_LABEL["none+confidence"])
            if meta.get("shift_at"):
                ax.axvline(meta["shift_at"], color="r", lw=0.8, ls=":", label="stream switches set")
            ax.set_xlabel("stream prompts seen")
            ax.set_title(f"{label} — held-out {set_name}", fontsize=9)
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "online.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_online(out_dir: Path, result: dict, meta: dict) -> list[Path]:
    from omnidraft.fsutil import atomic_write

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "results.json", json.dumps({"meta": meta, **result}, indent=1, default=str).encode())
    atomic_write(out_dir / "results.md", markdown(result, meta).encode())
    return [out_dir / "results.json", out_dir / "results.md", plot(out_dir, result, meta)]


def checkpoints_for(stream_n: int, count: int) -> list[int]:
    """``count`` evaluation points after 0, evenly spread, the last at the end of the stream."""
    return sorted({0, *(round(stream_n * (i + 1) / count) for i in range(count))})
