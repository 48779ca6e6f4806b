/* The gateway server's own state, shared by its files:
 *   server.c   start and stop (kv_gateway_start / _free), the keys file;
 *   routes.c   HTTP: routing, the key check, replies, a request's life on its
 *              connection thread (parse, tokenize, queue, text, stream);
 *   sched.c    the scheduler: the queue (fair between clients), admission,
 *              the engine's steps, health from the workers' coverage;
 *   ring.c     the same over ring entry nodes: a thread per request, the
 *              nodes' STATUS for /health;
 *   metrics.c  /metrics, /v1/slots and /health's bodies;
 *   endpoints.c the endpoints that are no generation (/tokenize,
 *              /detokenize, /props, /api/show, /api/version, /api/ps,
 *              /v1/models/{id}), CORS, the request log line and the
 *              startup summary;
 *   webui.c    the chat page at / (chat.html, compiled in) and its CSP.
 * What each API's requests and answers look like is gateway_internal.h's
 * (one table of handlers per API); this file is the server's plumbing.
 *
 * A request's life: its connection thread reads the body (at most
 * body_max), checks the key, parses and tokenizes, then queues a kv_gw_req
 * (at most queue_max waiting: beyond that 503 + Retry-After). The scheduler
 * admits queued requests as sessions between steps (at most max_active at
 * once), steps the engine, appends each session's new token to its
 * request's token array (allocated once, never moved: readers take
 * toks[0..n_toks) without the lock), and frees finished sessions. The
 * connection thread turns tokens into text (gateway/text.c) and answers
 * whole or as a stream. A client that goes away (its socket hung up, seen
 * before every wait) or a stop string marks the request cancelled, and the
 * scheduler frees its session before the next step.
 *
 * With ring entry nodes (opts.n_ring) there is no engine: the scheduler
 * gives each admitted request a thread that submits it to a ring node and
 * publishes the tokens (and their text) the home streams back, the same
 * way (ring.c).
 *
 * Locking: one mutex (g->mu) guards every queue, list, counter and the
 * mutable fields of every request; work_cv wakes the scheduler, out_cv the
 * connection threads. A request is freed when its last reference (the
 * connection's, the scheduler's) is dropped. Functions named *_locked are
 * called with g->mu held. */
#ifndef KVASIR_GATEWAY_SERVER_INTERNAL_H
#define KVASIR_GATEWAY_SERVER_INTERNAL_H

#include <microhttpd.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "gateway/gateway_internal.h"
#include "gateway/pay.h"
#include "http/http_guard.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/gateway.h"
#include "kvasir/ledger.h"
#include "kvasir/node.h"
#include "kvasir/ring.h"

#define KV_GW_N_CODES 10     /* HTTP statuses counted apart (metrics.c) */
#define KV_GW_N_BUCKETS 12   /* step-time histogram buckets (metrics.c) */
#define KV_GW_MISSING_MAX 16 /* uncovered shards named by /health */

enum { KV_REQ_QUEUED = 0, KV_REQ_ACTIVE, KV_REQ_DONE };

/* TEST ONLY (script.c): a scripted output's tokens */
#define KV_GW_SCRIPT_MAX 64u
#define KV_GW_SCRIPT_MAX_BYTES (1u << 20)
typedef struct kv_gw_script {
    int32_t *toks;              /* [n] */
    uint32_t n;
} kv_gw_script;

