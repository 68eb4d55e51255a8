/* Paged attention on a CPU: the kernel behind `radixkv.kernels.cpu_attention`.
 *
 * The same computation as `reference.paged_attention_step` (causal varlen attention of each
 * request's new queries over its paged context, GQA, an optional sliding window, logit soft-cap
 * and sinks), without what makes the torch reference slow on a CPU: it reads K and V in place
 * through the block table (no gathered copy of every request's context in every layer), never
 * materialises a padded score matrix, and keeps an online softmax per query row (flash
 * attention's recurrence).
 *
 * Work item = (kv head, a few requests' query tokens, at most TILE_Q of them). A request's rows
 * are its tokens times the GQA group's query heads, so each K/V row read serves every query head
 * that shares it. Requests whose block tables begin with the same blocks (a prefix the radix tree
 * serves to all of them) come as one group with the length of that shared part: an item of the
 * group attends the shared keys once with all its requests' rows, then each request's own keys
 * with its rows, the online softmax carried from one to the other. The shared blocks are read
 * once per item instead of once per request.
 *
 * Keys go by tiles of LANES positions (any block size: each position finds its own block), the
 * next tiles' rows prefetched: a decode step is bound by reading K and V, and without the
 * prefetch it waited on every block's first lines. Each query row takes a tile's LANES dot
 * products as LANES vector accumulators over head_dim, summed into one vector of scores by a
 * transposing reduction.
 *
 * Plain C99 + OpenMP with GCC / Clang vector extensions, built at first use by cpu_attention.py
 * with the host's compiler for the host (-O3 -march=native, FMA contraction on); no -ffast-math
 * (a branch-free polynomial exp, explicit masks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 8   /* keys per tile: one vector of scores (an AVX2 register of fp32) */
#define TILE_Q 16 /* query tokens per work item */
#define AHEAD 4   /* tiles whose K / V rows are prefetched ahead of the one being read */
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));

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
    const int32_t *members;   /* the requests to attend for, group by group */
    const int32_t *group_starts; /* [num_groups + 1]: each group's first index into members */
    const int32_t *group_shared; /* [num_groups]: leading keys held in the same blocks by every
                                  * member's table, visible to every member's queries; 0 for a
                                  * group of one */
    int64_t q_token_stride, q_head_stride;
    int64_t k_block_stride, k_token_stride, k_head_stride;
    int64_t v_block_stride, v_token_stride, v_head_stride;
    int32_t num_groups;
    int32_t max_blocks, block_size, num_q_heads, num_kv_heads, head_dim;
    int32_t window;           /* 0: none */
    int32_t cache_is_bf16;    /* 0: fp32 cache; 1: bf16 */
    int32_t num_threads;
    float scale;
    float softcap;            /* 0: none */
} Args;

INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* mask ? a : b, lane by lane (a vector ?: is C++ only): mask lanes are all ones or all zeros. */
INLINE vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) lane by lane for x <= 0 (scores minus their running max): Cephes' single-precision
 * polynomial after a range reduction by ln 2; under 2 ulp. Lanes below -87 give a tiny positive
 * value, never NaN; the caller zeroes masked lanes itself. */
INLINE vf exp_neg(vf x) {
    const vf lowest = x - x - 87.0f;
    x = select(x < lowest, lowest, x);
    vf y = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf); /* trunc(y) */
    n += __builtin_convertvector(y < n, vf); /* floor(y): -1 where trunc rounded up */
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

INLINE float exp_neg1(float x) {
    vf v = {0};
    v[0] = x;
    return exp_neg(v)[0];
}

