/* serve.c - `pi0 serve`: openpi's websocket policy server (a drop-in for openpi's serve_policy.py). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "server/server.h"
#include "util/clock.h"

static const char *help =
    "usage: pi0 serve --checkpoint DIR --adapter libero|droid|FILE.json [--host 127.0.0.1] [--port 8000]\n"
    "                 [--max-batch 8] [--batch-wait-ms 2] [--prep-threads 2] [--no-warmup] [--tokenizer PATH]\n"
    "                 [--norm-stats PATH] [--norm zscore|quantile] [--steps N] [--horizon N] [--seed N]\n"
    "                 [--max-frame-mb 64] [--max-transit-mb 1024] [--max-queue-mb 1024] [--max-clients 256]\n"
    "                 [--request-timeout-s 30] [--idle-timeout-s 3600] [--backend auto|cpu|cuda] [--quiet]\n"
    "\n"
    "Serves the policy over openpi's websocket protocol: openpi_client's WebsocketClientPolicy connects to\n"
    "ws://HOST:PORT, gets a metadata map, then sends msgpack observations and gets back\n"
    "{\"actions\", \"policy_timing\", \"server_timing\"}. A bad request gets a text frame with the error and\n"
    "a close with code 1011. GET /healthz answers 200 \"OK\". SIGINT/SIGTERM finish the requests in\n"
    "flight, close every connection (code 1001) and exit 0.\n"
    "\n"
    "Requests from different clients that arrive together run as one batch:\n"
    "  --max-batch N        at most N observations per policy call (1..64, default 8)\n"
    "  --batch-wait-ms T    after a request is ready, wait up to T ms for others to join its batch while more\n"
    "                       can come (default 2; 0 = never wait: under load, batches still form from the\n"
    "                       requests that queued while the previous batch ran)\n"
    "  --prep-threads N     threads decoding and preprocessing requests beside the model (1..64, default 2)\n"
    "  --no-warmup          start listening without first running every batch shape once (on a GPU the first\n"
    "                       request of each new shape then pays for a graph capture)\n"
    "\n"
    "Limits (a request past one is refused with its error; see README \"pi0 serve\"):\n"
    "  --max-frame-mb N     one request at most N MiB (default 64)\n"
    "  --max-transit-mb N   requests being received hold at most N MiB together (default 1024)\n"
    "  --max-queue-mb N     requests received and not yet answered hold at most N MiB together (default 1024)\n"
    "  --max-clients N      websockets at once (default 256; more are closed on accept)\n"
    "  --request-timeout-s  a request must arrive whole within this many seconds of its first byte (default 30)\n"
    "  --idle-timeout-s     a connection with nothing in flight is closed (1001) after this long (default 3600)\n"
    "\n"
    "  --adapter            how the robot's observation maps onto the model: libero, droid, or a JSON file\n"
    "  --tokenizer PATH     default: DIR/paligemma_tokenizer.model, then openpi's download cache\n"
    "  --norm-stats PATH    default: the norm_stats.json under DIR/assets/\n"
    "  --norm MODE          zscore or quantile; default: the model's own (see pi0 infer --help)\n"
    "  --horizon N          action steps (default: config.json's action_horizon, else the adapter's)\n"
    "  --steps N            Euler steps (default 10)\n"
    "  --seed N             every request uses noise from seed N (reproducible); default: a fresh seed each\n"
    "  --port 0             any free port (the \"listening on\" line says which)\n"
    "  --quiet              no load progress and no per-connection lines on stderr\n"
    "Loads the policy, warms up every batch shape (reporting how long it took), then prints\n"
    "\"listening on ws://HOST:PORT\" on stdout once it accepts connections.\n";

static volatile sig_atomic_t stop_requested;

/* The first signal asks for a graceful stop; a second one kills (the default action is restored). */
static void on_signal(int sig) {
    stop_requested = 1;
    signal(sig, SIG_DFL);
}

typedef struct {
    const char *host;
} listen_info;

static void on_listen(void *user, int port) {
    const listen_info *li = user;
    int v6 = strchr(li->host, ':') != NULL; /* ws://[::1]:8000 */
    printf("listening on ws://%s%s%s:%d\n", v6 ? "[" : "", li->host, v6 ? "]" : "", port);
    fflush(stdout);
}

static void log_line(void *user, const char *line) {
    (void)user;
    fprintf(stderr, "pi0 serve: %s\n", line);
}

