/* The top k of n scores, chosen and ordered exactly as torch.topk chooses
 * them on a CPU, ties included (a mixture of experts' router: fastllm.c's
 * route). torch runs libstdc++'s nth_element then sort over (value, index)
 * pairs compared by value alone (partial_sort where k * 64 <= n), so a tie
 * falls to whichever element those algorithms leave in front; topk.c
 * mirrors them step by step. NaN ranks first, as torch's comparison has it. */
#ifndef FASTLLM_TOPK_H
#define FASTLLM_TOPK_H

typedef struct { float v; int i; } FlmRanked;

/* Reorder q[0..n-1] so that q[0..k-1] are its top k, highest first. */
void flm_top_k(FlmRanked *q, int n, int k);

#endif
