"""A layer's slots in memory, and the decode step over them: the hot path, once per token per layer.

Packed buffers per layer, so the fields that move together move in one copy:
    kv    [2, batch, kv_heads, capacity, head_dim]  keys then values, in the model's dtype (or int8)
    meta  [N_META, batch, kv_heads, capacity]       integers (int32; int64 for a float64 model):
          token id, RoPE position, protection key (see policy.protection_key)
    acc   [N_ACC, batch, kv_heads, capacity]        the score dtype (float32; float64): the
          attention mass each slot received and the queries that could see it
    qp    [4, batch, kv_heads, capacity]            int8 slots only (CacheConfig.kv_quant): their
          scales and zero points, float16 (kv_int8.py); None for slots at the model's width
"""

import functools
from dataclasses import dataclass

import torch

from . import kv_int8
from .policy import heavy_score

IDS, POS, KEY = range(3)  # rows of a layer's meta buffer
N_META = 3
SCORE, QUERIES = range(2)  # rows of its acc buffer
N_ACC = 2
INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}  # the meta dtype for each score dtype: same width


def score_dtype(model_dtype):
    """Scores add up in at least float32, like transformers' softmax."""
    return torch.promote_types(model_dtype, torch.float32)


@dataclass(frozen=True)
class StepRows:
    """What differs between the rows of one decode step, made on the host before it (`make`) and
    read by every layer: one row for a conversation alone, several for conversations stacked by
    chat/batch.py. b rows, h KV heads, g query heads per KV head, cap = budget + 1 slots.

    ints [N_META, b, h]: the new token's id, RoPE position and protection key per row (the key is
    the largest value for a token never evicted: a sink of a short chat, or pinned); threshold
    [b, 1, 1]: a slot is protected while its key is >= it; weights [b*h, 1, g]: 1, or 0 for a row
    that sits this step out; beta [b*h, 1, 1]: the decay, 1 for those rows; query_add [b, 1, 1]:
    the queries a "mean" score counts; empty [b, 1, cap] bool or None: free slots of a
    conversation still below its budget (never attended, filled first); idle [b, 1, 1] bool or
    None: rows whose spare moves onto itself, so nothing of theirs changes.

    Everything that changes from token to token is a tensor here, so a compiled step sees the
    same graph at every token (the host decides the rest: position re-rolls, pins)."""

    ints: torch.Tensor
    threshold: torch.Tensor
    weights: torch.Tensor
    beta: torch.Tensor
    query_add: torch.Tensor
    empty: torch.Tensor | None = None
    idle: torch.Tensor | None = None

    @classmethod
    def make(cls, n_seen, kept, active, kv_heads, group, n_recent, decay, meta_dtype, acc_dtype, device):
        """n_seen [b] ints: the tokens each row has seen (the new token's id); kept [b] bools: its
        new token is never evicted; active [b] bools (False: the row sits this step out). One
        tensor for the integers, and the weights made once for rows that all step: a handful of
        ops a token (a torch.tensor from a list is six)."""
        b, h, id_max = len(n_seen), kv_heads, torch.iinfo(meta_dtype).max
        keys = [id_max if k else s for s, k in zip(n_seen, kept)]
        thresholds = [s + 1 - n_recent for s in n_seen]
        ints = torch.tensor([n_seen, n_seen, keys, thresholds], dtype=meta_dtype, device=device)
        if all(active):
            weights, beta, query_add = every_row_steps(b, h, group, decay, acc_dtype, device)
        else:
            on = torch.tensor(active, dtype=acc_dtype, device=device)
            weights, beta, query_add = row_weights(on, h, group, decay)
        return cls(ints=ints[:N_META].view(N_META, b, 1).expand(N_META, b, h), threshold=ints[N_META].view(b, 1, 1),
                   weights=weights, beta=beta, query_add=query_add,
                   idle=None if all(active) else (query_add == 0))


def row_weights(on, h, group, decay):
    """on [b]: 1 for a row that steps, 0 for one that sits out -> (weights [b*h, 1, g], beta [b*h, 1, 1],
    query_add [b, 1, 1]), as StepRows holds them."""
    b = on.shape[0]
    # contiguous: a batch matrix of all-zero strides sends baddbmm_ down a slow path (an addmm per head)
    weights = on.view(b, 1, 1, 1).expand(b, h, 1, group).contiguous().view(b * h, 1, group)
    beta = (1 + on * (decay - 1)).view(b, 1, 1, 1).expand(b, h, 1, 1).reshape(b * h, 1, 1)
    return weights, beta, on.view(b, 1, 1)


