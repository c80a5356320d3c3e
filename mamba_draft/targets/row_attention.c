/* Row-exact attention for CPU targets: every query row's output is a function of that row's query and of the keys
 * and values it sees, in position order, and of nothing else: not of how many rows, keys or batch rows share the
 * call, not of where the visible keys sit among hidden ones, not of the thread that computes it, not of the SIMD
 * width the compiler picked.
 *
 * Why it holds: the arithmetic is a fixed sequence of IEEE-754 float operations per row (no -ffast-math, no
 * contraction: -ffp-contract=off, fused multiply-adds only where written as fmaf, which rounds once everywhere), and
 * every sum has a fixed association that depends only on the row's own visible keys:
 *   score_n = (16 lane partial sums over the head dimension, lane l holding d = l, l + 16, ..., in order, then
 *             folded 8, 4, 2, 1) * scale  [then softcap, then + the mask's bias]
 *   e_n     = exp_(score_n - max), a polynomial of fixed IEEE operations (the same bits vectorized or not)
 *   denom   = 16 lane partial sums of e_n, lane n mod 16 over the row's n-th visible key, folded as above (+ sink)
 *   out[d]  = (sum over n in order of fmaf(e_n, v_n[d], .)) / denom, rounded once to the output dtype.
 * The n-th visible key is counted among the row's visible keys only, so a tree node behind masked siblings and a
 * decoding step after the same committed tokens sum the same terms in the same order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };
enum { MASK_CAUSAL = 0, MASK_NONE = 1, MASK_BOOL = 2, MASK_F32 = 3 };
#define LANES 16

static void to_float(float *dst, const void *src, int64_t n, int dtype) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    } else {
        const _Float16 *s = (const _Float16 *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static void from_float(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {  /* round to nearest even, as torch's .to(torch.bfloat16) */
        const uint32_t *s = (const uint32_t *)src;
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = s[i];
            d[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                                   : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    } else {
        _Float16 *d = (_Float16 *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

static float fold(float *lanes) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    return lanes[0];
}

/* q and k hold `padded` floats (a multiple of LANES; zeros past the head dimension) */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline float dot(const float *q, const float *k, int padded) { /* the portable loop's operations, in registers */
    __m512 lanes = _mm512_setzero_ps();
    for (int c = 0; c < padded; c += LANES) lanes = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), lanes);
    /* fold's order: lane l + lane l + 8, then + 4, + 2, + 1 */
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
    const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    const __m128 pair = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}
#else
static float dot(const float *q, const float *k, int padded) {
    float lanes[LANES] = {0};
    for (int c = 0; c < padded; c += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = fmaf(q[c + l], k[c + l], lanes[l]);
    return fold(lanes);
}
#endif

/* e^x for x <= 0 (a score minus the row's max): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 7;
 * relative error ~1e-7; 0 below -87 (what it would add to a sum whose largest term is 1 is below float's reach) */
static void exp_nonpositive(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float t = v * 1.44269504f + 12582912.0f;  /* adding 1.5 * 2^23 rounds to an integer */
        float k = t - 12582912.0f;
        float r = fmaf(-k, 0.693145752f, v);
        r = fmaf(-k, 1.42860677e-6f, r);
        float p = 1.98412698e-4f;
        p = fmaf(p, r, 1.38888889e-3f);
        p = fmaf(p, r, 8.33333333e-3f);
        p = fmaf(p, r, 4.16666667e-2f);
        p = fmaf(p, r, 1.66666667e-1f);
        p = fmaf(p, r, 0.5f);
        p = fmaf(p, r, 1.0f);
        p = fmaf(p, r, 1.0f);
        union { uint32_t u; float f; } scale = {.u = (uint32_t)((int32_t)k + 127) << 23};
        x[i] = x[i] < -87.0f ? 0.0f : p * scale.f;
    }
}

typedef struct {
    const char *q, *k, *v;
    const char *mask;
    char *out;
    const float *sinks;
    int64_t qs[3], ks[3], vs[3], ms[3], os[3];  /* byte strides: (batch, head, row); mask (batch, row, key) */
    int batch, heads, kv_heads, queries, keys, dim, dtype, mask_kind;
    float scale, softcap;
} Call;

