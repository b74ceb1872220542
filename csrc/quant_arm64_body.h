/* The int8 matmul of quant_arm64.c for one feature level, included once per
 * level with SUFFIX (name suffix), TARGET (its attribute) and MODE (0: NEON
 * widening multiplies, 1: SDOT, 2: SDOT and SMMLA) defined. Every output is
 * fma_block's operations of quant.c in the same order; only the exact
 * integer sums are formed differently. */
#define QCAT2(a, b) a##_##b
#define QCAT(a, b) QCAT2(a, b)
#define FN(name) QCAT(name, SUFFIX)

/* Sums over k = 4m .. 4m+3 for m = m0 .. m0+n-1 (n even) of the 4 rows of v
 * times the token's activations x0 (k < 16) and x1 (k >= 16). */
ARM_INLINE TARGET int32x4_t FN(dots)(const int8x16_t v[8], int8x16_t x0, int8x16_t x1, const int m0, const int n) {
#if MODE >= 1
    int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
#define D(acc, m) acc = vdotq_laneq_s32(acc, v[m], (m) < 4 ? x0 : x1, (m) & 3)
    if (m0 == 0) { D(a, 0); D(b, 1); D(a, 2); D(b, 3); }
    if (m0 + n > 4) { D(a, 4); D(b, 5); D(a, 6); D(b, 7); }
#undef D
    return vaddq_s32(a, b);
#else
    /* Two products of at most 128 x 127 fit a 16-bit lane; pairs of lanes
     * then widen into 32 bits: lo holds rows 0-1, hi rows 2-3. */
    int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
#define BC(m) vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8((m) < 4 ? x0 : x1), (m) & 3))
#define P(m)                                                                                   \
    {                                                                                          \
        const int8x16_t xa = BC(m), xb = BC(m + 1);                                           \
        int16x8_t l = vmull_s8(vget_low_s8(v[m]), vget_low_s8(xa));                           \
        int16x8_t h = vmull_high_s8(v[m], xa);                                                 \
        l = vmlal_s8(l, vget_low_s8(v[m + 1]), vget_low_s8(xb));                              \
        h = vmlal_high_s8(h, v[m + 1], xb);                                                    \
        lo = vpadalq_s16(lo, l);                                                               \
        hi = vpadalq_s16(hi, h);                                                               \
    }
    if (m0 == 0) { P(0) P(2) }
    if (m0 + n > 4) { P(4) P(6) }
#undef P
#undef BC
    return vpaddq_s32(lo, hi);
#endif
}

/* A block's integer sums over its first (I0) and last (I1) 16 k: for the
 * types whose halves share a scale, all 32 k in I0 and 0 in I1, which
 * block_fma adds anyway (exact either way). */
#define BLOCK_SUMS(I0, I1, v, x0, x1, type)                                     \
    if ((type) == FLM_Q6_K) {                                                   \
        I0 = FN(dots)(v, x0, x1, 0, 4);                                         \
        I1 = FN(dots)(v, x0, x1, 4, 4);                                         \
    } else {                                                                    \
        I0 = FN(dots)(v, x0, x1, 0, 8);                                         \
        I1 = vdupq_n_s32(0);                                                    \
    }

/* Rows 4q .. 4q+3 of one panel for NT tokens. */
ARM_INLINE TARGET void FN(qrows)(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, int K,
                                 const int type, const int NT, int q, int rows, const FlmQuantType *L) {
    const int bits = L->bits, off = bits == 8 ? 0 : L->offset;   /* 8-bit quants come back signed */
    const size_t sbb = sb_bytes(L);
    float32x4_t acc[NT];
    for (int t = 0; t < NT; t++) acc[t] = vdupq_n_f32(0.0f);
    uint8_t fields[256];
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *h = pp + (size_t)(b * 32 / L->sb) * sbb;
        const int i = b * 32 % L->sb / 32;
        int8x16_t v[8];
        if ((type == FLM_Q4_K || type == FLM_Q5_K) && i == 0) k_fields(fields, h);
        unpack4(v, h + L->header + (size_t)i * L->data, bits, q);
        RowScales s = row_scales(h, fields, type, i, q);
#if MODE == 2
        /* Pairs of tokens: SMMLA multiplies 2 tokens x 8 k by 2 rows x 8 k.
         * Zipping the panels' 4-k groups into its 8-k rows costs about what
         * it saves for one pair (benchmarks/arm64_block_instructions.py),
         * so tiles of 2 tokens take SDOT, and tiles of 4 share the zips. */
        int8x16_t w01[4], w23[4];
        for (int j = 0; j < 4; j++) {
            w01[j] = vreinterpretq_s8_s32(vzip1q_s32(vreinterpretq_s32_s8(v[2 * j]), vreinterpretq_s32_s8(v[2 * j + 1])));
            w23[j] = vreinterpretq_s8_s32(vzip2q_s32(vreinterpretq_s32_s8(v[2 * j]), vreinterpretq_s32_s8(v[2 * j + 1])));
        }
        int t = 0;
        for (; NT >= 4 && t + 2 <= NT; t += 2) {
            const FlmQ8 *xa = x + (size_t)t * lda + b, *xb = xa + lda;
            int32x4_t r01[2], r23[2];
            for (int half = 0; half < 2; half++) {
                r01[half] = r23[half] = vdupq_n_s32(0);
                for (int j = 2 * half; j < 2 * half + 2; j++) {
                    const int8x16_t a = vcombine_s8(vld1_s8(xa->q + 8 * j), vld1_s8(xb->q + 8 * j));
                    r01[half] = vmmlaq_s32(r01[half], a, w01[j]);
                    r23[half] = vmmlaq_s32(r23[half], a, w23[j]);
                }
            }
            for (int u = 0; u < 2; u++) {
                int32x4_t I[2];
                for (int half = 0; half < 2; half++) {
                    const int64x2_t lo = vreinterpretq_s64_s32(r01[half]), hi = vreinterpretq_s64_s32(r23[half]);
                    I[half] = vreinterpretq_s32_s64(u ? vzip2q_s64(lo, hi) : vzip1q_s64(lo, hi));
                }
                acc[t + u] = block_fma(acc[t + u], I[0], I[1], s, type, off, u ? xb : xa);
            }
        }
        for (; t < NT; t++) {
#else
        for (int t = 0; t < NT; t++) {
#endif
            const FlmQ8 *xb = x + (size_t)t * lda + b;
            const int8x16_t x0 = vld1q_s8(xb->q), x1 = vld1q_s8(xb->q + 16);
            int32x4_t I0, I1;
            BLOCK_SUMS(I0, I1, v, x0, x1, type)
            acc[t] = block_fma(acc[t], I0, I1, s, type, off, xb);
        }
    }
    for (int t = 0; t < NT; t++) store4(out + (size_t)t * ldo, acc[t], rows);
}

