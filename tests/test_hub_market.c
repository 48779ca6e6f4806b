/* The market that follows demand: the policy module (src/hub/market.h)
 * against naive references, and the real `kvasir hub` process taking
 * signed demand reports (POST /v1/demand).
 * kv-test-labels: net unit attack
 *
 * References. With no demand the module must be today's fixed market: the
 * reward base * wanted / (live + 1) and the scarcest-first order recomputed
 * naively, wanted at its floor whatever the time. On a scripted demand
 * series the wanted count is recomputed independently: the demand rate as
 * the sum over the whole report history of its decayed contributions (the
 * module keeps one running value), then the documented rule with its
 * timers; on noise around a threshold it may move at most once. Against
 * the hub: a demand report raises a shard's wanted count, the node's own
 * choice (kv_node_choose) on the hub's market takes the new replica, and
 * wanted falls back after the hold time; a lying coordinator is held to its
 * budget, cannot replay, and alone cannot raise a shard; two hubs on one
 * PostgreSQL store agree (KV_TEST_PG: tests/test_pg_store.sh). */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hub/market.h"
#include "hub/store.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/slice.h"
#include "kvtest.h"

#define HUBT_DIR_TAG "hubmkt"
#define HUBT_DB_TAG "kvm"
#include "hub_support.h"

/* ---- the policy against naive references ------------------------------------ */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

/* today's order, naively: sort by the fraction live/wanted, then by the
 * deficit, then by index, with an insertion sort over doubles */
static void naive_order(const uint32_t *wanted, const uint32_t *live, size_t n, uint32_t *out) {
    for (size_t i = 0; i < n; i++) out[i] = (uint32_t)i;
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0; j--) {
            const uint32_t a = out[j - 1], b = out[j];
            const double fa = (double)live[a] / wanted[a], fb = (double)live[b] / wanted[b];
            const long da = (long)wanted[a] - live[a], db = (long)wanted[b] - live[b];
            const bool swap = fb < fa || (fb == fa && (db > da || (db == da && b < a)));
            if (!swap) break;
            out[j - 1] = b;
            out[j] = a;
        }
}

static void test_zero_demand_is_fixed_market(void) {
    for (int round = 0; round < 200; round++) {
        kv_mkt_policy p;
        const uint32_t floor = 1 + (uint32_t)(rnd() % 5);
        const uint64_t base = 1 + rnd() % 5000000;
        kv_mkt_policy_default(&p, floor, base);
        p.ceiling = floor + (uint32_t)(rnd() % 4);
        p.raise_ms = 1;
        p.hold_ms = 1;
        ASSERT_EQ(kv_mkt_policy_check(&p, NULL), 0);
        enum { N = 40 };
        uint32_t wanted[N], live[N], ord[N];
        kv_mkt_sort srt[N];
        for (size_t i = 0; i < N; i++) {
            kv_mkt_state s;
            kv_mkt_state_init(&p, &s);
            /* no demand: wanted stays at the floor whenever it is evaluated */
            int64_t t = 1700000000000;
            for (int k = 0; k < 5; k++) {
                t += (int64_t)(rnd() % 100000);
                kv_mkt_step(&p, &s, t);
                ASSERT_EQ(s.wanted, floor);
            }
            ASSERT_TRUE(kv_mkt_rate(&p, &s, t) == 0);
            wanted[i] = s.wanted;
            live[i] = (uint32_t)(rnd() % 7);
            ASSERT_EQ(kv_mkt_reward(&p, wanted[i], live[i], kv_mkt_rate(&p, &s, t)),
                      base * wanted[i] / ((uint64_t)live[i] + 1));
            srt[i] = (kv_mkt_sort){(uint32_t)i, wanted[i], live[i]};
        }
        qsort(srt, N, sizeof *srt, kv_mkt_cmp);
        naive_order(wanted, live, N, ord);
        for (size_t i = 0; i < N; i++) ASSERT_EQ(srt[i].idx, ord[i]);
    }
    /* demand raises the reward, at most twice the fixed market's */
    kv_mkt_policy p;
    kv_mkt_policy_default(&p, 2, 1000000);
    ASSERT_EQ(kv_mkt_reward(&p, 2, 1, 0), 1000000u);
    ASSERT_EQ(kv_mkt_reward(&p, 2, 1, p.per_replica / 2), 1500000u);
    ASSERT_EQ(kv_mkt_reward(&p, 2, 1, 1e12), 2000000u);
    /* settings out of range are refused, naming the setting */
    kv_diag d = {0};
    p.low = p.high;
    ASSERT_EQ(kv_mkt_policy_check(&p, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "low") != NULL);
    kv_mkt_policy_default(&p, 3, 1);
    p.ceiling = 2;
    ASSERT_EQ(kv_mkt_policy_check(&p, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "--wanted-max") != NULL);
}

/* The reference: demand from the whole history, the rule from its text. */
typedef struct ref_ev {
    int64_t t;
    double c;
} ref_ev;

