/* A ring node (include/kvasir/ring.h): one layer window of a model, its
 * sequences' caches, the link to the node after it (dialed, redialed when
 * it drops), the link from the node before it (accepted), and clients.
 *
 * Roles follow from the window: the head (layer 0) begins sequences
 * (embeds prompts and tokens), the tail (last layer) samples; a node may be
 * both (a ring of one links to itself). Every frame a node forwards
 * unchanged (START on its way to the head, TOKEN, ERROR, BROKEN, PROBE) is
 * sent as the bytes received.
 *
 * Invariants: a sequence id is known to a node from its START to its last
 * TOKEN (or ERROR, or a break); frames of an unknown sequence are dropped,
 * never computed, and a replayed request takes a fresh id, so nothing that
 * crossed a break reaches a client. A HIDDEN frame must start at the
 * sequence's next position here (the ring keeps every node's positions in
 * step); anything else fails the request. The home keeps the tokens of its
 * requests (prompt + streamed) so that it can replay them.
 *
 * Hot path: a HIDDEN frame is decoded in place, its floats widened into a
 * buffer allocated once, computed with kv_state_batch_window (the engine's
 * own forward pass over the window) and the output encoded straight into the
 * next link's send buffer. Compute runs on the loop's thread; the pool
 * parallelizes it. */
#include <errno.h>
#include <pthread.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/prefix_cache.h" /* the prompt cache of this node's window */
#include "engine/spec.h" /* the draft sources' guesses */
#include "kvasir/dispatch_demand.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"   /* KV_STOP_* */
#include "kvasir/grammar.h"
#include "kvasir/link.h"
#include "kvasir/model.h"
#include "kvasir/net.h"
#include "kvasir/pieces.h"
#include "kvasir/ring.h"
#include "kvasir/slice.h"
#include "kvasir/transport.h"
#include "kvasir/pieces.h"

#include <sodium.h>

#define KV_RN_HELLO_MS 5000        /* an accepted connection must say HELLO within this */
#define KV_RN_REDIAL_MS 200        /* next link: pause between dials */
#define KV_RN_PROBE_MS 500         /* resend a probe while the ring is not whole */
#define KV_RN_TICK_MS 100          /* replay deadlines checked this often */
#define KV_RN_TX_MAX (1024u << 20) /* bytes queued on one link at most */
#define KV_RN_MAX_CONNS 256u     /* accepted connections at once (links and clients) */

typedef struct kv_rconn kv_rconn;

/* A sequence this node holds state for. */
typedef struct kv_rseq {
    uint64_t seq;        /* ring id; 0 = free */
    uint32_t home;       /* first layer of its home */
    kv_ring_params p;
    kv_sampler *smp;     /* tail: its sampler (penalty history = prompt + sampled) */
    uint32_t n_gen;      /* tail: tokens sampled */
    kv_grammar *gram;    /* tail: the request's grammar (EXT), NULL none */
    kv_grammar_matcher *gm; /* tail: its position in gram */
    uint32_t *gmask;     /* tail: [(n_vocab + 31) / 32] the tokens gram allows next */
    bool gdone;          /* tail: gram is complete (nothing but end-of-generation may follow) */
    /* speculative decoding (docs/SPECULATIVE.md "Over the ring") */
    uint32_t spec_pos0, spec_n; /* every node: the last verify pass's first position and tokens (0: none) */
    int32_t *ctx;        /* tail, drafting: [ctx_cap] the prompt, then every token sampled */
    uint32_t n_ctxt, ctx_cap;
    int32_t *drec;       /* tail, test source: [p.n_draft_rec] the recording (a copy) */
    uint32_t gen0;       /* tail: tokens generated before this attempt (a replay's p.n_gen) */
    uint32_t n_draft;    /* tail: drafts sent after the last token, verified by the next pass */
    int32_t draft[KV_RING_MAX_DRAFT];
    int32_t *ptok;       /* prompt cache: [n_ptok] the START's tokens of its whole blocks (their key) */
    uint32_t n_ptok;     /* a multiple of the cache block */
} kv_rseq;

/* A request whose home is this node. */
typedef struct kv_rreq {
    uint64_t id;         /* the client sees this one */
    uint64_t seq;        /* ring id of the current attempt; 0 while held */
    kv_rconn *client;    /* NULL once the client left */
    kv_ring_params p;    /* its views (bias, grammar) point at the two below */
    kv_logit_bias *bias; /* [p.sample.n_bias] the logit bias (a copy), NULL none */
    char *grammar;       /* [p.grammar_len] the grammar text (a copy), NULL none */
    int32_t *drec;       /* [p.n_draft_rec] a test draft's recording (a copy), NULL none */
    int32_t *toks;       /* [cap] prompt, then the tokens streamed */
    uint32_t n_prompt, n_gen, cap;
    bool held;           /* waiting for the ring to be whole */
    bool looking;        /* its LOOKUP (id seq) is on its way round the ring */
    bool no_cache;       /* an attempt missed the caches: begin from position 0 from now on */
    uint32_t n_cached;   /* positions the current attempt took from the caches */
    int64_t deadline_ms; /* while held */
    struct kv_rreq *next;
} kv_rreq;

struct kv_rconn {
    kv_ring_node *n;
    kv_net_conn *nc;
    enum { KV_RC_NEW = 0, KV_RC_AUTH, KV_RC_PREV, KV_RC_CLIENT, KV_RC_NEXT } role;
    bool acked;          /* NEXT: HELLO_ACK received and the acceptor's AUTH_OK checked */
    bool hello_ok;       /* NEXT: HELLO_ACK received (AUTH_CHALLENGE next) */
    kv_ring_hello peer;  /* AUTH: the HELLO that waits for its AUTH; NEXT: the HELLO_ACK */
    uint8_t challenge[32]; /* AUTH: ours; NEXT: the acceptor's */
    uint8_t peer_key[32];  /* NEXT: the acceptor's key */
    uint8_t nonce[32];     /* NEXT: ours */
    kv_rreq *req;        /* CLIENT: its request (one at a time) */
    kv_net_timer hs_t;   /* HELLO deadline */
    kv_link_sniff *tp;   /* the transport (owned by nc): TLS, or plaintext */
    bool loopback;       /* accepted from a loopback address */
    kv_rconn *lprev, *lnext; /* the node's list of connections (freed with it) */
};

struct kv_ring_node {
    kv_ring_node_opts o;
    kv_model *m;
    kv_pieces *pc;            /* sliced model: the manifest's pieces present here (the window's slabs) */
    kv_remote *remote;        /* --worker: the window's experts computed by expert workers */
    kv_expert_provider prov;  /* over the slices (owned) */
    kv_demand_meter *meter;   /* counts prov's calls per shard (sliced, no --worker) */
    kv_draft *mtp;            /* tail: the MTP draft source (the model's block after the head), NULL: none */
    char mtp_why[512];        /* tail: why there is none (a --draft mtp request is refused with it) */
    pthread_mutex_t dm_mu;    /* guards dm, dm_tokens (read by the hub's demand reporter) */
    kv_remote_demand *dm;     /* [n_slabs of the manifest] demand as of the last pass, NULL: not sliced */
    uint64_t dm_tokens;       /* tokens run through the window, as of the last pass */
    kv_pool *pool;
    kv_state *st;
    const kv_hparams *hp;
    uint32_t n_layer, n_embd, n_vocab, n_ctx, n_batch, max_seqs;
    bool head, tail;
    char model_id[KV_RING_MODEL_ID_LEN + 1];
    uint8_t sk[64];           /* this node's Ed25519 key (seed || pk) */
    kv_tls_ctx *tls;          /* its TLS context (a certificate of its key) */
    uint8_t (*allow)[32];     /* [n_allow] keys admitted (a copy) */
    uint8_t hub_key[32];      /* vouchers by this hub admit a key too */
    bool has_hub_key;
    char next_addr[256];
    kv_net_loop *loop;
    int lfd;
    kv_net_watch lw;
    char addr[128];
    struct sockaddr_storage next_sa;
    socklen_t next_salen;
    kv_rconn *next;           /* dialed link (NULL while down) */
    uint32_t next_first, next_last;
    kv_rconn *prev;           /* accepted link from the node before */
    uint32_t prev_first, prev_last; /* its window */
    pthread_mutex_t next_mu;  /* guards next_want, next_changed (set from other threads) */
    char next_want[256];      /* kv_ring_node_set_next's address */
    bool next_changed;
    kv_net_timer redial_t, probe_t, tick_t;
    bool ring_up;             /* a probe of ours, or someone's "whole", went round */
    uint64_t nonce;
    char why[256];            /* the last break */
    kv_rseq *seqs;            /* [max_seqs]; index = state sequence */
    kv_rreq *reqs;            /* home requests */
    kv_rconn *conns;          /* every connection alive */
    uint32_t n_conns;         /* of them */
    kv_net_budget budget;     /* bytes buffered by accepted connections */
    struct kv_rdelay *dq_head, *dq_tail, *stage; /* --link-delay-ms FIFO, a frame being written */
    size_t dq_bytes;
    kv_net_timer delay_t;
    uint64_t id_base, id_ctr;
    uint32_t max_tok;         /* tokens per forward pass: max(n_batch, max_seqs) */
    float *xin, *xout;        /* [max_tok][n_embd] queued hidden states in, results out */
    float *logits;            /* [rows_cap][n_vocab] */
    uint32_t rows_cap;        /* logit rows per forward pass: max_seqs + room for two verify passes */
    int32_t *tbuf;            /* [n_batch] a prompt chunk */
    int32_t *q_tok;           /* [max_tok] queued tokens (head) */
    uint32_t *sbuf;           /* [max_tok] state sequence of each queued token */
    uint32_t *q_out;          /* [max_seqs] queue index of each logits row */
    struct kv_rjob *jobs;     /* [max_tok] queued frames */
    uint32_t n_jobs, q_n, n_out_q; /* frames, tokens and logit rows queued */
    kv_grammar_vocab *gvocab; /* tail: the vocabulary's trie, built at the first grammar */
    uint8_t *vocab;           /* the tokenizer GGUF VOCAB_ACK sends, built at the first VOCAB */
    size_t vocab_len;
    kv_ring_node_stats stats;
    /* the prompt cache (docs/PROTOCOL.md "Prompt cache over the ring"): this window's K/V rows and
       recurrent states of prompt blocks, keyed by the prompt's tokens from position 0 */
    kv_pcache *pcache;        /* NULL: none (--prompt-cache 0) */
    uint32_t pc_block;        /* tokens per block */
    bool pc_rec;              /* this window holds recurrent layers: a block is resumable only with a state */
    kv_pc_entry **pc_path;    /* [n_ctx / pc_block + 1] a matched chain */
    uint32_t pc_starts;       /* STARTs that began from the cache here (the test_cache_drop hook) */
    int32_t *pc_tok;          /* [n_ctx] a LOOKUP's or START's tokens as host ints */
    uint8_t *pc_bits;         /* [n_ctx / pc_block / 8 + 1] a LOOKUP's state bits being built */
};

static double kv_rn_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

__attribute__((format(printf, 2, 3))) static void kv_rn_log(kv_ring_node *n, const char *fmt, ...) {
    if (!n->o.log) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(n->o.log, "kvasir ring %u-%u: ", n->o.first, n->o.last);
    vfprintf(n->o.log, fmt, ap);
    fputc('\n', n->o.log);
    fflush(n->o.log);
    va_end(ap);
}

/* ---- sending ------------------------------------------------------------------ */

/* --link-delay-ms: frames to the next node wait in a FIFO (an emulated
 * one-way link latency where netem is not available). */
typedef struct kv_rdelay {
    struct kv_rdelay *next;
    int64_t due_ms;
    size_t len;
    uint8_t data[];
} kv_rdelay;

static bool kv_rn_delayed(const kv_rconn *c) { return c && c->role == KV_RC_NEXT && c->n->o.link_delay_ms; }

static void kv_rn_delay_drop(kv_ring_node *n) {
    while (n->dq_head) {
        kv_rdelay *e = n->dq_head;
        n->dq_head = e->next;
        free(e);
    }
    n->dq_tail = NULL;
    n->dq_bytes = 0;
    free(n->stage);
    n->stage = NULL;
}

static void kv_rn_delay_push(kv_ring_node *n, kv_rdelay *e, size_t len) {
    e->next = NULL;
    e->len = len;
    e->due_ms = kv_net_now_ms() + n->o.link_delay_ms;
    if (n->dq_tail) n->dq_tail->next = e;
    else n->dq_head = e;
    n->dq_tail = e;
    n->dq_bytes += len;
    if (n->dq_bytes > KV_RN_TX_MAX && n->next) {
        kv_net_conn_close(n->next->nc, KV_ENOMEM, "delayed output over its bound");
        return;
    }
    if (!kv_net_timer_armed(&n->delay_t)) kv_net_timer_start(n->loop, &n->delay_t, n->o.link_delay_ms);
}

static void kv_rn_delay_timer(kv_net_loop *l, kv_net_timer *t) {
    kv_ring_node *n = t->data;
    const int64_t now = kv_net_now_ms();
    while (n->dq_head && n->dq_head->due_ms <= now) {
        kv_rdelay *e = n->dq_head;
        n->dq_head = e->next;
        if (!n->dq_head) n->dq_tail = NULL;
        n->dq_bytes -= e->len;
        if (n->next && !kv_net_conn_closing(n->next->nc)) (void)kv_net_conn_send(n->next->nc, e->data, e->len);
        free(e);
    }
    if (n->dq_head) kv_net_timer_start(l, t, n->dq_head->due_ms - now);
}

/* Room for a frame of sz bytes on c (NULL: the link is gone or full; it
 * closes); kv_rn_commit sends the len bytes written there. */
static uint8_t *kv_rn_reserve(kv_rconn *c, size_t sz) {
    if (!c || kv_net_conn_closing(c->nc)) return NULL;
    if (kv_rn_delayed(c)) {
        free(c->n->stage);
        c->n->stage = malloc(sizeof(kv_rdelay) + sz);
        return c->n->stage ? c->n->stage->data : NULL;
    }
    return kv_net_conn_reserve(c->nc, sz);
}

static void kv_rn_commit(kv_rconn *c, size_t len) {
    if (kv_rn_delayed(c)) {
        kv_rdelay *e = c->n->stage;
        c->n->stage = NULL;
        if (e) kv_rn_delay_push(c->n, e, len);
        return;
    }
    kv_net_conn_commit(c->nc, len);
}

static void kv_rn_send_raw(kv_rconn *c, const uint8_t *f, size_t len) {
    if (!c || kv_net_conn_closing(c->nc)) return;
    if (kv_rn_delayed(c)) {
        kv_rdelay *e = malloc(sizeof *e + len);
        if (!e) return;
        memcpy(e->data, f, len);
        kv_rn_delay_push(c->n, e, len);
        return;
    }
    (void)kv_net_conn_send(c->nc, f, len);
}

static void kv_rn_send_error(kv_rconn *c, uint64_t seq, int code, uint32_t origin, const char *msg) {
    uint8_t buf[KV_RING_HEADER + 20 + KV_RING_MAX_MSG];
    size_t len;
    if (kv_ring_error_encode(buf, sizeof buf, seq, code, origin, msg, &len, NULL)) return;
    if (kv_link_sniff_undecided(c->tp)) { /* silent so far: told in plaintext, best effort (the worker's way) */
        ssize_t r = send(kv_net_conn_fd(c->nc), buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)r;
        return;
    }
    kv_rn_send_raw(c, buf, len);
}

static bool kv_rn_next_up(const kv_ring_node *n) { return n->next && n->next->acked && !kv_net_conn_closing(n->next->nc); }
static bool kv_rn_next_is_tail(const kv_ring_node *n) { return n->next_last == n->n_layer - 1; }

