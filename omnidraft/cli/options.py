"""Every command-line option, defined once, with one default (the config dataclass's) and one check.

Subcommands compose the groups they need: models, decoding, n-gram cache, training. Values are
checked by their argparse type as they are parsed (NaN, inf, out-of-range numbers, text that is not
UTF-8), so a bad value is one line and exit status 2 before anything loads. Nothing here imports
torch: ``omnidraft --help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from omnidraft.config import (
    DEFAULT_DRAFTER_DTYPE,
    DEVICES,
    DRAFT_STOPS,
    DRAFTER_DTYPES,
    ENGINES,
    INT8_NO_ADAPTER,
    MAX_BRANCH_ROWS,
    TRANSLATIONS,
    DecodeConfig,
    default_rule,
)
from omnidraft.errors import OmnidraftError
from omnidraft.train.config import DIVERGENCES, LOSS_KINDS, NGRAM_WEIGHTS, TrainConfig
from omnidraft.verify import MIN_TEMPERATURE, RULES, help_text

DEFAULT_DRAFTER = "builtin:smollm2-135m"
DEFAULT_TARGET = "builtin:qwen2.5-coder-0.5b"
CACHE_POLICIES = ("lru", "lfu")


class CliParser(argparse.ArgumentParser):
    """argparse with the project's error convention: one line on stderr, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"omnidraft: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


# ---------------------------------------------------------------- checked value types


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range ({_range(low, high)})")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], float]:
    """A finite float in a range; NaN and inf are refused (they pass plain `<` checks)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
            hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
            raise argparse.ArgumentTypeError(f"{value:g} is out of range (must be {' and '.join(x for x in (lo, hi) if x)})")
        return value

    parse.__name__ = "number"
    return parse


def temperature(high: float | None = None, *, zero: bool = True) -> Callable[[str], float]:
    """A sampling temperature: 0 (greedy, when ``zero``) or at least ``MIN_TEMPERATURE``.

    Below it there is nothing left to sample: logits divided by a subnormal temperature overflow,
    and a temperature that small is greedy decoding in all but name. So it is refused in one line
    (with what to give instead) rather than turned into garbage or silently into greedy."""
    check = number(0, high, low_open=not zero)

    def parse(text: str) -> float:
        value = check(text)
        if 0 < value < MIN_TEMPERATURE:
            instead = "0 for greedy decoding" if zero else f"at least {MIN_TEMPERATURE:g}"
            raise argparse.ArgumentTypeError(f"{value:g} is too small a temperature to sample with "
                                             f"(below {MIN_TEMPERATURE:g}); give {instead}")
        return value

    parse.__name__ = "number"
    return parse


def _range(low: int | None, high: int | None) -> str:
    if high is None:
        return f"must be at least {low}"
    return f"must be at most {high}" if low is None else f"must be {low}..{high}"


def text(value: str) -> str:
    """Text that really is text: bytes that are not UTF-8 arrive as lone surrogates from argv."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    return value


SEED = integer(0, 2**63 - 1)
COUNT = integer(1)


# ---------------------------------------------------------------- models


def add_model_options(parser: argparse.ArgumentParser, *, target: bool = True, drafter: bool = True) -> None:
    g = parser.add_argument_group("models")
    if drafter:
        g.add_argument("--drafter", type=text, default=DEFAULT_DRAFTER, help="drafter spec, or 'none' for the target alone")
    if target:
        g.add_argument("--target", type=text, default=DEFAULT_TARGET,
                       help="target spec: builtin:NAME, a model folder, or a hub id")
        g.add_argument("--engine", choices=ENGINES, default="auto",
                       help="what runs the target: llamacpp (GGUF models, the builtins; fast on CPU), torch (any "
                            "transformers model; memory-bound, where drafting pays most); auto: llamacpp for GGUF "
                            "targets when llama-cpp-python is installed")
        g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                       help="target precision on the torch engine (default: float32 on the CPU, bfloat16 on a GPU; "
                            "bfloat16 implies --engine torch under auto)")
        g.add_argument("--device", choices=DEVICES, default="auto",
                       help="where the torch engine runs the target: cuda (bfloat16, a static KV cache and CUDA "
                            "graphs), cpu, or auto: the GPU when torch sees one")
        r = parser.add_argument_group("remote target (--target grpc://HOST:PORT or grpcs://HOST:PORT)")
        r.add_argument("--token-file", default=None, help="file holding the server's token (default: $OMNIDRAFT_TOKEN)")
        r.add_argument("--deadline", type=number(0, 3600, low_open=True), default=30.0,
                       help="seconds each call to the server may take (default 30)")
        r.add_argument("--rtt-ms", type=number(0, 10_000), default=0.0,
                       help="add this many ms of round trip to every call, half to each message of a stream "
                            "(to measure what a network costs)")
        r.add_argument("--remote-protocol", choices=("stream", "verify"), default="stream",
                       help="stream (default): the server decodes each request in one stream and verifies the "
                            "drafts the device streams up meanwhile, waiting for one only where that pays; verify: "
                            "one round trip per draft")
    if drafter:
        g.add_argument("--drafter-backend", type=text, default="auto",
                       help="what runs the drafter: torch, onnx (the export `omnidraft export` wrote under the home), "
                            "an export folder, llamacpp (its GGUF on llama.cpp; adapters as GGUF LoRA), native (its GGUF on "
                            "omnidraft's own one-call forward, built by set-up on AVX2 CPUs), or auto: "
                            "the fastest of these this machine has that agrees with the fp32 drafter, measured "
                            "once per home and CPU (`omnidraft models backends` shows it)")
        g.add_argument("--drafter-dtype", choices=DRAFTER_DTYPES, default=None,
                       help="drafter precision on torch (speed only: the target verifies every token; int8 takes no "
                            "adapter); giving it skips auto's measurement. Default: auto's choice, or "
                            f"{DEFAULT_DRAFTER_DTYPE} under --drafter-backend torch")
        g.add_argument("--adapter", type=text, default="auto",
                       help="drafter LoRA adapter: auto (the pair's, if trained), none, or an adapter folder")


