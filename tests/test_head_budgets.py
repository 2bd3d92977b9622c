"""Head budgets (Ada-KV), the bench's measurement (bench/head_budgets.py): the joint choice of a
layer's kept slots against a plain reference, the per-head mode against H2OCache bit for bit
(what makes its Ada-KV figure mean something), Ada-KV's memory and protection, and the ppl
bench's --head-budget end to end."""

import random

import pytest
import torch

from h2o_chat.bench import evaluate
from h2o_chat.bench.head_budgets import HeadBudgetCache, HeadBudgetLayer, keep_jointly
from h2o_chat.bench.ppl import streaming_nlls
from h2o_chat.cache.h2o import H2OCache
from h2o_chat.cache.policy import select_keep
from tests.conftest import make_tiny_llama, run_ppl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_keep(heads, total):
    """The rule in plain Python: heads is a list of [(token_id, rank, protected)] per head; returns
    the set of (head, slot) kept: every protected slot, then the unprotected ones by rank, the newer
    token first on a tie, then the earlier head."""
    kept = {(h, i) for h, slots in enumerate(heads) for i, (_, _, protected) in enumerate(slots) if protected}
    free = sorted(((rank, token, -h, i) for h, slots in enumerate(heads) for i, (token, rank, protected)
                   in enumerate(slots) if not protected), reverse=True)
    return kept | {(-minus_h, i) for _, _, minus_h, i in free[: total - len(kept)]}


def test_keep_jointly_matches_a_plain_reference_on_random_scores():
    rng = random.Random(0)
    for trial in range(300):
        n_heads, n_seen = rng.randint(1, 4), rng.randint(5, 60)
        heads = []
        for _ in range(n_heads):  # each head holds its own subset of the tokens seen, in token order
            tokens = sorted(rng.sample(range(n_seen), rng.randint(1, n_seen)))
            # ranks from a few values, so ties (between tokens, and between heads) are common
            heads.append([(t, float(rng.randint(0, 5)) if trial % 2 else rng.random(), rng.random() < 0.2)
                          for t in tokens])
        slots = [s for head in heads for s in head]
        n_protected = sum(p for _, _, p in slots)
        total = rng.randint(n_protected, len(slots))
        ids = torch.tensor([[t for t, _, _ in slots]])
        ranks = torch.tensor([[r for _, r, _ in slots]], dtype=torch.float32)
        protected = torch.tensor([[p for _, _, p in slots]])
        keep = keep_jointly(ids, ranks, protected, total)[0]
        flat = [(h, i) for h, head in enumerate(heads) for i in range(len(head))]
        assert {flat[j] for j in keep.nonzero()[:, 0].tolist()} == reference_keep(heads, total)
        assert int(keep.sum()) == total


def test_keep_jointly_on_one_head_keeps_select_keeps_set():
    torch.manual_seed(0)
    for _ in range(50):
        n, budget = 64, 20
        ids = torch.randperm(200)[:n].sort().values[None]
        ranks = torch.randint(0, 4, (1, n)).float()  # many ties
        protected = torch.rand(1, n) < 0.15
        kept = keep_jointly(ids, ranks, protected, budget)[0].nonzero()[:, 0]
        assert torch.equal(kept, select_keep(ids[None], ranks[None], protected[None], budget)[0, 0].sort().values)


def sharp_tiny_llama(dtype):
    """The tiny random LLaMA with its projections scaled up: attention that is not near uniform, so
    heads differ in how spread it is (at its initial scale they barely do)."""
    model = make_tiny_llama(dtype)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "proj" in name:
                weight.mul_(8)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_quant", ["none", "int8"])
@pytest.mark.parametrize("score", ["sum", "mean"])
def test_per_head_reproduces_h2ocache_bit_for_bit(dtype, kv_quant, score):
    """Every head its own budget through the bench's cache: the same NLL per token as H2OCache, exactly,
    through chunked eviction and rolling re-lays (400 tokens, a budget of 40: the span passes 80)."""
    model = sharp_tiny_llama(dtype)
    tokens = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(1))
    settings = dict(policy="h2o", budget=40, n_sink=4, score=score, prefill_chunk=8, kv_quant=kv_quant)
    library = streaming_nlls(model, tokens, H2OCache(model, **settings), 64)
    cache = HeadBudgetCache(model, shared="head", **settings)
    assert torch.equal(streaming_nlls(model, tokens, cache, 64), library)
    assert all(layer.slot_counts() == [40, 40] for layer in cache.layers)
    assert all(head.roll_floor > 0 for layer in cache.layers for head in layer.heads)  # it did re-lay


@pytest.mark.parametrize("score", ["sum", "mean"])
def test_ada_kv_shares_the_layers_slots_and_keeps_every_heads_sinks_and_window(score):
    model = sharp_tiny_llama(torch.float32)
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    settings = dict(policy="h2o", budget=40, n_sink=4, score=score, prefill_chunk=8)
    uniform = H2OCache(model, **settings)
    streaming_nlls(model, tokens, uniform, 64)
    cache = HeadBudgetCache(model, shared="layer", **settings)
    counts = []
    evict = HeadBudgetLayer.evict

    def counted(layer, limits):  # after every chunk, the layer within its kv_heads x budget slots
        evict(layer, limits)
        counts.append(layer.slot_counts())
        assert sum(counts[-1]) <= 2 * 40

    HeadBudgetLayer.evict = counted
    try:
        streaming_nlls(model, tokens, cache, 64)
    finally:
        HeadBudgetLayer.evict = evict
    limits, n_seen = cache.limits, 299
    assert any(c[0] != c[1] for c in counts)  # the heads did share unevenly
    for i, layer in enumerate(cache.layers):
        assert sum(layer.slot_counts()) == 2 * 40
        for ids in cache.token_ids(i):  # every head: its sinks and its whole recent window
            window = set(range(n_seen - limits.n_recent, n_seen)) | set(range(limits.n_sink))
            assert window <= set(ids.tolist()) and ids.tolist() == sorted(set(ids.tolist()))
    assert cache.kv_bytes() == uniform.kv_bytes() and cache.full_kv_bytes() == uniform.full_kv_bytes()


def test_ppl_head_budget_flag(tiny_model_dir, play_text, tmp_path):
    rows = {r["label"]: r for r in run_ppl(tiny_model_dir, play_text, tmp_path, "--tokens", "160",
                                           "--budgets", "32", "--chunk", "8", "--methods", "full,h2o-sum",
                                           "--head-budget", "library,per-head,ada-kv", "--long-tokens", "0")["rows"]}
    assert list(rows) == ["full", "h2o-sum library", "h2o-sum per-head", "h2o-sum ada-kv"]
    assert rows["h2o-sum per-head"]["mean_nll"] == rows["h2o-sum library"]["mean_nll"]
    assert {rows[k]["kv_pct"] for k in list(rows)[1:]} == {f"{32 / 159:.1%}"}
    assert "| head_budget |" in (tmp_path / "ppl.md").read_text()
    with pytest.raises(SystemExit):
        evaluate.main(["ppl", "--head-budget", "per-layer"])
