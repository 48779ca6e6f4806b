/* OpenCL expert provider (kvasir/opencl.h).
 *
 * A request's (token, rank) slots are grouped by expert (stable counting
 * sort, as the CPU provider in src/moe/local.c), their inputs quantized on
 * the host to the gate/up activation type, and for every active expert one
 * kernel launch per matrix computes all its (row, slot) dot products into a
 * device buffer. The activation (SwiGLU, or gpt-oss's clamped SwiGLU after
 * the gate and up biases), the re-quantization for down and down's bias run
 * on the host with the CPU functions, in src/moe/local.c's operations, so
 * the only device arithmetic is the dot products, in the canonical order.
 * Every expert the source holds is looked at when the provider is made: a
 * tensor type the kernels do not compute is refused there, naming the
 * tensor and its type, not at the first request. Expert weights are uploaded on first
 * use and cached on the device (one buffer per layer, expert and matrix);
 * scratch buffers are sized once for max_tokens. Without OpenCL at build
 * time the entry points report KV_EUNSUPPORTED. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/arch.h"
#include "kvasir/opencl.h"
#include "kvasir/ops.h"
#include "kvasir/quant.h"

#ifdef KV_HAVE_OPENCL
#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120
#endif
#include <CL/cl.h>

#include "opencl/cl_kernels.h"

typedef struct kv_cl {
    kv_expert_source src;
    uint32_t n_slots_max;     /* max_tokens * n_expert_used */
    cl_context ctx;
    cl_command_queue q;
    cl_program prog;
    cl_kernel k;
    cl_mem *wbuf;             /* [n_layer][n_expert][3] gate, up, down; NULL until used */
    cl_mem bx, bg, bu, bh, bd; /* slot inputs, gate, up, SwiGLU inputs to down, down outputs */
    int32_t *slot_order, *exp_first, *active, *cursor;
    kv_expert_weights *w;     /* [n_expert] by active index */
    uint8_t *xq, *hq;         /* [n_slots][row] quantized inputs */
    float *gate, *up, *down;  /* [n_slots][n_ff], [n_slots][n_ff], [n_slots][n_embd] */
    size_t xq_cap, hq_cap;    /* bytes of one quantized row, largest type */
    float *pre_gate, *pre_up; /* kv_opencl_expert_compute_pre: [n_slots][n_ff] products before their
                                 biases, in (token, rank) order, or NULL */
} kv_cl;

static int kv_cl_fail(kv_diag *d, const char *what, cl_int err) {
    return kv_fail(d, KV_EUNSUPPORTED, "opencl: %s failed (error %d)", what, (int)err);
}

/* The first GPU of any platform, else the first device of any kind. */
static int kv_cl_pick(cl_platform_id *pp, cl_device_id *pd, kv_diag *d) {
    cl_platform_id plats[8];
    cl_uint np = 0;
    cl_int e = clGetPlatformIDs(8, plats, &np);
    if (e != CL_SUCCESS || np == 0) return kv_fail(d, KV_EUNSUPPORTED, "opencl: no platform (error %d)", (int)e);
    if (np > 8) np = 8;
    const cl_device_type kinds[2] = {CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_ALL};
    for (int k = 0; k < 2; k++)
        for (cl_uint i = 0; i < np; i++) {
            cl_uint nd = 0;
            if (clGetDeviceIDs(plats[i], kinds[k], 1, pd, &nd) == CL_SUCCESS && nd > 0) {
                *pp = plats[i];
                return 0;
            }
        }
    return kv_fail(d, KV_EUNSUPPORTED, "opencl: no device on %u platform(s)", np);
}

bool kv_opencl_available(char *name, size_t cap) {
    cl_platform_id p;
    cl_device_id dev;
    kv_diag d = {0};
    if (kv_cl_pick(&p, &dev, &d)) return false;
    if (name && cap) {
        char dn[128] = "", pn[128] = "";
        clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof dn - 1, dn, NULL);
        clGetPlatformInfo(p, CL_PLATFORM_NAME, sizeof pn - 1, pn, NULL);
        snprintf(name, cap, "%s (%s)", dn, pn);
    }
    return true;
}

