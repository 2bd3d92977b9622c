"""H2OCache: what it keeps, proved against the slow reference and against DynamicCache."""

import warnings

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from h2o_chat import CacheConfig, H2OCache
from h2o_chat.cache import scoring
from h2o_chat.cache.config import BUDGET_SHAPES, layer_budgets
from h2o_chat.cache.scoring import add_mass, grouped_attention
from h2o_chat.cache.step import KEY
from tests import reference
from tests.conftest import make_tiny_llama
from tests.reference import ReferenceH2O

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POLICIES = ["full", "window", "sink", "h2o"]
POSITIONS = ["absolute", "rolling"]
# every policy once, and h2o with each score mode
POLICY_SCORES = [("full", "sum"), ("window", "sum"), ("sink", "sum"), ("h2o", "sum"), ("h2o", "mean"), ("h2o", "decay")]


def greedy(model, ids, cache, steps):
    return model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_evicted_equals_dynamic_cache(policy, positions):
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    expected = greedy(make_tiny_llama(), ids, DynamicCache(), 64)
    model = make_tiny_llama()
    cache = H2OCache(model, policy=policy, budget=84, n_sink=4, n_recent=40, positions=positions, prefill_chunk=7)
    got = greedy(model, ids, cache, 64)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert cache.layers[0].n_slots == 83  # every token still there: nothing was evicted


def run_both(model, cache, ref, prompt, steps, check):
    """Feed the prompt then `steps` greedy tokens to both; call check() after every forward."""
    logits = model(prompt, cache=cache).logits
    ref_logits = ref.forward(prompt)
    check(logits, ref_logits)
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        logits = model(token, cache=cache).logits
        ref_logits = ref.forward(token)
        check(logits, ref_logits)


# the single-KV-head (MQA) model, batch 1 and 2: one head's slots are a dense block of the buffer;
# each budget shape (a pyramid's layers hold 17 and 7 slots of the stated 2 x 12)
MQA_CASES = [(policy, "sum", positions, batch, shape) for policy in ("h2o", "sink") for positions in POSITIONS
             for batch in (1, 2) for shape in BUDGET_SHAPES]
# int8 slots (kv_quant): GQA and MQA, both position modes (rolling re-lays rotate and round int8 keys again)
INT8_CASES = [(kv_heads, policy, positions) for kv_heads in (2, 1) for policy in ("h2o", "sink")
              for positions in POSITIONS]


@pytest.mark.parametrize("budget_shape", BUDGET_SHAPES)
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("policy,score", POLICY_SCORES)
@pytest.mark.slow
def test_same_tokens_scores_and_logits_as_reference(tiny_llama64, policy, score, positions, budget_shape):
    check_against_reference(tiny_llama64, policy, score, positions, batch=2, budget_shape=budget_shape)


@pytest.mark.parametrize("policy,score,positions,batch,budget_shape", MQA_CASES)
def test_single_kv_head_same_as_reference(policy, score, positions, batch, budget_shape):
    check_against_reference(make_tiny_llama(torch.float64, kv_heads=1), policy, score, positions, batch, budget_shape)


@pytest.mark.parametrize("kv_heads,policy,positions", INT8_CASES)
def test_int8_slots_same_as_reference(kv_heads, policy, positions):
    check_against_reference(make_tiny_llama(torch.float64, kv_heads=kv_heads), policy, "sum", positions, batch=2,
                            kv_quant="int8")


