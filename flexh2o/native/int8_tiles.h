/* int8_dots.c's tiles on vectors: AVX-512 (Q8_0 blocks two at a time, Q4_0 and Q4_1 four), or
AVX2 (one row of x, two blocks at a time). int8_dots.c includes this after its plain C steps, which
define the operations every path does (its header says which) and which the tiles' leftover blocks
take; a tile defines ROWS, the rows of x it takes at once.
*/

#ifndef FLEXH2O_INT8_TILES_H
#define FLEXH2O_INT8_TILES_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ROWS 4
#define INLINED static inline __attribute__((always_inline))

/* y's sums of rows (<= ROWS) rows and cols (<= COLS) weight rows from their sums, in registers
   (acc: A, lows: L, weight row c's at 4c), and the blocks from `from` on done in plain C. */
INLINED void finish(int format, const uint8_t *qx, int64_t qrow, int rows, const uint8_t *w, int64_t wrow, int cols,
                    int64_t k, int64_t from, __m512 acc[ROWS][COLS], __m512 *lows, float *y, int64_t ldy) {
    int64_t blocks = k / BLOCK, bytes = weight_block_bytes(format);
    for (int r = 0; r < rows; r++) {
        const uint8_t *row = qx + r * qrow;
        const float *dx = (const float *)(row + k);
        float L[4 * COLS] = {0};
        if (format != Q8_0)
            _mm512_storeu_ps(L, lows[r]);
        if (from == blocks) { /* pair_result's sums, in registers */
            for (int c = 0; c < cols; c++) {
                __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
                float sum = sum8(_mm256_add_ps(_mm512_castps512_ps256(acc[r][c]), high));
                y[r * ldy + c] = format == Q8_0 ? sum : sum + ((L[4 * c] + L[4 * c + 1]) + (L[4 * c + 2] + L[4 * c + 3]));
            }
            continue;
        }
        for (int c = 0; c < cols; c++) {
            float A[16];
            _mm512_storeu_ps(A, acc[r][c]);
            for (int64_t b = from; b < blocks; b++)
                any_step(format, w + c * wrow + b * bytes, (const int8_t *)row + b * BLOCK, dx, dx + blocks, b, A,
                         L + 4 * c);
            y[r * ldy + c] = pair_result(format, A, L + 4 * c);
        }
    }
}

/* rows (<= ROWS) quantized rows of x against cols (<= COLS) weight rows of Q8_0 blocks, two at a
   time: a 512-bit vector holds an even block's eight lanes, then the next odd one's. Inlined with
   constant arguments, so its arrays are registers. */
INLINED void pair_tile(const uint8_t *qx, int64_t qrow, int rows, const uint8_t *w, int64_t wrow, int cols,
                       int64_t k, float *y, int64_t ldy) {
    int64_t blocks = k / BLOCK, bytes = weight_block_bytes(Q8_0), pairs = blocks / 2 * 2;
    __m512 acc[ROWS][COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            acc[r][c] = _mm512_setzero_ps();
    __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512i scale_pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    for (int64_t b = 0; b < pairs; b += 2) {
        prefetch_ahead(w, wrow, cols, b * bytes, 2 * bytes);
        __m512i codes[COLS];
        __m512 dw[COLS];
        __mmask64 negative[COLS];
        for (int c = 0; c < cols; c++) {
            const uint8_t *even = w + c * wrow + b * bytes, *odd = even + bytes;
            uint32_t h0, h1; /* dw of blocks b and b + 1 */
            memcpy(&h0, even, 4);
            memcpy(&h1, odd, 4);
            __m128 heads = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)h0), (int)h1, 1));
            dw[c] = _mm512_permutexvar_ps(scale_pick, _mm512_castps128_ps512(heads));
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(even + 2))),
                                           _mm256_loadu_si256((const __m256i *)(odd + 2)), 1);
            negative[c] = _mm512_movepi8_mask(q);
            codes[c] = _mm512_abs_epi8(q);
        }
        for (int r = 0; r < rows; r++) {
            const uint8_t *row = qx + r * qrow;
            __m512i x = _mm512_loadu_si512(row + b * BLOCK);
            __m512 d = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(
                _mm_load_sd((const double *)((const float *)(row + k) + b)))));
            for (int c = 0; c < cols; c++) {
                __m512i s = _mm512_mask_sub_epi8(x, negative[c], _mm512_setzero_si512(), x);
                __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], s);
                acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lanes), dw[c]), d, acc[r][c]);
            }
        }
    }
    finish(Q8_0, qx, qrow, rows, w, wrow, cols, k, pairs, acc, NULL, y, ldy);
}