static double ref_rate(const kv_mkt_policy *p, const ref_ev *ev, size_t n, int64_t now) {
    double r = 0;
    for (size_t i = 0; i < n; i++)
        if (ev[i].t <= now)
            r += ev[i].c * log(2.0) / (p->half_life_ms / 1000.0) * pow(2.0, -(double)(now - ev[i].t) / p->half_life_ms);
    return r;
}

typedef struct ref_rule {
    uint32_t w;
    int64_t above, below, changed; /* -1: the condition does not hold / never changed */
} ref_rule;

static void ref_eval(const kv_mkt_policy *p, ref_rule *m, double r, int64_t t) {
    const double per = p->per_replica;
    if (m->w < p->ceiling && r > p->high * per * m->w) {
        if (m->above < 0) m->above = t;
        if (t - m->above >= p->raise_ms) {
            m->w++;
            m->changed = t;
            m->above = m->below = -1;
        }
    } else {
        m->above = -1;
    }
    const bool held_since_change = m->changed < 0 || t - m->changed >= p->hold_ms;
    if (m->w > p->floor && r < p->low * per * (m->w - 1)) {
        if (m->below < 0) m->below = t;
        if (t - m->below >= p->hold_ms && held_since_change) {
            m->w--;
            m->changed = t;
            m->below = -1;
        }
    } else {
        m->below = -1;
    }
}

/* A series: quiet, noise around the first raise threshold, a ramp to a
 * peak, then quiet again; reports every 100 ms, the rule evaluated after
 * each. */
static void test_scripted_series(void) {
    kv_mkt_policy p;
    kv_mkt_policy_default(&p, 1, 1000);
    p.ceiling = 4;
    p.per_replica = 100;
    p.raise_ms = 1000;
    p.hold_ms = 5000;
    p.half_life_ms = 2000;
    p.share = 1;
    ASSERT_EQ(kv_mkt_policy_check(&p, NULL), 0);
    enum { STEPS = 1400 };
    static ref_ev ev[STEPS];
    size_t nev = 0;
    kv_mkt_state s;
    kv_mkt_state_init(&p, &s);
    ref_rule m = {p.floor, -1, -1, -1};
    const int64_t t0 = 1700000000000;
    int changes_in_noise = 0, max_w = 0;
    uint32_t prev = s.wanted;
    for (int k = 0; k < STEPS; k++) {
        const int64_t t = t0 + 100 * (int64_t)k;
        double rate; /* the flow this step, computations/s */
        if (k < 100) rate = 0;
        else if (k < 500) rate = 100 * (1.0 + 0.08 * ((double)(rnd() % 2001) / 1000.0 - 1.0)); /* 100 +- 8% */
        else if (k < 800) rate = 100 + 11.0 * (k - 500); /* to 3400/s */
        else if (k < 900) rate = 3400;
        else rate = 0;
        const double c = rate * 0.1;
        if (c > 0) {
            ev[nev++] = (ref_ev){t, c};
            kv_mkt_add(&p, &s, t, c, 0, NULL);
        }
        kv_mkt_step(&p, &s, t);
        const double rr = ref_rate(&p, ev, nev, t);
        ASSERT_NEAR(kv_mkt_rate(&p, &s, t), rr, 1e-9 * (rr + 1));
        ref_eval(&p, &m, rr, t);
        if (s.wanted != m.w) {
            fprintf(stderr, "step %d: module wants %u, the reference %u (rate %.6f)\n", k, s.wanted, m.w, rr);
            ASSERT_EQ(s.wanted, m.w);
            return;
        }
        if (k >= 100 && k < 500 && s.wanted != prev) changes_in_noise++;
        if ((int)s.wanted > max_w) max_w = (int)s.wanted;
        prev = s.wanted;
    }
    ASSERT_EQ(max_w, 4);              /* the peak took it to the ceiling */
    ASSERT_TRUE(changes_in_noise <= 1); /* no flapping around the threshold */
    ASSERT_EQ(s.wanted, 1u);          /* back at the floor once quiet */
}

/* One stranger key alone cannot raise a shard; two can; an operator key can. */
static void test_share_cap(void) {
    kv_mkt_policy p;
    kv_mkt_policy_default(&p, 1, 1000);
    p.ceiling = 5;
    p.per_replica = 10;
    p.raise_ms = 0;
    p.hold_ms = 1000;
    uint8_t a[32] = {1}, b[32] = {2};
    kv_mkt_state s;
    kv_mkt_state_init(&p, &s);
    int64_t t = 1700000000000;
    for (int k = 0; k < 50; k++, t += 100) {
        kv_mkt_add(&p, &s, t, 1000, 0, a);
        kv_mkt_step(&p, &s, t);
    }
    ASSERT_TRUE(kv_mkt_rate(&p, &s, t) > 100);
    ASSERT_TRUE(kv_mkt_driving_rate(&p, &s, t) < 1e-6);
    ASSERT_EQ(s.wanted, 1u);
    /* a second key with as much: the driving rate is the whole rate again */
    for (int k = 0; k < 50; k++, t += 100) {
        kv_mkt_add(&p, &s, t, 1000, 0, a);
        kv_mkt_add(&p, &s, t, 1000, 0, b);
        kv_mkt_step(&p, &s, t);
    }
    ASSERT_TRUE(s.wanted > 1);
    kv_mkt_state o;
    kv_mkt_state_init(&p, &o);
    for (int k = 0; k < 10; k++, t += 100) {
        kv_mkt_add(&p, &o, t, 1000, 0, NULL);
        kv_mkt_step(&p, &o, t);
    }
    ASSERT_TRUE(o.wanted > 1);
}

