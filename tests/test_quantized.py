"""A quantized model is still a transformers model: its forward, generate and H2OCache work
unchanged, the lean step (its packed step: fused q/k/v and gate/up) computes exactly what the
model's own forward computes, and with nothing evicted H2OCache equals DynamicCache on it.
It also pins where int4 bits depend on how tokens are split into forwards, and by how much."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from h2o_chat import ChatSession, H2OCache
from h2o_chat.models import packed
from h2o_chat.models.decode import Decoder
from h2o_chat.models.load import load_model
from h2o_chat.models.packed import KERNEL_ROWS, Int4Linear, PackedEmbedding
from h2o_chat.models.quantize import fuse_projections, quantize_linears, weights_label
from tests.conftest import make_tiny_chat, make_tiny_llama
from tests.test_cache import greedy
from tests.test_decode import POLICY_SCORES, assert_same_state, decode_both
from tests.test_session import USER_TURNS, chat, naive_replies


def quantized(model, kind):
    quantize_linears(model, kind)
    return fuse_projections(model)


def fed_whole_and_split(model, ids, split):
    """ids [1, n] into two caches (policy "full"): in one forward, and in two at `split`.
    Returns ((logits [1, vocab] float32 after the last token, cache), the same for the split)."""
    fed = []
    for cuts in ((0, ids.shape[1]), (0, split, ids.shape[1])):
        cache = H2OCache(model, policy="full")
        with torch.no_grad():
            for start, stop in zip(cuts, cuts[1:]):
                logits = model(ids[:, start:stop], cache=cache, logits_to_keep=1).logits[:, -1].float()
        fed.append((logits, cache))
    return fed


def same_keys_and_values(a, b):
    """Every layer's keys and values bitwise (the H2O scores are sums whose order follows the
    chunks: they differ by float rounding whatever the weights)."""
    return all(torch.equal(x.kv, y.kv) for x, y in zip(a.layers, b.layers))


@pytest.mark.parametrize("policy,score", POLICY_SCORES)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_lean_step_is_the_quantized_model_forward_bit_for_bit(kind, policy, score):
    own, lean, equal_steps = decode_both(quantized(make_tiny_llama(torch.bfloat16), kind), policy=policy, score=score,
                                         budget=16, n_sink=2, n_recent=6, prefill_chunk=4)
    assert equal_steps == 40
    assert_same_state(own, lean)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batches_and_float32_activations(dtype, batch):
    """fp32 models cast to bf16 around the kernels, in the forward and in the lean step alike."""
    model = quantized(make_tiny_llama(dtype, kv_heads=1), "int4")
    assert model.model.layers[0].self_attn.qkv_proj is not None and Decoder(model).packed
    own, lean, equal_steps = decode_both(model, batch=batch, budget=12, n_recent=4)
    assert equal_steps == 40
    assert_same_state(own, lean)


def test_a_quantized_model_with_attention_biases():
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, use_sliding_window=False)
    torch.manual_seed(0)
    model = quantized(Qwen2ForCausalLM(config).eval().to(torch.bfloat16), "int4")
    own, lean, equal_steps = decode_both(model, budget=16, n_recent=6)
    assert equal_steps == 40
    assert_same_state(own, lean)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_nothing_evicted_equals_dynamic_cache_on_the_quantized_model(kind):
    """generate: DynamicCache and a cache that never evicts, on the same quantized model. The
    prompt's rows (batch x tokens) are more than KERNEL_ROWS: its prefill takes the dequantizing path."""
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    assert ids.numel() > KERNEL_ROWS
    expected = greedy(quantized(make_tiny_llama(), kind), ids, DynamicCache(), 48)
    model = quantized(make_tiny_llama(), kind)
    cache = H2OCache(model, policy="h2o", budget=96, n_sink=4, n_recent=40, prefill_chunk=7)
    got = greedy(model, ids, cache, 48)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):  # fp32 attention, bf16 kernel inputs: a few bf16 steps
        torch.testing.assert_close(a, b, atol=b.abs().max().item() / 2**6, rtol=0)
    assert cache.layers[0].n_slots == 40 + 48 - 1


def test_a_chat_session_runs_on_int4_weights():
    model, tokenizer = make_tiny_chat()
    quantized(model, "int4")
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16),
                          temperature=0, max_new_tokens=12)
    assert session.timeline.decoder.packed
    replies = ["".join(session.send(text)) for text in ("Hello there!", "And again?")]
    assert all(replies) and session.stats["tokens_seen"] > 40
    assert weights_label(model) == "int4, lm_head fp32"  # the lm_head stays float (quantize_linears)