/* Blocks b .. b + t - 1 (t <= 4) of quad_tile: a last one of fewer than four taken as four with the
   missing blocks' codes, scales and x zero (adding zeros leaves a sum as it is: the sums start at +0,
   never -0). */
INLINED void quad_blocks(int format, const uint8_t *qx, int64_t qrow, int rows, const uint8_t *w, int64_t wrow,
                         int cols, int64_t k, int64_t b, int t, __m512 acc[ROWS][COLS], __m512 *lows) {
    int64_t blocks = k / BLOCK, bytes = weight_block_bytes(format);
    int at = format == Q4_1 ? 4 : 2; /* where a block's codes start */
    __m512i nibble = _mm512_set1_epi8(15);
    __m512i by_block = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512i dw_at = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    __m256i dw_at4 = _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0), mw_at = _mm256_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0);
    if (t == 4)
        prefetch_ahead(w, wrow, cols, b * bytes, 4 * bytes);
    __m512i low_codes[COLS], high_codes[COLS];
    __m512 dw[COLS];
    __m128 mw[COLS]; /* of blocks b .. b + 3 */
    for (int c = 0; c < cols; c++) {
        const uint8_t *first = w + c * wrow + b * bytes;
        __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(first + at)));
        int heads[4] = {(int)bits32(first)}; /* each block's first two words: dw, then (Q4_1) mw */
        for (int q = 1; q < t && q < 4; q++) {
            __m128i codes = _mm_loadu_si128((const __m128i *)(first + q * bytes + at));
            raw = q == 1 ? _mm512_inserti32x4(raw, codes, 1) : q == 2 ? _mm512_inserti32x4(raw, codes, 2)
                                                                      : _mm512_inserti32x4(raw, codes, 3);
            heads[q] = (int)bits32(first + q * bytes);
        }
        low_codes[c] = _mm512_and_si512(raw, nibble);
        high_codes[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        __m256 words = _mm256_cvtph_ps(_mm_setr_epi32(heads[0], heads[1], heads[2], heads[3]));
        dw[c] = _mm512_permutexvar_ps(dw_at, _mm512_castps256_ps512(words));
        mw[c] = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(words, format == Q4_1 ? mw_at : dw_at4));
        if (format == Q4_0)
            mw[c] = _mm_mul_ps(mw[c], _mm_set1_ps(-8.0f));
    }
    for (int c = cols; c < COLS; c++)
        mw[c] = _mm_setzero_ps();
    __m512 mws = _mm512_insertf32x4(_mm512_castps128_ps512(mw[0]), mw[1], 1);
    mws = _mm512_insertf32x4(_mm512_insertf32x4(mws, mw[2], 2), mw[3], 3);
    __mmask16 some = (__mmask16)((1u << t) - 1);
    for (int r = 0; r < rows; r++) {
        const uint8_t *row = qx + r * qrow + b * BLOCK;
        const float *dx = (const float *)(qx + r * qrow + k);
        __m512i x0, x1;
        __m128 d4, s4;
        if (t == 4) {
            x0 = _mm512_loadu_si512(row), x1 = _mm512_loadu_si512(row + 64);
            d4 = _mm_loadu_ps(dx + b), s4 = _mm_loadu_ps(dx + blocks + b);
        } else {
            x0 = _mm512_maskz_loadu_epi8(t >= 2 ? ~0ull : 0xffffffffull, row);
            x1 = _mm512_maskz_loadu_epi8(t == 3 ? 0xffffffffull : 0, row + 64);
            d4 = _mm_maskz_loadu_ps(some, dx + b), s4 = _mm_maskz_loadu_ps(some, dx + blocks + b);
        }
        __m512i x_low = _mm512_shuffle_i64x2(x0, x1, 0x88); /* each block's first 16 bytes */
        __m512i x_high = _mm512_shuffle_i64x2(x0, x1, 0xdd);
        __m512 d = _mm512_permutexvar_ps(by_block, _mm512_castps128_ps512(d4));
        for (int c = 0; c < cols; c++) {
            __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low_codes[c], x_low);
            lanes = _mm512_dpbusd_epi32(lanes, high_codes[c], x_high);
            acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lanes), dw[c]), d, acc[r][c]);
        }
        lows[r] = _mm512_fmadd_ps(mws, _mm512_broadcast_f32x4(s4), lows[r]);
    }
}