/* The bound of one report against a naive recomputation from the rule's
 * text, on random reports over the test model's slabs. */
static void test_report_bound(void) {
    const size_t ns = g_m->n_slabs;
    const uint32_t used = g_m->n_expert_used;
    ASSERT_TRUE(used > 0);
    for (int round = 0; round < 500; round++) {
        kv_hub_demand_shard sh[64];
        size_t n = 0;
        for (size_t i = 0; i < ns && n < 64; i++) {
            if (rnd() % 3 == 0) continue;
            const uint64_t big = rnd() % 4 == 0 ? (rnd() % 1000000000) : rnd() % 500;
            sh[n++] = (kv_hub_demand_shard){g_m->slabs[i].layer, g_m->slabs[i].first, g_m->slabs[i].last, big,
                                            rnd() % 3000000};
        }
        kv_hub_demand r = {0, sh, n};
        const uint64_t granted = rnd() % 300;
        double acc[64] = {0}, wt[64] = {0}, total = 0, want[64] = {0}, wwant[64] = {0}, wtotal = 0;
        ASSERT_EQ(kv_mkt_bound(g_m, &r, granted, acc, wt, &total, NULL), 0);
        /* naive: per shard, then per layer, then waiting */
        for (size_t k = 0; k < n; k++) {
            size_t i = 0;
            while (g_m->slabs[i].layer != sh[k].layer || g_m->slabs[i].first != sh[k].first) i++;
            const uint32_t width = sh[k].last - sh[k].first + 1;
            const double cap = (double)granted * (used < width ? used : width);
            want[i] = fmin((double)sh[k].computations, cap);
            wwant[i] = sh[k].wait_us / 1000.0;
        }
        for (uint32_t L = 0; L < g_m->n_layer; L++) {
            double sum = 0;
            for (size_t i = 0; i < ns; i++)
                if (g_m->slabs[i].layer == L) sum += want[i];
            for (size_t i = 0; i < ns; i++)
                if (g_m->slabs[i].layer == L && sum > (double)granted * used) want[i] *= (double)granted * used / sum;
        }
        for (size_t i = 0; i < ns; i++) {
            wwant[i] = fmin(wwant[i], want[i] * 1000);
            wtotal += want[i];
            ASSERT_NEAR(acc[i], want[i], 1e-9 * (want[i] + 1));
            ASSERT_NEAR(wt[i], wwant[i], 1e-9 * (wwant[i] + 1));
        }
        ASSERT_NEAR(total, wtotal, 1e-9 * (wtotal + 1));
    }
    /* a shard that is not the model's adds nothing */
    kv_hub_demand_shard bad[2] = {{g_m->slabs[0].layer, g_m->slabs[0].first, g_m->slabs[0].last, 5, 5},
                                  {g_m->slabs[0].layer, g_m->slabs[0].first, g_m->slabs[0].last + 1, 5, 5}};
    kv_hub_demand r = {10, bad, 2};
    double acc[64] = {0}, wt[64] = {0}, total = 0;
    kv_diag d = {0};
    ASSERT_EQ(kv_mkt_bound(g_m, &r, 10, acc, wt, &total, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "shards[1]") != NULL);
    ASSERT_TRUE(acc[0] == 0 && total == 0);
}

/* ---- against the hub ----------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Slab i of the hub's market (a fresh GET, which also evaluates the rule). */
static int market_shard(const hub_proc *p, size_t i, kv_hub_shard_view *out) {
    resp r = get(p, "/v1/market");
    kv_hub_market m;
    kv_diag d = {0};
    int rc = r.status == 200 ? kv_hub_parse_market(&m, r.body, r.n, &d) : -1;
    resp_free(&r);
    if (rc) return -1;
    rc = -1;
    for (size_t k = 0; k < m.n_shards; k++)
        if (m.shards[k].layer == g_m->slabs[i].layer && m.shards[k].first == g_m->slabs[i].first) {
            *out = m.shards[k];
            rc = 0;
        }
    kv_hub_market_free(&m);
    return rc;
}

/* The market in manifest order (as a node maps it). */
static int market_view(const hub_proc *p, kv_hub_shard_view *view) {
    for (size_t i = 0; i < g_m->n_slabs; i++)
        if (market_shard(p, i, &view[i])) return -1;
    return 0;
}

/* A report of `comp` computations on slab i for `tokens` tokens. */
static char *demand_body(uint64_t tokens, size_t i, uint64_t comp) {
    kv_hub_demand_shard sh = {g_m->slabs[i].layer, g_m->slabs[i].first, g_m->slabs[i].last, comp, 1000};
    kv_hub_demand r = {tokens, &sh, 1};
    return kv_hub_demand_json(&r);
}

