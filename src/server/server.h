/*
 * server.h - openpi's websocket policy server (docs/protocol.md), with request batching.
 *
 * One network thread (libwebsockets) accepts clients, sends each the metadata frame, reads requests and
 * writes replies; one inference thread owns the policy. Requests that arrive together are decoded and
 * queued; the inference thread takes up to `max_batch` of them, waiting at most `batch_wait_ms` after the
 * first for more, and runs them as one pi0_policy_infer call. A bad request gets a text frame with the
 * error and a close with code 1011; other clients are not affected. GET /healthz answers 200 "OK\n".
 *
 * Every reply carries openpi's fields: `actions` (float64, (horizon, action_dims)), `policy_timing` {infer_ms:
 * the batched policy call} and `server_timing` {infer_ms: decoded request to packed reply, prev_total_ms: the
 * connection's previous request from its first byte to its reply written (from the 2nd request on), and ours:
 * batch_size, queue_ms}. The metadata frame is {engine, model ("pi0" or "pi05"), adapter, action_horizon,
 * action_dims, action_dim, backend, max_batch, batch_wait_ms}.
 *
 * The library prints nothing: the per-connection lines and errors go to `log` when it is set.
 */
#ifndef PI0_SERVER_SERVER_H
#define PI0_SERVER_SERVER_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "pi0_policy.h"

typedef struct {
    const char *host;        /* "127.0.0.1" */
    int port;                /* 8000; 0 = any free port (see pi0_server_options.on_listen) */
    int max_batch;           /* 1..64 */
    double batch_wait_ms;    /* >= 0 */
    size_t max_frame_bytes;  /* larger request frames are refused; 0 = 64 MiB */
    int has_seed;            /* every request uses noise from `seed` (reproducible); else a fresh seed each */
    uint64_t seed;
    int quiet;               /* no per-connection log lines (only start-up failures, through `err`) */
    /* Called once the socket listens, with the bound port (may be NULL). */
    void (*on_listen)(void *user, int port);
    /* One line (no newline) per connect, disconnect, refused request, and a summary at shutdown; may be NULL.
     * Called from the network thread. */
    void (*log)(void *user, const char *line);
    void *user;
} pi0_server_options;

/*
 * Serves until *stop becomes non-zero (set it from a SIGINT/SIGTERM handler), then stops accepting,
 * finishes the requests in flight, closes every connection and returns. The policy is borrowed.
 */
pi0_status pi0_server_run(pi0_policy *policy, const pi0_server_options *opts, volatile sig_atomic_t *stop,
                          pi0_error *err);

#endif
