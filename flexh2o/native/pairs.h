/* The float32 products two weight rows at a time, on CPUs with AVX-512 (blocks.c, quant4.c).

The 256-bit code sums each weight row (against one row of x) in an eight-lane accumulator, one
multiply-add per eight values in block order, then adds the lanes up with sum8. Here a 512-bit
register holds two such accumulators, weight row a's in its low half and row b's in its high half,
multiplied by x's eight values repeated in both halves: every lane goes through exactly the same
float operations as before, so the results are bit-equal, with about half the instructions a block.

A weight row's values come in units (a GGUF block of 32, a quant.py group of 64): `pair_values`
makes a unit of both rows as vectors of 16 (row a's eight values in lanes 0-7, row b's in 8-15),
with the same float operations as the 256-bit code. The 4-bit formats make them with a table: the 16 values a block's
codes can stand for, each made as one code's value is made (code * scale + minimum, two roundings),
looked up by code; one lookup replaces a conversion, a product and a sum. vpermb moves each code to
its lane, so this needs AVX512-VBMI too (Ice Lake and later). That is for one row of x; a tile of
several rows makes them as the 256-bit code does (`converted`): the lookups are shuffles, and on a
Zen 4 they held back the tile's multiply-adds (converted, Q4_0 and Q4_1 at 8 and 32 rows were
1.11-1.16x faster, the groups 1.03-1.04x), where at one row the table is 1.13x faster.
*/

#ifndef FLEXH2O_PAIRS_H
#define FLEXH2O_PAIRS_H

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__FMA__) && defined(__F16C__)
#define PAIRS_512 1
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* The values of `unit` of weight rows a and b, a vector of 16 for each eight of a row's; `scales`:
   their float16 scale and minimum as floats (a's, then b's), where scale_at gives them; `rows`: the
   rows of x they will be multiplied with. */
typedef void (*pair_values)(int format, const uint8_t *a, const uint8_t *b, int64_t unit, const float scales[4],
                            int rows, __m512 w[8]);
/* Where a unit's float16 scale is (its minimum follows it), from its row's start. */
typedef int64_t (*scale_at)(int format, int64_t unit);

/* Eight floats of x in both halves. */
static inline __m512 twice(const float *x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)x)));
}

static inline void store_sums(__m512 acc, float *a, float *b) {
    *a = sum8(_mm512_castps512_ps256(acc));
    *b = sum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

/* vpermb's selector putting byte `from_a + l` into the low byte of lane l and byte `from_b + l` into
   lane 8 + l's (l < 8), the lane's other bytes taking byte 0 (looked_up reads only a lane's low
   five bits). */
static inline __m512i picks(int from_a, int from_b) {
    __m512i lane = _mm512_set_epi32(7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i from = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(from_a), _mm512_set1_epi32(from_b));
    return _mm512_add_epi32(lane, from);
}

/* code * scale + low for the codes 0..15 (codes 0..15 minus `zero` where zero is 8: Q4_0's), made as
   the 256-bit code makes a value: converted, less zero, times the scale, plus the minimum. */
static inline __m512 code_table(float scale, float low, int zero) {
    __m512 codes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    if (zero)
        return _mm512_mul_ps(_mm512_sub_ps(codes, _mm512_set1_ps((float)zero)), _mm512_set1_ps(scale));
    return _mm512_add_ps(_mm512_mul_ps(codes, _mm512_set1_ps(scale)), _mm512_set1_ps(low));
}

/* The values of 16 codes: the code bytes at `at` in `codes` (bit 4 set in row b's), from table a or b. */
static inline __m512 looked_up(__m512i codes, __m512i at, __m512 table_a, __m512 table_b) {
    return _mm512_permutex2var_ps(table_a, _mm512_permutexvar_epi8(at, codes), table_b);
}

/* (bytes & 15) | 16 in the bytes of row b (those from `b_from` on): the codes as looked_up takes them. */
static inline __m512i nibbles(__m512i bytes, int b_from) {
    __m512i row_b = _mm512_maskz_set1_epi8(~0ull << b_from, 16);
    return _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi8(15), row_b, 0xea); /* (a & b) | c */
}

/* The values of the 4-bit codes in `bytes` (16 or 32) bytes at a and at b (byte i holds code i in its
   low nibble and code i + bytes in its high one), in looked_up's lanes, made as the 256-bit code
   makes them: converted, less `zero`, times the scale, plus the minimum. */
static ALWAYS_INLINE void converted(const uint8_t *a, const uint8_t *b, int bytes, const float s[4], int zero,
                                    __m512 *w) {
    __m512 scale = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[2]));
    __m512 low = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s[1]), _mm512_set1_ps(s[3]));
    for (int h = 0; h < bytes / 8; h++) {
        __m128i eight = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(a + 8 * h)),
                                           _mm_loadl_epi64((const __m128i *)(b + 8 * h)));
        __m512i codes = _mm512_cvtepu8_epi32(eight);
        __m512i halves[2] = {_mm512_and_si512(codes, _mm512_set1_epi32(15)), _mm512_srli_epi32(codes, 4)};
        for (int n = 0; n < 2; n++) {
            __m512 c = _mm512_cvtepi32_ps(halves[n]);
            w[h + n * bytes / 8] = zero ? _mm512_mul_ps(_mm512_sub_ps(c, _mm512_set1_ps((float)zero)), scale)
                                        : _mm512_add_ps(_mm512_mul_ps(c, scale), low);
        }
    }
}

