/* Freivalds checks of expert outputs with Gaussian vectors
 * (include/kvasir/verify.h; the bound and the error analysis are
 * docs/VERIFY.md).
 *
 * Per prepared expert and per matrix (gate, up, down) we keep: n_proj
 * Gaussian vectors r (f32, out long), s = W^T r (f64, in long, accumulated
 * in f64 from the dequantized weights and the f32 r, so s belongs to exactly
 * the r that is stored), and the column statistics a = |W|^T 1 and
 * b = (W o W)^T 1 (f32, in long: the scale of the rounding error, the same
 * for every r). Both r and s are stored vector after vector ([n_proj][n]),
 * so the check's kernels (quant/vdot.h: scalar reference, AVX2, AVX-512,
 * NEON, chosen with the quant level) run down contiguous rows, 4 or 8
 * columns per register, and up to four answers of one expert
 * (kv_verify_check_batch) share every load of r and s.
 *
 * The vectors of generation t of matrix k of expert (layer, e) are ChaCha20
 * output (libsodium's randombytes_buf_deterministic) under the key
 * BLAKE2b(secret seed; layer, e, k, t), turned into normals by Box-Muller in
 * f64: the worker cannot predict them, and nothing it sees depends on them
 * except whether it was caught. Every rotate_every checks of an expert the
 * next generation replaces them in place (one pass over the weights the
 * verifier was given, which stay mapped): a check never allocates. */
#include <math.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/arch.h"
#include "kvasir/ops.h"
#include "kvasir/quant.h"
#include "quant/vdot.h"
#include "verify/verify_internal.h"

#define KV_U32 (1.0 / 16777216.0) /* unit roundoff of f32, 2^-24 */
#define KV_U64 (1.0 / 9007199254740992.0) /* unit roundoff of f64, 2^-53 */
#define KV_PI 3.14159265358979323846

typedef struct kv_vmat {
    uint32_t type, vdt;  /* weight type and its activation (vec_dot) type */
    uint32_t in, out;    /* columns and rows */
    const void *W;       /* the weights (a view the caller keeps mapped) */
    float *r;            /* [n_proj][out] Gaussian vectors, one after the other */
    double *s;           /* [n_proj][in] W^T r, likewise */
    float *a;            /* [in] column sums of |W| */
    float *b;            /* [in] column sums of W^2: E[s_j^2] for a Gaussian r */
    double rmax[KV_VERIFY_MAX_PROJ]; /* max_i |r_i| per vector (the worst-case bound) */
    double *c;           /* [n_proj][in/32] M^T r, M the blocks' mins: Q8_1 activations only, else NULL */
    const float *ob;     /* [out] the bias the worker adds to this product before answering (gpt-oss's
                            down; gate and up are answered before theirs), NULL: none */
    double rb[KV_VERIFY_MAX_PROJ];  /* r . ob per vector, in f64 */
    double rba[KV_VERIFY_MAX_PROJ]; /* |r| . |ob| (the worst-case bound's f64 rounding of rb) */
    double ob1, ob2;     /* |ob|_1, |ob|_2 */
} kv_vmat;

typedef struct kv_vexp {
    kv_vmat m[3];        /* gate, up, down */
    uint32_t act;        /* enum kv_expert_act between up and down */
    const float *gate_b, *up_b; /* [n_ff] biases added to the answered gate and up before act, or NULL */
    uint64_t gen;        /* generation of the vectors in m */
    uint32_t checks;     /* checks made with this generation */
} kv_vexp;

struct kv_verify {
    kv_verify_opts o;
    uint32_t n_layer, n_expert, n_embd, n_ff;
    uint8_t seed[32];    /* secret */
    kv_vexp **tab;       /* [n_layer * n_expert], NULL until prepared */
    size_t bytes;        /* projections held */
    /* scratch */
    double *acc;         /* [2][max(n_embd, n_ff)] column statistics in f64 */
    uint64_t *rnd;       /* [max * n_proj] the key stream of one matrix's vectors */
    float *row;          /* [max] a dequantized row */
    float *xin, *hin, *h; /* [KV_VDOT_MAX_NT][n_embd], [.][n_ff], [.][n_ff]: a group's activations */
    float *xup;          /* [KV_VDOT_MAX_NT][n_embd]: up's, when its activation type is not gate's */
    float *ub;           /* [n_ff] up plus its bias, the activation's second operand */
    double *dx, *dh, *dxu; /* [KV_VDOT_MAX_NT][n_embd/32], [.][n_ff/32], [.][n_embd/32]: Q8_1 blocks' s - d*sum(qs) */
    uint8_t *qbuf;       /* one quantized activation row */
};