typedef struct kv_gw_req {
    struct kv_gw_req *next;     /* queue or active list (g->mu) */
    uint64_t id;                /* 1, 2, ... */
    uint64_t client;            /* who asked (its API key, or its address when no keys): keyed hash */
    int api;
    kv_session_opts so;
    int32_t *prompt;            /* [n_prompt], freed once prompted */
    uint32_t n_prompt;
    uint32_t max_tokens;
    struct kv_grammar *grammar; /* structured output its session samples under (owned), NULL none */
    const kv_gw_script *script; /* TEST ONLY: the tokens published in place of the sampled ones, or NULL */
    kv_gw_budget budget;        /* the reasoning budget (budget.on false: none); the scheduler's */
    /* guarded by g->mu */
    int refs;
    int state;                  /* KV_REQ_* */
    bool cancel;                /* client gone or a stop string matched */
    bool displaced;             /* dropped from a full queue for another client's request (503) */
    bool cut;                   /* the output ends here: a forced end of reasoning met max_tokens */
    int32_t *toks;              /* [cap] tokens published; entries below n_toks never change */
    kv_token_logprob *lps;      /* [cap] their log-probabilities (so.logprobs), or NULL; as toks */
    kv_token_logprob *plps;     /* [n_prompt] the prompt's (so.prompt_logprobs: echo), or NULL; written
                                   once, before the first token shows (n_toks > 0): plps[i] of token i */
    uint32_t n_plps;            /* entries written (0 until then) */
    int32_t prompt0;            /* the prompt's first token (its entry: no log-probability) */
    uint32_t plp_skip;          /* leading entries of plps that are no text of the prompt (a BOS added) */
    struct kv_gw_req *lead;     /* a later choice of the same request (OpenAI's "n"): admitted once the first
                                   choice's prompt is evaluated, so the prompt cache holds it (the lead
                                   outlives it: the connection holds both and cancels them together) */
    uint32_t n_toks, cap;
    enum kv_stop stop;
    int err;                    /* 0, or why it failed */
    char errmsg[256];
    kv_session *s;              /* the scheduler's */
    enum kv_session_status sst; /* last seen, for /v1/slots */
    uint32_t n_cached;          /* prompt tokens its session took from the prompt cache */
    bool paid;                  /* its work is recorded below when it finishes */
    uint64_t products;          /* its session's (token, expert) products (kv_session_work), once DONE */
    kv_gw_work_node *work;      /* [n_work] workers that answered some of them, once DONE */
    kv_receipt *rcpts;          /* [n_work] their receipts (work[i].receipt points here) */
    uint32_t n_work;
    uint8_t pay_consumer[32], pay_nonce[16]; /* the authorization it is paid by */
    /* a ring request (g->n_ring): its prompt is the tokens above (rendered
       and tokenized here, as for a local engine), its grammar travels as text */
    struct kv_gateway *g;
    char *rgrammar;             /* the GBNF text of grammar (owned), NULL none; a later choice uses its lead's */
    kv_logit_bias *rbias;       /* so.sample.bias's copy (owned), NULL none */
    bool accepted;              /* (g->mu) the home took it */
} kv_gw_req;

/* The local-experts policy's state (autoscale.c). level 0 is tight (every
 * held expert computed here), KV_GW_AS_LEVELS wide (all sent to workers). */
#define KV_GW_AS_LEVELS 4u
typedef struct kv_gw_autoscale {
    bool on;                    /* a local budget and an engine with workers */
    uint64_t budget;            /* bytes of slab files held (--local-experts) */
    uint64_t held_bytes;        /* of them chosen now */
    uint32_t held_slabs;
    uint32_t level;             /* 0..KV_GW_AS_LEVELS; local share = 1 - level / KV_GW_AS_LEVELS */
    uint32_t widen_at[KV_GW_AS_LEVELS + 1]; /* sessions active when each level was entered */
    double target_s;            /* step time target; 0 until derived */
    bool target_given;          /* --step-target-ms (else derived from tight steps) */
    double min_tight_s;         /* shortest step seen at level 0 */
    uint32_t n_tight;           /* steps seen at level 0 (the derivation waits for a few) */
    double ewma_s;              /* step time, moving average */
    double last_change;         /* monotonic seconds of the last decision */
    double rehold_at;           /* when the held slabs are chosen again by demand */
    double cost[KV_GW_AS_LEVELS + 1]; /* per level: moving average of step time per session */
    uint32_t cost_n[KV_GW_AS_LEVELS + 1]; /* steps in it (0: not measured at this load) */
    uint32_t cost_conc;         /* load when the costs began (they hold for this load) */
    double cost_at[KV_GW_AS_LEVELS + 1]; /* monotonic seconds of each level's last costed step */
    double reprobe_s;           /* a wider level measured dearer is not tried again before this (s) */
    uint32_t unpaid_here;       /* "did not pay" tightenings since the costs began */
    double unpaid_at[KV_GW_AS_LEVELS + 1]; /* when each level last did not pay (0: not since the costs began) */
    uint32_t load;              /* most sessions active at once over the last 0.5 to 1 s */
    uint32_t load_cur, load_prev; /* the most in the current and the previous half-second window */
    double load_win;            /* start of the current window */
    uint64_t widened, tightened;/* decisions */
    uint64_t unpaid;            /* of the tightenings: a wider level cost more per session */
    uint64_t probes;            /* of the tightenings: to measure the narrower level at this load */
    uint64_t rehold;            /* times the held set was chosen again */
    uint64_t pairs_remote, pairs_local, pairs_held_local; /* the remote's, after the last step */
    kv_remote_demand *demand;   /* [n_demand] per manifest slab, copied after each step (NULL: none) */
    size_t n_demand;
} kv_gw_autoscale;