/* The same for Q4_0 or Q4_1 blocks, four at a time: a 512-bit vector holds the 16 bytes of codes of
   each of four blocks, and against their low nibbles x's values 0..15 of the same four blocks, against
   their high nibbles values 16..31: two vpdpbusd leave the four blocks' four lanes each. */
INLINED void quad_tile(int format, const uint8_t *qx, int64_t qrow, int rows, const uint8_t *w, int64_t wrow,
                       int cols, int64_t k, float *y, int64_t ldy) {
    int64_t blocks = k / BLOCK, quads = blocks / 4 * 4;
    __m512 acc[ROWS][COLS], lows[ROWS]; /* lows: weight row c's L in lanes 4c .. 4c + 3 */
    for (int r = 0; r < rows; r++) {
        lows[r] = _mm512_setzero_ps();
        for (int c = 0; c < cols; c++)
            acc[r][c] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < quads; b += 4)
        quad_blocks(format, qx, qrow, rows, w, wrow, cols, k, b, 4, acc, lows);
    if (quads < blocks)
        quad_blocks(format, qx, qrow, rows, w, wrow, cols, k, quads, (int)(blocks - quads), acc, lows);
    finish(format, qx, qrow, rows, w, wrow, cols, k, blocks, acc, lows, y, ldy);
}

INLINED void tile(int format, const uint8_t *qx, int64_t qrow, int rows, const uint8_t *w, int64_t wrow, int cols,
                  int64_t k, float *y, int64_t ldy) {
    if (format == Q8_0)
        pair_tile(qx, qrow, rows, w, wrow, cols, k, y, ldy);
    else
        quad_tile(format, qx, qrow, rows, w, wrow, cols, k, y, ldy);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ROWS 1
/* The eight lane sums of u[i] * s[i], u unsigned, s signed (no product pair reaches the int16 limit
   of maddubs: a nibble or |Q8_0 code| <= 128 times |x code| <= 127). */
static inline __m256i lane_dots(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Q8_0 block b of one quantized row against cols (<= COLS) weight rows, into the sums of b's parity. */
static inline __attribute__((always_inline)) void step(const uint8_t *row, int64_t k, int64_t b, const uint8_t *w,
                                                       int64_t wrow, int cols, __m256 *acc) {
    int64_t bytes = weight_block_bytes(Q8_0);
    __m256i x = _mm256_loadu_si256((const __m256i *)(row + b * BLOCK));
    __m256 d = _mm256_set1_ps(((const float *)(row + k))[b]);
    for (int c = 0; c < cols; c++) {
        const uint8_t *block = w + c * wrow + b * bytes;
        __m256i q = _mm256_loadu_si256((const __m256i *)(block + 2));
        __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(lane_dots(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q))),
                                      _mm256_set1_ps(half_at(block)));
        acc[c] = _mm256_fmadd_ps(scaled, d, acc[c]);
    }
}

/* The eight lane sums of u0[i] * s0[i] + u1[i] * s1[i] (u nibbles: two maddubs pairs add up to at
   most 4 * 15 * 127, within int16). */
