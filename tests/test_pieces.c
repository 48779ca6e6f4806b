/* kv-test-labels: unit net */
/* Pieces: the model identity against an independent reimplementation of its
 * definition (libsodium SHA-256 over the file read with stdio), two models
 * that differ only in weights (same header bytes) get different ids and
 * refuse each other's slabs; a sparse skeleton's identity equals that of
 * its dense copy and comes without reading holes; file hashes equal
 * libsodium's over the bytes; a FIFO anywhere a piece is expected is
 * refused without hanging (slices, manifest, coordinator, worker); a
 * manifest padded or extended with unknown keys is refused before its tree
 * is built; a sliced skeleton runs only when asked (allow_sparse). */
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <sodium.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_remote.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/model.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "kvtest.h"
#include "test_auth_support.h"

static char g_dir[64];
static const char *g_bin;

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 999;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static bool one_line(const kv_diag *d) { return d->msg[0] && !strchr(d->msg, '\n'); }

/* Same flags, seed given: models that differ only in weight bytes. */
static void gen_model(const char *out, int seed) {
    ASSERT_EQ(sh("%s gen-model --arch qwen3moe --out %s --layers 2 --embd 256 --ff-exp 256 --experts 8 "
                 "--experts-used 2 --heads 4 --kv-heads 2 --head-dim 64 --vocab 1024 --type q4_k --seed %d "
                 ">/dev/null 2>&1", g_bin, out, seed),
              0);
}

/* The identity as slice.h defines it, computed the plain way: the whole
 * file read with stdio, libsodium's SHA-256, 1 MiB leaves of the tensor
 * data (from the data offset to the end of the last tensor). */
static void ref_model_id(const char *path, char out[65]) {
    kv_gguf *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_gguf_open(&g, path, &d), 0);
    if (!g) return;
    const uint64_t off = kv_gguf_data_offset(g);
    uint64_t end = off;
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        if (t->file_offset + t->nbytes > end) end = t->file_offset + t->nbytes;
    }
    kv_gguf_close(g);
    FILE *f = fopen(path, "rb");
    uint8_t *buf = malloc(1u << 20), hh[32], leaf[32], id[32], len8[8];
    ASSERT_TRUE(f && buf);
    uint8_t *hdr = malloc(off);
    ASSERT_EQ(fread(hdr, 1, off, f), off);
    crypto_hash_sha256(hh, hdr, off);
    free(hdr);
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    crypto_hash_sha256_update(&st, (const uint8_t *)"kvasir-model-id-v2", 19); /* with the NUL */
    crypto_hash_sha256_update(&st, hh, 32);
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((end - off) >> (8 * i));
    crypto_hash_sha256_update(&st, len8, 8);
    for (uint64_t p = off; p < end;) {
        const size_t k = end - p < (1u << 20) ? (size_t)(end - p) : (1u << 20);
        ASSERT_EQ(fread(buf, 1, k, f), k);
        crypto_hash_sha256(leaf, buf, k);
        crypto_hash_sha256_update(&st, leaf, 32);
        p += k;
    }
    crypto_hash_sha256_final(&st, id);
    fclose(f);
    free(buf);
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", id[i]);
}

static void ensure_model(const char *path, int seed) {
    struct stat st;
    if (stat(path, &st)) gen_model(path, seed);
}

static void lib_model_id(const char *path, int threads, char out[65]) {
    kv_gguf *g = NULL;
    kv_diag d = {0};
    out[0] = 0;
    ASSERT_EQ(kv_gguf_open(&g, path, &d), 0);
    if (!g) return;
    ASSERT_EQ(kv_pieces_model_id(g, path, threads, out, &d), 0);
    kv_gguf_close(g);
}

/* ---- identity ---------------------------------------------------------------- */

