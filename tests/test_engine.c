/* kv-test-labels: unit net */
/* The engine and its sessions (src/engine/engine.c) against an independent
 * reference: each session run alone through the plain kv_state path (its
 * own single-sequence state, kv_state_eval for the prompt and every token,
 * its own sampler with the same parameters), from the full model file.
 *
 *   - mixes: sessions joining at different steps, with prompts longer than
 *     the step's prompt budget (chunked prefill beside other sessions'
 *     decodes), greedy and seeded sampling, one leaving early: every
 *     session's tokens and the logits of every token byte-identical to the
 *     reference; for qwen3moe and qwen35moe, in-process, from slabs, and
 *     through worker processes (`kvasir worker`);
 *   - F16 KV cache: identical across the three placements and to a
 *     single-sequence F16 reference, close to F32;
 *   - KV memory: blocks follow the tokens held, only attending layers have
 *     a cache; a session that cannot get blocks fails alone with a clear
 *     error while the others stay exact;
 *   - non-finite values (an expert provider answering NaN, Inf or 3e38; a
 *     model with a NaN norm weight, F32 or Q8_0, greedy or sampled, also
 *     through `kvasir run`): the session fails with KV_ERANGE naming
 *     session and step, never a crash or a token;
 *   - API errors and stop conditions. */
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "kvtest.h"
#include "test_auth_support.h"
#include "quant/vec.h"

#define MAX_GEN 12

static char g_dir[200];
static const char *g_bin;

/* ---- fixtures: a generated model per architecture, sliced ----------------- */

typedef struct fixture {
    const char *arch;
    char model[300];      /* the full file */
    char slices[300];     /* DIR/manifest.json with every slab */
    char coord[300];      /* DIR/manifest.json with the backbone only */
    char group[2][4096];  /* slab files of each half of the experts */
    kv_model *m;
    uint32_t n_vocab;
    bool ok;
} fixture;

static fixture g_fx[2];

static int run_cmd(const char *cmd) { return system(cmd); }

static bool fixture_make(fixture *f, const char *arch) {
    kv_diag d = {0};
    kv_gen_config c;
    f->arch = arch;
    char dir[240];
    snprintf(dir, sizeof dir, "%s/%.20s", g_dir, arch);
    mkdir(dir, 0755);
    if (!strcmp(arch, "qwen3moe")) {
        if (kv_gen_preset_get("tiny", &c, &d)) return false;
        c.n_layer = 3; c.n_embd = 128; c.n_ff_exp = 64; c.n_expert = 8; c.n_expert_used = 3;
        c.n_head = 4; c.n_head_kv = 2; c.head_dim = 32; c.n_vocab = 512; c.type = KV_TYPE_Q8_0;
        c.n_ctx = 256; c.seed = 21;
    } else {
        c = (kv_gen_config){.arch = "qwen35moe", .n_layer = 4, .n_embd = 128, .n_ff_exp = 64, .n_expert = 8,
                            .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 32, .n_vocab = 600,
                            .n_ctx = 256, .type = KV_TYPE_F32, .seed = 5, .full_attn_interval = 2,
                            .ssm_d_state = 16, .ssm_n_group = 2, .ssm_dt_rank = 6, .n_rot = 12,
                            .rope_sections = {2, 1, 2, 1}, .n_nextn = 1, .n_ff_shexp = 48};
        kv_gen_fill_defaults(&c);
    }
    c.n_threads = 1;
    c.log = NULL;
    snprintf(f->model, sizeof f->model, "%s/m.gguf", dir);
    if (kv_gen_model(&c, f->model, &d)) {
        fprintf(stderr, "gen %s: %s\n", arch, d.msg);
        return false;
    }
    char sl[260], co[260], cmd[1400];
    snprintf(sl, sizeof sl, "%s/sl", dir);
    snprintf(co, sizeof co, "%s/coord", dir);
    const kv_slice_opts so = {c.n_expert / 2, -1, -1, 1};
    if (kv_slice_model(f->model, sl, &so, NULL, &d)) {
        fprintf(stderr, "slice %s: %s\n", arch, d.msg);
        return false;
    }
    mkdir(co, 0755);
    snprintf(cmd, sizeof cmd, "cp '%s/backbone.gguf' '%s/manifest.json' '%s/'", sl, sl, co);
    if (run_cmd(cmd)) return false;
    snprintf(f->slices, sizeof f->slices, "%s/manifest.json", sl);
    snprintf(f->coord, sizeof f->coord, "%s/manifest.json", co);
    if (kv_model_load(&f->m, f->model, &d)) return false;
    const kv_hparams *hp = kv_model_hparams(f->m);
    f->n_vocab = hp->n_vocab;
    const uint32_t half = hp->n_expert / 2;
    for (int g = 0; g < 2; g++) {
        size_t o = 0;
        for (uint32_t l = 0; l < hp->n_layer; l++)
            o += (size_t)snprintf(f->group[g] + o, sizeof f->group[g] - o, "%s%s/experts/blk.%u.%04u-%04u.gguf",
                                  l ? "," : "", sl, l, half * g, half * g + half - 1);
    }
    f->ok = true;
    return true;
}

/* ---- workers ----------------------------------------------------------------- */

typedef struct proc {
    pid_t pid;
    char addr[32];
} proc;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

static uint16_t free_port(void) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &l)) return 0;
    close(fd);
    return ntohs(a.sin_port);
}

