/* A new token's queries and keys rotated (RoPE) and its keys and values written into a layer's
 * spare slot: what models/decode.py's step did in ~18 aten ops a layer (slices and views of the
 * q/k/v matmul's result, two products, a flip and a sum for the rotation, a split, a copy each into
 * the slot), for a bf16 model on a CPU, bit for bit: each product and the sum are rounded to bf16
 * as torch's bf16 ops round them, and elementwise there is no order of summation to differ
 * (tests/test_decode.py holds the step to the model's own forward bit for bit).
 *
 *     rotated[i] = bf16(bf16(x[i] * cos[i]) + bf16(x[(i + d/2) % d] * sin_flip[i]))
 *
 * sin_flip is sin with its first half negated: x[i + d/2] * -sin[i] is rotate_half(x)[i] * sin[i]
 * exactly (a sign flip rounds symmetrically).
 *
 * Arguments (bf16 as uint16_t; strides in elements):
 *   y        [rows, width], row r at y + r * y_stride: the q/k/v projection's output, q at
 *            columns q_start.. (q_heads * d), k at k_start (kv_heads * d), v at v_start
 *   cos, sin_flip  [rows, d] dense
 *   query    [rows, q_heads, d] dense, written: the rotated queries
 *   kv       keys then values [2, rows, kv_heads, cap, d] at strides value_offset, row_stride,
 *            head_stride, slot_stride (the last dim dense): slot cap - 1 of each row and KV head
 *            gets the rotated key and the value */
#include <stdint.h>
#include <string.h>

#include "bf16.h"


static void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin_flip, int d, uint16_t *out) {
    for (int i = 0; i < d; i++) {
        float straight = from_bf16(to_bf16(from_bf16(x[i]) * from_bf16(cos[i])));
        float turned = from_bf16(to_bf16(from_bf16(x[(i + d / 2) % d]) * from_bf16(sin_flip[i])));
        out[i] = to_bf16(straight + turned);
    }
}

int rotate_one(int rows, int q_heads, int kv_heads, int d, int cap, const uint16_t *y, int64_t y_stride,
               int q_start, int k_start, int v_start, const uint16_t *cos, const uint16_t *sin_flip,
               uint16_t *query, uint16_t *kv, int64_t value_offset, int64_t row_stride, int64_t head_stride,
               int64_t slot_stride) {
    if (d < 2 || d % 2 || cap < 1)
        return 1;
    for (int r = 0; r < rows; r++) {
        const uint16_t *row = y + r * y_stride, *c = cos + (int64_t)r * d, *s = sin_flip + (int64_t)r * d;
        for (int j = 0; j < q_heads; j++)
            rotate(row + q_start + j * d, c, s, d, query + ((int64_t)r * q_heads + j) * d);
        for (int j = 0; j < kv_heads; j++) {
            uint16_t *key = kv + r * row_stride + j * head_stride + (int64_t)(cap - 1) * slot_stride;
            rotate(row + k_start + j * d, c, s, d, key);
            memcpy(key + value_offset, row + v_start + j * d, sizeof(uint16_t) * d);
        }
    }
    return 0;
}
