/* A quantized model's whole decode step in one call: for a batch of sequences that each decode one token, every
 * layer's RMSNorm, products, RoPE, cache store, attention, SwiGLU and skip connections, then back to Python once.
 * minillm/model.py is the readable reference, operation by operation; this file does the same arithmetic, with the
 * same compiled code for each operation (small_ops.c, and the two kernels below), without a trip through Python and
 * PyTorch's dispatcher between operations, and fuses each operation that feeds a product
 * into the rounding of that product's input to int8 (RMSNorm, SiLU times up, attention's output), and RoPE into
 * the cache store.
 *   weights  int4_matmul.c's layouts (int4 in groups, or int8 per channel or in groups)
 *   cache    a paged pool per layer, [blocks, block_size, kv_heads, head_dim] for keys and for values: float32, or
 *            int8 with a float32 scale per vector (one token, one KV head), [blocks, block_size, kv_heads] each
 *   x        [m, hidden] float32, the embeddings on entry and the last layer's output on return (in place)
 *   ends     where the model gives them, the step starts from token ids and ends in logits: the embedding lookup
 *            (int8 rows, a scale per row), the final RMSNorm and the head's product run in the call too
 * One OpenMP team runs the whole step: its threads split each product's tiles of output rows (every weight byte is
 * read once), the rows of x and the sequences of attention (with fewer sequences than threads, their KV heads),
 * with a barrier between phases. Built by minillm/kernels/decode_step.py from this file and the two kernels it
 * includes, compiled together so that the kernels' inner functions inline here as they do in their own libraries. */
#include "int4_matmul.c"
#include "paged_decode.c" /* and small_ops.c, which it includes */

/* One decoder layer: its four products, the q/k/v product's bias (NULL where it has none, as in Llama; Qwen2 has
 * one), its two RMSNorm gains and its cache pools (float32; or int8, with the scales k_scale and v_scale, NULL for a
 * float32 pool). */
typedef struct {
    Weight qkv, o, gate_up, down;
    const float *qkv_bias;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;
} Layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, block_size;
    float eps, scale; /* RMSNorm's epsilon; attention's 1 / sqrt(head_dim) */
    const Layer *layers;
    const float *cos, *sin_signed; /* [positions, head_dim]: RoPE's tables, the sine's first half negated */
    /* The step's two ends (NULL where the caller runs them): the token embedding, int8 codes [vocab, hidden] with a
     * float32 scale per row; the final RMSNorm's gain and the head's product (vocabulary scores). */
    const int8_t *embed_q;
    const float *embed_scale;
    const float *final_norm;
    Weight head;
} Model;

/* Row `token` of the int8 embedding, as float32: each code times its row's scale, one rounding, as PyTorch's
 * q.float() * scale computes it. */
static void embed_row(const Model *md, int64_t token, float *out) {
    const float scale = md->embed_scale[token];
    const int8_t *q = md->embed_q + token * md->hidden;
    for (int64_t j = 0; j < md->hidden; j++) out[j] = (float)q[j] * scale;
}

/* x [m, hidden] through every layer. positions and slots [m] are each new token's position and cache slot;
 * block_tables [m, max_blocks] and context_lens [m] (int32) each sequence's blocks and length after this token.
 * With `tokens` [m] (the model's ends set), x is first filled with their embeddings; with `logits` [m, vocab],
 * the last layer's output goes on through the final norm and the head into it. */
