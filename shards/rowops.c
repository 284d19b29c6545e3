/* The small per-row steps of a transformer layer on the CPU, fused.
 *
 * Built at first use by shards/qblocks.py, as qblocks.c is. A decode step's matmuls are a
 * few big kernel calls, but between them torch ran about 80 small ops a layer (norms,
 * casts, rope, the KV write, attention, the activation, residual adds) at 1-3 us each:
 * more time than the matmuls took. Each function here does one stretch of them over
 * whole rows in one call (shards/rowops.py says which).
 *
 * Activations are float32; an input or output marked bf16 is bfloat16 (what torch's int4
 * kernels take and give), read exactly and written rounded to nearest even, as torch's
 * .to(torch.bfloat16) does. Sums run in float with 16 lanes (omp simd), so a result may
 * differ from torch's in the last bits; every path of meshd runs the same code for the
 * same row, so one node and a mesh, batched or not, give the same floats.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u; /* a NaN stays a (quiet) NaN */
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? (u >> 16) | 0x40 : r);
}

/* n values from p (float32, or bf16 when bf16) into dst. */
static void load(float *restrict dst, const void *p, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_load(s + i);
    } else {
        memcpy(dst, p, (size_t)n * 4);
    }
}

static void store(void *p, const float *restrict src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *restrict d = p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = bf16_round(src[i]);
    } else {
        memcpy(p, src, (size_t)n * 4);
    }
}

/* Row r of a matrix of float32, or bf16, with rows ``stride`` elements apart. */
static inline void *row(const void *p, int64_t r, int64_t stride, int bf16) {
    return (char *)p + r * stride * (bf16 ? 2 : 4);
}

/* x held to [lo, hi] by bit masks: with ?: or fminf GCC leaves vexp's loops scalar. */
static inline float clampf(float x, float lo, float hi) {
    union { float f; int32_t i; } v = {x}, l = {lo}, h = {hi};
    int32_t below = -(x < lo), above = -(x > hi);
    v.i = (v.i & ~below) | (l.i & below);
    v.i = (v.i & ~above) | (h.i & above);
    return v.f;
}

/* e^x for x <= 0 (softmax, where x = s - max) and for the activations: Cephes' expf
 * reduction to 2^n e^r, |r| <= ln2/2, with its degree-6 polynomial (about 1 ulp), in a
 * form the compiler vectorizes, which libm's expf is not without -ffast-math. */
static inline float vexp(float x) {
    x = clampf(x, -87.3f, 88.3f);
    float t = x * 1.44269504088896341f;
    int32_t k = (int32_t)(t + copysignf(0.5f, t)); /* nearest (floorf would not vectorize) */
    float n = (float)k;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s = {.i = (k + 127) << 23};
    return p * s.f;
}

static float sum_squares(const float *restrict x, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s) simdlen(16)
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* x <- x * rsqrt(mean(x^2) + eps) * w, in place. */
static void rms_norm(float *restrict x, int64_t n, const float *restrict w, float eps) {
    float rstd = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * rstd * w[i];
}

/* For each of n rows of h: when a is given, x += a (a normed by post first when given);
 * then when w is given, out = rms_norm(x, w). The start and the middle of a block:
 * norm, or residual add + norm, in one pass. */
int ro_add_norm(int64_t n, int64_t h, float *x, int64_t sx, const void *a, int64_t sa, int a_bf16,
                const float *post, const float *w, float eps, void *out, int64_t so, int out_bf16) {
    float *t = malloc((size_t)h * 4);
    if (!t) return -1;
    for (int64_t r = 0; r < n; r++) {
        float *xr = x + r * sx;
        if (a) {
            load(t, row(a, r, sa, a_bf16), h, a_bf16);
            if (post) rms_norm(t, h, post, eps);
#pragma omp simd
            for (int64_t i = 0; i < h; i++) xr[i] = xr[i] + t[i];
        }
        if (w) {
            memcpy(t, xr, (size_t)h * 4);
            rms_norm(t, h, w, eps);
            store(row(out, r, so, out_bf16), t, h, out_bf16);
        }
    }
    free(t);
    return 0;
}

static void silu_mul(float *restrict g, const float *restrict u, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + vexp(-g[i])) * u[i];
}