static void test_identity_weights(void) {
    char a[300], b[300], sa[300], sb[300], p[600], q[600];
    snprintf(a, sizeof a, "%s/seed1.gguf", g_dir);
    snprintf(b, sizeof b, "%s/seed2.gguf", g_dir);
    ensure_model(a, 1);
    ensure_model(b, 2);
    /* the headers are byte-identical (independent of our reader: cmp) */
    kv_gguf *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_gguf_open(&g, a, &d), 0);
    const uint64_t off = g ? kv_gguf_data_offset(g) : 0;
    kv_gguf_close(g);
    ASSERT_EQ(sh("cmp -s -n %llu %s %s", (unsigned long long)off, a, b), 0);
    ASSERT_NE(sh("cmp -s %s %s", a, b), 0);
    char ra[65], rb[65], la[65], lb[65], l1[65], ma[65] = "";
    ref_model_id(a, ra);
    ref_model_id(b, rb);
    lib_model_id(a, 0, la);
    lib_model_id(b, 3, lb);
    lib_model_id(a, 1, l1);
    ASSERT_STREQ(la, ra);
    ASSERT_STREQ(lb, rb);
    ASSERT_STREQ(l1, ra);
    ASSERT_TRUE(strcmp(ra, rb) != 0);
    ASSERT_EQ(kv_gguf_open(&g, a, &d), 0);
    if (g) kv_slice_model_id(g, ma); /* through the mapping */
    kv_gguf_close(g);
    ASSERT_STREQ(ma, ra);
    printf("  seed 1: %.16s..., seed 2: %.16s... (same %llu-byte header)\n", ra, rb, (unsigned long long)off);
    /* slicing carries the identity into the manifest and every piece */
    snprintf(sa, sizeof sa, "%s/s_seed1", g_dir);
    snprintf(sb, sizeof sb, "%s/s_seed2", g_dir);
    ASSERT_EQ(kv_slice_model(a, sa, &(kv_slice_opts){4, -1, -1, 2}, NULL, &d), 0);
    ASSERT_EQ(kv_slice_model(b, sb, &(kv_slice_opts){4, -1, -1, 2}, NULL, &d), 0);
    kv_manifest *m = NULL, *mb = NULL;
    snprintf(p, sizeof p, "%s/manifest.json", sa);
    snprintf(q, sizeof q, "%s/manifest.json", sb);
    ASSERT_EQ(kv_manifest_load(&m, p, &d), 0);
    ASSERT_EQ(kv_manifest_load(&mb, q, &d), 0);
    if (!m || !mb) return;
    ASSERT_STREQ(m->model_id, ra);
    ASSERT_STREQ(mb->model_id, rb);
    for (size_t i = 0; i <= m->n_slabs; i++) {
        snprintf(q, sizeof q, "%s/%s", sa, i < m->n_slabs ? m->slabs[i].file.path : m->backbone.path);
        kv_gguf *sg = NULL;
        kv_str id = {0};
        ASSERT_EQ(kv_gguf_open(&sg, q, &d), 0);
        if (sg) ASSERT_EQ(kv_gguf_get_str(sg, "kvasir.source.id", &id, &d), 0);
        ASSERT_TRUE(id.len == 64 && !memcmp(id.ptr, ra, 64));
        char fid[65] = "";
        if (sg) ASSERT_EQ(kv_pieces_file_identity(sg, q, fid, &d), 0);
        ASSERT_STREQ(fid, ra);
        kv_gguf_close(sg);
    }
    /* a slab of the seed-2 model, its size and hash written into the seed-1
     * manifest: same header, other weights, so another model */
    ASSERT_EQ(sh("cp %s/%s %s/%s", sb, mb->slabs[0].file.path, sa, m->slabs[0].file.path), 0);
    {
        json_t *j = json_load_file(p, 0, NULL);
        json_t *s0 = json_array_get(json_object_get(j, "slabs"), 0);
        char hex[65];
        kv_sha256_hex(mb->slabs[0].file.sha256, hex);
        json_object_set_new(s0, "sha256", json_string(hex));
        json_object_set_new(s0, "size", json_integer((json_int_t)mb->slabs[0].file.size));
        json_dump_file(j, p, JSON_INDENT(1));
        json_decref(j);
    }
    kv_slices *s = (kv_slices *)1;
    ASSERT_EQ(kv_slices_open(&s, p, NULL, &d), KV_EFORMAT);
    ASSERT_TRUE(s == NULL && one_line(&d) && strstr(d.msg, "belongs to another model"));
    printf("  seed-2 slab in a seed-1 folder: %s\n", d.msg);
    kv_manifest_free(m);
    kv_manifest_free(mb);
}

