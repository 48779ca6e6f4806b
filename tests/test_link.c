/* kv-test-labels: net attack */
/* The link layer: hex, key files, signatures and vouchers checked against
 * libsodium directly (its hex codec, SHA-256 and Ed25519 as the reference),
 * the handshake transcript against its definition in docs/PROTOCOL.md, the
 * blocking I/O helpers' limits (idle and total, cancellation, a peer that
 * closes, a full socket buffer on a blocking fd) over socket pairs,
 * and the coordinator's blocking dispatch handshake (kv_link_dial_dispatch)
 * against a real in-process kv_worker: the right key, a worker that proves
 * another key, a caller the worker does not serve, vouchers good, forged and
 * expired, another model or width, a relay that flips one byte of AUTH_OK,
 * and peers that close early or never answer. Everything on 127.0.0.1. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/link.h"
#include "kvasir/probe.h"
#include "kvasir/slice.h"
#include "kvtest.h"

static char g_dir[256];
static kv_manifest *g_m;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void seed_key(uint8_t tag, uint8_t pk[32], uint8_t sk[64]) {
    uint8_t seed[32];
    memset(seed, 0x33, sizeof seed);
    seed[0] = tag;
    crypto_sign_seed_keypair(pk, sk, seed);
}

/* ---- hex --------------------------------------------------------------------- */

static void test_hex_round_trip(void) {
    uint8_t b[64], back[64];
    char ours[129], ref[129];
    for (size_t n = 0; n <= sizeof b; n++) {
        randombytes_buf(b, n);
        kv_hex(b, n, ours);
        sodium_bin2hex(ref, sizeof ref, b, n);
        ASSERT_STREQ(ours, ref);
        memset(back, 0xee, sizeof back);
        ASSERT_EQ(kv_unhex(ours, 2 * n, back, n, false), 0);
        ASSERT_EQ(memcmp(back, b, n), 0);
        /* either case where the format allows it, as libsodium reads it */
        for (size_t i = 0; i < 2 * n; i++) ours[i] = (char)(ours[i] >= 'a' ? ours[i] - 32 : ours[i]);
        size_t bl = 0;
        ASSERT_EQ(sodium_hex2bin(back, sizeof back, ours, 2 * n, NULL, &bl, NULL), 0);
        ASSERT_EQ(bl, n);
        memset(back, 0xee, sizeof back);
        ASSERT_EQ(kv_unhex(ours, 2 * n, back, n, true), 0);
        ASSERT_EQ(memcmp(back, b, n), 0);
        if (memchr(ours, 'A', 2 * n) || memchr(ours, 'B', 2 * n) || memchr(ours, 'C', 2 * n) ||
            memchr(ours, 'D', 2 * n) || memchr(ours, 'E', 2 * n) || memchr(ours, 'F', 2 * n))
            ASSERT_EQ(kv_unhex(ours, 2 * n, back, n, false), KV_EFORMAT);
    }
}

static void test_hex_rejects(void) {
    uint8_t out[32];
    char good[65];
    uint8_t k[32];
    for (int i = 0; i < 32; i++) k[i] = (uint8_t)(i * 37 + 1);
    kv_hex(k, 32, good);
    ASSERT_EQ(kv_unhex(good, 63, out, 32, true), KV_EFORMAT);  /* one digit short */
    ASSERT_EQ(kv_unhex(good, 64, out, 31, true), KV_EFORMAT);  /* too long for out */
    ASSERT_EQ(kv_unhex(good, 62, out, 32, true), KV_EFORMAT);
    ASSERT_EQ(kv_unhex(NULL, 0, out, 0, true), KV_EFORMAT);
    ASSERT_EQ(kv_unhex("", 0, out, 0, false), 0);
    static const char bad[] = {'g', 'G', ' ', '+', '-', 'x', ':', '/', '@', '`', '\0', '\n'};
    for (size_t b = 0; b < sizeof bad; b++)
        for (int pos = 0; pos < 64; pos += 13) {
            char s[65];
            memcpy(s, good, 65);
            s[pos] = bad[b];
            ASSERT_EQ(kv_unhex(s, 64, out, 32, true), KV_EFORMAT);
            ASSERT_EQ(kv_unhex(s, 64, out, 32, false), KV_EFORMAT);
            size_t bl = 0;
            ASSERT_NE(sodium_hex2bin(out, 32, s, 64, NULL, &bl, NULL) == 0 && bl == 32, 1); /* the reference agrees */
        }
    /* kv_key_from_hex: exactly 64 lowercase digits */
    kv_diag d = {0};
    ASSERT_EQ(kv_key_from_hex(good, out, &d), 0);
    ASSERT_EQ(memcmp(out, k, 32), 0);
    ASSERT_EQ(kv_key_from_hex(NULL, out, &d), KV_EINVAL);
    char s[80];
    snprintf(s, sizeof s, "%.63s", good);
    ASSERT_EQ(kv_key_from_hex(s, out, &d), KV_EINVAL);
    snprintf(s, sizeof s, "%s0", good);
    ASSERT_EQ(kv_key_from_hex(s, out, &d), KV_EINVAL);
    snprintf(s, sizeof s, "%s", good);
    s[5] = 'A';
    if (good[5] >= 'a') ASSERT_EQ(kv_key_from_hex(s, out, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "64 lowercase hex digits") != NULL);
}