static void kv_cl_free(void *impl) {
    kv_cl *c = impl;
    if (!c) return;
    if (c->wbuf) {
        size_t nw = (size_t)c->src.n_layer * c->src.n_expert * 3;
        for (size_t i = 0; i < nw; i++)
            if (c->wbuf[i]) clReleaseMemObject(c->wbuf[i]);
        free(c->wbuf);
    }
    cl_mem *bs[5] = {&c->bx, &c->bg, &c->bu, &c->bh, &c->bd};
    for (int i = 0; i < 5; i++)
        if (*bs[i]) clReleaseMemObject(*bs[i]);
    if (c->k) clReleaseKernel(c->k);
    if (c->prog) clReleaseProgram(c->prog);
    if (c->q) clReleaseCommandQueue(c->q);
    if (c->ctx) clReleaseContext(c->ctx);
    free(c->slot_order);
    free(c->exp_first);
    free(c->active);
    free(c->cursor);
    free(c->w);
    free(c->xq);
    free(c->hq);
    free(c->gate);
    free(c->up);
    free(c->down);
    free(c);
}

static bool kv_cl_type_ok(uint32_t t) {
    switch (t) {
    case KV_TYPE_F32: case KV_TYPE_F16: case KV_TYPE_BF16: case KV_TYPE_Q8_0: case KV_TYPE_Q4_0:
    case KV_TYPE_Q4_K: case KV_TYPE_Q5_K: case KV_TYPE_Q6_K: return true;
    case KV_TYPE_Q4_1: case KV_TYPE_Q5_0: case KV_TYPE_Q5_1: case KV_TYPE_IQ4_NL: case KV_TYPE_MXFP4: return true;
    case KV_TYPE_Q2_K: case KV_TYPE_Q3_K: case KV_TYPE_IQ4_XS: return true;
    default: return false;
    }
}

/* The device buffer of one matrix of one expert, uploaded on first use. */
static int kv_cl_weights(kv_cl *c, uint32_t layer, uint32_t e, int which, const void *host, size_t bytes,
                         cl_mem *out, kv_diag *d) {
    cl_mem *slot = &c->wbuf[((size_t)layer * c->src.n_expert + e) * 3 + (size_t)which];
    if (!*slot) {
        cl_int err;
        *slot = clCreateBuffer(c->ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, bytes, (void *)host, &err);
        if (err != CL_SUCCESS) {
            *slot = NULL;
            return kv_cl_fail(d, "uploading expert weights", err);
        }
    }
    *out = *slot;
    return 0;
}

/* Y rows [0, rows) x slots [s0, s1) of one matrix. */
static int kv_cl_mat(kv_cl *c, cl_mem W, uint32_t type, int64_t n, uint32_t rows, cl_mem A, size_t a_stride,
                     cl_mem Y, int32_t s0, int32_t s1, kv_diag *d) {
    cl_ulong rb = kv_type_row_size(type, (uint64_t)n), a_off = (cl_ulong)s0 * a_stride, as = a_stride;
    cl_ulong y_off = (cl_ulong)s0 * rows, ys = rows;
    cl_int nn = (cl_int)n;
    cl_uint ty = type, nr = rows;
    cl_int e = clSetKernelArg(c->k, 0, sizeof W, &W);
    e |= clSetKernelArg(c->k, 1, sizeof ty, &ty);
    e |= clSetKernelArg(c->k, 2, sizeof rb, &rb);
    e |= clSetKernelArg(c->k, 3, sizeof nn, &nn);
    e |= clSetKernelArg(c->k, 4, sizeof A, &A);
    e |= clSetKernelArg(c->k, 5, sizeof a_off, &a_off);
    e |= clSetKernelArg(c->k, 6, sizeof as, &as);
    e |= clSetKernelArg(c->k, 7, sizeof Y, &Y);
    e |= clSetKernelArg(c->k, 8, sizeof y_off, &y_off);
    e |= clSetKernelArg(c->k, 9, sizeof ys, &ys);
    e |= clSetKernelArg(c->k, 10, sizeof nr, &nr);
    if (e != CL_SUCCESS) return kv_cl_fail(d, "clSetKernelArg", e);
    size_t gws[2] = {rows, (size_t)(s1 - s0)};
    e = clEnqueueNDRangeKernel(c->q, c->k, 2, NULL, gws, NULL, 0, NULL, NULL);
    return e == CL_SUCCESS ? 0 : kv_cl_fail(d, "clEnqueueNDRangeKernel", e);
}