static void gelu_mul(float *restrict g, const float *restrict u, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float v = g[i], z = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        float e = vexp(-2.0f * fabsf(z)); /* tanh(|z|) = (1 - e) / (1 + e) */
        float th = (1.0f - e) / (1.0f + e);
        g[i] = 0.5f * v * (1.0f + copysignf(th, z)) * u[i];
    }
}

/* out = act(gate) * up for n rows of `inter`; act is SiLU, or GELU's tanh form (gelu). */
int ro_act_mul(int64_t n, int64_t inter, const void *g, int64_t sg, int g_bf16, const void *u, int64_t su,
               int u_bf16, int gelu, void *out, int64_t so, int out_bf16) {
    float *gt = malloc((size_t)inter * 8);
    if (!gt) return -1;
    float *ut = gt + inter;
    for (int64_t r = 0; r < n; r++) {
        load(gt, row(g, r, sg, g_bf16), inter, g_bf16);
        load(ut, row(u, r, su, u_bf16), inter, u_bf16);
        (gelu ? gelu_mul : silu_mul)(gt, ut, inter);
        store(row(out, r, so, out_bf16), gt, inter, out_bf16);
    }
    free(gt);
    return 0;
}

/* x (heads of hd) <- x * cos + roll(x, hd / 2) * ssin: the rotate-half rope with the sign
 * folded into ssin (shards/model.py's apply_rope). */
static void rope(float *restrict x, int64_t heads, int64_t hd, const float *restrict cos,
                 const float *restrict ssin, float *restrict tmp) {
    int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * hd;
        for (int64_t j = 0; j < hd; j++) tmp[j] = xh[j] * cos[j] + xh[(j + half) % hd] * ssin[j];
        memcpy(xh, tmp, (size_t)hd * 4);
    }
}

/* s[j] = scale * (q . k_j) for keys k_0..k_{S-1} (rows of hd): four keys at a time, each
 * with lanes of its own, summed across lanes once per key. */
#ifdef __AVX512F__
/* 16 floats as one vector (GCC's vector extension: one zmm register here); its + and * are
 * the same IEEE operations lane by lane as the scalar code's (no contraction: -ffp-contract=off). */
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
static inline vf16 ld16(const float *p) {
    vf16 v;
    memcpy(&v, p, 64);
    return v;
}
static inline void st16(float *p, vf16 v) { memcpy(p, &v, 64); }

/* One stage of a 16 x 16 transpose: rows c and c + 2^b swap the elements whose lane bit b
 * differs from their row's. */
#define TSTAGE(A, B, LO, HI) do { _Pragma("GCC unroll 16") for (int c_ = 0; c_ < 16; c_++) if (!(c_ & (B))) { \
        vf16 x_ = A[c_], y_ = A[c_ + (B)]; A[c_] = __builtin_shuffle(x_, y_, LO); \
        A[c_ + (B)] = __builtin_shuffle(x_, y_, HI); } } while (0)

/* scores() for 16 keys at once, to the bit: a key's dot is what scores' omp simd loop
 * compiles to on a 16-lane machine (lane l sums d = l, l + 16, ... in order from 0, then 0
 * + lane 0 + lane 1 ... + lane 15), but the 16 lane sums of the 16 keys are transposed in
 * registers and added as vectors, where scores added them one float after another: a chain
 * of 16 dependent adds a key was most of attention's time. hd: a multiple of 16. */
static void scores16(const float *restrict q, const float *restrict k, int64_t hd, float scale, float *restrict s) {
    vf16 a[16], qv = ld16(q);
    _Pragma("GCC unroll 16")  /* unrolled: a[] in registers */
    for (int c = 0; c < 16; c++) a[c] = (vf16){0} + qv * ld16(k + c * hd);
    for (int64_t d = 16; d < hd; d += 16) {
        qv = ld16(q + d);
        _Pragma("GCC unroll 16")
        for (int c = 0; c < 16; c++) a[c] = a[c] + qv * ld16(k + c * hd + d);
    }
    const vi16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
               hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
               lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
               hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
               lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
               hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
               lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
               hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    TSTAGE(a, 8, lo8, hi8);
    TSTAGE(a, 4, lo4, hi4);
    TSTAGE(a, 2, lo2, hi2);
    TSTAGE(a, 1, lo1, hi1);
    vf16 sum = (vf16){0};
    _Pragma("GCC unroll 16")
    for (int l = 0; l < 16; l++) sum = sum + a[l];
    st16(s, sum * scale);
}

