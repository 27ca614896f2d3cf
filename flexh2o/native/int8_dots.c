/* GGUF's Q4_0, Q4_1 and Q8_0 blocks multiplied by int8 activations, as llama.cpp multiplies them:
each row of x is quantized alone, per block of 32 values, to signed bytes q with a float scale
dx = max|x| / 127 (x * 127 / max|x| rounded to nearest) and the block's sum sx = dx * (sum of q),
and a weight block against it is one integer dot product.

A weight value is q * dw + mw with Q4_1's minimum mw, Q4_0's (q - 8) * dw taken as mw = -8 dw, and
Q8_0's signed q * dw with no mw. So block b adds dw * dx * <q, qx> + mw * sx. Its integer dot is
kept as a few exact partial sums (lanes), each made a float, multiplied by dw, and added times dx
(a fused multiply-add) into one of sixteen float sums A:
- Q8_0: eight lanes of four neighbouring products (the int32 lanes vpdpbusd, or maddubs then madd,
  leave in a 256-bit vector), the even blocks' into A[0..7], the odd ones' into A[8..15].
- Q4_0 and Q4_1: four lanes, lane l the products of values 4l..4l+3 and 16+4l..16+4l+3 (the codes
  of the same four bytes, low nibbles then high), block b's into A[4 (b % 4) + l]. With 512-bit
  vectors, one vpdpbusd pair then takes four blocks, a lane each from the low and the high nibbles:
  half the float work a block of eight lanes had (results/kernel_speed.md).
The mw * sx terms go by fused multiply-adds into the sums L: Q4_1's and Q4_0's L[b % 4]. Each sum
takes its blocks in order; at the end y = sum8(A[l] + A[8 + l]) (common.h's sum8 order), plus
(L[0] + L[1]) + (L[2] + L[3]) for Q4_0 and Q4_1. Every path (AVX512-VNNI, AVX-VNNI or AVX2, plain C)
does exactly these operations, so all give the same bits, and a (row of x, weight row) result does
not depend on the other rows or the threads. The plain C steps are here; the vector paths' tiles are
in int8_tiles.h.

A block of x whose values are not all finite gets a NaN scale, so its rows' results are NaN.
A quantized row: its k bytes q, then its k / 32 scales dx, then its k / 32 sums sx (floats).
*/

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "common.h"

#define BLOCK 32
enum int8_format { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 }; /* blocks.c's numbers */

static int64_t weight_block_bytes(int format) {
    return format == Q4_0 ? 18 : format == Q4_1 ? 20 : 34;
}

int64_t int8_row_bytes(int64_t k) {
    return k + 8 * (k / BLOCK);
}

/* q, dx and sx of a block whose largest magnitude is amax; `bad`: a value not finite. */
static void finish_block(const float *v, float amax, int bad, int8_t *q, float *dx, float *sx) {
    if (bad) {
        memset(q, 0, BLOCK);
        *dx = *sx = NAN;
        return;
    }
    float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        q[i] = (int8_t)nearbyintf(v[i] * inverse);
        sum += q[i];
    }
    *dx = amax / 127.0f;
    *sx = *dx * (float)sum;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static void quantize_block(const float *v, int8_t *q, float *dx, float *sx) {
    __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_setzero_ps(), beyond = _mm256_setzero_ps();
    __m256 x[4];
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(v + 8 * j);
        __m256 a = _mm256_andnot_ps(sign, x[j]);
        largest = _mm256_max_ps(a, largest);
        beyond = _mm256_or_ps(beyond, _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    if (_mm256_movemask_ps(beyond)) {
        finish_block(v, amax, 1, q, dx, sx);
        return;
    }
    __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inverse)); /* to nearest, ties to even: nearbyintf's */
        sum = _mm256_add_epi32(sum, c[j]);
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    *dx = amax / 127.0f;
    *sx = *dx * (float)_mm_cvtsi128_si32(s);
}
#else
static void quantize_block(const float *v, int8_t *q, float *dx, float *sx) {
    float amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < BLOCK; i++) {
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
        bad |= !(a <= FLT_MAX);
    }
    finish_block(v, amax, bad, q, dx, sx);
}
#endif