static void kv_cl_release(kv_cl *c, uint32_t layer, int n) {
    if (!c->src.release) return;
    for (int i = 0; i < n; i++) c->src.release(c->src.ctx, layer, (uint32_t)c->active[i]);
}

static int kv_cl_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    kv_cl *c = impl;
    const kv_expert_source *src = &c->src;
    if (req->layer >= src->n_layer)
        return kv_fail(d, KV_ERANGE, "experts: layer %u out of range (%u layers)", req->layer, src->n_layer);
    if (req->n_embd != src->n_embd || req->n_used == 0 || req->n_tokens == 0 ||
        (uint64_t)req->n_tokens * req->n_used > c->n_slots_max)
        return kv_fail(d, KV_EINVAL, "experts: request shape (%u tokens x %u experts, embd %u) exceeds "
                       "provider limits", req->n_tokens, req->n_used, req->n_embd);
    const uint32_t n_slots = req->n_tokens * req->n_used, E = src->n_embd, F = src->n_ff_exp;
    memset(c->exp_first, 0, (src->n_expert + 1) * sizeof(int32_t));
    for (uint32_t s = 0; s < n_slots; s++) {
        const int32_t e = req->ids[s];
        if (e < 0 || (uint32_t)e >= src->n_expert)
            return kv_fail(d, KV_ERANGE, "experts: expert id %d out of range (%u experts)", e, src->n_expert);
        c->exp_first[e + 1]++;
    }
    int n_active = 0;
    for (uint32_t e = 0; e < src->n_expert; e++) {
        if (c->exp_first[e + 1]) c->active[n_active++] = (int32_t)e;
        c->exp_first[e + 1] += c->exp_first[e];
    }
    memcpy(c->cursor, c->exp_first, src->n_expert * sizeof(int32_t));
    for (uint32_t s = 0; s < n_slots; s++) c->slot_order[c->cursor[req->ids[s]]++] = (int32_t)s;
    int rc = 0, n_acq = 0;
    for (; n_acq < n_active; n_acq++) {
        memset(&c->w[n_acq], 0, sizeof c->w[n_acq]);
        rc = src->acquire(src->ctx, req->layer, (uint32_t)c->active[n_acq], &c->w[n_acq], d);
        if (rc) goto done;
        const kv_expert_weights *w = &c->w[n_acq];
        if (n_acq > 0 && (w->up_type != c->w[0].up_type || w->gate_type != c->w[0].gate_type ||
                          w->down_type != c->w[0].down_type || w->act != c->w[0].act)) {
            n_acq++;
            rc = kv_fail(d, KV_EFORMAT, "experts: layer %u expert %d has other tensor types or activation than "
                         "expert %d", req->layer, c->active[n_acq - 1], c->active[0]);
            goto done;
        }
    }
    const uint32_t tg = c->w[0].gate_type, tu = c->w[0].up_type, td = c->w[0].down_type;
    const kv_type_info *ig = kv_type_get(tg), *iu = kv_type_get(tu), *id = kv_type_get(td);
    if (!kv_cl_type_ok(tg) || !kv_cl_type_ok(tu) || !kv_cl_type_ok(td) || !ig || !iu || !id) {
        rc = kv_fail(d, KV_EUNSUPPORTED, "opencl: layer %u: unsupported expert tensor types (%s, %s, %s)", req->layer,
                     ig ? ig->name : "?", iu ? iu->name : "?", id ? id->name : "?");
        goto done;
    }
    const size_t hs = (size_t)kv_type_row_size(id->vec_dot_type, F);
    cl_int e = CL_SUCCESS;
    /* gate, then up; the inputs are quantized again for up only when its
     * activation type differs (gate Q8_0, up Q4_K): the in-order queue
     * runs gate's kernels before the blocking write replaces them */
    for (int m = 0; m < 2 && !rc; m++) {
        const uint32_t ty = m ? tu : tg, vdt = m ? iu->vec_dot_type : ig->vec_dot_type;
        const size_t xs = (size_t)kv_type_row_size(vdt, E);
        if (m == 0 || vdt != ig->vec_dot_type) {
            for (uint32_t i = 0; i < n_slots; i++) {
                const int32_t t = c->slot_order[i] / (int32_t)req->n_used;
                kv_quantize_rows(vdt, req->x + (size_t)t * E, E, E, 1, c->xq + (size_t)i * xs, xs);
            }
            e = clEnqueueWriteBuffer(c->q, c->bx, CL_TRUE, 0, (size_t)n_slots * xs, c->xq, 0, NULL, NULL);
            if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "writing inputs", e); goto done; }
        }
        for (int a = 0; a < n_active && !rc; a++) {
            const int32_t ex = c->active[a], s0 = c->exp_first[ex], s1 = c->exp_first[ex + 1];
            cl_mem wm;
            rc = kv_cl_weights(c, req->layer, (uint32_t)ex, m, m ? c->w[a].up : c->w[a].gate,
                               (size_t)kv_type_row_size(ty, E) * F, &wm, d);
            if (!rc) rc = kv_cl_mat(c, wm, ty, E, F, c->bx, xs, m ? c->bu : c->bg, s0, s1, d);
        }
    }
    if (rc) goto done;
    e = clEnqueueReadBuffer(c->q, c->bg, CL_TRUE, 0, (size_t)n_slots * F * sizeof(float), c->gate, 0, NULL, NULL);
    if (e == CL_SUCCESS)
        e = clEnqueueReadBuffer(c->q, c->bu, CL_TRUE, 0, (size_t)n_slots * F * sizeof(float), c->up, 0, NULL, NULL);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "reading gate/up", e); goto done; }
    if (c->pre_gate) /* what a verifier checks: the products, before biases and activation */
        for (uint32_t i = 0; i < n_slots; i++) {
            const size_t o = (size_t)c->slot_order[i] * F;
            memcpy(c->pre_gate + o, c->gate + (size_t)i * F, (size_t)F * sizeof(float));
            memcpy(c->pre_up + o, c->up + (size_t)i * F, (size_t)F * sizeof(float));
        }
    for (int a = 0; a < n_active; a++) { /* slots in sorted order, expert by expert */
        const kv_expert_weights *w = &c->w[a];
        for (int32_t i = c->exp_first[c->active[a]]; i < c->exp_first[c->active[a] + 1]; i++) {
            float *g = c->gate + (size_t)i * F, *u = c->up + (size_t)i * F;
            if (w->gate_b) /* biases join after the products, before the activation (ggml's add_id) */
                for (uint32_t k = 0; k < F; k++) g[k] = g[k] + w->gate_b[k];
            if (w->up_b)
                for (uint32_t k = 0; k < F; k++) u[k] = u[k] + w->up_b[k];
            kv_expert_act(w->act, g, g, u, F);
            kv_quantize_rows(id->vec_dot_type, g, F, F, 1, c->hq + (size_t)i * hs, hs);
        }
    }
    e = clEnqueueWriteBuffer(c->q, c->bh, CL_TRUE, 0, (size_t)n_slots * hs, c->hq, 0, NULL, NULL);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "writing down inputs", e); goto done; }
    for (int a = 0; a < n_active && !rc; a++) {
        const int32_t ex = c->active[a], s0 = c->exp_first[ex], s1 = c->exp_first[ex + 1];
        cl_mem wd;
        rc = kv_cl_weights(c, req->layer, (uint32_t)ex, 2, c->w[a].down, (size_t)kv_type_row_size(td, F) * E, &wd, d);
        if (!rc) rc = kv_cl_mat(c, wd, td, F, E, c->bh, hs, c->bd, s0, s1, d);
    }
    if (rc) goto done;
    e = clEnqueueReadBuffer(c->q, c->bd, CL_TRUE, 0, (size_t)n_slots * E * sizeof(float), c->down, 0, NULL, NULL);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "reading down", e); goto done; }
    for (int a = 0; a < n_active; a++) {
        const float *b = c->w[a].down_b;
        for (int32_t i = c->exp_first[c->active[a]]; i < c->exp_first[c->active[a] + 1]; i++) {
            float *o = out + (size_t)c->slot_order[i] * E;
            const float *y = c->down + (size_t)i * E;
            if (b)
                for (uint32_t k = 0; k < E; k++) o[k] = y[k] + b[k];
            else
                memcpy(o, y, (size_t)E * sizeof(float));
        }
    }
