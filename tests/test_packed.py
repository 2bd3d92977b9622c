"""Packed weights (models/packed.py, models/gguf.py's block repacking): what the kernels compute
with is exactly what the GGUF file holds, and a packed linear computes x @ W.T.

The repacking proofs run the kernel itself in float32 on an identity input: its output is then
the weights it reads, bit for bit, so these compare the bytes the kernel sees (layout, nibble
order, scales and zeros) with the gguf package's own dequantization. K-quant blocks come from
bench/kquants.py (the gguf package reads them but cannot write them); its writers are checked
here against gguf's reader first."""

import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from h2o_chat import native
from h2o_chat.bench import kquants
from h2o_chat.models import load as load_mod
from h2o_chat.models import packed as packed_mod
from h2o_chat.models.gguf import AFFINE, AS_HALVES, AS_STORED, REPEATS, repack
from h2o_chat.models.load import ModelLoadError, resolve_quantization
from h2o_chat.models.packed import (
    GROUP,
    KERNEL_ROWS,
    Int4Linear,
    Int8Linear,
    PackedEmbedding,
    dequantize_int4,
    pack_int4_cpu,
    unpack_int4_cpu,
)
from h2o_chat.models.quantize import fuse

Q = gguf.GGMLQuantizationType


def test_our_int4_layout_is_the_kernels():
    codes = torch.randint(0, 16, (192, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(pack_int4_cpu(codes), theirs)
    assert torch.equal(unpack_int4_cpu(theirs), codes)


def kernel_weights(codes, scale, zero, repeats=1):
    """What the CPU kernel computes with, float32 [out, in]: codes packed by torch's own op, the
    kernel run in float32 on an identity input (repeats: [I, I], the two halves summed by it)."""
    out, width = codes.shape
    rows = -(-out // 64) * 64
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(F.pad(codes, (0, 0, 0, rows - out)).int(), 1)
    sz = torch.stack((F.pad(scale, (0, 0, 0, rows - out)), F.pad(zero, (0, 0, 0, rows - out))), -1).transpose(0, 1)
    eye = torch.eye(width // repeats).repeat(1, repeats)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, GROUP, sz.contiguous()).T[:out]


def blocks_of(kind, rows, cols, seed=1):
    """Gaussian rows whose scale grows along the inputs (blocks of very different scales), as
    `kind` blocks (gguf's quantizer, or kquants.py's for K-quants) and gguf's float32 values."""
    values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * np.linspace(
        0.01, 3, cols, dtype=np.float32)
    raw = kquants.quantize(values, kind)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols))


@pytest.mark.parametrize("kind,bits", [("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6)])
def test_our_k_quant_blocks_read_back_through_gguf(kind, bits):
    """kquants.py's blocks, read by gguf's dequantize: every weight within a step or so of the
    value written (a nibble or scale in the wrong place is off by the whole range), and the
    error as small as the bits allow (Q4_1, Q5_1 and Q8_0's by gguf's own writer, for scale)."""
    values = np.random.default_rng(9).standard_normal((64, 1024), dtype=np.float32) * 0.02
    raw = kquants.quantize(values, kind)
    assert raw.shape == (64, 1024 // 256 * gguf.GGML_QUANT_SIZES[Q[kind]][1])
    back = gguf.quants.dequantize(raw, Q[kind]).reshape(values.shape)
    reference = {4: "Q4_1", 5: "Q5_1", 6: "Q8_0"}[bits]
    theirs = gguf.quants.dequantize(gguf.quants.quantize(values, Q[reference]), Q[reference]).reshape(values.shape)
    error, their_error = (np.sqrt(((w - values) ** 2).mean()) for w in (back, theirs))
    if bits < 6:
        assert error < 1.05 * their_error  # the same codes per 32 as Q4_1 / Q5_1, 6-bit scales
    else:
        assert their_error < error < 0.5 * 2 ** -5 * np.abs(values).max()  # Q6_K: between 5 and 8 bits
    step = (values.max() - values.min()) / 2**bits
    assert np.abs(back - values).max() < step


def test_k_quant_scales_are_ggmls_12_byte_packing():
    """Q4_K's 6-bit scales and mins, written by kquants.py and read back by gguf's get_scale_min."""
    sc = np.random.default_rng(10).integers(0, 64, (50, 8)).astype(np.uint8)
    m = np.random.default_rng(11).integers(0, 64, (50, 8)).astype(np.uint8)
    their_sc, their_m = gguf.quants.Q4_K.get_scale_min(kquants._pack_scales(sc, m))
    assert np.array_equal(their_sc, sc) and np.array_equal(their_m, m)


EXACT = [*AS_STORED, *AS_HALVES]


@pytest.mark.parametrize("kind", EXACT)
@pytest.mark.parametrize("rows,cols", [(80, 256), (64, 512), (7, 768), (80, 96), (7, 32)])
def test_gguf_blocks_repack_exactly(kind, rows, cols):
    """Q4_0, Q4_1, Q4_K as int4 group 32 (scale s, zero b + 8s); Q8_0, Q5_0, Q5_1, Q5_K as two
    int4 halves (16s h, s l + b): the codes, scales and zeros dequantize (float32) to gguf's
    values bitwise, and so do the kernel's weights (packed by torch's own op)."""
    if kind.endswith("_K") and cols % 256:
        pytest.skip("K-quant rows are whole super-blocks of 256")
    raw, expected = blocks_of(kind, rows, cols)
    codes, scale, zero = repack(kind, raw)
    repeats = REPEATS[kind]
    assert codes.shape == (rows, cols * repeats) and scale.shape == zero.shape == (rows, cols * repeats // GROUP)
    assert torch.equal(dequantize_int4(codes, scale, zero).view(rows, repeats, cols).sum(1), expected)
    assert torch.equal(kernel_weights(codes, scale, zero, repeats), expected)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_blocks_of_any_bytes_are_within_two_float32_steps(kind):
    """Blocks no quantizer writes (random bytes, d and dmin up to 2^16 apart): b + 8s can round
    in float32, so not every weight is gguf's bit for bit, but each is within 2 float32 ulps of
    its group's largest term; blocks whose dmin is within 2^-2..2^6 of d are exact."""
    rng = np.random.default_rng(12)
    size = gguf.GGML_QUANT_SIZES[Q[kind]][1]
    raw = rng.integers(0, 256, (128, 4 * size), dtype=np.uint8)
    fields = (2.0 ** rng.uniform(-14, 2, (128, 4, 2)) * rng.uniform(1, 2, (128, 4, 2))).astype(np.float16)
    raw.reshape(128, 4, size)[..., :4] = fields.view(np.uint8).reshape(128, 4, 4)  # d, dmin: finite, 2^-14..2^3
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(128, -1))
    codes, scale, zero = repack(kind, raw)
    got = kernel_weights(codes, scale, zero, REPEATS[kind])
    _, s, b = AFFINE[kind](raw)
    largest = torch.from_numpy(np.maximum(32 * np.abs(s), np.abs(b))).repeat_interleave(GROUP, 1)
    assert ((got - expected).abs() <= 2 * 2**-24 * largest).all()
    ratio = fields[..., 1].astype(np.float32) / fields[..., 0].astype(np.float32)
    near = torch.from_numpy((ratio >= 2**-2) & (ratio <= 2**6)).repeat_interleave(256, 1)
    assert near.any() and (~near).any() and torch.equal(got[near], expected[near])
    assert not torch.equal(got, expected)  # the test is about something: some far blocks do round


@pytest.mark.parametrize("kind", EXACT)
def test_a_repacked_linear_is_a_bf16_matmul_with_ggufs_weights(kind):
    """The kernel itself (bf16 activations, scales and zeros), one token and two: x @ W.T with
    gguf's float32 weights in a bf16 matmul, within test_a_packed_linear_is_x_times_its_weight's
    tolerance (the kernels' bf16 rounding)."""
    raw, weight = blocks_of(kind, 130, 512)
    layer = Int4Linear.from_codes(*repack(kind, raw), 512, repeats=REPEATS[kind])
    for rows in (1, 2):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(13)).bfloat16()
        expected = F.linear(x, weight.bfloat16()).float()
        torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_q4_1_zero_is_exact_in_float32():
    """zero = m + 8d holds exactly (no rounding) for every block of the embedded model's kind of data."""
    values = np.random.default_rng(2).standard_normal((256, 512), dtype=np.float32) * 0.05
    _, scale, zero = repack("Q4_1", gguf.quants.quantize(values, Q.Q4_1))
    m = zero.double() - 8 * scale.double()
    assert torch.equal(m.float().double(), m)  # m recovered exactly: m + 8d was not rounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", ["int4", "int8", "q8_0 halves"])
@pytest.mark.parametrize("out,inp", [(100, 40), (72, 96), (130, 576)])
def test_a_packed_linear_is_x_times_its_weight(make, out, inp, dtype):
    """Odd shapes (rows padded to 64, inputs to 32), batch 1 and 2, one token and a prefill-sized
    chunk (which dequantizes instead), bf16 and fp32 activations: x @ dequantized(W).T."""
    weight = torch.randn(out, inp, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(out) if out == 72 else None
    if make == "int4":
        layer = Int4Linear.from_float(weight, bias)
    elif make == "int8":
        layer = Int8Linear.from_float(weight, bias)
    else:
        if inp % GROUP:
            pytest.skip("Q8_0 rows are whole blocks of 32")
        layer = Int4Linear.from_codes(*repack("Q8_0", gguf.quants.quantize(weight.numpy(), Q.Q8_0)), inp, bias, repeats=2)
    w = layer.dequantize(torch.float32)[:out]
    for shape in [(1, 1, inp), (2, 1, inp), (2, KERNEL_ROWS + 5, inp)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        y = layer(x)
        assert y.shape == (*shape[:-1], out) and y.dtype == dtype
        expected = x.float() @ w.T + (0 if bias is None else bias.to(torch.bfloat16).float())
        torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_int4_weights_are_within_half_a_step_of_the_float_ones():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    error = (Int4Linear.from_float(weight).dequantize()[:64] - weight).abs().view(64, -1, GROUP)
    groups = weight.view(64, -1, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    # half a step, and the bf16 rounding of scale and zero (2^-8 of the group's largest weight)
    assert (error.amax(-1) <= 0.5 * step + groups.abs().amax(-1) / 2**7).all()


def test_the_embedding_reads_rows_of_the_packed_table():
    table = Int4Linear.from_float(torch.randn(200, 96, generator=torch.Generator().manual_seed(6)))
    ids = torch.tensor([[0, 31, 32, 63], [64, 127, 150, 199]])
    rows = PackedEmbedding(table, torch.bfloat16, tied=True)(ids)
    assert rows.shape == (2, 4, 96) and torch.equal(rows, table.dequantize(torch.bfloat16)[ids])
    halves = Int4Linear.from_codes(*repack("Q8_0", gguf.quants.quantize(np.random.default_rng(7).standard_normal(
        (100, 64), dtype=np.float32), Q.Q8_0)), 64, repeats=2)
    assert torch.equal(PackedEmbedding(halves, torch.float32, tied=True)(ids[:, :2]), halves.dequantize()[ids[:, :2]])


def codes_first_weight(layer):
    """The weight a forward past KERNEL_ROWS used to dequantize, written out the first way: the
    codes unpacked, (q - 8) in bf16, times the scale, plus the zero, each op rounding to bf16;
    two halves summed. bf16 [out_pad, in_features]."""
    codes = unpack_int4_cpu(layer.packed)
    scale, zero = (layer.scales_and_zeros[..., i].t().unsqueeze(-1) for i in (0, 1))  # [rows, groups, 1]
    w = (codes.view(torch.int8) - 8).to(torch.bfloat16).view(codes.shape[0], -1, GROUP) * scale + zero
    w = w.view(codes.shape[0], layer.repeats, -1).sum(1)
    return w[:, :layer.in_features]


@pytest.mark.parametrize("in_c", [True, False], ids=["dequant_int4.c", "torch ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forward_past_kernel_rows_is_the_codes_first_matmul_bit_for_bit(dtype, in_c, monkeypatch):
    """A forward of more than KERNEL_ROWS rows dequantizes W.T straight out of the packed bytes
    (Int4Linear.weight_t: one C function, or torch's ops): its result is bf16 x @ W.T with the
    codes-first weight, bit for bit, for rows padded to 64, inputs padded to 32, a bias, two Q8_0
    halves and a fused part."""
    monkeypatch.setenv("H2O_CHAT_NATIVE", "1" if in_c else "0")
    if in_c and native.dequant_int4() is None:
        pytest.skip("no C compiler here")
    assert (native.dequant_int4() is not None) == in_c
    gen = torch.Generator().manual_seed(11)
    halves = Int4Linear.from_codes(*repack("Q8_0", gguf.quants.quantize(
        torch.randn(130, 96, generator=gen).numpy(), Q.Q8_0)), 96, torch.randn(130, generator=gen), repeats=2)
    parts = [Int4Linear.from_float(torch.randn(n, 96, generator=gen)) for n in (128, 64, 64)]
    fuse(parts)
    layers = [Int4Linear.from_float(torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen) if bias else None)
              for out, inp, bias in [(100, 40, True), (192, 576, False), (576, 1536, False), (70, 96, True)]] + [halves, parts[1]]
    for layer in layers:
        weight = codes_first_weight(layer)
        assert torch.equal(layer.dequantize(torch.bfloat16), weight)
        x = torch.randn(2, KERNEL_ROWS // 2 + 3, layer.in_features, generator=gen).to(dtype)
        expected = F.linear(x.to(torch.bfloat16), weight)[..., :layer.out_features]
        expected = (expected if layer.bias is None else expected + layer.bias).to(dtype)
        assert torch.equal(layer(x), expected)


def test_a_weight_with_a_non_finite_scale_dequantizes_as_torch_s_ops(monkeypatch):
    """dequant_int4.c takes 16 weights a step only where every scale and zero is finite; a corrupt
    file's infinity or NaN takes its weight-by-weight path: torch's ops' values, NaNs where theirs."""
    if native.dequant_int4() is None:
        pytest.skip("no C compiler here")
    layer = Int4Linear.from_float(torch.randn(128, 64, generator=torch.Generator().manual_seed(14)))
    layer.scales_and_zeros[0, 3, 0] = float("inf")  # row 3, group 0: q = 8 makes 0 * inf
    layer.scales_and_zeros[1, 70, 1] = float("nan")
    ours = layer.weight_t()
    monkeypatch.setenv("H2O_CHAT_NATIVE", "0")
    theirs = layer.weight_t()
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours.isnan().any() and ours.isinf().any()
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_a_prompts_embedding_reads_each_distinct_row_once_with_the_same_bits():
    """Past KERNEL_ROWS ids a lookup dequantizes each distinct id once and repeats it: the rows are
    a short lookup's, bit for bit, repeated ids and all."""
    table = Int4Linear.from_float(torch.randn(200, 96, generator=torch.Generator().manual_seed(12)))
    ids = torch.randint(0, 200, (2, KERNEL_ROWS + 40), generator=torch.Generator().manual_seed(13))
    assert ids.unique().numel() < ids.numel()
    embedding = PackedEmbedding(table, torch.bfloat16, tied=True)
    rows = embedding(ids)
    assert rows.shape == (*ids.shape, 96) and torch.equal(rows, table.dequantize(torch.bfloat16)[ids])
    assert all(torch.equal(rows[:, i:i + 8], embedding(ids[:, i:i + 8])) for i in range(0, ids.shape[1], 8))


@pytest.mark.parametrize("make", [Int4Linear.from_float, Int8Linear.from_float])
def test_fused_parts_share_the_fused_weight_and_compute_the_same(make):
    gen = torch.Generator().manual_seed(8)
    parts = [make(torch.randn(n, 64, generator=gen)) for n in (64, 32, 32)]
    x = torch.randn(1, 64, generator=gen).bfloat16()
    before = [p(x) for p in parts]
    fused = fuse(parts)
    after = [p(x) for p in parts]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    together = fused.module(x)
    assert all(torch.equal(together[:, s:e], b) for (s, e), b in zip(fused.spans, before))
    storage = (lambda m: m.packed) if isinstance(parts[0], Int4Linear) else (lambda m: m.codes)
    assert all(storage(p).untyped_storage().data_ptr() == storage(fused.module).untyped_storage().data_ptr() for p in parts)


def test_a_quantization_that_does_not_fit_the_device_says_what_to_use(monkeypatch):
    assert resolve_quantization(None) == "none" and resolve_quantization("INT4") == "int4"
    with pytest.raises(ValueError, match="unknown quantization 'int3'; use auto, none, int4, int8, 4bit, 8bit"):
        resolve_quantization("int3")
    with pytest.raises(ModelLoadError, match="bitsandbytes, which needs a CUDA GPU; on this cpu use quantization='int8'"):
        resolve_quantization("8bit", "cpu")
    # a CPU whose torch has no int4 kernel: int4 is refused with int8 instead, and auto falls back to none
    real = packed_mod.kernel_missing
    monkeypatch.setattr(packed_mod, "kernel_missing", lambda kind, device: "no kernel" if kind == "int4" else real(kind, device))
    with pytest.raises(ModelLoadError, match="quantization='int4': no kernel; use quantization='int8'"):
        resolve_quantization("int4", "cpu")
    assert resolve_quantization("auto", "cpu") == "none"
    assert load_mod.QUANTIZATIONS == ("auto", "none", "int4", "int8", "4bit", "8bit")
