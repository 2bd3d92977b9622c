"""The lean decode step (decode.py) computes exactly what the model's own forward computes.

Two caches are fed the same prompt; then one decodes through `model(token, cache=...)` and the
other through `Decoder.step`, each from its own logits. Bitwise equality is required of the
logits and of every cache buffer, for every policy and score, GQA and MQA, batch 1 and 2,
fp64 / fp32 / bf16, while the layers fill, once they evict, and across a position roll.
"""

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from h2o_chat import H2OCache
from h2o_chat.models.decode import Decoder
from tests.conftest import make_tiny_llama

POLICY_SCORES = [("full", "sum"), ("window", "sum"), ("sink", "sum"), ("h2o", "sum"), ("h2o", "mean"), ("h2o", "decay")]


def decode_both(model, steps=40, batch=1, prompt_len=9, **cache_kwargs):
    """(model's own forward, Decoder.step): the two caches after `steps` greedy tokens each, and
    the number of steps whose logits were bitwise equal."""
    own, lean = H2OCache(model, **cache_kwargs), H2OCache(model, **cache_kwargs)
    decoder = Decoder(model)
    assert decoder.why_not is None
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(prompt, cache=own).logits[:, -1].float()
        model(prompt, cache=lean)
        equal_steps = 0
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            position = torch.full((batch,), lean.get_seq_length())
            lean_logits = decoder.step(token, position, lean)
            logits = model(token, cache=own).logits[:, -1].float()
            equal_steps += torch.equal(logits, lean_logits)
    return own, lean, equal_steps


def assert_same_state(own, lean):
    for i, (a, b) in enumerate(zip(own.layers, lean.layers)):
        assert (a.n_seen, a.n_slots, a.roll_floor) == (b.n_seen, b.n_slots, b.roll_floor), f"layer {i}"
        assert torch.equal(a.kv, b.kv) and torch.equal(a.meta, b.meta) and torch.equal(a.acc, b.acc), f"layer {i}"