done:
    kv_cl_release(c, req->layer, n_acq);
    return rc;
}

int kv_opencl_expert_compute_pre(const kv_expert_provider *p, const kv_expert_req *req, float *out, float *gate,
                                 float *up, kv_diag *d) {
    if (p->compute != kv_cl_compute) return kv_fail(d, KV_EINVAL, "opencl: not an OpenCL provider");
    kv_cl *c = p->impl;
    c->pre_gate = gate;
    c->pre_up = up;
    const int rc = kv_cl_compute(c, req, out, d);
    c->pre_gate = c->pre_up = NULL;
    return rc;
}

/* Every expert the source holds (acquire's KV_ENOTFOUND: one it does not
 * hold, or a layer without routed experts): its tensor types are ones the
 * kernels compute, its activation one the host computes, and within a layer
 * all agree (compute takes one type per matrix per layer). */
static int kv_cl_check_source(const kv_expert_source *src, kv_diag *d) {
    static const char *const stems[3] = {KV_EXPERT_STEM_GATE, KV_EXPERT_STEM_UP, KV_EXPERT_STEM_DOWN};
    for (uint32_t l = 0; l < src->n_layer; l++) {
        kv_expert_weights w0 = {0};
        bool have = false;
        for (uint32_t e = 0; e < src->n_expert; e++) {
            kv_expert_weights w;
            memset(&w, 0, sizeof w);
            kv_diag dd = {0};
            const int rc = src->acquire(src->ctx, l, e, &w, &dd);
            if (rc == KV_ENOTFOUND) continue;
            if (rc) {
                *d = dd;
                return kv_diag_prefix(d, rc, "opencl: layer %u expert %u", l, e);
            }
            if (src->release) src->release(src->ctx, l, e);
            const uint32_t ty[3] = {w.gate_type, w.up_type, w.down_type};
            for (int k = 0; k < 3; k++)
                if (!kv_cl_type_ok(ty[k]) || !kv_type_get(ty[k])) {
                    const kv_type_info *ti = kv_type_get(ty[k]);
                    return kv_fail(d, KV_EUNSUPPORTED, "opencl: tensor 'blk.%u.%s.weight' has type %s (%u), which "
                                   "the OpenCL kernels do not compute; run these experts on the CPU", l, stems[k],
                                   ti ? ti->name : "?", ty[k]);
                }
            if (w.act > KV_ACT_SWIGLU_CLAMP)
                return kv_fail(d, KV_EUNSUPPORTED, "opencl: layer %u: expert activation %u is not one the OpenCL "
                               "path computes", l, w.act);
            if (!have) {
                w0 = w, have = true;
            } else if (w.gate_type != w0.gate_type || w.up_type != w0.up_type || w.down_type != w0.down_type ||
                       w.act != w0.act) {
                return kv_fail(d, KV_EFORMAT, "opencl: layer %u expert %u has other tensor types or activation than "
                               "the layer's first", l, e);
            }
        }
    }
    return 0;
}