def check_against_reference(model, policy, score, positions, batch, budget_shape="uniform", kv_quant="none"):
    kv_heads = model.config.num_key_value_heads
    cache = H2OCache(model, policy=policy, budget=12, n_sink=2, n_recent=4, score=score, positions=positions,
                     prefill_chunk=5, budget_shape=budget_shape, kv_quant=kv_quant)
    lim = cache.limits
    budgets = [lim.layer(i).budget for i in range(2)]
    if policy != "full":  # uniform: 12 in each layer; pyramid: the 6 heavy slots (8: window has no sinks) as 11 + 1 (15 + 1)
        assert budgets == [12, 12] if budget_shape == "uniform" else [19, 5] if policy == "window" else [17, 7]
    ref = ReferenceH2O(model, policy=policy, budget=budgets, n_sink=lim.n_sink, n_recent=lim.n_recent,
                       score=score, positions=positions, prefill_chunk=5, kv_quant=kv_quant)
    prompt = torch.randint(0, 128, (batch, 23), generator=torch.Generator().manual_seed(2))

    # memory: the stated total, 2 layers x 12 slots, each [batch, kv_heads, head_dim] keys and values
    per_slot = 2 * batch * kv_heads * cache.head_dim * torch.finfo(model.dtype).bits // 8
    if kv_quant == "int8":  # a byte a number, and a float16 scale and zero point for each key and value
        per_slot = batch * kv_heads * (2 * cache.head_dim + 4 * 2)

    def check(logits, ref_logits):
        # float64 throughout except RoPE angles, which transformers computes in float32
        # (re-rotating a kept key composes two such rotations: float32-level differences)
        torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=1e-6)
        assert policy == "full" or cache.kv_bytes() <= 2 * 12 * per_slot
        for layer in range(2):
            ids, scores = cache.token_ids(layer), cache.scores(layer)
            for b in range(batch):
                for h in range(kv_heads):
                    assert sorted(ids[b, h].tolist()) == ref.kept(layer, b, h), (layer, b, h)
                    ref_scores = ref.scores(layer, b, h)
                    want = torch.tensor([ref_scores[t] for t in ids[b, h].tolist()])
                    torch.testing.assert_close(scores[b, h], want.double(), atol=1e-6, rtol=1e-6)
                    if positions == "rolling":  # re-rotated keys equal keys rotated fresh to their positions
                        fresh = ref.fresh_keys(layer, b, h)
                        want_keys = torch.stack([fresh[t] for t in ids[b, h].tolist()])
                        keys = cache.layers[layer].widened(torch.float64)[0]
                        torch.testing.assert_close(keys[b, h], want_keys, atol=1e-6, rtol=1e-6)

    run_both(model, cache, ref, prompt, 40, check)
    if policy != "full":
        assert [layer.n_slots for layer in cache.layers] == budgets
        assert cache.kv_bytes() == 2 * 12 * per_slot  # every layer full: exactly the stated total


def test_pinned_tokens_match_reference_and_stay(tiny_llama64):
    model = tiny_llama64
    cache = H2OCache(model, policy="h2o", budget=12, n_sink=1, n_recent=4, prefill_chunk=5)
    cache.protect(6, 9)
    ref = ReferenceH2O(model, budget=12, n_sink=1, n_recent=4, positions="rolling", prefill_chunk=5, pins=[(6, 9)])
    prompt = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(3))

    def check(logits, ref_logits):
        torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=1e-6)
        for layer in range(2):
            for h in range(2):
                kept = cache.token_ids(layer)[0, h].tolist()
                assert sorted(kept) == ref.kept(layer, 0, h)
                assert {6, 7, 8} <= set(kept)

    run_both(model, cache, ref, prompt, 30, check)


def test_pins_that_leave_no_room_are_refused(tiny_llama):
    cache = H2OCache(tiny_llama, policy="h2o", budget=16, n_sink=2, n_recent=8)
    cache.protect(10, 16)  # 2 + 6 + 8 = 16: fits exactly
    with pytest.raises(ValueError, match="the pins need 7 slots, but 8 recent [+] 2 sinks leave 6 of the budget of 16: "
                                         "raise the budget, lower the recent window or unpin a message"):
        cache.protect(20, 21)
    cache.unprotect(10, 16)
    cache.protect(20, 21)