int cmd_serve(int argc, char **argv) {
    const char *checkpoint = NULL, *adapter = NULL, *tokenizer = NULL, *norm_stats = NULL, *backend_name = "auto";
    const char *host = "127.0.0.1", *norm = NULL;
    long long port = 8000, max_batch = 8, wait_ms = 2, frame_mb = 64, steps = 10, seed = 0, horizon = 0;
    long long transit_mb = 1024, queue_mb = 1024, max_clients = 256, prep_threads = 2, request_s = 30, idle_s = 3600;
    int has_seed = 0, quiet = 0, warmup = 1, r, bad;
    pi0_norm_mode norm_mode = PI0_NORM_DEFAULT;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(help, stdout), EXIT_OK;
        if (!strcmp(argv[i], "--quiet")) { quiet = 1; continue; }
        if (!strcmp(argv[i], "--no-warmup")) { warmup = 0; continue; }
        if (!strcmp(argv[i], "--quantile-norm")) { norm_mode = PI0_NORM_QUANTILE; continue; }
        if ((r = flag_value(argc, argv, &i, "--checkpoint", &checkpoint)) || (r = flag_value(argc, argv, &i, "--adapter", &adapter)) ||
            (r = flag_value(argc, argv, &i, "--tokenizer", &tokenizer)) || (r = flag_value(argc, argv, &i, "--norm-stats", &norm_stats)) ||
            (r = flag_value(argc, argv, &i, "--backend", &backend_name)) || (r = flag_value(argc, argv, &i, "--host", &host)) ||
            (r = flag_value(argc, argv, &i, "--norm", &norm))) {
            if (r < 0) return usage_error("serve", "%s needs a value", argv[i]);
            continue;
        }
        const int_flag ints[] = {
            {"--port", 0, 65535, &port}, {"--max-batch", 1, 64, &max_batch}, {"--batch-wait-ms", 0, 60000, &wait_ms},
            {"--max-frame-mb", 1, 4096, &frame_mb}, {"--steps", 1, PI0_MAX_STEPS, &steps}, {"--seed", 0, INT64_MAX, &seed},
            {"--horizon", 1, PI0_MAX_HORIZON, &horizon}, {"--max-transit-mb", 1, 1 << 20, &transit_mb},
            {"--max-queue-mb", 1, 1 << 20, &queue_mb}, {"--max-clients", 1, 1 << 20, &max_clients},
            {"--prep-threads", 1, 64, &prep_threads}, {"--request-timeout-s", 1, 86400, &request_s},
            {"--idle-timeout-s", 1, 1 << 30, &idle_s},
        };
        const int_flag *f = int_flag_value(argc, argv, &i, ints, sizeof ints / sizeof ints[0], &bad);
        if (f) {
            if (bad) return int_flag_error("serve", f);
            has_seed |= f->out == &seed;
            continue;
        }
        return usage_error("serve", "unknown option '%s'", argv[i]);
    }
    if (!checkpoint) return usage_error("serve", "--checkpoint is required");
    if (!adapter) return usage_error("serve", "--adapter is required (libero, droid or a JSON file)");
    if (!*host) return usage_error("serve", "--host is empty");
    pi0_backend backend;
    if (pi0_backend_from_name(backend_name, &backend)) return usage_error("serve", "unknown backend '%s'", backend_name);
    if (norm && norm_mode_from_name(norm, &norm_mode)) return usage_error("serve", "--norm takes zscore or quantile");

    int last_percent = -1;
    pi0_policy_options popts = {
        .checkpoint = checkpoint, .adapter = adapter, .tokenizer = tokenizer, .norm_stats = norm_stats,
        .norm_mode = norm_mode, .num_steps = (int)steps, .horizon = (int)horizon,
        .model = {.backend = backend, .progress = quiet ? NULL : progress_to_stderr, .progress_user = &last_percent},
    };
    pi0_policy *policy;
    pi0_error err = {0};
    double t0 = pi0_now_ms(), warmup_s = 0;
    if (pi0_policy_open(&popts, &policy, &err)) return run_error("serve", &err);
    double load_s = (pi0_now_ms() - t0) / 1e3;
    const pi0_model *model = pi0_policy_model(policy);
    if (warmup && pi0_policy_warmup(policy, (int)max_batch, &warmup_s, &err)) {
        pi0_policy_free(policy);
        return run_error("serve", &err);
    }
    if (!quiet) {
        char warm[160] = "";
        if (pi0_model_graph_captures(model))
            snprintf(warm, sizeof warm, ", warm-up %.1f s: %llu batch shapes for 1..%lld requests", warmup_s,
                     (unsigned long long)pi0_model_graph_captures(model), max_batch);
        fprintf(stderr, "pi0 serve: %s on %s ready in %.1f s (load %.1f s%s); host memory %.2f GB, GPU memory %.2f GB\n",
                pi0_model_kind_name(pi0_model_dims(model)->kind), pi0_backend_name(pi0_model_backend(model)),
                load_s + warmup_s, load_s, warm, (double)host_anon_bytes() / 1e9,
                (double)pi0_model_device_memory(model) / 1e9);
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    listen_info li = {host};
    pi0_server_options sopts = {
        .host = host, .port = (int)port, .max_batch = (int)max_batch, .batch_wait_ms = (double)wait_ms,
        .max_frame_bytes = (size_t)frame_mb << 20, .max_transit_bytes = (size_t)transit_mb << 20,
        .max_queue_bytes = (size_t)queue_mb << 20, .request_timeout_s = (double)request_s, .idle_timeout_s = (double)idle_s,
        .max_clients = (int)max_clients, .prep_threads = (int)prep_threads, .has_seed = has_seed, .seed = (uint64_t)seed,
        .quiet = quiet,
        .on_listen = on_listen, .log = log_line, .user = &li,
    };
    /* on_listen and log share `user`: log ignores it. */
    pi0_status st = pi0_server_run(policy, &sopts, &stop_requested, &err);
    pi0_policy_free(policy);
    if (st) return run_error("serve", &err);
    if (!quiet) fprintf(stderr, "pi0 serve: stopped\n");
    return EXIT_OK;
}