@functools.cache
def every_row_steps(b, h, group, decay, acc_dtype, device):
    """`row_weights` for b rows that all step, made once per shape (never written: StepRows only reads them)."""
    return row_weights(torch.ones(b, dtype=acc_dtype, device=device), h, group, decay)


@dataclass(frozen=True)
class DecodeStep:
    """Views over a full layer's whole buffers and the step's scratch buffers, made once (`over`).
    b rows, h KV heads, g query heads per KV head, cap = budget + 1 slots, d head_dim; acc is the
    score dtype."""

    group: int
    spare_k: torch.Tensor  # [b, h, 1, d]  views of the spare slot
    spare_v: torch.Tensor
    spare_kv: torch.Tensor  # [2, b, h, 1, d]
    spare_meta: torch.Tensor  # [N_META, b, h, 1]
    spare_acc4: torch.Tensor  # [N_ACC, b, h, 1]
    spare_ints: torch.Tensor  # [3, b, h]: the spare's id, position and protection key
    spare_key: torch.Tensor  # [b, h]
    spare_acc: torch.Tensor  # [N_ACC, b, h]: its score and query count
    keys_t: torch.Tensor  # [b*h, d, cap] (float slots: int8 ones are read through `int8`)
    values: torch.Tensor  # [b*h, cap, d]
    ids: torch.Tensor  # [b, h, cap]
    key: torch.Tensor  # [b, h, cap]
    scores: torch.Tensor  # [b, h, cap] acc
    queries: torch.Tensor  # [b, h, cap] acc
    scores3: torch.Tensor  # [b*h, 1, cap] acc
    scale: torch.Tensor  # 0-d tensors, so no op makes one from a Python number
    inf: torch.Tensor
    id_max: torch.Tensor
    spare_index: torch.Tensor
    logits: torch.Tensor | None  # [b*h, g, cap] model dtype (None for int8 slots: `int8` has its own)
    logits_acc: torch.Tensor | None  # [b*h, g, cap] acc, for a model whose dtype is not acc
    probs: torch.Tensor  # [b*h, g, cap] acc
    probs_low: torch.Tensor | None  # [b*h, g, cap] model dtype
    out: torch.Tensor  # [b*h, g, d]
    protected: torch.Tensor  # [b, h, cap] bool
    rank: torch.Tensor  # [b, h, cap] acc
    lowest: torch.Tensor  # [b, h, 1] acc
    is_lowest: torch.Tensor  # [b, h, cap] bool
    tiebreak: torch.Tensor  # [b, h, cap] meta's dtype
    victim: torch.Tensor  # [b, h, 1] long
    stage_kv: torch.Tensor  # [2, b, h, 1, d]: the spare, copied out (a source may not alias its target)
    stage_meta: torch.Tensor  # [N_META, b, h, 1]
    stage_acc: torch.Tensor  # [N_ACC, b, h, 1]
    stage_kv_flat: torch.Tensor  # [2, b*h, d]: views of the two above, as index_copy_ reads them
    stage_meta_flat: torch.Tensor  # [N_META, b*h]
    stage_acc_flat: torch.Tensor  # [N_ACC, b*h]
    kv_flat: torch.Tensor  # [2, b*h*cap, d]: every (row, head)'s slots laid end to end
    meta_flat: torch.Tensor  # [N_META, b*h*cap]
    acc_flat: torch.Tensor  # [N_ACC, b*h*cap]
    slot_base: torch.Tensor  # [b*h]: where each (row, head)'s slots start in the flat views
    victim_rows: torch.Tensor  # [b*h]: a view of victim
    flat_victim: torch.Tensor  # [b*h]
    out4: torch.Tensor  # [b, 1, q_heads, d]: a view of out, what attend returns
    int8: kv_int8.Int8Step | None  # int8 slots: their views and scratch (None otherwise)
    spare_qp: torch.Tensor | None  # [N_ROWS, b, h, 1] int8 slots: the spare's scales and zero points
    stage_qp: torch.Tensor | None  # [N_ROWS, b, h, 1]
    stage_qp_flat: torch.Tensor | None  # [N_ROWS, b*h]
    qp_flat: torch.Tensor | None  # [N_ROWS, b*h*cap]

    @classmethod
    def over(cls, kv, meta, acc_buf, qp, group, dtype, scaling, wide=None):
        """kv [2, b, h, cap, d], meta [N_META, b, h, cap], acc_buf [N_ACC, b, h, cap], qp (int8 slots)
        [N_ROWS, b, h, cap] or None; queries of `group` heads per KV head in `dtype`; for int8 slots,
        wide [b*h, cap, d] in acc's dtype (a kv_int8.WideScratch's)."""
        _, b, h, cap, d = kv.shape
        spare, acc, dev, low = cap - 1, acc_buf.dtype, kv.device, dtype
        out, victim = torch.empty(b * h, group, d, dtype=low, device=dev), torch.empty(b, h, 1, dtype=torch.long, device=dev)
        stage_kv, stage_meta = kv.new_empty(2, b, h, 1, d), meta.new_empty(N_META, b, h, 1)
        stage_acc = acc_buf.new_empty(acc_buf.shape[0], b, h, 1)
        stage_qp = None if qp is None else qp.new_empty(qp.shape[0], b, h, 1)
        float_slots = kv.dtype != kv_int8.CODES  # int8 slots attend through their own buffers (kv_int8.Int8Step)
        return cls(
            group=group,
            spare_k=kv[0, :, :, spare:], spare_v=kv[1, :, :, spare:],
            spare_kv=kv[:, :, :, spare:], spare_meta=meta[..., spare:], spare_acc4=acc_buf[..., spare:],
            spare_ints=meta[:, :, :, spare], spare_key=meta[KEY, :, :, spare],
            spare_acc=acc_buf[:N_ACC, :, :, spare],
            keys_t=kv[0].view(b * h, cap, d).transpose(1, 2), values=kv[1].view(b * h, cap, d),
            int8=None if float_slots else kv_int8.Int8Step.over(kv, qp, group, dtype, wide),
            ids=meta[IDS], key=meta[KEY], scores=acc_buf[SCORE], queries=acc_buf[QUERIES],
            scores3=acc_buf[SCORE].view(b * h, 1, cap),
            scale=torch.tensor(scaling, dtype=acc, device=dev), inf=torch.tensor(torch.inf, dtype=acc, device=dev),
            id_max=torch.tensor(torch.iinfo(meta.dtype).max, dtype=meta.dtype, device=dev),
            spare_index=torch.tensor(spare, device=dev),
            logits=torch.empty(b * h, group, cap, dtype=low, device=dev) if float_slots else None,
            # softmax in at least float32, like transformers' eager attention: for a bf16 model
            # the logits are copied up and the probabilities down, into buffers made here
            logits_acc=torch.empty(b * h, group, cap, dtype=acc, device=dev) if acc != low and float_slots else None,
            probs=torch.empty(b * h, group, cap, dtype=acc, device=dev),
            probs_low=torch.empty(b * h, group, cap, dtype=low, device=dev) if acc != low and float_slots else None,
            out=out, out4=out.view(b, 1, group * h, d),
            protected=torch.empty(b, h, cap, dtype=torch.bool, device=dev),
            rank=torch.empty(b, h, cap, dtype=acc, device=dev), lowest=torch.empty(b, h, 1, dtype=acc, device=dev),
            is_lowest=torch.empty(b, h, cap, dtype=torch.bool, device=dev),
            tiebreak=torch.empty(b, h, cap, dtype=meta.dtype, device=dev),
            victim=victim, victim_rows=victim.view(b * h),
            stage_kv=stage_kv, stage_meta=stage_meta, stage_acc=stage_acc,
            stage_kv_flat=stage_kv.view(2, b * h, d), stage_meta_flat=stage_meta.view(N_META, b * h),
            stage_acc_flat=stage_acc.view(-1, b * h),
            spare_qp=None if qp is None else qp[..., spare:], stage_qp=stage_qp,
            stage_qp_flat=None if qp is None else stage_qp.view(-1, b * h),
            qp_flat=None if qp is None else qp.view(-1, b * h * cap),
            # the victims as indices into the slots of every (row, head) laid end to end: one
            # index_copy_ moves the spare (a bf16 scatter_ along the slot dim is ~10x slower on CPU)
            kv_flat=kv.view(2, b * h * cap, d), meta_flat=meta.view(N_META, b * h * cap),
            acc_flat=acc_buf.view(-1, b * h * cap),
            slot_base=torch.arange(0, b * h * cap, cap, device=dev),
            flat_victim=torch.empty(b * h, dtype=torch.long, device=dev),
        )

    def write_spare(self, keys, values, rows: StepRows):
        """The new tokens [b, h, 1, d] into the spare slot: id, RoPE position and protection key
        from `rows`, score and query count zero; int8 slots quantized."""
        if self.int8 is None:
            self.spare_k.copy_(keys)
            self.spare_v.copy_(values)
        else:
            self.int8.write(keys, values)
        self.spare_ints.copy_(rows.ints)
        self.spare_acc.fill_(0)


