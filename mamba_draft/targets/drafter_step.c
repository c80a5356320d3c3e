/* The compiled CPU step of a Mamba-2 drafter (`mamba_draft.cpu_drafter`): one call feeds one token to each of `rows`
 * state rows through every layer (the fusion with the target's hidden state, norm, in_proj, causal conv, SSM update,
 * gated norm, out_proj, residual), the final norm and the draft head, with no Python between the operations.
 *
 * A drafter only proposes (the target verifies every token), so its step needs no bits of its own: it follows
 * `MambaDrafter.step`'s arithmetic in fp32 (products by `linear`, weights read in the drafter's dtype), and the tests
 * hold it to the torch step within float rounding. Included by cpu_step.c: one library of CPU kernels.
 */

typedef struct {
    const void *norm;            /* (d_model) */
    Weight in_proj;              /* d_model -> z, xBC, dt, padded to whole 16-lane blocks */
    const void *conv_w, *conv_b; /* (conv_dim, d_conv), (conv_dim) or NULL */
    const float *dt_bias, *A, *D; /* (heads) fp32; A = -exp(A_log) */
    const void *gate_norm;       /* (d_inner) */
    Weight out_proj;             /* d_inner -> d_model */
} MambaLayer;

typedef struct {
    int layers, d_model, d_inner, heads, head_dim, d_state, groups, conv_dim, d_conv, in_width, target_hidden, vocab;
    int dtype, conv_dtype, ssm_dtype, residual_fp32;
    float eps, dt_low, dt_high;
    const void *embed;                      /* (embedding rows, d_model) */
    Weight fuse;                            /* d_model + target_hidden -> d_model (target_hidden 0: unused) */
    const void *stand_in, *feature_norm;    /* (target_hidden) */
    const void *final_norm;                 /* (d_model) */
    Weight head;                            /* d_model -> vocab (the draft vocabulary's rows) */
    const MambaLayer *layer;
} MambaDrafter;

static inline float softplus_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
static inline float silu_(float x) { return x / (1.0f + expf(-x)); }

/* out = weight * (x / sqrt(mean(x^2) + eps)), each group of `group` values normed apart; rounded to `dtype` */
static void drafter_norm(const float *x, int width, int group, const void *weight, float eps, int dtype, float *out) {
    for (int g0 = 0; g0 < width; g0 += group) {
        float squares = 0.0f;
        for (int d = g0; d < g0 + group; d++) squares += x[d] * x[d];
        const float inverse = 1.0f / sqrtf(squares / (float)group + eps);
        for (int d = g0; d < g0 + group; d++)
            out[d] = to_dtype(element(weight, d, dtype) * to_dtype(x[d] * inverse, dtype), dtype);
    }
}

/* floats of work space a step over `rows` rows needs */
int64_t drafter_step_work(const MambaDrafter *m, int rows) {
    const int64_t wide = m->d_model + m->target_hidden > m->d_inner ? m->d_model + m->target_hidden : m->d_inner;
    return (int64_t)rows * (2 * (int64_t)m->d_model + wide + m->in_width + m->d_inner);
}

/* ids (rows); features (rows, target_hidden) or NULL (the stand-in); conv (layers, rows, conv_dim, d_conv) in
 * conv_dtype, ssm (layers, rows, heads, head_dim, d_state) in ssm_dtype, each row's own part contiguous, the layers
 * and rows `strides` elements apart (conv's layer, conv's row, ssm's layer, ssm's row), updated in place; writes
 * logits (rows, vocab) and the final-norm states (rows, d_model), fp32 holding dtype values. */