static bool worker_start(proc *p, const char *slabs) {
    const uint16_t port = free_port();
    if (!port) return false;
    snprintf(p->addr, sizeof p->addr, "127.0.0.1:%u", port);
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen("/dev/null", "w", stdout);
        (void)f;
        execl(g_bin, g_bin, "worker", "--slabs", slabs, "--listen", p->addr, "--threads", "1", "--quiet", "--allow-key",
              kvt_coord_hex(), (char *)NULL);
        _exit(127);
    }
    p->pid = pid;
    for (int i = 0; i < 250; i++) {
        int fd = -1;
        if (!kv_link_connect(p->addr, 200, &fd, NULL)) {
            close(fd);
            return true;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) break;
        sleep_ms(20);
    }
    return false;
}

static void worker_stop(proc *p) {
    if (p->pid <= 0) return;
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

/* ---- the reference: one session alone on the plain kv_state path ---------- */

typedef struct spec {
    int join;             /* step before which it is created */
    int leave;            /* step before which it is freed (-1: runs to the end) */
    uint32_t n_prompt;
    uint32_t prompt_seed;
    float temp;           /* 0: greedy */
    uint64_t seed;
    uint32_t max_tokens;
} spec;

typedef struct result {
    int32_t tok[MAX_GEN];
    float *logits;        /* [MAX_GEN][n_vocab] */
    uint32_t n;
    int err;
} result;

static void make_prompt(const spec *sp, uint32_t n_vocab, int32_t *out) {
    uint64_t x = sp->prompt_seed * 2654435761u + 1;
    for (uint32_t i = 0; i < sp->n_prompt; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        out[i] = (int32_t)(3 + (x >> 33) % (n_vocab - 3));
    }
}

static kv_sample_params sp_params(const spec *sp) {
    kv_sample_params p = kv_sample_defaults();
    p.temp = sp->temp;
    p.seed = sp->seed;
    p.repeat_penalty = 1.1f;
    return p;
}

static void ref_run(const fixture *f, const spec *sp, uint32_t kv_type, result *r) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *st = NULL;
    kv_sampler *smp = NULL;
    const uint32_t V = f->n_vocab;
    r->logits = calloc((size_t)MAX_GEN * V, sizeof(float));
    r->n = 0;
    int32_t prompt[256];
    make_prompt(sp, V, prompt);
    const kv_state_opts so = {.n_ctx = 256, .n_batch = 3, .kv_type = kv_type};
    const kv_sample_params p = sp_params(sp);
    if (kv_pool_new(&pool, 1, &d) || kv_state_new(&st, f->m, pool, &so, &d) ||
        kv_sampler_new(&smp, (int32_t)V, &p, &d)) {
        KVT_FAIL("reference: %s", d.msg);
        goto done;
    }
    for (uint32_t i = 0; i < sp->n_prompt; i++) kv_sampler_accept(smp, prompt[i]);
    float *lg = malloc(V * sizeof(float));
    if (kv_state_eval(st, prompt, sp->n_prompt, lg, &d)) KVT_FAIL("reference eval: %s", d.msg);
    while (r->n < sp->max_tokens && r->n < MAX_GEN) {
        const int32_t t = kv_sampler_sample(smp, lg);
        kv_sampler_accept(smp, t);
        memcpy(r->logits + (size_t)r->n * V, lg, V * sizeof(float));
        r->tok[r->n++] = t;
        if (kv_tok_is_eog(kv_model_tok(f->m), t)) break;
        if (r->n == sp->max_tokens) break;
        if (kv_state_eval(st, &t, 1, lg, &d)) {
            KVT_FAIL("reference eval: %s", d.msg);
            break;
        }
    }
    free(lg);
done:
    kv_sampler_free(smp);
    kv_state_free(st);
    kv_pool_free(pool);
}

/* ---- driving an engine through a scenario ----------------------------------- */

/* Creates, prompts, steps and frees sessions as the specs say; records what
 * each emits. Returns the steps run. */
static int drive(kv_engine *e, const spec *sps, int n, result *res, int max_steps) {
    kv_session *ss[16] = {0};
    const uint32_t V = kv_model_hparams(kv_engine_model(e))->n_vocab;
    int step = 0;
    for (int i = 0; i < n; i++) {
        res[i].logits = calloc((size_t)MAX_GEN * V, sizeof(float));
        res[i].n = 0;
        res[i].err = 0;
    }
    for (; step < max_steps; step++) {
        bool pending = false;
        for (int i = 0; i < n; i++) {
            if (sps[i].join == step) {
                kv_diag d = {0};
                kv_session_opts o = {.sample = sp_params(&sps[i]), .max_tokens = sps[i].max_tokens};
                ASSERT_EQ(kv_session_new(&ss[i], e, &o, &d), 0);
                int32_t prompt[256];
                make_prompt(&sps[i], V, prompt);
                if (ss[i]) ASSERT_EQ(kv_session_prompt(ss[i], prompt, sps[i].n_prompt, &d), 0);
            }
            if (sps[i].leave == step && ss[i]) {
                kv_session_free(ss[i]);
                ss[i] = NULL;
            }
            pending |= sps[i].join > step;
        }
        if (!pending && !kv_engine_busy(e)) break;
        kv_diag d = {0};
        const int rc = kv_engine_step(e, &d);
        if (rc < 0) {
            KVT_FAIL("step %d: %s", step, d.msg);
            break;
        }
        for (int i = 0; i < n; i++) {
            if (!ss[i]) continue;
            const int32_t t = kv_session_token(ss[i]);
            if (t >= 0 && res[i].n < MAX_GEN) {
                ASSERT_TRUE(kv_session_logits(ss[i]) != NULL);
                if (kv_session_logits(ss[i]))
                    memcpy(res[i].logits + (size_t)res[i].n * V, kv_session_logits(ss[i]), V * sizeof(float));
                res[i].tok[res[i].n++] = t;
            }
            if (kv_session_status(ss[i]) == KV_SESSION_FAILED) res[i].err = kv_session_error(ss[i], NULL);
        }
    }
    for (int i = 0; i < n; i++) kv_session_free(ss[i]);
    return step;
}