/* Rows (b, i) of heads [h0, h1), all of one key head: the keys each visible key converted once for them all */
static void rows(const Call *c, int b, int i, int h0, int h1, int *index, float *bias, float *scores, float *qf,
                 float *kf, float *acc) {
    const int padded = (c->dim + LANES - 1) / LANES * LANES;
    const int kvh = h0 / (c->heads / c->kv_heads), heads = h1 - h0;
    const char *mask = c->mask ? c->mask + b * c->ms[0] + i * c->ms[1] : NULL;
    int seen = 0;
    for (int j = 0; j < c->keys; j++) {
        float add = 0.0f;
        if (c->mask_kind == MASK_CAUSAL) {
            if (j > i) break;
        } else if (c->mask_kind == MASK_BOOL) {
            if (!mask[j * c->ms[2]]) continue;
        } else if (c->mask_kind == MASK_F32) {
            add = *(const float *)(mask + j * c->ms[2]);
            if (add <= -65504.0f) continue;  /* a hidden key: -inf or a dtype's lowest value (fp16: -65504) */
        }
        bias[seen] = add;
        index[seen++] = j;
    }
    for (int g = 0; g < heads; g++) {
        memset(qf + g * padded, 0, padded * sizeof(float));
        to_float(qf + g * padded, c->q + b * c->qs[0] + (h0 + g) * c->qs[1] + i * c->qs[2], c->dim, c->dtype);
    }
    memset(kf, 0, padded * sizeof(float));
    const char *keys = c->k + b * c->ks[0] + kvh * c->ks[1];
    const int in_place = c->dtype == F32 && c->dim == padded; /* fp32 rows of whole lanes: read where they lie */
    for (int n = 0; n < seen; n++) {
        const float *key = in_place ? (const float *)(keys + index[n] * c->ks[2]) : kf;
        if (!in_place) to_float(kf, keys + index[n] * c->ks[2], c->dim, c->dtype);
        for (int g = 0; g < heads; g++) scores[g * c->keys + n] = dot(qf + g * padded, key, padded) * c->scale;
        if (c->softcap > 0.0f)
            for (int g = 0; g < heads; g++)
                scores[g * c->keys + n] = c->softcap * tanhf(scores[g * c->keys + n] / c->softcap);
        for (int g = 0; g < heads; g++) scores[g * c->keys + n] += bias[n];
    }
    memset(acc, 0, (size_t)heads * padded * sizeof(float));
    float denom[64];
    for (int g = 0; g < heads; g++) {
        float *e = scores + g * c->keys, top = c->sinks ? c->sinks[h0 + g] : -INFINITY;
        float tops[LANES]; /* the max is the same in any order: by lanes, so that it vectorizes */
        for (int l = 0; l < LANES; l++) tops[l] = top;
        int n0 = 0;
        for (; n0 + LANES <= seen; n0 += LANES)
            for (int l = 0; l < LANES; l++) tops[l] = e[n0 + l] > tops[l] ? e[n0 + l] : tops[l];
        for (int n = n0; n < seen; n++) top = e[n] > top ? e[n] : top;
        for (int l = 0; l < LANES; l++) top = tops[l] > top ? tops[l] : top;
        for (int n = 0; n < seen; n++) e[n] -= top;
        exp_nonpositive(e, seen);
        float lanes[LANES] = {0};
        for (int n = 0; n < seen; n++) lanes[n % LANES] += e[n];
        denom[g] = fold(lanes);
        if (c->sinks) {
            float sink = c->sinks[h0 + g] - top;
            exp_nonpositive(&sink, 1);
            denom[g] += sink;
        }
    }
    const char *values = c->v + b * c->vs[0] + kvh * c->vs[1];
#if defined(__AVX512F__)
    if (in_place && padded % 64 == 0) { /* the same fused multiply-adds, each output's sum in a register over the keys */
        for (int g = 0; g < heads; g++)
            for (int c0 = 0; c0 < padded; c0 += 64) {
                __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
                for (int n = 0; n < seen; n++) {
                    const float *value = (const float *)(values + index[n] * c->vs[2]) + c0;
                    const __m512 p = _mm512_set1_ps(scores[g * c->keys + n]);
                    o0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(value), o0);
                    o1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16), o1);
                    o2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 32), o2);
                    o3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 48), o3);
                }
                float *o = acc + g * padded + c0;
                _mm512_storeu_ps(o, o0), _mm512_storeu_ps(o + 16, o1);
                _mm512_storeu_ps(o + 32, o2), _mm512_storeu_ps(o + 48, o3);
            }
    } else