int drafter_step(const MambaDrafter *m, int rows, const int64_t *ids, int64_t tokens, const float *features,
                 void *conv, void *ssm, const int64_t *strides, float *logits, float *normed, float *work,
                 int threads) {
    const int D = m->d_model, I = m->d_inner, H = m->heads, P = m->head_dim, N = m->d_state, G = m->groups;
    const int C = m->conv_dim, K = m->d_conv, W = m->in_width, T = m->target_hidden, dtype = m->dtype;
    for (int r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= tokens) return 3;
    const int64_t wide = D + T > I ? D + T : I;
    float *h = work, *x = h + (int64_t)rows * D, *cat = x + (int64_t)rows * D, *zx = cat + (int64_t)rows * wide;
    float *y = zx + (int64_t)rows * W;
    for (int r = 0; r < rows; r++) { /* the first layer's input: the token's embedding, fused with the target's state */
        float *e = T ? cat + (int64_t)r * (D + T) : h + (int64_t)r * D;
        for (int d = 0; d < D; d++) e[d] = element(m->embed, ids[r] * D + d, dtype);
        if (T) {
            float f[T];
            for (int d = 0; d < T; d++)
                f[d] = features ? to_dtype(features[(int64_t)r * T + d], dtype) : element(m->stand_in, d, dtype);
            drafter_norm(f, T, T, m->feature_norm, m->eps, dtype, e + D);
        }
    }
    if (T) linear(cat, rows, D + T, m->fuse, NULL, D, h, D, dtype, threads);
    const int64_t conv_layer = strides[0], conv_row = strides[1], ssm_layer = strides[2], ssm_row = strides[3];
    for (int i = 0; i < m->layers; i++) {
        const MambaLayer *L = m->layer + i;
        for (int r = 0; r < rows; r++) drafter_norm(h + (int64_t)r * D, D, D, L->norm, m->eps, dtype, x + (int64_t)r * D);
        linear(x, rows, D, L->in_proj, NULL, W, zx, W, dtype, threads); /* z | x B C | dt */
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
        for (int r = 0; r < rows; r++) {
            float *z = zx + (int64_t)r * W, *xbc = z + I, *dt = xbc + C;
            const int64_t conv_at = i * conv_layer + r * conv_row, ssm_at = i * ssm_layer + r * ssm_row;
            for (int c = 0; c < C; c++) { /* the causal conv: shift the window, append, weigh, SiLU */
                float sum = L->conv_b ? element(L->conv_b, c, dtype) : 0.0f, window[K];
                for (int k = 0; k < K - 1; k++) window[k] = element(conv, conv_at + (int64_t)c * K + k + 1, m->conv_dtype);
                window[K - 1] = to_dtype(xbc[c], m->conv_dtype);
                for (int k = 0; k < K; k++) {
                    store(conv, conv_at + (int64_t)c * K + k, window[k], m->conv_dtype);
                    sum += window[k] * element(L->conv_w, (int64_t)c * K + k, dtype);
                }
                xbc[c] = to_dtype(silu_(to_dtype(sum, dtype)), dtype);
            }
            const float *xs = xbc, *Bs = xbc + I, *Cs = Bs + G * N;
            float *yr = y + (int64_t)r * I;
            for (int hd = 0; hd < H; hd++) { /* state <- state * exp(dt A) + dt x B^T; y = state C + D x */
                const int g = hd / (H / G);
                float step = softplus_(to_dtype(dt[hd], dtype) + L->dt_bias[hd]);
                step = step < m->dt_low ? m->dt_low : step > m->dt_high ? m->dt_high : step;
                const float decay = expf(step * L->A[hd]);
                for (int p = 0; p < P; p++) {
                    const float xv = xs[hd * P + p], dx = step * xv;
                    const int64_t at = ssm_at + ((int64_t)hd * P + p) * N;
                    float out = 0.0f;
                    if (m->ssm_dtype == F32 && N % LANES == 0) { /* in place, by lanes: loops that vectorize */
                        float *state = (float *)ssm + at, lanes[LANES] = {0};
                        for (int n = 0; n < N; n++) state[n] = state[n] * decay + dx * Bs[g * N + n];
                        for (int n0 = 0; n0 < N; n0 += LANES)
                            for (int l = 0; l < LANES; l++) lanes[l] += state[n0 + l] * Cs[g * N + n0 + l];
                        out = fold(lanes);
                    } else {
                        for (int n = 0; n < N; n++) {
                            const float s = element(ssm, at + n, m->ssm_dtype) * decay + dx * Bs[g * N + n];
                            store(ssm, at + n, s, m->ssm_dtype);
                            out += s * Cs[g * N + n];
                        }
                    }
                    yr[hd * P + p] = to_dtype(out + xv * L->D[hd], dtype) * silu_(z[hd * P + p]);
                }
            }
            drafter_norm(yr, I, I / G, L->gate_norm, m->eps, dtype, yr);
        }
        linear(y, rows, I, L->out_proj, NULL, D, x, D, dtype, threads);
        for (int64_t j = 0; j < (int64_t)rows * D; j++)
            h[j] = m->residual_fp32 ? h[j] + x[j] : to_dtype(h[j] + x[j], dtype);
    }
    for (int r = 0; r < rows; r++)
        drafter_norm(h + (int64_t)r * D, D, D, m->final_norm, m->eps, dtype, normed + (int64_t)r * D);
    linear(normed, rows, D, m->head, NULL, m->vocab, logits, m->vocab, dtype, threads);
    return 0;
}
