/* Freivalds checks of expert outputs (include/kvasir/verify.h; the error
 * analysis is docs/VERIFY.md).
 *
 * Per prepared expert and per matrix (gate, up, down) we keep: n_proj sign
 * vectors r (bits, out long), s = W^T r (f32, in long, accumulated in f64
 * from the dequantized weights) and a = |W|^T 1 (f32, in long: the scale of
 * the rounding error). The sign vectors come from a secret seed (the OS's
 * RNG unless a test fixes one) through libsodium's deterministic stream, so
 * they are the verifier's alone. Everything a check needs besides the
 * projections is scratch allocated in kv_verify_new: a check never
 * allocates. */
#include <math.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/ops.h"
#include "kvasir/quant.h"
#include "kvasir/verify.h"

#define KV_U32 (1.0 / 16777216.0) /* unit roundoff of f32, 2^-24 */

typedef struct kv_vmat {
    uint32_t type, vdt;  /* weight type and its activation (vec_dot) type */
    uint32_t in, out;    /* columns and rows */
    uint8_t *r;          /* [n_proj][(out + 7) / 8] sign bits (1 = -1) */
    float *s;            /* [n_proj][in] W^T r */
    float *a;            /* [in] column sums of |W| */
} kv_vmat;

typedef struct kv_vexp {
    kv_vmat m[3];        /* gate, up, down */
} kv_vexp;

struct kv_verify {
    kv_verify_opts o;
    uint32_t n_layer, n_expert, n_embd, n_ff;
    uint8_t seed[32];    /* secret */
    kv_vexp **tab;       /* [n_layer * n_expert], NULL until prepared */
    size_t bytes;        /* projections held */
    /* scratch */
    double *acc;         /* [n_proj + 1][max(n_embd, n_ff)] */
    float *row;          /* [max] a dequantized row / a dequantized activation */
    float *xin, *hin, *h; /* [n_embd], [n_ff], [n_ff] */
    uint8_t *qbuf;       /* one quantized activation row */
};

size_t kv_verify_expert_bytes(uint32_t n_embd, uint32_t n_ff, uint32_t n_proj) {
    const size_t gu = (size_t)n_proj * n_embd * 4 + (size_t)n_embd * 4 + (size_t)n_proj * ((n_ff + 7) / 8);
    const size_t dn = (size_t)n_proj * n_ff * 4 + (size_t)n_ff * 4 + (size_t)n_proj * ((n_embd + 7) / 8);
    return 2 * gu + dn + sizeof(kv_vexp);
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
    if (!v->o.n_proj) v->o.n_proj = 2;
    if (v->o.kappa <= 0) v->o.kappa = KV_VERIFY_KAPPA;
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
    v->acc = malloc((v->o.n_proj + 1) * mx * sizeof(double));
    v->row = malloc(mx * sizeof(float));
    v->xin = malloc(n_embd * sizeof(float));
    v->hin = malloc(n_ff * sizeof(float));
    v->h = malloc(n_ff * sizeof(float));
    v->qbuf = malloc(kv_matmul_scratch(mx, 1));
    if (!v->tab || !v->acc || !v->row || !v->xin || !v->hin || !v->h || !v->qbuf) {
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
    }
    free(x);
}

void kv_verify_free(kv_verify *v) {
    if (!v) return;
    if (v->tab)
        for (size_t i = 0; i < (size_t)v->n_layer * v->n_expert; i++) kv_vexp_free(v->tab[i]);
    free(v->tab);
    free(v->acc);
    free(v->row);
    free(v->xin);
    free(v->hin);
    free(v->h);
    free(v->qbuf);
    sodium_memzero(v->seed, sizeof v->seed);
    free(v);
}

size_t kv_verify_bytes(const kv_verify *v) { return v->bytes; }

bool kv_verify_ready(const kv_verify *v, uint32_t layer, uint32_t e) {
    return layer < v->n_layer && e < v->n_expert && v->tab[(size_t)layer * v->n_expert + e] != NULL;
}