/* o[h][d] = sum over keys j of p[h * ps + j] v[j][d] for nh (1 or 2) heads and w (1 to 4)
 * vectors of d from d0, each element summed as attend_row's loop sums it (from 0, key by
 * key in order: the same bits), in registers rather than through memory each key. */
static inline __attribute__((always_inline)) void weigh(const float *p, int64_t ps, const int nh, int64_t S,
                                                        const float *v, int64_t hd, int64_t d0, const int w,
                                                        float *o) {
    vf16 a[2][4];
    for (int h = 0; h < nh; h++)
        for (int x = 0; x < w; x++) a[h][x] = (vf16){0};
    for (int64_t j = 0; j < S; j++) {
        const float *vj = v + j * hd + d0;
        vf16 x_[4];
        for (int x = 0; x < w; x++) x_[x] = ld16(vj + 16 * x);
        for (int h = 0; h < nh; h++) {
            vf16 pj = (vf16){0} + p[h * ps + j];
            for (int x = 0; x < w; x++) a[h][x] = a[h][x] + pj * x_[x];
        }
    }
    for (int h = 0; h < nh; h++)
        for (int x = 0; x < w; x++) st16(o + h * hd + d0 + 16 * x, a[h][x]);
}

/* The group's heads' outputs o [group][hd] from their softmaxed scores p [group][S]. */
static void weigh_values(const float *p, int64_t S, int64_t group, const float *v, int64_t hd, float *o) {
    for (int64_t i = 0; i < group; i += 2) {
        int two = i + 1 < group;
        for (int64_t d0 = 0; d0 < hd; d0 += 64) {
            int64_t w = hd - d0 >= 64 ? 4 : (hd - d0) / 16;
            const float *pi = p + i * S;
            float *oi = o + i * hd;
            if (two) {
                switch (w) {
                case 4: weigh(pi, S, 2, S, v, hd, d0, 4, oi); break;
                case 3: weigh(pi, S, 2, S, v, hd, d0, 3, oi); break;
                case 2: weigh(pi, S, 2, S, v, hd, d0, 2, oi); break;
                default: weigh(pi, S, 2, S, v, hd, d0, 1, oi); break;
                }
            } else {
                switch (w) {
                case 4: weigh(pi, S, 1, S, v, hd, d0, 4, oi); break;
                case 3: weigh(pi, S, 1, S, v, hd, d0, 3, oi); break;
                case 2: weigh(pi, S, 1, S, v, hd, d0, 2, oi); break;
                default: weigh(pi, S, 1, S, v, hd, d0, 1, oi); break;
                }
            }
        }
    }
}
#define FAST_ATTENTION(hd) ((hd) % 16 == 0)
#endif

static void scores(const float *restrict q, const float *restrict k, int64_t S, int64_t hd, float scale,
                   float *restrict s) {
    int64_t j = 0;
    for (; j + 4 <= S; j += 4) {
        const float *k0 = k + j * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t d = 0; d < hd; d++) {
            a0 += q[d] * k0[d];
            a1 += q[d] * k1[d];
            a2 += q[d] * k2[d];
            a3 += q[d] * k3[d];
        }
        s[j] = a0 * scale;
        s[j + 1] = a1 * scale;
        s[j + 2] = a2 * scale;
        s[j + 3] = a3 * scale;
    }
    for (; j < S; j++) {
        float a = 0.0f;
        const float *kj = k + j * hd;
#pragma omp simd reduction(+ : a)
        for (int64_t d = 0; d < hd; d++) a += q[d] * kj[d];
        s[j] = a * scale;
    }
}

/* p <- softmax(p) over n. */
static void softmax(float *restrict p, int64_t n) {
    float m = -INFINITY, z = 0.0f;
#pragma omp simd reduction(max : m)  /* a max is exact in any order: the same m */
    for (int64_t j = 0; j < n; j++) m = p[j] > m ? p[j] : m;
#pragma omp simd reduction(+ : z)
    for (int64_t j = 0; j < n; j++) {
        p[j] = vexp(p[j] - m);
        z += p[j];
    }
    float inv = 1.0f / z;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) p[j] *= inv;
}