size_t kv_verify_expert_bytes(uint32_t n_embd, uint32_t n_ff, uint32_t n_proj) {
    /* per matrix: r (f32) over the rows, s (f64) over the columns, a and b (f32) over the columns */
    const size_t gu = (size_t)n_proj * n_ff * 4 + (size_t)n_proj * n_embd * 8 + (size_t)n_embd * 8;
    const size_t dn = (size_t)n_proj * n_embd * 4 + (size_t)n_proj * n_ff * 8 + (size_t)n_ff * 8;
    return 2 * gu + dn + sizeof(kv_vexp);
}

double kv_verify_miss_bound(uint32_t n_proj, double ratio, uint32_t out) {
    if (!(ratio > 0)) return 1.0;
    const double one = sqrt(2.0 / KV_PI) * (1.0 / ratio + sqrt((double)out) / 8388608.0);
    return one >= 1.0 ? 1.0 : pow(one, (double)n_proj);
}

int kv_verify_new(kv_verify **out, uint32_t n_layer, uint32_t n_expert, uint32_t n_embd, uint32_t n_ff,
                  const kv_verify_opts *opts, kv_diag *d) {
    *out = NULL;
    if (!n_layer || !n_expert || !n_embd || !n_ff || n_embd > (1u << 20) || n_ff > (1u << 22) ||
        (uint64_t)n_layer * n_expert > (1u << 24))
        return kv_fail(d, KV_EINVAL, "verify: dims %u x %u experts, %u x %u out of bounds", n_layer, n_expert, n_embd,
                       n_ff);
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "verify: libsodium failed to start");
    kv_verify *v = calloc(1, sizeof *v);
    if (!v) return kv_fail(d, KV_ENOMEM, "verify: out of memory");
    if (opts) v->o = *opts;
    if (!v->o.n_proj) v->o.n_proj = KV_VERIFY_DEFAULT_PROJ;
    if (v->o.kappa <= 0) v->o.kappa = KV_VERIFY_KAPPA;
    if (!v->o.rotate_every) v->o.rotate_every = KV_VERIFY_ROTATE;
    if (v->o.n_proj > KV_VERIFY_MAX_PROJ) {
        free(v);
        return kv_fail(d, KV_EINVAL, "verify: at most %u projections per matrix", KV_VERIFY_MAX_PROJ);
    }
    if (v->o.seed) {
        memset(v->seed, 0, 32);
        for (int i = 0; i < 8; i++) v->seed[i] = (uint8_t)(v->o.seed >> (8 * i));
    } else {
        randombytes_buf(v->seed, 32);
    }
    v->n_layer = n_layer, v->n_expert = n_expert, v->n_embd = n_embd, v->n_ff = n_ff;
    const size_t mx = n_embd > n_ff ? n_embd : n_ff;
    v->tab = calloc((size_t)n_layer * n_expert, sizeof *v->tab);
    v->acc = malloc(2 * mx * sizeof(double));
    v->rnd = malloc((mx * v->o.n_proj + 1) * sizeof(uint64_t)); /* + 1: normals come in pairs */
    v->row = malloc(mx * sizeof(float));
    v->xin = malloc((size_t)KV_VDOT_MAX_NT * n_embd * sizeof(float));
    v->hin = malloc((size_t)KV_VDOT_MAX_NT * n_ff * sizeof(float));
    v->h = malloc((size_t)KV_VDOT_MAX_NT * n_ff * sizeof(float));
    v->xup = malloc((size_t)KV_VDOT_MAX_NT * n_embd * sizeof(float));
    v->ub = malloc((size_t)n_ff * sizeof(float));
    v->dxu = malloc(((size_t)KV_VDOT_MAX_NT * (n_embd / 32) + 1) * sizeof(double));
    v->qbuf = malloc(kv_matmul_scratch(mx, 1));
    v->dx = malloc(((size_t)KV_VDOT_MAX_NT * (n_embd / 32) + 1) * sizeof(double));
    v->dh = malloc(((size_t)KV_VDOT_MAX_NT * (n_ff / 32) + 1) * sizeof(double));
    if (!v->tab || !v->acc || !v->rnd || !v->row || !v->xin || !v->hin || !v->h || !v->qbuf || !v->dx || !v->dh ||
        !v->xup || !v->ub || !v->dxu) {
        kv_verify_free(v);
        return kv_fail(d, KV_ENOMEM, "verify: out of memory");
    }
    *out = v;
    return 0;
}

static void kv_vexp_free(kv_vexp *x) {
    if (!x) return;
    for (int k = 0; k < 3; k++) {
        free(x->m[k].r);
        free(x->m[k].s);
        free(x->m[k].a);
        free(x->m[k].b);
        free(x->m[k].c);
    }
    free(x);
}

