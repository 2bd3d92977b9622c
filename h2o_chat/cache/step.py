"""A layer's slots in memory, and the decode step over them: the hot path, once per token per layer.

Packed buffers per layer, so the fields that move together move in one copy:
    kv    [2, batch, kv_heads, capacity, head_dim]  keys then values, in the model's dtype (or int8)
    meta  [N_META, batch, kv_heads, capacity]       integers (int32; int64 for a float64 model):
          token id, RoPE position, protection key (see policy.protection_key)
    acc   [N_ACC, batch, kv_heads, capacity]        the score dtype (float32; float64): the
          attention mass each slot received and the queries that could see it
    qp    [4, batch, kv_heads, capacity]            int8 slots only (CacheConfig.kv_quant): their
          scales and zero points, float16 (kv_int8.py); None for slots at the model's width
A cache whose layers all have one capacity holds each kind as one buffer [layers, ...] and its
layers' buffers are views of it, so the eviction runs once a token for every layer (`Eviction`).

A decode step, per layer i (`step_layer`): the new key and value into the spare slot, `attend`
(every slot, the scores: as aten ops, or for a bf16 model on a CPU one C function, native/), and
after the last layer `evict` (one victim per layer, row and head, the spare moved into it).
"""

import functools
from dataclasses import dataclass

import torch

from .. import native
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
    """A full layer's attention for one new token: views over its buffers and the scratch the
    attention writes, made once (`over`). b rows, h KV heads, g query heads per KV head, cap =
    budget + 1 slots, d head_dim; acc is the score dtype. What the token then evicts is an
    `Eviction`'s, over this layer alone or over every layer of its cache at once. With `native`
    (a bf16 model on a CPU: native/) the attention is one op over `kv` (and `qp`), and the aten
    ops' own buffers (logits, logits_acc, probs_low) are not made."""

    group: int
    kv: torch.Tensor  # [2, b, h, cap, d] the layer's slots
    qp: torch.Tensor | None  # [4, b, h, cap] their scales and zero points (int8 slots)
    native: object | None  # torch.ops.h2o_chat.attend_one, or None: the aten ops
    scaling: float
    spare_k: torch.Tensor  # [b, h, 1, d]  views of the spare slot
    spare_v: torch.Tensor
    keys_t: torch.Tensor  # [b*h, d, cap] (float slots: int8 ones are read through `int8`)
    values: torch.Tensor  # [b*h, cap, d]
    scores3: torch.Tensor  # [b*h, 1, cap] acc: a view of the layer's scores
    scale: torch.Tensor  # 0-d, so no op makes one from a Python number
    logits: torch.Tensor | None  # [b*h, g, cap] model dtype (None for int8 slots: `int8` has its own)
    logits_acc: torch.Tensor | None  # [b*h, g, cap] acc, for a model whose dtype is not acc
    probs: torch.Tensor  # [b*h, g, cap] acc
    probs_low: torch.Tensor | None  # [b*h, g, cap] model dtype
    out: torch.Tensor  # [b*h, g, d]
    out4: torch.Tensor  # [b, 1, q_heads, d]: a view of out, what attend returns
    int8: kv_int8.Int8Step | None  # int8 slots: their views and scratch (None otherwise)

    @classmethod
    def over(cls, kv, acc_buf, qp, group, dtype, scaling, wide=None):
        """kv [2, b, h, cap, d], acc_buf [N_ACC, b, h, cap], qp (int8 slots) [N_ROWS, b, h, cap] or
        None; queries of `group` heads per KV head in `dtype`; for int8 slots, wide [b*h, cap, d] in
        acc's dtype (a kv_int8.WideScratch's)."""
        _, b, h, cap, d = kv.shape
        spare, acc, dev, low = cap - 1, acc_buf.dtype, kv.device, dtype
        out = torch.empty(b * h, group, d, dtype=low, device=dev)
        op = native.attend_one() if native.serves(kv, qp, dtype, group) else None
        float_slots = kv.dtype != kv_int8.CODES  # int8 slots attend through their own buffers (kv_int8.Int8Step)
        aten = float_slots and op is None  # the aten ops' buffers
        return cls(
            group=group, kv=kv, qp=qp, native=op, scaling=float(scaling), spare_k=kv[0, :, :, spare:], spare_v=kv[1, :, :, spare:],
            keys_t=kv[0].view(b * h, cap, d).transpose(1, 2), values=kv[1].view(b * h, cap, d),
            scores3=acc_buf[SCORE].view(b * h, 1, cap), scale=torch.tensor(scaling, dtype=acc, device=dev),
            logits=torch.empty(b * h, group, cap, dtype=low, device=dev) if aten else None,
            # softmax in at least float32, like transformers' eager attention: for a bf16 model
            # the logits are copied up and the probabilities down, into buffers made here
            logits_acc=torch.empty(b * h, group, cap, dtype=acc, device=dev) if acc != low and aten else None,
            probs=torch.empty(b * h, group, cap, dtype=acc, device=dev),
            probs_low=torch.empty(b * h, group, cap, dtype=low, device=dev) if acc != low and aten else None,
            out=out, out4=out.view(b, 1, group * h, d),
            int8=None if float_slots else kv_int8.Int8Step.over(kv, qp, group, dtype, wide),
        )

    def write_spare(self, keys, values):
        """The new keys and values [b, h, 1, d] into the spare slot (int8 slots: quantized). Its id,
        position, protection key and zero score are the Eviction's to write (`Eviction.prepare`)."""
        if self.int8 is None:
            self.spare_k.copy_(keys)
            self.spare_v.copy_(values)
        else:
            self.int8.write(keys, values)


