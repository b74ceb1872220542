/* A QEMU TCG plugin that counts the guest instructions a program executes.

   Build (host compiler, no QEMU headers needed):
       cc -O2 -shared -fPIC -o libcount.so benchmarks/qemu_count_plugin.c
   Run:
       qemu-aarch64 -cpu neoverse-n1 -plugin ./libcount.so,outfile=n.txt ./prog
   and n.txt holds "insns <total> vcpus <threads seen>". Without outfile= the
   line goes to QEMU's plugin log, shown by `-d plugin`.

   Every translated block adds its instruction count when it starts to run,
   so an instruction is counted each time it executes. qemu-user runs each
   guest thread (an OpenMP thread, say) as a vCPU of its own, so each vCPU
   adds into a counter of its own (its own cache line: no lost updates, no
   contention) and the counters are summed at exit. `inline=on` instead adds
   inline into one shared counter, which is faster but is only exact while
   one thread runs: QEMU 7.2's inline add is not atomic. The output says how
   many vCPUs were seen, so a multi-threaded inline count can be recognised.

   `profile=PATH` also writes, for every translated block, a line
   "<guest address> <instructions> <times run>" (hex, decimal, decimal), from
   which instructions per function can be summed against a symbol table.

   Debian packages QEMU 7.2 with plugin support but without its
   qemu-plugin.h, so the few declarations used here are written out below
   from QEMU's documented plugin API, version 1 (QEMU 7.2). */
#define _POSIX_C_SOURCE 200809L   /* strdup */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- QEMU plugin API, version 1 (QEMU 7.2), the part this plugin uses ---- */
#define PLUGIN_EXPORT __attribute__((visibility("default")))
typedef uint64_t qemu_plugin_id_t;
typedef struct {
    const char *target_name;
    struct { int min, cur; } version;
    bool system_emulation;
    union { struct { int smp_vcpus, max_vcpus; } system; };
} qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS, QEMU_PLUGIN_CB_RW_REGS };
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_simple_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_init_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_simple_cb_t cb);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
                                              void *ptr, uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
void qemu_plugin_outs(const char *string);
PLUGIN_EXPORT int qemu_plugin_version = 1;
/* ---- end of the API declarations ---- */

/* vCPU indices beyond the table (more live threads than this) share one
   atomic counter instead. */
#define MAX_VCPUS 1024
static struct { uint64_t n; char pad[56]; } per_vcpu[MAX_VCPUS] __attribute__((aligned(64)));
static uint64_t overflow;      /* atomic */
static uint64_t inline_count;  /* inline=on: one thread only */
static unsigned vcpus_seen;    /* atomic */
static bool use_inline;
static char *outfile;

/* profile=: one record per translated block, in a list (a block translated
   again gets a record of its own; the reader adds them up). */
struct block { uint64_t vaddr, n, runs; struct block *next; };
static char *profile;
static struct block *blocks;   /* pushed atomically */

static void vcpu_init(qemu_plugin_id_t id, unsigned int vcpu_index)
{
    (void)id; (void)vcpu_index;
    __atomic_fetch_add(&vcpus_seen, 1, __ATOMIC_RELAXED);
}

static void tb_exec(unsigned int vcpu_index, void *n_insns)
{
    if (vcpu_index < MAX_VCPUS)
        per_vcpu[vcpu_index].n += (uintptr_t)n_insns;
    else
        __atomic_fetch_add(&overflow, (uintptr_t)n_insns, __ATOMIC_RELAXED);
}

static void block_exec(unsigned int vcpu_index, void *block)
{
    struct block *b = block;
    tb_exec(vcpu_index, (void *)(uintptr_t)b->n);
    __atomic_fetch_add(&b->runs, 1, __ATOMIC_RELAXED);
}

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    size_t n = qemu_plugin_tb_n_insns(tb);
    if (profile) {
        struct block *b = calloc(1, sizeof *b);
        if (b) {
            b->vaddr = qemu_plugin_tb_vaddr(tb);
            b->n = n;
            b->next = __atomic_load_n(&blocks, __ATOMIC_RELAXED);
            while (!__atomic_compare_exchange_n(&blocks, &b->next, b, true, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {}
            qemu_plugin_register_vcpu_tb_exec_cb(tb, block_exec, QEMU_PLUGIN_CB_NO_REGS, b);
            return;
        }
        fprintf(stderr, "qemu_count_plugin: out of memory, block left out of the profile\n");
    }
    if (use_inline)
        qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &inline_count, n);
    else
        qemu_plugin_register_vcpu_tb_exec_cb(tb, tb_exec, QEMU_PLUGIN_CB_NO_REGS, (void *)(uintptr_t)n);
}

static void write_profile(void)
{
    FILE *f = fopen(profile, "w");
    if (!f) {
        fprintf(stderr, "qemu_count_plugin: cannot write %s\n", profile);
        return;
    }
    for (struct block *b = __atomic_load_n(&blocks, __ATOMIC_ACQUIRE); b; b = b->next)
        if (b->runs)
            fprintf(f, "%llx %llu %llu\n", (unsigned long long)b->vaddr, (unsigned long long)b->n,
                    (unsigned long long)b->runs);
    if (fclose(f) != 0)
        fprintf(stderr, "qemu_count_plugin: cannot write %s\n", profile);
}

static void at_exit(qemu_plugin_id_t id, void *userdata)
{
    (void)id; (void)userdata;
    if (profile)
        write_profile();
    uint64_t total = inline_count + __atomic_load_n(&overflow, __ATOMIC_RELAXED);
    for (int i = 0; i < MAX_VCPUS; i++)
        total += per_vcpu[i].n;
    char line[96];
    snprintf(line, sizeof line, "insns %llu vcpus %u\n", (unsigned long long)total,
             __atomic_load_n(&vcpus_seen, __ATOMIC_RELAXED));
    if (!outfile) {
        qemu_plugin_outs(line);
        return;
    }
    FILE *f = fopen(outfile, "w");
    if (!f || fputs(line, f) == EOF || fclose(f) != 0)
        fprintf(stderr, "qemu_count_plugin: cannot write %s\n", outfile);
}

PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    if (info->version.cur < 1) {
        fprintf(stderr, "qemu_count_plugin: needs plugin API version 1, QEMU offers %d\n", info->version.cur);
        return -1;
    }
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "outfile=", 8) == 0 && argv[i][8]) {
            outfile = strdup(argv[i] + 8);
        } else if (strncmp(argv[i], "profile=", 8) == 0 && argv[i][8]) {
            profile = strdup(argv[i] + 8);
        } else if (strcmp(argv[i], "inline=on") == 0) {
            use_inline = true;
        } else if (strcmp(argv[i], "inline=off") == 0) {
            use_inline = false;
        } else {
            fprintf(stderr, "qemu_count_plugin: unknown argument '%s' (outfile=PATH, profile=PATH, inline=on|off)\n", argv[i]);
            return -1;
        }
    }
    if (profile && use_inline) {
        fprintf(stderr, "qemu_count_plugin: profile= counts through callbacks, not inline=on\n");
        return -1;
    }
    qemu_plugin_register_vcpu_init_cb(id, vcpu_init);
    qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
