/* Parsers of what the hub and its clients read from the network: the Range
 * header, a node's announcement and the market JSON. Each reads untrusted
 * bytes: every length and count is bounded by a named maximum, integers must
 * be JSON integers in range, strings have length limits and no control
 * bytes, and an error leaves the output zeroed with one line in d. Each has
 * a libFuzzer target (fuzz/fuzz_hub_*.c). */
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/hub.h"

/* ---- Range ------------------------------------------------------------- */

/* Reads a decimal u64 of at most 19 digits at *p (so no overflow). */
static int kv_rd_u64(const char **p, uint64_t *out) {
    const char *s = *p;
    uint64_t v = 0;
    int n = 0;
    while (*s >= '0' && *s <= '9') {
        if (++n > 19) return -1;
        v = v * 10 + (uint64_t)(*s++ - '0');
    }
    if (!n) return -1;
    *p = s;
    *out = v;
    return 0;
}

int kv_hub_parse_range(const char *hdr, uint64_t size, uint64_t *off, uint64_t *len, kv_diag *d) {
    *off = *len = 0;
    if (strncmp(hdr, "bytes=", 6)) return kv_fail(d, KV_EFORMAT, "Range: only 'bytes=' ranges are served");
    const char *p = hdr + 6;
    while (*p == ' ') p++;
    uint64_t a = 0, b = 0;
    if (*p == '-') { /* suffix: the last N bytes */
        p++;
        if (kv_rd_u64(&p, &b)) return kv_fail(d, KV_EFORMAT, "Range: bad suffix length");
        while (*p == ' ') p++;
        if (*p) return kv_fail(d, KV_EFORMAT, "Range: one range only");
        if (b == 0 || size == 0) return kv_fail(d, KV_ERANGE, "Range: empty suffix range");
        *len = b < size ? b : size;
        *off = size - *len;
        return 0;
    }
    if (kv_rd_u64(&p, &a) || *p++ != '-') return kv_fail(d, KV_EFORMAT, "Range: expected A-B");
    bool open_end = !(*p >= '0' && *p <= '9');
    if (!open_end && kv_rd_u64(&p, &b)) return kv_fail(d, KV_EFORMAT, "Range: bad end");
    while (*p == ' ') p++;
    if (*p) return kv_fail(d, KV_EFORMAT, "Range: one range only");
    if (!open_end && b < a) return kv_fail(d, KV_EFORMAT, "Range: end before start");
    if (a >= size) return kv_fail(d, KV_ERANGE, "Range: start %" PRIu64 " is past the end (%" PRIu64 " bytes)", a, size);
    if (open_end || b >= size) b = size - 1;
    *off = a;
    *len = b - a + 1;
    return 0;
}

/* ---- announcement -------------------------------------------------------- */

#define KV_ALNUM "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
#define KV_ADDR_CHARS KV_ALNUM ".-:[]"  /* host names, IPv4, [IPv6], port */
#define KV_NAME_CHARS KV_ALNUM "._+-"   /* backend names */
#define KV_SITE_CHARS "abcdefghijklmnopqrstuvwxyz0123456789._-" /* site names */

int kv_hub_site_check(const char *name, kv_diag *d) {
    const size_t n = strlen(name);
    if (n == 0 || n > KV_HUB_MAX_SITE)
        return kv_fail(d, KV_EINVAL, "site name must be 1 to %u bytes, got %zu", KV_HUB_MAX_SITE, n);
    for (size_t i = 0; i < n; i++)
        if (!strchr(KV_SITE_CHARS, name[i]))
            return kv_fail(d, KV_EINVAL, "site name '%.40s' may hold only [a-z0-9._-]", name);
    if (name[0] == '.' || name[0] == '-' || name[0] == '_')
        return kv_fail(d, KV_EINVAL, "site name '%.40s' must start with a letter or a digit", name);
    return 0;
}

static int kv_j_u64(json_t *o, const char *ctx, const char *key, uint64_t hi, uint64_t *out, kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v || !json_is_integer(v)) return kv_fail(d, KV_EFORMAT, "%s: '%s' must be an integer", ctx, key);
    json_int_t x = json_integer_value(v);
    if (x < 0 || (uint64_t)x > hi)
        return kv_fail(d, KV_EFORMAT, "%s: '%s' is out of range [0, %" PRIu64 "]", ctx, key, hi);
    *out = (uint64_t)x;
    return 0;
}

