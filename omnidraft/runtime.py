"""Assemble a ready-to-run decoder from model specs: the glue the CLI, demos and benchmark share.

``load_pipeline`` loads the target and the drafter, builds the vocabulary bridge, opens the pair's
persistent n-gram cache and the target's lookup history, and puts the pair's adapter (if one was
trained) into the drafter. It imports nothing from ``omnidraft.train``: decoding needs only what
``omnidraft.adapter`` reads.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnidraft import fastlinear, models
from omnidraft.adapter import store as adapters
from omnidraft.adapter.slot import AdapterSlot
from omnidraft.config import (
    DEFAULT_DRAFTER_DTYPE,
    DEVICES,
    DRAFTER_DTYPES,
    ENGINES,
    INT8_NO_ADAPTER,
)
from omnidraft.console import notice, warn
from omnidraft.decode import SpeculativeDecoder
from omnidraft.drafter import Drafter
from omnidraft.drafter.torch_lm import TorchDraftLM, convert_drafter
from omnidraft.errors import OmnidraftError
from omnidraft.home import home_dir
from omnidraft.kv import output_vocab_size
from omnidraft.ngram.trie import NgramCache, NgramTrie
from omnidraft.sources.history import LookupHistory, open_history
from omnidraft.sources.lookup import LOOKUP_MAX
from omnidraft.target import Target, static
from omnidraft.target.torch_target import TorchTarget, torch_target
from omnidraft.vocab.bridge import VocabBridge
from omnidraft.identity import pair_slug, vocab_fingerprint


@dataclass
class Pipeline:
    decoder: SpeculativeDecoder
    target_spec: str
    drafter_spec: str | None
    target_model: torch.nn.Module | None  # the torch model (None when the target runs on llama.cpp)
    drafter_model: torch.nn.Module | None
    adapter_slot: AdapterSlot | None = None  # when a drafter is loaded
    engine: str = "torch"
    drafter_backend: str | None = None  # what runs the drafter: "llamacpp", "onnx-int8", "torch-bfloat16", ...

    @property
    def target_tokenizer(self) -> Any:
        return self.decoder.target.tokenizer

    def close(self) -> None:
        """Write what the pair's persistent n-gram cache holds pending and close its file now.

        A store left to the garbage collector or to interpreter exit closes at a moment nobody
        chose, and closing the last connection checkpoints and removes its ``-wal`` file, so a
        front end closes its pipeline when it is done. The models stay loaded."""
        ngrams = self.decoder.ngrams
        if ngrams is not None and hasattr(ngrams, "close"):
            ngrams.close()


def build_bridge(drafter_model, drafter_tokenizer, target_model, target_tokenizer) -> VocabBridge:
    return VocabBridge(drafter_tokenizer, target_tokenizer, output_vocab_size(drafter_model), output_vocab_size(target_model))


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python is there (found without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class RemoteOptions:
    """How to reach a target on a server (``grpc://`` / ``grpcs://`` specs)."""

    token: str | None = None  # from --token-file or $OMNIDRAFT_TOKEN, never the command line
    deadline_s: float = 30.0
    rtt_ms: float = 0.0  # an injected round-trip delay (bench)
    protocol: str = "stream"  # a stream per request (streaming verification), or one Verify per step


def resolve_engine(spec: str, engine: str, dtype: str | None = None, device: str = "cpu") -> str:
    """``auto``: on a GPU the torch engine (``torch-cuda``); on the CPU llama.cpp for a GGUF target (a
    builtin or a .gguf file) when llama-cpp-python is installed and no torch dtype was asked for (its
    quantized CPU kernels run them faster than our fp32 torch engine, docs/performance.md has the
    numbers), else torch."""
    if engine not in ENGINES:
        raise OmnidraftError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if spec.startswith(("grpc://", "grpcs://")):
        return "remote"
    if device == "cuda":
        if engine == "llamacpp":
            raise OmnidraftError("--device cuda runs the torch engine (llama.cpp here is a CPU build); "
                                 "drop --engine llamacpp or use --device cpu")
        return "torch-cuda"
    if engine != "auto":
        return engine
    gguf = models.builtin(spec) is not None or models.is_gguf_file(spec)
    return "llamacpp" if gguf and dtype in (None, "float32") and llama_cpp_installed() else "torch"


def target_device(spec: str, device: str) -> str:
    """``auto|cpu|cuda`` → ``cpu`` or ``cuda`` (a remote target: ``cpu``, the server places it), refusing
    a GPU torch cannot see."""
    if spec.startswith(("grpc://", "grpcs://")):
        return "cpu"
    if device not in DEVICES:
        raise OmnidraftError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    resolved = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if resolved == "cuda" and not torch.cuda.is_available():
        raise OmnidraftError("--device cuda: torch sees no CUDA device on this machine (torch.cuda.is_available() "
                             "is false); use --device cpu")
    return resolved


def load_target(spec: str, engine: str = "auto", *, home=None, dtype: str | None = None, quiet: bool = False,
                remote: RemoteOptions | None = None, device: str = "auto",
                context: int | None = None, batch: int = 1) -> tuple[Target, torch.nn.Module | None, str]:
    """(target, its torch model or None, the engine that runs it).

    ``dtype`` None: float32 on the CPU, bfloat16 on a GPU. ``context``: positions of the GPU engine's
    static cache per session (default ``static.DEFAULT_CONTEXT``). ``batch`` > 1: a server's target
    whose sessions (that many) share each forward (torch engine)."""
    device = target_device(spec, device)
    engine = resolve_engine(spec, engine, dtype, device)
    if batch > 1 and engine not in ("torch", "torch-cuda"):
        raise OmnidraftError("--batch runs on the torch engine (--engine torch): llama.cpp sessions are served one "
                             "forward each")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    if engine == "remote":
        from omnidraft.rpc.client import RemoteTarget

        options = remote or RemoteOptions()
        return RemoteTarget(spec, token=options.token, home=home, deadline_s=options.deadline_s,
                            rtt_ms=options.rtt_ms, protocol=options.protocol), None, engine
    if engine == "llamacpp":
        from omnidraft.target.llamacpp import LlamaCppTarget, check_gguf_file

        gguf = models.gguf_of(spec, home, progress=not quiet)
        if gguf is None:
            raise OmnidraftError(f"--engine llamacpp runs GGUF models: {spec} is not one (use builtin:NAME, "
                                 "a .gguf file, or --engine torch)")
        check_gguf_file(gguf)  # before a tokenizer is read out of it
        tokenizer = models.load_tokenizer(spec, home, progress=not quiet)
        return LlamaCppTarget(gguf, tokenizer), None, engine
    model, tokenizer = models.load(spec, home=home, dtype=dtype, progress=not quiet)
    target = torch_target(model, tokenizer, device, context or static.DEFAULT_CONTEXT, batch)
    if device != "cuda" and batch == 1:  # the eager CPU engine: the one on fastlinear's kernels
        time_kernels(target, "target", home, quiet)
    return target, model, engine


def time_kernels(engine: TorchTarget | TorchDraftLM, what: str, home=None, quiet: bool = False) -> None:
    """Choose an eager CPU engine's kernels before the first request, once per home and CPU (the
    choices are kept in the home): for every read up to a lookup draft's verify and the longer read
    classes. A fresh home's first requests would otherwise pay it in their forwards (~1-2 s each new
    row count), and the cost policy would learn those forwards' times as the target's V and the
    drafter's d."""
    fastlinear.keep_choices_at(models.models_dir(home) / "costs" / "kernels.json", cost_machine())
    start = time.perf_counter()
    timed = engine.warm_up(LOOKUP_MAX, progress=not quiet)
    if timed and not quiet:
        notice(f"timed the {what}'s kernels for {timed} shapes in {time.perf_counter() - start:.0f} s "
               "(once for this home and CPU)")


def make_drafter(drafter_model: torch.nn.Module, bridge: VocabBridge, target: Target, dtype: str = "float32") -> Drafter:
    """A torch drafter that stops drafting after proposing the target's end-of-sequence token."""
    stop = [d for d, t in enumerate(bridge.d2t_list) if t in target.eos_ids]
    return Drafter(TorchDraftLM(drafter_model, dtype), stop_ids=stop)


@dataclass
class CacheOptions:
    """How the persistent n-gram cache of the pair is used (see omnidraft/ngram/store.py)."""

    enabled: bool = True  # False: in-memory only, starts empty, nothing written
    max_entries: int | None = None  # None: no cap
    policy: str = "lru"
    frozen: bool = False


def open_ngram_cache(drafter_tok, target_tok, options: CacheOptions, home=None) -> NgramCache:
    if not options.enabled:
        return NgramTrie()
    from omnidraft.ngram.store import open_pair_cache

    try:
        return open_pair_cache(drafter_tok, target_tok, home=home, max_entries=options.max_entries,
                               policy=options.policy, frozen=options.frozen)
    except ValueError as exc:
        raise OmnidraftError(f"bad n-gram cache option: {exc}") from None


def open_lookup_history(target_tok, options: CacheOptions, home=None) -> LookupHistory | None:
    """The target tokenizer's lookup history under the n-gram cache's switch: none when that cache
    is in memory only (``--no-ngram``, benchmarks), read-only when it is frozen (evaluation)."""
    if not options.enabled:
        return None
    try:
        return open_history(target_tok, home=home, read_only=options.frozen)
    except OSError as exc:  # e.g. a cache_store/ we may not read: draft from the context alone
        warn(f"cannot open the lookup history ({exc.strerror or exc}); drafting without it")
        return None


@contextlib.contextmanager
def loading_heap():
    """Python's cyclic garbage collector paused while models load, then :func:`settle_heap`.

    A load allocates about a million long-lived objects (vocabularies parsed from JSON and GGUF
    metadata, token tables). The collector runs a full collection each time the heap has grown by a
    quarter, and each one walks everything loaded so far: seconds of every command's start. Paused,
    the garbage cycles a load leaves are collected once, at the end. The collector's state is
    restored whether or not the load succeeds."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        settle_heap()
    finally:
        if was_enabled:
            gc.enable()


@loading_heap()  # a fresh pause per call (contextmanager objects decorate as ContextDecorator)
def load_pipeline(target_spec: str, drafter_spec: str | None, *, home=None, dtype: str | None = None,
                  drafter_dtype: str | None = None, cache: CacheOptions | None = None, quiet: bool = False,
                  adapter: str = "auto", engine: str = "auto", remote: RemoteOptions | None = None,
                  drafter_backend: str = "auto", device: str = "auto") -> Pipeline:
    """Load target (and drafter unless None/'none') and wire bridge, n-gram cache, drafter, decoder.

    ``adapter``: "auto" uses the pair's LoRA adapter under ``<home>/adapters/`` if one was
    trained, "none" runs the base drafter, anything else is the path of an adapter folder.
    ``drafter_backend`` "auto" with no ``drafter_dtype``: the backend measured fastest on this machine
    (:func:`choose_drafter_backend`); "auto" with a dtype: the ONNX export if there is one, else torch
    in that dtype; torch without a dtype: bfloat16.
    """
    drafting = drafter_spec not in (None, "none")
    for spec in (target_spec, drafter_spec if drafting else None):
        if spec is not None:
            models.check_spec(spec)  # an unknown builtin or a missing folder fails here, before loading
    if drafter_dtype is not None and drafter_dtype not in DRAFTER_DTYPES:
        raise OmnidraftError(f"unknown drafter dtype {drafter_dtype!r}; choose one of {', '.join(DRAFTER_DTYPES)}")
    if drafting and adapter not in ("auto", "none"):
        precheck_adapter(adapter, drafter_dtype)  # a bad path fails now, not after a minute of loading
    if not quiet:
        notice(f"loading target {target_spec} ({resolve_engine(target_spec, engine, dtype, target_device(target_spec, device))})")
    target, target_model, engine = load_target(target_spec, engine, home=home, dtype=dtype, quiet=quiet, remote=remote,
                                               device=device)
    target_tok = target.tokenizer
    if not drafting:
        return Pipeline(SpeculativeDecoder(target), target_spec, None, target_model, None, engine=engine)
    if drafter_backend == "auto" and drafter_dtype is None:  # after the target: what fails at once does
        chosen = choose_drafter_backend(drafter_spec, home, quiet).chosen
        drafter_backend = chosen.backend
        drafter_dtype = chosen.dtype if chosen.backend == "torch" else None
    drafter_dtype = drafter_dtype or DEFAULT_DRAFTER_DTYPE
    on_gguf = drafter_backend in GGUF_BACKENDS
    export = None if on_gguf else onnx_export_for(drafter_spec, drafter_backend, home)
    if not quiet:
        where = GGUF_BACKENDS.get(drafter_backend) or ('onnx: ' + str(export) if export else 'torch ' + drafter_dtype)
        notice(f"loading drafter {drafter_spec} ({where})")
    if on_gguf:  # the drafter's GGUF in-process: nothing dequantized, the torch drafter not loaded
        load = native_drafter if drafter_backend == "native" else gguf_drafter
        lm, drafter_tok = load(drafter_spec, home, quiet)
        drafter_model, vocab, backend = None, lm.vocab_size, drafter_backend
        arch = gguf_architecture(lm.gguf_path, home)  # the torch twin's: the trainer's adapters fit it
    elif export is not None:  # the exported graph on onnxruntime: the torch drafter is not loaded at all
        from transformers import AutoTokenizer

        from omnidraft.drafter.onnx_lm import OnnxDraftLM

        lm = OnnxDraftLM(export)
        drafter_model, drafter_tok = None, AutoTokenizer.from_pretrained(export)
        vocab, arch, backend = lm.vocab_size, lm.manifest["architecture"], f"onnx-{lm.manifest['quant']}"
        if lm.merged_adapter:  # the adapter is in its weights: none goes on top
            if adapter not in ("auto", "none"):
                raise OmnidraftError(f"--adapter {adapter}: the export in {export} has {lm.merged_adapter} merged "
                                     f"into its weights and takes no other")
            adapter = "none"
            if not quiet:
                notice(f"adapter {lm.merged_adapter} (merged into the export)")
    else:
        drafter_model, drafter_tok = models.load(drafter_spec, home=home, dtype="float32", progress=not quiet)
        vocab, arch, backend = output_vocab_size(drafter_model), adapters.architecture_fingerprint(drafter_model), drafter_dtype
        drafter_model = convert_drafter(drafter_model, drafter_dtype)  # after the fingerprint: int8 hides the weights
        lm = TorchDraftLM(drafter_model, drafter_dtype)
        time_kernels(lm, "drafter", home, quiet)
    bridge = VocabBridge(drafter_tok, target_tok, vocab, target.vocab_size)
    if bridge.intersection_size == 0:
        raise OmnidraftError(f"{drafter_spec} and {target_spec} share no token: nothing can be drafted")
    identity = adapters.Identity(vocab_fingerprint(drafter_tok)[:16], vocab_fingerprint(target_tok)[:16], arch)
    ngrams = open_ngram_cache(drafter_tok, target_tok, cache or CacheOptions(), home)
    history = open_lookup_history(target_tok, cache or CacheOptions(), home)
    drafter = Drafter(lm, stop_ids=[d for d, t in enumerate(bridge.d2t_list) if t in target.eos_ids])
    decoder = SpeculativeDecoder(target, drafter, bridge, ngrams, history=history)
    slot = AdapterSlot(drafter, identity, adapters.pair_dir(drafter_spec, target_spec, home))
    decoder.observers.append(slot)
    decoder.cost_policy.keep_at(policy_path(drafter_spec, target_spec, engine, backend, home), policy_machine(backend))
    slot.listeners.append(decoder.cost_policy.drafter_weights)
    decoder.cost_policy.switch = slot  # per request: the adapter, or the base weights where they draft faster
    use_adapter(slot, adapter, quiet)
    decoder.cost_policy.drafter_weights(slot.weights)  # also when no adapter loaded: "none" may be news
    label = backend if backend in GGUF_BACKENDS or backend.startswith("onnx") else f"torch-{backend}"
    return Pipeline(decoder, target_spec, drafter_spec, target_model, drafter_model, slot, engine, label)


def settle_heap() -> None:
    """Collect once, then exempt everything loaded so far from Python's garbage collector.

    Tokenizers, vocabulary tables and model objects are a few hundred thousand long-lived objects; a
    full collection walks all of them (a quarter of a second here) and Python starts one every few
    thousand allocations, so decoding stalled at random steps, more often in the loop that allocates
    more (the speculative one). Frozen objects are never walked again; what is allocated later still is.
    Each call first unfreezes, so garbage frozen by an earlier load (a pipeline dropped since, in a
    reference cycle) is collected here rather than kept for the life of the process.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


GGUF_BACKENDS = {"llamacpp": "llama.cpp", "native": "native"}  # drafter backends that run its GGUF as it is


def _drafter_gguf(drafter_spec: str, backend: str, home=None) -> Path:
    gguf = models.gguf_of(drafter_spec, home, progress=False)  # ~100 MB: a bar would only flash
    if gguf is None:
        raise OmnidraftError(f"--drafter-backend {backend} runs a GGUF file; {drafter_spec} is neither a builtin "
                             f"nor a .gguf file")
    return gguf


_NATIVE_WEIGHTS: dict[Path, Any] = {}


def _native_weights(gguf: Path, home=None):
    """The GGUF's weights in the native forward, loaded once per process (every fork shares them,
    whichever home asked first); the file's index is kept under ``<home>/models/gguf-index``."""
    from omnidraft.drafter.native_lm import load_native_model

    if gguf not in _NATIVE_WEIGHTS:
        weights = load_native_model(gguf, models.models_dir(home) / "gguf-index")
        if weights.head_vocab is not None:  # the tokens this home has read: their head rows stay in every step
            weights.head_vocab.keep_at(models.models_dir(home) / "costs" / f"head-rows-{gguf.stem}.bits")
        _NATIVE_WEIGHTS[gguf] = weights
    return _NATIVE_WEIGHTS[gguf]


def native_drafter(drafter_spec: str, home=None, quiet: bool = False):
    """(NativeDraftLM, tokenizer) for ``--drafter-backend native``: the GGUF's blocks in omnidraft's own
    forward (omnidraft/kernels/qdraft.cpp)."""
    from omnidraft.drafter.native_lm import NativeDraftLM, NativeUnsupported

    gguf = _drafter_gguf(drafter_spec, "native", home)
    try:
        weights = _native_weights(gguf.resolve(), home)
    except NativeUnsupported as exc:
        raise OmnidraftError(f"--drafter-backend native: {exc}") from None
    if not quiet:
        from omnidraft.drafter import native_lm

        notice(f"native drafter: long reads on {native_lm.chosen_long_reads()}")
    return NativeDraftLM(weights), models.load_tokenizer(drafter_spec, home, progress=not quiet)


def native_drafter_available() -> bool:
    """Whether this machine has the native drafter (its kernels built, the CPU able to run them)."""
    from omnidraft import kernels

    return kernels.qdraft() is not None


def gguf_drafter(drafter_spec: str, home=None, quiet: bool = False):
    """(LlamaCppDraftLM, tokenizer) for ``--drafter-backend llamacpp``: a builtin's GGUF or a .gguf file."""
    from omnidraft.drafter.llamacpp_lm import LlamaCppDraftLM

    gguf = _drafter_gguf(drafter_spec, "llamacpp", home)
    tokenizer = models.load_tokenizer(drafter_spec, home, progress=not quiet)
    return LlamaCppDraftLM(gguf, tokenizer), tokenizer


def drafter_backend_candidates(drafter_spec: str, home=None) -> tuple[list[tuple[str, str | None]], Path | None]:
    """The backends ``auto`` weighs for this drafter besides torch float32 (the reference), and the
    export folder when there is one."""
    export = onnx_export_for(drafter_spec, "auto", home)
    has_gguf = models.builtin(drafter_spec) is not None or models.is_gguf_file(drafter_spec)
    kinds: list[tuple[str, str | None]] = [("torch", "bfloat16")]
    if export is not None:
        kinds.append(("onnx", export.name.rsplit("-", 1)[-1]))
    if has_gguf and llama_cpp_installed():  # (its file is found and checked when it is loaded)
        kinds.append(("llamacpp", None))
    if has_gguf and native_drafter_available():
        kinds.append(("native", None))
    return kinds, export


def kept_drafter_choice(drafter_spec: str, home=None):
    """The choice ``auto`` made on this machine if it still holds (nothing measured), else None."""
    from omnidraft.drafter import choice
    from omnidraft.identity import spec_slug

    kinds, _ = drafter_backend_candidates(drafter_spec, home)
    return choice.load_choice(choice.record_path(spec_slug(drafter_spec), home),
                              choice.fingerprint([("torch", "float32"), *kinds]))


def choose_drafter_backend(drafter_spec: str, home=None, quiet: bool = False, remeasure: bool = False):
    """What ``--drafter-backend auto`` runs the drafter on: the fastest backend this machine has that
    agrees with the fp32 drafter (omnidraft/drafter/choice.py), measured once per home and CPU."""
    import copy

    from omnidraft.drafter import choice
    from omnidraft.identity import spec_slug

    kinds, export = drafter_backend_candidates(drafter_spec, home)
    key = choice.fingerprint([("torch", "float32"), *kinds])
    path = choice.record_path(spec_slug(drafter_spec), home)
    kept = None if remeasure else choice.load_choice(path, key)
    if kept is not None:
        return kept
    model, tokenizer = models.load(drafter_spec, home=home, dtype="float32", progress=not quiet)

    def load(kind: tuple[str, str | None]):
        backend, dtype = kind
        if backend == "torch":
            return TorchDraftLM(convert_drafter(copy.deepcopy(model), dtype), dtype)
        if backend == "onnx":
            from omnidraft.drafter.onnx_lm import OnnxDraftLM

            return OnnxDraftLM(export)
        if backend == "native":  # its arithmetic, on the whole head: the kept head rows are the loop's choice of
            lm = native_drafter(drafter_spec, home, quiet=True)[0]  # what to propose, measured in the loop by the
            lm.prune_head = False  # bench (a fresh home's probe would count every first use of a word as a miss)
            return lm
        return gguf_drafter(drafter_spec, home, quiet=True)[0]

    if not quiet:
        notice(f"measuring the drafter on {', '.join(' '.join(filter(None, k)) for k in kinds)} and torch float32 "
               f"(once for this home and CPU)")
    candidates = [choice.Candidate(b, d, lambda k=(b, d): load(k)) for b, d in kinds]
    measures = choice.measure(TorchDraftLM(model, "float32"), candidates, tokenizer)
    picked = choice.BackendChoice(choice.pick(measures), measures, choice.cpu_model(), time.time())
    choice.save_choice(path, picked, key)
    if not quiet:
        notice(picked.why())
    return picked


def gguf_architecture(gguf: Path, home=None) -> str:
    """The adapter fingerprint (module names and shapes) of the torch model a GGUF loads as, without
    loading its weights. Reading the config out of a GGUF takes seconds, so it is kept per file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from omnidraft.fsutil import file_memo

    def derive() -> dict:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with torch.device("meta"):  # shapes and names only: no memory, no weights read
            twin = AutoModelForCausalLM.from_config(config)
        return {"architecture": adapters.architecture_fingerprint(twin)}

    return str(file_memo(gguf, models.models_dir(home) / "architectures", ("architecture",), derive)["architecture"])


def onnx_export_for(drafter_spec: str, backend: str, home=None) -> Path | None:
    """The export folder the drafter runs from on onnxruntime, or None for the torch backend.

    ``auto``: the drafter's export under ``<home>/export/`` when there is one (int8 first), else
    torch; ``onnx``: that export, or a one-line error saying how to make it; a folder: that export."""
    from omnidraft.export.folder import settle
    from omnidraft.identity import spec_slug

    if backend in ("torch", *GGUF_BACKENDS):
        return None
    if backend not in ("auto", "onnx"):
        folder = Path(backend).expanduser()
        settle(folder)
        if not (folder / "manifest.json").is_file():
            raise OmnidraftError(f"--drafter-backend {backend}: no omnidraft export there (run `omnidraft export --out {backend}`)")
        return folder
    for quant in ("int8", "fp32"):
        folder = home_dir(home) / "export" / f"{spec_slug(drafter_spec)}-{quant}"
        settle(folder)  # an export killed mid-replace: put its old or new folder back before looking
        if (folder / "manifest.json").is_file():
            return folder
    if backend == "onnx":
        raise OmnidraftError(f"no ONNX export of {drafter_spec} under {home_dir(home) / 'export'}; "
                             f"run `omnidraft export --drafter {drafter_spec}` first")
    return None


def cost_machine() -> str:
    """What a pair's measured costs depend on beyond the pair and engine: the CPU, torch and the
    native kernels: a change of any of them changes what a step costs."""
    from omnidraft import kernels
    from omnidraft.drafter import choice

    native = kernels.build_dir().name if kernels.linear_rows() is not None else "none"
    if kernels.linear_rows_512() is not None:
        native += f" + {kernels.build_dir('skinny512').name}"
    return f"{choice.cpu_model()}; torch {torch.__version__}; kernels {native}"


def policy_machine(backend: str) -> str:
    """What a pair's drafting costs depend on: :func:`cost_machine`, and for the native drafter its own
    kernel's build (a rebuilt kernel steps and reads at other costs, which are measured again)."""
    from omnidraft import kernels

    machine = cost_machine()
    if backend == "native" and kernels.qdraft() is not None:
        machine += f"; drafter {kernels.build_dir('qdraft').name}"
    return machine


def policy_path(drafter_spec: str, target_spec: str, engine: str, drafter_dtype: str, home=None) -> Path:
    """Where a pair's draft-policy measurements live: they depend on the engine and the drafter's dtype."""
    return models.models_dir(home) / "costs" / f"{pair_slug(drafter_spec, target_spec)}@{engine}-{drafter_dtype}.json"


def precheck_adapter(adapter: str, drafter_dtype: str | None) -> None:
    """What can be checked of an explicit adapter folder before any model is loaded."""
    folder = Path(adapter).expanduser()
    try:
        if drafter_dtype == "int8":
            raise adapters.AdapterProblem(INT8_NO_ADAPTER)
        if not folder.is_dir():
            raise adapters.AdapterProblem(f"no adapter folder at {folder}")
        version_dir = adapters.current_version_dir(folder)
        if version_dir is None:
            raise adapters.AdapterProblem(f"{folder} holds no published adapter")
        adapters.read_meta(version_dir)
    except adapters.AdapterProblem as exc:
        raise OmnidraftError(f"--adapter {adapter}: {exc}") from None


def use_adapter(slot: AdapterSlot, adapter: str, quiet: bool = False) -> None:
    """Load the adapter ``adapter`` names into ``slot`` (see :func:`load_pipeline`).

    An explicit path that is missing, corrupt or made for another pair is an error; with "auto"
    such an adapter is reported in one line and not used.
    """
    if adapter == "none":
        return
    explicit = adapter != "auto"
    folder = Path(adapter).expanduser() if explicit else slot.folder
    try:
        if explicit and not folder.is_dir():
            raise adapters.AdapterProblem(f"no adapter folder at {folder}")
        loaded = adapters.load(folder, slot.identity)
        if loaded is None:
            if explicit:
                raise adapters.AdapterProblem(f"{folder} holds no published adapter")
            return
        slot.use(loaded)
    except (adapters.AdapterProblem, ValueError) as exc:
        if explicit:
            raise OmnidraftError(f"--adapter {adapter}: {exc}") from None
        warn(f"{exc}; running without an adapter (--adapter none hides this)")
        return
    except OSError as exc:  # an adapter folder we may not read
        raise OmnidraftError(f"cannot read the adapter in {folder}: {exc.strerror or exc}") from None
    if not quiet:
        notice(f"adapter {slot.description}")


def encode_prompt(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Target token ids for a prompt: as is (with the tokenizer's BOS rule), or chat-templated.

    A model without a chat template (a base model) gets a plain User:/Assistant: transcript.
    """
    if not chat:
        return list(tokenizer(text)["input_ids"])
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return list(tokenizer("\n".join(lines) + "\nAssistant:")["input_ids"])
