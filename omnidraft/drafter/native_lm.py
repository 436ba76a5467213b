"""The drafter on omnidraft's own native forward: the GGUF's quantized blocks, one C++ call per token.

Drafting is one token at a time, where what costs is everything but the arithmetic: eager torch and
onnxruntime pay per operator (30 layers x ~20 operators for SmolLM2), and llama.cpp rounds activations
to 8 bits, which moves the drafter's top token on a few percent of positions. ``kernels/qdraft.cpp``
runs the whole forward in one call on the GGUF's Q4_1/Q8_0 blocks as they are (nothing dequantized)
with 16-bit activations, so it follows the float32 drafter (the same dequantized weights) closely.
A read of many rows (a prompt) is bound by arithmetic instead: there the products go float32 on
dequantized tiles, or AMX tiles, whichever :func:`choose_long_reads` timed fastest on this CPU.

:class:`NativeDraftLM` is a :class:`~omnidraft.drafter.base.DraftLM`: a float16 KV cache per instance
(``fork`` shares the weights), rollback by truncating the cached ids, and LoRA adapters in peft names
applied as float16 branches in the GGUF's row order (q/k rows permuted as llama.cpp's converter
permutes the base weights, :func:`~omnidraft.adapter.gguf_lora.gguf_tensors`).

Llama-architecture GGUFs whose Linear weights are all Q4_1 or Q8_0 are supported (the builtin
SmolLM2 is); :func:`load_native_model` says why any other is not.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omnidraft.adapter.gguf_lora import GgufShape, gguf_tensors
from omnidraft.kv import common_prefix_len

SUPPORTED_TYPES = {"Q4_1": 3, "Q8_0": 8}  # name -> ggml type id, what qdraft.cpp reads
SLOTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # qdraft.cpp's order
READ_CHUNK = 256  # rows per forward when reading a long context (bounds the scratch memory)
HEAD_ROWS_DIR = Path(__file__).parent / "head_rows"  # shipped starting sets, by vocabulary (scripts/rank_head_rows.py)


class NativeUnsupported(RuntimeError):
    """This GGUF or machine cannot run on the native drafter (the reason is the message)."""


@dataclass(frozen=True)
class NativeModel:
    """Loaded weights shared by every :class:`NativeDraftLM` over them."""

    model: object  # qdraft.Model
    shape: GgufShape
    vocab_size: int
    hidden_size: int
    n_ff: int
    max_positions: int
    path: Path
    head_vocab: HeadVocab | None = None  # the head's kept rows (None: every step takes the whole head)
    vocab_key: str = ""  # names the GGUF's token list (``vocab_key``): a shipped head-row set is made per vocabulary

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """GGUF slot name -> (out, in) of its weight."""
        e, kv = self.hidden_size, self.shape.n_head_kv * (self.hidden_size // self.shape.n_head)
        return {"attn_q": (e, e), "attn_k": (kv, e), "attn_v": (kv, e), "attn_output": (e, e),
                "ffn_gate": (self.n_ff, e), "ffn_up": (self.n_ff, e), "ffn_down": (e, self.n_ff)}


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a GGUF: where its bytes are in the file, what they hold."""

    name: str
    kind: str  # the ggml type's name: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]
    offset: int
    n_bytes: int
    file: np.ndarray  # the whole file, memory-mapped

    @property
    def data(self) -> np.ndarray:
        raw = self.file[self.offset:self.offset + self.n_bytes]
        return raw.view(np.float32) if self.kind == "F32" else raw


@dataclass(frozen=True)
class _GgufIndex:
    """What the native forward reads of a GGUF: its scalar metadata and its tensors' places.

    gguf's ``GGUFReader`` parses every field, the drafter's 49,152 tokens and 48,900 merges among them,
    with numpy views per string: about two seconds of every process that loads the drafter. The index
    it yields is small, so it is kept per file (path, size and mtime) and later loads map the file
    and read the tensors straight from it."""

    fields: dict
    tensors: dict[str, _Tensor]
    vocab: str = ""  # ``vocab_key`` of the token list ("" where the file has none)

    @classmethod
    def load(cls, gguf: Path, memo_dir: Path | None) -> _GgufIndex:
        from omnidraft.fsutil import file_memo

        doc = file_memo(gguf, memo_dir, ("fields", "tensors", "vocab"), lambda: cls._read(gguf))
        fields, tensors = doc["fields"], doc["tensors"]
        file = np.memmap(gguf, mode="r")
        return cls(fields, {name: _Tensor(name, kind, tuple(shape), offset, n_bytes, file)
                            for name, kind, shape, offset, n_bytes in tensors}, doc["vocab"])

    @staticmethod
    def _read(gguf: Path) -> dict:
        from gguf import GGUFReader, GGUFValueType

        reader = GGUFReader(str(gguf))
        fields = {}
        for key, field in reader.fields.items():
            if len(field.types) == 1 and field.types[0] != GGUFValueType.ARRAY:
                value = field.parts[field.data[0]]
                fields[key] = value.tobytes().decode() if field.types[0] == GGUFValueType.STRING else value[0].item()
        tensors = [[t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)]
                   for t in reader.tensors]
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = vocab_key([bytes(tokens.parts[i]) for i in tokens.data]) if tokens is not None else ""
        return {"fields": fields, "tensors": tensors, "vocab": vocab}

    def field(self, key: str):
        if key not in self.fields:
            raise NativeUnsupported(f"the GGUF has no {key}")
        return self.fields[key]