/* ---- key files ---------------------------------------------------------------- */

static void test_key_file(void) {
    char path[400], sub[300];
    snprintf(sub, sizeof sub, "%s/keys", g_dir);
    snprintf(path, sizeof path, "%s/node.key", sub);
    kv_node_key k, k2;
    kv_diag d = {0};
    ASSERT_EQ(kv_key_file_load(&k, path, false, &d), KV_ENOTFOUND);
    ASSERT_EQ(kv_key_file_load(&k, path, true, &d), 0);
    struct stat st;
    ASSERT_EQ(stat(path, &st), 0);
    ASSERT_EQ(st.st_size, 65);
    ASSERT_EQ(st.st_mode & 0777, 0600);
    ASSERT_EQ(stat(sub, &st), 0);
    ASSERT_EQ(st.st_mode & 0777, 0700);
    /* the file is the seed: libsodium derives the same key from it */
    char line[80] = {0};
    FILE *f = fopen(path, "rb");
    ASSERT_TRUE(f != NULL);
    if (!f) return;
    ASSERT_EQ(fread(line, 1, sizeof line, f), 65);
    fclose(f);
    uint8_t seed[32], pk[32], sk[64];
    size_t bl = 0;
    ASSERT_EQ(sodium_hex2bin(seed, 32, line, 64, NULL, &bl, NULL), 0);
    crypto_sign_seed_keypair(pk, sk, seed);
    ASSERT_EQ(memcmp(pk, k.pk, 32), 0);
    ASSERT_EQ(memcmp(sk, k.sk, 64), 0);
    /* loading again, even with create, never replaces it */
    ASSERT_EQ(kv_key_file_load(&k2, path, true, &d), 0);
    ASSERT_EQ(memcmp(k2.sk, k.sk, 64), 0);
    kv_node_key_from_seed(&k2, seed);
    ASSERT_EQ(memcmp(k2.pk, pk, 32), 0);
    /* anything else is refused and left as it is */
    /* no newline, one line too many, a digit short, a stray first byte */
    char bad[4][80];
    snprintf(bad[0], sizeof bad[0], "%.64s", line);
    snprintf(bad[1], sizeof bad[1], "%.64s\n\n", line);
    snprintf(bad[2], sizeof bad[2], "%.63s\n", line);
    snprintf(bad[3], sizeof bad[3], "X%.63s\n", line);
    for (size_t i = 0; i < 4; i++) {
        char bp[400];
        snprintf(bp, sizeof bp, "%s/bad%zu.key", g_dir, i);
        f = fopen(bp, "wb");
        fputs(bad[i], f);
        fclose(f);
        ASSERT_EQ(kv_key_file_load(&k2, bp, true, &d), KV_EFORMAT);
        f = fopen(bp, "rb"); /* left as it was */
        char got[80] = {0};
        ASSERT_EQ(fread(got, 1, sizeof got, f), strlen(bad[i]));
        fclose(f);
        ASSERT_STREQ(got, bad[i]);
    }
    char up[80];
    memcpy(up, line, 66);
    for (int i = 0; i < 64; i++)
        if (up[i] >= 'a') up[i] = (char)(up[i] - 32);
    if (memcmp(up, line, 64)) {
        char bp[400];
        snprintf(bp, sizeof bp, "%s/upper.key", g_dir);
        f = fopen(bp, "wb");
        fwrite(up, 1, 65, f);
        fclose(f);
        ASSERT_EQ(kv_key_file_load(&k2, bp, false, &d), KV_EFORMAT);
    }
}

/* ---- signatures and vouchers ------------------------------------------------- */

static void test_sign_verify(void) {
    uint8_t pk[32], sk[64], dg[32], sig[64], ref[64];
    seed_key(9, pk, sk);
    for (int t = 0; t < 16; t++) {
        randombytes_buf(dg, sizeof dg);
        kv_link_sign(sk, dg, sig);
        crypto_sign_detached(ref, NULL, dg, 32, sk); /* Ed25519 is deterministic */
        ASSERT_EQ(memcmp(sig, ref, 64), 0);
        ASSERT_EQ(kv_link_verify(pk, dg, sig), 0);
        uint8_t bad[64];
        memcpy(bad, sig, 64);
        bad[t % 64] ^= (uint8_t)(1u << (t % 8));
        ASSERT_EQ(kv_link_verify(pk, dg, bad), KV_EAUTH);
        dg[t] ^= 1;
        ASSERT_EQ(kv_link_verify(pk, dg, sig), KV_EAUTH);
    }
    uint8_t pk2[32], sk2[64];
    seed_key(10, pk2, sk2);
    ASSERT_EQ(kv_link_verify(pk2, dg, sig), KV_EAUTH);
}

/* ---- the handshake transcript --------------------------------------------------- */

/* The transcript by docs/PROTOCOL.md's definition, with libsodium's SHA-256:
 * domain, role byte, model id, (dispatch) u16 LE version, acceptor key,
 * challenge, connector key, nonce, and the binding when there is one. */
