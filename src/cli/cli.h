/* The `kvasir` command line: one thin file per subcommand, each parsing its
 * flags and calling the library. Conventions shared by every subcommand:
 * errors are printed once, on one line, as "kvasir CMD: message", and the
 * command returns non-zero (1 for usage errors, 2 for failures). */
#ifndef KVASIR_CLI_H
#define KVASIR_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "kvasir/err.h"

typedef int (*kv_cmd_fn)(int argc, char **argv);

int kv_cmd_gen_model(int argc, char **argv);
int kv_cmd_tokenize(int argc, char **argv);
int kv_cmd_run(int argc, char **argv);
int kv_cmd_bench(int argc, char **argv);
int kv_cmd_inspect(int argc, char **argv);
int kv_cmd_slice(int argc, char **argv);
int kv_cmd_gguf_split(int argc, char **argv);
int kv_cmd_expert(int argc, char **argv);
int kv_cmd_worker(int argc, char **argv);
int kv_cmd_xcheck(int argc, char **argv);
int kv_cmd_hub(int argc, char **argv);
int kv_cmd_market(int argc, char **argv);
int kv_cmd_node(int argc, char **argv);
int kv_cmd_wallet(int argc, char **argv);
int kv_cmd_ledger(int argc, char **argv);
int kv_cmd_gateway(int argc, char **argv);
int kv_cmd_swarm(int argc, char **argv);
int kv_cmd_plan(int argc, char **argv);
int kv_cmd_ring(int argc, char **argv);
int kv_cmd_key(int argc, char **argv);

struct kv_node_key;
/* Loads (creating if absent) a coordinator key: path, else
 * DATA/coordinator.key when data_dir is given, else ~/.kvasir/coordinator.key.
 * Returns 0, or prints one line and returns non-zero. */
int kv_cli_key(const char *cmd, const char *path, const char *data_dir, struct kv_node_key *k);

#include "kvasir/dispatch_evidence.h"
#include "kvasir/hub.h"
/* What a coordinator command proves to workers: its key (kv_cli_key), and
 * with a hub, the hub's voucher for it and the key the placement lists for
 * each of workers[0..n). A hub that does not vouch for the key is a warning
 * (workers that list it with --allow-key still serve it). */
typedef struct kv_cli_auth {
    kv_node_key key;
    kv_voucher voucher;
    bool has_voucher;
    uint8_t (*worker_keys)[32]; /* [n] or NULL */
    const char *hub;            /* where caught workers are reported, or NULL */
} kv_cli_auth;
/* kv_engine_opts.on_caught for the CLI (arg: a kv_cli_auth): one line on
 * stderr, and with a hub a signed report (POST /v1/report) carrying the
 * worker's signed evidence when there is some. */
void kv_cli_caught(void *arg, uint32_t worker, const char *addr, const uint8_t key[32], const char *why,
                   const struct kv_evidence *ev);
int kv_cli_auth_setup(const char *cmd, const char *key_path, const char *hub, const char *data_dir,
                      char *const *workers, uint32_t n, kv_cli_auth *a);
void kv_cli_auth_free(kv_cli_auth *a);

/* Prints "kvasir <cmd>: <printf message>\n" to stderr; returns rc. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
int kv_cli_err(const char *cmd, int rc, const char *fmt, ...);
/* Prints the diag as one line; returns 2. */
int kv_cli_diag(const char *cmd, const kv_diag *d);

/* Bounded numeric flag parsing. Each returns 0, or prints a one-line error
 * naming the flag and returns 1 (usage error). */
int kv_arg_long(const char *cmd, const char *flag, const char *s, long lo, long hi, long *out);
int kv_arg_u64(const char *cmd, const char *flag, const char *s, uint64_t *out);
int kv_arg_float(const char *cmd, const char *flag, const char *s, double lo, double hi,
                 float *out);
/* Returns argv[*i+1] and advances *i, or prints "flag needs a value" and
 * returns NULL. If `known` (a NULL-terminated list of the command's value
 * flags) is given and argv[*i] is not in it, prints "unknown option". */
const char *kv_arg_value(const char *cmd, int argc, char **argv, int *i, const char *const *known);

#endif
