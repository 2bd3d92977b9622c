"""Every token a chat session has fed to the model, and what the cache keeps of it now.

Per token: its vocabulary id, text piece, role and turn (index into the history; -1 for the
system prompt), and its absolute index (its position in the list, which is also the token id
the cache stores). Retention is read from the cache on demand, so the ledger itself stays small:
a few Python objects per token (a 20,000-token ledger is a few MB).
"""

from dataclasses import dataclass, field

import torch


@dataclass
class Ledger:
    vocab_ids: list = field(default_factory=list)
    pieces: list = field(default_factory=list)
    roles: list = field(default_factory=list)
    turns: list = field(default_factory=list)

    def __len__(self):
        return len(self.vocab_ids)

    def append(self, vocab_ids, pieces, role, turn):
        # vocab_ids last: len() counts only tokens whose every field is written, so a panel
        # reading from another thread mid-append never indexes a half-recorded token
        self.pieces += pieces
        self.roles += [role] * len(vocab_ids)
        self.turns += [turn] * len(vocab_ids)
        self.vocab_ids += vocab_ids

    def truncate(self, n):
        for name in ("vocab_ids", "pieces", "roles", "turns"):
            del getattr(self, name)[n:]

    def retention(self, cache):
        """What the cache keeps of each token now (batch row 0):
        kept   [layers, kv_heads, tokens] bool: which (layer, head) pairs hold it
        score  [layers, kv_heads, tokens] float: its score where held, 0 elsewhere
        fraction [tokens]: share of (layer, head) pairs that hold it
        status [tokens]: sink / pinned / recent / heavy (h2o, once it evicts) or kept / evicted
        """
        n = len(self)
        # the panel may read while a reply is being fed from another thread: each layer is read
        # in one go (read_slots), and the cache can be ahead of the ledger, so tokens the ledger
        # has not recorded yet land in a spare column that is dropped
        slots = {i: cache.read_slots(i) for i in range(len(cache.layers))}
        slots = {i: read for i, read in slots.items() if read is not None}  # a layer not fed yet holds nothing
        n_heads = next((ids.shape[1] for ids, _ in slots.values()), 1)
        kept = torch.zeros(len(cache.layers), n_heads, n + 1, dtype=torch.bool)
        score = torch.zeros(len(cache.layers), n_heads, n + 1)
        for i, (ids, scores) in slots.items():
            ids = ids[0].cpu().clamp(max=n)
            kept[i].scatter_(1, ids, True)
            score[i].scatter_(1, ids, scores[0].float().cpu())
        kept, score = kept[..., :n], score[..., :n]
        fraction = kept.float().mean(dim=(0, 1))
        lim = cache.limits
        n_sink = lim.n_sink if lim else 0
        n_recent = lim.n_recent if lim and lim.budget is not None else 0
        # "heavy" means kept for its score while others were evicted: before the first eviction,
        # or under a policy that does not score, a token outside the recent window is just "kept"
        evicting = bool(slots) and cache.get_seq_length() > cache.slots_used(min(slots))
        heavy = "heavy" if cache.config.policy == "h2o" and evicting else "kept"
        pinned = set().union(*(range(s, e) for s, e in cache.pins))
        status = []
        for t in range(n):
            if fraction[t] == 0:
                status.append("evicted")
            elif t < n_sink:
                status.append("sink")
            elif t in pinned:
                status.append("pinned")
            elif t >= n - n_recent:
                status.append("recent")
            else:
                status.append(heavy)
        return {"kept": kept, "score": score, "fraction": fraction, "status": status}
