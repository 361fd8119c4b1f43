/* AMX's tiles for the CPU kernels' AMX builds (quant_gemm_amx.h: int8; prefill_attention_amx.h:
   bfloat16): the process's permission to use them and the tile configuration record.

   Linux hands a process the AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); a VM that
   lists AMX but refuses it, or kills the process for running it, fails the build's probe in a child
   process (kernels/cpu/quant.py, kernels/cpu/prefill_attention.py), and a build without tiles runs
   instead. The configuration is a thread's state: each thread of a parallel region loads it before
   its first tile instruction and releases the tiles after its last. */
#ifndef INFLIGHT_AMX_H
#define INFLIGHT_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* 1 once the kernel granted this process the tile state, 0 if it refused (asked once). */
static int amx_ready(void) {
    static int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == 0) {
        const long granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
        __atomic_store_n(&state, granted == 0 ? 1 : -1, __ATOMIC_RELEASE); /* asking twice is harmless */
    }
    return state > 0;
}

/* An empty palette-1 configuration: the caller sets rows[t] and colsb[t] of the tiles it uses. */
static inline amx_config_t amx_config(void) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    return c;
}
#endif
