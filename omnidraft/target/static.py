"""A static-shape decoder engine for a GPU, in the style of gpt-fast's ``generate.py``.

Why it exists: eager transformers on a GPU spends a step in kernel launches (hundreds per
forward), so a 0.5B model's step costs several ms where its arithmetic takes well under one.
A CUDA graph replays the whole forward in one launch, but it needs fixed shapes and fixed
addresses: a KV cache allocated once (static), and forwards of a fixed number of rows.

Every forward therefore has one of two shapes, its *class*:

* ``DECODE_ROWS`` rows: plain steps and verifies (the last emitted token and the proposals);
* ``PREFILL_ROWS`` rows: reads of two or more new context tokens (a prompt, a chat's next turn).

A read is padded to its class's rows and cut into several forwards when longer. Padding rows
write their keys and values to one spare cache slot no real row attends to.

**Batch invariance.** Inside one class every forward has the same shapes, and a row's arithmetic
(its GEMM dot products, its attention over the cache) does not depend on the other rows. So a
token's KV entry and logits are the same bits whether it was read alone in a plain step or among
proposals in a verify: greedy speculative output equals this engine's own greedy output, token for
token, in bf16 too (an eager engine computes a 9-row verify with other kernels than a 1-row step
and differs at near-ties). The price is that a plain step pays for ``DECODE_ROWS`` rows; on a GPU
that is memory-bound at these sizes (docs/remote.md has the measured step costs).

**Sessions together.** A :class:`SessionPool` holds several sessions' caches in one tensor, so a
server can serve every session that has work in one forward (``serve --batch``,
:func:`logits_together`): on a GPU in padded classes of 1, 2, 4… sessions, each allowed only where it
gives the full class's bits; on a CPU unpadded (:func:`forward_ragged`), where a padded row costs
as much as a real one.

Llama-family decoders only (``llama``, ``qwen2``: RMSNorm, rotary positions, grouped-query
attention, SwiGLU MLP); other architectures run on the eager engine. On a CPU the padded code runs
without graphs (the tests use it there).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnidraft.kv import common_prefix_len, max_positions_of

DECODE_ROWS = 16  # rows of every plain step and verify: a verify of up to 15 proposals is one forward
PREFILL_ROWS = 128  # rows of every context read of two or more tokens
DEFAULT_CONTEXT = 4096  # positions of a session's static cache (the model's own limit when smaller)
ARCHITECTURES = ("llama", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")  # rotary tables that do not change with the length
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (x, weight, bias) -> x W^T + b


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # q, k and v projections in one matrix: one GEMM per layer
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # gate and up projections in one matrix
    w_down: torch.Tensor


@dataclass
class Weights:
    """A Llama-family decoder's weights on one device and dtype, shared by every session."""

    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    head: torch.Tensor
    inv_freq: torch.Tensor  # float32 rotary frequencies, as the model's rotary module holds them
    rope_scale: float
    eps: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_positions: int

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return int(self.head.shape[0])


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run on this engine, or None when it can."""
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"architecture {config.model_type!r} (the static engine runs {', '.join(ARCHITECTURES)})"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    rope_type = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
    if rope_type not in _ROPE_TYPES:
        return f"rotary embedding type {rope_type!r}"
    return None


def extract(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> Weights:
    """Copy a transformers Llama-family model's weights to ``device`` in ``dtype``."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the static engine cannot run this model: {reason}")

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype).contiguous()

    def cat(*linears) -> torch.Tensor:
        return put(torch.cat([lin.weight for lin in linears]))

    layers = []
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        bias = attn.q_proj.bias is not None
        layers.append(Layer(
            attn_norm=put(block.input_layernorm.weight),
            wqkv=cat(attn.q_proj, attn.k_proj, attn.v_proj),
            bqkv=put(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])) if bias else None,
            wo=put(attn.o_proj.weight),
            mlp_norm=put(block.post_attention_layernorm.weight),
            w_gate_up=cat(mlp.gate_proj, mlp.up_proj),
            w_down=put(mlp.down_proj.weight),
        ))
    config = model.config
    rotary = model.model.rotary_emb
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Weights(
        embed=put(model.model.embed_tokens.weight), layers=layers, norm=put(model.model.norm.weight),
        head=put(model.get_output_embeddings().weight),
        inv_freq=rotary.inv_freq.detach().to(device=device, dtype=torch.float32),
        rope_scale=float(getattr(rotary, "attention_scaling", 1.0)), eps=float(config.rms_norm_eps),
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        max_positions=max_positions_of(model))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, the weight applied in the input's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, rotate-half form (x: [rows, heads, dim]; cos, sin: [rows, 1, dim])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, sessions: int = 1) -> torch.Tensor:
    """Grouped-query attention of ``sessions`` sessions, each over every slot of its own cache:
    q [sessions * rows, heads, dim] (a session's rows together), keys and values
    [sessions * kv heads, slots, dim], bias [sessions * kv heads, group * rows, slots] (0 or -inf)
    → [sessions * rows, heads * dim].

    Written out as two batched GEMMs rather than ``scaled_dot_product_attention``: with an explicit
    mask and a few query rows the fused kernels either refuse grouped heads or pick a kernel that
    costs ~25x a one-row step's (cuDNN, measured on an H100), and these GEMMs keep each row's
    arithmetic independent of the others'. Scores and softmax in float32."""
    total, heads, dim = q.shape
    rows = total // sessions
    # head h of a session reads kv head h // group: [sessions, rows, heads, dim] -> [sessions * kv heads, group * rows, dim]
    qg = q.view(sessions, rows, heads, dim).transpose(1, 2).reshape(keys.shape[0], bias.shape[1], dim).float()
    scores = torch.baddbmm(bias, qg, keys.float().transpose(1, 2), alpha=dim ** -0.5)
    out = torch.bmm(scores.softmax(-1).to(values.dtype), values)  # [sessions * kv heads, group * rows, dim]
    return out.view(sessions, heads, rows, dim).transpose(1, 2).reshape(total, heads * dim)


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _qkv(w: Weights, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         linear: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries and keys (rotated) and values: [rows, heads or kv heads, dim] each."""
    rows = x.shape[0]
    q_width, kv_width = w.n_heads * w.head_dim, w.n_kv_heads * w.head_dim
    qkv = linear(rms_norm(x, layer.attn_norm, w.eps), layer.wqkv, layer.bqkv)
    qk = rotate(qkv[:, : q_width + kv_width].view(rows, w.n_heads + w.n_kv_heads, w.head_dim), cos, sin)
    return qk[:, : w.n_heads], qk[:, w.n_heads:], qkv[:, q_width + kv_width:].view(rows, w.n_kv_heads, w.head_dim)


def _after_attention(w: Weights, layer: Layer, x: torch.Tensor, attended: torch.Tensor, linear: Linear) -> torch.Tensor:
    """The residual stream after a layer's output projection and its MLP."""
    x = x + linear(attended, layer.wo, None)
    gate, up = linear(rms_norm(x, layer.mlp_norm, w.eps), layer.w_gate_up, None).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, layer.w_down, None)