/* A session's record equals the reference (a prefix of it when it left early). */
static bool same(const result *got, const result *ref, uint32_t V, bool prefix) {
    if (got->err) return false;
    if (prefix ? got->n > ref->n : got->n != ref->n) return false;
    for (uint32_t i = 0; i < got->n; i++)
        if (got->tok[i] != ref->tok[i]) return false;
    return !memcmp(got->logits, ref->logits, (size_t)got->n * V * sizeof(float));
}

/* Six sessions: three from the start with long prompts (chunked over
 * several steps at 5 prompt tokens a step), two joining while others
 * decode, one leaving mid-way; greedy and sampled. */
static const spec g_mix[] = {
    {0, -1, 13, 1, 0.0f, 0, 10},
    {0, -1, 7, 2, 0.9f, 42, 12},
    {0, -1, 4, 3, 1.3f, 7, 9},
    {2, 6, 9, 4, 0.0f, 0, 12},
    {3, -1, 17, 5, 0.7f, 99, 8},
    {9, -1, 2, 6, 0.0f, 0, 6},
};
#define N_MIX ((int)(sizeof g_mix / sizeof g_mix[0]))

enum placement { PL_LOCAL, PL_SLABS, PL_WORKERS };
static const char *const pl_name[] = {"local", "slabs", "workers"};

static kv_engine *open_at(fixture *f, enum placement pl, uint32_t kv_type, proc *w, kv_diag *d) {
    kv_engine *e = NULL;
    kv_engine_opts o = {.n_threads = 2, .n_ctx = 256, .n_batch = 5, .max_sessions = 8, .kv_type = kv_type};
    const char *addrs[2];
    if (pl == PL_LOCAL) {
        kv_engine_open(&e, f->model, &o, d);
    } else if (pl == PL_SLABS) {
        kv_engine_open(&e, f->slices, &o, d);
    } else {
        for (int g = 0; g < 2; g++) {
            if (!worker_start(&w[g], f->group[g])) {
                KVT_FAIL("worker %d did not start", g);
                return NULL;
            }
            addrs[g] = w[g].addr;
        }
        o.workers = addrs;
        o.n_workers = 2;
        o.key_sk = kvt_coord_sk();
        o.worker_timeout_ms = 5000;
        kv_engine_open(&e, f->coord, &o, d);
    }
    return e;
}

/* Runs g_mix at a placement; checks every session against its reference. */
static void mix_at(fixture *f, enum placement pl, uint32_t kv_type, result *ref, result *out) {
    kv_diag d = {0};
    proc w[2] = {{0}};
    kv_engine *e = open_at(f, pl, kv_type, w, &d);
    ASSERT_TRUE(e != NULL);
    if (!e) {
        fprintf(stderr, "open %s %s: %s\n", f->arch, pl_name[pl], d.msg);
        return;
    }
    const int steps = drive(e, g_mix, N_MIX, out, 200);
    kv_engine_stats st;
    kv_engine_get_stats(e, &st);
    int ok = 0;
    for (int i = 0; i < N_MIX; i++) {
        const bool eq = same(&out[i], &ref[i], f->n_vocab, g_mix[i].leave >= 0);
        if (!eq) KVT_FAIL("%s %s kv %s: session %d differs from its reference (%u vs %u tokens, err %d)", f->arch,
                          pl_name[pl], kv_type ? "f16" : "f32", i, out[i].n, ref[i].n, out[i].err);
        ok += eq;
        kvt_checks++;
    }
    ASSERT_TRUE(st.max_step_tokens > 5); /* prompt chunks rode along with decodes */
    if (pl == PL_WORKERS) {
        kv_remote_stats rs;
        kv_remote_get_stats(kv_engine_remote(e), &rs);
        ASSERT_TRUE(rs.pairs_remote > 0);
        ASSERT_EQ(rs.pairs_local, 0);
        /* one expert request per MoE layer and step: never split per session (a step
           without logits has none in its last block) */
        ASSERT_TRUE(st.steps_headless > 0);
        ASSERT_EQ(rs.calls, st.steps * kv_model_hparams(kv_engine_model(e))->n_layer - st.steps_headless);
    }
    printf("  %s %s kv %s: %d sessions exact over %d steps (%llu prefill + %llu decode tokens, at most %u a step)\n",
           f->arch, pl_name[pl], kv_type ? "f16" : "f32", ok, steps, (unsigned long long)st.tokens_prefill,
           (unsigned long long)st.tokens_decode, st.max_step_tokens);
    kv_engine_free(e);
    for (int g = 0; g < 2; g++) worker_stop(&w[g]);
}

static void free_results(result *r, int n) {
    for (int i = 0; i < n; i++) free(r[i].logits);
}

