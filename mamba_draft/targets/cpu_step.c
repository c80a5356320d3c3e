/* The compiled CPU step of a Llama-family target: one call runs a decoding step or a tree's verification (any rows
 * of any batch) through every layer, over the engine's static KV cache, with no Python between the operations.
 *
 * Exact by construction, as the row attention it includes: every value of a row is a fixed sequence of IEEE-754
 * float operations on that row's own inputs (and, in attention, on the keys it sees, in position order), so a
 * token's logits are the same bits however many rows share the call. A product's output is one sequential sum of
 * fused multiply-adds in k order (`linear`): no library picks a kernel by shape, and a fused multiply-add rounds once
 * on every CPU, so the bits do not depend on the SIMD width either.
 *
 * The arithmetic follows transformers' modules (LlamaRMSNorm, rotary embedding, SiLU gate, residuals) in fp32 and
 * rounds to the model's dtype where they do (every module's output, each product of the rotary embedding), so a
 * bf16 model computes what its eager forward computes up to the order of its sums.
 */
#include "row_attention.c"

#define BLOCK 4 /* rows that share one pass over a block of weights */

typedef struct {
    const void *input_norm, *q, *k, *v, *q_bias, *k_bias, *v_bias, *o, *o_bias;
    const void *post_norm, *gate, *up, *down;
    void *keys, *values; /* the layer's cache: (batch, kv heads, slots, head dim) in the model's dtype */
} Layer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab, tokens, dtype, slots; /* tokens: embedding rows */
    float eps, scale;
    const void *embed, *norm, *head;
    const Layer *layer;
} Model;

static inline float to_dtype(float v, int dtype) {
    if (dtype == F32) return v;
    if (dtype == F16) return (float)(_Float16)v;
    union { float f; uint32_t u; } x = {.f = v};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return v; /* NaN */
    x.u = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) & 0xffff0000u;
    return x.f;
}

static inline float element(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == F16) return (float)((const _Float16 *)p)[i];
    union { uint32_t u; float f; } x = {.u = (uint32_t)((const uint16_t *)p)[i] << 16};
    return x.f;
}

/* 16 float lanes (16 output columns) and the operations a product needs; every variant computes the same bits
 * (fmaf and the fused multiply-add instructions both round once) */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef struct { __m512 a; } Lanes;