def vocab_key(tokens: Sequence[bytes]) -> str:
    """A name for a token list (sha256 of the tokens, each length-prefixed): two GGUFs of one model, at any
    quantization, share it, so a set of head rows made for one serves the other."""
    digest = hashlib.sha256()
    for token in tokens:
        digest.update(len(token).to_bytes(4, "little") + token)
    return digest.hexdigest()


def head_rows_file(key: str) -> Path:
    """Where the starting set of head rows shipped for vocabulary ``key`` lives (it may not exist)."""
    return HEAD_ROWS_DIR / f"{key[:16]}.bits"


def _blocks(tensor: _Tensor) -> tuple[torch.Tensor, int]:
    kind = tensor.kind
    if kind not in SUPPORTED_TYPES:
        raise NativeUnsupported(f"{tensor.name} is {kind}; the native drafter reads {', '.join(SUPPORTED_TYPES)}")
    return torch.from_numpy(np.ascontiguousarray(tensor.data).reshape(-1).copy()), SUPPORTED_TYPES[kind]


def _floats(tensor: _Tensor) -> torch.Tensor:
    if tensor.kind != "F32":
        raise NativeUnsupported(f"{tensor.name} is {tensor.kind}, not F32")
    return torch.from_numpy(np.asarray(tensor.data, dtype=np.float32).reshape(-1).copy())


def load_native_model(gguf: str | Path, index_dir: Path | None = None) -> NativeModel:
    """Read a llama-architecture GGUF into the native forward; NativeUnsupported says why not.
    ``index_dir``: where the file's index is kept between processes (none: the GGUF is parsed)."""
    from omnidraft import kernels

    module = kernels.qdraft()
    if module is None:
        raise NativeUnsupported(kernels.unsupported_reason() or "the native kernels are not built (run scripts/setup.sh)")
    index = _GgufIndex.load(Path(gguf), index_dir)
    arch = index.field("general.architecture")
    if arch != "llama":
        raise NativeUnsupported(f"the native drafter runs llama-architecture GGUFs, not {arch}")
    n_layers, n_embd = index.field("llama.block_count"), index.field("llama.embedding_length")
    n_head, n_ff = index.field("llama.attention.head_count"), index.field("llama.feed_forward_length")
    n_kv = index.field("llama.attention.head_count_kv")
    eps = index.field("llama.attention.layer_norm_rms_epsilon")
    base = float(index.fields.get("llama.rope.freq_base", 10000.0))
    if index.fields.get("llama.rope.scaling.type") is not None:
        raise NativeUnsupported("rope scaling is not supported by the native drafter")
    tensors = index.tensors
    model = module.Model(n_embd, n_head, n_kv, n_ff, float(eps), base)
    try:
        for i in range(n_layers):
            blocks = [_blocks(tensors[f"blk.{i}.{slot}.weight"]) for slot in SLOTS]
            model.add_layer([b for b, _ in blocks], [t for _, t in blocks], _floats(tensors[f"blk.{i}.attn_norm.weight"]),
                            _floats(tensors[f"blk.{i}.ffn_norm.weight"]))
        embed, embed_type = _blocks(tensors["token_embd.weight"])
        head, head_type = _blocks(tensors["output.weight"]) if "output.weight" in tensors else (embed, embed_type)
        vocab = int(tensors["token_embd.weight"].shape[1])
        model.set_output(embed, embed_type, head, head_type, vocab, _floats(tensors["output_norm.weight"]))
    except KeyError as exc:
        raise NativeUnsupported(f"the GGUF lacks tensor {exc}") from None
    except RuntimeError as exc:  # a shape qdraft.cpp refuses
        raise NativeUnsupported(str(exc).splitlines()[0]) from None
    context = int(index.field("llama.context_length"))
    choose_long_reads(model, vocab)
    return NativeModel(model, GgufShape(arch, n_layers, n_head, n_kv), vocab, n_embd, n_ff, context, Path(gguf),
                       HeadVocab(model, vocab, shipped_base(index.vocab, vocab)), index.vocab)


