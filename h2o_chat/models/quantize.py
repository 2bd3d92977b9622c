"""A model's linear layers as packed ones (packed.py): quantizing a float model at load, fusing each
layer's q/k/v and gate/up into one matmul for the lean decode step, and saying in words which
weights a model runs.

    quantize_linears(model, "int4")   every decoder-layer linear and the lm_head, in place
    fuse_projections(model)           layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    weights_label(model)              "int4 (GGUF Q4_1 blocks)", "bf16", ...
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .packed import COMPUTE_DTYPE, Int4Linear, Int8Linear, block_scales

PACKED = (Int4Linear, Int8Linear)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def quantize_linears(model, kind):
    """Replace the linears of `model`'s decoder layers with Int4Linear ("int4", group 32) or
    Int8Linear ("int8", per row) quantized from their float weights, one at a time (each float
    weight is freed as its packed one is made).

    The lm_head stays float, as transformers leaves it under bitsandbytes: it is the layer whose
    rounding costs most (the embedded model's, per-row int8: +0.25% perplexity on its own; int4
    group 32: +4%), the int8 kernel reads it no faster than bf16 matmul does (49152 x 576: 7.1 and
    6.8 ms, one thread), and tied to the embedding it costs no memory of its own."""
    make = Int4Linear.from_float if kind == "int4" else Int8Linear.from_float
    lm_head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module is not lm_head:
            model.set_submodule(name, make(module.weight.detach(), None if module.bias is None else module.bias.detach()))
    return model


@dataclass(frozen=True)
class Fused:
    """One matmul standing for several of a layer's projections: `module` computes them all;
    `spans` are each projection's output columns [start, stop) in its result."""

    module: nn.Module
    spans: tuple


def fuse(parts):
    """Int4Linear (CPU) or Int8Linear parts reading the same input -> one Fused module, whose
    weight the parts then share (each part becomes a view of its rows: no second copy), or None
    when they cannot be fused (different kinds or widths)."""
    first = parts[0]
    if not all(type(p) is type(first) and p.in_features == first.in_features for p in parts):
        return None
    if isinstance(first, Int4Linear):
        if first.packed.device.type != "cpu" or any(p.repeats != first.repeats for p in parts):
            return None
        packed = torch.cat([p.packed for p in parts])
        scales = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        heights = [p.packed.shape[0] for p in parts]  # padded to 64 rows each
        fused = Int4Linear(packed, scales, first.in_features, packed.shape[0], _cat_bias(parts, heights), first.repeats,
                           scales_by_block=block_scales(scales))
    else:
        heights = [p.out_features for p in parts]
        fused = Int8Linear(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           _cat_bias(parts, heights), first.in_features)
    spans, start = [], 0
    for part, height in zip(parts, heights):
        view = fused.rows(start, start + height)
        for name, tensor in view._buffers.items():  # None ones too: a part keeps no copy of its own
            setattr(part, name, tensor)  # the part now reads the fused weight's rows
        spans.append((start, start + part.out_features))
        start += height
    return Fused(fused, tuple(spans))


def _cat_bias(parts, heights):
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([torch.zeros(h, dtype=COMPUTE_DTYPE, device=p.scales_and_zeros.device if isinstance(p, Int4Linear) else p.scales.device)
                      if p.bias is None else torch.nn.functional.pad(p.bias.to(COMPUTE_DTYPE), (0, h - p.out_features))
                      for p, h in zip(parts, heights)])


def fuse_projections(model):
    """For each decoder layer whose q/k/v (and gate/up) are packed alike, one Fused matmul, kept
    as `self_attn.qkv_proj` and `mlp.gate_up_proj`. Plain attributes, not submodules: their
    storage is the parts' storage, and the model's own forward still calls the parts."""
    for layer in model.base_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, names, attr in ((attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"), (mlp, ("gate_proj", "up_proj"), "gate_up_proj")):
            parts = [getattr(owner, n) for n in names]
            if all(isinstance(p, PACKED) for p in parts):
                object.__setattr__(owner, attr, fuse(parts))
    return model


def weights_label(model) -> str | None:
    """Which weights `model` runs (None: no model), in a few words, for the panel's stats line and
    /v1/models: what the GGUF loader wrote into `model.h2o_weights` ("int4: GGUF Q4_1 as stored
    (210), ..."), else what its linear layers are: "bf16", "int8, lm_head bf16", "bitsandbytes
    Linear4bit, lm_head bf16"."""
    if model is None:
        return None
    written = getattr(model, "h2o_weights", None)
    if written:
        return written
    dtype = _SHORT.get(getattr(model, "dtype", None), str(getattr(model, "dtype", "")))

    def kind(module):
        if isinstance(module, Int4Linear):
            return "int4"
        if isinstance(module, Int8Linear):
            return "int8"
        return dtype if type(module) is nn.Linear else f"bitsandbytes {type(module).__name__}"

    lm_head = model.get_output_embeddings()
    kinds = Counter(kind(m) for m in model.modules() if isinstance(m, (nn.Linear, *PACKED)) and m is not lm_head)
    main = kinds.most_common(1)[0][0] if kinds else dtype
    head = kind(lm_head) if lm_head is not None else main
    return main if head == main else f"{main}, lm_head {head}"