/* The sum and the largest of a vector's lanes, by halving (three shuffles, not LANES scalars). */
INLINE float hsum(vf v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

INLINE vf vmax(vf a, vf b) { return select(a > b, a, b); }

INLINE float hmax(vf v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

/* { hsum(s[0]), ..., hsum(s[7]) } as one vector: pairs, then quads, then halves added across
 * vectors (14 shuffles and 7 adds for 8 sums). */
INLINE vf sum_lanes8(const vf s[LANES]) {
#define PAIRS(a, b) (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) \
                     + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define QUADS(a, b) (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) \
                     + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    const vf t0 = PAIRS(s[0], s[1]), t1 = PAIRS(s[2], s[3]);
    const vf t2 = PAIRS(s[4], s[5]), t3 = PAIRS(s[6], s[7]);
    const vf u0 = QUADS(t0, t1), u1 = QUADS(t2, t3);
#undef PAIRS
#undef QUADS
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Per-thread scratch of one work item. */
typedef struct {
    float *q;      /* [rows, D]: the item's query rows, scaled */
    float *acc;    /* [rows, D] */
    float *m;      /* [rows]: running max */
    float *l;      /* [rows]: running denominator */
    float *p;      /* [rows, LANES]: one tile's probabilities */
    float *corr;   /* [rows]: one tile's rescaling of each accumulator */
    int32_t *pos;  /* [rows]: each row's query position */
    int32_t *token;/* [rows]: each row's query token */
    int32_t *head; /* [rows]: each row's query head */
    float *k;      /* [LANES, D]: a bf16 tile's keys as fp32 */
    float *v;      /* [LANES, D] */
    float *zero;   /* [D]: the row of absent lanes */
} Scratch;

/* The K and V rows of LANES consecutive positions: n of them present, the rest the zero row. */
typedef struct {
    const float *k[LANES], *v[LANES];
    vi lane_pos; /* each lane's key position */
    vi present;
} Tile;

/* The element offsets of the K and V rows of `kv_head` at positions [key0, key0 + n) of
 * `table`'s blocks (one division per tile, not per position). */
INLINE void row_offsets(const Args *a, const int32_t *table, int32_t kv_head, int32_t key0,
                        int n, int64_t k_off[LANES], int64_t v_off[LANES]) {
    int32_t index = key0 / a->block_size, slot = key0 % a->block_size;
    for (int j = 0; j < n; j++) {
        const int64_t block = table[index];
        k_off[j] = block * a->k_block_stride + slot * a->k_token_stride
                   + kv_head * a->k_head_stride;
        v_off[j] = block * a->v_block_stride + slot * a->v_token_stride
                   + kv_head * a->v_head_stride;
        if (++slot == a->block_size) slot = 0, index++;
    }
}

INLINE int tile_keys(int32_t key0, int32_t end) {
    return end - key0 < LANES ? (end - key0 > 0 ? end - key0 : 0) : LANES;
}

static void prefetch_tile(const Args *a, const int32_t *table, int32_t key0, int32_t end) {
    const int size = a->cache_is_bf16 ? 2 : 4;
    const int64_t bytes = (int64_t)a->head_dim * size;
    const int n = tile_keys(key0, end);
    for (int32_t h = 0; h < a->num_kv_heads; h++) {
        int64_t k_off[LANES], v_off[LANES];
        row_offsets(a, table, h, key0, n, k_off, v_off);
        for (int j = 0; j < n; j++) {
            const char *k = (const char *)a->k_cache + k_off[j] * size;
            const char *v = (const char *)a->v_cache + v_off[j] * size;
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(k + b);
                __builtin_prefetch(v + b);
            }
        }
    }
}

INLINE void bf16_row(const uint16_t *src, float *dst, int D) {
    int d = 0;
    for (; d + LANES <= D; d += LANES) {
        vh h;
        memcpy(&h, src + d, sizeof h);
        const vu bits = __builtin_convertvector(h, vu) << 16;
        memcpy(dst + d, &bits, sizeof bits);
    }
    for (; d < D; d++) {
        const uint32_t bits = (uint32_t)src[d] << 16;
        memcpy(dst + d, &bits, sizeof bits);
    }
}

static void tile_at(const Args *a, const Scratch *w, const int32_t *table, int32_t kv_head,
                    int32_t key0, int32_t end, Tile *t) {
    const int D = a->head_dim, n = tile_keys(key0, end);
    int64_t k_off[LANES], v_off[LANES];
    row_offsets(a, table, kv_head, key0, n, k_off, v_off);
    for (int j = 0; j < LANES; j++) {
        t->lane_pos[j] = key0 + j;
        t->present[j] = j < n ? -1 : 0;
        if (j >= n) {
            t->k[j] = t->v[j] = w->zero;
        } else if (a->cache_is_bf16) {
            bf16_row((const uint16_t *)a->k_cache + k_off[j], w->k + (int64_t)j * D, D);
            bf16_row((const uint16_t *)a->v_cache + v_off[j], w->v + (int64_t)j * D, D);
            t->k[j] = w->k + (int64_t)j * D;
            t->v[j] = w->v + (int64_t)j * D;
        } else {
            t->k[j] = (const float *)a->k_cache + k_off[j];
            t->v[j] = (const float *)a->v_cache + v_off[j];
        }
    }
}

/* The scores of one query row against a tile's LANES keys. */
INLINE vf tile_scores(const float *q, const Tile *t, int D) {
    vf dot[LANES] = {{0}};
    int d = 0;
    for (; d + LANES <= D; d += LANES) {
        const vf qd = vload(q + d);
        for (int j = 0; j < LANES; j++) dot[j] += qd * vload(t->k[j] + d);
    }
    vf s = sum_lanes8(dot);
    if (d < D) {
        float tail[LANES] = {0};
        for (int j = 0; j < LANES; j++)
            for (int e = d; e < D; e++) tail[j] += q[e] * t->k[j][e];
        s += vload(tail);
    }
    return s;
}

/* acc_r = acc_r * correction_r + p_r @ V over a tile for R (1 or 2) rows at once, four vectors of
 * head_dim each in registers: two rows keep eight independent sums in flight, one row's four
 * wait on each other's latency. */
INLINE void tile_values(float *const acc[2], const float correction[2], const float *const p[2],
                        const Tile *t, int D, const int R) {
    int d = 0;
    for (; d + 4 * LANES <= D; d += 4 * LANES) {
        vf s[2][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) s[r][c] = vload(acc[r] + d + c * LANES) * correction[r];
        for (int j = 0; j < LANES; j++) {
            const float *v = t->v[j] + d;
            const vf v0 = vload(v), v1 = vload(v + LANES), v2 = vload(v + 2 * LANES);
            const vf v3 = vload(v + 3 * LANES);
            for (int r = 0; r < R; r++) {
                const vf pj = (vf){0} + p[r][j];
                s[r][0] += pj * v0;
                s[r][1] += pj * v1;
                s[r][2] += pj * v2;
                s[r][3] += pj * v3;
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) vstore(acc[r] + d + c * LANES, s[r][c]);
    }
    for (; d + LANES <= D; d += LANES)
        for (int r = 0; r < R; r++) {
            vf s0 = vload(acc[r] + d) * correction[r];
            for (int j = 0; j < LANES; j++) s0 += ((vf){0} + p[r][j]) * vload(t->v[j] + d);
            vstore(acc[r] + d, s0);
        }
    for (; d < D; d++)
        for (int r = 0; r < R; r++) {
            float x = acc[r][d] * correction[r];
            for (int j = 0; j < LANES; j++) x += p[r][j] * t->v[j][d];
            acc[r][d] = x;
        }
}

/* Row i's scores against a tile and its online softmax: its probabilities into w->p, the factor
 * its accumulator is to be rescaled by into w->corr (1 and all zeros when it sees no key here). */
INLINE void tile_softmax(const Args *a, Scratch *w, const Tile *t, int i) {
    const int D = a->head_dim;
    float *p = w->p + (int64_t)i * LANES;
    vf x = tile_scores(w->q + (int64_t)i * D, t, D);
    if (a->softcap > 0) { /* cap * tanh(s / cap), tanh(y) = sign(y) (1 - e) / (1 + e) */
        const vf y = x / a->softcap;
        const vf e = exp_neg(-2.0f * select(y < 0, -y, y));
        const vf th = (1.0f - e) / (1.0f + e);
        x = a->softcap * select(y < 0, -th, th);
    }
    const int32_t pos = w->pos[i];
    vi visible = t->present & (t->lane_pos <= pos);
    if (a->window > 0) visible &= (pos - t->lane_pos) < a->window;
    x = select(visible, x, (vf){0} - INFINITY);
    const float tile_max = hmax(x);
    if (tile_max == -INFINITY) { /* nothing visible to this row here */
        vstore(p, (vf){0});
        w->corr[i] = 1.0f;
        return;
    }
    const float m_old = w->m[i], m_new = tile_max > m_old ? tile_max : m_old;
    const float correction = m_old == -INFINITY ? 0.0f : exp_neg1(m_old - m_new);
    const vf e = select(visible, exp_neg(x - m_new), (vf){0});
    w->l[i] = w->l[i] * correction + hsum(e);
    w->m[i] = m_new;
    w->corr[i] = correction;
    vstore(p, e);
}

/* Rows [r0, r1) against one tile. */
INLINE void attend_tile(const Args *a, Scratch *w, const Tile *t, int r0, int r1) {
    const int D = a->head_dim;
    for (int i = r0; i < r1; i++) tile_softmax(a, w, t, i);
    int i = r0;
    for (; i + 2 <= r1; i += 2) {
        float *const acc[2] = {w->acc + (int64_t)i * D, w->acc + (int64_t)(i + 1) * D};
        const float *const p[2] = {w->p + (int64_t)i * LANES, w->p + (int64_t)(i + 1) * LANES};
        tile_values(acc, w->corr + i, p, t, D, 2);
    }
    if (i < r1) {
        float *const acc[2] = {w->acc + (int64_t)i * D, NULL};
        const float *const p[2] = {w->p + (int64_t)i * LANES, NULL};
        tile_values(acc, w->corr + i, p, t, D, 1);
    }
}

/* For every kv head h, its rows [h * per_head + i0, h * per_head + i1) against keys [key_from,
 * key_to) of `table`. The heads go inside the tiles: a tile's positions hold every head's rows
 * side by side, so the cache is read in order (head by head, the prefetchers fetched the other
 * heads' lines too and two thirds of the bandwidth went to lines read later, if at all). */
static void attend(const Args *a, Scratch *w, const int32_t *table, int per_head, int i0, int i1,
                   int32_t key_from, int32_t key_to) {
    if (i0 >= i1) return;
    for (int32_t ahead = 0; ahead < AHEAD; ahead++)
        prefetch_tile(a, table, key_from + ahead * LANES, key_to);
    for (int32_t key0 = key_from; key0 < key_to; key0 += LANES) {
        prefetch_tile(a, table, key0 + AHEAD * LANES, key_to);
        for (int32_t h = 0; h < a->num_kv_heads; h++) {
            Tile t;
            tile_at(a, w, table, h, key0, key_to, &t);
            attend_tile(a, w, &t, h * per_head + i0, h * per_head + i1);
        }
    }
}

/* One work item: members [m0, m1) of a group, from query token t0 of each (t0 > 0 only for a
 * group of one whose queries span several items), every head. Rows go by kv head, then member,
 * token and the GQA group's query heads. */
static void run_item(const Args *a, Scratch *w, int32_t m0, int32_t m1, int32_t t0,
                     int32_t shared) {
    const int D = a->head_dim, group = a->num_q_heads / a->num_kv_heads;
    int seg_start[TILE_Q + 1], seg_tokens[TILE_Q];
    int per_head = 0;
    for (int32_t m = m0; m < m1; m++) {
        const int32_t req = a->members[m];
        const int32_t q_len = a->cu_seqlens_q[req + 1] - a->cu_seqlens_q[req];
        seg_tokens[m - m0] = q_len - t0 < TILE_Q ? q_len - t0 : TILE_Q;
        seg_start[m - m0] = per_head;
        per_head += seg_tokens[m - m0] * group;
    }
    seg_start[m1 - m0] = per_head;
    const int rows = per_head * a->num_kv_heads;
    for (int32_t m = m0; m < m1; m++) {
        const int32_t req = a->members[m], q0 = a->cu_seqlens_q[req];
        const int32_t ctx = a->seq_lens[req] - (a->cu_seqlens_q[req + 1] - q0);
        for (int32_t h = 0; h < a->num_kv_heads; h++)
            for (int32_t tk = 0; tk < seg_tokens[m - m0]; tk++)
                for (int g = 0; g < group; g++) {
                    const int row = h * per_head + seg_start[m - m0] + tk * group + g;
                    const int32_t token = q0 + t0 + tk, head = h * group + g;
                    const float *src = a->q + token * a->q_token_stride + head * a->q_head_stride;
                    for (int d = 0; d < D; d++) w->q[(int64_t)row * D + d] = src[d] * a->scale;
                    w->token[row] = token;
                    w->head[row] = head;
                    w->pos[row] = ctx + t0 + tk;
                    w->m[row] = -INFINITY;
                    w->l[row] = 0.0f;
                }
    }
    memset(w->acc, 0, sizeof(float) * (size_t)rows * D);
    if (shared > 0) {
        const int32_t *table = a->block_tables + (int64_t)a->members[m0] * a->max_blocks;
        attend(a, w, table, per_head, 0, per_head, 0, shared);
    }
    for (int32_t m = m0; m < m1; m++) {
        const int i0 = seg_start[m - m0], i1 = seg_start[m - m0 + 1];
        if (i0 == i1) continue;
        const int32_t *table = a->block_tables + (int64_t)a->members[m] * a->max_blocks;
        const int32_t first_pos = w->pos[i0], last_pos = w->pos[i1 - 1];
        int32_t lo = shared;
        if (a->window > 0 && first_pos - a->window + 1 > lo) lo = first_pos - a->window + 1;
        attend(a, w, table, per_head, i0, i1, lo, last_pos + 1);
    }
    for (int i = 0; i < rows; i++) {
        const int32_t head = w->head[i];
        float m = w->m[i], l = w->l[i], keep = 1.0f;
        if (a->sinks != NULL) { /* one more score, no value: it only joins the denominator */
            const float sink = a->sinks[head], m_new = sink > m ? sink : m;
            keep = exp_neg1(m - m_new);
            l = l * keep + exp_neg1(sink - m_new);
        }
        const float inv = keep / l;
        float *dst = a->out + ((int64_t)w->token[i] * a->num_q_heads + head) * D;
        const float *acc = w->acc + (int64_t)i * D;
        for (int d = 0; d < D; d++) dst[d] = acc[d] * inv;
    }
}

static Scratch scratch_at(float *mem, int rows, int D) {
    Scratch w;
    w.q = mem;
    w.acc = w.q + (size_t)rows * D;
    w.m = w.acc + (size_t)rows * D;
    w.l = w.m + rows;
    w.p = w.l + rows;
    w.corr = w.p + (size_t)rows * LANES;
    w.pos = (int32_t *)(w.corr + rows);
    w.token = w.pos + rows;
    w.head = w.token + rows;
    w.k = (float *)(w.head + rows);
    w.v = w.k + (size_t)LANES * D;
    w.zero = w.v + (size_t)LANES * D;
    memset(w.zero, 0, sizeof(float) * (size_t)D);
    return w;
}

typedef struct {
    int32_t m0, m1, t0, shared;
} Item;

static int32_t q_len_of(const Args *a, int32_t m) {
    const int32_t req = a->members[m];
    return a->cu_seqlens_q[req + 1] - a->cu_seqlens_q[req];
}

/* The work items of every group: a group of one in tiles of TILE_Q of its queries; a larger
 * group in runs of at most TILE_Q members and TILE_Q queries together (the caller groups only
 * requests of at most TILE_Q queries, so every run takes one member at least). Returns the
 * count; with `items` NULL it only counts. */
static int64_t plan_items(const Args *a, Item *items) {
    int64_t n = 0;
    for (int32_t g = 0; g < a->num_groups; g++) {
        const int32_t first = a->group_starts[g], end = a->group_starts[g + 1];
        if (end - first == 1) {
            for (int32_t t0 = 0; t0 < q_len_of(a, first); t0 += TILE_Q, n++)
                if (items != NULL) items[n] = (Item){first, end, t0, 0};
            continue;
        }
        for (int32_t m0 = first; m0 < end; n++) {
            int32_t m1 = m0, tokens = 0;
            while (m1 < end && m1 - m0 < TILE_Q && tokens + q_len_of(a, m1) <= TILE_Q)
                tokens += q_len_of(a, m1++);
            if (items != NULL) items[n] = (Item){m0, m1, 0, a->group_shared[g]};
            m0 = m1;
        }
    }
    return n;
}

/* Returns 0, or -1 when scratch memory could not be allocated (then nothing was written). */
int radixkv_paged_attention(const Args *a) {
    const int64_t num_items = plan_items(a, NULL);
    if (num_items == 0) return 0;
    int threads = a->num_threads > 1 ? a->num_threads : 1;
#ifndef _OPENMP
    threads = 1;
#endif
    const int D = a->head_dim, rows = TILE_Q * a->num_q_heads;
    const size_t floats = (size_t)rows * (2 * D + LANES + 6) + (size_t)(2 * LANES + 1) * D;
    Item *items = malloc(sizeof(Item) * (size_t)num_items);
    float *mem = malloc(sizeof(float) * floats * (size_t)threads);
    if (items == NULL || mem == NULL) {
        free(items);
        free(mem);
        return -1;
    }
    plan_items(a, items);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t i = 0; i < num_items; i++) {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        Scratch w = scratch_at(mem + floats * (size_t)tid, rows, D);
        run_item(a, &w, items[i].m0, items[i].m1, items[i].t0, items[i].shared);
    }
    free(items);
    free(mem);
    return 0;
}
