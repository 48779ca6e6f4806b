/* kvasir wallet: make an Ed25519 key, show its account, and sign a payment
 * authorization (the X-KVR-Payment header) for one gateway (docs/LEDGER.md). */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "kvasir/ledger.h"
#include "kvasir/link.h"

#define CMD "wallet"

static const char *const kv_value_flags[] = {"--out", "--key", "--gateway", "--max", "--expires", NULL};

static const char *kv_wallet_help =
    "usage: kvasir wallet new --out KEYFILE\n"
    "       kvasir wallet show --key KEYFILE [--json]\n"
    "       kvasir wallet pay --key KEYFILE --gateway GATEWAY_ID --max MICRO_KVR [--expires SECONDS] [--json]\n"
    "  new   writes a fresh Ed25519 key (mode 0600, never overwrites) and prints its public key\n"
    "  show  prints the public key: the consumer account (or node account) of this key\n"
    "  pay   prints a payment authorization for the X-KVR-Payment header: usable once, at\n"
    "        GATEWAY_ID only, for at most MICRO_KVR, for SECONDS from now (default 3600)\n";

int kv_cmd_wallet(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(kv_wallet_help, argc < 2 ? stderr : stdout);
        return argc < 2 ? 1 : 0;
    }
    const char *sub = argv[1], *out = NULL, *key = NULL, *gateway = NULL;
    uint64_t max = 0, expires = 3600;
    bool have_max = false, json = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_wallet_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--out")) {
            out = v;
        } else if (!strcmp(a, "--key")) {
            key = v;
        } else if (!strcmp(a, "--gateway")) {
            gateway = v;
        } else if (!strcmp(a, "--max")) {
            if (kv_arg_u64(CMD, a, v, &max)) return 1;
            if (max == 0 || max > KV_LEDGER_MAX_AMOUNT)
                return kv_cli_err(CMD, 1, "--max: %llu is outside 1..%llu", (unsigned long long)max,
                                  (unsigned long long)KV_LEDGER_MAX_AMOUNT);
            have_max = true;
        } else if (!strcmp(a, "--expires")) {
            if (kv_arg_u64(CMD, a, v, &expires)) return 1;
            if (expires == 0 || expires > UINT64_C(10) * 365 * 86400)
                return kv_cli_err(CMD, 1, "--expires: %llu is outside 1..315360000 seconds", (unsigned long long)expires);
        }
    }
    kv_diag d = {0};
    kv_wallet w;
    char hex[65];
    if (!strcmp(sub, "new")) {
        if (!out) return kv_cli_err(CMD, 1, "new needs --out KEYFILE");
        if (kv_wallet_generate(&w, &d) || kv_wallet_save(&w, out, &d)) return kv_cli_diag(CMD, &d);
        kv_hex(w.pk, 32, hex);
        printf("%s\n", hex);
        return 0;
    }
    if (!key) return kv_cli_err(CMD, 1, "%s needs --key KEYFILE", sub);
    if (!strcmp(sub, "show")) {
        if (kv_wallet_load(&w, key, &d)) return kv_cli_diag(CMD, &d);
        kv_hex(w.pk, 32, hex);
        if (json) printf("{\"public_key\":\"%s\",\"account\":\"consumer:%s\"}\n", hex, hex);
        else printf("%s\n", hex);
        return 0;
    }
    if (!strcmp(sub, "pay")) {
        if (!gateway || !have_max) return kv_cli_err(CMD, 1, "pay needs --gateway and --max");
        if (kv_wallet_load(&w, key, &d)) return kv_cli_diag(CMD, &d);
        kv_auth a;
        char hdr[KV_AUTH_HEADER_MAX];
        uint64_t now = (uint64_t)time(NULL);
        if (kv_auth_sign(&a, &w, gateway, max, now + expires, &d) || kv_auth_encode(&a, hdr, sizeof hdr, &d))
            return kv_cli_diag(CMD, &d);
        if (json) {
            char nonce[33];
            kv_hex(a.nonce, 16, nonce);
            kv_hex(a.consumer, 32, hex);
            printf("{\"header\":\"%s\",\"consumer\":\"consumer:%s\",\"gateway\":\"%s\",\"max\":%llu,"
                   "\"expires\":%llu,\"nonce\":\"%s\"}\n", hdr, hex, a.gateway, (unsigned long long)a.max,
                   (unsigned long long)a.expires, nonce);
        } else {
            printf("%s\n", hdr);
        }
        return 0;
    }
    return kv_cli_err(CMD, 1, "unknown subcommand '%s' (new, show, pay)", sub);
}
