"""Attention that also reports how much attention each cached token received.

H2O needs the attention probabilities, which fused kernels (sdpa, flash) never materialise. We
register an attention function named "h2o" with transformers' `AttentionInterface`. When the
forward runs with an `H2OCache`, the cache's `update` puts itself into the attention kwargs and
returns the new keys and values unchanged; this function hands them and the queries to
`cache.attend`, which writes, attends (`grouped_attention`, chunk by chunk) and evicts. With
any other cache (a model switched to "h2o" and then used with `DynamicCache`) it is plain sdpa,
so switching a model's attention never changes what it computes.
"""

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "h2o"


@functools.lru_cache(maxsize=16)
def causal_bias(group, n, slots, dtype, device):
    """[group * n, slots]: 0 where query row (g, i) may look, -inf where it may not. Query i of
    the newest n tokens sees every slot up to its own, at slots - n + i (bottom-right causal).
    Made once per chunk shape and reused (a prefill repeats the same few shapes every layer)."""
    first_hidden = torch.arange(slots - n + 1, slots + 1, device=device)  # per query row
    hidden = torch.arange(slots, device=device)[None, :] >= first_hidden[:, None]  # [n, slots]
    bias = torch.zeros(n, slots, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return bias.repeat(group, 1)


def grouped_attention(query, keys, values, scaling):
    """Causal attention of the newest `n` tokens over all `slots` keys, with probabilities.

    query:  [batch, q_heads, n, head_dim], the last n of the keys are the same n tokens
    keys, values: [batch, kv_heads, slots, head_dim], slots >= n; every slot before the last n
            is visible to every query, in any order (attention does not care about slot order)
    returns output [batch, n, q_heads, head_dim] and
            probs  [batch, kv_heads, group, n, slots] float32 (float64 for a float64 model) (group = q_heads // kv_heads)

    GQA without repeat_kv: the query heads of one KV group are stacked as extra query rows,
    so the probabilities come out already grouped per KV head. One [b * kvh, group * n, slots]
    buffer in the softmax dtype is made and everything happens in it: the scale and the causal
    mask go in with the logits (one baddbmm, or for a low-precision model one add that widens
    its logits), the softmax runs in place. tests/reference.py keeps the explicit version
    (scale, masked_fill and softmax as separate passes) as the oracle.
    """
    b, q_heads, n, d = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    acc = torch.promote_types(query.dtype, torch.float32)  # softmax in at least float32, like eager attention
    q = query.reshape(b * kv_heads, group * n, d)
    keys_t = keys.reshape(b * kv_heads, slots, d).transpose(1, 2)
    if n == 1:  # one query sees every slot: no mask (and no bias per slot count, which grows every step)
        logits = torch.bmm(q, keys_t)
        logits = (logits if acc == query.dtype else logits.to(acc)).mul_(scaling)
    elif acc == query.dtype:
        logits = torch.baddbmm(causal_bias(group, n, slots, acc, query.device), q, keys_t, alpha=scaling)
    else:  # bf16/fp16 logits, scaled and masked while widened: the same rounding as .float() * scaling
        logits = torch.add(causal_bias(group, n, slots, acc, query.device), torch.bmm(q, keys_t), alpha=scaling)
    probs = torch.softmax(logits, dim=-1, out=logits)
    out = torch.bmm(probs.to(values.dtype), values.reshape(b * kv_heads, slots, d))  # [b*kvh, group*n, d]
    out = out.view(b, q_heads, n, d).transpose(1, 2)
    return out, probs.view(b, kv_heads, group, n, slots)


def add_mass(scores, queries, probs, score, decay):
    """Add a chunk's attention mass to its slots' scores, in place.

    probs [batch, kv_heads, group, n, slots] (grouped_attention's): the newest n slots are the
    chunk's own tokens; scores, queries [batch, kv_heads, slots]. The column mass is one reduction
    over the group's query heads and the chunk's rows together (no [b, kvh, n, slots] partial sum).
    score "decay": each query row first multiplies what came before it by `decay`, so chunking
    does not change the result; "mean" also counts, per slot, the queries that could see it."""
    b, h, group, n, slots = probs.shape
    if score == "decay":
        weights = decay ** torch.arange(n - 1, -1, -1, device=probs.device, dtype=torch.float32)
        rows = weights.to(probs.dtype).repeat(group)  # [group * n]: row (g, i) weighs decay^(n-1-i)
        scores.mul_(decay**n).add_(torch.matmul(rows, probs.view(b, h, group * n, slots)))
        return
    scores.add_(probs.sum(dim=(2, 3)))
    if score == "mean":
        seen_by = torch.full((slots,), n, dtype=torch.float32, device=probs.device)
        seen_by[slots - n :] = torch.arange(n, 0, -1, dtype=torch.float32, device=probs.device)
        queries.add_(seen_by)


def h2o_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = kwargs.pop("h2o_cache", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = cache.attend(module.layer_idx, query, key, value, scaling)
    if module.layer_idx == len(cache.layers) - 1:
        cache.end()  # the forward's last layer: the cache's host work after a step
    return out, None


def register():
    """Idempotent: make "h2o" a valid attn_implementation (with sdpa's mask for the fallback)."""
    AttentionInterface.register(ATTN_NAME, h2o_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