# ---------------------------------------------------------------- decoding


_DECODE_FLAGS: dict[str, tuple[Callable[[str], Any] | None, str]] = {
    "max_new_tokens": (COUNT, "most new tokens"),
    "temperature": (temperature(), "sampling temperature (0: greedy; else at least 1e-4)"),
    "top_p": (number(0, 1, low_open=True), "nucleus sampling mass, applied to target and drafter alike"),
    "verify": (None, "verification rule; default greedy at temperature 0, else text-sample (the fastest exact rule)"),
    "draft_len": (COUNT, "most drafter tokens per step (k)"),
    "draft_stop": (None, "when a draft ends: head (the adapter's acceptance head), confidence, fixed (always k); "
                         "auto: the cost-aware policy (drafts only while one more token is expected to raise "
                         "tokens per second, from measured verify and draft costs)"),
    "draft_confidence": (number(0, 1, high_open=True), "confidence stop: end a draft after a token the drafter gives "
                                                       "less than this probability"),
    "stop_gamma": (number(0, 1, low_open=True, high_open=True), "head stop: end a draft once P(some drafted token is "
                                                                "rejected) > γ (eq. 7)"),
    "translate": (None, "drafter -> target translation: text (re-tokenize; greedy), tokens (direct mapping + n-grams); "
                        "auto: the rule's first choice"),
    "seed": (SEED, "random seed of the sampling rules"),
    "slrs_lookahead": (integer(1, 8), "slrs: drafter tokens per drafted string (Algorithm 3's lookahead); above 1 each "
                                      "verified token walks a tree of drafter spellings, refused where it blows up"),
    "branch_rows": (integer(-1, MAX_BRANCH_ROWS), "rows of the drafter's runner-up tokens verified beside its draft in the "
                                                  "same forward (greedy, torch targets): -1 as many as the cost policy "
                                                  "expects to pay, 0 none; on a streamed server target, N > 0 has the "
                                                  "device fork its draft at the runner-ups (off by default)"),
}
_DECODE_CHOICES = {"verify": tuple(RULES), "draft_stop": DRAFT_STOPS, "translate": TRANSLATIONS}


def add_decode_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The decoding options, from :class:`DecodeConfig`'s fields and defaults."""
    g = parser.add_argument_group("decoding")
    defaults = {f.name: f.default for f in fields(DecodeConfig)}
    for name, (kind, help_) in _DECODE_FLAGS.items():
        if name in skip:
            continue
        default = defaults[name]
        extra = f" (default {default})" if default is not None else ""
        if name == "verify":
            help_ = f"{help_}. {help_text()}"
        g.add_argument(f"--{name.replace('_', '-')}", type=kind, choices=_DECODE_CHOICES.get(name), default=default,
                       help=help_ + extra)
    if "use_ngram" not in skip:
        g.add_argument("--no-ngram", dest="use_ngram", action="store_false", help="do not use or learn the n-gram cache")
    if "lookup" not in skip:
        g.add_argument("--no-lookup", dest="lookup", action="store_false",
                       help="do not draft by prompt lookup (copying what followed the last words earlier in the text)")


def decode_config(args: argparse.Namespace, **override: Any) -> DecodeConfig:
    """The :class:`DecodeConfig` the parsed options describe (every field checked)."""
    values = {f.name: getattr(args, f.name) for f in fields(DecodeConfig) if hasattr(args, f.name)}
    values.update(override)
    if values.get("verify") is None:
        values["verify"] = default_rule(values.get("temperature", 0.0))
    config = DecodeConfig(**values)
    config.validate()
    return config


