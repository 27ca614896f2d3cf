/* GGUF's blocks of 32 values (Q4_0, Q4_1, Q8_0), as llama.cpp's files store them, and 16-bit
values (F16, BF16: 32 of them taken as a block with no scale), dequantized and multiplied without a
widened copy (gguf_blocks.py); the 16-bit ones' product is sixteen_bit.c's.

A block: its float16 scale d, for Q4_1 a float16 minimum m, then its quants. Q4_0: 16 bytes of
nibbles, value (q - 8) * d; Q4_1: value q * d + m; the low nibbles are values 0..15, the high ones
16..31. Q8_0: 32 signed bytes, value q * d. Values are made in float32 as gguf_reader.py's torch
code makes them (a product, then a sum, no fused multiply-add), so dequantizing is bit-equal to
it; the product differs from dequantize-then-multiply only in the order of its sums. A 16-bit
value widens to float32 exactly.

Each function does the rows [first, last) of its arguments, so the caller splits over threads.
*/

#include "common.h"
#include "pairs.h"

#define BLOCK 32

enum format { GROUPS = -1, Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, F16 = 3, BF16 = 4 };

static int64_t block_bytes(int format) {
    return format == Q4_0 ? 18 : format == Q4_1 ? 20 : format == Q8_0 ? 34 : 2 * BLOCK;
}

static void block_values(int format, const uint8_t *b, float *v) {
    if (format == F16 || format == BF16) {
        uint16_t bits[BLOCK];
        memcpy(bits, b, sizeof bits);
        for (int i = 0; i < BLOCK; i++)
            v[i] = format == F16 ? (float)f16_from_bits(bits[i]) : bf16_to_float(bits[i]);
        return;
    }
    float d = half_at(b);
    if (format == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < BLOCK; i++)
            v[i] = (float)q[i] * d;
    } else if (format == Q4_0) {
        const uint8_t *q = b + 2;
        for (int i = 0; i < BLOCK / 2; i++) {
            v[i] = (float)((q[i] & 15) - 8) * d;
            v[i + BLOCK / 2] = (float)((q[i] >> 4) - 8) * d;
        }
    } else {
        float m = half_at(b + 2);
        const uint8_t *q = b + 4;
        for (int i = 0; i < BLOCK / 2; i++) {
            v[i] = (float)(q[i] & 15) * d + m;
            v[i + BLOCK / 2] = (float)(q[i] >> 4) * d + m;
        }
    }
}

/* y[i, j] = sum over c of x[i, c] * w[j, c] for the rows i < m of x (float32, k values each, row
   stride ldx) and the weight rows first <= j < last (each k / BLOCK blocks); y float32, row stride ldy. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The block's values as four vectors of eight, made as block_values makes them. */
static void block_vectors(int format, const uint8_t *b, __m256 w[4]) {
    if (format == F16 || format == BF16) {
        for (int q = 0; q < 4; q++) {
            __m128i bits = _mm_loadu_si128((const __m128i *)(b + 16 * q));
            w[q] = format == F16 ? _mm256_cvtph_ps(bits)
                                 : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
        }
        return;
    }
    __m256 d = _mm256_set1_ps(half_at(b));
    if (format == Q8_0) {
        for (int q = 0; q < 4; q++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * q));
            w[q] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
        }
        return;
    }
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + (format == Q4_1 ? 4 : 2)));
    __m128i mask = _mm_set1_epi8(15);
    __m128i low = _mm_and_si128(raw, mask), high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    __m256 m = _mm256_set1_ps(format == Q4_1 ? half_at(b + 2) : 0.0f), eight = _mm256_set1_ps(8.0f);
    for (int q = 0; q < 4; q++) {
        __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[q]));
        w[q] = format == Q4_0 ? _mm256_mul_ps(_mm256_sub_ps(c, eight), d) : _mm256_add_ps(_mm256_mul_ps(c, d), m);
    }
}

/* One weight row against up to ROWS rows of x: each block's values made once, in registers. */
#define ROWS 8
static void row_block(int format, const float *x, int64_t rows, int64_t ldx, int64_t k, const uint8_t *b,
                      float *y, int64_t ldy) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++)
        acc[r] = _mm256_setzero_ps();
    int64_t bytes = block_bytes(format);
    for (int64_t start = 0; start < k; start += BLOCK, b += bytes) {
        __m256 w[4];
        block_vectors(format, b, w);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * ldx + start;
            for (int q = 0; q < 4; q++)
                acc[r] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xr + 8 * q), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        y[r * ldy] = sum8(acc[r]);
}

/* WIDE weight rows against one row of x. There row_block's sum is one chain of dependent
   multiply-adds, each waiting for the one before, and the chain, not the dequantizing, sets the
   time; here the sums of WIDE weight rows advance side by side. Each is still summed exactly as
   row_block sums it, so a row's result does not depend on how many rows came with it. */
#define WIDE 4
static void wide_block(int format, const float *x, int64_t k, const uint8_t *b, int64_t row_bytes, float *y) {
    __m256 acc[WIDE];
    for (int c = 0; c < WIDE; c++)
        acc[c] = _mm256_setzero_ps();
    int64_t bytes = block_bytes(format);
    for (int64_t start = 0, at = 0; start < k; start += BLOCK, at += bytes)
        for (int c = 0; c < WIDE; c++) {
            __m256 w[4];
            block_vectors(format, b + c * row_bytes + at, w);
            for (int q = 0; q < 4; q++)
                acc[c] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x + start + 8 * q), acc[c]);
        }
    for (int c = 0; c < WIDE; c++)
        y[c] = sum8(acc[c]);
}

#ifdef PAIRS_512
/* scale_at for the GGUF blocks. */
static ALWAYS_INLINE int64_t block_scale(int format, int64_t unit) {
    return unit * block_bytes(format);
}