/* A qwen3moe header with 4 layers of 16 experts, tensor data all holes but
 * for one norm: ~200 MB logical. */
static void write_skeleton(const char *path) {
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);
    kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", &d);
    kv_gguf_writer_set_u32(w, "qwen3moe.block_count", 4, &d);
    kv_gguf_writer_set_u32(w, "qwen3moe.expert_count", 16, &d);
    kv_gguf_writer_set_u32(w, "qwen3moe.expert_used_count", 2, &d);
    for (int L = 0; L < 4; L++) {
        char n[64];
        const uint64_t ng[3] = {2048, 768, 16}, nd[3] = {768, 2048, 16}, nn[1] = {2048};
        snprintf(n, sizeof n, "blk.%d.attn_norm.weight", L);
        kv_gguf_writer_add_tensor(w, n, 1, nn, KV_TYPE_F32, NULL, &d);
        snprintf(n, sizeof n, "blk.%d.ffn_gate_exps.weight", L);
        kv_gguf_writer_add_tensor(w, n, 3, ng, KV_TYPE_Q4_K, NULL, &d);
        snprintf(n, sizeof n, "blk.%d.ffn_up_exps.weight", L);
        kv_gguf_writer_add_tensor(w, n, 3, ng, KV_TYPE_Q4_K, NULL, &d);
        snprintf(n, sizeof n, "blk.%d.ffn_down_exps.weight", L);
        ASSERT_EQ(kv_gguf_writer_add_tensor(w, n, 3, nd, KV_TYPE_Q6_K, NULL, &d), 0);
    }
    ASSERT_EQ(kv_gguf_writer_begin(w, path, &d), 0);
    float v[2048];
    for (int i = 0; i < 2048; i++) v[i] = 1.0f + (float)i;
    ASSERT_EQ(kv_gguf_writer_write_data(w, 4, 0, v, sizeof v, &d), 0); /* blk.1.attn_norm */
    ASSERT_EQ(kv_gguf_writer_finish(w, &d), 0);
    kv_gguf_writer_free(w);
}

static void test_identity_sparse(void) {
    char sk[300], dense[300];
    snprintf(sk, sizeof sk, "%s/skel.gguf", g_dir);
    snprintf(dense, sizeof dense, "%s/skel_dense.gguf", g_dir);
    write_skeleton(sk);
    ASSERT_EQ(sh("cp --sparse=never %s %s", sk, dense), 0);
    struct stat a, b;
    ASSERT_TRUE(!stat(sk, &a) && !stat(dense, &b));
    ASSERT_TRUE((uint64_t)a.st_blocks * 512 < (uint64_t)a.st_size / 16); /* really sparse */
    char r[65], ls[65], ld[65];
    ref_model_id(dense, r);
    lib_model_id(sk, 2, ls);
    lib_model_id(dense, 2, ld);
    ASSERT_STREQ(ls, r);
    ASSERT_STREQ(ld, r);
    /* one changed byte in a hole makes another model */
    ASSERT_EQ(sh("printf 'x' | dd of=%s bs=1 seek=%lld conv=notrunc status=none", dense,
                 (long long)a.st_size - 5000), 0);
    lib_model_id(dense, 2, ld);
    ASSERT_TRUE(strcmp(ld, r) != 0);
    /* a full-size skeleton: ~76 GB of holes, identity without reading them */
    char big[300];
    snprintf(big, sizeof big, "%s/q35_122b.gguf", g_dir);
    ASSERT_EQ(sh("%s gen-model --preset qwen35-122b-a10b --skeleton --out %s >/dev/null 2>&1", g_bin, big), 0);
    const double t0 = now_s();
    lib_model_id(big, 0, ls);
    const double dt = now_s() - t0;
    struct stat bs;
    ASSERT_EQ(stat(big, &bs), 0);
    printf("  skeleton identity: %.1f GB logical in %.3f s (%.16s...)\n", (double)bs.st_size / 1e9, dt, ls);
    ASSERT_TRUE(strlen(ls) == 64);
    ASSERT_TRUE(dt < 10.0); /* hashing 76 GB of zeros would take ~40 s even with SHA-NI */
    unlink(big);
}

