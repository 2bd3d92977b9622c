"""K-quant blocks (Q4_K, Q5_K, Q6_K) written in numpy, for test and benchmark files.

The `gguf` package dequantizes K-quants but cannot quantize them, and most GGUF files people
download are K-quants (Q4_K_M above all), so the files random_gguf.py writes need blocks made
here. Valid, not optimal: each sub-block's scale and minimum come from its range (llama.cpp
searches for better ones), then the super-block's fp16 d (and dmin) and 6- or 8-bit scales are
rounded and the codes chosen against those rounded values, as llama.cpp does. A super-block is
256 weights (QK_K); the layouts are ggml's (ggml-common.h), read back by `gguf.quants.dequantize`
(tests/test_gguf.py checks every writer against it):

    Q4_K  144 bytes: d, dmin (fp16), 12 bytes of 6-bit scales sc and mins m (8 sub-blocks of 32),
          128 bytes of 4-bit codes q;                          w = d * sc * q - dmin * m
    Q5_K  176 bytes: as Q4_K, plus 32 bytes holding each code's fifth bit; q in 0..31
    Q6_K  210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (16 sub-blocks
          of 16), d (fp16);                                    w = d * sc * (q - 32), q in 0..63
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize(values, kind):
    """values float32 [rows, cols] -> the GGUF blocks of `kind` ("Q4_K", ..., or any type the
    gguf package quantizes itself), uint8 [rows, bytes a row]."""
    if kind in WRITERS:
        values = np.asarray(values, dtype=np.float32)
        rows, cols = values.shape
        if cols % QK_K:
            raise ValueError(f"{kind} rows are whole super-blocks of {QK_K}; got {cols} values a row")
        return WRITERS[kind](values.reshape(-1, QK_K)).reshape(rows, -1)
    import gguf

    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])


def _fp16(x):
    """x rounded to fp16 (as stored) and its bytes: (float32 [n, 1], uint8 [n, 2])."""
    half = x.astype(np.float16).reshape(-1, 1)
    return half.astype(np.float32), half.view(np.uint8)


def _inverse(x):
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0, 1 / x).astype(np.float32)


def _affine_subblocks(blocks, levels):
    """Q4_K / Q5_K's scales: blocks [n, 256] in 8 sub-blocks of 32, each mapped [min, max] ->
    0..levels (min clamped to <= 0, as llama.cpp does). Returns the stored fields (d, dmin fp16
    bytes, the 12 scale bytes) and the codes uint8 [n, 8, 32] against the rounded scales."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # [n, 8]
    scale, minimum = (sub.max(-1) - low) / levels, -low
    d, d_bytes = _fp16(scale.max(-1) / 63)
    dmin, dmin_bytes = _fp16(minimum.max(-1) / 63)
    sc = np.clip(np.rint(scale * _inverse(d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(minimum * _inverse(dmin)), 0, 63).astype(np.uint8)
    step, offset = d * sc, dmin * m  # what the reader computes: w = step * q - offset
    q = np.clip(np.rint((sub + offset[..., None]) * _inverse(step)[..., None]), 0, levels).astype(np.uint8)
    return d_bytes, dmin_bytes, _pack_scales(sc, m), q


def _pack_scales(sc, m):
    """8 six-bit scales and 8 six-bit mins -> ggml's 12 bytes (gguf's Q4_K.get_scale_min reads
    them): bytes 0-3 scales 0-3 with scales 4-7's top two bits above, 4-7 the same for the mins,
    8-11 the low four bits of scale 4-7 and min 4-7."""
    low = np.concatenate((sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6)), axis=1)
    return np.concatenate((low, (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)), axis=1).astype(np.uint8)


def _nibble_pairs(q):
    """codes [n, 8, 32] (0..15) -> 128 bytes: byte 32c + i holds sub-block 2c's element i in its
    low nibble and sub-block 2c + 1's in its high one."""
    pairs = q.reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def q4_k(blocks):
    """[n, 256] float32 -> [n, 144] Q4_K blocks."""
    d, dmin, scales, q = _affine_subblocks(blocks, 15)
    return np.concatenate((d, dmin, scales, _nibble_pairs(q)), axis=1)


def q5_k(blocks):
    """[n, 256] float32 -> [n, 176] Q5_K blocks: the fifth bits in 32 bytes, byte i's bit j being
    sub-block j's element i."""
    d, dmin, scales, q = _affine_subblocks(blocks, 31)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # [n, 32]
    return np.concatenate((d, dmin, scales, high, _nibble_pairs(q & 15)), axis=1)


def q6_k(blocks):
    """[n, 256] float32 -> [n, 210] Q6_K blocks: symmetric sub-blocks of 16, each scale its
    largest |w| / 31 as an int8 multiple of d (the largest 127), codes q - 32 in -32..31."""
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31  # [n, 16]
    d, d_bytes = _fp16(scale.max(-1) / 127)
    sc = np.clip(np.rint(scale * _inverse(d)), -128, 127).astype(np.int8)
    step = d * sc
    q = (np.clip(np.rint(sub * _inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # element 128h + r: low four bits in byte 64h + r % 64 (low nibble for r < 64, high above);
    # top two bits in byte 32h + r % 32, at bit 2 * (r // 32)
    low = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # [n, 2, 64]
    top = (q >> 4).reshape(-1, 2, 4, 32)
    high = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [n, 2, 32]
    return np.concatenate((low.reshape(-1, 128), high.reshape(-1, 64), sc.view(np.uint8), d_bytes), axis=1)


WRITERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
