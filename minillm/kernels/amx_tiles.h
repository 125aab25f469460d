/* Chapter 6 — AMX's tile registers as minillm's int4/int8 kernel (int4_matmul.c) uses them, shared with the loop
 * that times their peak (int8_peak.c), so that the peak is measured in the kernel's own tile shapes. Included only
 * where the build has AMX (__AMX_INT8__ and __AMX_TILE__). */
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16 /* rows of x per tile product */
#define AMX_K 32    /* codes per row of x in a tile product: one int8 block of x */

/* Whether Linux lends this process the tile registers (asked each call; the answer holds for the process). */
static int amx_request(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Palette 1 for the calling thread: tiles 0-3 16 x 16 int32 sums, tiles 4-5 16 rows of 32 x codes, tiles 6-7 a
 * block's weights as 8 rows of (16 weight rows x 4 consecutive codes), the layout vpdpbusd takes, which is also
 * tdpbssd's. Two of each operand, so that one block's loads can overlap the other's product. */
static void amx_configure(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed))
        cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = AMX_K;
    for (int t = 6; t < 8; t++) cfg.rows[t] = AMX_K / 4, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
