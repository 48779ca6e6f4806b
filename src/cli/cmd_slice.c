/* PLACEHOLDER: replaced by the real subcommand. */
#include "cli/cli.h"
int kv_cmd_slice(int argc, char **argv) { (void)argc; (void)argv; return kv_cli_err("slice", 2, "not built yet"); }