static void mix_all(int fi) {
    fixture *f = &g_fx[fi];
    if (!f->ok) {
        KVT_FAIL("fixture %d missing", fi);
        return;
    }
    for (uint32_t kt = KV_TYPE_F32; kt <= KV_TYPE_F16; kt++) {
        result ref[N_MIX], out[N_MIX];
        for (int i = 0; i < N_MIX; i++) ref_run(f, &g_mix[i], kt, &ref[i]);
        for (int pl = PL_LOCAL; pl <= PL_WORKERS; pl++) {
            mix_at(f, (enum placement)pl, kt, ref, out);
            free_results(out, N_MIX);
        }
        if (kt == KV_TYPE_F16) { /* F16 is lossy but close to F32 */
            result r32;
            ref_run(f, &g_mix[0], KV_TYPE_F32, &r32);
            double maxd = 0, maxa = 0;
            for (size_t i = 0; i < f->n_vocab; i++) {
                const double dd = fabs((double)r32.logits[i] - ref[0].logits[i]);
                if (dd > maxd) maxd = dd;
                if (fabs(r32.logits[i]) > maxa) maxa = fabs(r32.logits[i]);
            }
            printf("  %s: F16 KV vs F32 after the prompt: max |dlogit| %.3g (max |logit| %.3g)\n", f->arch, maxd, maxa);
            ASSERT_TRUE(maxd > 0 && maxd <= 0.1 * maxa); /* lossy, bounded */
            free(r32.logits);
        }
        free_results(ref, N_MIX);
    }
}

static void test_mix_qwen3moe(void) { mix_all(0); }
static void test_mix_qwen35moe(void) { mix_all(1); }

/* ---- KV memory ---------------------------------------------------------------- */

static void test_kv_memory(void) {
    for (int fi = 0; fi < 2; fi++) {
        fixture *f = &g_fx[fi];
        kv_diag d = {0};
        kv_engine *e = NULL;
        const kv_engine_opts o = {.n_threads = 1, .n_ctx = 256, .n_batch = 64, .max_sessions = 4};
        ASSERT_EQ(kv_engine_open(&e, f->model, &o, &d), 0);
        if (!e) continue;
        const kv_hparams *hp = kv_model_hparams(f->m);
        uint32_t attends = 0;
        for (uint32_t il = 0; il < hp->n_layer; il++) attends += !kv_model_layer(f->m, il)->recurrent;
        kv_engine_stats st;
        kv_engine_get_stats(e, &st);
        ASSERT_EQ(st.mem.n_attn_layers, attends);
        ASSERT_EQ(st.mem.blocks_allocated, 0); /* nothing before the first token */
        ASSERT_EQ(st.mem.block_bytes, 2ull * attends * st.mem.block_tokens * hp->n_head_kv * hp->head_dim * 4);
        kv_session *a = NULL, *b = NULL;
        const spec sa = {0, -1, 40, 1, 0, 0, 1}, sb = {0, -1, 3, 2, 0, 0, 1};
        int32_t pa[64], pb[64];
        make_prompt(&sa, f->n_vocab, pa);
        make_prompt(&sb, f->n_vocab, pb);
        kv_session_opts so = {.sample = sp_params(&sa), .max_tokens = 1};
        ASSERT_EQ(kv_session_new(&a, e, &so, &d), 0);
        ASSERT_EQ(kv_session_new(&b, e, &so, &d), 0);
        ASSERT_EQ(kv_session_prompt(a, pa, 40, &d), 0);
        ASSERT_EQ(kv_session_prompt(b, pb, 3, &d), 0);
        while (kv_engine_busy(e)) ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
        kv_engine_get_stats(e, &st);
        const uint32_t bt = st.mem.block_tokens;
        ASSERT_EQ(st.mem.blocks_held, (40 + bt - 1) / bt + (3 + bt - 1) / bt);
        ASSERT_EQ(st.mem.recurrent_bytes > 0, fi == 1);
        const uint64_t rec2 = st.mem.recurrent_bytes;
        kv_session_free(a);
        kv_engine_get_stats(e, &st);
        ASSERT_EQ(st.mem.blocks_held, (3 + bt - 1) / bt);
        ASSERT_EQ(st.mem.recurrent_bytes, rec2 / 2);
        printf("  %s: %u of %u layers cached, %llu B per %u-token block; 43 tokens in 2 sessions held %u blocks\n",
               f->arch, attends, hp->n_layer, (unsigned long long)st.mem.block_bytes, bt,
               (40 + bt - 1) / bt + (3 + bt - 1) / bt);
        kv_session_free(b);
        kv_engine_free(e);
    }
}

/* A pool capped at 4 blocks: the session that asks for a fifth fails alone
 * with a clear message; the others stay exact. */