static void quantize_row(const float *x, int64_t k, uint8_t *out) {
    int64_t blocks = k / BLOCK;
    float *dx = (float *)(out + k);
    for (int64_t b = 0; b < blocks; b++)
        quantize_block(x + b * BLOCK, (int8_t *)out + b * BLOCK, dx + b, dx + blocks + b);
}

/* rows of x [m, k] (row stride ldx) into m quantized rows of int8_row_bytes(k) bytes each. */
void quantize_int8(const float *x, int64_t m, int64_t ldx, int64_t k, uint8_t *out) {
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * ldx, k, out + i * int8_row_bytes(k));
}

/* The plain C step of a (row of x, weight row) pair: Q8_0 block `block` against the row's block at x
   (scale dx), into the float sums A[8] of its parity. */
static void block_step(const uint8_t *block, const int8_t *x, float dx, float *A) {
    float d = half_at(block);
    int lanes[8] = {0};
    for (int v = 0; v < BLOCK; v++)
        lanes[v / 4] += ((const int8_t *)block)[2 + v] * x[v];
    for (int l = 0; l < 8; l++)
        A[l] = fmaf((float)lanes[l] * d, dx, A[l]);
}

/* The same for a Q4_0 or Q4_1 block (the row's block sum sx): its four lanes into A[4] and its
   mw * sx into L, the sums of its place among four. */
static void quad_step(int format, const uint8_t *block, const int8_t *x, float dx, float sx, float *A, float *L) {
    float d = half_at(block);
    const uint8_t *codes = block + (format == Q4_1 ? 4 : 2);
    int lanes[4] = {0};
    for (int v = 0; v < BLOCK; v++)
        lanes[v % 16 / 4] += ((codes[v % 16] >> (v < 16 ? 0 : 4)) & 15) * x[v];
    for (int l = 0; l < 4; l++)
        A[l] = fmaf((float)lanes[l] * d, dx, A[l]);
    *L = fmaf(format == Q4_1 ? half_at(block + 2) : -8.0f * d, sx, *L);
}

/* Block b of the row at x (its scales dx, sums sx) into the sums A[16] and L[4] of its format. */
static void any_step(int format, const uint8_t *block, const int8_t *x, const float *dx, const float *sx, int64_t b,
                     float *A, float *L) {
    if (format == Q8_0)
        block_step(block, x, dx[b], A + 8 * (b % 2));
    else
        quad_step(format, block, x, dx[b], sx[b], A + 4 * (b % 4), L + b % 4);
}

/* A pair's result from its sums: A[16] and (Q4_0, Q4_1) L[4]. */
static float pair_result(int format, const float *A, const float *L) {
    float S[8];
    for (int l = 0; l < 8; l++)
        S[l] = A[l] + A[8 + l];
    float sum = sum8_of(S);
    return format == Q8_0 ? sum : sum + ((L[0] + L[1]) + (L[2] + L[3]));
}

#define COLS 4 /* weight rows a tile multiplies side by side */

/* Bytes [at, at + size) (size <= 128) of the weight rows three tiles on (each tile `cols` rows of
   wrow bytes), into L2: pairs.h's pair_tile says why; one tile on was too near, and a step's two
   Q8_0 blocks span two lines (with only the first prefetched, a cold Q8_0 product ran at half its
   warm speed). */
static inline void prefetch_ahead(const uint8_t *w, int64_t wrow, int cols, int64_t at, int64_t size) {
    for (int c = 0; c < cols; c++) {
        const char *row = (const char *)w + (3 * cols + c) * wrow + at;
        __builtin_prefetch(row, 0, 2); /* (_mm_prefetch here: GCC 12 left every one out) */
        if (size > 64)
            __builtin_prefetch(row + 64, 0, 2);
    }
}

#include "int8_tiles.h" /* the tiles on vectors, where the CPU has them: ROWS */

