"""int4_mm.c, a decode step's one row times a 4-bit weight, computes what aten's CPU kernel does.

It reads the same packed bytes (torch's CPU layout, packed.py) and writes x as two signed bytes a
value per group of 32 (15 bits), so its error against the exact product of bf16 x and the
dequantized weight is aten's (whose bf16 inputs hold 8 significant bits), and its integer sums make
a row's result independent of the other rows of the call and of the instruction set (VNNI or
AVX2). Int4Linear runs it for one row and aten's kernel for more; H2O_CHAT_NATIVE=0 runs aten's.
A symmetric weight (every zero 0: a GGUF Q4_0 file's) also keeps its scales in the order the
kernel reads them, which it reads instead of the pairs, for the same bits.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from h2o_chat import H2OCache, native
from h2o_chat.models.decode import Decoder
from h2o_chat.models.packed import GROUP, INT4_MM_ROWS, Int4Linear
from h2o_chat.models.quantize import fuse, fuse_projections, quantize_linears
from tests.conftest import make_tiny_llama

needs_int4_mm = pytest.mark.skipif(native.loaded() is None or native.loaded().int4_mm is None,
                                   reason="no native int4 kernel here (no C compiler, or no AVX2)")


def layer(out_features, in_features, seed=0, repeats=1):
    g = torch.Generator().manual_seed(seed)
    if repeats == 1:
        return Int4Linear.from_float(0.05 * torch.randn(out_features, in_features, generator=g))
    # an 8-bit weight held as two 4-bit halves along the inputs (gguf.py's Q8_0)
    codes = torch.randint(0, 16, (out_features, 2 * in_features), dtype=torch.uint8, generator=g)
    scale = torch.rand(out_features, 2 * in_features // GROUP, generator=g) / 100
    return Int4Linear.from_codes(codes, scale, 8 * scale, in_features, repeats=2)


def symmetric_layer(out_features, in_features, seed=0):
    """w = (q - 8) * scale, every zero 0: a GGUF Q4_0 file's blocks."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=g)
    scale = torch.rand(out_features, in_features // GROUP, generator=g) / 100
    return Int4Linear.from_codes(codes, scale, torch.zeros_like(scale), in_features)


@needs_int4_mm
@pytest.mark.parametrize("out_features,in_features,repeats", [
    (960, 576, 1),  # the embedded model's fused q/k/v
    (576, 1536, 1),  # its down projection
    (100, 64, 1),  # padded to 128 rows; two groups
    (64, 32, 1),  # one block, one group
    (200, 96, 2),  # an 8-bit weight as two halves
])
@pytest.mark.parametrize("rows", [1, 3])
def test_int4_mm_is_as_close_to_the_exact_product_as_aten(out_features, in_features, repeats, rows):
    module = layer(out_features, in_features, seed=out_features + rows, repeats=repeats)
    x = module.pad_input((3 * torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)))
                         .to(torch.bfloat16))
    scales = module.scales_and_zeros.contiguous()
    ours = native.int4_mm()(x, module.packed, scales).double()
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, module.packed, GROUP, scales).double()
    reference = x[:, :in_features].double() @ module.weight_t(torch.float64)  # W.T [in_features, out_pad]
    # the padded rows (past out_features) are zero in both
    assert ours.shape == aten.shape == (rows, module.packed.shape[0])
    assert not ours[:, out_features:].any()
    error, error_aten = (ours - reference).abs(), (aten - reference).abs()
    # each output within a bf16 step of itself plus x's rounding to 15 bits, and no worse than aten's overall
    assert (error <= 2**-8 * reference.abs() + 2**-12 * reference.abs().max()).all()
    assert error.mean() <= 1.25 * error_aten.mean() + 1e-12


@needs_int4_mm
def test_a_row_gets_the_same_bits_alone_as_among_other_rows():
    module = layer(300, 576, seed=3)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    scales = module.scales_and_zeros.contiguous()
    together = native.int4_mm()(x, module.packed, scales)
    for r in range(5):
        assert torch.equal(native.int4_mm()(x[r:r + 1], module.packed, scales)[0], together[r])


@needs_int4_mm
@pytest.mark.parametrize("make", [layer, symmetric_layer])
def test_the_avx2_path_gives_the_vnni_path_s_bits(make):
    # the AVX2 build (maddubs + madd for dpbusd) on this machine, against the library in use
    avx2 = native.compiled(extra_flags=["-mno-avx512vnni", "-mno-avxvnni"])
    module = make(200, 1536, seed=5)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    scales, by_block = module.scales_and_zeros.contiguous(), module.scales_by_block
    y = torch.empty(3, module.packed.shape[0], dtype=torch.bfloat16)
    status = avx2.int4_mm(3, 1536, module.packed.shape[0], x.data_ptr(), x.stride(0), module.packed.data_ptr(),
                          scales.data_ptr(), None if by_block is None else by_block.data_ptr(), y.data_ptr(), y.stride(0))
    assert status == 0
    assert torch.equal(y, native.int4_mm()(x, module.packed, scales, by_block))


