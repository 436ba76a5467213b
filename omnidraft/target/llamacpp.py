"""A GGUF model on llama.cpp (through llama-cpp-python, in-process) as the target.

Only llama-cpp-python's low-level C API is used: one model, one context, one reusable
``llama_batch``. Each :meth:`LlamaCppTarget.score` call rolls the KV cache back to the common prefix
of what it holds and the new ids (``llama_memory_seq_rm``), then evaluates the rest, flagging
logits only for the last m + 1 positions: a prompt in chunks of ``n_batch``, proposals in evals of
at most ``logit_batch`` rows. The rows are copied once, straight from llama.cpp's output buffer into a torch tensor.
``Llama(logits_all=True)`` is avoided on purpose: it keeps an n_ctx x n_vocab float32 buffer
(2.5 GB for Qwen's vocabulary at n_ctx = 4096).

Defaults for a small CPU machine: ``n_threads`` = physical cores of this process's CPUs, at most 4
(llama.cpp's kernels are compute-bound; hyper-threads and more threads than cores only add
contention); ``n_ctx`` = 4096 capped by the model's training context (the KV cache then costs
12-28 MB per 1k positions for the builtin models, and every builtin was trained on 32k).
``swa_full`` stays on so that Gemma-3's sliding-window layers keep every position and a rollback
is exact beyond the window.

Batch invariance: llama.cpp's fast CPU matmuls pick kernels by batch size (llamafile's tinyBLAS
from 2 rows, repacked weights' gemm from 4, ggml's tiled matmul from 8), so on a default build the
m + 1 rows of one verify eval round differently from m + 1 one-token evals, and at a near-tie the
argmax flips: speculative greedy output then drifts from plain greedy output. ``scripts/setup.sh``
builds llama.cpp with a one-line patch (``scripts/patch_llamacpp.py``): tinyBLAS runs only evals of
at least :data:`TINYBLAS_MIN_ROWS` rows. The target reads a prompt as llama.cpp does (at tinyBLAS
speed) and evaluates proposals in evals below that size with weights unrepacked and the tiled
matmul off, so their rows take ggml's one-token ``vec_dot`` arithmetic and are bit-identical to
one-token evals. A prompt's KV is the same in every run that reads the same span, which
:meth:`LlamaCppTarget.trim` keeps true across requests (see :meth:`LlamaCppTarget._invariance`;
docs/performance.md has the measured differences and costs).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnidraft.errors import OmnidraftError
from omnidraft.kv import common_prefix_len

PIP_INSTALL = "pip install llama-cpp-python==0.3.36"
DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512
MAX_DEFAULT_THREADS = 4

INVARIANT_BUILD = ("bash scripts/setup.sh (it rebuilds llama-cpp-python with a patched llamafile), or: "
                   'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --force-reinstall --no-cache-dir --no-binary '
                   "llama-cpp-python llama-cpp-python==0.3.36 (prompts are then read 1.5x slower)")
# The patched build (scripts/patch_llamacpp.py) runs llamafile's tinyBLAS only for evals of at least
# this many rows: prompt reads. Every eval with logits stays below it (``score`` splits a longer one).
TINYBLAS_MIN_ROWS = 32
TINYBLAS_ENV = "GGML_LLAMAFILE_MIN_ROWS"

_LOG: deque[tuple[int, str]] = deque(maxlen=64)  # llama.cpp's recent log lines, never printed
_LOG_CALLBACK = None  # the ctypes callback must outlive every call into llama.cpp
_BACKEND_READY = False
_HAS_LLAMAFILE: bool | None = None
_TINYBLAS_MIN_ROWS = 0  # what the loaded build reports (0: no patch, tinyBLAS from 2 rows if it has llamafile)
# Whether the loaded build has scripts/patch_llamacpp.py's multi-row kernels (x86 with AVX2;
# scripts/llamacpp_cols.c): each verified row of Q5_0/Q8_0/Q4_K/Q6_K weights then costs a fraction of a
# one-token eval, and is bit for bit the same row
_MULTI_ROW = False
# A build with ggml's AMX kernels (x86 -march=native on Sapphire Rapids and later) repacks Q4_K/Q8_0
# weights into AMX buffers and crashes in the first eval (llama.cpp issue 20824): such a build loads
# weights without extra buffer types. scripts/setup.sh builds without AMX, so this is for other builds.
_HAS_AMX: bool = False


def _llama_cpp():
    """Import llama_cpp, silence its logging and initialise the backend once."""
    global _LOG_CALLBACK, _BACKEND_READY
    try:
        import llama_cpp
    except ImportError:
        raise OmnidraftError(f"the llama.cpp backend needs llama-cpp-python; run: {PIP_INSTALL}") from None
    except OSError as exc:  # the shared library is there but cannot be loaded (wrong CPU, missing libgomp)
        raise OmnidraftError(f"llama-cpp-python is installed but its library does not load ({exc}); "
                             f"rebuild it on this machine: pip install --force-reinstall --no-cache-dir "
                             f"llama-cpp-python==0.3.36") from None
    if _LOG_CALLBACK is None:
        @llama_cpp.llama_log_callback
        def _keep_log(level: int, text: bytes, user_data) -> None:  # must never raise into C
            _LOG.append((int(level), (text or b"").decode("utf-8", "replace")))

        _LOG_CALLBACK = _keep_log
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))  # re-set: importing llama_cpp installs a printer
    if not _BACKEND_READY:
        global _HAS_LLAMAFILE, _HAS_AMX, _TINYBLAS_MIN_ROWS, _MULTI_ROW
        info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
        _HAS_LLAMAFILE = "LLAMAFILE = 1" in info
        _HAS_AMX = "AMX_INT8 = 1" in info
        if _HAS_LLAMAFILE:
            _TINYBLAS_MIN_ROWS = _patched_min_rows(llama_cpp)
        _MULTI_ROW = _cpu_export(llama_cpp, "ggml_cpu_omnidraft_multi_row", ctypes.c_int) == 1
        if not _HAS_LLAMAFILE or _TINYBLAS_MIN_ROWS >= 2:
            # a build that can serve batch-invariant targets: ggml's tiled matmul (batches of 8+)
            # must be off too, and ggml reads this switch once, at the process's first matmul
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")
        llama_cpp.llama_backend_init()
        _BACKEND_READY = True
    return llama_cpp


def _patched_min_rows(llama_cpp) -> int:
    """The tinyBLAS row threshold of a build patched by scripts/patch_llamacpp.py (0 for a stock build).

    The patch reads :data:`TINYBLAS_ENV` once, at its first matmul: it is set here, before any eval,
    unless the user set it. A threshold below 2 leaves the build as released."""
    os.environ.setdefault(TINYBLAS_ENV, str(TINYBLAS_MIN_ROWS))
    return _cpu_export(llama_cpp, "ggml_cpu_llamafile_min_rows", ctypes.c_int64)


def _cpu_export(llama_cpp, name: str, restype: type) -> int:
    """What the loaded ggml CPU library's exported ``name()`` returns (one of the patch's queries); 0
    when no library there exports it (a stock build)."""
    base = Path(getattr(llama_cpp.llama_cpp, "_base_path", Path(llama_cpp.__file__).parent / "lib"))
    for lib in sorted(base.glob("*ggml-cpu*")):
        try:
            fn = getattr(ctypes.CDLL(str(lib)), name, None)
        except OSError:
            continue
        if fn is not None:
            fn.restype = restype
            return int(fn())
    return 0


def use_extra_buffers(batch_invariant: bool = False) -> bool:
    """Whether llama.cpp may repack weights into extra buffer types: not for a batch-invariant target
    (repacked weights use gemm for 4+ rows, gemv for fewer), nor with a build's AMX kernels (they crash)."""
    return not batch_invariant and not _HAS_AMX