# ---------------------------------------------------------------------------------------------
# The embedded model as the app loads it: int4 from the GGUF's own blocks


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_int4_is_its_gguf_blocks_in_the_right_row_order(embedded_model, embedded_int4):
    """Every packed weight is the dequantized model's (transformers' own GGUF loader, which undoes
    llama.cpp's q/k row order) within bf16's rounding of the scales; a misordered row would be
    off by the weights' whole size. The logits agree likewise, and pick the same tokens."""
    dense, tokenizer = embedded_model
    model, _ = embedded_int4
    assert weights_label(model) == "int4: GGUF Q4_1 as stored (210), Q8_0 as two exact int4 halves (1)"
    assert isinstance(model.get_input_embeddings(), PackedEmbedding) and model.lm_head.repeats == 2
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj", "model.layers.29.mlp.down_proj",
                 "lm_head"):
        ours, theirs = model.get_submodule(name), dense.get_submodule(name).weight
        assert isinstance(ours, Int4Linear)
        error = (ours.dequantize()[: theirs.shape[0]] - theirs).abs().max()
        assert error <= theirs.abs().max() / 2**7, name
    ids = tokenizer("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = model(ids).logits.float(), dense(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.fixture(scope="module")
def embedded_int4_fp32(embedded_conversion):
    """The app's int4 weights (the GGUF's blocks) with float32 activations: issue 32's check."""
    model, tokenizer = load_model(dtype="float32")
    assert weights_label(model).startswith("int4: GGUF Q4_1") and model.dtype == torch.float32
    return model, tokenizer


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_int4_lean_step_and_dynamic_cache(embedded_int4, embedded_int4_fp32):
    """The lean step on the app's model, bit for bit; then nothing evicted against DynamicCache
    with float32 activations (the same int4 weights): in bf16, sdpa and H2O's explicit attention
    round differently and a greedy tie can flip, as it would for the float model."""
    model, tokenizer = embedded_int4
    own, lean, equal_steps = decode_both(model, steps=24, budget=24, n_recent=8, prefill_chunk=8)
    assert equal_steps == 24
    assert_same_state(own, lean)
    model, tokenizer = embedded_int4_fp32
    ids = tokenizer("Write one sentence about the sea.", return_tensors="pt").input_ids
    expected = greedy(model, ids, DynamicCache(), 24)
    got = greedy(model, ids, H2OCache(model, policy="h2o", budget=64, n_recent=32), 24)
    # The kernels read bf16 inputs: a float32 difference in attention can round an input to the
    # next bf16 value, and 30 layers carry that on; the logits agree to a few bf16 steps at every
    # token until the two texts part, which they do only where the best two tokens are that close
    # (on this prompt at the 8th token through int4_mm, never through aten's kernel; on "Name
    # three colours of the rainbow." the other way round: the 20th through aten's)
    new = ids.shape[1]
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        torch.testing.assert_close(a, b, atol=b.abs().max().item() / 2**5, rtol=0)
        if got.sequences[0, new + step] != expected.sequences[0, new + step]:
            break  # past here the two continue different texts


def test_a_row_through_the_kernels_has_the_same_bits_however_it_is_called():
    """Up to KERNEL_ROWS rows a projection is a kernel's: int4_mm's for one row (NATIVE_ROWS: a
    decode step), aten's for more. Within each, a row's bits depend neither on how many rows share
    its call nor on q/k/v (gate/up) going through one fused call or separate ones, so the lean
    step's fused matmuls are the model's own forward's separate ones. Across the two, a row moves
    by rounding: within a bf16 step of itself (2^-7) and 2^-12 of the largest."""
    model = quantized(make_tiny_llama(), "int4")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(KERNEL_ROWS, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for fused, parts in ((attn.qkv_proj, (attn.q_proj, attn.k_proj, attn.v_proj)), (mlp.gate_up_proj, (mlp.gate_proj, mlp.up_proj))):
        for rows in (x[:1], x[:2], x):
            together = fused.module(rows)
            for part, (start, stop) in zip(parts, fused.spans):
                assert torch.equal(together[:, start:stop], part(rows))
        for part in parts:
            whole = part(x).float()
            assert torch.equal(part(x[:2]).float(), whole[:2]) and torch.equal(part(x[5:12]).float(), whole[5:12])
            alone = part(x[:1]).float()
            assert not torch.equal(alone, whole[:1]) or packed.NATIVE_ROWS == 0
            assert ((alone - whole[:1]).abs() <= 2**-7 * whole[:1].abs() + 2**-12 * whole.abs().max()).all()


def test_past_kernel_rows_a_layer_computes_with_its_weight_rounded_to_bf16():
    """What a row gets in a forward of more than KERNEL_ROWS rows instead of the kernel's bits:
    x @ W with W rounded to bf16 (each weight by up to 2^-9 of itself). The two differ, within
    that rounding and each result's own: 3 x 2^-9 of sum |x| |w|."""
    layer = quantized(make_tiny_llama(), "int4").model.layers[0].mlp.down_proj
    x = torch.randn(KERNEL_ROWS + 1, layer.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    past = layer(x).float()
    kernel = torch.cat([layer(x[:KERNEL_ROWS]), layer(x[KERNEL_ROWS:])]).float()
    assert not torch.equal(past, kernel)
    size = x.float().abs() @ layer.dequantize()[:layer.out_features].abs().t()
    assert ((past - kernel).abs() <= 3 * size / 2**9).all()


def test_int4_tokens_fed_in_other_chunks_differ_by_bf16_steps_unless_all_take_the_kernel(monkeypatch):
    """The same tokens in one forward past KERNEL_ROWS rows and in two of fewer (a session's
    turns against generate re-prefilling them). Float weights: the same bits, so here attention
    rounds alike both ways and what is left is the linears. Int4 weights: the first layer's keys
    differ and the logits are a few bf16 steps apart (packed.py's docstring: why greedy text can
    differ); with every row through the kernel, the same bits again."""
    ids = torch.randint(0, 128, (1, KERNEL_ROWS + 36), generator=torch.Generator().manual_seed(2))
    (whole, whole_cache), (split, split_cache) = fed_whole_and_split(make_tiny_llama(), ids, 40)
    assert torch.equal(whole, split) and same_keys_and_values(whole_cache, split_cache)

    model = quantized(make_tiny_llama(), "int4")
    (whole, whole_cache), (split, split_cache) = fed_whole_and_split(model, ids, 40)
    assert not torch.equal(whole_cache.layers[0].kv, split_cache.layers[0].kv)
    torch.testing.assert_close(split, whole, atol=whole.abs().max().item() / 2**5, rtol=0)

    monkeypatch.setattr(packed, "KERNEL_ROWS", ids.shape[1])
    (whole, whole_cache), (split, split_cache) = fed_whole_and_split(model, ids, 40)
    assert torch.equal(whole, split) and same_keys_and_values(whole_cache, split_cache)


def test_a_first_reply_on_int4_weights_is_generates_token_for_token():
    """A first reply, bf16, a prompt past KERNEL_ROWS: the session and model.generate prefill it in
    one forward and decode through bitwise equal steps, so they agree token for token. (Later
    turns are fed in other chunks: a few bf16 steps apart, see the embedded test below.)"""
    model, tokenizer = make_tiny_chat(torch.bfloat16)
    quantized(model, "int4")
    turn = "Tell me a story about a lighthouse keeper and the ships at sea."
    expected = naive_replies(model, tokenizer, [turn], 24, lambda: H2OCache(model, policy="full"))
    session = ChatSession(model, tokenizer, cache=dict(policy="full"), temperature=0, max_new_tokens=24)
    assert chat(session, [turn]) == expected and len(session.timeline.fed) > KERNEL_ROWS + 24


def fed_as_a_session_feeds_it(model, ids, replies):
    """ids [1, n] into a cache (policy "full") as a ChatSession feeds a conversation: each message
    (with the template around it) in one forward, each reply's tokens, [start, stop) in `replies`,
    one a step through the lean step -> (logits [1, vocab] float32 after the last token, cache)."""
    cache, decoder, cuts = H2OCache(model, policy="full"), Decoder(model), [0]
    for start, stop in replies:
        cuts += [*range(start, stop)]
    cuts.append(ids.shape[1])
    for start, stop in zip(cuts, cuts[1:]):
        logits = decoder.forward(ids[:, start:stop], cache)
    return logits, cache


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_int4_session_and_generate_part_by_bf16_steps(embedded_int4_fp32, monkeypatch):
    """Issue 32's check on the file's int4 weights: three turns, policy "full", float32, greedy, 24
    tokens. The first reply is generate's token for token (the same prefill, bitwise equal steps).
    Later, the session has fed each reply a token a step and each message in a few rows where
    generate re-prefills the whole history in one forward, and the two part from the first layer:
    past KERNEL_ROWS rows the weights are rounded to bf16 (the first layer's keys differ); and even
    with every row through the kernel, a token attended alone and in a prefill round differently in
    float32 (~1e-7), which the bf16 cast before o_proj turns into a bf16 step now and then. The
    logits stay within 2^-5 of the largest: greedy text can differ where two tokens are closer."""
    model, tokenizer = embedded_int4_fp32
    turns = USER_TURNS[:3]
    session = ChatSession(model, tokenizer, cache=dict(policy="full"), temperature=0, max_new_tokens=24)
    replies = chat(session, turns)
    assert replies[0] == naive_replies(model, tokenizer, turns[:1], 24, lambda: H2OCache(model, policy="full"))[0]

    history = session.history[:5]  # the third turn's prompt, as the session rendered and fed it

    def length(messages, **kwargs):
        return len(tokenizer.apply_chat_template(messages, return_dict=True, **kwargs)["input_ids"])

    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert session.timeline.fed[:ids.shape[1]] == ids[0].tolist() and ids.shape[1] > KERNEL_ROWS
    replies = [(length(history[:turn], add_generation_prompt=True), length(history[:turn + 1])) for turn in (1, 3)]
    with torch.no_grad():
        whole = model(ids, cache=H2OCache(model, policy="full"), logits_to_keep=1).logits[:, -1].float()
        for every_row_through_the_kernel in (False, True):
            if every_row_through_the_kernel:  # int4_mm: a row's bits do not depend on its call
                monkeypatch.setattr(packed, "KERNEL_ROWS", 10**6)
                monkeypatch.setattr(packed, "NATIVE_ROWS", 10**6 if packed.native.int4_mm() is not None else 0)
                whole_cache = H2OCache(model, policy="full")
                whole = model(ids, cache=whole_cache, logits_to_keep=1).logits[:, -1].float()
            fed, fed_cache = fed_as_a_session_feeds_it(model, ids, replies)
            assert not torch.equal(fed, whole)
            torch.testing.assert_close(fed, whole, atol=whole.abs().max().item() / 2**5, rtol=0)
    # through the kernel alone the first layer's keys and values are the same bits (a row's
    # projections do not depend on its call); a later layer's are not (attention's rounding)
    assert torch.equal(fed_cache.layers[0].kv, whole_cache.layers[0].kv)
    assert not same_keys_and_values(fed_cache, whole_cache)


def test_odd_widths_through_the_lean_step():
    """Hidden 40 and intermediate 72: no layer's inputs a multiple of 32 (zero-padded for both
    kernels: the int8 one returns garbage on rows whose length is not a multiple of 16)."""
    config = LlamaConfig(hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
    for kind in ("int4", "int8"):
        torch.manual_seed(0)
        model = quantized(LlamaForCausalLM(config).eval().to(torch.bfloat16), kind)
        own, lean, equal_steps = decode_both(model, steps=16, budget=12, n_recent=4)
        assert equal_steps == 16
        assert_same_state(own, lean)


def test_the_panel_and_the_api_say_which_weights_run(tmp_path):
    import asyncio

    from h2o_chat.serve.api import Api
    from h2o_chat.ui.draw import panel

    model, tokenizer = make_tiny_chat()
    quantized(model, "int8")
    session = ChatSession(model, tokenizer, cache=dict(policy="h2o", budget=48, n_sink=2, n_recent=16), max_new_tokens=4)
    "".join(session.send("Hi"))
    assert "· weights int8, lm_head fp32" in panel(session)["stats"]
    api = Api(model, tokenizer, dict(policy="h2o", budget=48), str(tmp_path), None, False, 1, 64, None, None)
    assert asyncio.run(api.models(None))["data"][0]["weights"] == "int8, lm_head fp32"


def test_the_command_line_takes_quantization_and_the_old_flags():
    from h2o_chat.serve.cli import parse_args, quantization_of

    assert quantization_of(parse_args([])) == "auto"
    assert quantization_of(parse_args(["--quantization", "int8"])) == "int8"
    assert quantization_of(parse_args(["--load-in-4bit"])) == "4bit"
    assert quantization_of(parse_args(["--load-in-8bit", "--quantization", "8bit"])) == "8bit"
    with pytest.raises(ValueError, match="--load-in-4bit is --quantization 4bit; give one of them"):
        quantization_of(parse_args(["--load-in-4bit", "--quantization", "int4"]))
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "nf4"])