static uint64_t reply_u64(const resp *r, const char *key) {
    json_t *j = json_loads(r->body, 0, NULL);
    json_t *v = json_object_get(j, key);
    const uint64_t x = json_is_integer(v) ? (uint64_t)json_integer_value(v)
                       : json_is_real(v) ? (uint64_t)json_real_value(v) : UINT64_MAX;
    json_decref(j);
    return x;
}

/* Polls the market until slab i wants `want` (each GET evaluates the rule);
 * the seconds it took, or -1 after limit_s. *began (may be NULL) gets the
 * time the answering GET started: where nothing else reads the market, the
 * change was made during that GET, so no earlier. */
static double wait_wanted_at(const hub_proc *p, size_t i, uint32_t want, double limit_s, double *began) {
    const double t0 = now_s();
    while (now_s() - t0 < limit_s) {
        kv_hub_shard_view v;
        const double t = now_s();
        if (!market_shard(p, i, &v) && v.wanted == want) {
            if (began) *began = t;
            return now_s() - t0;
        }
        usleep(50000);
    }
    return -1;
}
static double wait_wanted(const hub_proc *p, size_t i, uint32_t want, double limit_s) {
    return wait_wanted_at(p, i, want, limit_s, NULL);
}

static void register_all(const hub_proc *p, kv_node_key *k, int idx, const char *addr) {
    int all[64];
    for (size_t i = 0; i < g_m->n_slabs; i++) all[i] = (int)i;
    test_key(k, idx);
    ASSERT_EQ(do_register(p, k, addr, all, g_m->n_slabs, NULL), 200);
}

/* A scripted demand raises slab 0's wanted count one step per raise time
 * up to the ceiling, a node's own choice takes the new replica, and once
 * the reports stop wanted falls back to the floor, no sooner than the hold
 * time after the last change. */
