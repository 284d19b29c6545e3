/* y = x W^T with W held as llama.cpp's own GGUF blocks, never expanded to float.
 *
 * Built at first use by shards/qblocks.py (cc -O3 -march=native -fopenmp -shared -fPIC).
 * The approach is llama.cpp's CPU one (ggml-cpu quants): each input row is quantized once
 * per call to int8 in blocks of 32 with a float scale (and the sum of its codes, for the
 * types with an offset); then each output is a sum over blocks of integer dot products
 * (AVX2 maddubs/madd, or AVX512-VNNI dpbusd where the CPU has it) times the two scales.
 * A plain C path does the same where there is no AVX2. OpenMP splits the output rows.
 *
 * Block layouts (GGML type ids; bytes little-endian; d, m, dmin fp16):
 *   Q4_0  2  32 w, 18 B: d, qs[16]                    w = (q - 8) d
 *   Q4_1  3  32 w, 20 B: d, m, qs[16]                 w = q d + m
 *   Q5_0  6  32 w, 22 B: d, qh[4], qs[16]             w = (q - 16) d
 *   Q5_1  7  32 w, 24 B: d, m, qh[4], qs[16]          w = q d + m
 *   Q8_0  8  32 w, 34 B: d, qs[32] (int8)             w = q d
 *   Q4_K 12 256 w, 144 B: d, dmin, sc/m[12], qs[128]  w = d sc_i q - dmin m_i (i: 32 w)
 *   Q5_K 13 256 w, 176 B: d, dmin, sc/m[12], qh[32], qs[128]
 *   Q6_K 14 256 w, 210 B: ql[128], qh[64], sc[16] (int8), d   w = d sc_i (q - 32) (i: 16 w)
 * In the 32-weight types qs[j] holds weight j (low nibble) and j + 16 (high), qh bit j
 * the fifth bit of weight j. The K-quants as ggml_blocks.py reads them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QB_AVX2 1
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static int block_info(int type, int *per, int *bytes) {
    switch (type) {
    case Q4_0: *per = 32; *bytes = 18; return 0;
    case Q4_1: *per = 32; *bytes = 20; return 0;
    case Q5_0: *per = 32; *bytes = 22; return 0;
    case Q5_1: *per = 32; *bytes = 24; return 0;
    case Q8_0: *per = 32; *bytes = 34; return 0;
    case Q4_K: *per = 256; *bytes = 144; return 0;
    case Q5_K: *per = 256; *bytes = 176; return 0;
    case Q6_K: *per = 256; *bytes = 210; return 0;
    }
    return -1;
}

static float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef QB_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    float f;
    if (e == 0) {
        f = (float)man * 5.9604644775390625e-8f; /* subnormal (or zero): man * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static void k_scale_min(const uint8_t *s, int i, int *sc, int *m) {  /* get_scale_min_k4 */
    if (i < 4) {
        *sc = s[i] & 63;
        *m = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 0x0F) | ((s[i - 4] >> 6) << 4);
        *m = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
}

/* Weights [32g, 32g + 32) of block b: codes q, w = q * s[j / 16] + z (s, z products in
 * float32 in the order shards/quant.py's dequantize_weight takes them). */
