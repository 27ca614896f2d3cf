/* F16 and BF16 matrices (16-bit values, no scale: a GGUF file's, kept 16-bit by gguf_blocks.py)
multiplied by float32 rows of x, each value widened in registers.

A (row of x, weight row) sum runs over k in 16 partial sums P (lane l takes values l, l + 16,
l + 32, ...), one fused multiply-add a value, and y = sum8(S) with S[l] = P[l] + P[8 + l]
(common.h's order). Every path (AVX-512: one 16-lane vector a sum; AVX2: two of eight; plain C)
does exactly these operations, so all give the same bits, and a row's result does not depend on
the other rows, the tile it fell in or the threads.

With AVX-512 a tile is four rows of x by six weight rows: 24 sums in registers, each x vector used
six times and each weight vector four, sixteen values a step; with AVX2, three rows by two (12 of
its 16 registers hold the sums). pairs.h's tiles (two weight rows' eight-lane sums in a register,
each x vector loaded into both halves) did twice the loads a multiply-add: on a 2-core Zen 4,
162-181 GFLOPS on a 1.26B model's matrices at 32-256 rows where these tiles make 188-221 (the
CPU's peak about 232).
*/

#include <math.h>

#include "common.h"

#define STEP 16 /* values of k a step */

#if defined(__AVX512F__) && defined(__F16C__)
typedef __m512 sums; /* 16 partial sums, or 16 values */
#define WIDTH 16 /* floats a vector holds */
#define TILE_X 4
#define TILE_W 6

static inline sums zeros(void) { return _mm512_setzero_ps(); }
static inline sums x_values(const float *x) { return _mm512_loadu_ps(x); }
static inline sums fma16(sums a, sums b, sums c) { return _mm512_fmadd_ps(a, b, c); }

static inline sums widened(int bf16, const uint16_t *w) {
    __m256i bits = _mm256_loadu_si256((const __m256i *)w);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)) : _mm512_cvtph_ps(bits);
}

static inline float total(sums p) {
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(p), high));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef struct {
    __m256 low, high; /* lanes 0-7, 8-15 */
} sums;
#define WIDTH 8
#define TILE_X 3
#define TILE_W 2

static inline sums zeros(void) { return (sums){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline sums x_values(const float *x) { return (sums){_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)}; }

static inline sums fma16(sums a, sums b, sums c) {
    return (sums){_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
}

static inline __m256 widened8(int bf16, const uint16_t *w) {
    __m128i bits = _mm_loadu_si128((const __m128i *)w);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)) : _mm256_cvtph_ps(bits);
}

static inline sums widened(int bf16, const uint16_t *w) { return (sums){widened8(bf16, w), widened8(bf16, w + 8)}; }
static inline float total(sums p) { return sum8(_mm256_add_ps(p.low, p.high)); }
#endif

#ifdef TILE_X
#define ALWAYS_INLINE_16 inline __attribute__((always_inline))

/* rows (<= TILE_X) rows of x against cols (<= TILE_W) weight rows of k values each (row stride k).
   Inlined with constant rows and cols, so its sums are registers. The next tile's weight rows are
   prefetched into L2 as these are read (pairs.h's pair_tile says why). */
