/* What the kernels share: the widths they read and write, and their conversions. */

#ifndef FLEXH2O_COMMON_H
#define FLEXH2O_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum dtype { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, NaN kept a NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline uint16_t f16_bits(_Float16 h) {
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

static inline _Float16 f16_from_bits(uint16_t b) {
    _Float16 h;
    memcpy(&h, &b, 2);
    return h;
}

/* The float16 at p (any alignment) as a float. */
static inline float half_at(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return (float)f16_from_bits(bits);
}

/* The four bytes at p (any alignment). */
static inline uint32_t bits32(const uint8_t *p) {
    uint32_t b;
    memcpy(&b, p, 4);
    return b;
}

/* The sum of s[0..7] in sum8's order, for the paths without vectors. */
static inline float sum8_of(const float *s) {
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}


#ifdef __AVX2__
/* Eight floats as bfloat16, rounded to nearest even (float_to_bf16's rounding, NaN kept a NaN). */
static inline void store_bf16(const float *v, uint16_t *out) {
    __m256 x = _mm256_loadu_ps(v);
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    rounded = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    __m256i high = _mm256_srli_epi32(rounded, 16);
    _mm_storeu_si128((__m128i *)out, _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}

static inline void store_bf16s(const float *v, uint16_t *out, int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        store_bf16(v + i, out + i);
    for (; i < count; i++)
        out[i] = float_to_bf16(v[i]);
}
#else
static inline void store_bf16s(const float *v, uint16_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        out[i] = float_to_bf16(v[i]);
}
#endif

/* count floats of v into out (of dtype) from element `at`. */
static inline void store_values(const float *v, void *out, int dtype, int64_t at, int64_t count) {
    if (dtype == FLOAT32) {
        memcpy((float *)out + at, v, (size_t)count * 4);
    } else if (dtype == BFLOAT16) {
        store_bf16s(v, (uint16_t *)out + at, count);
    } else {
        for (int64_t i = 0; i < count; i++)
            ((_Float16 *)out)[at + i] = (_Float16)v[i];
    }
}

/* quant4.c's product over the weight rows [first, last) of quant.py's groups (blocks.c's matmul_all
   hands them out). */
void matmul_groups(const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y, int64_t ldy,
                   int64_t first, int64_t last);

/* sixteen_bit.c's product of F16 (bf16 0) or BF16 weight rows [first, last) of k values each
   (blocks.c's matmul_all hands them over). */
void matmul_sixteen(int bf16, const float *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *w, float *y,
                    int64_t ldy, int64_t first, int64_t last);

/* y[i * ldy] += the dot product of row i of x (row stride ldx) with v's count values, for i < m:
   the portable products' inner step. */
static inline void add_dots(const float *x, int64_t m, int64_t ldx, const float *v, int count, float *y, int64_t ldy) {
    for (int64_t i = 0; i < m; i++) {
        float sum = 0.0f;
        for (int c = 0; c < count; c++)
            sum += x[i * ldx + c] * v[c];
        y[i * ldy] += sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* e^x for eight floats x <= 0 (below -87, -inf included, 0): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
   Taylor polynomial to r^7 (relative error about 1e-7), times 2^n. */
static inline __m256 exp8(__m256 x) {
    __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ); /* below: 0 (an empty slot's -inf) */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), kept);
}
#endif

#endif
