"""Attention that also reports how much attention each cached token received.

H2O needs the attention probabilities, which fused kernels (sdpa, flash) never materialise. We
register an attention function named "h2o" with transformers' `AttentionInterface`. When the
forward runs with an `H2OCache`, the cache's `update` puts itself into the attention kwargs and
this function hands the whole layer to `cache.attend`, which calls `grouped_attention` chunk by
chunk. With any other cache (a model switched to "h2o" and then used with `DynamicCache`) it is
plain sdpa, so switching a model's attention never changes what it computes.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "h2o"


def grouped_attention(query, keys, values, scaling):
    """Causal attention of the newest `n` tokens over all `slots` keys, with probabilities.

    query:  [batch, q_heads, n, head_dim], the last n of the keys are the same n tokens
    keys, values: [batch, kv_heads, slots, head_dim], slots >= n; every slot before the last n
            is visible to every query, in any order (attention does not care about slot order)
    returns output [batch, n, q_heads, head_dim] and
            probs  [batch, kv_heads, group, n, slots] float32 (float64 for a float64 model) (group = q_heads // kv_heads)

    GQA without repeat_kv: the query heads of one KV group are stacked as extra query rows,
    so the probabilities come out already grouped per KV head.
    """
    b, q_heads, n, d = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = query.reshape(b, kv_heads, group * n, d)
    # softmax in at least float32, like transformers' eager attention
    logits = torch.matmul(q, keys.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scaling
    if n > 1:
        # bottom-right causal: query i sees every slot up to its own, at slots - n + i
        first_hidden = torch.arange(slots - n + 1, slots + 1, device=query.device)  # per query row
        hidden = torch.arange(slots, device=query.device)[None, :] >= first_hidden[:, None]  # [n, slots]
        logits = logits.view(b, kv_heads, group, n, slots).masked_fill(hidden, float("-inf"))
        logits = logits.view(b, kv_heads, group * n, slots)
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values)  # [b, kvh, group*n, d]
    out = out.view(b, q_heads, n, d).transpose(1, 2)
    return out, probs.view(b, kv_heads, group, n, slots)


def h2o_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = kwargs.pop("h2o_cache", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.attend(module.layer_idx, query, scaling), None


def register():
    """Idempotent: make "h2o" a valid attn_implementation (with sdpa's mask for the fallback)."""
    AttentionInterface.register(ATTN_NAME, h2o_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