def forward(w: Weights, cache_k: torch.Tensor, cache_v: torch.Tensor, tokens: torch.Tensor,
            positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """Logits [rows, vocab] for ``tokens`` at ``positions``, writing their keys and values into the
    caches first. The caches are [layers, sessions, kv heads, slots, dim]; the rows are the sessions'
    in turn, the same number each (row r belongs to session r // (rows / sessions)). Shapes and
    addresses never change between calls of one class, so the whole function can be captured in a
    CUDA graph."""
    total = tokens.shape[0]
    _, sessions, kv_heads, slots, dim = cache_k.shape
    rows, group = total // sessions, w.n_heads // w.n_kv_heads
    visible = torch.arange(slots, device=tokens.device)[None, :] <= positions[:, None]  # [total, slots]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=tokens.device).masked_fill_(~visible, float("-inf"))
    bias = (bias.view(sessions, 1, 1, rows, slots).expand(sessions, kv_heads, group, rows, slots)
            .reshape(sessions * kv_heads, group * rows, slots))  # one copy per query head of a group
    # where each row's key and value go in a layer's cache seen as [sessions * kv heads * slots, dim]
    session_of_row = torch.arange(total, device=tokens.device) // rows
    write_at = ((session_of_row[:, None] * kv_heads + torch.arange(kv_heads, device=tokens.device)[None, :]) * slots
                + positions[:, None]).flatten()
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
    x = w.embed[tokens]
    for i, layer in enumerate(w.layers):
        q, k, v = _qkv(w, layer, x, cos, sin, _torch_linear)
        keys, values = cache_k[i].view(-1, dim), cache_v[i].view(-1, dim)
        keys.index_copy_(0, write_at, k.reshape(-1, dim))
        values.index_copy_(0, write_at, v.reshape(-1, dim))
        attended = attend(q, keys.view(-1, slots, dim), values.view(-1, slots, dim), bias, sessions)
        x = _after_attention(w, layer, x, attended, _torch_linear)
    return F.linear(rms_norm(x, w.norm, w.eps), w.head)


def forward_ragged(w: Weights, cache_k: torch.Tensor, cache_v: torch.Tensor, reads: Sequence[tuple[int, Sequence[int], int]],
                   cos_table: torch.Tensor, sin_table: torch.Tensor, linear: Linear) -> torch.Tensor:
    """Logits [rows, vocab] of several sessions' tokens in one forward without padding, for a CPU:
    ``reads`` holds (slot, tokens, start) per session, and their rows come in that order. The
    Linear layers run on every row at once (``linear``); attention runs per session, over its own
    cache up to its last position, so a session's attention is the same arithmetic whoever else
    was read with it. Caches as in :func:`forward`."""
    counts = [len(tokens) for _, tokens, _ in reads]
    tokens = torch.tensor([t for _, chunk, _ in reads for t in chunk], dtype=torch.long)
    positions = torch.cat([torch.arange(start, start + n) for (_, _, start), n in zip(reads, counts)])
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
    group = w.n_heads // w.n_kv_heads
    masks = []  # per session: [kv heads, group * rows, its length] of 0 / -inf (causal within its rows)
    for (_, _, start), n in zip(reads, counts):
        visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        masks.append(bias.repeat(group, 1).expand(w.n_kv_heads, -1, -1))
    x = w.embed[tokens]
    for i, layer in enumerate(w.layers):
        q, k, v = _qkv(w, layer, x, cos, sin, linear)
        attended, row = [], 0
        for (slot, _, start), n, bias in zip(reads, counts, masks):
            keys, values = cache_k[i, slot], cache_v[i, slot]  # [kv heads, slots, dim]
            keys[:, start: start + n] = k[row: row + n].transpose(0, 1)
            values[:, start: start + n] = v[row: row + n].transpose(0, 1)
            attended.append(attend(q[row: row + n], keys[:, : start + n], values[:, : start + n], bias))
            row += n
        x = _after_attention(w, layer, x, torch.cat(attended), linear)
    return linear(rms_norm(x, w.norm, w.eps), w.head, None)


def _native_linear() -> Linear | None:
    """The one-pass CPU kernel as a Linear (``omnidraft.kernels``): every row gets the same bits
    whatever the number of rows, which is what lets a CPU pool serve sessions together. None where
    it is not built."""
    from omnidraft import kernels

    wide, rows = kernels.linear_rows_512(), kernels.linear_rows()
    if wide is None and rows is None:
        return None

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = wide(x.contiguous(), weight) if wide is not None else rows(x.contiguous(), weight, True)
        return out if bias is None else out + bias

    return linear


class _Runner:
    """One class's forward over a set of caches (one session's, or a pool's): static input buffers,
    and on a GPU the captured graph. Row r belongs to the caches' session r // ``per_session``."""

    def __init__(self, weights: Weights, caches: tuple[torch.Tensor, torch.Tensor], tables: tuple[torch.Tensor, torch.Tensor],
                 per_session: int, spare: int, graphs: bool) -> None:
        self.weights, (self.cache_k, self.cache_v), (self.cos, self.sin) = weights, caches, tables
        self.per_session, self.spare = per_session, spare
        self.sessions = self.cache_k.shape[1]
        rows = per_session * self.sessions
        self.tokens = torch.zeros(rows, dtype=torch.long, device=weights.device)
        self.positions = torch.full((rows,), spare, dtype=torch.long, device=weights.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        if graphs:
            self._capture()

    def _call(self) -> torch.Tensor:
        return forward(self.weights, self.cache_k, self.cache_v, self.tokens, self.positions, self.cos, self.sin)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs (cuBLAS workspaces, lazy inits) write the spare slots only
            for _ in range(2):
                self._call()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._call()

    def run_many(self, reads: dict[int, tuple[Sequence[int], int]]) -> dict[int, torch.Tensor]:
        """One forward: for each session index s in ``reads``, its tokens (at most ``per_session``)
        read at positions start, start + 1, …; every other row is padding. Each session's logits rows."""
        per = self.per_session
        tokens = [0] * (per * self.sessions)
        positions = [self.spare] * (per * self.sessions)
        for s, (chunk, start) in reads.items():
            tokens[s * per: s * per + len(chunk)] = chunk
            positions[s * per: s * per + len(chunk)] = range(start, start + len(chunk))
        self.tokens.copy_(torch.tensor(tokens, dtype=torch.long))
        self.positions.copy_(torch.tensor(positions, dtype=torch.long))
        if self.graph is None:
            out = self._call()
        else:
            self.graph.replay()
            out = self.out
        return {s: out[s * per: s * per + len(chunk)] for s, (chunk, _) in reads.items()}

    def run(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Logits of one session's ``tokens`` read at positions ``start``..., padded to the class."""
        return self.run_many({0: (tokens, start)})[0]


class SessionPool:
    """The static KV caches of up to ``sessions`` sessions in one tensor pair
    ([layers, sessions, kv heads, slots, dim]), so that one forward can serve all of them: a server's
    batching. Its decode class has ``sessions`` × ``DECODE_ROWS`` rows, DECODE_ROWS per session (padding
    where a session has less work or none). Every decode read of a pooled session runs in that one
    class, alone or together with others, so its bits never depend on who else was served: a client's
    output is the same whether it was alone on the server or one of many. A pool of one session is
    what a lone engine uses (its decode class: DECODE_ROWS rows).

    Smaller classes (the first 1, 2, 4… slots: sessions take the lowest free slot) would spare a lone
    session the others' padding, but whether a row gets the same bits in a forward of another size
    depends on the kernels the GPU library picks for it. ``warm_up`` checks each size against the
    full one on a probe and allows only those that agree bit for bit (:attr:`classes`); until then,
    and where none agrees, every decode forward is the full class.

    Prompt reads (the prefill class) stay per session: each is its own forward over its slot.

    ``padded=False`` is the CPU's pool, where a padded row costs as much as a real one: no classes
    and no graphs. Every session's decode tokens go in one forward of just their rows, the Linear
    layers through the native one-pass kernel (a row's bits do not depend on how many rows share
    it) and attention per session (:func:`forward_ragged`); a prompt is read alone with torch's
    GEMM."""

    def __init__(self, weights: Weights, sessions: int = 1, max_context: int = DEFAULT_CONTEXT,
                 graphs: bool | None = None, padded: bool = True) -> None:
        if sessions < 1:
            raise ValueError(f"a pool holds at least one session, not {sessions}")
        self.padded = padded
        self._native = None if padded else _native_linear()
        if not padded and self._native is None:
            raise ValueError("serving sessions together on a CPU needs omnidraft's native kernel, which is not "
                             "built here (scripts/setup.sh builds it)")
        w = weights
        self.weights, self.sessions = w, sessions
        self.max_context = min(max_context, w.max_positions)
        self.spare = self.max_context  # the padding rows' slot: beyond every real position
        slots = -(-(self.max_context + 1) // 64) * 64  # a multiple of 64: odd GEMM strides take slow kernels
        shape = (len(w.layers), sessions, w.n_kv_heads, slots, w.head_dim)
        self.cache_k = torch.zeros(shape, dtype=w.embed.dtype, device=w.device)
        self.cache_v = torch.zeros_like(self.cache_k)
        angles = torch.arange(slots, device=w.device, dtype=torch.float32)[:, None] * w.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.cos = (angles.cos() * w.rope_scale).to(w.embed.dtype)
        self.sin = (angles.sin() * w.rope_scale).to(w.embed.dtype)
        self.graphs = padded and (w.device.type == "cuda" if graphs is None else graphs)
        self.vocab_size = w.vocab_size
        self._free = list(range(sessions))
        self._lock = threading.Lock()
        self._decode: dict[int, _Runner] = {}  # class size (slots covered) -> its runner
        self.classes = [sessions]  # the sizes a decode forward may take (checked by warm_up)

    def session(self) -> StaticLM:
        """A session on a free slot of this pool (its slot comes back when it is garbage)."""
        return StaticLM(self.weights, self.max_context, self.graphs, pool=self)

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.sessions} sessions of the pool are in use")
            slot = min(self._free)  # the lowest: busy sessions stay in the small classes
            self._free.remove(slot)
            return slot

    def give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def runner(self, first: int, slots: int, per_session: int) -> _Runner:
        """A forward class over the caches of slots ``first`` .. ``first + slots - 1``."""
        caches = (self.cache_k[:, first: first + slots], self.cache_v[:, first: first + slots])
        return _Runner(self.weights, caches, (self.cos, self.sin), per_session, self.spare, self.graphs)

    def _decoder(self, size: int) -> _Runner:
        if size not in self._decode:
            self._decode[size] = self.runner(0, size, DECODE_ROWS)
        return self._decode[size]

    def read_decode(self, reads: Sequence[tuple[StaticLM, Sequence[int]]]) -> list[torch.Tensor]:
        """Each session's ``tokens`` read after what it holds, every session's in the same forwards of
        the decode class (one per DECODE_ROWS tokens of the longest); their logits rows (model dtype).
        The class is the smallest allowed one that covers the highest slot read."""
        if not self.padded:
            return self._read_ragged([(lm, tokens) for lm, tokens in reads], self._native)
        size = min(c for c in self.classes if c > max(lm.slot for lm, _ in reads))
        out: list[list[torch.Tensor]] = [[] for _ in reads]
        for offset in range(0, max(len(tokens) for _, tokens in reads), DECODE_ROWS):
            chunks = {lm.slot: (list(tokens[offset: offset + DECODE_ROWS]), len(lm.cached_ids))
                      for lm, tokens in reads if len(tokens) > offset}
            rows = self._decoder(size).run_many(chunks)
            for i, (lm, _) in enumerate(reads):
                if lm.slot in rows:
                    out[i].append(rows[lm.slot].clone())
                    lm.cached_ids.extend(chunks[lm.slot][0])
        return [torch.cat(rows) for rows in out]

    def _read_ragged(self, reads: Sequence[tuple[StaticLM, Sequence[int]]], linear: Linear) -> list[torch.Tensor]:
        """One unpadded forward of every session's tokens (``forward_ragged``); each one's rows."""
        logits = forward_ragged(self.weights, self.cache_k, self.cache_v,
                                [(lm.slot, list(tokens), len(lm.cached_ids)) for lm, tokens in reads],
                                self.cos, self.sin, linear)
        for lm, tokens in reads:
            lm.cached_ids.extend(tokens)
        return list(logits.split([len(tokens) for _, tokens in reads]))

    def warm_up(self, max_rows: int) -> None:
        """Capture the decode graphs now rather than in a request's first forward, and allow the
        smaller classes that give the full class's bits. Run it before any session holds tokens:
        the check reads a probe into slot 0. (A CPU pool has nothing to prepare.)"""
        if not self.padded:
            return
        full = self._decoder(self.sessions)
        if self.sessions == 1:
            return
        probe = torch.randint(0, self.vocab_size, (DECODE_ROWS,), generator=torch.Generator().manual_seed(0)).tolist()
        reference = full.run_many({0: (probe, 0)})[0].clone()
        self.classes = [size for size in _powers_of_two_below(self.sessions)
                        if torch.equal(self._decoder(size).run_many({0: (probe, 0)})[0], reference)] + [self.sessions]
        for size in [s for s in self._decode if s not in self.classes]:
            del self._decode[size]  # its graph and buffers


def _powers_of_two_below(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i < n]


class StaticLM:
    """One session of the engine: its slot of a :class:`SessionPool` and the token ids it holds; the
    same contract as ``kv.CachedLM`` (``logits_for``, ``reset``, ``crop``), reading every forward in
    one of the two classes. Without a pool it gets a pool of its own (one session)."""

    def __init__(self, weights: Weights, max_context: int = DEFAULT_CONTEXT, graphs: bool | None = None,
                 *, pool: SessionPool | None = None) -> None:
        self.pool = pool if pool is not None else SessionPool(weights, 1, max_context, graphs)
        self.slot = self.pool.take()
        weakref.finalize(self, self.pool.give_back, self.slot)
        self.weights, self.max_context, self.graphs = weights, self.pool.max_context, self.pool.graphs
        self.vocab_size = self.pool.vocab_size
        self.cached_ids: list[int] = []
        self._prefill: _Runner | None = None

    def session(self) -> StaticLM:
        """Another session over the same weights: on the same pool when it is shared (batching),
        else with a cache of its own."""
        if self.pool.sessions > 1:
            return self.pool.session()
        own = SessionPool(self.weights, 1, self.max_context, self.graphs, padded=self.pool.padded)
        return StaticLM(self.weights, self.max_context, self.graphs, pool=own)

    def reset(self) -> None:
        self.cached_ids = []  # slots past the cached length are overwritten before anything reads them

    def crop(self, length: int) -> None:
        del self.cached_ids[length:]

    def _read_prompt(self, tokens: Sequence[int]) -> torch.Tensor:
        """Read ``tokens`` after the cached ones in forwards of the prefill class; the last row."""
        if not self.pool.padded:
            return self.pool._read_ragged([(self, tokens)], _torch_linear)[0][-1:]
        if self._prefill is None:
            self._prefill = self.pool.runner(self.slot, 1, PREFILL_ROWS)
        for i in range(0, len(tokens), PREFILL_ROWS):
            chunk = list(tokens[i:i + PREFILL_ROWS])
            last = self._prefill.run(chunk, len(self.cached_ids))[-1:].clone()
            self.cached_ids.extend(chunk)
        return last

    def _begin(self, ids: Sequence[int], keep: int) -> tuple[torch.Tensor | None, list[int]]:
        """Crop to what ``ids`` share with the cache and read their unread context if it is a prompt:
        (its last logits row or None, the tokens left for the decode class).

        Unread context of two or more tokens is a prompt: it is read in the prefill class, as the
        engine decoding alone reads it, and the proposals after it in the decode class. A single
        unread context token (the token the last step emitted) is read with the proposals."""
        if keep < 1 or keep > len(ids):
            raise ValueError(f"keep must be in [1, {len(ids)}], got {keep}")
        if len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} positions exceed this engine's context of {self.max_context}")
        self.crop(min(common_prefix_len(self.cached_ids, ids), len(ids) - keep))
        new = list(ids[len(self.cached_ids):])
        context = len(new) - (keep - 1)
        if context >= 2:
            return self._read_prompt(new[:context]), new[context:]
        return None, new

    @torch.inference_mode()
    def logits_for(self, ids: Sequence[int], keep: int = 1) -> torch.Tensor:
        """Logits (float32, CPU, [keep, vocab]) predicting the token after each of the last ``keep``
        ids, the last ``keep - 1`` of which are proposals."""
        return logits_together([(self, ids, keep)])[0]

    def warm_up(self, max_rows: int) -> None:
        """Capture both classes' graphs now rather than in a request's first forwards."""
        if self.pool.sessions == 1:  # a shared pool is warmed up by its owner, before sessions hold tokens
            self.pool.warm_up(max_rows)  # one session: nothing to check, the graph is captured
        if self._prefill is None and self.pool.padded:
            self._prefill = self.pool.runner(self.slot, 1, PREFILL_ROWS)


@torch.inference_mode()
def logits_together(requests: Sequence[tuple[StaticLM, Sequence[int], int]],
                    to_host: bool = True) -> list[torch.Tensor]:
    """``logits_for`` of several sessions of one pool, (session, ids, keep) each: every prompt read
    on its own, then every session's decode-class tokens in the same forwards. ``to_host`` False:
    the rows stay where the pool computed them, for a caller that needs only each row's argmax
    (a greedy server: a vocabulary-wide row per token is the largest copy off a GPU)."""
    pools = {id(lm.pool) for lm, _, _ in requests}
    if len(pools) != 1 or len({lm.slot for lm, _, _ in requests}) != len(requests):
        raise ValueError("logits_together reads distinct sessions of one pool")
    begun = [lm._begin(ids, keep) for lm, ids, keep in requests]
    decoding = [(i, lm) for i, (lm, _, _) in enumerate(requests) if begun[i][1]]
    decoded = dict(zip((i for i, _ in decoding),
                       requests[0][0].pool.read_decode([(lm, begun[i][1]) for i, lm in decoding]) if decoding else []))
    kept = [torch.cat([r for r in (begun[i][0], decoded.get(i)) if r is not None])[-keep:]
            for i, (_, _, keep) in enumerate(requests)]
    together = torch.cat(kept).float()
    if to_host:
        together = together.cpu()  # one copy to the host for every session (one wait on the GPU)
    elif together.is_cuda:  # the forward is done when this returns: callers time it (the server's budget)
        torch.cuda.current_stream(together.device).synchronize()
    return list(together.split([len(rows) for rows in kept]))
