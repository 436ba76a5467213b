"""``omnidraft bench``: every mode on the same loaded weights and prompts, interleaved per prompt.

Modes run A B C, A B C, … per prompt after one warm-up of each, so a machine that drifts (other
jobs, thermal) hurts all modes alike. Speedups are per-prompt ratios of tokens/s against the
``target`` mode (our engine, target alone), summarised by median and mean; absolute times are
reported but only ratios are meant to be compared across machines.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from omnidraft.config import DecodeConfig
from omnidraft.decode import SpeculativeDecoder
from omnidraft.ngram.trie import NgramCache, NgramTrie

if TYPE_CHECKING:
    from omnidraft.adapter.slot import AdapterSlot

# greedy: text translation (our default); greedy-ngram: the paper's token mapping + n-gram cache;
# greedy-nocache: token mapping alone. tli / omnidraft: rejection sampling at --temperature.
# greedy-repeat: the same request a second time, with the lookup history of the first (a repeated session).
# greedy-chain: greedy with chains only (no branches of the drafter's runner-up tokens beside them).
# greedy-base: greedy with the drafter's base weights (no adapter, no acceptance head): what --adapter gains or
# costs, measured in the same run. greedy-nohead: greedy with the adapter but without its acceptance head (the
# stop rule reads the calibrated max q): what the head gains or costs. greedy-adapter: greedy with the
# adapter on every request, where greedy (as generate and chat) lets the cost policy run the base
# weights for requests where they are expected to draft faster. greedy-noheal: greedy without token healing
# (the drafter drafts after all of its context, even a bare line break: vocab/healing.py).
OUR_MODES = ("target", "target-sample", "greedy", "greedy-ngram", "greedy-nocache", "tli", "omnidraft", "text-sample", "rdk", "slrs",
             "lookup", "greedy-nolookup", "greedy-repeat", "greedy-base", "greedy-chain", "greedy-nohead", "greedy-adapter",
             "greedy-noheal")
BASE_MODES = ("greedy-base",)  # the drafter without its adapter (a fork with base weights)
SAMPLING_MODES = ("tli", "omnidraft", "text-sample", "rdk", "slrs", "hf-uag-sample", "target-sample")  # at --sample-temperature
HF_MODES = ("hf-target", "hf-uag", "hf-lookup", "hf-uag-sample")
ASSISTED_MODES = ("hf-uag", "hf-uag-sample")  # transformers' assisted generation: the drafter as a torch model
# On llama.cpp: its own greedy loop (llama-cpp-python's ``Llama.generate``), our loop with the
# target alone, ours with the cost-aware draft policy, and ours drafting blindly (always k = 4).
LLAMA_MODES = ("llamacpp", "target@llamacpp", "greedy@llamacpp", "greedy-k4@llamacpp", "greedy-onnx@llamacpp",
               "greedy-gguf@llamacpp", "lookup@llamacpp", "greedy-nolookup@llamacpp", "greedy-repeat@llamacpp",
               "greedy-noheal@llamacpp")
ONNX_MODES = ("greedy-onnx", "greedy-onnx@llamacpp")  # the drafter on onnxruntime (the home's export)
GGUF_MODES = ("greedy-gguf", "greedy-gguf@llamacpp")  # the drafter's GGUF on llama.cpp
# Against a target on a server: it decodes alone and streams (``server-stream``: what a thin client
# has, the baseline), streaming verification (``stream``; ``stream-forks``: the device also drafts
# forks for likely corrections), and one Verify per step for reference: per token (``target``) or
# per draft (``greedy`` and its token-translation variants).
STREAM_MODES = ("server-stream", "stream", "stream-forks")
FORKS_ON = 8  # --branch-rows of the stream-forks mode: any positive value turns forks on
REMOTE_MODES = STREAM_MODES + ("target", "greedy", "greedy-ngram", "greedy-nocache")
ALL_MODES = OUR_MODES + ("greedy-onnx", "greedy-gguf") + HF_MODES + LLAMA_MODES + STREAM_MODES
DEFAULT_MODES = ("target", "hf-target", "hf-uag", "greedy", "greedy-ngram", "greedy-nocache", "tli", "omnidraft")
GREEDY_MODES = ("target", "hf-target", "hf-uag", "hf-lookup", "greedy", "greedy-ngram", "greedy-nocache", "greedy-onnx",
                "greedy-gguf", "lookup", "greedy-nolookup", "greedy-repeat", "greedy-base", "greedy-chain", "greedy-nohead",
                "greedy-adapter", "greedy-noheal") + LLAMA_MODES + STREAM_MODES


def baseline_of(mode: str, available: Collection[str] = ()) -> str:
    """Each engine's modes are compared with its own target alone (the llama.cpp modes with ours on
    llama.cpp), and a sampling mode with the target sampling at the same temperature when that ran
    (``target-sample``: a plain sampled step pays a softmax and a draw that a greedy one does not)."""
    if mode in LLAMA_MODES:
        return "target@llamacpp"
    return "target-sample" if mode in SAMPLING_MODES and "target-sample" in available else "target"


@dataclass
class PromptRun:
    """One mode on one prompt."""

    token_ids: list[int]
    wall_s: float
    target_forwards: int
    drafted_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None
    ngram_hits_proposed: int = 0
    ngram_hits_accepted: int = 0
    split: dict[str, float] = field(default_factory=dict)  # draft / verify / bridge / other seconds
    steps: int = 0
    plain_steps: int = 0  # steps the draft policy left to the target alone
    wire_bytes: int = 0  # message bytes both ways, for a remote target
    lookup_steps: int = 0  # steps that verified a prompt-lookup draft instead of the drafter's
    lookup_proposed: int = 0
    lookup_accepted: int = 0
    token_times: list[float] = field(default_factory=list)  # seconds from the request's start to each token's arrival
    timely_forwards: int = 0  # a server's stream forwards that began with a usable draft (verified or not)
    branch_rows: int = 0  # rows of the drafter's runner-up branches verified
    branch_steps: int = 0  # steps that kept a branch
    forked_forwards: int = 0  # a server's stream forwards that verified a fork of the device's draft (a correction it foresaw)
    device_token_s: float | None = None  # a streaming device's drafter, seconds per token (its drafting is off the steps' clock)
    server_wait_s: float = 0.0  # a server's stream forwards' waits for the device's draft
    server_plain_s: list[float] = field(default_factory=list)  # a server's time on each stream forward that verified nothing

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0


def interleave(num_prompts: int, modes: Sequence[str]) -> list[tuple[int, str]]:
    """The run order: every mode on prompt 0, then every mode on prompt 1, …"""
    return [(p, m) for p in range(num_prompts) for m in modes]


def summarize(runs: dict[str, list[PromptRun]], baseline: str | None = "target",
              compare: Collection[str] = GREEDY_MODES) -> dict[str, dict]:
    """Per-mode table: tokens/s, per-prompt speedup vs the baseline (median, mean), acceptance…

    The baseline is ``baseline`` for torch-engine modes and ``target@llamacpp`` for the llama.cpp
    modes. ``compare``: the modes whose outputs must equal the baseline's (the greedy, lossless
    ones); they get ``identical_to_target``. ``baseline=None``: no ratios (runs that were not
    timed against the target, such as the cache ablation's learning stream).
    """
    out: dict[str, dict] = {}
    for mode, mode_runs in runs.items():
        base_name = None if baseline is None else (
            baseline_of(mode, runs) if mode in LLAMA_MODES or mode in SAMPLING_MODES else baseline)
        base = runs.get(base_name) if base_name is not None else None
        tokens = sum(len(r.token_ids) for r in mode_runs)
        wall = sum(r.wall_s for r in mode_runs)
        forwards = sum(r.target_forwards for r in mode_runs)
        ratios = [r.tokens_per_s / b.tokens_per_s for r, b in zip(mode_runs, base) if b.tokens_per_s > 0] if base else []
        rates = [r.acceptance_rate for r in mode_runs if r.acceptance_rate is not None]
        split = {k: sum(r.split.get(k, 0.0) for r in mode_runs) for k in ("draft", "verify", "bridge", "other")}
        catch_up = sum(r.split.get("catch_up", 0.0) for r in mode_runs)
        drafted = sum(r.drafted_tokens for r in mode_runs if r.steps)  # our modes (lookup proposals are not drafted)
        device = [r.device_token_s for r in mode_runs if r.device_token_s is not None]
        row = {
            "prompts": len(mode_runs),
            "new_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "speedup_vs_target": statistics.median(ratios) if ratios else None,
            "speedup_vs_target_mean": statistics.fmean(ratios) if ratios else None,
            "speedup_per_prompt": ratios,
            "acceptance_rate": statistics.fmean(rates) if rates else None,
            "tokens_per_target_forward": tokens / forwards if forwards else None,
            "ngram_hits_proposed": sum(r.ngram_hits_proposed for r in mode_runs),
            "ngram_hits_accepted": sum(r.ngram_hits_accepted for r in mode_runs),
            "time_split_s": split,
            # a drafted token's cost in the loop, without the catch-up reads after plain steps (reported apart);
            # a streaming device drafts on its own thread, off the steps' clock: its measured pace instead
            "drafter_ms_per_token": (1000 * (split["draft"] - catch_up) / drafted if drafted and split["draft"] > 0
                                     else 1000 * statistics.fmean(device) if device else None),
            "catch_up_s": catch_up,
            "drafted_steps": sum(r.steps - r.plain_steps - r.lookup_steps for r in mode_runs),  # by the drafter
            "lookup_steps": sum(r.lookup_steps for r in mode_runs),
            "lookup_proposed": sum(r.lookup_proposed for r in mode_runs),
            "lookup_accepted": sum(r.lookup_accepted for r in mode_runs),
            "wire_bytes_per_token": sum(r.wire_bytes for r in mode_runs) / tokens if tokens else None,
            # streaming verification: the share of server forwards a draft reached in time
            "timely_forward_share": sum(r.timely_forwards for r in mode_runs) / forwards if forwards else None,
            "forked_forward_share": sum(r.forked_forwards for r in mode_runs) / forwards if forwards else None,
            "server_wait_s": sum(r.server_wait_s for r in mode_runs),
            # the server's plain step as each mode saw it: on a host the device shares, its drafting slows the server
            "server_plain_step_ms": 1000 * statistics.median(plain) if (plain := [s for r in mode_runs for s in r.server_plain_s]) else None,
            "steps": sum(r.steps for r in mode_runs),
            "branch_rows": sum(r.branch_rows for r in mode_runs),
            "branch_steps": sum(r.branch_steps for r in mode_runs),
        }
        row.update(latency_ms(mode_runs))
        if mode in compare and base:
            same = [r.token_ids == b.token_ids for r, b in zip(mode_runs, base)]
            row["identical_to_target"] = all(same)
            row["identical_prompts"] = sum(same)  # how many prompts, where not all (llama.cpp near-ties)
        out[mode] = row
    return out


def latency_ms(runs: Sequence[PromptRun]) -> dict[str, float | None]:
    """Time to first token (median over prompts) and inter-token latency (median and p90 over all
    tokens). Tokens that arrive together share their chunk's gap: a chunk of m tokens after a gap g
    gives each of them g / m, so a step that emits several tokens lowers the per-token latency."""
    ttft = [r.token_times[0] for r in runs if r.token_times]
    itl: list[float] = []
    for r in runs:
        times = r.token_times
        j = 1
        while j < len(times):
            end = j
            while end < len(times) and times[end] == times[j]:
                end += 1
            itl += [(times[j] - times[j - 1]) / (end - j)] * (end - j)
            j = end
    if not itl:
        return {"ttft_ms": statistics.median(ttft) * 1000 if ttft else None, "itl_ms_median": None, "itl_ms_p90": None}
    cuts = statistics.quantiles(itl, n=10, method="inclusive") if len(itl) > 1 else [itl[0]] * 9
    return {"ttft_ms": statistics.median(ttft) * 1000, "itl_ms_median": statistics.median(itl) * 1000,
            "itl_ms_p90": cuts[8] * 1000}


# ---- modes ---------------------------------------------------------------------------------------
ModeFn = Callable[[list[int]], PromptRun]


def fresh(decoder: SpeculativeDecoder) -> None:
    """Every run reads its prompt from scratch: modes share engines, and a KV cache still holding
    the previous mode's prompt would make whichever mode runs second look faster."""
    decoder.target.reset()
    if hasattr(decoder.target, "new_session"):  # a server keeps its sessions' KV caches: start a new one
        decoder.target.new_session()
    if decoder.drafter is not None:
        decoder.drafter.reset()


def device_token_s(decoder: SpeculativeDecoder) -> float | None:
    """A streaming device's drafter cost per token as its pace measured it (None: no drafter, or not a stream)."""
    pace = getattr(decoder.target, "pace", None)
    return pace.token_s if pace is not None and decoder.drafter is not None and decoder.target.streams else None


def our_mode(decoder: SpeculativeDecoder, config: DecodeConfig) -> ModeFn:
    """A mode of our engine: the decoder's own stats give the counters and the time split."""

    def run(prompt_ids: list[int]) -> PromptRun:
        fresh(decoder)
        sent = getattr(decoder.target, "bytes_sent", 0) + getattr(decoder.target, "bytes_received", 0)
        timely, forked = getattr(decoder.target, "timely_forwards", 0), getattr(decoder.target, "forked_forwards", 0)
        waited = getattr(decoder.target, "waited_s", 0.0)
        plain = len(getattr(decoder.target, "plain_busy_s", ()))
        token_ids, times, start = [], [], time.perf_counter()
        for chunk in decoder.stream_ids(prompt_ids, config):
            now = time.perf_counter() - start
            token_ids += chunk
            times += [now] * len(chunk)
        s = decoder.stats
        drafting = decoder.drafter is not None or decoder.use_lookup
        wire = getattr(decoder.target, "bytes_sent", 0) + getattr(decoder.target, "bytes_received", 0) - sent
        return PromptRun(token_ids, s.wall_s, s.target_forwards, s.drafted_tokens, s.proposed_tokens,
                         s.accepted_tokens, s.acceptance_rate if drafting else None, s.ngram_hits_proposed,
                         s.ngram_hits_accepted, {"draft": s.draft_s, "catch_up": s.catch_up_s, "verify": s.verify_s,
                                                 "bridge": s.bridge_s, "other": s.other_s},
                         s.steps, s.plain_steps, wire, s.lookup_steps, s.lookup_proposed, s.lookup_accepted, times,
                         getattr(decoder.target, "timely_forwards", 0) - timely, s.branch_rows, s.branch_steps,
                         getattr(decoder.target, "forked_forwards", 0) - forked, device_token_s(decoder),
                         getattr(decoder.target, "waited_s", 0.0) - waited,
                         list(getattr(decoder.target, "plain_busy_s", ())[plain:]))

    run.decoder = decoder  # what the draft policy measured and chose, for the report
    return run


def repeat_mode(decoder: SpeculativeDecoder, config: DecodeConfig) -> ModeFn:
    """The same request twice: the first run (not timed) adds its output to the decoder's lookup
    history, the second is timed — what a user who re-runs a script or regenerates an answer gets."""
    timed = our_mode(decoder, config)

    def run(prompt_ids: list[int]) -> PromptRun:
        fresh(decoder)
        decoder.generate(prompt_ids, config)
        return timed(prompt_ids)

    run.decoder = decoder
    return run


def scratch_history(tokenizer):
    """An empty lookup history in a temporary folder (removed with the returned holder)."""
    import tempfile

    from omnidraft.sources.history import open_history

    holder = tempfile.TemporaryDirectory(prefix="omnidraft-bench-history-")
    history = open_history(tokenizer, home=holder.name)
    history.holder = holder  # the folder lives as long as the history
    return history


class _ForwardCounter:
    """Counts forward calls of a module (how many target / assistant passes transformers makes)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def hf_mode(target_model, target_tok, max_new_tokens: int, assistant=None, assistant_tok=None,
            prompt_lookup: int = 0, temperature: float = 0.0, seed: int = 0) -> ModeFn:
    """transformers' own ``generate``: plain greedy, universal assisted generation (UAG), or its
    prompt lookup (``prompt_lookup_num_tokens``); sampling at ``temperature`` > 0."""

    def run(prompt_ids: list[int]) -> PromptRun:
        ids = torch.tensor([prompt_ids])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, attention_mask=torch.ones_like(ids))
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
            torch.manual_seed(seed)
        if prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        if assistant is not None:
            kwargs.update(assistant_model=assistant, tokenizer=target_tok, assistant_tokenizer=assistant_tok)
        t_count = _ForwardCounter(target_model)
        a_count = _ForwardCounter(assistant) if assistant is not None else None
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = target_model.generate(ids, **kwargs)[0, len(prompt_ids):].tolist()
        finally:
            t_count.close()
            if a_count:
                a_count.close()
        wall = time.perf_counter() - start
        run_ = PromptRun(out, wall, t_count.count, split={"other": wall})
        if a_count is not None:
            # UAG does not report acceptance; one assistant forward ≈ one drafted token, and every
            # target forward emits one token of its own, so accepted ≈ emitted − target forwards.
            run_.drafted_tokens = run_.proposed_tokens = a_count.count
            run_.accepted_tokens = max(len(out) - t_count.count, 0)
            run_.acceptance_rate = run_.accepted_tokens / a_count.count if a_count.count else 0.0
        return run_

    return run


def llama_native_mode(target, max_new_tokens: int) -> ModeFn:
    """llama-cpp-python's own greedy loop (``Llama.generate``) on the GGUF our llama.cpp target runs:
    the speed a CPU user already has without omnidraft.

    The weights load as the target loads them: a batch-invariant target keeps them unrepacked, and
    repacked weights take other kernels, whose logits differ enough to flip a near-tie (one HumanEval
    prompt in four diverged within 42 tokens)."""
    import llama_cpp
    import llama_cpp.llama as high_level

    from omnidraft.target.llamacpp import use_extra_buffers

    defaults = high_level.llama_cpp.llama_model_default_params

    def same_weights_as_ours():  # Llama() takes no use_extra_bufts: its defaults are patched while it loads
        params = defaults()
        params.use_extra_bufts = use_extra_buffers(target.batch_invariant)
        return params

    high_level.llama_cpp.llama_model_default_params = same_weights_as_ours
    try:
        llm = llama_cpp.Llama(str(target.path), n_ctx=target.max_context, n_threads=target.n_threads,
                              n_threads_batch=target.n_threads, verbose=False)
    finally:
        high_level.llama_cpp.llama_model_default_params = defaults

    def run(prompt_ids: list[int]) -> PromptRun:
        out: list[int] = []
        start = time.perf_counter()
        llm.reset()  # no prompt prefix kept from the previous run (see ``fresh``)
        for token in llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in target.eos_ids or len(out) == max_new_tokens:
                break
        wall = time.perf_counter() - start
        return PromptRun(out, wall, len(out), split={"other": wall})

    return run


def build_modes(pipe, modes: Sequence[str], base: DecodeConfig, temperature: float,
                ngrams_factory: Callable[[], NgramCache] = NgramTrie, llama=None, onnx=None,
                gguf=None, base_drafter=None, assistant=None,
                choosing: Callable[[], AdapterSlot | None] | None = None) -> dict[str, ModeFn]:
    """Mode name -> runner, all sharing the pipeline's target engine, drafter and weights.

    ``base`` carries the shared knobs (max new tokens, draft length, draft policy, seed).
    ``llama``: the same target on llama.cpp (a ``LlamaCppTarget``), for the ``@llamacpp`` modes;
    ``onnx``: the drafter on onnxruntime (a ``Drafter`` over ``OnnxDraftLM``), for the ``-onnx`` modes;
    ``gguf``: the drafter on llama.cpp (a ``Drafter`` over ``LlamaCppDraftLM``), for the ``-gguf`` modes;
    ``base_drafter``: the drafter with its base weights (:func:`without_adapter`), for ``greedy-base``;
    ``choosing``: makes an adapter slot of its own over a fork of the drafter (:func:`weights_choice_slot`),
    one for each of ``greedy`` and ``greedy@llamacpp``, whose policy chooses its weights per request
    (None, or a slot of None: the mode drafts with the shared drafter);
    ``assistant``: the drafter as a torch model, for transformers' assisted modes (default: the
    pipeline's; a pipeline whose drafter runs on a GGUF or an export has none, and those modes refuse
    to run rather than run transformers without an assistant).
    """
    target, drafter, bridge = pipe.decoder.target, pipe.decoder.drafter, pipe.decoder.bridge
    max_new_tokens = base.max_new_tokens
    remote = hasattr(target, "with_protocol")  # a server: each mode in a session of its own
    if remote:
        server = target
        target = server.with_protocol("verify")  # a round trip per step
        streamed = server.with_protocol("stream")
    elif any(m in STREAM_MODES for m in modes):
        raise ValueError("the server-stream and stream modes need a target on a server (--target grpc://…)")

    def cfg(**kw) -> DecodeConfig:
        return replace(base, **kw)

    assistant = assistant if assistant is not None else pipe.drafter_model
    if assistant is None and any(m in ASSISTED_MODES for m in modes):
        raise ValueError(f"{', '.join(m for m in modes if m in ASSISTED_MODES)}: transformers' assisted generation "
                         "needs the drafter as a torch model, and this pipeline's drafter has none")

    def spec(config: DecodeConfig, ngrams: NgramCache) -> ModeFn:
        return our_mode(SpeculativeDecoder(target, drafter, bridge, ngrams), config)

    def choosing_weights(verifier, config: DecodeConfig, ngrams: NgramCache) -> ModeFn:
        """A mode whose drafter's weights its policy picks per request, on a slot of the mode's own
        (two such modes switching one fork would each see the other's switches as their own)."""
        slot = choosing() if choosing is not None else None
        if slot is None:
            return our_mode(SpeculativeDecoder(verifier, drafter, bridge, ngrams), config)
        decoder = SpeculativeDecoder(verifier, slot.drafter, bridge, ngrams)
        slot.listeners.append(decoder.cost_policy.drafter_weights)
        decoder.cost_policy.drafter_weights(slot.weights)
        decoder.cost_policy.switch = slot
        return our_mode(decoder, config)

    table: dict[str, Callable[[], ModeFn]] = {
        "server-stream": lambda: our_mode(SpeculativeDecoder(streamed.with_protocol("stream")),
                                          cfg(verify="greedy", lookup=False)),
        "stream": lambda: our_mode(SpeculativeDecoder(streamed.with_protocol("stream"), drafter, bridge, ngrams_factory()),
                                   cfg(verify="greedy", translate="text")),
        "stream-forks": lambda: our_mode(SpeculativeDecoder(streamed.with_protocol("stream"), drafter, bridge, ngrams_factory()),
                                         cfg(verify="greedy", translate="text", branch_rows=FORKS_ON)),
        "target": lambda: our_mode(SpeculativeDecoder(target), cfg(verify="greedy", lookup=False)),
        "target-sample": lambda: our_mode(SpeculativeDecoder(target), cfg(verify=None, temperature=temperature, lookup=False)),
        "greedy": lambda: choosing_weights(target, cfg(verify="greedy", translate="text"), ngrams_factory()),
        "greedy-adapter": lambda: spec(cfg(verify="greedy", translate="text"), ngrams_factory()),
        "greedy-ngram": lambda: spec(cfg(verify="greedy", translate="tokens", lookup=False), ngrams_factory()),
        "greedy-nocache": lambda: spec(cfg(verify="greedy", translate="tokens", use_ngram=False, lookup=False), NgramTrie()),
        "tli": lambda: spec(cfg(verify="tli", temperature=temperature), NgramTrie()),
        "omnidraft": lambda: spec(cfg(verify="omnidraft", temperature=temperature), ngrams_factory()),
        "text-sample": lambda: spec(cfg(verify="text-sample", temperature=temperature, translate="text"), ngrams_factory()),
        "rdk": lambda: spec(cfg(verify="rdk", temperature=temperature), NgramTrie()),
        "slrs": lambda: spec(cfg(verify="slrs", temperature=temperature), NgramTrie()),
        # transformers prunes the assistant's LM head to the shared vocabulary when UAG samples: it gets a copy
        "hf-uag-sample": lambda: hf_mode(pipe.target_model, target.tokenizer, max_new_tokens, copy.deepcopy(assistant),
                                         bridge.drafter_tokenizer, temperature=temperature, seed=base.seed),
        "hf-target": lambda: hf_mode(pipe.target_model, target.tokenizer, max_new_tokens),
        "hf-uag": lambda: hf_mode(pipe.target_model, target.tokenizer, max_new_tokens, assistant, bridge.drafter_tokenizer),
        "hf-lookup": lambda: hf_mode(pipe.target_model, target.tokenizer, max_new_tokens, prompt_lookup=10),
        "lookup": lambda: our_mode(SpeculativeDecoder(target, lookup=True), cfg(verify="greedy")),
        "greedy-nolookup": lambda: spec(cfg(verify="greedy", translate="text", lookup=False), ngrams_factory()),
        "greedy-chain": lambda: spec(cfg(verify="greedy", translate="text", branch_rows=0), ngrams_factory()),
        "greedy-nohead": lambda: spec(cfg(verify="greedy", translate="text", use_head=False), ngrams_factory()),
        "greedy-noheal": lambda: spec(cfg(verify="greedy", translate="text", heal=False), ngrams_factory()),
        "greedy-base": lambda: our_mode(SpeculativeDecoder(target, base_drafter, bridge, ngrams_factory()),
                                        cfg(verify="greedy", translate="text")),
        "lookup@llamacpp": lambda: our_mode(SpeculativeDecoder(llama, lookup=True), cfg(verify="greedy")),
        "greedy-nolookup@llamacpp": lambda: our_mode(SpeculativeDecoder(llama, drafter, bridge, ngrams_factory()),
                                                     cfg(verify="greedy", translate="text", lookup=False)),
        "greedy-noheal@llamacpp": lambda: our_mode(SpeculativeDecoder(llama, drafter, bridge, ngrams_factory()),
                                                    cfg(verify="greedy", translate="text", heal=False)),
        "greedy-repeat": lambda: repeat_mode(SpeculativeDecoder(target, drafter, bridge, ngrams_factory(),
                                                                history=scratch_history(target.tokenizer)),
                                             cfg(verify="greedy", translate="text")),
        "greedy-repeat@llamacpp": lambda: repeat_mode(SpeculativeDecoder(llama, drafter, bridge, ngrams_factory(),
                                                                         history=scratch_history(target.tokenizer)),
                                                      cfg(verify="greedy", translate="text")),
        "llamacpp": lambda: llama_native_mode(llama, max_new_tokens),
        "target@llamacpp": lambda: our_mode(SpeculativeDecoder(llama), cfg(verify="greedy", lookup=False)),
        "greedy@llamacpp": lambda: choosing_weights(llama, cfg(verify="greedy", translate="text"), ngrams_factory()),
        "greedy-k4@llamacpp": lambda: our_mode(SpeculativeDecoder(llama, drafter, bridge, ngrams_factory()),
                                               cfg(verify="greedy", translate="text", draft_len=4, draft_stop="fixed")),
        "greedy-onnx": lambda: our_mode(SpeculativeDecoder(target, onnx, bridge, ngrams_factory()),
                                        cfg(verify="greedy", translate="text")),
        "greedy-onnx@llamacpp": lambda: our_mode(SpeculativeDecoder(llama, onnx, bridge, ngrams_factory()),
                                                 cfg(verify="greedy", translate="text")),
        "greedy-gguf": lambda: our_mode(SpeculativeDecoder(target, gguf, bridge, ngrams_factory()),
                                        cfg(verify="greedy", translate="text")),
        "greedy-gguf@llamacpp": lambda: our_mode(SpeculativeDecoder(llama, gguf, bridge, ngrams_factory()),
                                                 cfg(verify="greedy", translate="text")),
    }
    if onnx is None and any(m in ONNX_MODES for m in modes):
        raise ValueError("the -onnx modes need the drafter's ONNX export (omnidraft export)")
    if gguf is None and any(m in GGUF_MODES for m in modes):
        raise ValueError("the -gguf modes need the drafter on llama.cpp")
    if base_drafter is None and any(m in BASE_MODES for m in modes):
        raise ValueError("the greedy-base mode needs the drafter with its base weights")
    if llama is None and any(m in LLAMA_MODES for m in modes):
        raise ValueError("the @llamacpp modes need the target on llama.cpp")
    unknown = [m for m in modes if m not in table]
    if unknown:
        raise ValueError(f"unknown bench modes {unknown}; known: {', '.join(ALL_MODES)}")
    return {m: table[m]() for m in modes}


def without_adapter(drafter):
    """A drafter over the same model with its base weights and no acceptance head: a fork (its own KV
    cache) with the adapter taken off. ValueError where a fork cannot drop an adapter: the torch
    backend merges one into its weights, and its fork copies the merged weights."""
    from omnidraft.drafter import Drafter
    from omnidraft.drafter.torch_lm import TorchDraftLM

    if drafter is None:
        raise ValueError("the greedy-base mode needs a drafter (--drafter)")
    if isinstance(drafter.lm, TorchDraftLM) and drafter.lm.has_adapter:
        raise ValueError("greedy-base with an adapter needs a drafter backend that holds the adapter apart from the "
                         "weights (--drafter-backend native, llamacpp or onnx); torch merges it into them")
    lm = drafter.lm.fork()
    lm.apply_adapter(None)
    return Drafter(lm, drafter.stop_ids)


def weights_choice_slot(slot):
    """A fork of the slot's drafter in an adapter slot of its own, holding the same adapter, for a
    mode whose policy switches its weights per request while the other modes keep the shared
    drafter's; None where there is no adapter to choose against, or the backend cannot fork one that
    can drop it (torch merges the adapter into the weights its fork copies)."""
    from omnidraft.adapter.slot import AdapterSlot
    from omnidraft.drafter import Drafter
    from omnidraft.drafter.torch_lm import TorchDraftLM

    if slot is None or slot.current is None or isinstance(slot.drafter.lm, TorchDraftLM):
        return None
    fork = AdapterSlot(Drafter(slot.drafter.lm.fork(), slot.drafter.stop_ids), slot.identity, slot.folder)
    fork.use(slot.current)
    return fork


def policy_report(mode_fns: dict[str, ModeFn]) -> dict[str, dict]:
    """Per mode with the cost-aware draft policy: the verify costs and drafter cost it measured
    (ms, after the run's online updates) and how often it chose each drafter allowance (0 = plain step;
    the report's ``budget_choices`` key is kept for existing result files)."""
    out = {}
    for mode, fn in mode_fns.items():
        policy = getattr(getattr(fn, "decoder", None), "cost_policy", None)
        if policy is not None and policy.measured:
            out[mode] = {"verify_ms_by_proposals": policy.cost_table_ms(),
                         "draft_ms_per_token": round(policy.draft_cost.seconds_per_token * 1000, 2),
                         "budget_choices": dict(sorted(policy.choices.items()))}
            if policy.switch is not None:  # the requests each weights drafted (the weights choice)
                out[mode]["weights_requests"] = dict(policy.weights_choice.picks)
                trials = policy.weights_choice.summary()
                if trials:
                    out[mode]["weights_trials"] = trials
    return out


def run_bench(mode_fns: dict[str, ModeFn], prompts: list[list[int]], warmup: list[int] | None = None,
              progress: bool = True) -> dict[str, list[PromptRun]]:
    """Warm every mode up once, then run them interleaved per prompt."""
    from tqdm.auto import tqdm

    if warmup is not None:
        for fn in mode_fns.values():
            fn(warmup)
    runs: dict[str, list[PromptRun]] = {m: [] for m in mode_fns}
    order = interleave(len(prompts), list(mode_fns))
    bar = tqdm(order, desc="bench", disable=not progress, unit="run")
    for p, mode in bar:
        runs[mode].append(mode_fns[mode](prompts[p]))
        bar.set_postfix_str(f"prompt {p + 1}/{len(prompts)} {mode}")
    return runs
