/* The end of a bf16 model's RMSNorm, once torch has summed the squares: what models/decode.py's
 * rms_norm does after its `sum` with five aten ops a norm (div_, add_, rsqrt_, mul_, the copy down
 * to bf16, the weight's product: 61 norms a token on the embedded model), in one pass.
 *
 * The bits: every step is elementwise and rounds as torch's ops do: the variance sum / count and
 * + eps in float32, 1 / sqrt (torch's rsqrt on a CPU: a correctly rounded square root, then a
 * correctly rounded division), x times it in float32, rounded to bf16, then times the bf16 weight
 * (a product of two bf16 is exact in float32) rounded to bf16 (tests/test_decode.py holds the lean
 * step to the model's forward bit for bit). The sum itself stays torch's: its order of additions is
 * its own.
 *
 * Arguments: rows x hidden float32 x (row r at x + r * hidden), sum_sq [rows] float32, weight
 * [hidden] bf16, out [rows, hidden] bf16. */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

void rms_tail(int rows, int hidden, const float *restrict x, const float *restrict sum_sq, float count, float eps,
              const uint16_t *restrict weight, uint16_t *restrict out) {
    for (int r = 0; r < rows; r++) {
        float scale = 1.0f / sqrtf(sum_sq[r] / count + eps);
        const float *row = x + (int64_t)r * hidden;
        uint16_t *y = out + (int64_t)r * hidden;
        for (int i = 0; i < hidden; i++)
            y[i] = to_bf16(from_bf16(weight[i]) * round_bf16(row[i] * scale));
    }
}
