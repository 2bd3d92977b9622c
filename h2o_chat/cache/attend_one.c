/* One new token's attention over a layer's slots, bf16 keys and values: what step.py's `attend`
 * does in eight aten ops (a bmm for the logits, their scale, a float32 softmax, a bmm for the output,
 * the scores' baddbmm, the casts between them), in one pass over each KV head's slots.
 *
 * Why: on a CPU those ops are each a kernel launch over ~200 KB, and the two small bmm (oneDNN,
 * [3, 3, 64] x [3, 64, 513]) cost ~40 us each against a few us of arithmetic. Here each KV head's
 * keys are read once for all its query heads, and its values once.
 *
 * The same roundings as the aten path: the logits rounded to bf16 (the bmm's output) before the
 * scale, the softmax in float32, the probabilities rounded to bf16 for the output's products, the
 * output accumulated in float32 and rounded to bf16, the scores added in float32. What differs is the
 * order of each sum and the exp (a polynomial here, within 2 ulp of float32's), so results
 * are equal to the aten path's within float32 rounding (tests/test_native.py), not bit for bit.
 *
 * Plain C, no intrinsics: the loops over head_dim and over slots are written in lanes of 16 so a
 * compiler vectorizes them without being allowed to reorder float sums (no -ffast-math: in a
 * shared library GCC 12 would switch the whole process to flush-to-zero). native.py compiles this
 * file with the system's C compiler for the machine it runs on (-O3 -march=native).
 *
 * Shapes: b rows, h KV heads, g query heads per KV head, cap slots, d head_dim (a multiple of 16,
 * at most 256), bh = b * h. Every pointer is to contiguous memory unless a stride says otherwise.
 *   query   [b, h * g, d] bf16, row r at query + r * query_row_stride
 *   keys    [bh, cap, d] bf16       values [bh, cap, d] bf16
 *   scores  [bh, cap] float32: += the attention each slot received, weighted per query head
 *   weights [bh, g] float32: each query head's weight in the scores (0 for a row that sits out)
 *   empty   [b or 1, cap] bool (1: a free slot, never attended) or NULL; empty_row_stride 0 or cap
 *   probs   [bh, g, cap] float32: scratch (left holding the probabilities)
 *   out     [bh, g, d] bf16: the attention's output
 */
#include <stdint.h>
#include <string.h>

enum { LANES = 16, MAX_GROUP = 16, MAX_DIM = 256 };  /* sum_lanes is written for 16 lanes */

/* GCC's and Clang's vector types: LANES floats an operation, lowered to whatever the machine has
 * (one AVX-512 register, two AVX2 ones, four NEON ones), with no reordering of any sum. */
typedef float floats __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uints __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t halves __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint8_t bytes __attribute__((vector_size(LANES)));
typedef float floats8 __attribute__((vector_size(8 * sizeof(float))));
typedef float floats4 __attribute__((vector_size(4 * sizeof(float))));

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's bf16 cast (a NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

static inline floats load(const float *p) {
    floats v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, floats v) { memcpy(p, &v, sizeof v); }

/* LANES bf16 values widened to float32 (exact: a bf16 is a float32's top half). */
static inline floats load_bf16(const uint16_t *p) {
    halves h;
    memcpy(&h, p, sizeof h);
    return (floats)(__builtin_convertvector(h, uints) << 16);
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

static inline floats where(ints mask, floats yes, floats no) {
    return (floats)((mask & (ints)yes) | (~mask & (ints)no));
}

/* round_bf16 on each lane. */
static inline floats round_bf16_lanes(floats x) {
    uints u = (uints)x;
    ints nan = x != x;
    return where(nan, (floats)((u | 0x400000u) & 0xffff0000u), (floats)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u));
}

/* A slot's logit from its dot product, LANES slots at once (empty: 0, or their free-slot flags):
 * rounded to bf16 as the bmm's output, scaled, -inf where free; `largest` keeps each lane's maximum. */
static inline floats logits_lanes(floats dots, const uint8_t *empty, float scale, floats *largest) {
    floats logits = round_bf16_lanes(dots) * scale;
    if (empty) {
        bytes flags;
        memcpy(&flags, empty, sizeof flags);
        logits = where(__builtin_convertvector(flags, ints) != 0, (floats){0} - __builtin_inff(), logits);
    }
    *largest = where(logits > *largest, logits, *largest);
    return logits;
}

/* exp(x) for x <= 0 (a logit less its row's largest): Cephes' expf, range reduction by ln 2 and a
 * degree-6 polynomial, within 2 ulp of float32's exp; 0 below -87 (where float32's exp underflows),
 * so a masked slot's -inf gives 0. */
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
    floats two_to_n = (floats)((n + 127) << 23);
    return where(under, zero, y * two_to_n);
}