static void test_demand_raises_and_falls(void) {
    char db[512], extra[512], hex[65];
    db_path(db, sizeof db, "raise");
    kv_node_key coord, stranger, a, b;
    test_key(&coord, 900);
    test_key(&stranger, 901);
    kv_hex(coord.pk, 32, hex);
    snprintf(extra, sizeof extra, "--wanted 1 --wanted-max 3 --vouch-key %s --demand-per-replica 50 "
             "--market-raise-ms 300 --market-hold-ms 1500 --demand-half-life-ms 300", hex);
    hub_proc p;
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    register_all(&p, &a, 910, "127.0.0.1:9310");
    const size_t ns = g_m->n_slabs;
    kv_hub_shard_view view[64];
    uint8_t take[64];
    uint64_t bytes;
    kv_diag d = {0};
    ASSERT_EQ(market_view(&p, view), 0);
    for (size_t i = 0; i < ns; i++) {
        ASSERT_EQ(view[i].wanted, 1u);
        ASSERT_TRUE(view[i].demand == 0);
    }
    /* a key the hub does not vouch for reports nothing */
    uint64_t acc = 0;
    kv_hub_demand_shard sh = {g_m->slabs[0].layer, g_m->slabs[0].first, g_m->slabs[0].last, 2000, 5000};
    kv_hub_demand rep = {1000, &sh, 1};
    ASSERT_EQ(kv_hub_report_demand(p.url, &stranger, &rep, &acc, &d), KV_EAUTH);
    /* demand on slab 0, kept up every 100 ms until it wants 3 */
    uint32_t seen[8] = {0};
    size_t n_seen = 0;
    double t_top = -1, t_seen = -1;
    const double t0 = now_s();
    while (now_s() - t0 < 8) {
        const double t_iter = now_s(); /* the raise seen below was made no earlier */
        ASSERT_EQ(kv_hub_report_demand(p.url, &coord, &rep, &acc, &d), 0);
        ASSERT_EQ(acc, 1000u);
        kv_hub_shard_view v;
        ASSERT_EQ(market_shard(&p, 0, &v), 0);
        if (!n_seen || seen[n_seen - 1] != v.wanted) {
            if (n_seen < 8) seen[n_seen++] = v.wanted;
        }
        if (v.wanted == 3) {
            t_top = t_iter;
            t_seen = now_s();
            ASSERT_TRUE(v.demand > 150);
            ASSERT_TRUE(v.wait_ms > 0);
            break;
        }
        usleep(100000);
    }
    ASSERT_TRUE(t_top > 0);
    /* one step at a time, at least the raise time apart */
    ASSERT_EQ(n_seen, 3u);
    ASSERT_EQ(seen[0], 1u);
    ASSERT_EQ(seen[1], 2u);
    ASSERT_EQ(seen[2], 3u);
    ASSERT_TRUE(t_seen - t0 >= 0.59); /* two raises, each held 300 ms first (the hub counts whole ms) */
    /* the other shards stay at the floor */
    ASSERT_EQ(market_view(&p, view), 0);
    for (size_t i = 1; i < ns; i++) ASSERT_EQ(view[i].wanted, 1u);
    /* `kvasir market` shows the demand per shard */
    char cmd[1024], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' market --hub %s", getenv("KV_BIN"), p.url);
    FILE *f = popen(cmd, "r");
    size_t n = f ? fread(out, 1, sizeof out - 1, f) : 0;
    if (f) pclose(f);
    out[n] = 0;
    ASSERT_TRUE(strstr(out, "demand/s") != NULL);
    /* a node with room for one shard takes the newly wanted replica */
    ASSERT_EQ(kv_node_choose(view, ns, g_m->slabs[0].file.size, NULL, 5, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 1);
    for (size_t i = 1; i < ns; i++) ASSERT_EQ(take[i], 0);
    const int s0[] = {0};
    test_key(&b, 911);
    ASSERT_EQ(do_register(&p, &b, "127.0.0.1:9311", s0, 1, NULL), 200);
    kv_hub_shard_view v;
    ASSERT_EQ(market_shard(&p, 0, &v), 0);
    ASSERT_EQ(v.live, 2u);
    /* quiet: back to the floor, each step no sooner than the hold time
     * after the change before it (a lower bound: never flaky under load) */
    double t_two = 0;
    ASSERT_TRUE(wait_wanted_at(&p, 0, 2, 10, &t_two) >= 0);
    ASSERT_TRUE(now_s() - t_top >= 1.5 - 0.02);
    ASSERT_TRUE(wait_wanted(&p, 0, 1, 10) >= 0);
    ASSERT_TRUE(now_s() - t_two >= 1.5 - 0.02);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* The market's state lives in the store: a restarted hub wants what it
 * wanted. */
static void test_restart_keeps_market(void) {
    char db[512], extra[512], hex[65];
    db_path(db, sizeof db, "keep");
    kv_node_key coord;
    test_key(&coord, 920);
    kv_hex(coord.pk, 32, hex);
    snprintf(extra, sizeof extra, "--wanted 1 --wanted-max 4 --vouch-key %s --demand-per-replica 50 "
             "--market-raise-ms 1 --market-hold-ms 600000 --demand-half-life-ms 600000", hex);
    hub_proc p;
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    kv_hub_demand_shard sh = {g_m->slabs[1].layer, g_m->slabs[1].first, g_m->slabs[1].last, 200000, 0};
    kv_hub_demand rep = {100000, &sh, 1};
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_report_demand(p.url, &coord, &rep, NULL, &d), 0);
    ASSERT_TRUE(wait_wanted(&p, 1, 2, 5) >= 0);
    kv_hub_shard_view before, after;
    ASSERT_EQ(market_shard(&p, 1, &before), 0);
    ASSERT_EQ(hub_stop(&p), 0);
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    ASSERT_EQ(market_shard(&p, 1, &after), 0);
    ASSERT_TRUE(after.wanted >= before.wanted);
    ASSERT_NEAR(after.demand, before.demand, before.demand * 0.01);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* A coordinator that lies: its tokens are held to its budget, its
 * computations to what those tokens can need, it cannot replay or backdate
 * a report, alone it cannot raise a shard, and its keys together are held
 * to their address block's budget. */
static void test_liar(void) {
    char db[512];
    db_path(db, sizeof db, "liar");
    hub_proc p;
    if (hub_start(&p, db, "--vouch-open --wanted 1 --wanted-max 4 --demand-per-replica 10 --market-raise-ms 100 "
                          "--demand-key-tokens 1000 --demand-half-life-ms 60000 --reward 1000")) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a, liar, k[5];
    register_all(&p, &a, 930, "127.0.0.1:9330");
    test_key(&liar, 931);
    /* far more than its budget: 1000 tokens counted, 2 computations each
     * (top-2 of this model) at most */
    char *body = demand_body(1000000000, 0, 1000000000000000ull);
    const uint64_t c1 = kv_node_next_counter(&liar);
    resp r = post_signed(&p, &liar, "/v1/demand", body, c1);
    ASSERT_EQ(r.status, 200);
    ASSERT_EQ(reply_u64(&r, "tokens"), 1000u);
    ASSERT_TRUE(reply_u64(&r, "computations") <= 2000u);
    resp_free(&r);
    kv_hub_shard_view v0, v1;
    ASSERT_EQ(market_shard(&p, 0, &v0), 0);
    const double cap_rate = 2000 * log(2.0) / 60.0; /* 2000 computations into a 60 s half-life */
    ASSERT_TRUE(v0.demand > 0 && v0.demand <= cap_rate * 1.001);
    /* the same signed bytes again, here: refused, nothing counted */
    r = post_signed(&p, &liar, "/v1/demand", body, c1);
    ASSERT_EQ(r.status, 409);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    free(body);
    /* a backdated counter (ten minutes ago) is refused */
    body = demand_body(10, 0, 20);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r = post_signed(&p, &liar, "/v1/demand", body, ((uint64_t)ts.tv_sec - 600) * 1000000u);
    ASSERT_EQ(r.status, 409);
    resp_free(&r);
    /* the budget of this window is spent: a further report counts nothing */
    r = post_signed(&p, &liar, "/v1/demand", body, kv_node_next_counter(&liar));
    ASSERT_EQ(r.status, 200);
    ASSERT_EQ(reply_u64(&r, "tokens"), 0u);
    resp_free(&r);
    free(body);
    /* a shard that is not the model's, a malformed body */
    r = post_signed(&p, &liar, "/v1/demand", "{\"tokens\":1,\"shards\":[{\"layer\":99,\"first\":0,\"last\":3,"
                    "\"computations\":1,\"wait_us\":0}]}", kv_node_next_counter(&liar));
    ASSERT_EQ(r.status, 400);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    r = post_signed(&p, &liar, "/v1/demand", "{\"tokens\":-1,\"shards\":[]}", kv_node_next_counter(&liar));
    ASSERT_EQ(r.status, 400);
    resp_free(&r);
    /* alone it cannot raise the shard, and the reward it sees is at most
     * twice the fixed market's */
    usleep(400000);
    ASSERT_EQ(market_shard(&p, 0, &v1), 0);
    ASSERT_EQ(v1.wanted, 1u);
    ASSERT_TRUE(v1.reward <= 2 * (1000u * 1 / (v1.live + 1)));
    ASSERT_TRUE(v1.demand <= v0.demand * 1.0001);
    /* fresh keys from the same address block share its budget (4 x 1000
     * a window; the liar spent 1000 of it) */
    uint64_t sum = 0;
    for (int i = 0; i < 5; i++) {
        test_key(&k[i], 940 + i);
        body = demand_body(1000, 0, 2000);
        r = post_signed(&p, &k[i], "/v1/demand", body, kv_node_next_counter(&k[i]));
        ASSERT_EQ(r.status, 200);
        sum += reply_u64(&r, "tokens");
        resp_free(&r);
        free(body);
    }
    ASSERT_EQ(sum, 3000u);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* Two hubs on one PostgreSQL store: one market state, one budget. */
static void test_two_hubs_demand(void) {
    char db[512], extra[512], hex[65];
    db_path(db, sizeof db, "shared");
    kv_node_key coord, a;
    test_key(&coord, 950);
    kv_hex(coord.pk, 32, hex);
    snprintf(extra, sizeof extra, "--refresh-ms 100 --wanted 1 --wanted-max 3 --vouch-key %s "
             "--demand-per-replica 50 --market-raise-ms 200 --market-hold-ms 600000 "
             "--demand-half-life-ms 600000", hex);
    hub_proc ha, hb;
    if (hub_start(&ha, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    if (hub_start(&hb, db, extra)) {
        ASSERT_TRUE(0);
        hub_stop(&ha);
        return;
    }
    register_all(&ha, &a, 951, "127.0.0.1:9351");
    char *body = demand_body(100000, 2, 200000);
    const uint64_t c1 = kv_node_next_counter(&coord);
    resp r = post_signed(&ha, &coord, "/v1/demand", body, c1);
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    /* the same request at the other hub is a replay */
    r = post_signed(&hb, &coord, "/v1/demand", body, c1);
    ASSERT_EQ(r.status, 409);
    resp_free(&r);
    free(body);
    ASSERT_TRUE(wait_wanted(&ha, 2, 2, 5) >= 0);
    usleep(400000); /* past both views' refresh */
    kv_hub_shard_view va, vb;
    ASSERT_EQ(market_shard(&ha, 2, &va), 0);
    ASSERT_EQ(market_shard(&hb, 2, &vb), 0);
    ASSERT_EQ(va.wanted, vb.wanted);
    ASSERT_NEAR(va.demand, vb.demand, va.demand * 0.001);
    ASSERT_TRUE(va.demand > 0);
    /* more demand at B: both hubs step one state to the ceiling */
    body = demand_body(100000, 2, 200000);
    r = post_signed(&hb, &coord, "/v1/demand", body, kv_node_next_counter(&coord));
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    free(body);
    ASSERT_TRUE(wait_wanted(&hb, 2, 3, 5) >= 0);
    ASSERT_TRUE(wait_wanted(&ha, 2, 3, 5) >= 0);
    usleep(400000);
    ASSERT_EQ(market_shard(&ha, 2, &va), 0);
    ASSERT_EQ(market_shard(&hb, 2, &vb), 0);
    ASSERT_EQ(va.wanted, 3u);
    ASSERT_EQ(vb.wanted, 3u);
    ASSERT_NEAR(va.demand, vb.demand, va.demand * 0.001);
    for (size_t i = 0; i < g_m->n_slabs; i++) {
        if (i == 2) continue;
        ASSERT_EQ(market_shard(&ha, i, &va), 0);
        ASSERT_EQ(market_shard(&hb, i, &vb), 0);
        ASSERT_EQ(va.wanted, 1u);
        ASSERT_EQ(vb.wanted, 1u);
    }
    ASSERT_EQ(hub_stop(&ha), 0);
    ASSERT_EQ(hub_stop(&hb), 0);
}

/* ---- the store's market table and demand budgets ---------------------------- */

static int collect_row(void *arg, const kv_mkt_row *r) {
    kv_mkt_row *out = arg;
    if (r->layer == out->layer && r->first == out->first) *out = *r;
    return 0;
}

/* Writes are conditional on the version read (of two hubs stepping one
 * state, one wins); a report's counter is refused when not above the last;
 * its tokens are held to the key's and the block's budgets per window. */
static void test_store_market_and_budgets(void) {
    char db[512];
    db_path(db, sizeof db, "store");
    kv_hub_store st;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_store_open(&st, db, &d), 0);
    kv_mkt_row r = {.layer = 3, .first = 8};
    r.s = (kv_mkt_state){.rate = 12.5, .wait = 1.25, .top_rate = 3.5, .rate_ms = 1700000000123, .wanted = 2,
                         .changed_ms = 1700000000000, .above_ms = 0, .below_ms = 1700000000100, .version = 1};
    memset(r.s.top_pk, 0xab, 32);
    ASSERT_EQ(st.ops->mkt_put(st.impl, &r, 0, &d), 0);
    ASSERT_EQ(st.ops->mkt_put(st.impl, &r, 0, &d), KV_EPROTO); /* another hub made it first */
    kv_mkt_row got = {.layer = 3, .first = 8};
    ASSERT_EQ(st.ops->mkt_each(st.impl, collect_row, &got, &d), 0);
    ASSERT_TRUE(got.s.rate == r.s.rate && got.s.wait == r.s.wait && got.s.top_rate == r.s.top_rate);
    ASSERT_TRUE(!memcmp(got.s.top_pk, r.s.top_pk, 32));
    ASSERT_EQ(got.s.rate_ms, r.s.rate_ms);
    ASSERT_EQ(got.s.wanted, r.s.wanted);
    ASSERT_EQ(got.s.changed_ms, r.s.changed_ms);
    ASSERT_EQ(got.s.above_ms, r.s.above_ms);
    ASSERT_EQ(got.s.below_ms, r.s.below_ms);
    ASSERT_EQ(got.s.version, r.s.version);
    r.s.version = 2;
    r.s.wanted = 3;
    ASSERT_EQ(st.ops->mkt_put(st.impl, &r, 1, &d), 0);
    r.s.wanted = 4;
    ASSERT_EQ(st.ops->mkt_put(st.impl, &r, 1, &d), KV_EPROTO); /* stale version */
    ASSERT_EQ(st.ops->mkt_each(st.impl, collect_row, &got, &d), 0);
    ASSERT_EQ(got.s.wanted, 3u);
    ASSERT_EQ(got.s.version, 2);
    const kv_demand_budget b = {.window_ms = 1000, .key_tokens = 100, .net_tokens = 150};
    uint8_t k1[32] = {1}, k2[32] = {2};
    uint64_t g = 0;
    const int64_t t = 1700000000000;
    ASSERT_EQ(st.ops->demand_charge(st.impl, k1, 10, "10.0.0.0/24", t, &b, 70, &g, &d), 0);
    ASSERT_EQ(g, 70u);
    ASSERT_EQ(st.ops->demand_charge(st.impl, k1, 10, "10.0.0.0/24", t, &b, 5, &g, &d), KV_EPROTO);
    ASSERT_EQ(st.ops->demand_charge(st.impl, k1, 11, "10.0.0.0/24", t + 1, &b, 70, &g, &d), 0);
    ASSERT_EQ(g, 30u); /* the key's 100 */
    ASSERT_EQ(st.ops->demand_charge(st.impl, k2, 5, "10.0.0.0/24", t + 2, &b, 100, &g, &d), 0);
    ASSERT_EQ(g, 50u); /* the block's 150 */
    ASSERT_EQ(st.ops->demand_charge(st.impl, k2, 6, "10.0.1.0/24", t + 3, &b, 100, &g, &d), 0);
    ASSERT_EQ(g, 50u); /* another block, the key's remaining 50 */
    ASSERT_EQ(st.ops->demand_charge(st.impl, k1, 12, "10.0.0.0/24", t + 1000, &b, 100, &g, &d), 0);
    ASSERT_EQ(g, 100u); /* a new window */
    kv_hub_store_close(&st);
    /* the state survives a reopen */
    ASSERT_EQ(kv_hub_store_open(&st, db, &d), 0);
    memset(&got.s, 0, sizeof got.s);
    ASSERT_EQ(st.ops->mkt_each(st.impl, collect_row, &got, &d), 0);
    ASSERT_EQ(got.s.wanted, 3u);
    ASSERT_TRUE(got.s.rate == 12.5);
    kv_hub_store_close(&st);
}

/* ---- real nodes following the market ----------------------------------------- */

/* `kvasir node` with a budget of `budget` bytes, its data in g_dir/name. */
static pid_t node_start(const hub_proc *p, const char *name, uint64_t budget) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "exec '%s' node --hub %s --budget %llu --data '%s/%s' --interval-ms 300 --threads 1 "
             ">'%s/%s.log' 2>&1", getenv("KV_BIN"), p->url, (unsigned long long)budget, g_dir, name, g_dir, name);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static void node_stop(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    for (int i = 0; i < 100; i++) {
        if (waitpid(pid, NULL, WNOHANG) == pid) return;
        usleep(50000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* The live count of every slab; false when the market cannot be read. */
static bool market_live(const hub_proc *p, uint32_t *live) {
    kv_hub_shard_view view[64];
    if (market_view(p, view)) return false;
    for (size_t i = 0; i < g_m->n_slabs; i++) live[i] = view[i].live;
    return true;
}

/* Two real nodes: one holds every shard, the other has room for one.
 * Demand on slab 0 raises its wanted count and the small node takes the
 * newly wanted replica (a wanted one beats the extra replica it held);
 * when the demand is gone and wanted falls back, one of the two gives its
 * replica of slab 0 up again, and no shard is ever left without one. */
static void test_nodes_follow_demand(void) {
    char db[512], extra[512], hex[65];
    db_path(db, sizeof db, "nodes");
    kv_node_key coord;
    test_key(&coord, 960);
    kv_hex(coord.pk, 32, hex);
    snprintf(extra, sizeof extra, "--wanted 1 --wanted-max 2 --vouch-key %s --demand-per-replica 50 "
             "--market-raise-ms 300 --market-hold-ms 2000 --demand-half-life-ms 400 --deadline-ms 3000", hex);
    hub_proc p;
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    const size_t ns = g_m->n_slabs;
    uint64_t all = 0, big = 0;
    for (size_t i = 0; i < ns; i++) {
        all += g_m->slabs[i].file.size;
        if (g_m->slabs[i].file.size > big) big = g_m->slabs[i].file.size;
    }
    pid_t n1 = node_start(&p, "n1", all + big / 2), n2 = -1;
    uint32_t live[64];
    double t0 = now_s();
    bool ok = false;
    while (!ok && now_s() - t0 < 30) {
        ok = market_live(&p, live);
        for (size_t i = 0; ok && i < ns; i++) ok = live[i] == 1;
        if (!ok) usleep(100000);
    }
    ASSERT_TRUE(ok);
    n2 = node_start(&p, "n2", big + big / 2);
    /* the small node fills its room with an extra replica of something */
    t0 = now_s();
    ok = false;
    while (!ok && now_s() - t0 < 30) {
        uint32_t sum = 0;
        if (market_live(&p, live))
            for (size_t i = 0; i < ns; i++) sum += live[i];
        ok = sum == ns + 1;
        if (!ok) usleep(100000);
    }
    ASSERT_TRUE(ok);
    /* demand on slab 0, kept up until the small node holds it */
    kv_hub_demand_shard sh = {g_m->slabs[0].layer, g_m->slabs[0].first, g_m->slabs[0].last, 2000, 0};
    kv_hub_demand rep = {1000, &sh, 1};
    kv_diag d = {0};
    t0 = now_s();
    ok = false;
    while (!ok && now_s() - t0 < 30) {
        ASSERT_EQ(kv_hub_report_demand(p.url, &coord, &rep, NULL, &d), 0);
        kv_hub_shard_view v;
        ok = !market_shard(&p, 0, &v) && v.wanted == 2 && v.live == 2;
        if (!ok) usleep(100000);
    }
    ASSERT_TRUE(ok);
    /* quiet: wanted falls back, one holder gives slab 0 up, no shard goes
     * uncovered meanwhile */
    t0 = now_s();
    ok = false;
    bool uncovered = false;
    while (!ok && now_s() - t0 < 30) {
        kv_hub_shard_view v;
        if (market_live(&p, live))
            for (size_t i = 0; i < ns; i++) uncovered |= live[i] == 0;
        ok = !market_shard(&p, 0, &v) && v.wanted == 1 && v.live == 1;
        if (!ok) usleep(100000);
    }
    ASSERT_TRUE(ok);
    ASSERT_TRUE(!uncovered);
    /* and it stays that way: nobody takes the extra replica back */
    usleep(1500000);
    kv_hub_shard_view v;
    ASSERT_EQ(market_shard(&p, 0, &v), 0);
    ASSERT_EQ(v.live, 1u);
    if (!ok || uncovered) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "tail -n 25 '%s/n1.log' '%s/n2.log' >&2", g_dir, g_dir);
        run_cmd(cmd);
    }
    node_stop(n1);
    node_stop(n2);
    ASSERT_EQ(hub_stop(&p), 0);
}

static const kvt_case cases[] = {
    KVT_CASE(test_zero_demand_is_fixed_market), KVT_CASE(test_scripted_series), KVT_CASE(test_share_cap),
    KVT_CASE(test_report_bound),                KVT_CASE(test_store_market_and_budgets),
    KVT_CASE(test_demand_raises_and_falls),     KVT_CASE(test_restart_keeps_market), KVT_CASE(test_liar),
    KVT_CASE(test_nodes_follow_demand),
};
static const kvt_case cases_pg[] = {KVT_CASE(test_two_hubs_demand)};

int main(int argc, char **argv) {
    static kvt_case all[KVT_N(cases) + KVT_N(cases_pg)];
    size_t n = 0;
    for (size_t i = 0; i < KVT_N(cases); i++) all[n++] = cases[i];
    if (getenv("KV_TEST_PG") && *getenv("KV_TEST_PG"))
        for (size_t i = 0; i < KVT_N(cases_pg); i++) all[n++] = cases_pg[i];
    return kvt_run_with(argc, argv, all, n, setup, teardown);
}