/* Projections of one matrix (out rows of `in` elements of type). */
static int kv_vmat_prepare(kv_verify *v, kv_vmat *m, const void *W, uint32_t type, uint32_t in, uint32_t out,
                           const uint8_t seed[32], kv_diag *d) {
    const kv_type_info *ti = kv_type_get(type);
    const uint64_t rb = kv_type_row_size(type, in);
    if (!ti || !ti->to_float || !rb) return kv_fail(d, KV_EUNSUPPORTED, "verify: weight type %u cannot be read", type);
    const uint32_t P = v->o.n_proj, nb = (out + 7) / 8;
    m->type = type;
    m->vdt = ti->vec_dot_type;
    m->in = in;
    m->out = out;
    m->r = malloc((size_t)P * nb);
    m->s = malloc((size_t)P * in * sizeof(float));
    m->a = malloc((size_t)in * sizeof(float));
    if (!m->r || !m->s || !m->a) return kv_fail(d, KV_ENOMEM, "verify: out of memory");
    randombytes_buf_deterministic(m->r, (size_t)P * nb, seed);
    double *acc = v->acc; /* [P][in] then a at [P*in] */
    memset(acc, 0, (size_t)(P + 1) * in * sizeof(double));
    for (uint32_t i = 0; i < out; i++) {
        ti->to_float((const uint8_t *)W + (size_t)i * rb, v->row, in);
        for (uint32_t p = 0; p < P; p++) {
            const bool neg = (m->r[(size_t)p * nb + i / 8] >> (i % 8)) & 1;
            double *sp = acc + (size_t)p * in;
            if (neg)
                for (uint32_t j = 0; j < in; j++) sp[j] -= v->row[j];
            else
                for (uint32_t j = 0; j < in; j++) sp[j] += v->row[j];
        }
        double *ap = acc + (size_t)P * in;
        for (uint32_t j = 0; j < in; j++) ap[j] += fabs((double)v->row[j]);
    }
    for (size_t j = 0; j < (size_t)P * in; j++) m->s[j] = (float)acc[j];
    for (uint32_t j = 0; j < in; j++) m->a[j] = (float)acc[(size_t)P * in + j];
    return 0;
}

int kv_verify_prepare(kv_verify *v, uint32_t layer, uint32_t e, const kv_expert_weights *w, kv_diag *d) {
    if (layer >= v->n_layer || e >= v->n_expert)
        return kv_fail(d, KV_ERANGE, "verify: layer %u expert %u out of range", layer, e);
    kv_vexp **slot = &v->tab[(size_t)layer * v->n_expert + e];
    if (*slot) return 0;
    kv_vexp *x = calloc(1, sizeof *x);
    if (!x) return kv_fail(d, KV_ENOMEM, "verify: out of memory");
    /* one secret stream per (expert, matrix) */
    const void *mats[3] = {w->gate, w->up, w->down};
    const uint32_t types[3] = {w->gate_type, w->up_type, w->down_type};
    int rc = 0;
    for (int k = 0; k < 3 && !rc; k++) {
        uint8_t ms[32], tag[12];
        for (int i = 0; i < 4; i++) {
            tag[i] = (uint8_t)(layer >> (8 * i));
            tag[4 + i] = (uint8_t)(e >> (8 * i));
            tag[8 + i] = (uint8_t)((uint32_t)k >> (8 * i));
        }
        crypto_generichash(ms, 32, tag, sizeof tag, v->seed, 32);
        rc = k < 2 ? kv_vmat_prepare(v, &x->m[k], mats[k], types[k], v->n_embd, v->n_ff, ms, d)
                   : kv_vmat_prepare(v, &x->m[k], mats[k], types[k], v->n_ff, v->n_embd, ms, d);
        sodium_memzero(ms, sizeof ms);
    }
    if (!rc && x->m[0].vdt != x->m[1].vdt) rc = kv_fail(d, KV_EUNSUPPORTED, "verify: gate and up activations differ");
    if (rc) {
        kv_vexp_free(x);
        return rc;
    }
    *slot = x;
    v->bytes += kv_verify_expert_bytes(v->n_embd, v->n_ff, v->o.n_proj);
    return 0;
}

/* The activation as the worker's kernel sees it: converted to vdt and back. */
static void kv_verify_activation(kv_verify *v, uint32_t vdt, const float *x, uint32_t n, float *out) {
    if (vdt == KV_TYPE_F32) {
        memcpy(out, x, n * sizeof(float));
        return;
    }
    kv_quantize_rows(vdt, x, n, n, 1, v->qbuf, (size_t)kv_type_row_size(vdt, n));
    kv_type_get(vdt)->to_float(v->qbuf, out, n);
}

