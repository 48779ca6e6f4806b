/* Bad input to the CLI: a truncated GGUF, a corrupt one, an unknown
 * architecture, a tensor type we cannot compute, a wrong tensor shape, a
 * prompt longer than the context, bad flags. Each must give exactly one
 * line on stderr naming the problem, a non-zero exit, and no crash (exit by
 * signal fails the test). Defective models are made by rewriting a valid
 * one through the GGUF reader and writer with one mutation. */
#include <stdbool.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvtest.h"

static char g_dir[256];
static const char *g_bin;

/* Runs the command, captures stderr; returns exit status (or 1000+signal). */
static int run_cmd(const char *args, char *err, size_t cap) {
    char cmd[4096], ef[300];
    snprintf(ef, sizeof ef, "%s/stderr.txt", g_dir);
    snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>%s", g_bin, args, ef);
    int st = system(cmd);
    err[0] = 0;
    FILE *f = fopen(ef, "rb");
    if (f) {
        size_t n = fread(err, 1, cap - 1, f);
        err[n] = 0;
        fclose(f);
    }
    if (WIFSIGNALED(st)) return 1000 + WTERMSIG(st);
    if (WIFEXITED(st) && WEXITSTATUS(st) >= 128) return 1000 + WEXITSTATUS(st) - 128; /* shell-reported signal */
    return WIFEXITED(st) ? WEXITSTATUS(st) : 999;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* Expects failure, one line, containing `needle`. */
static void expect_err(const char *what, const char *args, const char *needle) {
    char err[8192];
    int rc = run_cmd(args, err, sizeof err);
    if (rc == 0 || rc >= 999) KVT_FAIL("%s: exit status %d (want a clean non-zero exit)", what, rc);
    kvt_checks++;
    if (count_lines(err) != 1) KVT_FAIL("%s: stderr has %d lines: %s", what, count_lines(err), err);
    kvt_checks++;
    if (!strstr(err, needle)) KVT_FAIL("%s: stderr lacks '%s': %s", what, needle, err);
    kvt_checks++;
    printf("%-28s -> %s", what, err);
}

typedef enum { MUT_ARCH, MUT_TYPE, MUT_SHAPE } mutation;

/* Rewrites src to dst with one mutation. Returns 0 on success. */
static int rewrite(const char *src, const char *dst, mutation mut) {
    kv_diag d = {0};
    kv_gguf *g = NULL;
    kv_gguf_writer *w = NULL;
    int rc = kv_gguf_open(&g, src, &d);
    if (!rc) rc = kv_gguf_writer_new(&w, &d);
    for (size_t i = 0; !rc && i < kv_gguf_n_kv(g); i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(g, i);
        if (mut == MUT_ARCH && kv_str_eq(kv->key, "general.architecture"))
            rc = kv_gguf_writer_set_str(w, "general.architecture", "llama9000", &d);
        else
            rc = kv_gguf_writer_copy_kv(w, kv, &d);
    }
    for (size_t i = 0; !rc && i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        char name[300];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        uint32_t type = t->type, nd = t->n_dims;
        if (!strcmp(name, "blk.0.attn_q.weight")) {
            if (mut == MUT_TYPE) type = KV_TYPE_Q8_1; /* a real ggml type kvasir computes no weights of (an activation type) */
            if (mut == MUT_SHAPE) ne[1] = ne[1] / 2;
        }
        rc = kv_gguf_writer_add_tensor(w, name, nd, ne, type, NULL, &d);
    }
    if (!rc) rc = kv_gguf_writer_begin(w, dst, &d);
    for (size_t i = 0; !rc && i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        char name[300];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        if (strcmp(name, "blk.0.attn_q.weight") || mut == MUT_ARCH)
            rc = kv_gguf_writer_write_data(w, i, 0, t->data, t->nbytes, &d);
    }
    if (!rc) rc = kv_gguf_writer_finish(w, &d);
    if (rc) fprintf(stderr, "rewrite: %s\n", d.msg);
    kv_gguf_writer_free(w);
    kv_gguf_close(g);
    return rc;
}

static char good[300]; /* a valid small model, written by setup */

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) { fprintf(stderr, "FAIL: KV_BIN is not set\n"); return 1; }
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-test-cli-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    char args[2048], err[8192];
    snprintf(good, sizeof good, "%s/good.gguf", g_dir);
    snprintf(args, sizeof args, "gen-model --arch qwen3moe --out %s --layers 1 --embd 64 --ff-exp 32 "
             "--experts 4 --experts-used 2 --heads 2 --kv-heads 1 --head-dim 32 --vocab 600 --ctx 64 --type f32",
             good);
    ASSERT_EQ(run_cmd(args, err, sizeof err), 0);
    snprintf(args, sizeof args, "run -m %s -p hello -n 2 --temp 0", good);
    ASSERT_EQ(run_cmd(args, err, sizeof err), 0);

    return 0;
}

