/* Probe: one blocking dispatch connection that proves a worker's key and
 * asks it a few compute challenges, or its counters (include/kvasir/probe.h).
 *
 * The handshake is the link's (kv_link_dial_dispatch: the worker must prove
 * the key expected, we prove ours with a voucher when given); then one
 * COMPUTE per task and its RESULT, or one STATS and its STATS_ACK. Frames are decoded with the model's dims, so a
 * RESULT of another width or pair count is refused before its rows are read.
 * The answer deadline covers all tasks together: what a challenger bounds is
 * the time from the first question to the last answer. */
#include "kvasir/probe.h"

#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double kv_probe_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Reads one frame of `type` within the time left until deadline (ms on
 * kv_probe_now_ms's clock); an ERROR frame becomes its code. */
static int kv_probe_expect(kv_frame_rx *rx, const kv_link_chan *fd, double deadline, const kv_proto_limits *lim, uint16_t type,
                           const char *addr, kv_msg *m, kv_diag *d) {
    double left = deadline - kv_probe_now_ms();
    if (left < 1) return kv_fail(d, KV_ETIMEOUT, "%s: no answer in time", addr);
    kv_frame_rx_reset(rx);
    int rc = kv_proto_read_msg_chan(rx, fd, (int)left, lim, m, d);
    if (rc) return rc;
    if (m->h.type == KV_MSG_ERROR) return kv_fail(d, m->u.error.code, "%s: %s", addr, m->u.error.msg);
    if (m->h.type != type)
        return kv_fail(d, KV_EPROTO, "%s: frame %s where %s was due", addr, kv_msg_type_name(m->h.type),
                       kv_msg_type_name(type));
    return 0;
}

int kv_probe_worker(const kv_probe_opts *o, const kv_probe_task *tasks, uint32_t n_tasks, const float *x, float *y,
                    kv_probe_result *res, kv_diag *d) {
    memset(res, 0, sizeof *res);
    if (!o->addr || !o->model_id || strlen(o->model_id) != KV_PROTO_MODEL_ID_LEN || !o->worker_key || !o->sk ||
        !o->n_embd || o->n_embd > KV_PROTO_MAX_EMBD || n_tasks > KV_PROBE_MAX_TASKS || (n_tasks && (!x || !y)))
        return kv_fail(d, KV_EINVAL, "probe: bad arguments");
    const int answer_ms = o->answer_ms > 0 ? o->answer_ms : 1500;
    const double t0 = kv_probe_now_ms();
    const kv_link_dispatch_opts lo = {.addr = o->addr, .model_id = o->model_id, .worker_key = o->worker_key,
                                      .sk = o->sk, .voucher = o->voucher, .n_embd = o->n_embd,
                                      .timeout_ms = o->connect_ms > 0 ? o->connect_ms : 2000};
    kv_link_dispatch ln;
    int rc = kv_link_dial_dispatch(&lo, &ln, d);
    res->connected = ln.connected;
    snprintf(res->backend, sizeof res->backend, "%s", ln.backend);
    if (rc) return rc;
    const kv_link_chan ch = {ln.fd, ln.tls}, *fd = &ch;
    const uint16_t ver = ln.version;
    /* the largest frame read is a RESULT of one pair (bounded as a HELLO_ACK is) */
    const size_t cap = KV_PROTO_HEADER + KV_PROTO_HELLO_ACK_FIXED_V2 + KV_PROTO_MAX_NAME +
                       (size_t)KV_PROTO_MAX_RANGES * (12 + KV_PROTO_SLAB_SIZE) + 64;
    const size_t ocap = kv_msg_compute_size(KV_ENC_F32, 1, o->n_embd, 1) + KV_PROTO_HEADER;
    uint8_t *buf = malloc(cap), *ob = malloc(ocap);
    if (!buf || !ob) {
        rc = kv_fail(d, KV_ENOMEM, "probe: out of memory");
        goto done;
    }
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, cap);
    kv_msg m;
    size_t n = 0;
    res->key_proven = true;
    const double t1 = kv_probe_now_ms();
    res->handshake_ms = t1 - t0;
    const double deadline = t1 + answer_ms;
    const kv_proto_limits lim = {.n_embd = o->n_embd};
    for (uint32_t t = 0; t < n_tasks; t++) {
        const kv_proto_pair pr = {0, tasks[t].expert};
        kv_msg_compute c = {.layer = tasks[t].layer, .enc = KV_ENC_F32, .out_enc = KV_ENC_F32, .n_tokens = 1,
                            .n_embd = o->n_embd, .n_pairs = 1, .x = x + (size_t)t * o->n_embd, .pairs = &pr};
        if ((rc = kv_msg_compute_encode(ob, ocap, 10 + t, &c, &n, d))) goto done;
        kv_frame_set_version(ob, ver);
        const double ts = kv_probe_now_ms();
        double left = deadline - ts;
        if (left < 1 || (rc = kv_proto_write_all_chan(fd, ob, n, (int)left, d)) ||
            (rc = kv_probe_expect(&rx, fd, deadline, &lim, KV_MSG_RESULT, o->addr, &m, d))) {
            if (!rc) rc = kv_fail(d, KV_ETIMEOUT, "%s: no answer in time", o->addr);
            goto done;
        }
        if (m.h.request_id != 10 + t || m.u.result.n_pairs != 1 || m.u.result.n_ff) {
            rc = kv_fail(d, KV_EPROTO, "%s: a RESULT for another request", o->addr);
            goto done;
        }
        kv_msg_result_row(&m.u.result, 0, y + (size_t)t * o->n_embd);
        res->answered++;
        const double took = kv_probe_now_ms() - ts;
        if (!res->task_min_ms || took < res->task_min_ms) res->task_min_ms = took;
    }
    res->answer_ms = kv_probe_now_ms() - t1;
done:
    free(buf);
    free(ob);
    kv_link_dispatch_close(&ln);
    return rc;
}

int kv_probe_stats(const kv_probe_opts *o, kv_msg_stats *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    if (!o->addr || !o->model_id || !o->worker_key || !o->sk) return kv_fail(d, KV_EINVAL, "probe: bad arguments");
    const int wait_ms = o->answer_ms > 0 ? o->answer_ms : 2000;
    const kv_link_dispatch_opts lo = {.addr = o->addr, .model_id = o->model_id, .worker_key = o->worker_key,
                                      .sk = o->sk, .voucher = o->voucher, .n_embd = o->n_embd,
                                      .timeout_ms = o->connect_ms > 0 ? o->connect_ms : 2000};
    kv_link_dispatch ln;
    int rc = kv_link_dial_dispatch(&lo, &ln, d);
    if (rc) return rc;
    /* a STATS_ACK of any version, or an ERROR with the longest text */
    uint8_t ob[KV_PROTO_HEADER], buf[KV_PROTO_HEADER + KV_PROTO_ERROR_FIXED + KV_PROTO_MAX_TEXT + KV_PROTO_STATS_ACK_SIZE_V6];
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, sizeof buf);
    kv_msg m;
    size_t n = 0;
    if (!(rc = kv_msg_stats_encode(ob, sizeof ob, 2, &n, d))) {
        kv_frame_set_version(ob, ln.version);
        const kv_link_chan ch = {ln.fd, ln.tls};
        if (!(rc = kv_proto_write_all_chan(&ch, ob, n, wait_ms, d)) &&
            !(rc = kv_probe_expect(&rx, &ch, kv_probe_now_ms() + wait_ms, NULL, KV_MSG_STATS_ACK, o->addr, &m, d)))
            *out = m.u.stats;
    }
    kv_link_dispatch_close(&ln);
    return rc;
}
