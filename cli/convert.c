/*
 * convert.c - `pi0 convert`: an openpi JAX/orbax checkpoint to the PyTorch format the engine loads.
 *
 * The work is done by tools/convert_openpi.py: orbax's format (an OCDBT B-tree over zstd-compressed zarr
 * chunks) is read with tensorstore, the library orbax itself uses, not by a parser of ours. This command
 * finds the script and runs it with python3, passing every argument through; the script's exit status
 * (0 done, 1 failed, 2 bad command line) is the command's.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

#define SCRIPT "convert_openpi.py"

/* Where the script may be, relative to the directory of the `pi0` binary: next to the source tree it was
 * built in (build/pi0 -> tools/), or where `make install` puts it (PREFIX/bin/pi0 -> PREFIX/share/pi0/). */
static const char *const script_dirs[] = {"/../tools/", "/../share/pi0/"};

static int is_file(const char *path) { return access(path, R_OK) == 0; }

/* The script's path into `out`: $PI0_TOOLS_DIR when set, else beside the binary. */
static int find_script(char *out, size_t size) {
    const char *tools = getenv("PI0_TOOLS_DIR");
    if (tools && *tools) return snprintf(out, size, "%s/" SCRIPT, tools) < (int)size && is_file(out);
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return 0;
    exe[n] = 0;
    *strrchr(exe, '/') = 0;
    for (size_t i = 0; i < sizeof script_dirs / sizeof *script_dirs; i++)
        if (snprintf(out, size, "%s%s" SCRIPT, exe, script_dirs[i]) < (int)size && is_file(out)) return 1;
    return 0;
}

int cmd_convert(int argc, char **argv) {
    char script[PATH_MAX + 64];
    if (!find_script(script, sizeof script)) {
        const char *tools = getenv("PI0_TOOLS_DIR");
        if (tools && *tools) fprintf(stderr, "pi0 convert: error: no %s/" SCRIPT " (PI0_TOOLS_DIR)\n", tools);
        else fprintf(stderr, "pi0 convert: error: cannot find " SCRIPT " in ../tools or ../share/pi0 beside the pi0 "
                             "binary: set PI0_TOOLS_DIR to its directory\n");
        return EXIT_FAILURE_RUN;
    }
    /* python3 SCRIPT ARGS...: argv[0] ("convert") gives its slot to the script */
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (!args) return fprintf(stderr, "pi0 convert: out of memory\n"), EXIT_FAILURE_RUN;
    args[0] = "python3";
    args[1] = script;
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    fflush(NULL);
    execvp(args[0], args);
    fprintf(stderr, "pi0 convert: error: cannot run python3 (%s): install Python 3 to convert openpi checkpoints\n",
            strerror(errno));
    free(args);
    return EXIT_FAILURE_RUN;
}