/* One new position of one session before attention: its q, k, v heads loaded (q/k normed
 * per head when qn/kn are given, then roped with this row's cos and signed sin) into qf, kf,
 * vf, and k and v written into the session's cache [nkv, cap, hd] at pos. */
static void prepare_row(int64_t nq, int64_t nkv, int64_t hd, const void *q, int q_bf16, const void *k, int k_bf16,
                        const void *v, int v_bf16, const float *qn, const float *kn, float eps, const float *cos,
                        const float *ssin, float *kc, float *vc, int64_t cap, int64_t pos, float *qf, float *kf,
                        float *vf, float *tmp) {
    load(qf, q, nq * hd, q_bf16);
    load(kf, k, nkv * hd, k_bf16);
    load(vf, v, nkv * hd, v_bf16);
    if (qn)
        for (int64_t h = 0; h < nq; h++) rms_norm(qf + h * hd, hd, qn, eps);
    if (kn)
        for (int64_t h = 0; h < nkv; h++) rms_norm(kf + h * hd, hd, kn, eps);
    rope(qf, nq, hd, cos, ssin, tmp);
    rope(kf, nkv, hd, cos, ssin, tmp);
    for (int64_t h = 0; h < nkv; h++) {
        memcpy(kc + (h * cap + pos) * hd, kf + h * hd, (size_t)hd * 4);
        memcpy(vc + (h * cap + pos) * hd, vf + h * hd, (size_t)hd * 4);
    }
}

/* The attention of one prepared row at pos: each q head of qf attends to keys first..pos of
 * its kv head in the cache (q head i reads kv head i / (nq / nkv)) with softmax at `scale`.
 * p: scratch of (nq / nkv) * (pos - first + 1) floats, o: of nq * hd. out: the heads side by
 * side [nq * hd]. What a row gets depends only on its q, the keys and values it reads and
 * their count: the same bits whether the row runs alone or among others. */
static void attend_row(int64_t nq, int64_t nkv, int64_t hd, const float *qf, const float *kc, const float *vc,
                       int64_t cap, int64_t pos, int64_t first, float scale, float *p, float *o, void *out,
                       int out_bf16) {
    int64_t S = pos - first + 1, group = nq / nkv;
    for (int64_t g = 0; g < nkv; g++) { /* the q heads of kv head g share each key and value read */
        const float *kg = kc + (g * cap + first) * hd, *vg = vc + (g * cap + first) * hd;
        for (int64_t i = 0; i < group; i++) {
            int64_t h = g * group + i, j = 0;
#ifdef __AVX512F__
            if (FAST_ATTENTION(hd))
                for (; j + 16 <= S; j += 16) scores16(qf + h * hd, kg + j * hd, hd, scale, p + i * S + j);
#endif
            scores(qf + h * hd, kg + j * hd, S - j, hd, scale, p + i * S + j);
        }
        for (int64_t i = 0; i < group; i++) softmax(p + i * S, S);
#ifdef __AVX512F__
        if (FAST_ATTENTION(hd)) {
            weigh_values(p, S, group, vg, hd, o + g * group * hd);
            continue;
        }
#endif
        for (int64_t i = 0; i < group; i++) memset(o + (g * group + i) * hd, 0, (size_t)hd * 4);
        for (int64_t j = 0; j < S; j++) {
            const float *vj = vg + j * hd;
            for (int64_t i = 0; i < group; i++) {
                float *oh = o + (g * group + i) * hd, pj = p[i * S + j];
#pragma omp simd
                for (int64_t d = 0; d < hd; d++) oh[d] += pj * vj[d];
            }
        }
    }
    store(out, o, nq * hd, out_bf16);
}

