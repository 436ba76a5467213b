"""``omnidraft experiment cache|online``: the paper's ablations, reproduced on the real models.

``cache``: learn an n-gram cache over a stream of prompts, then compare no cache, ¼ and ½ of its
size under LRU and LFU, and the full cache on the held-out prompts that follow (Table 14, Figure 9).
``online``: distil the target into the drafter's LoRA adapter along a stream (per loss) and
evaluate the held-out prompts that follow at checkpoints (Table 1, Figures 2 and 5). The code is
``omnidraft/experiments/``; nothing on the decoding path imports it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from omnidraft.cli.bench import (
    WARMUP_TEXT,
    add_prompt_options,
    load_for_bench,
    run_meta,
)
from omnidraft.cli.options import (
    COUNT,
    add_decode_options,
    add_model_options,
    add_train_options,
    check_adaptable,
    decode_config,
    remote_options,
    temperature,
    train_config,
)
from omnidraft.errors import OmnidraftError

CACHE_STREAM_N = 60
ONLINE_STREAM_N = 200


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the papers' ablations and studies: the n-gram cache, online distillation, "
                                          "exact sampling rules, server capacity")
    kinds = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    cache = kinds.add_parser("cache", help="n-gram cache ablation: growth, LRU/LFU budgets (Table 14, Figure 9)")
    _common(cache, CACHE_STREAM_N)
    cache.add_argument("--verify", choices=("greedy", "omnidraft"), default=None,
                       help="greedy (default, lossless) or omnidraft sampling at --sample-temperature")
    cache.add_argument("--sample-temperature", type=temperature(zero=False), default=0.7,
                       help="temperature with --verify omnidraft (default 0.7)")
    cache.set_defaults(func=cmd_cache)
    online = kinds.add_parser("online", help="online distillation along a stream, evaluated at checkpoints (Table 1); "
                                             "it trains its own adapters in memory (--adapter is not used)")
    _common(online, ONLINE_STREAM_N)
    online.add_argument("--checkpoints", type=COUNT, default=4, help="evaluations along the stream after the untrained one")
    online.add_argument("--losses", default="dm,hybrid",
                        help="losses to compare: dm, hybrid, frozen (no distillation: the acceptance head alone)")
    online.add_argument("--head-draft-len", type=COUNT, default=None,
                        help="most tokens per draft when the acceptance head (or the confidence baseline it replaces) "
                             "stops drafts (default: --draft-len)")
    online.add_argument("--shift-to", default=None, help="the stream's second half comes from this set")
    online.add_argument("--records", type=Path, default=None,
                        help="cache of recorded target outputs, reused across runs (default OUT/records.pt)")
    add_train_options(online, skip=("loss",))
    online.set_defaults(func=cmd_online)
    sampling = kinds.add_parser("sampling", help="exact sampling rules: expected acceptance per proposal along "
                                                 "target-sampled text (RDK's τ), and SLRS's tree sizes")
    add_prompt_options(sampling, n=6)
    add_model_options(sampling)
    sampling.add_argument("--sample-temperature", type=temperature(zero=False), default=0.7,
                          help="temperature of the target's text and of every rule (default 0.7)")
    sampling.add_argument("--positions", type=COUNT, default=64, help="target-sampled tokens per prompt (default 64)")
    sampling.add_argument("--taus", default="0.25,0.5,1,2", help="RDK affinity temperatures to compare")
    sampling.set_defaults(func=cmd_sampling)
    capacity = kinds.add_parser("capacity", help="N devices drafting against one `omnidraft serve`: aggregate tokens/s "
                                                 "with and without drafting (--target grpc://HOST:PORT)")
    add_prompt_options(capacity, n=2)
    capacity.add_argument("--clients", default="1,2,4,8", help="client counts to run (default 1,2,4,8)")
    capacity.add_argument("--drafting", choices=("both", "off", "on"), default="both",
                          help="runs without drafting (the thin client), with it, or both (default)")
    add_model_options(capacity)
    add_decode_options(capacity, skip=("verify", "translate", "temperature", "use_ngram"))
    capacity.set_defaults(func=cmd_capacity)


def _common(p: argparse.ArgumentParser, stream_n: int) -> None:
    add_prompt_options(p, n=8)
    p.add_argument("--stream-n", type=COUNT, default=stream_n, help=f"prompts in the learning stream, from --offset "
                                                                     f"(default {stream_n}); the held-out --n follow it")
    add_model_options(p)
    add_decode_options(p, skip=("verify", "translate", "temperature", "use_ngram"))


def _stream_and_heldout(args: argparse.Namespace):
    """The stream slice and the disjoint held-out slice right after it, both complete."""
    from omnidraft.data import load_prompts

    stream = load_prompts(args.prompts, n=args.stream_n, offset=args.offset)
    heldout = load_prompts(args.prompts, n=args.n, offset=args.offset + args.stream_n)
    if len(stream) < args.stream_n or len(heldout) < args.n:
        have = args.offset + len(stream) + len(heldout)
        raise OmnidraftError(f"--prompts {args.prompts} has {have} prompts from the start up to what was asked, fewer than "
                             f"--offset + --stream-n + --n = {args.offset + args.stream_n + args.n}")
    return stream, heldout


def cmd_cache(args: argparse.Namespace) -> int:
    """``experiment cache``: stream, capped streams, held-out evaluation (experiments/cache_ablation.py)."""
    from omnidraft.experiments.cache_ablation import (
        run_cache_ablation,
        speculative_config,
    )
    from omnidraft.experiments.cache_report import ablation_table, write_ablation
    from omnidraft.runtime import encode_prompt

    if args.drafter == "none":
        raise OmnidraftError("experiment cache needs a drafter (not --drafter none)")
    verify = args.verify or "greedy"
    config = speculative_config(decode_config(args, verify="greedy", temperature=0.0), verify, args.sample_temperature)
    stream_records, heldout_records = _stream_and_heldout(args)
    args.out.mkdir(parents=True, exist_ok=True)
    pipe = load_for_bench(args)
    stream = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in stream_records]
    heldout = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in heldout_records]
    warm = encode_prompt(pipe.target_tokenizer, WARMUP_TEXT, chat=False)
    result = run_cache_ablation(pipe, stream, heldout, config, args.out / "caches", warmup=warm[:16])
    meta = run_meta(args, len(heldout)) | {"ablation": "cache", "stream_n": args.stream_n, "stream_offset": args.offset,
                                           "heldout_offset": args.offset + args.stream_n, "verify": verify,
                                           "temperature": config.temperature}
    files = write_ablation(args.out, meta, result)
    sys.stdout.write(ablation_table(result.summary))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def _slices(args: argparse.Namespace, stream_n: int):
    """(stream records, their set names, held-out records by set) as PromptRecords."""
    from omnidraft.data import load_prompts

    if args.shift_to is None:
        stream = load_prompts(args.prompts, n=stream_n, offset=args.offset)
        held = {args.prompts: load_prompts(args.prompts, n=args.n, offset=args.offset + stream_n)}
        sets = [args.prompts] * len(stream)
    else:
        half = stream_n // 2
        first = load_prompts(args.prompts, n=half, offset=args.offset)
        second = load_prompts(args.shift_to, n=stream_n - half, offset=0)
        stream, sets = first + second, [args.prompts] * len(first) + [args.shift_to] * len(second)
        held = {args.prompts: load_prompts(args.prompts, n=args.n, offset=args.offset + half),
                args.shift_to: load_prompts(args.shift_to, n=args.n, offset=stream_n - half)}
    if len(stream) < stream_n or any(len(v) < args.n for v in held.values()):
        raise OmnidraftError(f"not enough prompts for a stream of {stream_n} and {args.n} held-out "
                             f"(sets: {', '.join(held)}); lower --stream-n / --n or --offset")
    return stream, sets, held


def cmd_online(args: argparse.Namespace) -> int:
    """``experiment online``: train along a stream per loss, evaluate held-out prompts at checkpoints."""
    from omnidraft.experiments.online import (
        LOSSES,
        OnlinePlan,
        RecordCache,
        checkpoints_for,
        modes_of,
        records_meta,
        run_online,
        write_online,
    )
    from omnidraft.runtime import encode_prompt

    stream_n = args.stream_n
    losses = [x.strip() for x in args.losses.split(",") if x.strip()]
    if not losses or any(x not in LOSSES for x in losses):
        raise OmnidraftError(f"--losses takes a comma-separated list of {', '.join(LOSSES)}")
    if args.checkpoints < 1 or args.checkpoints > stream_n:
        raise OmnidraftError("--checkpoints must be between 1 and --stream-n")
    if args.drafter == "none":
        raise OmnidraftError("experiment online trains the drafter: it needs one (not --drafter none)")
    check_adaptable(args, training=True)
    train = train_config(args)
    stream, sets, held = _slices(args, stream_n)
    decode = decode_config(args, verify="greedy", temperature=0.0, lookup=False)  # the drafter alone is measured
    pipe = load_for_bench(args, adapter="none")
    encode = lambda recs: [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in recs]
    plan = OnlinePlan(stream=encode(stream), held_out={k: encode(v) for k, v in held.items()},
                      checkpoints=checkpoints_for(stream_n, args.checkpoints), interval=args.interval,
                      losses=losses, stream_sets=sets)
    records = RecordCache(args.records or args.out / "records.pt", records_meta(pipe, args.max_new_tokens, args.top_k))
    result = run_online(pipe, plan, decode, train, records, head_k=args.head_draft_len)
    meta = run_meta(args, args.n) | {
        "stream": args.prompts + (f" → {args.shift_to}" if args.shift_to else ""), "stream_n": stream_n,
        "held_out": {k: len(v) for k, v in held.items()}, "interval": args.interval, "checkpoints": plan.checkpoints,
        "losses": losses, "modes": modes_of(losses, train.head), "head_draft_len": args.head_draft_len,
        "train": asdict(train), "top_k": args.top_k, "shift_at": stream_n // 2 if args.shift_to else None}
    files = write_online(args.out, result, meta)
    sys.stdout.write((args.out / "results.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def cmd_sampling(args: argparse.Namespace) -> int:
    """``experiment sampling``: see omnidraft/experiments/sampling.py."""
    from omnidraft.data import load_prompts
    from omnidraft.experiments.sampling import expected_acceptance, markdown, slrs_cost
    from omnidraft.fsutil import atomic_write
    from omnidraft.runtime import encode_prompt

    try:
        taus = [float(x) for x in args.taus.split(",") if x.strip()]
    except ValueError:
        taus = []
    if not taus or any(not 0 < t < 100 for t in taus):
        raise OmnidraftError("--taus takes a comma-separated list of temperatures in (0, 100)")
    if args.drafter == "none":
        raise OmnidraftError("experiment sampling needs a drafter (not --drafter none)")
    records = load_prompts(args.prompts, n=args.n, offset=args.offset)
    args.out.mkdir(parents=True, exist_ok=True)
    pipe = load_for_bench(args)
    prompts = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in records]
    acceptance = expected_acceptance(pipe, prompts, args.sample_temperature, args.positions, taus, seed=0)
    cost = slrs_cost(pipe.decoder.bridge)
    meta = (f"drafter `{args.drafter}` → target `{args.target}`, prompts `{args.prompts}` × {len(prompts)}, "
            f"{args.positions} target-sampled tokens each at T = {args.sample_temperature:g}")
    text = markdown(acceptance, cost, meta)
    atomic_write(args.out / "sampling.md", text)
    sys.stdout.write(text)
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    """``experiment capacity``: see omnidraft/experiments/capacity.py."""
    from omnidraft.data import load_prompts
    from omnidraft.experiments.capacity import markdown, run_capacity
    from omnidraft.fsutil import atomic_write
    from omnidraft.rpc.client import RemoteTarget, is_remote
    from omnidraft.runtime import encode_prompt

    if not is_remote(args.target):
        raise OmnidraftError("experiment capacity measures a server: give --target grpc://HOST:PORT")
    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        clients = []
    if not clients or min(clients) < 1 or max(clients) > 64:
        raise OmnidraftError("--clients takes a comma-separated list of counts in 1..64")
    records = load_prompts(args.prompts, n=args.n, offset=args.offset)
    args.out.mkdir(parents=True, exist_ok=True)
    pipe = load_for_bench(args)
    options = remote_options(args)

    def connect():
        return RemoteTarget(args.target, token=options.token, deadline_s=options.deadline_s, rtt_ms=options.rtt_ms)

    prompts = [encode_prompt(pipe.target_tokenizer, r.text, chat=r.chat) for r in records]
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.drafting]
    rows = run_capacity(pipe, connect, prompts, clients, decode_config(args, verify="greedy", temperature=0.0), modes)
    probe = connect()
    info = probe.server_info()
    probe.close()
    meta = (f"drafter `{args.drafter}` → target `{args.target}` ({pipe.decoder.target.engine} on the server, "
            f"{'batching ' + str(info.batch_sessions) + ' sessions per forward' if info.batch_sessions > 1 else 'one session per forward'}), "
            f"prompts `{args.prompts}` × {len(prompts)} per client, {args.max_new_tokens} new tokens, greedy, "
            f"injected round trip {args.rtt_ms:g} ms")
    text = markdown(rows, meta)
    atomic_write(args.out / "capacity.md", text)
    sys.stdout.write(text)
    return 0
