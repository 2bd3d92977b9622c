"""Head budgets (Ada-KV) measured without touching the decode step: a bench-only cache whose layers
share their `H x budget` slots between their KV heads, for the streaming perplexity bench
(`evaluate ppl --head-budget library,per-head,ada-kv`). docs/budgets.md has what it measured.

Ada-KV (Feng et al., 2024) keeps a layer's tokens jointly over its heads: the layer's slots go to
the highest scores of any head, so a head whose attention is spread holds more slots and a
concentrated one fewer, the layer's total fixed. This is the memory of docs/budgets.md's layout 2
(one row of `H x budget` slots a layer, a head index per slot), simulated: each KV head of a layer
is an `H2OLayer` of its own (one KV head, its own slot count), so heads can hold different
numbers of slots without padding or masks, and every write, attention, score and rolling re-lay
is the library's own code. Only the choice of what to keep is made here, over the layer:

    every chunk of --chunk tokens: each head writes it, attends and scores (H2OLayer.attend_chunk,
    told to keep everything) -> if the layer holds more than H x budget slots, `keep_jointly`
    picks the kept set over all its heads -> each head keeps its share, in token order -> heads
    re-lay positions when due.

Protection is per head, as in H2OCache: every head keeps its sinks and its recent window (the
same `n_recent` newest tokens; Ada-KV's "safeguard" floor is this), only the heavy-hitter slots
move between heads. Scores are compared across heads as they are (H2O's accumulated attention
mass, or the mass per query with `mean`): each query's softmax sums to 1 in every head, so a
head's mass is on the same scale as another's.

`shared="head"` (`--head-budget per-head`) makes each head a group of its own, `budget` slots
each: H2OCache's rule through this code, which must give H2OCache's perplexity (bit for bit:
tests/test_head_budgets.py on the tiny model, docs/budgets.md on the embedded one) before its
`layer` (`--head-budget ada-kv`) figure means anything.

Only what the ppl bench drives: batch 1, the general (chunked) path; never the decode step.
"""

from types import SimpleNamespace

import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache.config import Budget
from ..cache.h2o import H2OCache, H2OLayer
from ..cache.policy import priority
from ..cache.step import KEY

# evaluate ppl --head-budget: H2OCache itself; this cache with a budget per head (the check); Ada-KV
SHARED_BY = {"library": None, "per-head": "head", "ada-kv": "layer"}


def keep_jointly(token_ids, ranks, protected, total):
    """Which of a group of heads' slots to keep: [batch, slots] bools, `total` of them per row.

    token_ids, ranks, protected: [batch, slots], the group's heads' slots side by side (each head's
    in turn). Protected slots are kept; the rest of `total` goes to the unprotected slots of highest
    rank whichever head holds them; ties keep the newer token, then the earlier head. With one head
    in the group it keeps policy.select_keep's set. Callers guarantee protected.sum(-1) <= total."""
    by_newest = token_ids.argsort(dim=-1, descending=True, stable=True)
    key = torch.where(protected, torch.inf, ranks.double()).gather(-1, by_newest)
    kept = by_newest.gather(-1, key.argsort(dim=-1, descending=True, stable=True))[..., :total]
    return torch.zeros_like(protected).scatter_(-1, kept, True)


