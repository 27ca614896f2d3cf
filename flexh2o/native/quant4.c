/* 4-bit groups (quant.py's format) quantized and dequantized in one pass over the values.

Bit-equal to quant.py's torch path: the same float32 operations in the same order (a subtraction
then a division, a multiplication then an addition: built with -ffp-contract=off, so no fused
multiply-add rounds once where torch rounds twice), round half to even, the group minimum
rounded down and the scale up to float16 the same way.

Each function does the rows [first, last) of its arguments, so the caller splits a tensor over
threads.
*/

#include <math.h>

#include "common.h"
#include "pairs.h"

#define GROUP 64
#define HALF (GROUP / 2)
#define LEVELS 15
#define GROUP_BYTES (HALF + 4)

/* x as float16, rounded towards +inf (up) or -inf (down): quant.py's _round_float16. */
static uint16_t round_float16(float x, int up) {
    _Float16 y = (_Float16)x;
    int wrong = up ? (float)y < x : (float)y > x;
    if (!wrong)
        return f16_bits(y);
    uint16_t bits = f16_bits(y);
    if ((float)y == 0.0f)
        return up ? 0x0001 : 0x8001;
    int away_from_zero = up ? (float)y > 0.0f : (float)y < 0.0f;
    return (uint16_t)(away_from_zero ? bits + 1 : bits - 1);
}

/* count values of src from offset, widened (exactly) to float32. */
static void load_values(const void *src, int dtype, int64_t offset, int64_t count, float *dst) {
    int64_t i = 0;
    if (dtype == FLOAT32) {
        memcpy(dst, (const float *)src + offset, (size_t)count * 4);
    } else if (dtype == BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src + offset;
#ifdef __AVX2__
        for (; i + 8 <= count; i += 8) {
            __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
#endif
        for (; i < count; i++)
            dst[i] = bf16_to_float(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)src + offset;
#ifdef __F16C__
        for (; i + 8 <= count; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < count; i++)
            dst[i] = (float)s[i];
    }
}

#ifdef __AVX2__
/* The eight codes of c (floats 0..15, NaN none: already clamped) as bytes at out. */
static void store_codes(__m256 c, uint8_t *out) {
    __m256i i32 = _mm256_cvttps_epi32(c);
    __m128i i16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(i16, i16));
}

static void group_min_max(const float *v, float *lo, float *hi, int *nan) {
    __m256 mn = _mm256_loadu_ps(v), mx = mn, unordered = _mm256_cmp_ps(mn, mn, _CMP_UNORD_Q);
    for (int i = 8; i < GROUP; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        mn = _mm256_min_ps(mn, x);
        mx = _mm256_max_ps(mx, x);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float a[8], b[8];
    _mm256_storeu_ps(a, mn);
    _mm256_storeu_ps(b, mx);
    *lo = a[0], *hi = b[0];
    for (int i = 1; i < 8; i++) {
        *lo = a[i] < *lo ? a[i] : *lo;
        *hi = b[i] > *hi ? b[i] : *hi;
    }
    *nan = _mm256_movemask_ps(unordered) != 0;
}

static void group_codes(const float *v, float low, float divisor, uint8_t *codes) {
    __m256 lo = _mm256_set1_ps(low), d = _mm256_set1_ps(divisor);
    __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps((float)LEVELS);
    for (int i = 0; i < GROUP; i += 8) {
        __m256 c = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(v + i), lo), d);
        c = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm256_min_ps(_mm256_max_ps(c, zero), top); /* max(NaN, 0) is 0: a NaN group's scale marks it */
        store_codes(c, codes + i);
    }
}

/* The group's 64 values from its 32 bytes of codes: low nibbles first, then high ones. */
static void group_values(const uint8_t *pairs, float scale, float low, float *v) {
    __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(low);
    __m128i mask = _mm_set1_epi8(15);
    for (int half = 0; half < 2; half++) {
        __m128i a = _mm_loadu_si128((const __m128i *)pairs + half);
        __m128i nibbles[2] = {_mm_and_si128(a, mask), _mm_and_si128(_mm_srli_epi16(a, 4), mask)};
        for (int k = 0; k < 2; k++) {
            for (int q = 0; q < 2; q++) {
                __m128i bytes = q ? _mm_srli_si128(nibbles[k], 8) : nibbles[k];
                __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                _mm256_storeu_ps(v + k * HALF + half * 16 + q * 8, _mm256_add_ps(_mm256_mul_ps(x, s), l));
            }
        }
    }
}
#else
static void group_min_max(const float *v, float *lo, float *hi, int *nan) {
    *lo = *hi = v[0];
    *nan = 0;
    for (int i = 0; i < GROUP; i++) {
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
        *nan |= v[i] != v[i];
    }
}

static void group_codes(const float *v, float low, float divisor, uint8_t *codes) {
    for (int i = 0; i < GROUP; i++) {
        float c = nearbyintf((v[i] - low) / divisor);
        codes[i] = (uint8_t)fminf(fmaxf(c, 0.0f), (float)LEVELS); /* NaN becomes 0 */
    }
}