static void decode32(int type, const uint8_t *b, int g, int8_t *q, float *s, float *z) {
    int j, sc, m;
    uint32_t qh;
    *z = 0.0f;
    switch (type) {
    case Q4_0: case Q4_1: {
        const uint8_t *qs = b + (type == Q4_0 ? 2 : 4);
        for (j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[j + 16] = qs[j] >> 4; }
        s[0] = s[1] = f16(b);
        *z = type == Q4_0 ? -8.0f * s[0] : f16(b + 2);
        return;
    }
    case Q5_0: case Q5_1: {
        int off = type == Q5_0 ? 2 : 4;
        const uint8_t *qs = b + off + 4;
        memcpy(&qh, b + off, 4);
        for (j = 0; j < 16; j++) {
            q[j] = (int8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
            q[j + 16] = (int8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        s[0] = s[1] = f16(b);
        if (type == Q5_0) { for (j = 0; j < 32; j++) q[j] -= 16; }
        else *z = f16(b + 2);
        return;
    }
    case Q8_0:
        memcpy(q, b + 2, 32);
        s[0] = s[1] = f16(b);
        return;
    case Q4_K: case Q5_K: {
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + 32 * (g / 2);
        k_scale_min(b + 4, g, &sc, &m);
        for (j = 0; j < 32; j++) {
            int v = g & 1 ? qs[j] >> 4 : qs[j] & 15;
            if (type == Q5_K) v |= ((b[16 + j] >> g) & 1) << 4;
            q[j] = (int8_t)v;
        }
        s[0] = s[1] = f16(b) * (float)sc;
        *z = -(f16(b + 2) * (float)m);
        return;
    }
    case Q6_K: {
        int h = g / 4, k = g % 4;
        const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qhp = b + 128 + 32 * h;
        const int8_t *scp = (const int8_t *)(b + 192) + 8 * h + 2 * k;
        float d = f16(b + 208);
        for (j = 0; j < 32; j++) {
            int lo = k < 2 ? ql[j] & 15 : ql[j] >> 4;
            q[j] = (int8_t)((lo | (((qhp[j] >> (2 * k)) & 3) << 4)) - 32);
        }
        s[0] = d * (float)scp[0];
        s[1] = d * (float)scp[1];
        return;
    }
    }
}

/* -- the input rows: int8 blocks of 32 with a scale each ----------------------------------
 * One rounding keeps 7 bits of a block's largest value: the small values of a block that
 * holds an outlier (Gemma's residual stream has them) lose most of theirs. With ``two``
 * passes the rounding error is rounded again, on a grid d2 = d / 128, into a second set of
 * blocks (|q2| <= 64), and each dot product is taken against both and joined in integers
 * (128 p1 + p2, in units of d2): about 14 bits, for one more integer dot a block. */
typedef struct {
    const int8_t *q, *q2;  /* [K] codes; q2 NULL with one pass */
    const float *d, *d2;   /* [K / 32] scales */
    const float *sum;      /* [K / 32] the block's values summed as rounded (offset terms) */
    const int32_t *ls, *ls2; /* [K / 32 * 8] q's (q2's) codes summed in fours: a dpbusd lane's */
    const float *dv;       /* [K / 32 * 8] the scale the SIMD dots are in (d, or d2 with two passes),
                            * each 8 times: one load gives a block's (256-bit) or two adjacent
                            * blocks' (512-bit), where broadcasts and an insert a row cost a third
                            * of a drafted row's time. The same floats, so the same products. */
    /* With two passes on AVX-512 (qb_matmul fills these; NULL otherwise): */
    const int16_t *xw;     /* [K] both passes joined, 128 q + q2 (|.| <= 16383), a pair of blocks
                            * (64 values) as two halves of 32: a dword lane l of the first takes
                            * values 4l, 4l + 1, of the second 4l + 2, 4l + 3 (see acc_w2) */
    const int32_t *lsc;    /* [K / 4] 128 ls + ls2: xw summed in fours */
    const float *st;       /* the sums of the MT rows of this row's tile side by side: [K / 32][MT],
                            * read through the tile's first row (zeros past the last row) */
} xrow;

static float round_block(const float *x, int8_t *q, float *err) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
    for (int j = 0; j < 32; j++) {
        int v = (int)lrintf(x[j] * id);
        q[j] = (int8_t)v;
        if (err) err[j] = x[j] - (float)v * dd;
    }
    return dd;
}

static void quantize_row(const float *x, int64_t K, int8_t *q, int8_t *q2, float *d, float *d2, float *sum,
                         int32_t *ls, int32_t *ls2) {
    float err[32];
    for (int64_t b = 0; b < K / 32; b++) {
        int32_t s1 = 0, s2 = 0;
        d[b] = round_block(x + 32 * b, q + 32 * b, q2 ? err : NULL);
        for (int j = 0; j < 32; j++) s1 += q[32 * b + j];
        sum[b] = d[b] * (float)s1;
        if (q2) {
            float dd = d[b] / 128.0f, id = d[b] > 0.0f ? 128.0f / d[b] : 0.0f;
            for (int j = 0; j < 32; j++) {
                int v = (int)lrintf(err[j] * id);
                v = v > 127 ? 127 : v < -127 ? -127 : v;
                q2[32 * b + j] = (int8_t)v;
                s2 += v;
            }
            d2[b] = dd;
            sum[b] += dd * (float)s2;
        }
    }
    for (int64_t i = 0; i < K / 4; i++) {
        ls[i] = q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3];
        if (q2) ls2[i] = q2[4 * i] + q2[4 * i + 1] + q2[4 * i + 2] + q2[4 * i + 3];
    }
}

typedef void (*dot_rows_fn)(int type, const uint8_t *row, const xrow *x, int64_t M, int64_t K, float *out);

static inline int32_t idot16(const int8_t *a, const int8_t *b) {
    int32_t s = 0;
    for (int i = 0; i < 16; i++) s += a[i] * b[i];
    return s;
}

static float dot_scalar(int type, const uint8_t *row, const xrow *xr, int64_t K) {
    int per = 32, bytes = 0;
    block_info(type, &per, &bytes);
    float acc = 0.0f;
    int8_t q[32];
    float s[2], z;
    for (int64_t blk = 0; blk < K / per; blk++) {
        for (int g = 0; g < per / 32; g++) {
            int64_t j = blk * (per / 32) + g;
            const int8_t *x = xr->q + 32 * j;
            decode32(type, row + blk * bytes, g, q, s, &z);
            acc += xr->d[j] * (s[0] * (float)idot16(q, x) + s[1] * (float)idot16(q + 16, x + 16)) + z * xr->sum[j];
            if (xr->q2) {
                x = xr->q2 + 32 * j;
                acc += xr->d2[j] * (s[0] * (float)idot16(q, x) + s[1] * (float)idot16(q + 16, x + 16));
            }
        }
    }
    return acc;
}

static void dot_rows_scalar(int type, const uint8_t *row, const xrow *x, int64_t M, int64_t K, float *out) {
    for (int64_t m = 0; m < M; m++) out[m] = dot_scalar(type, row, &x[m], K);
}

#ifdef QB_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* unsigned u (0..255) . signed x, int32 lanes of 4 bytes each (lanes 0-3: bytes 0-15) */
static inline __m256i dot_us(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* signed w . signed x: |w| . (x with w's sign) */
static inline __m256i dot_ss(__m256i w, __m256i x) {
    return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline __m256i nibbles32(const uint8_t *qs) {  /* qs[16] -> weights 0..31 */
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

static inline __m256i high_bits32(const uint8_t *p) {  /* byte j = 16 where bit j of *p is set */
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(t, bit), _mm256_set1_epi8(16));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* acc += sw * (x block j . w) (both passes, joined: 128 p1 + p2 in units of d2 = d / 128):
 * w signed (ss), or unsigned (us) */
static inline __m256 acc_ss(__m256 acc, __m256i w, const xrow *x, int64_t j, __m256 sw) {
    __m256i aw = _mm256_sign_epi8(w, w);
    __m256i p = dot_us(aw, _mm256_sign_epi8(load32(x->q + 32 * j), w));
    if (x->q2) p = _mm256_add_epi32(_mm256_slli_epi32(p, 7), dot_us(aw, _mm256_sign_epi8(load32(x->q2 + 32 * j), w)));
    return _mm256_fmadd_ps(_mm256_mul_ps(sw, _mm256_loadu_ps(x->dv + 8 * j)), _mm256_cvtepi32_ps(p), acc);
}

static inline __m256 acc_us(__m256 acc, __m256i u, const xrow *x, int64_t j, __m256 sw) {
    __m256i p = dot_us(u, load32(x->q + 32 * j));
    if (x->q2) p = _mm256_add_epi32(_mm256_slli_epi32(p, 7), dot_us(u, load32(x->q2 + 32 * j)));
    return _mm256_fmadd_ps(_mm256_mul_ps(sw, _mm256_loadu_ps(x->dv + 8 * j)), _mm256_cvtepi32_ps(p), acc);
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QB_512 1
/* Two blocks of 32 in one 512-bit register (llama.cpp's AVX2 width doubled): blocks j and
 * j + 1 of the input are adjacent, so one load takes both. */
static inline __m512 pair_ps(__m256 a, __m256 b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

static inline __m512i pair_si(__m256i a, __m256i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

/* Two passes in one integer dot (vpdpwssd on int16), not two dpbusd joined by a shift and an
 * add a row: the weights widened to int16 once for all the tile's rows, each row's 128 q + q2
 * read as it is. A dword lane sums the same four products as dpbusd's lane (values 4l..4l+3:
 * the first half's pair, then the second's), in exact integers, so the same int32 as before:
 * the same floats after. A drafted row's dots cost about half (measured in the commit). */
static inline __m512i lanes_lo(__m512i u) {  /* bytes 4l, 4l + 1 of each dword -> int16, zero-extended */
    return _mm512_shuffle_epi8(u, _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1)));
}
static inline __m512i lanes_hi(__m512i u) {  /* bytes 4l + 2, 4l + 3 */
    return _mm512_shuffle_epi8(u, _mm512_broadcast_i32x4(
        _mm_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1)));
}
static inline __m512i signed_lo(__m512i w) {  /* as lanes_lo, sign-extended: the byte to a word's top, shifted back */
    return _mm512_srai_epi16(_mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(
        _mm_setr_epi8(-1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13))), 8);
}
static inline __m512i signed_hi(__m512i w) {
    return _mm512_srai_epi16(_mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(
        _mm_setr_epi8(-1, 2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15))), 8);
}

/* acc += sw * (x blocks j, j + 1 . w), two passes, w widened ([lo | hi] of lanes_lo/hi);
 * ``shift``: codes offset by 2^shift, taken off in integers as acc_off2 does (0: none). */
static inline __m512 acc_w2(__m512 acc, __m512i lo, __m512i hi, const xrow *x, int64_t j, __m512 sw,
                            const int shift) {
    __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(x->xw + 32 * j)));
    p = _mm512_dpwssd_epi32(p, hi, _mm512_loadu_si512((const void *)(x->xw + 32 * j + 32)));
    if (shift) p = _mm512_sub_epi32(p, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->lsc + 8 * j)), shift));
    return _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_loadu_ps(x->dv + 8 * j)), _mm512_cvtepi32_ps(p), acc);
}