static void ref_transcript(int proto, char role, const char *model, uint16_t ver, const uint8_t ak[32],
                           const uint8_t ch[32], const uint8_t ck[32], const uint8_t nonce[32], const uint8_t *bind,
                           uint8_t out[32]) {
    const char *dom = proto == KV_LINK_HS_DISPATCH ? "kvasir-dispatch-auth-v3\n" : "kvasir-ring-auth-v1\n";
    const uint8_t r = (uint8_t)role, v[2] = {(uint8_t)ver, (uint8_t)(ver >> 8)};
    crypto_hash_sha256_state s;
    crypto_hash_sha256_init(&s);
    crypto_hash_sha256_update(&s, (const uint8_t *)dom, strlen(dom));
    crypto_hash_sha256_update(&s, &r, 1);
    crypto_hash_sha256_update(&s, (const uint8_t *)model, 64);
    if (proto == KV_LINK_HS_DISPATCH) crypto_hash_sha256_update(&s, v, 2);
    crypto_hash_sha256_update(&s, ak, 32);
    crypto_hash_sha256_update(&s, ch, 32);
    crypto_hash_sha256_update(&s, ck, 32);
    crypto_hash_sha256_update(&s, nonce, 32);
    if (bind) crypto_hash_sha256_update(&s, bind, 32);
    crypto_hash_sha256_final(&s, out);
}

/* One side's copy of everything a transcript covers (the other side builds
 * its own from what crossed the wire). */
typedef struct side {
    char model[65];
    uint16_t ver;
    uint8_t ak[32], ch[32], ck[32], nonce[32], bind[32];
    bool has_bind;
} side;

static kv_link_transcript side_t(const side *s, uint32_t proto) {
    return (kv_link_transcript){.proto = proto, .model_id = s->model, .version = s->ver, .acceptor_key = s->ak,
                                .challenge = s->ch, .connector_key = s->ck, .nonce = s->nonce,
                                .binding = s->has_bind ? s->bind : NULL};
}

static void test_transcript(void) {
    uint8_t apk[32], ask[64], cpk[32], csk[64];
    seed_key(21, apk, ask);
    seed_key(22, cpk, csk);
    for (uint32_t proto = 0; proto < KV_LINK_HS_COUNT; proto++) {
        for (int with_bind = 0; with_bind < 2; with_bind++) {
            side a = {.ver = 4, .has_bind = with_bind};
            randombytes_buf(a.ch, 32);
            randombytes_buf(a.nonce, 32);
            randombytes_buf(a.bind, 32);
            uint8_t mid[32];
            randombytes_buf(mid, 32);
            kv_hex(mid, 32, a.model);
            memcpy(a.ak, apk, 32);
            memcpy(a.ck, cpk, 32);
            side c = a; /* the connector's copy */
            const char roles[2][2] = {{'C', 'W'}, {'C', 'A'}};
            /* the digest is the protocol's definition, byte for byte, and the
             * codecs' own names for it agree */
            uint8_t dg[32], ref[32];
            for (int role = 0; role < 2; role++) {
                kv_link_transcript t = side_t(&a, proto);
                kv_link_transcript_digest(&t, role, dg);
                ref_transcript((int)proto, roles[proto][role], a.model, a.ver, a.ak, a.ch, a.ck, a.nonce,
                               with_bind ? a.bind : NULL, ref);
                ASSERT_EQ(memcmp(dg, ref, 32), 0);
                if (!with_bind && proto == KV_LINK_HS_DISPATCH) {
                    kv_dispatch_digest(roles[proto][role], a.model, a.ver, a.ak, a.ch, a.ck, a.nonce, ref);
                    ASSERT_EQ(memcmp(dg, ref, 32), 0);
                }
            }
            /* the connector signs, the acceptor verifies on its own copy, and back */
            uint8_t csig[64], asig[64];
            kv_link_transcript t = side_t(&c, proto);
            kv_link_transcript_sign(&t, KV_LINK_CONNECTOR, csk, csig);
            t = side_t(&a, proto);
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, cpk, csig), 0);
            kv_link_transcript_sign(&t, KV_LINK_ACCEPTOR, ask, asig);
            t = side_t(&c, proto);
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, apk, asig), 0);
            /* a signature never passes for the other role, key or protocol */
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, apk, csig), KV_EAUTH);
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, cpk, asig), KV_EAUTH);
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, apk, csig), KV_EAUTH);
            t.proto = 1 - proto;
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, cpk, csig), KV_EAUTH);
            /* a binding present on one side only fails */
            side nb = a;
            nb.has_bind = !with_bind;
            t = side_t(&nb, proto);
            ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, cpk, csig), KV_EAUTH);
            /* one flipped byte of any field fails; the version is covered by dispatch only */
            for (int field = 0; field < 7; field++) {
                if (field == 6 && !with_bind) continue;
                for (int k = 0; k < 4; k++) {
                    side x = a;
                    const int at = (int)randombytes_uniform(32);
                    switch (field) {
                    case 0: x.model[2 * at] = x.model[2 * at] == '0' ? '1' : '0'; break;
                    case 1: x.ver ^= (uint16_t)(1u << (k * 4)); break;
                    case 2: x.ak[at] ^= 1; break;
                    case 3: x.ch[at] ^= 0x80; break;
                    case 4: x.ck[at] ^= 4; break;
                    case 5: x.nonce[at] ^= 0x10; break;
                    default: x.bind[at] ^= 2; break;
                    }
                    t = side_t(&x, proto);
                    const int want = field == 1 && proto == KV_LINK_HS_RING ? 0 : KV_EAUTH;
                    ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, cpk, csig), want);
                    ASSERT_EQ(kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, apk, asig), want);
                }
            }
        }
    }
}

