/* Paged decode attention for CPUs: one new query token per sequence attends to its whole cached context,
 * reading each key and value row straight from the block pool (no gathered copy), in two passes over the
 * context: scores and their softmax, then the weighted sum of values. Compiled at first use by
 * minillm/kernels/cpu.py; shapes follow flash_attn_with_kvcache:
 *   q [seqs, heads, dim] (rows q_stride floats apart)   out [seqs, heads, dim]
 *   k_cache, v_cache [blocks, block_size, kv_heads, dim]
 *   block_tables [seqs, max_blocks] (int32)   context_lens [seqs] (int32)
 * Every query head of a sequence is handled in the same pass, so each key and value row is read from
 * memory once per sequence, not once per query head. paged_decode_i8 reads an int8 pool instead, each
 * vector (one token, one KV head) with a float32 scale, k_scale and v_scale [blocks, block_size, kv_heads]:
 * a quarter of the bytes, dequantized in registers as they are read. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* One sequence over a float32 pool: its query heads `qs` [heads, dim] against the first `len` cached tokens, into
 * `os` [heads, dim], with `scores` [heads, len] as scratch. */
static inline __attribute__((always_inline)) void decode_seq_f32_dim(
        const float *qs, const float *k_cache, const float *v_cache, const int32_t *table, int64_t len, float *os,
        float *scores, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size,
        float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cache slot: every KV head of one token */
    /* Slot by slot, all heads at once: each slot's row is read whole and in order, which the hardware prefetcher
     * streams from memory; a pass per head would read it in strided pieces, which it follows poorly. */
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len) prefetch_bytes(k_cache + slot(table, t + AHEAD_SLOTS, block_size) * row, row * 4);
        const float *k = k_cache + slot(table, t, block_size) * row;
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) /* each key vector for every query head of its group */
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                scores[h * len + t] = scale * dot(qs + h * head_dim, k + kvh * head_dim, head_dim);
    }
    softmax_rows(scores, os, num_heads, len, head_dim);
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len) prefetch_bytes(v_cache + slot(table, t + AHEAD_SLOTS, block_size) * row, row * 4);
        const float *v = v_cache + slot(table, t, block_size) * row;
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
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
                           int64_t head_dim, int64_t block_size, float scale) {
    if (head_dim == 64)
        decode_seq_f32_dim(qs, k_cache, v_cache, table, len, os, scores, num_heads, num_kv_heads, 64, block_size,
                           scale);
    else
        decode_seq_f32_dim(qs, k_cache, v_cache, table, len, os, scores, num_heads, num_kv_heads, head_dim,
                           block_size, scale);
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
                       out + s * num_heads * head_dim, scores, num_heads, num_kv_heads, head_dim, block_size, scale);
        free(scores);
    }
}

/* One sequence over an int8 pool: each key and value vector is widened to float once, for every query head of
 * its group; a key's scale multiplies its dot products, a value's scale its widened copy. */
static inline __attribute__((always_inline)) void decode_seq_i8_dim(
        const float *qs, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale, const float *v_scale,
        const int32_t *table, int64_t len, float *os, float *scores, int64_t num_heads, int64_t num_kv_heads,
        const int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len) prefetch_bytes(k_cache + slot(table, t + AHEAD_SLOTS, block_size) * row, row);
        const int64_t i = slot(table, t, block_size);
        const int8_t *k = k_cache + i * row;
        const float *ks = k_scale + i * num_kv_heads;
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            float kf[head_dim];
            for (int64_t d = 0; d < head_dim; d++) kf[d] = (float)k[kvh * head_dim + d];
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                scores[h * len + t] = scale * ks[kvh] * dot(qs + h * head_dim, kf, head_dim);
        }
    }
    softmax_rows(scores, os, num_heads, len, head_dim);
    for (int64_t t = 0; t < len; t++) {
        if (t + AHEAD_SLOTS < len) prefetch_bytes(v_cache + slot(table, t + AHEAD_SLOTS, block_size) * row, row);
        const int64_t i = slot(table, t, block_size);
        const int8_t *v = v_cache + i * row;
        const float *vs = v_scale + i * num_kv_heads;
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
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

/* decode_seq_i8_dim, with fixed-length loops the compiler unrolls for the common head size. */
static void decode_seq_i8(const float *qs, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                          const float *v_scale, const int32_t *table, int64_t len, float *os, float *scores,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale) {
    if (head_dim == 64)
        decode_seq_i8_dim(qs, k_cache, v_cache, k_scale, v_scale, table, len, os, scores, num_heads, num_kv_heads,
                          64, block_size, scale);
    else
        decode_seq_i8_dim(qs, k_cache, v_cache, k_scale, v_scale, table, len, os, scores, num_heads, num_kv_heads,
                          head_dim, block_size, scale);
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
                      out + s * num_heads * head_dim, scores, num_heads, num_kv_heads, head_dim, block_size, scale);
        free(scores);
    }
}
