/* The ring: pipeline inference with no master.
 *
 * Each node holds a window of consecutive layers [first, last] of one model
 * (kv_model_opts.window: only the window's tensors are touched, so only
 * they become resident), keeps the KV cache and recurrent state of those
 * layers for every sequence in flight, and passes each token's hidden
 * state to the node after it (its --next). The node with layer 0 (the
 * head) embeds tokens; the node with the last layer (the tail) applies the
 * final norm and the LM head, samples, and sends the token to its next,
 * which is the head, which feeds it back in. A client submits a request to
 * any node (its home); the home takes its token ids (SUBMIT_TOKENS: the
 * gateway renders and tokenizes, with the tokenizer a node sends it by
 * VOCAB) or tokenizes its text, and sends it along the ring to the head; tokens travel from the tail back to the home and out to the
 * client. Several sequences are in flight at once and every node computes
 * whichever hidden state arrives, so with S sequences S nodes work at once.
 *
 * Frames (docs/PROTOCOL.md, "Ring protocol"): a 12-byte header (magic
 * "KVRG", version, type, payload length, little-endian) and a payload whose
 * every count is bounded by a named maximum and checked against the bytes
 * present; hidden states and logits from a peer must be finite (a
 * non-finite value is a lie, and closes the link). The codec below never
 * allocates: decoded messages are views into the caller's frame.
 *
 * Faults: when a link of the ring closes, every node learns it (a BROKEN
 * frame travels from the node after the break to the node before it), drops
 * the sequences in flight, and the home of each request holds it: once the
 * ring is whole again (a replacement took the missing window, a PROBE went
 * round), it replays the request from its tokens (the prompt and the tokens
 * already streamed, as one prompt), so it completes with the same bits; if
 * the ring does not re-form within the replay deadline, the client gets a
 * clear error. A token is never taken from a sequence that crossed a break.
 *
 * Threads: a node runs on one thread (its event loop), computing on its own
 * pool; kv_ring_node_stop may be called from any thread or a signal
 * handler. */
#ifndef KVASIR_RING_H
#define KVASIR_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"
#include "kvasir/sample.h"
#include "kvasir/tok.h" /* kv_chat_msg */

/* ---- wire format -------------------------------------------------------- */