/* ---- sequences ------------------------------------------------------------------ */

static kv_rseq *kv_rn_seq(kv_ring_node *n, uint64_t seq) {
    for (uint32_t i = 0; i < n->max_seqs; i++)
        if (n->seqs[i].seq == seq) return &n->seqs[i];
    return NULL;
}
static uint32_t kv_rn_slot(const kv_ring_node *n, const kv_rseq *s) { return (uint32_t)(s - n->seqs); }

static void kv_rn_seq_free(kv_ring_node *n, kv_rseq *s) {
    if (!s || !s->seq) return;
    kv_state_reset_seq(n->st, kv_rn_slot(n, s));
    kv_draft_reset(n->mtp, kv_rn_slot(n, s));
    kv_sampler_free(s->smp);
    kv_grammar_matcher_free(s->gm);
    kv_grammar_free(s->gram);
    free(s->gmask);
    free(s->ctx);
    free(s->drec);
    free(s->ptok);
    memset(s, 0, sizeof *s);
}

/* The grammar limits of a sequence: the gateway's per request (the text
 * bound of the wire and the same matcher memory), so a grammar the gateway
 * accepted is accepted here and its tables flush at the same points. */
static void kv_rn_grammar_limits(kv_grammar_limits *lim) {
    kv_grammar_limits_default(lim);
    lim->max_memory_bytes = KV_RING_GRAMMAR_MEMORY;
    lim->max_text_bytes = KV_RING_MAX_GRAMMAR;
}

/* The tail's half of a sequence beginning: its sampler (logit bias and
 * penalties of the extension), fed the prompt, and its grammar; in a replay
 * the generated tokens (the last p.n_gen) are fed as the engine feeds a
 * sampled token (kv_sampler_accept_sampled, the grammar advanced past it),
 * so the draws that follow are the ones an unbroken sequence makes. */
static int kv_rn_tail_begin(kv_ring_node *n, kv_rseq *s, const kv_ring_start *st, kv_diag *d) {
    kv_sample_params sp = st->p.sample;
    kv_logit_bias bias[KV_SAMPLE_MAX_BIAS];
    for (uint32_t i = 0; i < sp.n_bias; i++) {
        float b[1];
        bias[i].token = kv_ring_tokens_get(st->p.bias_wire, 2 * i);
        kv_ring_floats_get(st->p.bias_wire + 8 * (size_t)i + 4, 1, b);
        bias[i].bias = b[0];
        if ((uint32_t)bias[i].token >= n->n_vocab)
            return kv_fail(d, KV_ERANGE, "ring: logit bias token %d outside the vocabulary [0, %u)", bias[i].token, n->n_vocab);
    }
    sp.bias = sp.n_bias ? bias : NULL;
    int rc = kv_sampler_new(&s->smp, (int32_t)n->n_vocab, &sp, d);
    if (rc) return rc;
    if (st->p.grammar_len) {
        kv_grammar_limits lim;
        kv_rn_grammar_limits(&lim);
        if (!n->gvocab && (rc = kv_grammar_vocab_from_tok(&n->gvocab, kv_model_tok(n->m), d))) return rc;
        if ((rc = kv_grammar_parse(&s->gram, st->p.grammar, st->p.grammar_len, &lim, d))) return rc;
        if ((rc = kv_grammar_matcher_new(&s->gm, s->gram, d))) return rc;
        if (!(s->gmask = malloc(((size_t)n->n_vocab + 31) / 32 * sizeof *s->gmask)))
            return kv_fail(d, KV_ENOMEM, "ring: out of memory for a grammar mask");
    }
    if (st->p.flags & KV_RING_SUBMIT_DRAFT) { /* the drafts are made here, from the context */
        if (st->p.draft_kind == KV_RING_DRAFT_MTP) {
            if (!n->mtp)
                return kv_fail(d, KV_EUNSUPPORTED, "the tail cannot draft with --draft mtp: %s", n->mtp_why);
            /* its experts are the block's (layer n_layer): served now, or refused here, not at the first draft */
            if (n->remote && (rc = kv_remote_check_layer(n->remote, n->n_layer, d)))
                return kv_diag_prefix(d, rc, "the tail cannot draft with --draft mtp (the MTP block's experts, layer %u)",
                                      n->n_layer);
            kv_draft_reset(n->mtp, kv_rn_slot(n, s));
        }
        s->ctx_cap = n->n_ctx + KV_RING_MAX_DRAFT + 2;
        if (!(s->ctx = malloc((size_t)s->ctx_cap * sizeof *s->ctx)))
            return kv_fail(d, KV_ENOMEM, "ring: out of memory for a drafting context");
        for (uint32_t i = 0; i < st->n_tokens; i++) s->ctx[i] = kv_ring_tokens_get(st->tokens, i);
        s->n_ctxt = st->n_tokens;
        s->gen0 = st->p.n_gen;
        if (st->p.n_draft_rec) {
            if (!(s->drec = malloc((size_t)st->p.n_draft_rec * sizeof *s->drec)))
                return kv_fail(d, KV_ENOMEM, "ring: out of memory for a draft recording");
            for (uint32_t i = 0; i < st->p.n_draft_rec; i++) {
                s->drec[i] = kv_ring_tokens_get(st->p.draft_rec_wire, i);
                if ((uint32_t)s->drec[i] >= n->n_vocab)
                    return kv_fail(d, KV_ERANGE, "ring: recorded draft token %d outside the vocabulary [0, %u)",
                                   s->drec[i], n->n_vocab);
            }
        }
    }
    const uint32_t n_prompt = st->n_tokens - st->p.n_gen;
    for (uint32_t i = 0; i < n_prompt; i++) kv_sampler_accept(s->smp, kv_ring_tokens_get(st->tokens, i));
    for (uint32_t i = n_prompt; i < st->n_tokens; i++) {
        const int32_t t = kv_ring_tokens_get(st->tokens, i);
        if (s->gm && (rc = kv_grammar_accept(s->gm, n->gvocab, t, d))) return rc;
        kv_sampler_accept_sampled(s->smp, t);
    }
    return 0;
}

/* ---- the prompt cache ------------------------------------------------------------ *
 * Each node keeps the prompt blocks its window computed (kv_pcache: the K/V
 * rows of its layers and, with recurrent layers, the state at a block's end
 * when a pass ended there), keyed by the prompt's tokens from position 0
 * and checked exactly. A reused prefix must be held by every window alike,
 * and each node evicts on its own: so before a sequence begins, its home
 * sends a LOOKUP round the ring in which every node lowers the count of
 * blocks all hold and clears the blocks it could not resume after; the
 * START then says how many positions every node copies instead of
 * computing. A node that no longer holds them (evicted since) fails the
 * sequence with KV_ENOTFOUND, and its home begins it again from position 0:
 * a copy is never partial, and never of other tokens. Only blocks wholly
 * inside a START's tokens are stored: every node knows those tokens (a
 * generated token is known to the tail and the head only), and no verify
 * pass reaches them. */

static void kv_rn_put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* Tokens [0, nt) of a wire view into n->pc_tok (nt <= n_ctx). */
static void kv_rn_pc_tokens(kv_ring_node *n, const uint8_t *wire, uint32_t nt) {
    for (uint32_t i = 0; i < nt; i++) n->pc_tok[i] = kv_ring_tokens_get(wire, i);
}

/* This node's part of a LOOKUP of n_blocks blocks of B tokens (n->pc_tok
 * holds its first min(n_blocks, n_ctx / B) blocks): lowers *n_match to the
 * blocks its cache holds and clears bit k of state for every block it
 * cannot resume after. The chain it holds is touched (most recently used):
 * it is about to be copied. Allocates nothing. */
static void kv_rn_lookup_apply(kv_ring_node *n, uint32_t B, uint32_t n_blocks, uint32_t *n_match, uint8_t *state) {
    n->stats.cache_lookups++;
    uint32_t m = 0;
    if (n->pcache && B == n->pc_block) {
        const uint32_t nb = n_blocks < n->n_ctx / B ? n_blocks : n->n_ctx / B;
        m = kv_pcache_match(n->pcache, n->pc_tok, nb * B, nb, n->pc_path);
        kv_pcache_touch(n->pcache, n->pc_path, m);
    }
    if (*n_match > m) *n_match = m;
    for (uint32_t k = 0; k < n_blocks; k++)
        if (k >= m || (n->pc_rec && !kv_pc_entry_rec(n->pc_path[k]))) state[k / 8] &= (uint8_t)~(1u << (k % 8));
}

/* A sequence that begins from the prompt cache: positions [0, n_cached)
 * become the blocks this node holds for exactly those tokens (with the
 * recurrent state after the last); else KV_ENOTFOUND, a clear miss (its
 * home begins it again from position 0). On failure the slot is empty. */
static int kv_rn_cache_restore(kv_ring_node *n, kv_rseq *s, const kv_ring_start *st, kv_diag *d) {
    const uint32_t slot = kv_rn_slot(n, s), B = n->pc_block, nc = st->n_cached;
    const uint32_t nb = n->pcache ? nc / B : 0;
    uint32_t m = 0;
    if (n->pcache && n->o.test_cache_drop && ++n->pc_starts == n->o.test_cache_drop) {
        kv_pcache *fresh = NULL; /* the test hook: every block evicted since the LOOKUP */
        kv_diag hd = {0};
        if (!kv_pcache_new(&fresh, n->o.prompt_cache_bytes, B, kv_state_kv_bytes(n->st, B), kv_state_rec_bytes(n->st), &hd)) {
            kv_pcache_free(n->pcache);
            n->pcache = fresh;
            kv_rn_log(n, "test hook: prompt cache emptied before sequence %016llx", (unsigned long long)st->seq);
        }
    }
    if (nb && nc % B == 0 && nc <= n->n_ctx) {
        kv_rn_pc_tokens(n, st->tokens, nc);
        m = kv_pcache_match(n->pcache, n->pc_tok, nc, nb, n->pc_path);
    }
    if (!nb || nc % B || m < nb || (n->pc_rec && !kv_pc_entry_rec(n->pc_path[nb - 1]))) {
        n->stats.cache_misses++;
        return kv_fail(d, KV_ENOTFOUND, "prompt cache miss: the %u positions agreed on are no longer held here "
                       "(evicted since the lookup); the home begins the sequence again from position 0", nc);
    }
    kv_diag rd = {0};
    int rc = kv_state_reserve(n->st, slot, nc, &rd);
    for (uint32_t i = 0; !rc && i < nb; i++) rc = kv_state_kv_set(n->st, slot, i * B, B, kv_pc_entry_kv(n->pc_path[i]), &rd);
    if (!rc) rc = kv_state_seq_resume(n->st, slot, nc, kv_pc_entry_rec(n->pc_path[nb - 1]), &rd);
    if (rc) {
        kv_state_reset_seq(n->st, slot);
        n->stats.cache_misses++;
        return kv_fail(d, KV_ENOTFOUND, "prompt cache miss: the %u cached positions could not be restored (%.300s); "
                       "the home begins the sequence again from position 0", nc, rd.msg);
    }
    kv_pcache_touch(n->pcache, n->pc_path, nb);
    kv_rn_log(n, "sequence %016llx: %u positions from the prompt cache", (unsigned long long)st->seq, nc);
    n->stats.cache_hits++;
    n->stats.cache_tokens += nc;
    return 0;
}

typedef struct kv_rn_fill_arg {
    kv_state *st;
    uint32_t seq, p0, n;
} kv_rn_fill_arg;

static int kv_rn_pc_fill(void *arg, void *kv, void *rec) {
    const kv_rn_fill_arg *a = arg;
    kv_diag d = {0};
    if (kv && kv_state_kv_get(a->st, a->seq, a->p0, a->n, kv, &d)) return d.code ? d.code : KV_EINVAL;
    if (rec && kv_state_rec_get(a->st, a->seq, rec, &d)) return d.code ? d.code : KV_EINVAL;
    return 0;
}

/* After a pass that took s over positions [p0, p1): stores the prompt
 * blocks it completed, under the cached chain of the blocks before them
 * (none when that chain is no longer whole); the recurrent state goes with
 * the block that ends where s now stands. */
static void kv_rn_cache_store(kv_ring_node *n, kv_rseq *s, uint32_t p0, uint32_t p1) {
    if (!n->pcache || !s->ptok) return;
    const uint32_t B = n->pc_block, slot = kv_rn_slot(n, s), pos = kv_state_pos_seq(n->st, slot);
    const uint32_t k0 = p0 / B, k1 = (p1 < s->n_ptok ? p1 : s->n_ptok) / B;
    if (k0 >= k1) return;
    if (kv_pcache_match(n->pcache, s->ptok, k0 * B, k0, n->pc_path) < k0) return;
    kv_pc_entry *parent = k0 ? n->pc_path[k0 - 1] : NULL;
    for (uint32_t k = k0; k < k1; k++) {
        kv_rn_fill_arg a = {n->st, slot, k * B, B};
        if (!(parent = kv_pcache_insert(n->pcache, parent, k, s->ptok + (size_t)k * B, (k + 1) * B == pos,
                                        kv_rn_pc_fill, &a)))
            break;
    }
}

/* A slot for a sequence beginning (tail: its sampler, fed the prompt). */
static int kv_rn_seq_new(kv_ring_node *n, const kv_ring_start *st, kv_rseq **out, kv_diag *d) {
    *out = NULL;
    if (kv_rn_seq(n, st->seq)) return kv_fail(d, KV_EPROTO, "ring: sequence %016llx begun twice", (unsigned long long)st->seq);
    if (st->n_tokens > n->n_ctx)
        return kv_fail(d, KV_ECTXFULL, "ring: a prompt of %u tokens does not fit the context of %u", st->n_tokens, n->n_ctx);
    for (uint32_t i = 0; i < st->n_tokens; i++)
        if ((uint32_t)kv_ring_tokens_get(st->tokens, i) >= n->n_vocab)
            return kv_fail(d, KV_ERANGE, "ring: prompt token %d out of range (vocab %u)", kv_ring_tokens_get(st->tokens, i), n->n_vocab);
    kv_rseq *s = kv_rn_seq(n, 0);
    if (!s) return kv_fail(d, KV_ENOMEM, "ring: node %u-%u holds %u sequences already", n->o.first, n->o.last, n->max_seqs);
    if (n->tail) {
        const int rc = kv_rn_tail_begin(n, s, st, d);
        if (rc) {
            kv_sampler_free(s->smp);
            kv_grammar_matcher_free(s->gm);
            kv_grammar_free(s->gram);
            free(s->gmask);
            free(s->ctx);
            free(s->drec);
            memset(s, 0, sizeof *s);
            return rc;
        }
    }
    s->seq = st->seq;
    s->home = st->home;
    s->p = st->p;
    s->p.bias_wire = NULL; /* views into the START frame, used above only */
    s->p.grammar = NULL;
    s->p.draft_rec_wire = NULL;
    s->p.draft_rec = NULL;
    s->n_gen = 0;
    kv_state_reset_seq(n->st, kv_rn_slot(n, s));
    if (n->pcache && (s->n_ptok = st->n_tokens / n->pc_block * n->pc_block) && (s->ptok = malloc((size_t)s->n_ptok * sizeof *s->ptok)))
        for (uint32_t i = 0; i < s->n_ptok; i++) s->ptok[i] = kv_ring_tokens_get(st->tokens, i);
    if (!s->ptok) s->n_ptok = 0; /* out of memory: its blocks are not stored */
    if (st->n_cached) {
        const int rc = kv_rn_cache_restore(n, s, st, d);
        if (rc) {
            kv_rn_seq_free(n, s);
            return rc;
        }
    }
    *out = s;
    return 0;
}