/* pair_values for the GGUF blocks: block `unit` of rows a and b. */
static ALWAYS_INLINE void block_pair(int format, const uint8_t *a, const uint8_t *b, int64_t unit, const float s[4],
                                     int rows, __m512 w[8]) {
    int64_t at = unit * block_bytes(format);
    a += at, b += at;
    if (format == Q8_0) { /* as the 256-bit code: each code converted, times the scale */
        __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[2]));
        for (int q = 0; q < 4; q++) {
            __m128i eight = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(a + 2 + 8 * q)),
                                               _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * q)));
            w[q] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(eight)), d);
        }
        return;
    }
    int codes_at = format == Q4_1 ? 4 : 2, zero = format == Q4_0 ? 8 : 0;
    if (rows > 1) {
        converted(a + codes_at, b + codes_at, BLOCK / 2, s, zero, w);
        return;
    }
    __m512 table_a = code_table(s[0], s[1], zero), table_b = code_table(s[2], s[3], zero);
    __m512i raw = _mm512_castsi256_si512(pair_of_16(a + codes_at, b + codes_at));
    __m512i low = nibbles(raw, 16), high = nibbles(_mm512_srli_epi16(raw, 4), 16);
    for (int q = 0; q < 4; q++)
        w[q] = looked_up(q < 2 ? low : high, picks(8 * (q % 2), 16 + 8 * (q % 2)), table_a, table_b);
}

static void block_pairs(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w,
                        int64_t row_bytes, float *y, int64_t ldy, int64_t *first, int64_t last) {
#define FORMAT(f) case f: pair_products(block_pair, block_scale, f, BLOCK, x, m, ldx, k, w, row_bytes, y, ldy, first, \
                                        last); return;
    switch (format) { /* a copy for each format, its tests on `format` gone */
    FORMAT(Q4_0) FORMAT(Q4_1) FORMAT(Q8_0)
    }
#undef FORMAT
}
#endif

void matmul_blocks(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y,
                   int64_t ldy, int64_t first, int64_t last) {
    int64_t row_bytes = k / BLOCK * block_bytes(format), j = first;
#ifdef PAIRS_512
    block_pairs(format, x, m, ldx, k, w, row_bytes, y, ldy, &j, last); /* all but a few rows, two at a time */
#endif
    if (m == 1)
        for (; j + WIDE <= last; j += WIDE)
            wide_block(format, x, k, w + j * row_bytes, row_bytes, y + j);
    for (; j < last; j++) /* a weight row stays in L1 while every block of x passes */
        for (int64_t i = 0; i < m; i += ROWS)
            row_block(format, x + i * ldx, m - i < ROWS ? m - i : ROWS, ldx, k, w + j * row_bytes, y + i * ldy + j,
                      ldy);
}
#else
void matmul_blocks(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y,
                   int64_t ldy, int64_t first, int64_t last) {
    int64_t per_row = k / BLOCK, bytes = block_bytes(format);
    float v[BLOCK];
    for (int64_t j = first; j < last; j++) {
        for (int64_t i = 0; i < m; i++)
            y[i * ldy + j] = 0.0f;
        const uint8_t *b = w + j * per_row * bytes;
        for (int64_t g = 0; g < per_row; g++, b += bytes) {
            block_values(format, b, v);
            add_dots(x + g * BLOCK, m, ldx, v, BLOCK, y + j, ldy);
        }
    }
}
#endif

/* blocks: rows of n / BLOCK blocks; out: rows of n values of dtype (row r at out + r * row_stride).
   A prompt step widens every matrix so, once per step: into float32, eight values at a time where
   the CPU has AVX2 (the scalar loop took 17% of a SmolLM2 prompt step). */
void dequantize_blocks(int format, const uint8_t *blocks, int64_t n, void *out, int dtype, int64_t row_stride,
                       int64_t first, int64_t last) {
    int64_t per_row = n / BLOCK, bytes = block_bytes(format);
    float v[BLOCK];
    for (int64_t r = first; r < last; r++) {
        const uint8_t *b = blocks + r * per_row * bytes;
        for (int64_t i = 0; i < per_row; i++, b += bytes) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            if (dtype == FLOAT32) {
                __m256 w[4];
                block_vectors(format, b, w);
                for (int q = 0; q < 4; q++)
                    _mm256_storeu_ps((float *)out + r * row_stride + i * BLOCK + 8 * q, w[q]);
                continue;
            }
#endif
            block_values(format, b, v);
            store_values(v, out, dtype, r * row_stride + i * BLOCK, BLOCK);
        }
    }
}

/* A product over every weight row, on `threads` OpenMP threads (where built with OpenMP), in chunks
   of CHUNK rows: handed out by OpenMP's own pool, a decode step's small products are split over
   the cores (Python's thread hand-off cost more than they took). format: a GGUF block format, or
   GROUPS for quant.py's groups (quant4.c's matmul_groups). A 16-bit matrix (sixteen_bit.c's
   matmul_sixteen) goes in chunks of 24 rows, whole tiles of its six. */
#define CHUNK 16
void matmul_all(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y,
                int64_t ldy, int64_t n, int threads) {
    int64_t chunk = format == F16 || format == BF16 ? 24 : CHUNK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j += chunk) {
        int64_t last = j + chunk < n ? j + chunk : n;
        if (format == GROUPS)
            matmul_groups(x, m, ldx, k, w, y, ldy, j, last);
        else if (format == F16 || format == BF16)
            matmul_sixteen(format == BF16, x, m, ldx, k, (const uint16_t *)w, y, ldy, j, last);
        else
            matmul_blocks(format, x, m, ldx, k, w, y, ldy, j, last);
    }
}
