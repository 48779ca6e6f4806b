/* The gateway: the HTTP APIs clients already speak (OpenAI chat completions
 * and completions, Anthropic messages, Ollama chat and generate,
 * llama-server's completion, tokenize and props) over one engine, with
 * continuous batching.
 *
 * One scheduler thread owns the engine (kvasir/engine.h's contract): it
 * admits queued requests as sessions between steps, runs kv_engine_step for
 * every active session at once, publishes each session's new token and
 * frees the sessions that finished, failed or whose client went away. HTTP
 * connections (libmicrohttpd, one thread per connection, bounded in number
 * and per client IP) parse and check the request, tokenize the prompt, hand
 * it over through a bounded queue and turn the published tokens into text
 * (whole UTF-8 characters only, stop strings matched across tokens and never
 * sent) in the API's own shape, streamed or whole. A request's tokens do not
 * depend on what runs beside it (the engine's guarantee).
 *
 * A swarm (the engine's experts on workers): GET /health is 503 until every
 * shard is covered by a worker that is up; with opts.hub_url a thread
 * re-reads the hub's placement map and the scheduler adds its new nodes to
 * the engine's workers between steps; a step that fails for want of a
 * holder keeps its sessions and is retried (step_retry_ms), so nothing is
 * answered partially. A ring (opts.ring_addrs): no engine; each request is
 * a sequence of the ring, submitted to an entry node (docs/GATEWAY.md "A
 * ring"). docs/GATEWAY.md.
 *
 * Errors are answered in the shape of the API asked (OpenAI
 * {"error":{...}}, Anthropic {"type":"error",...}, Ollama {"error":"..."})
 * with the status that fits: 400 malformed body or a prompt longer than
 * the context (both counts named), 401 without a valid key when keys are
 * configured, 402 when the gateway charges (ledger_path) and the request's
 * X-KVR-Payment authorization is missing or refused (nothing is charged
 * then), 404 unknown model or path, 413 body too large (or its JSON needs
 * more than parse_max bytes of memory), 503 with Retry-After when the queue
 * is full or the model cannot run (/health 503: a prompt is answered at
 * once, not queued behind a swarm that cannot compute it).
 *
 * Fair shares: a client is its API key (its address when there are no
 * keys). The scheduler admits next the queued request of the client with the
 * fewest sessions running (ties: the one waiting longest); when the queue is
 * full a newcomer displaces the newest queued request of the client that
 * holds the most places (at least two more than the newcomer's client: that
 * request ends 503), so no client can hold the queue while others wait.
 * Connections are guarded as src/http/http_guard.h says (a deadline for a
 * whole request, per-address limits, the fullest address yields). */
#ifndef KVASIR_GATEWAY_H
#define KVASIR_GATEWAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/engine.h"
#include "kvasir/err.h"

typedef struct kv_gateway kv_gateway;
struct kv_voucher; /* kvasir/link.h */

#define KV_GATEWAY_MAX_KEYS 1024u
#define KV_GATEWAY_MAX_KEY_LEN 256u
#define KV_GATEWAY_MAX_BODY (64u << 20)