static ALWAYS_INLINE_16 void tile(int bf16, int rows, int cols, const float *x, int64_t ldx, int64_t k,
                                  const uint16_t *w, float *y, int64_t ldy) {
    sums acc[TILE_X][TILE_W];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            acc[r][c] = zeros();
    for (int64_t i = 0; i < k; i += STEP) {
        if (i % 32 == 0)
            for (int c = 0; c < cols; c++)
                __builtin_prefetch(w + (cols + c) * k + i, 0, 2);
        sums v[TILE_W];
        for (int c = 0; c < cols; c++)
            v[c] = widened(bf16, w + c * k + i);
        for (int r = 0; r < rows; r++) {
            sums xr = x_values(x + r * ldx + i);
            for (int c = 0; c < cols; c++)
                acc[r][c] = fma16(v[c], xr, acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            y[r * ldy + c] = total(acc[r][c]);
}

/* tile with `rows` (1 .. TILE_X) made a constant. */
static ALWAYS_INLINE_16 void rows_tile(int bf16, int64_t rows, int cols, const float *x, int64_t ldx, int64_t k,
                                       const uint16_t *w, float *y, int64_t ldy) {
    switch (rows) {
    case 1: tile(bf16, 1, cols, x, ldx, k, w, y, ldy); return;
#if TILE_X > 2
    case 2: tile(bf16, 2, cols, x, ldx, k, w, y, ldy); return;
#endif
#if TILE_X > 3
    case 3: tile(bf16, 3, cols, x, ldx, k, w, y, ldy); return;
#endif
    default: tile(bf16, TILE_X, cols, x, ldx, k, w, y, ldy);
    }
}

/* Weight rows w[0 .. cols) (cols constant) against every row of x, TILE_X at a time. */
static ALWAYS_INLINE_16 void weight_rows(int bf16, int cols, const float *x, int64_t m, int64_t ldx, int64_t k,
                                         const uint16_t *w, float *y, int64_t ldy) {
    for (int64_t i = 0; i < m; i += TILE_X)
        rows_tile(bf16, m - i, cols, x + i * ldx, ldx, k, w, y + i * ldy, ldy);
}

/* x's rows ROW_BLOCK at a time, each block against every weight row before the next: a block of a
   prompt's rows stays in the caches while the weight rows pass (with all 1024 rows of 5632 values,
   23 MB, read again for every tile of weight rows, the product ran 2.3x slower). */
#define ROW_BLOCK 128
static ALWAYS_INLINE_16 void products(int bf16, const float *x, int64_t m, int64_t ldx, int64_t k,
                                      const uint16_t *w, float *y, int64_t ldy, int64_t first, int64_t last) {
    for (int64_t i = 0; i < m; i += ROW_BLOCK, x += ROW_BLOCK * ldx, y += ROW_BLOCK * ldy) {
        int64_t rows = m - i < ROW_BLOCK ? m - i : ROW_BLOCK, j = first;
        for (; j + TILE_W <= last; j += TILE_W)
            weight_rows(bf16, TILE_W, x, rows, ldx, k, w + j * k, y + j, ldy);
#if TILE_W > 2
        for (; j + 2 <= last; j += 2)
            weight_rows(bf16, 2, x, rows, ldx, k, w + j * k, y + j, ldy);
#endif
        for (; j < last; j++)
            weight_rows(bf16, 1, x, rows, ldx, k, w + j * k, y + j, ldy);
    }
}

/* The floats a vector of this build holds: 16 (AVX-512), 8 (AVX2) or 1 (plain C). */
int sixteen_bit_width(void) {
    return WIDTH;
}

void matmul_sixteen(int bf16, const float *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *w, float *y,
                    int64_t ldy, int64_t first, int64_t last) {
    if (bf16)
        products(1, x, m, ldx, k, w, y, ldy, first, last);
    else
        products(0, x, m, ldx, k, w, y, ldy, first, last);
}
#else
int sixteen_bit_width(void) {
    return 1;
}

static float value(int bf16, uint16_t bits) {
    return bf16 ? bf16_to_float(bits) : (float)f16_from_bits(bits);
}

void matmul_sixteen(int bf16, const float *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *w, float *y,
                    int64_t ldy, int64_t first, int64_t last) {
    for (int64_t j = first; j < last; j++)
        for (int64_t i = 0; i < m; i++) {
            float p[STEP] = {0}, s[8];
            for (int64_t c = 0; c < k; c++)
                p[c % STEP] = fmaf(value(bf16, w[j * k + c]), x[i * ldx + c], p[c % STEP]);
            for (int l = 0; l < 8; l++)
                s[l] = p[l] + p[8 + l];
            y[i * ldy + j] = sum8_of(s);
        }
}
#endif
