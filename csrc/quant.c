/* Quantized weights: GGML blocks repacked into panels (layout: quant.h),
 * their exact dequantization, int8 activations, and the portable int8
 * matmul that every SIMD path must match bit for bit. */
#include <math.h>
#include <string.h>

#include "quant.h"
#include "simd.h"

#define PANEL FLM_PANEL

int flm_is_quantized(int type) { return type >= FLM_Q8_0 && type < FLM_TYPES; }

/* The finite check of flm_finite, for one type, over n_words 16-bit or
 * 32-bit words (stride: words from one checked word to the next; of GGML
 * blocks, their bytes): all exponent bits set is infinity or NaN. Chunks
 * of 64K words go to the threads; one found is enough. */
static int all_finite(const uint8_t *p, size_t n_words, size_t stride, int wide, uint32_t exponent,
                      int n_threads) {
    const size_t chunk = 1 << 16, chunks = (n_words + chunk - 1) / chunk;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(n_threads > 0 ? n_threads : 1)
    for (size_t c = 0; c < chunks; c++) {
        const size_t end = (c + 1) * chunk < n_words ? (c + 1) * chunk : n_words;
        int found = 0;
        if (wide)
            for (size_t i = c * chunk; i < end; i++) {
                uint32_t w;
                memcpy(&w, p + i * stride, 4);
                found |= (w & exponent) == exponent;
            }
        else
            for (size_t i = c * chunk; i < end; i++) {
                uint16_t h;
                memcpy(&h, p + i * stride, 2);
                found |= (h & exponent) == exponent;
            }
        bad |= found;
    }
    return !bad;
}

int flm_finite(const void *data, size_t n, int type, int n_threads) {
    const uint8_t *p = (const uint8_t *)data;
    switch (type) {
    case FLM_F32: return all_finite(p, n, 4, 1, 0x7F800000u, n_threads);
    case FLM_BF16: return all_finite(p, n, 2, 0, 0x7F80u, n_threads);
    case FLM_F16: return all_finite(p, n, 2, 0, 0x7C00u, n_threads);
    }
    const FlmQuantType *q = flm_quant_type(type);
    if (!q) return 0;
    const size_t blocks = n / (size_t)q->ggml_block, bytes = (size_t)q->ggml_bytes;
    /* the f16 fields of a block: d (Q6_K's after its quants), and m or
     * dmin right after it where the type adds a min (offset 0) */
    const int d_at = type == FLM_Q6_K ? 208 : 0;
    const int has_min = q->offset == 0;
    return all_finite(p + d_at, blocks, bytes, 0, 0x7C00u, n_threads) &&
           (!has_min || all_finite(p + 2, blocks, bytes, 0, 0x7C00u, n_threads));
}

static size_t sb_bytes(const FlmQuantType *q) { return (size_t)q->header + (size_t)q->sb / 32 * q->data; }
static size_t panel_bytes(const FlmQuantType *q, int K) {
    return q->bits == 16 ? (size_t)K * PANEL * 2 : (size_t)K / q->sb * sb_bytes(q);
}

size_t flm_quant_packed_bytes(int N, int K, int type) {
    return (size_t)((N + PANEL - 1) / PANEL) * panel_bytes(flm_quant_type(type), K);
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* ----------------------------------------------------- GGML's blocks */

/* One GGML superblock of a row, decoded: unsigned quants and raw scales. */
typedef struct {
    uint8_t u[256];
    uint16_t d, m;          /* f16 scale, and min (Q4_1, Q5_1) or dmin (Q4_K, Q5_K) */
    uint8_t sc[16], mn[16]; /* per 32 (Q4_K, Q5_K: 6 bits each) or per 16 (Q6_K: int8 bits) */
} Decoded;

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K superblock. */
static void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Little-endian words of GGML's bytes, each one load or store: GCC does
 * not merge byte loops into one everywhere, and with them a load packed
 * Q4_K at 1.3 GB/s a core, against 5 with these. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define FLM_LE64(v) __builtin_bswap64(v)
#define FLM_LE32(v) __builtin_bswap32(v)
#else
#define FLM_LE64(v) (v)
#define FLM_LE32(v) (v)
#endif

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return FLM_LE64(v);
}

static inline void wr64(uint8_t *p, uint64_t v) {
    v = FLM_LE64(v);
    memcpy(p, &v, 8);
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return FLM_LE32(v);
}

static inline void wr32(uint8_t *p, uint32_t v) {
    v = FLM_LE32(v);
    memcpy(p, &v, 4);
}

/* Bit i of the 8 bits x, as bit 0 of byte i (a multiply places bit i at
 * 8i for i < 7; bit 7 would collide with bit 0's copy, so it goes alone). */
static inline uint64_t bits_to_bytes(uint32_t x) {
    return ((uint64_t)(x & 0x7F) * 0x0002040810204081ULL & 0x0101010101010101ULL) | (uint64_t)(x & 0x80) << 49;
}

/* Bit 0 of byte i of w (its other bits zero) as bit i of a byte: the inverse. */
static inline uint32_t bytes_to_bits(uint64_t w) { return (uint32_t)((w * 0x0102040810204080ULL) >> 56); }

/* Its quants go to u (o->u, or a panel row's), the rest to o. */
static inline __attribute__((always_inline)) void decode(Decoded *o, uint8_t *u, const uint8_t *b, int type) {
    switch (type) {
    case FLM_Q8_0:
        o->d = rd16(b);
        for (int k = 0; k < 32; k++) u[k] = (uint8_t)((int8_t)b[2 + k] + 128);
        break;
    case FLM_Q4_0:
    case FLM_Q4_1: {
        const uint8_t *qs = b + (type == FLM_Q4_1 ? 4 : 2);
        o->d = rd16(b);
        o->m = type == FLM_Q4_1 ? rd16(b + 2) : 0;
        for (int j = 0; j < 16; j++) {
            u[j] = qs[j] & 0xF;
            u[j + 16] = qs[j] >> 4;
        }
        break;
    }
    case FLM_Q5_0:
    case FLM_Q5_1: {
        const int m = type == FLM_Q5_1;
        const uint8_t *qh = b + (m ? 4 : 2), *qs = qh + 4;
        const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        o->d = rd16(b);
        o->m = m ? rd16(b + 2) : 0;
        for (int j = 0; j < 16; j += 8) {   /* 8 quants of each half at a time, as words */
            const uint64_t w = rd64(qs + j), nib = 0x0F0F0F0F0F0F0F0FULL;
            wr64(u + j, (w & nib) | bits_to_bytes(h >> j & 0xFF) << 4);
            wr64(u + j + 16, (w >> 4 & nib) | bits_to_bytes(h >> (j + 16) & 0xFF) << 4);
        }
        break;
    }
    case FLM_Q4_K:
    case FLM_Q5_K: {
        const int five = type == FLM_Q5_K;
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
        o->d = rd16(b);
        o->m = rd16(b + 2);
        for (int j = 0; j < 8; j++) k_scale_min(scales, j, &o->sc[j], &o->mn[j]);
        /* 64 values: two sub-blocks from one run of 32 bytes; 8 bytes at a time, as words */
        const uint64_t nib = 0x0F0F0F0F0F0F0F0FULL, one = 0x0101010101010101ULL;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l += 8) {
                const uint64_t w = rd64(qs + 32 * c + l), h = five ? rd64(qh + l) : 0;
                wr64(u + 64 * c + l, (w & nib) | (h >> (2 * c) & one) << 4);
                wr64(u + 64 * c + 32 + l, (w >> 4 & nib) | (h >> (2 * c + 1) & one) << 4);
            }
        break;
    }
    case FLM_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128, *sc = b + 192;
        o->d = rd16(b + 208);
        memcpy(o->sc, sc, 16);
        const uint64_t nib = 0x0F0F0F0F0F0F0F0FULL, two = 0x0303030303030303ULL;
        for (int n = 0; n < 2; n++)   /* 8 bytes at a time, as words */
            for (int l = 0; l < 32; l += 8) {
                const uint8_t *L = ql + 64 * n;
                const uint64_t a = rd64(L + l), c = rd64(L + l + 32), h = rd64(qh + 32 * n + l);
                uint8_t *un = u + 128 * n;
                wr64(un + l, (a & nib) | (h & two) << 4);
                wr64(un + l + 32, (c & nib) | (h >> 2 & two) << 4);
                wr64(un + l + 64, (a >> 4 & nib) | (h >> 4 & two) << 4);
                wr64(un + l + 96, (c >> 4 & nib) | (h >> 6 & two) << 4);
            }
        break;
    }
    }
}

/* ------------------------------------------------------------ panels */