/* Fails seq everywhere: frees it here, and sends an ERROR round the ring
 * (and to the client when this node is the home). */
static void kv_rn_deliver_error(kv_ring_node *n, uint64_t seq, int code, const char *msg);
static void kv_rn_fail_seq(kv_ring_node *n, uint64_t seq, int code, const char *msg) {
    kv_rn_seq_free(n, kv_rn_seq(n, seq));
    kv_rn_log(n, "sequence %016llx failed: %s", (unsigned long long)seq, msg);
    kv_rn_deliver_error(n, seq, code, msg);
    if (kv_rn_next_up(n) && n->next_first != n->o.first) kv_rn_send_error(n->next, seq, code, n->o.first, msg);
}

/* ---- home requests ----------------------------------------------------------------- */

static kv_rreq *kv_rn_req_by_seq(kv_ring_node *n, uint64_t seq) {
    for (kv_rreq *r = n->reqs; r; r = r->next)
        if (r->seq == seq) return r;
    return NULL;
}

static void kv_rn_req_free(kv_ring_node *n, kv_rreq *r) {
    for (kv_rreq **pp = &n->reqs; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    if (r->client) r->client->req = NULL;
    free(r->toks);
    free(r->bias);
    free(r->grammar);
    free(r->drec);
    free(r);
}

static void kv_rn_launch(kv_ring_node *n, kv_rreq *r);
static void kv_rn_deliver_error(kv_ring_node *n, uint64_t seq, int code, const char *msg) {
    kv_rreq *r = kv_rn_req_by_seq(n, seq);
    if (!r) return;
    if (code == KV_ENOTFOUND && r->n_cached && !r->held) { /* a node's cache lost the agreed blocks */
        kv_rn_log(n, "request %016llx: %s", (unsigned long long)r->id, msg);
        r->no_cache = true;
        kv_rn_launch(n, r);
        return;
    }
    if (r->client) kv_rn_send_error(r->client, r->id, code, n->o.first, msg);
    kv_rn_req_free(n, r);
}

static uint64_t kv_rn_new_id(kv_ring_node *n) {
    uint64_t id;
    do id = n->id_base ^ (++n->id_ctr * 0x9e3779b97f4a7c15ull);
    while (id == 0 || kv_rn_req_by_seq(n, id));
    return id;
}

static void kv_rn_on_start(kv_ring_node *n, const kv_ring_start *st, const uint8_t *raw, size_t raw_len);

/* Begins r's sequence r->seq: its prompt and the tokens already streamed,
 * as one prompt, for the tokens still wanted; every node takes positions
 * [0, n_cached) from its prompt cache (a LOOKUP agreed on them). */
static void kv_rn_begin(kv_ring_node *n, kv_rreq *r, uint32_t n_cached) {
    r->looking = false;
    r->n_cached = n_cached;
    const uint32_t n_tok = r->n_prompt + r->n_gen;
    kv_ring_start st = {.seq = r->seq, .home = n->o.first, .flags = 0, .n_cached = n_cached, .p = r->p, .n_tokens = n_tok};
    st.p.n_predict = r->p.n_predict - r->n_gen;
    if (st.p.flags & KV_RING_SUBMIT_EXT) st.p.n_gen = r->n_gen; /* the tail feeds them as sampled tokens */
    const size_t sz = KV_RING_HEADER + 64 + 4 * (size_t)n_tok + kv_ring_params_size(&st.p) - 40;
    uint8_t *f = malloc(sz);
    size_t len;
    kv_diag d = {0};
    if (!f || kv_ring_start_encode(f, sz, &st, r->toks, &len, &d)) {
        if (r->client) kv_rn_send_error(r->client, r->id, f ? d.code : KV_ENOMEM, n->o.first, f ? d.msg : "out of memory");
        free(f);
        kv_rn_req_free(n, r);
        return;
    }
    kv_ring_msg m;
    if (kv_ring_decode(f, len, &m, &d)) { /* cannot happen: our own encoding */
        free(f);
        kv_rn_req_free(n, r);
        return;
    }
    kv_rn_on_start(n, &m.u.start, f, len);
    free(f);
}

/* Home: sends r's LOOKUP (id r->seq) round the ring, with this node's part
 * applied. False when none is made: no cache here, the request missed once,
 * no whole block before its last token, or no link. */
static bool kv_rn_lookup_send(kv_ring_node *n, kv_rreq *r) {
    const uint32_t B = n->pc_block, n_tok = r->n_prompt + r->n_gen;
    if (!n->pcache || r->no_cache || n_tok <= B || !kv_rn_next_up(n)) return false;
    uint32_t nb = (n_tok - 1) / B; /* at least the last token is computed: its logits */
    if (nb > n->n_ctx / B) nb = n->n_ctx / B;
    if ((uint64_t)nb * B > KV_RING_MAX_PROMPT) nb = KV_RING_MAX_PROMPT / B;
    if (!nb) return false;
    const kv_ring_lookup l = {.seq = r->seq, .origin = n->o.first, .block_tokens = B, .n_blocks = nb, .n_match = nb};
    memset(n->pc_bits, 0, ((size_t)nb + 7) / 8);
    for (uint32_t k = 0; k < nb; k++) n->pc_bits[k / 8] |= (uint8_t)(1u << (k % 8));
    const size_t sz = KV_RING_HEADER + kv_ring_lookup_size(B, nb);
    uint8_t *f = kv_rn_reserve(n->next, sz);
    size_t len;
    if (!f || kv_ring_lookup_encode(f, sz, &l, r->toks, n->pc_bits, &len, NULL)) return false;
    uint32_t m = nb;
    memcpy(n->pc_tok, r->toks, (size_t)nb * B * sizeof *r->toks);
    kv_rn_lookup_apply(n, B, nb, &m, f + KV_RING_HEADER + 24 + 4 * (size_t)nb * B);
    kv_rn_put32(f + KV_RING_HEADER + 20, m);
    kv_rn_commit(n->next, len);
    r->looking = true;
    return true;
}

/* Sends the request into the ring under a fresh sequence id: first a LOOKUP
 * of its prompt in the nodes' prompt caches (when this node has one), then
 * its START. */
static void kv_rn_launch(kv_ring_node *n, kv_rreq *r) {
    r->held = false;
    r->looking = false;
    r->seq = kv_rn_new_id(n);
    if (!kv_rn_lookup_send(n, r)) kv_rn_begin(n, r, 0);
}

/* A LOOKUP: this node's part, and on to the next; back at its home, the
 * sequence begins from the blocks every node holds (the last with a state
 * wherever one is needed). */
static void kv_rn_on_lookup(kv_ring_node *n, const kv_ring_lookup *l, const uint8_t *raw, size_t len) {
    if (l->origin == n->o.first) {
        kv_rreq *r = kv_rn_req_by_seq(n, l->seq);
        if (!r || !r->looking || r->held) { /* an attempt lost in a break */
            n->stats.dropped++;
            return;
        }
        uint32_t k = l->block_tokens == n->pc_block ? l->n_match : 0;
        while (k && !((l->state[(k - 1) / 8] >> ((k - 1) % 8)) & 1u)) k--;
        if ((uint64_t)k * n->pc_block >= r->n_prompt + r->n_gen) k = 0; /* cannot happen: our own lookup */
        kv_rn_begin(n, r, k * n->pc_block);
        return;
    }
    uint8_t *f = kv_rn_next_up(n) ? kv_rn_reserve(n->next, len) : NULL;
    if (!f) return; /* no link: the break handling holds the request at its home */
    memcpy(f, raw, len);
    const uint32_t nt = l->n_blocks * l->block_tokens;
    if (n->pcache && l->block_tokens == n->pc_block) {
        const uint32_t nb = l->n_blocks < n->n_ctx / n->pc_block ? l->n_blocks : n->n_ctx / n->pc_block;
        kv_rn_pc_tokens(n, l->tokens, nb * n->pc_block);
    }
    uint32_t m = l->n_match;
    kv_rn_lookup_apply(n, l->block_tokens, l->n_blocks, &m, f + KV_RING_HEADER + 24 + 4 * (size_t)nt);
    kv_rn_put32(f + KV_RING_HEADER + 20, m);
    kv_rn_commit(n->next, len);
}

/* The ring is whole again: replay every held request. */
static void kv_rn_replay_all(kv_ring_node *n) {
    kv_rreq *r = n->reqs;
    while (r) {
        kv_rreq *nx = r->next;
        if (r->held) {
            if (r->n_gen) n->stats.replays++;
            if (r->n_gen) kv_rn_log(n, "replaying request %016llx from its %u + %u tokens", (unsigned long long)r->id,
                                    r->n_prompt, r->n_gen);
            kv_rn_launch(n, r);
        }
        r = nx;
    }
}

/* ---- breaks and probes --------------------------------------------------------------- */

/* Every sequence in flight is lost: drop them, hold the home requests. */
static void kv_rn_broken(kv_ring_node *n, const char *why) {
    if (n->ring_up || !n->why[0]) snprintf(n->why, sizeof n->why, "%s", why);
    if (n->ring_up) {
        n->stats.breaks++;
        kv_rn_log(n, "ring broken: %s", why);
    }
    n->ring_up = false;
    n->n_jobs = n->q_n = n->n_out_q = 0; /* queued work of lost sequences */
    for (uint32_t i = 0; i < n->max_seqs; i++) kv_rn_seq_free(n, &n->seqs[i]);
    const int64_t dl = kv_net_now_ms() + n->o.replay_timeout_ms;
    for (kv_rreq *r = n->reqs; r; r = r->next)
        if (!r->held) {
            r->held = true;
            r->seq = 0;
            r->deadline_ms = dl;
        }
}

static void kv_rn_send_probe(kv_ring_node *n, uint32_t kind) {
    if (!kv_rn_next_up(n)) return;
    kv_ring_probe q = {n->o.first, kind, n->nonce};
    uint8_t buf[KV_RING_HEADER + 16];
    size_t len;
    if (!kv_ring_probe_encode(buf, sizeof buf, &q, &len, NULL)) kv_rn_send_raw(n->next, buf, len);
}

static void kv_rn_probe_timer(kv_net_loop *l, kv_net_timer *t) {
    kv_ring_node *n = t->data;
    if (n->ring_up || !kv_rn_next_up(n)) return;
    n->nonce++;
    kv_rn_send_probe(n, 1);
    kv_net_timer_start(l, t, KV_RN_PROBE_MS);
}

static void kv_rn_on_probe(kv_ring_node *n, const kv_ring_probe *q, const uint8_t *raw, size_t len) {
    if (q->origin == n->o.first) {
        if (q->kind == 1 && q->nonce == n->nonce && !n->ring_up) { /* our probe came round: whole */
            n->ring_up = true;
            n->why[0] = 0;
            kv_rn_log(n, "ring whole");
            kv_rn_send_probe(n, 2);
            kv_rn_replay_all(n);
        }
        return;
    }
    if (q->kind == 2 && !n->ring_up) {
        n->ring_up = true;
        n->why[0] = 0;
        kv_rn_log(n, "ring whole");
        kv_rn_replay_all(n);
    }
    if (kv_rn_next_up(n)) kv_rn_send_raw(n->next, raw, len);
}

/* ---- compute ------------------------------------------------------------------------- */

/* Home: a token of one of its requests, to its client (logits from the wire
 * or from the tail's own row). */
static void kv_rn_deliver_token(kv_ring_node *n, const kv_ring_token *t, const uint8_t *logits_wire,
                                const float *logits_host);

/* ---- the work queue: frames that arrive together run as one forward pass ----
 * HIDDEN frames (and, at the head, tokens fed back) are queued as they are
 * decoded and computed together at the end of the loop iteration (or when
 * the queue is full, or before any frame that changes which sequences
 * exist), in one kv_state_batch_window call: the engine's guarantee that no
 * result depends on batch composition keeps every sequence's bits. */

/* Queued: tokens [off, off + count) of the queue are sequence s's, from pos. */
typedef struct kv_rjob {
    kv_rseq *s;
    uint64_t seq;        /* s->seq when queued (a sequence freed meanwhile is skipped) */
    uint32_t pos, count, off;
    bool want;           /* the tail samples after its last token (the HIDDEN flag) */
    bool logits;         /* ... and this node is the tail: a logits row */
    bool verify;         /* a verify pass: the tail samples after every token (a row each) */
} kv_rjob;

static void kv_rn_sample(kv_ring_node *n, kv_rseq *s, const float *rows, uint32_t row0, uint32_t n_rows);

/* Demand: the meter's (or the remote's) counters after a pass, for the
 * reporter's thread; they are read on the compute thread only. */
static void kv_rn_demand_copy(kv_ring_node *n, uint32_t n_tokens) {
    if (!n->dm) return;
    const size_t ns = n->pc->m->n_slabs;
    pthread_mutex_lock(&n->dm_mu);
    if (n->remote) kv_remote_get_demand(n->remote, n->dm, ns);
    else if (n->meter) kv_demand_meter_get(n->meter, n->dm, ns);
    n->dm_tokens += n_tokens;
    pthread_mutex_unlock(&n->dm_mu);
}

/* Computes everything queued and sends the results on. */
static void kv_rn_flush(kv_ring_node *n) {
    if (!n->n_jobs) return;
    const uint32_t nj = n->n_jobs, nt = n->q_n;
    n->n_jobs = 0;
    n->q_n = 0;
    uint32_t n_out = 0;
    for (uint32_t j = 0; j < nj; j++) {
        const kv_rjob *b = &n->jobs[j];
        if (b->logits && b->verify)
            for (uint32_t i = 0; i < b->count; i++) n->q_out[n_out++] = b->off + i;
        else if (b->logits)
            n->q_out[n_out++] = b->off + b->count - 1;
    }
    kv_diag d = {0};
    char msg[KV_RING_MAX_MSG];
    int rc = 0;
    for (uint32_t j = 0; j < nj && !rc; j++) {
        const kv_rjob *b = &n->jobs[j];
        rc = kv_state_reserve(n->st, kv_rn_slot(n, b->s), b->pos + b->count, &d);
        /* a verify pass keeps the recurrent state after each drafted position but the last */
        if (!rc && b->verify) rc = kv_state_spec_keep(n->st, kv_rn_slot(n, b->s), b->count - 1, &d);
    }
    const double t0 = kv_rn_now();
    if (!rc)
        rc = kv_state_batch_window(n->st, n->head ? n->q_tok : NULL, n->head ? NULL : n->xin, n->sbuf, nt, n->q_out, n_out,
                                   n_out ? n->logits : NULL, n->tail ? NULL : n->xout, &d);
    n->stats.busy_s += kv_rn_now() - t0;
    if (rc) {
        snprintf(msg, sizeof msg, "ring: node %u-%u: %.440s", n->o.first, n->o.last, d.msg);
        for (uint32_t j = 0; j < nj; j++)
            if (n->jobs[j].s->seq == n->jobs[j].seq) kv_rn_fail_seq(n, n->jobs[j].seq, rc, msg);
        return;
    }
    n->stats.batches++;
    kv_rn_demand_copy(n, nt);
    uint32_t k = 0;
    for (uint32_t j = 0; j < nj; j++) {
        const kv_rjob *b = &n->jobs[j];
        const uint32_t n_rows = b->logits ? (b->verify ? b->count : 1) : 0;
        const float *row = n_rows ? n->logits + (size_t)k * n->n_vocab : NULL;
        const uint32_t row0 = k;
        k += n_rows;
        n->stats.frames_hidden++;
        n->stats.tokens_computed += b->count;
        if (n->o.die_after_frames && n->stats.frames_hidden >= n->o.die_after_frames) {
            kv_rn_log(n, "test hook: dying after %llu frames", (unsigned long long)n->stats.frames_hidden);
            _exit(137);
        }
        if (b->s->seq != b->seq) continue; /* failed meanwhile */
        if (!kv_state_seq_finite(n->st, kv_rn_slot(n, b->s))) {
            snprintf(msg, sizeof msg, "ring: node %u-%u: a NaN or Inf appeared in the hidden state at position %u or "
                     "before; no token taken", n->o.first, n->o.last, b->pos + b->count - 1);
            kv_rn_fail_seq(n, b->seq, KV_ERANGE, msg);
            continue;
        }
        kv_rn_cache_store(n, b->s, b->pos, b->pos + b->count);
        if (!n->tail) {
            const uint32_t hf = (b->want ? KV_RING_HIDDEN_LOGITS : 0) | (b->verify ? KV_RING_HIDDEN_VERIFY : 0);
            kv_ring_hidden h = {b->seq, b->pos, b->count, hf, n->n_embd, NULL};
            const size_t sz = KV_RING_HEADER + kv_ring_hidden_size(b->count, n->n_embd);
            uint8_t *f = kv_rn_reserve(n->next, sz);
            size_t len;
            if (f && !kv_ring_hidden_encode(f, sz, &h, n->xout + (size_t)b->off * n->n_embd, &len, NULL))
                kv_rn_commit(n->next, len);
            continue; /* no link: the break handling drops the sequence */
        }
        if (row) kv_rn_sample(n, b->s, row, row0, n_rows);
    }
}

/* Queues count tokens of sequence s from pos: tokens (head) or hidden
 * states x (wire floats, widened here). */
static void kv_rn_enqueue(kv_ring_node *n, kv_rseq *s, const int32_t *tokens, const uint8_t *x, uint32_t pos,
                          uint32_t count, bool want_logits, bool verify) {
    const bool logits = n->tail && want_logits;
    const uint32_t rows = logits ? (verify ? count : 1) : 0;
    const uint64_t seq = s->seq;
    bool again = false; /* a recurrent window's prompt: one pass per frame, so a state is kept at each frame's end */
    for (uint32_t j = 0; n->pc_rec && pos < s->n_ptok && j < n->n_jobs && !again; j++) again = n->jobs[j].s == s;
    if (again || n->q_n + count > n->max_tok || (rows && n->n_out_q + rows > n->rows_cap)) kv_rn_flush(n);
    if (s->seq != seq) return; /* it failed in that pass */
    if (n->q_n == 0) n->n_out_q = 0;
    uint32_t expect = kv_state_pos_seq(n->st, kv_rn_slot(n, s));
    bool queued = false;
    for (uint32_t j = 0; j < n->n_jobs; j++)
        if (n->jobs[j].s == s) expect += n->jobs[j].count, queued = true;
    if (pos < expect && !queued && s->spec_n && pos > s->spec_pos0 && pos < s->spec_pos0 + s->spec_n) {
        /* the tail kept pos - spec_pos0 positions of the last verify pass: the
           rest were computed from drafts it rejected */
        kv_diag rd = {0};
        if (kv_state_seq_rollback(n->st, kv_rn_slot(n, s), pos, &rd)) {
            char msg[KV_RING_MAX_MSG];
            snprintf(msg, sizeof msg, "ring: node %u-%u: %.440s", n->o.first, n->o.last, rd.msg);
            kv_rn_fail_seq(n, s->seq, rd.code ? rd.code : KV_EINTERNAL, msg);
            return;
        }
        expect = pos;
    }
    if (pos != expect) {
        char msg[KV_RING_MAX_MSG];
        snprintf(msg, sizeof msg, "ring: node %u-%u: sequence at position %u here, frame says %u", n->o.first,
                 n->o.last, expect, pos);
        kv_rn_flush(n); /* its queued tokens must not run after its slot is freed */
        kv_rn_fail_seq(n, s->seq, KV_EPROTO, msg);
        return;
    }
    const uint32_t off = n->q_n;
    for (uint32_t i = 0; i < count; i++) n->sbuf[off + i] = kv_rn_slot(n, s);
    if (tokens) memcpy(n->q_tok + off, tokens, count * sizeof *tokens);
    else kv_ring_floats_get(x, count * n->n_embd, n->xin + (size_t)off * n->n_embd);
    n->jobs[n->n_jobs++] = (kv_rjob){s, s->seq, pos, count, off, want_logits, logits, verify};
    n->q_n += count;
    n->n_out_q += rows;
    s->spec_pos0 = verify ? pos : 0;
    s->spec_n = verify ? count : 0;
}

static bool kv_rn_tick(kv_net_loop *l, void *data) {
    (void)l;
    kv_rn_flush(data);
    return false;
}

/* The tail: draws the token of s from a logits row whose context held
 * `held` positions (the engine's order), into *t (pos, token, log-probability,
 * stop). Returns false when the sequence failed (it is freed). */
static bool kv_rn_draw(kv_ring_node *n, kv_rseq *s, const float *row, uint32_t held, kv_ring_token *t) {
    const uint64_t seq = s->seq;
    char msg[KV_RING_MAX_MSG];
    for (uint32_t i = 0; i < n->n_vocab; i++)
        if (!isfinite(row[i])) {
            snprintf(msg, sizeof msg, "ring: node %u-%u: logit %u of position %u is not finite; no token taken",
                     n->o.first, n->o.last, i, held - 1);
            kv_rn_fail_seq(n, seq, KV_ERANGE, msg);
            return false;
        }
    /* the engine's order (kv_engine_step): the grammar's mask, the draw, the
       log-probability before the token enters the penalties' history, the
       grammar past the token, the token taken, the stop conditions */
    kv_diag gd = {0};
    const kv_tok *vt = kv_model_tok(n->m);
    if (s->gm && kv_grammar_mask(s->gm, n->gvocab, s->gmask, &gd)) {
        snprintf(msg, sizeof msg, "ring: node %u-%u: %.400s", n->o.first, n->o.last, gd.msg);
        kv_rn_fail_seq(n, seq, gd.code ? gd.code : KV_ERANGE, msg);
        return false;
    }
    const int32_t tok = kv_sampler_sample_allowed(s->smp, row, NULL, s->gm ? s->gmask : NULL);
    if (tok < 0) {
        kv_rn_fail_seq(n, seq, tok, s->gm ? "ring: the grammar allows no token here" : "ring: the sampler refused the logits");
        return false;
    }
    *t = (kv_ring_token){.seq = seq, .pos = held, .token = tok, .n_logits = 0};
    if (s->p.flags & KV_RING_SUBMIT_LOGPROBS) {
        const int lrc = kv_sampler_logprobs(s->smp, row, tok, s->p.top_logprobs, &t->lp);
        if (lrc) {
            kv_rn_fail_seq(n, seq, lrc, "ring: the log-probabilities of the logits could not be computed");
            return false;
        }
        t->has_lp = true;
    }
    if (s->gm) {
        if (kv_grammar_accept(s->gm, n->gvocab, tok, &gd)) {
            snprintf(msg, sizeof msg, "ring: node %u-%u: %.400s", n->o.first, n->o.last, gd.msg);
            kv_rn_fail_seq(n, seq, gd.code ? gd.code : KV_EINVAL, msg);
            return false;
        }
        s->gdone = false;
        if (kv_grammar_can_end(s->gm)) { /* complete when nothing but end-of-generation may follow */
            if (kv_grammar_mask(s->gm, n->gvocab, s->gmask, &gd)) {
                snprintf(msg, sizeof msg, "ring: node %u-%u: %.400s", n->o.first, n->o.last, gd.msg);
                kv_rn_fail_seq(n, seq, gd.code ? gd.code : KV_ERANGE, msg);
                return false;
            }
            bool more = false;
            for (uint32_t w = 0; w < (n->n_vocab + 31) / 32 && !more; w++)
                for (uint32_t bits = s->gmask[w]; bits && !more; bits &= bits - 1)
                    more = !kv_tok_is_eog(vt, (int32_t)(w * 32 + (uint32_t)__builtin_ctz(bits)));
            s->gdone = !more;
        }
    }
    kv_sampler_accept_sampled(s->smp, tok);
    s->n_gen++;
    n->stats.tokens_sampled++;
    if (s->ctx && s->n_ctxt < s->ctx_cap) s->ctx[s->n_ctxt++] = tok;
    uint32_t stop = KV_STOP_NONE;
    if (!(s->p.flags & KV_RING_SUBMIT_IGNORE_EOG) && kv_tok_is_eog(vt, tok)) stop = KV_STOP_EOG;
    else if (s->gdone) stop = KV_STOP_GRAMMAR;
    else if (s->n_gen >= s->p.n_predict) stop = KV_STOP_MAX_TOKENS;
    else if (held >= n->n_ctx) stop = KV_STOP_CTX_FULL;
    t->stop = stop;
    return true;
}

/* The tail: the drafts to feed after the token at position p1 (the last
 * of a pass): at most k, never past the context (the verify pass's k + 1
 * positions fit) nor past n_predict (a pass yields at most k + 1 tokens). */
static uint32_t kv_rn_draft(kv_ring_node *n, kv_rseq *s, uint32_t p1, const float *hidden, int32_t *out) {
    uint32_t k = s->p.draft_max;
    if (p1 + 1 >= n->n_ctx) return 0;
    if (k > n->n_ctx - p1 - 1) k = n->n_ctx - p1 - 1;
    if (s->n_gen >= s->p.n_predict) return 0;
    if (k > s->p.n_predict - s->n_gen - 1) k = s->p.n_predict - s->n_gen - 1;
    if (k > KV_RING_MAX_DRAFT) k = KV_RING_MAX_DRAFT;
    if (!k) return 0;
    if (s->p.draft_kind == KV_RING_DRAFT_NGRAM) return kv_draft_ngram(s->ctx, s->n_ctxt, k, out);
    if (s->p.draft_kind == KV_RING_DRAFT_TEST && s->drec)
        return kv_draft_test_guess(s->drec, s->p.n_draft_rec, s->p.draft_p, s->p.draft_seed, n->n_vocab,
                                   s->gen0 + s->n_gen, k, out);
    /* mtp: from the hidden state that gave the token at p1 and that token (the context holds every
       position up to it); a failure of the block only leaves the pass without drafts */
    if (s->p.draft_kind == KV_RING_DRAFT_MTP && n->mtp && hidden && s->n_ctxt == p1 + 1) {
        const kv_draft_ctx c = {s->ctx, s->n_ctxt, s->gen0 + s->n_gen, hidden, kv_rn_slot(n, s)};
        const int m = kv_draft_propose(n->mtp, &c, k, out);
        return m > 0 ? (uint32_t)m : 0;
    }
    return 0;
}

/* The tail: a sampled token to the home's client (when this node is the
 * home) and on to the head. */
static void kv_rn_send_token(kv_ring_node *n, kv_rseq *s, kv_ring_token *t, const float *row) {
    if (s->home == n->o.first) kv_rn_deliver_token(n, t, NULL, row);
    /* to the head: it feeds the token back in (or frees the sequence) */
    const bool logits_on_ring = (s->p.flags & KV_RING_SUBMIT_LOGITS) && s->home != n->o.first;
    t->n_logits = logits_on_ring ? n->n_vocab : 0;
    const size_t sz = KV_RING_HEADER + 4u * (size_t)t->n_draft +
                      (t->has_lp ? kv_ring_token_size_lp(0, t->n_logits, t->lp.n_top) : kv_ring_token_size(0, t->n_logits));
    uint8_t *f = kv_rn_reserve(n->next, sz);
    size_t len;
    if (f && !kv_ring_token_encode(f, sz, t, row, &len, NULL)) kv_rn_commit(n->next, len);
}

/* The tail: samples s's tokens from its n_rows logits rows and sends them
 * on. One row: a plain pass. More: a verify pass of the token fed and
 * n_rows - 1 drafts (s->draft): the draw after each position, as plain
 * decoding would draw it, while the draws equal the drafts; the sequence
 * then rolls back to the positions kept, and the last token carries the
 * next pass's drafts. row0: the pass's row of rows[0] (its hidden state,
 * kv_state_hidden_out, is what the mtp source drafts from). */
static void kv_rn_sample(kv_ring_node *n, kv_rseq *s, const float *rows, uint32_t row0, uint32_t n_rows) {
    const uint32_t slot = kv_rn_slot(n, s);
    const uint32_t pos0 = kv_state_pos_seq(n->st, slot) - n_rows;
    const uint32_t verified = n_rows - 1;
    uint32_t acc = 0, m = 0;
    s->n_draft = 0;
    for (uint32_t i = 0; i < n_rows; i++) {
        const float *row = rows + (size_t)i * n->n_vocab;
        kv_ring_token t;
        if (!kv_rn_draw(n, s, row, pos0 + i + 1, &t)) return; /* failed: freed */
        m = i + 1;
        const bool hit = i < verified && t.token == s->draft[i];
        acc += hit;
        const bool more = hit && !t.stop;
        if (!more && !t.stop && s->p.draft_kind)
            t.n_draft = kv_rn_draft(n, s, pos0 + m, kv_state_hidden_out(n->st, row0 + i), t.drafts);
        t.spec = more ? KV_RING_TOKEN_SPEC(1, 0, 0) : KV_RING_TOKEN_SPEC(0, verified, acc);
        if (!more && s->p.draft_kind) {
            n->stats.spec_passes++;
            n->stats.spec_drafted += verified;
            n->stats.spec_accepted += acc;
        }
        if (!more) {
            s->n_draft = t.n_draft;
            memcpy(s->draft, t.drafts, t.n_draft * sizeof *t.drafts);
        }
        kv_rn_send_token(n, s, &t, row);
        if (t.stop) {
            kv_rn_seq_free(n, s);
            return;
        }
        if (!more) break;
    }
    s->spec_n = 0;
    if (m < n_rows) {
        kv_diag d = {0};
        if (kv_state_seq_rollback(n->st, slot, pos0 + m, &d)) {
            char msg[KV_RING_MAX_MSG];
            snprintf(msg, sizeof msg, "ring: node %u-%u: %.440s", n->o.first, n->o.last, d.msg);
            kv_rn_fail_seq(n, s->seq, d.code ? d.code : KV_EINTERNAL, msg);
        }
    }
}

/* Home: a token of one of its requests, to the client. */
static void kv_rn_deliver_token(kv_ring_node *n, const kv_ring_token *t, const uint8_t *logits_wire,
                                const float *logits_host) {
    kv_rreq *r = kv_rn_req_by_seq(n, t->seq);
    if (!r) return;
    if (r->n_prompt + r->n_gen >= r->cap) { /* cannot happen: cap covers n_predict */
        kv_rn_req_free(n, r);
        return;
    }
    if (r->client && n->pcache && r->n_gen == 0) { /* before its first token: the prompt tokens the caches gave */
        uint8_t cb[KV_RING_HEADER + 12];
        size_t cl;
        if (!kv_ring_cached_encode(cb, sizeof cb, r->id, r->n_cached, &cl, NULL)) kv_rn_send_raw(r->client, cb, cl);
    }
    r->toks[r->n_prompt + r->n_gen++] = t->token;
    if (r->client) {
        char piece[KV_RING_MAX_PIECE];
        int pn = kv_tok_is_eog(kv_model_tok(n->m), t->token) ? 0
                                                             : kv_tok_piece(kv_model_tok(n->m), t->token, false, piece, sizeof piece);
        if (pn < 0) pn = 0;
        if (pn > (int)sizeof piece) pn = (int)sizeof piece;
        const bool want = r->p.flags & KV_RING_SUBMIT_LOGITS;
        float *lg = NULL;
        if (want && !logits_host && logits_wire) {
            lg = n->logits; /* the tail's buffer is free here: this node is not computing */
            kv_ring_floats_get(logits_wire, n->n_vocab, lg);
            logits_host = lg;
        }
        kv_ring_token o = {.seq = r->id, .pos = t->pos, .token = t->token, .stop = t->stop,
                           .piece_len = (uint32_t)pn, .piece = piece, .n_logits = want && logits_host ? n->n_vocab : 0,
                           .has_lp = t->has_lp, .lp = t->lp, .spec = t->spec}; /* the drafts stay on the ring */
        const size_t sz = KV_RING_HEADER + (o.has_lp ? kv_ring_token_size_lp(o.piece_len, o.n_logits, o.lp.n_top)
                                                     : kv_ring_token_size(o.piece_len, o.n_logits));
        uint8_t *f = kv_rn_reserve(r->client, sz);
        size_t len;
        if (f && !kv_ring_token_encode(f, sz, &o, logits_host, &len, NULL)) kv_net_conn_commit(r->client->nc, len);
    }
    if (t->stop) kv_rn_req_free(n, r);
}

/* A sequence begins, or passes on its way to the head. */
static void kv_rn_on_start(kv_ring_node *n, const kv_ring_start *st, const uint8_t *raw, size_t raw_len) {
    kv_diag d = {0};
    kv_rn_flush(n); /* a slot may be taken: nothing queued may still name it */
    if (!(st->flags & KV_RING_START_BEGUN) && !n->head) { /* toward the head */
        if (kv_rn_next_up(n)) kv_rn_send_raw(n->next, raw, raw_len);
        return;
    }
    if ((st->flags & KV_RING_START_BEGUN) && n->head) return; /* came round: cannot happen, the tail stops it */
    kv_rseq *s;
    if (kv_rn_seq_new(n, st, &s, &d)) {
        char msg[KV_RING_MAX_MSG];
        snprintf(msg, sizeof msg, "ring: node %u-%u: %.440s", n->o.first, n->o.last, d.msg);
        kv_rn_deliver_error(n, st->seq, d.code, msg);
        if (kv_rn_next_up(n) && n->next_first != n->o.first) kv_rn_send_error(n->next, st->seq, d.code, n->o.first, msg);
        return;
    }
    if (!n->tail && kv_rn_next_up(n)) {
        if (st->flags & KV_RING_START_BEGUN) {
            kv_rn_send_raw(n->next, raw, raw_len);
        } else { /* the head begins it: the same frame, flagged */
            uint8_t *f = kv_rn_reserve(n->next, raw_len);
            if (f) {
                memcpy(f, raw, raw_len);
                f[KV_RING_HEADER + 12] |= KV_RING_START_BEGUN; /* flags u32 LE at payload offset 12 */
                kv_rn_commit(n->next, raw_len);
            }
        }
    }
    if (!n->head) return;
    /* the head: the prompt in chunks of n_batch, logits after the last; with a
       prompt cache the chunks end at block ends (a recurrent state is kept
       where a pass ends), from the cached positions on */
    const uint64_t seq = s->seq;
    uint32_t chunk = n->n_batch;
    if (n->pcache && chunk >= n->pc_block) chunk -= chunk % n->pc_block;
    for (uint32_t done = st->n_cached; done < st->n_tokens;) {
        const uint32_t c = st->n_tokens - done < chunk ? st->n_tokens - done : chunk;
        for (uint32_t i = 0; i < c; i++) n->tbuf[i] = kv_ring_tokens_get(st->tokens, done + i);
        kv_rn_enqueue(n, s, n->tbuf, NULL, done, c, done + c == st->n_tokens, false);
        done += c;
        if (s->seq != seq) return; /* it failed */
    }
}

static void kv_rn_on_hidden(kv_ring_node *n, const kv_ring_hidden *h) {
    kv_rseq *s = kv_rn_seq(n, h->seq);
    if (!s || n->head) {
        n->stats.dropped++;
        return;
    }
    if (h->n_embd != n->n_embd) {
        char msg[KV_RING_MAX_MSG];
        snprintf(msg, sizeof msg, "ring: node %u-%u: hidden state of %u floats, the model has %u", n->o.first, n->o.last,
                 h->n_embd, n->n_embd);
        kv_rn_fail_seq(n, h->seq, KV_EPROTO, msg);
        return;
    }
    const bool verify = h->flags & KV_RING_HIDDEN_VERIFY;
    if (n->tail && (verify ? h->n_tokens - 1 : 0) != s->n_draft) {
        char msg[KV_RING_MAX_MSG];
        snprintf(msg, sizeof msg, "ring: node %u-%u: a pass of %u tokens at position %u, after %u drafts", n->o.first,
                 n->o.last, h->n_tokens, h->pos, s->n_draft);
        kv_rn_fail_seq(n, h->seq, KV_EPROTO, msg);
        return;
    }
    if (h->n_tokens > n->n_batch && !verify) {
        char msg[KV_RING_MAX_MSG];
        snprintf(msg, sizeof msg, "ring: node %u-%u: HIDDEN of %u tokens exceeds the batch %u", n->o.first, n->o.last,
                 h->n_tokens, n->n_batch);
        kv_rn_fail_seq(n, h->seq, KV_ERANGE, msg);
        return;
    }
    kv_rn_enqueue(n, s, NULL, h->x, h->pos, h->n_tokens, h->flags & KV_RING_HIDDEN_LOGITS, verify);
}

static void kv_rn_on_token(kv_ring_node *n, const kv_ring_token *t, const uint8_t *raw, size_t len) {
    kv_rseq *s = kv_rn_seq(n, t->seq);
    if (n->tail) { /* a ring of one: the head half of this node */
        if (!s) return;
    }
    const uint32_t home = s ? s->home : UINT32_MAX;
    if (n->head && s && !t->stop && !(t->spec & KV_RING_TOKEN_MORE)) {
        /* the token takes position pos, the drafts after it (a verify pass) */
        int32_t fed[KV_RING_MAX_DRAFT + 1];
        fed[0] = t->token;
        bool ok = true;
        for (uint32_t i = 0; i < t->n_draft; i++) {
            fed[i + 1] = t->drafts[i];
            ok = ok && (uint32_t)t->drafts[i] < n->n_vocab;
        }
        if (!ok) {
            kv_rn_fail_seq(n, t->seq, KV_ERANGE, "ring: a drafted token outside the vocabulary");
            return;
        }
        kv_rn_enqueue(n, s, fed, NULL, t->pos, 1 + t->n_draft, true, t->n_draft > 0);
    }
    if (t->stop && s && !n->tail) kv_rn_seq_free(n, s);
    if (n->tail) return;
    if (home == n->o.first) {
        kv_rn_deliver_token(n, t, t->n_logits ? t->logits : NULL, NULL);
        if (!t->stop) return;
    } else if (home == UINT32_MAX) {
        n->stats.dropped++;
        if (!t->stop) return;
    }
    if (kv_rn_next_up(n) && !kv_rn_next_is_tail(n)) kv_rn_send_raw(n->next, raw, len);
}

static void kv_rn_on_error_frame(kv_ring_node *n, const kv_ring_error *e, const uint8_t *raw, size_t len) {
    kv_rn_flush(n);
    kv_rn_seq_free(n, kv_rn_seq(n, e->seq));
    kv_rn_deliver_error(n, e->seq, e->code, e->msg);
    if (e->origin != n->o.first && kv_rn_next_up(n) && n->next_first != e->origin) kv_rn_send_raw(n->next, raw, len);
}

/* ---- clients ------------------------------------------------------------------------- */

/* Copies the extension's views (bias, grammar) of a SUBMIT_TOKENS frame
 * into r, and points p's at them, checking what only this node knows: bias
 * tokens inside the vocabulary, a grammar that parses. */
static int kv_rn_req_own_ext(kv_ring_node *n, kv_rreq *r, kv_ring_params *p, kv_diag *d) {
    if (!(p->flags & KV_RING_SUBMIT_EXT)) return 0;
    if ((p->flags & KV_RING_SUBMIT_DRAFT) && p->draft_kind == KV_RING_DRAFT_MTP && !n->hp->n_layer_nextn)
        return kv_fail(d, KV_EUNSUPPORTED, "--draft mtp: the model (%s) has no MTP (nextn) block (ngram or "
                       "test:FILE:P)", n->hp->arch_name);
    if (p->sample.n_bias) {
        if (!(r->bias = malloc(p->sample.n_bias * sizeof *r->bias))) return kv_fail(d, KV_ENOMEM, "out of memory");
        for (uint32_t i = 0; i < p->sample.n_bias; i++) {
            float b[1];
            r->bias[i].token = kv_ring_tokens_get(p->bias_wire, 2 * i);
            kv_ring_floats_get(p->bias_wire + 8 * (size_t)i + 4, 1, b);
            r->bias[i].bias = b[0];
            if ((uint32_t)r->bias[i].token >= n->n_vocab)
                return kv_fail(d, KV_EINVAL, "'logit_bias' token %d is outside the vocabulary [0, %u)", r->bias[i].token,
                               n->n_vocab);
        }
    }
    p->sample.bias = r->bias;
    p->bias_wire = NULL;
    if (p->grammar_len) {
        kv_grammar_limits lim;
        kv_rn_grammar_limits(&lim);
        kv_grammar *g = NULL;
        const int rc = kv_grammar_parse(&g, p->grammar, p->grammar_len, &lim, d); /* refused now, not at the tail */
        kv_grammar_free(g);
        if (rc) return rc;
        if (!(r->grammar = malloc(p->grammar_len))) return kv_fail(d, KV_ENOMEM, "out of memory");
        memcpy(r->grammar, p->grammar, p->grammar_len);
    }
    p->grammar = r->grammar;
    if ((p->flags & KV_RING_SUBMIT_DRAFT) && p->n_draft_rec) {
        if (!(r->drec = malloc((size_t)p->n_draft_rec * sizeof *r->drec))) return kv_fail(d, KV_ENOMEM, "out of memory");
        for (uint32_t i = 0; i < p->n_draft_rec; i++) {
            r->drec[i] = kv_ring_tokens_get(p->draft_rec_wire, i);
            if ((uint32_t)r->drec[i] >= n->n_vocab)
                return kv_fail(d, KV_EINVAL, "draft: recorded token %u is %d, outside the vocabulary [0, %u)", i,
                               r->drec[i], n->n_vocab);
        }
    }
    p->draft_rec = r->drec;
    p->draft_rec_wire = NULL;
    return 0;
}

/* A client's request: its prompt tokenized here (SUBMIT: the text as
 * `kvasir run -p` takes it; SUBMIT_CHAT: the chat template over the
 * messages, each content plain text, as the gateway builds it), BOS first
 * when the model adds one; ACCEPT back, and into the ring (or held until it
 * is whole). n_predict is cut to what the context can hold (the tail stops
 * at a full context first). */
static void kv_rn_on_submit(kv_ring_node *n, kv_rconn *c, const kv_ring_params *prm, const char *text,
                            uint32_t text_len, const kv_ring_submit_chat *chat, const kv_ring_submit_tokens *stok) {
    kv_diag d = {0};
    if (c->req) {
        kv_rn_send_error(c, 0, KV_EINVAL, n->o.first, "ring: one request at a time per connection");
        return;
    }
    const kv_tok *tok = kv_model_tok(n->m);
    const size_t bytes = stok ? stok->n_tokens : chat ? (size_t)chat->text_bytes + 16u * ((size_t)chat->n_msgs + 1) : text_len;
    const size_t cap = 3 * bytes + 8;
    int32_t *ids = malloc(cap * sizeof *ids);
    kv_chat_msg *cm = chat ? malloc(chat->n_msgs * sizeof *cm) : NULL;
    if (!ids || (chat && !cm)) {
        free(ids);
        free(cm);
        kv_rn_send_error(c, 0, KV_ENOMEM, n->o.first, "ring: out of memory");
        return;
    }
    size_t off = 0, n_ids = 0;
    if (!stok && kv_tok_add_bos(tok) && kv_tok_bos(tok) >= 0) ids[off++] = kv_tok_bos(tok);
    int rc = 0;
    if (stok) { /* the client's rendering, as it is (it holds BOS when the model adds one) */
        for (uint32_t i = 0; i < stok->n_tokens && !rc; i++) {
            ids[i] = kv_ring_tokens_get(stok->tokens, i);
            if ((uint32_t)ids[i] >= n->n_vocab)
                rc = kv_fail(&d, KV_EINVAL, "prompt token %u is %d, outside the vocabulary [0, %u)", i, ids[i], n->n_vocab);
        }
        n_ids = stok->n_tokens;
    } else if (chat) {
        const uint8_t *at = chat->msgs;
        for (uint32_t i = 0; i < chat->n_msgs; i++) {
            uint32_t role, ml;
            const char *content;
            at = kv_ring_chat_next(at, &role, &content, &ml);
            cm[i] = (kv_chat_msg){kv_ring_chat_role_name(role), content, ml};
        }
        rc = kv_tok_encode_chatml(tok, cm, chat->n_msgs, true, ids + off, cap - off, &n_ids, &d);
    } else {
        rc = kv_tok_encode(tok, text, text_len, true, ids + off, cap - off, &n_ids, &d);
    }
    free(cm);
    n_ids += off;
    char msg[KV_RING_MAX_MSG];
    kv_ring_params p = *prm;
    if (!rc && n_ids == 0) rc = kv_fail(&d, KV_EINVAL, "the prompt is empty");
    if (!rc && (n_ids > n->n_ctx || n_ids > KV_RING_MAX_PROMPT))
        rc = kv_fail(&d, KV_ECTXFULL, "prompt has %zu tokens, longer than the context (%u)", n_ids, n->n_ctx);
    if (!rc && p.n_predict > n->n_ctx + 2 - n_ids) p.n_predict = n->n_ctx + 2 - (uint32_t)n_ids;
    if (!rc && n_ids + p.n_predict > KV_RING_MAX_PROMPT + 1u)
        rc = kv_fail(&d, KV_ERANGE, "prompt + n_predict exceed %u tokens", KV_RING_MAX_PROMPT);
    kv_rreq *r = NULL;
    if (!rc) {
        kv_sampler *probe = NULL; /* the parameters are checked where they are used: check them here first */
        kv_sample_params ps = p.sample; /* the bias is checked with its copy below */
        ps.bias = NULL;
        ps.n_bias = 0;
        rc = kv_sampler_new(&probe, (int32_t)n->n_vocab, &ps, &d);
        kv_sampler_free(probe);
    }
    if (!rc && (!(r = calloc(1, sizeof *r)) || !(r->toks = malloc(((size_t)n_ids + p.n_predict) * sizeof *r->toks))))
        rc = kv_fail(&d, KV_ENOMEM, "out of memory");
    if (!rc) rc = kv_rn_req_own_ext(n, r, &p, &d);
    if (rc) {
        snprintf(msg, sizeof msg, "ring: %.480s", d.msg);
        kv_rn_send_error(c, 0, rc, n->o.first, msg);
        if (r) free(r->toks);
        if (r) free(r->bias);
        if (r) free(r->grammar);
        if (r) free(r->drec);
        free(r);
        free(ids);
        return;
    }
    memcpy(r->toks, ids, n_ids * sizeof *ids);
    free(ids);
    r->n_prompt = (uint32_t)n_ids;
    r->cap = (uint32_t)n_ids + p.n_predict;
    r->p = p;
    r->client = c;
    r->id = kv_rn_new_id(n);
    c->req = r;
    r->next = n->reqs;
    n->reqs = r;
    n->stats.requests++;
    const size_t sz = KV_RING_HEADER + 12 + 4 * (size_t)r->n_prompt;
    uint8_t *f = kv_rn_reserve(c, sz);
    size_t len;
    if (f && !kv_ring_accept_encode(f, sz, r->id, r->toks, r->n_prompt, &len, NULL)) kv_net_conn_commit(c->nc, len);
    if (n->ring_up) {
        kv_rn_launch(n, r);
    } else {
        r->held = true;
        r->deadline_ms = kv_net_now_ms() + n->o.replay_timeout_ms;
    }
}

/* VOCAB: the model's tokenizer.* metadata as a GGUF without tensors (built
 * once): a client that renders and tokenizes prompts itself (the gateway)
 * tokenizes as this node would. */
static void kv_rn_on_vocab(kv_ring_node *n, kv_rconn *c) {
    kv_diag d = {0};
    if (!n->vocab && kv_ring_vocab_pack(kv_model_gguf(n->m), &n->vocab, &n->vocab_len, &d)) {
        char msg[KV_RING_MAX_MSG];
        snprintf(msg, sizeof msg, "ring: node %u-%u: %.440s", n->o.first, n->o.last, d.msg);
        kv_rn_send_error(c, 0, d.code ? d.code : KV_EINTERNAL, n->o.first, msg);
        return;
    }
    const size_t sz = KV_RING_HEADER + 4 + n->vocab_len;
    uint8_t *f = kv_rn_reserve(c, sz);
    size_t len;
    if (f && !kv_ring_vocab_encode(f, sz, KV_RING_VOCAB_ACK, n->vocab, (uint32_t)n->vocab_len, &len, &d))
        kv_net_conn_commit(c->nc, len);
}

/* STATUS: whether the ring is whole as this node sees it, its window and limits. */
static void kv_rn_on_status(kv_ring_node *n, kv_rconn *c) {
    kv_ring_status st = {.flags = n->ring_up ? KV_RING_STATUS_WHOLE : 0, .n_layer = n->n_layer, .first = n->o.first,
                         .last = n->o.last, .n_ctx = n->n_ctx, .max_seqs = n->max_seqs};
    for (uint32_t i = 0; i < n->max_seqs; i++) st.n_seqs += n->seqs[i].seq != 0;
    if (!n->ring_up) snprintf(st.msg, sizeof st.msg, "%s", n->why[0] ? n->why : "the ring has not formed yet");
    uint8_t buf[KV_RING_HEADER + 32 + KV_RING_MAX_MSG];
    size_t len;
    if (!kv_ring_status_encode(buf, sizeof buf, KV_RING_STATUS_ACK, &st, &len, NULL)) kv_rn_send_raw(c, buf, len);
}

/* Held requests past their deadline fail with the break's reason. */
static void kv_rn_tick_timer(kv_net_loop *l, kv_net_timer *t) {
    kv_ring_node *n = t->data;
    const int64_t now = kv_net_now_ms();
    kv_rreq *r = n->reqs;
    while (r) {
        kv_rreq *nx = r->next;
        if (r->held && now >= r->deadline_ms) {
            char msg[KV_RING_MAX_MSG];
            snprintf(msg, sizeof msg, "ring broken: %.300s; it did not re-form within %u ms (%u tokens were streamed)",
                     n->why[0] ? n->why : "the ring has not formed", n->o.replay_timeout_ms, r->n_gen);
            if (r->client) kv_rn_send_error(r->client, r->id, KV_ETIMEOUT, n->o.first, msg);
            kv_rn_log(n, "request %016llx failed: %s", (unsigned long long)r->id, msg);
            kv_rn_req_free(n, r);
        }
        r = nx;
    }
    kv_net_timer_start(l, t, KV_RN_TICK_MS);
}

/* ---- connections ------------------------------------------------------------------------ */

static int kv_rc_frame_len(kv_net_conn *nc, const uint8_t *hdr, size_t *total, kv_diag *d) {
    (void)nc;
    kv_ring_header h;
    int rc = kv_ring_header_decode(hdr, KV_RING_HEADER, &h, d);
    if (rc) return rc;
    *total = KV_RING_HEADER + (size_t)h.len;
    return 0;
}

static void kv_rc_on_error(kv_net_conn *nc, int code, const char *why) {
    kv_rconn *c = kv_net_conn_data(nc);
    if (c->role != KV_RC_NEXT) kv_rn_send_error(c, 0, code < 0 ? code : KV_EPROTO, c->n->o.first, why);
}

static void kv_rn_redial(kv_net_loop *l, kv_net_timer *t);

static kv_rconn *kv_rc_new(kv_ring_node *n) {
    kv_rconn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->n = n;
    c->lnext = n->conns;
    if (n->conns) n->conns->lprev = c;
    n->conns = c;
    n->n_conns++;
    return c;
}

static void kv_rc_free(kv_rconn *c) {
    kv_ring_node *n = c->n;
    if (c->lprev) c->lprev->lnext = c->lnext;
    else n->conns = c->lnext;
    if (c->lnext) c->lnext->lprev = c->lprev;
    n->n_conns--;
    free(c);
}

static void kv_rc_on_close(kv_net_conn *nc, int code, const char *why) {
    kv_rconn *c = kv_net_conn_data(nc);
    kv_ring_node *n = c->n;
    kv_net_timer_stop(n->loop, &c->hs_t);
    char msg[KV_RING_MAX_MSG];
    if (c->role == KV_RC_NEXT) {
        n->next = NULL;
        kv_rn_delay_drop(n); /* frames of the link that closed */
        if (c->acked) {
            snprintf(msg, sizeof msg, "layers %u-%u are gone: the link to them (%s) closed: %.200s", n->next_first,
                     n->next_last, n->next_addr, why && *why ? why : kv_err_name(code));
            kv_rn_log(n, "%s", msg);
            kv_rn_broken(n, msg);
        }
        if (!kv_net_loop_stopping(n->loop)) kv_net_timer_start(n->loop, &n->redial_t, KV_RN_REDIAL_MS);
    } else if (c->role == KV_RC_PREV) {
        n->prev = NULL;
        snprintf(msg, sizeof msg, "layers %u-%u are gone: the link from them closed: %.200s", n->prev_first,
                 n->prev_last, why && *why ? why : kv_err_name(code));
        kv_rn_log(n, "%s", msg);
        const bool was_up = n->ring_up;
        kv_rn_broken(n, msg);
        (void)was_up;
        if (kv_rn_next_up(n)) { /* tell everyone after us, round to the node before the break */
            uint8_t buf[KV_RING_HEADER + 8 + KV_RING_MAX_MSG];
            size_t len;
            if (!kv_ring_broken_encode(buf, sizeof buf, n->o.first, msg, &len, NULL)) kv_rn_send_raw(n->next, buf, len);
        }
    } else if (c->role == KV_RC_CLIENT && c->req) {
        /* the client left (a stop string matched, it hung up): its sequence
           is freed round the ring (an ERROR from here), a held one forgotten */
        kv_rreq *r = c->req;
        r->client = NULL;
        c->req = NULL;
        if (r->seq && !r->held) {
            kv_rn_flush(n); /* nothing queued may name its slot once freed */
            kv_rn_fail_seq(n, r->seq, KV_EIO, "ring: the client left");
        } else {
            kv_rn_req_free(n, r);
        }
    }
    kv_rc_free(c);
}

static bool kv_rn_allowed(const kv_ring_node *n, const uint8_t key[32]) {
    if (n->o.allow_any) return true;
    for (size_t i = 0; i < n->o.n_allow; i++)
        if (!memcmp(n->allow[i], key, 32)) return true;
    return false;
}

/* A connector's hub voucher (docs/HUB.md "Vouching"): the hub this node
 * trusts signed (model, key, expiry) and the expiry is ahead of this node's
 * clock. false with why[] saying what was wrong ("" when no voucher came). */
static bool kv_rn_vouched(const kv_ring_node *n, const kv_ring_auth *a, char *why, size_t cap) {
    why[0] = 0;
    if (!a->voucher_expires_ms) return false;
    if (!n->has_hub_key) return snprintf(why, cap, "a voucher, but this node trusts no hub; "), false;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const uint64_t now_ms = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
    if (a->voucher_expires_ms <= now_ms)
        return snprintf(why, cap, "its voucher expired %llu ms ago; ",
                        (unsigned long long)(now_ms - a->voucher_expires_ms)), false;
    if (kv_voucher_verify(n->hub_key, n->model_id, a->key, a->voucher_expires_ms, a->voucher_sig))
        return snprintf(why, cap, "its voucher is not the trusted hub's for this model and key; "), false;
    return true;
}

static int kv_rn_check_peer(kv_ring_node *n, const kv_ring_hello *h, uint32_t want_first, bool check_last,
                            char *msg, size_t cap) {
    if (h->role != KV_RING_ROLE_LINK) return snprintf(msg, cap, "ring: expected a ring node, got a client"), KV_EPROTO;
    if (strcmp(h->model_id, n->model_id) || h->n_layer != n->n_layer || h->n_embd != n->n_embd || h->n_vocab != n->n_vocab)
        return snprintf(msg, cap, "ring: the peer serves another model (%.16s..., %u layers) than this node (%.16s..., %u layers)",
                        h->model_id, h->n_layer, n->model_id, n->n_layer), KV_EPROTO;
    if (check_last ? (h->last + 1) % n->n_layer != want_first : h->first != want_first)
        return snprintf(msg, cap, "ring: the peer holds layers %u-%u; this node %s layer %u", h->first, h->last,
                        check_last ? "starts at" : "needs its next to start at", want_first), KV_EPROTO;
    return 0;
}

static int kv_rc_on_frame(kv_net_conn *nc, const uint8_t *f, size_t len) {
    kv_rconn *c = kv_net_conn_data(nc);
    kv_ring_node *n = c->n;
    kv_ring_msg m;
    kv_diag d = {0};
    char msg[KV_RING_MAX_MSG];
    int rc = kv_ring_decode(f, len, &m, &d);
    if (rc) {
        if (c->role != KV_RC_NEXT) kv_rn_send_error(c, 0, rc, n->o.first, d.msg);
        kv_net_conn_close(nc, rc, d.msg);
        return rc;
    }
    const uint16_t ty = m.h.type;
    kv_tls *tls = kv_link_sniff_tls(c->tp);
    uint8_t binding[KV_TLS_EXPORTER_LEN];
    if (tls && kv_tls_exporter(tls, binding)) {
        kv_net_conn_close(nc, KV_EINTERNAL, "no TLS exporter for this session");
        return KV_EINTERNAL;
    }
    if (c->role == KV_RC_NEXT && !c->acked && !tls && c->tp && ty != KV_RING_ERROR) {
        kv_rn_log(n, "the next node answered TLS in plaintext (an older node?): not linking");
        kv_net_conn_close(nc, KV_EPROTO, "the next node answered TLS in plaintext");
        return KV_EPROTO;
    }
    if (c->role == KV_RC_NEW && !tls && !c->loopback && !n->o.insecure_plaintext) {
        snprintf(msg, sizeof msg, "ring: plaintext from a non-loopback address refused: a link that leaves the "
                 "machine needs TLS 1.3 (ring v%u, its key handshake bound to the TLS session); an older build, "
                 "or --insecure-plaintext on one side only", KV_RING_VERSION);
        kv_rn_send_error(c, 0, KV_EUNSUPPORTED, n->o.first, msg);
        kv_net_conn_close(nc, KV_EUNSUPPORTED, msg);
        return KV_EUNSUPPORTED;
    }
    if (c->role == KV_RC_NEW) {
        if (ty != KV_RING_HELLO) {
            kv_rn_send_error(c, 0, KV_EPROTO, n->o.first, "ring: the first frame must be HELLO");
            kv_net_conn_close(nc, KV_EPROTO, "no HELLO");
            return KV_EPROTO;
        }
        if (m.u.hello.role == KV_RING_ROLE_LINK &&
            (rc = kv_rn_check_peer(n, &m.u.hello, n->o.first, true, msg, sizeof msg))) {
            kv_rn_send_error(c, 0, rc, n->o.first, msg);
            kv_net_conn_close(nc, rc, msg);
            return rc;
        }
        c->peer = m.u.hello;
        c->role = KV_RC_AUTH; /* nothing else until the peer proves its key */
        kv_ring_hello me = {KV_RING_ROLE_LINK, n->n_layer, n->o.first, n->o.last, n->n_embd, n->n_vocab, {0}};
        memcpy(me.model_id, n->model_id, sizeof me.model_id);
        uint8_t buf[KV_RING_HEADER + 128];
        size_t bl;
        if (!kv_ring_hello_encode(buf, sizeof buf, KV_RING_HELLO_ACK, &me, &bl, NULL)) kv_rn_send_raw(c, buf, bl);
        kv_ring_auth ch;
        memcpy(ch.key, n->sk + 32, 32);
        randombytes_buf(c->challenge, sizeof c->challenge);
        memcpy(ch.nonce, c->challenge, 32);
        if (!kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH_CHALLENGE, &ch, &bl, NULL)) kv_rn_send_raw(c, buf, bl);
        return 0;
    }
    if (c->role == KV_RC_AUTH) {
        if (ty != KV_RING_AUTH) {
            kv_rn_send_error(c, 0, KV_EAUTH, n->o.first, "ring: AUTH must follow HELLO; nothing is served before it");
            kv_net_conn_close(nc, KV_EAUTH, "no AUTH");
            return KV_EAUTH;
        }
        char hex[65];
        kv_hex(m.u.auth.key, 32, hex);
        const kv_link_transcript t = {.proto = KV_LINK_HS_RING, .model_id = n->model_id, .acceptor_key = n->sk + 32,
                                      .challenge = c->challenge, .connector_key = m.u.auth.key, .nonce = m.u.auth.nonce,
                                      .binding = tls ? binding : NULL};
        if (!kv_rn_allowed(n, m.u.auth.key) && !kv_rn_vouched(n, &m.u.auth, msg, sizeof msg))
            snprintf(msg + strlen(msg), sizeof msg - strlen(msg), "ring: key %.16s... is not allowed on this node (--allow-key%s)",
                     hex, n->has_hub_key ? ", or a voucher of the hub" : "");
        else if (kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, m.u.auth.key, m.u.auth.sig))
            snprintf(msg, sizeof msg, "ring: the signature of key %.16s... does not verify", hex);
        else
            msg[0] = 0;
        if (!msg[0] && c->peer.role == KV_RING_ROLE_LINK && n->prev)
            snprintf(msg, sizeof msg, "ring: layer %u already has a live link from the node before it", n->o.first);
        if (msg[0]) {
            const int code = strstr(msg, "already") ? KV_EPROTO : KV_EAUTH;
            kv_rn_send_error(c, 0, code, n->o.first, msg);
            kv_rn_log(n, "refused a %s: %s", c->peer.role == KV_RING_ROLE_LINK ? "link" : "client", msg);
            kv_net_conn_close(nc, code, msg);
            return code;
        }
        kv_net_timer_stop(n->loop, &c->hs_t);
        kv_ring_auth ok;
        kv_link_transcript_sign(&t, KV_LINK_ACCEPTOR, n->sk, ok.sig);
        uint8_t buf[KV_RING_HEADER + 64];
        size_t bl;
        if (!kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH_OK, &ok, &bl, NULL)) kv_rn_send_raw(c, buf, bl);
        if (c->peer.role == KV_RING_ROLE_LINK) {
            c->role = KV_RC_PREV;
            n->prev = c;
            n->prev_first = c->peer.first;
            n->prev_last = c->peer.last;
            kv_rn_log(n, "link from layers %u-%u up (key %.16s...)", c->peer.first, c->peer.last, hex);
        } else {
            c->role = KV_RC_CLIENT;
        }
        return 0;
    }
    if (c->role == KV_RC_NEXT) {
        if (!c->acked) {
            if (ty == KV_RING_ERROR) {
                kv_rn_log(n, "the next node refused the link: %s", m.u.error.msg);
                kv_net_conn_close(nc, m.u.error.code, m.u.error.msg);
                return m.u.error.code;
            }
            if (!c->hello_ok) {
                if (ty != KV_RING_HELLO_ACK ||
                    (rc = kv_rn_check_peer(n, &m.u.hello, (n->o.last + 1) % n->n_layer, false, msg, sizeof msg))) {
                    if (ty != KV_RING_HELLO_ACK) snprintf(msg, sizeof msg, "ring: expected HELLO_ACK from the next node, got frame type %u", ty);
                    kv_rn_log(n, "%s", msg);
                    kv_net_conn_close(nc, KV_EPROTO, msg);
                    return KV_EPROTO;
                }
                c->hello_ok = true;
                c->peer = m.u.hello;
                return 0;
            }
            if (ty == KV_RING_AUTH_CHALLENGE) { /* prove our key; the next must be a node we admit */
                char hex[65];
                kv_hex(m.u.auth.key, 32, hex);
                if (!kv_rn_allowed(n, m.u.auth.key)) {
                    kv_rn_log(n, "the next node's key %.16s... is not allowed (--allow-key); not linking", hex);
                    kv_net_conn_close(nc, KV_EAUTH, "the next node's key is not allowed");
                    return KV_EAUTH;
                }
                memcpy(c->peer_key, m.u.auth.key, 32);
                memcpy(c->challenge, m.u.auth.nonce, 32);
                kv_ring_auth a = {0}; /* a link proves its key alone (no voucher) */
                memcpy(a.key, n->sk + 32, 32);
                randombytes_buf(c->nonce, 32);
                memcpy(a.nonce, c->nonce, 32);
                const kv_link_transcript t = {.proto = KV_LINK_HS_RING, .model_id = n->model_id,
                                              .acceptor_key = c->peer_key, .challenge = c->challenge,
                                              .connector_key = a.key, .nonce = a.nonce,
                                              .binding = tls ? binding : NULL};
                kv_link_transcript_sign(&t, KV_LINK_CONNECTOR, n->sk, a.sig);
                uint8_t buf[KV_RING_HEADER + 128];
                size_t bl;
                if (!kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH, &a, &bl, NULL)) kv_rn_send_raw(c, buf, bl);
                return 0;
            }
            const kv_link_transcript t = {.proto = KV_LINK_HS_RING, .model_id = n->model_id, .acceptor_key = c->peer_key,
                                          .challenge = c->challenge, .connector_key = n->sk + 32, .nonce = c->nonce,
                                          .binding = tls ? binding : NULL};
            if (ty != KV_RING_AUTH_OK || kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, c->peer_key, m.u.auth.sig)) {
                snprintf(msg, sizeof msg, "ring: the next node's AUTH_OK is missing or does not verify");
                kv_rn_log(n, "%s", msg);
                kv_net_conn_close(nc, KV_EAUTH, msg);
                return KV_EAUTH;
            }
            m.u.hello = c->peer;
            c->acked = true;
            kv_net_timer_stop(n->loop, &c->hs_t);
            n->next_first = m.u.hello.first;
            n->next_last = m.u.hello.last;
            kv_rn_log(n, "link to layers %u-%u (%s) up", n->next_first, n->next_last, n->next_addr);
            n->nonce++;
            kv_rn_send_probe(n, 1);
            kv_net_timer_start(n->loop, &n->probe_t, KV_RN_PROBE_MS);
            return 0;
        }
        if (ty == KV_RING_ERROR && m.u.error.seq == 0) {
            kv_net_conn_close(nc, m.u.error.code, m.u.error.msg);
            return m.u.error.code;
        }
        return 0; /* nothing else comes back on our own link */
    }
    if (c->role == KV_RC_CLIENT) {
        if (ty == KV_RING_STATUS) {
            kv_rn_on_status(n, c);
            return 0;
        }
        if (ty == KV_RING_VOCAB) {
            kv_rn_on_vocab(n, c);
            return 0;
        }
        if (ty != KV_RING_SUBMIT && ty != KV_RING_SUBMIT_CHAT && ty != KV_RING_SUBMIT_TOKENS) {
            kv_rn_send_error(c, 0, KV_EPROTO, n->o.first,
                             "ring: a client sends SUBMIT, SUBMIT_CHAT, SUBMIT_TOKENS, VOCAB and STATUS frames only");
            kv_net_conn_close(nc, KV_EPROTO, "client frame");
            return KV_EPROTO;
        }
        if (ty == KV_RING_SUBMIT) kv_rn_on_submit(n, c, &m.u.submit.p, m.u.submit.text, m.u.submit.text_len, NULL, NULL);
        else if (ty == KV_RING_SUBMIT_CHAT) kv_rn_on_submit(n, c, &m.u.chat.p, NULL, 0, &m.u.chat, NULL);
        else kv_rn_on_submit(n, c, &m.u.stok.p, NULL, 0, NULL, &m.u.stok);
        return 0;
    }
    /* the link from the node before; what changes which sequences exist runs after the queue */
    if (ty != KV_RING_HIDDEN && ty != KV_RING_LOOKUP && !(ty == KV_RING_TOKEN && !m.u.token.stop)) kv_rn_flush(n);
    switch (ty) {
    case KV_RING_LOOKUP: kv_rn_on_lookup(n, &m.u.lookup, f, len); break;
    case KV_RING_START: kv_rn_on_start(n, &m.u.start, f, len); break;
    case KV_RING_HIDDEN: kv_rn_on_hidden(n, &m.u.hidden); break;
    case KV_RING_TOKEN: kv_rn_on_token(n, &m.u.token, f, len); break;
    case KV_RING_ERROR:
        if (m.u.error.seq == 0) {
            kv_net_conn_close(nc, m.u.error.code, m.u.error.msg);
            return m.u.error.code;
        }
        kv_rn_on_error_frame(n, &m.u.error, f, len);
        break;
    case KV_RING_BROKEN:
        kv_rn_broken(n, m.u.broken.msg);
        if (m.u.broken.origin != n->o.first && kv_rn_next_up(n)) kv_rn_send_raw(n->next, f, len);
        break;
    case KV_RING_PROBE: kv_rn_on_probe(n, &m.u.probe, f, len); break;
    default:
        kv_rn_send_error(c, 0, KV_EPROTO, n->o.first, "ring: unexpected frame on a ring link");
        kv_net_conn_close(nc, KV_EPROTO, "unexpected frame");
        return KV_EPROTO;
    }
    return 0;
}