/* acc += sw * (x blocks j, j + 1 . w), w signed [block j | block j + 1]; as acc_ss */
static inline __m512 acc_ss2(__m512 acc, __m512i w, const xrow *x, int64_t j, __m512 sw) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i aw = _mm512_abs_epi8(w);
    __mmask64 neg = _mm512_movepi8_mask(w);
    __m512i xv = _mm512_loadu_si512((const void *)(x->q + 32 * j));
    __m512i p = _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(xv, neg, zero, xv));
    if (x->q2) {
        xv = _mm512_loadu_si512((const void *)(x->q2 + 32 * j));
        p = _mm512_add_epi32(_mm512_slli_epi32(p, 7), _mm512_dpbusd_epi32(zero, aw, _mm512_mask_sub_epi8(xv, neg, zero, xv)));
    }
    return _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_loadu_ps(x->dv + 8 * j)), _mm512_cvtepi32_ps(p), acc);
}
/* acc += sw * (x blocks j, j + 1 . (u - 2^shift)), u unsigned: the offset taken off each
 * dpbusd lane in integers (the input's codes summed in the same fours), so the weights need
 * no sign tricks (Q5_0: codes 0..31 less 16, Q6_K: 0..63 less 32). Exact: the same sums as
 * acc_ss2's, 7-15% less time on Q5_0 at M=1. */
static inline __m512 acc_off2(__m512 acc, __m512i u, const xrow *x, int64_t j, __m512 sw, int shift) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i p = _mm512_dpbusd_epi32(zero, u, _mm512_loadu_si512((const void *)(x->q + 32 * j)));
    p = _mm512_sub_epi32(p, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->ls + 8 * j)), shift));
    if (x->q2) {
        __m512i p2 = _mm512_dpbusd_epi32(zero, u, _mm512_loadu_si512((const void *)(x->q2 + 32 * j)));
        p2 = _mm512_sub_epi32(p2, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->ls2 + 8 * j)), shift));
        p = _mm512_add_epi32(_mm512_slli_epi32(p, 7), p2);
    }
    return _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_loadu_ps(x->dv + 8 * j)), _mm512_cvtepi32_ps(p), acc);
}

/* acc += sw * (x blocks j, j + 1 . u), u unsigned codes with no offset (Q4_1: its minimum
 * is added apart, as a zero times the input block's sum) */
static inline __m512 acc_us2(__m512 acc, __m512i u, const xrow *x, int64_t j, __m512 sw) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i p = _mm512_dpbusd_epi32(zero, u, _mm512_loadu_si512((const void *)(x->q + 32 * j)));
    if (x->q2) p = _mm512_add_epi32(_mm512_slli_epi32(p, 7),
                                  _mm512_dpbusd_epi32(zero, u, _mm512_loadu_si512((const void *)(x->q2 + 32 * j))));
    return _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_loadu_ps(x->dv + 8 * j)), _mm512_cvtepi32_ps(p), acc);
}

/* A Q5_0 / Q5_1 block's codes 0..31 (qh at b, qs at b + 4): the fifth bits added as a mask. */
static inline __m256i q5_codes(const uint8_t *b) {
    uint32_t qh;
    memcpy(&qh, b, 4);
    __m256i nib = nibbles32(b + 4);
    return _mm256_mask_add_epi8(nib, (__mmask32)qh, nib, _mm256_set1_epi8(16));
}

/* Q5_0 blocks i and i + 1 of a row: their codes 0..31 (u) and scales (s), side by side. */
static inline void q5_0_pair(const uint8_t *row, int64_t i, __m512i *u, __m512 *s) {
    const uint8_t *b0 = row + 22 * i, *b1 = b0 + 22;
    *u = pair_si(q5_codes(b0 + 2), q5_codes(b1 + 2));
    *s = pair_ps(_mm256_set1_ps(f16(b0)), _mm256_set1_ps(f16(b1)));
}
#endif

/* out[r] = row . x[r] for r < mt: each weight block is decoded once for mt input rows
 * (a prefill's), with two accumulators a row so that consecutive blocks do not wait on
 * each other's FMA. Inlined with mt a constant (1 to MT) so the accumulators stay in registers.
 * ``wide`` (a constant too): two passes joined in int16 (acc_w2, x->xw), for the types that
 * have it (wide_type); the other types' code is left out of those copies. */
