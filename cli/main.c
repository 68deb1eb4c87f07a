/* main.c - the `pi0` command: one subcommand per job. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char *usage =
    "usage: pi0 COMMAND [options]\n"
    "\n"
    "Inference engine for Physical Intelligence's Pi0 and Pi0.5 vision-language-action policies.\n"
    "\n"
    "commands:\n"
    "  sample    run sample_actions on inputs from a safetensors file, write the actions\n"
    "  bench     time inference on a checkpoint or on built-in random weights\n"
    "  inspect   show a checkpoint's model (Pi0 or Pi0.5), dims, dtypes, parameter counts, unused and missing tensors\n"
    "  init      write a checkpoint of random weights (any dims)\n"
    "  convert   an openpi JAX checkpoint (orbax params/) to this format (needs python3 and tensorstore)\n"
    "  infer     one robot observation (msgpack, as on the wire) to actions, through the policy\n"
    "  serve     the openpi websocket policy server, batching concurrent requests\n"
    "\n"
    "Run 'pi0 COMMAND --help' for a command's options.\n"
    "Exit codes: 0 success, 1 the work failed, 2 bad command line.\n";

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? EXIT_USAGE : EXIT_OK;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "inspect")) return cmd_inspect(argc - 1, argv + 1);
    if (!strcmp(cmd, "init")) return cmd_init(argc - 1, argv + 1);
    if (!strcmp(cmd, "convert")) return cmd_convert(argc - 1, argv + 1);
    if (!strcmp(cmd, "infer") || !strcmp(cmd, "serve")) {
#ifdef PI0_WITH_SERVER
        return (cmd[0] == 'i' ? cmd_infer : cmd_serve)(argc - 1, argv + 1);
#else
        fprintf(stderr, "pi0 %s: this build has no server support (it needs msgpack-c and libwebsockets: "
                        "install libmsgpack-dev and libwebsockets-dev, then rebuild)\n", cmd);
        return EXIT_FAILURE_RUN;
#endif
    }
    fprintf(stderr, "pi0: unknown command '%s'\n%s", cmd, usage);
    return EXIT_USAGE;
}
