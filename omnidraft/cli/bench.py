"""``omnidraft bench``: speed and acceptance of every mode, side by side in one run.

The paper's ablations (n-gram cache, online distillation) are ``omnidraft experiment``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from omnidraft.cli.options import (
    COUNT,
    add_cache_options,
    add_decode_options,
    add_model_options,
    check_adaptable,
    decode_config,
    integer,
    remote_options,
    temperature,
)
from omnidraft.data import PROMPTS_HELP
from omnidraft.errors import OmnidraftError

DEFAULT_MODES = "target,hf-target,hf-uag,greedy,greedy-ngram,greedy-nocache,tli,omnidraft"
LLAMA_DEFAULT_MODES = "llamacpp,target@llamacpp,greedy@llamacpp,greedy-k4@llamacpp"
WARMUP_TEXT = "Hello, world. Write one short sentence."
# What the bench's modes pick themselves (each mode is a verification rule and a translation).
MODE_FIELDS = ("verify", "translate", "temperature", "use_ngram")


def add_prompt_options(parser: argparse.ArgumentParser, n: int = 10) -> None:
    """Which prompts (bench and the experiments)."""
    g = parser.add_argument_group("prompts")
    g.add_argument("--prompts", default="humaneval", help=PROMPTS_HELP)
    g.add_argument("--n", type=COUNT, default=n, help=f"number of prompts (default {n})")
    g.add_argument("--offset", type=integer(0), default=0, help="skip this many prompts of the set")
    g.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder (results.json/md, charts)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark our modes against the target alone and transformers' assisted generation")
    add_prompt_options(p)
    p.add_argument("--modes", default=None,
                   help=f"comma-separated; default: {DEFAULT_MODES} on the torch engine, plus {LLAMA_DEFAULT_MODES} "
                        "when the target also runs on llama.cpp (--engine auto|llamacpp)")
    p.add_argument("--sample-temperature", type=temperature(zero=False), default=0.7,
                   help="temperature of the sampling modes (tli, omnidraft, text-sample, rdk, slrs, hf-uag-sample); the greedy modes "
                        "run at 0 (default 0.7)")
    add_model_options(p)
    add_decode_options(p, skip=MODE_FIELDS)
    cache = p.add_argument_group("n-gram cache of the modes that learn one (greedy, greedy-ngram, omnidraft)")
    cache.add_argument("--ngram-cache", choices=("fresh", "home"), default="fresh",
                       help="fresh (default): each mode starts empty and learns during the run; home: the pair's "
                            "persistent cache under the home, as generate uses it")
    add_cache_options(p)
    p.set_defaults(func=run)


def engines(args: argparse.Namespace) -> list[str]:
    """The engines a bench compares: torch always (the memory-bound case and transformers' modes),
    llama.cpp too for a GGUF target when it is installed (or asked for)."""
    from omnidraft.runtime import resolve_engine

    if args.target.startswith(("grpc://", "grpcs://")):
        return ["remote"]
    if args.engine == "torch":
        return ["torch"]
    return ["torch", "llamacpp"] if args.engine == "llamacpp" or resolve_engine(args.target, "auto") == "llamacpp" else ["torch"]


def parse_modes(args: argparse.Namespace) -> list[str]:
    from omnidraft.bench.runner import ALL_MODES, REMOTE_MODES, STREAM_MODES
    from omnidraft.runtime import onnx_export_for

    on = engines(args)
    default = "server-stream,stream,greedy" if on == ["remote"] else DEFAULT_MODES + ("," + LLAMA_DEFAULT_MODES if "llamacpp" in on else "")
    if on != ["remote"] and onnx_export_for(args.drafter, "auto") is not None:  # an export to draft from
        default += ",greedy-onnx" + (",greedy-onnx@llamacpp" if "llamacpp" in on else "")
    modes = [m.strip() for m in (args.modes or default).split(",") if m.strip()]
    if on == ["remote"] and not set(modes) <= set(REMOTE_MODES):
        raise OmnidraftError(f"against a remote target the bench runs {', '.join(REMOTE_MODES)} (verification runs "
                             "on the server: no transformers or llama.cpp modes here)")
    if on != ["remote"] and set(modes) & set(STREAM_MODES):
        raise OmnidraftError(f"the {' and '.join(STREAM_MODES)} modes need a target on a server (--target grpc://HOST:PORT)")
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise OmnidraftError(f"unknown --modes {unknown or '(empty)'}; choose from {', '.join(ALL_MODES)}")
    return on_engine(modes, args.engine) if args.modes else modes


def on_engine(modes: list[str], engine: str) -> list[str]:
    """An explicit ``--engine llamacpp`` applies to the modes that name no engine: ``greedy`` means
    ``greedy@llamacpp`` there. A mode that exists only on torch (transformers' modes, the sampling
    rules) is refused in one line rather than silently run on another engine."""
    from omnidraft.bench.runner import LLAMA_MODES

    if engine != "llamacpp":
        return modes
    moved = [m if m in LLAMA_MODES else f"{m}@llamacpp" for m in modes]
    torch_only = [m for m, n in zip(modes, moved) if n not in LLAMA_MODES]
    if torch_only:
        raise OmnidraftError(f"--engine llamacpp: {', '.join(torch_only)} run only on torch; "
                             f"on llama.cpp choose from {', '.join(LLAMA_MODES)} (or drop --engine)")
    return list(dict.fromkeys(moved))


def _validate(args: argparse.Namespace) -> list[str]:
    """The modes, and cache options that mean something together."""
    modes = parse_modes(args)
    if args.freeze_cache and args.ngram_cache != "home":
        raise OmnidraftError("--freeze-cache needs --ngram-cache home (a frozen fresh cache stays empty)")
    if args.cache_policy is not None and args.cache_size is None:
        raise OmnidraftError("--cache-policy only matters with --cache-size")
    if args.max_new_tokens < 2:
        raise OmnidraftError("--max-new-tokens must be at least 2 for a bench (one token leaves nothing to draft)")
    check_adaptable(args, training=False)
    return modes


def _ngram_factory(args: argparse.Namespace, pipe) -> Callable:
    """What each n-gram mode of a plain bench starts from (see --ngram-cache)."""
    from omnidraft.ngram.store import fresh_store
    from omnidraft.ngram.trie import NgramTrie
    from omnidraft.runtime import CacheOptions, open_ngram_cache
    from omnidraft.identity import pair_id

    drafter_tok, target_tok = pipe.decoder.bridge.drafter_tokenizer, pipe.target_tokenizer
    policy = args.cache_policy or "lru"
    if args.ngram_cache == "home":
        options = CacheOptions(max_entries=args.cache_size, policy=policy, frozen=args.freeze_cache)
        return lambda: open_ngram_cache(drafter_tok, target_tok, options)
    if args.cache_size is None:
        return NgramTrie  # in memory, as before: nothing to bound, nothing to keep
    pair, counter = pair_id(drafter_tok, target_tok), itertools.count(1)
    return lambda: fresh_store(args.out / "caches", f"fresh-{next(counter)}", pair, max_entries=args.cache_size, policy=policy)


def run_meta(args: argparse.Namespace, n: int) -> dict:
    """What every report of a run says about its set-up."""
    import torch

    from omnidraft.config import DEFAULT_DRAFTER_DTYPE
    from omnidraft.drafter.choice import cpu_model

    return {"host": cpu_model(), "drafter": args.drafter, "target": args.target, "prompts": args.prompts, "n": n,
            "offset": args.offset, "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            "draft_confidence": args.draft_confidence, "draft_stop": args.draft_stop, "stop_gamma": args.stop_gamma,
            "drafter_dtype": args.drafter_dtype or DEFAULT_DRAFTER_DTYPE,
            "drafter_backend": getattr(args, "drafter_backend", "auto"), "temperature_sampling_modes": getattr(args, "sample_temperature", None),
            "seed": args.seed, "threads": torch.get_num_threads(), "rtt_ms": getattr(args, "rtt_ms", 0.0)}


def load_for_bench(args: argparse.Namespace, adapter: str | None = None, modes: Sequence[str] = (),
                   measured_drafter: bool = False):
    """The pipeline, with its own n-gram cache in memory: the home's store is opened only when
    asked for (--ngram-cache home, once per mode), so a bench never writes the user's state.

    The target loads on torch unless every mode in ``modes`` runs on llama.cpp: then nothing is
    dequantized (a 1.5B GGUF would become 6 GB of fp32 weights that no mode uses).

    ``--drafter-backend auto`` with ``measured_drafter`` (the bench) runs the drafter where
    ``generate`` and ``chat`` run it, the backend measured fastest here, so a bench measures what a
    user gets; without it (the experiments, which study the trainer's own model) and with
    ``--drafter-dtype`` it stays on eager torch."""
    from omnidraft.bench.runner import LLAMA_MODES
    from omnidraft.runtime import CacheOptions, load_pipeline

    remote = args.target.startswith(("grpc://", "grpcs://"))
    llama_only = bool(modes) and all(m in LLAMA_MODES for m in modes)
    engine = "auto" if remote else ("llamacpp" if llama_only else "torch")
    return load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, drafter_dtype=args.drafter_dtype,
                         cache=CacheOptions(enabled=False), adapter=adapter or args.adapter,
                         engine=engine, remote=remote_options(args),
                         drafter_backend=_backend_for_bench(args, measured_drafter))


def _backend_for_bench(args: argparse.Namespace, measured_drafter: bool) -> str:
    if args.drafter_backend != "auto":
        return args.drafter_backend
    return "auto" if measured_drafter and args.drafter_dtype is None else "torch"


def assistant_model(args: argparse.Namespace, pipe, modes: Sequence[str]):
    """The drafter as a torch model, for transformers' assisted modes (None where no mode needs one).

    The pipeline's when its drafter runs on torch; else (a GGUF or ONNX backend holds no torch
    model) the drafter loaded for them with its base weights, in the torch dtype that stepped fastest
    when this home chose its backend, so transformers is compared at its best on this machine."""
    from omnidraft.bench.runner import ASSISTED_MODES

    if not any(m in ASSISTED_MODES for m in modes) or args.drafter == "none":
        return None
    if pipe.drafter_model is not None:
        return pipe.drafter_model
    from omnidraft import models
    from omnidraft.runtime import convert_drafter, kept_drafter_choice

    model, _ = models.load(args.drafter, dtype="float32", progress=False)
    return convert_drafter(model, args.drafter_dtype or fastest_torch_dtype(kept_drafter_choice(args.drafter)))


def fastest_torch_dtype(choice) -> str:
    """float32 or bfloat16, whichever the backend choice timed faster (float32 without a record:
    transformers' own default on a CPU)."""
    steps = {m.dtype: m.ms_per_token for m in (choice.measures if choice else ()) if m.backend == "torch"}
    return "bfloat16" if steps.get("bfloat16", math.inf) < steps.get("float32", math.inf) else "float32"


def onnx_backend(drafter_backend: str) -> str:
    """What the -onnx modes run: the export ``--drafter-backend`` names (a folder), else the home's
    ("onnx": a one-line error where there is none). A backend that is no export (torch, native,
    llamacpp) drafts the other modes and leaves the -onnx modes to the home's export."""
    from omnidraft.runtime import GGUF_BACKENDS

    return "onnx" if drafter_backend in ("auto", "torch", *GGUF_BACKENDS) else drafter_backend


def _onnx_drafter(args: argparse.Namespace, pipe):
    """The drafter from its ONNX export (``--drafter-backend`` names one; default: the home's)."""
    from omnidraft.drafter import Drafter
    from omnidraft.drafter.onnx_lm import OnnxDraftLM
    from omnidraft.runtime import onnx_export_for

    folder = onnx_export_for(args.drafter, onnx_backend(args.drafter_backend))
    return _with_pipeline_adapter(Drafter(OnnxDraftLM(folder), pipe.decoder.drafter.stop_ids), pipe)


def _gguf_drafter(args: argparse.Namespace, pipe):
    """The drafter's GGUF on llama.cpp, sharing the pipeline's stop tokens and adapter."""
    from omnidraft.drafter import Drafter
    from omnidraft.runtime import gguf_drafter

    lm, _ = gguf_drafter(args.drafter, quiet=True)
    return _with_pipeline_adapter(Drafter(lm, pipe.decoder.drafter.stop_ids), pipe)


def _with_pipeline_adapter(drafter, pipe):
    """``drafter`` with the adapter ``--adapter`` gave the pipeline's drafter (and its acceptance
    head), so every mode of one run drafts with the same trained weights, whatever runs them."""
    from omnidraft.adapter.slot import AdapterSlot

    slot = pipe.adapter_slot
    if slot is not None and slot.current is not None:
        AdapterSlot(drafter, slot.identity, slot.folder).use(slot.current)
    return drafter


def _llama_target(args: argparse.Namespace, pipe):
    """The same target on llama.cpp, sharing the torch pipeline's tokenizer (so its bridge too)."""
    from omnidraft import models
    from omnidraft.target.llamacpp import LlamaCppTarget

    if isinstance(pipe.decoder.target, LlamaCppTarget):  # loaded there already (only llama.cpp modes)
        return pipe.decoder.target
    gguf = models.gguf_of(args.target)
    if gguf is None:
        raise OmnidraftError(f"the @llamacpp modes need a GGUF target (builtin:NAME or a .gguf file), not {args.target}")
    return LlamaCppTarget(gguf, pipe.target_tokenizer)


def run(args: argparse.Namespace) -> int:
    from omnidraft.bench.conversations import expand_turns
    from omnidraft.bench.report import markdown_table, write_results
    from omnidraft.bench.runner import (
        BASE_MODES,
        LLAMA_MODES,
        GGUF_MODES,
        ONNX_MODES,
        without_adapter,
        weights_choice_slot,
        build_modes,
        policy_report,
        run_bench,
        summarize,
    )
    from omnidraft.data import load_prompts
    from omnidraft.runtime import encode_prompt

    modes = _validate(args)
    base = decode_config(args, verify="greedy", temperature=0.0)
    records = load_prompts(args.prompts, n=args.n, offset=args.offset)
    if not records:
        raise OmnidraftError(f"--prompts {args.prompts} has no prompts at offset {args.offset}")
    args.out.mkdir(parents=True, exist_ok=True)  # a file in the way fails now, not after the run
    pipe = load_for_bench(args, modes=modes, measured_drafter=True)
    prompts, turns = expand_turns(pipe.decoder.target, records, base)
    factory = _ngram_factory(args, pipe) if pipe.decoder.drafter is not None else None
    llama = _llama_target(args, pipe) if any(m in LLAMA_MODES for m in modes) else None
    onnx = _onnx_drafter(args, pipe) if any(m in ONNX_MODES for m in modes) else None
    gguf = _gguf_drafter(args, pipe) if any(m in GGUF_MODES for m in modes) else None
    try:
        plain = without_adapter(pipe.decoder.drafter) if any(m in BASE_MODES for m in modes) else None
    except ValueError as exc:
        raise OmnidraftError(str(exc)) from None
    fns = build_modes(pipe, modes, base, args.sample_temperature, llama=llama, onnx=onnx, gguf=gguf,
                      base_drafter=plain, assistant=assistant_model(args, pipe, modes),
                      choosing=lambda: weights_choice_slot(pipe.adapter_slot),
                      **({"ngrams_factory": factory} if factory else {}))
    warm = encode_prompt(pipe.target_tokenizer, WARMUP_TEXT, chat=False)
    runs = run_bench(fns, prompts, warmup=warm[:16])
    summary = summarize(runs, baseline="server-stream" if "server-stream" in runs else "target")
    meta = run_meta(args, len(prompts)) | {"ngram_cache": args.ngram_cache, "cache_size": args.cache_size,
                                           "cache_policy": args.cache_policy or "lru", "freeze_cache": args.freeze_cache,
                                           "engines": engines(args), "policy": policy_report(fns), "drafter_backend": pipe.drafter_backend,
                                           "adapter": pipe.adapter_slot.description if pipe.adapter_slot else "none"}
    if max(turns) > 1:  # a multi-turn set: which turn of its chat each prompt is
        meta["turns"] = turns
    files = write_results(args.out, meta, summary)
    sys.stdout.write(markdown_table(summary))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