static void test_kv_full(void) {
    fixture *f = &g_fx[0];
    kv_diag d = {0};
    kv_engine *e = NULL;
    const kv_hparams *hp = kv_model_hparams(f->m);
    const uint64_t blk = 2ull * hp->n_layer * 16 * hp->n_head_kv * hp->head_dim * 4;
    const kv_engine_opts o = {.n_threads = 2, .n_ctx = 256, .n_batch = 5, .max_sessions = 4, .kv_bytes_max = 4 * blk};
    ASSERT_EQ(kv_engine_open(&e, f->model, &o, &d), 0);
    if (!e) return;
    const spec sps[] = {
        {0, -1, 13, 1, 0.0f, 0, 10}, /* 22 positions: 2 blocks */
        {0, -1, 40, 2, 0.0f, 0, 4},  /* 3 blocks: gets 2, then fails */
        {1, -1, 5, 3, 0.8f, 3, 8},   /* 12 positions: 1 block */
    };
    result out[3], ref[3];
    drive(e, sps, 3, out, 200);
    ref_run(f, &sps[0], KV_TYPE_F32, &ref[0]);
    ref_run(f, &sps[2], KV_TYPE_F32, &ref[2]);
    ASSERT_TRUE(same(&out[0], &ref[0], f->n_vocab, false));
    ASSERT_TRUE(same(&out[2], &ref[2], f->n_vocab, false));
    ASSERT_EQ(out[1].err, KV_ENOMEM);
    ASSERT_EQ(out[1].n, 0);
    /* the message, as a session reads it */
    kv_session *s = NULL;
    kv_session_opts so = {.sample = sp_params(&sps[1])};
    int32_t p[64];
    make_prompt(&sps[1], f->n_vocab, p);
    ASSERT_EQ(kv_session_new(&s, e, &so, &d), 0);
    ASSERT_EQ(kv_session_prompt(s, p, 40, &d), 0);
    kv_session *t = NULL;
    ASSERT_EQ(kv_session_new(&t, e, &so, &d), 0);
    ASSERT_EQ(kv_session_prompt(t, p, 40, &d), 0);
    for (int i = 0; i < 20 && kv_engine_busy(e); i++) ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
    kv_diag se = {0};
    ASSERT_EQ(kv_session_status(t), KV_SESSION_FAILED);
    ASSERT_EQ(kv_session_error(t, &se), KV_ENOMEM);
    printf("  pool of 4 blocks: %s\n", se.msg);
    ASSERT_TRUE(strstr(se.msg, "session") && strstr(se.msg, "step") && strstr(se.msg, "KV cache full"));
    kv_session_free(s);
    kv_session_free(t);
    free_results(out, 3);
    free(ref[0].logits);
    free(ref[2].logits);
    kv_engine_free(e);
}

/* ---- non-finite logits ---------------------------------------------------------- */

typedef struct liar {
    kv_expert_provider inner;
    float value;        /* written into the output */
    int from_call;      /* calls before it starts lying */
    uint32_t row;       /* token row it lies about; UINT32_MAX: every row */
    int calls;
} liar;

static int liar_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    liar *L = impl;
    int rc = L->inner.compute(L->inner.impl, req, out, d);
    if (rc || L->calls++ < L->from_call) return rc;
    for (uint32_t t = 0; t < req->n_tokens; t++) {
        if (L->row != UINT32_MAX && t != L->row) continue;
        for (size_t i = 0; i < (size_t)req->n_used * req->n_embd; i++) out[(size_t)t * req->n_used * req->n_embd + i] = L->value;
    }
    return 0;
}

static void test_nonfinite_provider(void) {
    const float vals[] = {NAN, INFINITY, 3e38f};
    for (int fi = 0; fi < 2; fi++) {
        fixture *f = &g_fx[fi];
        for (int vi = 0; vi < 3; vi++) {
            for (int temp0 = 0; temp0 < 2; temp0++) {
                kv_diag d = {0};
                kv_pool *pool = NULL;
                ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
                liar L = {.value = vals[vi], .from_call = 0, .row = 0};
                ASSERT_EQ(kv_expert_local_new(&L.inner, f->m, pool, 64, &d), 0);
                /* rows: the step's tokens; session A decodes first (row 0), B after */
                const kv_expert_provider p = {&L, liar_compute, NULL, "liar"};
                kv_engine *e = NULL;
                const kv_engine_opts o = {.n_threads = 1, .n_ctx = 128, .n_batch = 16, .max_sessions = 4};
                ASSERT_EQ(kv_engine_open_model(&e, f->m, &p, &o, &d), 0);
                const spec sa = {0, -1, 5, 1, temp0 ? 0.0f : 0.8f, 1, 6}, sb = {0, -1, 5, 2, 0.0f, 0, 6};
                int32_t pa[8], pb[8];
                make_prompt(&sa, f->n_vocab, pa);
                make_prompt(&sb, f->n_vocab, pb);
                kv_session *a = NULL, *b = NULL;
                kv_session_opts oa = {.sample = sp_params(&sa), .max_tokens = 6};
                ASSERT_EQ(kv_session_new(&a, e, &oa, &d), 0);
                ASSERT_EQ(kv_session_prompt(a, pa, 5, &d), 0);
                /* the first step: A's prompt only, every row lied about */
                L.row = UINT32_MAX;
                int rc = kv_engine_step(e, &d);
                ASSERT_EQ(rc, 0); /* no token: A failed */
                ASSERT_EQ(kv_session_status(a), KV_SESSION_FAILED);
                ASSERT_EQ(kv_session_token(a), -1);
                kv_diag se = {0};
                ASSERT_EQ(kv_session_error(a, &se), KV_ERANGE);
                ASSERT_TRUE(strstr(se.msg, "session 1") && strstr(se.msg, "step 1") && strstr(se.msg, "NaN"));
                if (vi == 0 && temp0) printf("  a NaN-answering provider, greedy: %s\n", se.msg);
                /* a fresh session beside it, honest answers: exact */
                L.row = 1000000;
                kv_session_opts ob = {.sample = sp_params(&sb), .max_tokens = 6};
                ASSERT_EQ(kv_session_new(&b, e, &ob, &d), 0);
                ASSERT_EQ(kv_session_prompt(b, pb, 5, &d), 0);
                result rb = {.logits = NULL}, ref;
                rb.logits = calloc((size_t)MAX_GEN * f->n_vocab, sizeof(float));
                while (kv_engine_busy(e)) {
                    ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
                    if (kv_session_token(b) >= 0 && rb.n < MAX_GEN) {
                        memcpy(rb.logits + (size_t)rb.n * f->n_vocab, kv_session_logits(b), f->n_vocab * sizeof(float));
                        rb.tok[rb.n++] = kv_session_token(b);
                    }
                }
                ref_run(f, &sb, KV_TYPE_F32, &ref);
                ASSERT_TRUE(same(&rb, &ref, f->n_vocab, false));
                kv_session_free(a);
                kv_session_free(b);
                kv_engine_free(e);
                free(rb.logits);
                free(ref.logits);
                L.inner.free(L.inner.impl);
                kv_pool_free(pool);
            }
        }
    }
}

