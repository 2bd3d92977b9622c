"""Which cache slots to keep: pure tensor functions over a layer's slots.

Every policy is the same rule with different knobs. A layer keeps, per batch row and KV head,
`budget` slots:
  - protected slots, always kept: the first `n_sink` tokens (attention sinks), pinned tokens,
    and the `n_recent` newest tokens (the recent window);
  - the rest of the budget goes to the unprotected slots of highest *priority*: the
    heavy-hitter score for `h2o`, recency for `window` and `sink` (so those two simply keep
    the newest tokens that fit).
`full` never evicts. Ties in priority keep the newer token, so the choice is deterministic.
"""

import torch


def never_evicted(token, n_sink, pins=()):
    """The one rule for which tokens are protected for good: the first `n_sink` (attention sinks)
    and pinned ones. token: an int, or a tensor of token ids (-> a bool tensor of its shape).
    pins: list of absolute [start, end) token ranges."""
    if isinstance(token, int):
        return token < n_sink or any(start <= token < end for start, end in pins)
    fixed = token < n_sink
    for start, end in pins:
        fixed |= (token >= start) & (token < end)
    return fixed


def protection_key(slot_token_ids, n_sink, pins=()):
    """[batch, kv_heads, slots], the slot token ids' dtype: what a slot's protection is decided by.
    A slot is protected while `key >= n_seen - n_recent`: the key is the token id (so it leaves
    the recent window as the conversation moves on) or, for tokens `never_evicted`, the dtype's
    largest value (protected for good). Kept beside each slot, it makes the per-step test one
    comparison with one number."""
    return torch.where(never_evicted(slot_token_ids, n_sink, pins), torch.iinfo(slot_token_ids.dtype).max, slot_token_ids)


def heavy_score(scores, queries, score):
    """[batch, kv_heads, slots]: what a slot's attention mass counts for: the mass itself (`sum`,
    `decay`) or, with `mean`, the mass per query that could see the token."""
    return scores / queries.clamp(min=1) if score == "mean" else scores


def priority(policy, score, token_ids, scores, queries):
    """What eviction ranks the unprotected slots by: the heavy-hitter score for `h2o`, recency
    (the token id) for `window` and `sink`, so those keep the newest tokens that fit."""
    return heavy_score(scores, queries, score) if policy == "h2o" else token_ids


def select_keep(slot_token_ids, priority, protected, budget):
    """Slots to keep, [batch, kv_heads, budget], ordered by token index.

    Protected slots first, then unprotected slots by priority (higher kept), ties keeping the
    newer token. Callers guarantee protected.sum(-1) <= budget.
    """
    by_newest = slot_token_ids.argsort(dim=-1, descending=True)
    key = torch.where(protected, torch.inf, priority.double()).gather(-1, by_newest)
    # A stable sort on the key of slots already ordered newest-first breaks ties towards newer.
    order = by_newest.gather(-1, key.argsort(dim=-1, descending=True, stable=True))[..., :budget]
    return order.gather(-1, slot_token_ids.gather(-1, order).argsort(dim=-1))

