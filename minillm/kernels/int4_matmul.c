/* Matrix products with quantized weights for CPUs: out = x W^T (+ residual), with W in one of two formats:
 *   int4  4-bit codes q in 0..15 with a scale s and zero point z per group of G inputs (w = q * s + z, GGUF's
 *         Q4_1), laid out by minillm/kernels/int4_cpu.py as
 *         wq    [tiles, K / 8, 16 rows, 4] bytes: byte (c, j, i) holds q[16t + j, 8c + i] in its low nibble and
 *               q[16t + j, 8c + 4 + i] in its high one, so one 64-byte load gives 4 consecutive codes of 16 rows,
 *               twice: the layout of the integer dot-product instructions, one output row per 32-bit lane
 *         ws,wz [tiles, K / G, 16 rows] float16 scales and zero points
 *   int8  signed codes q with a float scale s per group of G inputs (w = q * s, symmetric; G = K: one scale per
 *         output channel, G = 32: GGUF's Q8_0), laid out as
 *         wq    [tiles, K / 4, 16 rows, 4] int8: byte (c, j, i) holds q[16t + j, 4c + i]
 *         ws    [tiles, K / G, 16 rows] float32
 * x [M, K] float32; residual, out [M, N] float32 (residual may be NULL or equal out). The library is compiled at
 * first use by minillm/kernels/int4_cpu.py.
 * The products are not weight-only: each row of x is quantized to int8 per block of 32 (symmetric, one float scale
 * a block, as llama.cpp's Q8 blocks), so the inner products run on integers: AVX512-VNNI's vpdpbusd (unsigned
 * bytes times signed bytes, four products summed into each 32-bit lane), AVX2's vpmaddubsw, or plain C, as the
 * compiler finds; and where the CPU has AMX, each whole group of 16 rows of x through its tile product (below).
 * int4: the zero points need only the float sum of x over each group: sum w x = s sum q x + z sum x.
 * int8: vpdpbusd wants one operand unsigned, so the kernel flips each code's sign bit (q + 128 in 0..255) and
 * starts the block's integer sum at -128 * (sum of x's codes in the block): exact, and nothing more to read. Its
 * scales multiply once per group: once per row when G = K.
 * Threads split the output rows (tiles of 16); each thread runs every row of x over a tile while the tile is
 * in cache, so a call reads each weight byte from memory once. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROWS 16         /* weight rows per tile: one per 32-bit lane of a 512-bit register */
#define BLOCK 32        /* inputs per int8 block of x */
#define MR 4            /* rows of x sharing each unpacked block of weights */
#define MCHUNK 64       /* rows of x per work item: larger batches also split over threads by rows */
/* Blocks (and groups) of int4 weights to prefetch ahead, ~4 KB of codes: on the machine this was written on it
 * made a decode step's products (each a stream of 0.2 to 1.1 MB) about 15 % faster (benchmarks/int4_cpu.py). */
#define AHEAD 16
#define AHEAD8 8 /* the same 4 KB of int8 weights: 8 blocks of 512 bytes */
#define SERIAL_QUANTIZE 65536 /* x smaller than this (elements) is quantized by the calling thread alone */
/* sum q x = sum (q - C) x + C sum x, with the last sum taken exactly: x's rounding error is then weighted by
 * q - C (|q - C| <= 7.5) instead of q (up to 15), which cuts the product's error in half for typical weights. */
#define CENTER 7.5f

/* A weight in one of the two layouts above; for int8, zero is NULL. */
typedef struct {
    int bits;
    const void *q, *scale, *zero;
    int64_t n, k, g;
} Weight;

/* x quantized: codes [M, K], scales and code sums [M, K / 32], exact group sums [M, K / G] and the centring term
 * CENTER * (exact - rounded group sum) [M, K / G]. */
typedef struct {
    int8_t *q;
    float *scale, *sum, *corr;
    int32_t *isum;
    int64_t k, blocks, groups;
} Acts;

