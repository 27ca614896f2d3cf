/* A decode step's attention over a full float32 cache, each (sequence, KV head) by itself, reading
only the slots that hold a token.

PyTorch's fused CPU attention reads every slot up to the cache's length, the empty ones masked:
where slots are refilled, a gpu-batch's sequences are of every length and the longest sets what
all of them read. Here a sequence's K and V are read up to its own last token, once each: the
logits of every query head sharing the KV head (grouped heads) from one pass over K, then their
softmax, then the weighted sum from one pass over V. Each (sequence, KV head) is computed alone,
in one fixed order, so a sequence's result does not depend on the others in its batch.
*/

#include <math.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
/* One query head: q [d] (scaled) over k and v [n, d] of its KV head, pos [n] (< 0: empty), into
   out [d]; e: room for n floats (rounded up to eight). The weighted sum of V is kept in registers,
   CHUNK values of d at a time (in memory, each slot's multiply-add waited on the store of the one
   before); each value of out is summed over the slots in slot order, one multiply-add each. */
#define CHUNK 32
static void attend_one(const float *q, const float *k, const float *v, const int32_t *pos, int64_t n, int64_t d,
                       float *e, float *out) {
    int64_t last = n;
    while (last > 0 && pos[last - 1] < 0)
        last--;
    int64_t width = (last + 7) / 8 * 8;
    if (last == 0) { /* no token at all (never the case: the new one is stored first) */
        memset(out, 0, (size_t)d * sizeof(float));
        return;
    }
    for (int64_t s = 0; s < width; s++) {
        if (s >= last || pos[s] < 0) {
            e[s] = -INFINITY;
            continue;
        }
        const float *ks = k + s * d;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(ks + c), acc);
        e[s] = sum8(acc);
    }
    float top = -INFINITY;
    for (int64_t s = 0; s < last; s++)
        top = e[s] > top ? e[s] : top;
    __m256 sum = _mm256_setzero_ps(), m = _mm256_set1_ps(top);
    for (int64_t s = 0; s < width; s += 8) {
        __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + s), m));
        _mm256_storeu_ps(e + s, x);
        sum = _mm256_add_ps(sum, x);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sum8(sum));
    for (int64_t c0 = 0; c0 < d; c0 += CHUNK) {
        int64_t parts = (d - c0 < CHUNK ? d - c0 : CHUNK) / 8;
        __m256 acc[CHUNK / 8];
        for (int p = 0; p < CHUNK / 8; p++)
            acc[p] = _mm256_setzero_ps();
        for (int64_t s = 0; s < last; s++) {
            if (pos[s] < 0)
                continue;
            __m256 w = _mm256_set1_ps(e[s]);
            const float *vs = v + s * d + c0;
            if (parts == CHUNK / 8)
                for (int p = 0; p < CHUNK / 8; p++)
                    acc[p] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 8 * p), acc[p]);
            else
                for (int p = 0; p < parts; p++)
                    acc[p] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 8 * p), acc[p]);
        }
        for (int p = 0; p < parts; p++)
            _mm256_storeu_ps(out + c0 + 8 * p, _mm256_mul_ps(acc[p], inv));
    }
}

/* q [b, kv_heads, group, d], sequence i's at q + i * ldq, multiplied by `scale` here (as torch's q * scale
   would); k and v [b, kv_heads, capacity, d], pos [b, kv_heads, capacity]: slots [0, n) of each; out
   [b, kv_heads, group, d]. d a multiple of 8. Each query head is a task of its own, so that a
   sequence's few heads still share the threads evenly. Returns 0, or -1 where a thread could not
   have its buffers (out is then not written whole). */
int decode_attention(const float *q, int64_t ldq, float scale, const float *k, const float *v, const int32_t *pos,
                     int64_t b, int64_t kv_heads, int64_t group, int64_t capacity, int64_t n, int64_t d, float *out,
                     int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *e = malloc((size_t)((n + 7) / 8 * 8 + d + 1) * sizeof(float));
        if (e == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < b * kv_heads * group; task++) {
            if (e == NULL)
                continue;
            int64_t t = task / group, j = task % group; /* (sequence, KV head), query head */
            float *scaled = e + (n + 7) / 8 * 8;
            const float *qj = q + t / kv_heads * ldq + (t % kv_heads * group + j) * d;
            for (int64_t c = 0; c < d; c++)
                scaled[c] = qj[c] * scale;
            attend_one(scaled, k + t * capacity * d, v + t * capacity * d, pos + t * capacity, n, d, e,
                       out + task * d);
        }
        free(e);
    }
    return failed ? -1 : 0;
}
#else
int decode_attention(const float *q, int64_t ldq, float scale, const float *k, const float *v, const int32_t *pos,
                     int64_t b, int64_t kv_heads, int64_t group, int64_t capacity, int64_t n, int64_t d, float *out,
                     int threads) {
    return -1; /* built without AVX2: the caller keeps PyTorch's attention */
}
#endif

/* A decode step's new token into slot t of a full float32 cache: k_new and v_new [b, kv_heads, d] (sequence i's
   head h at i * ld_b + h * ld_h), its position pos[i * ld_pos] (int64) for every KV head of sequence i. */
void append_token(float *k, float *v, int32_t *pos, int64_t b, int64_t kv_heads, int64_t capacity, int64_t d,
                  int64_t t, const float *k_new, int64_t k_ld_b, int64_t k_ld_h, const float *v_new, int64_t v_ld_b,
                  int64_t v_ld_h, const int64_t *new_pos, int64_t ld_pos) {
    for (int64_t i = 0; i < b; i++)
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t slot = (i * kv_heads + h) * capacity + t;
            memcpy(k + slot * d, k_new + i * k_ld_b + h * k_ld_h, (size_t)d * sizeof(float));
            memcpy(v + slot * d, v_new + i * v_ld_b + h * v_ld_h, (size_t)d * sizeof(float));
            pos[slot] = (int32_t)new_pos[i * ld_pos];
        }
}
