/* A Llama layer's decode step in one call: the attention half (RMSNorm, the q/k/v product, the
rotary turn, the new token into the full cache, the attention, the output product, the residual
add) or the MLP half (RMSNorm, gate and up, SiLU(gate) * up, down, the residual add).

Each part is the kernel the layer's Python code calls one by one (layer_ops.c, blocks.c,
int8_dots.c, attention.c), with the same arguments in the same order, so the results are the same
bits; one call instead of a dozen saves the Python between them, which at a decode step's few rows
cost more than the arithmetic (docs/design.md, "Where a CPU decode step goes"). hidden [b, h] is
updated in place; scratch is the caller's room for the step's intermediate rows.
*/

#include <stddef.h>
#include <stdint.h>

void rms_norm_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, const float *w, float eps, float *out,
                   int64_t ldo, int threads);
void rotate_rows(float *x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const float *cos_, const float *sin_,
                 int64_t ldc, int threads);
void silu_mul_rows(const float *x, int64_t ldx, int64_t rows, int64_t f, float *out, int64_t ldo, int threads);
void matmul_all(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y,
                int64_t ldy, int64_t n, int threads);
int matmul_int8(int format, const float *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *w, float *y,
                int64_t ldy, int64_t n, int threads);
void append_token(float *k, float *v, int32_t *pos, int64_t b, int64_t kv_heads, int64_t capacity, int64_t d,
                  int64_t t, const float *k_new, int64_t k_ld_b, int64_t k_ld_h, const float *v_new, int64_t v_ld_b,
                  int64_t v_ld_h, const int64_t *new_pos, int64_t ld_pos);
int decode_attention(const float *q, int64_t ldq, float scale, const float *k, const float *v, const int32_t *pos,
                     int64_t b, int64_t kv_heads, int64_t group, int64_t capacity, int64_t n, int64_t d, float *out,
                     int threads);

/* x [m, k] times the weight w [n, k] in `format` (int8: with int8 activations) into y [m, n]; 0 or -1. */
static int product(int format, int int8, const float *x, int64_t m, int64_t k, const uint8_t *w, float *y,
                   int64_t n, int threads) {
    if (int8)
        return matmul_int8(format, x, m, k, k, w, y, n, n, threads);
    matmul_all(format, x, m, k, k, w, y, n, n, threads);
    return 0;
}

static void add_rows(float *hidden, const float *rows, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        hidden[i] += rows[i];
}

/* The attention half. q, k and v rows of the product: heads, then kv_heads, then kv_heads heads of
   d values; cos_, sin_ [b, d]; the cache k, v [b, kv_heads, capacity, d], pos [b, kv_heads,
   capacity], sequence i's new token going to slot t (or slots[i], where slots are refilled) at
   position new_pos[i * ld_pos], its slots [0, n) attended over after. scratch: b * (2 * h +
   (heads + 2 * kv_heads) * d + heads * d) floats. Returns 0; 1 where it did nothing (built without
   AVX2, which the attention needs: the caller takes its own path); -1 where it ran out of memory
   after the cache was written. */
int llama_attention_decode(float *hidden, int64_t b, int64_t h, const float *norm, float eps, int qkv_format,
                           int qkv_int8, const uint8_t *qkv_w, int o_format, int o_int8, const uint8_t *o_w,
                           int64_t heads, int64_t kv_heads, int64_t d, const float *cos_, const float *sin_, float *k,
                           float *v, int32_t *pos, int64_t capacity, int64_t t, const int64_t *slots, int64_t n,
                           const int64_t *new_pos, int64_t ld_pos, float scale, float *scratch, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    int64_t width = (heads + 2 * kv_heads) * d;
    float *normed = scratch, *qkv = normed + b * h, *attended = qkv + b * width, *out = attended + b * heads * d;
    rms_norm_rows(hidden, h, b, h, norm, eps, normed, h, threads);
    if (product(qkv_format, qkv_int8, normed, b, h, qkv_w, qkv, width, threads))
        return 1;  /* (nothing written yet) */
    rotate_rows(qkv, width, b, heads + kv_heads, d, cos_, sin_, d, threads);
    if (slots == NULL)
        append_token(k, v, pos, b, kv_heads, capacity, d, t, qkv + heads * d, width, d, qkv + (heads + kv_heads) * d,
                     width, d, new_pos, ld_pos);
    else
        for (int64_t i = 0; i < b; i++) {
            int64_t row = i * kv_heads * capacity;
            append_token(k + row * d, v + row * d, pos + row, 1, kv_heads, capacity, d, slots[i],
                         qkv + i * width + heads * d, width, d, qkv + i * width + (heads + kv_heads) * d, width, d,
                         new_pos + i * ld_pos, ld_pos);
        }
    if (decode_attention(qkv, width, scale, k, v, pos, b, kv_heads, heads / kv_heads, capacity, n, d, attended,
                         threads))
        return -1;
    if (product(o_format, o_int8, attended, b, heads * d, o_w, out, h, threads))
        return -1;
    add_rows(hidden, out, b * h);
    return 0;
#else
    return 1;
#endif
}