@pytest.mark.slow
def test_memory_is_bounded_over_1000_tokens(tiny_llama):
    cache = H2OCache(tiny_llama, policy="h2o", budget=64, n_sink=4, n_recent=32, positions="rolling")
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    out = tiny_llama.generate(ids, cache=cache, max_new_tokens=1000, min_new_tokens=1000, do_sample=False)
    assert out.shape[1] == 1010 and cache.get_seq_length() == 1009  # the last token is never fed back
    for layer in cache.layers:
        assert layer.keys.shape == (1, 2, 64, 16) and layer.values.shape == (1, 2, 64, 16)
        assert layer.capacity == 65  # the one spare slot of "cache replace", nothing that grows


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", POLICIES)
def test_single_kv_head_evicts_in_fp32_and_bf16(policy, dtype, batch):
    # one KV head crashed at the first eviction (scatter from a view of its own buffer)
    model = make_tiny_llama(dtype, kv_heads=1)
    cache = H2OCache(model, policy=policy, budget=12, n_sink=2, n_recent=4, prefill_chunk=5)
    prompt = torch.randint(0, 128, (batch, 9), generator=torch.Generator().manual_seed(9))
    out = greedy(model, prompt, cache, 30)
    assert out.sequences.shape == (batch, 39) and cache.get_seq_length() == 38
    for layer in range(2):
        ids = cache.token_ids(layer)
        assert ids.shape == (batch, 1, 38 if policy == "full" else 12)
        for row in ids[:, 0].tolist():
            assert len(set(row)) == len(row)  # no token held twice, none lost to a bad move
            if policy != "full":
                assert set(range(34, 38)) <= set(row)  # the recent window
                assert policy == "window" or {0, 1} <= set(row)  # the sinks


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_batch_rows_are_independent(policy):
    prompt = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    model = make_tiny_llama(torch.float64)
    both = H2OCache(model, policy=policy, budget=16, n_sink=2, n_recent=6, prefill_chunk=8)
    out = greedy(model, prompt, both, 40)
    for row in range(2):
        alone = H2OCache(model, policy=policy, budget=16, n_sink=2, n_recent=6, prefill_chunk=8)
        out_row = greedy(model, prompt[row : row + 1], alone, 40)
        assert torch.equal(out.sequences[row], out_row.sequences[0])
        for layer in range(2):
            assert torch.equal(both.token_ids(layer)[row], alone.token_ids(layer)[0])
            torch.testing.assert_close(both.scores(layer)[row], alone.scores(layer)[0])


def test_grouped_scores_are_the_sum_over_the_query_heads_of_a_group():
    torch.manual_seed(6)
    b, kv_heads, group, n, slots, d = 2, 3, 3, 4, 9, 8
    query = torch.randn(b, kv_heads * group, n, d, dtype=torch.float64)
    keys = torch.randn(b, kv_heads, slots, d, dtype=torch.float64)
    values = torch.randn(b, kv_heads, slots, d, dtype=torch.float64)
    out, probs = grouped_attention(query, keys, values, scaling=d**-0.5)
    # per query head, the textbook way: repeat the KV heads, bottom-right causal mask
    k_rep, v_rep = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    logits = query @ k_rep.transpose(-1, -2) * d**-0.5
    causal = torch.ones(n, slots, dtype=torch.bool).tril(diagonal=slots - n)
    p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [b, q_heads, n, slots]
    torch.testing.assert_close(out, (p @ v_rep).transpose(1, 2))
    per_kv_head = p.view(b, kv_heads, group, n, slots).sum(dim=(2, 3))
    torch.testing.assert_close(probs.sum(dim=(2, 3)).double(), per_kv_head)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,kv_heads,group,n,slots", [(1, 3, 3, 1, 17), (2, 3, 3, 16, 40), (1, 3, 3, 64, 200),
                                                      (2, 1, 4, 5, 5), (1, 2, 1, 7, 30)])
def test_fused_grouped_attention_is_the_explicit_one(dtype, b, kv_heads, group, n, slots):
    # the fused passes (bias and scale in the logits' baddbmm/add, softmax in place) round alike:
    # bit-identical to the explicit oracle in every dtype, a decode row (n = 1) and MQA included
    gen = torch.Generator().manual_seed(n * slots)
    d = 16
    query = torch.randn(b, n, kv_heads * group, d, generator=gen).to(dtype).transpose(1, 2)  # strided, as models hand it
    kv = torch.randn(2, b, kv_heads, slots + 3, d, generator=gen).to(dtype)[:, :, :, :slots]  # live slots of a buffer
    out, probs = grouped_attention(query, kv[0], kv[1], scaling=d**-0.5)
    out_ref, probs_ref = reference.explicit_grouped_attention(query, kv[0], kv[1], scaling=d**-0.5)
    assert probs.dtype == probs_ref.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(probs, probs_ref) and torch.equal(out, out_ref)
    # the column mass, summed in one reduction (decay: one weighted matmul) instead of two: float
    # rounding order differs, so within a few ulps of the oracle's
    for score in ("sum", "mean", "decay"):
        scores, queries = torch.zeros(2, b, kv_heads, slots, dtype=probs.dtype)
        add_mass(scores, queries, probs, score, decay=0.9)
        tol = 1e-12 if probs.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(scores, reference.explicit_column_mass(probs_ref, score).to(probs.dtype),
                                   rtol=tol, atol=tol)