/* ---- blocking I/O ----------------------------------------------------------------- */

/* A peer that writes pieces of a pattern with pauses between them. */
typedef struct dribble {
    int fd;
    size_t piece, n_pieces;
    int pause_ms;
    bool close_after;
} dribble;

static uint8_t pattern_byte(size_t i) { return (uint8_t)(i * 131u + 7u); }

static void *dribble_main(void *arg) {
    dribble *b = arg;
    uint8_t buf[4096];
    size_t at = 0;
    for (size_t k = 0; k < b->n_pieces; k++) {
        struct timespec ts = {0, (long)b->pause_ms * 1000000L};
        nanosleep(&ts, NULL);
        for (size_t i = 0; i < b->piece; i++) buf[i] = pattern_byte(at + i);
        if (write(b->fd, buf, b->piece) != (ssize_t)b->piece) break;
        at += b->piece;
    }
    if (b->close_after) close(b->fd);
    return NULL;
}

static int g_cancel_calls;
static bool cancel_after_3(void *arg) {
    (void)arg;
    return ++g_cancel_calls >= 3;
}

/* A reader that drains a socket after a pause and counts what it got. */
typedef struct drain {
    int fd, pause_ms;
    size_t got;
    bool pattern_ok;
} drain;

static void *drain_main(void *arg) {
    drain *r = arg;
    struct timespec ts = {0, (long)r->pause_ms * 1000000L};
    nanosleep(&ts, NULL);
    uint8_t buf[65536];
    r->pattern_ok = true;
    ssize_t k;
    while ((k = read(r->fd, buf, sizeof buf)) > 0) {
        for (ssize_t i = 0; i < k; i++)
            if (buf[i] != pattern_byte(r->got + (size_t)i)) r->pattern_ok = false;
        r->got += (size_t)k;
    }
    return NULL;
}

static void test_io_read(void) {
    int sv[2];
    uint8_t buf[400];
    kv_diag d = {0};
    /* four pieces 60 ms apart: an idle limit of 200 ms holds over the
     * 240 ms, a total one of 100 ms does not */
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    dribble b = {.fd = sv[0], .piece = 100, .n_pieces = 4, .pause_ms = 60};
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, dribble_main, &b), 0);
    kv_link_io io = {.timeout_ms = 200, .idle = true};
    ASSERT_EQ(kv_link_read_full(sv[1], buf, sizeof buf, &io, &d), 0);
    ASSERT_EQ(io.got, sizeof buf);
    for (size_t i = 0; i < sizeof buf; i++) ASSERT_EQ(buf[i], pattern_byte(i));
    pthread_join(th, NULL);
    ASSERT_EQ(pthread_create(&th, NULL, dribble_main, &b), 0);
    io = (kv_link_io){.timeout_ms = 100, .peer = "the tester"};
    double t0 = now_ms();
    ASSERT_EQ(kv_link_read_full(sv[1], buf, sizeof buf, &io, &d), KV_ETIMEOUT);
    double took = now_ms() - t0;
    ASSERT_TRUE(took >= 99 && took < 1000);
    ASSERT_TRUE(io.got < sizeof buf && io.got % 100 == 0); /* what came is kept */
    ASSERT_TRUE(strstr(d.msg, "the tester") != NULL);
    pthread_join(th, NULL);
    /* the rest completes the same buffer */
    kv_link_io rest = {.timeout_ms = 1000};
    ASSERT_EQ(kv_link_read_full(sv[1], buf + io.got, sizeof buf - io.got, &rest, &d), 0);
    for (size_t i = 0; i < sizeof buf; i++) ASSERT_EQ(buf[i], pattern_byte(i));
    /* an idle limit shorter than the pause fails on the first pause */
    b.pause_ms = 150;
    b.n_pieces = 2;
    ASSERT_EQ(pthread_create(&th, NULL, dribble_main, &b), 0);
    io = (kv_link_io){.timeout_ms = 60, .idle = true};
    t0 = now_ms();
    ASSERT_EQ(kv_link_read_full(sv[1], buf, 200, &io, &d), KV_ETIMEOUT);
    took = now_ms() - t0;
    ASSERT_TRUE(took >= 59 && took < 1000);
    ASSERT_EQ(io.got, 0u);
    pthread_join(th, NULL);
    ASSERT_EQ(kv_link_read_full(sv[1], buf, 200, NULL, &d), 0); /* drain what came late */
    /* cancelled: asked every KV_LINK_POLL_MS, the third answer ends it */
    g_cancel_calls = 0;
    io = (kv_link_io){.timeout_ms = 5000, .idle = true, .cancelled = cancel_after_3};
    t0 = now_ms();
    ASSERT_EQ(kv_link_read_full(sv[1], buf, 10, &io, &d), KV_EIO);
    took = now_ms() - t0;
    ASSERT_TRUE(io.was_cancelled && !io.closed && g_cancel_calls == 3);
    ASSERT_TRUE(took >= 3 * KV_LINK_POLL_MS - 1 && took < 3 * KV_LINK_POLL_MS + 1000);
    /* a peer that closes inside the read: what came, then closed */
    b = (dribble){.fd = sv[0], .piece = 30, .n_pieces = 1, .pause_ms = 10, .close_after = true};
    ASSERT_EQ(pthread_create(&th, NULL, dribble_main, &b), 0);
    io = (kv_link_io){.timeout_ms = 2000};
    ASSERT_EQ(kv_link_read_full(sv[1], buf, 100, &io, &d), KV_EIO);
    ASSERT_TRUE(io.closed && io.got == 30);
    ASSERT_TRUE(strstr(d.msg, "closed the connection") != NULL);
    pthread_join(th, NULL);
    close(sv[1]);
}

