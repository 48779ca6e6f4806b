/* PLACEHOLDER: replaced by the real subcommand. */
#include "cli/cli.h"
int kv_cmd_gen_model(int argc, char **argv) { (void)argc; (void)argv; return kv_cli_err("gen_model", 2, "not built yet"); }