typedef struct kv_gateway_opts {
    const char *host;           /* bind address; NULL = "127.0.0.1" */
    uint16_t port;              /* 0 = any free port (kv_gateway_port says which) */
    const char *model_name;     /* the model id clients name; NULL = "kvasir" */
    const char *const *api_keys;/* [n_api_keys] accepted keys (copied); none = no auth */
    uint32_t n_api_keys;
    uint32_t max_active;        /* sessions stepping at once; 0 = 16 (at most the engine's) */
    uint32_t queue_max;         /* requests waiting for a slot; 0 = 64 */
    uint32_t max_conns;         /* open connections; 0 = 256 */
    uint32_t per_ip_conns;      /* open connections per client IP (IPv6: per /64); 0 = 16 */
    uint32_t timeout_s;         /* idle connection timeout; 0 = 120 */
    uint32_t request_s;         /* a request's headers and body arrive within this (a kept-alive
                                   connection's wait for its next request included); 0 = 30 */
    size_t body_max;            /* request body bytes; 0 = 1 MiB, at most KV_GATEWAY_MAX_BODY */
    size_t parse_max;           /* memory one request's parsed JSON may hold (413 beyond);
                                   0 = 4 * body_max + 1 MiB */
    size_t parse_total;         /* memory all requests' parsed JSON may hold together (503 beyond);
                                   0 = the larger of 256 MiB and 4 * parse_max */
    uint32_t max_tokens_default;/* when a request names none; 0 = 512 */
    bool hold;                  /* start with admission held (kv_gateway_hold) */
    /* charging in KVR (docs/LEDGER.md "The gateway"); all unset = free */
    const char *ledger_path;    /* an initialized ledger: every completion is paid */
    const char *gateway_key_path; /* the gateway's node key (required with a ledger) */
    const char *gateway_id;     /* the id authorizations name; NULL = "gw-" + 24 hex of the key */
    uint64_t price_prompt;      /* micro-KVR per prompt token */
    uint64_t price_completion;  /* micro-KVR per completion token */
    /* a swarm (the engine is a coordinator: kv_engine_remote non-NULL) */
    const char *hub_url;        /* re-read HUB/v1/placement and add its new nodes to the engine's
                                   workers (opened with room: kv_engine_opts.max_workers); NULL = none */
    uint32_t hub_refresh_ms;    /* how often; 0 = 2000 (and at once after a failed step) */
    const struct kv_node_key *demand_key; /* with hub_url: report the demand per shard to the hub
                                   every 5 s signed by this key (copied; docs/HUB.md "Demand");
                                   NULL = no reports */
    uint32_t step_retry_ms;     /* a failed step (an expert whose holders are all gone) is retried,
                                   its sessions kept, for this long before they fail; 0 = 30000 */
    uint64_t local_experts;     /* bytes of the manifest folder's slabs to hold and compute here while
                                   steps are fast (docs/GATEWAY.md "Local experts"); 0 = none held */
    double step_target_ms;      /* with local_experts: widen past this step time; 0 = derived */
    /* a ring (kvasir ring, docs/PROTOCOL.md "Ring protocol"): no engine here
       (kv_gateway_start takes e = NULL); every request is submitted to an
       entry node, which tokenizes it (the same template) and streams the
       tokens back; concurrent requests are concurrent ring sequences */
    const char *const *ring_addrs; /* [n_ring] entry nodes "HOST:PORT" (copied), tried in turn */
    uint32_t n_ring;            /* at most KV_GATEWAY_MAX_RING; 0 = no ring */
    const uint8_t *ring_key_sk; /* [64] the client key proved to the nodes (copied); NULL = a random one */
    const struct kv_voucher *ring_voucher; /* a hub voucher for that key, shown to the nodes (copied);
                                   NULL = none */
    uint32_t ring_timeout_ms;   /* longest wait for one frame from the ring; 0 = 60000 */
    const char *ring_draft;     /* --draft over the ring: ngram or test:FILE:P[:SEED] (the ring's tail
                                   drafts, kv_ring_draft_params); NULL = none */
    uint32_t ring_draft_max;    /* --draft-max; 0 = 3 */
    uint32_t ring_status_ms;    /* /health asks every entry node this often; 0 = 1000 */
    /* The chat template the chat APIs render the prompt with: the model's
       own (tokenizer.chat_template in its GGUF) unless this replaces it; a
       model with neither gets ChatML (said once on stderr at start) */
    const char *chat_template;  /* a template's source (copied), chat_template_len bytes; NULL = the model's */
    size_t chat_template_len;   /* at most KV_GATEWAY_MAX_TEMPLATE */
    const char *chat_template_name; /* where it came from, in messages (a file name); NULL = "--chat-template" */
    /* HTTPS (include/kvasir/https.h): serve this certificate; NULL = plain HTTP, which
       is refused (KV_EINVAL) on a non-loopback host unless insecure_plaintext */
    const struct kv_https_cert *tls; /* read while the gateway lives */
    bool insecure_plaintext;
    /* CORS (docs/GATEWAY.md "CORS"): a request whose Origin is one of these
       (or any, with "*") is answered with Access-Control-Allow-Origin, and an
       OPTIONS preflight with 204 and the methods and headers allowed; none =
       no CORS headers, and OPTIONS is a 404 or 405 as any other method */
    const char *const *cors_origins; /* [n_cors] (copied); each at most KV_GATEWAY_MAX_ORIGIN_LEN bytes */
    uint32_t n_cors;            /* at most KV_GATEWAY_MAX_CORS */
    /* stderr: one line per request (method, route, status, tokens, ms; never a
       prompt or a key) and a summary of the model at start, unless quiet */
    bool quiet;
    const char *model_path;     /* the file or manifest served, for GET /props (copied); NULL = none */
    bool no_web_ui;             /* GET / (and /index.html) answers 404, not the chat page */
    const char *down_msg;       /* no engine and no ring: the model cannot run here, and this says why
                                   (copied; at most 200 bytes kept): /health and every prompt answer 503
                                   with it, at once */
} kv_gateway_opts;