/* Row r's fields in a panel superblock's header. */
static inline __attribute__((always_inline)) void put_header(uint8_t *h, int type, int r, const Decoded *o) {
    memcpy(h + 2 * r, &o->d, 2);
    if (type == FLM_Q4_1 || type == FLM_Q5_1 || type == FLM_Q4_K || type == FLM_Q5_K) memcpy(h + 32 + 2 * r, &o->m, 2);
    if (type == FLM_Q4_K || type == FLM_Q5_K)   /* 6-bit fields (flm_k_scale: quant.h) */
        for (int j = 0; j < 4; j++) {
            h[64 + 16 * j + r] = (uint8_t)(o->sc[j] | (o->sc[j + 4] >> 4) << 6);
            h[128 + 16 * j + r] = (uint8_t)(o->mn[j] | (o->mn[j + 4] >> 4) << 6);
            h[192 + 16 * j + r] = (uint8_t)((o->sc[j + 4] & 15) | (o->mn[j + 4] & 15) << 4);
        }
    if (type == FLM_Q6_K)
        for (int i = 0; i < 16; i++) h[32 + i * 16 + r] = o->sc[i];
}

/* The records of a panel superblock from the quants of its 16 rows
 * (u[r][k], zero for rows past N): whole words at a time, no branch on the
 * values, so that a load's packing streams. */
static inline __attribute__((always_inline)) void put_records(uint8_t *sbp, const FlmQuantType *q, uint8_t u[PANEL][256]) {
    for (int i = 0; i < q->sb / 32; i++) {
        uint8_t *rec = sbp + q->header + (size_t)i * q->data;
        if (q->bits == 8) {
            for (int g = 0; g < 8; g++)
                for (int r = 0; r < PANEL; r++) memcpy(rec + (g * 16 + r) * 4, &u[r][32 * i + 4 * g], 4);
            continue;
        }
        for (int g = 0; g < 4; g++)
            for (int r = 0; r < PANEL; r++) {
                const uint32_t lo = rd32(&u[r][32 * i + 8 * g]), hi = rd32(&u[r][32 * i + 8 * g + 4]);
                wr32(rec + (g * 16 + r) * 4, (lo & 0x0F0F0F0Fu) | (hi & 0x0F0F0F0Fu) << 4);
            }
        if (q->bits == 6) {
            /* byte 4r+j of vector h, bits 2c..2c+1: the top bits of row r's quant k = 4(4h+c)+j */
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < PANEL; r++) {
                    uint32_t w = 0;
                    for (int c = 0; c < 4; c++) w |= (rd32(&u[r][32 * i + 16 * h + 4 * c]) >> 4 & 0x03030303u) << 2 * c;
                    wr32(rec + 256 + 64 * h + 4 * r, w);
                }
            continue;
        }
        for (int plane = 0; plane < q->bits - 4; plane++) {
            /* bit k of bits[r]: bit 4+plane of row r's quant k */
            uint32_t bits[PANEL];
            for (int r = 0; r < PANEL; r++) {
                bits[r] = 0;
                for (int c = 0; c < 4; c++)
                    bits[r] |= bytes_to_bits(rd64(&u[r][32 * i + 8 * c]) >> (4 + plane) & 0x0101010101010101ULL)
                               << 8 * c;
            }
            /* mask m, bit 4r+j: k = 4m+j of row r */
            for (int m = 0; m < 8; m++) {
                uint64_t mask = 0;
                for (int r = 0; r < PANEL; r++) mask |= (uint64_t)(bits[r] >> 4 * m & 0xF) << 4 * r;
                wr64(rec + 256 + 64 * plane + 8 * m, mask);
            }
        }
    }
}

/* Row r of a panel superblock whose other rows are empty (a one-row panel). */
static void put_row(uint8_t *sbp, const FlmQuantType *q, int type, int r, const Decoded *o) {
    uint8_t u[PANEL][256];
    memset(u, 0, sizeof u);
    memcpy(u[r], o->u, (size_t)q->sb);
    put_header(sbp, type, r, o);
    put_records(sbp, q, u);
}

/* Panel p of flm_quant_pack, for a type known at compile time (so that its
 * block layout is constants: inlined into one copy per type below). */
static inline __attribute__((always_inline)) void pack_panel(uint8_t *pp, const uint8_t *src, int p, int N, int K,
                                                             const int type) {
    const FlmQuantType *q = &flm_quant_types[type];
    const size_t row_bytes = (size_t)K / q->ggml_block * q->ggml_bytes;
    const int rows = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    uint8_t u[PANEL][256];
    Decoded o;
    memset(u, 0, sizeof u);   /* rows past N: zero quants, and zero scales below */
    memset(&o, 0, sizeof o);
    for (int j = 0; j < K / q->sb; j++) {
        uint8_t *sbp = pp + (size_t)j * sb_bytes(q);
        memset(sbp, 0, (size_t)q->header);
        for (int r = 0; r < rows; r++) {
            decode(&o, u[r], src + (size_t)(p * PANEL + r) * row_bytes + (size_t)j * q->ggml_bytes, type);
            put_header(sbp, type, r, &o);
        }
        put_records(sbp, q, u);
    }
}

static void pack_f16_panel(uint8_t *pp, const uint8_t *src, int p, int N, int K) {
    memset(pp, 0, (size_t)K * PANEL * 2);   /* rows past N: zero weights */
    for (int r = 0; r < PANEL && p * PANEL + r < N; r++) {
        const uint8_t *row = src + (size_t)(p * PANEL + r) * K * 2;
        for (int k = 0; k < K; k++) memcpy(pp + ((size_t)k * PANEL + r) * 2, row + 2 * (size_t)k, 2);
    }
}

void flm_quant_pack(void *dst, const void *src, int N, int K, int type, int n_threads) {
    const FlmQuantType *q = flm_quant_type(type);
    const int panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(n_threads > 0 ? n_threads : 1)
    for (int p = 0; p < panels; p++) {
        uint8_t *pp = (uint8_t *)dst + (size_t)p * panel_bytes(q, K);
        switch (type) {
#define CASE(TY) case TY: pack_panel(pp, (const uint8_t *)src, p, N, K, TY); break;
        CASE(FLM_Q8_0) CASE(FLM_Q4_0) CASE(FLM_Q4_1) CASE(FLM_Q5_0) CASE(FLM_Q5_1)
        CASE(FLM_Q4_K) CASE(FLM_Q5_K) CASE(FLM_Q6_K)
#undef CASE
        case FLM_F16: pack_f16_panel(pp, (const uint8_t *)src, p, N, K); break;
        }
    }
}

/* The quants of one 32-k record: u[r*32 + k]. */
static void unpack_record(uint8_t *u, const uint8_t *rec, const FlmQuantType *q) {
    for (int r = 0; r < PANEL; r++) {
        if (q->bits == 8) {
            for (int g = 0; g < 8; g++)
                for (int j = 0; j < 4; j++) u[r * 32 + 4 * g + j] = rec[(g * 16 + r) * 4 + j];
            continue;
        }
        for (int g = 0; g < 4; g++)
            for (int j = 0; j < 4; j++) {
                const uint8_t b = rec[(g * 16 + r) * 4 + j];
                u[r * 32 + 8 * g + j] = b & 0xF;
                u[r * 32 + 8 * g + 4 + j] = b >> 4;
            }
        if (q->bits == 6) {
            for (int m = 0; m < 8; m++)
                for (int j = 0; j < 4; j++)
                    u[r * 32 + 4 * m + j] |= (uint8_t)((rec[256 + 64 * (m / 4) + 4 * r + j] >> 2 * (m % 4) & 3) << 4);
            continue;
        }
        for (int plane = 0; plane < q->bits - 4; plane++)
            for (int m = 0; m < 8; m++)
                for (int j = 0; j < 4; j++) {
                    const int bit = 4 * r + j;
                    if ((rec[256 + 64 * plane + 8 * m + bit / 8] >> (bit % 8)) & 1)
                        u[r * 32 + 4 * m + j] |= (uint8_t)(16 << plane);
                }
    }
}

/* Scales of row r for the 32-k block i of a superblock header h:
 * w = a * u + b for the first 16 k and a2 * u + b for the last 16 (a2 = a
 * except in Q6_K), each as GGML forms it; the offset is folded into b
 * here (d * (u - off) = d*u - d*off exactly: both are products of an f16
 * and a small integer). */
typedef struct { float a, a2, b; } RowScale;

static RowScale row_scale(const uint8_t *h, int type, int i, int r) {
    const float d = flm_f16_to_f32(rd16(h + 2 * r));
    RowScale s = {d, d, 0.0f};
    switch (type) {
    case FLM_Q8_0: s.b = -128.0f * d; break;
    case FLM_Q4_0: s.b = -8.0f * d; break;
    case FLM_Q5_0: s.b = -16.0f * d; break;
    case FLM_Q4_1:
    case FLM_Q5_1: s.b = flm_f16_to_f32(rd16(h + 32 + 2 * r)); break;
    case FLM_Q4_K:
    case FLM_Q5_K:
        s.a = s.a2 = d * (float)flm_k_scale(h, i, r);
        s.b = -(flm_f16_to_f32(rd16(h + 32 + 2 * r)) * (float)flm_k_min(h, i, r));
        break;
    case FLM_Q6_K:
        s.a = d * (float)(int8_t)h[32 + (2 * i) * 16 + r];
        s.a2 = d * (float)(int8_t)h[32 + (2 * i + 1) * 16 + r];
        break;
    }
    return s;
}