/* ---- file hashes, the manifest's expected hash ------------------------------- */

static void test_hash_file(void) {
    char src[300], dir[300], p[600];
    snprintf(src, sizeof src, "%s/seed1.gguf", g_dir);
    snprintf(dir, sizeof dir, "%s/s_hash", g_dir);
    ensure_model(src, 1);
    kv_diag d = {0};
    ASSERT_EQ(kv_slice_model(src, dir, &(kv_slice_opts){4, -1, -1, 2}, NULL, &d), 0);
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    kv_manifest *m = NULL;
    ASSERT_EQ(kv_manifest_load(&m, p, &d), 0);
    if (!m) return;
    const kv_manifest_slab *ms = &m->slabs[m->n_slabs - 1];
    ASSERT_TRUE(kv_manifest_find_slab(m, ms->layer, ms->first, ms->last) == ms);
    ASSERT_TRUE(kv_manifest_find_slab(m, ms->layer, ms->first, ms->last + 1) == NULL);
    ASSERT_TRUE(kv_manifest_find_slab(m, ms->layer + 1, ms->first, ms->last) == NULL);
    for (size_t i = 0; i < m->n_slabs; i++) {
        const kv_manifest_slab *x = &m->slabs[i];
        ASSERT_TRUE(kv_manifest_find_slab(m, x->layer, x->first, x->last) == x);
    }
    snprintf(p, sizeof p, "%s/%s", dir, ms->file.path);
    uint8_t got[32], ref[32];
    ASSERT_EQ(kv_pieces_hash_file(p, got, &d), 0);
    FILE *f = fopen(p, "rb");
    uint8_t *buf = malloc(ms->file.size);
    ASSERT_TRUE(f && buf && fread(buf, 1, ms->file.size, f) == ms->file.size);
    crypto_hash_sha256(ref, buf, ms->file.size);
    fclose(f);
    free(buf);
    ASSERT_EQ(memcmp(got, ref, 32), 0);
    ASSERT_EQ(memcmp(got, ms->file.sha256, 32), 0);
    ASSERT_EQ(kv_pieces_hash_file("/nonexistent/x", got, &d), KV_ENOTFOUND);
    ASSERT_EQ(kv_pieces_hash_file(dir, got, &d), KV_EIO);
    ASSERT_TRUE(one_line(&d) && strstr(d.msg, "not a regular file"));
    kv_manifest_free(m);
}

/* ---- FIFOs --------------------------------------------------------------------- */

/* Runs what in a child under alarm(5): 0 if it returned want with a one-line
 * message holding `msg`, else a failure (a hang is killed by SIGALRM). */
static int g_fifo_case;
static const char *g_fifo_path;

