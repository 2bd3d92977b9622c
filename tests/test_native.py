"""The native kernels (native/: attend_one.c, int4_mm.c) compute what the aten ops they replace do.

Where a bf16 model decodes on a CPU and a C compiler exists, a layer's decode step attends through
one C function, over bf16 slots or 8-bit ones; H2O_CHAT_NATIVE=0 chooses the aten ops. Both round
where the other does (bf16 slots: bf16 logits, a float32 softmax, bf16 probabilities in the
output's products; 8-bit slots: float32 throughout; float32 scores), in another order of
summation and with another exp. So one step over the same slots gives outputs
within one bf16 step and scores within float32 rounding, a free slot or a row sitting out gets
exactly nothing, and a bf16 model decoding the same tokens keeps the same tokens. (A
logit at a bf16 rounding boundary can round either way, so "within rounding" is stated per test.)
"""

import logging

import pytest
import torch

from h2o_chat import H2OCache, native
from h2o_chat.cache import kv_int8
from h2o_chat.cache.step import DecodeStep, StepRows, attend
from h2o_chat.models.decode import Decoder
from tests.conftest import make_tiny_llama

needs_native = pytest.mark.skipif(native.loaded() is None, reason="no native attention here (no C compiler)")
BF16_STEP = 2**-7  # bf16's relative spacing: one step of its 8-bit significand


def one_step(monkeypatch, use_native, kv, qp, acc, query, rows, group):
    """attend() once over copies of kv, qp and acc: (output, scores after, the step's native op)."""
    monkeypatch.setenv("H2O_CHAT_NATIVE", "1" if use_native else "0")
    kv, acc, qp = kv.clone(), acc.clone(), None if qp is None else qp.clone()
    wide = kv_int8.WideScratch().for_slots(kv, acc.dtype)
    step = DecodeStep.over(kv, acc, qp, group, torch.bfloat16, query.shape[-1] ** -0.5, wide)
    out = attend(step, query, rows).clone()
    return out, acc[0], step.native


@needs_native
@pytest.mark.parametrize("rows,kv_heads,group,head_dim,slots", [
    (1, 3, 3, 64, 513),  # the embedded model's layer
    (1, 2, 2, 16, 17),  # the tiny test model's
    (1, 1, 4, 32, 40),  # one KV head (MQA)
    (1, 8, 4, 128, 33),  # a larger model's head
    (3, 2, 2, 64, 65),  # a batch's rows
])
@pytest.mark.parametrize("filling", [False, True])
@pytest.mark.parametrize("width", ["bf16", "int8"])
def test_one_step_is_the_aten_ops_within_rounding(monkeypatch, rows, kv_heads, group, head_dim, slots, filling, width):
    g = torch.Generator().manual_seed(rows * 1000 + slots)
    kv = torch.randn(2, rows, kv_heads, slots, head_dim, generator=g).to(torch.bfloat16)
    qp = None
    if width == "int8":  # codes with a scale and a zero point per slot, laid out as a layer holds them
        kv, scale, zero = kv_int8.quantize(kv)
        qp = torch.stack([scale[0], scale[1], zero[0], zero[1]])
    acc = torch.rand(2, rows, kv_heads, slots, generator=g)
    # the queries as the step has them: the first heads of a [rows, q + kv heads, 1, d] tensor (keys after them)
    qk = (3 * torch.randn(rows, kv_heads * group + kv_heads, 1, head_dim, generator=g)).to(torch.bfloat16)
    query = qk[:, : kv_heads * group]
    active = [r != 1 for r in range(rows)]  # a batch's second row sits this step out
    state = StepRows.make([100] * rows, [False] * rows, active, kv_heads, group, 0, 1.0, torch.int32,
                          torch.float32, "cpu")
    if filling:  # the free slots [n_slots, budget) of each row, the spare (the last) never free
        n_slots = torch.tensor([slots // 2 + r for r in range(rows)])[:, None]
        slot = torch.arange(slots)
        empty = ((slot >= n_slots) & (slot < slots - 1))[:, None]
        state = StepRows(**{**state.__dict__, "empty": empty})
    out, scores, op = one_step(monkeypatch, True, kv, qp, acc, query, state, group)
    out_aten, scores_aten, op_aten = one_step(monkeypatch, False, kv, qp, acc, query, state, group)
    assert op is not None and op_aten is None
    # a dot product summed in another order can round to the neighbouring bf16 logit, which moves
    # that slot's probability by about scale x one bf16 step of the logit (a percent or less): so the
    # output within a bf16 step of its largest value, each slot's added mass within 0.1% of the largest
    torch.testing.assert_close(out.float(), out_aten.float(), rtol=BF16_STEP,
                               atol=BF16_STEP * out_aten.float().abs().max().item())
    added, added_aten = scores - acc[0], scores_aten - acc[0]
    torch.testing.assert_close(added, added_aten, rtol=0, atol=1e-3 * added_aten.max().item())
    unchanged = torch.zeros_like(scores, dtype=torch.bool)
    unchanged[~torch.tensor(active)] = True  # a row sitting out: its scores exactly as they were
    if filling:
        unchanged |= empty.view(rows, 1, slots)  # a free slot: exactly nothing added
    assert torch.equal(scores[unchanged], acc[0][unchanged])


def decode_teacher_forced(monkeypatch, use_native, model, tokens, **cache_kwargs):
    """Feed `tokens` [1, n] one at a time after a 9-token prompt: (logits per step [n, vocab], kept
    token ids of every layer at the end, the first layer step's native op)."""
    monkeypatch.setenv("H2O_CHAT_NATIVE", "1" if use_native else "0")
    cache, decoder = H2OCache(model, **cache_kwargs), Decoder(model)
    prompt = torch.arange(9)[None]
    logits = []
    with torch.no_grad():
        model(prompt, cache=cache)
        for t in range(tokens.shape[1]):
            position = torch.tensor([cache.get_seq_length()])
            logits.append(decoder.step(tokens[:, t:t + 1], position, cache)[0])
    return torch.stack(logits), [cache.token_ids(i) for i in range(len(cache.layers))], cache.layers[0].step.native


@needs_native
@pytest.mark.parametrize("policy,score", [("h2o", "sum"), ("h2o", "mean"), ("h2o", "decay"), ("window", "sum")])
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_a_bf16_model_decodes_as_on_the_aten_ops(monkeypatch, policy, score, kv_heads, kv_quant):
    # the same 60 tokens fed to both (not each one's own argmax, which a near tie could flip): the
    # layers fill, then evict; the same tokens kept, logits within a few bf16 steps of the largest
    model = make_tiny_llama(torch.bfloat16, kv_heads=kv_heads, random_norms=True)
    tokens = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(5))
    settings = dict(policy=policy, score=score, budget=16, n_sink=2, n_recent=4, kv_quant=kv_quant)
    logits, kept, op = decode_teacher_forced(monkeypatch, True, model, tokens, **settings)
    logits_aten, kept_aten, op_aten = decode_teacher_forced(monkeypatch, False, model, tokens, **settings)
    assert op is not None and op_aten is None
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_aten))
    largest = logits_aten.abs().max()
    torch.testing.assert_close(logits, logits_aten, rtol=0, atol=4 * BF16_STEP * largest)