/* Row m of the quantized x from its float row x, with exact sums per group of g inputs. */
static void quantize_row(const Acts *a, const float *x, int64_t m, int64_t g) {
    int8_t *q = a->q + m * a->k;
    float *scale = a->scale + m * a->blocks, *sum = a->sum + m * a->groups, *corr = a->corr + m * a->groups;
    const int64_t k = a->k;
    for (int64_t gi = 0; gi < k / g; gi++) {
        float exact = 0.0f, rounded = 0.0f;
        for (int64_t b = gi * g; b < (gi + 1) * g; b += BLOCK) { /* simple loops, which the compiler vectorizes */
            float amax = 0.0f;
            int32_t v[BLOCK], isum = 0;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(x[b + i]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < BLOCK; i++) v[i] = (int32_t)rintf(x[b + i] * inv);
            for (int i = 0; i < BLOCK; i++) {
                q[b + i] = (int8_t)v[i];
                isum += v[i];
                exact += x[b + i];
            }
            scale[b / BLOCK] = amax / 127.0f;
            a->isum[m * a->blocks + b / BLOCK] = isum;
            rounded += scale[b / BLOCK] * (float)isum;
        }
        sum[gi] = exact;
        corr[gi] = CENTER * (exact - rounded);
    }
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__)
const char *quant_matmul_isa(void) { return "avx512vnni"; }

/* Rows m0 .. m0 + rows of a tile's output: each row's sums plus its residual (where given), ncols columns. */
static inline __attribute__((always_inline)) void store_rows(const __m512 *acc, int rows, int64_t m0,
                                                             const float *residual, float *out, int64_t n, int64_t n0,
                                                             int64_t ncols) {
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    for (int r = 0; r < rows; r++) {
        const int64_t at = (m0 + r) * n + n0;
        __m512 y = acc[r];
        if (residual) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, residual + at));
        _mm512_mask_storeu_ps(out + at, mask, y);
    }
}

/* out[m0 .. m0 + mr, n0 .. n0 + ncols] for one tile; mr is a constant where inlined, so acc stays in registers. */
static inline __attribute__((always_inline)) void tile4(const uint8_t *wq, const uint16_t *ws, const uint16_t *wz,
                                                        const Acts *a, int64_t m0, const int mr, int64_t g,
                                                        const float *residual, float *out, int64_t n, int64_t n0,
                                                        int64_t ncols) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < a->groups; gi++) {
        _mm_prefetch((const char *)(ws + (gi + AHEAD) * ROWS), _MM_HINT_T0);
        _mm_prefetch((const char *)(wz + (gi + AHEAD) * ROWS), _MM_HINT_T0);
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ws + gi * ROWS)));
        const __m512 zw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wz + gi * ROWS)));
        __m512 gsum[MR];
        for (int r = 0; r < mr; r++) gsum[r] = _mm512_set1_ps(a->corr[(m0 + r) * a->groups + gi]);
        for (int64_t b = gi * (g / BLOCK); b < (gi + 1) * (g / BLOCK); b++) {
            const uint8_t *p = wq + b * 4 * 64;
            for (int v = 0; v < 4; v++) _mm_prefetch((const char *)(p + AHEAD * 4 * 64 + 64 * v), _MM_HINT_T0);
            __m512i w[8];
            for (int v = 0; v < 4; v++) {
                const __m512i raw = _mm512_loadu_si512(p + 64 * v);
                w[2 * v] = _mm512_and_si512(raw, low);
                w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = a->q + (m0 + r) * a->k + b * BLOCK;
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    d0 = _mm512_dpbusd_epi32(d0, w[j], _mm512_set1_epi32(load4(xr + 4 * j)));
                    d1 = _mm512_dpbusd_epi32(d1, w[j + 1], _mm512_set1_epi32(load4(xr + 4 * j + 4)));
                }
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
                gsum[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(a->scale[(m0 + r) * a->blocks + b]), gsum[r]);
            }
        }
        for (int r = 0; r < mr; r++) {
            acc[r] = _mm512_fmadd_ps(gsum[r], sw, acc[r]);
            acc[r] = _mm512_fmadd_ps(zw, _mm512_set1_ps(a->sum[(m0 + r) * a->groups + gi]), acc[r]);
        }
    }
    store_rows(acc, mr, m0, residual, out, n, n0, ncols);
}

/* The int8 tile: codes with their sign bit flipped (q + 128, unsigned) against x's signed codes; each block's
 * sum starts at -128 * (sum of x's codes) to take the 128s back out. The weight scales multiply once per group. */
