/* Integer products, the numerics of llama.cpp on a GGUF's weights: a coded weight (4-bit codes with a scale and an
 * offset per group of 32 inputs, or signed 8-bit codes with a scale) is multiplied as its codes, and each row's
 * activations are quantized per group of 32 to signed 8-bit codes with a float scale (`quantize`):
 *
 *   out[m][n] = sum over groups g, in order, of   fma(isum, d_w[g][n] * d_x[m][g], .)   then, for 4-bit codes,
 *               fma(m_w[g][n], s_x[m][g], .)        isum = sum_k code_w[k][n] * code_x[m][k]  (an exact int32)
 *
 * Exact by construction, and the same bits on every CPU: an integer sum has no rounding and no order, so the AMX
 * tiles, the AVX512-VNNI and AVX2 dot products and the portable loop give the same `isum` for a row whatever rows
 * share the call; the float work is the same fixed sequence of multiplies and fused multiply-adds per output
 * (`Lanes`, which rounds once per operation on every instruction set). A row's bits depend on its own inputs only.
 *
 * The integer tile of a block of 16 outputs and a group of 32 inputs (`CpuStep.encode`, integer=True): 16 fp32
 * scales, for 4-bit codes 16 fp32 offsets, then the codes in dot-product order, byte (q * 64 + n * 4 + r) for output
 * n and input 4q + r: 4-bit codes packed two to a byte (q < 4; the low nibble input 4q + r, the high one 16 + 4q + r),
 * 8-bit codes stored plus 128 as unsigned bytes (q < 8). This is the layout of an AMX B tile and of VNNI's operand.
 */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) /* (every AMX CPU has it) */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#else
#define AMX 0
#endif

/* a row's activations quantized per group of 32: codes q (int8), per group the scale d, s = d * sum(q) and sum(q);
 * q = nearest-even(x * (1 / (max |x| / 127))), as the loop below computes it (the vector form: the same operations) */
static void quantize(const float *x, int rows, int inner, int8_t *q, float *d, float *s, int32_t *sum) {
    const int groups = inner / GROUP;
    for (int m = 0; m < rows; m++)
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (int64_t)m * inner + g * GROUP;
            int8_t *qg = q + (int64_t)m * inner + g * GROUP;
            int32_t total = 0;
            float scale;
#if defined(__AVX512F__)
            const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.0f;
            const __m512 inverse = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f), top = _mm512_set1_ps(127.0f);
            const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512i qa = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(
                _mm512_roundscale_ps(_mm512_mul_ps(a, inverse), rounding), top), _mm512_sub_ps(_mm512_setzero_ps(), top)));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(
                _mm512_roundscale_ps(_mm512_mul_ps(b, inverse), rounding), top), _mm512_sub_ps(_mm512_setzero_ps(), top)));
            _mm_storeu_si128((void *)qg, _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((void *)(qg + 16), _mm512_cvtepi32_epi8(qb));
            total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
            float amax = 0.0f;
            for (int k = 0; k < GROUP; k++) amax = fabsf(xg[k]) > amax ? fabsf(xg[k]) : amax;
            scale = amax / 127.0f;
            const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            for (int k = 0; k < GROUP; k++) {
                float v = nearbyintf(xg[k] * inverse); /* to nearest even */
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                qg[k] = (int8_t)v;
                total += qg[k];
            }
#endif
            const int64_t at = (int64_t)m * groups + g;
            d[at] = scale, sum[at] = total, s[at] = scale * (float)total;
        }
}

/* The 16 outputs' integer sums over one group: isum[n] = sum_k code_w[k][n] * code_x[k] (8-bit codes signed; VNNI
 * multiplies the stored code + 128 and takes 128 * sum(code_x), `sum_x`, off). `group_sums_rows`: of `count` rows
 * (x and sum_x `x_stride` / `sum_stride` apart), the block's codes decoded once; `group_sums`: of one row. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
typedef __m512i Sums;
#define ROWS_OF_SUMS 1
static inline void group_sums_rows(const uint8_t *codes, int bits, const int8_t *x, int64_t x_stride,
                                   const int32_t *sum_x, int64_t sum_stride, int count, Sums *out) {
    __m512i w[8];
    if (bits == 4) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int q = 0; q < 4; q++) {
            const __m512i packed = _mm512_loadu_si512((const void *)(codes + q * 64));
            w[q] = _mm512_and_si512(packed, low), w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
    } else {
        for (int q = 0; q < 8; q++) w[q] = _mm512_loadu_si512((const void *)(codes + q * 64));
    }
    for (int j = 0; j < count; j++) {
        const int8_t *xj = x + j * x_stride;
        __m512i s = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) { /* w[q] holds inputs 4q..4q+3 (4 bits: q < 4 the low nibbles, else the high) */
            int32_t xs;
            memcpy(&xs, xj + 4 * q, 4);
            s = _mm512_dpbusd_epi32(s, w[q], _mm512_set1_epi32(xs));
        }
        out[j] = bits == 8 ? _mm512_sub_epi32(s, _mm512_set1_epi32(128 * sum_x[j * sum_stride])) : s;
    }
}
static inline Lanes sums_to_lanes(Sums s) { return (Lanes){_mm512_cvtepi32_ps(s)}; }
#elif defined(__AVX2__)
typedef struct { __m256i lo, hi; } Sums; /* outputs 0-7, 8-15 */
/* 8 outputs' dot products over 4 inputs: u8 codes (at most 255) times s8 activations; maddubs's pairs stay below
 * 2^15 for 4-bit codes (2 * 15 * 127); 8-bit codes are first made signed and multiplied by sign (|w| <= 128) */