def test_the_aten_ops_run_where_there_is_no_compiler(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="h2o_chat"):
            assert native.attend_one() is None
        assert "attention and int4 matmuls run as aten ops: no C compiler (/nonexistent/cc)" in caplog.text
        kv, acc = torch.zeros(2, 1, 2, 5, 16, dtype=torch.bfloat16), torch.zeros(2, 1, 2, 5)
        assert DecodeStep.over(kv, acc, None, 2, torch.bfloat16, 0.25).native is None
    finally:
        native.loaded.cache_clear()  # the next test compiles again, with the real compiler


def test_h2o_chat_native_0_chooses_the_aten_ops_and_float32_never_takes_the_kernel(monkeypatch):
    kv, acc = torch.zeros(2, 1, 2, 5, 16, dtype=torch.bfloat16), torch.zeros(2, 1, 2, 5)
    monkeypatch.setenv("H2O_CHAT_NATIVE", "0")
    assert DecodeStep.over(kv, acc, None, 2, torch.bfloat16, 0.25).native is None
    monkeypatch.setenv("H2O_CHAT_NATIVE", "1")
    assert DecodeStep.over(kv.float(), acc, None, 2, torch.float32, 0.25).native is None  # bit-exact tests' dtypes


@needs_native
def test_eager_code_calls_a_kernel_as_its_op_computes_and_the_profiler_and_compiler_still_see_the_op():
    # native.direct: eager code skips torch's dispatcher (~2.3 us a call, 181 calls a token), with
    # the registered op's result; the profiler counts one op of its name (bench ops), and
    # torch.compile traces the op itself, in one graph
    from torch.profiler import ProfilerActivity, profile

    from h2o_chat.models.packed import Int4Linear

    layer = Int4Linear.from_float(torch.randn(128, 64, generator=torch.Generator().manual_seed(5)))
    x, scales = torch.randn(1, 64).to(torch.bfloat16), layer.scales_and_zeros.contiguous()
    calls = [native.dequant_int4()] + ([native.int4_mm()] if native.int4_mm() is not None else [])
    for call in calls:
        args = (layer.packed, scales) if call is calls[0] else (x, layer.packed, scales)
        assert call.op.name().startswith("h2o_chat::") and torch.equal(call(*args), call.op(*args))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call(*args)
        assert [e.name for e in prof.events()].count(call.op.name()) == 1
        compiled = torch.compile(lambda *a, call=call: call(*a) * 1, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(*args), call.op(*args))


@needs_native
@pytest.mark.parametrize("rows,hidden", [(1, 576), (4, 576), (3, 64), (1, 2048)])
def test_a_norms_steps_after_its_sum_are_torchs_bits(rows, hidden):
    # rms_tail.c against decode.rms_norm's torch ops, on random rows, sums and a random weight (a
    # test model's norm weights are all ones, where a dropped rounding before the weight's product
    # would not show); large and tiny magnitudes, so the float32 and bf16 roundings all happen
    from h2o_chat.models.decode import Scratch, rms_norm

    g = torch.Generator().manual_seed(rows * 7 + hidden)
    x = (torch.randn(rows, hidden, generator=g) * torch.logspace(-3, 3, rows)[:, None]).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    s = Scratch.make(rows, hidden, 1, 16, torch.bfloat16, 1e-5, "cpu")
    expected = rms_norm(x, weight, s).clone()
    tail = native.rms_tail()
    got = rms_norm(x, weight, s, lambda x32, sum_sq, w, out: tail(x32, sum_sq, w, float(hidden), 1e-5, out))
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