static inline __attribute__((always_inline)) void tile8(const int8_t *wq, const float *ws, const Acts *a, int64_t m0,
                                                        const int mr, int64_t g, const float *residual, float *out,
                                                        int64_t n, int64_t n0, int64_t ncols) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    __m512 acc[MR]; /* starting from the residual, which one group a row (per channel) adds in its single rounding */
    for (int r = 0; r < mr; r++)
        acc[r] = residual ? _mm512_maskz_loadu_ps(mask, residual + (m0 + r) * n + n0) : _mm512_setzero_ps();
    for (int64_t gi = 0; gi < a->groups; gi++) {
        __m512 gsum[MR];
        for (int r = 0; r < mr; r++) gsum[r] = _mm512_setzero_ps();
        for (int64_t b = gi * (g / BLOCK); b < (gi + 1) * (g / BLOCK); b++) {
            const int8_t *p = wq + b * 8 * 64;
            for (int v = 0; v < 8; v++) _mm_prefetch((const char *)(p + AHEAD8 * 8 * 64 + 64 * v), _MM_HINT_T0);
            __m512i w[8];
            for (int v = 0; v < 8; v++) w[v] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * v), flip);
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = a->q + (m0 + r) * a->k + b * BLOCK;
                __m512i d0 = _mm512_set1_epi32(-128 * a->isum[(m0 + r) * a->blocks + b]), d1 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {
                    d0 = _mm512_dpbusd_epi32(d0, w[j], _mm512_set1_epi32(load4(xr + 4 * j)));
                    d1 = _mm512_dpbusd_epi32(d1, w[j + 1], _mm512_set1_epi32(load4(xr + 4 * j + 4)));
                }
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
                gsum[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(a->scale[(m0 + r) * a->blocks + b]), gsum[r]);
            }
        }
        const __m512 sw = _mm512_loadu_ps(ws + gi * ROWS);
        for (int r = 0; r < mr; r++) acc[r] = _mm512_fmadd_ps(gsum[r], sw, acc[r]);
    }
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(out + (m0 + r) * n + n0, mask, acc[r]);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
/* AMX (Intel's tile unit, Sapphire Rapids on): one tdpbssd multiplies 16 rows of x's codes by a block of 32 inputs
 * of 16 weight rows, 8192 multiply-adds where vpdpbusd does 64, into a 16 x 16 tile of the same exact integer sums
 * the loop above forms row by row. The block's float arithmetic after it is the loop's, in its order, so the two
 * paths agree to the bit; only the integer dot products moved. Used for each whole group of 16 rows of x (batched
 * decode, prefill); the rows left over take the loop above. Linux lends a process the tile registers on request. */
#include "amx_tiles.h"
_Static_assert(AMX_K == BLOCK, "a tile product's row of x is one int8 block");

static int amx_on = 0; /* whether the products use AMX: on from load where Linux grants it */

/* Ask for the tile registers once; use them if granted and `want` is 1, not if it is 0 (a negative `want` changes
 * nothing). Returns whether the products use them now. */
int quant_matmul_use_amx(int want) {
    static int granted = -1;
    if (granted < 0) granted = amx_request();
    if (want >= 0) amx_on = want && granted;
    return amx_on;
}

__attribute__((constructor)) static void amx_default(void) { quant_matmul_use_amx(1); }

#define AMX_BLOCKS 4 /* blocks multiplied, each into its own tile of sums, before their sums are read back: one
                      * block at a time ran slower when this was written (timed against the vector loop) */

/* The integer sums of `nb` (1 to 4) consecutive blocks for 16 rows of x whose codes start at xq (row stride k), the
 * block's weights every 512 bytes from w: dots[j][r][i] = sum over block j of x[r] q[i]. */
static inline void amx_dots(const int8_t *xq, int64_t k, const int8_t *w, int nb, int32_t dots[][AMX_ROWS][16]) {
#define AMX_DOT(c, xt, wt, j)                                                                        \
    do {                                                                                             \
        _tile_zero(c);                                                                               \
        _tile_loadd(xt, xq + (j) * BLOCK, k);                                                        \
        _tile_loadd(wt, w + (j) * 512, 64);                                                          \
        _tile_dpbssd(c, xt, wt);                                                                     \
    } while (0)
    AMX_DOT(0, 4, 6, 0);
    if (nb > 1) AMX_DOT(1, 5, 7, 1);
    if (nb > 2) AMX_DOT(2, 4, 6, 2);
    if (nb > 3) AMX_DOT(3, 5, 7, 3);
#undef AMX_DOT
    _tile_stored(0, dots[0], 64);
    if (nb > 1) _tile_stored(1, dots[1], 64);
    if (nb > 2) _tile_stored(2, dots[2], 64);
    if (nb > 3) _tile_stored(3, dots[3], 64);
}

