/* Probe: one blocking dispatch connection that proves a worker's key and
 * asks it a few compute challenges (include/kvasir/probe.h).
 *
 * The sequence is the coordinator's side of docs/PROTOCOL.md, v3: HELLO,
 * HELLO_ACK, AUTH_CHALLENGE (the worker's key must be the one expected),
 * AUTH (our key over the transcript, with a voucher when given), AUTH_OK
 * (the worker's signature over the transcript, verified), then one COMPUTE
 * per task and its RESULT. Frames are decoded with the model's dims, so a
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
static int kv_probe_expect(kv_frame_rx *rx, int fd, double deadline, const kv_proto_limits *lim, uint16_t type,
                           const char *addr, kv_msg *m, kv_diag *d) {
    double left = deadline - kv_probe_now_ms();
    if (left < 1) return kv_fail(d, KV_ETIMEOUT, "%s: no answer in time", addr);
    kv_frame_rx_reset(rx);
    int rc = kv_proto_read_msg(rx, fd, (int)left, lim, m, d);
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
    const int connect_ms = o->connect_ms > 0 ? o->connect_ms : 2000;
    const int answer_ms = o->answer_ms > 0 ? o->answer_ms : 1500;
    const double t0 = kv_probe_now_ms();
    double deadline = t0 + connect_ms;
    int fd = -1, rc = kv_link_connect(o->addr, connect_ms, &fd, d);
    if (rc) return rc;
    res->connected = true;
    /* the largest frame read is a RESULT of one pair, or a HELLO_ACK */
    const size_t cap = KV_PROTO_HEADER + KV_PROTO_HELLO_ACK_FIXED_V2 + KV_PROTO_MAX_NAME +
                       (size_t)KV_PROTO_MAX_RANGES * (12 + KV_PROTO_SLAB_SIZE) + 64;
    const size_t ocap = kv_msg_compute_size(KV_ENC_F32, 1, o->n_embd, 1) + KV_PROTO_AUTH_SIZE + KV_PROTO_HEADER;
    uint8_t *buf = malloc(cap), *ob = malloc(ocap);
    if (!buf || !ob) {
        rc = kv_fail(d, KV_ENOMEM, "probe: out of memory");
        goto done;
    }
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, cap);
    kv_msg m;
    size_t n = 0;
    kv_msg_hello h = {KV_PROTO_AUTH_VERSION, KV_PROTO_VERSION, {0}, 1u << KV_ENC_F32};
    memcpy(h.model_id, o->model_id, KV_PROTO_MODEL_ID_LEN);
    if ((rc = kv_msg_hello_encode(ob, ocap, 1, &h, &n, d)) || (rc = kv_proto_write_all(fd, ob, n, connect_ms, d)) ||
        (rc = kv_probe_expect(&rx, fd, deadline, NULL, KV_MSG_HELLO_ACK, o->addr, &m, d)))
        goto done;
    const uint16_t ver = m.u.ack.version;
    snprintf(res->backend, sizeof res->backend, "%s", m.u.ack.backend);
    if (ver < KV_PROTO_AUTH_VERSION) {
        rc = kv_fail(d, KV_EAUTH, "%s speaks dispatch v%u, without authentication", o->addr, ver);
        goto done;
    }
    if (strcmp(m.u.ack.model_id, o->model_id) || m.u.ack.n_embd != o->n_embd) {
        rc = kv_fail(d, KV_EPROTO, "%s serves another model (%.16s, n_embd %u)", o->addr, m.u.ack.model_id,
                     m.u.ack.n_embd);
        goto done;
    }
    if ((rc = kv_probe_expect(&rx, fd, deadline, NULL, KV_MSG_AUTH_CHALLENGE, o->addr, &m, d))) goto done;
    if (sodium_memcmp(m.u.challenge.worker_key, o->worker_key, 32)) {
        rc = kv_fail(d, KV_EAUTH, "%s proves another key than the one registered for it", o->addr);
        goto done;
    }
    uint8_t challenge[32], dg[32];
    memcpy(challenge, m.u.challenge.challenge, 32);
    kv_msg_auth a = {0};
    memcpy(a.key, o->sk + 32, 32);
    randombytes_buf(a.nonce, sizeof a.nonce);
    kv_dispatch_digest('C', o->model_id, ver, o->worker_key, challenge, a.key, a.nonce, dg);
    kv_link_sign(o->sk, dg, a.sig);
    if (o->voucher) {
        a.flags = KV_PROTO_AUTH_VOUCHER;
        a.voucher_expires_ms = o->voucher->expires_ms;
        memcpy(a.voucher_sig, o->voucher->sig, 64);
    }
    if ((rc = kv_msg_auth_encode(ob, ocap, 0, &a, &n, d))) goto done;
    kv_frame_set_version(ob, ver);
    if ((rc = kv_proto_write_all(fd, ob, n, connect_ms, d)) ||
        (rc = kv_probe_expect(&rx, fd, deadline, NULL, KV_MSG_AUTH_OK, o->addr, &m, d)))
        goto done;
    kv_dispatch_digest('W', o->model_id, ver, o->worker_key, challenge, a.key, a.nonce, dg);
    if (kv_link_verify(o->worker_key, dg, m.u.auth_ok)) {
        rc = kv_fail(d, KV_EAUTH, "%s: its AUTH_OK does not verify", o->addr);
        goto done;
    }
    res->key_proven = true;
    const double t1 = kv_probe_now_ms();
    res->handshake_ms = t1 - t0;
    deadline = t1 + answer_ms;
    const kv_proto_limits lim = {.n_embd = o->n_embd};
    for (uint32_t t = 0; t < n_tasks; t++) {
        const kv_proto_pair pr = {0, tasks[t].expert};
        kv_msg_compute c = {.layer = tasks[t].layer, .enc = KV_ENC_F32, .out_enc = KV_ENC_F32, .n_tokens = 1,
                            .n_embd = o->n_embd, .n_pairs = 1, .x = x + (size_t)t * o->n_embd, .pairs = &pr};
        if ((rc = kv_msg_compute_encode(ob, ocap, 10 + t, &c, &n, d))) goto done;
        kv_frame_set_version(ob, ver);
        double left = deadline - kv_probe_now_ms();
        if (left < 1 || (rc = kv_proto_write_all(fd, ob, n, (int)left, d)) ||
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
    }
    res->answer_ms = kv_probe_now_ms() - t1;
done:
    free(buf);
    free(ob);
    close(fd);
    return rc;
}