/* 16 bytes at a, then 16 at b. */
static inline __m256i pair_of_16(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* 32 bytes at a, then 32 at b. */
static inline __m512i pair_of_32(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* The scales (and minimums) at `at` in the weight rows 0 .. 2 * pairs - 1 (pairs <= 4) as floats, in
   s: converted together, not one by one (a scalar conversion each cost more than the lookups they
   feed), and left in memory, where each is broadcast by a load rather than shuffled out of a register. */
static ALWAYS_INLINE void unit_scales(int64_t at, int pairs, const uint8_t *w, int64_t row_bytes, float s[16]) {
    int b[8] = {0};
    for (int c = 0; c < 2 * pairs; c++)
        b[c] = (int)bits32(w + c * row_bytes + at);
    _mm512_storeu_ps(s, _mm512_cvtph_ps(_mm256_set_epi32(b[7], b[6], b[5], b[4], b[3], b[2], b[1], b[0])));
    __asm__("" : "+m"(*(float(*)[16])s)); /* (the compiler would shuffle them out otherwise) */
}

#define TILE_ROWS 8 /* rows of x a tile takes at most */

/* y[r * ldy + c] = the product of row r of x (r < rows) and weight row c (c < 2 * pairs), the weight
   rows `row_bytes` apart from w, each of k / size units of `size` values. size, pairs and rows:
   constants, so that the compiler unrolls the loops over them and keeps every sum in a register
   (pairs * rows <= 16). The next tile's rows are prefetched as this one's are read: reading a
   matrix from memory, the hardware's own prefetching left the product waiting (1.3-1.6x slower).
   They are prefetched into L2, not L1: into L1, reading and multiplying took turns (at one row of
   x a cold F16 layer, then multiplied here, took about its time warm plus its time to read: 20
   GB/s where plain loads read 35; into L2, 29). */
static ALWAYS_INLINE void pair_tile(pair_values values, scale_at scales, int format, int size, int pairs, int rows,
                                    const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t row_bytes,
                                    float *y, int64_t ldy) {
    __m512 acc[16];
    for (int t = 0; t < pairs * rows; t++)
        acc[t] = _mm512_setzero_ps();
    int64_t unit_bytes = row_bytes / (k / size);
    for (int64_t u = 0; u < k / size; u++) {
        for (int c = 0; c < 2 * pairs; c++)
            _mm_prefetch((const char *)w + (2 * pairs + c) * row_bytes + u * unit_bytes, _MM_HINT_T1);
        float s[16];
        unit_scales(scales(format, u), pairs, w, row_bytes, s);
        __m512 v[4][8];
        for (int p = 0; p < pairs; p++)
            values(format, w + 2 * p * row_bytes, w + (2 * p + 1) * row_bytes, u, s + 4 * p, rows, v[p]);
        /* each x read once for every pair (read pair by pair, the compiler kept them all and spilled) */
        for (int q = 0; q < size / 8; q++)
            for (int r = 0; r < rows; r++) {
                __m512 xr = twice(x + r * ldx + size * u + 8 * q);
                for (int p = 0; p < pairs; p++)
                    acc[p * rows + r] = _mm512_fmadd_ps(v[p][q], xr, acc[p * rows + r]);
            }
    }
    for (int p = 0; p < pairs; p++)
        for (int r = 0; r < rows; r++)
            store_sums(acc[p * rows + r], y + r * ldy + 2 * p, y + r * ldy + 2 * p + 1);
}

/* pair_tile over two pairs of weight rows, with `rows` (1 .. TILE_ROWS) made a constant. */
static ALWAYS_INLINE void rows_tile(pair_values values, scale_at scales, int format, int size, int64_t rows,
                                    const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t row_bytes,
                                    float *y, int64_t ldy) {
#define TILE(n) case n: pair_tile(values, scales, format, size, 2, n, x, ldx, k, w, row_bytes, y, ldy); return;
    switch (rows) {
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7)
    default: pair_tile(values, scales, format, size, 2, TILE_ROWS, x, ldx, k, w, row_bytes, y, ldy);
    }
#undef TILE
}

/* The weight rows [*first, last) four at a time (eight where x is one row: more sums side by side);
   *first is left at the rows left over (fewer than four). */
static ALWAYS_INLINE void pair_products(pair_values values, scale_at scales, int format, int size, const float *x,
                                        int64_t m, int64_t ldx, int64_t k, const uint8_t *w, int64_t row_bytes,
                                        float *y, int64_t ldy, int64_t *first, int64_t last) {
    int64_t j = *first;
    if (m == 1)
        for (; j + 8 <= last; j += 8)
            pair_tile(values, scales, format, size, 4, 1, x, ldx, k, w + j * row_bytes, row_bytes, y + j, ldy);
    for (; j + 4 <= last; j += 4)
        for (int64_t i = 0; i < m; i += TILE_ROWS)
            rows_tile(values, scales, format, size, m - i, x + i * ldx, ldx, k, w + j * row_bytes, row_bytes,
                      y + i * ldy + j, ldy);
    *first = j;
}
#endif

#endif
