"""Equal KV memory: the comparisons' memory points (`--memory 0.1,0.2,0.5`), fractions of the bytes
a full cache at the model's width holds for the same tokens, turned into the slots each arm affords.

A slot's bytes are measured, not assumed (`bytes_per_token`): a few tokens go through a cache of
that width that evicts nothing, and its `kv_bytes()` is divided by them. On the embedded model
(30 layers, 3 KV heads, head_dim 64, bf16) that is 23,040 bytes a token at the model's width
(2 x 64 x 2 bytes per layer and head) and 12,240 with int8 slots (2 x 64 codes + four float16
scales and zero points = 136 bytes): the same memory holds 256 / 136 = 1.88 times the slots.
kvpress keeps transformers' DynamicCache at the model's width; OpenVINO's own cache is counted by
what its worker reports (peers/openvino.py).
"""

import math
from fractions import Fraction

import torch

from .common import kv_bytes, make_cache

PROBE_TOKENS = 2  # tokens fed to measure a width: any count below the probe cache's budget


@torch.no_grad()
def bytes_per_token(model, width=""):
    """The bytes one token costs over all layers and KV heads in a cache of `width`: "" (the model's
    own dtype, H2OCache), "int8" (CacheConfig.kv_quant) or "dynamic" (transformers' DynamicCache,
    what kvpress compresses). Measured on PROBE_TOKENS tokens that nothing evicts."""
    method = "dynamic" if width == "dynamic" else "full" + (f":{width}" if width else "")
    cache = make_cache(model, method, budget=8 * PROBE_TOKENS)
    model(torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=model.device), cache=cache)
    total = kv_bytes(cache)
    if total % PROBE_TOKENS:
        raise RuntimeError(f"a {method} cache holds {total} bytes for {PROBE_TOKENS} tokens: not a whole number each")
    return total // PROBE_TOKENS


def width_of(method):
    """The width a method's slots are stored at: 'h2o-sum:int8' -> 'int8', 'h2o-sum' -> '' (the model's)."""
    return method.partition(":")[2]


def memory_fraction(text):
    """'0.1' -> Fraction(1, 10): exact, so that 10% of 3,584 tokens is not a float a hair under 358.4."""
    value = Fraction(text)
    if not 0 < value <= 1:
        raise ValueError(f"a memory point is a fraction of the full cache's bytes in (0, 1], got {text}")
    return value


def memory_points(text):
    """'0.1,0.2,0.5' -> [Fraction(1, 10), Fraction(1, 5), Fraction(1, 2)] (the command-line type of --memory)."""
    return [memory_fraction(x.strip()) for x in text.split(",")]


def slots_at(memory, n_tokens, full_per_token, per_token, multiple=1):
    """The most slots (per layer and KV head), a multiple of `multiple` (OpenVINO's block), whose bytes
    fit in `memory` (a Fraction) of what a full cache holds for n_tokens tokens at full_per_token
    bytes each, at per_token bytes a slot: floor(memory * n * full / per / multiple) * multiple,
    in exact arithmetic."""
    return math.floor(memory * n_tokens * full_per_token / per_token / multiple) * multiple


def percent(memory):
    """Fraction(1, 10) -> '10%' (a label)."""
    return f"{float(memory) * 100:g}%"
