/* PLACEHOLDER: replaced by the real subcommand. */
#include "cli/cli.h"
int kv_cmd_expert(int argc, char **argv) { (void)argc; (void)argv; return kv_cli_err("expert", 2, "not built yet"); }
