"""The drafter as one flat function of tensors, for export to ONNX (llama-architecture drafters).

transformers' forward takes cache objects and keyword switches an exporter cannot follow; this
module computes the same thing from plain tensors in, plain tensors out (gpt-fast style):

    inputs:  input_ids [1, s]; past_key_values.{i}.key / .value [1, kv_heads, past, head_dim] for
             every layer i; for every adapted Linear, ``<module>.lora_A.weight`` [in, r] and
             ``<module>.lora_B.weight`` [r, out]: peft's A and B *transposed*, ready for MatMul (no
             transpose per step); r may be 0: no adapter, the base model
    outputs: logits [1, 1, vocab] (batch, position, vocab: the rank onnxruntime-genai reads; only
             the last position is computed) and hidden [1, hidden] at the last position (the LM
             head's input: an acceptance head runs on it); present.{i}.key / .value = past + the s
             new positions

Positions continue the past (a rewind is only a shorter past). The LoRA delta is x·Aᵀ·Bᵀ (fed as Aᵀ
and Bᵀ) with α/r folded into B by whoever supplies the tensors, the onnxruntime / Olive convention.
"""

from __future__ import annotations

import math

import torch
import torch.onnx.operators
from torch import nn


def rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, heads: int, kv_heads: int):
    """Rotary, the new keys and values after the past, and causal grouped-query attention.

    q/k/v [1, s, heads * d] (k, v: kv_heads * d) before rotary; past [1, kv_heads, past, d]; cos/sin
    [1, 1, s, d] at the new positions; mask [1, 1, s, past + s] (0 or -inf). Returns the output
    [1, s, heads * d] and the presents [1, kv_heads, past + s, d]. The queries of one kv head are
    stacked along the sequence axis ([1, kv, group * s, d]), so k and v are not copied per query head."""
    s, d = q.shape[1], past_k.shape[3]
    group = heads // kv_heads
    q = q.view(1, s, heads, d).transpose(1, 2)
    k = k.view(1, s, kv_heads, d).transpose(1, 2)
    v = v.view(1, s, kv_heads, d).transpose(1, 2)
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
    total = k.shape[2]
    scores = (q.reshape(1, kv_heads, group * s, d) @ k.transpose(2, 3)) / math.sqrt(d)
    scores = scores.reshape(1, kv_heads, group, s, total) + mask[:, :, None]
    probs = scores.softmax(-1).reshape(1, kv_heads, group * s, total)
    out = (probs @ v).reshape(1, heads, s, d).transpose(1, 2).reshape(1, s, heads * d)
    return out, k, v


