/*
 * server.h - openpi's websocket policy server (docs/protocol.md), with request batching.
 *
 * One network thread (libwebsockets) accepts clients, sends each the metadata frame, reads requests and
 * writes replies. Preparation threads decode each request and run pi0_policy_prepare on it (images
 * resized, state normalized, prompt tokenized), so that neither the network nor the model waits for
 * that. One inference thread owns the model: it takes up to `max_batch` prepared requests, waiting at
 * most `batch_wait_ms` after the first for more when more can come, and runs them as one
 * pi0_policy_infer_prepared call. A bad request gets a text frame with the error and a close with code
 * 1011; other clients are not affected. GET /healthz answers 200 "OK\n".
 *
 * Every reply carries openpi's fields: `actions` (float64, (horizon, action_dims)), `policy_timing` {infer_ms:
 * the batched model call} and `server_timing` {infer_ms: request complete to reply packed, prev_total_ms: the
 * connection's previous request from its first byte to its reply written (from the 2nd request on)}, and in
 * server_timing ours, in ms: receive_ms (first to last byte), prep_queue_ms (waiting for a preparation
 * thread), decode_ms, prepare_ms, queue_ms (prepared to its batch starting), model_ms, encode_ms (packing
 * the actions), prev_send_ms (the previous reply's writing), and batch_size. The metadata frame is {engine, model ("pi0" or "pi05"), adapter,
 * action_horizon, action_dims, action_dim, backend, max_batch, batch_wait_ms, limits: {every limit below}}.
 *
 * Bounds (each a pi0_server_options field, 0 = the default): a request frame at most max_frame_bytes;
 * requests being received hold at most max_transit_bytes together, requests received and not yet answered
 * at most max_queue_bytes (beyond either, the request that would exceed it is refused); a request must
 * arrive whole within request_timeout_s of its first byte, and a connection with nothing in flight for
 * idle_timeout_s is closed (1001); at most max_clients websockets at once (further connections are closed
 * on accept, and never past the process's file-descriptor limit, which start-up raises to its hard limit).
 * Requests of a connection that has gone are dropped before they run.
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
    size_t max_transit_bytes; /* requests being received, together; 0 = 1 GiB */
    size_t max_queue_bytes;  /* requests received and not yet answered, together; 0 = 1 GiB */
    double request_timeout_s; /* first byte to last of one request; 0 = 30 */
    double idle_timeout_s;   /* a connection with nothing in flight; 0 = 3600 */
    int max_clients;         /* websockets at once; 0 = 256 */
    int prep_threads;        /* threads decoding and preparing requests, 1..64; 0 = 2 */
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