def attend_and_replace(s: DecodeStep, query, config, rows: StepRows):
    """The decode step once the new token sits in the spare slot (`write_spare`): attend over every
    slot, add the mass to the scores, pick one victim per row and head and move the spare into it.
    query [b, q_heads, 1, d] -> [b, 1, q_heads, d]."""
    b, q_heads, _, d = query.shape
    bh = s.scores3.shape[0]
    q = query.reshape(bh, s.group, d)  # a view unless rows > 1 come strided
    if s.int8 is None:
        logits = torch.bmm(q, s.keys_t, out=s.logits)
        if s.logits_acc is not None:
            logits = s.logits_acc.copy_(logits)
        logits.mul_(s.scale)
    else:
        logits = s.int8.attention_logits(q, s.scale)
    if rows.empty is not None:
        logits.view(b, -1, s.group, logits.shape[-1]).masked_fill_(rows.empty[:, :, None], -torch.inf)
    probs = torch.softmax(logits, -1, out=s.probs)
    if s.int8 is None:
        torch.bmm(probs if s.probs_low is None else s.probs_low.copy_(probs), s.values, out=s.out)
    else:
        s.out.copy_(s.int8.attention_output(probs))
    # the group's mass into the scores, one batched matmul: [b*kvh, 1, group] @ probs
    if config.score == "decay":
        s.scores3.mul_(rows.beta)
    s.scores3.baddbmm_(rows.weights, probs)
    if config.score == "mean":
        s.queries.add_(rows.query_add)
    # the victim: the unprotected slot of lowest priority, the older token on ties
    torch.ge(s.key, rows.threshold, out=s.protected)
    if config.policy == "h2o":
        priority = heavy_score(s.scores, s.queries, config.score)
        torch.where(s.protected, s.inf, priority, out=s.rank)
        torch.amin(s.rank, -1, keepdim=True, out=s.lowest)
        torch.eq(s.rank, s.lowest, out=s.is_lowest)
        torch.where(s.is_lowest, s.ids, s.id_max, out=s.tiebreak)
    else:  # window, sink: the oldest unprotected token
        torch.where(s.protected, s.id_max, s.ids, out=s.tiebreak)
    if rows.empty is not None:
        s.tiebreak.masked_fill_(rows.empty, -1)  # a free slot is taken before any token is evicted
    torch.argmin(s.tiebreak, -1, keepdim=True, out=s.victim)
    if rows.idle is not None:
        torch.where(rows.idle, s.spare_index, s.victim, out=s.victim)
    # cache replace: the spare slot (copied out first: a source may not alias its target)
    s.stage_kv.copy_(s.spare_kv)
    s.stage_meta.copy_(s.spare_meta)
    s.stage_acc.copy_(s.spare_acc4)
    torch.add(s.slot_base, s.victim_rows, out=s.flat_victim)
    s.kv_flat.index_copy_(1, s.flat_victim, s.stage_kv_flat)
    s.meta_flat.index_copy_(1, s.flat_victim, s.stage_meta_flat)
    s.acc_flat.index_copy_(1, s.flat_victim, s.stage_acc_flat)
    if s.qp_flat is not None:
        s.stage_qp.copy_(s.spare_qp)
        s.qp_flat.index_copy_(1, s.flat_victim, s.stage_qp_flat)
    return s.out4
