"""What the model and the machine allow of a conversation's settings, beyond the bounds each
setting declares (cache.config.setting: what any model allows).

    Limits.of(model)           measured now: the memory free on the model's device
      .check(settings)         ValueError with a sentence, before anything is allocated (Apply, the API)
      .nearest(settings)       -> (settings, [changes])  for a saved conversation that must still open

Two settings can ask for more than a machine has:

- `budget`: the KV of `budget + 1` slots (the decode step's spare) in every layer and KV head, for
  the live cache and the snapshots a session keeps (timeline.MAX_SNAPSHOTS), must fit in half of
  the memory free now; the other half is left to the model's activations, the other
  conversations and the system. A budget of 10**9 once asked for 768 GB in one allocation and
  broke the conversation for good.
- `max_new_tokens`: every token of a reply stays in the app (its ledger entry, its text, the
  panel's drawing of it: about APP_BYTES_PER_TOKEN) and, under policy "full", in the KV; a reply
  whose tokens would not fit in the same half cannot run to its end.

A fraction budget is a share of the first prompt, which the message size limit already bounds.
"""

import os
from dataclasses import dataclass, replace

import torch

from .timeline import MAX_SNAPSHOTS

KV_COPIES = 1 + MAX_SNAPSHOTS  # the live cache and its snapshots
USABLE_SHARE = 0.5  # of the memory free now, what one conversation's settings may plan on
# what the app keeps of each token (measured: the ledger 125 B, the panel's retention of it in every
# layer and KV head 450 B and its token map's HTML ~300 B while it is drawn); rounded up
APP_BYTES_PER_TOKEN = 1024


def free_bytes(device):
    """Memory free now on `device` (CUDA: the device's; else the system's available memory), or
    None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:  # MemAvailable counts the page cache the system would give back
            found = dict(line.split(":", 1) for line in f)
        return int(found["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def kv_bytes_per_slot(model):
    """Bytes of one slot's keys and values in every layer and KV head of `model`."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def gib(n):
    return f"{n / 2**30:,.1f} GiB"


@dataclass(frozen=True)
class Limits:
    per_slot: int  # KV bytes of a slot in every layer and KV head
    usable: int | None  # bytes a conversation's settings may plan on (None: unknown, nothing is bounded)

    @classmethod
    def of(cls, model):
        free = free_bytes(model.device)
        return cls(kv_bytes_per_slot(model), None if free is None else int(free * USABLE_SHARE))

    @property
    def max_budget(self):
        return None if self.usable is None else max(1, self.usable // (KV_COPIES * self.per_slot) - 1)

    def max_new_tokens(self, cache):
        if self.usable is None:
            return None
        per_token = APP_BYTES_PER_TOKEN + (self.per_slot if cache.policy == "full" else 0)
        return max(1, self.usable // per_token)

    def problems(self, settings):
        """[(setting, nearest allowed value, why)] for what `settings` asks beyond this machine."""
        found, cache = [], settings.cache
        budget = cache.budget
        if self.max_budget is not None and isinstance(budget, int) and cache.policy != "full" \
                and budget > self.max_budget:
            need = (budget + 1) * KV_COPIES * self.per_slot
            found.append(("budget", self.max_budget,
                          f"a budget of {budget:,} slots needs {gib(need)} for its keys and values (the cache and "
                          f"its {MAX_SNAPSHOTS} snapshots), and this machine has {gib(self.usable)} to spare: "
                          f"the budget can be at most {self.max_budget:,}"))
        most = self.max_new_tokens(cache)
        wanted = settings.sampling.max_new_tokens
        if most is not None and wanted > most:
            found.append(("max_new_tokens", most,
                          f"a reply of {wanted:,} tokens would not fit in the {gib(self.usable)} this machine has to "
                          f"spare (the app keeps about {APP_BYTES_PER_TOKEN:,} bytes of every token"
                          + (" and, under policy full, its keys and values" if cache.policy == "full" else "")
                          + f"): max new tokens can be at most {most:,}"))
        return found

    def check(self, settings):
        """Refuse, with a sentence, settings this machine cannot run; nothing is allocated before."""
        found = self.problems(settings)
        if found:
            raise ValueError("; ".join(why for _, _, why in found))

    def nearest(self, settings):
        """(settings this machine can run, [changes]): what it cannot run becomes its largest allowed."""
        cache, sampling, changes = settings.cache, settings.sampling, []
        for name, value, _ in self.problems(settings):
            if name == "budget":
                changes.append(f"budget {cache.budget:,} -> {value:,}")
                recent = cache.n_recent
                fits = isinstance(recent, int) and cache.n_sink_effective + recent <= value
                cache = replace(cache, budget=value, n_recent=recent if fits else None)
            else:
                changes.append(f"max_new_tokens {sampling.max_new_tokens:,} -> {value:,}")
                sampling = replace(sampling, max_new_tokens=value)
        return replace(settings, cache=cache, sampling=sampling), changes