void kv_verify_free(kv_verify *v) {
    if (!v) return;
    if (v->tab)
        for (size_t i = 0; i < (size_t)v->n_layer * v->n_expert; i++) kv_vexp_free(v->tab[i]);
    free(v->tab);
    free(v->acc);
    if (v->rnd) sodium_memzero(v->rnd, ((size_t)(v->n_embd > v->n_ff ? v->n_embd : v->n_ff) * v->o.n_proj + 1) * 8);
    free(v->rnd);
    free(v->row);
    free(v->xin);
    free(v->hin);
    free(v->h);
    free(v->qbuf);
    free(v->dx);
    free(v->dh);
    free(v->xup);
    free(v->ub);
    free(v->dxu);
    sodium_memzero(v->seed, sizeof v->seed);
    free(v);
}

size_t kv_verify_bytes(const kv_verify *v) { return v->bytes; }

bool kv_verify_ready(const kv_verify *v, uint32_t layer, uint32_t e) {
    return layer < v->n_layer && e < v->n_expert && v->tab[(size_t)layer * v->n_expert + e] != NULL;
}

/* The vectors of generation gen of matrix k of expert (layer, e): n normals
 * from the ChaCha20 stream keyed by BLAKE2b(seed; layer, e, k, gen). */
static void kv_verify_normals(kv_verify *v, uint32_t layer, uint32_t e, uint32_t k, uint64_t gen, float *r,
                              size_t n) {
    uint8_t key[32], tag[20];
    for (int i = 0; i < 4; i++) {
        tag[i] = (uint8_t)(layer >> (8 * i));
        tag[4 + i] = (uint8_t)(e >> (8 * i));
        tag[8 + i] = (uint8_t)(k >> (8 * i));
    }
    for (int i = 0; i < 8; i++) tag[12 + i] = (uint8_t)(gen >> (8 * i));
    crypto_generichash(key, sizeof key, tag, sizeof tag, v->seed, sizeof v->seed);
    const size_t n2 = (n + 1) & ~(size_t)1; /* Box-Muller makes pairs */
    randombytes_buf_deterministic(v->rnd, n2 * sizeof(uint64_t), key);
    sodium_memzero(key, sizeof key);
    for (size_t i = 0; i < n2; i += 2) {
        /* u1 in (0, 1], u2 in [0, 1), 53 bits each (the stream's words read little-endian or
         * not: the same secret bits either way) */
        const double u1 = ((double)(v->rnd[i] >> 11) + 1.0) * KV_U64;
        const double u2 = (double)(v->rnd[i + 1] >> 11) * KV_U64;
        const double rho = sqrt(-2.0 * log(u1));
        r[i] = (float)(rho * cos(2.0 * KV_PI * u2));
        if (i + 1 < n) r[i + 1] = (float)(rho * sin(2.0 * KV_PI * u2));
    }
}

/* Generation gen of matrix k's vectors and their s = W^T r (one pass over W);
 * with stats, also the column statistics a and b (the first time only). */
static void kv_vmat_fill(kv_verify *v, kv_vmat *m, uint32_t layer, uint32_t e, uint32_t k, uint64_t gen,
                         bool stats) {
    const kv_type_info *ti = kv_type_get(m->type);
    const kv_vkernels *K = kv_vkernels_get();
    const uint64_t rb = kv_type_row_size(m->type, m->in);
    const uint32_t P = v->o.n_proj;
    kv_verify_normals(v, layer, e, k, gen, m->r, (size_t)m->out * P);
    for (uint32_t p = 0; p < P; p++) m->rmax[p] = 0;
    for (size_t i = 0; i < (size_t)m->out * P; i++)
        if (fabs((double)m->r[i]) > m->rmax[i / m->out]) m->rmax[i / m->out] = fabs((double)m->r[i]);
    if (m->ob) /* the output bias projected: r . y - r . ob is the product's projection */
        for (uint32_t p = 0; p < P; p++) {
            double acc = 0, aa = 0;
            for (uint32_t i = 0; i < m->out; i++) {
                const double t = (double)m->r[(size_t)p * m->out + i] * m->ob[i];
                acc += t;
                aa += fabs(t);
            }
            m->rb[p] = acc;
            m->rba[p] = aa;
        }
    memset(m->s, 0, (size_t)m->in * P * sizeof(double));
    double *ap = v->acc, *bp = v->acc + m->in;
    if (stats) memset(v->acc, 0, 2 * (size_t)m->in * sizeof(double));
    /* column tiles of about 256 weights, so that the tile of s every row adds to stays in
     * the cache; each s_j is still summed over the rows in increasing i */
    uint32_t tw = ti->blck >= 256 ? ti->blck : 256 / ti->blck * ti->blck;
    if (m->in % tw) tw = m->in;
    for (uint32_t j0 = 0; j0 < m->in; j0 += tw) {
        const size_t off = (size_t)(j0 / ti->blck) * ti->size;
        for (uint32_t i = 0; i < m->out; i++) {
            ti->to_float((const uint8_t *)m->W + (size_t)i * rb + off, v->row, tw);
            double rp[KV_VERIFY_MAX_PROJ];
            for (uint32_t p = 0; p < P; p++) rp[p] = m->r[(size_t)p * m->out + i];
            K->axpy(P, rp, v->row, tw, m->s + j0, m->in);
            if (stats)
                for (uint32_t j = 0; j < tw; j++) {
                    const double w = v->row[j];
                    ap[j0 + j] += fabs(w);
                    bp[j0 + j] += w * w;
                }
        }
    }
    if (stats)
        for (uint32_t j = 0; j < m->in; j++) {
            m->a[j] = (float)ap[j];
            m->b[j] = (float)bp[j];
        }
    if (m->c) { /* Q4_1/Q5_1 blocks begin with fp16 d, then fp16 m (quant/legacy.h) */
        const uint32_t nb = m->in / 32;
        memset(m->c, 0, (size_t)nb * P * sizeof(double));
        for (uint32_t i = 0; i < m->out; i++) {
            const uint8_t *row = (const uint8_t *)m->W + (size_t)i * rb;
            for (uint32_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + (size_t)b * ti->size;
                const double mn = kv_fp16_to_fp32((uint16_t)(blk[2] | blk[3] << 8));
                for (uint32_t p = 0; p < P; p++) m->c[(size_t)p * nb + b] += (double)m->r[(size_t)p * m->out + i] * mn;
            }
        }
    }
}

