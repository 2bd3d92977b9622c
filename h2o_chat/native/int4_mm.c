/* One row times a 4-bit weight: what aten._weight_int4pack_mm_for_cpu does for a decode step's
 * single token (packed.py's Int4Linear), reading the same packed bytes, in ~1.3x less time on
 * the embedded model's layers (docs/engine.md).
 *
 * The weight, in torch's CPU layout (packed.py: pack_int4_cpu): rows in blocks of 64; a block is
 * input-major, 32 bytes an input, byte j holding row j's code in its low nibble and row j + 32's
 * in its high one; one (scale, zero) bf16 pair per row and group of 32 inputs, w = (q - 8) *
 * scale + zero. So for a group g and row r:
 *
 *     sum_i x_i w_ri = scale_gr * sum_i x_i q_ri + (zero_gr - 8 scale_gr) * sum_i x_i
 *
 * How: the first sum in integers, 4 products an instruction (AVX-512 VNNI's dpbusd: unsigned 8
 * bits times signed 8 bits, 4 adjacent pairs summed into a 32-bit lane; on plain AVX2, maddubs
 * and madd do the same in two). x is written per group as 15-bit integers in two signed bytes,
 * x ~= step * (254 * high + low), high = round(x / (max|x| / 127)): two passes of the same
 * products. One pass would be llama.cpp's 8-bit activations (3x aten's error on random rows,
 * measured); two keep the error at aten's, whose bf16 inputs hold 8 significant bits, for a 1.07x
 * slower kernel. The group's second sum is exact in float32.
 *
 * The lanes: dpbusd wants a row's 4 consecutive inputs in one 32-bit lane, and the layout holds an
 * input's 64 rows side by side, so 4 inputs' 32-byte runs are interleaved (unpack 8 then 16 bits:
 * a 4x4 byte transpose per 128-bit lane). That leaves rows in the order lane_row() gives, which
 * the scales are permuted to match and the output is written back from.
 *
 * Intrinsics, not vector types as attend_one.c: the byte transpose and dpbusd have no portable
 * spelling. Without AVX2 the function returns 1 and packed.py calls aten's kernel. No -ffast-math
 * (attend_one.c says why); every float sum is in an order written here, so a row's result does not
 * depend on the other rows of a call, the threads, or the instruction set (tests/test_native.py).
 *
 * A symmetric weight (every zero 0: a GGUF Q4_0 file's) may also come with its scales alone, block
 * by block: [out_pad / 64, k / 32, 64] bf16, a group's 64 in lane_row order (packed.py:
 * scales_by_block). They are read instead of the pairs: half the bytes, one contiguous run a block,
 * one load an accumulator; the offset -8 scale is what the pairs' (zero - 8 scale) is with zero 0,
 * so the bits are the same. The 1B-class Q4_0 file's 113 matrices: 1.11-1.15x (docs/engine.md).
 *
 * Arguments: n rows of x (bf16, row r at x + r * x_stride, k inputs, a multiple of 32), the packed
 * weight [out_pad, k / 2] (out_pad a multiple of 64), its pairs [k / 32, out_pad, 2] bf16, its
 * scales by block or NULL, y [n, out_pad] bf16 (row r at y + r * y_stride). Returns 0, or 1 (not
 * built for this CPU), 2 (shapes), 3 (out of memory). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { GROUP = 32, BLOCK = 64, HALF = 32, STEPS = GROUP / 4 };


/* A row of x, k inputs -> per group of 32: high and low codes (int8 [k] each), the step (max|x| /
 * 127 / 254) and the exact sum of x. */
static void split_row(const uint16_t *x, int k, int8_t *high, int8_t *low, float *step, float *sum) {
    for (int g = 0; g < k / GROUP; g++) {
        float v[GROUP], top = 0.f, total = 0.f;
        for (int i = 0; i < GROUP; i++) {
            v[i] = from_bf16(x[g * GROUP + i]);
            top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
            total += v[i];
        }
        float inverse = top > 0.f ? 127.f / top : 0.f;
        for (int i = 0; i < GROUP; i++) {
            float scaled = v[i] * inverse, whole = rintf(scaled);
            high[g * GROUP + i] = (int8_t)whole;
            low[g * GROUP + i] = (int8_t)rintf((scaled - whole) * 254.f);  /* |scaled - whole| <= 0.5 */
        }
        step[g] = top / 127.f / 254.f;
        sum[g] = total;
    }
}