/* Compares r . outv with s . in for every projection of m. */
static int kv_verify_mat(kv_verify *v, const kv_vmat *m, int stage, const float *in, const float *outv,
                         kv_verify_report *rep, kv_diag *d) {
    const uint32_t nb = (m->out + 7) / 8;
    double scale = 0;
    for (uint32_t j = 0; j < m->in; j++) scale += (double)m->a[j] * fabs((double)in[j]);
    for (uint32_t p = 0; p < v->o.n_proj; p++) {
        const uint8_t *r = m->r + (size_t)p * nb;
        const float *s = m->s + (size_t)p * m->in;
        double lhs = 0, rhs = 0, ss = 0, sabs = 0;
        for (uint32_t i = 0; i < m->out; i++) lhs += ((r[i / 8] >> (i % 8)) & 1) ? -(double)outv[i] : (double)outv[i];
        for (uint32_t j = 0; j < m->in; j++) {
            const double t = (double)s[j] * (double)in[j];
            rhs += t;
            ss += t * t;
            sabs += fabs(t);
        }
        double tol;
        if (v->o.worst_case) {
            /* every dot: |error| <= n u / (1 - n u) sum |w x|; s rounded to f32: u sum |s x| */
            const double g = m->in * KV_U32 / (1 - m->in * KV_U32);
            tol = g * scale + 2 * KV_U32 * sabs;
        } else {
            tol = v->o.kappa * KV_U32 * (scale / sqrt((double)m->in * m->out) + sqrt(ss));
        }
        tol += 1e-30; /* an all-zero input has a zero tolerance otherwise */
        const double ratio = fabs(lhs - rhs) / tol;
        if (rep && ratio > rep->worst_ratio) rep->worst_ratio = ratio;
        if (!(ratio <= 1.0)) {
            static const char *const names[3] = {"gate", "up", "down"};
            if (rep) {
                rep->stage = stage;
                rep->proj = p;
                rep->lhs = lhs;
                rep->rhs = rhs;
                rep->tol = tol;
            }
            return kv_fail(d, KV_EPROTO, "caught: %s product differs from its projection by %.3g (tolerance %.3g)",
                           names[stage], fabs(lhs - rhs), tol);
        }
    }
    return 0;
}

int kv_verify_check(kv_verify *v, uint32_t layer, uint32_t e, const float *x, const float *gate, const float *up,
                    const float *y, kv_verify_report *rep, kv_diag *d) {
    if (rep) {
        memset(rep, 0, sizeof *rep);
        rep->stage = -1;
    }
    if (!kv_verify_ready(v, layer, e))
        return kv_fail(d, KV_ENOTFOUND, "verify: layer %u expert %u has no projections", layer, e);
    const kv_vexp *X = v->tab[(size_t)layer * v->n_expert + e];
    for (uint32_t i = 0; i < v->n_ff; i++)
        if (!isfinite(gate[i]) || !isfinite(up[i]))
            return kv_fail(d, KV_EPROTO, "caught: a pre-activation is not finite");
    for (uint32_t i = 0; i < v->n_embd; i++)
        if (!isfinite(y[i])) return kv_fail(d, KV_EPROTO, "caught: an output is not finite");
    kv_verify_activation(v, X->m[0].vdt, x, v->n_embd, v->xin);
    int rc = kv_verify_mat(v, &X->m[0], 0, v->xin, gate, rep, d);
    if (!rc) rc = kv_verify_mat(v, &X->m[1], 1, v->xin, up, rep, d);
    if (rc) return rc;
    /* the down input, recomputed from the checked gate and up as the worker does */
    kv_swiglu(v->h, gate, up, v->n_ff);
    for (uint32_t i = 0; i < v->n_ff; i++)
        if (!isfinite(v->h[i])) return kv_fail(d, KV_EPROTO, "caught: SwiGLU of the pre-activations is not finite");
    kv_verify_activation(v, X->m[2].vdt, v->h, v->n_ff, v->hin);
    return kv_verify_mat(v, &X->m[2], 2, v->hin, y, rep, d);
}