/* The MLP half: gate and up rows [2f] of one product, down [h, f]. scratch: b * (2 * h + 3 * f)
   floats. Returns 0, or 1 where it ran out of memory (hidden unchanged). */
int llama_mlp_decode(float *hidden, int64_t b, int64_t h, const float *norm, float eps, int gate_up_format,
                     int gate_up_int8, const uint8_t *gate_up_w, int down_format, int down_int8, const uint8_t *down_w,
                     int64_t f, float *scratch, int threads) {
    float *normed = scratch, *gate_up = normed + b * h, *act = gate_up + b * 2 * f, *out = act + b * f;
    rms_norm_rows(hidden, h, b, h, norm, eps, normed, h, threads);
    if (product(gate_up_format, gate_up_int8, normed, b, h, gate_up_w, gate_up, 2 * f, threads))
        return 1;
    silu_mul_rows(gate_up, 2 * f, b, f, act, f, threads);
    if (product(down_format, down_int8, act, b, f, down_w, out, h, threads))
        return 1;
    add_rows(hidden, out, b * h);
    return 0;
}

/* What llama_layers_decode reads of each layer: a row of LAYER_FIELDS int64 values (pointers as
   integers), in this order. */
enum { ATTN_NORM, QKV_FORMAT, QKV_INT8, QKV_W, O_FORMAT, O_INT8, O_W, CACHE_K, CACHE_V, CACHE_POS, CAPACITY, SLOT,
       ATTENDED, MLP_NORM, GATE_UP_FORMAT, GATE_UP_INT8, GATE_UP_W, DOWN_FORMAT, DOWN_INT8, DOWN_W, LAYER_FIELDS };

int64_t llama_layer_fields(void) { return LAYER_FIELDS; }

/* `layers` whole Llama layers (attention half, then MLP half) of a decode step, one after another,
   each as the two calls above would run it: table [layers, LAYER_FIELDS] (SLOT: the t of
   llama_attention_decode, ATTENDED: its n). scratch: as the larger of the two halves needs.
   Returns 0; 1 where nothing was done (built without AVX2); -1 where it ran out of memory part way. */
int llama_layers_decode(float *hidden, int64_t b, int64_t h, int64_t layers, const int64_t *table, float eps,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t f, const float *cos_, const float *sin_,
                        const int64_t *slots, const int64_t *new_pos, int64_t ld_pos, float scale, float *scratch,
                        int threads) {
    for (int64_t j = 0; j < layers; j++) {
        const int64_t *l = table + j * LAYER_FIELDS;
        int done = llama_attention_decode(
            hidden, b, h, (const float *)l[ATTN_NORM], eps, (int)l[QKV_FORMAT], (int)l[QKV_INT8],
            (const uint8_t *)l[QKV_W], (int)l[O_FORMAT], (int)l[O_INT8], (const uint8_t *)l[O_W], heads, kv_heads, d,
            cos_, sin_, (float *)l[CACHE_K], (float *)l[CACHE_V], (int32_t *)l[CACHE_POS], l[CAPACITY], l[SLOT],
            slots, l[ATTENDED], new_pos, ld_pos, scale, scratch, threads);
        if (done)
            return done == 1 && j == 0 ? 1 : -1;
        if (llama_mlp_decode(hidden, b, h, (const float *)l[MLP_NORM], eps, (int)l[GATE_UP_FORMAT],
                             (int)l[GATE_UP_INT8], (const uint8_t *)l[GATE_UP_W], (int)l[DOWN_FORMAT],
                             (int)l[DOWN_INT8], (const uint8_t *)l[DOWN_W], f, scratch, threads))
            return -1;
    }
    return 0;
}