static void kv_rc_on_open(kv_net_conn *nc, int code) {
    kv_rconn *c = kv_net_conn_data(nc);
    kv_ring_node *n = c->n;
    if (code < 0) return; /* on_close follows and redials */
    if (c->role != KV_RC_NEXT) return; /* an accepted connection's transport opened: the peer speaks first */
    kv_ring_hello me = {KV_RING_ROLE_LINK, n->n_layer, n->o.first, n->o.last, n->n_embd, n->n_vocab, {0}};
    memcpy(me.model_id, n->model_id, sizeof me.model_id);
    uint8_t buf[KV_RING_HEADER + 24 + KV_RING_MODEL_ID_LEN];
    size_t bl;
    if (!kv_ring_hello_encode(buf, sizeof buf, KV_RING_HELLO, &me, &bl, NULL)) kv_rn_send_raw(c, buf, bl);
}

static const kv_net_conn_cbs kv_rc_cbs = {
    .on_open = kv_rc_on_open,
    .frame_len = kv_rc_frame_len,
    .on_frame = kv_rc_on_frame,
    .on_error = kv_rc_on_error,
    .on_close = kv_rc_on_close,
};

static kv_net_conn_opts kv_rn_conn_opts(void) {
    return (kv_net_conn_opts){.header = KV_RING_HEADER, .max_frame = KV_RING_HEADER + KV_RING_MAX_PAYLOAD,
                              .tx_max = KV_RN_TX_MAX, .frame_timeout_ms = 30000, .write_timeout_ms = 30000};
}