/* Whether the check can read a matrix of type with rows of `in` elements:
 * to_float, and with Q8_1 activations blocks of 32 that begin with d, m. */
static bool kv_vmat_readable(uint32_t type, uint32_t in) {
    const kv_type_info *ti = kv_type_get(type);
    if (!ti || !ti->to_float || !kv_type_row_size(type, in)) return false;
    const kv_type_info *vi = kv_type_get(ti->vec_dot_type);
    if (!vi || (ti->vec_dot_type != KV_TYPE_F32 && !vi->to_float)) return false;
    return ti->vec_dot_type != KV_TYPE_Q8_1 || (ti->blck == 32 && ti->size >= 4 && in % 32 == 0);
}

int kv_verify_supported(const kv_expert_weights *w, uint32_t layer, uint32_t n_embd, uint32_t n_ff, kv_diag *d) {
    static const char *const stems[3] = {KV_EXPERT_STEM_GATE, KV_EXPERT_STEM_UP, KV_EXPERT_STEM_DOWN};
    const uint32_t types[3] = {w->gate_type, w->up_type, w->down_type};
    for (int k = 0; k < 3; k++)
        if (!kv_vmat_readable(types[k], k < 2 ? n_embd : n_ff)) {
            const kv_type_info *ti = kv_type_get(types[k]);
            return kv_fail(d, KV_EUNSUPPORTED, "verify: tensor 'blk.%u.%s.weight' has type %s (%u), which the "
                           "verifier cannot check; run without verification", layer, stems[k], ti ? ti->name : "?",
                           types[k]);
        }
    if (w->act > KV_ACT_SWIGLU_CLAMP)
        return kv_fail(d, KV_EUNSUPPORTED, "verify: layer %u: expert activation %u is not one the verifier computes",
                       layer, w->act);
    return 0;
}

size_t kv_verify_weights_bytes(const kv_expert_weights *w, uint32_t n_embd, uint32_t n_ff, uint32_t n_proj) {
    size_t n = kv_verify_expert_bytes(n_embd, n_ff, n_proj);
    const uint32_t types[3] = {w->gate_type, w->up_type, w->down_type};
    for (int k = 0; k < 3; k++) /* the projected mins of Q8_1-activation blocks (kv_vmat.c) */
        if (kv_type_get(types[k]) && kv_type_get(types[k])->vec_dot_type == KV_TYPE_Q8_1)
            n += (size_t)n_proj * ((k < 2 ? n_embd : n_ff) / 32) * sizeof(double);
    return n;
}

/* Room and statistics for one matrix (out rows of `in` elements of type);
 * ob: the bias the worker adds to its output, or NULL. */