#define MT 8
static inline __attribute__((always_inline)) void dot_tile(int type, const uint8_t *row, const xrow *x, int64_t K,
                                                           float *out, const int mt, const int wide) {
    __m256 acc[2][MT];
    float accz[MT];
    for (int r = 0; r < mt; r++) { acc[0][r] = acc[1][r] = _mm256_setzero_ps(); accz[r] = 0.0f; }
#ifdef QB_512
    __m512 acc5[MT];
    for (int r = 0; r < mt; r++) acc5[r] = _mm512_setzero_ps();
    __m256 zv = _mm256_setzero_ps();  /* accz of the tile's rows as lanes (x->st), where wide */
#define ZV_OUT() do { float z_[MT]; _mm256_storeu_ps(z_, zv); for (int r = 0; r < mt; r++) accz[r] = z_[r]; } while (0)
#endif
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    switch (type) {
    /* blocks of 32 two at a time, block i into acc[A] (A a constant: registers, not memory) */
#define PAIRS(STEP) do { int64_t i = 0; \
        for (; i + 1 < K / 32; i += 2) { STEP(i, 0); STEP(i + 1, 1); } \
        if (i < K / 32) STEP(i, 0); } while (0)
    /* block I's signed weights (W) and scale (S), for the types whose blocks are just those */
#define Q8_0_W(I) load32(row + 34 * (I) + 2)
#define Q8_0_S(I) _mm256_set1_ps(f16(row + 34 * (I)))
#define Q5_0_W(I) _mm256_sub_epi8(_mm256_or_si256(nibbles32(row + 22 * (I) + 6), high_bits32(row + 22 * (I) + 2)), \
                                  _mm256_set1_epi8(16))
#define Q5_0_S(I) _mm256_set1_ps(f16(row + 22 * (I)))
#define SS_STEP(W, S, I, A) do { __m256i w = W(I); __m256 s = S(I); \
        for (int r = 0; r < mt; r++) acc[A][r] = acc_ss(acc[A][r], w, &x[r], (I), s); } while (0)
#define Q8_0_STEP(I, A) SS_STEP(Q8_0_W, Q8_0_S, I, A)
#define Q5_0_STEP(I, A) SS_STEP(Q5_0_W, Q5_0_S, I, A)
#define Q4_0_W(I) _mm256_sub_epi8(nibbles32(row + 18 * (I) + 2), _mm256_set1_epi8(8))
#define Q4_0_S(I) _mm256_set1_ps(f16(row + 18 * (I)))
#define Q4_0_STEP(I, A) SS_STEP(Q4_0_W, Q4_0_S, I, A)
#define Q4_1_STEP(I, A) do { const uint8_t *b = row + 20 * (I); \
        __m256i u = nibbles32(b + 4); \
        __m256 s = _mm256_set1_ps(f16(b)); float z = f16(b + 2); \
        for (int r = 0; r < mt; r++) { acc[A][r] = acc_us(acc[A][r], u, &x[r], (I), s); \
                                        accz[r] += z * x[r].sum[(I)]; } } while (0)
#define Q5_1_STEP(I, A) do { const uint8_t *b = row + 24 * (I); \
        __m256i u = _mm256_or_si256(nibbles32(b + 8), high_bits32(b + 4)); \
        __m256 s = _mm256_set1_ps(f16(b)); float z = f16(b + 2); \
        for (int r = 0; r < mt; r++) { acc[A][r] = acc_us(acc[A][r], u, &x[r], (I), s); \
                                        accz[r] += z * x[r].sum[(I)]; } } while (0)
#ifdef QB_512
    /* acc5 += (u - 2^SH) . x for blocks I, I + 1, u unsigned codes: two passes widened once */
#define OFF2_STEP(U, S, I, SH) do { \
        if (wide) { __m512i lo = lanes_lo(U), hi = lanes_hi(U); \
            for (int r = 0; r < mt; r++) acc5[r] = acc_w2(acc5[r], lo, hi, &x[r], (I), (S), (SH)); } \
        else for (int r = 0; r < mt; r++) acc5[r] = acc_off2(acc5[r], (U), &x[r], (I), (S), (SH)); } while (0)
    /* two blocks a 512-bit register; an odd last block on its own */
    case Q8_0: {  /* signed: the sign tricks (measured: offsets in integers were 20% slower here) */
        int64_t i = 0;
        for (; i + 1 < K / 32; i += 2) {
            __m512i w = pair_si(Q8_0_W(i), Q8_0_W(i + 1));
            __m512 s = pair_ps(Q8_0_S(i), Q8_0_S(i + 1));
            if (wide) {
                __m512i lo = signed_lo(w), hi = signed_hi(w);
                for (int r = 0; r < mt; r++) acc5[r] = acc_w2(acc5[r], lo, hi, &x[r], i, s, 0);
            } else
                for (int r = 0; r < mt; r++) acc5[r] = acc_ss2(acc5[r], w, &x[r], i, s);
        }
        if (i < K / 32) Q8_0_STEP(i, 0);
        break;
    }
    case Q5_0: {  /* codes 0..31, the 16 taken off in integers */
        int64_t i = 0;
        for (; i + 1 < K / 32; i += 2) {
            __m512i u;
            __m512 s;
            q5_0_pair(row, i, &u, &s);
            OFF2_STEP(u, s, i, 4);
        }
        if (i < K / 32) Q5_0_STEP(i, 0);
        break;
    }
    case Q4_0: {  /* codes 0..15, the 8 taken off in integers */
        int64_t i = 0;
        for (; i + 1 < K / 32; i += 2) {
            const uint8_t *b0 = row + 18 * i, *b1 = b0 + 18;
            __m512i u = pair_si(nibbles32(b0 + 2), nibbles32(b1 + 2));
            __m512 s = pair_ps(_mm256_set1_ps(f16(b0)), _mm256_set1_ps(f16(b1)));
            OFF2_STEP(u, s, i, 3);
        }
        if (i < K / 32) Q4_0_STEP(i, 0);
        break;
    }
    case Q4_1: {
        int64_t i = 0;
        for (; i + 1 < K / 32; i += 2) {
            const uint8_t *b0 = row + 20 * i, *b1 = b0 + 20;
            __m512i u = pair_si(nibbles32(b0 + 4), nibbles32(b1 + 4));
            __m512 s = pair_ps(_mm256_set1_ps(f16(b0)), _mm256_set1_ps(f16(b1)));
            float z0 = f16(b0 + 2), z1 = f16(b1 + 2);
            if (wide) {
                __m512i lo = lanes_lo(u), hi = lanes_hi(u);
                for (int r = 0; r < mt; r++) acc5[r] = acc_w2(acc5[r], lo, hi, &x[r], i, s, 0);
                /* the minimum's terms of the tile's rows side by side: each lane the same
                 * operations as accz[r] += z0 * sum[i] + z1 * sum[i + 1] */
                zv = _mm256_add_ps(zv, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(z0), _mm256_loadu_ps(x->st + MT * i)),
                                                     _mm256_mul_ps(_mm256_set1_ps(z1), _mm256_loadu_ps(x->st + MT * i + MT))));
            } else
                for (int r = 0; r < mt; r++) {
                    acc5[r] = acc_us2(acc5[r], u, &x[r], i, s);
                    accz[r] += z0 * x[r].sum[i] + z1 * x[r].sum[i + 1];
                }
        }
        if (wide) ZV_OUT();
        if (i < K / 32) Q4_1_STEP(i, 0);
        break;
    }
