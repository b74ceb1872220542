/* The top k of an array of (value, index) pairs in torch.topk's order on a
 * CPU: see topk.h. */
#include "topk.h"

#include <math.h>
#include <string.h>

static int ranks_before(FlmRanked a, FlmRanked b) { return (isnan(a.v) && !isnan(b.v)) || a.v > b.v; }
static void swap_ranked(FlmRanked *a, FlmRanked *b) { FlmRanked t = *a; *a = *b; *b = t; }
static int floor_log2(int n) { int l = 0; while (n >>= 1) l++; return l; }

static void insertion_sort(FlmRanked *q, int f, int l) {
    if (f == l) return;
    for (int i = f + 1; i < l; i++) {
        FlmRanked v = q[i];
        if (ranks_before(v, q[f])) {
            memmove(q + f + 1, q + f, sizeof(FlmRanked) * (i - f));
            q[f] = v;
        } else {
            int j = i;
            while (ranks_before(v, q[j - 1])) { q[j] = q[j - 1]; j--; }
            q[j] = v;
        }
    }
}

static int partition_pivot(FlmRanked *q, int f, int l) {
    const int a = f + 1, b = f + (l - f) / 2, c = l - 1;
    int m;   /* the median of a, b, c moves to f */
    if (ranks_before(q[a], q[b])) m = ranks_before(q[b], q[c]) ? b : ranks_before(q[a], q[c]) ? c : a;
    else m = ranks_before(q[a], q[c]) ? a : ranks_before(q[b], q[c]) ? c : b;
    swap_ranked(&q[f], &q[m]);
    int lo = f + 1, hi = l;
    for (;;) {
        while (ranks_before(q[lo], q[f])) lo++;
        hi--;
        while (ranks_before(q[f], q[hi])) hi--;
        if (!(lo < hi)) return lo;
        swap_ranked(&q[lo], &q[hi]);
        lo++;
    }
}

static void sift(FlmRanked *q, int f, int hole, int len, FlmRanked v) {
    const int top = hole;
    int child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (ranks_before(q[f + child], q[f + child - 1])) child--;
        q[f + hole] = q[f + child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        q[f + hole] = q[f + child - 1];
        hole = child - 1;
    }
    int parent = (hole - 1) / 2;
    while (hole > top && ranks_before(q[f + parent], v)) {
        q[f + hole] = q[f + parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    q[f + hole] = v;
}

static void pop_heap_to(FlmRanked *q, int f, int l, int r) {
    FlmRanked v = q[r];
    q[r] = q[f];
    sift(q, f, 0, l - f, v);
}

/* partial_sort(f, m, l): heap_select then sort_heap. */
static void partial_sort(FlmRanked *q, int f, int m, int l) {
    const int len = m - f;
    for (int parent = (len - 2) / 2; len >= 2 && parent >= 0; parent--) sift(q, f, parent, len, q[f + parent]);
    for (int i = m; i < l; i++)
        if (ranks_before(q[i], q[f])) pop_heap_to(q, f, m, i);
    for (int e = m; e - f > 1;) {
        e--;
        pop_heap_to(q, f, e, e);
    }
}

static void introselect(FlmRanked *q, int f, int nth, int l, int depth) {
    while (l - f > 3) {
        if (depth == 0) {
            const int len = nth + 1 - f;   /* heap_select(f, nth + 1, l), then nth to the front */
            for (int parent = (len - 2) / 2; len >= 2 && parent >= 0; parent--)
                sift(q, f, parent, len, q[f + parent]);
            for (int i = nth + 1; i < l; i++)
                if (ranks_before(q[i], q[f])) pop_heap_to(q, f, nth + 1, i);
            swap_ranked(&q[f], &q[nth]);
            return;
        }
        depth--;
        const int cut = partition_pivot(q, f, l);
        if (cut <= nth) f = cut;
        else l = cut;
    }
    insertion_sort(q, f, l);
}

static void introsort(FlmRanked *q, int f, int l, int depth) {
    while (l - f > 16) {
        if (depth == 0) {
            partial_sort(q, f, l, l);
            return;
        }
        depth--;
        const int cut = partition_pivot(q, f, l);
        introsort(q, cut, l, depth);
        l = cut;
    }
}

static void sort_ranked(FlmRanked *q, int f, int l) {
    if (f == l) return;
    introsort(q, f, l, 2 * floor_log2(l - f));
    if (l - f > 16) {
        insertion_sort(q, f, f + 16);
        for (int i = f + 16; i < l; i++) {
            FlmRanked v = q[i];
            int j = i;
            while (ranks_before(v, q[j - 1])) { q[j] = q[j - 1]; j--; }
            q[j] = v;
        }
    } else {
        insertion_sort(q, f, l);
    }
}

void flm_top_k(FlmRanked *q, int n, int k) {
    if ((long)k * 64 <= n) {
        partial_sort(q, 0, k, n);
        return;
    }
    if (k - 1 != n) introselect(q, 0, k - 1, n, 2 * floor_log2(n));
    sort_ranked(q, 0, k - 1);
}