/* One weight from its quant, as GGML's dequantizer computes it. */
static float weight(RowScale s, int type, int u, int k) {
    const float a = k < 16 ? s.a : s.a2;   /* a2 differs from a in Q6_K only */
    return type == FLM_Q6_K ? a * (float)(u - 32) : a * (float)u + s.b;
}

void flm_quant_dequant_panel(float *dst, const void *wp, int p, int k0, int nk, int K, int type) {
    const FlmQuantType *q = flm_quant_type(type);
    const uint8_t *pp = (const uint8_t *)wp + (size_t)p * panel_bytes(q, K);
    if (type == FLM_F16) {
        const uint16_t *h = (const uint16_t *)pp + (size_t)k0 * PANEL;
        for (size_t i = 0; i < (size_t)nk * PANEL; i++) dst[i] = flm_f16_to_f32(h[i]);
        return;
    }
    uint8_t u[PANEL * 32];
    for (int k = k0; k < k0 + nk; k += 32) {
        const uint8_t *sbp = pp + (size_t)(k / q->sb) * sb_bytes(q);
        const int i = k % q->sb / 32;
        unpack_record(u, sbp + q->header + (size_t)i * q->data, q);
        for (int r = 0; r < PANEL; r++) {
            RowScale s = row_scale(sbp, type, i, r);
            for (int j = 0; j < 32; j++) dst[(size_t)(k - k0 + j) * PANEL + r] = weight(s, type, u[r * 32 + j], j);
        }
    }
}

void flm_quant_packed_row(float *out, const void *wp, int r, int K, int type) {
    const FlmQuantType *q = flm_quant_type(type);
    const uint8_t *pp = (const uint8_t *)wp + (size_t)(r / PANEL) * panel_bytes(q, K);
    const int i16 = r % PANEL;
    if (type == FLM_F16) {
        for (int k = 0; k < K; k++) out[k] = flm_f16_to_f32(rd16(pp + ((size_t)k * PANEL + i16) * 2));
        return;
    }
    /* Only this row's quants of each record (an embedding lookup per token). */
    for (int k = 0; k < K; k += 32) {
        const uint8_t *sbp = pp + (size_t)(k / q->sb) * sb_bytes(q), *rec;
        const int i = k % q->sb / 32;
        rec = sbp + q->header + (size_t)i * q->data;
        uint8_t u[32];
        for (int g = 0; g < (q->bits == 8 ? 8 : 4); g++)
            for (int j = 0; j < 4; j++) {
                const uint8_t byte = rec[(g * 16 + i16) * 4 + j];
                if (q->bits == 8) {
                    u[4 * g + j] = byte;
                } else {
                    u[8 * g + j] = byte & 0xF;
                    u[8 * g + 4 + j] = byte >> 4;
                }
            }
        if (q->bits == 6)
            for (int m = 0; m < 8; m++)
                for (int j = 0; j < 4; j++)
                    u[4 * m + j] |= (uint8_t)((rec[256 + 64 * (m / 4) + 4 * i16 + j] >> 2 * (m % 4) & 3) << 4);
        for (int plane = 0; plane < q->bits - 4 && q->bits == 5; plane++)
            for (int m = 0; m < 8; m++)
                for (int j = 0; j < 4; j++) {
                    const int bit = 4 * i16 + j;
                    if ((rec[256 + 64 * plane + 8 * m + bit / 8] >> (bit % 8)) & 1) u[4 * m + j] |= (uint8_t)(16 << plane);
                }
        const RowScale sc = row_scale(sbp, type, i, i16);
        for (int j = 0; j < 32; j++) out[k + j] = weight(sc, type, u[j], j);
    }
}

void flm_quant_dequant_row(float *out, const void *row, int K, int type) {
    const FlmQuantType *q = flm_quant_type(type);
    if (type == FLM_F16) {
        for (int k = 0; k < K; k++) out[k] = flm_f16_to_f32(rd16((const uint8_t *)row + 2 * (size_t)k));
        return;
    }
    /* Through a one-row panel, so both paths share one definition. */
    uint8_t sbp[320 + 8 * 384];
    Decoded o;
    for (int j = 0; j < K / q->sb; j++) {
        memset(&o, 0, sizeof o);
        memset(sbp, 0, sizeof sbp);
        decode(&o, o.u, (const uint8_t *)row + (size_t)j * q->ggml_bytes, type);
        put_row(sbp, q, type, 0, &o);
        for (int i = 0; i < q->sb / 32; i++) {
            RowScale s = row_scale(sbp, type, i, 0);
            for (int k = 0; k < 32; k++) out[j * q->sb + 32 * i + k] = weight(s, type, o.u[32 * i + k], k);
        }
    }
}

/* ------------------------------------------------------- activations */

void flm_quantize_q8_generic(FlmQ8 *dst, const float *x, int K) {
    for (int b = 0; b < K / 32; b++, x += 32) {
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(x[k]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        dst[b].d = amax / 127.0f;
        int s0 = 0, s1 = 0;
        for (int k = 0; k < 32; k++) {
            const int v = (int)nearbyintf(x[k] * id);
            dst[b].q[k] = (int8_t)v;
            if (k < 16) s0 += v;
            else s1 += v;
        }
        flm_q8_set_sums(&dst[b], s0, s1);
    }
}

/* ------------------------------------------------- the int8 matmul
 *
 * Per row and 32-k block, with exact integer sums I = sum u*q and the
 * block's activation sums S = s0 + s1:
 *   offset types (Q8_0, Q4_0, Q5_0): acc = fma((float)(I - off*S), d*xd, acc)
 *   min types (Q4_1, Q5_1):          acc = fma((float)I, d*xd, acc); acc = fma(m, xd*S, acc)
 *   Q4_K, Q5_K (a = d*sc, b = dmin*mn): acc = fma((float)I, a*xd, acc); acc = fma(-b, xd*S, acc)
 *   Q6_K, per 16 k (h = 0, 1):       acc = fma((float)(I_h - 32*s_h), (d*sc_h)*xd, acc)
 * xd*S and -32*s_h are formed once, when the activations are quantized
 * (FlmQ8.ds, FlmQ8.s32).
 * The SIMD paths compute the same operations in the same order. */

static float fma_block(float acc, const uint8_t *hdr, int type, int i, int r, const uint8_t *u, const FlmQ8 *x) {
    const float d = flm_f16_to_f32(rd16(hdr + 2 * r));
    int I0 = 0, I1 = 0;
    for (int k = 0; k < 16; k++) I0 += u[k] * x->q[k];
    for (int k = 16; k < 32; k++) I1 += u[k] * x->q[k];
    const int S = x->s[0] + x->s[1];
    switch (type) {
    case FLM_Q8_0:
    case FLM_Q4_0:
    case FLM_Q5_0:
        return fmaf((float)(I0 + I1 - flm_quant_type(type)->offset * S), d * x->d, acc);
    case FLM_Q4_1:
    case FLM_Q5_1:
        acc = fmaf((float)(I0 + I1), d * x->d, acc);
        return fmaf(flm_f16_to_f32(rd16(hdr + 32 + 2 * r)), x->ds, acc);
    case FLM_Q4_K:
    case FLM_Q5_K: {
        const float a = d * (float)flm_k_scale(hdr, i, r);
        const float b = flm_f16_to_f32(rd16(hdr + 32 + 2 * r)) * (float)flm_k_min(hdr, i, r);
        acc = fmaf((float)(I0 + I1), a * x->d, acc);
        return fmaf(-b, x->ds, acc);
    }
    default: { /* FLM_Q6_K */
        const float a0 = d * (float)(int8_t)hdr[32 + (2 * i) * 16 + r];
        const float a1 = d * (float)(int8_t)hdr[32 + (2 * i + 1) * 16 + r];
        acc = fmaf((float)(I0 + x->s32[0]), a0 * x->d, acc);
        return fmaf((float)(I1 + x->s32[1]), a1 * x->d, acc);
    }
    }
}

void flm_qgemm_generic(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T, int p0,
                       int np, int N, int type) {
    const FlmQuantType *q = flm_quant_type(type);
    uint8_t u[PANEL * 32];
    for (int p = p0; p < p0 + np; p++) {
        const uint8_t *pp = (const uint8_t *)wp + (size_t)p * panel_bytes(q, K);
        for (int t0 = 0; t0 < T; t0 += 8) {
            float acc[8][PANEL] = {{0}};
            const int nt = T - t0 < 8 ? T - t0 : 8;
            for (int b = 0; b < K / 32; b++) {
                const uint8_t *sbp = pp + (size_t)(b * 32 / q->sb) * sb_bytes(q);
                const int i = b * 32 % q->sb / 32;
                unpack_record(u, sbp + q->header + (size_t)i * q->data, q);
                for (int t = 0; t < nt; t++)
                    for (int r = 0; r < PANEL; r++)
                        acc[t][r] = fma_block(acc[t][r], sbp, type, i, r, u + r * 32, x + (size_t)(t0 + t) * lda + b);
            }
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < PANEL && p * PANEL + r < N; r++) out[(size_t)(t0 + t) * ldo + p * PANEL + r] = acc[t][r];
        }
    }
}

