"""The decode forward: one new token per batch row through a LLaMA-family model and its H2O cache,
as one plain function over the model's own weights (gpt-fast's `decode_one_token`).

Why: on a CPU, decoding a small model is overhead-bound. transformers' forward spends ~200 aten
ops and as many Python calls per layer on one token (module hooks, kwargs plumbing, mask
building, output capturing); the weights' matmuls are the only work that has to be done.
This forward runs the same arithmetic, op for op (so its logits are bitwise those of
`model(token, cache=cache)`: tests/test_decode.py), in about a third of the ops:

    x = embed[token]                                   [rows, hidden]
    per layer:  h = rms_norm(x) -> q, k, v (rotated) -> cache.attend -> x += o_proj(...)
                (a bf16 model on a CPU: the rotation and the keys' and values' write into the
                cache's spare slot are one op, native/rotate_one.c)
                h = rms_norm(x) -> x += down(silu(gate(h)) * up(h))
    logits = lm_head(rms_norm(x))                      [rows, vocab]

Each matmul is a plain function decided once per model (`lean_call`): a float model's F.linear,
or for packed weights (packed.py: int4/int8, loaded by load_model) the kernel, with fewer, larger
matmuls: one for q/k/v and one for gate/up per layer (quantize.fuse_projections), 4 instead of 7,
and the lm_head read at 4.5 bits. Its logits equal the model's own forward's (tests/test_decode.py,
tests/test_quantized.py).

The cache is anything with `begin(n)`, `attend(layer_idx, query, keys, values, scaling)` per
layer and `end()`, called directly (transformers' `update` and attention hook are for the model's own forward): an
`H2OCache` (any state: filling, full, or `policy="full"`) or a batch of them (batch.py). For a
model it cannot run exactly (bitsandbytes or offloaded weights, dynamic RoPE, another
activation), a Decoder calls the model's own forward instead; `Decoder.why_not` says why.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .. import native
from ..cache.h2o import STATIC_ROPE_TYPES
from .quantize import PACKED


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer for the lean step. Each matmul is a plain function, rows [n, in] ->
    [n, out] in the model's dtype (a float nn.Linear's F.linear, or a packed kernel:
    packed.Int4Linear.lean); slices say where each projection's columns are in its result."""

    input_norm: torch.Tensor  # [hidden]
    qkv: object  # h [rows, hidden] -> [rows, (q_heads + 2 kv_heads) * head_dim]
    qk: slice | None  # q then k, adjacent in qkv's result (None: not adjacent, q and k are cat)
    q: slice
    k: slice
    v: slice
    o: object  # [rows, q_heads * head_dim] -> [rows, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: object  # h [rows, hidden] -> [rows, 2 * intermediate]
    gate: slice
    up: slice
    down: object  # [rows, intermediate] -> [rows, hidden]


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
        self.q_heads, self.kv_heads, self.hidden = text.num_attention_heads, text.num_key_value_heads, text.hidden_size
        dtype = self.norm.dtype
        self.embed = base.embed_tokens  # a module: a float table, or rows of a packed one
        self.lm_head = lean_call(model.lm_head, dtype)
        self.layers = [layer_calls(layer, self.head_dim, dtype) for layer in base.layers]
        # a bf16 model on a CPU: the rotation and the spare slot's writes as one op where the cache's
        # step attends natively (native/rotate_one.c); asking compiles the C kernels now (~2 s, once
        # a process), not inside a reply's first token
        cpu_bf16 = dtype == torch.bfloat16 and self.norm.device.type == "cpu"
        self.rotate = native.rotate_one() if cpu_bf16 else None
        # and a norm's steps after its sum of squares (native/rms_tail.c): rms_norm's `tail`, where
        # every norm's weight is bf16 (a float32 one would make the torch ops' result float32)
        norms = [self.norm] + [w.input_norm for w in self.layers] + [w.post_norm for w in self.layers]
        plain = all(n.dtype == torch.bfloat16 and n.is_contiguous() for n in norms)
        tail, count, eps = native.rms_tail() if cpu_bf16 and plain else None, float(self.hidden), float(self.eps)
        self.norm_tail = None if tail is None else (lambda x32, sum_sq, weight, out: tail(x32, sum_sq, weight, count, eps, out))
        self._scratch = {}  # rows -> Scratch: a Decoder runs one step at a time
        self._compiled = None  # layers_step compiled (`compile`), run for a cache with static shapes

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
        seen) -> logits [rows, vocab] float32. The cache is called directly: `begin(1)`, then
        per layer `attend(layer, query, keys, values, scaling)`, then `end()`."""
        if self.why_not is not None:
            out = self.model(token_ids, position_ids=positions[:, None], cache=cache, logits_to_keep=1)
            return out.logits[:, -1].float()
        cache.begin(1)
        scratch = self.scratch(token_ids.shape[0], token_ids.device)
        if cache.static_step:
            # inference_mode skips autograd's dispatch and version counters, ~1 us of each of a
            # step's ~3,000 ops (bench ops). Only here: the static step writes in place into
            # buffers made outside it (the cache's, DecodeStep's, scratch) and allocates nothing
            # that outlives it, so no inference tensor ever reaches code that runs without it (an
            # in-place write to one there raises). The general path (a layer's first input
            # allocates its buffers; a large budget under an eighth full) runs under no_grad.
            with torch.inference_mode():
                layers_step = self.layers_step if self._compiled is None else self._compiled
                logits = layers_step(token_ids, positions, cache, scratch)
        else:
            logits = self.layers_step(token_ids, positions, cache, scratch)
        cache.end()
        return logits

    def compile(self, **options):
        """Compile the tensor work of a step (`layers_step`) with torch.compile (`options` its own,
        e.g. mode="reduce-overhead" for CUDA graphs), for caches whose step has the same shapes at
        every token (`cache.static_step`: full or filling layers, or a batch); others run it eagerly. It
        compiles at the first such step. Returns self."""
        if self.why_not is None:
            self._compiled = torch.compile(self.layers_step, dynamic=False, **options)
        return self

    def switch_to(self, compiled):
        """Run `compiled` (layers_step's arguments and result; models/compile.py's CompiledStep) for
        caches whose step has static shapes. One reference, read once at the start of each step."""
        if self.why_not is None:
            self._compiled = compiled
        return self

    compiled = property(lambda self: self._compiled, doc="what runs a step of static shapes (None: layers_step)")

    def scratch(self, rows, device):
        """The norms' buffers for a step of `rows` rows, made at the first one."""
        return self._scratch.get(rows) or self._scratch.setdefault(rows, Scratch.make(
            rows, self.hidden, self.q_heads, self.head_dim, self.norm.dtype, self.eps, device))

    def layers_step(self, token_ids, positions, cache, scratch):
        """The tensor work of `step`, between the cache's `begin` and `end`: no host sync, no Python
        branch on a value that changes from token to token, so a compiler sees one graph for every
        token of a full cache (tests/test_decode.py counts its recompiles)."""
        rows, d, heads = token_ids.shape[0], self.head_dim, (self.q_heads, self.kv_heads)
        x = self.embed(token_ids).view(rows, self.hidden)
        cos, sin_flip = self.rotation(positions, x.dtype)  # [rows, 1, 1, head_dim]
        halves = (rows, -1, 1, 2, d // 2)
        steps = cache.decode_steps() if self.rotate is not None and cache.static_step else None
        for i, w in enumerate(self.layers):
            y = w.qkv(rms_norm(x, w.input_norm, scratch, self.norm_tail))
            step = steps[i] if steps is not None else None
            if step is not None and step.native is not None and step.int8 is None and step.kv.shape[1] == rows:
                # queries and keys rotated, keys and values into the spare slot: one op, the same bits
                self.rotate(y, w.q.start, w.k.start, w.v.start, cos, sin_flip, scratch.query, step.kv)
                attended = cache.attend(i, scratch.query, None, None, self.scaling)
            else:
                qk = (y[:, w.qk] if w.qk is not None else torch.cat((y[:, w.q], y[:, w.k]), dim=-1)).view(rows, -1, 1, d)
                # queries and keys rotated together: one rotation's ops instead of two (elementwise: same
                # bits). rotate_half(x) * sin is (-x2, x1) * sin: here (x2, x1) * (-sin, sin), the same
                # products (a sign flip rounds symmetrically), in a flip instead of two slices, neg and cat
                q, k = (qk * cos + qk.view(halves).flip(-2).view(qk.shape) * sin_flip).split(heads, 1)  # [rows, heads, 1, head_dim]
                v = y[:, w.v].view(rows, -1, 1, d)
                attended = cache.attend(i, q, k, v, self.scaling)
            x = x + w.o(attended.view(rows, -1))
            gu = w.gate_up(rms_norm(x, w.post_norm, scratch, self.norm_tail))
            x = x + w.down(F.silu(gu[:, w.gate]) * gu[:, w.up])
        return self.lm_head(rms_norm(x, self.norm, scratch, self.norm_tail)).float()

    def rotation(self, positions, dtype):
        """RoPE's cos, and sin with its first half negated, for the new tokens, [rows, 1, 1, head_dim],
        as transformers makes cos and sin."""
        freqs = positions[:, None, None, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling
        sin[..., : self.head_dim // 2].neg_()
        return cos.to(dtype), sin.to(dtype)  # broadcast over [rows, heads, 1, head_dim]


@dataclass(frozen=True)
class Scratch:
    """Buffers a step reuses for `rows` rows, so a norm's casts are one copy_ each where `.float()`
    and `.to(dtype)` are four ops (to, _to_copy, empty_strided, copy_), and its constants are
    tensors already (a Python number becomes a tensor and is cast, four more ops each time); and
    where rotate_one writes the queries."""

    wide: torch.Tensor  # [rows, hidden] float32
    narrow: torch.Tensor  # [rows, hidden] the model's dtype
    count: torch.Tensor  # 0-d float32: hidden, what `mean` divides by
    eps: torch.Tensor  # 0-d float32: the norms' epsilon
    query: torch.Tensor  # [rows, q_heads, 1, head_dim] the model's dtype: rotate_one's rotated queries

    @classmethod
    def make(cls, rows, hidden, q_heads, head_dim, dtype, eps, device):
        return cls(wide=torch.empty(rows, hidden, device=device), narrow=torch.empty(rows, hidden, dtype=dtype, device=device),
                   count=torch.tensor(float(hidden), device=device), eps=torch.tensor(eps, dtype=torch.float32, device=device),
                   query=torch.empty(rows, q_heads, 1, head_dim, dtype=dtype, device=device))


def rms_norm(x, weight, s: Scratch, tail=None):
    """LlamaRMSNorm's bits, x [rows, hidden]: in float32, back to the model's dtype before the
    weight. Its `mean` is `sum` then `div_` by the count on a CPU, x.pow(2) is x * x, and the
    in-place ops round as the out-of-place ones (tests/test_decode.py holds this to the model's
    bits); 10 ops instead of 26. With `tail` (a bf16 model on a CPU: Decoder.norm_tail) the steps
    after the sum are one op writing s.narrow, which is returned: 4 ops (the caller's matmul reads
    it before the next norm writes it again)."""
    x32 = s.wide.copy_(x)
    if tail is not None:
        tail(x32, (x32 * x32).sum(-1), weight, s.narrow)
        return s.narrow
    variance = (x32 * x32).sum(-1, keepdim=True).div_(s.count)
    return weight * s.narrow.copy_(x32.mul_(variance.add_(s.eps).rsqrt_()))


def lean_call(module, dtype):
    """rows [n, in] -> [n, out] in `dtype` for a packed module or a float nn.Linear."""
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
    return (lambda rows: torch.cat([c(rows) for c in calls], dim=-1)), spans


def layer_calls(layer, head_dim, dtype):
    attn, mlp = layer.self_attn, layer.mlp
    qkv, (q, k, v) = joined([attn.q_proj, attn.k_proj, attn.v_proj], getattr(attn, "qkv_proj", None), dtype)
    gate_up, (gate, up) = joined([mlp.gate_proj, mlp.up_proj], getattr(mlp, "gate_up_proj", None), dtype)
    return LayerCalls(input_norm=layer.input_layernorm.weight, qkv=qkv, qk=slice(q.start, k.stop) if q.stop == k.start else None,
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

