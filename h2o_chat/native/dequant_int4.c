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
#include <string.h>

enum { GROUP = 32, BLOCK = 64, HALF = 32, LANES = 16 };

/* 16 weights a step, as GCC's and Clang's vector types: one AVX-512 register, two AVX2 ones or
 * four NEON ones. The same steps in plain C, a weight at a time (bf16.h's to_bf16 and its NaN
 * test), were vectorized 8 lanes wide around them: the embedded model's 210 weights took 23.5-27.0
 * ms, these 14.1-16.9 (docs/engine.md). */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

/* bf16.h's to_bf16 on 16 floats' bits, left in the top 16 bits: nearest even. Its NaN test is not
 * needed here: every NaN below is a bf16's or the CPU's own (0 * inf), so its low 16 bits are 0
 * and adding 0x7fff (+ 1) cannot carry it out of being a NaN, and the CPU has made it quiet, as
 * to_bf16 would (tests/test_packed.py plants an infinite scale and a NaN zero). */
static inline u32x16 round_bits(u32x16 u) { return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; }

/* 16 rows' weights of one input from their codes (0..15) and pairs (32 bits, the scale in the low
 * half): the product rounded to bf16, then the sum. */
static inline void dequant16(u8x16 codes, const uint16_t *pairs, uint16_t *out) {
    u32x16 pair;
    memcpy(&pair, pairs, sizeof pair);
    f32x16 scale = (f32x16)(pair << 16), zero = (f32x16)(pair & 0xffff0000u);
    f32x16 q = __builtin_convertvector(__builtin_convertvector(codes, i32x16) - 8, f32x16);
    u32x16 product = round_bits((u32x16)(q * scale));
    u16x16 w = __builtin_convertvector(round_bits((u32x16)((f32x16)product + zero)) >> 16, u16x16);
    memcpy(out, &w, sizeof w);
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
            for (int j = 0; j < HALF; j += LANES) {  /* rows j.. in the low nibbles, j + 32.. in the high */
                u8x16 both;
                memcpy(&both, bytes + j, sizeof both);
                dequant16(both & 15, group_pairs + 2 * (b * BLOCK + j), row + b * BLOCK + j);
                dequant16(both >> 4, group_pairs + 2 * (b * BLOCK + HALF + j), row + b * BLOCK + HALF + j);
            }
        }
    }
    return 0;
}