#define KV_RING_MAGIC 0x4752564bu      /* "KVRG" little-endian */
#define KV_RING_VERSION 5u /* 2: over TLS, both key-handshake signatures cover the session's exporter;
                                   3: SUBMIT_TOKENS (the client's own rendering, as token ids), the
                                   sampling extension (penalties, logit bias, grammar, logprobs) and
                                   VOCAB (the tokenizer and chat template for a client);
                                   4: speculative decoding: the draft block of a request, HIDDEN's
                                   VERIFY flag, TOKEN's spec word and drafts;
                                   5: the prompt cache: LOOKUP round the ring, START's n_cached,
                                   CACHED to the client */
#define KV_RING_HEADER 12u             /* magic u32, version u16, type u16, len u32 */
#define KV_RING_MAX_TOKENS 4096u       /* tokens in one HIDDEN / START / ACCEPT frame */
#define KV_RING_MAX_EMBD 65536u        /* n_embd of a hidden state */
#define KV_RING_MAX_VOCAB (1u << 22)   /* logits in one TOKEN frame */
#define KV_RING_MAX_TEXT (1u << 20)    /* prompt bytes in SUBMIT */
#define KV_RING_MAX_PIECE 256u         /* bytes of one token's text in TOKEN */
#define KV_RING_MAX_MSG 512u           /* bytes of an ERROR / BROKEN message */
#define KV_RING_MAX_LAYERS 512u
#define KV_RING_MAX_HIDDEN_BYTES (64u << 20) /* x of one HIDDEN frame */
#define KV_RING_MAX_PAYLOAD ((64u << 20) + 64u) /* the largest payload of any frame */
#define KV_RING_MODEL_ID_LEN 64u       /* model identity: 64 lowercase hex digits */
#define KV_RING_MAX_MSGS 512u          /* messages in one SUBMIT_CHAT */
#define KV_RING_MAX_GRAMMAR (1u << 20) /* bytes of GBNF text in a sampling extension */
#define KV_RING_GRAMMAR_MEMORY (64u << 20) /* bytes of one sequence's grammar matcher tables (the
                                              gateway's per-request bound, so both flush alike) */
#define KV_RING_MAX_VOCAB_BYTES (48u << 20) /* the tokenizer GGUF of a VOCAB_ACK */
#define KV_RING_MAX_DRAFT 15u          /* drafted tokens per verify pass (k; the engine's KV_DRAFT_MAX) */
#define KV_RING_MAX_DRAFT_REC KV_RING_MAX_PROMPT /* tokens of a test draft source's recording */
#define KV_RING_MAX_CACHE_BLOCK 4096u  /* tokens per prompt cache block (KV_PCACHE_MAX_BLOCK) */

enum kv_ring_type {
    KV_RING_HELLO = 1,   /* first frame on every connection: role, model, window */
    KV_RING_HELLO_ACK,   /* the acceptor's answer: its model and window */
    KV_RING_SUBMIT,      /* client -> home: a prompt (text) and sampling parameters */
    KV_RING_ACCEPT,      /* home -> client: the request's id and prompt tokens */
    KV_RING_START,       /* along the ring: a sequence begins (params + prompt tokens) */
    KV_RING_HIDDEN,      /* along the ring: hidden states of a sequence's tokens */
    KV_RING_TOKEN,       /* tail -> head -> ... -> home -> client: a sampled token */
    KV_RING_ERROR,       /* a request (seq != 0) or the connection failed */
    KV_RING_BROKEN,      /* along the ring: a link broke; drop the sequences in flight */
    KV_RING_PROBE,       /* along the ring: is it whole? (kind 1), it is (kind 2) */
    KV_RING_AUTH_CHALLENGE, /* acceptor -> connector after HELLO_ACK: its key, a fresh challenge */
    KV_RING_AUTH,        /* connector -> acceptor: its key, a nonce, a signature of the transcript */
    KV_RING_AUTH_OK,     /* acceptor -> connector: its signature of the same transcript */
    KV_RING_SUBMIT_CHAT, /* client -> home: chat messages (the home applies the chat template) */
    KV_RING_STATUS,      /* client -> node: is the ring whole? (no payload) */
    KV_RING_STATUS_ACK,  /* node -> client: the answer, its window and limits */
    KV_RING_SUBMIT_TOKENS, /* client -> home: a prompt as token ids (the client rendered and tokenized it) */
    KV_RING_VOCAB,       /* client -> node: send the model's tokenizer (no payload) */
    KV_RING_VOCAB_ACK,   /* node -> client: the tokenizer.* metadata as a GGUF without tensors */
    KV_RING_LOOKUP,      /* home -> round the ring -> home: the prefix every node's prompt cache holds (v5) */
    KV_RING_CACHED,      /* home -> client, before the first TOKEN: prompt tokens taken from the caches (v5) */
    KV_RING_TYPE_COUNT
};

enum kv_ring_role { KV_RING_ROLE_LINK = 1, KV_RING_ROLE_CLIENT = 2 };

#define KV_RING_SUBMIT_LOGITS 1u /* SUBMIT flags: TOKEN frames to the client carry the logits */
#define KV_RING_SUBMIT_IGNORE_EOG 2u /* SUBMIT flags: an end-of-generation token does not stop it */
#define KV_RING_SUBMIT_EXT 4u    /* SUBMIT_TOKENS / START flags: the frame ends with the sampling extension */
#define KV_RING_SUBMIT_LOGPROBS 8u /* SUBMIT_TOKENS / START flags (with EXT): TOKEN frames carry the sampled
                                      token's log-probability and top_logprobs alternatives */
#define KV_RING_SUBMIT_DRAFT 16u /* SUBMIT_TOKENS / START flags (with EXT): speculative decoding, the draft
                                      block follows the extension (docs/SPECULATIVE.md "Over the ring") */
#define KV_RING_STATUS_WHOLE 1u  /* STATUS_ACK flags: the ring is whole (a probe went round) */

/* Roles of SUBMIT_CHAT messages on the wire. */
enum kv_ring_chat_role { KV_RING_CHAT_SYSTEM = 1, KV_RING_CHAT_USER, KV_RING_CHAT_ASSISTANT };
#define KV_RING_START_BEGUN 1u   /* START flags: the head has begun the sequence */
#define KV_RING_HIDDEN_LOGITS 1u /* HIDDEN flags: the tail samples after the last token */
#define KV_RING_HIDDEN_VERIFY 2u /* HIDDEN flags (with LOGITS): a verify pass, the first token and
                                    n_tokens - 1 drafts; the tail samples after each; every node keeps
                                    the recurrent state after each and rolls back to where the
                                    sequence's next frame starts (at most KV_RING_MAX_DRAFT + 1 tokens) */
/* TOKEN spec word */
#define KV_RING_TOKEN_MORE 1u        /* another token of the same pass follows: the head does not feed this one */
#define KV_RING_TOKEN_VERIFIED(w) (((w) >> 8) & 0xffu)  /* last token of a pass: drafts it verified */
#define KV_RING_TOKEN_ACCEPTED(w) (((w) >> 16) & 0xffu) /* last token of a pass: drafts accepted */
#define KV_RING_TOKEN_SPEC(more, verified, accepted) \
    ((uint32_t)((more) ? KV_RING_TOKEN_MORE : 0u) | ((uint32_t)(verified) << 8) | ((uint32_t)(accepted) << 16))

/* Draft sources a request names (KV_RING_SUBMIT_DRAFT). */
enum kv_ring_draft { KV_RING_DRAFT_NGRAM = 1, KV_RING_DRAFT_TEST = 2, KV_RING_DRAFT_MTP = 3 };

typedef struct kv_ring_header {
    uint32_t magic, len;
    uint16_t version, type;
} kv_ring_header;

typedef struct kv_ring_hello {
    uint32_t role;                          /* kv_ring_role */
    uint32_t n_layer, first, last;          /* the sender's window (0s for a client) */
    uint32_t n_embd, n_vocab;
    char model_id[KV_RING_MODEL_ID_LEN + 1];/* 64 hex digits (empty for a client) */
} kv_ring_hello;

/* Sampling and stop parameters of a request, as they travel. The
 * extension (flags KV_RING_SUBMIT_EXT; SUBMIT_TOKENS and START only) adds
 * sample.presence_penalty, frequency_penalty and the logit bias, the
 * logprobs alternatives and a grammar the tail samples under. */
typedef struct kv_ring_params {
    uint32_t flags;          /* KV_RING_SUBMIT_* */
    uint32_t n_predict;      /* tokens to emit, >= 1 */
    kv_sample_params sample; /* decoded: sample.bias NULL, the entries are at bias_wire */
    uint32_t top_logprobs;   /* EXT: alternatives per token, 0..KV_SAMPLE_MAX_TOP (with LOGPROBS) */
    uint32_t n_gen;          /* EXT, START: the last n_gen tokens were generated (a replay), 0 in SUBMIT_TOKENS */
    const uint8_t *bias_wire;/* decoded EXT: [sample.n_bias] {i32 token, f32 bias} LE (view); the encoder
                                writes sample.bias when it is set, else these bytes */
    const char *grammar;     /* EXT: GBNF text the tail samples under, grammar_len bytes (view); NULL none */
    uint32_t grammar_len;    /* 0..KV_RING_MAX_GRAMMAR */
    /* DRAFT (docs/SPECULATIVE.md "Over the ring"): the tail drafts with this source */
    uint32_t draft_kind;     /* kv_ring_draft */
    uint32_t draft_max;      /* k, 1..KV_RING_MAX_DRAFT */
    double draft_p;          /* TEST: acceptance in [0, 1] */
    uint64_t draft_seed;     /* TEST: the hash seed */
    uint32_t n_draft_rec;    /* TEST: 1..KV_RING_MAX_DRAFT_REC tokens recorded; 0 for NGRAM and MTP */
    const uint8_t *draft_rec_wire; /* decoded TEST: [n_draft_rec] i32 LE (view) */
    const int32_t *draft_rec;/* the encoder writes these host ints when set, else draft_rec_wire */
} kv_ring_params;

typedef struct kv_ring_submit {
    kv_ring_params p;
    const char *text;        /* [text_len] UTF-8, not NUL-terminated (view) */
    uint32_t text_len;
} kv_ring_submit;

typedef struct kv_ring_submit_chat {
    kv_ring_params p;
    uint32_t n_msgs;         /* 1..KV_RING_MAX_MSGS */
    uint32_t text_bytes;     /* the contents' bytes, at most KV_RING_MAX_TEXT */
    const uint8_t *msgs;     /* n_msgs x {u32 role, u32 len, u8 content[len]} (view; kv_ring_chat_next) */
} kv_ring_submit_chat;

typedef struct kv_ring_status {
    uint32_t flags;          /* KV_RING_STATUS_* */
    uint32_t n_layer, first, last; /* the answering node's window */
    uint32_t n_ctx;          /* positions per sequence */
    uint32_t max_seqs;       /* sequences in flight at once */
    uint32_t n_seqs;         /* sequences it holds now */
    char msg[KV_RING_MAX_MSG + 1]; /* why it is not whole ("" when whole) */
} kv_ring_status;

typedef struct kv_ring_start {
    uint64_t seq;            /* ring-wide sequence id (the home chooses it) */
    uint32_t home;           /* first layer of the home node */
    uint32_t flags;          /* KV_RING_START_* */
    kv_ring_params p;
    uint32_t n_tokens;       /* prompt, 1..KV_RING_MAX_TOKENS * 16 */
    const uint8_t *tokens;   /* [n_tokens] i32 LE (view; kv_ring_tokens_get) */
    uint32_t n_cached;       /* v5 (on the wire after flags): positions [0, n_cached) every node takes
                                from its prompt cache (a LOOKUP agreed on them; below n_tokens); 0: the
                                whole prompt is computed */
} kv_ring_start;

typedef struct kv_ring_hidden {
    uint64_t seq;
    uint32_t pos;            /* position of the first token */
    uint32_t n_tokens;       /* 1..KV_RING_MAX_TOKENS */
    uint32_t flags;          /* KV_RING_HIDDEN_* */
    uint32_t n_embd;
    const uint8_t *x;        /* [n_tokens][n_embd] f32 LE, every value finite (view) */
} kv_ring_hidden;

typedef struct kv_ring_token {
    uint64_t seq;
    uint32_t pos;            /* position the token will take (prompt + tokens before it) */
    int32_t token;
    uint32_t stop;           /* kv_stop: 0 = more follow */
    uint32_t piece_len;      /* bytes of text (to a client; 0 on the ring) */
    const char *piece;       /* view */
    uint32_t n_logits;       /* 0 or n_vocab */
    const uint8_t *logits;   /* [n_logits] f32 LE, every value finite (view) */
    bool has_lp;             /* the frame ends with the token's log-probability (LOGPROBS requests) */
    kv_token_logprob lp;     /* with has_lp: lp.token == token, every value finite */
    uint32_t spec;           /* KV_RING_TOKEN_SPEC: MORE, drafts verified and accepted by its pass */
    uint32_t n_draft;        /* on the ring, the last token of a pass: the drafts the head feeds after it */
    int32_t drafts[KV_RING_MAX_DRAFT];
} kv_ring_token;

typedef struct kv_ring_submit_tokens {
    kv_ring_params p;
    uint32_t n_tokens;       /* 1..KV_RING_MAX_PROMPT */
    const uint8_t *tokens;   /* [n_tokens] i32 LE (view) */
} kv_ring_submit_tokens;

typedef struct kv_ring_accept {
    uint64_t seq;
    uint32_t n_tokens;
    const uint8_t *tokens;   /* [n_tokens] i32 LE (view) */
} kv_ring_accept;

/* LOOKUP (v5): which prefix of a prompt every node's prompt cache holds.
 * The home sends it round the ring before the sequence's START; each node
 * lowers n_match to the blocks of tokens its cache holds (from position 0)
 * and clears the state bits of the blocks at whose end it holds no
 * recurrent state (a window without recurrent layers needs none). */
typedef struct kv_ring_lookup {
    uint64_t seq;            /* the START that follows takes this id */
    uint32_t origin;         /* first layer of the home (it travels round to there) */
    uint32_t block_tokens;   /* tokens per block, 1..KV_RING_MAX_CACHE_BLOCK */
    uint32_t n_blocks;       /* blocks looked up, >= 1, n_blocks * block_tokens <= KV_RING_MAX_PROMPT */
    uint32_t n_match;        /* 0..n_blocks: blocks [0, n_match) held by every node so far */
    const uint8_t *tokens;   /* [n_blocks * block_tokens] i32 LE (view) */
    const uint8_t *state;    /* [(n_blocks + 7) / 8] bit k (LSB first): every node so far holds a
                                recurrent state after block k or needs none (view; bits past
                                n_blocks are 0) */
} kv_ring_lookup;

typedef struct kv_ring_error {
    uint64_t seq;            /* 0: the connection */
    int32_t code;            /* a negative KV_E* */
    uint32_t origin;         /* first layer of the node that raised it (it travels round to there) */
    char msg[KV_RING_MAX_MSG + 1];
} kv_ring_error;

typedef struct kv_ring_broken {
    uint32_t origin;         /* first layer of the node that saw the break */
    char msg[KV_RING_MAX_MSG + 1];
} kv_ring_broken;

typedef struct kv_ring_probe {
    uint32_t origin;         /* first layer of the node that sent it */
    uint32_t kind;           /* 1: probe, 2: the ring is whole */
    uint64_t nonce;
} kv_ring_probe;

typedef struct kv_ring_auth {
    uint8_t key[32];         /* Ed25519 public key (AUTH_CHALLENGE: the acceptor's; AUTH: the connector's) */
    uint8_t nonce[32];       /* AUTH_CHALLENGE: the challenge; AUTH: the connector's nonce */
    uint8_t sig[64];         /* AUTH and AUTH_OK: over kv_ring_auth_digest */
    uint64_t voucher_expires_ms; /* AUTH: a hub voucher for key, Unix ms; 0 = none (the frame is 128 bytes) */
    uint8_t voucher_sig[64];     /* AUTH with a voucher: the hub's signature over kv_voucher_digest */
} kv_ring_auth;

typedef struct kv_ring_msg {
    kv_ring_header h;
    union {
        kv_ring_hello hello;    /* HELLO, HELLO_ACK */
        kv_ring_submit submit;
        kv_ring_accept accept;
        kv_ring_start start;
        kv_ring_hidden hidden;
        kv_ring_token token;
        kv_ring_error error;
        kv_ring_broken broken;
        kv_ring_probe probe;
        kv_ring_auth auth;      /* AUTH_CHALLENGE (key, nonce), AUTH (all), AUTH_OK (sig) */
        kv_ring_submit_chat chat;
        kv_ring_status status;  /* STATUS_ACK (STATUS has no payload) */
        kv_ring_submit_tokens stok; /* SUBMIT_TOKENS */
        kv_ring_lookup lookup;      /* LOOKUP */
        struct {
            uint64_t id;          /* CACHED: the request (ACCEPT's id) */
            uint32_t n_cached;    /* its prompt tokens taken from the prompt caches */
        } cached;
        struct {
            const uint8_t *gguf;  /* VOCAB_ACK: a GGUF of the tokenizer.* metadata, no tensors (view) */
            uint32_t len;         /* 1..KV_RING_MAX_VOCAB_BYTES */
        } vocab;
    } u;
} kv_ring_msg;

#define KV_RING_MAX_PROMPT (KV_RING_MAX_TOKENS * 16u) /* tokens of one START / ACCEPT */

/* Payload bytes of a frame of each kind (0 if the counts are out of bounds);
 * a TOKEN's drafts add 4 bytes each. */
size_t kv_ring_hidden_size(uint32_t n_tokens, uint32_t n_embd);
size_t kv_ring_token_size(uint32_t piece_len, uint32_t n_logits);
/* A TOKEN frame's payload with a log-probability of n_top alternatives
 * (n_top <= KV_SAMPLE_MAX_TOP; 0 if out of bounds). */
size_t kv_ring_token_size_lp(uint32_t piece_len, uint32_t n_logits, uint32_t n_top);
/* The bytes the parameters (and their extension) take in a frame. */
size_t kv_ring_params_size(const kv_ring_params *p);

/* Decodes the header of a frame from hdr[n] (n >= KV_RING_HEADER). Errors:
 * KV_EPROTO for a bad magic or unknown type, KV_EUNSUPPORTED for another
 * version, KV_ERANGE for a payload over KV_RING_MAX_PAYLOAD. */
int kv_ring_header_decode(const uint8_t *hdr, size_t n, kv_ring_header *out, kv_diag *d);
/* Decodes one whole frame f[n] into views over f. Every count is checked
 * against its maximum and the exact payload size; floats from the wire must
 * be finite. Errors KV_EPROTO / KV_ERANGE / KV_EUNSUPPORTED; nothing is
 * allocated. */
int kv_ring_decode(const uint8_t *f, size_t n, kv_ring_msg *out, kv_diag *d);

/* Encoders: write one frame into out[cap], *n its size. KV_ERANGE if it
 * does not fit or a count is out of bounds. */
int kv_ring_hello_encode(uint8_t *out, size_t cap, uint16_t type, const kv_ring_hello *h, size_t *n, kv_diag *d);
int kv_ring_submit_encode(uint8_t *out, size_t cap, const kv_ring_submit *s, size_t *n, kv_diag *d);
/* tokens are host int32_t here */
int kv_ring_accept_encode(uint8_t *out, size_t cap, uint64_t seq, const int32_t *tokens, uint32_t n_tokens,
                          size_t *n, kv_diag *d);
int kv_ring_start_encode(uint8_t *out, size_t cap, const kv_ring_start *s, const int32_t *tokens, size_t *n,
                         kv_diag *d);
/* x: host floats [n_tokens][n_embd] */
int kv_ring_hidden_encode(uint8_t *out, size_t cap, const kv_ring_hidden *h, const float *x, size_t *n, kv_diag *d);
/* logits: host floats [n_logits] (may be NULL when n_logits is 0) */
int kv_ring_token_encode(uint8_t *out, size_t cap, const kv_ring_token *t, const float *logits, size_t *n,
                         kv_diag *d);
int kv_ring_error_encode(uint8_t *out, size_t cap, uint64_t seq, int32_t code, uint32_t origin, const char *msg,
                         size_t *n, kv_diag *d);
int kv_ring_broken_encode(uint8_t *out, size_t cap, uint32_t origin, const char *msg, size_t *n, kv_diag *d);
int kv_ring_probe_encode(uint8_t *out, size_t cap, const kv_ring_probe *p, size_t *n, kv_diag *d);
/* LOOKUP: tokens[n_blocks * block_tokens] host ints, state[(n_blocks + 7) / 8]
 * (bits past n_blocks must be 0). KV_ERANGE / KV_EINVAL. */
int kv_ring_lookup_encode(uint8_t *out, size_t cap, const kv_ring_lookup *l, const int32_t *tokens,
                          const uint8_t *state, size_t *n, kv_diag *d);
/* The payload bytes of a LOOKUP of n_blocks blocks (0 out of bounds). */
size_t kv_ring_lookup_size(uint32_t block_tokens, uint32_t n_blocks);
int kv_ring_cached_encode(uint8_t *out, size_t cap, uint64_t id, uint32_t n_cached, size_t *n, kv_diag *d);

/* msgs[n_msgs]: roles "system", "user" or "assistant" (KV_EINVAL otherwise),
 * contents of len bytes; at most KV_RING_MAX_MSGS messages and
 * KV_RING_MAX_TEXT bytes in all (KV_ERANGE). */
int kv_ring_submit_chat_encode(uint8_t *out, size_t cap, const kv_ring_params *p, const kv_chat_msg *msgs,
                               uint32_t n_msgs, size_t *n, kv_diag *d);
/* Walks the messages of a decoded SUBMIT_CHAT: at points at a message
 * (c->msgs first); returns the next one's start, with its role (a
 * kv_ring_chat_role), content view and length. Only for frames
 * kv_ring_decode accepted (it checked every length). */
const uint8_t *kv_ring_chat_next(const uint8_t *at, uint32_t *role, const char **content, uint32_t *len);
/* "system", "user", "assistant" for a kv_ring_chat_role, NULL otherwise. */
const char *kv_ring_chat_role_name(uint32_t role);
/* SUBMIT_TOKENS: p (its extension when flags has KV_RING_SUBMIT_EXT) and
 * tokens[n_tokens] (host ints, each >= 0 and < KV_RING_MAX_VOCAB; the home
 * checks them against its vocabulary). KV_ERANGE / KV_EINVAL. */
int kv_ring_submit_tokens_encode(uint8_t *out, size_t cap, const kv_ring_params *p, const int32_t *tokens,
                                 uint32_t n_tokens, size_t *n, kv_diag *d);
/* VOCAB (gguf NULL, len 0) or VOCAB_ACK (len 1..KV_RING_MAX_VOCAB_BYTES). */
int kv_ring_vocab_encode(uint8_t *out, size_t cap, uint16_t type, const uint8_t *gguf, uint32_t len, size_t *n,
                         kv_diag *d);
/* The VOCAB_ACK payload of a model: a GGUF (v3, no tensors) holding g's
 * tokenizer.* pairs as they are, for kv_gguf_open_mem and kv_tok_load.
 * *out is malloc'd (the caller frees). KV_ERANGE past
 * KV_RING_MAX_VOCAB_BYTES, KV_ENOTFOUND without a tokenizer, KV_ENOMEM. */
int kv_ring_vocab_pack(const kv_gguf *g, uint8_t **out, size_t *len, kv_diag *d);
/* type KV_RING_STATUS (no payload; st unused, may be NULL) or
 * KV_RING_STATUS_ACK (32 + msg bytes). */
int kv_ring_status_encode(uint8_t *out, size_t cap, uint16_t type, const kv_ring_status *st, size_t *n, kv_diag *d);

/* type: KV_RING_AUTH_CHALLENGE (key, nonce: 64 bytes), KV_RING_AUTH (key,
 * nonce, sig: 128; 200 with a voucher: voucher_expires_ms != 0) or
 * KV_RING_AUTH_OK (sig: 64). */
int kv_ring_auth_encode(uint8_t *out, size_t cap, uint16_t type, const kv_ring_auth *a, size_t *n, kv_diag *d);

/* The transcript both ends of a connection sign (the dispatch plane's
 * scheme, in its own domain): SHA-256 over "kvasir-ring-auth-v1\n", the role
 * ('C' the connector: a node linking to its next, or a client; 'A' the
 * acceptor), the model id (64 hex), the acceptor's key and challenge, the
 * connector's key and nonce. The fresh challenge makes every connection's
 * transcript different (a signature cannot be replayed elsewhere); the
 * acceptor's key binds the proof to the node it was meant for. Pure. */
void kv_ring_auth_digest(char role, const char model_id[KV_RING_MODEL_ID_LEN], const uint8_t acceptor_key[32],
                         const uint8_t challenge[32], const uint8_t connector_key[32], const uint8_t nonce[32],
                         uint8_t out[32]);

/* Views to host values. */
int32_t kv_ring_tokens_get(const uint8_t *tokens, uint32_t i);
void kv_ring_floats_get(const uint8_t *src, uint32_t n, float *dst);

/* ---- the node ----------------------------------------------------------- */

typedef struct kv_ring_node kv_ring_node;

typedef struct kv_ring_node_opts {
    const char *model;          /* GGUF file, or DIR/manifest.json of a sliced model */
    uint32_t first, last;       /* the layer window */
    const char *listen;         /* "HOST:PORT" (port 0 picks one) */
    const char *next;           /* "HOST:PORT" of the node holding layer last + 1 (mod n_layer);
                                   NULL: set later with kv_ring_node_set_next (a hub) */
    int n_threads;              /* compute threads; 0 = all CPUs */
    uint32_t n_ctx;             /* positions per sequence; 0 = min(model, 4096) */
    uint32_t n_batch;           /* prompt tokens per HIDDEN frame; 0 = 256 */
    uint32_t max_seqs;          /* sequences in flight at once; 0 = 16 */
    uint32_t replay_timeout_ms; /* a broken ring must re-form within this, else requests fail; 0 = 30000 */
    bool skip_hashes;           /* sliced model: check sizes and identity, not every SHA-256 */
    bool allow_sparse;          /* sliced model: open a sparse manifest (a sliced skeleton: pieces
                                   without hashes, holes read as zeros) and accept its workers'
                                   unhashed slabs; refused (KV_EUNSUPPORTED) without it */
    FILE *log;                  /* links up and down, breaks, replays; NULL = silent */
    /* Authentication (every connection, as the dispatch plane): the
     * connector proves an Ed25519 key over the connection's transcript; a
     * link's connector also checks the acceptor's proof. A key is admitted
     * when it is in allow_keys, or any key when allow_any. */
    const uint8_t *key_sk;      /* [64] this node's secret key (seed || pk); NULL = a fresh random key */
    const uint8_t (*allow_keys)[32]; /* [n_allow] keys admitted (nodes and clients alike) */
    size_t n_allow;
    bool allow_any;             /* admit every key that proves itself (an open ring) */
    const uint8_t *hub_key;     /* [32] also admit a key that brings a voucher of this hub (docs/HUB.md
                                   "Vouching": for this model, not expired by this node's clock);
                                   NULL = none */
    const char *const *workers; /* [n_workers] sliced model: the window's routed experts are
                                   computed by these expert workers (kvasir worker, the dispatch
                                   protocol; this node proves its own key to them) */
    uint32_t n_workers;
    uint32_t worker_wait_ms;    /* with workers: how long opening waits for every expert of the window
                                   to have a worker up (workers still starting, a handshake refused
                                   for capacity and retried) before it fails; 0 = 30000 */
    uint32_t link_delay_ms;     /* frames to the next node wait this long first (an emulated
                                   link latency, for benchmarks where netem is missing); 0 = none */
    uint32_t die_after_frames;  /* test hook: the process ends abruptly (as if killed) after
                                   computing this many HIDDEN frames, before sending the last; 0 = never */
    uint64_t prompt_cache_bytes; /* --prompt-cache: this node's prompt cache budget (the K/V rows of its
                                   window and, qwen35moe, its recurrent states at block ends);
                                   0 = none (docs/PROTOCOL.md "Prompt cache over the ring") */
    uint32_t prompt_cache_block; /* tokens per cache block, a multiple of 16 up to 4096, the same on every
                                   node; 0 = 64 */
    uint32_t test_cache_drop;   /* test hook: the Nth START that begins from the prompt cache here finds
                                   the cache emptied first (as if evicted since the LOOKUP); 0 = never */
    bool insecure_plaintext;    /* --insecure-plaintext: dial the next node in plaintext and serve
                                   plaintext peers from any address; off: the link to the next
                                   node is TLS 1.3 with its key handshake bound to the session,
                                   and a plaintext peer is served only from loopback */
} kv_ring_node_opts;

typedef struct kv_ring_node_stats {
    uint64_t frames_hidden;     /* HIDDEN frames computed */
    uint64_t batches;           /* forward passes (frames that arrived together run as one) */
    uint64_t tokens_computed;   /* tokens run through the window */
    uint64_t tokens_sampled;    /* tail: tokens sampled */
    uint64_t requests;          /* home: requests accepted */
    uint64_t replays;           /* home: requests replayed after a break */
    uint64_t breaks;            /* breaks seen */
    uint64_t dropped;           /* frames of unknown (dropped) sequences ignored */
    uint64_t spec_passes;       /* tail: passes of drafting sequences sampled (plain and verify) */
    uint64_t spec_drafted;      /* tail: drafted tokens verified */
    uint64_t spec_accepted;     /* tail: drafted tokens equal to the token drawn there */
    uint64_t weight_bytes;      /* bytes of the window's tensors */
    uint64_t cache_lookups;     /* LOOKUPs this node answered (its own requests' included) */
    uint64_t cache_hits;        /* sequences begun from blocks of its prompt cache */
    uint64_t cache_tokens;      /* positions taken from its prompt cache, not computed */
    uint64_t cache_misses;      /* agreed blocks gone by the START (evicted meanwhile): the sequence failed
                                   with KV_ENOTFOUND and its home began it again from position 0 */
    uint64_t cache_blocks;      /* blocks its prompt cache holds now */
    uint64_t cache_bytes;       /* bytes they take */
    uint64_t cache_evictions;   /* blocks evicted for room */
    double busy_s;              /* time spent computing */
} kv_ring_node_stats;

/* Loads the window and listens (the next link is dialed by run, and
 * redialed whenever it drops). Errors of kv_model_load_ex, KV_EINVAL for a
 * bad window or address, KV_EIO if the port is taken. Free with
 * kv_ring_node_free (accepts NULL). */
int kv_ring_node_new(kv_ring_node **out, const kv_ring_node_opts *o, kv_diag *d);
void kv_ring_node_free(kv_ring_node *n);
/* "HOST:PORT" actually bound. */
const char *kv_ring_node_addr(const kv_ring_node *n);
/* Serves until kv_ring_node_stop. Returns 0, or KV_EIO if the loop failed. */
int kv_ring_node_run(kv_ring_node *n, kv_diag *d);
void kv_ring_node_stop(kv_ring_node *n);
void kv_ring_node_get_stats(const kv_ring_node *n, kv_ring_node_stats *out);
/* Sets the next node's address (thread-safe; used when a hub says who holds
 * the window after this one): dialed at the next (re)dial, the current link
 * is kept while it is up. opts.next may then be NULL at start. */
void kv_ring_node_set_next(kv_ring_node *n, const char *host_port);
void kv_ring_node_window(const kv_ring_node *n, uint32_t *first, uint32_t *last, uint32_t *n_layer);
struct kv_manifest;       /* kvasir/slice.h */
struct kv_remote_demand; /* kvasir/dispatch_remote.h */
/* Demand per shard (kvasir/dispatch_demand.h): a sliced window meters the
 * expert computations its layers needed, whoever computed them (its own
 * slabs: their wait is its compute time; --worker: as the remote counts
 * them). The manifest its counters are indexed by (NULL when the window is
 * not sliced: nothing is metered; it lives as long as n). */
const struct kv_manifest *kv_ring_node_manifest(const kv_ring_node *n);
/* Counters since start, per manifest slab, into out[0..min(cap, n_slabs)),
 * and *tokens, the tokens run through the window; as of the last forward
 * pass. Thread-safe. */
void kv_ring_node_get_demand(kv_ring_node *n, struct kv_remote_demand *out, size_t cap, uint64_t *tokens);

/* ---- the layer market (src/ring/hub.c, docs/HUB.md GET /v1/ring) ---------- */

#define KV_RING_HUB_ADDR 255u /* longest node address the market lists (KV_HUB_MAX_ADDR) */

typedef struct kv_ring_window {
    uint32_t first, last;          /* the window's layers */
    uint64_t bytes;                /* of its slabs */
    uint32_t wanted, live;         /* holders */
    char addr[KV_RING_HUB_ADDR + 1]; /* a live holder's ring address, "" none */
} kv_ring_window;

/* Parses GET /v1/ring (len bytes, untrusted; fuzzed: fuzz/fuzz_ring_market.c)
 * into out[cap] (*n windows) and *n_layer; every number range-checked, node
 * addresses of [A-Za-z0-9.-:[]]. KV_EFORMAT / KV_ERANGE; *n is 0 on error. */
int kv_ring_parse_market(const char *json, size_t len, kv_ring_window *out, size_t cap, size_t *n, uint32_t *n_layer,
                         kv_diag *d);
/* The window a node with `budget` bytes takes: the scarcest (fewest live
 * holders per wanted) whose bytes fit, the lower layers first on ties; -1
 * if none fits. */
int kv_ring_choose(const kv_ring_window *w, size_t n, uint64_t budget);
/* Takes a window from the hub's market and makes dir/pieces/ hold the
 * manifest, the backbone and the window's slabs (fetched, resumable, hash
 * checked): *first, *last and manifest_path[cap] say what to serve. */
int kv_ring_hub_join(const char *hub, const char *dir, uint64_t budget, uint32_t *first, uint32_t *last,
                     char *manifest_path, size_t cap, FILE *log, kv_diag *d);
typedef struct kv_ring_hub kv_ring_hub;
/* Registers node (its window's slabs, backend "ring", its address) with the
 * hub under dir/node.key, then heartbeats on a thread of its own, answers
 * storage challenges and sets the node's next to the live holder of the
 * window after its own. Stop with kv_ring_hub_stop (accepts NULL). */
int kv_ring_hub_start(kv_ring_hub **out, const char *hub, const char *dir, kv_ring_node *node, uint64_t budget,
                      FILE *log, kv_diag *d);
void kv_ring_hub_stop(kv_ring_hub *h);

/* ---- the ring of sites (src/ring/hub.c, docs/HUB.md "Sites") -------------
 * The hub's site placement (GET /v1/sites) gives each site a window of
 * layers whose experts its own workers hold; a ring node of that site
 * (kvasir ring --hub URL --site NAME) runs the window with those workers. */

#define KV_RING_SITE_WORKERS 64u   /* site-local workers one window takes */
#define KV_RING_SITE_WINDOWS 64u   /* windows (sites) of one placement */

typedef struct kv_ring_site_window {
    char site[48];
    uint32_t first, last;                               /* layers, inclusive */
    uint32_t n_workers;
    char workers[KV_RING_SITE_WORKERS][KV_RING_HUB_ADDR + 1]; /* the site's workers for the window */
    char ring[KV_RING_HUB_ADDR + 1];                    /* a ring node of the site running it, "" none */
} kv_ring_site_window;

typedef struct kv_ring_sites {
    bool placed;                    /* a site placement is in force */
    char reason[256];               /* why not */
    uint32_t n_win;
    kv_ring_site_window win[KV_RING_SITE_WINDOWS];
} kv_ring_sites;

/* Parses GET /v1/sites (untrusted: windows consecutive from layer 0,
 * addresses of [A-Za-z0-9.-:[]], counts bounded; workers beyond
 * KV_RING_SITE_WORKERS are left out). KV_EFORMAT for a malformed answer. */
int kv_ring_parse_sites(const char *json, size_t len, kv_ring_sites *out, kv_diag *d);
/* Site mode of kv_ring_hub_join: the window the hub's placement gives
 * `site`, its workers (copied into workers[cap], *n_workers) and the
 * manifest, backbone and the window's slabs in dir (the hub challenges the
 * slabs a node registers). KV_ENOTFOUND when no placement gives the site a
 * window (d says why). */
int kv_ring_hub_join_site(const char *hub, const char *dir, const char *site, uint32_t *first, uint32_t *last,
                          char *manifest_path, size_t cap, char (*workers)[KV_RING_HUB_ADDR + 1], uint32_t wcap,
                          uint32_t *n_workers, FILE *log, kv_diag *d);
/* kv_ring_hub_start for a node of `site`: it registers with its site, and
 * its next is the ring node of the next site's window. */
int kv_ring_hub_start_site(kv_ring_hub **out, const char *hub, const char *dir, kv_ring_node *node, uint64_t budget,
                           const char *site, FILE *log, kv_diag *d);
/* The entry nodes of the hub's ring of sites, when one is in force and every
 * window has a ring node: their addresses in out[cap] (*n). 0 with *n = 0
 * and why[] when there is none; an error when the hub cannot be read. */
int kv_ring_hub_site_entries(const char *hub, char (*out)[KV_RING_HUB_ADDR + 1], uint32_t cap, uint32_t *n, char *why,
                             size_t why_cap, kv_diag *d);

/* ---- the client ----------------------------------------------------------- */

struct kv_voucher; /* kvasir/link.h */

/* Called for every token streamed back (logits NULL unless asked for;
 * n_vocab floats). Return non-zero to stop reading (the request is then
 * abandoned). */
typedef int (*kv_ring_token_fn)(void *data, int32_t token, const char *piece, size_t piece_len,
                                const float *logits, uint32_t n_vocab);

typedef struct kv_ring_result {
    bool submitted;          /* the handshake passed and the request was sent */
    bool accepted;           /* ACCEPT came: the home took the request */
    int32_t *prompt;         /* [n_prompt] the prompt's tokens (malloc'd; kv_ring_result_free) */
    uint32_t n_prompt;
    uint32_t n_tokens;       /* tokens streamed */
    uint32_t stop;           /* kv_stop of the last token */
    uint32_t spec_passes;    /* passes that yielded the tokens (a token without KV_RING_TOKEN_MORE ends one) */
    uint32_t spec_drafted;   /* drafted tokens the passes verified */
    uint32_t spec_accepted;  /* of them accepted */
    bool cache_looked;       /* CACHED came: the home looked the prompt up in the ring's prompt caches */
    uint32_t n_cached;       /* of the prompt's tokens, those taken from the caches (not computed) */
} kv_ring_result;

/* Submits text to the node at addr and streams the tokens to fn until the
 * request stops. timeout_ms bounds each wait for a frame (0 = 60000).
 * Errors: the connection's, or the request's ERROR (code and message as the
 * ring gave them: "ring broken: ..."). */
int kv_ring_request(const char *addr, const char *text, size_t text_len, const kv_ring_params *p,
                   int timeout_ms, kv_ring_token_fn fn, void *data, kv_ring_result *res, kv_diag *d);
/* The same, proving key_sk ([64] seed || pk; NULL = a fresh random key, which
 * only an open ring admits) to the node; KV_EAUTH when the node refuses it or
 * its own proof is wrong. */
int kv_ring_request_key(const char *addr, const uint8_t *key_sk, const char *text, size_t text_len,
                        const kv_ring_params *p, int timeout_ms, kv_ring_token_fn fn, void *data, kv_ring_result *res,
                        kv_diag *d);
void kv_ring_result_free(kv_ring_result *r);

/* --draft SPEC and --draft-max K (0: 3) as a request's draft block: "ngram",
 * or "test:FILE:P[:SEED]" (FILE read here, *rec malloc'd: the caller frees
 * it after the request; p->draft_rec points at it); "none" / NULL leaves p
 * as it is. Sets KV_RING_SUBMIT_EXT | KV_RING_SUBMIT_DRAFT. KV_EUNSUPPORTED
 * for mtp (a ring window does not hold the MTP block), KV_EINVAL /
 * KV_ERANGE / the file's errors naming the flag. */
int kv_ring_draft_params(const char *spec, uint32_t k, kv_ring_params *p, int32_t **rec, kv_diag *d);

/* Called once with the prompt's tokens when the home accepted the request;
 * non-zero abandons it. */
typedef int (*kv_ring_accept_fn)(void *data, const int32_t *prompt, uint32_t n_prompt);

/* A request, in full. */
typedef struct kv_ring_req {
    const char *text;            /* SUBMIT: the prompt as `kvasir run -p` takes it (special token texts
                                    parsed), text_len bytes; or */
    size_t text_len;
    const kv_chat_msg *msgs;     /* SUBMIT_CHAT when n_msgs > 0: the home applies ChatML (every content
                                    plain text); or */
    uint32_t n_msgs;
    const int32_t *tokens;       /* SUBMIT_TOKENS when n_tokens > 0: the prompt as the client rendered and
                                    tokenized it (the gateway: the model's chat template; BOS included) */
    uint32_t n_tokens;
    kv_ring_params p;
    const uint8_t *key_sk;       /* [64] the key proved to the node; NULL = a fresh random one */
    int timeout_ms;              /* longest wait for one frame; 0 = 60000 */
    const struct kv_voucher *voucher; /* a hub voucher for key_sk's key, sent in AUTH; NULL = none */
    kv_ring_accept_fn on_accept; /* may be NULL */
    kv_ring_token_fn on_token;   /* may be NULL */
    /* with p.flags KV_RING_SUBMIT_LOGPROBS: called before on_token with the
       token's log-probability (NULL if the frame carried none); may be NULL */
    void (*on_logprob)(void *data, const kv_token_logprob *lp);
    bool (*cancelled)(void *data); /* polled every 100 ms while waiting; true: the request is abandoned
                                      (KV_EIO; the node frees it round the ring). NULL = never */
    void *data;                  /* for the callbacks */
} kv_ring_req;

/* Submits q to the node at addr and streams its tokens until it stops.
 * Returns 0 when the last token came (or a callback abandoned it); the
 * connection's error, or the request's ERROR as the ring gave it (code and
 * message: "ring broken: ...", KV_ECTXFULL for a prompt too long, ...).
 * res->submitted says whether the node was reached and the request sent
 * (a failure before it may be retried at another node), res->accepted
 * whether the home took it. Free res with kv_ring_result_free. Thread-safe
 * (one connection per call). */
int kv_ring_request_ex(const char *addr, const kv_ring_req *q, kv_ring_result *res, kv_diag *d);

/* Fetches the model's tokenizer from the node at addr (VOCAB): *gguf
 * (malloc'd, *len bytes; the caller frees) is a GGUF without tensors that
 * holds the node's tokenizer.* metadata (vocabulary, merges, special
 * tokens, chat template), for kv_gguf_open_mem and kv_tok_load. Errors: the
 * connection's, the handshake's, the node's, KV_ETIMEOUT. */
int kv_ring_vocab_get(const char *addr, const uint8_t *key_sk, const struct kv_voucher *voucher, int timeout_ms,
                      uint8_t **gguf, size_t *len, kv_diag *d);

/* Asks the node at addr (proving key_sk, as a client) whether the ring is
 * whole as it sees it: *out holds its answer (STATUS_ACK). Errors: the
 * connection's, the handshake's (KV_EAUTH), KV_ETIMEOUT after timeout_ms
 * (0 = 5000) per frame. */
int kv_ring_status_get(const char *addr, const uint8_t *key_sk, int timeout_ms, kv_ring_status *out, kv_diag *d);
/* The same, with a hub voucher for the key (NULL = none). */
int kv_ring_status_get_v(const char *addr, const uint8_t *key_sk, const struct kv_voucher *voucher, int timeout_ms,
                         kv_ring_status *out, kv_diag *d);

#endif
