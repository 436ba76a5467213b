"""``omnidraft generate``: one prompt through cross-vocabulary speculative decoding."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omnidraft.config import (
    DEFAULT_DRAFTER_DTYPE,
    DRAFT_STOPS,
    TRANSLATIONS,
    VERIFIERS,
    DecodeConfig,
)
from omnidraft.errors import OmnidraftError


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by generate, chat and bench."""
    parser.add_argument("--drafter", default="builtin:smollm2-135m", help="drafter spec, or 'none' for the target alone")
    parser.add_argument("--target", default="builtin:qwen2.5-coder-0.5b", help="target spec: builtin:NAME, a folder, or a hub id")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--verify", choices=VERIFIERS, default=None, help="default: greedy at temperature 0, else omnidraft")
    parser.add_argument("--draft-len", type=int, default=DecodeConfig.draft_len, help="most drafter tokens per step (k)")
    add_draft_stop_args(parser)
    parser.add_argument("--translate", choices=TRANSLATIONS, default="auto",
                        help="drafter->target translation: text (re-tokenize, greedy), tokens (direct mapping + n-grams); auto: text for greedy")
    parser.add_argument("--drafter-dtype", choices=("float32", "bfloat16", "int8"), default=DEFAULT_DRAFTER_DTYPE,
                        help="drafter precision (speed only: the target verifies every token)")
    parser.add_argument("--no-ngram", action="store_true", help="do not use or learn the n-gram cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="target dtype: float32 (default) or bfloat16")
    add_adapter_arg(parser)
    add_cache_args(parser)


def add_draft_stop_args(parser: argparse.ArgumentParser) -> None:
    """How long each draft is (generate, chat, adapt, bench)."""
    d = DecodeConfig
    parser.add_argument("--draft-stop", choices=DRAFT_STOPS, default=d.draft_stop,
                        help="when to stop drafting: head (the adapter's learned acceptance head), confidence, "
                             "fixed (always --draft-len); auto: head when the adapter has one, else confidence")
    parser.add_argument("--draft-confidence", type=float, default=d.draft_confidence,
                        help=f"confidence stop: end a draft after a token the drafter gives less than this probability (default {d.draft_confidence})")
    parser.add_argument("--stop-gamma", type=float, default=d.stop_gamma,
                        help=f"head stop: end a draft once P(some drafted token is rejected) > γ (eq. 7; default {d.stop_gamma})")


def draft_stop_options(args: argparse.Namespace) -> dict:
    return {"draft_confidence": args.draft_confidence, "draft_stop": args.draft_stop, "stop_gamma": args.stop_gamma}


def add_adapter_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapter", default="auto",
                        help="drafter LoRA adapter: auto (the pair's, if trained), none, or an adapter folder")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """The persistent n-gram cache's options (generate, chat, bench). ``--cache-policy`` defaults
    to None (meaning lru) so a command can tell whether it was given."""
    parser.add_argument("--cache-size", type=int, default=None, help="cap on n-gram cache entries (default: no cap)")
    parser.add_argument("--cache-policy", choices=("lru", "lfu"), default=None, help="eviction policy when capped (default lru)")
    parser.add_argument("--freeze-cache", action="store_true", help="use the n-gram cache read-only (evaluation)")


def cache_options(args: argparse.Namespace):
    from omnidraft.runtime import CacheOptions

    if args.cache_size is not None and args.cache_size < 1:
        raise OmnidraftError("--cache-size must be at least 1 (leave it out for no cap)")
    return CacheOptions(enabled=not args.no_ngram, max_entries=args.cache_size,
                        policy=args.cache_policy or "lru", frozen=args.freeze_cache)


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    verify = args.verify or ("greedy" if args.temperature == 0 else "omnidraft")
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, verify=verify, draft_len=args.draft_len,
                          temperature=args.temperature, top_p=args.top_p, seed=args.seed, use_ngram=not args.no_ngram,
                          translate=args.translate, **draft_stop_options(args))
    config.validate()
    return config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, used as is unless --chat")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    add_decode_args(p)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn with the target's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(func=run)


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OmnidraftError(f"cannot read --prompt-file {args.prompt_file}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from omnidraft.runtime import encode_prompt, load_pipeline

    config = decode_config(args)
    text = _prompt_text(args)
    if not text:
        raise OmnidraftError("the prompt is empty")
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, drafter_dtype=args.drafter_dtype,
                         cache=cache_options(args), quiet=args.json, adapter=args.adapter)
    prompt_ids = encode_prompt(pipe.target_tokenizer, text, chat=args.chat)
    decoder = pipe.decoder
    if args.json:
        result = decoder.generate(prompt_ids, config)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.as_dict()}))
        return 0
    for piece in decoder.stream(prompt_ids, config):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = decoder.stats
    print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, accept {s.acceptance_rate:.2f}, "
          f"{s.tokens_per_target_forward:.2f} tok/target forward]", file=sys.stderr)
    return 0