/* ------------------------------------------------ AVX-512 VNNI */
#ifdef FLM_X86

/* The layout of a type, read from the table: with the type a constant in
 * each instantiation of the kernels below, the reads fold away. */
INLINE int q_sb(int t) { return flm_quant_types[t].sb; }
INLINE int q_header(int t) { return flm_quant_types[t].header; }
INLINE int q_bits(int t) { return flm_quant_types[t].bits; }
INLINE int q_data(int t) { return flm_quant_types[t].data; }
INLINE int q_offset(int t) { return flm_quant_types[t].offset; }
INLINE int q_has_min(int t) { return t == FLM_Q4_1 || t == FLM_Q5_1; }
INLINE int q_is_k(int t) { return t == FLM_Q4_K || t == FLM_Q5_K; }

/* v[m]: the 16 rows' quants for k = 4m .. 4m+3 of one record, as bytes. */
INLINE AVX512VNNI void unpack16(__m512i v[8], const uint8_t *rec, const int bits) {
    if (bits == 8) {
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) v[m] = _mm512_loadu_si512((const void *)(rec + 64 * m));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    _Pragma("GCC unroll 8")
    for (int g = 0; g < 4; g++) {
        const __m512i x = _mm512_loadu_si512((const void *)(rec + 64 * g));
        v[2 * g] = _mm512_and_si512(x, low);
        v[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    }
    if (bits == 6) {
        /* Both top bits of 4 groups from one vector: a shift (16-bit lanes;
         * what crosses into a byte from its neighbour is masked off) and
         * one ternary OR-with-mask each. */
        const __m512i top = _mm512_set1_epi8(0x30);
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; h++) {
            const __m512i c = _mm512_loadu_si512((const void *)(rec + 256 + 64 * h));
            v[4 * h] = _mm512_ternarylogic_epi32(v[4 * h], _mm512_slli_epi16(c, 4), top, 0xF8);
            v[4 * h + 1] = _mm512_ternarylogic_epi32(v[4 * h + 1], _mm512_slli_epi16(c, 2), top, 0xF8);
            v[4 * h + 2] = _mm512_ternarylogic_epi32(v[4 * h + 2], c, top, 0xF8);
            v[4 * h + 3] = _mm512_ternarylogic_epi32(v[4 * h + 3], _mm512_srli_epi16(c, 2), top, 0xF8);
        }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int plane = 0; plane < bits - 4; plane++) {
        const __m512i bit = _mm512_set1_epi8((char)(16 << plane));
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) {
            uint64_t mask;
            memcpy(&mask, rec + 256 + 64 * plane + 8 * m, 8);
            v[m] = _mm512_mask_add_epi8(v[m], (__mmask64)mask, v[m], bit);
        }
    }
}

/* acc + the dot products of w's 16 rows with the 4 activation bytes at x.
 * GCC 12 broadcasts x into a register with an instruction of its own for
 * most calls; the dot product's own memory broadcast ({1to16}) saves one
 * instruction per dot product. On the 2-core Xeon, medians of 3
 * alternating runs: gemm_speed's 1.7B up projection, 512 tokens, one
 * thread, Q8_0 +6%, Q5_K +3%, Q4_K +1%, decoding level; forward_speed's
 * 1.7B shape, pp512, one thread, Q5_K +2.6%, Q8_0 +3%, Q4_K_M level.
 * Clang keeps the intrinsic (the asm was not tried with it). */
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;
INLINE AVX512VNNI __m512i dot4(__m512i acc, __m512i w, const int8_t *x) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const unaligned_i32 *)x));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*(const unaligned_i32 *)x));
#endif
}

INLINE AVX512VNNI __m512 f16x16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE AVX512VNNI __m512 u8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* A Q4_K/Q5_K superblock's 6-bit scales and mins (flm_k_scale in quant.h)
 * as bytes, once for its 8 blocks: f[16i + r] the scale, f[128 + 16i + r]
 * the min of row r's sub-block i. The 16-bit shifts move bits within each
 * byte; the masks drop what crossed over from the next. */
INLINE AVX512VNNI void k_fields(uint8_t f[256], const uint8_t *h) {
    const __m512i P = _mm512_loadu_si512(h + 64), M = _mm512_loadu_si512(h + 128), L = _mm512_loadu_si512(h + 192);
    const __m512i six = _mm512_set1_epi8(63), nib = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    _mm512_storeu_si512(f, _mm512_and_si512(P, six));
    _mm512_storeu_si512(f + 64, _mm512_or_si512(_mm512_and_si512(L, nib),
                                                _mm512_and_si512(_mm512_srli_epi16(P, 2), top)));
    _mm512_storeu_si512(f + 128, _mm512_and_si512(M, six));
    _mm512_storeu_si512(f + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), nib),
                                                 _mm512_and_si512(_mm512_srli_epi16(M, 2), top)));
}
INLINE AVX512VNNI __m512 i8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The lines of a record of `data` bytes that the cache is asked for ahead
 * of it (stream_prefetch, simd.h). A tile of 4 or more tokens computes long
 * enough on each block that the hardware prefetcher falls behind and the
 * pass waits on memory: on a 2-core AVX-512 Xeon a pass of 8 tokens (8
 * decoding streams, or a short prompt) ran 13-25% faster with it on the
 * default model's shape and 45% on a 1.7B shape, a pass of 512 the same.
 * Decoding (tiles of 1 and 2 tokens, 4 panels side by side) needs it too:
 * kernels_x86.c has the figures. */
INLINE void prefetch_record(StreamPrefetch pf, const uint8_t *rec, int data) {
    for (int o = 0; o <= data; o += 64) stream_prefetch(pf, rec + o);
}

/* prefetch_record for stream j of NP panels side by side (the decoding
 * kernels; end: the end of its panel): past that, not the next panel, which
 * stream j+1 of this call read already, but the same place NP panels on,
 * where stream j of the kernel's next call starts when a thread runs
 * consecutive items, as decoding hands them out (fastllm.c). At 2 threads
 * of the 2-core Xeon, forward_speed's 1.7B shape at Q4_K_M decoded
 * 25.5-25.8 → 26.5-27.1 tokens/s (1 thread 13.2-13.4 → 14.0-14.1). */
INLINE void prefetch_stream(StreamPrefetch pf, const uint8_t *rec, int data, const uint8_t *end, int NP,
                            size_t pb) {
    prefetch_record(pf, rec + (rec + pf.ahead >= end ? (size_t)(NP - 1) * pb : 0), data);
}

/* v[m]: as unpack16, but for 4-bit quants the high nibbles (odd m) are
 * left in place, 16 times their value: one operation less per 64 bytes,
 * for tiles of few tokens, whose integer sums of odd m are divided by 16
 * again (exactly: they are multiples of 16). */
INLINE AVX512VNNI void unpack16_high(__m512i v[8], const uint8_t *rec) {
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    _Pragma("GCC unroll 8")
    for (int g = 0; g < 4; g++) {
        const __m512i x = _mm512_loadu_si512((const void *)(rec + 64 * g));
        v[2 * g] = _mm512_and_si512(x, low);
        v[2 * g + 1] = _mm512_and_si512(x, high);
    }
}

/* A block's scales for its 16 rows: a = d * scale (Q6_K: a, a2 for its two
 * halves), mn the min (Q4_1, Q5_1) or dmin * min (Q4_K, Q5_K); fields:
 * the superblock's 6-bit fields from k_fields. */
INLINE AVX512VNNI void block_scales(const uint8_t *h, const uint8_t *fields, int i, const int type, __m512 *a,
                                    __m512 *a2, __m512 *mn) {
    const __m512 d = f16x16(h);
    *a = *a2 = *mn = d;
    if (q_has_min(type)) *mn = f16x16(h + 32);
    if (q_is_k(type)) {
        *a = _mm512_mul_ps(d, u8x16(fields + i * 16));
        *mn = _mm512_mul_ps(f16x16(h + 32), u8x16(fields + 128 + i * 16));
    }
    if (type == FLM_Q6_K) {
        *a = _mm512_mul_ps(d, i8x16(h + 32 + (2 * i) * 16));
        *a2 = _mm512_mul_ps(d, i8x16(h + 32 + (2 * i + 1) * 16));
    }
}

