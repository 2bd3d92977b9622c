"""8-bit keys and values (CacheConfig.kv_quant="int8"): a slot's key and value as 8-bit codes with
a scale and a zero point each, per token and head: zero + code * scale, codes 0..255 (uint8), the
zero point the vector's smallest element.

Why a zero point: a key's channels are lopsided (RoPE pairs with a large mean), so a symmetric
scale wastes half its codes; on the embedded model over 1,024 tokens of held-out text the
offset nearly halves the logits' error (mean |delta| 0.09 -> 0.05, top-1 agreement 98.4% -> 99.2%).

Why float16 scales and zero points: a slot's bytes are what a user pays in. Stored at float32
they took 16 of a token and head's 144 bytes (head_dim 64); at float16, 8 of 136, so the same
memory holds 256 / 136 = 1.88x the tokens of a bf16 cache instead of 1.78x. The codes are
computed against the exact pair and the pair is then rounded to float16 (by up to 2^-11 of
itself): a value comes back within half a step plus at most 255 * 2^-11 of a step and 2^-11 of
its zero point. (Codes computed against the rounded pair instead left re-laid keys no closer, 1.06
against 1.03 steps rms after 12 re-lays in test_kv_quant's rolling case, for two more ops in the
decode step.) Keys and values beyond float16's range (65,504) cannot be stored.

Scales and zero points live in a layer's `qp` buffer [4, b, h, cap] float16 (rows KEY_SCALE,
VALUE_SCALE, KEY_ZERO, VALUE_ZERO), laid out slot for slot as kv, meta and acc are, so every move
of a slot (a replacement, an eviction's gather, a batch row, a saved state) moves it the same way.
The decode step never widens a [slots, head_dim] tensor by its scales (a broadcast over head_dim
costs ~10x a copy on a CPU): it copies the codes into one float scratch shared by the cache's
layers (`WideScratch`), the keys and then the values through the same buffer, copies the four
rows up to float32 once, and puts the scales and zero points on the small side of each product:
    q . (zero + codes * scale)        = scale * (q . codes) + zero * sum(q)        (logits)
    sum_j p_j (zero_j + codes_j s_j)  = (p * s) @ codes + p @ zero                 (output)
"""

from dataclasses import dataclass

import torch

KEY_SCALE, VALUE_SCALE, KEY_ZERO, VALUE_ZERO = range(4)  # rows of a layer's qp buffer
SCALES, ZEROS = slice(KEY_SCALE, VALUE_SCALE + 1), slice(KEY_ZERO, VALUE_ZERO + 1)
N_ROWS = 4
QP_DTYPE = torch.float16  # how scales and zero points are stored
CODES = torch.uint8  # the dtype of a layer's kv buffer for 8-bit slots
STEPS = 255  # a vector's range [low, high] in 255 steps: codes 0..255, zero = low
TINY = 2.0**-24  # the smallest scale, a constant vector's: float16's smallest positive number
HUGE = torch.finfo(QP_DTYPE).max  # the largest scale float16 holds


def quantize(x, acc_dtype=torch.float32):
    """x [..., head_dim] float -> (codes uint8 [..., head_dim], scale [...], zero [...] in QP_DTYPE)
    with zero + codes * scale ~ x: each vector's range cut into 255 steps from its smallest element
    (in acc_dtype), each element rounded to the nearest, then the pair rounded to QP_DTYPE. (x -
    low) / scale lies in [0, 255] however the floats round (x >= low exactly, and the range over
    its own 255th is 255 to a few ulps), so no clamp is needed. Values on a grid that QP_DTYPE
    holds come back exactly. `Int8Step.write` does the same ops on the new token, bit for bit."""
    x = x.to(acc_dtype, copy=True)
    low, high = torch.aminmax(x, dim=-1)
    scale = torch.sub(high, low).div_(STEPS).clamp_(TINY, HUGE)
    codes = x.sub_(low[..., None]).div_(scale[..., None]).round_().to(CODES)
    return codes, scale.to(QP_DTYPE), low.to(QP_DTYPE)