struct kv_gateway {
    kv_engine *e;               /* the scheduler's alone */
    const kv_tok *tok;          /* immutable: any thread */
    uint32_t n_ctx;
    kv_gateway_opts o;
    char model[KV_GW_MAX_MODEL_LEN + 1];
    char **keys;                /* [n_keys] copies */
    uint32_t n_keys;
    long long started;          /* unix seconds */
    struct MHD_Daemon *mhd;
    uint16_t port;
    pthread_t sched;
    bool sched_up;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, out_cv;
    /* guarded by mu */
    bool quit, hold, healthy;
    char health_msg[256];
    kv_gw_req *queue, *queue_tail, *active;
    uint32_t n_queued, n_active;
    uint64_t next_id;
    uint64_t req_count[KV_GW_API_COUNT + 1][KV_GW_N_CODES];
    uint64_t completed, cancelled, rejected_full, tokens_prompt, tokens_completion;
    uint64_t steps, steps_failed;
    uint64_t tokens_generated;  /* tokens the engine produced for requests (sent or not) */
    uint32_t max_batch;         /* most sessions one step carried */
    kv_engine_stats eng;        /* the engine's counters after the last step (the scheduler's copy) */
    kv_gw_pay *pay;             /* charging (pay.h), NULL when free */
    kv_gw_tmpl *tmpl;           /* the chat template (immutable: any thread), NULL: ChatML */
    kv_gw_script script[KV_GW_SCRIPT_MAX]; /* TEST ONLY (script.c): [n_script], immutable once started */
    uint32_t n_script;
    uint64_t script_next;       /* (mu) the next request's text */
    kv_http_guard *guard;       /* connection limits and request deadlines (http_guard.h) */
    uint8_t client_salt[16];    /* keys the hash that names a client (kv_gw_req.client) */
    size_t parse_live;          /* (mu) bytes parsed JSON holds, or is reserved for a parse */
    uint64_t parse_refused, displaced;
    uint64_t step_bucket[KV_GW_N_BUCKETS + 1];
    double step_sum;
    /* a swarm: the engine's experts on workers */
    const kv_manifest *man;     /* the coordinator's manifest (immutable), NULL without workers */
    kv_gw_watch *watch;         /* the hub's placement reader, or NULL */
    double fail_since;          /* scheduler only: monotonic time steps began failing, 0 if not */
    /* guarded by mu */
    uint32_t cov_total, cov_covered, cov_up, cov_n_missing;
    uint32_t cov_missing[KV_GW_MISSING_MAX]; /* manifest slab indices of uncovered shards */
    uint64_t steps_retried;     /* failed steps kept for a retry */
    uint64_t workers_added;     /* workers added from the hub's placement */
    uint64_t hedges, hedges_won, late_answers; /* the remote's hedged requests (kv_remote_get_hedges) */
    uint64_t hedges_cancelled; /* superseded requests their worker dropped on a CANCEL (kv_remote_hedges_cancelled) */
    uint64_t sigs_checked, sigs_deferred; /* answer signatures checked on arrival / taken unchecked (kv_remote_get_sigs) */
    uint64_t hedged_pairs;      /* slots those hedges carried (kv_remote_hedged_pairs) */
    /* local experts (autoscale.c, docs/GATEWAY.md "Local experts"); guarded by mu */
    kv_gw_autoscale as;
    /* demand reports to the hub (demand.c); counters guarded by mu */
    struct kv_gw_demand *demand;
    uint64_t demand_reports, demand_report_errors, demand_tokens_accepted;
    /* workers caught lying (kv_gateway_caught): never asked for a receipt,
       never paid; guarded by caught_mu (taken from the engine's hook, inside
       a step, and under mu when a session settles: never the other way) */
    pthread_mutex_t caught_mu;
    uint8_t caught[KV_REMOTE_MAX_WORKERS][32];
    uint32_t n_caught;
    /* a ring (o.n_ring): entry nodes and what /health last heard from each */
    char *ring[KV_GATEWAY_MAX_RING];
    uint32_t n_ring;
    uint8_t ring_sk[64];        /* the client key proved to the nodes */
    kv_voucher ring_voucher;    /* the hub's voucher for it */
    bool has_ring_voucher;
    pthread_t ring_watch;
    bool ring_watch_up;
    pthread_cond_t ring_cv;     /* wakes the watcher to stop */
    /* guarded by mu */
    struct {
        bool up;                /* it answered STATUS */
        kv_ring_status st;      /* its answer */
        char err[256];          /* why it did not */
    } ring_st[KV_GATEWAY_MAX_RING];
    uint32_t ring_rr;           /* next entry to try first */
    /* the ring's tokenizer (VOCAB from an entry node, loaded once; then tok
       and n_ctx are set, under mu, before /health can say healthy) */
    uint8_t *ring_vocab;        /* the GGUF bytes ring_gguf reads */
    struct kv_gguf *ring_gguf;
    kv_tok *ring_tok;           /* tok, owned */
    kv_gw_tmpl *ring_tmpl_old;  /* the template opened before the tokenizer came (freed at the end) */
    uint32_t n_ring_threads;    /* request threads alive */
    /* endpoints.c (immutable once started) */
    char **cors;                /* [n_cors] allowed Origins ("*": any) */
    uint32_t n_cors;
    char *model_path;           /* for /props, or NULL */
    const char *tmpl_src;       /* the chat template's source (for /props, /api/show), or NULL */
    size_t tmpl_src_len;
    char *tmpl_own;             /* tmpl_src when it is our copy (freed) */
};