/* One new position of one session through attention (prepare_row, then attend_row). */
int ro_attend(int64_t nq, int64_t nkv, int64_t hd, const void *q, int q_bf16, const void *k, int k_bf16,
              const void *v, int v_bf16, const float *qn, const float *kn, float eps, const float *cos,
              const float *ssin, float *kc, float *vc, int64_t cap, int64_t pos, int64_t first, float scale,
              void *out, int out_bf16) {
    if (nkv <= 0 || nq % nkv || hd % 2 || pos < first || first < 0 || pos >= cap) return -2;
    int64_t S = pos - first + 1, group = nq / nkv;
    float *buf = malloc((size_t)((nq + 2 * nkv) * hd + hd + group * S + nq * hd) * 4);
    if (!buf) return -1;
    float *qf = buf, *kf = qf + nq * hd, *vf = kf + nkv * hd, *tmp = vf + nkv * hd, *p = tmp + hd;
    float *o = p + group * S;
    prepare_row(nq, nkv, hd, q, q_bf16, k, k_bf16, v, v_bf16, qn, kn, eps, cos, ssin, kc, vc, cap, pos, qf, kf, vf,
                tmp);
    attend_row(nq, nkv, hd, qf, kc, vc, cap, pos, first, scale, p, o, out, out_bf16);
    free(buf);
    return 0;
}

/* T new positions start..start+T-1 of one session through attention (a prompt's chunk, a
 * replay, a draft's rows): every row prepared and written into the cache in order, then each
 * row attends as ro_attend would for it alone (keys from its window's first, window 0: all),
 * rows spread over `threads`. Rows are `*_ld` elements apart in q, k, v and out. So a row's
 * attention has the same bits in a chunk of any length as decoded alone. */
int ro_attend_rows(int64_t T, int threads, int64_t nq, int64_t nkv, int64_t hd, const void *q, int64_t q_ld,
                   int q_bf16, const void *k, int64_t k_ld, int k_bf16, const void *v, int64_t v_ld, int v_bf16,
                   const float *qn, const float *kn, float eps, const float *cos, const float *ssin, float *kc,
                   float *vc, int64_t cap, int64_t start, int64_t window, float scale, void *out, int64_t out_ld,
                   int out_bf16) {
    if (T <= 0 || nkv <= 0 || nq % nkv || hd % 2 || start < 0 || start + T > cap || window < 0) return -2;
    float *qs = malloc((size_t)(T * nq * hd + 2 * nkv * hd + hd) * 4);
    if (!qs) return -1;
    float *kf = qs + T * nq * hd, *vf = kf + nkv * hd, *tmp = vf + nkv * hd;
    for (int64_t r = 0; r < T; r++)
        prepare_row(nq, nkv, hd, row(q, r, q_ld, q_bf16), q_bf16, row(k, r, k_ld, k_bf16), k_bf16,
                    row(v, r, v_ld, v_bf16), v_bf16, qn, kn, eps, cos + r * hd, ssin + r * hd, kc, vc, cap,
                    start + r, qs + r * nq * hd, kf, vf, tmp);
    int64_t group = nq / nkv, failed = 0;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t r = 0; r < T; r++) {
        int64_t pos = start + r, first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        float *scratch = malloc((size_t)(group * (pos - first + 1) + nq * hd) * 4);
        if (!scratch) {
            failed |= 1;
            continue;
        }
        attend_row(nq, nkv, hd, qs + r * nq * hd, kc, vc, cap, pos, first, scale, scratch,
                   scratch + group * (pos - first + 1), row(out, r, out_ld, out_bf16), out_bf16);
        free(scratch);
    }
    free(qs);
    return failed ? -1 : 0;
}

/* -- a whole block for decode rows -----------------------------------------------------------
 *
 * What shards/rowops.py's ``block`` does for rows that are each one new position of a session
 * with a cache, as the nine steps below, with the linears that run on the block kernel called
 * from here: qb_matmul of shards/qblocks.c, passed in (the two libraries are built apart).
 * The same functions above and the same matmul on the same inputs in the same order, so the
 * same floats; the Python between them is gone (about 100 us a layer of a decode step, where
 * a small model's matmuls take 150-300 us). A linear on another kernel (torch's int4) is a
 * step rowops.py runs between two calls here.
 *
 *   0 h = norm(x)     1 qkv = h Wqkv      2 att = attend(qkv)   3 o = att Wo
 *   4 x += post(o), h = ffn_norm(x)       5 gu = h Wgu          6 p = act(g) * u
 *   7 o = p W2        8 x += post(o)
 *
 * scratch (float32): h [n, H], o [n, H], qkv [n, (nq + 2 nkv) hd], att [n, nq hd],
 * gu [n, 2 inter], p [n, inter], one after another.
 * rows: per row (K cache, V cache, capacity, position, first key) for ro_attend.
 *
 * The plan of a block (ro_plan, written once a block by rowops.py): one description, these
 * structs; rowops.py's ctypes Structures name the same fields, and the library is not used
 * where their layouts differ (ro_layout, checked at load and by tests/test_rowops.py). */
