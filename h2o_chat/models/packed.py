"""Linear layers whose weights stay 4 or 8 bits wide in memory, run by torch's own weight-only
kernels (the ones gpt-fast uses):

    Int4Linear   w = (q - 8) * scale + zero, q in 0..15, one (scale, zero) per group of 32 inputs
                 CPU: one row (a decode step) torch.ops.h2o_chat.int4_mm (native/int4_mm.c, where
                 it compiles), more aten._weight_int4pack_mm_for_cpu; CUDA: aten._weight_int4pack_mm
                 (tinygemm)
    Int8Linear   w = q * scale, q in -128..127, one scale per output row: aten._weight_int8pack_mm
    PackedEmbedding  a token's row read out of an Int4Linear's packed weight (a tied lm_head's)

Each keeps nn.Linear's interface (in_features, out_features, forward(x [..., in]) -> [..., out]),
so a quantized model is still a transformers model: its forward, generate and H2OCache run
unchanged. The kernels compute in bf16, their only vectorized path on a CPU (fp32 activations
take a scalar loop, ~30x slower); a model of another dtype is cast to bf16 around them.

Why decode is faster: a token reads every weight once, and a CPU's time for that is the bytes
over the memory bandwidth; 4.5 bits a weight instead of 16. Why prefill is not done by the same
kernel: it dequantizes its weights again for every few rows (measured: 2.3x bf16's time at 256
rows), so above `KERNEL_ROWS` rows a layer dequantizes its weight once and calls bf16 matmul
(`weight_t`: in bf16 on a CPU native/dequant_int4.c, 2-5x faster than torch's ops, the same bits).

What that costs in exactness: a row's result depends on how many rows share its call. One row
(NATIVE_ROWS: a decode step) is int4_mm's bits, 2 to KERNEL_ROWS rows aten's kernel's, each whatever
the count and fused (q/k/v in one call) or not; the two differ by rounding (a bf16 step now and
then). Past KERNEL_ROWS the weight is rounded to bf16 first (each weight by up to 2^-9 of itself),
so the result moves by up to ~2^-8 of sum(|x| |w|). And every input is cast to bf16: a float32
difference of ~1e-7 elsewhere (attention for one token against the same token inside a prefill)
moves an input to the next bf16 value now and then, which float weights would carry on at ~1e-7.
So the same tokens fed in different chunks (a ChatSession's turns: a reply one token a step, a
message in a few rows; model.generate: the whole history in one forward) part from the first
layers on: on the embedded model by ~1% of the largest logit (a few bf16 steps; float32
activations), and greedy text can differ where two tokens are that close. Both causes are
measured in tests/test_quantized.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from .. import native

GROUP = 32  # inputs sharing one (scale, zero): GGUF's block size, and the kernels' smallest group
COMPUTE_DTYPE = torch.bfloat16  # the kernels' activations, scales and zeros
# At most this many rows go through a kernel; more dequantize the weight for one bf16 matmul. The
# crossovers measured on the embedded model's layers (prefill of 4-512 tokens, one thread):
KERNEL_ROWS = 64  # int4: the kernel is faster than bf16 itself up to 64 rows, the dequantizing path from ~100
INT8_KERNEL_ROWS = 24  # int8: at 32 rows the two take the same time, at 64 the kernel 1.35x longer
# int4_mm.c runs a call of up to this many rows, aten's kernel more: on the embedded model's layers
# (2 cores) a token's 121 int4 matmuls took 3.9-4.3 ms against aten's 5.2-5.4, while at 3 rows
# int4_mm matched aten on the larger ones and was 1.2-1.3x slower on the small (docs/engine.md)
NATIVE_ROWS = 1
BLOCK_ROWS = 64  # the CPU kernel's weight layout holds rows in blocks of 64 (see pack_int4_cpu)
PACK_ROWS = 4096  # rows packed at a time: bounds the memory a large matrix needs while it is packed
# weight_t's constants as 0-dim tensors: a Python int would be wrapped into a tensor every call
_SIGN_FLIP = torch.tensor(0x88, dtype=torch.uint8)
_NIBBLE = torch.tensor(4, dtype=torch.int8)


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# Quantizing float weights


def quantize_int4(weight):
    """Asymmetric 4-bit codes per group of 32 inputs (gpt-fast's `get_group_qparams`): the group's
    range [min, max] in 16 steps. weight [out, in] (in a multiple of 32) -> codes uint8 [out, in]
    in 0..15, scale and zero float32 [out, in / 32] with w ~= (codes - 8) * scale + zero."""
    w = weight.float().reshape(weight.shape[0], -1, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-6)
    codes = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(weight.shape), scale, low + 8 * scale


def quantize_int8(weight):
    """Symmetric 8-bit codes per output row. weight [out, in] -> codes int8 [out, in] and scale
    float32 [out] with w ~= codes * scale."""
    w = weight.float()
    scale = (w.abs().amax(-1) / 127).clamp(min=1e-8)
    return (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale


def dequantize_int4(codes, scale, zero):
    """(codes - 8) * scale + zero in float32, [out, in]: what the kernels compute with."""
    w = (codes.float() - 8).reshape(codes.shape[0], -1, GROUP)
    return (w * scale[..., None] + zero[..., None]).reshape(codes.shape)


# ---------------------------------------------------------------------------------------------
# The CPU kernel's layout (aten._convert_weight_to_int4pack_for_cpu, torch 2.13)


def pack_int4_cpu(codes):
    """codes uint8 [rows, k] (rows a multiple of 64) -> the CPU kernel's packed weight, uint8
    [rows, k / 2]: rows in blocks of 64; a block is k-major, 32 bytes per input, byte j holding
    row j in its low nibble and row j + 32 in its high one. This is the layout that
    `_convert_weight_to_int4pack_for_cpu` writes (checked once, `check_cpu_layout`); packing it
    here needs no int32 copy of the codes (4 bytes a weight) and goes a block of rows at a time."""
    rows, k = codes.shape
    blocks = codes.reshape(rows // BLOCK_ROWS, 2, BLOCK_ROWS // 2, k)
    return (blocks[:, 0] | (blocks[:, 1] << 4)).transpose(1, 2).reshape(rows, k // 2)


def unpack_int4_cpu(packed):
    """The codes of `pack_int4_cpu`'s layout, uint8 [rows, k] in 0..15."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    # bytes to [block, row % 32, input] first: the nibbles then split with dense reads and writes
    # (splitting them straight out of the k-major layout is 2x slower)
    blocks = packed.view(rows // BLOCK_ROWS, k, BLOCK_ROWS // 2).transpose(1, 2).contiguous()
    codes = torch.empty(rows // BLOCK_ROWS, 2, BLOCK_ROWS // 2, k, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(blocks, 15, out=codes[:, 0])
    torch.bitwise_right_shift(blocks, 4, out=codes[:, 1])
    return codes.view(rows, k)


@functools.cache
def check_cpu_layout():
    """Raise when this torch packs int4 weights differently from `pack_int4_cpu` (its layout is
    private to torch: a later release may change it, and prefill and PackedEmbedding read it)."""
    codes = torch.randint(0, 16, (2 * BLOCK_ROWS, 2 * GROUP), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    if not torch.equal(theirs, pack_int4_cpu(codes)):
        raise RuntimeError(f"torch {torch.__version__} packs int4 weights in a layout h2o-chat does not know "
                           "(it was written for torch 2.13); load with quantization='none' or 'int8'")


def pack_int4_cuda(codes):
    """codes uint8 [rows, k] -> tinygemm's packed weight (aten._convert_weight_to_int4pack: two codes
    a byte, the even input in the high nibble, then its own tiling). Returns (packed, inner_k_tiles).
    Written for CUDA builds of torch and not run on this project's CPU-only machines."""
    k = codes.shape[1]
    tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles), tiles


def kernel_missing(kind, device) -> str | None:
    """Why the `kind` ("int4", "int8") kernel cannot run on `device` (None: it can)."""
    device = torch.device(device)
    if kind == "int4":
        op = "_weight_int4pack_mm_for_cpu" if device.type == "cpu" else "_weight_int4pack_mm"
    else:
        op = "_weight_int8pack_mm"
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    if key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key):
        return f"this torch has no {kind} kernel for {device.type} (aten.{op})"
    if device.type == "cuda" and kind == "int4" and not torch.cuda.is_bf16_supported():
        return "the int4 CUDA kernel (tinygemm) needs a GPU with bf16 (compute capability 8.0+)"
    return None


def _int4_mm_row(i):
    """The row of a block that native/int4_mm.c's lane i % 8 of accumulator i // 8 sums (its lane_row)."""
    v, lane = i // 8, i % 8
    return 32 * ((v % 4) // 2) + 8 * (v // 4) + (0 if lane < 4 else 16) + 4 * (v % 2) + lane % 4


INT4_MM_ROWS = torch.tensor([_int4_mm_row(i) for i in range(BLOCK_ROWS)])


def block_scales(scales_and_zeros):
    """A symmetric weight's scales (every zero 0: a GGUF Q4_0 file's) as int4_mm reads them, bf16
    [out_pad / 64, groups, 64]: block by block, group by group, a group's 64 in INT4_MM_ROWS order;
    None for a weight with a nonzero zero, off a CPU, or where int4_mm does not run. 1/16 byte a
    weight beside the pairs' 1/8; a decode step reads them instead of the pairs: half the bytes,
    one run a block (the 1B-class Q4_0 file's matrices 1.11-1.15x, docs/engine.md). An asymmetric
    weight keeps the pairs alone: the same copy of them measured 1.06x for 1/8 byte a weight."""
    if scales_and_zeros.device.type != "cpu" or scales_and_zeros[..., 1].any() or native.int4_mm() is None:
        return None
    groups, out_pad, _ = scales_and_zeros.shape
    scales = scales_and_zeros[..., 0].reshape(groups, out_pad // BLOCK_ROWS, BLOCK_ROWS)
    return scales[:, :, INT4_MM_ROWS].transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------------------
# The modules


def cpu_int4_mm(one_row, rows, packed, scales, scales_by_block=None):
    """rows bf16 [n, width] times a CPU-packed int4 weight: `one_row` (native.int4_mm, or None where
    it does not run) for a call of up to NATIVE_ROWS rows, aten's kernel for more."""
    if one_row is not None and rows.shape[0] <= NATIVE_ROWS:
        return one_row(rows, packed, scales, scales_by_block)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales)


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W [out_features, in_features] held as 4-bit codes, group 32.

    packed: the kernel's weight (CPU: uint8 [out_pad, width / 2]); scales_and_zeros: bf16
    [width / 32, out_pad, 2]; scales_by_block: a symmetric weight's scales again, as a decode step
    reads them (`block_scales`), or None. out_pad is out_features rounded up to 64 (zero rows,
    sliced off).
    `repeats` = 2 holds an 8-bit weight exactly as two 4-bit halves side by side along the
    inputs, W = W_high + W_low (see gguf.py: Q8_0), read by one kernel call on [x, x]; width is
    in_features * repeats, rounded up to 32 (zero columns; x is padded to match)."""

    def __init__(self, packed, scales_and_zeros, in_features, out_features, bias=None, repeats=1, inner_k_tiles=None,
                 scales_by_block=None):
        super().__init__()
        self.in_features, self.out_features, self.repeats = in_features, out_features, repeats
        self.width = _round_up(in_features * repeats, GROUP)
        self.inner_k_tiles = inner_k_tiles  # CUDA's layout only
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("scales_by_block", scales_by_block, persistent=False)  # derived: not saved
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_codes(cls, codes, scale, zero, in_features, bias=None, repeats=1, device="cpu"):
        """codes uint8 [out, width] in 0..15 (width = in_features * repeats rounded up to 32),
        scale and zero float [out, width / 32] -> the module on `device`."""
        return cls.from_chunks([(codes, scale, zero)], codes.shape[0], codes.shape[1], in_features, bias, repeats, device)

    @classmethod
    def from_chunks(cls, chunks, out_features, width, in_features, bias=None, repeats=1, device="cpu"):
        """`from_codes` for a weight given as consecutive row ranges (codes, scale, zero), each a
        multiple of 64 rows but the last: a large table is packed without all its codes at once."""
        device = torch.device(device)
        assert width == _round_up(in_features * repeats, GROUP) and repeats in (1, 2), (width, in_features, repeats)
        assert repeats == 1 or width == in_features * repeats, "two halves need in_features a multiple of 16"
        padded_out = _round_up(out_features, BLOCK_ROWS)
        scales_and_zeros = torch.empty(width // GROUP, padded_out, 2, dtype=COMPUTE_DTYPE)
        scales_and_zeros[:, out_features:] = 0  # padded rows: scale and zero 0, weights 0 whatever their codes
        packed = torch.empty(padded_out, width // 2, dtype=torch.uint8)  # every row is written below
        all_codes, start = [], 0
        for codes, scale, zero in chunks:
            stop = start + codes.shape[0]
            assert codes.shape[1] == width and (start % BLOCK_ROWS == 0), (codes.shape, start)
            scales_and_zeros[:, start:stop, 0] = scale.t()
            scales_and_zeros[:, start:stop, 1] = zero.t()
            if device.type == "cpu":
                check_cpu_layout()
                if codes.shape[0] % BLOCK_ROWS:
                    codes = F.pad(codes, (0, 0, 0, _round_up(codes.shape[0], BLOCK_ROWS) - codes.shape[0]))
                packed[start:start + codes.shape[0]] = pack_int4_cpu(codes)
            else:
                all_codes.append(codes)
            start = stop
        assert start == out_features, (start, out_features)
        tiles = None
        if device.type != "cpu":
            codes = F.pad(torch.cat(all_codes), (0, 0, 0, padded_out - out_features))
            packed, tiles = pack_int4_cuda(codes.to(device))
        bias = None if bias is None else bias.to(device=device, dtype=COMPUTE_DTYPE)
        scales_and_zeros = scales_and_zeros.to(device)
        return cls(packed, scales_and_zeros, in_features, out_features, bias, repeats, tiles, block_scales(scales_and_zeros))

    @classmethod
    def from_float(cls, weight, bias=None, device=None):
        """Quantize a float weight [out, in] (`quantize_int4`); inputs past a multiple of 32 are
        zero columns, which meet the zero padding `pad_input` adds to x."""
        width = _round_up(weight.shape[1], GROUP)
        codes, scale, zero = quantize_int4(F.pad(weight.float(), (0, width - weight.shape[1])))
        return cls.from_codes(codes, scale, zero, weight.shape[1], bias, device=device or weight.device)

    def forward(self, x):
        """x [..., in_features] -> [..., out_features] in x's dtype, computed in bf16: the kernel up to
        KERNEL_ROWS rows, past them the bf16-rounded weight (not the kernel's bits: module docstring)."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)
        if rows.shape[0] > KERNEL_ROWS and self.packed.device.type == "cpu":
            # W.T as the matmul reads it (no transposed copy); the padded rows' columns unread
            y = torch.mm(rows, self.weight_t(COMPUTE_DTYPE)[:, :self.out_features])
        else:
            y = self.matmul(self.pad_input(rows))
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def pad_input(self, rows):
        """rows [n, in_features] -> the kernel's input [n, width]: repeated, and zero-padded."""
        if self.repeats > 1:
            rows = torch.cat([rows] * self.repeats, dim=-1)
        if rows.shape[-1] != self.width:
            rows = F.pad(rows, (0, self.width - rows.shape[-1]))
        return rows

    def matmul(self, rows):
        """The kernel: rows bf16 [n, width] -> bf16 [n, out_pad]."""
        return self.kernel()(rows)

    def kernel(self):
        """The kernel over this weight as f(rows bf16 [n, width]) -> [n, out_pad], chosen by rows
        (the native op looked up once, for the lean step)."""
        # contiguous(): the CPU kernel reads a sliced (strided) scales tensor as if it were dense
        # and returns wrong numbers without a word (fused.py's parts are slices)
        packed, scales, by_block = self.packed, self.scales_and_zeros.contiguous(), self.scales_by_block
        if packed.device.type != "cpu":
            return lambda rows: torch.ops.aten._weight_int4pack_mm(rows, packed, GROUP, scales)
        one_row = native.int4_mm()
        return lambda rows: cpu_int4_mm(one_row, rows, packed, scales, by_block)

    def lean(self, dtype):
        """This layer as one plain function for the lean decode step: rows [n, in_features] in
        `dtype` -> [n, out_features] in `dtype`, bias added. Everything that does not change per
        call (which kernel, casts, padding) is decided here."""
        kernel, bias, out = self.kernel(), self.bias, self.out_features
        cast, pad = dtype != COMPUTE_DTYPE, self.repeats > 1 or self.width != self.in_features
        trim = self.scales_and_zeros.shape[1] != out  # the padded rows' columns are dropped
        if not (cast or pad or trim or bias is not None):
            return kernel

        def call(rows):
            rows = rows.to(COMPUTE_DTYPE) if cast else rows
            y = kernel(self.pad_input(rows) if pad else rows)
            y = y[:, :out] if trim else y
            y = y if bias is None else y + bias
            return y.to(dtype) if cast else y
        return call

    def dequantize(self, dtype=torch.float32, rows=None):
        """W [out_pad, in_features] (padded rows are zero) in `dtype`, from the packed codes (CPU): a
        transposed view of `weight_t`. rows: only these rows (an index tensor), [len(rows),
        in_features], contiguous: PackedEmbedding's lookup."""
        if rows is None:
            return self.weight_t(dtype).t()
        sz = self.scales_and_zeros[:, rows]
        codes = self.row_codes(rows)
        w = (codes.view(torch.int8) - 8).to(dtype).view(codes.shape[0], -1, GROUP)
        scale, zero = (sz[..., i].t().to(dtype).unsqueeze(-1).contiguous() for i in (0, 1))  # [rows, groups, 1]
        # in place, two ops, each rounding to `dtype` as weight_t's do (the same bits)
        w = w.mul_(scale).add_(zero).view(codes.shape[0], -1)
        if self.repeats > 1:
            w = w.view(w.shape[0], self.repeats, -1).sum(1)
        return w[:, :self.in_features]

    def weight_t(self, dtype=COMPUTE_DTYPE):
        """W.T [in_features, out_pad] in `dtype` (CPU): (q - 8) * scale + zero, rounded to `dtype`
        after the product and after the sum (the bits `dequantize` has always given; one addcmul
        would round once). A prefill's matmul reads this layout as it is, and it is the packed
        bytes' own: they hold a block of 64 rows input by input, 32 bytes an input, so each byte
        run fills a 32-weight run of W.T's row, and the scales broadcast along out_pad weights
        (along W's rows they would be runs of 32: the product and the sum took ~1.3x as long)."""
        out_pad, width, half = self.packed.shape[0], self.width, BLOCK_ROWS // 2
        cpu = self.packed.device.type == "cpu" and self.packed.is_contiguous()
        in_c = native.dequant_int4() if dtype == torch.bfloat16 and cpu else None
        if in_c is not None:  # the same bits in one pass (native/dequant_int4.c)
            wt = in_c(self.packed, self.scales_and_zeros.contiguous())
            wt = wt.view(self.repeats, -1, out_pad).sum(0) if self.repeats > 1 else wt
            return wt[:self.in_features]
        # q ^ 8 read as a signed 4-bit number is q - 8: arithmetic shifts sign-extend each nibble,
        # so the codes come out as q - 8 with no subtraction pass
        signed = torch.bitwise_xor(self.packed, _SIGN_FLIP).view(torch.int8).view(out_pad // BLOCK_ROWS, width, half)
        wt = torch.empty(width, out_pad, dtype=dtype, device=self.packed.device)
        nibbles = wt.view(width, out_pad // BLOCK_ROWS, 2, half).transpose(0, 1)  # [block, input, nibble, 32]
        nibbles[:, :, 0].copy_((signed << _NIBBLE) >> _NIBBLE)  # low nibbles: a block's rows 0..31
        nibbles[:, :, 1].copy_(signed >> _NIBBLE)  # high: rows 32..63
        # dense scales and zeros, [2, groups, 1, out_pad]: multiplying by strided ones is 6x slower
        sz = self.scales_and_zeros.permute(2, 0, 1)
        sz = (sz if sz.dtype == dtype else sz.to(dtype)).contiguous().unsqueeze(2)
        wt.view(width // GROUP, GROUP, out_pad).mul_(sz[0]).add_(sz[1])
        if self.repeats > 1:
            wt = wt.view(self.repeats, -1, out_pad).sum(0)
        return wt[:self.in_features]

    def row_codes(self, rows):
        """The codes of rows `rows` (int64 [n]), uint8 [n, width], read straight from the packed
        layout: byte (block, input, row % 32), low or high nibble by row % 64 < 32."""
        half = BLOCK_ROWS // 2
        blocks = self.packed.view(-1, self.width, half)  # [block, input, row % 32]
        shift = ((rows % BLOCK_ROWS) >= half).to(torch.uint8)[:, None] * 4
        return (blocks[rows // BLOCK_ROWS, :, rows % half] >> shift) & 15

    def rows(self, start, stop):
        """An Int4Linear for output rows [start, stop) of this one (multiples of 64) that shares
        its packed weight; its scales are a slice too (the kernel path makes them dense)."""
        assert start % BLOCK_ROWS == 0 and stop % BLOCK_ROWS == 0 and self.packed.device.type == "cpu"
        by_block = None if self.scales_by_block is None else self.scales_by_block[start // BLOCK_ROWS:stop // BLOCK_ROWS]
        return Int4Linear(self.packed[start:stop], self.scales_and_zeros[:, start:stop], self.in_features,
                          stop - start, None, self.repeats, scales_by_block=by_block)

    def extra_repr(self):
        kind = "8-bit as two 4-bit halves" if self.repeats == 2 else "4-bit"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, group={GROUP}"


class Int8Linear(nn.Module):
    """y = x @ W.T + bias with W [out_features, in_features] held as int8 codes [out, width] and
    one bf16 scale per output row, run by aten._weight_int8pack_mm (where this torch has no such
    kernel for the device, and above INT8_KERNEL_ROWS rows, W is dequantized for one bf16 matmul).
    width is in_features rounded up to 32 with zero columns: the CPU kernel returns garbage for
    rows whose length is not a multiple of 16 (measured, torch 2.13); x is padded to match."""

    def __init__(self, codes, scales, bias=None, in_features=None):
        super().__init__()
        self.out_features, self.width = codes.shape
        self.in_features = in_features or self.width
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.has_kernel = kernel_missing("int8", codes.device) is None

    @classmethod
    def from_float(cls, weight, bias=None, device=None):
        """Quantize a float weight [out, in] (`quantize_int8`)."""
        width = _round_up(weight.shape[1], GROUP)
        codes, scale = quantize_int8(F.pad(weight.float(), (0, width - weight.shape[1])))
        device = device or weight.device
        bias = None if bias is None else bias.to(device=device, dtype=COMPUTE_DTYPE)
        return cls(codes.to(device), scale.to(device=device, dtype=COMPUTE_DTYPE), bias, weight.shape[1])

    def forward(self, x):
        """x [..., in_features] -> [..., out_features] in x's dtype, computed in bf16: the kernel up to
        KERNEL_ROWS rows, past them the bf16-rounded weight (not the kernel's bits: module docstring)."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)
        if rows.shape[0] > INT8_KERNEL_ROWS or not self.has_kernel:
            y = F.linear(rows, self.dequantize(COMPUTE_DTYPE))
        else:
            y = self.matmul(self.pad_input(rows))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def pad_input(self, rows):
        """rows [n, in_features] -> [n, width]."""
        return rows if self.width == self.in_features else F.pad(rows, (0, self.width - self.in_features))

    def lean(self, dtype):
        """As Int4Linear.lean: rows [n, in_features] in `dtype` -> [n, out_features] in `dtype`."""
        if not self.has_kernel:
            return lambda rows: self(rows)
        kernel, codes, scales, bias = torch.ops.aten._weight_int8pack_mm, self.codes, self.scales, self.bias
        cast, pad = dtype != COMPUTE_DTYPE, self.width != self.in_features
        if not (cast or pad or bias is not None):
            return lambda rows: kernel(rows, codes, scales)

        def call(rows):
            rows = rows.to(COMPUTE_DTYPE) if cast else rows
            y = kernel(self.pad_input(rows) if pad else rows, codes, scales)
            y = y if bias is None else y + bias
            return y.to(dtype) if cast else y
        return call

    def matmul(self, rows):
        """The kernel: rows bf16 [n, in_features] -> bf16 [n, out_features]."""
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)

    def dequantize(self, dtype=torch.float32, rows=None):
        """W [out_features, in_features] in `dtype`; rows: only these rows (an index tensor)."""
        codes, scales = (self.codes, self.scales) if rows is None else (self.codes[rows], self.scales[rows])
        return codes[:, :self.in_features].to(dtype) * scales.to(dtype)[:, None]

    def rows(self, start, stop):
        """An Int8Linear for output rows [start, stop) that shares this one's codes and scales."""
        return Int8Linear(self.codes[start:stop], self.scales[start:stop], None, self.in_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, 8-bit, per-row scales"


class PackedEmbedding(nn.Module):
    """A token table read out of a packed weight (CPU): the rows of a tied lm_head (Int4Linear or
    Int8Linear), so the table is held once, at its packed width, or a table packed for this alone.
    A lookup dequantizes only the rows asked for; ids [...] -> [..., embedding_dim] in `dtype`."""

    def __init__(self, table, dtype, tied: bool):
        super().__init__()
        self.table, self.dtype, self.tied = table, dtype, tied
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids):
        rows = ids.reshape(-1)
        if rows.numel() <= KERNEL_ROWS:  # a decode step's few tokens: no sort
            return self.table.dequantize(self.dtype, rows=rows).view(*ids.shape, self.embedding_dim)
        # a prompt repeats its tokens (2,048 of a text: ~670 distinct): each row dequantized once
        distinct, where = rows.unique(return_inverse=True)
        return self.table.dequantize(self.dtype, rows=distinct)[where].view(*ids.shape, self.embedding_dim)

    def extra_repr(self):
        source = "the tied lm_head's packed rows" if self.tied else "a packed table"
        return f"{self.num_embeddings}, {self.embedding_dim}, read from {source}"