static int fifo_child(void) {
    kv_diag d = {0};
    int rc = 0;
    if (g_fifo_case == 0) {
        kv_slices *s = NULL;
        rc = kv_slices_open(&s, g_fifo_path, NULL, &d);
    } else if (g_fifo_case == 1) {
        kv_manifest *m = NULL;
        rc = kv_manifest_load(&m, g_fifo_path, &d);
    } else if (g_fifo_case == 2) {
        kv_remote *r = NULL;
        kv_pool *pool = NULL;
        kv_pool_new(&pool, 1, &d);
        const kv_remote_opts o = {.timeout_ms = 500, .key_sk = kvt_coord_sk()};
        rc = kv_remote_open(&r, g_fifo_path, pool, &o, &d);
    } else {
        kv_worker *w = NULL;
        const kv_worker_opts o = {.slabs = g_fifo_path, .listen = "127.0.0.1:0", .n_threads = 1, .quiet = true,
                                  .allow_keys = kvt_coord_allow(), .n_allow_keys = 1};
        rc = kv_worker_open(&w, &o, &d);
    }
    printf("  fifo case %d: rc %d: %s\n", g_fifo_case, rc, d.msg);
    return rc < 0 && one_line(&d) && strstr(d.msg, "not a regular file") ? 0 : 1;
}

static void expect_fifo_refused(int which, const char *path) {
    g_fifo_case = which;
    g_fifo_path = path;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(5);
        const int r = fifo_child();
        fflush(stdout);
        _exit(r);
    }
    int st = 0;
    ASSERT_TRUE(pid > 0 && waitpid(pid, &st, 0) == pid);
    if (!WIFEXITED(st)) KVT_FAIL("fifo case %d (%s) hung: killed by signal %d", which, path, WTERMSIG(st));
    else ASSERT_EQ(WEXITSTATUS(st), 0);
}

static void test_fifo(void) {
    char src[300], dir[300], man[600], p[700], coord[300];
    snprintf(src, sizeof src, "%s/fifo_src.gguf", g_dir);
    snprintf(dir, sizeof dir, "%s/s_fifo", g_dir);
    ensure_model(src, 7);
    kv_diag d = {0};
    ASSERT_EQ(kv_slice_model(src, dir, &(kv_slice_opts){4, -1, -1, 2}, NULL, &d), 0);
    snprintf(man, sizeof man, "%s/manifest.json", dir);
    kv_manifest *m = NULL;
    ASSERT_EQ(kv_manifest_load(&m, man, &d), 0);
    if (!m) return;
    /* a slab replaced by a FIFO: run -m DIR (kv_slices_open) */
    snprintf(p, sizeof p, "%s/%s", dir, m->slabs[1].file.path);
    ASSERT_EQ(unlink(p), 0);
    ASSERT_EQ(mkfifo(p, 0600), 0);
    expect_fifo_refused(0, man);
    /* the coordinator holding the backbone, the manifest and that FIFO */
    snprintf(coord, sizeof coord, "%s/coord", g_dir);
    ASSERT_EQ(sh("mkdir -p %s/experts && cp %s/backbone.gguf %s/manifest.json %s/ && mkfifo %s/%s", coord, dir, dir,
                 coord, coord, m->slabs[1].file.path), 0);
    snprintf(p, sizeof p, "%s/manifest.json", coord);
    expect_fifo_refused(2, p);
    /* worker --slabs DIR: the FIFO is one of the folder's *.gguf */
    expect_fifo_refused(3, dir);
    /* manifest.json itself a FIFO */
    ASSERT_EQ(unlink(man), 0);
    ASSERT_EQ(mkfifo(man, 0600), 0);
    expect_fifo_refused(1, man);
    kv_manifest_free(m);
}

/* ---- manifest bounds and unknown keys ----------------------------------------- */

/* Parses text in a child whose address space is capped at 1 GiB (jansson
 * building a tree for the padded manifest took 5 GB); returns 0 if parsing
 * failed with KV_EFORMAT and a one-line message holding want. */