#define KV_GATEWAY_MAX_CORS 32u
#define KV_GATEWAY_MAX_ORIGIN_LEN 256u

#define KV_GATEWAY_MAX_TEMPLATE (1u << 20) /* bytes of a chat template */

#define KV_GATEWAY_MAX_RING 8u

/* Starts serving engine e (borrowed: the gateway's scheduler thread drives
 * it from now on and no other thread may touch it until kv_gateway_free),
 * or, with opts.n_ring, the ring at opts.ring_addrs (e must be NULL then;
 * a ledger is refused: KV_EUNSUPPORTED).
 * Errors: KV_EINVAL (bad options), KV_EIO (cannot bind), KV_ENOMEM; *out is
 * NULL then. */
int kv_gateway_start(kv_gateway **out, kv_engine *e, const kv_gateway_opts *opts, kv_diag *d);
/* Stops listening, ends every request (clients get an error or a cut
 * stream), frees every session and joins the scheduler; the engine is the
 * caller's again. Accepts NULL. */
void kv_gateway_free(kv_gateway *g);
uint16_t kv_gateway_port(const kv_gateway *g);
/* Holds (or releases) admission: while held, requests queue (up to
 * queue_max) and no new session starts; active ones keep running. For
 * draining and for tests that need a full queue. Thread-safe. */
void kv_gateway_hold(kv_gateway *g, bool hold);

/* Records a worker key caught lying (kv_engine_opts.on_caught, docs/VERIFY.md):
 * from now on no session that has not settled yet asks it for a receipt or
 * pays it a share (its share goes back to the consumer, the ledger's rule
 * for a missing receipt). A zero key is ignored. Thread-safe; callable from
 * the engine's hook inside a step. */
void kv_gateway_caught(kv_gateway *g, const uint8_t key[32]);

typedef struct kv_gateway_stats {
    uint64_t requests;          /* requests answered (every status) */
    uint64_t completed;         /* generations that ran to their end */
    uint64_t cancelled;         /* sessions freed because the client went away */
    uint64_t rejected_full;     /* 503: queue full (displaced requests included) */
    uint64_t displaced;         /* queued requests displaced by another client's (503) */
    uint64_t parse_refused;     /* 413/503: a body whose JSON needed more than its budget */
    size_t parse_live;          /* bytes parsed JSON holds now (reserved during a parse) */
    uint64_t conns_evicted;     /* incomplete connections closed to let another address in */
    uint64_t conns_expired;     /* connections closed at the whole-request deadline */
    uint64_t conns_refused;     /* newcomers refused (address at its limit, or full) */
    uint32_t conns_open;        /* connections open now */
    uint64_t tokens_prompt, tokens_completion;
    uint32_t queued, active;    /* now */
} kv_gateway_stats;
void kv_gateway_get_stats(kv_gateway *g, kv_gateway_stats *out); /* thread-safe */

/* Reads API keys from a file: one per line, '#' comments and blank lines
 * skipped, surrounding whitespace trimmed. *keys (n_keys entries, each and
 * the array malloc'd) is freed with kv_gateway_keys_free. Errors: KV_EIO,
 * KV_EFORMAT (a key too long or with control bytes), KV_ERANGE (too many). */
int kv_gateway_keys_load(const char *path, char ***keys, uint32_t *n_keys, kv_diag *d);
void kv_gateway_keys_free(char **keys, uint32_t n_keys);

#endif