static void tile4_amx(const uint8_t *wq, const uint16_t *ws, const uint16_t *wz, const Acts *a, int64_t m0,
                      int64_t g, const float *residual, float *out, int64_t n, int64_t n0, int64_t ncols) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t per_group = g / BLOCK;
    int32_t dots[AMX_BLOCKS][AMX_ROWS][16] __attribute__((aligned(64)));
    int8_t w[AMX_BLOCKS][8][64] __attribute__((aligned(64))); /* the blocks' codes unpacked, as the loop's w[] */
    __m512 acc[AMX_ROWS], gsum[AMX_ROWS]; /* a group's sum carries over from one batch of blocks to the next */
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = gsum[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < a->blocks; b0 += AMX_BLOCKS) {
        const int nb = a->blocks - b0 < AMX_BLOCKS ? (int)(a->blocks - b0) : AMX_BLOCKS;
        for (int j = 0; j < nb; j++) {
            const uint8_t *p = wq + (b0 + j) * 4 * 64;
            for (int v = 0; v < 4; v++) {
                _mm_prefetch((const char *)(p + AHEAD * 4 * 64 + 64 * v), _MM_HINT_T0);
                const __m512i raw = _mm512_loadu_si512(p + 64 * v);
                _mm512_store_si512(w[j][2 * v], _mm512_and_si512(raw, low));
                _mm512_store_si512(w[j][2 * v + 1], _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
            }
        }
        amx_dots(a->q + m0 * a->k + b0 * BLOCK, a->k, w[0][0], nb, dots);
        for (int j = 0; j < nb; j++) { /* the loop's float arithmetic, in its order for each row */
            const int64_t b = b0 + j, gi = b / per_group;
            if (b % per_group == 0)
                for (int r = 0; r < AMX_ROWS; r++) gsum[r] = _mm512_set1_ps(a->corr[(m0 + r) * a->groups + gi]);
            for (int r = 0; r < AMX_ROWS; r++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j][r]));
                gsum[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(a->scale[(m0 + r) * a->blocks + b]), gsum[r]);
            }
            if (b % per_group == per_group - 1) {
                _mm_prefetch((const char *)(ws + (gi + AHEAD) * ROWS), _MM_HINT_T0);
                _mm_prefetch((const char *)(wz + (gi + AHEAD) * ROWS), _MM_HINT_T0);
                const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ws + gi * ROWS)));
                const __m512 zw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wz + gi * ROWS)));
                for (int r = 0; r < AMX_ROWS; r++) {
                    acc[r] = _mm512_fmadd_ps(gsum[r], sw, acc[r]);
                    acc[r] = _mm512_fmadd_ps(zw, _mm512_set1_ps(a->sum[(m0 + r) * a->groups + gi]), acc[r]);
                }
            }
        }
    }
    store_rows(acc, AMX_ROWS, m0, residual, out, n, n0, ncols);
}