/* A string field of 1..cap-1 bytes from the set `ok` (so it needs no
 * escaping wherever it is echoed: JSON, logs, tables). */
static int kv_j_str(json_t *o, const char *ctx, const char *key, const char *ok, char *out, size_t cap,
                    kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v || !json_is_string(v)) return kv_fail(d, KV_EFORMAT, "%s: '%s' must be a string", ctx, key);
    size_t n = json_string_length(v);
    const char *s = json_string_value(v);
    if (n == 0 || n >= cap) return kv_fail(d, KV_EFORMAT, "%s: '%s' must be 1 to %zu bytes", ctx, key, cap - 1);
    for (size_t i = 0; i < n; i++)
        if (!s[i] || !strchr(ok, s[i]))
            return kv_fail(d, KV_EFORMAT, "%s: '%s' may hold only [%s]", ctx, key, ok);
    memcpy(out, s, n + 1);
    return 0;
}

static int kv_j_hex32(json_t *o, const char *ctx, const char *key, uint8_t out[32], kv_diag *d) {
    json_t *v = json_object_get(o, key);
    const char *s = v && json_is_string(v) ? json_string_value(v) : NULL;
    bool ok = s && json_string_length(v) == 64;
    for (int i = 0; ok && i < 32; i++) {
        unsigned x = 0;
        for (int j = 0; j < 2; j++) {
            char c = s[2 * i + j];
            if (c >= '0' && c <= '9') x = x * 16 + (unsigned)(c - '0');
            else if (c >= 'a' && c <= 'f') x = x * 16 + (unsigned)(c - 'a' + 10);
            else ok = false;
        }
        out[i] = (uint8_t)x;
    }
    return ok ? 0 : kv_fail(d, KV_EFORMAT, "%s: '%s' must be 64 lowercase hex digits", ctx, key);
}

static int kv_held_cmp(const void *a, const void *b) {
    const kv_hub_held *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    return 0;
}

void kv_hub_announce_free(kv_hub_announce *a) {
    if (!a) return;
    free(a->shards);
    memset(a, 0, sizeof *a);
}

