"""A GGUF file's weights read at their own width.

transformers' GGUF loader always dequantizes, so the blocks are read here with the `gguf`
package's GGUFReader (metadata) and plain file reads (tensor bytes: a memory map would count the
whole file in the process's resident memory once read).

Each block type with an exact path is read as integer codes c and, per group of 32 inputs, a
step s and offset b with w = s * c + b (the `affine_*` functions, gguf's own arithmetic):

    Q4_0  block of 32: d (fp16), 4-bit q;  w = d (q - 8)          c = q, s = d, b = -8d
    Q4_1  block of 32: d, m (fp16), 4-bit q;  w = d q + m         c = q, s = d, b = m
    Q4_K  super-block of 256: d, dmin (fp16), 8 sub-blocks of 32 with 6-bit sc, m, 4-bit q;
          w = d sc q - dmin m                                      c = q, s = d sc, b = -dmin m
    Q5_0, Q5_1, Q5_K  as Q4_0 (c = q - 16), Q4_1, Q4_K with 5-bit q (0..31)
    Q8_0  block of 32: d (fp16), int8 q;  w = d q                  c = q, s = d, b = 0

AS_STORED (4-bit c) is the int4 kernel's group-32 layout, w = (code - 8) scale + zero: codes c,
scale s, zero b + 8s. AS_HALVES (5 to 8-bit c): the int8 kernel has one scale per row, not per
block, so it cannot hold them exactly; c = 16 h + l (h = c >> 4 in -8..7, l = c & 15) makes
w = (16s) h + (s l + b), two int4 group-32 weights (codes h + 8, scale 16s, zero 0; codes l,
scale s, zero b + 8s) side by side along the inputs: Int4Linear with repeats=2 reads them with
one kernel call on [x, x] (10 bits a weight with the scales).

    Q6_K  sub-blocks of 16 (w = d sc (q - 32), int8 sc): no int4 group of 32 holds two scales, and
          one int8 scale per row cannot hold them either: quantized again to int8 per row (the
          PER_ROW kinds, 8 bits a weight) from the gguf package's values
    F32, F16, BF16  float tensors (norms, biases; a float linear stays float under "auto")
    anything else (Q2_K, Q3_K, IQ*, ...)  dequantized by the gguf package and quantized again to
          int4 group 32

One log line names what was quantized again. In float32 the kernel's weights are the gguf
package's own values bit for bit (tests/test_packed.py): s c and 8s are exact (an fp16 times a
small integer), and so are b + 8s and s l + b, the one sum each path adds, for every block of
Q4_0, Q5_0 and Q8_0 (b = 0 or -8d) and for every block a quantizer writes (gguf's, kquants.py's:
the offset is about -8 steps); sufficient is an offset scale (m, K-quants' dmin) within 2^-2..2^6
of the step scale d. A block far outside that (random bytes) is within 2 float32 ulps of its
group's largest weight. The kernels keep scales and zeros in bf16, which rounds them as a bf16
model rounds its weights.

LLaMA GGUFs store q and k rows permuted for llama.cpp's rotary layout; transformers undoes it
when it dequantizes (LlamaTensorProcessor), and the same row permutation is undone here on the
blocks (a row's blocks are that row's bytes, so permuting rows of blocks is exact).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .packed import (
    COMPUTE_DTYPE,
    GROUP,
    PACK_ROWS,
    Int4Linear,
    Int8Linear,
    PackedEmbedding,
    quantize_int4,
    quantize_int8,
)

log = logging.getLogger("h2o_chat")

Q = None  # gguf.GGMLQuantizationType, set on first use (import gguf only when a GGUF is read)


def _gguf():
    import gguf

    global Q
    Q = gguf.GGMLQuantizationType
    return gguf


AS_STORED = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit codes with a scale and zero per 32: the int4 kernel's layout
AS_HALVES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K")  # 5- to 8-bit codes per 32: two exact int4 halves
EXACT = AS_STORED + AS_HALVES
PER_ROW = ("Q6_K",)  # sub-blocks of 16, which no int4 group holds: int8 per row from the file's values
FLOATS = ("F32", "F16", "BF16")


class GGUFError(ValueError):
    """A GGUF file whose weights cannot be read; the message is one line naming what can."""


def requantizable_kinds():
    """Block types read by dequantizing (the gguf package's numpy code) and quantizing again."""
    gguf = _gguf()
    return sorted(t.name for t in gguf.quants._type_traits if t.name not in EXACT + FLOATS)


def check_readable(weights):
    """GGUFError for the first tensor whose block type has no path here."""
    others = requantizable_kinds()
    for info in weights.tensors.values():
        if info.kind not in EXACT + FLOATS + tuple(others):
            again = ", ".join(k for k in others if k not in PER_ROW)
            raise GGUFError(f"{info.name} is stored as {info.kind}, which h2o-chat cannot read; it reads "
                            f"{', '.join(AS_STORED)} as stored, {', '.join(AS_HALVES)} as two exact int4 halves, "
                            f"{', '.join(FLOATS)} as floats, and quantizes {', '.join(PER_ROW)} again to int8 "
                            f"per row and {again} to int4")
        if info.rows > 1 and info.cols % GROUP:
            raise GGUFError(f"{info.name}: {info.cols} inputs a row, not a multiple of {GROUP}")


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: rows of `row_bytes` bytes each (a 1-D tensor is one row)."""

    name: str
    kind: str  # the block type's name: "Q4_1", "F32", ...
    rows: int
    cols: int
    offset: int  # from the file's start
    row_bytes: int


class GGUFWeights:
    """The tensors of a GGUF file, read a range of rows at a time."""

    def __init__(self, path):
        gguf = _gguf()
        self.path = Path(path)
        self.architecture, tensors = read_header(self.path)
        self.tensors = {}
        for name, dims, kind, offset in tensors:
            cols, rows = dims[0], int(np.prod(dims[1:])) if len(dims) > 1 else 1
            block, size = gguf.GGML_QUANT_SIZES[Q(kind)]
            self.tensors[name] = TensorInfo(name, Q(kind).name, rows, cols, offset, cols // block * size)

    def raw(self, info: TensorInfo, start=0, stop=None):
        """Rows [start, stop) of `info` as stored, uint8 [rows, row_bytes]."""
        stop = info.rows if stop is None else stop
        with open(self.path, "rb") as f:
            f.seek(info.offset + start * info.row_bytes)
            data = np.fromfile(f, dtype=np.uint8, count=(stop - start) * info.row_bytes)
        return data.reshape(stop - start, info.row_bytes)

    def dequantized(self, info: TensorInfo, start=0, stop=None):
        """Rows [start, stop) in float32 [rows, cols], by the gguf package."""
        values = _gguf().quants.dequantize(self.raw(info, start, stop), Q[info.kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, info.cols)


# GGUF's metadata value types (gguf.GGUFValueType): fixed sizes, 8 = string, 9 = array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_header(path):
    """(architecture, [(name, dims, type id, absolute offset)]) from a GGUF file's header.

    Not GGUFReader: it turns every metadata value into numpy views, and a tokenizer's 100,000
    strings take it seconds; only two values are needed here, the rest is skipped."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise GGUFError(f"{Path(path).name} is not a GGUF file")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise GGUFError(f"{Path(path).name}: GGUF version {version} (big-endian or too old) is not read here")
        pos, fields = 24, {}

        def string(pos):
            (n,) = struct.unpack_from("<Q", m, pos)
            return bytes(m[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

        def skip(kind, pos):
            if kind == 8:
                return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
            if kind == 9:
                item, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if item in _SIZES:
                    return pos + count * _SIZES[item]
                for _ in range(count):
                    pos = skip(item, pos)
                return pos
            return pos + _SIZES[kind]

        for _ in range(n_fields):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key in ("general.architecture", "general.alignment"):
                fields[key] = string(pos)[0] if kind == 8 else struct.unpack_from("<I", m, pos)[0]
            pos = skip(kind, pos)
        tensors = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, [int(d) for d in dims], kind, offset))
    alignment = fields.get("general.alignment", 32)
    start = -(-pos // alignment) * alignment  # the data section begins at the next aligned byte
    return fields.get("general.architecture"), [(n, d, k, start + o) for n, d, k, o in tensors]


# ---------------------------------------------------------------------------------------------
# Blocks -> integer codes c with a group-32 affine map w = s * c + b, then the int4 kernel's
# codes, scales and zeros (numpy in, torch out). s, b: float32 [rows, cols / 32], computed as the
# gguf package computes its weights (d * sc is exact in float32: an fp16 times a 6-bit integer).


def _blocks(raw, block_bytes):
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _fp16(blocks, start):
    """The fp16 field at byte `start` of each block, float32 [rows, blocks]."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(quads):
    """16 bytes of packed codes per block -> [rows, blocks, 32]: low nibbles are elements 0..15,
    high nibbles 16..31 (ggml's order)."""
    return np.concatenate((quads & 15, quads >> 4), axis=-1)


def _fifth_bits(qh):
    """Q5_0/Q5_1's 4 bytes a block (a little-endian uint32) -> bit i of element i, [rows, blocks, 32]."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.reshape(*qh.shape[:-1], 32)


def _rows(values, rows):
    return values.reshape(rows, -1)


def affine_q4_0(raw):
    """Q4_0, block of 32: d (fp16), 16 bytes of codes q in 0..15; w = d (q - 8): c = q, s = d, b = -8d."""
    b = _blocks(raw, 18)
    d = _fp16(b, 0)
    return _rows(_nibbles(b[..., 2:]), raw.shape[0]), d, -8 * d


def affine_q4_1(raw):
    """Q4_1, block of 32: d, m (fp16), 16 bytes of codes q; w = d q + m."""
    b = _blocks(raw, 20)
    return _rows(_nibbles(b[..., 4:]), raw.shape[0]), _fp16(b, 0), _fp16(b, 2)


def affine_q8_0(raw):
    """Q8_0, block of 32: d (fp16), 32 int8 codes q; w = d q."""
    b = _blocks(raw, 34)
    d = _fp16(b, 0)
    return _rows(b[..., 2:].view(np.int8), raw.shape[0]), d, np.zeros_like(d)


def affine_q5_0(raw):
    """Q5_0, block of 32: d (fp16), the fifth bits (4 bytes), 16 bytes of low nibbles; q in
    0..31, w = d (q - 16): c = q - 16 in -16..15, s = d, b = 0."""
    b = _blocks(raw, 22)
    q = _nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4)
    d = _fp16(b, 0)
    return _rows(q.astype(np.int16) - 16, raw.shape[0]), d, np.zeros_like(d)


def affine_q5_1(raw):
    """Q5_1, block of 32: d, m (fp16), the fifth bits, 16 bytes of low nibbles; w = d q + m."""
    b = _blocks(raw, 24)
    q = _nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4)
    return _rows(q, raw.shape[0]), _fp16(b, 0), _fp16(b, 2)


def _k_scales(blocks):
    """A Q4_K/Q5_K super-block's d, dmin (fp16) and 12 bytes of 6-bit scales sc and mins m ->
    the 8 sub-blocks' s = d sc and b = -dmin m, float32 [rows, blocks * 8] (gguf's get_scale_min)."""
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    packed = blocks[..., 4:16]
    low, mins, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((low & 63, (high & 15) | ((low >> 2) & 48)), axis=-1).astype(np.float32)
    m = np.concatenate((mins & 63, (high >> 4) | ((mins >> 2) & 48)), axis=-1).astype(np.float32)
    rows = blocks.shape[0]
    return _rows(d[..., None] * sc, rows), _rows(-(dmin[..., None] * m), rows)


def _k_nibbles(qs):
    """128 bytes of a K super-block's 4-bit codes -> [rows, blocks, 8, 32]: byte 32c + i holds
    sub-block 2c's element i (low nibble) and sub-block 2c + 1's (high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate((chunks & 15, chunks >> 4), axis=-2).reshape(*qs.shape[:-1], 8, 32)


def affine_q4_k(raw):
    """Q4_K, super-block of 256 (144 bytes): 8 sub-blocks of 32, each its own 6-bit scale and min:
    w = d sc q - dmin m, q in 0..15: c = q, s = d sc, b = -dmin m, the int4 kernel's group 32."""
    b = _blocks(raw, 144)
    s, offset = _k_scales(b)
    return _rows(_k_nibbles(b[..., 16:]), raw.shape[0]), s, offset


def affine_q5_k(raw):
    """Q5_K, super-block of 256 (176 bytes): Q4_K's scales, then 32 bytes of fifth bits (byte i's
    bit j: sub-block j's element i), then 128 bytes of low nibbles; q in 0..31."""
    b = _blocks(raw, 176)
    s, offset = _k_scales(b)
    high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [rows, blocks, 32 elements, 8 sub-blocks]
    q = _k_nibbles(b[..., 48:]) | (high.swapaxes(-1, -2) << 4)
    return _rows(q, raw.shape[0]), s, offset


def one_int4(c, s, b):
    """c in 0..15 -> the int4 kernel's codes, scale s, zero b + 8s: (c - 8) s + b + 8s = s c + b."""
    return torch.from_numpy(c.astype(np.uint8)), torch.from_numpy(s), torch.from_numpy(b + 8 * s)


def two_halves(c, s, b):
    """c = 16 h + l (h = c >> 4 in -8..7, l = c & 15) -> two int4 weights side by side along the
    inputs, codes uint8 [rows, 2 cols], scale and zero [rows, 2 groups]: the high half codes h + 8,
    scale 16s, zero 0 (16 s h); the low half codes l, scale s, zero b + 8s (s l + b)."""
    high, low = (c >> 4) + 8, c & 15  # arithmetic shift: floor(c / 16)
    codes = np.concatenate((high, low), axis=1).astype(np.uint8)
    scale = np.concatenate((16 * s, s), axis=1)
    zero = np.concatenate((np.zeros_like(s), b + 8 * s), axis=1)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero)


AFFINE = {"Q4_0": affine_q4_0, "Q4_1": affine_q4_1, "Q4_K": affine_q4_k,
          "Q8_0": affine_q8_0, "Q5_0": affine_q5_0, "Q5_1": affine_q5_1, "Q5_K": affine_q5_k}
REPEATS = {kind: 1 if kind in AS_STORED else 2 for kind in AFFINE}  # int4 weights a file weight becomes


def repack(kind, raw):
    """Rows of `kind` blocks, uint8 [rows, row bytes] -> the int4 kernel's (codes uint8 [rows,
    cols * repeats], scale, zero float32 [rows, cols * repeats / 32]): AS_STORED kinds one int4
    weight, AS_HALVES kinds two (REPEATS)."""
    c, s, b = AFFINE[kind](raw)
    return one_int4(c, s, b) if REPEATS[kind] == 1 else two_halves(c, s, b)


def llama_row_order(rows, heads):
    """The row permutation transformers undoes on a LLaMA GGUF's q/k weights (its
    `_reverse_permute_weights`): row i of the result is row order[i] of the file."""
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.swapaxes(2, 1).reshape(rows)


# ---------------------------------------------------------------------------------------------
# Building the model


class _Loader:
    """Fills a model skeleton (made on the meta device) from a GGUFWeights."""

    def __init__(self, weights: GGUFWeights, config, dtype, device, quantization):
        gguf = _gguf()
        self.weights, self.config, self.dtype, self.device, self.quantization = weights, config, dtype, device, quantization
        arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(weights.architecture)
        if arch is None:
            raise GGUFError(f"GGUF architecture {weights.architecture!r} is not one the gguf package knows")
        self.names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        self.requantized = Counter()  # (block type, to what width) under "auto", for the log line
        self.made = Counter()  # (block type, what became of it) per linear, for `label`

    def gguf_name(self, hf_name):
        """'model.layers.0.self_attn.q_proj.weight' -> 'blk.0.attn_q.weight' (None: not in the map)."""
        base, _, suffix = hf_name.rpartition(".")
        name = self.names.get_name(base)
        return None if name is None else f"{name}.{suffix}"

    def info(self, hf_name):
        name = self.gguf_name(hf_name)
        if name is None or name not in self.weights.tensors:
            return None
        return self.weights.tensors[name]

    def row_order(self, hf_name, info):
        """The rows to read, in the model's order (q/k of a LLaMA GGUF), or None."""
        if self.weights.architecture != "llama":
            return None
        heads = {"q_proj": self.config.num_attention_heads, "k_proj": self.config.num_key_value_heads}
        part = hf_name.rsplit(".", 2)[-2]
        return llama_row_order(info.rows, heads[part]) if part in heads else None

    def float_tensor(self, info, order=None):
        values = self.weights.dequantized(info)
        if order is not None:
            values = values[torch.from_numpy(order)]
        return values.reshape(-1) if info.rows == 1 else values

    def linear(self, hf_name, info, bias):
        """The module for a linear weight stored as `info`, in self.quantization's terms."""
        order = self.row_order(hf_name, info)
        kind, mode = info.kind, self.quantization
        if hf_name == "lm_head.weight":
            mode = "auto" if kind in EXACT + FLOATS else "int8"  # see load_gguf_model's docstring
        if mode == "auto" and kind in PER_ROW:
            mode = "int8"
        if mode == "int8":
            self.made[kind, "quantized to int8"] += 1
            if self.quantization == "auto":  # PER_ROW kinds, and the lm_head (its rule, above)
                self.requantized[kind, "int8 per row"] += 1
            codes, scales = self._int8_rows(info, order)
            bias = None if bias is None else bias.to(self.device, COMPUTE_DTYPE)
            return Int8Linear(codes.to(self.device), scales.to(self.device, COMPUTE_DTYPE), bias, info.cols)
        if mode == "auto" and kind in FLOATS:
            self.made[kind, "kept"] += 1
            layer = nn.Linear(info.cols, info.rows, bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(self.float_tensor(info, order).to(self.device, self.dtype), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias.to(self.device, self.dtype), requires_grad=False)
            return layer
        if kind in AS_STORED or (mode == "auto" and kind in AS_HALVES):
            self.made[kind, "as stored" if kind in AS_STORED else "as two exact int4 halves"] += 1
            chunks = (repack(kind, raw) for raw in self._raw_chunks(info, order))
            return Int4Linear.from_chunks(chunks, info.rows, info.cols * REPEATS[kind], info.cols, bias, REPEATS[kind],
                                          device=self.device)
        self.made[kind, "quantized to int4"] += 1
        if self.quantization == "auto":
            self.requantized[kind, f"int4 group {GROUP}"] += 1
        chunks = (quantize_int4(rows) for rows in self._float_chunks(info, order))
        return Int4Linear.from_chunks(chunks, info.rows, info.cols, info.cols, bias, device=self.device)

    def label(self):
        """What the linears became, for weights_label: "int4: GGUF Q4_1 as stored (210), Q8_0 as
        two exact int4 halves (1)"."""
        packed = any(how != "kept" for _, how in self.made)
        main = "int8" if self.quantization == "int8" else "int4" if packed else str(self.dtype).removeprefix("torch.")
        parts = ", ".join(f"{kind} {how} ({n})" for (kind, how), n in self.made.most_common())
        return f"{main}: GGUF {parts}"

    def _raw_chunks(self, info, order):
        if order is not None:
            yield self.weights.raw(info)[order]
            return
        for start in range(0, info.rows, PACK_ROWS):
            yield self.weights.raw(info, start, min(start + PACK_ROWS, info.rows))

    def _float_chunks(self, info, order):
        if order is not None:
            yield self.weights.dequantized(info)[torch.from_numpy(order)]
            return
        for start in range(0, info.rows, PACK_ROWS):
            yield self.weights.dequantized(info, start, min(start + PACK_ROWS, info.rows))

    def _int8_rows(self, info, order):
        """The tensor quantized to int8 per row (`quantize_int8`) a chunk at a time, into codes int8
        [rows, cols] and scales float32 [rows] made once (no second copy of a large table)."""
        codes, scales, start = torch.empty(info.rows, info.cols, dtype=torch.int8), torch.empty(info.rows), 0
        for rows in self._float_chunks(info, order):
            stop = start + rows.shape[0]
            codes[start:stop], scales[start:stop] = quantize_int8(rows)
            start = stop
        return codes, scales

    def _float_rows(self, info, dtype):
        """The whole tensor in `dtype` (a chunk at a time in float32)."""
        return torch.cat([rows.to(dtype) for rows in self._float_chunks(info, None)])

    def fill(self, model):
        """Replace every meta tensor of `model` with the file's."""
        cpu_packed = self.device.type == "cpu"
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                info = self.info(f"{name}.weight")
                tied = info is None and name == "lm_head" and getattr(self.config, "tie_word_embeddings", False)
                if tied:
                    info = self.info("model.embed_tokens.weight")
                if info is None:
                    raise GGUFError(f"the GGUF has no tensor for {name}")
                bias_info = self.info(f"{name}.bias") if module.bias is not None else None
                bias = self.float_tensor(bias_info) if bias_info is not None else None
                model.set_submodule(name, self.linear(name + ".weight", info, bias))
        embed = model.get_input_embeddings()
        info = self.info("model.embed_tokens.weight")
        lm_head = model.get_output_embeddings()
        tied = getattr(self.config, "tie_word_embeddings", False) and self.gguf_name("lm_head.weight") not in self.weights.tensors
        if tied and type(lm_head) is nn.Linear:  # a float lm_head: one table, shared
            embed.weight = lm_head.weight
        elif cpu_packed and tied and isinstance(lm_head, (Int4Linear, Int8Linear)):
            model.set_input_embeddings(PackedEmbedding(lm_head, self.dtype, tied=True))
        elif cpu_packed and self.quantization != "int8" and info.kind not in FLOATS:
            table = self.linear("model.embed_tokens.weight", info, None)
            model.set_input_embeddings(PackedEmbedding(table, self.dtype, tied=False))
        else:
            embed.weight = nn.Parameter(self._float_rows(info, self.dtype).to(self.device), requires_grad=False)
        for name, param in list(model.named_parameters()):
            if param.device.type == "meta":
                info = self.info(name)
                if info is None:
                    raise GGUFError(f"the GGUF has no tensor for {name}")
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                setattr(module, attr, nn.Parameter(self.float_tensor(info).to(self.device, self.dtype), requires_grad=False))
        base = model.base_model
        base.rotary_emb = type(base.rotary_emb)(config=base.rotary_emb.config).to(self.device)  # its buffers are computed, not stored
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
        if left:
            raise GGUFError(f"the GGUF left these tensors unset: {', '.join(left[:5])}")
        return model


def load_gguf_model(path, config, dtype, device, quantization="auto"):
    """A transformers model of `config` whose weights are the GGUF file's at their own width
    (module docstring). quantization: "auto" (float tensors stay float), "int4" (every decoder
    linear int4: AS_STORED kinds as they are, the rest quantized again) or "int8" (every decoder
    linear int8, per row). The lm_head keeps its exact path where it has one (as stored, as
    halves, a float one float) and is otherwise quantized to int8 per row, never to int4 group 32: it is
    the layer whose rounding costs most (the embedded model's Q8_0 lm_head at int4: +4% perplexity,
    at per-row int8: +0.25%)."""
    from transformers import AutoModelForCausalLM

    weights = GGUFWeights(path)
    check_readable(weights)
    loader = _Loader(weights, config, dtype, torch.device(device), quantization)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = loader.fill(model)
    model.h2o_weights = loader.label()
    if loader.requantized:
        parts = ", ".join(f"{n} {kind} to {width}" for (kind, width), n in loader.requantized.most_common())
        log.warning("h2o-chat: %s: weights with no exact int4 path, quantized again: %s", Path(path).name, parts)
    return model
