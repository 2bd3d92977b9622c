/* One new token's attention over a layer's slots, for a bf16 model's queries: what step.py's
 * `attend` does in eight aten ops or more (a bmm for the logits, their scale, a float32 softmax, a
 * bmm for the output, the scores' baddbmm, the casts between them), in one pass over each KV head's
 * keys and one over its values. Slots of either width: bf16 keys and values, or 8-bit codes with a
 * float16 scale and zero point each (kv_int8.py).
 *
 * Why: on a CPU those ops are each a kernel launch over ~200 KB, and the two small bmm (oneDNN,
 * [3, 3, 64] x [3, 64, 513]) cost ~40 us each against a few us of arithmetic.
 *
 * The same roundings as the aten ops. bf16 slots: the logits rounded to bf16 (the bmm's output)
 * before the scale, the softmax in float32, the probabilities rounded to bf16 for the output's
 * products, the output summed in float32 and rounded to bf16. 8-bit slots (all in float32, as
 * kv_int8.Int8Step): logit = (scale q) . codes * key_scale + sum(scale q) * key_zero, output =
 * (p * value_scale) . codes + p . value_zero. The scores add in float32. What differs is the order
 * of each sum and the exp (a polynomial, within 2 ulp of float32's), so results equal the aten ops'
 * within rounding (tests/test_native.py), not bit for bit.
 *
 * Plain C with GCC's and Clang's vector types, no intrinsics and no -ffast-math (which in a shared
 * library GCC 12 links with code that switches the whole process to flush-to-zero): every sum is in
 * an order written here. native/__init__.py compiles it for the machine it runs on (-O3 -march=native).
 *
 * Shapes: b rows, h KV heads, g query heads per KV head (at most 16), cap slots, d head_dim (a
 * multiple of 16, at most 256), head = row * h + KV head. Pointers are to contiguous memory unless a
 * stride says otherwise.
 *   query   [b, h * g, d] bf16, row r at query + r * query_row_stride
 *   keys, values  [b * h, cap, d]: bf16, or uint8 codes when qp is given
 *   qp      [4, b * h, cap] float16: key scales, value scales, key zeros, value zeros, row k at
 *           qp + k * qp_row_stride; NULL for bf16 slots
 *   scores  [b * h, cap] float32: += the attention each slot received, weighed per query head
 *   weights [b * h, g] float32: each query head's weight in the scores (0 for a row that sits out)
 *   empty   [b or 1, cap] bool (1: a free slot, never attended) or NULL; empty_row_stride 0 or cap
 *   probs   [b * h, g, cap] float32: scratch
 *   out     [b * h, g, d] bf16: the attention's output
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { LANES = 16, MAX_GROUP = 16, MAX_DIM = 256 };  /* sum_lanes is written for 16 lanes */
enum { KEY_SCALE, VALUE_SCALE, KEY_ZERO, VALUE_ZERO };  /* qp's rows, as kv_int8.py */

/* LANES values an operation, lowered to what the machine has (one AVX-512 register, two AVX2 ones,
 * four NEON ones). */
typedef float floats __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uints __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t halves __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint8_t bytes __attribute__((vector_size(LANES)));
typedef float floats8 __attribute__((vector_size(8 * sizeof(float))));
typedef float floats4 __attribute__((vector_size(4 * sizeof(float))));

/* float16 to float32, exactly (scales and zero points are finite: kv_int8.py clamps them). */
static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, magnitude = h & 0x7fffu;
    if (magnitude < 0x400u)  /* zero or subnormal: magnitude * 2^-24 */
        return sign ? -((float)magnitude * 0x1p-24f) : (float)magnitude * 0x1p-24f;
    return bits_to_float(sign | ((magnitude + ((127 - 15) << 10)) << 13));
}

static inline floats load(const float *p) {
    floats v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, floats v) { memcpy(p, &v, sizeof v); }

static inline floats where(ints mask, floats yes, floats no) {
    return (floats)((mask & (ints)yes) | (~mask & (ints)no));
}

/* LANES bf16 values, or 8-bit codes, as float32 (exact). */
static inline floats load_bf16(const uint16_t *p) {
    halves v;
    memcpy(&v, p, sizeof v);
    return (floats)(__builtin_convertvector(v, uints) << 16);
}

static inline floats load_codes(const uint8_t *p) {
    bytes v;
    memcpy(&v, p, sizeof v);
    /* widened in two steps: GCC 12 builds a one-step 8- to 32-bit widening lane by lane (2x slower) */
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(v, halves), ints), floats);
}

/* LANES float16 values as float32, as from_f16 does one. */
static inline floats load_f16(const uint16_t *p) {
    halves v;
    memcpy(&v, p, sizeof v);
    uints h = __builtin_convertvector(v, uints), sign = (h & 0x8000u) << 16, magnitude = h & 0x7fffu;
    floats small = __builtin_convertvector((ints)magnitude, floats) * 0x1p-24f;  /* < 2^10: signed converts */
    return where((ints)(magnitude < 0x400u), (floats)((uints)small | sign),
                 (floats)(sign | ((magnitude + ((127 - 15) << 10)) << 13)));
}