def dequantize(codes, scale, zero, dtype):
    """`quantize`'s output (or the stored one, scale and zero in QP_DTYPE) back to float: codes
    [..., head_dim] uint8, scale, zero [...] -> [..., head_dim] in dtype, computed in at least
    float32. (The prefill's path: the decode step never widens by the scales, see above.)"""
    wide = torch.promote_types(torch.promote_types(dtype, scale.dtype), torch.float32)
    return codes.to(wide).mul_(scale.to(wide)[..., None]).add_(zero.to(wide)[..., None]).to(dtype)


class WideScratch:
    """Where a decode step copies int8 codes as floats to multiply them: one buffer shared by every
    layer of a cache (they run one after another), so int8 slots cost one layer's keys (then its
    values) at float width, not every layer's. Keys and values take turns in it rather than sharing
    a buffer twice the size: this copy is memory-bound (in the embedded model's step, a [2, 3, 513,
    64] float32 copy took 15-20 us in some processes and 110-150 us in others, ~10 us hot in
    isolation), and half the bytes took int8's decode from 0.82x to 0.89x of bf16's in the slow
    ones (2026-12-07; docs/engine.md). A layer larger than the buffer gets a new one (a step made
    earlier keeps the old: its views still hold it)."""

    def __init__(self):
        self.buffer = None

    def for_slots(self, kv, acc_dtype):
        """[b*h, cap, d] in acc_dtype for the int8 slots kv [2, b, h, cap, d] (None for float slots)."""
        if kv.dtype != CODES:
            return None
        _, b, h, cap, d = kv.shape
        n = b * h * cap * d
        if self.buffer is None or self.buffer.numel() < n or self.buffer.dtype != acc_dtype or self.buffer.device != kv.device:
            self.buffer = torch.empty(n, dtype=acc_dtype, device=kv.device)
        return self.buffer[:n].view(b * h, cap, d)