def shipped_base(key: str, vocab: int) -> np.ndarray | None:
    """The starting head rows shipped for this vocabulary (a mask), or None: none ships, or it does not fit."""
    return read_mask(head_rows_file(key), vocab) if key else None


def read_mask(path: Path, vocab: int) -> np.ndarray | None:
    """The row mask packed in ``path`` (``np.packbits`` of ``vocab`` booleans), or None: no file, or one
    whose length does not fit this vocabulary."""
    try:
        bits = np.unpackbits(np.frombuffer(path.read_bytes(), dtype=np.uint8))
    except OSError:
        return None
    return bits[:vocab].astype(bool) if len(bits) == (vocab + 7) // 8 * 8 else None


class HeadVocab:
    """Which of the LM head's rows a drafter step computes: FR pruning (Algorithm 3 of the RDK paper, after
    FR-Spec), a frequency-ranked base grown by what this home has seen.

    Why: after each verify the target's weights have pushed the drafter's out of the CPU's caches, so a drafter
    step streams its ~96 MB from memory, and the tied head is ~30 MB of it, for 49,152 tokens of which a text
    uses a few thousand. Kept: a base of about a third of the vocabulary, and every token the drafter has read
    in this home (the prompts and the target's outputs), so a Chinese text's byte-level tokens, or a
    codebase's identifiers, are kept once they occur. Steps then give -inf for the other ids: the drafter
    cannot propose them, which costs acceptance only where its top token is one the home never wrote (the
    verifier keeps the output exact either way; docs/performance.md measures how often). The set only grows;
    it is kept in the home between processes (``keep_at``).

    The base is the first third of the ids (a BPE vocabulary's earliest merges, its most frequent pairs), and,
    where a set ships for the drafter's vocabulary (``head_rows/``, scripts/rank_head_rows.py), the tokens the
    drafter put first in a sample of its own text: common words merged late, such as "tuple" or " TODO",
    which the first third misses."""

    def __init__(self, model, vocab: int, base: np.ndarray | None = None) -> None:
        self._model = model
        if base is not None and base.shape != (vocab,):
            raise ValueError(f"a base of {base.shape} rows for a vocabulary of {vocab}")
        self.kept = base.astype(bool) if base is not None else np.arange(vocab) < vocab // 3
        self.version = 0  # grows with every change of ``kept``
        self.path: Path | None = None
        self._rows, self._rows_version = None, -1
        self._saved_version = 0
        self._lock = threading.Lock()

    def add(self, ids: Sequence[int]) -> None:
        """Keep the rows of ``ids`` (tokens the drafter reads) from now on; ValueError for an id outside
        the vocabulary (numpy would take a negative one from the end)."""
        if len(ids) == 1 and 0 <= ids[0] < len(self.kept):
            if self.kept[ids[0]]:  # a drafted token: the common case, decided without numpy's call overhead
                return
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.kept)):
            raise ValueError(f"token id out of range (the drafter's vocabulary has {len(self.kept)})")
        if self.kept[ids].all():
            return
        with self._lock:
            self.kept[ids] = True
            self.version += 1

    def rows(self):
        """The kernel's pruned head for the current set (qdraft.HeadRows), made once per version."""
        with self._lock:
            if self._rows_version != self.version:
                ids = torch.from_numpy(np.flatnonzero(self.kept).astype(np.int64))
                self._rows, self._rows_version = self._model.head_rows(ids), self.version
            return self._rows

    def keep_at(self, path: Path) -> None:
        """Start from the rows kept at ``path`` and write them there when they grew (``save``). A file that
        does not fit this vocabulary is ignored: the set starts again, as on a fresh home."""
        self.path = path
        kept = read_mask(path, len(self.kept))
        if kept is None:
            return
        with self._lock:
            self.kept |= kept
            self.version += 1
            self._saved_version = self.version

    def save(self) -> None:
        """Write the set to ``path`` if it grew since it was read or written (atomically: a crash leaves
        the old file); a read-only home is one line, never an error."""
        if self.path is None or self._saved_version == self.version:
            return
        from omnidraft.console import warn
        from omnidraft.errors import OmnidraftError
        from omnidraft.fsutil import atomic_write

        with self._lock:
            data, version = np.packbits(self.kept).tobytes(), self.version
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, data)
            self._saved_version = version
        except (OSError, OmnidraftError) as exc:  # a read-only home: the rows are read again next time
            warn(f"could not keep the drafter's head rows in {self.path}: {exc}")