def attend(s: DecodeStep, query, rows: StepRows):
    """One layer's attention once the new token sits in its spare slot (`write_spare`) and its
    Eviction is prepared: attend over every slot, add each row's mass to the scores. query [b,
    q_heads, 1, d] -> [b, 1, q_heads, d]."""
    if s.native is not None:
        s.native(query, s.kv, s.qp, s.scores3, rows.weights, rows.empty, s.scaling, s.probs, s.out)
        return s.out4
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
    s.scores3.baddbmm_(rows.weights, probs)
    return s.out4


@dataclass(frozen=True)
class Eviction:
    """The bookkeeping of one decode step for n layers at once: views over their slot buffers,
    stacked on a leading layer dim, and the scratch, made once (`over`). n = 1 for a layer on its
    own; every layer of a cache whose layers are views of one stacked buffer (H2OCache and the
    batch's Arena stack them), so the victim of every layer is found and moved in ~20 ops a token,
    not ~20 a layer. Nothing here changes what a layer computes: a layer's victim depends only on
    its own slots, read after its attention in either case.

    Shapes: n layers, b rows, h KV heads, cap slots, d head_dim; R_kv = 2, R_meta = N_META, R_acc
    = N_ACC, R_qp = kv_int8.N_ROWS (int8 slots) rows per buffer."""

    spare_ints: torch.Tensor  # [n, N_META, b, h]: views of the spare slot: id, position, protection key
    spare_acc: torch.Tensor  # [n, N_ACC, b, h]: its score and query count
    ids: torch.Tensor  # [n, b, h, cap]
    key: torch.Tensor  # [n, b, h, cap]
    scores: torch.Tensor  # [n, b, h, cap] acc
    queries: torch.Tensor  # [n, b, h, cap] acc
    inf: torch.Tensor  # 0-d tensors, so no op makes one from a Python number
    id_max: torch.Tensor
    spare_index: torch.Tensor
    protected: torch.Tensor  # [n, b, h, cap] bool
    rank: torch.Tensor  # [n, b, h, cap] acc
    lowest: torch.Tensor  # [n, b, h, 1] acc
    is_lowest: torch.Tensor  # [n, b, h, cap] bool
    tiebreak: torch.Tensor  # [n, b, h, cap] meta's dtype
    victim: torch.Tensor  # [n, b, h, 1] long
    slot_base: torch.Tensor  # [b*h]: where each (row, head)'s slots start, once (row, head) and slot are one dim
    slot: torch.Tensor  # [n, 1, b*h] long: each victim's index in that dim
    moves: tuple  # per buffer (kv, meta, acc, and qp for int8 slots): a Move

    @classmethod
    def over(cls, kv, meta, acc, qp):
        """kv [n, 2, b, h, cap, d], meta [n, N_META, b, h, cap], acc [n, N_ACC, b, h, cap], qp [n,
        N_ROWS, b, h, cap] or None: n layers' buffers, each view able to merge its (layer, row) and
        its (row, head, slot) dims (a stacked buffer, one layer's own with a dim added, or the rows
        of an arena's)."""
        n, _, b, h, cap, _ = kv.shape
        spare, dev = cap - 1, kv.device
        victim = torch.empty(n, b, h, 1, dtype=torch.long, device=dev)
        return cls(
            spare_ints=meta[..., spare], spare_acc=acc[..., spare],
            ids=meta[:, IDS], key=meta[:, KEY], scores=acc[:, SCORE], queries=acc[:, QUERIES],
            inf=torch.tensor(torch.inf, dtype=acc.dtype, device=dev),
            id_max=torch.tensor(torch.iinfo(meta.dtype).max, dtype=meta.dtype, device=dev),
            spare_index=torch.tensor(spare, device=dev),
            protected=torch.empty(n, b, h, cap, dtype=torch.bool, device=dev),
            rank=torch.empty(n, b, h, cap, dtype=acc.dtype, device=dev),
            lowest=torch.empty(n, b, h, 1, dtype=acc.dtype, device=dev),
            is_lowest=torch.empty(n, b, h, cap, dtype=torch.bool, device=dev),
            tiebreak=torch.empty(n, b, h, cap, dtype=meta.dtype, device=dev),
            victim=victim, slot_base=torch.arange(0, b * h * cap, cap, device=dev),
            slot=torch.empty(n, 1, b * h, dtype=torch.long, device=dev),
            moves=tuple(Move.over(buf) for buf in (kv, meta, acc, qp) if buf is not None),
        )

    @property
    def layers(self):
        """n: the layers it evicts for."""
        return self.victim.shape[0]

    def prepare(self, rows: StepRows, config):
        """Before the first of its layers attends: the new token's id, position and protection key
        into every spare slot, its score and query count zero, and the old scores decayed."""
        self.spare_ints.copy_(rows.ints)
        self.spare_acc.fill_(0)
        if config.score == "decay":
            self.scores.mul_(rows.beta.view(1, *self.scores.shape[1:3], 1))