static int kv_vmat_prepare(kv_verify *v, kv_vmat *m, const void *W, uint32_t type, uint32_t in, uint32_t out,
                           const float *ob, uint32_t layer, uint32_t e, uint32_t k, kv_diag *d) {
    const kv_type_info *ti = kv_type_get(type);
    if (!kv_vmat_readable(type, in)) return kv_fail(d, KV_EUNSUPPORTED, "verify: weight type %u cannot be read", type);
    const uint32_t P = v->o.n_proj;
    m->ob = ob;
    m->ob1 = m->ob2 = 0;
    for (uint32_t i = 0; ob && i < out; i++) {
        m->ob1 += fabs((double)ob[i]);
        m->ob2 += (double)ob[i] * ob[i];
    }
    m->ob2 = sqrt(m->ob2);
    m->type = type;
    m->vdt = ti->vec_dot_type;
    m->in = in;
    m->out = out;
    m->W = W;
    m->r = malloc((size_t)P * out * sizeof(float));
    m->s = malloc((size_t)P * in * sizeof(double));
    m->a = malloc((size_t)in * sizeof(float));
    m->b = malloc((size_t)in * sizeof(float));
    /* With Q8_1 activations (Q4_1, Q5_1) the kernel's min term is m * s, s the activation
     * block's fp16 d*sum(qs), not m * d * sum(qs) as the dequantized operands say: c
     * carries each block's mins projected, and the check adds c . (s - d*sum(qs)). */
    if (m->vdt == KV_TYPE_Q8_1 && ti->blck == 32 && ti->size >= 4 && in % 32 == 0)
        m->c = malloc((size_t)P * (in / 32) * sizeof(double));
    if (!m->r || !m->s || !m->a || !m->b || (m->vdt == KV_TYPE_Q8_1 && !m->c))
        return kv_fail(d, KV_ENOMEM, "verify: out of memory");
    kv_vmat_fill(v, m, layer, e, k, 0, true);
    return 0;
}

int kv_verify_prepare(kv_verify *v, uint32_t layer, uint32_t e, const kv_expert_weights *w, kv_diag *d) {
    if (layer >= v->n_layer || e >= v->n_expert)
        return kv_fail(d, KV_ERANGE, "verify: layer %u expert %u out of range", layer, e);
    kv_vexp **slot = &v->tab[(size_t)layer * v->n_expert + e];
    if (*slot) return 0;
    int rc = kv_verify_supported(w, layer, v->n_embd, v->n_ff, d);
    if (rc) return rc;
    kv_vexp *x = calloc(1, sizeof *x);
    if (!x) return kv_fail(d, KV_ENOMEM, "verify: out of memory");
    /* gpt-oss: the answered gate and up are the products before their biases (as the worker's
     * kv_expert_local_compute_pre returns them); down's bias is in the answered output */
    x->act = w->act;
    x->gate_b = w->gate_b;
    x->up_b = w->up_b;
    const void *mats[3] = {w->gate, w->up, w->down};
    const uint32_t types[3] = {w->gate_type, w->up_type, w->down_type};
    for (uint32_t k = 0; k < 3 && !rc; k++)
        rc = k < 2 ? kv_vmat_prepare(v, &x->m[k], mats[k], types[k], v->n_embd, v->n_ff, NULL, layer, e, k, d)
                   : kv_vmat_prepare(v, &x->m[k], mats[k], types[k], v->n_ff, v->n_embd, w->down_b, layer, e, k, d);
    if (rc) {
        kv_vexp_free(x);
        return rc;
    }
    *slot = x;
    v->bytes += kv_verify_weights_bytes(w, v->n_embd, v->n_ff, v->o.n_proj);
    return 0;
}

int kv_verify_peek(const kv_verify *v, uint32_t layer, uint32_t e, int stage, uint32_t p, float *r, uint64_t *gen) {
    if (!kv_verify_ready(v, layer, e)) return KV_ENOTFOUND;
    if (stage < 0 || stage > 2 || p >= v->o.n_proj) return KV_ERANGE;
    const kv_vexp *X = v->tab[(size_t)layer * v->n_expert + e];
    const kv_vmat *m = &X->m[stage];
    memcpy(r, m->r + (size_t)p * m->out, m->out * sizeof(float));
    *gen = X->gen;
    return 0;
}

/* The activation as the worker's kernel sees it: converted to vdt and back. */
static void kv_verify_activation(kv_verify *v, const kv_vkernels *K, uint32_t vdt, const float *x, uint32_t n,
                                 float *out, double *delta) {
    if (vdt == KV_TYPE_F32) {
        memcpy(out, x, n * sizeof(float));
        return;
    }
    if (vdt == KV_TYPE_Q8_K && K->q8k)
        K->q8k(x, v->qbuf, n); /* from_float's bits */
    else
        kv_quantize_rows(vdt, x, n, n, 1, v->qbuf, (size_t)kv_type_row_size(vdt, n));
    if (vdt == KV_TYPE_Q8_0 || vdt == KV_TYPE_Q8_K)
        K->deq(vdt, v->qbuf, out, n); /* the bits of to_float, vectorized */
    else
        kv_type_get(vdt)->to_float(v->qbuf, out, n);
    if (vdt == KV_TYPE_Q8_1) /* delta[b] = s - d * sum(qs) of block b (36 bytes: d, s, qs[32]) */
        for (uint32_t b = 0; b < n / 32; b++) {
            const uint8_t *q = v->qbuf + (size_t)b * 36;
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) sum += (int8_t)q[4 + j];
            delta[b] = (double)kv_fp16_to_fp32((uint16_t)(q[2] | q[3] << 8)) -
                       (double)kv_fp16_to_fp32((uint16_t)(q[0] | q[1] << 8)) * sum;
        }
}

