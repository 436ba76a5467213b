"""``omnidraft generate``: one prompt through cross-vocabulary speculative decoding."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omnidraft.cli.options import (
    add_cache_options,
    add_decode_options,
    add_model_options,
    cache_options,
    check_adaptable,
    decode_config,
    remote_options,
    text,
)
from omnidraft.errors import OmnidraftError

if TYPE_CHECKING:  # the runtime imports torch: loaded when a command runs, not at --help
    from omnidraft.config import DecodeConfig
    from omnidraft.runtime import Pipeline


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=text, help="prompt text, used as is unless --chat")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    add_model_options(p)
    add_decode_options(p)
    add_cache_options(p)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn with the target's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.set_defaults(func=run)


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt, from --prompt or --prompt-file; empty or unreadable is one line."""
    if args.prompt is not None:
        value = args.prompt
    else:
        try:
            value = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = "it is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else (exc.strerror or str(exc))
            raise OmnidraftError(f"cannot read --prompt-file {args.prompt_file}: {reason}") from None
    if not value.strip():
        raise OmnidraftError("the prompt is empty")
    return value


def run(args: argparse.Namespace) -> int:
    from omnidraft.runtime import load_pipeline

    config = decode_config(args)
    check_adaptable(args, training=False)
    prompt = prompt_text(args)
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, drafter_dtype=args.drafter_dtype,
                         cache=cache_options(args), quiet=args.json, adapter=args.adapter, engine=args.engine,
                         remote=remote_options(args), drafter_backend=args.drafter_backend)
    try:
        return _generate(args, pipe, prompt, config)
    finally:
        pipe.close()  # now, not at exit: the cache's last batch and its -wal file are settled when run returns


def _generate(args: argparse.Namespace, pipe: Pipeline, prompt: str, config: DecodeConfig) -> int:
    """Decode one prompt: the JSON result, or the text streamed with a one-line summary on stderr."""
    from omnidraft.runtime import encode_prompt

    prompt_ids = encode_prompt(pipe.target_tokenizer, prompt, chat=args.chat)
    decoder = pipe.decoder
    decoder.check_length(len(prompt_ids), config.max_new_tokens)  # before any forward pass
    if args.json:
        result = decoder.generate(prompt_ids, config)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.as_dict()}))
        return 0
    for piece in decoder.stream(prompt_ids, config):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = decoder.stats
    measured = f", measured this machine's costs once ({s.measure_s:.1f} s, not in tok/s)" if s.measure_s else ""
    print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, accept {s.acceptance_rate:.2f}, "
          f"{s.tokens_per_target_forward:.2f} tok/target forward{measured}]", file=sys.stderr)
    return 0
