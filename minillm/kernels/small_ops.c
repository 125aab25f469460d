/* The small operations between a decoder layer's products, on float32 rows: RMSNorm, RoPE and SiLU times up, and
 * greedy sampling's argmax over the logits. minillm/layers.py (sampling.py) defines each in PyTorch and, on a CPU,
 * calls these instead; the fused decode step
 * (decode_step.c) and the attention kernel (paged_decode.c) include this file and call the same row functions.
 * Each row function is kept out of line, one compiled body whoever calls it, so that a step layer by layer and a
 * fused step compute the same floats: an input of a product that differs in its last bit can round to another int8
 * code, and the tokens drift apart.
 * Compiled at first use by minillm/kernels/small_ops.py. */
#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define SMALL_SERIAL 65536 /* fewer elements than this are done by the calling thread alone */

/* out = x / sqrt(mean(x^2) + eps) * gain, one row of d values (out may be x). */
__attribute__((noinline)) static void rms_norm_row(const float *x, const float *gain, float eps, int64_t d,
                                                   float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < d; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)d + eps);
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * r * gain[i];
}

/* RoPE on `heads` consecutive heads of d values: x * cos + (x rolled by half a head) * signed sin, with the
 * signed sin's first half negated (layers.signed_sin); out may be x. */
__attribute__((noinline)) static void rope_row(const float *x, const float *cos, const float *sin_signed,
                                               int64_t heads, int64_t d, float *out) {
    const int64_t half = d / 2;
    float h[d];
    for (int64_t j = 0; j < heads; j++) {
        memcpy(h, x + j * d, sizeof(float) * d);
        float *o = out + j * d;
        for (int64_t i = 0; i < half; i++) o[i] = h[i] * cos[i] + h[i + half] * sin_signed[i]; /* the roll: */
        for (int64_t i = half; i < d; i++) o[i] = h[i] * cos[i] + h[i - half] * sin_signed[i]; /* two halves */
    }
}

/* out = silu(gate) * up for one row, gate and up side by side in gu [2n]. */
__attribute__((noinline)) static void silu_mul_row(const float *gu, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[n + i];
}

/* rms_norm_row over m rows of x (row i at x + i * x_stride) into out [m, d]. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *gain, float eps, int64_t m, int64_t d, float *out) {
    if (m * d < SMALL_SERIAL) {
        for (int64_t i = 0; i < m; i++) rms_norm_row(x + i * x_stride, gain, eps, d, out + i * d);
        return;
    }
#pragma omp parallel for
    for (int64_t i = 0; i < m; i++) rms_norm_row(x + i * x_stride, gain, eps, d, out + i * d);
}

/* rope_row over m tokens (token i's heads at x + i * x_stride, its cos and signed sin rows at cos + i * d and
 * sin_signed + i * d) into out [m, heads, d]. */
void rope_f32(const float *x, int64_t x_stride, const float *cos, const float *sin_signed, int64_t m, int64_t heads,
              int64_t d, float *out) {
    if (m * heads * d < SMALL_SERIAL) {
        for (int64_t i = 0; i < m; i++) rope_row(x + i * x_stride, cos + i * d, sin_signed + i * d, heads, d,
                                                 out + i * heads * d);
        return;
    }
#pragma omp parallel for
    for (int64_t i = 0; i < m; i++) rope_row(x + i * x_stride, cos + i * d, sin_signed + i * d, heads, d,
                                             out + i * heads * d);
}

/* silu_mul_row over m rows of gu [m, 2n] into out [m, n]. */
void silu_mul_f32(const float *gu, int64_t m, int64_t n, float *out) {
    if (m * n < SMALL_SERIAL) {
        for (int64_t i = 0; i < m; i++) silu_mul_row(gu + i * 2 * n, n, out + i * n);
        return;
    }
#pragma omp parallel for
    for (int64_t i = 0; i < m; i++) silu_mul_row(gu + i * 2 * n, n, out + i * n);
}

#define ARGMAX_CHUNK 64 /* values whose largest is kept in pass 1, so that pass 2 scans one chunk, not the row */

/* Whether a float is a NaN or an infinity, read from its bits: the library is built with -ffast-math, under which
 * the compiler takes isnan and isinf to be false. */
static inline bool not_finite(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (bits & 0x7F800000u) == 0x7F800000u;
}

/* Index of the first largest of n values, or -1 where that largest is not finite (a NaN anywhere, a +inf, or every
 * value -inf): what sampling.sample reads from PyTorch's max(dim=-1). One pass keeps each chunk's largest and counts
 * the NaNs and +infs (both loops vectorize); then the first chunk holding the row's largest, and the first place in
 * it. */
__attribute__((noinline)) static int64_t argmax_row(const float *x, int64_t n) {
    float chunk_max[(n + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK];
    float best = -INFINITY;
    int bad = 0; /* NaNs and +infs: a row with one has no argmax (-inf, a masked token, is fine) */
    for (int64_t c = 0; c * ARGMAX_CHUNK < n; c++) {
        const int64_t end = (c + 1) * ARGMAX_CHUNK < n ? (c + 1) * ARGMAX_CHUNK : n;
        float m = -INFINITY;
        for (int64_t i = c * ARGMAX_CHUNK; i < end; i++) {
            uint32_t bits;
            memcpy(&bits, x + i, 4);
            m = fmaxf(m, x[i]);
            bad += not_finite(x[i]) & (bits != 0xFF800000u);
        }
        chunk_max[c] = m;
        best = fmaxf(best, m);
    }
    if (bad || not_finite(best)) return -1; /* a NaN or +inf, or every value -inf */
    int64_t c = 0;
    while (chunk_max[c] != best) c++;
    int64_t i = c * ARGMAX_CHUNK;
    while (x[i] != best) i++;
    return i;
}

/* argmax_row over m rows of n values (contiguous) into idx [m]. */
void argmax_f32(const float *x, int64_t m, int64_t n, int64_t *idx) {
    if (m * n < SMALL_SERIAL) {
        for (int64_t i = 0; i < m; i++) idx[i] = argmax_row(x + i * n, n);
        return;
    }
#pragma omp parallel for
    for (int64_t i = 0; i < m; i++) idx[i] = argmax_row(x + i * n, n);
}