typedef struct {
    int64_t type;                /* ggml type id (shards/qblocks.c) */
    const uint8_t *blocks;
    int64_t first, rows;         /* the output columns it makes: first .. first + rows - 1 */
} ro_segment;

typedef struct {
    int64_t n, k;                /* out, in features */
    const float *bias;           /* float32 [n], or NULL */
    int64_t nseg;                /* its segments; -1: not run here (rowops.py runs it on another kernel) */
    const ro_segment *seg;
} ro_linear;

typedef struct {
    int64_t H, nq, nkv, hd, inter, gelu;
    /* eps of the first norm, of the middle add-norm, of the last add, of the q/k norms; the
     * attention scale */
    float eps_attn, eps_mid, eps_last, eps_qk, scale;
    /* norm weights (float32 [H], q/k: [hd]), NULL for none */
    const float *w_attn, *w_post_attn, *w_ffn, *w_post_ffn, *w_q, *w_k;
    int64_t n_qkv, n_gate_up;    /* linears making q|k|v, gate|up */
    /* 1 where the input of a linear not run here is written as bf16: h (q/k/v), att, h (gate/up), p */
    int64_t bf_h1, bf_att, bf_h5, bf_p;
    const ro_linear *linear;     /* the q/k/v ones, wo, the gate/up ones, w2: n_qkv + n_gate_up + 2 */
} ro_plan;

/* The layout rowops.py checks its Structures against: the three sizes, then each struct's
 * field offsets in order (plan, linear, segment). Returns how many it wrote (at most cap). */