static void test_io_write(void) {
    int sv[2];
    kv_diag d = {0};
    const size_t n = 8u << 20; /* far more than a socket buffers */
    uint8_t *big = malloc(n);
    ASSERT_TRUE(big != NULL);
    for (size_t i = 0; i < n; i++) big[i] = pattern_byte(i);
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    /* nobody reads: the deadline holds on a blocking fd, with part sent */
    kv_link_io io = {.timeout_ms = 100};
    double t0 = now_ms();
    ASSERT_EQ(kv_link_write_full(sv[0], big, n, &io, &d), KV_ETIMEOUT);
    double took = now_ms() - t0;
    ASSERT_TRUE(took >= 99 && took < 1000);
    ASSERT_TRUE(io.got > 0 && io.got < n);
    /* a reader that starts later: an idle limit longer than its pause sends all the rest */
    drain r = {.fd = sv[1], .pause_ms = 50};
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, drain_main, &r), 0);
    const size_t first = io.got;
    io = (kv_link_io){.timeout_ms = 2000, .idle = true};
    ASSERT_EQ(kv_link_write_full(sv[0], big + first, n - first, &io, &d), 0);
    ASSERT_EQ(io.got, n - first);
    close(sv[0]);
    pthread_join(th, NULL);
    ASSERT_EQ(r.got, n);
    ASSERT_TRUE(r.pattern_ok);
    close(sv[1]);
    /* a peer gone: KV_EIO, and no SIGPIPE (which would end this process) */
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    close(sv[1]);
    io = (kv_link_io){.timeout_ms = 1000};
    ASSERT_EQ(kv_link_write_full(sv[0], big, 1000, &io, &d), KV_EIO);
    close(sv[0]);
    free(big);
}

/* The voucher digest by its definition, with libsodium's SHA-256. */
static void ref_voucher_digest(const char *model, const uint8_t key[32], uint64_t exp, uint8_t out[32]) {
    uint8_t e[8];
    for (int i = 0; i < 8; i++) e[i] = (uint8_t)(exp >> (8 * i));
    crypto_hash_sha256_state s;
    crypto_hash_sha256_init(&s);
    crypto_hash_sha256_update(&s, (const uint8_t *)"kvasir-voucher-v1\n", 18);
    crypto_hash_sha256_update(&s, (const uint8_t *)model, 64);
    crypto_hash_sha256_update(&s, key, 32);
    crypto_hash_sha256_update(&s, e, 8);
    crypto_hash_sha256_final(&s, out);
}

static void test_voucher(void) {
    uint8_t hub_pk[32], hub_sk[64], coord_pk[32], coord_sk[64], other_pk[32], other_sk[64];
    seed_key(20, hub_pk, hub_sk);
    seed_key(21, coord_pk, coord_sk);
    seed_key(22, other_pk, other_sk);
    char model[65], model2[65];
    memset(model, 'a', 64);
    model[64] = 0;
    memcpy(model2, model, 65);
    model2[63] = 'b';
    const uint64_t exp = 1700000000123ull;
    uint8_t dg[32], ref[32], sig[64], refsig[64];
    kv_voucher_digest(model, coord_pk, exp, dg);
    ref_voucher_digest(model, coord_pk, exp, ref);
    ASSERT_EQ(memcmp(dg, ref, 32), 0);
    kv_voucher_sign(hub_sk, model, coord_pk, exp, sig);
    crypto_sign_detached(refsig, NULL, ref, 32, hub_sk);
    ASSERT_EQ(memcmp(sig, refsig, 64), 0);
    ASSERT_EQ(crypto_sign_verify_detached(sig, ref, 32, hub_pk), 0);
    ASSERT_EQ(kv_voucher_verify(hub_pk, model, coord_pk, exp, sig), 0);
    /* every field is bound */
    ASSERT_EQ(kv_voucher_verify(other_pk, model, coord_pk, exp, sig), KV_EAUTH); /* another hub */
    ASSERT_EQ(kv_voucher_verify(hub_pk, model2, coord_pk, exp, sig), KV_EAUTH);  /* another model */
    ASSERT_EQ(kv_voucher_verify(hub_pk, model, other_pk, exp, sig), KV_EAUTH);   /* another key */
    ASSERT_EQ(kv_voucher_verify(hub_pk, model, coord_pk, exp + 1, sig), KV_EAUTH); /* a later expiry */
    for (int i = 0; i < 64; i += 7) {
        uint8_t bad[64];
        memcpy(bad, sig, 64);
        bad[i] ^= 0x10;
        ASSERT_EQ(kv_voucher_verify(hub_pk, model, coord_pk, exp, bad), KV_EAUTH);
    }
    /* a voucher signed by the coordinator itself is not the hub's */
    kv_voucher_sign(coord_sk, model, coord_pk, exp, sig);
    ASSERT_EQ(kv_voucher_verify(hub_pk, model, coord_pk, exp, sig), KV_EAUTH);
}