static inline Lanes zero(void) { return (Lanes){_mm512_setzero_ps()}; }
static inline Lanes load(const float *p) { return (Lanes){_mm512_loadu_ps(p)}; }
static inline Lanes load_bf16(const uint16_t *p) {
    return (Lanes){_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)),
                                                         16))};
}
static inline Lanes fma_one(float x, Lanes w, Lanes acc) { return (Lanes){_mm512_fmadd_ps(_mm512_set1_ps(x), w.a, acc.a)}; }
static inline void unload(float *p, Lanes v) { _mm512_storeu_ps(p, v.a); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef struct { __m256 lo, hi; } Lanes;
static inline Lanes zero(void) { return (Lanes){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline Lanes load(const float *p) { return (Lanes){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __m256 widen(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}
static inline Lanes load_bf16(const uint16_t *p) { return (Lanes){widen(p), widen(p + 8)}; }
static inline Lanes fma_one(float x, Lanes w, Lanes acc) {
    const __m256 b = _mm256_set1_ps(x);
    return (Lanes){_mm256_fmadd_ps(b, w.lo, acc.lo), _mm256_fmadd_ps(b, w.hi, acc.hi)};
}
static inline void unload(float *p, Lanes v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
#else
typedef struct { float f[LANES]; } Lanes;
static inline Lanes zero(void) { return (Lanes){{0}}; }
static inline Lanes load(const float *p) { Lanes v; memcpy(v.f, p, sizeof v.f); return v; }
static inline Lanes load_bf16(const uint16_t *p) {
    Lanes v;
    for (int l = 0; l < LANES; l++) { union { uint32_t u; float f; } b = {.u = (uint32_t)p[l] << 16}; v.f[l] = b.f; }
    return v;
}
static inline Lanes fma_one(float x, Lanes w, Lanes acc) {
    for (int l = 0; l < LANES; l++) acc.f[l] = fmaf(x, w.f[l], acc.f[l]);
    return acc;
}
static inline void unload(float *p, Lanes v) { memcpy(p, v.f, sizeof v.f); }
#endif

static inline Lanes load_weights(const void *w, int64_t at, int dtype) {
    if (dtype == BF16) return load_bf16((const uint16_t *)w + at);
    if (dtype == F32) return load((const float *)w + at);
    float f[LANES];
    for (int l = 0; l < LANES; l++) f[l] = (float)((const _Float16 *)w)[at + l];
    return load(f);
}

/* out[m * stride + n] = dtype(x[m] . w[n] + bias[n]) for m < rows, n < outs; x (rows, inner) fp32; w the weight
 * (outs, inner) packed by blocks of 16 rows, column-major within a block: w[n] [k] at ((n / 16) * inner + k) * 16 +
 * n % 16 (`CpuStep.pack`). Each output is one sequential sum of fused multiply-adds over k = 0, 1, ..., inner - 1
 * from zero, plus the bias, rounded once to the dtype: the same sequence however many rows share the product. The
 * 16 outputs of a block share each weight load, BLOCK rows share it too. */
static void linear(const float *x, int rows, int inner, const void *w, const void *bias, int outs, float *out,
                   int64_t stride, int dtype, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int block = 0; block < outs / LANES; block++) {
        const int64_t base = (int64_t)block * inner * LANES;
        float bias_block[LANES], result[LANES];
        for (int l = 0; l < LANES; l++) bias_block[l] = bias ? element(bias, block * LANES + l, dtype) : 0.0f;
        for (int m0 = 0; m0 < rows; m0 += BLOCK) {
            const int count = rows - m0 < BLOCK ? rows - m0 : BLOCK;
            const float *xr = x + (int64_t)m0 * inner;
            Lanes acc[BLOCK] = {zero(), zero(), zero(), zero()};
            if (count == BLOCK) {
                for (int k = 0; k < inner; k++) {
                    const Lanes wv = load_weights(w, base + (int64_t)k * LANES, dtype);
                    acc[0] = fma_one(xr[k], wv, acc[0]);
                    acc[1] = fma_one(xr[inner + k], wv, acc[1]);
                    acc[2] = fma_one(xr[2 * inner + k], wv, acc[2]);
                    acc[3] = fma_one(xr[3 * inner + k], wv, acc[3]);
                }
            } else {
                for (int k = 0; k < inner; k++) {
                    const Lanes wv = load_weights(w, base + (int64_t)k * LANES, dtype);
                    for (int j = 0; j < count; j++) acc[j] = fma_one(xr[(int64_t)j * inner + k], wv, acc[j]);
                }
            }
            for (int j = 0; j < count; j++) {
                unload(result, acc[j]);
                float *o = out + (int64_t)(m0 + j) * stride + block * LANES;
                for (int l = 0; l < LANES; l++) o[l] = to_dtype(result[l] + bias_block[l], dtype);
            }
        }
    }
}

/* LlamaRMSNorm: dtype(weight * dtype(x * 1 / sqrt(mean(x^2) + eps))) */
static void rms_norm(const float *x, int rows, int width, const void *weight, float eps, float *out, int dtype) {
    for (int m = 0; m < rows; m++) {
        const float *xr = x + (int64_t)m * width;
        float lanes[LANES] = {0};
        for (int c = 0; c < width; c += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] = fmaf(xr[c + l], xr[c + l], lanes[l]);
        const float inverse = 1.0f / sqrtf(fold(lanes) / (float)width + eps);
        for (int d = 0; d < width; d++)
            out[(int64_t)m * width + d] = to_dtype(element(weight, d, dtype) * to_dtype(xr[d] * inverse, dtype), dtype);
    }
}

/* q * cos + rotate_half(q) * sin, each product and the sum rounded to the dtype, for `count` heads of one row */
static void rotate(float *x, int count, int dim, const float *cos, const float *sin, int dtype) {
    const int half = dim / 2;
    float turned[256];
    for (int h = 0; h < count; h++) {
        float *v = x + h * dim;
        for (int d = 0; d < dim; d++) turned[d] = d < half ? -v[d + half] : v[d - half];
        for (int d = 0; d < dim; d++)
            v[d] = to_dtype(to_dtype(v[d] * cos[d], dtype) + to_dtype(turned[d] * sin[d], dtype), dtype);
    }
}

/* x * sigmoid(x) = x / (1 + e^-x), with e^-|x| from the kernel's own exp (the same bits everywhere) */
static float silu(float x) {
    float e = -fabsf(x);
    exp_nonpositive(&e, 1);
    return x >= 0.0f ? x / (1.0f + e) : x * e / (1.0f + e);
}

/* element i of a dtype array := v (row_attention.c's conversion, which rounds to nearest even) */
static inline void store(void *dst, int64_t i, float v, int dtype) {
    from_float((char *)dst + i * (dtype == F32 ? 4 : 2), &v, 1, dtype);
}

/* ids: (batch, n) tokens; cos, sin: their rotary tables (batch, n, head dim) as fp32; write: the n cache slots the
 * new keys go to (the same for every row); mask: visibility (batch, n, keys) with its strides in bytes; keys: the
 * slots attention reads. Writes logits (batch * n, vocab) as fp32 holding dtype values and, if not NULL, the final
 * normed states (batch * n, hidden) likewise. work: `cpu_step_work(model, batch * n)` floats. */
int cpu_step_forward(const Model *m, int batch, int n, const int64_t *ids, const float *cos, const float *sin,
                     const int64_t *write, const uint8_t *mask, const int64_t *mask_strides, int keys, float *logits,
                     float *states, float *work, int threads) {
    const int rows = batch * n, H = m->hidden, D = m->head_dim, I = m->inter, dtype = m->dtype;
    const int qw = m->heads * D, kw = m->kv_heads * D, wide = H > qw ? H : qw;
    if (D > 256 || D % 2 || H % LANES || qw % LANES || kw % LANES || I % LANES || m->vocab % LANES ||
        keys > m->slots)
        return 1;
    for (int r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= m->tokens) return 3;
    for (int t = 0; t < n; t++)
        if (write[t] < 0 || write[t] >= keys) return 4;
    float *h = work, *x = h + (int64_t)rows * H, *y = x + (int64_t)rows * wide, *q = y + (int64_t)rows * H;
    float *k = q + (int64_t)rows * qw, *v = k + (int64_t)rows * kw;
    float *gate = v + (int64_t)rows * kw, *up = gate + (int64_t)rows * I;
    char *q_cast = (char *)(up + (int64_t)rows * I), *out_cast = q_cast + (int64_t)rows * qw * 4;
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < H; d++) h[(int64_t)r * H + d] = element(m->embed, ids[r] * H + d, dtype);
    const int64_t q_strides[3] = {(int64_t)n * qw, D, qw}; /* (batch, head, row), elements */
    const int64_t kv_strides[3] = {(int64_t)m->kv_heads * m->slots * D, (int64_t)m->slots * D, D};
    const int split = batch * n * m->kv_heads < 2 * threads; /* one query head per task: the same bits */
    for (int i = 0; i < m->layers; i++) {
        const Layer *L = m->layer + i;
        rms_norm(h, rows, H, L->input_norm, m->eps, x, dtype);
        linear(x, rows, H, L->q, L->q_bias, qw, q, qw, dtype, threads);
        linear(x, rows, H, L->k, L->k_bias, kw, k, kw, dtype, threads);
        linear(x, rows, H, L->v, L->v_bias, kw, v, kw, dtype, threads);
        for (int r = 0; r < rows; r++) {
            const int b = r / n, t = r % n;
            rotate(q + (int64_t)r * qw, m->heads, D, cos + (int64_t)r * D, sin + (int64_t)r * D, dtype);
            rotate(k + (int64_t)r * kw, m->kv_heads, D, cos + (int64_t)r * D, sin + (int64_t)r * D, dtype);
            for (int j = 0; j < qw; j++) store(q_cast, (int64_t)r * qw + j, q[(int64_t)r * qw + j], dtype);
            for (int g = 0; g < m->kv_heads; g++)
                for (int d = 0; d < D; d++) {
                    const int64_t slot = (((int64_t)b * m->kv_heads + g) * m->slots + write[t]) * D + d;
                    store(L->keys, slot, k[(int64_t)r * kw + g * D + d], dtype);
                    store(L->values, slot, v[(int64_t)r * kw + g * D + d], dtype);
                }
        }
        if (row_attention(q_cast, q_strides, L->keys, kv_strides, L->values, kv_strides, mask, mask_strides,
                          MASK_BOOL, out_cast, q_strides, NULL, batch, m->heads, m->kv_heads, n, keys, D, dtype,
                          m->scale, 0.0f, split, threads))
            return 2;
        for (int64_t j = 0; j < (int64_t)rows * qw; j++) x[j] = element(out_cast, j, dtype);
        linear(x, rows, qw, L->o, L->o_bias, H, y, H, dtype, threads);
        for (int64_t j = 0; j < (int64_t)rows * H; j++) h[j] = to_dtype(h[j] + y[j], dtype);
        rms_norm(h, rows, H, L->post_norm, m->eps, x, dtype);
        linear(x, rows, H, L->gate, NULL, I, gate, I, dtype, threads);
        linear(x, rows, H, L->up, NULL, I, up, I, dtype, threads);
        for (int64_t j = 0; j < (int64_t)rows * I; j++) gate[j] = to_dtype(to_dtype(silu(gate[j]), dtype) * up[j], dtype);
        linear(gate, rows, I, L->down, NULL, H, y, H, dtype, threads);
        for (int64_t j = 0; j < (int64_t)rows * H; j++) h[j] = to_dtype(h[j] + y[j], dtype);
    }
    rms_norm(h, rows, H, m->norm, m->eps, x, dtype);
    if (states) memcpy(states, x, (size_t)rows * H * sizeof(float));
    linear(x, rows, H, m->head, NULL, m->vocab, logits, m->vocab, dtype, threads);
    return 0;
}

/* floats of work space a call over `rows` rows needs */
int64_t cpu_step_work(const Model *m, int rows) {
    const int64_t qw = (int64_t)m->heads * m->head_dim, kw = (int64_t)m->kv_heads * m->head_dim;
    const int64_t wide = m->hidden > qw ? m->hidden : qw;
    return (int64_t)rows * (2 * m->hidden + wide + 3 * qw + 2 * kw + 2 * (int64_t)m->inter);
}