class GroupQueryAttention(torch.autograd.Function):
    """onnxruntime's fused ``com.microsoft::GroupQueryAttention``: exported as that one node (its
    symbolic; the export turns autograd inlining off so the forward is not traced), computed in torch
    by :func:`attend` for the trace's values. The node takes q/k/v before rotary, the past, its two
    lengths (``seqlens_k`` = past + s - 1, ``total``) and cos/sin tables [max_positions, d / 2]."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, heads_kv: tuple[int, int]):
        s, past = q.shape[1], past_k.shape[2]
        at = slice(past, past + s)
        cos, sin = torch.cat((cos[at], cos[at]), -1)[None, None], torch.cat((sin[at], sin[at]), -1)[None, None]
        mask = torch.full((s, past + s), float("-inf")).triu(past + 1)[None, None]
        return attend(q, k, v, past_k, past_v, cos, sin, mask, *heads_kv)

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, heads_kv: tuple[int, int]):
        heads, kv_heads = heads_kv
        return g.op("com.microsoft::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k, total, cos, sin,
                    num_heads_i=heads, kv_num_heads_i=kv_heads, do_rotary_i=1, rotary_interleaved_i=0, outputs=3)


LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # peft's "all-linear" on a llama block


def lora_modules(num_layers: int) -> list[str]:
    """Module paths of the adapted Linears, as peft names them (``model.layers.0.self_attn.q_proj``)."""
    return [f"model.layers.{i}.{t}" for i in range(num_layers) for t in LORA_TARGETS]


class FlatDrafter(nn.Module):
    """A transformers ``LlamaForCausalLM`` as a function of tensors (see the module docstring)."""

    def __init__(self, model: nn.Module, lora: bool = True, fused: bool = False) -> None:
        super().__init__()
        self.with_lora, self.fused = lora, fused
        cfg = model.config
        if cfg.model_type != "llama":
            raise ValueError(f"the ONNX export supports llama-architecture drafters, not {cfg.model_type!r}")
        self.layers = len(model.model.layers)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.model = model.float().eval()
        rotary = model.model.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.modules_lora = lora_modules(self.layers)
        # the fused node reads rotary from tables over every position, half a head wide
        angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.register_buffer("cos_table", angles.cos() * self.rope_scale, persistent=False)
        self.register_buffer("sin_table", angles.sin() * self.rope_scale, persistent=False)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, a_t: torch.Tensor | None = None, b_t: torch.Tensor | None = None) -> torch.Tensor:
        return x @ weight.t() if a_t is None else x @ weight.t() + (x @ a_t) @ b_t

    def forward(self, input_ids: torch.Tensor, *flat: torch.Tensor):
        pasts, loras = flat[: 2 * self.layers], flat[2 * self.layers:]
        lora = dict(zip(self.modules_lora, zip(loras[0::2], loras[1::2]))) if self.with_lora else \
            {m: () for m in self.modules_lora}
        inner = self.model.model
        s = input_ids.shape[1]
        past = pasts[0].shape[2]
        positions = torch.arange(s, dtype=torch.float32) + past
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.rope_scale)[None, None], (emb.sin() * self.rope_scale)[None, None]
        total = past + s
        rows = torch.arange(s)[:, None] + past
        cols = torch.arange(total)[None, :]
        mask = torch.where(cols > rows, torch.tensor(float("-inf")), torch.tensor(0.0))[None, None]
        x = inner.embed_tokens.weight[input_ids]
        # the fused node's lengths, from the shapes (traced, not constants): past + new, and that minus one
        total_len = (torch.onnx.operators.shape_as_tensor(pasts[0])[2]
                     + torch.onnx.operators.shape_as_tensor(input_ids)[1]).to(torch.int32)
        seqlens_k = (total_len - 1).reshape(1)
        presents = []
        for i, layer in enumerate(inner.layers):
            att = layer.self_attn
            name = f"model.layers.{i}"
            h = self._rms(x, layer.input_layernorm.weight)
            q = self._linear(h, att.q_proj.weight, *lora[f"{name}.self_attn.q_proj"])
            k = self._linear(h, att.k_proj.weight, *lora[f"{name}.self_attn.k_proj"])
            v = self._linear(h, att.v_proj.weight, *lora[f"{name}.self_attn.v_proj"])
            if self.fused:
                out, k, v = GroupQueryAttention.apply(q, k, v, pasts[2 * i], pasts[2 * i + 1], seqlens_k, total_len,
                                                      self.cos_table, self.sin_table, (self.heads, self.kv_heads))
            else:
                out, k, v = attend(q, k, v, pasts[2 * i], pasts[2 * i + 1], cos, sin, mask, self.heads, self.kv_heads)
            presents += [k, v]
            x = x + self._linear(out, att.o_proj.weight, *lora[f"{name}.self_attn.o_proj"])
            x = self._mlp(x, layer, lora, name)
        hidden = self._rms(x[:, -1], inner.norm.weight)
        logits = hidden @ self.model.get_output_embeddings().weight.t()
        return (logits[:, None], hidden, *presents)

    def _mlp(self, x: torch.Tensor, layer: nn.Module, lora: dict, name: str) -> torch.Tensor:
        mlp = layer.mlp
        h = self._rms(x, layer.post_attention_layernorm.weight)
        gate = self._linear(h, mlp.gate_proj.weight, *lora[f"{name}.mlp.gate_proj"])
        up = self._linear(h, mlp.up_proj.weight, *lora[f"{name}.mlp.up_proj"])
        return x + self._linear(nn.functional.silu(gate) * up, mlp.down_proj.weight, *lora[f"{name}.mlp.down_proj"])

    # ---- names and example tensors for the exporter

    def input_names(self) -> list[str]:
        kv = [f"past_key_values.{i}.{w}" for i in range(self.layers) for w in ("key", "value")]
        lora = [f"{m}.lora_{ab}.weight" for m in self.modules_lora for ab in ("A", "B")] if self.with_lora else []
        return ["input_ids", *kv, *lora]

    def output_names(self) -> list[str]:
        return ["logits", "hidden", *[f"present.{i}.{w}" for i in range(self.layers) for w in ("key", "value")]]

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """Module path -> (in features, out features) of each adapted Linear."""
        named = dict(self.model.named_modules())
        return {m: (named[m].in_features, named[m].out_features) for m in self.modules_lora}

    def example(self, seq: int = 3, past: int = 2, rank: int = 2) -> tuple[torch.Tensor, ...]:
        ids = torch.zeros(1, seq, dtype=torch.long)
        kv = [torch.zeros(1, self.kv_heads, past, self.head_dim) for _ in range(2 * self.layers)]
        lora = []
        for inp, out in (self.lora_shapes().values() if self.with_lora else []):
            lora += [torch.zeros(inp, rank), torch.zeros(rank, out)]
        return (ids, *kv, *lora)