@dataclass(frozen=True)
class Int8Step:
    """A full layer's int8 views and scratch for the decode step (step.DecodeStep holds one), made
    once. b rows, h KV heads, g query heads per KV head, cap slots, d head_dim; acc is the score
    dtype (float32, or float64), in which all of it runs."""

    key_codes: torch.Tensor  # [b*h, cap, d] uint8: views of kv
    value_codes: torch.Tensor
    keys_t: torch.Tensor  # [b*h, d, cap] acc: the key codes as floats, in the shared scratch
    values: torch.Tensor  # [b*h, cap, d] acc: the value codes, in the same scratch after the keys
    qp_rows: torch.Tensor  # [N_ROWS, b*h, cap] QP_DTYPE: a view of the layer's qp buffer
    qparams: torch.Tensor  # [N_ROWS, b*h, cap] acc: qp_rows copied up, once a step
    key_scales: torch.Tensor  # [b*h, 1, cap]: views of qparams' rows
    key_zeros: torch.Tensor  # [b*h, 1, cap]
    value_scales: torch.Tensor  # [b*h, 1, cap]
    value_zeros: torch.Tensor  # [b*h, cap, 1]
    query: torch.Tensor  # [b*h, g, d] acc: the query times the attention's scale
    query_sum: torch.Tensor  # [b*h, g, 1]
    logits: torch.Tensor  # [b*h, g, cap]
    probs_scaled: torch.Tensor  # [b*h, g, cap]
    out: torch.Tensor  # [b*h, g, d]
    zero_out: torch.Tensor  # [b*h, g, 1]
    new: torch.Tensor  # [2, b, h, 1, d]: the new key and value, quantized here
    new_key: torch.Tensor  # [b, h, 1, d]: views of it
    new_value: torch.Tensor
    new_high: torch.Tensor  # [2, b, h, 1, 1]
    new_rows: torch.Tensor  # [N_ROWS, b, h, 1, 1] acc: its scales and zero points, as qp's rows hold them
    new_scales: torch.Tensor  # [2, b, h, 1, 1]: views of new_rows
    new_zeros: torch.Tensor
    spare_codes: torch.Tensor  # [2, b, h, 1, d] uint8: views of the spare slot
    spare_rows: torch.Tensor  # [N_ROWS, b, h, 1, 1] QP_DTYPE: a view of qp's spare slot
    steps: torch.Tensor  # 0-d: 255
    tiny: torch.Tensor
    huge: torch.Tensor

    @classmethod
    def over(cls, kv, qp, group, dtype, wide):
        """kv [2, b, h, cap, d] uint8, qp [N_ROWS, b, h, cap] QP_DTYPE, queries of `group` heads per
        KV head in `dtype`, wide [b*h, cap, d] in the score dtype (a WideScratch's)."""
        _, b, h, cap, d = kv.shape
        spare, acc = cap - 1, wide.dtype
        rows = wide.new_empty(N_ROWS, b * h, cap)
        new, new_rows = wide.new_empty(2, b, h, 1, d), wide.new_empty(N_ROWS, b, h, 1, 1)
        return cls(
            key_codes=kv[0].view(b * h, cap, d), value_codes=kv[1].view(b * h, cap, d), keys_t=wide.transpose(1, 2), values=wide,
            qp_rows=qp.view(N_ROWS, b * h, cap), qparams=rows,
            key_scales=rows[KEY_SCALE, :, None], key_zeros=rows[KEY_ZERO, :, None],
            value_scales=rows[VALUE_SCALE, :, None], value_zeros=rows[VALUE_ZERO, :, :, None],
            query=wide.new_empty(b * h, group, d),
            query_sum=wide.new_empty(b * h, group, 1), logits=wide.new_empty(b * h, group, cap),
            probs_scaled=wide.new_empty(b * h, group, cap), out=wide.new_empty(b * h, group, d),
            zero_out=wide.new_empty(b * h, group, 1),
            new=new, new_key=new[0], new_value=new[1], new_high=wide.new_empty(2, b, h, 1, 1),
            new_rows=new_rows, new_scales=new_rows[:2], new_zeros=new_rows[2:],
            spare_codes=kv[:, :, :, spare:], spare_rows=qp[:, :, :, spare:, None],
            steps=torch.tensor(STEPS, dtype=acc, device=kv.device), tiny=torch.tensor(TINY, dtype=acc, device=kv.device),
            huge=torch.tensor(HUGE, dtype=acc, device=kv.device),
        )

    def write(self, keys, values):
        """The new token's keys and values [b, h, 1, d] into the spare slot, quantized as `quantize` does."""
        new = self.new
        self.new_key.copy_(keys)
        self.new_value.copy_(values)
        torch.aminmax(new, dim=-1, keepdim=True, out=(self.new_zeros, self.new_high))
        torch.sub(self.new_high, self.new_zeros, out=self.new_scales).div_(self.steps).clamp_(self.tiny, self.huge)
        self.spare_codes.copy_(new.sub_(self.new_zeros).div_(self.new_scales).round_())
        self.spare_rows.copy_(self.new_rows)  # stored, rounded to QP_DTYPE (computed apart: a strided out= would break a compiled graph)

    def attention_logits(self, query, scale):
        """query [b*h, g, d] -> [b*h, g, cap] acc: (scale * q).(zero + codes * s), the key codes
        copied into the scratch first, and every slot's scales and zero points up to acc."""
        self.qparams.copy_(self.qp_rows)  # the spare's too: `write` ran before
        self.values.copy_(self.key_codes)  # keys_t is the same buffer, transposed
        # scaled first: [b*h, g, d] is the smallest operand (a bf16 query is widened before, in
        # place: a mixed-dtype mul would round the product to bf16 and allocate its cast)
        if query.dtype == self.query.dtype:
            query = torch.mul(query, scale, out=self.query)
        else:
            query = self.query.copy_(query).mul_(scale)
        logits = torch.bmm(query, self.keys_t, out=self.logits).mul_(self.key_scales)
        # the zero points' term, an outer product [b*h, g, 1] x [b*h, 1, cap] (elementwise: a bmm of
        # inner size 1 costs a matmul call and its checks)
        return logits.addcmul_(torch.sum(query, -1, keepdim=True, out=self.query_sum), self.key_zeros)

    def attention_output(self, probs):
        """probs [b*h, g, cap] -> [b*h, g, d] acc: the values' (zero + codes * s) weighed by probs."""
        self.values.copy_(self.value_codes)  # over the keys: attention_logits is done with them
        out = torch.bmm(torch.mul(probs, self.value_scales, out=self.probs_scaled), self.values, out=self.out)
        return out.add_(torch.bmm(probs, self.value_zeros, out=self.zero_out))