@dataclass(frozen=True)
class Move:
    """One buffer's part of `evict`: copy each spare slot out (a source may not alias its target),
    then put it in its victim's slot with one index_copy_. The buffer [n, R, b, h, cap, *d] is seen
    as its memory's run of slots (`slots`), from its first to its last: every (layer, kind) block
    of b*h*cap slots starts `stride` slots after the one before, which for the rows of a batch is
    more than b*h*cap (the arena's unused rows lie between), so one index covers both."""

    spare: torch.Tensor  # [n, R, b, h, 1, *d]: a view of the spare slot
    stage: torch.Tensor  # [n, R, b, h, 1, *d]: where it is copied
    staged: torch.Tensor  # [n*R*b*h, *d]: a view of stage, as index_copy_ reads it
    slots: torch.Tensor  # [S, *d]: a view of the buffer's memory, slot by slot
    block: torch.Tensor  # [n, R, 1] long: where each (layer, kind) block starts in `slots`
    index: torch.Tensor  # [n, R, b*h] long: each victim's slot in `slots`

    @classmethod
    def over(cls, buf):
        n, r, b, h, cap, *d = buf.shape
        merged = buf.view(n * r, b * h * cap, *d)  # checks that the dims merge
        per_slot = merged.stride(1)  # elements in a slot: prod(d)
        stride = merged.stride(0) // per_slot
        slots = merged.as_strided(((n * r - 1) * stride + b * h * cap, *d), (per_slot, *merged.stride()[2:]))
        stage = buf.new_empty(n, r, b, h, 1, *d)
        return cls(spare=buf[:, :, :, :, cap - 1 :], stage=stage, staged=stage.view(n * r * b * h, *d), slots=slots,
                   block=torch.arange(0, n * r * stride, stride, device=buf.device).view(n, r, 1),
                   index=torch.empty(n, r, b * h, dtype=torch.long, device=buf.device))


def evict(e: Eviction, config, rows: StepRows):
    """After the last of its layers attended: pick one victim per layer, row and head (the
    unprotected slot of lowest priority, the older token on ties) and move the spare into it."""
    if config.score == "mean":
        e.queries.add_(rows.query_add)
    torch.ge(e.key, rows.threshold, out=e.protected)
    if config.policy == "h2o":
        priority = heavy_score(e.scores, e.queries, config.score)
        torch.where(e.protected, e.inf, priority, out=e.rank)
        torch.amin(e.rank, -1, keepdim=True, out=e.lowest)
        torch.eq(e.rank, e.lowest, out=e.is_lowest)
        torch.where(e.is_lowest, e.ids, e.id_max, out=e.tiebreak)
    else:  # window, sink: the oldest unprotected token
        torch.where(e.protected, e.id_max, e.ids, out=e.tiebreak)
    if rows.empty is not None:
        e.tiebreak.masked_fill_(rows.empty, -1)  # a free slot is taken before any token is evicted
    torch.argmin(e.tiebreak, -1, keepdim=True, out=e.victim)
    if rows.idle is not None:
        torch.where(rows.idle, e.spare_index, e.victim, out=e.victim)
    torch.add(e.slot_base, e.victim.view(e.slot.shape), out=e.slot)
    for move in e.moves:
        move.stage.copy_(move.spare)
        torch.add(move.block, e.slot, out=move.index)
        move.slots.index_copy_(0, move.index.view(-1), move.staged)


def step_layer(i, steps, evictions, keys, values, query, config, rows: StepRows):
    """Layer i of a decode step: its new keys and values [b, h, 1, d] into its spare slot, its
    attention (query [b, q_heads, 1, d] -> [b, 1, q_heads, d]), and the bookkeeping of its
    Eviction: `evictions` is [one over every layer] (prepared before layer 0, evicting after the
    last) or one per layer (each prepared and evicting around its own layer). keys and values None:
    they are in the spare slot already (models/decode.py wrote them, rotating: native/rotate_one.c)."""
    e, alone = (evictions[i], True) if len(evictions) > 1 else (evictions[0], False)
    if alone or i == 0:
        e.prepare(rows, config)
    if keys is not None:
        steps[i].write_spare(keys, values)
    out = attend(steps[i], query, rows)
    if alone or i == len(steps) - 1:
        evict(e, config, rows)
    return out
