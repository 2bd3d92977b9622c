/* A 4-bit weight as bf16 W.T, for a prefill's matmul: what packed.py's Int4Linear.weight_t computes
 * with torch's ops (an xor, two shifted copies, a product and a sum over the whole matrix: five
 * passes over 2 bytes a weight), in one pass that reads half a byte a weight and writes two.
 * Measured on a 1B-class model's 8192 x 2048 matrix (2 cores): torch's ops 18.6 ms, about what
 * the 256-row bf16 matmul that reads the result takes (21 ms); docs/engine.md has this kernel's.
 *
 * The weight, in torch's CPU layout (packed.py: pack_int4_cpu): rows in blocks of 64; a block is
 * input-major, 32 bytes an input, byte j holding row j's code in its low nibble and row j + 32's in
 * its high one; one (scale, zero) bf16 pair per row and group of 32 inputs. So input k of a block
 * is 64 adjacent weights of W.T's row k, and the loop runs along W.T's rows: each output row is
 * written once, in order.
 *
 * The bits: w = bf16(bf16((q - 8) * scale) + zero), rounded after the product and after the sum as
 * weight_t's bf16 mul_ and add_ round (tests/test_packed.py holds the two equal bit for bit).
 *
 * Arguments: the packed weight [out_pad, width / 2] (out_pad a multiple of 64, width of 32), its
 * pairs [width / 32, out_pad, 2] bf16, wt [width, out_pad] bf16. Returns 0, or 2 (shapes). */
#include <stdint.h>

#include "bf16.h"

enum { GROUP = 32, BLOCK = 64, HALF = 32 };

/* 32 rows' weights of one input from their codes (0..15) and pairs. */
static inline void dequant_half(const uint8_t *restrict codes, const uint16_t *restrict pairs, uint16_t *restrict out) {
    for (int j = 0; j < HALF; j++) {
        float product = round_bf16((float)(codes[j] - 8) * from_bf16(pairs[2 * j]));
        out[j] = to_bf16(product + from_bf16(pairs[2 * j + 1]));
    }
}

int dequant_int4(int out_pad, int width, const uint8_t *restrict packed, const uint16_t *restrict pairs,
                 uint16_t *restrict wt) {
    if (out_pad % BLOCK || width % GROUP || out_pad < 0 || width < 0)
        return 2;
    /* inputs split between torch's OpenMP threads (attend_one.c says how they are torch's) */
#pragma omp parallel for schedule(static)
    for (int k = 0; k < width; k++) {
        const uint16_t *group_pairs = pairs + (int64_t)(k / GROUP) * out_pad * 2;
        uint16_t *row = wt + (int64_t)k * out_pad;
        for (int b = 0; b < out_pad / BLOCK; b++) {
            const uint8_t *bytes = packed + ((int64_t)b * width + k) * HALF;
            uint8_t low[HALF], high[HALF];
            for (int j = 0; j < HALF; j++) {
                low[j] = bytes[j] & 15;
                high[j] = bytes[j] >> 4;
            }
            dequant_half(low, group_pairs + 2 * b * BLOCK, row + b * BLOCK);
            dequant_half(high, group_pairs + 2 * (b * BLOCK + HALF), row + b * BLOCK + HALF);
        }
    }
    return 0;
}