void decode_step_f32(const Model *md, float *x, int64_t m, const int64_t *tokens, const int64_t *positions,
                     const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                     int64_t max_blocks, float *logits) {
    const Layer *first = md->layers;
    const int64_t hidden = md->hidden, heads = md->heads, kv_heads = md->kv_heads, d = md->head_dim;
    const int64_t q_width = heads * d, qkv_width = first->qkv.n;
    const int64_t gu_width = first->gate_up.n, inter = gu_width / 2;
    int64_t widest = hidden; /* the longest row that is rounded to int8 for a product */
    if (inter > widest) widest = inter;
    if (q_width > widest) widest = q_width;
    Acts to_qkv = acts_new(m, hidden, first->qkv.g), to_o = acts_new(m, q_width, first->o.g);
    Acts to_gu = acts_new(m, hidden, first->gate_up.g), to_down = acts_new(m, inter, first->down.g);
    Acts to_head = {0}; /* (acts_free of an empty one frees NULL) */
    if (logits) to_head = acts_new(m, hidden, md->head.g);
    float *row = malloc(sizeof(float) * m * widest), *qkv = malloc(sizeof(float) * m * qkv_width);
    float *att = malloc(sizeof(float) * m * q_width), *gu = malloc(sizeof(float) * m * gu_width);
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        /* Fewer sequences than threads (batch 1): each sequence's attention split by KV heads over the team. */
        const int64_t share = (threads + m - 1) / m, parts = m >= threads ? 1 : share < kv_heads ? share : kv_heads;
        /* (each thread fills the rows its first norm reads: no barrier) */
        for (int64_t i = id; tokens && i < m; i += threads) embed_row(md, tokens[i], x + i * hidden);
        for (int64_t l = 0; l < md->num_layers; l++) {
            const Layer *L = md->layers + l;
            for (int64_t i = id; i < m; i += threads) { /* input RMSNorm, rounded to int8 for the qkv product */
                rms_norm_row(x + i * hidden, L->input_norm, md->eps, hidden, row + i * widest);
                quantize_row(&to_qkv, row + i * widest, i, L->qkv.g);
            }
#pragma omp barrier
            products(&L->qkv, &to_qkv, NULL, qkv, m, id, threads);
#pragma omp barrier
            for (int64_t i = id; i < m; i += threads) { /* the bias, RoPE on q and k, then k and v into their slots */
                float *h = qkv + i * qkv_width;
                if (L->qkv_bias)
                    for (int64_t j = 0; j < qkv_width; j++) h[j] += L->qkv_bias[j];
                rope_store_row(h, md->cos + positions[i] * d, md->sin_signed + positions[i] * d, heads, kv_heads, d,
                               slots[i], L->k_cache, L->v_cache, L->k_scale, L->v_scale);
            }
#pragma omp barrier
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < m * parts; item++) { /* attention: a sequence, or part of its KV heads */
                const int64_t i = item / parts, kv0 = kv_heads * (item % parts) / parts,
                              kv1 = kv_heads * (item % parts + 1) / parts;
                float *scores = malloc(sizeof(float) * heads * context_lens[i]);
                if (L->k_scale == NULL)
                    decode_seq_f32(qkv + i * qkv_width, L->k_cache, L->v_cache, block_tables + i * max_blocks,
                                   context_lens[i], att + i * q_width, scores, heads, kv_heads, d, md->block_size,
                                   md->scale, kv0, kv1);
                else
                    decode_seq_i8(qkv + i * qkv_width, L->k_cache, L->v_cache, L->k_scale, L->v_scale,
                                  block_tables + i * max_blocks, context_lens[i], att + i * q_width, scores, heads,
                                  kv_heads, d, md->block_size, md->scale, kv0, kv1);
                free(scores);
                if (parts == 1) quantize_row(&to_o, att + i * q_width, i, L->o.g); /* its output, to int8 */
            } /* (an omp for ends in a barrier) */
            if (parts > 1) { /* (the same in every thread) */
                for (int64_t i = id; i < m; i += threads) quantize_row(&to_o, att + i * q_width, i, L->o.g);
#pragma omp barrier
            }
            products(&L->o, &to_o, x, x, m, id, threads); /* the skip connection added in the product */
#pragma omp barrier
            for (int64_t i = id; i < m; i += threads) {
                rms_norm_row(x + i * hidden, L->post_norm, md->eps, hidden, row + i * widest);
                quantize_row(&to_gu, row + i * widest, i, L->gate_up.g);
            }
#pragma omp barrier
            products(&L->gate_up, &to_gu, NULL, gu, m, id, threads);
#pragma omp barrier
            for (int64_t i = id; i < m; i += threads) {
                silu_mul_row(gu + i * gu_width, inter, row + i * widest);
                quantize_row(&to_down, row + i * widest, i, L->down.g);
            }
#pragma omp barrier
            products(&L->down, &to_down, x, x, m, id, threads);
#pragma omp barrier
        }
        if (logits) { /* the final norm, rounded to int8 for the head, then the head */
            for (int64_t i = id; i < m; i += threads) {
                rms_norm_row(x + i * hidden, md->final_norm, md->eps, hidden, row + i * widest);
                quantize_row(&to_head, row + i * widest, i, md->head.g);
            }
#pragma omp barrier
            products(&md->head, &to_head, NULL, logits, m, id, threads);
        }
    }
    free(row), free(qkv), free(att), free(gu);
    acts_free(&to_qkv), acts_free(&to_o), acts_free(&to_gu), acts_free(&to_down), acts_free(&to_head);
}