/* ---- the dispatch handshake against a real worker ----------------------------- */

typedef struct tworker {
    kv_worker *w;
    pthread_t t;
    uint8_t pk[32], sk[64];
} tworker;

static void *worker_main(void *a) {
    kv_diag d = {0};
    kv_worker_serve(a, &d);
    return NULL;
}

/* A worker with key tag 40 that serves coordinator key tag 41 and vouchers of hub key tag 42. */
static int worker_up(tworker *tw) {
    char slabs[400];
    snprintf(slabs, sizeof slabs, "%s/sl", g_dir);
    seed_key(40, tw->pk, tw->sk);
    static uint8_t allow[1][32], hub_pk[32];
    uint8_t sk[64];
    seed_key(41, allow[0], sk);
    seed_key(42, hub_pk, sk);
    kv_worker_opts o = {.slabs = slabs, .listen = "127.0.0.1:0", .n_threads = 1, .quiet = true, .key_sk = tw->sk,
                        .allow_keys = (const uint8_t(*)[32])allow, .n_allow_keys = 1, .hub_key = hub_pk};
    kv_diag d = {0};
    if (kv_worker_open(&tw->w, &o, &d)) {
        fprintf(stderr, "worker: %s\n", d.msg);
        return -1;
    }
    return pthread_create(&tw->t, NULL, worker_main, tw->w);
}

static void worker_down(tworker *tw) {
    if (!tw->w) return;
    kv_worker_stop(tw->w);
    pthread_join(tw->t, NULL);
    kv_worker_free(tw->w);
    tw->w = NULL;
}

static uint64_t wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* One dial as caller key `tag`, expecting worker key wk; returns the code
 * and checks the fd contract (open exactly on success). */
static int dial(const char *addr, const char *model, const uint8_t wk[32], uint8_t tag, const kv_voucher *v,
                uint32_t n_embd, kv_link_dispatch *ln, kv_diag *d) {
    uint8_t pk[32], sk[64];
    seed_key(tag, pk, sk);
    const kv_link_dispatch_opts o = {.addr = addr, .model_id = model, .worker_key = wk, .sk = sk, .voucher = v,
                                     .n_embd = n_embd, .timeout_ms = 3000};
    int rc = kv_link_dial_dispatch(&o, ln, d);
    if (rc) ASSERT_EQ(ln->fd, -1);
    else ASSERT_TRUE(ln->fd >= 0);
    return rc;
}

/* STATS is answered only on an authenticated connection: an independent
 * sign that the handshake left the connection served. */
static int stats_on(const kv_link_dispatch *ln, kv_msg_stats *st) {
    uint8_t ob[KV_PROTO_HEADER], buf[4096];
    size_t n = 0;
    kv_diag d = {0};
    if (kv_msg_stats_encode(ob, sizeof ob, 7, &n, &d)) return -1;
    kv_frame_set_version(ob, ln->version);
    const kv_link_chan ch = {ln->fd, ln->tls};
    if (kv_proto_write_all_chan(&ch, ob, n, 2000, &d)) return -1;
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, sizeof buf);
    kv_msg m;
    if (kv_proto_read_msg_chan(&rx, &ch, 2000, NULL, &m, &d) || m.h.type != KV_MSG_STATS_ACK) return -1;
    *st = m.u.stats;
    return 0;
}