/* rhs[t*P + p] += c_p . delta_t for the nt answers, when m has Q8_1 activations. */
static void kv_verify_min_term(const kv_vmat *m, uint32_t P, uint32_t nt, const double *delta, double *rhs) {
    if (!m->c) return;
    const uint32_t nb = m->in / 32;
    for (uint32_t t = 0; t < nt; t++)
        for (uint32_t p = 0; p < P; p++) {
            double acc = 0;
            for (uint32_t b = 0; b < nb; b++) acc += m->c[(size_t)p * nb + b] * delta[(size_t)t * nb + b];
            rhs[t * P + p] += acc;
        }
}

/* The outcome of one stage of one answer. */
typedef struct kv_vres {
    int first;           /* the first vector beyond its tolerance, -1 if none */
    bool nonfinite;      /* r . out is not finite: out holds an infinity or a NaN */
    uint32_t over;       /* how many are */
    double lhs, rhs, tol; /* of the first */
    double worst;        /* max |lhs - rhs| / tol */
} kv_vres;

/* Compares r . outv (lhs) with s . in (rhs) for every vector r of m, given
 * the tolerance's sums S and B of in. */
static kv_vres kv_verify_cmp(const kv_verify *v, const kv_vmat *m, const double *lhs, const double *rhs, double S,
                             double B, const float *in, const float *outv) {
    const uint32_t P = v->o.n_proj;
    /* with an output bias, out_i = fl(product_i + ob_i): one more rounding of at most
     * u (|product_i| + |ob_i|) per row, which r weighs as it weighs the product's own: the
     * product's part is of the scale sqrt(B) already covers, ob's adds kappa u |ob|_2. Both
     * terms depend on the input and the weights only, never on the answer checked. */
    const double T = v->o.kappa * KV_U32 * (S / sqrt((double)m->in * m->out) + sqrt(B) + m->ob2) + 1e-30;
    double gab[KV_VERIFY_MAX_PROJ] = {0}, sab[KV_VERIFY_MAX_PROJ] = {0};
    if (v->o.worst_case) { /* the f64 sums' own rounding, rigorously: n u64 sum |terms| */
        for (uint32_t i = 0; i < m->out; i++)
            for (uint32_t p = 0; p < P; p++) gab[p] += fabs((double)m->r[(size_t)p * m->out + i] * outv[i]);
        for (uint32_t j = 0; j < m->in; j++)
            for (uint32_t p = 0; p < P; p++) sab[p] += fabs(m->s[(size_t)p * m->in + j] * in[j]);
    }
    kv_vres res = {-1, false, 0, 0, 0, 0, 0};
    /* Non-finite values are lies. r . out is finite exactly when out is: an infinity or a
     * NaN makes every term it enters infinite or NaN (0 x inf is NaN), and finite terms
     * cannot overflow an f64 sum (|r_i out_i| < 2^131, n < 2^23). */
    for (uint32_t p = 0; p < P; p++)
        if (!isfinite(lhs[p])) {
            res.first = 0, res.over = P, res.nonfinite = true;
            return res;
        }
    for (uint32_t p = 0; p < P; p++) {
        double tol = T;
        const double l = m->ob ? lhs[p] - m->rb[p] : lhs[p]; /* the product's projection */
        if (v->o.worst_case) {
            /* every dot: |error| <= n u / (1 - n u) sum |w x|, weighted by |r_i| <= rmax; then
             * the f64 sums (out and in terms) and s itself (out terms per column) */
            const double g = m->in * KV_U32 / (1 - m->in * KV_U32);
            const double g64 = 2.0 * (m->in + m->out) * KV_U64;
            tol = (g + 2.0 * m->out * KV_U64) * m->rmax[p] * S + g64 * (gab[p] + sab[p]) + 1e-30;
            if (m->ob) /* the bias's rounding, u max|r| (sum|product| <= S, + |ob|_1), and r . ob's own in f64 */
                tol += KV_U32 * m->rmax[p] * (S + m->ob1) + 2.0 * m->out * KV_U64 * m->rba[p];
        }
        const double ratio = fabs(l - rhs[p]) / tol;
        if (ratio > res.worst) res.worst = ratio;
        if (!(ratio <= 1.0)) {
            res.over++;
            if (res.first < 0) res.first = (int)p, res.lhs = l, res.rhs = rhs[p], res.tol = tol;
        }
    }
    return res;
}