#else
    case Q8_0: PAIRS(Q8_0_STEP); break;
    case Q5_0: PAIRS(Q5_0_STEP); break;
    case Q4_0: PAIRS(Q4_0_STEP); break;
    case Q4_1: PAIRS(Q4_1_STEP); break;
#endif
    case Q5_1: if (!wide) PAIRS(Q5_1_STEP); break;
    case Q6_K:
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *b = row + 210 * sb;
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = f16(b + 208);
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; h++) {
                __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32), hh = load32(b + 128 + 32 * h);
                __m256i c[4];
                c[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30));
                c[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30));
                c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hh, m30));
                c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30));
#ifdef QB_512
                _Pragma("GCC unroll 2")
                for (int k = 0; k < 4; k += 2) {  /* groups k, k + 1: adjacent input blocks */
                    int64_t j = 8 * sb + 4 * h + k;
                    const int8_t *q = sc + 8 * h + 2 * k;
                    __m256 sa = _mm256_setr_ps(d * q[0], d * q[0], d * q[0], d * q[0], d * q[1], d * q[1], d * q[1], d * q[1]);
                    __m256 sb_ = _mm256_setr_ps(d * q[2], d * q[2], d * q[2], d * q[2], d * q[3], d * q[3], d * q[3], d * q[3]);
                    __m512i u = pair_si(c[k], c[k + 1]);  /* codes 0..63, the 32 taken off in integers */
                    __m512 s_ = pair_ps(sa, sb_);
                    OFF2_STEP(u, s_, j, 5);
                }
#else
                _Pragma("GCC unroll 4")
                for (int k = 0; k < 4; k++) {
                    int64_t j = 8 * sb + 4 * h + k;
                    float s0 = d * (float)sc[8 * h + 2 * k], s1 = d * (float)sc[8 * h + 2 * k + 1];
                    __m256 s = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                    __m256i w = _mm256_sub_epi8(c[k], _mm256_set1_epi8(32));
                    for (int r = 0; r < mt; r++) acc[k & 1][r] = acc_ss(acc[k & 1][r], w, &x[r], j, s);
                }
#endif
            }
        }
        break;
    case Q4_K: case Q5_K:
        for (int64_t sb = 0; sb < K / 256 && !wide; sb++) {
            const uint8_t *b = row + (type == Q4_K ? 144 : 176) * sb;
            const uint8_t *qs = b + (type == Q4_K ? 16 : 48);
            float d = f16(b), dmin = f16(b + 2);
            __m256i hh = type == Q5_K ? load32(b + 16) : _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int g = 0; g < 8; g++) {
                int64_t j = 8 * sb + g;
                int sc, m;
                k_scale_min(b + 4, g, &sc, &m);
                __m256i q = load32(qs + 32 * (g / 2));
                __m256i u = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(q, 4) : q, m4);
                if (type == Q5_K)  /* bit g of qh byte l -> bit 4 of weight l */
                    u = _mm256_or_si256(u, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hh, g), 4),
                                                            _mm256_set1_epi8(16)));
                __m256 s = _mm256_set1_ps(d * (float)sc);
                float zm = dmin * (float)m;
                for (int r = 0; r < mt; r++) {
                    acc[g & 1][r] = acc_us(acc[g & 1][r], u, &x[r], j, s);
                    accz[r] -= zm * x[r].sum[j];
                }
            }
        }
        break;
    default:
        for (int r = 0; r < mt && !wide; r++) out[r] = dot_scalar(type, row, &x[r], K);
        return;
    }
    for (int r = 0; r < mt; r++) {
        out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + accz[r];
#ifdef QB_512
        out[r] += _mm512_reduce_add_ps(acc5[r]);
#endif
    }
}

#ifdef QB_512
static inline int wide_type(int type) {
    return type == Q8_0 || type == Q5_0 || type == Q4_0 || type == Q4_1 || type == Q6_K;
}
#endif

static void dot_rows_avx2(int type, const uint8_t *row, const xrow *x, int64_t M, int64_t K, float *out) {
    int64_t m = 0;
#ifdef QB_512
    if (x->xw) {  /* qb_matmul prepared the rows for the int16 tiles: two passes, M >= 2, a wide type */
        /* Tiles of 8: a decode row with up to 7 drafted rows reads the weights from memory
         * once (as 4 + 1 a 5-row step read them twice: the lone row cost a decode step). A
         * lone last row keeps the two dpbusd (the shuffles cost a single row 5%). */
        for (; m + MT <= M; m += MT) dot_tile(type, row, x + m, K, out + m, MT, 1);
        switch (M - m) {
        case 7: dot_tile(type, row, x + m, K, out + m, 7, 1); break;
        case 6: dot_tile(type, row, x + m, K, out + m, 6, 1); break;
        case 5: dot_tile(type, row, x + m, K, out + m, 5, 1); break;
        case 4: dot_tile(type, row, x + m, K, out + m, 4, 1); break;
        case 3: dot_tile(type, row, x + m, K, out + m, 3, 1); break;
        case 2: dot_tile(type, row, x + m, K, out + m, 2, 1); break;
        case 1: dot_tile(type, row, x + m, K, out + m, 1, 0); break;
        default: break;
        }
        return;
    }
#endif
    for (; m + 4 <= M; m += 4) dot_tile(type, row, x + m, K, out + m, 4, 0);
    /* The rest in one tile, not row by row: a decode row with 1-2 drafted rows beside it
     * decoded each weight block once per row (3 rows cost 2.8x one). A row's sums are the
     * same operations in the same order whatever the tile (no FMA contraction: -ffp-contract=off). */
    switch (M - m) {
    case 3: dot_tile(type, row, x + m, K, out + m, 3, 0); break;
    case 2: dot_tile(type, row, x + m, K, out + m, 2, 0); break;
    case 1: dot_tile(type, row, x + m, K, out + m, 1, 0); break;
    default: break;
    }
}
#endif