/* A copy of fixture f's file with a NaN in element 5 of tensor `name`. */
static bool nan_model(char *path, size_t cap, const fixture *f, const char *name) {
    char cmd[1000];
    snprintf(path, cap, "%s/nan-%s-%s.gguf", g_dir, f->arch, name);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", f->model, path);
    ASSERT_EQ(run_cmd(cmd), 0);
    const kv_gguf_tensor *t = kv_gguf_find_tensor(kv_model_gguf(f->m), name);
    ASSERT_TRUE(t != NULL);
    FILE *fp = t ? fopen(path, "r+b") : NULL;
    ASSERT_TRUE(fp != NULL);
    if (!fp) return false;
    const float nan = NAN;
    fseek(fp, (long)t->file_offset + 4 * 5, SEEK_SET);
    const bool ok = fwrite(&nan, 4, 1, fp) == 1;
    fclose(fp);
    ASSERT_TRUE(ok);
    return ok;
}

/* A GGUF with a NaN in a norm weight (the output norm, the first
 * block's attention norm; F32 and Q8_0 models, where quantizing the
 * activation would turn the NaN into finite garbage): greedy used to emit
 * a token silently; now the session fails with KV_ERANGE. */
static void nan_weight_one(const fixture *f, const char *name) {
    char path[400];
    if (!nan_model(path, sizeof path, f, name)) return;
    kv_diag d = {0};
    kv_engine *e = NULL;
    const kv_engine_opts o = {.n_threads = 1, .n_ctx = 64, .max_sessions = 2};
    ASSERT_EQ(kv_engine_open(&e, path, &o, &d), 0);
    if (!e) return;
    kv_session *s = NULL;
    kv_session_opts so = {.sample = kv_sample_defaults(), .max_tokens = 4};
    so.sample.temp = 0;
    ASSERT_EQ(kv_session_new(&s, e, &so, &d), 0);
    const int32_t p[3] = {5, 6, 7};
    ASSERT_EQ(kv_session_prompt(s, p, 3, &d), 0);
    ASSERT_EQ(kv_engine_step(e, &d), 0);
    ASSERT_EQ(kv_session_token(s), -1);
    ASSERT_EQ(kv_session_error(s, &d), KV_ERANGE);
    ASSERT_TRUE(strstr(d.msg, "NaN") != NULL);
    printf("  %s, NaN in %s, greedy: %s\n", f->arch, name, d.msg);
    kv_session_free(s);
    kv_engine_free(e);
}

static void test_nan_weight(void) {
    for (int fi = 0; fi < 2; fi++) {
        nan_weight_one(&g_fx[fi], "output_norm.weight");
        nan_weight_one(&g_fx[fi], "blk.0.attn_norm.weight");
    }
}

/* The same file through `kvasir run`: before, greedy printed token 0 and
 * sampling ran the top-k quickselect past its array on NaN; now one line
 * naming session and step, exit status 2, for greedy and sampled runs. */
static void test_run_cli_nan(void) {
    char path[400], cmd[1200], err[400];
    if (!nan_model(path, sizeof path, &g_fx[0], "output_norm.weight")) return;
    snprintf(err, sizeof err, "%s/run.err", g_dir);
    const char *modes[] = {"--temp 0", "--temp 0.8 --seed 3"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "'%s' run -m '%s' -p hello -n 3 %s --json > /dev/null 2> '%s'", g_bin, path, modes[i], err);
        const int st = run_cmd(cmd);
        ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2);
        FILE *f = fopen(err, "r");
        char line[600] = "";
        ASSERT_TRUE(f && fgets(line, sizeof line, f));
        if (f) fclose(f);
        ASSERT_TRUE(strstr(line, "kvasir run: session 1: step 1:") && strstr(line, "NaN"));
        if (i == 0) printf("  %s", line);
    }
}

/* A second turn continues the same cache: prompt, N tokens, then the last
 * token plus a new prompt, equals one sequence fed all of it on the plain
 * kv_state path (greedy, both architectures). */