@pytest.mark.parametrize("positions", ["absolute", "rolling"])
@pytest.mark.parametrize("policy,score", POLICY_SCORES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_lean_step_is_the_model_forward_bit_for_bit(dtype, policy, score, positions):
    # budget 16: the layers fill during the first steps, then evict; 40 steps past 2 x 16 cross a roll
    own, lean, equal_steps = decode_both(make_tiny_llama(dtype, random_norms=True), policy=policy, score=score, positions=positions,
                                         budget=16, n_sink=2, n_recent=6, prefill_chunk=4)
    assert equal_steps == 40
    assert_same_state(own, lean)
    if policy != "full":
        assert own.layers[0].n_slots == 16
        assert positions == "absolute" or own.layers[0].roll_floor > 0  # a roll happened inside the run


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_a_cache_the_lean_step_ran_takes_the_next_message_and_a_restore(kv_quant):
    """The lean step runs a full cache under torch.inference_mode (fewer dispatches: bench ops).
    What it leaves in the cache must stay ordinary tensors: the next message's prefill (the model's
    forward, under no_grad) writes into the same buffers in place, which raises on an inference
    tensor. Checked through the turn a chat takes, against a cache fed by the model's forward alone."""
    model = make_tiny_llama(torch.float32)
    settings = dict(budget=12, n_sink=2, n_recent=4, prefill_chunk=4, kv_quant=kv_quant)
    lean, own, decoder = H2OCache(model, **settings), H2OCache(model, **settings), Decoder(model)
    with torch.no_grad():
        # the first token through the step: the layers' buffers are made inside it
        decoder.step(torch.tensor([[1]]), torch.tensor([0]), lean)
        model(torch.tensor([[1]]), cache=own)
        for cache in (lean, own):
            model(torch.arange(2, 10)[None], cache=cache)
        for t in range(10):  # the layers fill at 12 (no_grad), then evict (inference_mode)
            decoder.step(torch.tensor([[40 + t]]), torch.tensor([lean.get_seq_length()]), lean)
            model(torch.tensor([[40 + t]]), cache=own)
        assert lean.is_full()
        assert not any(b.is_inference() for layer in lean.layers for b in (layer.kv, layer.meta, layer.acc))
        saved = lean.snapshot()
        for cache in (lean, own):  # the next message, in place into the full buffers
            model(torch.arange(30, 37)[None], cache=cache)
        assert_same_state(own, lean)
        lean.restore(saved)  # a regenerate: back before the message, then it again
        model(torch.arange(30, 37)[None], cache=lean)
        decoder.step(torch.tensor([[50]]), torch.tensor([lean.get_seq_length()]), lean)
        model(torch.tensor([[50]]), cache=own)
    assert_same_state(own, lean)


@pytest.mark.parametrize("positions", ["absolute", "rolling"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_lean_step_over_int8_slots_is_the_model_forward_bit_for_bit(dtype, kv_heads, positions):
    own, lean, equal_steps = decode_both(make_tiny_llama(dtype, kv_heads=kv_heads, random_norms=True), batch=2, positions=positions,
                                         budget=16, n_sink=2, n_recent=6, prefill_chunk=4, kv_quant="int8")
    assert equal_steps == 40
    assert_same_state(own, lean)
    assert own.layers[0].kv.dtype == torch.uint8 and own.layers[0].step.int8 is not None
    assert positions == "absolute" or own.layers[0].roll_floor > 0


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_kv_head_lean_step(dtype, batch):
    own, lean, equal_steps = decode_both(make_tiny_llama(dtype, kv_heads=1, random_norms=True), batch=batch, budget=12, n_recent=4)
    assert equal_steps == 40
    assert_same_state(own, lean)


def test_pinned_tokens_and_a_pin_added_mid_stream():
    model = make_tiny_llama(torch.float64)
    own, lean = H2OCache(model, budget=12, n_sink=1, n_recent=4), H2OCache(model, budget=12, n_sink=1, n_recent=4)
    for cache in (own, lean):
        cache.protect(2, 5)
    decoder = Decoder(model)
    token = torch.tensor([[7]])
    with torch.no_grad():
        for step in range(30):
            if step == 10:
                for cache in (own, lean):
                    cache.protect(11, 13)
            a = model(token, cache=own).logits[:, -1].float()
            b = decoder.forward(token, lean)
            assert torch.equal(a, b), f"step {step}"
            token = a.argmax(-1, keepdim=True)
    assert_same_state(own, lean)
    kept = set(lean.token_ids(0)[0, 0].tolist())
    assert {2, 3, 4, 11, 12} <= kept


def test_a_model_with_attention_biases_qwen2():
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, use_sliding_window=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # the case this test is for
    own, lean, equal_steps = decode_both(model, budget=16, n_recent=6)
    assert equal_steps == 40
    assert_same_state(own, lean)


class FakeQuantLinear(torch.nn.Linear):
    """Stands for bitsandbytes' Linear4bit/8bitLt: a Linear subclass whose weight is not the math."""


def test_models_it_cannot_run_exactly_take_their_own_forward():
    model = make_tiny_llama()
    model.model.layers[0].mlp.up_proj.__class__ = FakeQuantLinear
    decoder = Decoder(model)
    assert decoder.why_not == "quantized linear layers"
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    cache = H2OCache(model, budget=8, n_recent=4)
    decoder.forward(torch.tensor([[1, 2, 3]]), cache)
    decoder.forward(torch.tensor([[4]]), cache)
    assert len(calls) == 2 and cache.get_seq_length() == 4

    config = make_tiny_llama().config
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert Decoder(LlamaForCausalLM(config)).why_not == "RoPE type 'dynamic'"


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
@pytest.mark.parametrize("policy,score", POLICY_SCORES[1:])
def test_one_eviction_for_every_layer_moves_what_one_per_layer_does(policy, score, kv_quant, monkeypatch):
    # a uniform budget's layers are views of one stacked buffer each, and one step.Eviction picks
    # every layer's victims after the last layer attended (H2OCache.stacked); an Eviction per
    # layer, right after its own attention (a pyramid's way), must leave the same bits: logits,
    # and every buffer, while the layers fill, evict, and re-lay positions
    model = make_tiny_llama(torch.float32, kv_heads=2)
    settings = dict(policy=policy, score=score, budget=12, n_sink=2, n_recent=4, positions="rolling", kv_quant=kv_quant)
    own, lean, equal_steps = decode_both(model, steps=60, **settings)
    assert equal_steps == 60
    monkeypatch.setattr(H2OCache, "evicts_together", lambda self, per_layer: False)
    own_alone, alone, equal_alone = decode_both(model, steps=60, **settings)
    assert equal_alone == 60
    assert_same_state(lean, alone)
    if kv_quant == "int8":
        assert all(torch.equal(a.qp, b.qp) for a, b in zip(lean.layers, alone.layers))
    assert lean.evictions()[0].layers == 2 and alone.evictions()[0].layers == 1  # the two arms did step differently


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_the_step_is_one_graph_for_a_compiler(kv_quant):
    # issue 32: a GPU needs the step captured whole. Between the cache's begin (the host's part:
    # protection keys, the rows' ids) and end (counting, position re-rolls), Dynamo traces the lean
    # step, the cache's write, attention, scoring and eviction included, as one graph with no
    # break; the slot buffers it mutates are each of one dtype (inductor refuses a mutated input
    # viewed as two dtypes)
    import torch._dynamo

    model = make_tiny_llama(torch.float32)
    cache, decoder = H2OCache(model, budget=12, n_sink=2, n_recent=4, kv_quant=kv_quant), Decoder(model)
    with torch.no_grad():
        model(torch.arange(20)[None] % model.config.vocab_size, cache=cache)  # full: it evicts every step
        cache.begin(1)
        explained = torch._dynamo.explain(decoder.layers_step)(torch.tensor([[5]]), torch.tensor([20]), cache,
                                                               decoder.scratch(1, "cpu"))
        cache.end()
        filling = H2OCache(model, budget=12, n_sink=2, n_recent=4, kv_quant=kv_quant)
        model(torch.arange(5)[None], cache=filling)  # 5 of 12 slots: the step masks the free ones
        filling.begin(1)
        assert filling.static_step
        explained_filling = torch._dynamo.explain(decoder.layers_step)(torch.tensor([[5]]), torch.tensor([5]), filling,
                                                                       decoder.scratch(1, "cpu"))
    assert (explained_filling.graph_count, explained_filling.graph_break_count) == (1, 0), explained_filling.break_reasons
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    for layer in cache.layers:
        assert layer.acc.dtype == torch.float32 and layer.meta.dtype == torch.int32
        assert layer.acc.untyped_storage().data_ptr() != layer.meta.untyped_storage().data_ptr()


def run_script(decoder, model, tokens, phase=100, **settings):
    """What a compiled step must run through: conversation A alone (a pin set at its 50th token,
    positions re-laid every ~24 tokens), then B joins it in a batch (both full; B sits out every
    7th step), then B leaves and A goes on alone, and so on, phase by phase, `tokens` tokens of A in
    all, each token fixed (not sampled: the arms see the same inputs). Returns (A's logits per
    step [tokens, vocab], the two caches)."""
    from h2o_chat.chat.batch import Arena, Request

    def fed():
        cache = H2OCache(model, budget=12, n_sink=2, n_recent=4, positions="rolling", **settings)
        model(torch.arange(20)[None] % model.config.vocab_size, cache=cache)
        return cache

    a, b, out = fed(), fed(), []
    for t in range(tokens):
        token = torch.tensor([[(7 * t) % model.config.vocab_size]])
        if t == 50:
            a.protect(a.get_seq_length() + 1, a.get_seq_length() + 4)
        if (t // phase) % 2 == 0:  # A alone
            out.append(decoder.step(token, torch.tensor([a.get_seq_length()]), a)[0])
            continue
        if t % phase == 0:
            arena = Arena()
            arena.join(a)
            arena.join(b)
        requests = [Request(a, token)] + ([] if t % 7 == 0 else [Request(b, (token + 3) % model.config.vocab_size)])
        out.append(arena.step(decoder, requests)[0])
        if t % phase == phase - 1:
            arena.leave(b)
            arena.leave(a)
    return torch.stack(out), a, b


def test_a_compiled_step_never_recompiles_over_2000_tokens():
    # issue 32: "no recompiles as tokens, positions, pins and rows change". 2,000 tokens: one graph
    # for A alone, one for A and B stacked, one for a step where B sits out; tokens, positions,
    # evictions, a pin, position re-rolls and rows joining and leaving add none. The counting
    # backend sees each graph Dynamo compiles (it runs it as traced).
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    model = make_tiny_llama(torch.float32)
    decoder = Decoder(model).compile(backend=counting)
    with torch.no_grad():
        run_script(decoder, model, 2000)
    assert len(graphs) == 3


@pytest.mark.slow
def test_the_compiled_step_computes_what_the_eager_one_does():
    # inductor's kernels (float32) against the eager step over 500 tokens of the same script: logits
    # within 1e-5, and the same tokens kept in every layer of both conversations
    model = make_tiny_llama(torch.float32)
    compiled = Decoder(model).compile()
    with torch.no_grad():
        eager_logits, *eager_caches = run_script(Decoder(model), model, 500, phase=125)
        compiled_logits, *compiled_caches = run_script(compiled, model, 500, phase=125)
    assert torch.allclose(compiled_logits, eager_logits, rtol=0, atol=1e-5)
    for eager, comp in zip(eager_caches, compiled_caches):
        assert all(torch.equal(eager.token_ids(i), comp.token_ids(i)) for i in range(len(eager.layers)))

def test_a_compiled_decoder_runs_a_filling_cache_compiled_too():
    # below its budget a layer's free slots are masked (StepRows.empty), so its step has the
    # budget's shapes from the first token after the prompt: one graph while the slots fill, one
    # once they are full (it evicts), none for each size in between
    graphs = []
    model = make_tiny_llama(torch.float32)
    decoder = Decoder(model).compile(backend=lambda graph, inputs: graphs.append(graph) or graph.forward)
    cache = H2OCache(model, budget=12, n_sink=2, n_recent=4)
    with torch.no_grad():
        model(torch.arange(8)[None], cache=cache)
        for t in range(8):
            decoder.step(torch.tensor([[t]]), torch.tensor([cache.get_seq_length()]), cache)
            assert cache.layers[0].n_slots == min(9 + t, 12)
            assert len(graphs) == (1 if t < 4 else 2)  # 8 + 4 tokens fill the 12 slots


# aten ops of one decode step of the tiny float32 model (2 layers, full: it evicts), nested ones
# counted, as `bench ops` counts them: a ratchet, so a change that adds ops to the hot path fails
# here (a view with all-zero strides once sent baddbmm_ down an addmm per head: +1,177 ops a token
# on the embedded model). Lower the figure when a change removes some. (int8 slots: 413 -> 415 when
# keys and values took turns in half the scratch, one more copy a layer for half the bytes; 415 ->
# 419 when scales and zero points went to float16 in a buffer of their own: its copy up to float32
# and its move into the victim's slot, +5 a layer, less the zero term's bmm, -3.) 367 -> 360 and
# 419 -> 410 when one eviction served every layer (step.Eviction): -16 ops a layer beyond these 2,
# 3,036 -> ~2,540 on the embedded model's 30.
@pytest.mark.parametrize("kv_quant,most", [("none", 360), ("int8", 410)])
def test_a_decode_step_runs_no_more_ops_than_it_did(kv_quant, most):
    from torch.profiler import ProfilerActivity, profile

    model = make_tiny_llama(torch.float32)
    cache, decoder = H2OCache(model, budget=12, n_sink=2, n_recent=4, kv_quant=kv_quant), Decoder(model)
    with torch.no_grad():
        model(torch.arange(20)[None], cache=cache)
        for t in range(3):  # past the first step's one-off work (views, scratch)
            decoder.step(torch.tensor([[t]]), torch.tensor([cache.get_seq_length()]), cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.step(torch.tensor([[5]]), torch.tensor([cache.get_seq_length()]), cache)
    assert sum(e.name.startswith(("aten::", "h2o_chat::")) for e in prof.events()) <= most


@pytest.mark.parametrize("budget,first_static_at", [(12, 0), (40, 0), (41, 6), (56, 7)])
def test_a_small_budget_takes_the_step_from_the_first_token(budget, first_static_at, monkeypatch):
    # a budget up to STATIC_ALWAYS takes the decode step as soon as its buffers are made; a larger
    # one once an eighth of it is live (h2o.H2OCache.steps_static has the measurements)
    import h2o_chat.cache.h2o as h2o

    monkeypatch.setattr(h2o, "STATIC_ALWAYS", 40)
    model = make_tiny_llama(torch.float32)
    cache, decoder, took_step = H2OCache(model, budget=budget, n_sink=2, n_recent=4), Decoder(model), []
    with torch.no_grad():
        model(torch.arange(3)[None], cache=cache)
        for t in range(4):
            took_step.append(all(cache.steps_static()))
            decoder.step(torch.tensor([[t]]), torch.tensor([cache.get_seq_length()]), cache)
    assert took_step == [live >= first_static_at for live in range(3, 7)]


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_a_filling_layer_steps_as_the_general_path_computes(kv_quant, monkeypatch):
    # a layer below its budget takes the decode step with its free slots masked; forced onto the
    # general path (write into the next free slot, attend over the live ones) it computes the same:
    # logits within float32 rounding (the masked sums add the same terms in another order), the
    # same tokens in the same slots, the same scores, then the same evictions once full
    import h2o_chat.cache.h2o as h2o

    model = make_tiny_llama(torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))

    def run(static_from):
        monkeypatch.setattr(h2o, "STATIC_FROM", static_from)
        monkeypatch.setattr(h2o, "STATIC_ALWAYS", 0)  # the budget alone does not decide here
        cache, decoder, logits, took_step = H2OCache(model, budget=12, n_sink=2, n_recent=4, kv_quant=kv_quant), Decoder(model), [], []
        with torch.no_grad():
            token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
            for _ in range(14):  # 4 + 8 fill the 12 slots, then it evicts
                took_step.append(all(cache.steps_static()))
                logits.append(decoder.step(token, torch.full((2,), cache.get_seq_length()), cache))
                token = logits[-1].argmax(-1, keepdim=True)
        return torch.stack(logits), cache, took_step

    stepped, cache, took_step = run(4)
    general, reference, took_general = run(1)  # only a full layer takes the step
    assert all(took_step) and took_general == [False] * 8 + [True] * 6
    torch.testing.assert_close(stepped, general, atol=1e-5, rtol=0)
    for i in range(len(cache.layers)):
        assert torch.equal(cache.token_ids(i), reference.token_ids(i))
        torch.testing.assert_close(cache.scores(i), reference.scores(i), atol=1e-5, rtol=0)