@needs_int4_mm
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 64), (64, 32)])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_symmetric_weight_s_scales_by_block_give_the_pairs_bits(out_features, in_features, rows):
    module = symmetric_layer(out_features, in_features, seed=out_features + rows)
    out_pad = module.packed.shape[0]
    assert module.scales_by_block.shape == (out_pad // 64, in_features // GROUP, 64)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    scales = module.scales_and_zeros.contiguous()
    pairs = native.int4_mm()(x, module.packed, scales)
    by_block = native.int4_mm()(x, module.packed, scales, module.scales_by_block)
    assert torch.equal(by_block, pairs) and pairs[:, :out_features].abs().min() > 0
    # the scales by block are read, in the kernel's row order: block 0's lane 5 at 0 zeroes its row alone
    lane = 5
    emptied = module.scales_by_block.clone()
    emptied[0, :, lane] = 0
    y = native.int4_mm()(x, module.packed, scales, emptied)
    row = INT4_MM_ROWS[lane].item()
    assert not y[:, row].any()
    assert torch.equal(torch.cat([y[:, :row], y[:, row + 1:]], 1), torch.cat([pairs[:, :row], pairs[:, row + 1:]], 1))


def test_only_a_symmetric_weight_keeps_scales_by_block_and_fused_parts_share_them():
    if native.int4_mm() is None:
        assert symmetric_layer(64, 32).scales_by_block is None  # nothing would read them
        return
    assert layer(64, 32).scales_by_block is None and layer(64, 32, repeats=2).scales_by_block is None
    parts = [symmetric_layer(out, 96, seed=out) for out in (128, 100, 64)]
    alone = [p.scales_by_block.clone() for p in parts]
    fused = fuse(parts).module
    assert fused.scales_by_block.shape == (5, 3, 64)
    for part, before in zip(parts, alone):  # each part's scales are its rows of the fused ones: no copy
        assert part.scales_by_block.untyped_storage().data_ptr() == fused.scales_by_block.untyped_storage().data_ptr()
        assert torch.equal(part.scales_by_block, before)
    mixed = [symmetric_layer(64, 96), layer(64, 96)]
    assert fuse(mixed).module.scales_by_block is None and mixed[0].scales_by_block is None


@needs_int4_mm
def test_bad_shapes_get_an_error_not_garbage():
    module = layer(64, 64)
    with pytest.raises(ValueError, match="int4_mm: unsupported shapes"):
        native.int4_mm()(torch.zeros(1, 48, dtype=torch.bfloat16), module.packed[:, :24].contiguous(),
                         module.scales_and_zeros.contiguous())
    with pytest.raises(ValueError, match="bf16"):
        native.int4_mm()(torch.zeros(1, 64), module.packed, module.scales_and_zeros.contiguous())


def ops_run(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@needs_int4_mm
def test_one_row_takes_int4_mm_more_rows_and_h2o_chat_native_0_take_aten_s(monkeypatch):
    module = layer(128, 64)
    one, two = torch.randn(1, 64), torch.randn(2, 64)
    assert "h2o_chat::int4_mm" in ops_run(lambda: module.lean(torch.float32)(one))
    assert "h2o_chat::int4_mm" in ops_run(lambda: module(one))
    assert "h2o_chat::int4_mm" not in ops_run(lambda: module.lean(torch.float32)(two))
    monkeypatch.setenv("H2O_CHAT_NATIVE", "0")
    assert "h2o_chat::int4_mm" not in ops_run(lambda: module.lean(torch.float32)(one))


@needs_int4_mm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_int4_model_decodes_as_on_aten_s_kernel(monkeypatch, dtype):
    # the same 40 tokens fed to both, evicting from the 17th: logits within a few bf16 steps of the
    # largest, and the same tokens kept
    model = fuse_projections(quantize_linears(make_tiny_llama(dtype), "int4"))
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("H2O_CHAT_NATIVE", flag)
        cache, decoder, logits = H2OCache(model, budget=16, n_sink=2, n_recent=4), Decoder(model), []
        with torch.no_grad():
            model(torch.arange(9)[None], cache=cache)
            for t in range(tokens.shape[1]):
                position = torch.tensor([cache.get_seq_length()])
                logits.append(decoder.step(tokens[:, t:t + 1], position, cache)[0].float())
        runs.append((torch.stack(logits), [cache.token_ids(i) for i in range(len(cache.layers))]))
    (logits, kept), (logits_aten, kept_aten) = runs
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_aten))
    torch.testing.assert_close(logits, logits_aten, rtol=0, atol=4 * 2**-7 * logits_aten.abs().max().item())


def test_without_avx2_or_a_compiler_int4_layers_run_aten_s_kernel(monkeypatch):
    monkeypatch.setattr(native, "int4_mm", lambda: None)
    module = layer(128, 64)
    ran = ops_run(lambda: module.lean(torch.float32)(torch.randn(1, 64)))
    assert "aten::_weight_int4pack_mm_for_cpu" in ran and "h2o_chat::int4_mm" not in ran
