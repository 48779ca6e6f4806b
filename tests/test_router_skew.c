/* gen-model --router-skew: synthetic routers with hot experts.
 *
 * kv-test-labels: unit
 *
 * - Skew S changes only the routers (blk.N.ffn_gate_inp.weight): every other
 *   tensor is byte-identical to the skew-0 file of the same seed.
 * - Each router row is the skew-0 row times one constant (the same per-row
 *   random stream, a larger spread), and the constants of a layer are, as a
 *   multiset, exactly {1 + S/(1+r) : r = 0..n_expert-1} (the documented rule,
 *   recomputed here).
 * - The effect, computed independently in f64: top-k over W x for random
 *   unit-RMS inputs x picks the hottest expert far more often than the mean
 *   with skew, and about evenly without.
 * - The CLI bounds the flag. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "kvasir/gen.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvtest.h"

#define N_EXPERT 16u
#define N_USED 2u
#define SKEW 3.0f

static char tmpdir[256], p0[400], ps[400];

static kv_gen_config cfg(void) {
    kv_gen_config c;
    kv_diag d = {0};
    if (kv_gen_preset_get("tiny", &c, &d)) abort();
    c.n_vocab = 512;
    c.n_expert = N_EXPERT;
    c.n_expert_used = N_USED;
    c.n_threads = 2;
    c.log = NULL;
    return c;
}

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = n > 0 ? malloc((size_t)n) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *len = b ? (size_t)n : 0;
    return b;
}

static int is_router(const char *name) {
    const char *p = strstr(name, ".ffn_gate_inp.weight");
    return p && p[strlen(".ffn_gate_inp.weight")] == 0;
}

static int cmp_f64(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* hottest expert's share of top-k picks over the mean share, for n random
 * gaussian inputs (f64, an xorshift stream independent of the generator's) */
static double hot_ratio(const float *w, uint32_t n_embd, int n) {
    uint64_t s = 0x9e3779b97f4a7c15ull;
    double *x = malloc(n_embd * sizeof *x), cnt[N_EXPERT] = {0};
    if (!x) return 0;
    for (int t = 0; t < n; t++) {
        for (uint32_t i = 0; i < n_embd; i++) { /* Box-Muller */
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            double u1 = ((double)(s >> 11) + 0.5) / 9007199254740992.0;
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            double u2 = (double)(s >> 11) / 9007199254740992.0;
            x[i] = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        }
        double l[N_EXPERT];
        for (uint32_t e = 0; e < N_EXPERT; e++) {
            double a = 0;
            for (uint32_t i = 0; i < n_embd; i++) a += (double)w[(size_t)e * n_embd + i] * x[i];
            l[e] = a;
        }
        for (uint32_t k = 0; k < N_USED; k++) {
            uint32_t best = 0;
            for (uint32_t e = 1; e < N_EXPERT; e++)
                if (l[e] > l[best]) best = e;
            cnt[best] += 1;
            l[best] = -INFINITY;
        }
    }
    free(x);
    double mx = 0;
    for (uint32_t e = 0; e < N_EXPERT; e++) mx = cnt[e] > mx ? cnt[e] : mx;
    return mx / ((double)n * N_USED / N_EXPERT);
}