static inline __m256i dot4(__m256i w, int32_t xs, int bits) {
    __m256i x = _mm256_set1_epi32(xs);
    if (bits == 8) {
        w = _mm256_sub_epi8(w, _mm256_set1_epi8((char)0x80)); /* the signed code */
        x = _mm256_sign_epi8(x, w);
        w = _mm256_abs_epi8(w); /* -128 becomes 128, as an unsigned byte */
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
static inline Sums group_sums(const uint8_t *codes, int bits, const int8_t *x, int32_t sum_x) {
    (void)sum_x;
    Sums s = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int q = 0; q < (bits == 4 ? 4 : 8); q++) {
        __m256i w0 = _mm256_loadu_si256((const void *)(codes + q * 64));
        __m256i w1 = _mm256_loadu_si256((const void *)(codes + q * 64 + 32));
        int32_t xs;
        memcpy(&xs, x + 4 * q, 4);
        if (bits == 4) {
            const __m256i low = _mm256_set1_epi8(0x0f);
            int32_t hs;
            memcpy(&hs, x + 16 + 4 * q, 4);
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low);
            w0 = _mm256_and_si256(w0, low), w1 = _mm256_and_si256(w1, low);
            s.lo = _mm256_add_epi32(s.lo, dot4(h0, hs, 4)), s.hi = _mm256_add_epi32(s.hi, dot4(h1, hs, 4));
        }
        s.lo = _mm256_add_epi32(s.lo, dot4(w0, xs, bits)), s.hi = _mm256_add_epi32(s.hi, dot4(w1, xs, bits));
    }
    return s;
}
#if defined(__AVX512F__)
static inline Lanes sums_to_lanes(Sums s) {
    return (Lanes){_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(s.lo), s.hi, 1))};
}
#else
static inline Lanes sums_to_lanes(Sums s) { return (Lanes){_mm256_cvtepi32_ps(s.lo), _mm256_cvtepi32_ps(s.hi)}; }
#endif
#else
typedef struct { int32_t n[LANES]; } Sums;
static inline Sums group_sums(const uint8_t *codes, int bits, const int8_t *x, int32_t sum_x) {
    (void)sum_x;
    Sums s = {{0}};
    for (int q = 0; q < (bits == 4 ? 4 : 8); q++)
        for (int n = 0; n < LANES; n++)
            for (int r = 0; r < 4; r++) {
                const uint8_t c = codes[q * 64 + n * 4 + r];
                if (bits == 4)
                    s.n[n] += (c & 15) * x[4 * q + r] + (c >> 4) * x[16 + 4 * q + r];
                else
                    s.n[n] += (c - 128) * x[4 * q + r];
            }
    return s;
}
static inline Lanes sums_to_lanes(Sums s) {
    float f[LANES];
    for (int n = 0; n < LANES; n++) f[n] = (float)s.n[n];
    return load(f);
}
#endif

#ifndef ROWS_OF_SUMS
static inline void group_sums_rows(const uint8_t *codes, int bits, const int8_t *x, int64_t x_stride,
                                   const int32_t *sum_x, int64_t sum_stride, int count, Sums *out) {
    for (int j = 0; j < count; j++) out[j] = group_sums(codes, bits, x + j * x_stride, sum_x[j * sum_stride]);
}
#endif