static int kv_rn_resolve_next(kv_ring_node *n, const char *host_port, kv_diag *d);
static void kv_rc_hello_timeout(kv_net_loop *l, kv_net_timer *t);
static void kv_rn_redial(kv_net_loop *l, kv_net_timer *t) {
    kv_ring_node *n = t->data;
    if (n->next) return;
    pthread_mutex_lock(&n->next_mu); /* a new next from the hub */
    if (n->next_changed) {
        n->next_changed = false;
        kv_diag d = {0};
        if (kv_rn_resolve_next(n, n->next_want, &d)) kv_rn_log(n, "%s", d.msg);
        else kv_rn_log(n, "next node: %s (from the hub)", n->next_addr);
    }
    pthread_mutex_unlock(&n->next_mu);
    if (!n->next_salen) { /* not known yet */
        kv_net_timer_start(l, t, KV_RN_REDIAL_MS);
        return;
    }
    kv_rconn *c = kv_rc_new(n);
    if (!c) {
        kv_net_timer_start(l, t, KV_RN_REDIAL_MS);
        return;
    }
    c->role = KV_RC_NEXT;
    kv_net_timer_init(&c->hs_t, kv_rc_hello_timeout, c); /* the next must answer HELLO and AUTH in time */
    kv_net_conn_opts o = kv_rn_conn_opts();
    if (!n->o.insecure_plaintext) { /* TLS; the next's key is checked in its AUTH_CHALLENGE, bound to the session */
        if (kv_link_sniff_new_client(&c->tp, n->tls, NULL, NULL)) {
            kv_rc_free(c);
            kv_net_timer_start(l, t, KV_RN_REDIAL_MS);
            return;
        }
        o.io = &kv_link_sniff_io;
        o.io_ctx = c->tp;
    }
    if (kv_net_conn_dial(&c->nc, l, (const struct sockaddr *)&n->next_sa, n->next_salen, 2000, &o, &kv_rc_cbs, c, NULL)) {
        kv_rc_free(c);
        kv_net_timer_start(l, t, KV_RN_REDIAL_MS);
        return;
    }
    n->next = c;
    kv_net_timer_start(l, &c->hs_t, KV_RN_HELLO_MS);
}