static void expect_parse_refused(const char *text, size_t n, const char *want, const char *what) {
    fflush(NULL);
    const double t0 = now_s();
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit rl = {1ull << 30, 1ull << 30};
        setrlimit(RLIMIT_AS, &rl);
        alarm(20);
        kv_diag d = {0};
        kv_manifest *m = NULL;
        const int rc = kv_manifest_parse(&m, text, n, &d);
        printf("  %s: rc %d: %.160s\n", what, rc, d.msg);
        fflush(stdout);
        _exit(rc == KV_EFORMAT && !m && one_line(&d) && strstr(d.msg, want) ? 0 : 1);
    }
    int st = 0;
    ASSERT_TRUE(pid > 0 && waitpid(pid, &st, 0) == pid);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) KVT_FAIL("%s: not refused with '%s' (status %d)", what, want, st);
    printf("  %s: %.3f s\n", what, now_s() - t0);
}

static char *load_text(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)sz + 1);
    *n = p ? fread(p, 1, (size_t)sz, f) : 0;
    fclose(f);
    return p;
}

static void test_manifest_bounds(void) {
    char p[400];
    snprintf(p, sizeof p, "%s/s_fifo_ok", g_dir);
    char src[300];
    snprintf(src, sizeof src, "%s/fifo_src.gguf", g_dir);
    ensure_model(src, 7);
    kv_diag d = {0};
    ASSERT_EQ(kv_slice_model(src, p, &(kv_slice_opts){4, -1, -1, 2}, NULL, &d), 0);
    snprintf(p, sizeof p, "%s/s_fifo_ok/manifest.json", g_dir);
    size_t n = 0;
    char *text = load_text(p, &n);
    ASSERT_TRUE(text && n > 100 && text[n - 1] != 0);
    if (!text) return;
    kv_manifest *m = NULL;
    ASSERT_EQ(kv_manifest_parse(&m, text, n, &d), 0); /* as written */
    kv_manifest_free(m);
    /* 62 MiB: the manifest with an unknown key holding an array of zeros */
    const size_t pad = 62u << 20;
    char *big = malloc(n + pad + 64);
    ASSERT_TRUE(big != NULL);
    if (!big) return;
    size_t k = 0;
    memcpy(big, "{\"pad\": [0", 10);
    k = 10;
    while (k + 2 < pad) big[k++] = ',', big[k++] = '0';
    big[k++] = ']';
    big[k++] = ',';
    memcpy(big + k, text + 1, n - 1); /* the manifest's members after its '{' */
    k += n - 1;
    expect_parse_refused(big, k, "more than the", "62 MiB padded manifest");
    /* small unknown keys, at every level */
    const char *where[][3] = {
        {"{", "{\"extra\": 1, ", "unknown key 'extra'"},
        {"\"hparams\": {", "\"hparams\": {\"rope\": 2, ", "hparams: unknown key 'rope'"},
        {"\"model\": {", "\"model\": {\"license\": \"x\", ", "model: unknown key 'license'"},
        {"\"layers\": {", "\"layers\": {\"mtp\": [], ", "layers: unknown key 'mtp'"},
        {"\"backbone\": {", "\"backbone\": {\"url\": \"x\", ", "backbone: unknown key 'url'"},
        {"\"slabs\": [\n  {", "\"slabs\": [\n  {\"note\": null, ", "slabs[0]: unknown key 'note'"},
    };
    for (size_t i = 0; i < sizeof where / sizeof *where; i++) {
        const char *at = strstr(text, where[i][0]);
        ASSERT_TRUE(at != NULL);
        if (!at) continue;
        const size_t pre = (size_t)(at - text), la = strlen(where[i][0]), lb = strlen(where[i][1]);
        memcpy(big, text, pre);
        memcpy(big + pre, where[i][1], lb);
        memcpy(big + pre + lb, at + la, n - pre - la);
        expect_parse_refused(big, n - la + lb, where[i][2], where[i][2]);
    }
    /* too many JSON values for its slabs (inside the byte bound), too deep */
    k = 0;
    memcpy(big, "{\"pad\": [0", 10);
    k = 10;
    for (int i = 0; i < 5000; i++) big[k++] = ',', big[k++] = '0';
    big[k++] = ']';
    big[k++] = ',';
    memcpy(big + k, text + 1, n - 1);
    k += n - 1;
    expect_parse_refused(big, k, "JSON values", "10 KB of zeros under an unknown key");
    const char deep[] = "{\"slabs\": [{\"path\": [[1]]}]}";
    expect_parse_refused(deep, sizeof deep - 1, "nested deeper", "nesting");
    free(big);
    free(text);
}