/* The row of the block that f[index] holds: f[8 * v + lane] is lane `lane` of accumulator v. */
static inline int lane_row(int index) {
    int v = index / 8, lane = index % 8, part = v / 4, nibble = (v % 4) / 2, second = v % 2;
    return 32 * nibble + 8 * part + (lane < 4 ? 0 : 16) + 4 * second + lane % 4;
}

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
static inline __m256i dot_avx2(__m256i acc, __m256i u, __m256i s) {
    __m256i pairs = _mm256_maddubs_epi16(u, s);  /* at most 2 * 15 * 128: no saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#define DOT(acc, u, s) dot_avx2(acc, u, s)
#endif

/* 8 bf16 -> float32 */
static inline __m256 widen8(const uint16_t *h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}

/* One block of 64 rows for one row of x: f [64] float32, in lane_row order. Per group, 8 integer
 * accumulators of 8 lanes (the 64 rows) for each pass, then the group's scales: from `scales`
 * (this block's scales by block) where given, else from the pairs. */
static void block(int k, int out_pad, int b, const uint8_t *w, const uint16_t *pairs_all, const uint16_t *scales,
                  const int8_t *high, const int8_t *low, const float *step, const float *sum, float *f) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), top16 = _mm256_set1_epi32((int)0xffff0000u);
    memset(f, 0, sizeof(float) * BLOCK);
    for (int g = 0; g < k / GROUP; g++) {
        __m256i acc[8], rest[8];
        for (int v = 0; v < 8; v++)
            acc[v] = rest[v] = _mm256_setzero_si256();
        /* the next block's pairs of this group, 256 bytes a group row (out_pad * 4 bytes) apart: k / 32
         * such streams are more than the hardware prefetcher follows, so they are asked for here */
        if (!scales && b + 1 < out_pad / BLOCK) {
            const char *next = (const char *)(pairs_all + ((size_t)g * out_pad + (size_t)(b + 1) * BLOCK) * 2);
            for (int line = 0; line < 4; line++)
                _mm_prefetch(next + 64 * line, _MM_HINT_T0);
        }
        const uint8_t *p = w + (size_t)g * GROUP * HALF;
        for (int s = 0; s < STEPS; s++, p += 4 * HALF) {
            /* inputs 4s..4s+3 of the group: their bytes transposed so a lane holds a row's four */
            __m256i a = _mm256_loadu_si256((const __m256i *)p), b1 = _mm256_loadu_si256((const __m256i *)(p + HALF));
            __m256i c = _mm256_loadu_si256((const __m256i *)(p + 2 * HALF)), d = _mm256_loadu_si256((const __m256i *)(p + 3 * HALF));
            __m256i rows[4];
            for (int part = 0; part < 2; part++) {
                __m256i ab = part ? _mm256_unpackhi_epi8(a, b1) : _mm256_unpacklo_epi8(a, b1);
                __m256i cd = part ? _mm256_unpackhi_epi8(c, d) : _mm256_unpacklo_epi8(c, d);
                rows[2 * part] = _mm256_unpacklo_epi16(ab, cd);
                rows[2 * part + 1] = _mm256_unpackhi_epi16(ab, cd);
            }
            /* the next group's codes, a step's share of its 1 KiB: worth 3% on the 1B file's
             * matrices (64-256 KiB a block), nothing on the embedded model's (18-48 KiB) */
            _mm_prefetch((const char *)p + GROUP * HALF, _MM_HINT_T0);
            _mm_prefetch((const char *)p + GROUP * HALF + 64, _MM_HINT_T0);
            int32_t four_high, four_low;
            memcpy(&four_high, high + g * GROUP + 4 * s, 4);
            memcpy(&four_low, low + g * GROUP + 4 * s, 4);
            __m256i xh = _mm256_set1_epi32(four_high), xl = _mm256_set1_epi32(four_low);
            for (int v = 0; v < 8; v++) {
                __m256i r = rows[2 * (v / 4) + v % 2];
                __m256i q = _mm256_and_si256((v % 4) < 2 ? r : _mm256_srli_epi16(r, 4), nibble);
                acc[v] = DOT(acc[v], q, xh);
                rest[v] = DOT(rest[v], q, xl);
            }
        }
        /* the (scale, zero) pairs of accumulator v's rows: two 128-bit halves of rows in order */
        const __m256i *pairs = (const __m256i *)(pairs_all + ((size_t)g * out_pad + (size_t)b * BLOCK) * 2);
        __m256 x_step = _mm256_set1_ps(step[g]), x_sum = _mm256_set1_ps(sum[g]);
        for (int v = 0; v < 8; v++) {
            __m256 scale, offset;
            if (scales) {
                scale = widen8(scales + (size_t)g * BLOCK + 8 * v);
                offset = _mm256_mul_ps(_mm256_set1_ps(-8.f), scale);
            } else {
                int part = v / 4, nibble_v = (v % 4) / 2, second = v % 2;
                __m256i first8 = _mm256_loadu_si256(pairs + 4 * nibble_v + part);
                __m256i then8 = _mm256_loadu_si256(pairs + 4 * nibble_v + part + 2);
                __m256i sz = second ? _mm256_permute2x128_si256(first8, then8, 0x31) : _mm256_permute2x128_si256(first8, then8, 0x20);
                scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
                offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, _mm256_castsi256_ps(_mm256_and_si256(sz, top16)));
            }
            __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(acc[v], _mm256_set1_epi32(254)), rest[v]);
            __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, x_step), _mm256_loadu_ps(f + 8 * v));
            _mm256_storeu_ps(f + 8 * v, _mm256_fmadd_ps(offset, x_sum, t));
        }
    }
}
#endif