#ifdef ROWS
#define TILE_OF(format, rows, cols) tile(format, qx, qrow, rows, w, wrow, cols, k, y, ldy)
#define TILE_FOR_EACH_FORMAT(rows, cols) \
    if (format == Q4_0) TILE_OF(Q4_0, rows, cols); \
    else if (format == Q4_1) TILE_OF(Q4_1, rows, cols); \
    else TILE_OF(Q8_0, rows, cols)

static void full_tile(int format, const uint8_t *qx, int64_t qrow, const uint8_t *w, int64_t wrow, int64_t k,
                      float *y, int64_t ldy) {
    TILE_FOR_EACH_FORMAT(ROWS, COLS);
}

static void row_tile(int format, const uint8_t *qx, int64_t qrow, const uint8_t *w, int64_t wrow, int64_t k,
                     float *y, int64_t ldy) {
    TILE_FOR_EACH_FORMAT(1, COLS);
}

static void one_pair(int format, const uint8_t *qx, int64_t qrow, const uint8_t *w, int64_t wrow, int64_t k,
                     float *y, int64_t ldy) {
    TILE_FOR_EACH_FORMAT(1, 1);
}

/* y[i, j] for the quantized rows i < m and the weight rows first <= j < last. */
void matmul_int8_rows(int format, const uint8_t *qx, int64_t m, int64_t k, const uint8_t *w, float *y, int64_t ldy,
                      int64_t first, int64_t last) {
    int64_t qrow = int8_row_bytes(k), wrow = k / BLOCK * weight_block_bytes(format);
    for (int64_t j = first; j < last; j += COLS) {
        const uint8_t *wj = w + j * wrow;
        for (int64_t i = 0; i < m;) {
            const uint8_t *xi = qx + i * qrow;
            float *yij = y + i * ldy + j;
            if (last - j < COLS) {
                for (int64_t c = 0; c < last - j; c++)
                    one_pair(format, xi, qrow, wj + c * wrow, wrow, k, yij + c, ldy);
                i++;
            } else if (m - i >= ROWS) {
                full_tile(format, xi, qrow, wj, wrow, k, yij, ldy);
                i += ROWS;
            } else {
                row_tile(format, xi, qrow, wj, wrow, k, yij, ldy);
                i++;
            }
        }
    }
}
#else
void matmul_int8_rows(int format, const uint8_t *qx, int64_t m, int64_t k, const uint8_t *w, float *y, int64_t ldy,
                      int64_t first, int64_t last) {
    int64_t blocks = k / BLOCK, bytes = weight_block_bytes(format), qrow = int8_row_bytes(k);
    for (int64_t i = 0; i < m; i++) {
        const int8_t *x = (const int8_t *)(qx + i * qrow);
        const float *dx = (const float *)(qx + i * qrow + k);
        for (int64_t j = first; j < last; j++) {
            float A[16] = {0}, L[4] = {0};
            for (int64_t b = 0; b < blocks; b++)
                any_step(format, w + (j * blocks + b) * bytes, x + b * BLOCK, dx, dx + blocks, b, A, L);
            y[i * ldy + j] = pair_result(format, A, L);
        }
    }
}
#endif

/* y[i, j] = the product of row i of x (float32 [m, k], row stride ldx) with weight row j (blocks of
   `format`), j < n, y's row stride ldy: x quantized on the calling thread (a few microseconds at 32
   rows; handing it to the threads would cost a second wait for all of them), then the weight rows
   split over `threads` in chunks of 16. Returns 0, or -1 where no memory was left for the quantized
   rows. */
#define CHUNK 16
int matmul_int8(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y,
                int64_t ldy, int64_t n, int threads) {
    uint8_t *qx = malloc((size_t)(m * int8_row_bytes(k)));
    if (qx == NULL)
        return -1;
    quantize_int8(x, m, ldx, k, qx);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j += CHUNK)
        matmul_int8_rows(format, qx, m, k, w, y, ldy, j, j + CHUNK < n ? j + CHUNK : n);
    free(qx);
    return 0;
}
