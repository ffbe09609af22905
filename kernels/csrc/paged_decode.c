/* Paged decode attention for the CPU, fp32: one call for a whole batch.
 *
 * The contract is kernels/contract.py's PagedAttention for a decode batch (one query
 * row per sequence, at its last position, so every cached token is visible and no mask
 * is needed). Pools are (NB, BS, Hkv, D) contiguous; a sequence's token t lives in
 * block tables[b][t / BS] at offset t % BS. Grouped-query attention: the G = Hq / Hkv
 * query heads of KV head h are heads h*G .. h*G + G - 1.
 *
 * Why C: in torch each sequence costs about seven ops a layer (two gathers, two views,
 * bmm, softmax, bmm), and at 32 sequences the step's attention read K/V at 4 GB/s against
 * the core's 14 GB/s. Here a sequence's blocks are read where they lie, once for the
 * scores and once for the output, with no copy and no per-op dispatch; the caller
 * (kernels/native.py) calls it through ctypes, which releases the GIL for the call.
 *
 * Per (sequence, KV head): scores of its G queries over the context into `scratch`
 * (G x ctx), a softmax per row, then the output as the probability-weighted sum of V
 * rows. Built with -O3 -ffast-math -march=native. The scores take four query rows at a
 * time in 8-float vectors (GCC's vector extensions): four independent sums share each
 * load of a key row, where one sum per row waited on its previous FMA every time.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v); /* unaligned load; compiles to one vmovups */
    return v;
}

static inline float hsum8(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* The scores of n query rows (q, q + D, ...) against one key row, into s[0], s[ctx], ...
 * Four rows at a time share each load of k and keep four independent sums in flight. */
static inline void scores(const float *restrict q, const float *restrict k, int64_t n, int64_t D, float *restrict s,
                          int64_t ctx) {
    int64_t g = 0;
    if (D % 8 == 0) {
        for (; g + 4 <= n; g += 4) {
            const float *q0 = q + g * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 kv = load8(k + d);
                a0 += load8(q0 + d) * kv;
                a1 += load8(q1 + d) * kv;
                a2 += load8(q2 + d) * kv;
                a3 += load8(q3 + d) * kv;
            }
            s[g * ctx] = hsum8(a0);
            s[(g + 1) * ctx] = hsum8(a1);
            s[(g + 2) * ctx] = hsum8(a2);
            s[(g + 3) * ctx] = hsum8(a3);
        }
    }
    for (; g < n; g++) {
        const float *qg = q + g * D;
        float acc = 0.f;
        for (int64_t d = 0; d < D; d++) acc += qg[d] * k[d];
        s[g * ctx] = acc;
    }
}

/* Ask for the row PREFETCH_ROWS tokens ahead (in whatever block holds it), so that a
 * block's first rows are on their way before the current block ends: the hardware
 * prefetcher follows a stream only within a page, and every block starts a new one. */
#define PREFETCH_ROWS 16
static inline void prefetch_ahead(const float *pool, const int32_t *tbl, int64_t t, int64_t ctx, int64_t BS,
                                  int64_t row) {
    const int64_t a = t + PREFETCH_ROWS;
    if (a >= ctx) return;
    const char *p = (const char *)(pool + ((int64_t)tbl[a / BS] * BS + a % BS) * row);
    for (int64_t i = 0; i < row * (int64_t)sizeof(float); i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* q: (B, Hq, D), already multiplied by the softmax scale. out: (B, Hq, D).
 * tables: (B, W) int32. ctxs: (B,) int32, each >= 1. scratch: at least Hq * max(ctxs) floats. */
void kvfleet_paged_decode_f32(const float *restrict q, const float *restrict k_pool, const float *restrict v_pool,
                              const int32_t *restrict tables, int64_t W, const int32_t *restrict ctxs, int64_t B,
                              int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, float *restrict out,
                              float *restrict scratch) {
    const int64_t G = Hq / Hkv;
    const int64_t row = Hkv * D; /* floats between one token's K (or V) and the next's */
    for (int64_t b = 0; b < B; b++) {
        const int64_t ctx = ctxs[b];
        const int32_t *tbl = tables + b * W;
        const float *qb = q + b * Hq * D; /* Hq rows of D; those of KV head h start at h * G */
        float *s = scratch;               /* Hq rows of ctx */
        /* One pass over the context's keys, each token's row (all KV heads) read once, in order. */
        for (int64_t t = 0; t < ctx; t++) {
            const float *k = k_pool + ((int64_t)tbl[t / BS] * BS + t % BS) * row;
            prefetch_ahead(k_pool, tbl, t, ctx, BS, row);
            for (int64_t h = 0; h < Hkv; h++) scores(qb + h * G * D, k + h * D, G, D, s + h * G * ctx + t, ctx);
        }
        for (int64_t r = 0; r < Hq; r++) {
            float *sr = s + r * ctx;
            float m = sr[0];
            for (int64_t t = 1; t < ctx; t++) m = sr[t] > m ? sr[t] : m;
            for (int64_t t = 0; t < ctx; t++) sr[t] = expf(sr[t] - m); /* vectorised (glibc's libmvec) */
            float total = 0.f;
            for (int64_t t = 0; t < ctx; t++) total += sr[t];
            const float inv = 1.f / total;
            for (int64_t t = 0; t < ctx; t++) sr[t] *= inv;
        }
        float *o = out + b * Hq * D;
        memset(o, 0, (size_t)(Hq * D) * sizeof(float));
        /* And one pass over the values, in the same order. */
        for (int64_t t = 0; t < ctx; t++) {
            const float *v = v_pool + ((int64_t)tbl[t / BS] * BS + t % BS) * row;
            prefetch_ahead(v_pool, tbl, t, ctx, BS, row);
            for (int64_t r = 0; r < Hq; r++) {
                const float p = s[r * ctx + t];
                const float *vh = v + (r / G) * D;
                float *orow = o + r * D;
                for (int64_t d = 0; d < D; d++) orow[d] += p * vh[d];
            }
        }
    }
}
