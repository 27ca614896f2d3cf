/* A Llama layer's small float32 operations, each one pass over its rows: RMSNorm, the rotary turn
of q and k, and SiLU(gate) * up.

In torch each is several operations (RMSNorm seven: a square, a mean, an addition, a reciprocal
square root and three products), and at a decode step's few rows their dispatch, not their
arithmetic, is what costs. Each row is computed alone, in one fixed order, so a row's result does
not depend on the rows beside it. The rotary turn makes the same float32 products and sums as
models/layer_ops.rotate's torch code (built with -ffp-contract=off), so it is bit-equal to it; RMSNorm
sums in its own order and SiLU exponentiates its own way (common.h's exp8), within float32 rounding
of torch's.

Each function splits its rows over `threads` OpenMP threads where the work is large enough to pay
for it (a prompt's rows), and runs on the calling thread otherwise (a decode step's).
*/

#include <math.h>

#include "common.h"

#define PARALLEL_VALUES (1 << 16)

/* out[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)), as transformers' LlamaRMSNorm orders it. */
void rms_norm_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, const float *w, float eps, float *out,
                   int64_t ldo, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        float sum = 0.0f;
        int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps();
        for (; c + 8 <= n; c += 8) {
            __m256 v = _mm256_loadu_ps(xr + c);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        sum = sum8(acc);
#endif
        for (; c < n; c++)
            sum += xr[c] * xr[c];
        float scale = 1.0f / sqrtf(sum / (float)n + eps);
        for (c = 0; c < n; c++)
            o[c] = w[c] * (xr[c] * scale);
    }
}

/* The first `heads` heads (d values each) of each row of x turned in place by the row's phase, cos
   and sin [rows, d] (row stride ldc): value i of the first half paired with i + d/2, as
   x * cos + cat(-second half, first half) * sin. */
void rotate_rows(float *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const float *cos_, const float *sin_,
                 int64_t ldc, int threads) {
    int64_t half = d / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * d >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_ + r * ldc, *s = sin_ + r * ldc;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * ldx + h * d;
            for (int64_t i = 0; i < half; i++) {
                float first = v[i], second = v[i + half];
                v[i] = first * c[i] + (-second) * s[i];
                v[i + half] = second * c[i + half] + first * s[i + half];
            }
        }
    }
}

/* out[r, i] = silu(x[r, i]) * x[r, f + i] for i < f: the gate and up halves of a fused product.
   silu(g) = g * sigmoid(g), the sigmoid from t = e^-|g| (never above 1, so never overflowing): 1 / (1 + t)
   for g >= 0, t / (1 + t) below. */
void silu_mul_rows(const float *x, int64_t ldx, int64_t rows, int64_t f, float *out, int64_t ldo, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * f >= PARALLEL_VALUES / 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * ldx, *up = gate + f;
        float *o = out + r * ldo;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= f; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 t = exp8(_mm256_or_ps(g, sign)); /* e^-|g| */
            __m256 below = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
            __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, t, below), _mm256_add_ps(one, t));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < f; i++) {
            float t = expf(-fabsf(gate[i]));
            o[i] = gate[i] * ((gate[i] < 0.0f ? t : 1.0f) / (1.0f + t)) * up[i];
        }
    }
}