/* ---- sched.c ---- */
void kv_gw_req_unref_locked(kv_gw_req *r);
/* Ends r (its session freed, its work recorded when paid) with err/msg or
 * success, and drops the scheduler's reference. */
void kv_gw_req_finish_locked(kv_gateway *g, kv_gw_req *r, int err, const char *msg);
/* *ts = now + ms on CLOCK_REALTIME, for pthread_cond_timedwait. */
void kv_gw_deadline(struct timespec *ts, long ms);
void kv_gw_sched_health_locked(kv_gateway *g);
kv_gw_req *kv_gw_queue_pick_locked(kv_gateway *g);
bool kv_gw_queue_displace_locked(kv_gateway *g, const kv_gw_req *r);
void *kv_gw_sched_main(void *arg); /* the scheduler thread */

/* ---- ring.c ---- */
void *kv_gw_sched_ring(kv_gateway *g); /* the scheduler of a ring gateway */
void kv_gw_ring_poll(kv_gateway *g);
void *kv_gw_ring_watch_main(void *arg);
unsigned kv_gw_ring_http_status(int err);
/* Makes r (a request tokenized here) a ring request: the grammar's text
 * (a compulsory tool call's, built for format and think_open, or p's).
 * 0, or KV_ENOMEM / the tool grammar's error with d. */
int kv_gw_ring_req_attach(kv_gw_req *r, kv_gw_params *p, bool forced, int format, bool think_open, kv_diag *d);
/* Frees what a ring gateway loaded (its tokenizer), at the end. */
void kv_gw_ring_free(kv_gateway *g);

/* ---- script.c (TEST ONLY) ---- */
int kv_gw_script_load(kv_gateway *g, kv_diag *d); /* KVASIR_GATEWAY_TEST_SCRIPT, if set */
void kv_gw_script_free(kv_gateway *g);