/* The report and message of a failed stage. */
static int kv_verify_caught(const kv_verify *v, int stage, const kv_vres *res, kv_verify_report *rep, kv_diag *d) {
    static const char *const names[3] = {"gate", "up", "down"};
    if (rep) {
        rep->stage = stage;
        rep->proj = (uint32_t)res->first;
        rep->n_over = res->over;
        rep->lhs = res->lhs;
        rep->rhs = res->rhs;
        rep->tol = res->tol;
    }
    return kv_fail(d, KV_EPROTO, "caught: %s product differs from %u of %u projections (first by %.3g, tolerance %.3g)",
                   names[stage], res->over, v->o.n_proj, fabs(res->lhs - res->rhs), res->tol);
}

/* The next generation of an expert's vectors, in place. */
static void kv_verify_rotate(kv_verify *v, uint32_t layer, uint32_t e, kv_vexp *X) {
    X->gen++;
    X->checks = 0;
    for (uint32_t k = 0; k < 3; k++) kv_vmat_fill(v, &X->m[k], layer, e, k, X->gen, false);
}

/* Answers k0 .. k0 + nt - 1 of a batch (one generation), each
 * checked as kv_verify_check would, the loads of r and s shared. Returns
 * 0, or the first failing answer's error with its index in *bad. */
static int kv_verify_group(kv_verify *v, kv_vexp *X, uint32_t nt, const float *const *x, const float *const *gate,
                           const float *const *up, const float *const *y, uint32_t *bad, kv_verify_report *rep,
                           kv_diag *d) {
    const kv_vkernels *K = kv_vkernels_get();
    const uint32_t P = v->o.n_proj, E = v->n_embd, F = v->n_ff;
    double lg[KV_VDOT_MAX_NT * KV_VERIFY_MAX_PROJ], rg[KV_VDOT_MAX_NT * KV_VERIFY_MAX_PROJ];
    double lu[KV_VDOT_MAX_NT * KV_VERIFY_MAX_PROJ], ru[KV_VDOT_MAX_NT * KV_VERIFY_MAX_PROJ];
    double Sg[KV_VDOT_MAX_NT], Bg[KV_VDOT_MAX_NT], Su[KV_VDOT_MAX_NT], Bu[KV_VDOT_MAX_NT];
    const float *xin[KV_VDOT_MAX_NT], *xup[KV_VDOT_MAX_NT], *hin[KV_VDOT_MAX_NT];
    /* up's input as its kernel sees it: gate's, unless its activation type differs (gate Q8_0, up Q4_K) */
    const bool own_up = X->m[1].vdt != X->m[0].vdt;
    for (uint32_t t = 0; t < nt; t++) {
        kv_verify_activation(v, K, X->m[0].vdt, x[t], E, v->xin + (size_t)t * E, v->dx + (size_t)t * (E / 32));
        xin[t] = v->xin + (size_t)t * E;
        xup[t] = xin[t];
        if (own_up) {
            kv_verify_activation(v, K, X->m[1].vdt, x[t], E, v->xup + (size_t)t * E, v->dxu + (size_t)t * (E / 32));
            xup[t] = v->xup + (size_t)t * E;
        }
    }
    K->dots(P, nt, X->m[0].r, gate, F, X->m[0].s, X->m[0].a, X->m[0].b, xin, E, lg, rg, Sg, Bg);
    K->dots(P, nt, X->m[1].r, up, F, X->m[1].s, X->m[1].a, X->m[1].b, xup, E, lu, ru, Su, Bu);
    kv_verify_min_term(&X->m[0], P, nt, v->dx, rg);
    kv_verify_min_term(&X->m[1], P, nt, own_up ? v->dxu : v->dx, ru);
    /* gate and up of each answer in order; the first failure ends the group there */
    kv_vres fail = {-1, false, 0, 0, 0, 0, 0};
    int fstage = -1;
    uint32_t nd = nt; /* answers whose down product is checked */
    double worst[KV_VDOT_MAX_NT] = {0};
    for (uint32_t t = 0; t < nt && fstage < 0; t++) {
        const kv_vres rgt = kv_verify_cmp(v, &X->m[0], lg + t * P, rg + t * P, Sg[t], Bg[t], xin[t], gate[t]);
        worst[t] = rgt.worst;
        if (rgt.first >= 0) {
            fail = rgt, fstage = 0, nd = t;
            break;
        }
        const kv_vres rut = kv_verify_cmp(v, &X->m[1], lu + t * P, ru + t * P, Su[t], Bu[t], xup[t], up[t]);
        worst[t] = fmax(worst[t], rut.worst);
        if (rut.first >= 0) fail = rut, fstage = 1, nd = t;
        /* the down input, recomputed from the checked gate and up as the worker does */
        if (fstage < 0) {
            float *h = v->h + (size_t)t * F;
            if (X->act == KV_ACT_SWIGLU && !X->gate_b && !X->up_b) {
                K->swiglu(h, gate[t], up[t], F); /* kv_swiglu's bits */
            } else { /* the biases, then the activation, in src/moe/local.c's operations */
                for (uint32_t k = 0; k < F; k++) h[k] = X->gate_b ? gate[t][k] + X->gate_b[k] : gate[t][k];
                for (uint32_t k = 0; k < F; k++) v->ub[k] = X->up_b ? up[t][k] + X->up_b[k] : up[t][k];
                kv_expert_act(X->act, h, h, v->ub, F);
            }
            if (!K->finite(h, F)) fstage = 3, nd = t;
            else kv_verify_activation(v, K, X->m[2].vdt, h, F, v->hin + (size_t)t * F, v->dh + (size_t)t * (F / 32));
        }
        hin[t] = v->hin + (size_t)t * F;
    }
    /* the down products of the answers before the first failure */
    uint32_t t_bad = nd;
    if (nd) {
        double ld[KV_VDOT_MAX_NT * KV_VERIFY_MAX_PROJ], rd[KV_VDOT_MAX_NT * KV_VERIFY_MAX_PROJ];
        double Sd[KV_VDOT_MAX_NT], Bd[KV_VDOT_MAX_NT];
        K->dots(P, nd, X->m[2].r, y, E, X->m[2].s, X->m[2].a, X->m[2].b, hin, F, ld, rd, Sd, Bd);
        kv_verify_min_term(&X->m[2], P, nd, v->dh, rd);
        for (uint32_t t = 0; t < nd; t++) {
            const kv_vres rdt = kv_verify_cmp(v, &X->m[2], ld + t * P, rd + t * P, Sd[t], Bd[t], hin[t], y[t]);
            worst[t] = fmax(worst[t], rdt.worst);
            if (rdt.first >= 0) {
                fail = rdt, fstage = 2, t_bad = t;
                break;
            }
        }
    }
    /* what the checks of answers 0 .. t_bad (all, if none failed) made */
    const uint32_t n_seen = fstage < 0 ? nt : t_bad + 1;
    for (uint32_t t = 0; t < n_seen; t++)
        if (rep && worst[t] > rep->worst_ratio) rep->worst_ratio = worst[t];
    X->checks += n_seen;
    if (fstage < 0) return 0;
    if (bad) *bad = t_bad;
    if (fstage == 3) return kv_fail(d, KV_EPROTO, "caught: SwiGLU of the pre-activations is not finite");
    if (fail.nonfinite)
        return kv_fail(d, KV_EPROTO, fstage == 2 ? "caught: an output is not finite"
                                                 : "caught: a pre-activation is not finite");
    return kv_verify_caught(v, fstage, &fail, rep, d);
}