static void kv_rc_hello_timeout(kv_net_loop *l, kv_net_timer *t) {
    (void)l;
    kv_rconn *c = t->data;
    kv_rn_send_error(c, 0, KV_ETIMEOUT, c->n->o.first, "ring: the handshake (HELLO, AUTH) did not complete in time");
    kv_net_conn_close(c->nc, KV_ETIMEOUT, "the handshake did not complete in time");
}

static void kv_rn_accept(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    (void)ev;
    kv_ring_node *n = w->data;
    for (int k = 0; k < 16; k++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(n->lfd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) return;
        if (n->n_conns >= KV_RN_MAX_CONNS) { /* full: the newcomer is refused, the ring keeps serving */
            close(fd);
            continue;
        }
        int one = 1; /* tokens go out one small frame at a time: no Nagle */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        kv_rconn *c = kv_rc_new(n);
        if (!c) {
            close(fd);
            return;
        }
        kv_net_timer_init(&c->hs_t, kv_rc_hello_timeout, c);
        kv_net_conn_opts o = kv_rn_conn_opts();
        o.budget = &n->budget; /* a stranger's half-sent frames are bounded all together */
        c->loopback = kv_link_sockaddr_loopback((struct sockaddr *)&ss);
        if (kv_link_sniff_new(&c->tp, n->tls, NULL)) {
            close(fd);
            kv_rc_free(c);
            return;
        }
        o.io = &kv_link_sniff_io; /* TLS or plaintext, told by the first byte */
        o.io_ctx = c->tp;
        o.handshake_timeout_ms = KV_RN_HELLO_MS + 1000; /* hs_t (with an ERROR) fires first */
        if (kv_net_conn_new(&c->nc, l, fd, &o, &kv_rc_cbs, c, NULL)) {
            kv_rc_free(c);
            continue;
        }
        kv_net_timer_start(l, &c->hs_t, KV_RN_HELLO_MS);
    }
}