static void test_dial_worker(void) {
    tworker tw = {0};
    ASSERT_EQ(worker_up(&tw), 0);
    if (!tw.w) return;
    const char *addr = kv_worker_addr(tw.w), *model = kv_worker_model_id(tw.w);
    ASSERT_STREQ(model, g_m->model_id);
    kv_link_dispatch ln;
    kv_diag d = {0};
    kv_msg_stats st;

    /* the right key, a caller the worker allows */
    ASSERT_EQ(dial(addr, model, tw.pk, 41, NULL, g_m->n_embd, &ln, &d), 0);
    ASSERT_TRUE(ln.connected);
    ASSERT_EQ(ln.version, KV_PROTO_VERSION);
    ASSERT_EQ(ln.n_embd, g_m->n_embd);
    ASSERT_TRUE(ln.backend[0] != 0);
    if (ln.fd >= 0) {
        ASSERT_EQ(stats_on(&ln, &st), 0);
        kv_link_dispatch_close(&ln);
    }
    /* width unchecked (0) */
    ASSERT_EQ(dial(addr, model, tw.pk, 41, NULL, 0, &ln, &d), 0);
    kv_link_dispatch_close(&ln);

    /* the worker proves another key than the one expected */
    uint8_t other[32], osk[64];
    seed_key(43, other, osk);
    ASSERT_EQ(dial(addr, model, other, 41, NULL, g_m->n_embd, &ln, &d), KV_EAUTH);
    ASSERT_TRUE(strstr(d.msg, "proves another key") != NULL);
    ASSERT_TRUE(ln.connected);

    /* a caller the worker does not serve, without a voucher */
    ASSERT_EQ(dial(addr, model, tw.pk, 44, NULL, g_m->n_embd, &ln, &d), KV_EAUTH);

    /* the same stranger with the trusted hub's voucher is served */
    uint8_t spk[32], ssk[64], hpk[32], hsk[64];
    seed_key(44, spk, ssk);
    seed_key(42, hpk, hsk);
    kv_voucher v = {.expires_ms = wall_ms() + 600000};
    memcpy(v.key, spk, 32);
    kv_voucher_sign(hsk, model, spk, v.expires_ms, v.sig);
    ASSERT_EQ(dial(addr, model, tw.pk, 44, &v, g_m->n_embd, &ln, &d), 0);
    if (ln.fd >= 0) {
        ASSERT_EQ(stats_on(&ln, &st), 0);
        kv_link_dispatch_close(&ln);
    }
    /* bad vouchers: a flipped signature, another hub's, a later expiry than signed, expired */
    kv_voucher bad = v;
    bad.sig[17] ^= 4;
    ASSERT_EQ(dial(addr, model, tw.pk, 44, &bad, g_m->n_embd, &ln, &d), KV_EAUTH);
    bad = v;
    kv_voucher_sign(osk, model, spk, v.expires_ms, bad.sig);
    ASSERT_EQ(dial(addr, model, tw.pk, 44, &bad, g_m->n_embd, &ln, &d), KV_EAUTH);
    bad = v;
    bad.expires_ms += 1000;
    ASSERT_EQ(dial(addr, model, tw.pk, 44, &bad, g_m->n_embd, &ln, &d), KV_EAUTH);
    bad.expires_ms = wall_ms() - 1000;
    kv_voucher_sign(hsk, model, spk, bad.expires_ms, bad.sig);
    ASSERT_EQ(dial(addr, model, tw.pk, 44, &bad, g_m->n_embd, &ln, &d), KV_EAUTH);
    /* a voucher for another key does not carry over */
    ASSERT_EQ(dial(addr, model, tw.pk, 45, &v, g_m->n_embd, &ln, &d), KV_EAUTH);

    /* another model, another width */
    char m2[65];
    memcpy(m2, model, 65);
    m2[0] = m2[0] == 'a' ? 'b' : 'a';
    ASSERT_NE(dial(addr, m2, tw.pk, 41, NULL, g_m->n_embd, &ln, &d), 0);
    ASSERT_EQ(dial(addr, model, tw.pk, 41, NULL, g_m->n_embd + 1, &ln, &d), KV_EPROTO);
    /* bad arguments */
    ASSERT_EQ(dial(addr, "abc", tw.pk, 41, NULL, 0, &ln, &d), KV_EINVAL);
    ASSERT_EQ(kv_link_dial_dispatch(&(kv_link_dispatch_opts){.addr = addr, .model_id = model}, &ln, &d), KV_EINVAL);
    ASSERT_EQ(ln.fd, -1);

    /* the probe and the swarm's counters go through the same handshake */
    uint8_t cpk[32], csk[64];
    seed_key(41, cpk, csk);
    kv_probe_opts po = {.addr = addr, .model_id = model, .worker_key = tw.pk, .sk = csk};
    ASSERT_EQ(kv_probe_stats(&po, &st, &d), 0);
    kv_msg_stats ws;
    kv_worker_stats(tw.w, &ws);
    ASSERT_EQ(st.n_compute, ws.n_compute);
    po.worker_key = other;
    ASSERT_EQ(kv_probe_stats(&po, &st, &d), KV_EAUTH);
    worker_down(&tw);
}

/* ---- peers that misbehave ------------------------------------------------------ */

typedef struct fake {
    int lfd;
    int mode;          /* 0 close after HELLO, 1 silent, 2 relay to `to`, flipping a byte of AUTH_OK */
    const char *to;
    char addr[64];
    pthread_t t;
} fake;

static int listen_any(char *addr, size_t cap) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4) ||
        getsockname(fd, (struct sockaddr *)&a, &al))
        return -1;
    snprintf(addr, cap, "127.0.0.1:%u", ntohs(a.sin_port));
    return fd;
}

/* Copies worker -> client frame by frame (headers decoded by the codec),
 * flipping the last byte of AUTH_OK; client -> worker as it comes. */
static void relay(int c, const char *to) {
    int w = -1;
    kv_diag d = {0};
    if (kv_link_connect(to, 2000, &w, &d)) return;
    uint8_t buf[1 << 16];
    size_t have = 0;
    for (;;) {
        struct pollfd p[2] = {{.fd = c, .events = POLLIN}, {.fd = w, .events = POLLIN}};
        if (poll(p, 2, 3000) <= 0) break;
        if (p[0].revents) {
            uint8_t b[4096];
            ssize_t r = read(c, b, sizeof b);
            if (r <= 0 || write(w, b, (size_t)r) != r) break;
        }
        if (p[1].revents) {
            ssize_t r = read(w, buf + have, sizeof buf - have);
            if (r <= 0) break;
            have += (size_t)r;
            kv_frame_header h;
            while (have >= KV_PROTO_HEADER && !kv_frame_header_decode(buf, KV_PROTO_HEADER, &h, NULL) &&
                   have >= KV_PROTO_HEADER + h.len) {
                const size_t n = KV_PROTO_HEADER + h.len;
                if (h.type == KV_MSG_AUTH_OK && h.len) buf[n - 1] ^= 1;
                if (write(c, buf, n) != (ssize_t)n) goto out;
                memmove(buf, buf + n, have - n);
                have -= n;
            }
        }
    }
out:
    close(w);
}

