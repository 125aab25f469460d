/* Paged decode attention for CPUs: one new query token per sequence attends to its whole cached context,
 * reading each key and value row straight from the block pool (no gathered copy), in two passes over the
 * context: scores and their softmax, then the weighted sum of values. Compiled at first use by
 * minillm/kernels/cpu.py; shapes follow flash_attn_with_kvcache:
 *   q [seqs, heads, dim] (rows q_stride floats apart)   out [seqs, heads, dim]
 *   k_cache, v_cache [blocks, block_size, kv_heads, dim]
 *   block_tables [seqs, max_blocks] (int32)   context_lens [seqs] (int32)
 * Every query head of a sequence is handled in the same pass, so each key and value row is read from
 * memory once per sequence, not once per query head; the row functions take a range of KV heads [kv0, kv1) (with
 * their query heads), so that the fused decode step can split one sequence's heads over its threads.
 * paged_decode_i8 reads an int8 pool instead, each vector (one token, one KV head) with a float32 scale, k_scale
 * and v_scale [blocks, block_size, kv_heads]: a quarter of the bytes, dequantized in registers as they are read;
 * where the compiler targets AVX-512, 64-wide heads go a KV head at a time instead (each cache line is still read
 * once), so that its query heads' queries and outputs stay in registers.
 * rope_store_decode does a decode-only step's whole attention for one layer, RoPE and the cache store included,
 * in one call from the engine's layers; the fused decode step (decode_step.c) shares its row function. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "small_ops.c"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Slots to prefetch ahead: blocks lie anywhere in the pool, so the hardware cannot guess the next. */
#define AHEAD_SLOTS 4

/* The pool slot of a sequence's token t: its block from the table, then its place in the block. */
static inline int64_t slot(const int32_t *table, int64_t t, int64_t block_size) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i); /* one cache line */
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Each head's scores [heads, len] become its softmax weights; the output rows are zeroed for the sum. */
static void softmax_rows(float *scores, float *os, int64_t num_heads, int64_t len, int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *sh = scores + h * len, m = sh[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
        for (int64_t t = 0; t < len; t++) {
            sh[t] = expf(sh[t] - m);
            sum += sh[t];
        }
        for (int64_t t = 0; t < len; t++) sh[t] /= sum;
        for (int64_t d = 0; d < head_dim; d++) os[h * head_dim + d] = 0.0f;
    }
}

/* One sequence over a float32 pool: its query heads `qs` [heads, dim] of KV heads kv0 .. kv1 against the first
 * `len` cached tokens, into those heads of `os` [heads, dim], with `scores` [heads, len] as scratch. */
static inline __attribute__((always_inline)) void decode_seq_f32_dim(
        const float *qs, const float *k_cache, const float *v_cache, const int32_t *table, int64_t len, float *os,
        float *scores, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size,
        float scale, int64_t kv0, int64_t kv1) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cache slot: every KV head of one token */
    const int64_t first = kv0 * head_dim, width = (kv1 - kv0) * head_dim; /* the part of a row read here */
    /* Slot by slot, all heads at once: each slot's row is read whole and in order, which the hardware prefetcher
     * streams from memory; a pass per head would read it in strided pieces, which it follows poorly. */
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len)
            prefetch_bytes(k_cache + slot(table, t + AHEAD_SLOTS, block_size) * row + first, width * 4);
        const float *k = k_cache + slot(table, t, block_size) * row;
        for (int64_t kvh = kv0; kvh < kv1; kvh++) /* each key vector for every query head of its group */
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                scores[h * len + t] = scale * dot(qs + h * head_dim, k + kvh * head_dim, head_dim);
    }
    softmax_rows(scores + kv0 * group * len, os + kv0 * group * head_dim, (kv1 - kv0) * group, len, head_dim);
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len)
            prefetch_bytes(v_cache + slot(table, t + AHEAD_SLOTS, block_size) * row + first, width * 4);
        const float *v = v_cache + slot(table, t, block_size) * row;
        for (int64_t kvh = kv0; kvh < kv1; kvh++)
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                const float p = scores[h * len + t], *vh = v + kvh * head_dim;
                float *o = os + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * vh[d];
            }
    }
}