/* ---- life ------------------------------------------------------------------------------- */

/* Expert weights of a sliced model from the slabs present (mmap views). */
static int kv_rn_pieces_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    const kv_pieces *p = ctx;
    if (layer >= p->m->n_layer || e >= p->m->n_expert)
        return kv_fail(d, KV_ERANGE, "ring: layer %u expert %u out of range", layer, e);
    const int32_t si = p->where[(size_t)layer * p->m->n_expert + e];
    if (si < 0) return kv_fail(d, KV_ENOTFOUND, "ring: no slab here holds layer %u expert %u", layer, e);
    kv_piece_slab_weights(&p->slabs[si], e, w); /* biases and activation included */
    return 0;
}

/* The tail's MTP draft source: the block mapped with the window (.mtp),
 * its experts from the window's provider (experts; NULL: the window's own
 * file). When there is none, mtp_why says why and --draft mtp requests are
 * refused with it; every other request is served as before. Experts on
 * workers are checked per request (workers come and go). */
static void kv_rn_mtp_open(kv_ring_node *n, const kv_expert_provider *experts) {
    snprintf(n->mtp_why, sizeof n->mtp_why, "?");
    if (n->pc && !n->remote && n->hp->n_layer_nextn) { /* local slabs: the block's must all be here */
        const kv_manifest *mf = n->pc->m;
        for (uint32_t e = 0; e < mf->n_expert; e++)
            if (n->pc->where[(size_t)n->n_layer * mf->n_expert + e] < 0) {
                snprintf(n->mtp_why, sizeof n->mtp_why, "no slab here holds layer %u expert %u (the MTP block's "
                         "experts; --worker, or every slab of layer %u)", n->n_layer, e, n->n_layer);
                return;
            }
    }
    kv_diag d = {0};
    if (kv_draft_open(&n->mtp, "mtp", n->m, experts, n->pool, n->max_seqs, &d))
        snprintf(n->mtp_why, sizeof n->mtp_why, "%s", d.msg);
}

/* Resolves host_port into the next node's address. */
static int kv_rn_resolve_next(kv_ring_node *n, const char *host_port, kv_diag *d) {
    char host[256];
    uint16_t port;
    int rc = kv_link_parse_addr(host_port, host, sizeof host, &port, d);
    if (rc) return rc;
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int g = getaddrinfo(host, ps, &hints, &ai);
    if (g || !ai) return kv_fail(d, KV_EINVAL, "ring: cannot resolve the next node '%s': %s", host_port, gai_strerror(g));
    memcpy(&n->next_sa, ai->ai_addr, ai->ai_addrlen);
    n->next_salen = ai->ai_addrlen;
    freeaddrinfo(ai);
    snprintf(n->next_addr, sizeof n->next_addr, "%s", host_port);
    return 0;
}

void kv_ring_node_set_next(kv_ring_node *n, const char *host_port) {
    pthread_mutex_lock(&n->next_mu);
    if (strcmp(n->next_want, host_port)) {
        snprintf(n->next_want, sizeof n->next_want, "%s", host_port);
        n->next_changed = true;
    }
    pthread_mutex_unlock(&n->next_mu);
    kv_net_loop_wake(n->loop);
}

void kv_ring_node_window(const kv_ring_node *n, uint32_t *first, uint32_t *last, uint32_t *n_layer) {
    *first = n->o.first;
    *last = n->o.last;
    *n_layer = n->n_layer;
}

