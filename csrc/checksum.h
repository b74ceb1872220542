/* A fast checksum of a memory buffer, for telling a packed-weights cache
 * file that was cut short or altered from the one that was written. It
 * detects accidents (truncation, a torn write, a flipped bit, another
 * file's bytes), not an adversary. */
#ifndef FASTLLM_CHECKSUM_H
#define FASTLLM_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* 64-bit checksum of n bytes. The buffer is cut into chunks of 1 MiB,
 * each summed on its own (several threads at once), and the chunk sums
 * are combined in order: the result does not depend on n_threads. */
uint64_t flm_checksum(const void *data, size_t n, int n_threads);

#endif