/* decode_seq_f32_dim, with fixed-length loops the compiler unrolls for the common head size. */
static void decode_seq_f32(const float *qs, const float *k_cache, const float *v_cache, const int32_t *table,
                           int64_t len, float *os, float *scores, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int64_t kv0, int64_t kv1) {
    if (head_dim == 64)
        decode_seq_f32_dim(qs, k_cache, v_cache, table, len, os, scores, num_heads, num_kv_heads, 64, block_size,
                           scale, kv0, kv1);
    else
        decode_seq_f32_dim(qs, k_cache, v_cache, table, len, os, scores, num_heads, num_kv_heads, head_dim,
                           block_size, scale, kv0, kv1);
}

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                      const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                      int64_t q_stride) {
#pragma omp parallel for schedule(dynamic)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = context_lens[s];
        float *scores = malloc(sizeof(float) * num_heads * len); /* [heads, len] */
        decode_seq_f32(q + s * q_stride, k_cache, v_cache, block_tables + s * max_blocks, len,
                       out + s * num_heads * head_dim, scores, num_heads, num_kv_heads, head_dim, block_size, scale,
                       0, num_kv_heads);
        free(scores);
    }
}

/* One sequence over an int8 pool: each key and value vector is widened to float once, for every query head of
 * its group; a key's scale multiplies its dot products, a value's scale its widened copy. */
static inline __attribute__((always_inline)) void decode_seq_i8_dim(
        const float *qs, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale, const float *v_scale,
        const int32_t *table, int64_t len, float *os, float *scores, int64_t num_heads, int64_t num_kv_heads,
        const int64_t head_dim, int64_t block_size, float scale, int64_t kv0, int64_t kv1) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t first = kv0 * head_dim, width = (kv1 - kv0) * head_dim;
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len)
            prefetch_bytes(k_cache + slot(table, t + AHEAD_SLOTS, block_size) * row + first, width);
        const int64_t i = slot(table, t, block_size);
        const int8_t *k = k_cache + i * row;
        const float *ks = k_scale + i * num_kv_heads;
        for (int64_t kvh = kv0; kvh < kv1; kvh++) {
            float kf[head_dim];
            for (int64_t d = 0; d < head_dim; d++) kf[d] = (float)k[kvh * head_dim + d];
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                scores[h * len + t] = scale * ks[kvh] * dot(qs + h * head_dim, kf, head_dim);
        }
    }
    softmax_rows(scores + kv0 * group * len, os + kv0 * group * head_dim, (kv1 - kv0) * group, len, head_dim);
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len)
            prefetch_bytes(v_cache + slot(table, t + AHEAD_SLOTS, block_size) * row + first, width);
        const int64_t i = slot(table, t, block_size);
        const int8_t *v = v_cache + i * row;
        const float *vs = v_scale + i * num_kv_heads;
        for (int64_t kvh = kv0; kvh < kv1; kvh++) {
            float vf[head_dim];
            for (int64_t d = 0; d < head_dim; d++) vf[d] = vs[kvh] * (float)v[kvh * head_dim + d];
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                const float p = scores[h * len + t];
                float *o = os + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * vf[d];
            }
        }
    }
}

#if defined(__AVX512F__)
/* One cache line a slot of a pool block: the 64 bytes of one KV head's vector, `offset` bytes into each row. */
static inline void prefetch_block(const int8_t *cache, int64_t block, int64_t block_size, int64_t row, int64_t offset) {
    for (int64_t u = 0; u < block_size; u++) __builtin_prefetch(cache + (block * block_size + u) * row + offset);
}

/* One int8 vector of 64 values (a key or a value of one head), widened to four registers of floats. */
static inline void widen64(const int8_t *v, __m512 f[4]) {
    for (int j = 0; j < 4; j++)
        f[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + 16 * j))));
}

/* The lane sums of four registers, as the four floats of the result: one tree of adds and shuffles for all four
 * instead of a chain per register, which is what made each dot product costly when summed on its own. */
static inline __m128 lane_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E)); /* each 128-bit lane now holds one register's partials */
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8,
                                                                         4, 0), s));
}

/* decode_seq_i8_dim for 64-wide heads with AVX-512: a KV head at a time, up to four of its query heads at a time
 * held in registers while the context streams past, so that their scores' partial sums are reduced together and
 * their outputs accumulate in registers rather than in memory. Each output is summed over the context in the same
 * order as decode_seq_i8_dim's; only the scores' dot products are summed in another order. */