int kv_opencl_expert_new(kv_expert_provider *out, const kv_expert_source *src, uint32_t max_tokens,
                         kv_diag *d) {
    memset(out, 0, sizeof *out);
    if (max_tokens == 0) return kv_fail(d, KV_EINVAL, "opencl: max_tokens must be > 0");
    if (!src->acquire || !src->n_expert || !src->n_embd || !src->n_ff_exp || !src->n_expert_used || !src->n_layer)
        return kv_fail(d, KV_EINVAL, "opencl: incomplete expert source");
    int rc = kv_cl_check_source(src, d);
    if (rc) return rc;
    cl_platform_id plat;
    cl_device_id dev;
    rc = kv_cl_pick(&plat, &dev, d);
    if (rc) return rc;
    kv_cl *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(d, KV_ENOMEM, "opencl: out of memory");
    c->src = *src;
    const size_t ns = (size_t)max_tokens * src->n_expert_used;
    c->n_slots_max = (uint32_t)ns;
    cl_int e;
    c->ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &e);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "clCreateContext", e); goto fail; }
    c->q = clCreateCommandQueue(c->ctx, dev, 0, &e);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "clCreateCommandQueue", e); goto fail; }
    const char *srcs[1] = {kv_cl_source};
    c->prog = clCreateProgramWithSource(c->ctx, 1, srcs, NULL, &e);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "clCreateProgramWithSource", e); goto fail; }
    /* no -cl-fast-relaxed-math / -cl-mad-enable: the order of operations is the result */
    e = clBuildProgram(c->prog, 1, &dev, "", NULL, NULL);
    if (e != CL_SUCCESS) {
        char log[512] = "";
        clGetProgramBuildInfo(c->prog, dev, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, NULL);
        for (char *p = log; *p; p++)
            if (*p == '\n' || *p == '\r') *p = ' ';
        rc = kv_fail(d, KV_EUNSUPPORTED, "opencl: kernel build failed (error %d): %.300s", (int)e, log);
        goto fail;
    }
    c->k = clCreateKernel(c->prog, "kv_mat", &e);
    if (e != CL_SUCCESS) { rc = kv_cl_fail(d, "clCreateKernel", e); goto fail; }
    const size_t row_in = kv_matmul_scratch(src->n_embd, 1), row_ff = kv_matmul_scratch(src->n_ff_exp, 1);
    c->xq_cap = row_in;
    c->hq_cap = row_ff;
    c->wbuf = calloc((size_t)src->n_layer * src->n_expert * 3, sizeof(cl_mem));
    c->slot_order = malloc(ns * sizeof(int32_t));
    c->exp_first = malloc((src->n_expert + 1) * sizeof(int32_t));
    c->active = malloc(src->n_expert * sizeof(int32_t));
    c->cursor = malloc(src->n_expert * sizeof(int32_t));
    c->w = calloc(src->n_expert, sizeof *c->w);
    c->xq = malloc(ns * row_in);
    c->hq = malloc(ns * row_ff);
    c->gate = malloc(ns * src->n_ff_exp * sizeof(float));
    c->up = malloc(ns * src->n_ff_exp * sizeof(float));
    c->down = malloc(ns * src->n_embd * sizeof(float));
    if (!c->wbuf || !c->slot_order || !c->exp_first || !c->active || !c->cursor || !c->w || !c->xq || !c->hq ||
        !c->gate || !c->up || !c->down) {
        rc = kv_fail(d, KV_ENOMEM, "opencl: out of memory for %u tokens", max_tokens);
        goto fail;
    }
    struct { cl_mem *m; size_t bytes; cl_mem_flags f; } bufs[5] = {
        {&c->bx, ns * row_in, CL_MEM_READ_ONLY},
        {&c->bg, ns * src->n_ff_exp * sizeof(float), CL_MEM_WRITE_ONLY},
        {&c->bu, ns * src->n_ff_exp * sizeof(float), CL_MEM_WRITE_ONLY},
        {&c->bh, ns * row_ff, CL_MEM_READ_ONLY},
        {&c->bd, ns * src->n_embd * sizeof(float), CL_MEM_WRITE_ONLY},
    };
    for (int i = 0; i < 5; i++) {
        *bufs[i].m = clCreateBuffer(c->ctx, bufs[i].f, bufs[i].bytes, NULL, &e);
        if (e != CL_SUCCESS) {
            *bufs[i].m = NULL;
            rc = kv_cl_fail(d, "clCreateBuffer", e);
            goto fail;
        }
    }
    out->impl = c;
    out->compute = kv_cl_compute;
    out->free = kv_cl_free;
    out->name = "opencl";
    return 0;
fail:
    kv_cl_free(c);
    return rc;
}

#else /* no OpenCL in this build */

bool kv_opencl_available(char *name, size_t cap) {
    if (name && cap) name[0] = 0;
    return false;
}

int kv_opencl_expert_new(kv_expert_provider *out, const kv_expert_source *src, uint32_t max_tokens,
                         kv_diag *d) {
    (void)src;
    (void)max_tokens;
    memset(out, 0, sizeof *out);
    return kv_fail(d, KV_EUNSUPPORTED, "opencl: this build has no OpenCL (install ocl-icd-opencl-dev and "
                   "opencl-headers, then rebuild)");
}

int kv_opencl_expert_compute_pre(const kv_expert_provider *p, const kv_expert_req *req, float *out, float *gate,
                                 float *up, kv_diag *d) {
    (void)p, (void)req, (void)out, (void)gate, (void)up;
    return kv_fail(d, KV_EUNSUPPORTED, "opencl: this build has no OpenCL");
}

#endif