GGML_LOG_LEVEL_ERROR = 4  # ggml.h of the llama.cpp inside llama-cpp-python 0.3.36 (NONE, DEBUG, INFO, WARN, ERROR, CONT)


def _last_error() -> str:
    """What llama.cpp last logged as an error, as one short line ("error loading model: X" -> X)."""
    errors = [text.strip() for level, text in _LOG if level == GGML_LOG_LEVEL_ERROR and text.strip()]
    for line in errors:
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip().splitlines()[0][:200]
    return errors[-1].splitlines()[-1][:200] if errors else ""


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((base.joinpath("physical_package_id").read_text().strip(), base.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def default_threads() -> int:
    return max(1, min(MAX_DEFAULT_THREADS, physical_cores()))


def check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise OmnidraftError(f"no GGUF file at {path}; give the path of a .gguf model file")
    if not path.is_file():
        raise OmnidraftError(f"{path} is not a file; give the path of a .gguf model file")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise OmnidraftError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    if magic != b"GGUF":
        raise OmnidraftError(f"{path} is not a GGUF file (it starts with {magic!r}); give a .gguf model file")


def _free(llama_cpp, handles: dict) -> None:
    """Release the batch, context and model (weakref finalizer: must not reference the target)."""
    if handles.get("batch") is not None:
        llama_cpp.llama_batch_free(handles.pop("batch"))
    if handles.get("ctx") is not None:
        llama_cpp.llama_free(handles.pop("ctx"))
    if handles.get("lora") is not None:  # after the context that uses it, before the model it belongs to
        llama_cpp.llama_adapter_lora_free(handles.pop("lora"))
    if handles.get("model") is not None:
        llama_cpp.llama_model_free(handles.pop("model"))


class LlamaCppTarget:
    """:class:`~omnidraft.target.base.Target` over a GGUF file run by llama.cpp on this machine.

    ``LlamaCppTarget(gguf_path, tokenizer, *, n_ctx=None, n_threads=None, eos_ids=None)``

    - ``tokenizer``: the target's transformers tokenizer (text and the vocabulary bridge; llama.cpp's
      own tokenizer is not used, ids are passed through).
    - ``n_ctx``: positions the KV cache holds (default min(4096, the model's training context));
      ``max_context`` reports it.
    - ``n_threads``: default :func:`default_threads` (physical cores, at most 4).
    - ``eos_ids``: ids that end generation; default the tokenizer's generation config / eos token.
      llama.cpp's eos and eot tokens are always added.
    - ``n_batch``: tokens per ``llama_decode`` when reading a long prompt (512).
    - ``flash_attn``: llama.cpp's flash attention (off, as in ``Llama``'s default).
    - ``batch_invariant``: verify rows bit-identical to one-token rows (see :meth:`_invariance`);
      default: whenever the installed build allows it.
    - ``model_from``: share that target's loaded weights, with a KV cache of this one's own (the
      gRPC server's sessions); see :meth:`session`.
    """

    def __init__(self, gguf_path: str | os.PathLike, tokenizer: Any, *, n_ctx: int | None = None,
                 n_threads: int | None = None, eos_ids: Iterable[int] | None = None,
                 n_batch: int = DEFAULT_N_BATCH, flash_attn: bool = False,
                 batch_invariant: bool | None = None, model_from: LlamaCppTarget | None = None) -> None:
        path = Path(gguf_path).expanduser()
        check_gguf_file(path)
        lc = _llama_cpp()
        self._lc = lc
        self.path = path
        self.tokenizer = tokenizer
        self.n_threads = int(n_threads) if n_threads else default_threads()
        if self.n_threads < 1:
            raise OmnidraftError(f"n_threads must be >= 1, got {n_threads}")
        handles: dict = {}
        self._handles = handles
        self._finalizer = weakref.finalize(self, _free, lc, handles)

        self.batch_invariant = self._invariance(batch_invariant)
        if model_from is not None:  # a second context (another session) over the same weights
            model = model_from._handles["model"]
            self._owner = model_from  # the weights are freed with their owner, never before this context
        else:
            mparams = lc.llama_model_default_params()
            mparams.n_gpu_layers = 0
            mparams.use_extra_bufts = use_extra_buffers(self.batch_invariant)
            _LOG.clear()
            model = lc.llama_model_load_from_file(str(path).encode(), mparams)
            if not model:
                raise OmnidraftError(self._load_failure(path))
            handles["model"] = model
        self._model = model  # adapters are loaded against the weights, shared or owned
        self.architecture = self._meta(model, "general.architecture")
        self.n_embd = int(lc.llama_model_n_embd(model))

        self.n_ctx_train = int(lc.llama_model_n_ctx_train(model)) or DEFAULT_N_CTX
        if n_ctx is None:
            n_ctx = min(DEFAULT_N_CTX, self.n_ctx_train)
        elif n_ctx < 1:
            raise OmnidraftError(f"n_ctx must be >= 1, got {n_ctx}")
        elif n_ctx > self.n_ctx_train:
            raise OmnidraftError(f"n_ctx {n_ctx} exceeds the {self.n_ctx_train} positions {path.name} was trained "
                                 f"for; give n_ctx <= {self.n_ctx_train}")
        self.n_batch = max(1, min(int(n_batch), int(n_ctx)))
        # rows with logits per eval: below tinyBLAS's threshold on a patched build, so each takes the
        # one-token arithmetic (a llamafile-free build has no batched kernel to avoid)
        small = _HAS_LLAMAFILE and _TINYBLAS_MIN_ROWS >= 2 and self.batch_invariant
        self.logit_batch = min(self.n_batch, _TINYBLAS_MIN_ROWS - 1) if small else self.n_batch

        cparams = lc.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.swa_full = True  # sliding-window layers keep all positions: exact rollback past the window
        cparams.no_perf = True
        _LOG.clear()
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            why = _last_error()
            raise OmnidraftError(f"llama.cpp could not create a context for {path.name} with n_ctx={n_ctx}"
                                 f"{f' ({why})' if why else ''}; try a smaller n_ctx")
        handles["ctx"] = ctx
        self._ctx = ctx
        self.max_context = min(int(n_ctx), int(lc.llama_n_ctx(ctx)))  # llama.cpp may round n_ctx up (to 256)
        self._memory = lc.llama_get_memory(ctx)

        vocab = lc.llama_model_get_vocab(model)
        self.vocab_size = int(lc.llama_vocab_n_tokens(vocab))
        self.eos_ids = self._eos_ids(lc, vocab, tokenizer, eos_ids)

        batch = lc.llama_batch_init(self.n_batch, 0, 1)
        handles["batch"] = batch
        self._batch = batch
        for i in range(self.n_batch):  # every token belongs to sequence 0, set once
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        self._tok = np.ctypeslib.as_array(batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(batch.pos, shape=(self.n_batch,))
        self._want = np.ctypeslib.as_array(batch.logits, shape=(self.n_batch,))
        self._arange = np.arange(self.max_context + self.n_batch, dtype=np.int32)
        self._row_bytes = self.vocab_size * 4
        self._decode = lc.llama_decode
        self._get_logits = lc.llama_get_logits
        self.cached_ids: list[int] = []
        self.reset()

    # ------------------------------------------------------------------------------ loading

    def _load_failure(self, path: Path) -> str:
        why = _last_error()
        if why.startswith("unknown model architecture"):
            return f"llama.cpp cannot run {path.name}: {why}; run this model on the torch target instead"
        return (f"llama.cpp could not load {path.name}{f' ({why})' if why else ''}: the file is truncated or corrupt; "
                f"download or reinstall it")

    @staticmethod
    def _invariance(requested: bool | None) -> bool:
        """Batch invariance: the k + 1 rows of one verify eval are bit-identical to k + 1
        one-token evals, so speculative greedy output equals plain greedy output exactly.

        The fast CPU matmuls pick kernels by batch size (see the module docstring). Invariance
        needs a build whose llamafile is patched to leave small evals alone, or one without
        llamafile (:data:`INVARIANT_BUILD`), weights not repacked and ``GGML_CPU_TILED_MM=0``.
        ``None`` turns it on exactly when the build allows it."""
        tiled = os.environ.get("GGML_CPU_TILED_MM", "1")
        kernels = not _HAS_LLAMAFILE or _TINYBLAS_MIN_ROWS >= 2
        possible = kernels and tiled.strip() == "0"
        if requested is None:
            return possible
        if requested and not possible:
            if not kernels:
                raise OmnidraftError(f"batch-invariant verification needs llama-cpp-python built with the patched "
                                     f"llamafile or without it; run: {INVARIANT_BUILD}")
            raise OmnidraftError(f"batch-invariant verification needs GGML_CPU_TILED_MM=0 (it is {tiled!r}); "
                                 f"unset it before the first llama.cpp call")
        return bool(requested)

    def _meta(self, model, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_model_meta_val_str(model, key.encode(), buf, ctypes.sizeof(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else ""

    @staticmethod
    def _eos_ids(lc, vocab, tokenizer, eos_ids) -> frozenset[int]:
        ids: set[int] = set()
        if eos_ids is not None:
            ids.update(int(i) for i in eos_ids)
        else:
            ids.update(_tokenizer_eos(tokenizer))
        for tok in (lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab)):
            if tok is not None and int(tok) >= 0:
                ids.add(int(tok))
        return frozenset(ids)

    # ---------------------------------------------------------------------------- the target

    def session(self) -> LlamaCppTarget:
        """Another target over the same weights with its own context (KV cache)."""
        return LlamaCppTarget(self.path, self.tokenizer, n_ctx=self.max_context, n_threads=self.n_threads,
                              eos_ids=self.eos_ids, n_batch=self.n_batch, batch_invariant=self.batch_invariant,
                              model_from=self)

    def attention_dims(self) -> tuple[int, int, int]:
        """(layers, attention heads, key/value heads) of the loaded weights."""
        lc, model = self._lc, self._model
        return int(lc.llama_model_n_layer(model)), int(lc.llama_model_n_head(model)), int(lc.llama_model_n_head_kv(model))

    def use_lora(self, path: Path | None, scale: float = 1.0) -> None:
        """Load the GGUF LoRA at ``path`` and make it this context's only adapter, scaled by ``scale``
        (None: the base weights). The previous adapter is freed once the new one is set; the KV cache
        is left as it is (the caller resets it: it was computed with the old weights)."""
        lc = self._lc
        new = None
        if path is not None:
            _LOG.clear()
            new = lc.llama_adapter_lora_init(self._model, str(path).encode())
            if not new:
                raise OmnidraftError(f"llama.cpp could not load the LoRA adapter {Path(path).name}: "
                                     f"{_last_error() or 'no reason given'}")
        adapters = (lc.llama_adapter_lora_p_ctypes * 1)(new) if new else None
        scales = (ctypes.c_float * 1)(scale) if new else None
        lc.llama_set_adapters_lora(self._ctx, adapters, 1 if new else 0, scales)
        old = self._handles.pop("lora", None)
        if old is not None:
            lc.llama_adapter_lora_free(old)
        if new is not None:
            self._handles["lora"] = new

    def reset(self) -> None:
        """Forget the KV cache."""
        self._lc.llama_memory_clear(self._memory, True)
        self.cached_ids = []

    def close(self) -> None:
        """Free the llama.cpp model and context now (also done when the target is collected)."""
        self._finalizer()

    def __enter__(self) -> LlamaCppTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, ids: Sequence[int], num_proposed: int) -> torch.Tensor:
        """float32 [num_proposed + 1, vocab_size]: logits predicting the token after each of the
        last num_proposed + 1 ids, from evaluating what the cache does not hold.

        Unread context of two or more tokens (a prompt, a new chat turn) is read the way llama.cpp
        reads a prompt: chunks of ``n_batch``, logits for its last token only. The proposals (with
        the last context token when it is the only one unread) go in evals of at most
        ``logit_batch`` rows, which on the patched build keep ggml's one-token kernels: a verify's
        rows are then bit-identical to decoding the same tokens one at a time."""
        n = len(ids)
        rows = num_proposed + 1
        if n == 0:
            raise ValueError("score needs at least one token id")
        if n > self.max_context:
            raise OmnidraftError(f"{n} tokens do not fit the llama.cpp context of {self.max_context} positions; "
                                 f"shorten the prompt or the output, or give a larger n_ctx "
                                 f"(up to {self.n_ctx_train})")
        if rows < 1 or rows > n:
            raise ValueError(f"num_proposed must be in [0, {n - 1}], got {num_proposed}")
        if not isinstance(ids, list):
            ids = list(ids)
        keep = min(common_prefix_len(self.cached_ids, ids), n - rows)  # the last `rows` are always recomputed
        if keep < len(self.cached_ids):
            self._rollback(keep)
            keep = len(self.cached_ids)  # 0 when this memory could not drop a suffix
        new = ids[keep:]
        unread = len(new) - num_proposed  # context tokens the cache lacks: at least the last one
        out = torch.empty((rows, self.vocab_size), dtype=torch.float32)
        start = done = 0
        if unread > 1:  # a prompt: read as llama.cpp reads one (chunks of n_batch, logits for the last token)
            for i in range(0, unread, self.n_batch):
                chunk = new[i:min(i + self.n_batch, unread)]
                self._eval(chunk, keep + i, 1 if i + len(chunk) == unread else 0)
            self._copy_rows(out, 0, 1)
            start, done = unread, 1
        for j in range(start, len(new), self.logit_batch):  # the proposals: the one-token arithmetic
            part = new[j:j + self.logit_batch]
            self._eval(part, keep + j, len(part))
            self._copy_rows(out, done, len(part))
            done += len(part)
        return out

    def step(self, token: int) -> torch.Tensor:
        """[vocab] float32 logits after feeding one token behind the cached ones (a drafter's hot
        path: no prefix comparison)."""
        self._eval([int(token)], len(self.cached_ids), 1)
        out = torch.empty(self.vocab_size, dtype=torch.float32)
        ctypes.memmove(out.data_ptr(), self._get_logits(self._ctx), self._row_bytes)
        return out

    def keep_hidden(self, on: bool) -> None:
        """Whether the following evals also keep the final hidden state (the LM head's input).
        llama.cpp then outputs every row of an eval, so a drafter turns it on for one-token steps only."""
        self._lc.llama_set_embeddings(self._ctx, bool(on))

    def hidden_state(self) -> torch.Tensor:
        """[n_embd] float32: the last eval's final hidden state (after :meth:`keep_hidden`)."""
        ptr = self._lc.llama_get_embeddings_ith(self._ctx, -1)
        if not ptr:
            raise OmnidraftError("llama.cpp kept no hidden state for the last eval")
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy())

    def _copy_rows(self, out: torch.Tensor, first: int, n: int) -> None:
        """The last eval's ``n`` logit rows into ``out[first:first + n]``, one copy from llama.cpp's buffer."""
        ctypes.memmove(out[first].data_ptr(), self._get_logits(self._ctx), n * self._row_bytes)

    def trim(self, keep: int) -> None:
        """Drop cached positions from ``keep`` on. The decoder calls it when a request ends, with the
        length of what a target decoding alone would hold then (everything but the last token): a
        verify may have cached proposals past the end (an end-of-sequence token and what followed),
        and the next request must read the same span as the target alone would, in the same evals,
        for its prompt's KV to be the same."""
        keep = max(0, int(keep))
        if keep < len(self.cached_ids):
            self._rollback(keep)

    def drop(self, start: int, n: int) -> None:
        """Forget cached positions [start, start + n) and move the later ones down by n: llama.cpp
        re-rotates their keys at the next eval (its context shift). For a drafter's sliding window; a
        target that must stay exact never calls it (the moved keys saw the dropped positions)."""
        if not 0 <= start <= start + n <= len(self.cached_ids):
            raise ValueError(f"cannot drop positions {start}..{start + n} of {len(self.cached_ids)}")
        if n == 0:
            return
        if not self._lc.llama_memory_seq_rm(self._memory, 0, start, start + n):
            self._rollback(start)  # this memory cannot drop a span: the rest is read again
            return
        self._lc.llama_memory_seq_add(self._memory, 0, start + n, -1, -n)
        del self.cached_ids[start:start + n]

    def _rollback(self, keep: int) -> None:
        if not self._lc.llama_memory_seq_rm(self._memory, 0, keep, -1):
            # this memory cannot drop a suffix (recurrent state): start over from empty
            self._lc.llama_memory_clear(self._memory, True)
            self.cached_ids = []
            return
        del self.cached_ids[keep:]

    def _eval(self, tokens: list[int], start: int, n_logits: int) -> None:
        """One llama_decode of ``tokens`` at positions start.., logits for the last ``n_logits``."""
        n = len(tokens)
        batch = self._batch
        if n == 1:
            batch.token[0] = tokens[0]
            batch.pos[0] = start
            batch.logits[0] = 1 if n_logits else 0
        else:
            self._tok[:n] = tokens
            self._pos[:n] = self._arange[start:start + n]
            want = self._want
            want[:n - n_logits] = 0
            want[n - n_logits:n] = 1
        batch.n_tokens = n
        rc = self._decode(self._ctx, batch)
        if rc != 0:
            # the cache may hold part of the batch now: drop everything past what we know
            self._lc.llama_memory_seq_rm(self._memory, 0, start, -1)
            if rc == 1:
                raise OmnidraftError(f"llama.cpp found no room in its KV cache for {n} more tokens after {start}; "
                                     f"give a larger n_ctx")
            if rc == 2:
                raise OmnidraftError("llama.cpp evaluation was aborted; try again")
            why = _last_error()
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise OmnidraftError(f"token id {bad[0]} is outside the target's vocabulary of {self.vocab_size}; "
                                     f"check that the tokenizer matches {self.path.name}")
            raise OmnidraftError(f"llama.cpp failed to evaluate {n} tokens (llama_decode returned {rc}"
                                 f"{f': {why}' if why else ''})")
        self.cached_ids.extend(tokens)

    # ------------------------------------------------------------------------------- costs

    def measure_costs(self, ks: Sequence[int] = (1, 2, 3, 4, 6, 8), context: int = 120, repeats: int = 7,
                      warmup: int = 2) -> dict[int, float]:
        """Median milliseconds of one ``score`` eval of k new tokens (logits for all k rows) after
        ``context`` cached tokens: the verify cost table (k new tokens verify k - 1 proposals; see
        :meth:`omnidraft.costs.VerifyCosts.from_eval_ms`). The ks are interleaved within each repeat
        so that machine noise spreads over all of them. Leaves the target reset."""
        ks = sorted({int(k) for k in ks})
        if not ks or ks[0] < 1:
            raise ValueError("ks must be positive token counts")
        if context + ks[-1] > self.max_context:
            raise OmnidraftError(f"context {context} + {ks[-1]} tokens exceeds n_ctx {self.max_context}")
        ids = self._sample_ids(context + ks[-1])
        prefix = ids[:context]
        times: dict[int, list[float]] = {k: [] for k in ks}
        try:
            self.reset()
            self.score(prefix, 0)
            for r in range(warmup + repeats):
                order = ks[r % len(ks):] + ks[:r % len(ks)]
                for k in order:
                    self._rollback(context)
                    seq = ids[:context + k]
                    t0 = time.perf_counter()
                    self.score(seq, k - 1)
                    elapsed = time.perf_counter() - t0
                    if r >= warmup:
                        times[k].append(elapsed * 1000.0)
        finally:
            self.reset()
        return {k: statistics.median(v) for k, v in times.items()}

    def _sample_ids(self, count: int) -> list[int]:
        """Natural-text token ids for timing (any ids would do; text keeps attention realistic)."""
        text = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
                "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
                "The quick brown fox jumps over the lazy dog while the committee reviews the budget. ")
        ids: list[int] = []
        try:
            piece = list(self.tokenizer.encode(text, add_special_tokens=False))
        except (AttributeError, TypeError, ValueError):  # no usable tokenizer: any ids will do
            piece = []
        piece = [t for t in piece if 0 <= t < self.vocab_size] or list(range(100, 200))
        while len(ids) < count:
            ids.extend(piece)
        return ids[:count]


def _tokenizer_eos(tokenizer: Any) -> set[int]:
    """EOS ids from the tokenizer's folder generation config (what the torch target uses), else its eos token."""
    ids: set[int] = set()
    source = getattr(tokenizer, "name_or_path", None)
    if source and Path(source).is_dir() and (Path(source) / "generation_config.json").is_file():
        try:
            import json

            eos = json.loads((Path(source) / "generation_config.json").read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else [int(e) for e in eos or []])
        except (OSError, ValueError, TypeError):
            pass
    if not ids:
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
    return ids