int kv_hub_parse_announce(kv_hub_announce *a, const char *json, size_t len, kv_diag *d) {
    memset(a, 0, sizeof *a);
    if (len > (size_t)KV_HUB_MAX_SHARDS_PER_NODE * 256 + 4096)
        return kv_fail(d, KV_EFORMAT, "announcement: %zu bytes is too large", len);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "announcement: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    const char *ctx = "announcement";
    uint64_t mem = 0;
    if (!json_is_object(root)) {
        rc = kv_fail(d, KV_EFORMAT, "announcement: must be a JSON object");
        goto out;
    }
    if ((rc = kv_j_hex32(root, ctx, "nonce", a->nonce, d)) ||
        (rc = kv_j_str(root, ctx, "addr", KV_ADDR_CHARS, a->addr, sizeof a->addr, d)) ||
        (rc = kv_j_str(root, ctx, "backend", KV_NAME_CHARS, a->backend, sizeof a->backend, d)) ||
        (rc = kv_j_u64(root, ctx, "memory", (uint64_t)INT64_MAX, &mem, d)))
        goto out;
    a->memory = mem;
    json_t *js = json_object_get(root, "site");
    if (js) { /* optional: a node without --site is grouped by the hub */
        if ((rc = kv_j_str(root, ctx, "site", KV_SITE_CHARS, a->site, sizeof a->site, d))) goto out;
        if (kv_hub_site_check(a->site, d)) {
            kv_diag_prefix(d, KV_EFORMAT, "announcement");
            if (d) d->code = KV_EFORMAT;
            rc = KV_EFORMAT;
            goto out;
        }
    }
    /* HOST:PORT, port 1..65535 */
    const char *colon = strrchr(a->addr, ':');
    uint64_t port = 0;
    const char *pp = colon ? colon + 1 : NULL;
    if (!colon || colon == a->addr || kv_rd_u64(&pp, &port) || *pp || port < 1 || port > 65535) {
        rc = kv_fail(d, KV_EFORMAT, "announcement: 'addr' must be HOST:PORT with a port in 1..65535");
        goto out;
    }
    json_t *sh = json_object_get(root, "shards");
    if (!sh || !json_is_array(sh)) {
        rc = kv_fail(d, KV_EFORMAT, "announcement: 'shards' must be an array");
        goto out;
    }
    size_t n = json_array_size(sh);
    if (n > KV_HUB_MAX_SHARDS_PER_NODE) {
        rc = kv_fail(d, KV_EFORMAT, "announcement: %zu shards, at most %u", n, KV_HUB_MAX_SHARDS_PER_NODE);
        goto out;
    }
    a->shards = calloc(n ? n : 1, sizeof *a->shards);
    if (!a->shards) {
        rc = kv_fail(d, KV_ENOMEM, "announcement: out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(sh, i);
        uint64_t L, F, T;
        char c[48];
        snprintf(c, sizeof c, "announcement: shards[%zu]", i);
        if (!json_is_object(e)) {
            rc = kv_fail(d, KV_EFORMAT, "%s must be an object", c);
            goto out;
        }
        if ((rc = kv_j_u64(e, c, "layer", UINT32_MAX, &L, d)) || (rc = kv_j_u64(e, c, "first", UINT32_MAX, &F, d)) ||
            (rc = kv_j_u64(e, c, "last", UINT32_MAX, &T, d)) ||
            (rc = kv_j_hex32(e, c, "sha256", a->shards[i].sha256, d)))
            goto out;
        if (T < F) {
            rc = kv_fail(d, KV_EFORMAT, "%s: 'last' < 'first'", c);
            goto out;
        }
        a->shards[i].layer = (uint32_t)L;
        a->shards[i].first = (uint32_t)F;
        a->shards[i].last = (uint32_t)T;
    }
    a->n_shards = n;
    qsort(a->shards, n, sizeof *a->shards, kv_held_cmp);
    for (size_t i = 1; i < n; i++)
        if (!kv_held_cmp(&a->shards[i - 1], &a->shards[i])) {
            rc = kv_fail(d, KV_EFORMAT, "announcement: shard (layer %u, first %u) is listed twice",
                         a->shards[i].layer, a->shards[i].first);
            goto out;
        }
out:
    json_decref(root);
    if (rc) kv_hub_announce_free(a);
    return rc;
}

char *kv_hub_announce_json(const kv_hub_announce *a) {
    char hex[65];
    json_t *root = json_object(), *sh = json_array();
    kv_hex(a->nonce, 32, hex);
    json_object_set_new(root, "nonce", json_string(hex));
    json_object_set_new(root, "addr", json_string(a->addr));
    json_object_set_new(root, "memory", json_integer((json_int_t)a->memory));
    json_object_set_new(root, "backend", json_string(a->backend));
    if (a->site[0]) json_object_set_new(root, "site", json_string(a->site));
    for (size_t i = 0; i < a->n_shards; i++) {
        json_t *e = json_object();
        json_object_set_new(e, "layer", json_integer(a->shards[i].layer));
        json_object_set_new(e, "first", json_integer(a->shards[i].first));
        json_object_set_new(e, "last", json_integer(a->shards[i].last));
        kv_hex(a->shards[i].sha256, 32, hex);
        json_object_set_new(e, "sha256", json_string(hex));
        json_array_append_new(sh, e);
    }
    json_object_set_new(root, "shards", sh);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

/* ---- challenge answer ------------------------------------------------------ */

int kv_hub_parse_answer(const char *json, size_t len, uint8_t nonce[32], uint8_t hash[32], kv_diag *d) {
    memset(nonce, 0, 32);
    memset(hash, 0, 32);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "challenge answer: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    if (!json_is_object(root)) rc = kv_fail(d, KV_EFORMAT, "challenge answer: must be a JSON object");
    else if (!(rc = kv_j_hex32(root, "challenge answer", "nonce", nonce, d)))
        rc = kv_j_hex32(root, "challenge answer", "sha256", hash, d);
    json_decref(root);
    if (rc) {
        memset(nonce, 0, 32);
        memset(hash, 0, 32);
    }
    return rc;
}

/* ---- heartbeat ------------------------------------------------------------- */

#define KV_HUB_BEAT_MAX ((uint64_t)1 << 53) /* exact in a JS number (the status page) */

int kv_hub_parse_beat(kv_hub_beat *b, const char *json, size_t len, kv_diag *d) {
    memset(b, 0, sizeof *b);
    if (len == 0) return 0;
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "heartbeat: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = kv_fail(d, KV_EFORMAT, "heartbeat: must be a JSON object");
    } else if (json_object_get(root, "served_pairs") || json_object_get(root, "served_tokens")) {
        if (!(rc = kv_j_u64(root, "heartbeat", "served_pairs", KV_HUB_BEAT_MAX, &b->served_pairs, d)))
            rc = kv_j_u64(root, "heartbeat", "served_tokens", KV_HUB_BEAT_MAX, &b->served_tokens, d);
        b->has = rc == 0;
    }
    json_decref(root);
    if (rc) memset(b, 0, sizeof *b);
    return rc;
}

/* ---- demand report ------------------------------------------------------ */

void kv_hub_demand_free(kv_hub_demand *r) {
    if (!r) return;
    free(r->shards);
    memset(r, 0, sizeof *r);
}

static int kv_demand_cmp(const void *a, const void *b) {
    const kv_hub_demand_shard *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    return 0;
}

int kv_hub_parse_demand(kv_hub_demand *r, const char *json, size_t len, kv_diag *d) {
    memset(r, 0, sizeof *r);
    if (len > (size_t)KV_HUB_MAX_DEMAND_SHARDS * 160 + 4096)
        return kv_fail(d, KV_EFORMAT, "demand: %zu bytes is too large", len);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "demand: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    json_t *sh = json_object_get(root, "shards");
    if (!json_is_object(root) || !json_is_array(sh)) {
        rc = kv_fail(d, KV_EFORMAT, "demand: needs {\"tokens\": N, \"shards\": [...]}");
        goto out;
    }
    if ((rc = kv_j_u64(root, "demand", "tokens", KV_HUB_DEMAND_MAX, &r->tokens, d))) goto out;
    const size_t n = json_array_size(sh);
    if (n > KV_HUB_MAX_DEMAND_SHARDS) {
        rc = kv_fail(d, KV_EFORMAT, "demand: %zu shards, at most %u", n, KV_HUB_MAX_DEMAND_SHARDS);
        goto out;
    }
    if (!(r->shards = calloc(n ? n : 1, sizeof *r->shards))) {
        rc = kv_fail(d, KV_ENOMEM, "demand: out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(sh, i);
        char c[40];
        snprintf(c, sizeof c, "demand: shards[%zu]", i);
        uint64_t L, F, T, C, W;
        if (!json_is_object(e)) {
            rc = kv_fail(d, KV_EFORMAT, "%s must be an object", c);
            goto out;
        }
        if ((rc = kv_j_u64(e, c, "layer", UINT32_MAX, &L, d)) || (rc = kv_j_u64(e, c, "first", UINT32_MAX, &F, d)) ||
            (rc = kv_j_u64(e, c, "last", UINT32_MAX, &T, d)) ||
            (rc = kv_j_u64(e, c, "computations", KV_HUB_DEMAND_MAX, &C, d)) ||
            (rc = kv_j_u64(e, c, "wait_us", KV_HUB_DEMAND_MAX, &W, d)))
            goto out;
        if (T < F) {
            rc = kv_fail(d, KV_EFORMAT, "%s: 'last' < 'first'", c);
            goto out;
        }
        r->shards[i] = (kv_hub_demand_shard){(uint32_t)L, (uint32_t)F, (uint32_t)T, C, W};
    }
    r->n_shards = n;
    kv_hub_demand_shard *sorted = malloc((n ? n : 1) * sizeof *sorted);
    if (!sorted) {
        rc = kv_fail(d, KV_ENOMEM, "demand: out of memory");
        goto out;
    }
    memcpy(sorted, r->shards, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, kv_demand_cmp);
    for (size_t i = 1; i < n && !rc; i++)
        if (!kv_demand_cmp(&sorted[i - 1], &sorted[i]))
            rc = kv_fail(d, KV_EFORMAT, "demand: shard (layer %u, first %u) listed twice", sorted[i].layer,
                         sorted[i].first);
    free(sorted);
out:
    json_decref(root);
    if (rc) kv_hub_demand_free(r);
    return rc;
}

char *kv_hub_demand_json(const kv_hub_demand *r) {
    json_t *j = json_object(), *a = json_array();
    if (!j || !a) {
        json_decref(j);
        json_decref(a);
        return NULL;
    }
    json_object_set_new(j, "tokens", json_integer((json_int_t)r->tokens));
    for (size_t i = 0; i < r->n_shards; i++) {
        const kv_hub_demand_shard *e = &r->shards[i];
        json_t *o = json_object();
        json_object_set_new(o, "layer", json_integer(e->layer));
        json_object_set_new(o, "first", json_integer(e->first));
        json_object_set_new(o, "last", json_integer(e->last));
        json_object_set_new(o, "computations", json_integer((json_int_t)e->computations));
        json_object_set_new(o, "wait_us", json_integer((json_int_t)e->wait_us));
        json_array_append_new(a, o);
    }
    json_object_set_new(j, "shards", a);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

/* ---- market ------------------------------------------------------------- */

#define KV_HUB_MARKET_MAX_SHARDS (1u << 20) /* as KV_MANIFEST_MAX_SLABS */

void kv_hub_market_free(kv_hub_market *m) {
    if (!m) return;
    free(m->shards);
    memset(m, 0, sizeof *m);
}

int kv_hub_parse_market(kv_hub_market *m, const char *json, size_t len, kv_diag *d) {
    memset(m, 0, sizeof *m);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "market: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    json_t *cov = json_object_get(root, "covered"), *sh = json_object_get(root, "shards");
    if (!json_is_object(root) || !json_is_boolean(cov) || !json_is_array(sh)) {
        rc = kv_fail(d, KV_EFORMAT, "market: needs {\"covered\": bool, \"shards\": [...]}");
        goto out;
    }
    size_t n = json_array_size(sh);
    if (n > KV_HUB_MARKET_MAX_SHARDS) {
        rc = kv_fail(d, KV_EFORMAT, "market: %zu shards, at most %u", n, KV_HUB_MARKET_MAX_SHARDS);
        goto out;
    }
    m->covered = json_is_true(cov);
    m->shards = calloc(n ? n : 1, sizeof *m->shards);
    if (!m->shards) {
        rc = kv_fail(d, KV_ENOMEM, "market: out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(sh, i);
        char c[40];
        snprintf(c, sizeof c, "market: shards[%zu]", i);
        uint64_t L, F, T, B, W, V, R;
        if (!json_is_object(e)) {
            rc = kv_fail(d, KV_EFORMAT, "%s must be an object", c);
            goto out;
        }
        if ((rc = kv_j_u64(e, c, "layer", UINT32_MAX, &L, d)) || (rc = kv_j_u64(e, c, "first", UINT32_MAX, &F, d)) ||
            (rc = kv_j_u64(e, c, "last", UINT32_MAX, &T, d)) || (rc = kv_j_u64(e, c, "bytes", INT64_MAX, &B, d)) ||
            (rc = kv_j_u64(e, c, "wanted", UINT32_MAX, &W, d)) || (rc = kv_j_u64(e, c, "live", UINT32_MAX, &V, d)) ||
            (rc = kv_j_u64(e, c, "reward", INT64_MAX, &R, d)))
            goto out;
        if (T < F) {
            rc = kv_fail(d, KV_EFORMAT, "%s: 'last' < 'first'", c);
            goto out;
        }
        m->shards[i] = (kv_hub_shard_view){(uint32_t)L, (uint32_t)F, (uint32_t)T, B, (uint32_t)W, (uint32_t)V, R, 0, 0};
        /* demand and wait (hubs before demand have none): finite, >= 0 */
        const char *dk[2] = {"demand", "wait_ms"};
        double *dv[2] = {&m->shards[i].demand, &m->shards[i].wait_ms};
        for (int k = 0; k < 2; k++) {
            json_t *v = json_object_get(e, dk[k]);
            if (!v) continue;
            const double x = json_is_number(v) ? json_number_value(v) : -1;
            if (!(x >= 0 && x <= 1e18)) {
                rc = kv_fail(d, KV_EFORMAT, "%s: '%s' must be a number in [0, 1e18]", c, dk[k]);
                goto out;
            }
            *dv[k] = x;
        }
    }
    m->n_shards = n;
out:
    json_decref(root);
    if (rc) kv_hub_market_free(m);
    return rc;
}
