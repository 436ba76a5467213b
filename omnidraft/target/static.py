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

Llama-family decoders only (``llama``, ``qwen2``: RMSNorm, rotary positions, grouped-query
attention, SwiGLU MLP); other architectures run on the eager engine. On a CPU the same code runs
without graphs (the tests use it there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnidraft.kv import common_prefix_len, max_positions_of

DECODE_ROWS = 16  # rows of every plain step and verify: a verify of up to 15 proposals is one forward
PREFILL_ROWS = 128  # rows of every context read of two or more tokens
DEFAULT_CONTEXT = 4096  # positions of a session's static cache (the model's own limit when smaller)
ARCHITECTURES = ("llama", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")  # rotary tables that do not change with the length


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


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention over every cache slot: q [rows, heads, dim], keys and values
    [kv heads, slots, dim], bias [group * rows, slots] (0 or -inf) → [rows, heads * dim].

    Written out as two batched GEMMs rather than ``scaled_dot_product_attention``: with an explicit
    mask and a few query rows the fused kernels either refuse grouped heads or pick a kernel that
    costs ~25x a one-row step's (cuDNN, measured on an H100), and these GEMMs keep each row's
    arithmetic independent of the others'. Scores and softmax in float32."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    qg = q.transpose(0, 1).reshape(kv_heads, group * rows, dim).float()  # head h = kv head h // group
    scores = torch.baddbmm(bias, qg, keys.float().transpose(1, 2), alpha=dim ** -0.5)
    out = torch.bmm(scores.softmax(-1).to(values.dtype), values)  # [kv heads, group * rows, dim]
    return out.view(heads, rows, dim).transpose(0, 1).reshape(rows, heads * dim)


def forward(w: Weights, cache_k: torch.Tensor, cache_v: torch.Tensor, tokens: torch.Tensor,
            positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """Logits [rows, vocab] for ``tokens`` at ``positions``, writing their keys and values into the
    cache ([layers, kv heads, slots, dim]) first. Shapes and addresses never change between calls
    of one class, so the whole function can be captured in a CUDA graph."""
    rows = tokens.shape[0]
    slots = cache_k.shape[2]
    visible = torch.arange(slots, device=tokens.device)[None, :] <= positions[:, None]  # [rows, slots]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=tokens.device).masked_fill_(~visible, float("-inf"))
    bias = bias.repeat(w.n_heads // w.n_kv_heads, 1)  # one copy per query head of a group
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
    x = w.embed[tokens]
    q_width, kv_width = w.n_heads * w.head_dim, w.n_kv_heads * w.head_dim
    for i, layer in enumerate(w.layers):
        qkv = F.linear(rms_norm(x, layer.attn_norm, w.eps), layer.wqkv, layer.bqkv)
        qk = rotate(qkv[:, : q_width + kv_width].view(rows, w.n_heads + w.n_kv_heads, w.head_dim), cos, sin)
        q, k = qk[:, : w.n_heads], qk[:, w.n_heads:]
        cache_k[i].index_copy_(1, positions, k.transpose(0, 1))
        cache_v[i].index_copy_(1, positions, qkv[:, q_width + kv_width:].view(rows, w.n_kv_heads, w.head_dim).transpose(0, 1))
        x = x + F.linear(attend(q, cache_k[i], cache_v[i], bias), layer.wo)
        gate, up = F.linear(rms_norm(x, layer.mlp_norm, w.eps), layer.w_gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.w_down)
    return F.linear(rms_norm(x, w.norm, w.eps), w.head)


class _Runner:
    """One class's forward: static input buffers, and on a GPU the captured graph."""

    def __init__(self, lm: StaticLM, rows: int) -> None:
        device = lm.weights.device
        self.rows = rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.full((rows,), lm.spare, dtype=torch.long, device=device)
        self._lm = lm
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        if lm.graphs:
            self._capture()

    def _call(self) -> torch.Tensor:
        lm = self._lm
        return forward(lm.weights, lm.cache_k, lm.cache_v, self.tokens, self.positions, lm.cos, lm.sin)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs (cuBLAS workspaces, lazy inits) write the spare slot only
            for _ in range(2):
                self._call()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._call()

    def run(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Logits of ``tokens`` (at most ``rows``) read at positions ``start``..., padded to the class."""
        n, pad = len(tokens), self.rows - len(tokens)
        self.tokens.copy_(torch.tensor(list(tokens) + [0] * pad, dtype=torch.long))
        self.positions.copy_(torch.tensor(list(range(start, start + n)) + [self._lm.spare] * pad, dtype=torch.long))
        if self.graph is None:
            return self._call()[:n]
        self.graph.replay()
        return self.out[:n]


class StaticLM:
    """Weights + a static KV cache + the token ids it holds; the same contract as ``kv.CachedLM``
    (``logits_for``, ``reset``, ``crop``), reading every forward in one of the two classes."""

    def __init__(self, weights: Weights, max_context: int = DEFAULT_CONTEXT, graphs: bool | None = None) -> None:
        self.weights = weights
        self.max_context = min(max_context, weights.max_positions)
        self.spare = self.max_context  # the padding rows' slot: beyond every real position
        slots = -(-(self.max_context + 1) // 64) * 64  # a multiple of 64: odd GEMM strides take slow kernels
        w = weights
        shape = (len(w.layers), w.n_kv_heads, slots, w.head_dim)
        self.cache_k = torch.zeros(shape, dtype=w.embed.dtype, device=w.device)
        self.cache_v = torch.zeros_like(self.cache_k)
        angles = torch.arange(slots, device=w.device, dtype=torch.float32)[:, None] * w.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.cos = (angles.cos() * w.rope_scale).to(w.embed.dtype)
        self.sin = (angles.sin() * w.rope_scale).to(w.embed.dtype)
        self.graphs = w.device.type == "cuda" if graphs is None else graphs
        self._runners: dict[int, _Runner] = {}
        self.vocab_size = w.vocab_size
        self.cached_ids: list[int] = []

    def session(self) -> StaticLM:
        """Another cache (and graphs) over the same weights."""
        return StaticLM(self.weights, self.max_context, self.graphs)

    def reset(self) -> None:
        self.cached_ids = []  # slots past the cached length are overwritten before anything reads them

    def crop(self, length: int) -> None:
        del self.cached_ids[length:]

    def _runner(self, rows: int) -> _Runner:
        if rows not in self._runners:
            self._runners[rows] = _Runner(self, rows)
        return self._runners[rows]

    def _read(self, tokens: Sequence[int], rows: int) -> torch.Tensor:
        """Read ``tokens`` after the cached ones in forwards of ``rows`` rows; their logits (model dtype)."""
        runner, out = self._runner(rows), []
        for i in range(0, len(tokens), rows):
            chunk = list(tokens[i:i + rows])
            out.append(runner.run(chunk, len(self.cached_ids)).clone())
            self.cached_ids.extend(chunk)
        return torch.cat(out)

    @torch.inference_mode()
    def logits_for(self, ids: Sequence[int], keep: int = 1) -> torch.Tensor:
        """Logits (float32, CPU, [keep, vocab]) predicting the token after each of the last ``keep``
        ids, the last ``keep - 1`` of which are proposals.

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
            last = self._read(new[:context], PREFILL_ROWS)[-1:]
            rows = torch.cat([last, self._read(new[context:], DECODE_ROWS)]) if keep > 1 else last
        else:
            rows = self._read(new, DECODE_ROWS)
        return rows[-keep:].float().cpu()

    def warm_up(self, max_rows: int) -> None:
        """Capture both classes' graphs now rather than in a request's first forwards."""
        self._runner(DECODE_ROWS)
        self._runner(PREFILL_ROWS)