/* The int8 tile: its codes are signed already, in the tile's layout, so tdpbssd reads them where they lie. */
static void tile8_amx(const int8_t *wq, const float *ws, const Acts *a, int64_t m0, int64_t g, const float *residual,
                      float *out, int64_t n, int64_t n0, int64_t ncols) {
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    const int64_t per_group = g / BLOCK;
    int32_t dots[AMX_BLOCKS][AMX_ROWS][16] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS], gsum[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) {
        acc[r] = residual ? _mm512_maskz_loadu_ps(mask, residual + (m0 + r) * n + n0) : _mm512_setzero_ps();
        gsum[r] = _mm512_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < a->blocks; b0 += AMX_BLOCKS) {
        const int nb = a->blocks - b0 < AMX_BLOCKS ? (int)(a->blocks - b0) : AMX_BLOCKS;
        const int8_t *p = wq + b0 * 8 * 64;
        for (int v = 0; v < 8 * nb; v++) _mm_prefetch((const char *)(p + AHEAD8 * 8 * 64 + 64 * v), _MM_HINT_T0);
        amx_dots(a->q + m0 * a->k + b0 * BLOCK, a->k, p, nb, dots);
        for (int j = 0; j < nb; j++) {
            const int64_t b = b0 + j;
            if (b % per_group == 0)
                for (int r = 0; r < AMX_ROWS; r++) gsum[r] = _mm512_setzero_ps();
            for (int r = 0; r < AMX_ROWS; r++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[j][r]));
                gsum[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(a->scale[(m0 + r) * a->blocks + b]), gsum[r]);
            }
            if (b % per_group == per_group - 1) {
                const __m512 sw = _mm512_loadu_ps(ws + b / per_group * ROWS);
                for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_fmadd_ps(gsum[r], sw, acc[r]);
            }
        }
    }
    for (int r = 0; r < AMX_ROWS; r++) _mm512_mask_storeu_ps(out + (m0 + r) * n + n0, mask, acc[r]);
}
#define HAVE_AMX 1
#endif

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
const char *quant_matmul_isa(void) { return "avx2"; }

/* A tile's output rows m0 .. m0 + mr from the sums of its two halves, plus the residual where given, ncols
 * columns. */
static inline __attribute__((always_inline)) void store_halves(__m256 acc[2][MR], int mr, int64_t m0,
                                                               const float *residual, float *out, int64_t n,
                                                               int64_t n0, int64_t ncols) {
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mr; r++) {
            float y[8];
            _mm256_storeu_ps(y, acc[h][r]);
            for (int64_t j = 8 * h; j < ncols && j < 8 * h + 8; j++) {
                const int64_t at = (m0 + r) * n + n0 + j;
                out[at] = y[j - 8 * h] + (residual ? residual[at] : 0.0f);
            }
        }
}

/* Keeps an integer sum in a register and its additions in the order written: left to itself, GCC regroups the
 * additions, computing a block's products first and parking them on the stack, which cost the tiles a fifth to a
 * quarter of their speed with several rows of x. */
#define IN_ORDER(v) __asm__("" : "+x"(v))

/* As the AVX512 version, each tile in two halves of 8 rows (one per 32-bit lane of a 256-bit register), taken
 * together from each 64-byte line as it arrives, so memory streams throughout; each row of x's two broadcast codes
 * serve both halves. The 16-bit pair sums of vpmaddubsw stay below 2 * 15 * 127, so eight of them add up without
 * overflow. */
static inline __attribute__((always_inline)) void tile4(const uint8_t *wq, const uint16_t *ws, const uint16_t *wz,
                                                        const Acts *a, int64_t m0, const int mr, int64_t g,
                                                        const float *residual, float *out, int64_t n, int64_t n0,
                                                        int64_t ncols) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2][MR];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mr; r++) acc[h][r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < a->groups; gi++) {
        _mm_prefetch((const char *)(ws + (gi + AHEAD) * ROWS), _MM_HINT_T0);
        _mm_prefetch((const char *)(wz + (gi + AHEAD) * ROWS), _MM_HINT_T0);
        __m256 gsum[2][MR];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < mr; r++) gsum[h][r] = _mm256_set1_ps(a->corr[(m0 + r) * a->groups + gi]);
        for (int64_t b = gi * (g / BLOCK); b < (gi + 1) * (g / BLOCK); b++) {
            for (int v = 0; v < 4; v++)
                _mm_prefetch((const char *)(wq + b * 4 * 64 + AHEAD * 4 * 64 + 64 * v), _MM_HINT_T0);
            __m256i s[2][MR];
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < mr; r++) s[h][r] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) { /* line v: codes of inputs 8v .. 8v + 3 (low nibbles), 8v + 4 .. 8v + 7 */
                __m256i w[2][2];
                for (int h = 0; h < 2; h++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(wq + b * 4 * 64 + 64 * v + 32 * h));
                    w[h][0] = _mm256_and_si256(raw, low);
                    w[h][1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
                for (int r = 0; r < mr; r++) {
                    const int8_t *xr = a->q + (m0 + r) * a->k + b * BLOCK + 8 * v;
                    const __m256i xl = _mm256_set1_epi32(load4(xr)), xh = _mm256_set1_epi32(load4(xr + 4));
                    for (int h = 0; h < 2; h++) {
                        s[h][r] = _mm256_add_epi16(s[h][r], _mm256_maddubs_epi16(w[h][0], xl));
                        s[h][r] = _mm256_add_epi16(s[h][r], _mm256_maddubs_epi16(w[h][1], xh));
                        IN_ORDER(s[h][r]);
                    }
                }
            }
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < mr; r++) {
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[h][r], ones));
                    gsum[h][r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(a->scale[(m0 + r) * a->blocks + b]), gsum[h][r]);
                }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws + gi * ROWS + 8 * h)));
            const __m256 zw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wz + gi * ROWS + 8 * h)));
            for (int r = 0; r < mr; r++) {
                acc[h][r] = _mm256_fmadd_ps(gsum[h][r], sw, acc[h][r]);
                acc[h][r] = _mm256_fmadd_ps(zw, _mm256_set1_ps(a->sum[(m0 + r) * a->groups + gi]), acc[h][r]);
            }
        }
    }
    store_halves(acc, mr, m0, residual, out, n, n0, ncols);
}