CALIBRATION_ROWS = 32  # a short prompt: the read timed on each way, where AMX tiles start (AMX_MIN_ROWS)
_long_reads_chosen: str | None = None  # once per process: the choice is the module's, for every model


def chosen_long_reads() -> str | None:
    """What :func:`choose_long_reads` chose in this process, with its times (None before a model loaded)."""
    return _long_reads_chosen


def choose_long_reads(model, vocab: int) -> str:
    """Time a read of CALIBRATION_ROWS rows on each way of taking a long read's products that this CPU
    has (the integer products, float32 on dequantized tiles, AMX tiles) and keep the fastest for every
    long read of the process; returns what was chosen, with the times.

    Why time: which wins depends on the CPU's float32 and integer throughput (measured on a Sapphire
    Rapids: 67, 43 and 35 ms for 32 rows), not on anything a flag says. Once per process, ~0.5 s."""
    global _long_reads_chosen
    if _long_reads_chosen is not None:
        return _long_reads_chosen
    from omnidraft import kernels

    ext = kernels.qdraft()
    ids = torch.arange(CALIBRATION_ROWS, dtype=torch.int64) % vocab
    threads = torch.get_num_threads()

    def seconds(rows: int, amx: bool) -> float:
        ext.long_read_rows(rows)
        if ext.use_amx(amx) != amx:
            return float("inf")
        times = []
        for _ in range(4):  # the first warms the path up
            start = time.perf_counter()
            ext.Cache(model).forward(ids, 0, threads)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    start = ext.long_read_default  # reads from this many rows may take the float32 products (qdraft.cpp)
    ways = {"integer": seconds(0, False), "float32": seconds(start, False), "amx": seconds(start, True)}
    best = min(ways, key=ways.get)
    ext.long_read_rows(0 if best == "integer" else start)
    ext.use_amx(best == "amx")
    timed = ", ".join(f"{way} {1e3 * s:.0f} ms" for way, s in ways.items() if s != float("inf"))
    _long_reads_chosen = f"{best} ({CALIBRATION_ROWS}-row read: {timed})"
    return _long_reads_chosen