int ro_layout(int64_t *out, int cap) {
    const int64_t v[] = {
        sizeof(ro_plan), sizeof(ro_linear), sizeof(ro_segment),
        offsetof(ro_plan, H), offsetof(ro_plan, nq), offsetof(ro_plan, nkv), offsetof(ro_plan, hd),
        offsetof(ro_plan, inter), offsetof(ro_plan, gelu), offsetof(ro_plan, eps_attn), offsetof(ro_plan, eps_mid),
        offsetof(ro_plan, eps_last), offsetof(ro_plan, eps_qk), offsetof(ro_plan, scale), offsetof(ro_plan, w_attn),
        offsetof(ro_plan, w_post_attn), offsetof(ro_plan, w_ffn), offsetof(ro_plan, w_post_ffn), offsetof(ro_plan, w_q),
        offsetof(ro_plan, w_k), offsetof(ro_plan, n_qkv), offsetof(ro_plan, n_gate_up), offsetof(ro_plan, bf_h1),
        offsetof(ro_plan, bf_att), offsetof(ro_plan, bf_h5), offsetof(ro_plan, bf_p), offsetof(ro_plan, linear),
        offsetof(ro_linear, n), offsetof(ro_linear, k), offsetof(ro_linear, bias), offsetof(ro_linear, nseg),
        offsetof(ro_linear, seg),
        offsetof(ro_segment, type), offsetof(ro_segment, blocks), offsetof(ro_segment, first), offsetof(ro_segment, rows),
    };
    int n = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

typedef int (*ro_matmul)(int type, const uint8_t *W, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                         int64_t ldy, int threads, int scalar, int two);

/* The linear L (run when ``run``) over x [m, k] into y (rows ldy apart). */
static void run_linear(const ro_linear *L, int run, ro_matmul mm, const float *x, int64_t m, float *y,
                       int64_t ldy, int threads, int two, int *rc) {
    if (!run || L->nseg < 0) return;
    for (int64_t i = 0; i < L->nseg; i++) {
        const ro_segment *s = &L->seg[i];
        int e = mm((int)s->type, s->blocks, s->rows, L->k, x, m, y + s->first, ldy, threads, 0, two);
        if (e && !*rc) *rc = e;
    }
    if (L->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < L->n; j++) y[r * ldy + j] = y[r * ldy + j] + L->bias[j];
}

/* Steps first .. last - 1 of the block for n decode rows of x [n, H] (updated in place).
 * ext (rows ext_ld apart, bf16 when ext_bf16): the output of step first - 1 when rowops.py ran
 * it (a linear on another kernel), read in place of scratch; NULL when there is none. The
 * inputs of such linears are written in the dtype they take (the plan's bf_ flags, bf16 when set:
 * h for q/k/v, att, h for gate/up, p), as the step-by-step path writes them. */
int ro_block(const ro_plan *pl, ro_matmul mm, int threads, int two, int64_t n, float *x, const float *cos,
             const float *ssin, const int64_t *rows, float *scratch, int first, int last, const void *ext,
             int64_t ext_ld, int ext_bf16) {
    int64_t H = pl->H, nq = pl->nq, nkv = pl->nkv, hd = pl->hd, inter = pl->inter;
    int64_t qd = nq * hd, wqkv = (nq + 2 * nkv) * hd;
    int bf_h1 = (int)pl->bf_h1, bf_att = (int)pl->bf_att, bf_h5 = (int)pl->bf_h5, bf_p = (int)pl->bf_p;
    float *h = scratch, *o = h + n * H, *qkv = o + n * H, *att = qkv + n * wqkv, *gu = att + n * qd;
    float *p = gu + 2 * n * inter;
    /* where steps 2, 4, 6 and 8 read the linear before them: scratch, or ext */
    const void *src[9] = {0};
    int64_t ld[9] = {0};
    int bf[9] = {0};
    src[2] = qkv, ld[2] = wqkv, src[4] = o, ld[4] = H, src[6] = gu, ld[6] = 2 * inter, src[8] = o, ld[8] = H;
    if (ext && first >= 1 && first <= 8 && (first - 1) % 2 == 1) {
        src[first] = ext, ld[first] = ext_ld, bf[first] = ext_bf16;
    }
    int rc = 0;
#define STEP(i) (first <= (i) && (i) < last && !rc)
    if (STEP(0)) rc = ro_add_norm(n, H, x, H, NULL, 0, 0, NULL, pl->w_attn, pl->eps_attn, h, H, bf_h1);
    const ro_linear *L = pl->linear;
    for (int64_t i = 0, col = 0; i < pl->n_qkv; i++, L++) {
        run_linear(L, STEP(1), mm, h, n, qkv + col, wqkv, threads, two, &rc);
        col += L->n;
    }
    for (int64_t r = 0; r < n && STEP(2); r++) {
        const int64_t *c = rows + 5 * r;
        const char *q = row(src[2], r, ld[2], bf[2]);
        int64_t es = bf[2] ? 2 : 4;
        rc = ro_attend(nq, nkv, hd, q, bf[2], q + qd * es, bf[2], q + (qd + nkv * hd) * es, bf[2], pl->w_q, pl->w_k,
                       pl->eps_qk, cos + r * hd, ssin + r * hd, (float *)(intptr_t)c[0], (float *)(intptr_t)c[1],
                       c[2], c[3], c[4], pl->scale, row(att, r, qd, bf_att), bf_att);
    }
    run_linear(L++, STEP(3), mm, att, n, o, H, threads, two, &rc);
    if (STEP(4)) rc = ro_add_norm(n, H, x, H, src[4], ld[4], bf[4], pl->w_post_attn, pl->w_ffn, pl->eps_mid, h, H, bf_h5);
    for (int64_t i = 0, col = 0; i < pl->n_gate_up; i++, L++) {
        run_linear(L, STEP(5), mm, h, n, gu + col, 2 * inter, threads, two, &rc);
        col += L->n;
    }
    if (STEP(6)) {
        int64_t es = bf[6] ? 2 : 4;
        rc = ro_act_mul(n, inter, src[6], ld[6], bf[6], (const char *)src[6] + inter * es, ld[6], bf[6], (int)pl->gelu,
                        p, inter, bf_p);
    }
    run_linear(L, STEP(7), mm, p, n, o, H, threads, two, &rc);
    if (STEP(8)) rc = ro_add_norm(n, H, x, H, src[8], ld[8], bf[8], pl->w_post_ffn, NULL, pl->eps_last, NULL, H, 0);
#undef STEP
    return rc;
}