int int4_mm(int n, int k, int out_pad, const uint16_t *x, int64_t x_stride, const uint8_t *packed,
            const uint16_t *pairs, const uint16_t *scales, uint16_t *y, int64_t y_stride) {
#if !defined(__AVX2__)
    (void)n, (void)k, (void)out_pad, (void)x, (void)x_stride, (void)packed, (void)pairs, (void)scales, (void)y, (void)y_stride;
    return 1;
#else
    if (n < 1 || k < GROUP || k % GROUP || out_pad < BLOCK || out_pad % BLOCK)
        return 2;
    const int groups = k / GROUP;
    int8_t *codes = malloc((size_t)2 * n * k);
    float *numbers = malloc(sizeof(float) * 2 * (size_t)n * groups);
    if (!codes || !numbers) {
        free(codes);
        free(numbers);
        return 3;
    }
    for (int r = 0; r < n; r++)
        split_row(x + r * x_stride, k, codes + (size_t)2 * r * k, codes + (size_t)(2 * r + 1) * k,
                  numbers + (size_t)2 * r * groups, numbers + (size_t)(2 * r + 1) * groups);
    const int blocks = out_pad / BLOCK;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int b = 0; b < blocks; b++) {
        float f[BLOCK];
        for (int r = 0; r < n; r++) {
            block(k, out_pad, b, packed + (size_t)b * BLOCK * (k / 2), pairs,
                  scales ? scales + (size_t)b * groups * BLOCK : NULL, codes + (size_t)2 * r * k,
                  codes + (size_t)(2 * r + 1) * k, numbers + (size_t)2 * r * groups, numbers + (size_t)(2 * r + 1) * groups, f);
            for (int i = 0; i < BLOCK; i++)
                y[r * y_stride + (size_t)b * BLOCK + lane_row(i)] = to_bf16(f[i]);
        }
    }
    free(codes);
    free(numbers);
    return 0;
#endif
}