int kv_ring_node_new(kv_ring_node **out, const kv_ring_node_opts *opts, kv_diag *d) {
    *out = NULL;
    kv_ring_node *n = calloc(1, sizeof *n);
    if (!n) return kv_fail(d, KV_ENOMEM, "ring: out of memory");
    n->o = *opts;
    n->lfd = -1;
    if (!n->o.max_seqs) n->o.max_seqs = 16;
    if (!n->o.n_batch) n->o.n_batch = 256;
    if (!n->o.replay_timeout_ms) n->o.replay_timeout_ms = 30000;
    int rc = 0;
    if (n->o.max_seqs > 4096 || n->o.n_batch > KV_RING_MAX_TOKENS) {
        rc = kv_fail(d, KV_EINVAL, "ring: %u sequences / batch %u out of range (max 4096 / %u)", n->o.max_seqs, n->o.n_batch,
                     KV_RING_MAX_TOKENS);
        goto fail;
    }
    if (!n->o.model || !n->o.listen) {
        rc = kv_fail(d, KV_EINVAL, "ring: a model and a listen address are required");
        goto fail;
    }
    n->max_seqs = n->o.max_seqs;
    n->n_batch = n->o.n_batch;
    if (!n->o.allow_any && !n->o.n_allow) {
        rc = kv_fail(d, KV_EINVAL, "ring: no key is admitted: give --allow-key KEY (the keys of the other nodes and of "
                                   "clients) or --open");
        goto fail;
    }
    if (sodium_init() < 0) {
        rc = kv_fail(d, KV_EINTERNAL, "ring: libsodium did not initialize");
        goto fail;
    }
    if (n->o.key_sk) {
        memcpy(n->sk, n->o.key_sk, 64);
    } else {
        uint8_t pk[32];
        crypto_sign_keypair(pk, n->sk);
    }
    if (n->o.n_allow) {
        if (!(n->allow = malloc(n->o.n_allow * sizeof *n->allow))) {
            rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
            goto fail;
        }
        memcpy(n->allow, n->o.allow_keys, n->o.n_allow * sizeof *n->allow);
    }
    if (n->o.hub_key) {
        memcpy(n->hub_key, n->o.hub_key, 32);
        n->has_hub_key = true;
    }
    n->o.key_sk = NULL;
    n->o.allow_keys = NULL;
    n->o.hub_key = NULL;
    pthread_mutex_init(&n->next_mu, NULL);
    pthread_mutex_init(&n->dm_mu, NULL);
    if (n->o.next && (rc = kv_rn_resolve_next(n, n->o.next, d))) goto fail; /* else set later (a hub) */
    if ((rc = kv_pool_new(&n->pool, n->o.n_threads, d))) goto fail;
    const size_t pl = strlen(n->o.model);
    struct stat mst;
    const bool is_dir = !stat(n->o.model, &mst) && S_ISDIR(mst.st_mode);
    /* the tail maps the MTP block and the embedding too (views: touched only by --draft mtp) */
    const kv_model_opts mo = {.window = true, .layer_first = n->o.first, .layer_last = n->o.last, .mtp = true};
    const kv_expert_provider *experts = NULL;
    /* logit rows per pass: one per sequence, and room for two verify passes */
    const uint32_t rows_cap = n->max_seqs + 2 * (KV_RING_MAX_DRAFT + 1);
    uint32_t max_tok = n->n_batch > n->max_seqs ? n->n_batch : n->max_seqs;
    if (max_tok < rows_cap) max_tok = rows_cap;
    if (is_dir || (pl >= 5 && !strcmp(n->o.model + pl - 5, ".json"))) { /* sliced: backbone window + its slabs */
        char man[4200];
        snprintf(man, sizeof man, is_dir ? "%s/manifest.json" : "%s", n->o.model);
        const kv_pieces_opts po = {.who = "ring", .runnable = true, .slabs_may_be_missing = true,
                                   .skip_hashes = n->o.skip_hashes, .allow_sparse = n->o.allow_sparse,
                                   .keep_gguf = true, .n_threads = n->o.n_threads};
        kv_model_opts bo = mo;
        bo.no_experts = true;
        if ((rc = kv_pieces_open(&n->pc, man, &po, d)) ||
            (rc = kv_model_load_ex(&n->m, n->pc->backbone, &bo, d)) ||
            (rc = kv_pieces_check_model(n->pc->m, n->m, "ring", d)))
            goto fail;
        const kv_manifest *mf = n->pc->m;
        if (n->o.n_workers) { /* one market, two modes: this window's experts on expert workers */
            /* the other windows' experts are not ours to cover: open, then check our layers */
            const kv_remote_opts ro = {.workers = n->o.workers, .n_workers = n->o.n_workers, .max_tokens = max_tok,
                                       .skip_hashes = n->o.skip_hashes, .allow_sparse = n->o.allow_sparse,
                                       .log = n->o.log, .key_sk = n->sk,
                                       .allow_uncovered = true, .insecure_plaintext = n->o.insecure_plaintext};
            if ((rc = kv_remote_open(&n->remote, man, n->pool, &ro, d))) goto fail;
            experts = kv_remote_provider(n->remote);
            /* a worker still starting, or one that refused us for room and is
             * dialed again, comes up within the wait: keep looking until then */
            const uint32_t wait_ms = n->o.worker_wait_ms ? n->o.worker_wait_ms : 30000;
            for (uint32_t waited = 0;; waited += 100) {
                kv_remote_coverage cov;
                uint32_t miss[256];
                kv_remote_get_coverage(n->remote, &cov, miss, 256);
                const kv_manifest_slab *gap = NULL;
                for (uint32_t k = 0; k < cov.n_missing && !gap; k++) {
                    const kv_manifest_slab *sl = &mf->slabs[miss[k]];
                    if (sl->layer >= n->o.first && sl->layer <= n->o.last) gap = sl;
                }
                if (!gap) break;
                if (waited >= wait_ms) {
                    rc = kv_fail(d, KV_ENOTFOUND, "ring: layer %u experts %u-%u are served by no worker up after %u ms "
                                 "and their slab is not here", gap->layer, gap->first, gap->last, wait_ms);
                    goto fail;
                }
                kv_remote_tend(n->remote, 100);
            }
        }
        for (uint32_t il = n->o.first; il <= n->o.last && !n->remote; il++)
            for (uint32_t e = 0; e < mf->n_expert; e++)
                if (n->pc->where[(size_t)il * mf->n_expert + e] < 0) {
                    rc = kv_fail(d, KV_ENOTFOUND, "ring: no slab here holds layer %u expert %u (the window %u-%u needs "
                                 "every slab of its layers)", il, e, n->o.first, n->o.last);
                    goto fail;
                }
        const kv_expert_source src = {n->pc, kv_rn_pieces_acquire, NULL, mf->n_layer, mf->n_expert, mf->n_embd,
                                      kv_model_hparams(n->m)->n_ff_exp, kv_model_hparams(n->m)->n_expert_used};
        if (!n->remote) {
            if ((rc = kv_expert_local_new_src(&n->prov, &src, n->pool, max_tok, d)) ||
                (rc = kv_demand_meter_new(&n->meter, &n->prov, mf, d)))
                goto fail;
            experts = kv_demand_meter_provider(n->meter);
        }
        if (!(n->dm = calloc(mf->n_slabs ? mf->n_slabs : 1, sizeof *n->dm))) {
            rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
            goto fail;
        }
        snprintf(n->model_id, sizeof n->model_id, "%s", mf->model_id);
    } else {
        if (n->o.allow_sparse) { /* as run: only a manifest describes a skeleton's pieces */
            rc = kv_fail(d, KV_EINVAL, "ring: sparse pieces (--allow-sparse) need a sliced model (DIR/manifest.json), "
                         "not '%s'", n->o.model);
            goto fail;
        }
        if ((rc = kv_model_load_ex(&n->m, n->o.model, &mo, d))) goto fail;
        char id[65];
        if ((rc = kv_pieces_file_identity(kv_model_gguf(n->m), n->o.model, id, d))) goto fail;
        memcpy(n->model_id, id, sizeof n->model_id);
    }
    n->hp = kv_model_hparams(n->m);
    n->n_layer = n->hp->n_layer;
    n->n_embd = n->hp->n_embd;
    n->n_vocab = n->hp->n_vocab;
    n->head = n->o.first == 0;
    n->tail = n->o.last == n->n_layer - 1;
    const kv_state_opts so = {.n_ctx = n->o.n_ctx, .n_batch = n->n_batch, .experts = experts, .n_seq = n->max_seqs,
                              .max_tokens = max_tok};
    if ((rc = kv_state_new(&n->st, n->m, n->pool, &so, d))) goto fail;
    n->n_ctx = kv_state_n_ctx(n->st);
    if (n->tail) kv_rn_mtp_open(n, experts);
    n->seqs = calloc(n->max_seqs, sizeof *n->seqs);
    n->max_tok = max_tok;
    n->xin = malloc((size_t)max_tok * n->n_embd * sizeof(float));
    n->xout = malloc((size_t)max_tok * n->n_embd * sizeof(float));
    n->rows_cap = rows_cap;
    n->logits = malloc((size_t)(n->tail ? rows_cap : n->max_seqs) * n->n_vocab * sizeof(float));
    n->tbuf = malloc(n->n_batch * sizeof *n->tbuf);
    n->q_tok = malloc(max_tok * sizeof *n->q_tok);
    n->sbuf = malloc(max_tok * sizeof *n->sbuf);
    n->q_out = malloc(rows_cap * sizeof *n->q_out);
    n->jobs = malloc(max_tok * sizeof *n->jobs);
    if (!n->seqs || !n->xin || !n->xout || !n->logits || !n->tbuf || !n->q_tok || !n->sbuf || !n->q_out || !n->jobs) {
        rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
        goto fail;
    }
    if (n->o.prompt_cache_bytes) {
        kv_state_mem mem;
        kv_state_get_mem(n->st, &mem);
        n->pc_block = n->o.prompt_cache_block ? n->o.prompt_cache_block : 64;
        if (n->pc_block % mem.block_tokens || n->pc_block > KV_RING_MAX_CACHE_BLOCK) {
            rc = kv_fail(d, KV_EINVAL, "ring: prompt cache block of %u tokens is not a multiple of %u up to %u", n->pc_block,
                         mem.block_tokens, KV_RING_MAX_CACHE_BLOCK);
            goto fail;
        }
        const uint64_t rec = kv_state_rec_bytes(n->st);
        n->pc_rec = rec != 0;
        if ((rc = kv_pcache_new(&n->pcache, n->o.prompt_cache_bytes, n->pc_block, kv_state_kv_bytes(n->st, n->pc_block),
                                rec, d)))
            goto fail;
        n->pc_path = malloc(((size_t)n->n_ctx / n->pc_block + 1) * sizeof *n->pc_path);
        n->pc_tok = malloc((size_t)n->n_ctx * sizeof *n->pc_tok);
        n->pc_bits = malloc((size_t)n->n_ctx / n->pc_block / 8 + 1);
        if (!n->pc_path || !n->pc_tok || !n->pc_bits) {
            rc = kv_fail(d, KV_ENOMEM, "ring: out of memory for the prompt cache");
            goto fail;
        }
    }
    n->stats.weight_bytes = kv_model_weight_bytes(n->m);
    if (getrandom(&n->id_base, sizeof n->id_base, 0) != sizeof n->id_base) n->id_base = (uint64_t)time(NULL) * 0x2545f4914f6cdd1dull;
    kv_net_budget_init(&n->budget, (size_t)1 << 31);
    if ((rc = kv_link_tls_ctx(&n->tls, n->sk, d))) goto fail;
    if ((rc = kv_net_loop_new(&n->loop, d))) goto fail;
    if ((rc = kv_net_listen(n->o.listen, 64, &n->lfd, n->addr, sizeof n->addr, d))) goto fail;
    if ((rc = kv_net_watch_add(n->loop, &n->lw, n->lfd, KV_NET_READ, kv_rn_accept, n, d))) goto fail;
    kv_net_loop_set_tick(n->loop, kv_rn_tick, n);
    kv_net_timer_init(&n->redial_t, kv_rn_redial, n);
    kv_net_timer_init(&n->probe_t, kv_rn_probe_timer, n);
    kv_net_timer_init(&n->tick_t, kv_rn_tick_timer, n);
    kv_net_timer_init(&n->delay_t, kv_rn_delay_timer, n);
    snprintf(n->why, sizeof n->why, "the ring has not formed yet");
    *out = n;
    return 0;
fail:
    kv_ring_node_free(n);
    return rc;
}

const char *kv_ring_node_addr(const kv_ring_node *n) { return n->addr; }

int kv_ring_node_run(kv_ring_node *n, kv_diag *d) {
    kv_net_timer_start(n->loop, &n->redial_t, 0);
    kv_net_timer_start(n->loop, &n->tick_t, KV_RN_TICK_MS);
    return kv_net_loop_run(n->loop, d);
}

void kv_ring_node_stop(kv_ring_node *n) {
    if (n && n->loop) kv_net_loop_stop(n->loop);
}

void kv_ring_node_get_stats(const kv_ring_node *n, kv_ring_node_stats *out) {
    *out = n->stats;
    if (n->pcache) {
        kv_pcache_stats ps;
        kv_pcache_get_stats(n->pcache, &ps);
        out->cache_blocks = ps.entries;
        out->cache_bytes = ps.bytes;
        out->cache_evictions = ps.evictions;
    }
}

const kv_manifest *kv_ring_node_manifest(const kv_ring_node *n) { return n->dm ? n->pc->m : NULL; }

void kv_ring_node_get_demand(kv_ring_node *n, kv_remote_demand *out, size_t cap, uint64_t *tokens) {
    *tokens = 0;
    if (!n->dm) return;
    const size_t ns = n->pc->m->n_slabs < cap ? n->pc->m->n_slabs : cap;
    pthread_mutex_lock(&n->dm_mu);
    memcpy(out, n->dm, ns * sizeof *out);
    *tokens = n->dm_tokens;
    pthread_mutex_unlock(&n->dm_mu);
}

void kv_ring_node_free(kv_ring_node *n) {
    if (!n) return;
    if (n->loop) {
        if (n->lfd >= 0 && n->lw.fn) kv_net_watch_del(n->loop, &n->lw);
        kv_net_loop_free(n->loop); /* closes every connection without on_close */
    }
    while (n->conns) kv_rc_free(n->conns);
    kv_tls_ctx_free(n->tls);
    kv_rn_delay_drop(n);
    if (n->lfd >= 0) close(n->lfd);
    while (n->reqs) {
        kv_rreq *r = n->reqs;
        n->reqs = r->next;
        free(r->toks);
        free(r->bias);
        free(r->grammar);
        free(r->drec);
        free(r);
    }
    if (n->seqs)
        for (uint32_t i = 0; i < n->max_seqs; i++) {
            kv_sampler_free(n->seqs[i].smp);
            free(n->seqs[i].ctx);
            free(n->seqs[i].drec);
            free(n->seqs[i].ptok);
        }
    free(n->seqs);
    kv_draft_free(n->mtp);
    kv_state_free(n->st);
    if (n->prov.free) n->prov.free(n->prov.impl);
    kv_remote_free(n->remote);
    kv_pieces_free(n->pc);
    pthread_mutex_destroy(&n->next_mu);
    pthread_mutex_destroy(&n->dm_mu);
    kv_demand_meter_free(n->meter);
    free(n->dm);
    kv_model_free(n->m);
    kv_pool_free(n->pool);
    free(n->xin);
    free(n->xout);
    free(n->logits);
    free(n->vocab);
    kv_grammar_vocab_free(n->gvocab);
    free(n->tbuf);
    free(n->q_tok);
    free(n->sbuf);
    free(n->q_out);
    free(n->jobs);
    kv_pcache_free(n->pcache);
    free(n->pc_path);
    free(n->pc_tok);
    free(n->pc_bits);
    free(n->allow);
    sodium_memzero(n->sk, sizeof n->sk);
    free(n);
}