static void decode_seq_i8_64(const float *qs, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                             const float *v_scale, const int32_t *table, int64_t len, float *os, float *scores,
                             int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale, int64_t kv0,
                             int64_t kv1) {
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * 64;
    for (int64_t kvh = kv0; kvh < kv1; kvh++)
        for (int64_t h0 = kvh * group; h0 < (kvh + 1) * group; h0 += 4) {
            const int64_t n = (kvh + 1) * group - h0 < 4 ? (kvh + 1) * group - h0 : 4; /* query heads in this pass */
            __m512 q[4][4], acc[4][4], f[4];
            for (int64_t hh = 0; hh < 4; hh++)
                for (int j = 0; j < 4; j++) {
                    q[hh][j] = hh < n ? _mm512_loadu_ps(qs + (h0 + hh) * 64 + 16 * j) : _mm512_setzero_ps();
                    acc[hh][j] = _mm512_setzero_ps();
                }
            prefetch_block(k_cache, table[0], block_size, row, kvh * 64);
            for (int64_t t0 = 0; t0 < len; t0 += block_size) { /* a block at a time: no division per token */
                const int64_t first = (int64_t)table[t0 / block_size] * block_size;
                const int64_t count = len - t0 < block_size ? len - t0 : block_size;
                if (t0 + block_size < len) /* the next block's vectors of this head, while this block is summed */
                    prefetch_block(k_cache, table[t0 / block_size + 1], block_size, row, kvh * 64);
                for (int64_t u = 0; u < count; u++) {
                    const int64_t i = first + u, t = t0 + u;
                    widen64(k_cache + i * row + kvh * 64, f);
                    __m512 p[4];
                    for (int64_t hh = 0; hh < 4; hh++) {
                        p[hh] = _mm512_mul_ps(q[hh][0], f[0]);
                        for (int j = 1; j < 4; j++) p[hh] = _mm512_fmadd_ps(q[hh][j], f[j], p[hh]);
                    }
                    float s[4];
                    _mm_storeu_ps(s, _mm_mul_ps(_mm_set1_ps(scale * k_scale[i * num_kv_heads + kvh]),
                                                lane_sums4(p[0], p[1], p[2], p[3])));
                    for (int64_t hh = 0; hh < n; hh++) scores[(h0 + hh) * len + t] = s[hh];
                }
            }
            prefetch_block(v_cache, table[0], block_size, row, kvh * 64);
            softmax_rows(scores + h0 * len, os + h0 * 64, n, len, 64);
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t first = (int64_t)table[t0 / block_size] * block_size;
                const int64_t count = len - t0 < block_size ? len - t0 : block_size;
                if (t0 + block_size < len)
                    prefetch_block(v_cache, table[t0 / block_size + 1], block_size, row, kvh * 64);
                for (int64_t u = 0; u < count; u++) {
                    const int64_t i = first + u, t = t0 + u;
                    widen64(v_cache + i * row + kvh * 64, f);
                    const __m512 vs = _mm512_set1_ps(v_scale[i * num_kv_heads + kvh]);
                    for (int j = 0; j < 4; j++) f[j] = _mm512_mul_ps(vs, f[j]);
                    for (int64_t hh = 0; hh < n; hh++) {
                        const __m512 w = _mm512_set1_ps(scores[(h0 + hh) * len + t]);
                        for (int j = 0; j < 4; j++) acc[hh][j] = _mm512_fmadd_ps(w, f[j], acc[hh][j]);
                    }
                }
            }
            for (int64_t hh = 0; hh < n; hh++)
                for (int j = 0; j < 4; j++) _mm512_storeu_ps(os + (h0 + hh) * 64 + 16 * j, acc[hh][j]);
        }
}
#endif

/* One sequence over an int8 pool; 64-wide heads take decode_seq_i8_64 where the compiler targets AVX-512. */
static void decode_seq_i8(const float *qs, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                          const float *v_scale, const int32_t *table, int64_t len, float *os, float *scores,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, int64_t kv0, int64_t kv1) {
#if defined(__AVX512F__)
    if (head_dim == 64) {
        decode_seq_i8_64(qs, k_cache, v_cache, k_scale, v_scale, table, len, os, scores, num_heads, num_kv_heads,
                         block_size, scale, kv0, kv1);
        return;
    }
#else
    if (head_dim == 64) { /* fixed-length loops the compiler unrolls */
        decode_seq_i8_dim(qs, k_cache, v_cache, k_scale, v_scale, table, len, os, scores, num_heads, num_kv_heads,
                          64, block_size, scale, kv0, kv1);
        return;
    }
#endif
    decode_seq_i8_dim(qs, k_cache, v_cache, k_scale, v_scale, table, len, os, scores, num_heads, num_kv_heads,
                      head_dim, block_size, scale, kv0, kv1);
}