/* One token against the first 4*G rows of one panel (decode): the block's
 * address and the token's activations are read once for the panel's G row
 * groups rather than once a group, and each group is summed as qrows sums
 * it. */
ARM_INLINE TARGET void FN(qpanel1)(float *out, const FlmQ8 *x, const uint8_t *pp, int K, const int type, const int G,
                                   int rows, const FlmQuantType *L) {
    const int bits = L->bits, off = bits == 8 ? 0 : L->offset;
    const size_t sbb = sb_bytes(L);
    float32x4_t acc[4];
    for (int q = 0; q < G; q++) acc[q] = vdupq_n_f32(0.0f);
    uint8_t fields[256];
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *h = pp + (size_t)(b * 32 / L->sb) * sbb;
        const int i = b * 32 % L->sb / 32;
        if ((type == FLM_Q4_K || type == FLM_Q5_K) && i == 0) k_fields(fields, h);
        const FlmQ8 *xb = x + b;
        const int8x16_t x0 = vld1q_s8(xb->q), x1 = vld1q_s8(xb->q + 16);
        _Pragma("GCC unroll 4")   /* the sums stay in registers */
        for (int q = 0; q < G; q++) {
            int8x16_t v[8];
            unpack4(v, h + L->header + (size_t)i * L->data, bits, q);
            int32x4_t I0, I1;
            BLOCK_SUMS(I0, I1, v, x0, x1, type)
            acc[q] = block_fma(acc[q], I0, I1, row_scales(h, fields, type, i, q), type, off, xb);
        }
    }
    for (int q = 0; q < G; q++) store4(out + 4 * q, acc[q], rows - 4 * q);
}

ARM_INLINE TARGET void FN(qgemm_type)(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T,
                                      int p0, int np, int N, const int type) {
    const FlmQuantType *L = flm_quant_type(type);
    const size_t pb = (size_t)K / L->sb * sb_bytes(L);
    for (int p = p0; p < p0 + np; p++) {
        const uint8_t *pp = (const uint8_t *)wp + (size_t)p * pb;
        const int left = N - p * PANEL;
        if (T == 1) {   /* a whole panel's row groups at once, 4 of them a constant in its own copy */
            if (left >= PANEL) FN(qpanel1)(out + p * PANEL, x, pp, K, type, 4, left, L);
            else FN(qpanel1)(out + p * PANEL, x, pp, K, type, (left + 3) / 4, left, L);
            continue;
        }
        for (int q = 0; q < 4; q++) {
            const int rows = N - p * PANEL - 4 * q;
            if (rows <= 0) break;
            float *o = out + p * PANEL + 4 * q;
            int t = 0;
            for (; T - t >= 4; t += 4) FN(qrows)(o + (size_t)t * ldo, ldo, x + (size_t)t * lda, lda, pp, K, type, 4, q, rows, L);
            if (T - t >= 2) { FN(qrows)(o + (size_t)t * ldo, ldo, x + (size_t)t * lda, lda, pp, K, type, 2, q, rows, L); t += 2; }
            if (T - t >= 1) FN(qrows)(o + (size_t)t * ldo, ldo, x + (size_t)t * lda, lda, pp, K, type, 1, q, rows, L);
        }
    }
}

TARGET void FN(flm_qgemm)(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T, int p0,
                          int np, int N, int type) {
    switch (type) {
#define CASE(TY) case TY: FN(qgemm_type)(out, ldo, x, lda, wp, K, T, p0, np, N, TY); break;
    CASE(FLM_Q8_0) CASE(FLM_Q4_0) CASE(FLM_Q4_1) CASE(FLM_Q5_0) CASE(FLM_Q5_1)
    CASE(FLM_Q4_K) CASE(FLM_Q5_K) CASE(FLM_Q6_K)
#undef CASE
    }
}

#undef BLOCK_SUMS
#undef FN
#undef QCAT
#undef QCAT2
