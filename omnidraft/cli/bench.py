"""``omnidraft bench``: speed and acceptance of every mode, side by side in one run; with
``--ablation cache``, the n-gram cache ablation (OmniDraft Table 14 and Figure 9)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

from omnidraft.cli.adapt import add_train_args
from omnidraft.cli.bench_online import DEFAULT_STREAM_N as ONLINE_STREAM_N
from omnidraft.cli.bench_online import add_online_args, run_online_ablation
from omnidraft.cli.generate import (
    add_adapter_arg,
    add_cache_args,
    add_draft_stop_args,
    draft_stop_options,
)
from omnidraft.config import DEFAULT_DRAFTER_DTYPE, DecodeConfig
from omnidraft.errors import OmnidraftError

DEFAULT_MODES = "target,hf-target,hf-uag,greedy,greedy-ngram,greedy-nocache,tli,omnidraft"
DEFAULT_STREAM_N = 60
WARMUP_TEXT = "Hello, world. Write one short sentence."


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark our modes against the target alone and transformers' assisted generation")
    p.add_argument("--drafter", default="builtin:smollm2-135m")
    p.add_argument("--target", default="builtin:qwen2.5-coder-0.5b")
    p.add_argument("--prompts", default="humaneval", help="humaneval | alpaca | xsum | asdiv | path/to/file.jsonl")
    p.add_argument("--n", type=int, default=10, help="number of prompts (with --ablation: of the held-out slice)")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of the set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default=None, help=f"comma-separated (default {DEFAULT_MODES})")
    p.add_argument("--draft-len", type=int, default=DecodeConfig.draft_len)
    add_draft_stop_args(p)
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the modes tli and omnidraft (and of --ablation cache --verify omnidraft)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter-dtype", default=DEFAULT_DRAFTER_DTYPE, choices=("float32", "bfloat16", "int8"),
                   help="drafter precision (the target stays float32; hf-uag uses the same drafter)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    cache = p.add_argument_group("n-gram cache of the modes that learn one (greedy, greedy-ngram, omnidraft)")
    cache.add_argument("--ngram-cache", choices=("fresh", "home"), default="fresh",
                       help="fresh (default): each mode starts empty and learns during the run; home: the pair's "
                            "persistent cache under the home, as generate uses it")
    add_cache_args(cache)
    ablation = p.add_argument_group("ablation")
    ablation.add_argument("--ablation", choices=("cache", "online"), default=None,
                          help="cache: learn a cache over a stream of prompts, then compare no cache, 1/4 and 1/2 of its "
                               "size under LRU and LFU, and the full cache on the held-out --n prompts that follow; "
                               "online: distil the target into the drafter's LoRA adapter over a stream (per loss) and "
                               "evaluate the held-out --n prompts that follow at checkpoints")
    ablation.add_argument("--stream-n", type=int, default=None,
                          help=f"prompts in the learning stream, from --offset (default {DEFAULT_STREAM_N} for cache, "
                               f"{ONLINE_STREAM_N} for online)")
    ablation.add_argument("--verify", choices=("greedy", "omnidraft"), default=None,
                          help="(--ablation cache) greedy (default, lossless) or omnidraft sampling at --temperature")
    add_online_args(ablation)
    add_train_args(p, loss=False)
    add_adapter_arg(p)
    p.set_defaults(func=run)


def _validate_common(args: argparse.Namespace) -> None:
    if args.n < 1 or args.max_new_tokens < 2 or args.draft_len < 1 or args.offset < 0:
        raise OmnidraftError("--n and --draft-len must be >= 1, --max-new-tokens >= 2, --offset >= 0")
    if args.cache_size is not None and args.cache_size < 1:
        raise OmnidraftError("--cache-size must be at least 1 (leave it out for no cap)")


def _validate(args: argparse.Namespace) -> list[str]:
    """Plain bench: the modes, and cache options that mean something together."""
    from omnidraft.bench.runner import ALL_MODES

    _validate_common(args)
    for flag, value in (("--stream-n", args.stream_n), ("--verify", args.verify), ("--shift-to", args.shift_to),
                        ("--records", args.records)):
        if value is not None:
            raise OmnidraftError(f"{flag} belongs to --ablation (plain bench picks verifiers with --modes)")
    modes = [m.strip() for m in (args.modes or DEFAULT_MODES).split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise OmnidraftError(f"unknown --modes {unknown or '(empty)'}; choose from {', '.join(ALL_MODES)}")
    if args.freeze_cache and args.ngram_cache != "home":
        raise OmnidraftError("--freeze-cache needs --ngram-cache home (a frozen fresh cache stays empty)")
    if args.cache_policy is not None and args.cache_size is None:
        raise OmnidraftError("--cache-policy only matters with --cache-size")
    return modes


def _validate_ablation(args: argparse.Namespace) -> int:
    """--ablation cache|online: returns the stream length. The ablation sets every cache itself."""
    _validate_common(args)
    default = DEFAULT_STREAM_N if args.ablation == "cache" else ONLINE_STREAM_N
    stream_n = default if args.stream_n is None else args.stream_n
    if stream_n < 1:
        raise OmnidraftError("--stream-n must be at least 1")
    given = [flag for flag, on in (("--modes", args.modes is not None), ("--cache-size", args.cache_size is not None),
                                   ("--cache-policy", args.cache_policy is not None), ("--freeze-cache", args.freeze_cache),
                                   ("--ngram-cache home", args.ngram_cache == "home")) if on]
    if given:
        raise OmnidraftError(f"--ablation {args.ablation} sets its own modes and caches; drop {', '.join(given)}")
    if args.drafter == "none":
        raise OmnidraftError(f"--ablation {args.ablation} needs a drafter (not --drafter none)")
    if args.ablation == "cache" and (args.shift_to or args.records):
        raise OmnidraftError("--shift-to and --records belong to --ablation online")
    return stream_n


def _ngram_factory(args: argparse.Namespace, pipe) -> Callable:
    """What each n-gram mode of a plain bench starts from (see --ngram-cache)."""
    from omnidraft.bench.cache_ablation import fresh_store
    from omnidraft.ngram.store import pair_id
    from omnidraft.ngram.trie import NgramTrie
    from omnidraft.runtime import CacheOptions, open_ngram_cache

    drafter_tok, target_tok = pipe.decoder.bridge.drafter_tokenizer, pipe.target_tokenizer
    policy = args.cache_policy or "lru"
    if args.ngram_cache == "home":
        options = CacheOptions(max_entries=args.cache_size, policy=policy, frozen=args.freeze_cache)
        return lambda: open_ngram_cache(drafter_tok, target_tok, options)
    if args.cache_size is None:
        return NgramTrie  # in memory, as before: nothing to bound, nothing to keep
    pair, counter = pair_id(drafter_tok, target_tok), itertools.count(1)
    return lambda: fresh_store(args.out / "caches", f"fresh-{next(counter)}", pair, max_entries=args.cache_size, policy=policy)


def _meta(args: argparse.Namespace, n: int) -> dict:
    import torch

    return {"drafter": args.drafter, "target": args.target, "prompts": args.prompts, "n": n,
            "offset": args.offset, "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            **draft_stop_options(args), "drafter_dtype": args.drafter_dtype,
            "temperature_sampling_modes": args.temperature, "seed": args.seed, "threads": torch.get_num_threads()}


def _base_config(args: argparse.Namespace) -> DecodeConfig:
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len, seed=args.seed,
                        **draft_stop_options(args))
    base.validate()
    return base


def _load(args: argparse.Namespace):
    """The pipeline, with its own n-gram cache in memory: the home's store is opened only when
    asked for (--ngram-cache home, once per mode), so a bench never writes the user's state."""
    from omnidraft.runtime import CacheOptions, load_pipeline

    return load_pipeline(args.target, args.drafter, drafter_dtype=args.drafter_dtype, cache=CacheOptions(enabled=False),
                         adapter=args.adapter)


