/* kvasir xcheck: the backend matrix of one model. Samples experts of a
 * GGUF file (full model or slab), computes their FFNs for the same
 * deterministic hidden states on every backend this machine runs (the CPU
 * kernels: scalar, avx2, avxvnni, avx512, neon, neondot; OpenCL; and, with --arm,
 * the aarch64 build under qemu-user, whose outputs come back through files
 * of exactly the expected size), and prints cosine similarity and max
 * relative error (max |a-b| / max |a|) for every pair. Exit 3 when a pair
 * breaks its stated bound (docs/NUMERICS.md): every backend of this build
 * promises the scalar reference's bits, so the bound is identity. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "kvasir/arch.h"
#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/opencl.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"

#define CMD "xcheck"
#define KV_XC_MAX_BACKENDS 12
#define KV_XC_MAX_SAMPLES 64

static const char *const kv_value_flags[] = {"-m", "--model", "--experts", "--layers", "--tokens", "--seed",
                                             "--arm", "--dump", "--reps", NULL};
static const char *kv_xcheck_help =
    "usage: kvasir xcheck -m MODEL.gguf [--experts N] [--layers N] [--tokens T] [--seed S] [--arm BIN]\n"
    "                     [--json]\n"
    "  Computes sampled experts (N per layer, default 2, of the first --layers layers, default all)\n"
    "  for T deterministic hidden states (default 4) on every backend this machine runs and\n"
    "  prints cosine similarity and max relative error for each pair of backends.\n"
    "  --arm BIN   also run the aarch64 build BIN under qemu-aarch64 (its scalar, neon, neondot)\n"
    "  --dump P    (used by --arm) write each CPU backend's outputs to P.BACKEND.f32 and exit\n"
    "  --reps R    time the fastest of R runs per backend (default 1)\n"
    "  --json      one JSON object on stdout (expert_ms: wall time per sampled expert, per backend)\n"
    "Exit status 3 when a pair of backends differs beyond its stated bound (docs/NUMERICS.md).\n";

/* the GGUF as an expert source (views from kv_expert_find) */
static int kv_xc_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    uint32_t E, F;
    return kv_expert_find(ctx, layer, e, w, &E, &F, d);
}

static uint64_t kv_xc_rng;
static float kv_xc_gauss(void) {
    double s = 0;
    for (int i = 0; i < 4; i++) {
        kv_xc_rng ^= kv_xc_rng << 13;
        kv_xc_rng ^= kv_xc_rng >> 7;
        kv_xc_rng ^= kv_xc_rng << 17;
        s += (double)(kv_xc_rng >> 11) / 9007199254740992.0 - 0.5;
    }
    return (float)(s * 1.7);
}

typedef struct {
    char name[40];
    float *y;    /* [n_samples][T][E] */
    double ms;   /* wall time of one sample (one expert, T tokens), -1 if not timed here */
} kv_xc_be;

static double kv_xc_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Runs every sample through provider p into y. */
static int kv_xc_run(kv_expert_provider *p, const uint32_t (*samp)[2], uint32_t ns, uint32_t T, uint32_t E,
                     const float *x, float *y, kv_diag *d) {
    int32_t ids[64];
    for (uint32_t s = 0; s < ns; s++) {
        for (uint32_t t = 0; t < T; t++) ids[t] = (int32_t)samp[s][1];
        kv_expert_req rq = {samp[s][0], T, E, 1, x + (size_t)s * T * E, ids, NULL};
        int rc = p->compute(p->impl, &rq, y + (size_t)s * T * E, d);
        if (rc) return rc;
    }
    return 0;
}