static void test_skew(void) {
    kv_diag d = {0};
    kv_gen_config c = cfg();
    ASSERT_EQ(kv_gen_model(&c, p0, &d), 0);
    kv_gen_config cs = c;
    cs.router_skew = SKEW;
    int rc = kv_gen_model(&cs, ps, &d);
    if (rc) KVT_FAIL("gen: %s", d.msg);
    kv_gguf *g0 = NULL, *gs = NULL;
    ASSERT_EQ(kv_gguf_open(&g0, p0, &d), 0);
    ASSERT_EQ(kv_gguf_open(&gs, ps, &d), 0);
    if (!g0 || !gs) goto out;
    uint64_t nt = kv_gguf_n_tensors(g0);
    ASSERT_EQ(nt, kv_gguf_n_tensors(gs));
    int routers = 0;
    for (uint64_t k = 0; k < nt; k++) {
        const kv_gguf_tensor *a = kv_gguf_tensor_at(g0, k);
        char name[KV_GGUF_MAX_TENSOR_NAME + 1];
        snprintf(name, sizeof name, "%.*s", (int)a->name.len, a->name.ptr);
        const kv_gguf_tensor *b = kv_gguf_find_tensor(gs, name);
        ASSERT_TRUE(b && b->nbytes == a->nbytes && b->type == a->type);
        if (!b || b->nbytes != a->nbytes) continue;
        if (!is_router(name)) {
            if (memcmp(a->data, b->data, a->nbytes)) KVT_FAIL("%s changed with the router skew", name);
            continue;
        }
        routers++;
        ASSERT_EQ(a->type, KV_TYPE_F32);
        const float *wa = a->data, *wb = b->data;
        uint32_t n_embd = (uint32_t)a->ne[0];
        ASSERT_EQ(a->ne[1], N_EXPERT);
        double got[N_EXPERT], want[N_EXPERT];
        for (uint32_t e = 0; e < N_EXPERT; e++) {
            /* one constant per row: the least-squares ratio, then every
             * element checked against it */
            double num = 0, den = 0;
            for (uint32_t i = 0; i < n_embd; i++) {
                num += (double)wa[(size_t)e * n_embd + i] * wb[(size_t)e * n_embd + i];
                den += (double)wa[(size_t)e * n_embd + i] * wa[(size_t)e * n_embd + i];
            }
            got[e] = num / den;
            double worst = 0;
            for (uint32_t i = 0; i < n_embd; i++) {
                double ai = wa[(size_t)e * n_embd + i], bi = wb[(size_t)e * n_embd + i];
                double err = fabs(bi - got[e] * ai) / (fabs(got[e] * ai) + 1e-6);
                worst = err > worst ? err : worst;
            }
            if (worst > 1e-5) KVT_FAIL("%s row %u: not a scaled copy (rel err %g)", name, e, worst);
            want[e] = 1.0 + SKEW / (1.0 + e);
        }
        qsort(got, N_EXPERT, sizeof got[0], cmp_f64);
        qsort(want, N_EXPERT, sizeof want[0], cmp_f64);
        for (uint32_t e = 0; e < N_EXPERT; e++)
            if (fabs(got[e] - want[e]) > 1e-5 * want[e])
                KVT_FAIL("%s: gain #%u is %.7f, want %.7f", name, e, got[e], want[e]);
        if (routers == 1) {
            double r0 = hot_ratio(wa, n_embd, 3000), rs = hot_ratio(wb, n_embd, 3000);
            printf("hottest expert's load over the mean: %.2f without skew, %.2f with skew %g\n", r0, rs,
                   (double)SKEW);
            ASSERT_TRUE(r0 < 1.3);
            ASSERT_TRUE(rs > 2.0);
        }
    }
    ASSERT_EQ(routers, (int)c.n_layer);
out:
    kv_gguf_close(g0);
    kv_gguf_close(gs);
}

static int gen_cli(const char *extra) {
    const char *bin = getenv("KV_BIN");
    if (!bin) return -1;
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "%s gen-model --out %s/cli.gguf --vocab 512 %s 2>%s/err.txt >/dev/null", bin,
             tmpdir, extra, tmpdir);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_cli(void) {
    if (!getenv("KV_BIN")) {
        KVT_FAIL("KV_BIN is not set (ctest sets it to the kvasir binary)");
        return;
    }
    ASSERT_EQ(gen_cli("--router-skew 17"), 1);
    ASSERT_EQ(gen_cli("--router-skew -1"), 1);
    ASSERT_EQ(gen_cli("--router-skew hot"), 1);
    ASSERT_EQ(gen_cli("--router-skew"), 1);
    char ef[400];
    snprintf(ef, sizeof ef, "%s/err.txt", tmpdir);
    size_t n = 0;
    uint8_t *e = slurp(ef, &n);
    ASSERT_TRUE(e != NULL); /* the last error names the flag */
    if (e) {
        e[n - 1] = 0;
        ASSERT_TRUE(strstr((char *)e, "--router-skew") != NULL);
    }
    free(e);
    ASSERT_EQ(gen_cli("--experts 16 --experts-used 2 --router-skew 2.5"), 0);
}

static const kvt_case cases[] = {KVT_CASE(test_skew), KVT_CASE(test_cli)};

static int setup(void) {
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kv_test_skew_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir)) return 1;
    snprintf(p0, sizeof p0, "%s/zero.gguf", tmpdir);
    snprintf(ps, sizeof ps, "%s/skew.gguf", tmpdir);
    return 0;
}

static void teardown(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmpdir);
}

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