#ifdef QB_512
/* Q5_0 rows a and b against one input row (a decode step, M = 1), K / 32 even: each load of
 * the input's codes, lane sums and scales serves both rows. acc_off2's steps, written out
 * once for two rows (two calls of it measured 5-8% slower: the compiler reloads the input
 * for the second); the same operations in the same order, so the same bits. */
static void dot2_q5_0(const uint8_t *ra, const uint8_t *rb, const xrow *x, int64_t K, float *out) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
    for (int64_t i = 0; i + 1 < K / 32; i += 2) {
        __m512i xv = _mm512_loadu_si512((const void *)(x->q + 32 * i));
        __m512i ls = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->ls + 8 * i)), 4);
        __m512 dx = _mm512_loadu_ps(x->dv + 8 * i);
        __m512i xv2 = zero, ls2 = zero;
        if (x->q2) {
            xv2 = _mm512_loadu_si512((const void *)(x->q2 + 32 * i));
            ls2 = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(x->ls2 + 8 * i)), 4);
        }
#define Q5_0_ROW2(R, ACC) do { \
            __m512i u; \
            __m512 s; \
            q5_0_pair((R), i, &u, &s); \
            __m512i p = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, u, xv), ls); \
            if (x->q2) \
                p = _mm512_add_epi32(_mm512_slli_epi32(p, 7), _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, u, xv2), ls2)); \
            ACC = _mm512_fmadd_ps(_mm512_mul_ps(s, dx), _mm512_cvtepi32_ps(p), ACC); } while (0)
        Q5_0_ROW2(ra, acc_a);
        Q5_0_ROW2(rb, acc_b);
#undef Q5_0_ROW2
    }
    out[0] = 0.0f + _mm512_reduce_add_ps(acc_a);  /* (dot_tile adds its empty 256-bit part, +0) */
    out[1] = 0.0f + _mm512_reduce_add_ps(acc_b);
}
#endif

#ifdef QB_512
/* quantize_row's values, 32 at a time (it was 5 us of a K = 576 decode call's 6: libm's
 * lrintf, one value at a time). The same operations on each value: the product rounded to
 * nearest even (lrintf's mode), the error as a product then a difference (no FMA), the int8
 * codes by truncation as the cast, integer sums in any order; so the same codes and scales. */
static void quantize_row_512(const float *x, int64_t K, int8_t *q, int8_t *q2, float *d, float *d2, float *sum,
                             int32_t *ls, int32_t *ls2) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
        float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
        __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(v0));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(v1));
        d[b] = dd;
        sum[b] = dd * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
        if (q2) {
            const __m512 vd = _mm512_set1_ps(dd);
            float d2b = dd / 128.0f, id2 = dd > 0.0f ? 128.0f / dd : 0.0f;
            __m512 e0 = _mm512_sub_ps(x0, _mm512_mul_ps(_mm512_cvtepi32_ps(v0), vd));
            __m512 e1 = _mm512_sub_ps(x1, _mm512_mul_ps(_mm512_cvtepi32_ps(v1), vd));
            __m512i w0 = _mm512_cvtps_epi32(_mm512_mul_ps(e0, _mm512_set1_ps(id2)));
            __m512i w1 = _mm512_cvtps_epi32(_mm512_mul_ps(e1, _mm512_set1_ps(id2)));
            w0 = _mm512_min_epi32(_mm512_max_epi32(w0, lo), hi);
            w1 = _mm512_min_epi32(_mm512_max_epi32(w1, lo), hi);
            _mm_storeu_si128((__m128i *)(q2 + 32 * b), _mm512_cvtepi32_epi8(w0));
            _mm_storeu_si128((__m128i *)(q2 + 32 * b + 16), _mm512_cvtepi32_epi8(w1));
            d2[b] = d2b;
            sum[b] += d2b * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(w0, w1));
        }
    }
    /* the codes summed in fours: a dpbusd of ones against them, 64 codes (16 sums) a step */
    for (int64_t i = 0; i < K; i += 64) {
        __mmask64 m = K - i >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - i)) - 1;
        __mmask16 m4 = K - i >= 64 ? (__mmask16)0xffff : (__mmask16)(((unsigned)1 << ((K - i) / 4)) - 1);
        __m512i z = _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(ls + i / 4, m4, _mm512_dpbusd_epi32(z, ones, _mm512_maskz_loadu_epi8(m, q + i)));
        if (q2)
            _mm512_mask_storeu_epi32(ls2 + i / 4, m4, _mm512_dpbusd_epi32(z, ones, _mm512_maskz_loadu_epi8(m, q2 + i)));
    }
}
#endif

static void quantize(const float *x, int64_t K, int8_t *q, int8_t *q2, float *d, float *d2, float *sum,
                     int32_t *ls, int32_t *ls2, int simd) {
#ifdef QB_512
    if (simd) { quantize_row_512(x, K, q, q2, d, d2, sum, ls, ls2); return; }
#endif
    (void)simd;
    quantize_row(x, K, q, q2, d, d2, sum, ls, ls2);
}

/* One row x [K] as the kernels take it, for tests: codes q [2K] (the second pass after the
 * first), floats f [3 K / 32] (scales, second scales, sums), lane sums ls [K / 2]; simd 0 the
 * plain C. 0, or -1 for a K not a multiple of 32. */