/* acc + one token's (xb) products with a block's 16 rows (v, unpacked):
 * the operations of fma_block. Integer sums are exact in any order: one
 * chain of dot products per sum where a tile has tokens enough to keep the
 * core busy (an addition less per token and block), two where the tokens
 * are few, so that a single token does not wait on one chain's latency.
 * high16: v's odd groups hold 4-bit quants times 16 (unpack16_high). */
INLINE AVX512VNNI __m512 block_dot(__m512 acc, const __m512i v[8], const FlmQ8 *xb, __m512 a, __m512 a2, __m512 mn,
                                   const int type, const int one_chain, const int high16) {
    const __m512 xd = _mm512_set1_ps(xb->d);
    if (type == FLM_Q6_K) {
        /* The offsets from memory: a broadcast of a register formed here
         * took a vector port per token and block, beside 8 dot products
         * (gemm_speed's 1.7B up projection, 512 tokens, one thread, on the
         * 2-core Xeon: 277 -> 317 GFLOP/s; forward_speed's 7B shape, pp512,
         * one thread: 20.8 -> 23.4 tokens/s). */
        __m512i I0 = _mm512_set1_epi32(xb->s32[0]), I1 = _mm512_set1_epi32(xb->s32[1]);
        if (one_chain) {
            _Pragma("GCC unroll 4")
            for (int m = 0; m < 4; m++) {
                I0 = dot4(I0, v[m], xb->q + 4 * m);
                I1 = dot4(I1, v[m + 4], xb->q + 4 * m + 16);
            }
        } else {
            __m512i J0 = _mm512_setzero_si512(), J1 = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int m = 0; m < 4; m += 2) {
                I0 = dot4(I0, v[m], xb->q + 4 * m);
                J0 = dot4(J0, v[m + 1], xb->q + 4 * m + 4);
                I1 = dot4(I1, v[m + 4], xb->q + 4 * m + 16);
                J1 = dot4(J1, v[m + 5], xb->q + 4 * m + 20);
            }
            I0 = _mm512_add_epi32(I0, J0);
            I1 = _mm512_add_epi32(I1, J1);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I0), _mm512_mul_ps(a, xd), acc);
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(I1), _mm512_mul_ps(a2, xd), acc);
    }
    __m512i I = _mm512_set1_epi32(-q_offset(type) * (xb->s[0] + xb->s[1]));
    if (one_chain) {
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) I = dot4(I, v[m], xb->q + 4 * m);
    } else {
        __m512i J = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m += 2) {
            I = dot4(I, v[m], xb->q + 4 * m);
            J = dot4(J, v[m + 1], xb->q + 4 * m + 4);
        }
        I = _mm512_add_epi32(I, high16 ? _mm512_srai_epi32(J, 4) : J);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(a, xd), acc);
    if (q_has_min(type)) acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(xb->ds), acc);
    if (q_is_k(type)) acc = _mm512_fnmadd_ps(mn, _mm512_set1_ps(xb->ds), acc);
    return acc;
}

/* NP consecutive panels (pb bytes apart) for NT tokens, for decoding: the
 * panels side by side, block by block, each panel's sums in the order one
 * panel alone would take. A single stream of weights keeps too few reads
 * in flight to reach the memory's bandwidth from one core (the 16-core Xeon
 * read Q8_0 weights at 9 GB/s a core), where NP streams keep NP times as
 * many: 4 panels made decoding a 1.7B shape 12-14% faster at Q8_0 and
 * 30-35% at Q4_K_M, at 1 and 2 threads of a 2-core Xeon; 8 panels no
 * faster than 4. rows: the mask of the last panel's rows. */
INLINE AVX512VNNI void qpanel(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, size_t pb, int K,
                              const int type, const int NT, const int NP, __mmask16 rows, const int l2) {
    const int sb = q_sb(type), hdr = q_header(type), data = q_data(type);
    const StreamPrefetch pf = {flm_stream_ahead, l2};
    const size_t sbb = (size_t)hdr + (size_t)sb / 32 * data;
    /* Few tokens: the high nibbles of 4-bit quants stay in place. */
    const int high16 = q_bits(type) == 4 && NT <= 2;
    __m512 acc[NP * NT];
    _Pragma("GCC unroll 16")
    for (int t = 0; t < NP * NT; t++) acc[t] = _mm512_setzero_ps();
    uint8_t fields[NP][256];
    for (int b = 0; b < K / 32; b++) {
        const int i = b * 32 % sb / 32;
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NP; j++) {
            const uint8_t *h = pp + (size_t)j * pb + (size_t)(b * 32 / sb) * sbb;
            __m512i v[8];
            if (q_is_k(type) && i == 0) k_fields(fields[j], h);
            prefetch_stream(pf, h + hdr + (size_t)i * data, data, pp + (size_t)(j + 1) * pb, NP, pb);
            if (high16) unpack16_high(v, h + hdr + (size_t)i * data);
            else unpack16(v, h + hdr + (size_t)i * data, q_bits(type));
            __m512 a, a2, mn;
            block_scales(h, fields[j], i, type, &a, &a2, &mn);
            _Pragma("GCC unroll 16")
            for (int t = 0; t < NT; t++)
                acc[j * NT + t] = block_dot(acc[j * NT + t], v, x + (size_t)t * lda + b, a, a2, mn, type, 0, high16);
        }
    }
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NP; j++)
        _Pragma("GCC unroll 16")
        for (int t = 0; t < NT; t++)
            _mm512_mask_storeu_ps(out + (size_t)j * PANEL + (size_t)t * ldo, j == NP - 1 ? rows : 0xFFFF,
                                  acc[j * NT + t]);
}

/* One panel for a tile of NT tokens (at most 16), for prompts: each block
 * of weights unpacked once for all of them. The sums are named variables,
 * not an array: GCC 12 kept an array of them in memory as well as in
 * registers and stored every update (gemm_speed's 1.7B up projection, 512
 * tokens, one thread, on the 2-core Xeon, array → named: Q5_K 330 → 374
 * GFLOP/s, Q4_K 340 → 407, Q8_0 369 → 404, Q6_K 286 → 312). */
#define EACH_TOKEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
INLINE AVX512VNNI void qtile(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, int K, const int type,
                             const int NT, __mmask16 rows) {
    const int sb = q_sb(type), hdr = q_header(type), data = q_data(type);
    const StreamPrefetch pf = stream_prefetch_now();
    const size_t sbb = (size_t)hdr + (size_t)sb / 32 * data;
    const int high16 = q_bits(type) == 4 && NT <= 2;   /* as qpanel's */
#define DECLARE(t) __m512 acc##t = _mm512_setzero_ps();
    EACH_TOKEN(DECLARE)
#undef DECLARE
    uint8_t fields[256];
    for (int b = 0; b < K / 32; b++) {
        const int i = b * 32 % sb / 32;
        const uint8_t *h = pp + (size_t)(b * 32 / sb) * sbb;
        __m512i v[8];
        if (q_is_k(type) && i == 0) k_fields(fields, h);
        prefetch_record(pf, h + hdr + (size_t)i * data, data);
        if (high16) unpack16_high(v, h + hdr + (size_t)i * data);
        else unpack16(v, h + hdr + (size_t)i * data, q_bits(type));
        __m512 a, a2, mn;
        block_scales(h, fields, i, type, &a, &a2, &mn);
#define STEP(t) if ((t) < NT) acc##t = block_dot(acc##t, v, x + (size_t)(t) * lda + b, a, a2, mn, type, NT >= 8, high16);
        EACH_TOKEN(STEP)
#undef STEP
    }
#define STORE(t) if ((t) < NT) _mm512_mask_storeu_ps(out + (size_t)(t) * ldo, rows, acc##t);
    EACH_TOKEN(STORE)
#undef STORE
}
#undef EACH_TOKEN

/* Panels side by side when decoding (qpanel). */
#define DECODE_PANELS 4

