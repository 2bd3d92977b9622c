"""Every token a chat session has fed to the model, and what the cache keeps of it now.

Per token: its vocabulary id, text piece, role and turn (index into the history; -1 for the
system prompt), and its absolute index (its position in the list, which is also the token id
the cache stores). Retention is read from the cache on demand, so the ledger itself stays small:
a few Python objects per token (a 20,000-token ledger is a few MB).
"""

import itertools
from dataclasses import dataclass, field

import torch

ROLES = ("system", "user", "assistant", "template")  # a token's role: its message's, or the template's closing


def text_tensor(text):
    """Text as a uint8 tensor of its UTF-8 bytes (a tokenizer's piece may hold a lone surrogate:
    kept as it is)."""
    data = text.encode("utf-8", "surrogatepass")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def tensor_text(tensor, what):
    """The text `text_tensor` gave; ValueError naming `what` when the bytes are not UTF-8."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(f"{what} is not text")
    try:
        return tensor.numpy().tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8") from None


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

    def export(self, n):
        """The first n tokens as tensors for a saved state (chat/saved_kv.py): `ids`, `turns` [n]
        int64, `roles` [n] uint8 (indices into ROLES), and the text pieces joined (`pieces` uint8,
        UTF-8) with each piece's length in characters (`piece_lengths` [n] int64)."""
        pieces = self.pieces[:n]
        return {"ids": torch.tensor(self.vocab_ids[:n], dtype=torch.int64),
                "turns": torch.tensor(self.turns[:n], dtype=torch.int64),
                "roles": torch.tensor([ROLES.index(r) for r in self.roles[:n]], dtype=torch.uint8),
                "pieces": text_tensor("".join(pieces)),
                "piece_lengths": torch.tensor([len(p) for p in pieces], dtype=torch.int64)}

    @classmethod
    def from_tensors(cls, tensors, vocab_size):
        """The ledger `export` gave, checked (equal lengths, ids in the vocabulary, known roles,
        pieces that add up): ValueError otherwise."""
        ids, turns, roles, lengths = (tensors.get(k) for k in ("ids", "turns", "roles", "piece_lengths"))
        pieces = tensors.get("pieces")
        if any(t is None or t.dim() != 1 for t in (ids, turns, roles, lengths, pieces)):
            raise ValueError("its token ledger is incomplete")
        n = ids.numel()
        if not turns.numel() == roles.numel() == lengths.numel() == n:
            raise ValueError("its token ledger's columns differ in length")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size or int(roles.max()) >= len(ROLES)
                  or int(lengths.min()) < 0):
            raise ValueError("its token ledger holds values out of range")
        text = tensor_text(pieces, "its token ledger's text")
        ends = list(itertools.accumulate(lengths.tolist()))
        if (ends[-1] if ends else 0) != len(text):
            raise ValueError("its token ledger's text does not add up")
        return cls(ids.tolist(), [text[a:b] for a, b in zip([0, *ends], ends)],
                   [ROLES[r] for r in roles.tolist()], turns.tolist())

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
        evicting = any(cache.get_seq_length() > cache.slots_used(i) for i in slots)  # some layer (budgets may differ)
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
