"""A GGUF file's weights read at their own width.

transformers' GGUF loader always dequantizes, so the blocks are read here with the `gguf`
package's GGUFReader (metadata) and plain file reads (tensor bytes: a memory map would count the
whole file in the process's resident memory once read):

    Q4_1  block of 32: d, m (fp16), 16 bytes of codes q in 0..15;  w = d * q + m
          -> int4 group 32 as it is: scale = d, zero = m + 8d   ((q - 8) * d + m + 8d = d * q + m)
    Q4_0  block of 32: d (fp16), 16 bytes of codes;  w = d * (q - 8)  -> scale = d, zero = 0
    Q8_0  block of 32: d (fp16), 32 int8 codes q;  w = d * q. The int8 kernel has one scale per
          row, not per block, so it cannot hold Q8_0 exactly. Split q = 16 h + l (h = q >> 4 in
          -8..7, l = q & 15): w = (16d) h + d l, two int4 group-32 weights (codes h + 8, scale 16d,
          zero 0; codes l, scale d, zero 8d), side by side along the inputs: Int4Linear with
          repeats=2 reads them with one kernel call on [x, x]. Exact, 9 bits a weight.
    F32, F16, BF16  float tensors (norms, biases; a float linear stays float under "auto")
    anything else (K-quants, Q5_x, IQ*)  dequantized by the gguf package and quantized again to
          int4 group 32; one log line says how many and which

In fp32 all three repackings dequantize to exactly the gguf package's own values (every product
is exact: a fp16 scale times a 4-bit code; tests/test_packed.py). The kernels keep scales in
bf16, which rounds them as a bf16 model rounds its weights.

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


EXACT_INT4 = ("Q4_0", "Q4_1", "Q8_0")  # block types with an exact int4 path
FLOATS = ("F32", "F16", "BF16")


class GGUFError(ValueError):
    """A GGUF file whose weights cannot be read; the message is one line naming what can."""


def requantizable_kinds():
    """Block types read by dequantizing (the gguf package's numpy code) and quantizing again."""
    gguf = _gguf()
    return sorted(t.name for t in gguf.quants._type_traits if t.name not in EXACT_INT4 + FLOATS)


def check_readable(weights):
    """GGUFError for the first tensor whose block type has no path here."""
    others = requantizable_kinds()
    for info in weights.tensors.values():
        if info.kind not in EXACT_INT4 + FLOATS + tuple(others):
            raise GGUFError(f"{info.name} is stored as {info.kind}, which h2o-chat cannot read; it reads "
                            f"{', '.join(EXACT_INT4)} at their own width, {', '.join(FLOATS)} as floats, and "
                            f"quantizes {', '.join(others)} again to int4")
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
# Blocks -> int4 codes, scales and zeros (numpy in, torch out)


def _blocks(raw, block_bytes):
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _fp16(blocks, start):
    """The fp16 field at byte `start` of each block, float32 [rows, blocks]."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(quads):
    """16 bytes of packed codes per block -> [rows, blocks, 32]: low nibbles are elements 0..15,
    high nibbles 16..31 (ggml's order)."""
    return np.concatenate((quads & 15, quads >> 4), axis=-1)


def q4_0_codes(raw):
    """Q4_0 rows [rows, blocks * 18] -> codes uint8 [rows, cols], scale, zero float32 [rows, blocks]."""
    b = _blocks(raw, 18)
    d = _fp16(b, 0)
    codes = _nibbles(b[..., 2:]).reshape(raw.shape[0], -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.zeros_like(torch.from_numpy(d))


def q4_1_codes(raw):
    """Q4_1 rows [rows, blocks * 20] -> codes, scale = d, zero = m + 8d (exact in float32: m and
    8d are fp16 values of nearby size, m about -8d)."""
    b = _blocks(raw, 20)
    d, m = _fp16(b, 0), _fp16(b, 2)
    codes = _nibbles(b[..., 4:]).reshape(raw.shape[0], -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m + 8 * d)


def q8_0_halves(raw):
    """Q8_0 rows [rows, blocks * 34] -> the two 4-bit halves side by side: codes uint8
    [rows, 2 cols] (h + 8, then l), scale and zero [rows, 2 blocks] (16d, 0, then d, 8d)."""
    b = _blocks(raw, 34)
    d = _fp16(b, 0)
    q = b[..., 2:].view(np.int8).reshape(raw.shape[0], -1)
    high, low = (q >> 4) + 8, q & 15  # arithmetic shift: floor(q / 16)
    codes = np.concatenate((high, low), axis=1).astype(np.uint8)
    scale = np.concatenate((16 * d, d), axis=1)
    zero = np.concatenate((np.zeros_like(d), 8 * d), axis=1)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero)


REPACK = {"Q4_0": (q4_0_codes, 1), "Q4_1": (q4_1_codes, 1), "Q8_0": (q8_0_halves, 2)}  # (codes of, repeats)


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
        self.requantized = Counter()
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
            mode = "auto" if kind in EXACT_INT4 + FLOATS else "int8"  # see load_gguf_model's docstring
        if mode == "int8":
            self.made[kind, "quantized to int8"] += 1
            if self.quantization == "auto":  # the lm_head (its rule, above)
                self.requantized[kind] += 1
            codes, scales = zip(*(quantize_int8(rows) for rows in self._float_chunks(info, order)))
            bias = None if bias is None else bias.to(self.device, COMPUTE_DTYPE)
            return Int8Linear(torch.cat(codes).to(self.device), torch.cat(scales).to(self.device, COMPUTE_DTYPE), bias,
                              info.cols)
        if mode == "auto" and kind in FLOATS:
            self.made[kind, "kept"] += 1
            layer = nn.Linear(info.cols, info.rows, bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(self.float_tensor(info, order).to(self.device, self.dtype), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias.to(self.device, self.dtype), requires_grad=False)
            return layer
        if kind in ("Q4_0", "Q4_1") or (mode == "auto" and kind == "Q8_0"):
            self.made[kind, "as stored" if kind != "Q8_0" else "as two exact int4 halves"] += 1
            codes_of, repeats = REPACK[kind]
            chunks = (codes_of(raw) for raw in self._raw_chunks(info, order))
            return Int4Linear.from_chunks(chunks, info.rows, info.cols * repeats, info.cols, bias, repeats,
                                          device=self.device)
        self.made[kind, "quantized to int4"] += 1
        if self.quantization == "auto":
            self.requantized[kind] += 1
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
    linear int4: Q4_x as they are, the rest quantized again) or "int8" (every decoder linear int8,
    per row). The lm_head keeps its exact path where it has one (Q4_x as stored, Q8_0 as halves,
    a float one float) and is otherwise quantized to int8 per row, never to int4 group 32: it is
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
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(loader.requantized.items()))
        log.warning("h2o-chat: %s: %s weights have no exact int4 path; quantized again to int4 group %d "
                    "(the lm_head among them to int8 per row)", Path(path).name, kinds, GROUP)
    return model