INLINE AVX512VNNI void qgemm_type(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T,
                                  int p0, int np, int N, const int type) {
    const size_t pb = (size_t)K / q_sb(type) * ((size_t)q_header(type) + (size_t)q_sb(type) / 32 * q_data(type));
    const int l2 = flm_stream_l2;
    int p = p0;
    if (T <= FLM_DECODE_TOKENS)
        for (; p + DECODE_PANELS <= p0 + np; p += DECODE_PANELS) {
            const uint8_t *pp = (const uint8_t *)wp + (size_t)p * pb;
            const __mmask16 rows = tail_mask(N - (p + DECODE_PANELS - 1) * PANEL);
            /* The cache level as a constant: a branch at each prefetch
             * cost 10% of a one-thread decoding step at Q4_K. */
#define PANELS(NT, L2) qpanel(out + p * PANEL, ldo, x, lda, pp, pb, K, type, NT, DECODE_PANELS, rows, L2)
            if (T == 2) { if (l2) PANELS(2, 1); else PANELS(2, 0); }
            else if (l2) PANELS(1, 1); else PANELS(1, 0);
#undef PANELS
        }
    for (; p < p0 + np; p++) {
        const uint8_t *pp = (const uint8_t *)wp + (size_t)p * pb;
        const __mmask16 rows = tail_mask(N - p * PANEL);
        float *o = out + p * PANEL;
#define TOKENS(NT) qtile(o + (size_t)t * ldo, ldo, x + (size_t)t * lda, lda, pp, K, type, NT, rows)
        int t = 0;
        /* Tiles of 16 tokens unpack each block of weights once for 16
         * (fastllm's 1.7B shape at pp256, one thread: Q5_K +7%, Q4_K_M +2%,
         * Q8_0, Q4_0 and Q6_K within 0-4%, against tiles of 8). */
        for (; T - t >= 16; t += 16) TOKENS(16);
        if (T - t >= 8) { TOKENS(8); t += 8; }
        if (T - t >= 4) { TOKENS(4); t += 4; }
        if (T - t >= 2) { TOKENS(2); t += 2; }
        if (T - t >= 1) TOKENS(1);
#undef TOKENS
    }
}

AVX512VNNI void flm_qgemm_avx512_vnni(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T,
                                      int p0, int np, int N, int type) {
    switch (type) {
#define CASE(TY) case TY: qgemm_type(out, ldo, x, lda, wp, K, T, p0, np, N, TY); break;
    CASE(FLM_Q8_0) CASE(FLM_Q4_0) CASE(FLM_Q4_1) CASE(FLM_Q5_0) CASE(FLM_Q5_1)
    CASE(FLM_Q4_K) CASE(FLM_Q5_K) CASE(FLM_Q6_K)
#undef CASE
    }
}

/* ------------------------------------------------------- AVX2
 * A 256-bit vector holds half a panel: 8 rows x 4 k. maddubs multiplies
 * unsigned by signed bytes into 16-bit pair sums, which cannot overflow for
 * quants of up to 6 bits (2 x 63 x 127); 8-bit quants are made signed again
 * (u - 128) and multiplied as |w| by the activation with w's sign. */

INLINE AVX2 __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE AVX2 __m256 u8x8(const uint8_t *p) {
    int64_t e;
    memcpy(&e, p, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(e)));
}

/* k_fields (above) in 256-bit halves. */
INLINE AVX2 void k_fields8(uint8_t f[256], const uint8_t *h) {
    const __m256i six = _mm256_set1_epi8(63), nib = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    for (int o = 0; o < 64; o += 32) {
        const __m256i P = _mm256_loadu_si256((const __m256i *)(h + 64 + o));
        const __m256i M = _mm256_loadu_si256((const __m256i *)(h + 128 + o));
        const __m256i L = _mm256_loadu_si256((const __m256i *)(h + 192 + o));
        _mm256_storeu_si256((__m256i *)(f + o), _mm256_and_si256(P, six));
        _mm256_storeu_si256((__m256i *)(f + 64 + o), _mm256_or_si256(_mm256_and_si256(L, nib),
                                                                     _mm256_and_si256(_mm256_srli_epi16(P, 2), top)));
        _mm256_storeu_si256((__m256i *)(f + 128 + o), _mm256_and_si256(M, six));
        _mm256_storeu_si256((__m256i *)(f + 192 + o),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), nib),
                                            _mm256_and_si256(_mm256_srli_epi16(M, 2), top)));
    }
}
INLINE AVX2 __m256 i8x8(const uint8_t *p) {
    int64_t e;
    memcpy(&e, p, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(e)));
}

/* Rows 8h .. 8h+7 of a block's scales (block_scales, above). */
INLINE AVX2 void block_scales8(const uint8_t *hp, const uint8_t *fields, int i, int h, const int type, __m256 *a,
                               __m256 *a2, __m256 *mn) {
    const __m256 d = f16x8(hp + 16 * h);
    *a = *a2 = *mn = d;
    if (q_has_min(type)) *mn = f16x8(hp + 32 + 16 * h);
    if (q_is_k(type)) {
        *a = _mm256_mul_ps(d, u8x8(fields + i * 16 + 8 * h));
        *mn = _mm256_mul_ps(f16x8(hp + 32 + 16 * h), u8x8(fields + 128 + i * 16 + 8 * h));
    }
    if (type == FLM_Q6_K) {
        *a = _mm256_mul_ps(d, i8x8(hp + 32 + (2 * i) * 16 + 8 * h));
        *a2 = _mm256_mul_ps(d, i8x8(hp + 32 + (2 * i + 1) * 16 + 8 * h));
    }
}

/* acc + one token's products with 8 rows of a block, from their integer
 * sums without offsets (Q6_K: I0 over the first 16 k, I1 over the last;
 * others: I0 over all 32, I1 unused): the float part of block_dot, above. */
INLINE AVX2 __m256 block_fma8(__m256 acc, __m256i I0, __m256i I1, const FlmQ8 *xb, __m256 a, __m256 a2, __m256 mn,
                              const int type) {
    const __m256 xd = _mm256_set1_ps(xb->d);
    if (type == FLM_Q6_K) {
        I0 = _mm256_add_epi32(I0, _mm256_set1_epi32(xb->s32[0]));
        I1 = _mm256_add_epi32(I1, _mm256_set1_epi32(xb->s32[1]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I0), _mm256_mul_ps(a, xd), acc);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(I1), _mm256_mul_ps(a2, xd), acc);
    }
    const int bits = q_bits(type), off = bits == 8 ? 0 : q_offset(type);   /* 8-bit quants come back signed */
    __m256i I = I0;
    if (off) I = _mm256_sub_epi32(I, _mm256_set1_epi32(off * (xb->s[0] + xb->s[1])));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(a, xd), acc);
    if (q_has_min(type)) acc = _mm256_fmadd_ps(mn, _mm256_set1_ps(xb->ds), acc);
    if (q_is_k(type)) acc = _mm256_fnmadd_ps(mn, _mm256_set1_ps(xb->ds), acc);
    return acc;
}

/* 8 of a panel's rows, stored from acc: all of them, or the first rows. */
INLINE AVX2 void store_rows8(float *o, __m256 acc, int rows) {
    if (rows >= 8) {
        _mm256_storeu_ps(o, acc);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, acc);
    for (int r = 0; r < rows; r++) o[r] = tmp[r];
}

/* Activations k .. k+3 of a token in every 32-bit lane. */
INLINE AVX2 __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Quants 4g .. 4g+3 of half h of a 6-bit record (groups of 4 k): the
 * nibbles of groups 2g and 2g+1, and their top bits from one vector. */
INLINE AVX2 void six_bit_groups(__m256i v[4], const uint8_t *rec, int g, int h) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i c = _mm256_loadu_si256((const __m256i *)(rec + 256 + 64 * g + 32 * h));
    const __m256i L0 = _mm256_loadu_si256((const __m256i *)(rec + 128 * g + 32 * h));
    const __m256i L1 = _mm256_loadu_si256((const __m256i *)(rec + 128 * g + 64 + 32 * h));
    v[0] = _mm256_or_si256(_mm256_and_si256(L0, low), _mm256_and_si256(_mm256_slli_epi16(c, 4), top));
    v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), low), _mm256_and_si256(_mm256_slli_epi16(c, 2), top));
    v[2] = _mm256_or_si256(_mm256_and_si256(L1, low), _mm256_and_si256(c, top));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), low), _mm256_and_si256(_mm256_srli_epi16(c, 2), top));
}

/* Group 2g+e of half h of a 4- or 5-bit record, from its 64-byte group's
 * half w: the low (e = 0) or high nibbles, and for 5-bit quants the fifth
 * bit from the record's plane of 32 mask bits per vector, byte i taking bit i. */
INLINE AVX2 __m256i nibble_group(__m256i w, const uint8_t *rec, int g, int e, int h, const int bits) {
    __m256i v = _mm256_and_si256(e ? _mm256_srli_epi16(w, 4) : w, _mm256_set1_epi8(0x0F));
    if (bits == 5) {
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const uint8_t *plane = rec + 256 + 8 * (2 * g + e) + 4 * h;
        const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(plane)), spread), select);
        v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(b, select), _mm256_set1_epi8(16)));
    }
    return v;
}