/* A row of LANES-wide vectors: a slot's key or value (bf16, or codes when `codes`). */
static inline void load_slot(floats *row, const void *slots, int64_t slot, int d, int codes) {
    for (int v = 0; v < d / LANES; v++)
        row[v] = codes ? load_codes((const uint8_t *)slots + slot * d + v * LANES)
                       : load_bf16((const uint16_t *)slots + slot * d + v * LANES);
}

/* The sum of a vector's 16 lanes as a tree of halves: 4 steps, not 15 dependent adds. */
static inline float sum_lanes(floats v) {
    floats8 a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;
    floats4 c, e;
    memcpy(&c, &a, sizeof c);
    memcpy(&e, (const char *)&a + sizeof c, sizeof e);
    c += e;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline floats round_bf16_lanes(floats x) {
    uints u = (uints)x;
    return where(x != x, (floats)((u | 0x400000u) & 0xffff0000u), (floats)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u));
}

/* exp(x) for x <= 0 (a logit less its row's largest): Cephes' expf, range reduction by ln 2 and a
 * degree-6 polynomial, within 2 ulp of float32's exp; 0 below -87 (where float32's exp underflows),
 * so a free slot's -inf gives 0. */
static inline floats exp_nonpositive(floats x) {
    ints under = x < -87.0f;
    floats zero = {0}, xc = where(under, zero - 87.0f, x);
    ints n = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, ints);  /* round half down, x <= 0 */
    floats nf = __builtin_convertvector(n, floats);
    floats r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
    floats p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    floats y = p * r * r + r + 1.0f;
    return where(under, zero, y * (floats)((n + 127) << 23));
}

static inline float exp_nonpositive_one(float x) { return exp_nonpositive((floats){0} + x)[0]; }

/* A slot's logit from its dot product (in probs): bf16 slots round it to bf16 and scale it, 8-bit
 * ones add the zero point's term (the query came scaled); a free slot's is -inf. LANES slots at a
 * time, then the last few one by one. Returns the largest. */
static float logits(float *p, int cap, float scale, const uint16_t *key_scale, const uint16_t *key_zero,
                    float query_sum, const uint8_t *empty) {
    floats top = (floats){0} - __builtin_inff();
    int c = 0;
    for (; c + LANES <= cap; c += LANES) {
        floats x = load(p + c);
        x = key_scale ? x * load_f16(key_scale + c) + query_sum * load_f16(key_zero + c) : round_bf16_lanes(x) * scale;
        if (empty) {
            bytes flags;
            memcpy(&flags, empty + c, sizeof flags);
            x = where(__builtin_convertvector(flags, ints) != 0, (floats){0} - __builtin_inff(), x);
        }
        top = where(x > top, x, top);
        store(p + c, x);
    }
    float largest = top[0];
    for (int l = 1; l < LANES; l++)
        largest = top[l] > largest ? top[l] : largest;
    for (; c < cap; c++) {
        float x = key_scale ? p[c] * from_f16(key_scale[c]) + query_sum * from_f16(key_zero[c]) : round_bf16(p[c]) * scale;
        p[c] = (empty && empty[c]) ? -__builtin_inff() : x;
        largest = p[c] > largest ? p[c] : largest;
    }
    return largest;
}

/* logits -> probabilities, in place, in float32. */
static void softmax(float *p, int cap, float largest) {
    floats sums = {0};
    int c = 0;
    for (; c + LANES <= cap; c += LANES) {
        floats e = exp_nonpositive(load(p + c) - largest);
        store(p + c, e);
        sums += e;
    }
    float total = sum_lanes(sums);
    for (; c < cap; c++) {
        p[c] = exp_nonpositive_one(p[c] - largest);
        total += p[c];
    }
    float inverse = 1.0f / total;
    for (c = 0; c < cap; c++)
        p[c] *= inverse;
}

/* One KV head: its g queries over its cap slots; codes: 8-bit slots, qp this head's rows of their
 * scales and zero points, row k at qp + k * qp_row_stride. Inlined where d and codes are constants,
 * so each combination's loops are specialized. */