static inline __m256i nibble_dots(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* Q4_0 or Q4_1 blocks b and b + 1 (b even) of one quantized row against cols (<= COLS) weight rows,
   as quad_blocks takes four: a vector holds both blocks' codes, the low nibbles against each
   block's first 16 x values, the high ones against its last 16, leaving block b's four lanes in the
   low half of acc and b + 1's in the high half; their mw * sx into low[0] and low[1], weight row
   c's in lane c. */
static inline __attribute__((always_inline)) void two_q4_blocks(int format, const uint8_t *row, int64_t k,
                                                                int64_t b, const uint8_t *w, int64_t wrow, int cols,
                                                                __m256 *acc, __m128 *low) {
    int64_t blocks = k / BLOCK, bytes = weight_block_bytes(format);
    const float *dx = (const float *)(row + k);
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(row + b * BLOCK));
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(row + (b + 1) * BLOCK));
    __m256i x_low = _mm256_permute2x128_si256(x0, x1, 0x20), x_high = _mm256_permute2x128_si256(x0, x1, 0x31);
    __m256 d = _mm256_setr_m128(_mm_set1_ps(dx[b]), _mm_set1_ps(dx[b + 1]));
    __m256i nibble = _mm256_set1_epi8(15);
    float mw[2][COLS] = {{0}};
    for (int c = 0; c < cols; c++) {
        const uint8_t *first = w + c * wrow + b * bytes, *codes = first + (format == Q4_1 ? 4 : 2);
        __m256i raw = _mm256_setr_m128i(_mm_loadu_si128((const __m128i *)codes),
                                        _mm_loadu_si128((const __m128i *)(codes + bytes)));
        __m256i lanes = nibble_dots(_mm256_and_si256(raw, nibble), x_low,
                                    _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), x_high);
        float h0 = half_at(first), h1 = half_at(first + bytes);
        mw[0][c] = format == Q4_1 ? half_at(first + 2) : -8.0f * h0;
        mw[1][c] = format == Q4_1 ? half_at(first + bytes + 2) : -8.0f * h1;
        __m256 scale = _mm256_setr_m128(_mm_set1_ps(h0), _mm_set1_ps(h1));
        acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lanes), scale), d, acc[c]);
    }
    for (int e = 0; e < 2; e++)
        low[e] = _mm_fmadd_ps(_mm_setr_ps(mw[e][0], mw[e][1], mw[e][2], mw[e][3]), _mm_set1_ps(dx[blocks + b + e]),
                              low[e]);
}

/* One quantized row against cols (<= COLS) weight rows. Inlined with constant arguments, so its
   arrays are registers. */
static inline __attribute__((always_inline)) void tile(int format, const uint8_t *qx, int64_t qrow, int rows,
                                                       const uint8_t *w, int64_t wrow, int cols, int64_t k,
                                                       float *y, int64_t ldy) {
    (void)qrow, (void)rows, (void)ldy;
    int64_t blocks = k / BLOCK, bytes = weight_block_bytes(format), b = 0;
    __m256 acc[2][COLS]; /* A[0..7] and A[8..15] of each weight row */
    __m128 low[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int c = 0; c < cols; c++)
        acc[0][c] = acc[1][c] = _mm256_setzero_ps();
    for (; b + 1 < blocks; b += 2) {
        prefetch_ahead(w, wrow, cols, b * bytes, 2 * bytes);
        if (format == Q8_0) {
            step(qx, k, b, w, wrow, cols, acc[0]);
            step(qx, k, b + 1, w, wrow, cols, acc[1]);
        } else {
            two_q4_blocks(format, qx, k, b, w, wrow, cols, acc[b % 4 / 2], low + b % 4);
        }
    }
    float lows[4][4];
    for (int s = 0; s < 4; s++)
        _mm_storeu_ps(lows[s], low[s]);
    const float *dx = (const float *)(qx + k);
    for (int c = 0; c < cols; c++) {
        float A[16], L[4] = {lows[0][c], lows[1][c], lows[2][c], lows[3][c]};
        _mm256_storeu_ps(A, acc[0][c]);
        _mm256_storeu_ps(A + 8, acc[1][c]);
        if (b < blocks) /* an odd count: the last block in plain C */
            any_step(format, w + c * wrow + b * bytes, (const int8_t *)qx + b * BLOCK, dx, dx + blocks, b, A, L);
        y[c] = pair_result(format, A, L);
    }
}
#endif

#endif
