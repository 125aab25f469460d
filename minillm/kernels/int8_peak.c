/* Chapter 6 — the CPU's rate of 8-bit multiply-adds with the instructions of minillm's int4/int8 kernel
 * (int4_matmul.c): AVX512-VNNI's vpdpbusd (64 a 512-bit instruction), or AVX2's vpmaddubsw (32, into 16-bit sums
 * that one vpmaddwd widens every 8, as the int4 kernel does); and, where the kernel uses AMX, its tile product
 * tdpbssd in the kernel's shapes (int8_macs_amx). Each OpenMP thread runs `iters` rounds (of eight vpmaddubsw with
 * AVX2) of independent accumulators (enough to hide the instructions' latency) with nothing loaded from memory: the
 * arithmetic's ceiling, against which a batched product's time is read (minillm.roofline.measure_int8_peak).
 * Compiled like the kernels, for this CPU. Returns the multiply-adds done by all threads together (0 where the CPU
 * has neither instruction set); `sink` gets the sum of every accumulator, so the work cannot be optimized away (and
 * a test can check it). */
#include <omp.h>
#include <stdint.h>
#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__)
#include "amx_tiles.h"
#endif

#define CHAINS 12

double int8_macs(int64_t iters, int32_t *sink) {
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
        int32_t s = 0;
#if defined(__AVX512VNNI__)
        __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8((char)(omp_get_thread_num() + 1)), acc[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        for (int64_t i = 0; i < iters; i++) {
            __asm__ volatile("" : "+v"(a), "+v"(b)); /* operands "changed": nothing is folded into constants */
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        }
        for (int c = 0; c < CHAINS; c++) s += _mm512_reduce_add_epi32(acc[c]);
        total += (double)iters * CHAINS * 64;
#elif defined(__AVX2__)
        /* The int4 kernel's mix: vpmaddubsw into 16-bit sums (vpaddw), widened by one vpmaddwd every 8 rounds, as
         * the kernel widens once a block. 4 chains, each with its own operand, which the empty asm marks as changed
         * every round so that its products are computed again rather than hoisted; rounds run in eights. */
        __m256i a[4], acc[4];
        const __m256i b = _mm256_set1_epi8((char)(omp_get_thread_num() + 1)), ones = _mm256_set1_epi16(1);
        for (int c = 0; c < 4; c++) a[c] = _mm256_set1_epi8((char)(c + 1)), acc[c] = _mm256_set1_epi32(c);
        for (int64_t i = 0; i < iters; i++) {
            __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                _mm256_setzero_si256()};
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) { /* pairs of at most 2 * 4 * 2 a round: 8 rounds stay in 16 bits */
                __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]));
                for (int c = 0; c < 4; c++) pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(a[c], b));
            }
            for (int c = 0; c < 4; c++) acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(pairs[c], ones));
        }
        for (int c = 0; c < 4; c++) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, acc[c]);
            for (int j = 0; j < 8; j++) s += lanes[j];
        }
        total += (double)iters * 8 * 4 * 32;
#else
        (void)iters;
#endif
#pragma omp atomic
        *sink += s;
    }
    return total;
}

/* The same with AMX: each thread runs `iters` rounds of tdpbssd into 4 independent 16 x 16 tiles of sums, each
 * product 16 rows of 32 codes by 32 codes of 16 columns (8192 multiply-adds), the kernel's shapes: 3s times
 * (thread + 1)s. 0 where this build or Linux gives no AMX. */
double int8_macs_amx(int64_t iters, int32_t *sink) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__)
    if (!amx_request()) return 0;
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
        amx_configure(); /* the kernel's tiles: 0-3 sums, 4 x's codes, 6 a block's weights */
        int8_t a[AMX_ROWS][AMX_K], b[AMX_K / 4][64];
        int32_t c[16][16];
        for (int i = 0; i < AMX_ROWS * AMX_K; i++) a[i / AMX_K][i % AMX_K] = 3;
        for (int i = 0; i < AMX_K / 4 * 64; i++) b[i / 64][i % 64] = (int8_t)(omp_get_thread_num() + 1);
        _tile_loadd(4, a, AMX_K);
        _tile_loadd(6, b, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = 0; i < iters; i++) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 6);
            _tile_dpbssd(2, 4, 6);
            _tile_dpbssd(3, 4, 6);
        }
        int32_t s = 0;
#define ADD_TILE(t)                                               \
    _tile_stored(t, c, 64);                                       \
    for (int i = 0; i < 256; i++) s += c[i / 16][i % 16];
        ADD_TILE(0) ADD_TILE(1) ADD_TILE(2) ADD_TILE(3)
#undef ADD_TILE
        _tile_release();
        total += (double)iters * 4 * AMX_ROWS * 16 * AMX_K;
#pragma omp atomic
        *sink += s;
    }
    return total;
#else
    (void)iters, (void)sink;
    return 0;
#endif
}