static inline __attribute__((always_inline)) void attend_head(
        int d, int codes, int g, int cap, const uint16_t *query, const void *keys, const void *values,
        const uint16_t *qp, int64_t qp_row_stride, float *scores, const float *weights, float scale,
        const uint8_t *empty, float *probs, uint16_t *out) {
    const int n = d / LANES;
    floats q[MAX_GROUP][MAX_DIM / LANES], row[MAX_DIM / LANES], acc[MAX_GROUP][MAX_DIM / LANES];
    float query_sum[MAX_GROUP], zero_term[MAX_GROUP];
    for (int j = 0; j < g; j++) {  /* 8-bit slots: the query scaled first, in float32, as Int8Step */
        floats sums = {0};
        for (int v = 0; v < n; v++) {
            q[j][v] = codes ? load_bf16(query + j * d + v * LANES) * scale : load_bf16(query + j * d + v * LANES);
            sums += q[j][v];
        }
        query_sum[j] = sum_lanes(sums);
    }
    /* dot products: each slot's key read once for the g queries; a free slot's is skipped (its
     * logit is -inf: `logits` writes it), so a filling layer costs its live slots, not its budget */
    for (int c = 0; c < cap; c++) {
        if (empty && empty[c])
            continue;
        load_slot(row, keys, c, d, codes);
        for (int j = 0; j < g; j++) {
            floats lanes = q[j][0] * row[0];
            for (int v = 1; v < n; v++)
                lanes += q[j][v] * row[v];
            probs[j * cap + c] = sum_lanes(lanes);
        }
    }
    for (int j = 0; j < g; j++) {
        float *p = probs + j * cap;
        softmax(p, cap, logits(p, cap, scale, codes ? qp + KEY_SCALE * qp_row_stride : 0,
                               codes ? qp + KEY_ZERO * qp_row_stride : 0, query_sum[j], empty));
    }
    /* the scores: each slot's attention summed over the query heads by their weights, then added */
    for (int c = 0; c < cap; c++) {
        float mass = 0.0f;
        for (int j = 0; j < g; j++)
            mass += weights[j] * probs[j * cap + c];
        scores[c] += mass;
    }
    /* the output's weights, in place: bf16 slots' probabilities rounded to bf16 (the bmm's input);
     * 8-bit slots' times the value scales, and the zero points' term apart */
    for (int j = 0; j < g; j++) {
        float *p = probs + j * cap;
        const uint16_t *value_scale = codes ? qp + VALUE_SCALE * qp_row_stride : 0;
        const uint16_t *value_zero = codes ? qp + VALUE_ZERO * qp_row_stride : 0;
        floats zeros = {0};
        int c = 0;
        for (; c + LANES <= cap; c += LANES) {
            floats x = load(p + c);
            if (codes)
                zeros += x * load_f16(value_zero + c);
            store(p + c, codes ? x * load_f16(value_scale + c) : round_bf16_lanes(x));
        }
        zero_term[j] = sum_lanes(zeros);
        for (; c < cap; c++) {
            if (codes)
                zero_term[j] += p[c] * from_f16(value_zero[c]);
            p[c] = codes ? p[c] * from_f16(value_scale[c]) : round_bf16(p[c]);
        }
    }
    /* the output: each slot's value read once for the g queries */
    for (int j = 0; j < g; j++)
        for (int v = 0; v < n; v++)
            acc[j][v] = (floats){0};
    for (int c = 0; c < cap; c++) {
        if (empty && empty[c])
            continue;  /* its probability is 0 */
        load_slot(row, values, c, d, codes);
        for (int j = 0; j < g; j++) {
            float p = probs[j * cap + c];
            for (int v = 0; v < n; v++)
                acc[j][v] += p * row[v];
        }
    }
    for (int j = 0; j < g; j++)
        for (int i = 0; i < d; i++)
            out[j * d + i] = to_bf16(codes ? acc[j][i / LANES][i % LANES] + zero_term[j] : acc[j][i / LANES][i % LANES]);
}

/* Returns 0, or -1 when the shapes are outside what this kernel handles (nothing written). */
int attend_one(int b, int h, int g, int cap, int d, const uint16_t *query, int64_t query_row_stride, const void *keys,
               const void *values, const uint16_t *qp, int64_t qp_row_stride, float *scores, const float *weights,
               float scale, const uint8_t *empty, int64_t empty_row_stride, float *probs, uint16_t *out) {
    if (g < 1 || g > MAX_GROUP || d < LANES || d > MAX_DIM || d % LANES)
        return -1;
    int64_t width = qp ? 1 : 2;  /* bytes a key element takes */
    /* heads split between torch's threads: built with -fopenmp, this library uses the OpenMP runtime
     * torch loaded (the same soname), so its team and its thread count (torch.set_num_threads) */
#pragma omp parallel for schedule(static) if (b * h > 1)
    for (int64_t head = 0; head < (int64_t)b * h; head++) {
            int r = (int)(head / h), k = (int)(head % h);
            const uint16_t *q = query + r * query_row_stride + (int64_t)k * g * d;
            const char *ks = (const char *)keys + head * cap * d * width, *vs = (const char *)values + head * cap * d * width;
            const uint16_t *head_qp = qp ? qp + head * cap : 0;
            const uint8_t *e = empty ? empty + r * empty_row_stride : 0;
            float *s = scores + head * cap, *p = probs + head * g * cap;
            uint16_t *o = out + head * g * d;
            const float *w = weights + head * g;
            /* the common head sizes as constants, so their loops unroll and stay in registers */
#define HEAD(d, codes) attend_head(d, codes, g, cap, q, ks, vs, head_qp, qp_row_stride, s, w, scale, e, p, o)
            if (d == 64)
                qp ? HEAD(64, 1) : HEAD(64, 0);
            else if (d == 128)
                qp ? HEAD(128, 1) : HEAD(128, 0);
            else
                qp ? HEAD(d, 1) : HEAD(d, 0);
#undef HEAD
        }
    return 0;
}