#if AMX
static inline Sums load_sums(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
#endif

/* acc := the float work of one group of one row (module comment), from its 16 outputs' integer sums */
static inline Lanes int_epilogue(Lanes acc, Lanes isum, const uint8_t *tile, int bits, float d, float s) {
    acc = scaled(isum, fma_one(d, load((const float *)tile), zero()), acc);
    return bits == 4 ? fma_one(s, load((const float *)tile + LANES), acc) : acc;
}

enum { INT_ROWS = 4, AMX_ROWS = 16, AMX_FROM = 4 }; /* rows in registers; an AMX tile's rows; AMX from 4 rows on */

#if AMX
/* Linux lends a process the AMX tile state only when asked; MAMBA_DRAFT_AMX=0 keeps to the vector path (the same
 * bits: the comparison tests/test_cpu_step.py makes) */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) {
        const char *off = getenv("MAMBA_DRAFT_AMX");
        state = !(off && off[0] == '0') && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                   18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return state;
}

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* The B tile of a block's group g: its codes as unsigned bytes, 8 rows of 4 inputs x 16 outputs (4-bit codes
 * unpacked into `buffer`: rows 0-3 the low nibbles, inputs 0-15, rows 4-7 the high ones, inputs 16-31) */
static inline const uint8_t *b_tile(const uint8_t *tile, int bits, uint8_t *buffer) {
    const uint8_t *codes = tile + (bits == 4 ? 2 * LANES * 4 : LANES * 4);
    if (bits == 8) return codes;
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < 4; r++) {
        const __m512i w = _mm512_loadu_si512((const void *)(codes + r * 64));
        _mm512_store_si512((void *)(buffer + r * 64), _mm512_and_si512(w, low));
        _mm512_store_si512((void *)(buffer + 256 + r * 64), _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
    }
    return buffer;
}

/* acc[j] := the float work of group g (module comment) for the chunk's `count` rows, from its int32 tile `c` */
static inline void amx_epilogue(__m512 *acc, const int32_t *c, const uint8_t *tile, int bits, const float *d,
                                const float *s, const int32_t *sum, int groups, int g, int count) {
    const __m512 dw = _mm512_loadu_ps((const float *)tile);
    const __m512 mw = bits == 4 ? _mm512_loadu_ps((const float *)tile + LANES) : _mm512_setzero_ps();
    for (int j = 0; j < count; j++) {
        const int64_t at = (int64_t)j * groups + g;
        __m512i isum = _mm512_load_si512((const void *)(c + j * LANES));
        if (bits == 8) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * sum[at])); /* stored: code + 128 */
        /* as int_epilogue computes it: fma(isum, fma(d, dw, 0), acc), then fma(s, m, acc) */
        const __m512 dd = _mm512_fmadd_ps(_mm512_set1_ps(d[at]), dw, _mm512_setzero_ps());
        acc[j] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum), acc[j]);
        if (bits == 4) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(s[at]), mw, acc[j]);
    }
}

/* out[m] (16 floats per row) := the products of rows [0, real) (their codes `q` padded with zero rows to whole
 * 16-row tiles) and one block's tiles: per 16-row chunk, the groups' tile products in flight two at a time (tiles 0,
 * 1: the int32 sums, 16 rows x 16 outputs; 2, 3: the rows' 32 codes; 4, 5: the block's codes as B tiles) while
 * the float work of the one before runs on the vector units */
static void amx_block(const uint8_t *tiles, int bits, int inner, const int8_t *q, const float *d, const float *s,
                      const int32_t *sum, int real, float *out) {
    const int groups = inner / GROUP, bytes = tile_bytes(bits);
    /* 4-bit B tiles unpacked three groups ahead into a ring: a tile load right after the stores that wrote its
     * bytes waits for them to reach the cache */
    uint8_t buffers[4][8 * 64] __attribute__((aligned(64)));
    int32_t c[AMX_ROWS * LANES] __attribute__((aligned(64)));
#define B_TILE(g) (bits == 4 ? buffers[(g) & 3] : tiles + (int64_t)(g) * bytes + LANES * 4)
#define PREPARE(g)                                                                                          \
    do {                                                                                                    \
        if (bits == 4 && (g) < groups) b_tile(tiles + (int64_t)(g) * bytes, bits, buffers[(g) & 3]);         \
    } while (0)
#define ISSUE(C, A, B, g)                                                                                   \
    do {                                                                                                    \
        _tile_loadd(B, B_TILE(g), 64);                                                                      \
        _tile_loadd(A, a + (g) * GROUP, inner);                                                             \
        _tile_zero(C);                                                                                      \
        _tile_dpbsud(C, A, B);                                                                              \
    } while (0)
    for (int m0 = 0; m0 < real; m0 += AMX_ROWS) {
        const int count = real - m0 < AMX_ROWS ? real - m0 : AMX_ROWS;
        const int8_t *a = q + (int64_t)m0 * inner;
        const float *dm = d + (int64_t)m0 * groups, *sm = s + (int64_t)m0 * groups;
        const int32_t *summ = sum + (int64_t)m0 * groups;
        __m512 acc[AMX_ROWS];
        for (int j = 0; j < AMX_ROWS; j++) acc[j] = _mm512_setzero_ps();
        PREPARE(0);
        PREPARE(1);
        PREPARE(2);
        ISSUE(0, 2, 4, 0);
        for (int g = 0; g < groups; g += 2) {
            PREPARE(g + 3);
            if (g + 1 < groups) ISSUE(1, 3, 5, g + 1);
            _tile_stored(0, c, LANES * 4);
            amx_epilogue(acc, c, tiles + (int64_t)g * bytes, bits, dm, sm, summ, groups, g, count);
            if (g + 1 < groups) {
                PREPARE(g + 4);
                if (g + 2 < groups) ISSUE(0, 2, 4, g + 2);
                _tile_stored(1, c, LANES * 4);
                amx_epilogue(acc, c, tiles + (int64_t)(g + 1) * bytes, bits, dm, sm, summ, groups, g + 1, count);
            }
        }
        for (int j = 0; j < count; j++) _mm512_storeu_ps(out + (int64_t)(m0 + j) * LANES, acc[j]);
    }
#undef ISSUE
#undef PREPARE
#undef B_TILE
}
#else
static inline int amx_usable(void) { return 0; }
#endif