int kv_verify_check_batch(kv_verify *v, uint32_t layer, uint32_t e, uint32_t n, const float *const *x,
                          const float *const *gate, const float *const *up, const float *const *y, uint32_t *bad,
                          kv_verify_report *rep, kv_diag *d) {
    if (rep) {
        memset(rep, 0, sizeof *rep);
        rep->stage = -1;
    }
    if (bad) *bad = 0;
    if (!kv_verify_ready(v, layer, e))
        return kv_fail(d, KV_ENOTFOUND, "verify: layer %u expert %u has no projections", layer, e);
    kv_vexp *X = v->tab[(size_t)layer * v->n_expert + e];
    for (uint32_t k = 0; k < n;) {
        if (v->o.rotate_every != UINT32_MAX && X->checks >= v->o.rotate_every) kv_verify_rotate(v, layer, e, X);
        if (rep) rep->generation = X->gen;
        /* a group: up to KV_VDOT_MAX_NT answers of one generation */
        const uint32_t room = v->o.rotate_every == UINT32_MAX ? KV_VDOT_MAX_NT : v->o.rotate_every - X->checks;
        uint32_t nt = n - k < KV_VDOT_MAX_NT ? n - k : KV_VDOT_MAX_NT;
        if (nt > room) nt = room;
        uint32_t b = 0;
        const int rc = kv_verify_group(v, X, nt, x + k, gate + k, up + k, y + k, &b, rep, d);
        if (rc) {
            if (bad) *bad = k + b;
            return rc;
        }
        k += nt;
    }
    return 0;
}

int kv_verify_check(kv_verify *v, uint32_t layer, uint32_t e, const float *x, const float *gate, const float *up,
                    const float *y, kv_verify_report *rep, kv_diag *d) {
    return kv_verify_check_batch(v, layer, e, 1, &x, &gate, &up, &y, NULL, rep, d);
}
