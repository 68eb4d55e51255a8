/* Paged attention on a CPU: the kernel behind `radixkv.kernels.cpu_attention`.
 *
 * The same computation as `reference.paged_attention_step` (causal varlen attention of each
 * request's new queries over its paged context, GQA, an optional sliding window, logit soft-cap
 * and sinks), without what makes the torch reference slow on a CPU: it reads K and V in place
 * through the block table (no gathered copy of every request's context in every layer), never
 * materialises a padded score matrix, and keeps an online softmax per query row (flash
 * attention's recurrence).
 *
 * Work item = (request, kv head, tile of up to TILE_Q query tokens). A tile's rows are its tokens
 * times the GQA group's query heads, so each K/V row read serves every query head that shares it.
 * Keys go by chunks of CHUNK consecutive positions (any block size: each position finds its own
 * block), transposed into a small buffer so the scores of a chunk are CHUNK-wide vector FMAs with
 * no horizontal sums.
 *
 * Plain C99 + OpenMP, built at first use by cpu_attention.py with the host's compiler for the host
 * (-O3 -march=native); loops are written so that the compiler vectorizes them without
 * -ffast-math (independent lanes, a branch-free exp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK 16
#define TILE_Q 16
#define ROWS 4 /* query rows per register block */

/* One chunk's lanes as a vector (GCC / Clang vector extensions: lowered to the host's SIMD, two
 * AVX2 halves where there is no AVX-512). */
