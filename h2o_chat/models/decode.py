"""The decode forward: one new token per batch row through a LLaMA-family model and its H2O cache,
as one plain function over the model's own weights (gpt-fast's `decode_one_token`).

Why: on a CPU, decoding a small model is overhead-bound. transformers' forward spends ~200 aten
ops and as many Python calls per layer on one token (module hooks, kwargs plumbing, mask
building, output capturing); the weights' matmuls are the only work that has to be done.
This forward runs the same arithmetic, op for op (so its logits are bitwise those of
`model(token, cache=cache)`: tests/test_decode.py), in about a third of the ops:

    x = embed[token]                                   [rows, 1, hidden]
    per layer:  h = rms_norm(x) -> q, k, v (rotated) -> cache.attend -> x += o_proj(...)
                h = rms_norm(x) -> x += down(silu(gate(h)) * up(h))
    logits = lm_head(rms_norm(x))                      [rows, vocab]

The cache is anything with transformers' `update` and our `attend(layer_idx, query, scaling)`:
an `H2OCache` (any state: filling, full, or `policy="full"`) or a batch of them (batch.py).
For a model it cannot run exactly (bitsandbytes or offloaded weights, dynamic RoPE, another
activation), a Decoder calls the model's own forward instead; `Decoder.why_not` says why.

A model with packed weights (packed.py: int4/int8, loaded by load_model) takes the packed step:
the same arithmetic through the kernels, with fewer, larger matmuls, one for q/k/v and one for
gate/up per layer (quantize.fuse_projections): per layer 4 matmuls instead of 7, and the
lm_head read at 4.5 bits. Its logits equal the model's own forward's (tests/test_quantized.py).
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..cache.h2o import STATIC_ROPE_TYPES, rotate_half  # rotate_half: transformers' own, op for op
from .quantize import PACKED


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors (Linear weights are [out, in]; biases None unless the model has them)."""

    input_norm: torch.Tensor  # [hidden]
    q: torch.Tensor  # [q_heads * head_dim, hidden]
    k: torch.Tensor  # [kv_heads * head_dim, hidden]
    v: torch.Tensor  # [kv_heads * head_dim, hidden]
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, q_heads * head_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate: torch.Tensor  # [intermediate, hidden]
    up: torch.Tensor  # [intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    mlp_biases: tuple  # (gate, up, down) biases, or Nones


@dataclass(frozen=True)
class PackedLayer:
    """One decoder layer for the packed step. Each matmul is a plain function, rows [n, in] ->
    [n, out'] in the model's dtype (packed.Int4Linear.lean); slices say where each projection's
    columns are in its result."""

    input_norm: torch.Tensor  # [hidden]
    qkv: object  # h [rows, hidden] -> [rows, >= (q_heads + 2 kv_heads) * head_dim]
    qk: slice | None  # q then k, adjacent in qkv's result (None: not adjacent, q and k are cat)
    q: slice
    k: slice
    v: slice
    o: object  # [rows, q_heads * head_dim] -> [rows, >= hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: object  # h [rows, hidden] -> [rows, >= 2 * intermediate]
    gate: slice
    up: slice
    down: object  # [rows, intermediate] -> [rows, >= hidden]