static void test_second_turn(void) {
    for (int fi = 0; fi < 2; fi++) {
        fixture *f = &g_fx[fi];
        const uint32_t V = f->n_vocab, N = 5;
        const int32_t p1[6] = {11, 12, 13, 14, 15, 16}, p2[4] = {21, 22, 23, 24};
        /* reference */
        kv_diag d = {0};
        kv_pool *pool = NULL;
        kv_state *st = NULL;
        ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
        const kv_state_opts so = {.n_ctx = 64, .n_batch = 4};
        ASSERT_EQ(kv_state_new(&st, f->m, pool, &so, &d), 0);
        if (!st) return;
        float *lg = malloc(V * sizeof(float));
        int32_t ref[2][8];
        ASSERT_EQ(kv_state_eval(st, p1, 6, lg, &d), 0);
        for (int turn = 0; turn < 2; turn++) {
            for (uint32_t i = 0; i < N; i++) {
                int32_t t = 0;
                for (uint32_t v = 1; v < V; v++) if (lg[v] > lg[t]) t = (int32_t)v;
                ref[turn][i] = t;
                if (i + 1 < N) ASSERT_EQ(kv_state_eval(st, &t, 1, lg, &d), 0);
            }
            if (turn == 0) {
                int32_t next[5] = {ref[0][N - 1], p2[0], p2[1], p2[2], p2[3]};
                ASSERT_EQ(kv_state_eval(st, next, 5, lg, &d), 0);
            }
        }
        kv_state_free(st);
        kv_pool_free(pool);
        free(lg);
        /* the engine, a session beside it */
        kv_engine *e = NULL;
        const kv_engine_opts o = {.n_threads = 2, .n_ctx = 64, .n_batch = 3, .max_sessions = 2};
        ASSERT_EQ(kv_engine_open(&e, f->model, &o, &d), 0);
        if (!e) return;
        kv_session *s = NULL, *other = NULL;
        kv_session_opts sopt = {.sample = kv_sample_defaults(), .max_tokens = N, .ignore_eog = true};
        sopt.sample.temp = 0;
        ASSERT_EQ(kv_session_new(&s, e, &sopt, &d), 0);
        ASSERT_EQ(kv_session_new(&other, e, &sopt, &d), 0);
        ASSERT_EQ(kv_session_prompt(other, p2, 4, &d), 0);
        ASSERT_EQ(kv_session_prompt(s, p1, 6, &d), 0);
        int ok = 1;
        for (int turn = 0; turn < 2; turn++) {
            uint32_t n = 0;
            while (kv_session_status(s) == KV_SESSION_PREFILL || kv_session_status(s) == KV_SESSION_DECODE) {
                ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
                if (kv_session_token(s) >= 0) ok &= n < N && kv_session_token(s) == ref[turn][n++];
            }
            ok &= n == N;
            if (turn == 0) {
                int32_t next[5] = {ref[0][N - 1], p2[0], p2[1], p2[2], p2[3]};
                ASSERT_EQ(kv_session_prompt(s, next, 5, &d), 0);
                if (kv_session_status(other) == KV_SESSION_DONE) ASSERT_EQ(kv_session_prompt(other, p1, 2, &d), 0);
            }
        }
        ASSERT_TRUE(ok);
        kv_engine_free(e);
    }
}

/* Paged attention's weighted sum, block by block with
 * kv_f32_wsum_rows_acc, has the bits of one kv_f32_wsum_rows over all the
 * rows, on every backend this CPU has. */
