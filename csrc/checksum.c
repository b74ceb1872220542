/* flm_checksum (checksum.h): eight independent lanes per chunk, each a
 * multiply-rotate mix of every eighth 64-bit word, so that the multiplies
 * of one lane overlap the others' and a core streams at memory speed. */
#include <string.h>

#include "checksum.h"

#define CHUNK ((size_t)1 << 20)
#define LANES 8

static const uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL, P3 = 0x165667B19E3779F9ULL;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mix(uint64_t h, uint64_t v) { return rotl((h ^ v) * P1, 31) * P2; }

static uint64_t chunk_sum(const unsigned char *p, size_t n, uint64_t index) {
    uint64_t lane[LANES];
    for (int i = 0; i < LANES; i++) lane[i] = P3 * (uint64_t)(i + 1) + index;
    size_t at = 0;
    for (; at + 8 * LANES <= n; at += 8 * LANES)
        for (int i = 0; i < LANES; i++) {
            uint64_t v;
            memcpy(&v, p + at + 8 * i, 8);
            lane[i] = mix(lane[i], v);
        }
    uint64_t h = (uint64_t)n * P3;
    for (int i = 0; i < LANES; i++) h = mix(h, lane[i]);
    for (; at < n; at++) h = mix(h, p[at]);
    return h ^ (h >> 29);
}

uint64_t flm_checksum(const void *data, size_t n, int n_threads) {
    const unsigned char *p = (const unsigned char *)data;
    const long chunks = (long)((n + CHUNK - 1) / CHUNK);
    uint64_t h = mix(P1, (uint64_t)n);
    /* The chunk sums are combined in order, a few hundred at a time, so
     * the array of them stays small whatever n is. */
    enum { BATCH = 256 };
    uint64_t sums[BATCH];
    for (long c0 = 0; c0 < chunks; c0 += BATCH) {
        const long nc = chunks - c0 < BATCH ? chunks - c0 : BATCH;
#pragma omp parallel for schedule(static) num_threads(n_threads > 0 ? n_threads : 1)
        for (long c = 0; c < nc; c++) {
            const size_t at = (size_t)(c0 + c) * CHUNK, len = n - at < CHUNK ? n - at : CHUNK;
            sums[c] = chunk_sum(p + at, len, (uint64_t)(c0 + c));
        }
        for (long c = 0; c < nc; c++) h = mix(h, sums[c]);
    }
    return h ^ (h >> 32);
}