class Decoder:
    """Runs `model` over an H2O cache: `forward` for any input, `step` for one token a row."""

    def __init__(self, model):
        self.model, self.why_not = model, unsupported(model)
        self.packed = self.why_not is None and any(isinstance(m, PACKED) for m in model.modules())
        if self.why_not is None:
            self._take_weights(model)

    def _take_weights(self, model):
        base, text = model.base_model, model.config.get_text_config(decoder=True)
        self.norm, self.eps = base.norm.weight, base.norm.variance_epsilon
        rope = base.rotary_emb
        self.inv_freq, self.rope_scaling = rope.inv_freq.float(), rope.attention_scaling
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.scaling = base.layers[0].self_attn.scaling
        self.q_heads = text.num_attention_heads
        if self.packed:
            dtype = self.norm.dtype
            self.hidden, self.vocab = text.hidden_size, model.lm_head.out_features
            self.embed_rows = base.embed_tokens  # a module: a float table, or rows of a packed one
            self.lm_head_call = lean_call(model.lm_head, dtype)
            self.layers = [packed_layer(layer, text, self.head_dim, dtype) for layer in base.layers]
            self.step = self.packed_step
            return
        self.embed = base.embed_tokens.weight
        self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias
        self.layers = [layer_weights(layer) for layer in base.layers]

    @torch.no_grad()
    def forward(self, input_ids, cache):
        """input_ids [rows, n] into `cache` -> logits of each row's last token [rows, vocab] float32.
        One new token takes the lean step; a prefill chunk, the model's own forward."""
        if input_ids.shape[1] == 1:
            positions = torch.full((input_ids.shape[0],), cache.get_seq_length(), device=input_ids.device)
            return self.step(input_ids, positions, cache)
        return self.model(input_ids, cache=cache, logits_to_keep=1).logits[:, -1].float()

    @torch.no_grad()
    def step(self, token_ids, positions, cache):
        """token_ids [rows, 1], each at RoPE position positions [rows] (the tokens its cache has
        seen) -> logits [rows, vocab] float32."""
        if self.why_not is not None:
            out = self.model(token_ids, position_ids=positions[:, None], cache=cache, logits_to_keep=1)
            return out.logits[:, -1].float()
        x = F.embedding(token_ids, self.embed)  # [rows, 1, hidden]
        cos, sin = self.rotation(positions, x.dtype)
        rows, d, q_heads = x.shape[0], self.head_dim, self.q_heads
        kwargs = {}  # what transformers' attention passes to cache.update; the cache adds itself
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, self.eps)
            # queries and keys rotated together: one rotation's ops instead of two (elementwise: same bits)
            qk = torch.cat((F.linear(h, w.q, w.q_bias), F.linear(h, w.k, w.k_bias)), dim=-1).view(rows, 1, -1, d)
            qk = (qk * cos + rotate_half(qk) * sin).transpose(1, 2)  # [rows, q_heads + kv_heads, 1, head_dim]
            q, k = qk[:, :q_heads], qk[:, q_heads:]
            v = F.linear(h, w.v, w.v_bias).view(rows, 1, -1, d).transpose(1, 2)
            cache.update(k, v, i, kwargs=kwargs)
            attn = cache.attend(i, q, self.scaling).reshape(rows, 1, -1)
            x = x + F.linear(attn, w.o, w.o_bias)
            h = rms_norm(x, w.post_norm, self.eps)
            gate_b, up_b, down_b = w.mlp_biases
            x = x + F.linear(F.silu(F.linear(h, w.gate, gate_b)) * F.linear(h, w.up, up_b), w.down, down_b)
        return F.linear(rms_norm(x, self.norm, self.eps), self.lm_head, self.lm_head_bias)[:, -1].float()

    @torch.no_grad()
    def packed_step(self, token_ids, positions, cache):
        """`step` for packed weights (PackedLayer): token_ids [rows, 1] at positions [rows] ->
        logits [rows, vocab] float32."""
        x = self.embed_rows(token_ids)  # [rows, 1, hidden]
        cos, sin = self.rotation(positions, x.dtype)
        rows, d, q_heads, hidden = x.shape[0], self.head_dim, self.q_heads, self.hidden
        kwargs = {}
        for i, w in enumerate(self.layers):
            y = w.qkv(rms_norm(x, w.input_norm, self.eps).view(rows, hidden))
            qk = y[:, w.qk] if w.qk is not None else torch.cat((y[:, w.q], y[:, w.k]), dim=-1)
            qk = qk.view(rows, 1, -1, d)
            qk = (qk * cos + rotate_half(qk) * sin).transpose(1, 2)  # [rows, q_heads + kv_heads, 1, head_dim]
            q, k = qk[:, :q_heads], qk[:, q_heads:]
            v = y[:, w.v].view(rows, 1, -1, d).transpose(1, 2)
            cache.update(k, v, i, kwargs=kwargs)
            attn = cache.attend(i, q, self.scaling).reshape(rows, -1)
            x = x + w.o(attn)[:, :hidden].view(rows, 1, hidden)
            gu = w.gate_up(rms_norm(x, w.post_norm, self.eps).view(rows, hidden))
            x = x + w.down(F.silu(gu[:, w.gate]) * gu[:, w.up])[:, :hidden].view(rows, 1, hidden)
        return self.lm_head_call(rms_norm(x, self.norm, self.eps).view(rows, hidden))[:, :self.vocab].float()

    def rotation(self, positions, dtype):
        """RoPE's cos and sin for the new tokens, [rows, 1, 1, head_dim], as transformers makes them."""
        freqs = positions[:, None, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # broadcast over [rows, 1, heads, head_dim]


def rms_norm(x, weight, eps):
    """LlamaRMSNorm, op for op: in float32, back to the model's dtype before the weight."""
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def layer_weights(layer):
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
        q=attn.q_proj.weight, k=attn.k_proj.weight, v=attn.v_proj.weight, o=attn.o_proj.weight,
        q_bias=attn.q_proj.bias, k_bias=attn.k_proj.bias, v_bias=attn.v_proj.bias, o_bias=attn.o_proj.bias,
        gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight,
        mlp_biases=(mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias))