#endif
    for (int n = 0; n < seen; n++) {
        const float *value = in_place ? (const float *)(values + index[n] * c->vs[2]) : kf;
        if (!in_place) to_float(kf, values + index[n] * c->vs[2], c->dim, c->dtype);
        for (int g = 0; g < heads; g++) {
            const float p = scores[g * c->keys + n];
            float *o = acc + g * padded;
            for (int d = 0; d < c->dim; d++) o[d] = fmaf(p, value[d], o[d]);
        }
    }
    for (int g = 0; g < heads; g++) {
        float *o = acc + g * padded;
        for (int d = 0; d < c->dim; d++) o[d] = seen ? o[d] / denom[g] : 0.0f;
        from_float(c->out + b * c->os[0] + (h0 + g) * c->os[1] + i * c->os[2], o, c->dim, c->dtype);
    }
}

/* One call over (batch, heads, queries): tasks are (b, i, key head) with that key head's query heads together, or
 * single query heads (`split`) when there are too few tasks to keep `threads` busy; both give the same bits. */
int row_attention(const void *q, const int64_t *q_strides, const void *k, const int64_t *k_strides, const void *v,
                  const int64_t *v_strides, const void *mask, const int64_t *mask_strides, int mask_kind, void *out,
                  const int64_t *out_strides, const float *sinks, int batch, int heads, int kv_heads, int queries,
                  int keys, int dim, int dtype, float scale, float softcap, int split, int threads) {
    if (kv_heads < 1 || heads % kv_heads || heads / kv_heads > 64 || dim < 1) return 1;
    Call c = {(const char *)q, (const char *)k, (const char *)v, (const char *)mask, (char *)out, sinks,
              {0}, {0}, {0}, {0}, {0}, batch, heads, kv_heads, queries, keys, dim, dtype, mask_kind, scale, softcap};
    const int size = dtype == F32 ? 4 : 2;
    for (int a = 0; a < 3; a++) {
        c.qs[a] = q_strides[a] * size, c.ks[a] = k_strides[a] * size, c.vs[a] = v_strides[a] * size;
        c.os[a] = out_strides[a] * size;
        c.ms[a] = mask ? mask_strides[a] * (mask_kind == MASK_F32 ? 4 : 1) : 0;
    }
    const int group = heads / kv_heads, per_task = split ? 1 : group;
    const int64_t tasks = (int64_t)batch * queries * (heads / per_task);
    const int padded = (dim + LANES - 1) / LANES * LANES;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int *index = malloc((size_t)(keys + 1) * sizeof(int));
        float *bias = malloc((size_t)(keys + 1) * sizeof(float));
        float *scores = malloc((size_t)per_task * (keys + 1) * sizeof(float));
        float *qf = malloc((size_t)per_task * padded * sizeof(float));
        float *kf = malloc((size_t)padded * sizeof(float));
        float *acc = malloc((size_t)per_task * padded * sizeof(float));
        const int ready = index && bias && scores && qf && kf && acc;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t unit = t % (heads / per_task), row = t / (heads / per_task);
            const int h0 = (int)unit * per_task;
            if (ready)
                rows(&c, (int)(row / queries), (int)(row % queries), h0, h0 + per_task, index, bias, scores, qf, kf,
                     acc);
            else
                failed = 1;
        }
        free(index), free(bias), free(scores), free(qf), free(kf), free(acc);
    }
    return failed ? 2 : 0;
}