int qb_quantize(const float *x, int64_t K, int two, int simd, int8_t *q, float *f, int32_t *ls) {
    if (K % 32 || K <= 0) return -1;
    quantize(x, K, q, two ? q + K : NULL, f, f + K / 32, f + 2 * K / 32, ls, ls + K / 4, simd);
    return 0;
}

/* 3: AVX-512 VNNI, two blocks a register (Q8_0, Q5_0, Q6_K), 2: AVX2 with AVX512-VNNI's dot,
 * 1: AVX2, 0: plain C */
int qb_simd(void) {
#if defined(QB_AVX2) && defined(QB_512)
    return 3;
#elif defined(QB_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#elif defined(QB_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Ask for the weight row AHEAD bytes on while this one is summed: a decode step streams
 * every weight from memory once, and the hardware's own prefetch fell behind (SmolLM2 Q4_1,
 * one thread: the 30 layers' linears 24 ms a token without this, 14-15 ms with it; 1 KB
 * ahead 17 ms, 4-8 KB the same). A prefetch never faults, so past W's end is harmless. */
#define AHEAD 4096
static inline void read_ahead(const uint8_t *row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + AHEAD + o, 0, 3);
}

#define SMALL_M 64  /* up to this many input rows, no [N, M] buffer (qb_matmul) */
#define SMALL_N 64  /* weight rows whose outputs are moved to y together */
#define BIG_MN (1 << 18)  /* ... where the [N, M] buffer would hold this many floats (1 MB) */

/* y [M, N] (row stride ldy) = x [M, K] W^T, W [N] rows of K / per blocks; ``two``: round
 * the input twice (see xrow). 0, or -1 for a type or K it cannot run, -2 out of memory. */
int qb_matmul(int type, const uint8_t *W, int64_t N, int64_t K, const float *x, int64_t M, float *y,
              int64_t ldy, int threads, int scalar, int two) {
    int per, bytes;
    if (block_info(type, &per, &bytes) || K % per || N < 0 || M < 0) return -1;
    int64_t nb = K / 32, row_bytes = K / per * bytes;
    int8_t *xq = malloc((size_t)(2 * M * K) + 64);
    float *xf = malloc(sizeof(float) * (size_t)(3 * M * nb) + 64);
    xrow *xr = malloc(sizeof(xrow) * (size_t)(M + 1));
    int32_t *xl = malloc(sizeof(int32_t) * (size_t)(2 * M * (K / 4)) + 64);
    float *xv = malloc(sizeof(float) * (size_t)(8 * M * nb) + 64);
    int wide = 0;  /* the two passes joined in int16 (xrow's xw, lsc, st): the int16 tiles run */
#ifdef QB_512
    wide = two && !scalar && M >= 2 && wide_type(type);  /* (a decode step's lone row never does) */
#endif
    int16_t *xw = wide ? malloc(sizeof(int16_t) * (size_t)(M * K) + 64) : NULL;
    int32_t *xc = wide ? malloc(sizeof(int32_t) * (size_t)(M * (K / 4)) + 64) : NULL;
    float *xs = wide ? calloc((size_t)((M + MT - 1) / MT * MT * nb) + 16, sizeof(float)) : NULL;
    if (!xq || !xf || !xr || !xl || !xv || (wide && (!xw || !xc || !xs))) {
        free(xq); free(xf); free(xr); free(xl); free(xv); free(xw); free(xc); free(xs);
        return -2;
    }
    for (int64_t m = 0; m < M; m++) {
        int8_t *q = xq + 2 * m * K, *q2 = two ? q + K : NULL;
        float *d = xf + 3 * m * nb, *dv = xv + 8 * m * nb;
        int32_t *ls = xl + 2 * m * (K / 4);
        quantize(x + m * K, K, q, q2, d, d + nb, d + 2 * nb, ls, ls + K / 4, !scalar);
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < 8; l++) dv[8 * b + l] = two ? d[nb + b] : d[b];
        xr[m] = (xrow){q, q2, d, d + nb, d + 2 * nb, ls, ls + K / 4, dv, NULL, NULL, NULL};
        if (wide) {
            int16_t *w = xw + m * K;
            int32_t *c = xc + m * (K / 4);
            float *st = xs + m / MT * MT * nb;
            for (int64_t p = 0; p + 64 <= K; p += 64)  /* whole pairs of blocks; an odd last one runs on q, q2 */
                for (int l = 0; l < 16; l++)
                    for (int e = 0; e < 2; e++) {
                        w[p + 2 * l + e] = (int16_t)(128 * q[p + 4 * l + e] + q2[p + 4 * l + e]);
                        w[p + 32 + 2 * l + e] = (int16_t)(128 * q[p + 4 * l + 2 + e] + q2[p + 4 * l + 2 + e]);
                    }
            for (int64_t i = 0; i < K / 4; i++) c[i] = 128 * ls[i] + ls[K / 4 + i];
            for (int64_t b = 0; b < nb; b++) st[MT * b + m % MT] = d[2 * nb + b];
            xr[m].xw = w;
            xr[m].lsc = c;
            xr[m].st = st;
        }
    }
    dot_rows_fn dot = dot_rows_scalar;
#ifdef QB_AVX2
    if (!scalar) dot = dot_rows_avx2;
#endif
    (void)threads;
    if (M > 1 && M <= SMALL_M && M * N >= BIG_MN) {
        /* A decode batch through a wide linear (a head): each run of weight rows' outputs goes
         * from a buffer on the stack straight to their rows of y, not through an [N, M] buffer
         * and a transposing pass over it (a head's N x M floats are megabytes: out of cache
         * twice). Narrower linears keep the buffer: their 64-row runs split unevenly over
         * threads (measured 7-23% slower at 2 threads, N 192-1536). Same dots, same bits. */
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n0 = 0; n0 < N; n0 += SMALL_N) {
            float out[SMALL_N * SMALL_M];
            int64_t nn = N - n0 < SMALL_N ? N - n0 : SMALL_N;
            for (int64_t j = 0; j < nn; j++) {
                read_ahead(W + (n0 + j) * row_bytes, row_bytes);
                dot(type, W + (n0 + j) * row_bytes, xr, M, K, out + j * M);
            }
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < nn; j++) y[m * ldy + n0 + j] = out[j * M + m];
        }
        free(xq); free(xf); free(xr); free(xl); free(xv); free(xw); free(xc); free(xs);
        return 0;
    }
    float *yt = malloc(sizeof(float) * (size_t)(M * N) + 64);  /* [N, M]: each row's outputs together */
    if (!yt) { free(xq); free(xf); free(xr); free(xl); free(xv); free(xw); free(xc); free(xs); return -2; }
    int two_rows = 0;  /* a decode step's Q5_0: two weight rows a pass (dot2_q5_0) */
