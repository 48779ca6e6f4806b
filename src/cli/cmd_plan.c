/* kvasir plan (stub until written) */
#include "cli/cli.h"
int kv_cmd_plan(int argc, char **argv) { (void)argc; (void)argv; return kv_cli_err("plan", 2, "not yet"); }
