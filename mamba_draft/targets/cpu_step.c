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
#define GROUP 32 /* inputs that share a scale in a coded weight */

/* A product's weight: `codes` 0, the model's dtype packed by blocks of 16 output rows (`linear`); 16, the same in
 * bf16 (a float32 model's bf16 values); 4 or 8, the blocks split into tiles of GROUP inputs, each tile 16 fp32
 * scales, for 4-bit codes 16 fp32 offsets, then GROUP x 16 codes (input-major): weight = dtype(scale * code +
 * offset), the exact values the model holds (`encode` checks every one). A float16 scale times a code of at most 8
 * bits is exact in fp32 (at most 19 significant bits), so one fused multiply-add rounds as the product and the sum
 * rounded apart do. 4-bit: byte j of an input's 8 holds output j (low nibble) and j + 8. 8-bit: signed, no offset.
 * A GGUF's Q4_1 / Q8_0 weights dequantize to such values, so they cost their file's bytes. */
typedef struct { const void *data; int codes, integer; } Weight; /* integer: the tiles of `int_products.c` */

static inline int tile_bytes(int codes) {
    return codes == 4 ? 2 * LANES * 4 + GROUP * LANES / 2 : LANES * 4 + GROUP * LANES;
}

typedef struct {
    const void *input_norm;
    Weight q, k, v;
    const void *q_bias, *k_bias, *v_bias;
    Weight o;
    const void *o_bias, *post_norm;
    Weight gate, up, down;
    void *keys, *values; /* the layer's cache: (batch, kv heads, slots, head dim) in the model's dtype */
} Layer;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab, tokens, dtype, slots; /* tokens: embedding rows */
    float eps, scale;
    const void *embed, *norm;
    Weight head;
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
static inline Lanes scaled(Lanes q, Lanes d, Lanes m) { return (Lanes){_mm512_fmadd_ps(d.a, q.a, m.a)}; }
#define IN_REGISTERS(w) __asm__("" : "+v"((w).a)) /* one load for the rows' FMAs, not one folded into each */
static inline Lanes codes4(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const void *)p), low = _mm_set1_epi8(0x0f);
    const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    return (Lanes){_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both))};
}
static inline Lanes codes8(const uint8_t *p) {
    return (Lanes){_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)))};
}
static inline Lanes round_bf16(Lanes v) { /* to nearest even; the checked weights hold no NaN */
    const __m512i u = _mm512_castps_si512(v.a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return (Lanes){_mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32((int)0xffff0000u)))};
}
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
static inline Lanes scaled(Lanes q, Lanes d, Lanes m) {
    return (Lanes){_mm256_fmadd_ps(d.lo, q.lo, m.lo), _mm256_fmadd_ps(d.hi, q.hi, m.hi)};
}
#define IN_REGISTERS(w) __asm__("" : "+x"((w).lo), "+x"((w).hi))
static inline Lanes codes4(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const void *)p), low = _mm_set1_epi8(0x0f);
    return (Lanes){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, low))),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)))};
}
static inline Lanes codes8(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const void *)p);
    return (Lanes){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
static inline __m256 round_half(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline Lanes round_bf16(Lanes v) { return (Lanes){round_half(v.lo), round_half(v.hi)}; } /* no NaN here */
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
#define IN_REGISTERS(w) ((void)0)
static inline Lanes scaled(Lanes q, Lanes d, Lanes m) {
    for (int l = 0; l < LANES; l++) q.f[l] = fmaf(d.f[l], q.f[l], m.f[l]);
    return q;
}
static inline Lanes codes4(const uint8_t *p) {
    Lanes v;
    for (int l = 0; l < LANES / 2; l++) v.f[l] = (float)(p[l] & 15), v.f[l + LANES / 2] = (float)(p[l] >> 4);
    return v;
}
static inline Lanes codes8(const uint8_t *p) {
    Lanes v;
    for (int l = 0; l < LANES; l++) v.f[l] = (float)(int8_t)p[l];
    return v;
}
static inline Lanes round_bf16(Lanes v) {
    for (int l = 0; l < LANES; l++) v.f[l] = to_dtype(v.f[l], BF16);
    return v;
}
#endif

static inline Lanes load_weights(const void *w, int64_t at, int dtype) {
    if (dtype == BF16) return load_bf16((const uint16_t *)w + at);
    if (dtype == F32) return load((const float *)w + at);
    float f[LANES];
    for (int l = 0; l < LANES; l++) f[l] = (float)((const _Float16 *)w)[at + l];
    return load(f);
}

/* 16 weights of a coded tile: input kk's, all 16 outputs */
static inline __attribute__((always_inline)) Lanes decoded(const uint8_t *tile, int codes, int kk, Lanes d, Lanes m,
                                                           int bf16) {
    const Lanes w = codes == 4 ? scaled(codes4(tile + 2 * LANES * 4 + kk * LANES / 2), d, m)
                               : scaled(codes8(tile + LANES * 4 + kk * LANES), d, zero());
    return bf16 ? round_bf16(w) : w; /* a bf16 model holds the products rounded */
}

/* acc[j] += x[j] . w over all inputs, for count <= BLOCK rows of x (stride inner), from a block's coded tiles; the
 * sums live in registers (a constant count unrolls the row loop), not in `acc`, which may alias x */
static inline __attribute__((always_inline)) void coded_rows(const uint8_t *tiles, int codes, int bf16, int inner,
                                                             const float *x, int count, Lanes *acc) {
    const int bytes = tile_bytes(codes);
    Lanes s[BLOCK] = {acc[0], acc[1], acc[2], acc[3]};
    for (int g = 0; g < inner / GROUP; g++) {
        const uint8_t *tile = tiles + (int64_t)g * bytes;
        const Lanes d = load((const float *)tile), m = codes == 4 ? load((const float *)tile + LANES) : zero();
        const float *xg = x + g * GROUP;
        for (int kk = 0; kk < GROUP; kk++) {
            const Lanes w = decoded(tile, codes, kk, d, m, bf16);
            for (int j = 0; j < count; j++) s[j] = fma_one(xg[(int64_t)j * inner + kk], w, s[j]);
        }
    }
    for (int j = 0; j < count; j++) acc[j] = s[j];
}

#define CODED_ROWS(count)                                                                                 \
    (codes == 4 ? (bf16 ? coded_rows(tiles, 4, 1, inner, x, count, acc)                                    \
                        : coded_rows(tiles, 4, 0, inner, x, count, acc))                                   \
                : (bf16 ? coded_rows(tiles, 8, 1, inner, x, count, acc)                                    \
                        : coded_rows(tiles, 8, 0, inner, x, count, acc)))

static void coded_block(const uint8_t *tiles, int codes, int bf16, int inner, const float *x, int count, Lanes *acc) {
    switch (count) {
    case 1: CODED_ROWS(1); break;
    case 2: CODED_ROWS(2); break;
    case 3: CODED_ROWS(3); break;
    default: CODED_ROWS(4);
    }
}

/* s[j] += x[j * inner + k] * w_k for k < steps and j < count (<= BLOCK), in k order: w_k the 16 lanes at w[at + k *
 * 16] in `weight_dtype` (a column-major block); one load of w_k feeds every row's fused multiply-add */
static inline __attribute__((always_inline)) void accumulate(const void *w, int64_t at, int weight_dtype, int steps,
                                                             const float *x, int inner, int count, Lanes *s) {
    if (count == BLOCK) { /* four sums in registers */
        Lanes s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
        for (int k = 0; k < steps; k++) {
            Lanes wk = load_weights(w, at + (int64_t)k * LANES, weight_dtype);
            IN_REGISTERS(wk);
            s0 = fma_one(x[k], wk, s0);
            s1 = fma_one(x[inner + k], wk, s1);
            s2 = fma_one(x[2 * inner + k], wk, s2);
            s3 = fma_one(x[3 * inner + k], wk, s3);
        }
        s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
    } else {
        for (int k = 0; k < steps; k++) {
            const Lanes wk = load_weights(w, at + (int64_t)k * LANES, weight_dtype);
            for (int j = 0; j < count; j++) s[j] = fma_one(x[(int64_t)j * inner + k], wk, s[j]);
        }
    }
}

/* out[l] = dtype(sum[l] + bias[l]) for a block's 16 outputs of one row */
static inline void emit(float *out, const float *sum, const float *bias, int dtype) {
    for (int l = 0; l < LANES; l++) out[l] = to_dtype(sum[l] + bias[l], dtype);
}

/* acc[m] (16 lanes each) += x[m] . w over all inputs, for any rows: each tile decoded once into `tile_values`
 * (GROUP x 16 floats, in L1), then every row's sum carried on over its 32 inputs, in k order as `coded_rows` */
static void coded_many(const uint8_t *tiles, int codes, int bf16, int inner, const float *x, int rows, float *acc,
                       float *tile_values) {
    const int bytes = tile_bytes(codes);
    for (int g = 0; g < inner / GROUP; g++) {
        const uint8_t *tile = tiles + (int64_t)g * bytes;
        const Lanes d = load((const float *)tile), m = codes == 4 ? load((const float *)tile + LANES) : zero();
        for (int kk = 0; kk < GROUP; kk++) unload(tile_values + kk * LANES, decoded(tile, codes, kk, d, m, bf16));
        for (int m0 = 0; m0 < rows; m0 += BLOCK) {
            const int count = rows - m0 < BLOCK ? rows - m0 : BLOCK;
            float *a = acc + (int64_t)m0 * LANES;
            Lanes s[BLOCK];
            for (int j = 0; j < count; j++) s[j] = load(a + j * LANES);
            accumulate(tile_values, 0, F32, GROUP, x + (int64_t)m0 * inner + g * GROUP, inner, count, s);
            for (int j = 0; j < count; j++) unload(a + j * LANES, s[j]);
        }
    }
}

#include "int_products.c"

/* out[m * stride + n] = dtype(x[m] . w[n] + bias[n]) for m < rows, n < outs; x (rows, inner) fp32; w the weight
 * (outs, inner) by blocks of 16 output rows (`Weight`); plain: column-major within a block, w[n] [k] at
 * ((n / 16) * inner + k) * 16 + n % 16 (`CpuStep.pack`). Each output is one sequential sum of fused multiply-adds
 * over k = 0, 1, ..., inner - 1 from zero, plus the bias, rounded once to the dtype: the same sequence however many
 * rows share the product, and whether the weight is coded or not. The 16 outputs of a block share each weight load,
 * BLOCK rows share it too; a coded tile is decoded once for a call of more rows (`coded_many`). */
static void linear(const float *x, int rows, int inner, Weight w, const void *bias, int outs, float *out,
                   int64_t stride, int dtype, int threads) {
    if (w.integer) {
        int_linear(x, rows, inner, w, bias, outs, out, stride, dtype, threads);
        return;
    }
    const int bf16 = dtype == BF16, weight_dtype = w.codes == 16 ? BF16 : dtype;
    if (w.codes == 16) w.codes = 0;
#pragma omp parallel num_threads(threads)
    {
        /* many rows of a coded weight: every row's 16 sums, and one decoded tile */
        float *sums = w.codes && rows > BLOCK ? malloc(((size_t)rows + GROUP) * LANES * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int block = 0; block < outs / LANES; block++) {
            const uint8_t *tiles =
                w.codes ? (const uint8_t *)w.data + (int64_t)block * (inner / GROUP) * tile_bytes(w.codes) : NULL;
            float bias_block[LANES], result[LANES];
            for (int l = 0; l < LANES; l++) bias_block[l] = bias ? element(bias, block * LANES + l, dtype) : 0.0f;
            if (sums) {
                memset(sums, 0, (size_t)rows * LANES * sizeof(float));
                coded_many(tiles, w.codes, bf16, inner, x, rows, sums, sums + (int64_t)rows * LANES);
                for (int r = 0; r < rows; r++)
                    emit(out + (int64_t)r * stride + block * LANES, sums + (int64_t)r * LANES, bias_block, dtype);
                continue;
            }
            for (int m0 = 0; m0 < rows; m0 += BLOCK) {
                const int count = rows - m0 < BLOCK ? rows - m0 : BLOCK;
                const float *xr = x + (int64_t)m0 * inner;
                Lanes acc[BLOCK] = {zero(), zero(), zero(), zero()};
                if (w.codes)
                    coded_block(tiles, w.codes, bf16, inner, xr, count, acc);
                else
                    accumulate(w.data, (int64_t)block * inner * LANES, weight_dtype, inner, xr, inner, count, acc);
                for (int j = 0; j < count; j++) {
                    unload(result, acc[j]);
                    emit(out + (int64_t)(m0 + j) * stride + block * LANES, result, bias_block, dtype);
                }
            }
        }
        free(sums);
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

/* gate := dtype(dtype(silu(gate)) * up) over `count` values; silu(x) = x * sigmoid(x) = x / (1 + e^-x), with e^-|x|
 * from the kernel's own exp (the same bits everywhere), computed by chunks so that its loop vectorizes */
static void gated(float *gate, const float *up, int64_t count, int dtype, int threads) {
    enum { CHUNK = 256 };
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= 8 * CHUNK)
    for (int64_t c = 0; c < count; c += CHUNK) {
        const int len = count - c < CHUNK ? (int)(count - c) : CHUNK;
        float e[CHUNK];
        for (int j = 0; j < len; j++) e[j] = -fabsf(gate[c + j]);
        exp_nonpositive(e, len);
        for (int j = 0; j < len; j++) {
            const float x = gate[c + j], silu = x >= 0.0f ? x / (1.0f + e[j]) : x * e[j] / (1.0f + e[j]);
            gate[c + j] = to_dtype(to_dtype(silu, dtype) * up[c + j], dtype);
        }
    }
}

/* element i of a dtype array := v (row_attention.c's conversion, which rounds to nearest even) */
static inline void store(void *dst, int64_t i, float v, int dtype) {
    if (dtype == F32)
        ((float *)dst)[i] = v;
    else
        from_float((char *)dst + i * 2, &v, 1, dtype);
}

/* ids: (batch, n) tokens; cos, sin: their rotary tables (batch, n, head dim) as fp32; write: the n cache slots the
 * new keys go to (the same for every row); mask: visibility (batch, n, keys) with its strides in bytes; keys: the
 * slots attention reads. Writes logits (batch * n, vocab), or with `last` only each row's last token's (batch, vocab),
 * as fp32 holding dtype values and, if not NULL, the final
 * normed states (batch * n, hidden) likewise. work: `cpu_step_work(model, batch * n)` floats. */
int cpu_step_forward(const Model *m, int batch, int n, const int64_t *ids, const float *cos, const float *sin,
                     const int64_t *write, const uint8_t *mask, const int64_t *mask_strides, int keys, int last,
                     float *logits, float *states, float *work, int threads) {
    const int rows = batch * n, H = m->hidden, D = m->head_dim, I = m->inter, dtype = m->dtype;
    const int qw = m->heads * D, kw = m->kv_heads * D, wide = H > qw ? H : qw;
    if (D > 256 || D % 2 || H % LANES || qw % LANES || kw % LANES || I % LANES || m->vocab % LANES ||
        keys > m->slots)
        return 1;
    for (int i = 0; i < m->layers; i++) { /* a coded weight's inputs come in whole tiles */
        const Layer *L = m->layer + i;
        if (((L->q.codes || L->k.codes || L->v.codes || L->gate.codes || L->up.codes) && H % GROUP) ||
            (L->o.codes && qw % GROUP) || (L->down.codes && I % GROUP))
            return 1;
    }
    if (m->head.codes && H % GROUP) return 1;
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
        to_float(x, out_cast, (int64_t)rows * qw, dtype);
        linear(x, rows, qw, L->o, L->o_bias, H, y, H, dtype, threads);
        for (int64_t j = 0; j < (int64_t)rows * H; j++) h[j] = to_dtype(h[j] + y[j], dtype);
        rms_norm(h, rows, H, L->post_norm, m->eps, x, dtype);
        linear(x, rows, H, L->gate, NULL, I, gate, I, dtype, threads);
        linear(x, rows, H, L->up, NULL, I, up, I, dtype, threads);
        gated(gate, up, (int64_t)rows * I, dtype, threads);
        linear(gate, rows, I, L->down, NULL, H, y, H, dtype, threads);
        for (int64_t j = 0; j < (int64_t)rows * H; j++) h[j] = to_dtype(h[j] + y[j], dtype);
    }
    rms_norm(h, rows, H, m->norm, m->eps, x, dtype);
    if (states) memcpy(states, x, (size_t)rows * H * sizeof(float));
    if (last) { /* a prefill: only each row's last token needs the head's products */
        for (int b = 0; b < batch; b++)
            memmove(x + (int64_t)b * H, x + ((int64_t)b * n + n - 1) * H, (size_t)H * sizeof(float));
    }
    linear(x, last ? batch : rows, H, m->head, NULL, m->vocab, logits, m->vocab, dtype, threads);
    return 0;
}

/* out (rows, outs) = dtype(x . w^T + bias), x (rows, inner) fp32: one product, as the step computes it (drafters'
 * few-row products; `mamba_draft.row_linear`) */
int cpu_linear(const float *x, int rows, int inner, const Weight *w, const void *bias, int outs, float *out,
               int dtype, int threads) {
    if (outs % LANES || ((w->codes == 4 || w->codes == 8 || w->integer) && inner % GROUP)) return 1;
    linear(x, rows, inner, *w, bias, outs, out, outs, dtype, threads);
    return 0;
}

/* floats of work space a call over `rows` rows needs */
int64_t cpu_step_work(const Model *m, int rows) {
    const int64_t qw = (int64_t)m->heads * m->head_dim, kw = (int64_t)m->kv_heads * m->head_dim;
    const int64_t wide = m->hidden > qw ? m->hidden : qw;
    return (int64_t)rows * (2 * m->hidden + wide + 3 * qw + 2 * kw + 2 * (int64_t)m->inter);
}

#include "drafter_step.c"
