/* The dispatch: which path's table (kernels.h's FlmKernels) runs, the
 * widest that this CPU has and that stays within fp32 rounding of the
 * reference unless one is asked for. The tables: kernels_generic.c,
 * kernels_x86.c, kernels_arm64.c. */
#include "kernels.h"
#include "simd.h"
#include "simd_arm64.h"

#include <stddef.h>
#include <string.h>

#if !defined(FLM_X86) && !defined(FLM_ARM64)
/* Elsewhere the portable path alone. */
const FlmKernels *const flm_arch_paths[] = {NULL};
int flm_arch_supported(const FlmKernels *k) { (void)k; return 0; }
void flm_arch_adapt(FlmKernels *k) { (void)k; }
int flm_arch_set_stream_prefetch(int bytes, int level) { (void)bytes; (void)level; return -1; }
int flm_arch_stream_prefetch(int *bytes, int *level) { (void)bytes; (void)level; return -1; }
#endif

const FlmKernels *flm_kernels = &flm_kernels_generic;

/* The chosen path's table, as this CPU runs it. */
static FlmKernels chosen;

static void choose(const FlmKernels *k) {
    chosen = *k;
    flm_arch_adapt(&chosen);
    flm_kernels = &chosen;
}

static int supported(const FlmKernels *k) { return k == &flm_kernels_generic || flm_arch_supported(k); }

/* This architecture's paths, widest first, then the generic one. */
static const FlmKernels *path(size_t i) {
    size_t n = 0;
    while (flm_arch_paths[n]) n++;
    return i < n ? flm_arch_paths[i] : i == n ? &flm_kernels_generic : NULL;
}

/* The widest path whose results stay within fp32 rounding of the reference.
 * avx512_bf16, amx_bf16 and neon_bf16 round activations to bf16 and are only
 * used when asked for. */
void flm_kernels_init(void) {
    for (size_t i = 0; path(i); i++)
        if (path(i)->to_bf16 == NULL && supported(path(i))) {
            choose(path(i));
            return;
        }
}

int flm_kernels_select(const char *name) {
    for (size_t i = 0; path(i); i++)
        if (strcmp(path(i)->name, name) == 0 && supported(path(i))) {
            choose(path(i));
            return 0;
        }
    return -1;
}