def run(args: argparse.Namespace) -> int:
    if args.ablation == "cache":
        return run_cache_ablation(args)
    if args.ablation == "online":
        return run_online_ablation(args, _validate_ablation(args))
    from omnidraft.bench.report import markdown_table, write_results
    from omnidraft.bench.runner import build_modes, run_bench, summarize
    from omnidraft.data import load_prompts
    from omnidraft.runtime import encode_prompt

    modes = _validate(args)
    base = _base_config(args)
    records = load_prompts(args.prompts, n=args.n, offset=args.offset)
    if not records:
        raise OmnidraftError(f"--prompts {args.prompts} has no prompts at offset {args.offset}")
    pipe = _load(args)
    prompts = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in records]
    factory = _ngram_factory(args, pipe) if pipe.decoder.drafter is not None else None
    fns = build_modes(pipe, modes, base, args.temperature, **({"ngrams_factory": factory} if factory else {}))
    warm = encode_prompt(pipe.target_tokenizer, WARMUP_TEXT, chat=False)
    runs = run_bench(fns, prompts, warmup=warm[:16])
    summary = summarize(runs)
    meta = _meta(args, len(prompts)) | {"ngram_cache": args.ngram_cache, "cache_size": args.cache_size,
                                        "cache_policy": args.cache_policy or "lru", "freeze_cache": args.freeze_cache}
    files = write_results(args.out, meta, summary)
    sys.stdout.write(markdown_table(summary))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def _ablation_prompts(args: argparse.Namespace, stream_n: int):
    """The stream slice and the disjoint held-out slice right after it, both complete."""
    from omnidraft.data import load_prompts

    stream = load_prompts(args.prompts, n=stream_n, offset=args.offset)
    heldout = load_prompts(args.prompts, n=args.n, offset=args.offset + stream_n)
    if len(stream) < stream_n or len(heldout) < args.n:
        have = args.offset + len(stream) + len(heldout)
        raise OmnidraftError(f"--prompts {args.prompts} has {have} prompts from the start up to what was asked, fewer than "
                             f"--offset + --stream-n + --n = {args.offset + stream_n + args.n}")
    return stream, heldout


def run_cache_ablation(args: argparse.Namespace) -> int:
    """``--ablation cache``: stream, capped streams, held-out evaluation (bench/cache_ablation.py)."""
    from omnidraft.bench.cache_ablation import run_cache_ablation as ablate, speculative_config  # noqa: I001
    from omnidraft.bench.cache_report import ablation_table, write_ablation
    from omnidraft.runtime import encode_prompt

    stream_n = _validate_ablation(args)
    verify = args.verify or "greedy"
    config = speculative_config(_base_config(args), verify, args.temperature)
    stream_records, heldout_records = _ablation_prompts(args, stream_n)
    pipe = _load(args)
    stream = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in stream_records]
    heldout = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in heldout_records]
    warm = encode_prompt(pipe.target_tokenizer, WARMUP_TEXT, chat=False)
    result = ablate(pipe, stream, heldout, config, args.out / "caches", warmup=warm[:16])
    meta = _meta(args, len(heldout)) | {"ablation": "cache", "stream_n": stream_n, "stream_offset": args.offset,
                                        "heldout_offset": args.offset + stream_n, "verify": verify,
                                        "temperature": config.temperature}
    files = write_ablation(args.out, meta, result)
    sys.stdout.write(ablation_table(result.summary))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