static void group_values(const uint8_t *pairs, float scale, float low, float *v) {
    for (int i = 0; i < HALF; i++) {
        v[i] = (float)(pairs[i] & 15) * scale + low;
        v[i + HALF] = (float)(pairs[i] >> 4) * scale + low;
    }
}
#endif

/* Quantizes one group into its record; returns whether the group is one 4-bit groups cannot hold
   (NaN, infinite, or beyond float16's range: quant.check_quantizable's test). */
static int quantize_group(const float *v, uint8_t *record) {
    float lo, hi;
    int nan;
    group_min_max(v, &lo, &hi, &nan);
    int bad = nan || !(lo >= -65504.0f && hi <= 65504.0f);
    if (nan) /* torch's amin and amax give NaN: so does the group */
        lo = hi = NAN;
    uint16_t low_bits = round_float16(lo, 0);
    float low = (float)f16_from_bits(low_bits);
    uint16_t scale_bits = round_float16((hi - low) / (float)LEVELS, 1);
    float scale = (float)f16_from_bits(scale_bits);
    uint8_t codes[GROUP];
    group_codes(v, low, scale == 0.0f ? 1.0f : scale, codes);
    for (int i = 0; i < HALF; i++)
        record[i] = (uint8_t)(codes[i] | (codes[i + HALF] << 4));
    memcpy(record + HALF, &scale_bits, 2);
    memcpy(record + HALF + 2, &low_bits, 2);
    return bad;
}

/* x: rows of n values (row r at x + r * row_stride elements), out: rows of groups(n) records.
   Returns how many groups cannot be held (see quantize_group). */
int64_t quantize_rows(const void *x, int dtype, int64_t row_stride, int64_t n, uint8_t *out,
                      int64_t first, int64_t last) {
    int64_t groups = (n + GROUP - 1) / GROUP, bad = 0;
    float v[GROUP];
    for (int64_t r = first; r < last; r++) {
        uint8_t *record = out + r * groups * GROUP_BYTES;
        for (int64_t g = 0; g < groups; g++, record += GROUP_BYTES) {
            int64_t start = g * GROUP, count = n - start < GROUP ? n - start : GROUP;
            load_values(x, dtype, r * row_stride + start, count, v);
            for (int64_t i = count; i < GROUP; i++) /* the last group padded with its final value */
                v[i] = v[count - 1];
            bad += quantize_group(v, record);
        }
    }
    return bad; /* groups that cannot be held */
}

/* packed: rows of groups(n) records, out: rows of n values (row r at out + r * row_stride). */
void dequantize_rows(const uint8_t *packed, int64_t n, void *out, int dtype, int64_t row_stride,
                     int64_t first, int64_t last) {
    int64_t groups = (n + GROUP - 1) / GROUP;
    float v[GROUP];
    for (int64_t r = first; r < last; r++) {
        const uint8_t *record = packed + r * groups * GROUP_BYTES;
        for (int64_t g = 0; g < groups; g++, record += GROUP_BYTES) {
            uint16_t scale_bits, low_bits;
            memcpy(&scale_bits, record + HALF, 2);
            memcpy(&low_bits, record + HALF + 2, 2);
            float scale = (float)f16_from_bits(scale_bits), low = (float)f16_from_bits(low_bits);
            int64_t start = g * GROUP, count = n - start < GROUP ? n - start : GROUP;
            int64_t at = r * row_stride + start;
            if (dtype == FLOAT32 && count == GROUP) {
                group_values(record, scale, low, (float *)out + at);
                continue;
            }
            group_values(record, scale, low, v);
            store_values(v, out, dtype, at, count);
        }
    }
}

/* y[i, j] = sum over c of x[i, c] * w[j, c], for the rows i < m of x (float32, k values each, row
   stride ldx) and the weight rows first <= j < last: w's rows are groups(k) records each, k a
   multiple of GROUP. y is float32 with row stride ldy. Each weight value is what dequantize_rows
   makes of it (code * scale + minimum, rounded twice); only the order of the sums differs from
   dequantize-then-multiply. */
#if defined(__AVX2__) && defined(__FMA__)
/* Half a group's values (high: the high nibbles, values 32..63) as four vectors of eight, made as
   dequantize_rows makes them. */
static void half_group(const uint8_t *record, int high, __m256 w[4]) {
    uint16_t scale_bits, low_bits;
    memcpy(&scale_bits, record + HALF, 2);
    memcpy(&low_bits, record + HALF + 2, 2);
    __m256 s = _mm256_set1_ps((float)f16_from_bits(scale_bits));
    __m256 l = _mm256_set1_ps((float)f16_from_bits(low_bits));
    __m128i mask = _mm_set1_epi8(15);
    for (int q = 0; q < 4; q++) {
        __m128i a = _mm_loadu_si128((const __m128i *)record + q / 2);
        __m128i nib = high ? _mm_and_si128(_mm_srli_epi16(a, 4), mask) : _mm_and_si128(a, mask);
        __m128i bytes = (q % 2) ? _mm_srli_si128(nib, 8) : nib;
        w[q] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), s), l);
    }
}