class HeadBudgetLayer(CacheLayerMixin):
    """One layer as its KV heads: `heads[h]`, an H2OLayer of one KV head whose slots are in token
    order; `shared` "head" (each head `budget` slots) or "layer" (the heads share `H x budget`)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, config, inv_freq, max_positions, kv_heads, shared):
        super().__init__()
        self.config, self.shared = config, shared
        self.heads = [H2OLayer(config, inv_freq, max_positions) for _ in range(kv_heads)]

    @property
    def n_seen(self):
        return self.heads[0].n_seen

    def slot_counts(self):
        """[kv_heads] the slots each head holds now."""
        return [head.n_slots for head in self.heads]

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("HeadBudgetLayer is updated through HeadBudgetCache")

    def get_seq_length(self):
        return self.n_seen

    def get_mask_sizes(self, query_length):
        held = max(self.slot_counts())  # the attention here builds its own masks; this only has to be sane
        return held + query_length, self.n_seen - held

    def get_max_length(self):
        return -1

    def reset(self):
        for head in self.heads:
            head.reset()

    def attend(self, keys, values, query, scaling, limits: Budget, pins):
        """keys, values [1, kv_heads, n, head_dim], query [1, q_heads, n, head_dim] -> [1, n, q_heads,
        head_dim], chunk by chunk as H2OLayer.attend, the kept set chosen by `evict`."""
        if keys.shape[0] != 1:
            raise ValueError("HeadBudgetCache runs batch 1 only (the ppl bench's)")
        self.is_initialized = True
        group = query.shape[1] // len(self.heads)
        keep_all = Budget(None, limits.n_sink, limits.n_recent)  # each head writes, attends and scores only
        outs = []
        for s in range(0, keys.shape[2], self.config.prefill_chunk):
            c = slice(s, s + self.config.prefill_chunk)
            outs.append(torch.cat([head.attend_chunk(keys[:, h : h + 1, c], values[:, h : h + 1, c],
                                                     query[:, h * group : (h + 1) * group, c], scaling, keep_all, pins)
                                   for h, head in enumerate(self.heads)], dim=2))
            self.evict(limits)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def evict(self, limits):
        """Back to the budget, if over it: per head (`shared` "head") or over the layer's heads
        together ("layer"); then each head re-lays positions when due (at twice its own slots, or
        the budget if more)."""
        counts, budget = self.slot_counts(), limits.budget
        if budget is None or (max(counts) <= budget if self.shared == "head" else sum(counts) <= budget * len(counts)):
            return
        groups = [[head] for head in self.heads] if self.shared == "head" else [self.heads]
        for heads in groups:
            self.keep(heads, budget * len(heads), limits.n_recent)
        for head in self.heads:
            head.maybe_roll(Budget(max(budget, head.n_slots), limits.n_sink, limits.n_recent))

    def keep(self, heads, total, n_recent):
        """`total` slots over these heads (keep_jointly), each head's kept slots gathered in token order."""
        n_seen = heads[0].n_seen
        ids = torch.cat([head.token_ids[0, 0] for head in heads])[None]
        ranks = torch.cat([priority(self.config.policy, self.config.score, head.token_ids[0, 0], head.scores[0, 0],
                                    head.queries[0, 0]) for head in heads])[None]
        protected = torch.cat([head.meta[KEY, 0, 0, : head.n_slots] >= n_seen - n_recent for head in heads])[None]
        kept = keep_jointly(ids, ranks, protected, total)[0].split([head.n_slots for head in heads])
        for head, mask in zip(heads, kept):
            slots = mask.nonzero()[:, 0]  # slots are in token order, so the kept ones stay in it
            head.set_buffers(head.kv[:, :, :, slots], head.meta[..., slots], head.acc[..., slots],
                             None if head.qp is None else head.qp[..., slots], len(slots))


class HeadBudgetCache(H2OCache):
    """H2OCache's settings and its forward path, its layers `HeadBudgetLayer`s: with `shared` "layer"
    a layer's `kv_heads x budget` slots go to whichever heads' tokens score highest (Ada-KV); with
    "head" each head keeps `budget`, as H2OCache does. Batch 1, prefill path only (the decode step
    is never taken: `decode_rows` is None)."""

    def __init__(self, model, shared="layer", **settings):
        super().__init__(model, **settings)
        if shared not in ("head", "layer"):
            raise ValueError(f"shared must be 'head' or 'layer', got {shared!r}")
        if self.config.budget_shape != "uniform":
            raise ValueError("head budgets share each layer's own slots: budget_shape must be 'uniform'")
        inv_freq, n_layers = self.layers[0].inv_freq, len(self.layers)
        self.layers = [HeadBudgetLayer(self.config, inv_freq, self.max_positions, self.kv_heads, shared)
                       for _ in range(n_layers)]

    def decode_rows(self):
        return None

    def heads_as_cache(self):
        """Every layer's heads as one cache's layers: what H2OCache's byte counts read."""
        return SimpleNamespace(layers=[head for layer in self.layers for head in layer.heads], dtype=self.dtype,
                               get_seq_length=self.get_seq_length)

    def kv_bytes(self):
        """The live slots' bytes, counted as H2OCache counts them (its kv_bytes over every head)."""
        return H2OCache.kv_bytes(self.heads_as_cache())

    def full_kv_bytes(self):
        return H2OCache.full_kv_bytes(self.heads_as_cache())

    def token_ids(self, layer_idx):
        """[kv_heads] long tensors: each head's tokens (heads hold different numbers with "layer")."""
        return [head.token_ids[0, 0].long() for head in self.layers[layer_idx].heads]

    def scores(self, layer_idx):
        raise NotImplementedError("HeadBudgetCache: read layers[i].heads[h] (heads differ in slots)")