/* ---- metrics.c ---- */
int kv_gw_code_index(unsigned status);              /* into req_count's second index */
void kv_gw_metrics_step_locked(kv_gateway *g, double seconds); /* one engine step's time */
/* autoscale.c: local experts, tight when quiet, wide when busy */
int kv_gw_autoscale_open(kv_gateway *g, uint64_t budget, double target_ms, kv_diag *d); /* before the scheduler */
void kv_gw_autoscale_step_locked(kv_gateway *g, double seconds); /* scheduler: after a step (n_active after it) */
void kv_gw_autoscale_idle_locked(kv_gateway *g);  /* scheduler: no session active */
void kv_gw_autoscale_free(kv_gateway *g);
/* demand.c: every few seconds, what the engine's remote needed per shard since
 * the hub's last accepted report, signed by key (copied) */
typedef struct kv_gw_demand kv_gw_demand;
int kv_gw_demand_start(kv_gw_demand **out, kv_gateway *g, const char *hub, const kv_node_key *key, kv_diag *d);
void kv_gw_demand_free(kv_gw_demand *r); /* stops the thread; accepts NULL */
char *kv_gw_metrics_text(kv_gateway *g);            /* GET /metrics (malloc'd; NULL on no memory) */
char *kv_gw_slots_json(kv_gateway *g);              /* GET /v1/slots */
char *kv_gw_health_json(kv_gateway *g, bool *ok);   /* GET /health: the body, *ok for 200 or 503 */

/* ---- endpoints.c ---- */
/* An answer: status, Content-Type and a malloc'd body (NULL on no memory). */
typedef struct kv_gw_reply {
    unsigned status;
    const char *type;
    char *body;
} kv_gw_reply;
/* At start, before the template: the CORS origins, the model path and the
 * template's source copied (KV_EINVAL naming a bad origin, KV_ENOMEM). */
int kv_gw_endpoints_start(kv_gateway *g, const kv_gateway_opts *o, kv_diag *d);
void kv_gw_endpoints_free(kv_gateway *g);
/* The summary of the model on stderr (unless quiet), once listening. */
void kv_gw_summary(kv_gateway *g, const char *host, bool tls);
/* Whether url (with method) is one of endpoints.c's; *api the error shape,
 * *name its path as the log names it (a static string). */
bool kv_gw_endpoint_of(const char *method, const char *url, bool *method_ok, int *api, const char **name);
/* Answers an endpoint of endpoints.c (url as kv_gw_endpoint_of took it;
 * body n bytes, read within body_max). */
void kv_gw_endpoint(kv_gateway *g, const char *url, const char *body, size_t n, int api, kv_gw_reply *a);
/* CORS headers on r for c's Origin (none without --cors or a match). */
void kv_gw_cors_headers(const kv_gateway *g, struct MHD_Connection *c, struct MHD_Response *r);
/* An OPTIONS preflight: true when CORS is on (a is then the answer). */
bool kv_gw_cors_preflight(const kv_gateway *g, struct MHD_Connection *c, kv_gw_reply *a);
/* Ollama's answer to an /api/generate with no prompt (it loads the model:
 * here it is always loaded): {"model","created_at","response":"",
 * "done":true,"done_reason":"load"}. Malloc'd; NULL on no memory. */
char *kv_gw_ollama_load_json(const kv_gateway *g);
/* The request log line (unless quiet). */
void kv_gw_log_request(const kv_gateway *g, const char *method, const char *route, unsigned status,
                       uint32_t prompt_tokens, uint32_t completion_tokens, double ms);
/* A prompt to an unhealthy gateway: true with msg (cap bytes) saying why
 * (a 503 at once, rather than a request that waits on a swarm that cannot
 * compute it). */
bool kv_gw_unavailable(kv_gateway *g, char *msg, size_t cap);

/* ---- webui.c ---- */
/* GET /'s response: the chat page with its headers (CSP, type); NULL on no
 * memory. The caller queues and destroys it. Thread-safe. */
struct MHD_Response *kv_gw_webui_response(void);
const char *kv_gw_webui_csp(void); /* the page's Content-Security-Policy (static) */

/* ---- routes.c ---- */
enum MHD_Result kv_gw_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                             const char *version, const char *upload, size_t *upload_size, void **con_cls);
void kv_gw_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe);

#endif
