/* Memory read bandwidth at OMP_NUM_THREADS threads: the ceiling that token
 * generation, which reads every weight once per token, cannot pass.
 *
 * Each thread first writes, then sums, the same static slice of the buffer,
 * so its pages are local to it (first touch), as the run loop's are after
 * loading. The best of several reads is kept: one read of a buffer far
 * larger than the last-level cache is already a long average.
 *
 * Build and run: cc -O2 -fopenmp membw.c -o membw && OMP_NUM_THREADS=8 ./membw [MiB] [reads]
 * Prints one JSON line.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    int reads = argc > 2 ? atoi(argv[2]) : 5;
    size_t n = mib * 1024 * 1024 / sizeof(uint64_t);
    uint64_t *buf = malloc(n * sizeof *buf);
    if (!buf || n == 0 || reads < 1) {
        fprintf(stderr, "membw: cannot read %zu MiB %d times\n", mib, reads);
        return 1;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        buf[i] = i;

    double best = 1e30;
    uint64_t check = 0;  /* printed, so the sums cannot be optimized away */
    for (int r = 0; r <= reads; r++) {  /* read 0 is a warm-up */
        uint64_t sum = 0;
        double t0 = omp_get_wtime();
#pragma omp parallel for simd schedule(static) reduction(+ : sum)
        for (size_t i = 0; i < n; i++)
            sum += buf[i];
        double dt = omp_get_wtime() - t0;
        if (r > 0 && dt < best)
            best = dt;
        check += sum;
    }
    printf("{\"threads\": %d, \"mib\": %zu, \"reads\": %d, \"gb_per_s\": %.3f, \"check\": %llu}\n",
           omp_get_max_threads(), mib, reads, (double)(n * sizeof *buf) / best / 1e9,
           (unsigned long long)check);
    free(buf);
    return 0;
}
