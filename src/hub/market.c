/* The coverage market's policy: demand rates, wanted replicas with
 * hysteresis, the reward and the market's order. The rules are stated in
 * market.h; the hub (server.c) keeps one kv_mkt_state per shard in its store
 * and calls these functions under its lock. */
#include <math.h>
#include <string.h>

#include "hub/market.h"
#include "kvasir/pieces.h"

void kv_mkt_policy_default(kv_mkt_policy *p, uint32_t floor, uint64_t reward_base) {
    *p = (kv_mkt_policy){
        .floor = floor,
        .ceiling = floor,
        .per_replica = 2000.0,
        .high = 1.0,
        .low = 0.5,
        .raise_ms = 10000,
        .hold_ms = 120000,
        .half_life_ms = 60000,
        .share = 0.5,
        .reward_base = reward_base,
    };
}

int kv_mkt_policy_check(const kv_mkt_policy *p, kv_diag *d) {
    if (p->floor < 1 || p->floor > KV_MKT_MAX_WANTED)
        return kv_fail(d, KV_EINVAL, "market: --wanted %u must be 1..%u", p->floor, KV_MKT_MAX_WANTED);
    if (p->ceiling < p->floor || p->ceiling > KV_MKT_MAX_WANTED)
        return kv_fail(d, KV_EINVAL, "market: --wanted-max %u must be in [--wanted %u, %u]", p->ceiling, p->floor,
                       KV_MKT_MAX_WANTED);
    if (!(p->per_replica > 0 && p->per_replica <= KV_MKT_MAX_RATE))
        return kv_fail(d, KV_EINVAL, "market: --demand-per-replica %g must be in (0, %g]", p->per_replica,
                       KV_MKT_MAX_RATE);
    if (!(p->low > 0 && p->low < p->high && p->high <= 100))
        return kv_fail(d, KV_EINVAL, "market: watermarks need 0 < low (%g) < high (%g) <= 100", p->low, p->high);
    if (!p->half_life_ms) return kv_fail(d, KV_EINVAL, "market: --demand-half-life-ms must be > 0");
    if (!(p->share > 0 && p->share <= 1))
        return kv_fail(d, KV_EINVAL, "market: --demand-share %g must be in (0, 1]", p->share);
    return 0;
}

void kv_mkt_state_init(const kv_mkt_policy *p, kv_mkt_state *s) {
    memset(s, 0, sizeof *s);
    s->wanted = p->floor;
}

/* 2^(-(now - at) / half_life); 1 when now is not after at */
static double kv_mkt_decay(const kv_mkt_policy *p, int64_t at, int64_t now) {
    if (now <= at) return 1.0;
    return exp2(-(double)(now - at) / (double)p->half_life_ms);
}

double kv_mkt_rate(const kv_mkt_policy *p, const kv_mkt_state *s, int64_t now) {
    return s->rate * kv_mkt_decay(p, s->rate_ms, now);
}

double kv_mkt_wait(const kv_mkt_policy *p, const kv_mkt_state *s, int64_t now) {
    return s->wait * kv_mkt_decay(p, s->rate_ms, now);
}

double kv_mkt_driving_rate(const kv_mkt_policy *p, const kv_mkt_state *s, int64_t now) {
    const double k = kv_mkt_decay(p, s->rate_ms, now), r = s->rate * k;
    if (p->share >= 1) return r;
    double other = r - s->top_rate * k;
    if (other < 0) other = 0;
    const double cap = other / (1 - p->share);
    return cap < r ? cap : r;
}

void kv_mkt_add(const kv_mkt_policy *p, kv_mkt_state *s, int64_t now, double computations, double wait_ms,
                const uint8_t pk[32]) {
    if (now < s->rate_ms) now = s->rate_ms;
    const double k = kv_mkt_decay(p, s->rate_ms, now), unit = log(2.0) * 1000.0 / (double)p->half_life_ms;
    const double c = computations * unit;
    s->rate = s->rate * k + c;
    s->wait = s->wait * k + wait_ms * unit;
    s->top_rate *= k;
    if (s->rate > KV_MKT_MAX_RATE) s->rate = KV_MKT_MAX_RATE;
    if (s->wait > KV_MKT_MAX_RATE) s->wait = KV_MKT_MAX_RATE;
    s->rate_ms = now;
    if (pk) {
        if (!memcmp(s->top_pk, pk, 32)) {
            s->top_rate += c;
        } else if (c > s->top_rate) { /* a larger single contribution takes the slot */
            memcpy(s->top_pk, pk, 32);
            s->top_rate = c;
        }
    }
    if (s->top_rate > s->rate) s->top_rate = s->rate;
}

