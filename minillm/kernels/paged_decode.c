/* Paged decode attention for CPUs: one new query token per sequence attends to its whole cached context,
 * reading each key and value row straight from the block pool (no gathered copy), in two passes over the
 * context: scores and their softmax, then the weighted sum of values. Compiled at first use by
 * minillm/kernels/cpu.py; shapes follow flash_attn_with_kvcache:
 *   q [seqs, heads, dim] (rows q_stride floats apart)   out [seqs, heads, dim]
 *   k_cache, v_cache [blocks, block_size, kv_heads, dim]
 *   block_tables [seqs, max_blocks] (int32)   context_lens [seqs] (int32)
 * Every query head of a sequence is handled in the same pass, so each key and value row is read from
 * memory once per sequence, not once per query head. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Slots to prefetch ahead: blocks lie anywhere in the pool, so the hardware cannot guess the next. */
#define AHEAD 4

static inline const float *slot(const float *cache, const int32_t *table, int64_t t, int64_t block_size,
                                int64_t row) {
    return cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
}

static inline void prefetch_row(const float *p, int64_t row) {
    for (int64_t i = 0; i < row; i += 16) __builtin_prefetch(p + i); /* one 64-byte line per 16 floats */
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                      const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                      int64_t q_stride) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cache slot: every KV head of one token */
#pragma omp parallel for schedule(dynamic)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = context_lens[s];
        const int32_t *table = block_tables + s * max_blocks;
        const float *qs = q + s * q_stride;
        float *os = out + s * num_heads * head_dim;
        float *scores = malloc(sizeof(float) * num_heads * len); /* [heads, len] */
        /* Slot by slot, all heads at once: each slot's row is read whole and in order, which the hardware
         * prefetcher streams from memory; a pass per head would read it in strided pieces, which it follows
         * poorly. */
        for (int64_t t = 0; t < len; t++) {
            if (t + AHEAD < len) prefetch_row(slot(k_cache, table, t + AHEAD, block_size, row), row);
            const float *k = slot(k_cache, table, t, block_size, row);
            for (int64_t h = 0; h < num_heads; h++)
                scores[h * len + t] = scale * dot(qs + h * head_dim, k + (h / group) * head_dim, head_dim);
        }
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
        for (int64_t t = 0; t < len; t++) {
            if (t + AHEAD < len) prefetch_row(slot(v_cache, table, t + AHEAD, block_size, row), row);
            const float *v = slot(v_cache, table, t, block_size, row);
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * len + t], *vh = v + (h / group) * head_dim;
                float *o = os + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * vh[d];
            }
        }
        free(scores);
    }
}
