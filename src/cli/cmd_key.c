/* kvasir key: a coordinator's (or node's) Ed25519 key file, and the
 * shared --key FILE default of the coordinator commands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/dispatch_evidence.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"

#define CMD "key"

int kv_cli_key(const char *cmd, const char *path, const char *data_dir, kv_node_key *k) {
    char def[4200];
    if (!path) {
        const char *home = getenv("HOME");
        if (data_dir) snprintf(def, sizeof def, "%s/coordinator.key", data_dir);
        else if (home && home[0]) snprintf(def, sizeof def, "%s/.kvasir/coordinator.key", home);
        else return kv_cli_err(cmd, 1, "no --key FILE given and no HOME to keep a default key in");
        path = def;
    }
    kv_diag d = {0};
    if (kv_key_file_load(k, path, true, &d)) return kv_cli_diag(cmd, &d);
    return 0;
}

static const char *kv_key_help =
    "usage: kvasir key [--key FILE]\n"
    "Prints the public key (64 hex digits) of the Ed25519 key in FILE, creating the file\n"
    "(0600) when it does not exist. Default FILE: ~/.kvasir/coordinator.key, the key that\n"
    "`kvasir run`, `bench` and `gateway` prove to workers (give it to `kvasir worker\n"
    "--allow-key`, or to `kvasir hub --vouch-key`).\n";

int kv_cmd_key(int argc, char **argv) {
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(kv_key_help, stdout);
            return 0;
        }
        static const char *const flags[] = {"--key", NULL};
        const char *v = kv_arg_value(CMD, argc, argv, &i, flags);
        if (!v) return 1;
        path = v;
    }
    kv_node_key k;
    int rc = kv_cli_key(CMD, path, NULL, &k);
    if (rc) return rc;
    char hex[65];
    kv_hex(k.pk, 32, hex);
    printf("%s\n", hex);
    return 0;
}

int kv_cli_auth_setup(const char *cmd, const char *key_path, const char *hub, const char *data_dir,
                      char *const *workers, uint32_t n, kv_cli_auth *a) {
    memset(a, 0, sizeof *a);
    int rc = kv_cli_key(cmd, key_path, hub ? data_dir : NULL, &a->key);
    if (rc || !hub) return rc;
    a->hub = hub;
    if (n && !(a->worker_keys = calloc(n, sizeof *a->worker_keys))) return kv_cli_err(cmd, 2, "out of memory");
    kv_diag d = {0};
    rc = kv_node_fetch_auth(hub, &a->key, workers, n, a->worker_keys, &a->voucher, &d);
    if (rc == KV_EAUTH) {
        /* workers that list this key with --allow-key still admit it */
        fprintf(stderr, "kvasir %s: warning: %s\n", cmd, d.msg);
        return 0;
    }
    if (rc) return kv_cli_diag(cmd, &d);
    a->has_voucher = true;
    return 0;
}

void kv_cli_auth_free(kv_cli_auth *a) {
    free(a->worker_keys);
    a->worker_keys = NULL;
}

void kv_cli_caught(void *arg, uint32_t worker, const char *addr, const uint8_t key[32], const char *why,
                   const struct kv_evidence *ev) {
    kv_cli_auth *a = arg;
    (void)worker;
    fprintf(stderr, "kvasir: worker %s caught lying, dropped and its part redone: %s\n", addr, why);
    if (!a || !a->hub) return;
    kv_diag d = {0};
    bool unlisted = false;
    if (kv_node_report(a->hub, &a->key, key, why, ev, &unlisted, &d))
        fprintf(stderr, "kvasir: reporting it to the hub: %s\n", d.msg);
    else
        fprintf(stderr, "kvasir: reported it to the hub%s\n",
                unlisted ? ": unlisted" : ": the hub found its signed answer right and changed nothing");
}