void paged_decode_i8(const float *q, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                     const float *v_scale, const int32_t *block_tables, const int32_t *context_lens, float *out,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t max_blocks, float scale, int64_t q_stride) {
#pragma omp parallel for schedule(dynamic)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = context_lens[s];
        float *scores = malloc(sizeof(float) * num_heads * len);
        decode_seq_i8(q + s * q_stride, k_cache, v_cache, k_scale, v_scale, block_tables + s * max_blocks, len,
                      out + s * num_heads * head_dim, scores, num_heads, num_kv_heads, head_dim, block_size, scale,
                      0, num_kv_heads);
        free(scores);
    }
}

/* One vector of d values into an int8 pool slot and its scale, as minillm.quant_formats.quantize_int8 rounds it
 * (the largest magnitude on 127, round half to even, clamped): compiled without -ffast-math's reciprocals, so
 * that the division is the one PyTorch does and the cache holds the same codes whichever path stored them. The
 * maxima and the clamp are comparisons, which give fmaxf's and fminf's results (a NaN loses to a number) and,
 * unlike those without -ffast-math, are not calls into libm. */
__attribute__((optimize("no-fast-math"))) static void store_int8(const float *x, int64_t d, int8_t *q,
                                                                   float *scale) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float s = amax / 127.0f > FLT_MIN ? amax / 127.0f : FLT_MIN;
    for (int64_t i = 0; i < d; i++) {
        const float r = rintf(x[i] / s), low = r > -127.0f ? r : -127.0f;
        q[i] = (int8_t)(low < 127.0f ? low : 127.0f);
    }
    *scale = s;
}

/* One new token after its layer's q/k/v product, h = [q heads | k heads | v heads] of d values: RoPE on its q and k
 * heads in place (small_ops.c's rope_row, by the token's cos and signed sin rows), then its k and v into cache slot
 * `slot` of a float32 pool, or of an int8 one with a scale per vector (k_scale NULL: float32). */
static void rope_store_row(float *h, const float *cos, const float *sin_signed, int64_t heads, int64_t kv_heads,
                           int64_t d, int64_t slot, void *k_cache, void *v_cache, float *k_scale, float *v_scale) {
    const int64_t q_width = heads * d, kv_width = kv_heads * d;
    rope_row(h, cos, sin_signed, heads + kv_heads, d, h);
    if (k_scale == NULL) {
        memcpy((float *)k_cache + slot * kv_width, h + q_width, sizeof(float) * kv_width);
        memcpy((float *)v_cache + slot * kv_width, h + q_width + kv_width, sizeof(float) * kv_width);
        return;
    }
    for (int64_t j = 0; j < kv_heads; j++) {
        const int64_t at = slot * kv_heads + j;
        store_int8(h + q_width + j * d, d, (int8_t *)k_cache + at * d, k_scale + at);
        store_int8(h + q_width + kv_width + j * d, d, (int8_t *)v_cache + at * d, v_scale + at);
    }
}

/* A decode-only step's attention for one layer, from its q/k/v product's output qkv [seqs, (heads + 2 kv_heads) d]
 * (rotated in place): RoPE, the cache store and the attention of every sequence in one call, which a step layer by
 * layer otherwise makes four (rope, two stores, the kernel), each after a weight product has pushed the one
 * before's data out of the caches. cos and sin_signed [seqs, d] are each token's rows; out [seqs, heads, d]. */
void rope_store_decode(float *qkv, const float *cos, const float *sin_signed, const int64_t *slots, void *k_cache,
                       void *v_cache, float *k_scale, float *v_scale, const int32_t *block_tables,
                       const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
    for (int64_t s = 0; s < num_seqs; s++)
        rope_store_row(qkv + s * width, cos + s * head_dim, sin_signed + s * head_dim, num_heads, num_kv_heads,
                       head_dim, slots[s], k_cache, v_cache, k_scale, v_scale);
    if (k_scale == NULL)
        paged_decode_f32(qkv, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
                         head_dim, block_size, max_blocks, scale, width);
    else
        paged_decode_i8(qkv, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, max_blocks, scale, width);
}