/* ---- a sliced skeleton runs only when asked ------------------------------------- */

static void *serve_main(void *w) {
    kv_worker_serve(w, NULL);
    return NULL;
}

static void test_sparse_open(void) {
    char sk[300], dir[300], man[600];
    snprintf(sk, sizeof sk, "%s/skel.gguf", g_dir);
    snprintf(dir, sizeof dir, "%s/s_skel", g_dir);
    struct stat st;
    if (stat(sk, &st)) write_skeleton(sk);
    kv_diag d = {0};
    kv_slice_stats ss;
    ASSERT_EQ(kv_slice_model(sk, dir, &(kv_slice_opts){8, -1, -1, 2}, &ss, &d), 0);
    ASSERT_TRUE(ss.sparse);
    snprintf(man, sizeof man, "%s/manifest.json", dir);
    kv_slices *s = (kv_slices *)1;
    ASSERT_EQ(kv_slices_open(&s, man, NULL, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(s == NULL && one_line(&d) && strstr(d.msg, "skeleton") && strstr(d.msg, "--allow-sparse"));
    printf("  without allow_sparse: %s\n", d.msg);
    kv_slices_opts o = {0};
    o.allow_sparse = true;
    s = NULL;
    ASSERT_EQ(kv_slices_open(&s, man, &o, &d), 0);
    if (s) {
        const kv_manifest *m = kv_slices_manifest(s);
        ASSERT_TRUE(m->sparse && m->n_slabs == 8);
        /* an expert's weights are the source's bytes (zeros here) */
        kv_expert_source src = kv_slices_expert_source(s);
        kv_expert_weights w;
        ASSERT_EQ(src.acquire(src.ctx, 1, 3, &w, &d), 0);
        ASSERT_TRUE(w.gate != NULL && w.down != NULL);
        if (src.release) src.release(src.ctx, 1, 3);
    }
    kv_slices_free(s);
    /* the CLI: a real model (tokenizer and all) with holes punched in one
     * expert tensor slices sparse; run refuses it naming the flag, and runs
     * it with --allow-sparse */
    char src[300], sdir[300];
    snprintf(src, sizeof src, "%s/punched.gguf", g_dir);
    snprintf(sdir, sizeof sdir, "%s/s_punched", g_dir);
    gen_model(src, 5);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, src, &d), 0);
    const kv_gguf_tensor *t = g ? kv_gguf_find_tensor(g, "blk.1.ffn_up_exps.weight") : NULL;
    ASSERT_TRUE(t != NULL && t->nbytes > 3 * 4096);
    const uint64_t a0 = t ? (t->file_offset + 4095) / 4096 * 4096 : 0, len = t ? (t->nbytes - 4096) / 4096 * 4096 : 0;
    kv_gguf_close(g);
    ASSERT_EQ(sh("fallocate -p -o %llu -l %llu %s", (unsigned long long)a0, (unsigned long long)len, src), 0);
    ASSERT_EQ(kv_slice_model(src, sdir, &(kv_slice_opts){0, -1, -1, 2}, &ss, &d), 0);
    ASSERT_TRUE(ss.sparse);
    ASSERT_NE(sh("%s run -m %s -p hi -n 2 --threads 2 >/dev/null 2>%s/err.txt", g_bin, sdir, g_dir), 0);
    ASSERT_EQ(sh("grep -q -- '--allow-sparse' %s/err.txt && test $(wc -l < %s/err.txt) = 1", g_dir, g_dir), 0);
    ASSERT_EQ(sh("%s run -m %s --allow-sparse -p hi -n 2 --threads 2 >/dev/null 2>&1", g_bin, sdir), 0);
    /* distributed: a coordinator folder (backbone + manifest) and a worker
     * serving the sparse slabs */
    char coord[300];
    snprintf(coord, sizeof coord, "%s/c_punched", g_dir);
    ASSERT_EQ(sh("mkdir -p %s && cp %s/backbone.gguf %s/manifest.json %s/", coord, sdir, sdir, coord), 0);
    kv_worker *wk = NULL;
    const kv_worker_opts wo = {.slabs = sdir, .listen = "127.0.0.1:0", .n_threads = 1, .quiet = true,
                               .allow_keys = kvt_coord_allow(), .n_allow_keys = 1};
    ASSERT_EQ(kv_worker_open(&wk, &wo, &d), 0);
    pthread_t th;
    if (wk && !pthread_create(&th, NULL, serve_main, wk)) {
        char man2[400];
        snprintf(man2, sizeof man2, "%s/manifest.json", coord);
        kv_pool *pool = NULL;
        ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
        const char *addrs[1] = {kv_worker_addr(wk)};
        kv_remote *r = (kv_remote *)1;
        const kv_remote_opts ro = {.workers = addrs, .n_workers = 1, .timeout_ms = 5000, .key_sk = kvt_coord_sk()};
        ASSERT_EQ(kv_remote_open(&r, man2, pool, &ro, &d), KV_EUNSUPPORTED);
        ASSERT_TRUE(r == NULL && one_line(&d) && strstr(d.msg, "--allow-sparse"));
        const kv_remote_opts ro2 = {.workers = addrs, .n_workers = 1, .timeout_ms = 5000, .allow_sparse = true,
                                    .key_sk = kvt_coord_sk()};
        ASSERT_EQ(kv_remote_open(&r, man2, pool, &ro2, &d), 0);
        kv_remote_free(r);
        kv_pool_free(pool);
        char kf[300];
        snprintf(kf, sizeof kf, "%s/coord.key", g_dir);
        ASSERT_EQ(kvt_write_coord_key(kf), 0);
        ASSERT_NE(sh("%s run -m %s --worker %s --key %s -p hi -n 2 --threads 2 >/dev/null 2>%s/err.txt", g_bin, coord,
                     kv_worker_addr(wk), kf, g_dir), 0);
        ASSERT_EQ(sh("grep -q -- '--allow-sparse' %s/err.txt", g_dir), 0);
        ASSERT_EQ(sh("%s run -m %s --worker %s --key %s --allow-sparse -p hi -n 2 --threads 2 --json >%s/out.json "
                     "2>/dev/null", g_bin, coord, kv_worker_addr(wk), kf, g_dir), 0);
        kv_worker_stop(wk);
        pthread_join(th, NULL);
    }
    kv_worker_free(wk);
    /* the checks still hold: a slab of the wrong size is refused */
    ASSERT_EQ(sh("truncate -s -1 %s/experts/blk.0.0000-0007.gguf", dir), 0);
    s = (kv_slices *)1;
    ASSERT_EQ(kv_slices_open(&s, man, &o, &d), KV_EFORMAT);
    ASSERT_TRUE(s == NULL && strstr(d.msg, "bytes"));
}

static const kvt_case cases[] = {
    KVT_CASE(test_identity_weights), KVT_CASE(test_identity_sparse), KVT_CASE(test_hash_file),
    KVT_CASE(test_fifo),             KVT_CASE(test_manifest_bounds), KVT_CASE(test_sparse_open),
};

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) {
        fprintf(stderr, "FAIL: KV_BIN is not set\n");
        return 1;
    }
    if (sodium_init() < 0) return 1;
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof g_dir, "/tmp/kv_pieces_XXXXXX");
    return mkdtemp(g_dir) ? 0 : 1;
}

static void teardown(void) {
    if (!kvt_failures) sh("rm -rf %s", g_dir);
    else fprintf(stderr, "test files kept in %s\n", g_dir);
}

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