/* The int8 tile in two halves of 8 rows, both per line, as tile4. vpmaddubsw's pairs of 255 * 127 would saturate
 * 16 bits, so it takes |q| (unsigned) against x's codes carrying q's sign: pairs of at most 2 * 128 * 127, each
 * widened at once. */
static inline __attribute__((always_inline)) void tile8(const int8_t *wq, const float *ws, const Acts *a, int64_t m0,
                                                        const int mr, int64_t g, const float *residual, float *out,
                                                        int64_t n, int64_t n0, int64_t ncols) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][MR];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mr; r++) acc[h][r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < a->groups; gi++) {
        __m256 gsum[2][MR];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < mr; r++) gsum[h][r] = _mm256_setzero_ps();
        for (int64_t b = gi * (g / BLOCK); b < (gi + 1) * (g / BLOCK); b++) {
            for (int v = 0; v < 8; v++)
                _mm_prefetch((const char *)(wq + b * 8 * 64 + AHEAD8 * 8 * 64 + 64 * v), _MM_HINT_T0);
            __m256i s[2][MR];
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < mr; r++) s[h][r] = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) { /* line v: codes of inputs 4v .. 4v + 3 */
                __m256i w[2], size[2];
                for (int h = 0; h < 2; h++) {
                    w[h] = _mm256_loadu_si256((const __m256i *)(wq + b * 8 * 64 + 64 * v + 32 * h));
                    size[h] = _mm256_abs_epi8(w[h]);
                }
                for (int r = 0; r < mr; r++) {
                    const __m256i x = _mm256_set1_epi32(load4(a->q + (m0 + r) * a->k + b * BLOCK + 4 * v));
                    for (int h = 0; h < 2; h++) {
                        const __m256i pairs = _mm256_maddubs_epi16(size[h], _mm256_sign_epi8(x, w[h]));
                        s[h][r] = _mm256_add_epi32(s[h][r], _mm256_madd_epi16(pairs, ones));
                        IN_ORDER(s[h][r]);
                    }
                }
            }
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < mr; r++)
                    gsum[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]),
                                                 _mm256_set1_ps(a->scale[(m0 + r) * a->blocks + b]), gsum[h][r]);
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sw = _mm256_loadu_ps(ws + gi * ROWS + 8 * h);
            for (int r = 0; r < mr; r++) acc[h][r] = _mm256_fmadd_ps(gsum[h][r], sw, acc[h][r]);
        }
    }
    store_halves(acc, mr, m0, residual, out, n, n0, ncols);
}

#else
const char *quant_matmul_isa(void) { return "scalar"; }

static float half_to_float(uint16_t h) {
    const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    float f = exponent == 0 ? ldexpf((float)mantissa, -24)  /* zero and subnormals */
              : exponent == 31 ? (mantissa ? NAN : INFINITY)
              : ldexpf((float)(mantissa | 0x400), exponent - 25);
    return (h & 0x8000) ? -f : f;
}