/* The integer sums of HS halves of a block's record (rows 8h0 .. 8h0+7,
 * and with HS = 2 the 8 after them too) times the activations of NT
 * tokens (xb: the first's block, lda blocks apart), without offsets, as
 * block_fma8 takes them: I0[hh * NT + t] (Q6_K: and I1[hh * NT + t]).
 * Each 64-byte group is unpacked and multiplied as it is loaded, so that
 * few vectors are live, and the pair sums (of at most 2 x (2^bits - 1) x
 * 127 each) are added in 16 bits as far as that cannot overflow: 8 of
 * them for 4-bit quants, 4 for 5-bit, 2 for 6-bit, 1 for 8-bit (as |w| by
 * x with w's sign). Each half is done whole before the next: unpacking
 * both halves of a group at once to share the broadcasts read 20-25%
 * slower at one token on the AVX2-only EPYC VM (`gemm_speed 1 avx2 q4_k 1
 * "3B up" 4`).
 *
 * Sizes are fixed (NT * HS <= 4), not variable-length arrays: GCC keeps a
 * VLA in memory and re-aligns the stack for it at every block. KEEP pins a
 * running sum to a register after each addition, so that GCC cannot turn a
 * chain of them into a tree, which makes every product live at once and
 * spills them to the stack.
 * Both left the sums' bits alone and gave, on the Zen 4 VM (`gemm_speed 1
 * avx2 TYPE 512 "3B up"`), Q4_K 82-101 -> 146-161 GFLOP/s, Q4_0 99-111 ->
 * 170-184, Q8_0 75-89 -> 97-115; decoding from memory Q4_K 15 -> 21 GB/s.
 *
 * pre: the record's vectors unpacked already (unpack_half8, below; HS = 1,
 * 4- to 6-bit quants), or NULL to unpack them here. */
INLINE AVX2 void stream_ints8(__m256i I0[], __m256i I1[], const uint8_t *rec, const __m256i *pre, const FlmQ8 *xb,
                              int lda, const int NT, const int HS, const int bits, int h0) {
    const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
#define LOAD(o, hh) _mm256_loadu_si256((const __m256i *)(rec + (o) + 32 * (h0 + (hh))))
#define X(t, m) bcast4(xb[(size_t)(t) * lda].q + 4 * (m))
#define SUM32(p) _mm256_madd_epi16(p, ones)
#define EACH(u) for (int u = 0; u < HS * NT; u++)
#define KEEP(v) __asm__("" : "+x"(v))
    if (bits == 8) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        _Pragma("GCC unroll 2")
        for (int hh = 0; hh < HS; hh++) {
            __m256i J[4];   /* the second chain of sums: k = 16 .. 31 */
            for (int t = 0; t < NT; t++) I0[hh * NT + t] = J[t] = zero;
            _Pragma("GCC unroll 8")
            for (int m = 0; m < 8; m++) {
                const __m256i w = _mm256_xor_si256(LOAD(64 * m, hh), flip), aw = _mm256_sign_epi8(w, w);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < NT; t++) {
                    __m256i *I = m < 4 ? &I0[hh * NT + t] : &J[t];
                    *I = _mm256_add_epi32(*I, SUM32(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(X(t, m), w))));
                    KEEP(*I);
                }
            }
            for (int t = 0; t < NT; t++) I0[hh * NT + t] = _mm256_add_epi32(I0[hh * NT + t], J[t]);
        }
        return;
    }
    if (bits == 6) {
        _Pragma("GCC unroll 2")
        for (int hh = 0; hh < HS; hh++)
            _Pragma("GCC unroll 2")
            for (int g = 0; g < 2; g++) {
                __m256i v[4];
                if (pre) for (int j = 0; j < 4; j++) v[j] = pre[4 * g + j];
                else six_bit_groups(v, rec, g, h0 + hh);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < NT; t++) {
                    const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], X(t, 4 * g)),
                                                         _mm256_maddubs_epi16(v[1], X(t, 4 * g + 1)));
                    const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], X(t, 4 * g + 2)),
                                                         _mm256_maddubs_epi16(v[3], X(t, 4 * g + 3)));
                    (g == 0 ? I0 : I1)[hh * NT + t] = _mm256_add_epi32(SUM32(p01), SUM32(p23));
                }
            }
        return;
    }
    /* 4 or 5 bits */
    __m256i p[4];
    EACH(u) p[u] = zero;
    _Pragma("GCC unroll 2")
    for (int hh = 0; hh < HS; hh++) {
        _Pragma("GCC unroll 4")
        for (int g = 0; g < 4; g++) {
            const __m256i w = pre ? zero : LOAD(64 * g, hh);
            _Pragma("GCC unroll 2")
            for (int e = 0; e < 2; e++) {
                const __m256i v = pre ? pre[2 * g + e] : nibble_group(w, rec, g, e, h0 + hh, bits);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < NT; t++) {
                    p[hh * NT + t] = _mm256_add_epi16(p[hh * NT + t], _mm256_maddubs_epi16(v, X(t, 2 * g + e)));
                    KEEP(p[hh * NT + t]);
                }
            }
            if (bits == 5 && g == 1)   /* 4 groups of 5-bit pair sums: widen before the next 4 */
                for (int t = 0; t < NT; t++) {
                    I0[hh * NT + t] = SUM32(p[hh * NT + t]);
                    p[hh * NT + t] = zero;
                }
        }
    }
    EACH(u) I0[u] = bits == 5 ? _mm256_add_epi32(I0[u], SUM32(p[u])) : SUM32(p[u]);
#undef LOAD
#undef X
#undef SUM32
#undef EACH
#undef KEEP
}

/* Prompts: the quants of half h of a panel for a run of blocks, unpacked
 * once for all of a call's token tiles (qhalf_unpacked, below) rather than
 * once per tile, with the blocks' scales. 64 blocks (22 KiB) stay in L1
 * beside a tile's activations; 32 and 128 read the same. */
#define UNPACKED_BLOCKS 64
_Static_assert(UNPACKED_BLOCKS % 8 == 0, "a run of blocks starts a K-quant superblock");
typedef struct {
    __m256i v[UNPACKED_BLOCKS][8];
    __m256 a[UNPACKED_BLOCKS], a2[UNPACKED_BLOCKS], mn[UNPACKED_BLOCKS];
    int b0, nb;   /* the blocks held: b0 .. b0+nb-1 */
} Unpacked;

/* Blocks b0 .. b0+nb-1 of half h of a panel, of 4- to 6-bit quants, into u. */
INLINE AVX2 void unpack_half8(Unpacked *u, const uint8_t *pp, int b0, int nb, const int type, int h) {
    const int sb = q_sb(type), hdr = q_header(type), data = q_data(type), bits = q_bits(type);
    const size_t sbb = (size_t)hdr + (size_t)sb / 32 * data;
    const StreamPrefetch pf = stream_prefetch_now();
    uint8_t fields[256];
    u->b0 = b0;
    u->nb = nb;
    for (int j = 0; j < nb; j++) {
        const int b = b0 + j, i = b * 32 % sb / 32;
        const uint8_t *hp = pp + (size_t)(b * 32 / sb) * sbb, *rec = hp + hdr + (size_t)i * data;
        if (q_is_k(type) && i == 0) k_fields8(fields, hp);
        if (h == 0) prefetch_record(pf, rec, data);
        if (bits == 6)
            for (int g = 0; g < 2; g++) six_bit_groups(u->v[j] + 4 * g, rec, g, h);
        else
            for (int g = 0; g < 4; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * g + 32 * h));
                for (int e = 0; e < 2; e++) u->v[j][2 * g + e] = nibble_group(w, rec, g, e, h, bits);
            }
        block_scales8(hp, fields, i, h, type, &u->a[j], &u->a2[j], &u->mn[j]);
    }
}

/* Rows 8h .. 8h+7 of one panel for a tile of NT tokens (at most 4), for
 * prompts, the sums in named variables as qtile's (above). With u, only
 * u's blocks, from its unpacked quants, added to what out holds unless
 * they are the first (rows = 8). */
#define EACH_TOKEN(X) X(0) X(1) X(2) X(3)
INLINE AVX2 void qhalf_tile(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, int K, const int type,
                            const int NT, int h, int rows, const Unpacked *u) {
    const int sb = q_sb(type), hdr = q_header(type), data = q_data(type);
    const StreamPrefetch pf = stream_prefetch_now();
    const size_t sbb = (size_t)hdr + (size_t)sb / 32 * data;
#define DECLARE(t) __m256 acc##t = (t) < NT && u && u->b0 ? _mm256_loadu_ps(out + (size_t)(t) * ldo) : _mm256_setzero_ps();
    EACH_TOKEN(DECLARE)
#undef DECLARE
    uint8_t fields[256];
    const int end = u ? u->b0 + u->nb : K / 32;
    for (int b = u ? u->b0 : 0; b < end; b++) {
        __m256i I0[4], I1[4];
        __m256 a, a2, mn;
        if (u) {
            const int j = b - u->b0;
            stream_ints8(I0, I1, NULL, u->v[j], x + b, lda, NT, 1, q_bits(type), h);
            a = u->a[j];
            a2 = u->a2[j];
            mn = u->mn[j];
        } else {
            const int i = b * 32 % sb / 32;
            const uint8_t *hp = pp + (size_t)(b * 32 / sb) * sbb;
            if (q_is_k(type) && i == 0) k_fields8(fields, hp);
            if (h == 0) prefetch_record(pf, hp + hdr + (size_t)i * data, data);
            stream_ints8(I0, I1, hp + hdr + (size_t)i * data, NULL, x + b, lda, NT, 1, q_bits(type), h);
            block_scales8(hp, fields, i, h, type, &a, &a2, &mn);
        }
#define STEP(t) if ((t) < NT) acc##t = block_fma8(acc##t, I0[t], I1[t], x + (size_t)(t) * lda + b, a, a2, mn, type);
        EACH_TOKEN(STEP)
#undef STEP
    }
#define STORE(t) if ((t) < NT) store_rows8(out + (size_t)(t) * ldo, acc##t, rows);
    EACH_TOKEN(STORE)
#undef STORE
}
#undef EACH_TOKEN