class NativeDraftLM:
    """:class:`~omnidraft.drafter.base.DraftLM` over the native forward (one KV cache per instance)."""

    # a switch between one adapter and the base weights, back and forth, is a swap (``apply_adapter``):
    # the weights choice may alternate them draft by draft (``sources.policy.WeightsChoice``)
    cheap_adapter_switch = True

    def __init__(self, weights: NativeModel, n_threads: int | None = None) -> None:
        from omnidraft import kernels

        self.weights = weights
        self.vocab_size, self.hidden_size, self.max_positions = weights.vocab_size, weights.hidden_size, weights.max_positions
        self.n_threads = n_threads or torch.get_num_threads()
        self._cache = kernels.qdraft().Cache(weights.model)
        self._head_version = -1  # the head_vocab version this cache's pruned head was set from (-1: whole head)
        self.prune_head = weights.head_vocab is not None  # steps take only the kept head rows (HeadVocab)
        self._ids: list[int] = []
        self._hidden = torch.zeros(self.hidden_size)
        # the live adapter: (its state, as the caller holds it; its LoRA pairs; scaling). ``apply_adapter(None)``
        # sets it aside (``_stashed``) rather than dropping it, so a switch back to the same state object costs
        # a swap, not a conversion
        self._adapter: tuple[dict[str, torch.Tensor], dict, float] | None = None
        self._stashed: tuple[dict[str, torch.Tensor], dict, float] | None = None

    @property
    def cached_ids(self) -> list[int]:
        return self._ids

    @property
    def gguf_path(self) -> Path:
        return self.weights.path

    @property
    def last_hidden(self) -> torch.Tensor:
        return self._hidden

    def _feed(self, ids: Sequence[int]) -> torch.Tensor:
        if len(self._ids) + len(ids) > self.max_positions:
            raise ValueError(f"the drafter's context is {self.max_positions} tokens")
        self._sync_head(ids)
        logits = None
        for start in range(0, len(ids), READ_CHUNK):
            chunk = list(ids[start:start + READ_CHUNK])
            logits = self._cache.forward(torch.tensor(chunk, dtype=torch.int64), len(self._ids), self.n_threads)
            self._ids.extend(chunk)
        self._hidden = self._cache.hidden.clone()
        return logits

    def _sync_head(self, ids: Sequence[int]) -> None:
        """Keep the rows of the tokens about to be read, and give the cache the current pruned head."""
        vocab = self.weights.head_vocab
        if not self.prune_head or vocab is None:
            if self._head_version != -1:
                self._cache.set_head(None)
                self._head_version = -1
            return
        vocab.add(ids)
        if self._head_version != vocab.version:
            self._cache.set_head(vocab.rows())
            self._head_version = vocab.version

    def keep_rows(self, ids: Sequence[int]) -> None:
        """Keep the head rows of ``ids`` although they are not read (a healed token, which the draft spells again)."""
        if self.weights.head_vocab is not None:
            self.weights.head_vocab.add(ids)

    def save_head_vocab(self) -> None:
        """Keep the head rows this home has seen (the drafter source calls it after each request)."""
        if self.weights.head_vocab is not None:
            self.weights.head_vocab.save()

    def logits_for(self, ids: Sequence[int]) -> torch.Tensor:
        ids = list(ids)
        if not ids:
            raise ValueError("logits_for needs at least one id")
        keep = min(common_prefix_len(self._ids, ids), len(ids) - 1)  # the last id is always fed: its row is wanted
        del self._ids[keep:]
        return self._feed(ids[keep:])

    def step(self, token: int) -> torch.Tensor:
        return self._feed([token])

    def reset(self) -> None:
        self._ids = []

    def drop(self, start: int, n: int) -> None:
        """Forget cached positions [start, start + n); the later ones move down, keys re-rotated
        (``Cache::drop``): a window that slides keeps what it still covers instead of reading it again."""
        if not 0 <= start <= start + n <= len(self._ids):
            raise ValueError(f"cannot drop positions {start}..{start + n} of {len(self._ids)}")
        self._cache.drop(start, n, len(self._ids))
        del self._ids[start:start + n]

    def fork(self) -> NativeDraftLM:
        """Another drafter over the same weights with a KV cache of its own, and this one's adapter."""
        fork = NativeDraftLM(self.weights, self.n_threads)
        fork.prune_head = self.prune_head
        if self._adapter is not None:
            fork._use(*self._adapter[1:])
            fork._adapter = self._adapter
        return fork

    def apply_adapter(self, state: dict[str, torch.Tensor] | None, scaling: float = 1.0, keep_cache: bool = False) -> None:
        """Use LoRA tensors (peft names) scaled by ``scaling``; None: the base weights. A state that does
        not fit raises ValueError before anything changes. ``keep_cache``: see ``DraftLM.apply_adapter``."""
        if state is None:
            if self._adapter is not None and self._stashed is None:  # set aside: the way back is a swap
                self._cache.swap_lora()
                self._stashed = self._adapter
            else:
                self._use({}, 0.0)
            self._adapter = None
        elif self._adapter is None and self._stashed is not None and state is self._stashed[0] \
                and self._stashed[2] == float(scaling):  # the adapter set aside: swapped back in
            self._cache.swap_lora()
            self._adapter, self._stashed = self._stashed, None
        else:
            pairs = self._pairs(state)
            self._use(pairs, float(scaling))
            self._adapter = (state, pairs, float(scaling))
        if not keep_cache:
            self.reset()  # the cached keys were computed under the old weights

    def _use(self, pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        self._cache.clear_lora()
        self._cache.clear_stash()  # any adapter set aside is replaced (only the newest version runs again)
        self._stashed = None
        for (layer, slot), (a, b) in pairs.items():
            self._cache.set_lora(layer, slot, a, b, scaling)

    def _pairs(self, state: dict[str, torch.Tensor]) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """(layer, slot) -> (A, B) in the GGUF's row order, every shape checked against the weights."""
        shape = self.weights.shape
        try:
            tensors = gguf_tensors(state, shape)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"the adapter does not fit the drafter: {exc}") from None
        dims = self.weights.linear_shapes
        pairs = {}
        for name, a in tensors.items():
            if not name.endswith(".lora_a"):
                continue
            parts = name.split(".")  # blk.N.<slot>.weight.lora_a
            if parts[0] != "blk" or parts[2] not in SLOTS or not parts[1].isdigit() or int(parts[1]) >= shape.n_layers:
                raise ValueError(f"the native drafter takes LoRA on its attention and MLP layers only, not {name}")
            b = tensors[name[: -len("lora_a")] + "lora_b"]
            out, inp = dims[parts[2]]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
                raise ValueError(f"{name}: LoRA shapes {tuple(a.shape)} / {tuple(b.shape)} do not fit a [{out}, {inp}] weight")
            pairs[(int(parts[1]), SLOTS.index(parts[2]))] = (a.float().contiguous(), b.float().contiguous())
        return pairs