/* The same products lane by lane: the rows of a tile are the inner loop, which the compiler may vectorize. */
static void tile4(const uint8_t *wq, const uint16_t *ws, const uint16_t *wz, const Acts *a, int64_t m0, const int mr,
                  int64_t g, const float *residual, float *out, int64_t n, int64_t n0, int64_t ncols) {
    for (int64_t m = m0; m < m0 + mr; m++) {
        float acc[ROWS] = {0.0f};
        for (int64_t gi = 0; gi < a->groups; gi++) {
            float gsum[ROWS];
            for (int j = 0; j < ROWS; j++) gsum[j] = a->corr[m * a->groups + gi];
            for (int64_t b = gi * (g / BLOCK); b < (gi + 1) * (g / BLOCK); b++) {
                const int8_t *xr = a->q + m * a->k + b * BLOCK;
                int32_t dot[ROWS] = {0};
                for (int c = 0; c < 8; c++) { /* inputs 4c .. 4c + 3: low nibbles for even c, high for odd */
                    const uint8_t *p = wq + b * 4 * 64 + (c / 2) * 64;
                    for (int i = 0; i < 4; i++)
                        for (int j = 0; j < ROWS; j++)
                            dot[j] += ((p[4 * j + i] >> (4 * (c % 2))) & 0x0F) * xr[4 * c + i];
                }
                for (int j = 0; j < ROWS; j++) gsum[j] += (float)dot[j] * a->scale[m * a->blocks + b];
            }
            for (int j = 0; j < ROWS; j++)
                acc[j] += gsum[j] * half_to_float(ws[gi * ROWS + j])
                          + half_to_float(wz[gi * ROWS + j]) * a->sum[m * a->groups + gi];
        }
        for (int64_t j = 0; j < ncols; j++)
            out[m * n + n0 + j] = acc[j] + (residual ? residual[m * n + n0 + j] : 0.0f);
    }
}
static void tile8(const int8_t *wq, const float *ws, const Acts *a, int64_t m0, const int mr, int64_t g,
                  const float *residual, float *out, int64_t n, int64_t n0, int64_t ncols) {
    for (int64_t m = m0; m < m0 + mr; m++) {
        float acc[ROWS] = {0.0f}; /* starting from the residual, as the AVX512 tile does */
        for (int64_t j = 0; j < ncols && residual; j++) acc[j] = residual[m * n + n0 + j];
        for (int64_t gi = 0; gi < a->groups; gi++) {
            float gsum[ROWS] = {0.0f};
            for (int64_t b = gi * (g / BLOCK); b < (gi + 1) * (g / BLOCK); b++) {
                const int8_t *xr = a->q + m * a->k + b * BLOCK;
                int32_t dot[ROWS] = {0};
                for (int c = 0; c < 8; c++) { /* inputs 4c .. 4c + 3 */
                    const int8_t *p = wq + b * 8 * 64 + c * 64;
                    for (int i = 0; i < 4; i++)
                        for (int j = 0; j < ROWS; j++) dot[j] += p[4 * j + i] * xr[4 * c + i];
                }
                for (int j = 0; j < ROWS; j++) gsum[j] += (float)dot[j] * a->scale[m * a->blocks + b];
            }
            for (int j = 0; j < ROWS; j++) acc[j] += gsum[j] * ws[gi * ROWS + j];
        }
        for (int64_t j = 0; j < ncols; j++) out[m * n + n0 + j] = acc[j];
    }
}
#endif

#ifndef HAVE_AMX
int quant_matmul_use_amx(int want) { (void)want; return 0; } /* this build has no tile products */
#endif