/* qhalf_tile over T tokens, in tiles of 4, then 2 and 1. */
INLINE AVX2 void qhalf_tiles(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, int K, int T,
                             const int type, int h, int rows, const Unpacked *u) {
#define TOKENS(NT) qhalf_tile(out + (size_t)t * ldo, ldo, x + (size_t)t * lda, lda, pp, K, type, NT, h, rows, u)
    int t = 0;
    for (; T - t >= 4; t += 4) TOKENS(4);
    if (T - t >= 2) { TOKENS(2); t += 2; }
    if (T - t >= 1) TOKENS(1);
#undef TOKENS
}

/* A prompt of at least UNPACK_TOKENS tokens takes half h of a panel (all
 * 8 rows) through qhalf_tile a run of blocks at a time, each run unpacked
 * once: the sums go through out between runs, and a float stored and
 * loaded back is the same float, so the bits are those of whole tiles.
 * Unpacking is a third of a 6-bit tile's work and more of a 5-bit one's;
 * on the Zen 4 VM (`gemm_speed 1 avx2 TYPE 512 "3B up"`, GFLOP/s) Q6_K
 * read 74-85 -> 101-106, Q5_K 69-78 -> 156-180, Q5_0 90-95 -> 125-162,
 * Q4_K and Q4_0 level or better (benchmarks/README.md). With 4 or 8
 * tokens (one or two tiles) unpacking ahead was slower or level; with
 * 16, faster. */
#define UNPACK_TOKENS 16
INLINE AVX2 void qhalf_unpacked(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, int K, int T,
                                const int type, int h) {
    Unpacked u;
    for (int b0 = 0; b0 < K / 32; b0 += UNPACKED_BLOCKS) {
        unpack_half8(&u, pp, b0, K / 32 - b0 < UNPACKED_BLOCKS ? K / 32 - b0 : UNPACKED_BLOCKS, type, h);
        qhalf_tiles(out, ldo, x, lda, pp, K, T, type, h, 8, &u);
    }
}

/* Decoding: NP consecutive panels (pb bytes apart) side by side for NT
 * tokens (1 or 2), their sums from stream_ints8. A form that unpacked a
 * block's 8 vectors first and then multiplied them by 8 activation
 * broadcasts spilled them and its sums out of AVX2's 16 registers
 * (benchmarks/README.md: `gemm_speed 1 avx2 q4_k 1 "3B up" 4` read 8.7-10.6
 * GB/s with that and 14.7-17.0 with this on the Zen 4 VM; this form for
 * every type, on the AVX2-only EPYC VM (family 17h), against Q4_K's alone:
 * Q4_K +3%, Q6_K +33%, Q8_0 +11% at one token, +20-28% at two). For one
 * token both halves of a panel share a pass; for two, each half has its
 * own (the second finds the panels in L2), as their sums would not fit. */
INLINE AVX2 void qpanels(float *out, int ldo, const FlmQ8 *x, int lda, const uint8_t *pp, size_t pb, int K,
                         const int type, const int NT, const int NP, const int l2) {
    const int sb = q_sb(type), hdr = q_header(type), data = q_data(type), HS = NT == 1 ? 2 : 1;
    const StreamPrefetch pf = {flm_stream_ahead, l2};
    const size_t sbb = (size_t)hdr + (size_t)sb / 32 * data;
    for (int h0 = 0; h0 < 2; h0 += HS) {
        __m256 acc[DECODE_PANELS * 2];   /* NP * NT * HS; fixed, as in stream_ints8 */
        _Pragma("GCC unroll 8")
        for (int s = 0; s < NP * NT * HS; s++) acc[s] = _mm256_setzero_ps();
        uint8_t fields[DECODE_PANELS][256];
        for (int b = 0; b < K / 32; b++) {
            const int i = b * 32 % sb / 32;
            _Pragma("GCC unroll 4")
            for (int j = 0; j < NP; j++) {
                const uint8_t *hp = pp + (size_t)j * pb + (size_t)(b * 32 / sb) * sbb, *rec = hp + hdr + (size_t)i * data;
                if (q_is_k(type) && i == 0) k_fields8(fields[j], hp);
                if (h0 == 0) prefetch_stream(pf, rec, data, pp + (size_t)(j + 1) * pb, NP, pb);
                /* Opaque, so that the activations' broadcasts are made again
                 * for each panel (from memory, on a load port) rather than held. */
                const FlmQ8 *xo = x + b;
                __asm__("" : "+r"(xo));
                __m256i I0[2], I1[2];
                stream_ints8(I0, I1, rec, NULL, xo, lda, NT, HS, q_bits(type), h0);
                _Pragma("GCC unroll 2")
                for (int hh = 0; hh < HS; hh++) {
                    __m256 a, a2, mn;
                    block_scales8(hp, fields[j], i, h0 + hh, type, &a, &a2, &mn);
                    _Pragma("GCC unroll 2")
                    for (int t = 0; t < NT; t++)
                        acc[(j * NT + t) * HS + hh] = block_fma8(acc[(j * NT + t) * HS + hh], I0[hh * NT + t],
                                                                 I1[hh * NT + t], x + (size_t)t * lda + b, a, a2, mn, type);
                }
            }
        }
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NP; j++)
            _Pragma("GCC unroll 2")
            for (int t = 0; t < NT; t++)
                _Pragma("GCC unroll 2")
                for (int hh = 0; hh < HS; hh++)
                    _mm256_storeu_ps(out + (size_t)j * PANEL + 8 * (h0 + hh) + (size_t)t * ldo, acc[(j * NT + t) * HS + hh]);
    }
}

INLINE AVX2 void qgemm_type_avx2(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T,
                                 int p0, int np, int N, const int type) {
    const size_t pb = (size_t)K / q_sb(type) * ((size_t)q_header(type) + (size_t)q_sb(type) / 32 * q_data(type));
    const int l2 = flm_stream_l2;
    int p = p0;
    if (T <= FLM_DECODE_TOKENS)   /* decoding: whole panels side by side (the last may be partial: alone, below) */
        for (; p + DECODE_PANELS <= p0 + np && (p + DECODE_PANELS) * PANEL <= N; p += DECODE_PANELS) {
            const uint8_t *pp = (const uint8_t *)wp + (size_t)p * pb;
#define PANELS(NT, L2) qpanels(out + p * PANEL, ldo, x, lda, pp, pb, K, type, NT, DECODE_PANELS, L2)
            if (T == 2) { if (l2) PANELS(2, 1); else PANELS(2, 0); }   /* the level a constant, as above */
            else if (l2) PANELS(1, 1); else PANELS(1, 0);
#undef PANELS
        }
    for (; p < p0 + np; p++) {
        const uint8_t *pp = (const uint8_t *)wp + (size_t)p * pb;
        for (int h = 0; h < 2; h++) {
            const int rows = N - p * PANEL - 8 * h;
            if (rows <= 0) break;
            float *o = out + p * PANEL + 8 * h;
            if (T >= UNPACK_TOKENS && rows >= 8 && q_bits(type) < 8) qhalf_unpacked(o, ldo, x, lda, pp, K, T, type, h);
            else qhalf_tiles(o, ldo, x, lda, pp, K, T, type, h, rows, NULL);
        }
    }
}

AVX2 void flm_qgemm_avx2(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T, int p0, int np,
                         int N, int type) {
    switch (type) {
#define CASE(TY) case TY: qgemm_type_avx2(out, ldo, x, lda, wp, K, T, p0, np, N, TY); break;
    CASE(FLM_Q8_0) CASE(FLM_Q4_0) CASE(FLM_Q4_1) CASE(FLM_Q5_0) CASE(FLM_Q5_1)
    CASE(FLM_Q4_K) CASE(FLM_Q5_K) CASE(FLM_Q6_K)
#undef CASE
    }
}

AVX512 void flm_quantize_q8_avx512(FlmQ8 *dst, const float *x, int K) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int b = 0; b < K / 32; b++, x += 32) {
        const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        dst[b].d = amax / 127.0f;
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)dst[b].q, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(dst[b].q + 16), _mm512_cvtepi32_epi8(i1));
        flm_q8_set_sums(&dst[b], _mm512_reduce_add_epi32(i0), _mm512_reduce_add_epi32(i1));
    }
}
#endif