static void test_wsum_blocks(void) {
    enum { R = 70, HD = 136, STRIDE = 150 };
    static float V[R * STRIDE], w[R], one[HD], blk[HD];
    uint64_t x = 77;
    for (int i = 0; i < R * STRIDE; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        V[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
    for (int p = 0; p < R; p++) w[p] = (float)(p % 7 + 1) / 28.0f;
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512"};
    const char *was = kv_quant_backend();
    for (int b = 0; b < 4; b++) {
        if (kv_quant_set_backend(bes[b]) != 0) {
            kvt_skip_backend(bes[b], "not on this CPU");
            continue;
        }
        for (int n = 1; n <= HD; n += 45) {
            kv_f32_wsum_rows(one, w, V, STRIDE, R, n);
            for (int p0 = 0; p0 < R; p0 += 16) {
                const int m = R - p0 < 16 ? R - p0 : 16;
                if (p0 == 0) kv_f32_wsum_rows(blk, w, V, STRIDE, m, n);
                else kv_f32_wsum_rows_acc(blk, w + p0, V + (size_t)p0 * STRIDE, STRIDE, m, n);
            }
            ASSERT_TRUE(!memcmp(one, blk, (size_t)n * sizeof(float)));
        }
    }
    kv_quant_set_backend(was);
}

/* ---- API contract ------------------------------------------------------------------ */

static void test_api(void) {
    fixture *f = &g_fx[0];
    kv_diag d = {0};
    kv_engine *e = NULL;
    const kv_engine_opts o = {.n_threads = 1, .n_ctx = 32, .n_batch = 8, .max_sessions = 2};
    ASSERT_EQ(kv_engine_open(&e, f->model, &o, &d), 0);
    if (!e) return;
    ASSERT_EQ(kv_engine_step(e, &d), 0); /* nothing to do */
    kv_session *a = NULL, *b = NULL, *c = NULL;
    kv_session_opts so = {.sample = kv_sample_defaults(), .max_tokens = 3};
    so.sample.temp = 0;
    ASSERT_EQ(kv_session_new(&a, e, &so, &d), 0);
    ASSERT_EQ(kv_session_new(&b, e, &so, &d), 0);
    ASSERT_EQ(kv_session_new(&c, e, &so, &d), KV_ENOMEM); /* max_sessions */
    ASSERT_TRUE(c == NULL);
    const int32_t bad = (int32_t)f->n_vocab, p[4] = {9, 10, 11, 12};
    ASSERT_EQ(kv_session_prompt(a, &bad, 1, &d), KV_ERANGE);
    int32_t longp[40];
    for (int i = 0; i < 40; i++) longp[i] = 5 + i;
    ASSERT_EQ(kv_session_prompt(a, longp, 33, &d), KV_ECTXFULL);
    ASSERT_EQ(kv_session_status(a), KV_SESSION_IDLE);
    ASSERT_EQ(kv_session_prompt(a, p, 4, &d), 0);
    ASSERT_EQ(kv_session_status(a), KV_SESSION_PREFILL);
    ASSERT_EQ(kv_engine_step(e, &d), 1);
    ASSERT_EQ(kv_session_status(a), KV_SESSION_DECODE);
    ASSERT_EQ(kv_session_prompt(a, p, 4, &d), KV_EINVAL); /* while generating */
    while (kv_engine_busy(e)) ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
    ASSERT_EQ(kv_session_status(a), KV_SESSION_DONE);
    ASSERT_EQ(kv_session_stop_reason(a), KV_STOP_MAX_TOKENS);
    kv_session_stats st;
    kv_session_get_stats(a, &st);
    ASSERT_EQ(st.n_gen, 3);
    ASSERT_EQ(st.n_prompt, 4);
    ASSERT_EQ(st.pos, 6); /* the last token is emitted, not fed */
    /* the next turn continues the same cache */
    ASSERT_EQ(kv_session_prompt(a, p, 4, &d), 0);
    while (kv_engine_busy(e)) ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
    kv_session_get_stats(a, &st);
    ASSERT_EQ(st.pos, 12);
    ASSERT_EQ(st.n_gen_total, 6);
    /* context full: 32 positions */
    ASSERT_EQ(kv_session_prompt(a, longp, 21, &d), KV_ECTXFULL);
    ASSERT_EQ(kv_session_prompt(a, longp, 18, &d), 0);
    kv_session_opts big = so;
    big.max_tokens = 0;
    kv_session_free(a);
    ASSERT_EQ(kv_session_new(&a, e, &big, &d), 0);
    ASSERT_EQ(kv_session_prompt(a, longp, 30, &d), 0);
    while (kv_engine_busy(e)) ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
    ASSERT_EQ(kv_session_stop_reason(a), KV_STOP_CTX_FULL);
    kv_session_get_stats(a, &st);
    ASSERT_EQ(st.pos, 32);
    ASSERT_EQ(st.n_gen, 3);
    /* a stop token */
    kv_session_opts stp = so;
    stp.max_tokens = 10;
    kv_session_free(b);
    ASSERT_EQ(kv_session_new(&b, e, &stp, &d), 0);
    ASSERT_EQ(kv_session_prompt(b, p, 4, &d), 0);
    ASSERT_EQ(kv_engine_step(e, &d), 1);
    const int32_t first = kv_session_token(b);
    kv_session_free(b);
    stp.stop_tokens[0] = first;
    stp.n_stop = 1;
    ASSERT_EQ(kv_session_new(&b, e, &stp, &d), 0);
    ASSERT_EQ(kv_session_prompt(b, p, 4, &d), 0);
    ASSERT_EQ(kv_engine_step(e, &d), 1);
    ASSERT_EQ(kv_session_status(b), KV_SESSION_DONE);
    ASSERT_EQ(kv_session_stop_reason(b), KV_STOP_TOKEN);
    ASSERT_STREQ(kv_stop_name(kv_session_stop_reason(b)), "stop_token");
    /* paused sessions are skipped */
    kv_session_free(b);
    ASSERT_EQ(kv_session_new(&b, e, &so, &d), 0);
    ASSERT_EQ(kv_session_prompt(b, p, 4, &d), 0);
    kv_session_pause(b, true);
    ASSERT_TRUE(!kv_engine_busy(e));
    ASSERT_EQ(kv_engine_step(e, &d), 0);
    kv_session_pause(b, false);
    ASSERT_EQ(kv_engine_step(e, &d), 1);
    kv_engine_stats es;
    kv_engine_get_stats(e, &es);
    ASSERT_EQ(es.sessions_open, 2);
    ASSERT_TRUE(es.steps > 0 && es.tokens_prefill > 0 && es.t_prefill_s > 0);
    kv_engine_free(e); /* frees a and b */
    /* a bad source: one clear error */
    memset(&d, 0, sizeof d);
    ASSERT_NE(kv_engine_open(&e, "/nonexistent/model.gguf", &o, &d), 0);
    ASSERT_TRUE(e == NULL && d.msg[0]);
    kv_engine_opts bo = o;
    bo.kv_type = 7;
    ASSERT_EQ(kv_engine_open(&e, f->model, &bo, &d), KV_EINVAL);
}

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) {
        fprintf(stderr, "test_engine: KV_BIN (the kvasir binary) is not set\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-engine.XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    return !fixture_make(&g_fx[0], "qwen3moe") || !fixture_make(&g_fx[1], "qwen35moe");
}

static void teardown(void) {
    for (int i = 0; i < 2; i++) kv_model_free(g_fx[i].m);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (!kvt_failures) (void)!system(cmd);
    else fprintf(stderr, "test_engine: files kept in %s\n", g_dir);
}

static const kvt_case cases[] = {
    KVT_CASE(test_mix_qwen3moe), KVT_CASE(test_mix_qwen35moe), KVT_CASE(test_kv_memory),
    KVT_CASE(test_kv_full),      KVT_CASE(test_nonfinite_provider), KVT_CASE(test_nan_weight),
    KVT_CASE(test_run_cli_nan),  KVT_CASE(test_second_turn), KVT_CASE(test_wsum_blocks),
    KVT_CASE(test_api),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