def test_a_token_written_in_place_gets_the_meta_a_chunk_gives_it():
    # the growing path writes one token's id, position and protection key straight into its slot;
    # a prefill chunk builds them with new_meta: the same, for sinks, pins and plain tokens alike
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(3))
    one, chunk = (H2OCache(model, policy="h2o", budget=32, n_sink=2, n_recent=8) for _ in range(2))
    for cache in (one, chunk):
        cache.protect(5, 8)
    with torch.no_grad():
        model(ids, cache=chunk)
        for i in range(ids.shape[1]):
            model(ids[:, i : i + 1], cache=one)
    for a, b in zip(one.layers, chunk.layers):
        assert a.n_slots == b.n_slots == 14
        assert torch.equal(a.meta[: KEY + 1, :, :, :14], b.meta[: KEY + 1, :, :, :14])
        assert (a.meta[KEY, :, :, :14] == torch.iinfo(a.meta.dtype).max).sum() == 2 * 2 * (2 + 3)  # sinks, pins
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.scores, b.scores)


def test_rolling_generates_past_the_trained_context():
    model = make_tiny_llama(max_position_embeddings=64)
    cache = H2OCache(model, policy="h2o", budget=24, n_sink=2, n_recent=8, positions="rolling")
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(7))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="H2OCache")
        out = model.generate(ids, cache=cache, max_new_tokens=200, min_new_tokens=200, do_sample=False)
    assert out.shape[1] == 216
    # every key sits within twice the budget of the next query's position, never past the context
    for layer in range(2):
        distance = cache.get_seq_length() - cache.positions(layer)
        assert distance.min().item() >= 1 and distance.max().item() <= 48


def test_absolute_warns_once_past_the_trained_context():
    model = make_tiny_llama(max_position_embeddings=64)
    cache = H2OCache(model, policy="h2o", budget=24, n_sink=2, n_recent=8, positions="absolute")
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(7))
    with pytest.warns(UserWarning, match="passed the model's 64 trained positions") as record:
        model.generate(ids, cache=cache, max_new_tokens=100, min_new_tokens=100, do_sample=False)
    assert len([w for w in record if "H2OCache" in str(w.message)]) == 1


def test_prefill_scores_chunks_never_the_whole_prompt(tiny_llama, monkeypatch):
    shapes = []

    def recording(query, keys, values, scaling):
        shapes.append((query.shape[2], keys.shape[2]))
        return grouped_attention(query, keys, values, scaling)

    monkeypatch.setattr(scoring, "grouped_attention", recording)
    cache = H2OCache(tiny_llama, policy="h2o", budget=32, n_sink=4, n_recent=16, prefill_chunk=16)
    tiny_llama(torch.randint(0, 128, (1, 300)), cache=cache)
    assert max(n for n, _ in shapes) == 16  # queries per chunk
    assert max(s for _, s in shapes) == 32 + 16  # slots: the budget plus one chunk
    assert cache.layers[1].n_slots == 32 and cache.get_seq_length() == 300


def test_fraction_budget_is_taken_of_the_first_prompt(tiny_llama):
    cache = H2OCache(tiny_llama, policy="h2o", budget=0.2, n_sink=0, n_recent=0.1)
    tiny_llama(torch.randint(0, 128, (1, 200)), cache=cache)
    assert (cache.limits.budget, cache.limits.n_recent, cache.limits.n_heavy) == (40, 20, 20)
    assert cache.layers[0].n_slots == 40