/* Rows m0 .. m0 + mr of x over output tile t: constant row counts, so each copy keeps its sums in registers. */
static void rows(const Weight *w, const Acts *a, int64_t t, int64_t m0, int64_t mr, const float *residual,
                 float *out) {
    const int64_t n = w->n, n0 = t * ROWS, ncols = n - n0 < ROWS ? n - n0 : ROWS, g = w->g;
    if (w->bits == 8) {
        const int8_t *tq = (const int8_t *)w->q + t * w->k * ROWS;
        const float *ts = (const float *)w->scale + t * a->groups * ROWS;
#ifdef HAVE_AMX
        if (mr == AMX_ROWS) return tile8_amx(tq, ts, a, m0, g, residual, out, n, n0, ncols);
#endif
        switch (mr) {
        case 4: tile8(tq, ts, a, m0, 4, g, residual, out, n, n0, ncols); break;
        case 3: tile8(tq, ts, a, m0, 3, g, residual, out, n, n0, ncols); break;
        case 2: tile8(tq, ts, a, m0, 2, g, residual, out, n, n0, ncols); break;
        default: tile8(tq, ts, a, m0, 1, g, residual, out, n, n0, ncols);
        }
        return;
    }
    const uint8_t *tq = (const uint8_t *)w->q + t * (w->k / 8) * 64;
    const uint16_t *ts = (const uint16_t *)w->scale + t * a->groups * ROWS;
    const uint16_t *tz = (const uint16_t *)w->zero + t * a->groups * ROWS;
#ifdef HAVE_AMX
    if (mr == AMX_ROWS) return tile4_amx(tq, ts, tz, a, m0, g, residual, out, n, n0, ncols);
#endif
    switch (mr) {
    case 4: tile4(tq, ts, tz, a, m0, 4, g, residual, out, n, n0, ncols); break;
    case 3: tile4(tq, ts, tz, a, m0, 3, g, residual, out, n, n0, ncols); break;
    case 2: tile4(tq, ts, tz, a, m0, 2, g, residual, out, n, n0, ncols); break;
    default: tile4(tq, ts, tz, a, m0, 1, g, residual, out, n, n0, ncols);
    }
}

/* x quantized for m rows of k inputs whose weight groups are g wide, in one allocation (`acts_free` frees it). */
static Acts acts_new(int64_t m, int64_t k, int64_t g) {
    const int64_t blocks = k / BLOCK, groups = k / g;
    float *work = malloc(4 * m * (2 * blocks + 2 * groups) + m * k); /* one allocation: a call is a few us */
    const Acts a = {(int8_t *)(work + m * (2 * blocks + 2 * groups)), work, work + m * blocks,
                    work + m * (blocks + groups), (int32_t *)(work + m * (blocks + 2 * groups)), k, blocks, groups};
    return a;
}

static void acts_free(Acts *a) { free(a->scale); } /* the start of the allocation */

/* Thread `id` of `threads`: its share of out = x W^T (+ residual), x already quantized into a. Work items are
 * (tile of 16 output rows, chunk of x's rows), split in contiguous ranges by hand: a team of one then costs no more
 * than a plain call (an omp for costs a microsecond). */
static void products(const Weight *w, const Acts *a, const float *residual, float *out, int64_t m, int64_t id,
                     int64_t threads) {
    const int64_t tiles = (w->n + ROWS - 1) / ROWS, chunks = (m + MCHUNK - 1) / MCHUNK, items = tiles * chunks;
#ifdef HAVE_AMX
    const int amx = amx_on > 0 && m >= AMX_ROWS;
    if (amx) amx_configure();
#endif
    for (int64_t item = items * id / threads; item < items * (id + 1) / threads; item++) {
        const int64_t t = item / chunks, c = item % chunks, end = (c + 1) * MCHUNK < m ? (c + 1) * MCHUNK : m;
        int64_t m0 = c * MCHUNK;
#ifdef HAVE_AMX
        for (; amx && m0 + AMX_ROWS <= end; m0 += AMX_ROWS) rows(w, a, t, m0, AMX_ROWS, residual, out);
#endif
        for (; m0 < end; m0 += MR) rows(w, a, t, m0, end - m0 < MR ? end - m0 : MR, residual, out);
    }
#ifdef HAVE_AMX
    if (amx) _tile_release();
#endif
}

/* out = x W^T (+ residual) for x [m, k] float32 and W [n, k] in one of the layouts above (bits 4 or 8; k a multiple
 * of g, g of 32; int8: wz NULL). */
void quant_matmul_f32(int64_t bits, const void *wq, const void *ws, const void *wz, int64_t n, int64_t k, int64_t g,
                      const float *x, const float *residual, float *out, int64_t m) {
    const Weight w = {(int)bits, wq, ws, wz, n, k, g};
    Acts a = acts_new(m, k, g);
    /* A small x is quantized before the threads start: a barrier between the two phases costs more than that. */
    const int64_t serial = m * k <= SERIAL_QUANTIZE;
    for (int64_t i = 0; serial && i < m; i++) quantize_row(&a, x + i * k, i, g);
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        if (!serial) {
            for (int64_t i = id; i < m; i += threads) quantize_row(&a, x + i * k, i, g);
#pragma omp barrier
        }
        products(&w, &a, residual, out, m, id, threads);
    }
    acts_free(&a);
}