static void teardown(void) {
    char args[400];
    snprintf(args, sizeof args, "rm -rf %s", g_dir);
    if (system(args)) fprintf(stderr, "could not remove %s\n", g_dir);
}

/* truncated and corrupt files */
static void test_truncated_corrupt(void) {
    char path[300], args[2048], err[8192];
    (void)path; (void)err;
    /* truncated: header cut at several points, and data cut short */
    FILE *f = fopen(good, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)size);
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) KVT_FAIL("read good model");
    fclose(f);
    const long cuts[] = {0, 3, 10, 24, 100, 1000, size / 2, size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        snprintf(path, sizeof path, "%s/trunc%zu.gguf", g_dir, i);
        f = fopen(path, "wb");
        fwrite(buf, 1, (size_t)cuts[i], f);
        fclose(f);
        char what[64];
        snprintf(what, sizeof what, "truncated at %ld bytes", cuts[i]);
        snprintf(args, sizeof args, "run -m %s -p hello -n 2", path);
        expect_err(what, args, "kvasir run:");
    }
    /* corrupt: bad magic, and a huge tensor count */
    snprintf(path, sizeof path, "%s/magic.gguf", g_dir);
    buf[0] = 'X';
    f = fopen(path, "wb");
    fwrite(buf, 1, (size_t)size, f);
    fclose(f);
    snprintf(args, sizeof args, "run -m %s -p hello", path);
    expect_err("bad magic", args, "magic");
    buf[0] = 'G';
    memset(buf + 8, 0xff, 8); /* n_tensors = 2^64-1 */
    snprintf(path, sizeof path, "%s/count.gguf", g_dir);
    f = fopen(path, "wb");
    fwrite(buf, 1, (size_t)size, f);
    fclose(f);
    snprintf(args, sizeof args, "run -m %s -p hello", path);
    expect_err("huge tensor count", args, "tensor");
    free(buf);

}

/* unknown architecture, unsupported type, wrong shape */
static void test_mutated(void) {
    char path[300], args[2048], err[8192];
    (void)path; (void)err;
    snprintf(path, sizeof path, "%s/arch.gguf", g_dir);
    ASSERT_EQ(rewrite(good, path, MUT_ARCH), 0);
    snprintf(args, sizeof args, "run -m %s -p hello", path);
    expect_err("unknown architecture", args, "llama9000");
    snprintf(path, sizeof path, "%s/type.gguf", g_dir);
    ASSERT_EQ(rewrite(good, path, MUT_TYPE), 0);
    snprintf(args, sizeof args, "run -m %s -p hello", path);
    expect_err("unsupported tensor type", args, "q8_1");
    snprintf(path, sizeof path, "%s/shape.gguf", g_dir);
    ASSERT_EQ(rewrite(good, path, MUT_SHAPE), 0);
    snprintf(args, sizeof args, "run -m %s -p hello", path);
    expect_err("wrong tensor shape", args, "blk.0.attn_q.weight");

}

static void test_context(void) {
    char path[300], args[2048], err[8192];
    (void)path; (void)err;
    /* a prompt longer than the context (model context 64) */
    char longp[1200];
    memset(longp, 0, sizeof longp);
    for (int i = 0; i < 150; i++) strcat(longp, "zq7 ");
    snprintf(args, sizeof args, "run -m %s -p '%s' -n 4", good, longp);
    expect_err("prompt longer than context", args, "context");
    snprintf(args, sizeof args, "run -m %s -p 'hello there my good friend' --ctx 2 -n 4", good);
    expect_err("--ctx below prompt", args, "context");
}

static void test_flags(void) {
    char path[300], args[2048], err[8192];
    (void)path; (void)err;
    /* missing file, bad flags */
    snprintf(args, sizeof args, "run -m %s/nope.gguf -p hello", g_dir);
    expect_err("missing file", args, "nope.gguf");
    snprintf(args, sizeof args, "run -m %s -p hello --threads 0", good);
    expect_err("bad --threads", args, "--threads");
    snprintf(args, sizeof args, "run -m %s -p hello --temp abc", good);
    expect_err("bad --temp", args, "--temp");
    snprintf(args, sizeof args, "run -m %s -p hello --bogus", good);
    expect_err("unknown flag", args, "--bogus");
    snprintf(args, sizeof args, "bench -m %s/nope.gguf", g_dir);
    expect_err("bench missing file", args, "nope.gguf");
    snprintf(path, sizeof path, "%s/arch-tok.gguf", g_dir);
    ASSERT_EQ(rewrite(good, path, MUT_ARCH), 0);
    snprintf(args, sizeof args, "tokenize -m %s hello", path);
    /* tokenize does not need the architecture: it must still work */
    ASSERT_EQ(run_cmd(args, err, sizeof err), 0);
    snprintf(args, sizeof args, "frobnicate");
    expect_err("unknown command", args, "frobnicate");

}

static const kvt_case cases[] = {KVT_CASE(test_truncated_corrupt), KVT_CASE(test_mutated),
                                 KVT_CASE(test_context), KVT_CASE(test_flags)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
