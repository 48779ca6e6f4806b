/* LAN beacon: a hub announces itself by UDP broadcast so that a node
 * started without --hub finds it.
 *
 * A beacon is one datagram, every integer little-endian:
 *   off 0  u32  magic      0x3142564B (the bytes "K V B 1")
 *   off 4  u16  version    1
 *   off 6  u16  url_len    1..KV_BEACON_MAX_URL
 *   off 8  u8[64] model_id the hub's model identity, 64 lowercase hex digits
 *   off 72 u8[url_len] url "http://HOST:PORT" (or "https://HOST:PORT#sha256=HEX"), of
 *                          [A-Za-z0-9.:/[]_-#=], no NUL
 * and nothing else: the datagram is exactly 72 + url_len bytes. Anything
 * else (another magic or version, a length that disagrees, a byte outside
 * the sets) is refused with a message and changes nothing.
 *
 * The beacon is not signed (the hub server exposes no signing call). A listener
 * therefore treats it as a hint, not as a fact: kv_beacon_wait takes the
 * first valid datagram (of the wanted model, when one is named), and the
 * caller checks the hub's own /v1/status answers the same model id before
 * it trusts the URL (kvasir node does). A URL whose host is 0.0.0.0 (a hub
 * bound to every interface) is completed with the sender's address.
 *
 * On loopback the destination is 127.255.255.255 (Linux delivers a
 * datagram sent there to every socket bound to the port, SO_REUSEADDR, so
 * several nodes on one machine all hear it); on a LAN 255.255.255.255 or
 * the interface's broadcast address. */
#ifndef KVASIR_BEACON_H
#define KVASIR_BEACON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"

#define KV_BEACON_MAGIC 0x3142564Bu  /* "KVB1" read as little-endian u32 */
#define KV_BEACON_VERSION 1u
#define KV_BEACON_PORT 47474u        /* default UDP port */
#define KV_BEACON_MAX_URL 200u       /* bytes of the announced URL */
#define KV_BEACON_HEADER 72u         /* bytes before the URL */
#define KV_BEACON_MAX_SIZE (KV_BEACON_HEADER + KV_BEACON_MAX_URL)
#define KV_BEACON_INTERVAL_MS 1000u  /* default period of the sender */

typedef struct kv_beacon_msg {
    char model_id[65];               /* 64 lowercase hex digits + NUL */
    char url[KV_BEACON_MAX_URL + 1]; /* NUL-terminated */
} kv_beacon_msg;

/* Writes m as a datagram into buf[cap]; *n gets its size. KV_EINVAL if m's
 * fields would not parse back (the same checks as kv_beacon_parse),
 * KV_ERANGE if cap is too small. */
int kv_beacon_encode(const kv_beacon_msg *m, uint8_t *buf, size_t cap, size_t *n, kv_diag *d);
/* Parses a datagram of n bytes (untrusted; fuzzed: fuzz/fuzz_beacon.c).
 * On error *out is zeroed and d says why (KV_EFORMAT, KV_EUNSUPPORTED for
 * another version). */
int kv_beacon_parse(const uint8_t *buf, size_t n, kv_beacon_msg *out, kv_diag *d);

/* ---- sender (the hub) -------------------------------------------------- */

typedef struct kv_beacon kv_beacon;

typedef struct kv_beacon_opts {
    const char *to;          /* destination IPv4 address; NULL = "127.255.255.255" */
    uint16_t port;           /* 0 = KV_BEACON_PORT */
    uint32_t interval_ms;    /* 0 = KV_BEACON_INTERVAL_MS */
    kv_beacon_msg msg;       /* what to announce */
} kv_beacon_opts;

/* Opens a UDP socket (SO_BROADCAST) and starts a thread that sends the
 * datagram at once and then every interval until kv_beacon_free. Send
 * errors are counted, not fatal (a network may come and go). On error *out
 * is NULL. */
int kv_beacon_start(kv_beacon **out, const kv_beacon_opts *o, kv_diag *d);
/* Datagrams sent so far (thread-safe). */
uint64_t kv_beacon_sent(const kv_beacon *b);
/* Stops the thread (promptly, not after an interval) and closes the
 * socket; accepts NULL. */
void kv_beacon_free(kv_beacon *b);

/* ---- listener (the node) ----------------------------------------------- */

/* Listens on UDP 0.0.0.0:port (SO_REUSEADDR, so several listeners on one
 * machine share the port) for at most timeout_ms and returns the first
 * valid beacon; when model_id is not NULL, only one announcing that model.
 * Invalid datagrams are skipped (counted in *n_bad when not NULL). A URL
 * host of 0.0.0.0 is replaced by the sender's address. KV_ETIMEOUT when
 * none came, KV_EIO when the port cannot be bound. */
int kv_beacon_wait(uint16_t port, uint32_t timeout_ms, const char *model_id, kv_beacon_msg *out, uint32_t *n_bad,
                   kv_diag *d);

/* What a node does without --hub: kv_beacon_wait, then GET URL/v1/status
 * and checks the hub there serves the beacon's model id (the beacon is not
 * signed; a datagram that names another hub's URL is refused, and the wait
 * goes on while time is left). url[cap] gets the hub URL. Errors as
 * kv_beacon_wait's; KV_EHASH names a hub whose model differs. */
int kv_beacon_find_hub(uint16_t port, uint32_t timeout_ms, const char *model_id, char *url, size_t cap, kv_diag *d);

#endif