static void *fake_main(void *a) {
    fake *f = a;
    int c = accept(f->lfd, NULL, NULL);
    if (c < 0) return NULL;
    if (f->mode == 0) {
        uint8_t b[256];
        (void)!read(c, b, sizeof b); /* the HELLO, then gone */
    } else if (f->mode == 1) {
        struct pollfd p = {.fd = c, .events = POLLRDHUP};
        poll(&p, 1, 5000); /* says nothing until the dialer gives up */
    } else {
        relay(c, f->to);
    }
    close(c);
    return NULL;
}

static int fake_dial(int mode, const char *to, const uint8_t wk[32], const char *model, int timeout_ms, kv_diag *d,
                     double *took) {
    fake f = {.mode = mode, .to = to};
    f.lfd = listen_any(f.addr, sizeof f.addr);
    if (f.lfd < 0 || pthread_create(&f.t, NULL, fake_main, &f)) return 1;
    uint8_t pk[32], sk[64];
    seed_key(41, pk, sk);
    /* the byte-flipping relay (mode 2) works on plaintext frames: over TLS
       the flipped byte fails the record instead (test_tls), and a relay
       that terminates TLS itself cannot pass the bound proof (test_tls_mitm) */
    const kv_link_dispatch_opts o = {.addr = f.addr, .model_id = model, .worker_key = wk, .sk = sk,
                                     .timeout_ms = timeout_ms, .plaintext = mode == 2};
    kv_link_dispatch ln;
    const double t0 = now_ms();
    int rc = kv_link_dial_dispatch(&o, &ln, d);
    *took = now_ms() - t0;
    ASSERT_EQ(ln.fd, -1);
    kv_link_dispatch_close(&ln);
    pthread_join(f.t, NULL);
    close(f.lfd);
    return rc;
}

static void test_dial_bad_peers(void) {
    kv_diag d = {0};
    double took = 0;
    uint8_t wk[32], sk[64];
    seed_key(40, wk, sk);
    /* closes after HELLO */
    ASSERT_EQ(fake_dial(0, NULL, wk, g_m->model_id, 3000, &d, &took), KV_EIO);
    ASSERT_TRUE(took < 2500);
    /* never answers: the deadline holds */
    ASSERT_EQ(fake_dial(1, NULL, wk, g_m->model_id, 400, &d, &took), KV_ETIMEOUT);
    ASSERT_TRUE(took >= 350 && took < 2000);
    /* nobody listens */
    char addr[64];
    int fd = listen_any(addr, sizeof addr);
    close(fd);
    uint8_t pk[32];
    seed_key(41, pk, sk);
    kv_link_dispatch ln;
    const kv_link_dispatch_opts o = {.addr = addr, .model_id = g_m->model_id, .worker_key = wk, .sk = sk};
    ASSERT_EQ(kv_link_dial_dispatch(&o, &ln, &d), KV_EIO);
    ASSERT_TRUE(!ln.connected);
    ASSERT_EQ(ln.fd, -1);
    /* a relay that flips one byte of the worker's AUTH_OK: the proof fails */
    tworker tw = {0};
    ASSERT_EQ(worker_up(&tw), 0);
    if (!tw.w) return;
    ASSERT_EQ(fake_dial(2, kv_worker_addr(tw.w), tw.pk, g_m->model_id, 3000, &d, &took), KV_EAUTH);
    ASSERT_TRUE(strstr(d.msg, "AUTH_OK does not verify") != NULL);
    worker_down(&tw);
}

static int setup(void) {
    signal(SIGPIPE, SIG_IGN);
    if (sodium_init() < 0) return 1;
    const char *bin = getenv("KV_BIN");
    if (!bin) {
        fprintf(stderr, "KV_BIN is not set\n");
        return 1;
    }
    snprintf(g_dir, sizeof g_dir, "%s/kv_link_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) return 1;
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' gen-model --preset tiny --out '%s/m.gguf' >/dev/null 2>&1 && "
             "'%s' slice '%s/m.gguf' --out '%s/sl' --experts-per-slab 4 >/dev/null 2>&1",
             bin, g_dir, bin, g_dir, g_dir);
    if (system(cmd)) return 1;
    char man[400];
    snprintf(man, sizeof man, "%s/sl/manifest.json", g_dir);
    kv_diag d = {0};
    if (kv_manifest_load(&g_m, man, &d)) {
        fprintf(stderr, "%s\n", d.msg);
        return 1;
    }
    return 0;
}

static void teardown(void) {
    kv_manifest_free(g_m);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    (void)!system(cmd);
}

static const kvt_case cases[] = {
    KVT_CASE(test_hex_round_trip), KVT_CASE(test_hex_rejects), KVT_CASE(test_key_file),
    KVT_CASE(test_sign_verify),    KVT_CASE(test_transcript),  KVT_CASE(test_io_read),
    KVT_CASE(test_io_write),       KVT_CASE(test_voucher),     KVT_CASE(test_dial_worker),
    KVT_CASE(test_dial_bad_peers),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