/* One weight row against up to ROWS rows of x: each group's values made once, in registers, half a
   group at a time, and multiplied into every row's accumulator. */
#define ROWS 8
static void row_block(const float *x, int64_t rows, int64_t ldx, int64_t k, const uint8_t *record, float *y,
                      int64_t ldy) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t start = 0; start < k; start += GROUP, record += GROUP_BYTES)
        for (int high = 0; high < 2; high++) {
            __m256 w[4];
            half_group(record, high, w);
            const float *xs = x + start + high * HALF;
            for (int r = 0; r < ROWS; r++) {
                if (r >= rows)
                    break;
                const float *xr = xs + r * ldx;
                for (int q = 0; q < 4; q++)
                    acc[r] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xr + 8 * q), acc[r]);
            }
        }
    for (int r = 0; r < rows; r++)
        y[r * ldy] = sum8(acc[r]);
}

/* WIDE weight rows against one row of x, their sums side by side (blocks.c's wide_block says why);
   each summed exactly as row_block sums it. */
#define WIDE 4
static void wide_block(const float *x, int64_t k, const uint8_t *record, int64_t record_bytes, float *y) {
    __m256 acc[WIDE];
    for (int c = 0; c < WIDE; c++)
        acc[c] = _mm256_setzero_ps();
    for (int64_t start = 0, at = 0; start < k; start += GROUP, at += GROUP_BYTES)
        for (int high = 0; high < 2; high++)
            for (int c = 0; c < WIDE; c++) {
                __m256 w[4];
                half_group(record + c * record_bytes + at, high, w);
                for (int q = 0; q < 4; q++)
                    acc[c] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x + start + high * HALF + 8 * q), acc[c]);
            }
    for (int c = 0; c < WIDE; c++)
        y[c] = sum8(acc[c]);
}

#ifdef PAIRS_512
/* scale_at for quant.py's groups. */
static ALWAYS_INLINE int64_t group_scale(int format, int64_t group) {
    (void)format;
    return group * GROUP_BYTES + HALF;
}

/* pair_values for quant.py's groups: group `group` of rows a and b, the low nibbles' values first. */
static ALWAYS_INLINE void group_pair(int format, const uint8_t *a, const uint8_t *b, int64_t group, const float s[4],
                                     int rows, __m512 w[8]) {
    (void)format;
    int64_t at = group * GROUP_BYTES;
    if (rows > 1) {
        converted(a + at, b + at, HALF, s, 0, w);
        return;
    }
    __m512i raw = pair_of_32(a + at, b + at);
    __m512 table_a = code_table(s[0], s[1], 0), table_b = code_table(s[2], s[3], 0);
    __m512i low = nibbles(raw, HALF), high = nibbles(_mm512_srli_epi16(raw, 4), HALF);
    for (int q = 0; q < 8; q++)
        w[q] = looked_up(q < 4 ? low : high, picks(8 * (q % 4), HALF + 8 * (q % 4)), table_a, table_b);
}
#endif

void matmul_groups(const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y, int64_t ldy,
                   int64_t first, int64_t last) {
    int64_t record_bytes = k / GROUP * GROUP_BYTES, j = first;
#ifdef PAIRS_512
    pair_products(group_pair, group_scale, 0, GROUP, x, m, ldx, k, w, record_bytes, y, ldy, &j, last); /* most rows */
#endif
    if (m == 1)
        for (; j + WIDE <= last; j += WIDE)
            wide_block(x, k, w + j * record_bytes, record_bytes, y + j);
    for (; j < last; j++) /* a weight row stays in L1 while every block of x passes */
        for (int64_t i = 0; i < m; i += ROWS)
            row_block(x + i * ldx, m - i < ROWS ? m - i : ROWS, ldx, k, w + j * record_bytes, y + i * ldy + j, ldy);
}
#else
void matmul_groups(const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y, int64_t ldy,
                   int64_t first, int64_t last) {
    int64_t groups = k / GROUP;
    float v[GROUP];
    for (int64_t j = first; j < last; j++) {
        for (int64_t i = 0; i < m; i++)
            y[i * ldy + j] = 0.0f;
        const uint8_t *record = w + j * groups * GROUP_BYTES;
        for (int64_t g = 0; g < groups; g++, record += GROUP_BYTES) {
            uint16_t scale_bits, low_bits;
            memcpy(&scale_bits, record + HALF, 2);
            memcpy(&low_bits, record + HALF + 2, 2);
            group_values(record, (float)f16_from_bits(scale_bits), (float)f16_from_bits(low_bits), v);
            add_dots(x + g * GROUP, m, ldx, v, GROUP, y + j, ldy);
        }
    }
}
#endif