int kv_cmd_xcheck(int argc, char **argv) {
    const char *model = NULL, *arm = NULL, *dump = NULL;
    long n_exp = 2, n_lay = 0, T = 4, seed = 1, reps = 1;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_xcheck_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
            continue;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model = v;
        } else if (!strcmp(a, "--experts")) {
            if (kv_arg_long(CMD, a, v, 1, 16, &n_exp)) return 1;
        } else if (!strcmp(a, "--layers")) {
            if (kv_arg_long(CMD, a, v, 1, KV_MAX_LAYERS, &n_lay)) return 1;
        } else if (!strcmp(a, "--tokens")) {
            if (kv_arg_long(CMD, a, v, 1, 64, &T)) return 1;
        } else if (!strcmp(a, "--seed")) {
            if (kv_arg_long(CMD, a, v, 1, 1L << 30, &seed)) return 1;
        } else if (!strcmp(a, "--reps")) {
            if (kv_arg_long(CMD, a, v, 1, 100, &reps)) return 1;
        } else if (!strcmp(a, "--arm")) {
            arm = v;
        } else if (!strcmp(a, "--dump")) {
            dump = v;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir xcheck --help)", a);
        }
    }
    if (!model) return kv_cli_err(CMD, 1, "needs -m MODEL.gguf (see kvasir xcheck --help)");
    if (dump && strlen(dump) > 3000) return kv_cli_err(CMD, 1, "--dump: path too long");
    int rc = 2;
    kv_diag d = {0};
    kv_gguf *g = NULL;
    kv_pool *pool = NULL;
    float *x = NULL;
    kv_xc_be be[KV_XC_MAX_BACKENDS];
    int nb = 0;
    if (kv_gguf_open(&g, model, &d)) return kv_cli_diag(CMD, &d);
    /* the model's MoE layers and expert count, from its tensors */
    kv_expert_weights w;
    uint32_t E = 0, F = 0, n_layer = 0, n_expert = 0, samp[KV_XC_MAX_SAMPLES][2], ns = 0;
    for (uint32_t L = 0; L < KV_MAX_LAYERS; L++) {
        kv_diag e = {0};
        if (kv_expert_find(g, L, 0, &w, &E, &F, &e)) continue;
        n_layer = L + 1;
    }
    for (uint32_t e = 0; n_layer && e < KV_MAX_EXPERTS; e++) {
        kv_diag e2 = {0};
        uint32_t L0 = 0;
        while (L0 < n_layer && kv_expert_find(g, L0, 0, &w, &E, &F, &e2)) L0++;
        if (kv_expert_find(g, L0, e, &w, &E, &F, &e2)) break;
        n_expert = e + 1;
    }
    if (!n_layer || !n_expert) {
        rc = kv_cli_err(CMD, 2, "'%s' holds no routed experts", model);
        goto done;
    }
    /* samples: n_exp experts of each layer, spread over the ids */
    for (uint32_t L = 0; L < n_layer && (!n_lay || L < (uint32_t)n_lay); L++) {
        kv_diag e = {0};
        if (kv_expert_find(g, L, 0, &w, &E, &F, &e)) continue;
        for (long k = 0; k < n_exp && ns < KV_XC_MAX_SAMPLES; k++) {
            uint32_t ex = (uint32_t)((L * 5 + (uint32_t)k * (n_expert / (uint32_t)n_exp + 1)) % n_expert);
            samp[ns][0] = L;
            samp[ns][1] = ex;
            ns++;
        }
    }
    const size_t n = (size_t)ns * (size_t)T * E;
    x = malloc(n * sizeof(float));
    if (!x) {
        rc = kv_cli_err(CMD, 2, "out of memory");
        goto done;
    }
    kv_xc_rng = 88172645463325252ull ^ (uint64_t)seed;
    for (size_t i = 0; i < n; i++) x[i] = kv_xc_gauss();
    if (kv_pool_new(&pool, 1, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    kv_expert_source src = {g, kv_xc_acquire, NULL, n_layer, n_expert, E, F, 1};
    /* the CPU backends this machine runs */
    const char *cpu[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const char *prev = kv_quant_backend();
    for (size_t k = 0; k < sizeof cpu / sizeof cpu[0]; k++) {
        if (kv_quant_set_backend(cpu[k])) continue;
        kv_expert_provider p;
        if (kv_expert_local_new_src(&p, &src, pool, (uint32_t)T, &d)) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        be[nb].y = malloc(n * sizeof(float));
        snprintf(be[nb].name, sizeof be[nb].name, "%s", cpu[k]);
        int r = be[nb].y ? 0 : kv_fail(&d, KV_ENOMEM, "out of memory");
        be[nb].ms = -1;
        for (long k = 0; k < reps && !r; k++) { /* the fastest of --reps runs (the first faults pages in) */
            const double t0 = kv_xc_now_ms();
            r = kv_xc_run(&p, (const uint32_t (*)[2])samp, ns, (uint32_t)T, E, x, be[nb].y, &d);
            const double ms = (kv_xc_now_ms() - t0) / ns;
            if (be[nb].ms < 0 || ms < be[nb].ms) be[nb].ms = ms;
        }
        p.free(p.impl);
        nb++;
        if (r) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
    }
    kv_quant_set_backend(prev);
    if (dump) { /* the parent of an --arm run reads these */
        for (int b = 0; b < nb; b++) {
            char path[3100];
            snprintf(path, sizeof path, "%s.%s.f32", dump, be[b].name);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(be[b].y, sizeof(float), n, f) != n || fclose(f)) {
                rc = kv_cli_err(CMD, 2, "cannot write '%s'", path);
                goto done;
            }
        }
        rc = 0;
        goto done;
    }
    char dev[256];
    if (kv_opencl_available(dev, sizeof dev)) {
        kv_expert_provider p;
        if (kv_opencl_expert_new(&p, &src, (uint32_t)T, &d)) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        be[nb].y = malloc(n * sizeof(float));
        snprintf(be[nb].name, sizeof be[nb].name, "opencl");
        int r = be[nb].y ? 0 : kv_fail(&d, KV_ENOMEM, "out of memory");
        be[nb].ms = -1;
        for (long k = 0; k < reps && !r; k++) { /* the fastest of --reps runs (the first faults pages in) */
            const double t0 = kv_xc_now_ms();
            r = kv_xc_run(&p, (const uint32_t (*)[2])samp, ns, (uint32_t)T, E, x, be[nb].y, &d);
            const double ms = (kv_xc_now_ms() - t0) / ns;
            if (be[nb].ms < 0 || ms < be[nb].ms) be[nb].ms = ms;
        }
        p.free(p.impl);
        nb++;
        if (r) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
    }
    if (arm) { /* the aarch64 binary under qemu writes its backends' outputs */
        char tmpl[] = "/tmp/kvasir-xcheck.XXXXXX";
        if (!mkdtemp(tmpl)) {
            rc = kv_cli_err(CMD, 2, "cannot make a temporary folder");
            goto done;
        }
        char prefix[64], se[24], sl[24], st[24], ss[24];
        snprintf(prefix, sizeof prefix, "%s/out", tmpl);
        snprintf(se, sizeof se, "%ld", n_exp);
        snprintf(sl, sizeof sl, "%ld", n_lay ? n_lay : (long)KV_MAX_LAYERS);
        snprintf(st, sizeof st, "%ld", T);
        snprintf(ss, sizeof ss, "%ld", seed);
        pid_t pid = fork();
        if (pid == 0) {
            /* -L /: the multiarch loader and its own libc, whatever prefix the
             * environment names (cmake/aarch64.cmake says why) */
            char *args[] = {"qemu-aarch64", "-L", "/", (char *)arm, "xcheck", "-m", (char *)model, "--experts", se,
                            "--layers", sl, "--tokens", st, "--seed", ss, "--dump", prefix, NULL};
            execvp(args[0], args);
            _exit(127);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status)) {
            rc = kv_cli_err(CMD, 2, "--arm: '%s' under qemu-aarch64 failed (status %d)", arm, status);
            goto done;
        }
        const char *names[] = {"scalar", "neon", "neondot"};
        for (int k = 0; k < 3 && nb < KV_XC_MAX_BACKENDS; k++) {
            char path[160];
            snprintf(path, sizeof path, "%s.%s.f32", prefix, names[k]);
            struct stat sb;
            if (stat(path, &sb)) continue; /* a backend that CPU model lacks */
            FILE *f = fopen(path, "rb");
            be[nb].y = malloc(n * sizeof(float));
            snprintf(be[nb].name, sizeof be[nb].name, "aarch64:%s", names[k]);
            be[nb].ms = -1;
            nb++;
            bool ok = f && be[nb - 1].y && (uint64_t)sb.st_size == n * sizeof(float) &&
                      fread(be[nb - 1].y, sizeof(float), n, f) == n;
            if (f) fclose(f);
            unlink(path);
            for (size_t i = 0; ok && i < n; i++) ok = isfinite(be[nb - 1].y[i]);
            if (!ok) {
                rc = kv_cli_err(CMD, 2, "--arm: '%s' is not %zu finite floats", path, n);
                goto done;
            }
        }
        rmdir(tmpl);
    }
    /* every pair: cosine and max relative error; identity is the bound */
    int broken = 0;
    if (json) {
        json_t *jm = json_string(model); /* NULL for a path that is not UTF-8 */
        char *ms = jm ? json_dumps(jm, JSON_ENCODE_ANY) : NULL;
        printf("{\"model\":%s", ms ? ms : "null");
        free(ms);
        json_decref(jm);
        printf(",\"samples\":%u,\"tokens\":%ld,\"n_embd\":%u,\"n_ff\":%u,\"backends\":[", ns, T, E, F);
        for (int b = 0; b < nb; b++) printf("%s\"%s\"", b ? "," : "", be[b].name);
        printf("],\"expert_ms\":{");
        for (int b = 0, k = 0; b < nb; b++)
            if (be[b].ms >= 0) printf("%s\"%s\":%.4f", k++ ? "," : "", be[b].name, be[b].ms);
        printf("},\"pairs\":[");
    } else {
        printf("kvasir xcheck: %u experts x %ld tokens (n_embd %u, n_ff %u) on %d backends\n", ns, T, E, F, nb);
        for (int b = 0; b < nb; b++)
            if (be[b].ms >= 0) printf("  %-16s %.3f ms per expert (%ld tokens)\n", be[b].name, be[b].ms, T);
        printf("%-18s %-18s %14s %14s %10s\n", "a", "b", "cosine", "max rel err", "identical");
    }
    int np = 0;
    for (int a = 0; a < nb; a++)
        for (int b = a + 1; b < nb; b++) {
            double dot = 0, na = 0, nbb = 0, amax = 0, emax = 0;
            bool same = true;
            for (size_t i = 0; i < n; i++) {
                const double u = be[a].y[i], v = be[b].y[i];
                dot += u * v;
                na += u * u;
                nbb += v * v;
                if (fabs(u) > amax) amax = fabs(u);
                if (fabs(u - v) > emax) emax = fabs(u - v);
                if (memcmp(&be[a].y[i], &be[b].y[i], 4)) same = false;
            }
            const double cs = na > 0 && nbb > 0 ? dot / sqrt(na * nbb) : (na == nbb ? 1.0 : 0.0);
            const double rel = amax > 0 ? emax / amax : emax;
            if (!same) broken++;
            if (json)
                printf("%s{\"a\":\"%s\",\"b\":\"%s\",\"cosine\":%.12f,\"max_rel_err\":%.6g,\"identical\":%s}",
                       np ? "," : "", be[a].name, be[b].name, cs, rel, same ? "true" : "false");
            else
                printf("%-18s %-18s %14.10f %14.3g %10s\n", be[a].name, be[b].name, cs, rel, same ? "yes" : "NO");
            np++;
        }
    if (json) printf("],\"within_bounds\":%s}\n", broken ? "false" : "true");
    rc = broken ? kv_cli_err(CMD, 3, "%d backend pair(s) differ beyond their bound (identical bits)", broken) : 0;
done:
    for (int b = 0; b < nb; b++) free(be[b].y);
    free(x);
    kv_pool_free(pool);
    kv_gguf_close(g);
    return rc;
}