# ---------------------------------------------------------------- n-gram cache


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("n-gram cache")
    g.add_argument("--cache-size", type=COUNT, default=None, help="cap on n-gram cache entries (default: no cap)")
    g.add_argument("--cache-policy", choices=CACHE_POLICIES, default=None, help="eviction when capped (default lru)")
    g.add_argument("--freeze-cache", action="store_true", help="use the n-gram cache read-only (evaluation)")


def cache_options(args: argparse.Namespace):
    from omnidraft.runtime import CacheOptions

    if args.cache_policy is not None and args.cache_size is None:
        raise OmnidraftError("--cache-policy only matters with --cache-size")
    return CacheOptions(enabled=getattr(args, "use_ngram", True), max_entries=args.cache_size,
                        policy=args.cache_policy or "lru", frozen=args.freeze_cache)


# ---------------------------------------------------------------- training


_TRAIN_FLAGS: dict[str, tuple[Callable[[str], Any] | None, str]] = {
    "interval": (COUNT, "prompts per update, I (Algorithm 2)"),
    "top_k": (integer(1, 4096), "target log-probs kept per emitted position"),
    "loss": (None, "dm: L_DM only; hybrid: L_DM + λ·L_N-gram (eq. 3)"),
    "ngram_weight": (None, "weight of the n-gram NLL: const (λ) or target-prob (the verified p(t))"),
    "lam": (number(0), "λ for --ngram-weight const"),
    "span_weight": (number(0), "NLL weight on drafter tokens that straddle a target-token boundary (0: eq. (4) as written)"),
    "lr": (number(0, 1, low_open=True), "AdamW learning rate, constant"),
    "weight_decay": (number(0, 1), "AdamW weight decay"),
    "batch_size": (integer(1, 4096), "prompts per optimizer step"),
    "epochs": (integer(1, 100), "passes over the buffer per update (Algorithm 2 makes one)"),
    "divergence": (None, "at DM positions: reverse-kl (eq. 4), forward-kl, or tvd"),
    "target_temperature": (temperature(100, zero=False), "distil towards the target's distribution at this temperature"),
    "rank": (integer(1, 1024), "LoRA rank"),
    "alpha": (number(0, low_open=True), "LoRA alpha; scaling = alpha/rank"),
    "head": (None, "train the acceptance head beside the adapter (§3.3, Algorithm 3)"),
    "head_lr": (number(0, 1, low_open=True), "acceptance head learning rate"),
    "head_epochs": (integer(1, 100), "passes of the head over each update's positions"),
    "head_reject_weight": (number(0, low_open=True), "BCE weight of rejected tokens (1: calibrated probabilities)"),
    "head_replay": (integer(0), "the head also re-fits on this many earlier prompts (Algorithm 4's buffer R; 0: Algorithm 3)"),
}
_TRAIN_CHOICES = {"loss": LOSS_KINDS, "ngram_weight": NGRAM_WEIGHTS, "divergence": DIVERGENCES}
_TRAIN_NAMES = {"lam": "--lambda"}


def add_train_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The trainer's options, from :class:`TrainConfig` (defaults: OmniDraft Appendix A.2)."""
    g = parser.add_argument_group("training")
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for name, (kind, help_) in _TRAIN_FLAGS.items():
        if name in skip:
            continue
        flag = _TRAIN_NAMES.get(name, f"--{name.replace('_', '-')}")
        if name == "head":
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=defaults[name], help=help_)
            continue
        g.add_argument(flag, dest=name, type=kind, choices=_TRAIN_CHOICES.get(name), default=defaults[name],
                       help=f"{help_} (default {defaults[name]:g})" if isinstance(defaults[name], float)
                       else f"{help_} (default {defaults[name]})")


def train_config(args: argparse.Namespace, **override: Any) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    values.update(override)
    config = TrainConfig(**values)
    try:
        config.validate()
    except ValueError as exc:
        raise OmnidraftError(str(exc)) from None
    return config


def check_adaptable(args: argparse.Namespace, training: bool) -> None:
    """The one place the CLI refuses an adapter for an int8 drafter (LoRA needs float weights)."""
    explicit = getattr(args, "adapter", "auto") not in ("auto", "none")
    if getattr(args, "drafter_dtype", None) == "int8" and (training or explicit):
        raise OmnidraftError(INT8_NO_ADAPTER + (", or --no-train" if training else ""))


def remote_options(args: argparse.Namespace):
    """How to reach a ``grpc://`` target: the token from --token-file or $OMNIDRAFT_TOKEN."""
    from omnidraft.rpc import read_token
    from omnidraft.runtime import RemoteOptions

    token = read_token(getattr(args, "token_file", None)) if str(getattr(args, "target", "")).startswith("grpc") else None
    return RemoteOptions(token=token, deadline_s=getattr(args, "deadline", 30.0), rtt_ms=getattr(args, "rtt_ms", 0.0),
                         protocol=getattr(args, "remote_protocol", "stream"))