/* out[m * stride + n] = dtype(the integer product of row m and output n (module comment) + bias[n]) */
static void int_linear(const float *x, int rows, int inner, Weight w, const void *bias, int outs, float *out,
                       int64_t stride, int dtype, int threads) {
    const int groups = inner / GROUP, bytes = tile_bytes(w.codes), head = w.codes == 4 ? 2 * LANES * 4 : LANES * 4;
    const int tiled = AMX && rows >= AMX_FROM && amx_usable();
    const int padded = tiled ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
    int8_t *q = calloc((size_t)padded * inner, 1);
    float *d = malloc((size_t)rows * groups * 2 * sizeof(float)), *s = d + (int64_t)rows * groups;
    int32_t *sum = malloc((size_t)rows * groups * sizeof(int32_t));
    quantize(x, rows, inner, q, d, s, sum);
#pragma omp parallel num_threads(threads)
    {
        float *acc = NULL;
#if AMX
        if (tiled) {
            TileConfig config = {.palette = 1};
            for (int t = 0; t < 2; t++) {
                config.rows[t] = AMX_ROWS, config.colsb[t] = LANES * 4;   /* int32 sums */
                config.rows[2 + t] = AMX_ROWS, config.colsb[2 + t] = GROUP; /* the rows' codes */
                config.rows[4 + t] = GROUP / 4, config.colsb[4 + t] = 64;   /* the block's codes */
            }
            _tile_loadconfig(&config);
            acc = malloc((size_t)rows * LANES * sizeof(float));
        }
#endif
#pragma omp for schedule(static)
        for (int block = 0; block < outs / LANES; block++) {
            const uint8_t *tiles = (const uint8_t *)w.data + (int64_t)block * groups * bytes;
            float bias_block[LANES], result[LANES];
            for (int l = 0; l < LANES; l++) bias_block[l] = bias ? element(bias, block * LANES + l, dtype) : 0.0f;
#if AMX
            if (tiled) {
                amx_block(tiles, w.codes, inner, q, d, s, sum, rows, acc);
                for (int m = 0; m < rows; m++)
                    emit(out + (int64_t)m * stride + block * LANES, acc + (int64_t)m * LANES, bias_block, dtype);
                continue;
            }
#endif
            for (int m0 = 0; m0 < rows; m0 += INT_ROWS) {
                const int count = rows - m0 < INT_ROWS ? rows - m0 : INT_ROWS;
                Lanes sums[INT_ROWS] = {zero(), zero(), zero(), zero()};
                for (int g = 0; g < groups; g++) {
                    const uint8_t *tile = tiles + (int64_t)g * bytes;
                    Sums isums[INT_ROWS];
                    group_sums_rows(tile + head, w.codes, q + (int64_t)m0 * inner + g * GROUP, inner,
                                    sum + (int64_t)m0 * groups + g, groups, count, isums);
                    for (int j = 0; j < count; j++) {
                        const int64_t at = (int64_t)(m0 + j) * groups + g;
                        sums[j] = int_epilogue(sums[j], sums_to_lanes(isums[j]), tile, w.codes, d[at], s[at]);
                    }
                }
                for (int j = 0; j < count; j++) {
                    unload(result, sums[j]);
                    emit(out + (int64_t)(m0 + j) * stride + block * LANES, result, bias_block, dtype);
                }
            }
        }
#if AMX
        if (tiled) _tile_release();
#endif
        free(acc);
    }
    free(q), free(d), free(sum);
}
