/* A linear layer over few rows on a CPU: the kernel behind `radixkv.kernels.cpu_linear`.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a row-major weight w [N, K] (nn.Linear's own
 * layout) and few rows x [M, K]: a decode step's M is its batch. There the product is bound by
 * reading the weight once, and a BLAS sgemm tuned for large M reaches a fraction of that (see
 * benchmarks/RESULTS.md, CPU linears). Here each weight row is read once, in order, and meets the
 * rows of x while it is in cache: a register block of NR weight rows times MR rows of x keeps
 * MR * NR vector accumulators (dot products over k, summed across lanes at the end of the row).
 * The weight may be fp32 or bf16 (bf16 widened to fp32 in registers: half the bytes to read, the
 * same fp32 arithmetic); x, bias and out are fp32.
 *
 * Work is split over blocks of weight rows, one OpenMP thread each. Plain C99 with GCC / Clang
 * vector extensions, built by cpu_kernels.py with -O3 -march=native (AVX2 or AVX-512 lanes).
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#define MR_MAX 4 /* rows of x per register tile */
#define NB 12    /* weight rows per block: tiles of 4 x 3, 3 x 4, 2 x 6 or 1 x 12 */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* Mirrors `_LinearArgs` in cpu_linear.py field for field. Strides are in elements. */
typedef struct {
    const float *x;    /* [M, K], rows x_stride apart, unit stride along k */
    const void *w;     /* [N, K] contiguous, fp32 or bf16 */
    const float *bias; /* [N] or NULL */
    float *out;        /* [M, N], rows out_stride apart */
    int64_t x_stride;
    int64_t out_stride;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t w_is_bf16;
    int32_t num_threads;
} LinearArgs;

static inline vf load_x(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf load_w(const void *w, int64_t at, int bf16) {
    if (bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)w + at, sizeof h);
        vu bits = __builtin_convertvector(h, vu) << 16;
        vf v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    return load_x((const float *)w + at);
}

static inline const void *w_line(const void *w, int64_t at, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)w + at) : (const void *)((const float *)w + at);
}

static inline float w_at(const void *w, int64_t at, int bf16) {
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)w)[at] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)w)[at];
}

/* The lanes' sum by halving (a tree: independent adds, not a chain of LANES). */
static inline float lane_sum(vf v) {
    float t[LANES];
    memcpy(t, &v, sizeof t);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) t[i] += t[i + width];
    return t[0];
}

/* out[m0 .. m0+mr, n0 .. n0+nr]: mr * nr vector accumulators. Called with constant mr and nr
 * only, so that the loops unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const LinearArgs *a, int m0, int mr, int n0,
                                                        int nr, int bf16, int prefetch) {
    const int k = a->k, kv = k - k % LANES;
    const float *x = a->x + (int64_t)m0 * a->x_stride;
    const int64_t xs = a->x_stride;
    vf acc[MR_MAX][NB];
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 16
        for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
    for (int c = 0; c < kv; c += LANES) {
        if (prefetch && c % (64 / sizeof(float)) == 0) /* the next block's rows, a line a row */
#pragma GCC unroll 16
            for (int j = 0; j < nr; j++)
                __builtin_prefetch(w_line(a->w, (int64_t)(n0 + NB + j) * k + c, bf16), 0, 1);
        vf wv[NB];
#pragma GCC unroll 16
        for (int j = 0; j < nr; j++) wv[j] = load_w(a->w, (int64_t)(n0 + j) * k + c, bf16);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++) {
            vf xv = load_x(x + i * xs + c);
#pragma GCC unroll 16
            for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < mr; i++) {
        float *out = a->out + (int64_t)(m0 + i) * a->out_stride;
#pragma GCC unroll 16
        for (int j = 0; j < nr; j++) {
            float s = lane_sum(acc[i][j]);
            for (int c = kv; c < k; c++)
                s += x[i * xs + c] * w_at(a->w, (int64_t)(n0 + j) * k + c, bf16);
            out[n0 + j] = s + (a->bias ? a->bias[n0 + j] : 0.0f);
        }
    }
}

/* Every row of x against the NB weight rows from n0 (a block's weight rows stay in L1 while the
 * rows of x pass), in tiles of about a dozen accumulators whatever the rows left. */
static void weight_block(const LinearArgs *a, int n0, int bf16) {
    int m0 = 0;
    for (; m0 + 4 <= a->m; m0 += 4)
        for (int j = 0; j < NB; j += 3) tile(a, m0, 4, n0 + j, 3, bf16, m0 == 0);
    switch (a->m - m0) {
    case 3:
        for (int j = 0; j < NB; j += 4) tile(a, m0, 3, n0 + j, 4, bf16, m0 == 0);
        break;
    case 2:
        for (int j = 0; j < NB; j += 6) tile(a, m0, 2, n0 + j, 6, bf16, m0 == 0);
        break;
    case 1: tile(a, m0, 1, n0, NB, bf16, m0 == 0); break;
    default: break;
    }
}

/* The last N % NB weight rows, one at a time. */
static void weight_row(const LinearArgs *a, int n0, int bf16) {
    int m0 = 0;
    for (; m0 + 4 <= a->m; m0 += 4) tile(a, m0, 4, n0, 1, bf16, 0);
    for (; m0 < a->m; m0++) tile(a, m0, 1, n0, 1, bf16, 0);
}

int radixkv_linear(const LinearArgs *a) {
    const int blocks = a->n / NB, tail = a->n % NB;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
#endif
    for (int b = 0; b < blocks + tail; b++) {
        if (b < blocks) {
            if (a->w_is_bf16)
                weight_block(a, b * NB, 1);
            else
                weight_block(a, b * NB, 0);
        } else {
            weight_row(a, blocks * NB + (b - blocks), a->w_is_bf16);
        }
    }
    return 0;
}