def test_a_model_switched_to_h2o_still_works_with_dynamic_cache():
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    expected = greedy(make_tiny_llama(), ids, DynamicCache(), 16)
    model = make_tiny_llama()
    H2OCache(model)
    assert model.config._attn_implementation == "h2o"
    got = greedy(model, ids, DynamicCache(), 16)
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("kwargs,message", [
    (dict(budget=0), "budget must be positive"),
    (dict(budget=-5), "budget must be positive"),
    (dict(budget="many"), "budget must be"),
    (dict(budget=1.5), "whole number of slots or a fraction"),
    (dict(budget=16, n_sink=4, n_recent=13), "cannot hold 4 sinks and a recent window of 13"),
    (dict(policy="lru"), "unknown policy 'lru'"),
    (dict(score="max"), "unknown score 'max'"),
    (dict(positions="relative"), "unknown positions 'relative'"),
    (dict(prefill_chunk=0), "prefill chunk must be at least 1, got 0"),
    (dict(n_sink=-1), "sinks must be at least 0, got -1"),
    (dict(budget=64, n_recent=0.5), "the recent window may be a fraction only"),
    (dict(decay=0.0), "decay must be more than 0 and at most 1"),
    (dict(budget_shape="cone"), "unknown budget_shape 'cone'"),
    # a pyramid shares the heavy-hitter slots: with none, its top layer would hold only sinks and recent
    (dict(budget=16, n_sink=4, n_recent=12, budget_shape="pyramid"),
     "the budget shape 'pyramid' needs heavy-hitter slots to share between layers, but a budget of 16 with 4 sinks "
     "and a recent window of 12 leaves none: raise the budget or lower the recent window"),
    (dict(policy="sink", budget=16, budget_shape="pyramid"), "a recent window of 12 leaves none"),
])
def test_bad_settings_are_refused_before_any_work(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        H2OCache(tiny_llama, **kwargs)
    assert tiny_llama.config._attn_implementation != "h2o"  # refused before touching the model


@pytest.mark.parametrize("budget,n_layers,want", [
    (16, 2, (25, 7)),  # heavy 10: the top layer 10/20 -> at least 1, the bottom 2 x 10 - 1
    (46, 3, (84, 46, 8)),  # heavy 40: 78, 40, 2
    (36, 4, (65, 46, 26, 7)),  # heavy 30: 58.5, 39.5, 20.5, 1.5; the two rounded up are the lowest layers
    (16, 1, (16,)),  # one layer: nothing to share
    (7, 30, (7,) * 30),  # heavy 1: the top's at-least-1 is the average, every layer the same
])
def test_pyramid_layer_budgets_fall_linearly_and_sum_to_the_total(budget, n_layers, want):
    assert layer_budgets(budget, 2, 4, n_layers) == want
    limits = CacheConfig(budget=budget, n_sink=2, n_recent=4, budget_shape="pyramid").resolve(0, n_layers)
    assert limits.layers == want and sum(want) == n_layers * budget
    assert [limits.layer(i).budget for i in range(n_layers)] == list(want)
    assert limits.tightest.budget == min(want)


def test_pyramid_of_the_app_budget_keeps_every_layer_its_window():
    # the embedded model's 30 layers at the app's 512 slots: more below, fewer above, none below sinks + recent + 1
    limits = CacheConfig(budget=512, n_sink=4, budget_shape="pyramid").resolve(0, 30)
    layers = limits.layers
    assert sum(layers) == 30 * 512 and list(layers) == sorted(layers, reverse=True)
    assert min(layers) >= limits.n_sink + limits.n_recent + 1 and layers[0] > 512 > layers[-1]
    assert CacheConfig(budget=512, n_sink=4).resolve(0, 30).layers is None  # uniform: one budget, as before


def test_fraction_pyramid_is_shared_at_the_first_prompt(tiny_llama):
    cache = H2OCache(tiny_llama, policy="h2o", budget=0.2, n_sink=2, n_recent=0.05, budget_shape="pyramid")
    tiny_llama(torch.randint(0, 128, (1, 200)), cache=cache)
    assert (cache.limits.budget, cache.limits.layers) == (40, (2 + 10 + 55, 2 + 10 + 1))
    assert [layer.n_slots for layer in cache.layers] == [67, 13]
    assert cache.kv_bytes() == 2 * 40 * cache.full_kv_bytes() // (2 * 200)  # the stated total of 2 x 40 slots


def test_pins_must_fit_the_smallest_layer(tiny_llama):
    cache = H2OCache(tiny_llama, policy="h2o", budget=16, n_sink=2, n_recent=4, budget_shape="pyramid")
    assert cache.limits.layers == (25, 7)  # the top layer has 1 slot beyond its sinks and recent window
    cache.protect(10, 11)
    with pytest.raises(ValueError, match="the pins need 2 slots, but 4 recent [+] 2 sinks leave 1 of the smallest "
                                         "layer's budget of 7: raise the budget"):
        cache.protect(20, 21)


def test_unsupported_architecture_is_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32))
    with pytest.raises(ValueError, match="supports llama, mistral, qwen2 models, not 'gpt2'"):
        H2OCache(gpt2)