typedef float vf __attribute__((vector_size(CHUNK * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(CHUNK * sizeof(int32_t))));

/* Mirrors `_Args` in cpu_attention.py field for field. Strides are in elements. */
typedef struct {
    const float *q;           /* [num_tokens, num_q_heads, head_dim], fp32 */
    const void *k_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache;
    float *out;               /* [num_tokens, num_q_heads, head_dim], fp32, contiguous */
    const int32_t *block_tables; /* [num_reqs, max_blocks], contiguous */
    const int32_t *seq_lens;  /* [num_reqs] */
    const int32_t *cu_seqlens_q; /* [num_reqs + 1] */
    const float *sinks;       /* [num_q_heads] or NULL */
    const int32_t *requests;  /* the requests to attend for, ascending; NULL: every request */
    int64_t q_token_stride, q_head_stride;
    int64_t k_block_stride, k_token_stride, k_head_stride;
    int64_t v_block_stride, v_token_stride, v_head_stride;
    int32_t num_reqs;         /* rows of block_tables; with `requests`, its length */
    int32_t max_blocks, block_size, num_q_heads, num_kv_heads, head_dim;
    int32_t window;           /* 0: none */
    int32_t cache_is_bf16;    /* 0: fp32 cache; 1: bf16 */
    int32_t num_threads;
    float scale;
    float softcap;            /* 0: none */
} Args;

/* mask ? a : b, lane by lane (a vector ?: is C++ only): mask lanes are all ones or all zeros. */
static inline vf select(vi mask, vf a, vf b) {
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp(x) lane by lane for x <= 0 (scores minus their running max): Cephes' single-precision
 * polynomial after a range reduction by ln 2; under 2 ulp. Lanes below -87 give a tiny positive
 * value, never NaN; the caller zeroes masked lanes itself. */
static inline vf exp_neg(vf x) {
    const vf lowest = x - x - 87.0f;
    x = select(x < lowest, lowest, x);
    vf y = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf);  /* trunc(y) */
    n += __builtin_convertvector(y < n, vf);  /* floor(y): -1 where trunc rounded up */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float exp_neg1(float x) {
    vf v = {0};
    v[0] = x;
    return exp_neg(v)[0];
}


/* The sum of a vector's lanes by halving it (a few shuffles, not CHUNK scalar adds). */
typedef float vf_half __attribute__((vector_size(CHUNK / 2 * sizeof(float))));
typedef float vf_quarter __attribute__((vector_size(CHUNK / 4 * sizeof(float))));
typedef int32_t vi_half __attribute__((vector_size(CHUNK / 2 * sizeof(int32_t))));
typedef int32_t vi_quarter __attribute__((vector_size(CHUNK / 4 * sizeof(int32_t))));

static inline float hsum(vf v) {
    vf_half lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    lo += hi;
    vf_quarter a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (char *)&lo + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* The largest lane, by halving as hsum does. */
static inline float hmax(vf v) {
    vf_half lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    const vi_half lo_wins = lo > hi;
    lo = (vf_half)(((vi_half)lo & lo_wins) | ((vi_half)hi & ~lo_wins));
    vf_quarter a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (char *)&lo + sizeof a, sizeof b);
    const vi_quarter a_wins = a > b;
    a = (vf_quarter)(((vi_quarter)a & a_wins) | ((vi_quarter)b & ~a_wins));
    const float m01 = a[0] > a[1] ? a[0] : a[1], m23 = a[2] > a[3] ? a[2] : a[3];
    return m01 > m23 ? m01 : m23;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Load `n` values of one cache row into fp32 `dst` (a loop, not memcpy: rows are short and a
 * libc call per row cost more than the copy). */
static inline void load_row(const Args *a, const void *base, int64_t offset, float *dst, int n) {
    if (a->cache_is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int d = 0; d < n; d++) dst[d] = bf16_to_float(src[d]);
    } else {
        const float *src = (const float *)base + offset;
        for (int d = 0; d < n; d++) dst[d] = src[d];
    }
}

/* head_dim rounded up to whole vectors: the row length of the value and accumulator scratch. */
static inline int padded_dim(int D) { return (D + CHUNK - 1) / CHUNK * CHUNK; }

/* Per-thread scratch of one work item. */
typedef struct {
    float *q;    /* [rows, D]: the tile's query rows, scaled */
    float *acc;  /* [rows, DP] */
    float *m;    /* [rows]: running max */
    float *l;    /* [rows]: running denominator */
    float *kt;   /* [D, CHUNK]: one chunk's keys, transposed */
    float *v;    /* [CHUNK, DP]: one chunk's values */
    float *row;  /* [D] */
} Scratch;

/* One chunk of keys as attend_chunk prepared it. */
typedef struct {
    const float *const *kp; /* direct: each key's row in the cache */
    const float *const *vp; /* each value's row (the cache's, or scratch's) */
    vi lane;                /* each lane's key position */
    vi present;             /* lanes with a key */
    int32_t first_pos;      /* the position of the tile's first query token */
    int32_t num_keys;
    int group;
    int direct;
} Chunk;

/* Rows [i0, i0 + R) of the tile against one chunk: scores, the online softmax, acc += p @ V. R is
 * a constant at every call (1 to ROWS), so each count compiles to its own register-blocked copy. */
static inline __attribute__((always_inline)) void attend_rows(const Args *a, Scratch *w,
                                                             const Chunk *c, int i0, const int R) {
    const int D = a->head_dim, DP = padded_dim(D);
    const vf minus_inf = (vf){0} - INFINITY;
    vf sc[ROWS] = {{0}};
    if (c->direct) {
        for (int j = 0; j < c->num_keys; j++) {
            vf dot[ROWS] = {{0}};
            for (int d0 = 0; d0 < D; d0 += CHUNK) {
                vf kd, qd;
                memcpy(&kd, c->kp[j] + d0, sizeof kd);
                for (int r = 0; r < R; r++) {
                    memcpy(&qd, w->q + (int64_t)(i0 + r) * D + d0, sizeof qd);
                    dot[r] += qd * kd;
                }
            }
            for (int r = 0; r < R; r++) sc[r][j] = hsum(dot[r]);
        }
    } else {
        for (int d = 0; d < D; d++) {
            vf kd;
            memcpy(&kd, w->kt + d * CHUNK, sizeof kd);
            for (int r = 0; r < R; r++) sc[r] += w->q[(int64_t)(i0 + r) * D + d] * kd;
        }
    }
    vf p[ROWS];
    float correction[ROWS];
    for (int r = 0; r < R; r++) {
        const int i = i0 + r;
        p[r] = (vf){0};
        correction[r] = 1.0f;
        vf x = sc[r];
        if (a->softcap > 0) {  /* cap * tanh(s / cap), tanh(y) = sign(y) (1 - e) / (1 + e) */
            vf y = x / a->softcap;
            vf e = exp_neg(-2.0f * select(y < 0, -y, y));
            vf t = (1.0f - e) / (1.0f + e);
            x = a->softcap * select(y < 0, -t, t);
        }
        /* The query of row i sits at position first_pos + i / group. */
        const int32_t pos = c->first_pos + i / c->group;
        vi visible = c->present & (c->lane <= pos);
        if (a->window > 0) visible &= (pos - c->lane) < a->window;
        x = select(visible, x, minus_inf);
        const float chunk_max = hmax(x);
        if (chunk_max == -INFINITY) continue;  /* nothing visible to this row here */
        const float m_old = w->m[i], m_new = chunk_max > m_old ? chunk_max : m_old;
        correction[r] = m_old == -INFINITY ? 0.0f : exp_neg1(m_old - m_new);
        p[r] = select(visible, exp_neg(x - m_new), (vf){0});
        w->l[i] = w->l[i] * correction[r] + hsum(p[r]);
        w->m[i] = m_new;
    }
    /* acc = acc * correction + p @ V, CHUNK columns of head_dim at a time in registers. */
    for (int d0 = 0; d0 < D; d0 += CHUNK) {
        vf acc[ROWS];
        for (int r = 0; r < R; r++) {
            memcpy(&acc[r], w->acc + (int64_t)(i0 + r) * DP + d0, sizeof acc[r]);
            acc[r] *= correction[r];
        }
        for (int j = 0; j < c->num_keys; j++) {
            vf vj;
            memcpy(&vj, c->vp[j] + d0, sizeof vj);
            for (int r = 0; r < R; r++) acc[r] += p[r][j] * vj;
        }
        for (int r = 0; r < R; r++)
            memcpy(w->acc + (int64_t)(i0 + r) * DP + d0, &acc[r], sizeof acc[r]);
    }
}

static void attend_chunk(const Args *a, Scratch *w, int rows, int group, int32_t req,
                         int32_t kv_head, int32_t first_pos, int32_t key0, int32_t num_keys) {
    const int D = a->head_dim, DP = padded_dim(D);
    const int32_t *table = a->block_tables + (int64_t)req * a->max_blocks;
    /* Few rows (decode) over an fp32 cache read K and V where they are, by dot products: a
     * transposed copy would cost more than the rows' arithmetic. Otherwise keys [key0, key0 +
     * num_keys) are transposed into kt and values copied into rows of DP; lanes past num_keys
     * and values past D are 0 there (they meet zero probabilities and padded columns). */
    const int direct = !a->cache_is_bf16 && DP == D && rows <= 2 * ROWS;
    const float *kp[CHUNK], *vp[CHUNK];
    if (!direct && num_keys < CHUNK) memset(w->kt, 0, sizeof(float) * (size_t)D * CHUNK);
    if (!direct && DP != D) memset(w->v, 0, sizeof(float) * (size_t)DP * CHUNK);
    for (int j = 0; j < num_keys; j++) {
        int32_t pos = key0 + j;
        int64_t block = table[pos / a->block_size], slot = pos % a->block_size;
        int64_t k_off = block * a->k_block_stride + slot * a->k_token_stride
                        + (int64_t)kv_head * a->k_head_stride;
        int64_t v_off = block * a->v_block_stride + slot * a->v_token_stride
                        + (int64_t)kv_head * a->v_head_stride;
        if (direct) {
            kp[j] = (const float *)a->k_cache + k_off;
            vp[j] = (const float *)a->v_cache + v_off;
            continue;
        }
        if (a->cache_is_bf16) {
            load_row(a, a->k_cache, k_off, w->row, D);
            for (int d = 0; d < D; d++) w->kt[d * CHUNK + j] = w->row[d];
        } else {
            const float *k = (const float *)a->k_cache + k_off;
            for (int d = 0; d < D; d++) w->kt[d * CHUNK + j] = k[d];
        }
        load_row(a, a->v_cache, v_off, w->v + (int64_t)j * DP, D);
        vp[j] = w->v + (int64_t)j * DP;
    }
    vi lane;
    for (int j = 0; j < CHUNK; j++) lane[j] = key0 + j;  /* each lane's key position */
    const Chunk c = {kp, vp, lane, lane < key0 + num_keys, first_pos, num_keys, group, direct};
    /* Rows go in blocks of ROWS, the last block as many as are left (each count its own
     * specialised copy of attend_rows), so each key and value vector loaded serves every row of
     * a block and no arithmetic goes to padding rows. */
    int i0 = 0;
    for (; i0 + ROWS <= rows; i0 += ROWS) attend_rows(a, w, &c, i0, ROWS);
    switch (rows - i0) {
    case 1: attend_rows(a, w, &c, i0, 1); break;
    case 2: attend_rows(a, w, &c, i0, 2); break;
    case 3: attend_rows(a, w, &c, i0, 3); break;
    default: break;
    }
}

static void run_item(const Args *a, Scratch *w, int32_t req, int32_t kv_head, int32_t tile) {
    const int D = a->head_dim, DP = padded_dim(D), group = a->num_q_heads / a->num_kv_heads;
    const int32_t q0 = a->cu_seqlens_q[req], q_len = a->cu_seqlens_q[req + 1] - q0;
    const int32_t ctx = a->seq_lens[req] - q_len;
    const int32_t t0 = tile * TILE_Q;
    const int32_t tokens = q_len - t0 < TILE_Q ? q_len - t0 : TILE_Q;
    const int rows = tokens * group;
    for (int i = 0; i < rows; i++) {
        int32_t token = q0 + t0 + i / group, head = kv_head * group + i % group;
        const float *src = a->q + token * a->q_token_stride + head * a->q_head_stride;
        for (int d = 0; d < D; d++) w->q[(int64_t)i * D + d] = src[d] * a->scale;
        w->m[i] = -INFINITY;
        w->l[i] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)rows * DP);
    const int32_t first_pos = ctx + t0, last_pos = first_pos + tokens - 1;
    int32_t lo = 0;
    if (a->window > 0 && first_pos - a->window + 1 > 0) lo = first_pos - a->window + 1;
    lo -= lo % CHUNK;
    for (int32_t key0 = lo; key0 <= last_pos; key0 += CHUNK) {
        int32_t num_keys = last_pos + 1 - key0 < CHUNK ? last_pos + 1 - key0 : CHUNK;
        attend_chunk(a, w, rows, group, req, kv_head, first_pos, key0, num_keys);
    }
    for (int i = 0; i < rows; i++) {
        int32_t token = q0 + t0 + i / group, head = kv_head * group + i % group;
        float m = w->m[i], l = w->l[i], keep = 1.0f;
        if (a->sinks != NULL) {  /* one more score, no value: it only joins the denominator */
            float sink = a->sinks[head], m_new = sink > m ? sink : m;
            keep = exp_neg1(m - m_new);
            l = l * keep + exp_neg1(sink - m_new);
        }
        float inv = keep / l;
        float *dst = a->out + ((int64_t)token * a->num_q_heads + head) * D;
        const float *acc = w->acc + (int64_t)i * DP;
        for (int d = 0; d < D; d++) dst[d] = acc[d] * inv;
    }
}

static Scratch scratch_at(float *mem, int rows, int D) {
    Scratch w;
    w.q = mem;
    w.acc = w.q + (size_t)rows * D;
    w.m = w.acc + (size_t)rows * padded_dim(D);
    w.l = w.m + rows;
    w.kt = w.l + rows;
    w.v = w.kt + (size_t)D * CHUNK;
    w.row = w.v + (size_t)CHUNK * padded_dim(D);
    return w;
}

/* Returns 0, or -1 when scratch memory could not be allocated (then nothing was written). */
int radixkv_paged_attention(const Args *a) {
    /* Work items: for each request, tile of its queries and kv head. */
    int64_t num_items = 0;
    for (int32_t i = 0; i < a->num_reqs; i++) {
        int32_t r = a->requests == NULL ? i : a->requests[i];
        int32_t q_len = a->cu_seqlens_q[r + 1] - a->cu_seqlens_q[r];
        num_items += (int64_t)a->num_kv_heads * ((q_len + TILE_Q - 1) / TILE_Q);
    }
    if (num_items == 0) return 0;
    int threads = a->num_threads > 1 ? a->num_threads : 1;
#ifndef _OPENMP
    threads = 1;
#endif
    const int D = a->head_dim, group = a->num_q_heads / a->num_kv_heads;
    const int rows = TILE_Q * group;
    const size_t floats = (size_t)rows * (D + padded_dim(D) + 2) + (size_t)D * CHUNK
                          + (size_t)CHUNK * padded_dim(D) + (size_t)D;
    int32_t *items = malloc(sizeof(int32_t) * 3 * (size_t)num_items);
    float *mem = malloc(sizeof(float) * floats * (size_t)threads);
    if (items == NULL || mem == NULL) {
        free(items);
        free(mem);
        return -1;
    }
    int64_t n = 0;
    for (int32_t i = 0; i < a->num_reqs; i++) {
        int32_t r = a->requests == NULL ? i : a->requests[i];
        int32_t q_len = a->cu_seqlens_q[r + 1] - a->cu_seqlens_q[r];
        for (int32_t tile = 0; tile * TILE_Q < q_len; tile++)
            for (int32_t h = 0; h < a->num_kv_heads; h++) {
                items[3 * n] = r, items[3 * n + 1] = h, items[3 * n + 2] = tile;
                n++;
            }
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t i = 0; i < num_items; i++) {
#ifdef _OPENMP
        int tid = omp_get_thread_num();
#else
        int tid = 0;
#endif
        Scratch w = scratch_at(mem + floats * (size_t)tid, rows, D);
        run_item(a, &w, items[3 * i], items[3 * i + 1], items[3 * i + 2]);
    }
    free(items);
    free(mem);
    return 0;
}