def lean_call(module, dtype):
    """rows [n, in] -> [n, out'] in `dtype` for a packed module or a float nn.Linear."""
    if isinstance(module, PACKED):
        return module.lean(dtype)
    weight, bias = module.weight, module.bias
    return lambda rows: F.linear(rows, weight, bias)


def joined(parts, fused, dtype):
    """One function computing `parts` (modules reading the same input) and each one's columns in
    its result: the fused module's (quantize.fuse_projections) when there is one, else the parts'
    results side by side."""
    if fused is not None:
        return lean_call(fused.module, dtype), [slice(*span) for span in fused.spans]
    calls, widths = [lean_call(p, dtype) for p in parts], [p.out_features for p in parts]
    starts = [sum(widths[:i]) for i in range(len(parts))]
    spans = [slice(s, s + w) for s, w in zip(starts, widths)]
    return (lambda rows: torch.cat([c(rows)[:, :w] for c, w in zip(calls, widths)], dim=-1)), spans


def packed_layer(layer, text, head_dim, dtype):
    attn, mlp = layer.self_attn, layer.mlp
    qkv, (q, k, v) = joined([attn.q_proj, attn.k_proj, attn.v_proj], getattr(attn, "qkv_proj", None), dtype)
    gate_up, (gate, up) = joined([mlp.gate_proj, mlp.up_proj], getattr(mlp, "gate_up_proj", None), dtype)
    return PackedLayer(input_norm=layer.input_layernorm.weight, qkv=qkv, qk=slice(q.start, k.stop) if q.stop == k.start else None,
                       q=q, k=k, v=v, o=lean_call(attn.o_proj, dtype), post_norm=layer.post_attention_layernorm.weight,
                       gate_up=gate_up, gate=gate, up=up, down=lean_call(mlp.down_proj, dtype))


def unsupported(model):
    """Why this forward would not compute what `model`'s does (None: it would)."""
    text = model.config.get_text_config(decoder=True)
    base = model.base_model
    if getattr(text, "hidden_act", None) != "silu":
        return f"activation {getattr(text, 'hidden_act', None)!r}"
    rope = base.rotary_emb
    if getattr(rope, "rope_type", "default") not in STATIC_ROPE_TYPES:  # inv_freq fixed at load: cos/sin from it are HF's
        return f"RoPE type {rope.rope_type!r}"
    if getattr(text, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if any(type(m) is not torch.nn.Linear for m in linears):
        return "quantized linear layers"
    if any(getattr(m, "_hf_hook", None) is not None for m in model.modules()):
        return "weights offloaded or spread over devices (accelerate hooks)"
    if len({p.device for p in model.parameters()}) != 1:
        return "weights on more than one device"
    for layer in base.layers:
        if type(layer.input_layernorm).__name__ not in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"):
            return f"norm {type(layer.input_layernorm).__name__}"
    return None