def test_eviction_ties_keep_the_newer_token():
    # hand-made slots: token ids 0..5 with equal priority everywhere except slot 0 (protected)
    ids = torch.tensor([[[0, 5, 3, 1, 4, 2]]])
    priority = torch.tensor([[[9.0, 1.0, 1.0, 1.0, 1.0, 1.0]]])
    protected = ids == 0
    from h2o_chat.cache.policy import protection_key, select_keep
    from h2o_chat.cache.step import IDS, KEY, N_ACC, N_META, SCORE, DecodeStep, Eviction, StepRows, step_layer

    assert select_keep(ids, priority, protected, 4).tolist() == [[[0, 2, 4, 1]]]  # tokens 0, 3, 4, 5
    # the decode step, the same slots plus token 6 in the spare slot: a query of zeros adds the same
    # mass to every slot, so the tie stays, and token 1 (slot 3), the oldest, gives its slot to 6
    kv, meta, acc = torch.zeros(2, 1, 1, 7, 4), torch.zeros(N_META, 1, 1, 7, dtype=torch.int32), torch.zeros(N_ACC, 1, 1, 7)
    meta[IDS, :, :, :6] = ids.int()
    meta[KEY, :, :, :6] = protection_key(ids.int(), n_sink=1)
    acc[SCORE, :, :, :6] = priority
    query = torch.zeros(1, 1, 1, 4)
    step = DecodeStep.over(kv, acc, None, group=1, dtype=query.dtype, scaling=1.0)
    eviction = Eviction.over(kv[None], meta[None], acc[None], None)
    # token 6 (n_seen 7 after it), one recent token: the new one
    rows = StepRows.make([6], [False], [True], kv_heads=1, group=1, n_recent=1, decay=1.0, meta_dtype=torch.int32,
                         acc_dtype=torch.float32, device="cpu")
    step_layer(0, [step], [eviction], torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), query,
               CacheConfig(policy="h2o", budget=6, n_sink=1, n_recent=1), rows)
    assert meta[IDS, 0, 0, :6].tolist() == [0, 5, 3, 6, 4, 2]
    assert kv[0, 0, 0, 3].tolist() == [1.0] * 4


@pytest.mark.parametrize("kv_quant", ["none", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_a_full_layer_decodes_without_host_syncs_or_new_buffers(dtype, kv_quant):
    from torch.profiler import ProfilerActivity, profile

    model = make_tiny_llama(dtype)
    cache = H2OCache(model, policy="h2o", budget=16, n_sink=2, n_recent=4, positions="rolling", kv_quant=kv_quant)
    token = model(torch.randint(0, 128, (1, 30)), cache=cache).logits[:, -1:].argmax(-1)
    token = model(token, cache=cache).logits[:, -1:].argmax(-1)  # the first step stacks the layers' buffers, once
    buffers = [(layer.kv.data_ptr(), layer.meta.data_ptr(), layer.acc.data_ptr(), layer.kv.shape) for layer in cache.layers]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(40):  # past a re-lay of the positions (every 2 x budget tokens)
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    names = [e.name for e in prof.events()]
    assert "aten::_local_scalar_dense" not in names and "aten::is_nonzero" not in names  # no .item(), no bool()
    assert cache.layers[0].roll_floor > 0  # a re-lay happened inside the profiled steps
    assert [(layer.kv.data_ptr(), layer.meta.data_ptr(), layer.acc.data_ptr(), layer.kv.shape) for layer in cache.layers] == buffers
    assert all(layer.n_slots == 16 and layer.capacity == 17 for layer in cache.layers)


def test_snapshot_restores_into_the_same_buffers(tiny_llama64):
    model = tiny_llama64
    cache = H2OCache(model, policy="h2o", budget=12, n_sink=2, n_recent=4)

    def decode(token, steps):
        logits = []
        for _ in range(steps):
            logits.append(model(token, cache=cache).logits[:, -1])
            token = logits[-1].argmax(-1, keepdim=True)
        return torch.stack(logits)

    model(torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(10)), cache=cache)
    decode(torch.tensor([[1]]), 1)  # the first decode step stacks the layers' buffers (H2OCache.stack_layers), once
    snap, ids = cache.snapshot(), [cache.token_ids(i) for i in range(2)]
    pointer = cache.layers[0].kv.data_ptr()
    first = decode(torch.tensor([[3]]), 20)
    cache.restore(snap)
    assert cache.layers[0].kv.data_ptr() == pointer  # written back in place: the step's views stay valid
    assert all(torch.equal(a, cache.token_ids(i)) for i, a in enumerate(ids))
    assert torch.equal(decode(torch.tensor([[3]]), 20), first)  # the same continuation from the same state