bool kv_mkt_step(const kv_mkt_policy *p, kv_mkt_state *s, int64_t now) {
    const kv_mkt_state was = *s;
    if (s->wanted < p->floor) s->wanted = p->floor;
    if (s->wanted > p->ceiling) s->wanted = p->ceiling;
    const double r = kv_mkt_driving_rate(p, s, now), per = p->per_replica;
    /* raise */
    if (s->wanted < p->ceiling && r > p->high * per * s->wanted) {
        if (!s->above_ms) s->above_ms = now;
        if (now - s->above_ms >= (int64_t)p->raise_ms) {
            s->wanted++;
            s->changed_ms = now;
            s->above_ms = 0;
            s->below_ms = 0;
        }
    } else {
        s->above_ms = 0;
    }
    /* lower */
    if (s->wanted > p->floor && r < p->low * per * (s->wanted - 1)) {
        if (!s->below_ms) s->below_ms = now;
        if (now - s->below_ms >= (int64_t)p->hold_ms && now - s->changed_ms >= (int64_t)p->hold_ms) {
            s->wanted--;
            s->changed_ms = now;
            s->below_ms = 0;
        }
    } else {
        s->below_ms = 0;
    }
    return s->wanted != was.wanted || s->above_ms != was.above_ms || s->below_ms != was.below_ms ||
           s->changed_ms != was.changed_ms;
}

uint64_t kv_mkt_reward(const kv_mkt_policy *p, uint32_t wanted, uint32_t live, double rate) {
    const uint64_t base = p->reward_base;
    double u = rate > 0 ? rate / (p->per_replica * (live ? live : 1)) : 0;
    if (!(u > 0)) return base * wanted / ((uint64_t)live + 1); /* the fixed market's, exactly */
    if (u > 1) u = 1;
    const long double v = (long double)base * wanted / ((long double)live + 1) * (1 + (long double)u);
    return v >= (long double)UINT64_MAX ? UINT64_MAX : (uint64_t)v;
}

int kv_mkt_cmp(const void *a, const void *b) {
    const kv_mkt_sort *x = a, *y = b;
    uint64_t l = (uint64_t)x->live * y->wanted, r = (uint64_t)y->live * x->wanted;
    if (l != r) return l < r ? -1 : 1;
    int64_t dx = (int64_t)x->wanted - x->live, dy = (int64_t)y->wanted - y->live;
    if (dx != dy) return dx > dy ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

double kv_mkt_keep_held(size_t n_slabs, const uint32_t *held, size_t n_held, double *acc, double *wait_ms) {
    double total = 0;
    size_t j = 0;
    for (size_t i = 0; i < n_slabs; i++) {
        while (j < n_held && held[j] < i) j++;
        if (j < n_held && held[j] == i) {
            total += acc[i];
        } else {
            acc[i] = 0;
            wait_ms[i] = 0;
        }
    }
    return total;
}

int kv_mkt_bound(const kv_manifest *m, const kv_hub_demand *r, uint64_t granted, double *acc, double *wait_ms,
                 double *total, kv_diag *d) {
    *total = 0;
    for (size_t k = 0; k < r->n_shards; k++) {
        const kv_hub_demand_shard *e = &r->shards[k];
        if (!kv_manifest_find_slab(m, e->layer, e->first, e->last))
            return kv_fail(d, KV_EINVAL, "demand report: shards[%zu] (layer %u, experts %u-%u) is not a shard of "
                           "this model", k, e->layer, e->first, e->last);
    }
    const uint32_t used = m->n_expert_used;
    for (size_t k = 0; k < r->n_shards; k++) {
        const kv_hub_demand_shard *e = &r->shards[k];
        const size_t i = (size_t)(kv_manifest_find_slab(m, e->layer, e->first, e->last) - m->slabs);
        const uint32_t width = e->last - e->first + 1, per = used && used < width ? used : width;
        const double cap = (double)granted * per, v = (double)e->computations;
        acc[i] += v < cap ? v : cap;
        wait_ms[i] += (double)e->wait_us / 1000.0;
    }
    const double layer_cap = (double)granted * used;
    for (size_t a = 0; a < m->n_slabs;) { /* manifest order: a layer's slabs are consecutive */
        size_t z = a;
        double sum = 0;
        while (z < m->n_slabs && m->slabs[z].layer == m->slabs[a].layer) sum += acc[z++];
        for (size_t i = a; i < z; i++) {
            if (used && sum > layer_cap) acc[i] *= layer_cap / sum;
            if (wait_ms[i] > acc[i] * 1000.0) wait_ms[i] = acc[i] * 1000.0;
            *total += acc[i];
        }
        a = z;
    }
    return 0;
}