#ifdef QB_512
    two_rows = !scalar && type == Q5_0 && M == 1 && (K / 32) % 2 == 0;
#endif
    if (two_rows) {
#ifdef QB_512
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n = 0; n < N - 1; n += 2) {
            read_ahead(W + n * row_bytes, 2 * row_bytes);
            dot2_q5_0(W + n * row_bytes, W + (n + 1) * row_bytes, xr, K, yt + n);
        }
        if (N % 2) dot(type, W + (N - 1) * row_bytes, xr, M, K, yt + N - 1);
#endif
    } else {
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n = 0; n < N; n++) {
            read_ahead(W + n * row_bytes, row_bytes);
            dot(type, W + n * row_bytes, xr, M, K, yt + n * M);
        }
    }
    if (M == 1) memcpy(y, yt, sizeof(float) * (size_t)N);
    else
        for (int64_t n = 0; n < N; n++)
            for (int64_t m = 0; m < M; m++) y[m * ldy + n] = yt[n * M + m];
    free(xq); free(xf); free(xr); free(xl); free(xv); free(xw); free(xc); free(xs); free(yt);
    return 0;
}

/* out [T, K] float32: rows ids of W dequantized, bit for bit as dequantize_weight gives them. */
int qb_rows(int type, const uint8_t *W, int64_t K, const int64_t *ids, int64_t T, float *out) {
    int per, bytes;
    if (block_info(type, &per, &bytes) || K % per) return -1;
    int64_t row_bytes = K / per * bytes;
    int8_t q[32];
    float s[2], z;
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *row = W + ids[t] * row_bytes;
        float *o = out + t * K;
        for (int64_t blk = 0; blk < K / per; blk++)
            for (int g = 0; g < per / 32; g++) {
                decode32(type, row + blk * bytes, g, q, s, &z);
                for (int i = 0; i < 32; i++) {
                    float w = (float)q[i] * s[i / 16];
                    o[blk * per + 32 * g + i] = z != 0.0f ? w + z : w;
                }
            }
    }
    return 0;
}

/* -- float weights, every output summed in one order ------------------------------------
 *
 * y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W [N, K] float32, or
 * bf16 when w_bf16. torch's CPU GEMM sums an output in an order that depends on M (MKL
 * blocks K differently for a decode row, a batch and a prompt's chunk): the same row gave
 * other last bits with others beside it, so a replay, a cached prefix or a draft could
 * continue differently. Here output (m, n) is, whatever M, the tile or the thread: 16 lane
 * sums, lane l over k = l, l + 16, ... in order, each step one fused multiply-add (fmaf:
 * one rounding, the same on every path; element-wise, so vectorising cannot reorder them);
 * then the lanes in one fixed tree; then the last K % 16 terms in order; then the bias. Tiles of DM rows
 * by DN outputs keep the sums in registers; OpenMP splits the outputs. */
#define DL 16
#define DM 4
#define DN 4

static inline float lanes_sum(const float *a) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float w_at(const void *W, int w_bf16, int64_t i) {
    if (!w_bf16) return ((const float *)W)[i];
    uint32_t u = (uint32_t)((const uint16_t *)W)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Outputs n0..n0+nt of rows x[0..mt) (mt <= DM, nt <= DN). Inlined with constant mt and nt
 * for whole tiles (then unrolled into registers), with the actual ones at the edges: the
 * same operations on each output either way. */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int64_t ldx, int mt, const void *W,
                                                             int w_bf16, int64_t n0, int nt, int64_t K,
                                                             const float *bias, float *y, int64_t ldy) {
    float acc[DM][DN][DL];
    float wt[DN][DL];
    memset(acc, 0, sizeof(acc));
    int64_t k16 = K - K % DL;
    for (int64_t k = 0; k < k16; k += DL) {
        for (int j = 0; j < nt; j++) {
#pragma omp simd
            for (int l = 0; l < DL; l++) wt[j][l] = w_at(W, w_bf16, (n0 + j) * K + k + l);
        }
        for (int i = 0; i < mt; i++) {
            const float *xi = x + i * ldx + k;
            for (int j = 0; j < nt; j++) {
#pragma omp simd
                for (int l = 0; l < DL; l++) acc[i][j][l] = fmaf(xi[l], wt[j][l], acc[i][j][l]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) {
            float s = lanes_sum(acc[i][j]);
            for (int64_t k = k16; k < K; k++) s = fmaf(x[i * ldx + k], w_at(W, w_bf16, (n0 + j) * K + k), s);
            if (bias) s += bias[n0 + j];
            y[i * ldy + n0 + j] = s;
        }
}

int qb_dense(const float *x, int64_t ldx, int64_t M, const void *W, int w_bf16, int64_t N, int64_t K,
             const float *bias, float *y, int64_t ldy, int threads) {
    if (M < 0 || N < 0 || K < 0) return -1;
    int64_t tiles = (N + DN - 1) / DN;
    (void)threads;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * DN;
        int nt = N - n0 < DN ? (int)(N - n0) : DN;
        for (int64_t m0 = 0; m0 < M; m0 += DM) {
            int mt = M - m0 < DM ? (int)(M - m0) : DM;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy;
            if (mt == DM && nt == DN) {
                if (w_bf16) dense_tile(xm, ldx, DM, W, 1, n0, DN, K, bias, ym, ldy);
                else dense_tile(xm, ldx, DM, W, 0, n0, DN, K, bias, ym, ldy);
            } else if (mt == 1 && nt == DN) {  /* a decode row */
                if (w_bf16) dense_tile(xm, ldx, 1, W, 1, n0, DN, K, bias, ym, ldy);
                else dense_tile(xm, ldx, 1, W, 0, n0, DN, K, bias, ym, ldy);
            } else {
                dense_tile(xm, ldx, mt, W, w_bf16, n0, nt, K, bias, ym, ldy);
            }
        }
    }
    return 0;
}
