/* LD_PRELOAD shim that refuses a process the AMX tile state: the
 * arch_prctl(ARCH_REQ_XCOMP_PERM) request that ggml makes before it uses AMX
 * fails, so llama.cpp runs its AVX-512 kernels (with their weight repacking)
 * instead. For machines whose CPU reports AMX but whose virtual machine
 * faults on tile instructions (llama.cpp dies with SIGILL in tileloadd);
 * perf_targets.py --llama-no-amx builds and uses it.
 *
 *   cc -O2 -shared -fPIC benchmarks/no_amx_shim.c -o no_amx.so -ldl
 *   LD_PRELOAD=$PWD/no_amx.so llama-bench ... */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023

long syscall(long number, ...) {
    va_list ap;
    long a[6];
    va_start(ap, number);
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_arch_prctl && a[0] == ARCH_REQ_XCOMP_PERM) {
        errno = EPERM;
        return -1;
    }
    static long (*real)(long, ...);
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