/* One KV head: its g queries over its cap slots; d / LANES vectors a row. */
static void attend_head(int d, int g, int cap, const uint16_t *query, const uint16_t *keys, const uint16_t *values,
                        float *scores, const float *weights, float scale, const uint8_t *empty, float *probs,
                        uint16_t *out) {
    const int n = d / LANES;
    floats q[MAX_GROUP][MAX_DIM / LANES], row[MAX_DIM / LANES], acc[MAX_GROUP][MAX_DIM / LANES];
    for (int j = 0; j < g; j++)
        for (int v = 0; v < n; v++)
            q[j][v] = load_bf16(query + j * d + v * LANES);
    /* dot products: each slot's key read once for the g queries */
    for (int c = 0; c < cap; c++) {
        for (int v = 0; v < n; v++)
            row[v] = load_bf16(keys + (int64_t)c * d + v * LANES);
        for (int j = 0; j < g; j++) {
            floats lanes = q[j][0] * row[0];
            for (int v = 1; v < n; v++)
                lanes += q[j][v] * row[v];
            probs[j * cap + c] = sum_lanes(lanes);
        }
    }
    /* logits, LANES slots at a time (the last partial block through a padded copy) */
    float largest[MAX_GROUP];
    for (int j = 0; j < g; j++) {
        float *p = probs + j * cap;
        floats top = (floats){0} - __builtin_inff();
        int c = 0;
        for (; c + LANES <= cap; c += LANES)
            store(p + c, logits_lanes(load(p + c), empty ? empty + c : 0, scale, &top));
        if (c < cap) {
            float tail[LANES] = {0};
            uint8_t tail_empty[LANES];
            for (int l = 0; l < LANES; l++)
                tail_empty[l] = c + l >= cap || (empty && empty[c + l]);  /* padding: free */
            memcpy(tail, p + c, (size_t)(cap - c) * sizeof(float));
            floats logits = logits_lanes(load(tail), tail_empty, scale, &top);
            memcpy(p + c, &logits, (size_t)(cap - c) * sizeof(float));
        }
        largest[j] = top[0];
        for (int l = 1; l < LANES; l++)
            largest[j] = top[l] > largest[j] ? top[l] : largest[j];
    }
    /* softmax per query head, in float32; the last partial vector padded with -inf (exp: 0) */
    for (int j = 0; j < g; j++) {
        float *p = probs + j * cap;
        floats sums = {0}, m = sums + largest[j];
        int c = 0;
        for (; c + LANES <= cap; c += LANES) {
            floats e = exp_nonpositive(load(p + c) - m);
            store(p + c, e);
            sums += e;
        }
        if (c < cap) {
            float tail[LANES];
            for (int l = 0; l < LANES; l++)
                tail[l] = c + l < cap ? p[c + l] : -__builtin_inff();
            floats e = exp_nonpositive(load(tail) - m);
            sums += e;
            for (int l = 0; c + l < cap; l++)
                p[c + l] = e[l];
        }
        float inverse = 1.0f / sum_lanes(sums);
        for (c = 0; c < cap; c++)
            p[c] *= inverse;
    }
    /* the scores: each slot's attention summed over the query heads by their weights, then added */
    for (int c = 0; c < cap; c++) {
        float mass = 0.0f;
        for (int j = 0; j < g; j++)
            mass += weights[j] * probs[j * cap + c];
        scores[c] += mass;
    }
    /* the output: probabilities rounded to bf16 (the bmm's input), each slot's value read once for the g queries */
    for (int j = 0; j < g; j++) {
        float *p = probs + j * cap;
        int c = 0;
        for (; c + LANES <= cap; c += LANES)
            store(p + c, round_bf16_lanes(load(p + c)));
        for (; c < cap; c++)
            p[c] = round_bf16(p[c]);
    }
    for (int j = 0; j < g; j++)
        for (int v = 0; v < n; v++)
            acc[j][v] = (floats){0};
    for (int c = 0; c < cap; c++) {
        for (int v = 0; v < n; v++)
            row[v] = load_bf16(values + (int64_t)c * d + v * LANES);
        for (int j = 0; j < g; j++) {
            float p = probs[j * cap + c];
            for (int v = 0; v < n; v++)
                acc[j][v] += p * row[v];
        }
    }
    for (int j = 0; j < g; j++)
        for (int i = 0; i < d; i++)
            out[j * d + i] = to_bf16(acc[j][i / LANES][i % LANES]);
}

/* Returns 0, or -1 when the shapes are outside what this kernel handles (nothing written). */
int attend_one_bf16(int b, int h, int g, int cap, int d, const uint16_t *query, int64_t query_row_stride,
                    const uint16_t *keys, const uint16_t *values, float *scores, const float *weights, float scale,
                    const uint8_t *empty, int64_t empty_row_stride, float *probs, uint16_t *out) {
    if (g < 1 || g > MAX_GROUP || d < LANES || d > MAX_DIM || d % LANES)
        return -1;
    for (int r = 0; r < b; r++)
        for (int k = 0; k < h; k++) {
            int64_t head = (int64_t)r * h + k;
            attend_head(d, g, cap, query + r * query_row_stride + (int64_t)k * g * d, keys + head * cap * d,
                        values + head * cap * d, scores + head * cap, weights + head * g, scale,
                        empty ? empty + r * empty_row_stride : 0, probs + head * g * cap, out + head * g * d);
        }
    return 0;
}
