/*
 * server.c - the openpi websocket policy server on libwebsockets (see server.h).
 *
 * Threads: the caller's thread runs the lws event loop (every callback below, every connection's state) and
 * decodes and prepares a robot's usual, small request itself; `prep_threads` threads decode and prepare the
 * larger ones (prep_main); one inference thread owns the model
 * (worker_main). They share only the queues (server/queue.h): requests carry a connection id and the
 * connection's token, replies come back with the id, and the network thread looks the id up among the
 * live connections when it delivers, so a client that left while its request ran just loses its reply
 * (and one that left before loses its request, which is never run).
 *
 * Per connection: at most MAX_IN_FLIGHT requests are in the server; beyond that the connection stops
 * being read (lws_rx_flow_control) until a reply is written, so a pipelining client cannot queue without
 * bound. A message is reassembled from its frames into one buffer no larger than max_frame_bytes: the
 * size of the frame being read is known from its header, so an oversized request is refused at its first
 * bytes; the buffer then goes with the request, whole, to preparation.
 *
 * Memory: every byte a request holds is counted, while it arrives against max_transit_bytes (network
 * thread only; a request up to RX_ALWAYS is let in regardless, so that a robot's usual request still goes
 * while large ones fill the budget) and from then until it is answered or dropped against max_queue_bytes
 * (an atomic: the other threads release it). So the server's request memory stays below max_transit_bytes
 * + max_clients x RX_ALWAYS + max_queue_bytes + what preparation and the batch hold (docs/protocol.md).
 */
#include "server/server.h"

#include <libwebsockets.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "server/msgpack_numpy.h"
#include "server/queue.h"
#include "util/clock.h"
#include "util/error.h"
#include "util/rng.h"

enum {
    WRITE_CHUNK = 256 * 1024,         /* bytes per outgoing websocket fragment */
    RX_CHUNK = 64 * 1024,             /* lws's per-connection receive buffer */
    RX_FIRST_MAX = 4 * 1024 * 1024,   /* a message's buffer starts at most this large, whatever its frame announces */
    RX_ALWAYS = 1024 * 1024,          /* a message up to this size is received even past the transit budget, so
                                         that robots' usual requests still go while large ones fill it */
    MAX_IN_FLIGHT = 2,                /* requests of one connection in the server before it stops being read */
    INLINE_PREPARE_BYTES = 1024 * 1024, /* a request up to this size is prepared on the event loop (conn_request) */
    TICK_US = 50 * 1000,              /* how often the event loop looks at *stop and the timeouts */
    LATE_TICK_MS = 20,                /* a tick this late means the event loop was held up: logged */
    SLOW_RX_GAP_MS = 20,              /* a pause this long between two parts of one request is logged ... */
    SLOW_RX_LOG_EVERY_MS = 10000,     /* ... once per connection in this long (a robot on a slow link would flood it) */
    CLOSE_GRACE_MS = 2000,            /* at shutdown, time for connections to finish their close handshake */
    KILL_AFTER_S = 3,                 /* a connection being closed for a timeout is dropped after this, said or not */
    FD_HEADROOM = 32,                 /* descriptors kept free below the limit (files, pipes, CUDA) */
    MAX_PREP_THREADS = 64,
};

/* The defaults of the options' 0s (server.h). */
#define DEFAULT_MAX_FRAME ((size_t)64 << 20)
#define DEFAULT_MAX_TRANSIT ((size_t)1 << 30)
#define DEFAULT_MAX_QUEUE ((size_t)1 << 30)
#define DEFAULT_REQUEST_TIMEOUT_S 30.0
#define DEFAULT_IDLE_TIMEOUT_S 3600.0
#define DEFAULT_MAX_CLIENTS 256
#define DEFAULT_PREP_THREADS 2

typedef struct out_msg {
    struct out_msg *next;
    uint8_t *data; /* owned unless `shared` */
    size_t size, sent;
    int text;      /* an error message: the connection closes with 1011 after it */
    int shared;    /* the server's metadata */
    int is_reply;  /* answers a request (in_flight counts it) */
    double t_received_ms, t_posted_ms;
} out_msg;

/* Per-session data: lws allocates it zeroed for every connection, HTTP or websocket, and frees it after
 * LWS_CALLBACK_CLOSED. Only the network thread touches it. */
typedef struct conn {
    struct conn *prev, *next; /* the server's live websocket connections */
    struct lws *wsi;
    uint64_t id;              /* never reused */
    conn_token *token;        /* shared with its requests */
    int is_ws;                /* established (plain HTTP requests share this struct) */
    uint8_t *rx;              /* the message being reassembled */
    size_t rx_size, rx_cap;
    int rx_skip;              /* dropping the rest of the current message */
    double rx_t0;             /* its first byte */
    double rx_last_ms;        /* its latest part */
    int rx_counted;           /* it is counted on its way to the batch queue (queue_arriving) */
    double slow_logged_ms;    /* when a slow part of a request was last logged */
    uint64_t slow_unlogged;   /* slow parts since then, not logged */
    double last_active_ms;    /* the last byte read or written */
    int in_flight;            /* requests in the server whose reply is not written yet */
    int paused;               /* reading stopped (lws_rx_flow_control) */
    double prev_total_ms, prev_send_ms; /* < 0: no request answered yet */
    uint64_t requests;
    out_msg *out_head, *out_tail;
    int failed;               /* an error frame is queued: ignore what the client sends from now on */
    int close_code;           /* != 0: close with it once everything queued is written */
    char peer[64];
    int http_status;          /* plain HTTP: the answer to write */
    const char *http_body;
} conn;

typedef struct {
    pi0_policy *policy;
    pi0_server_options opts; /* with the defaults filled in */
    volatile sig_atomic_t *stop;
    struct lws_context *ctx;
    lws_sorted_usec_list_t tick;
    request_fifo prep;
    server_queue queue;
    pthread_t worker, preppers[MAX_PREP_THREADS];
    int num_preppers;
    atomic_int preppers_running; /* the last one to finish closes the batch queue */
    atomic_int worker_done;
    atomic_size_t queued_bytes; /* requests handed on and not yet answered or dropped */
    atomic_ullong dropped;      /* requests of closed connections, never run */
    uint8_t *metadata;
    size_t metadata_size;
    uint8_t *scratch; /* LWS_PRE + WRITE_CHUNK: each outgoing fragment is copied here behind lws's headroom */
    /* network thread */
    conn *conns;
    int num_conns, fd_limit;
    size_t transit_bytes;       /* receive buffers of every connection */
    uint64_t next_conn_id, seed_base, seed_count, refused_connections;
    int stopping, exit_loop;
    double close_deadline_ms; /* set once the worker has finished: connections get until then to close */
    double tick_due_ms;       /* when the tick should fire: how late it is shows how long the loop was held up */
    double longest_callback_ms; /* since the last tick, and which callback it was */
    const char *longest_callback;
    uint64_t late_ticks;
    double worst_late_ms;     /* the latest a tick has come */
    /* worker thread (the counters are read by the network thread after joining it) */
    server_request **batch;   /* max_batch each */
    const pi0_prepared **batch_prepared;
    uint64_t *batch_seeds;
    pi0_policy_result *results;
    uint64_t served, batches, errors;
    int largest_batch;
} server;

static void server_log(server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void server_log(server *s, const char *fmt, ...) {
    if (s->opts.quiet || !s->opts.log) return;
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    s->opts.log(s->opts.user, line);
}

/* ---- preparation and inference threads ------------------------------------------------------------ */

/* Frees a request and gives its bytes back to the queue budget. */
static void request_done(server *s, server_request *r) {
    atomic_fetch_sub(&s->queued_bytes, r->bytes);
    server_request_free(r);
}

static int request_abandoned(const server_request *r) {
    return atomic_load(&r->token->closed);
}

static server_reply *reply_error(const server_request *rq, const char *message) {
    server_reply *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->conn_id = rq->conn_id;
    r->is_error = 1;
    r->size = strlen(message);
    r->t_received_ms = rq->t_received_ms;
    if (!(r->data = malloc(r->size + 1))) {
        free(r);
        return NULL;
    }
    memcpy(r->data, message, r->size + 1);
    return r;
}

/* Hands replies to the network thread and wakes it. */
static void post_replies(server *s, server_reply *first, server_reply *last) {
    double now = pi0_now_ms();
    for (server_reply *r = first; r; r = r->next) r->t_posted_ms = now;
    queue_post_replies(&s->queue, first, last);
    lws_cancel_service(s->ctx);
}

static void pack_ms(pi0_packer *p, const char *key, double ms) {
    pi0_pack_str(p, key);
    pi0_pack_double(p, ms);
}

/* openpi's reply: {"actions": float64 (H, dims), "policy_timing": {...}, "server_timing": {...}}. */
static server_reply *reply_make(const server_request *rq, const pi0_policy_result *res, int batch_size,
                                double t_start_ms) {
    if (res->error.status) return reply_error(rq, res->error.message);
    pi0_packer p = {0};
    double t_encode = pi0_now_ms();
    pi0_pack_policy_reply(&p, res, res->model_ms, 1);
    double now = pi0_now_ms();
    pi0_pack_str(&p, "server_timing");
    pi0_pack_map(&p, 9 + (rq->prev_total_ms >= 0) * 2);
    pack_ms(&p, "infer_ms", now - rq->t_complete_ms);
    if (rq->prev_total_ms >= 0) pack_ms(&p, "prev_total_ms", rq->prev_total_ms), pack_ms(&p, "prev_send_ms", rq->prev_send_ms);
    pack_ms(&p, "receive_ms", rq->t_complete_ms - rq->t_received_ms);
    pack_ms(&p, "decode_ms", rq->decode_ms);
    pack_ms(&p, "prepare_ms", res->prepare_ms);
    pack_ms(&p, "queue_ms", t_start_ms - rq->t_prepared_ms);
    pack_ms(&p, "model_ms", res->model_ms);
    pack_ms(&p, "encode_ms", now - t_encode);
    pack_ms(&p, "prep_queue_ms", rq->t_prepared_ms - rq->t_complete_ms - rq->decode_ms - res->prepare_ms);
    pi0_pack_str(&p, "batch_size");
    pi0_pack_int(&p, batch_size);
    server_reply *r = p.failed ? NULL : calloc(1, sizeof *r);
    if (!r) {
        pi0_packer_free(&p);
        return reply_error(rq, "out of memory packing the reply");
    }
    r->conn_id = rq->conn_id;
    r->t_received_ms = rq->t_received_ms;
    r->data = p.data; /* the packer's buffer is plain malloc'd memory: the reply takes it */
    r->size = p.size;
    return r;
}

/* Decodes and prepares one request; NULL when it failed (its error reply posted) or was dropped. */
static server_request *prepare_request(server *s, server_request *r) {
    if (request_abandoned(r)) {
        atomic_fetch_add(&s->dropped, 1);
        request_done(s, r);
        return NULL;
    }
    pi0_observation obs = {0};
    pi0_error err = {0};
    char text[600];
    double t0 = pi0_now_ms();
    pi0_status st = pi0_observation_decode(r->message, r->message_size, &obs, &err);
    r->decode_ms = pi0_now_ms() - t0;
    if (st) snprintf(text, sizeof text, "bad request: %s", err.message);
    free(r->message), r->message = NULL;
    if (!st && (st = pi0_policy_prepare(s->policy, &obs, &r->prepared, &err))) snprintf(text, sizeof text, "%s", err.message);
    pi0_observation_free(&obs);
    r->t_prepared_ms = pi0_now_ms();
    if (!st) return r;
    server_reply *reply = reply_error(r, text); /* NULL: even the message found no memory; the client gets none */
    if (reply) post_replies(s, reply, reply);
    request_done(s, r);
    return NULL;
}

static void *prep_main(void *arg) {
    server *s = arg;
    for (server_request *r; (r = fifo_take(&s->prep));) {
        if ((r = prepare_request(s, r))) queue_push(&s->queue, r);
        else queue_expect(&s->queue, -1);
    }
    /* the FIFO is closed and empty: once every preparation thread is here, nothing more comes to the model */
    if (atomic_fetch_sub(&s->preppers_running, 1) == 1) queue_close(&s->queue);
    return NULL;
}

/* The requests of s->batch[0..n) whose connection is still there, moved to the front; returns how many. */
static int drop_abandoned(server *s, int n) {
    int live = 0;
    for (int i = 0; i < n; i++) {
        if (request_abandoned(s->batch[i])) {
            atomic_fetch_add(&s->dropped, 1);
            request_done(s, s->batch[i]);
        } else {
            s->batch[live++] = s->batch[i];
        }
    }
    return live;
}

static void *worker_main(void *arg) {
    server *s = arg;
    for (int taken; (taken = queue_take(&s->queue, s->opts.max_batch, s->opts.batch_wait_ms, s->batch));) {
        int n = drop_abandoned(s, taken);
        if (!n) continue;
        double t_start = pi0_now_ms();
        pi0_error err = {0};
        for (int i = 0; i < n; i++) {
            s->batch_prepared[i] = s->batch[i]->prepared;
            s->batch_seeds[i] = s->batch[i]->seed;
            s->results[i] = (pi0_policy_result){0};
        }
        /* A failure of the whole batch is in every result too: each client gets it. */
        pi0_policy_infer_prepared(s->policy, s->batch_prepared, s->batch_seeds, n, s->results, &err);
        server_reply *first = NULL, *last = NULL;
        for (int i = 0; i < n; i++) {
            server_reply *r = reply_make(s->batch[i], &s->results[i], n, t_start);
            if (r) { /* NULL only when even the error message found no memory: that client gets no answer */
                if (last) last->next = r;
                else first = r;
                last = r;
            }
            s->errors += s->results[i].error.status != PI0_OK;
            pi0_policy_result_free(&s->results[i]);
            request_done(s, s->batch[i]);
        }
        s->served += (uint64_t)n;
        s->batches++;
        if (n > s->largest_batch) s->largest_batch = n;
        post_replies(s, first, last);
    }
    atomic_store(&s->worker_done, 1);
    lws_cancel_service(s->ctx);
    return NULL;
}

/* ---- connections (network thread) ------------------------------------------------------------- */

/* Connected clients with nothing in the server: the ones a batch can still wait for. */
static int idle_clients(const server *s) {
    int n = 0;
    for (const conn *c = s->conns; c; c = c->next) n += !c->in_flight && !c->failed;
    return s->stopping ? 0 : n;
}

static void out_push(conn *c, out_msg *m) {
    m->next = NULL;
    if (c->out_tail) c->out_tail->next = m;
    else c->out_head = m;
    c->out_tail = m;
    lws_callback_on_writable(c->wsi);
}

static void out_free(out_msg *m) {
    if (!m->shared) free(m->data);
    free(m);
}

/* The message being received will not become a request: the batch queue stops counting on it. */
static void rx_uncount(server *s, conn *c) {
    if (!c->rx_counted) return;
    c->rx_counted = 0;
    queue_expect(&s->queue, -1);
}

static void rx_release(server *s, conn *c) {
    rx_uncount(s, c);
    free(c->rx);
    s->transit_bytes -= c->rx_cap;
    c->rx = NULL;
    c->rx_size = c->rx_cap = 0;
}

/* Ends a connection that cannot be told (or will not listen): the close handshake if it gets written, and
 * in any case the socket dropped within KILL_AFTER_S. */
static void conn_close_soon(conn *c, int code) {
    c->close_code = code;
    lws_callback_on_writable(c->wsi);
    lws_set_timeout(c->wsi, PENDING_TIMEOUT_USER_OK, KILL_AFTER_S);
}

/* Refuses the client's request: a text frame with the message, then close 1011 (openpi's behaviour). */
static void conn_fail(server *s, conn *c, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void conn_fail(server *s, conn *c, const char *fmt, ...) {
    if (c->failed) return;
    char text[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    server_log(s, "client %llu: error: %s", (unsigned long long)c->id, text);
    c->failed = 1;
    c->rx_skip = 1;
    rx_release(s, c);
    queue_set_idle(&s->queue, idle_clients(s));
    out_msg *m = calloc(1, sizeof *m);
    size_t len = strlen(text);
    if (m && (m->data = malloc(len + 1))) {
        memcpy(m->data, text, len + 1);
        m->size = len;
        m->text = 1;
        out_push(c, m);
    } else {
        free(m);
    }
    conn_close_soon(c, LWS_CLOSE_STATUS_UNEXPECTED_CONDITION);
}

static conn *conn_find(server *s, uint64_t id) {
    for (conn *c = s->conns; c; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

static void conn_established(server *s, conn *c, struct lws *wsi) {
    memset(c, 0, sizeof *c);
    c->wsi = wsi;
    c->id = ++s->next_conn_id;
    c->is_ws = 1;
    c->prev_total_ms = c->prev_send_ms = -1;
    c->last_active_ms = pi0_now_ms();
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->num_conns++;
    queue_set_idle(&s->queue, idle_clients(s));
    lws_get_peer_simple(wsi, c->peer, sizeof c->peer);
    server_log(s, "client %llu connected from %s (%d connected)", (unsigned long long)c->id, c->peer, s->num_conns);
    out_msg *m = calloc(1, sizeof *m);
    if (!m || !(c->token = conn_token_new())) {
        free(m);
        conn_fail(s, c, "out of memory");
        return;
    }
    m->data = s->metadata;
    m->size = s->metadata_size;
    m->shared = 1;
    out_push(c, m);
    if (s->stopping) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
}

/* Frees the requests of connections that have gone while they waited (for preparation or for the model),
 * so that their bytes go back to the queue budget at once. */
static void drop_abandoned_waiting(server *s) {
    int expected = 0;
    for (server_request *r = fifo_remove_abandoned(&s->prep), *next; r; r = next, expected++) {
        next = r->next;
        atomic_fetch_add(&s->dropped, 1);
        request_done(s, r);
    }
    if (expected) queue_expect(&s->queue, -expected);
    for (server_request *r = queue_remove_abandoned(&s->queue), *next; r; r = next) {
        next = r->next;
        atomic_fetch_add(&s->dropped, 1);
        request_done(s, r);
    }
}

static void conn_closed(server *s, conn *c) {
    if (!c->is_ws) return;
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->num_conns--;
    rx_release(s, c);
    while (c->out_head) {
        out_msg *m = c->out_head;
        c->out_head = m->next;
        out_free(m);
    }
    c->out_tail = NULL;
    c->is_ws = 0;
    if (c->token) atomic_store(&c->token->closed, 1); /* its requests still queued are dropped unrun */
    conn_token_release(c->token);
    c->token = NULL;
    if (c->in_flight) drop_abandoned_waiting(s);
    queue_set_idle(&s->queue, idle_clients(s));
    server_log(s, "client %llu disconnected after %llu requests%s (%d connected)", (unsigned long long)c->id,
               (unsigned long long)c->requests, c->in_flight ? ", its requests in flight dropped" : "", s->num_conns);
}

static uint64_t next_seed(server *s) {
    if (s->opts.has_seed) return s->opts.seed;
    return rng_mix64(s->seed_base + ++s->seed_count);
}

/* The whole message is in c->rx: it goes, with its buffer, to preparation. */
static void conn_request(server *s, conn *c) {
    if (s->stopping) { /* arrived after shutdown began: dropped with the connection */
        rx_uncount(s, c);
        return;
    }
    if (!c->rx_size) {
        conn_fail(s, c, "empty request: expected a msgpack map (the observation)");
        return;
    }
    size_t queued = atomic_load(&s->queued_bytes);
    if (c->rx_cap > s->opts.max_queue_bytes - (queued < s->opts.max_queue_bytes ? queued : s->opts.max_queue_bytes)) {
        conn_fail(s, c, "server busy: %zu MB of requests are waiting (its --max-queue-mb is %zu); try again later",
                  queued >> 20, s->opts.max_queue_bytes >> 20);
        return;
    }
    server_request *r = calloc(1, sizeof *r);
    if (!r) {
        conn_fail(s, c, "out of memory");
        return;
    }
    r->conn_id = c->id;
    r->token = conn_token_ref(c->token);
    r->message = c->rx, r->message_size = c->rx_size, r->bytes = c->rx_cap;
    atomic_fetch_add(&s->queued_bytes, r->bytes);
    s->transit_bytes -= c->rx_cap;
    c->rx = NULL, c->rx_size = c->rx_cap = 0;
    r->seed = next_seed(s);
    r->t_received_ms = c->rx_t0;
    r->t_complete_ms = pi0_now_ms();
    r->prev_total_ms = c->prev_total_ms;
    r->prev_send_ms = c->prev_send_ms;
    c->requests++;
    if (++c->in_flight >= MAX_IN_FLIGHT && !c->paused) {
        lws_rx_flow_control(c->wsi, 0);
        c->paused = 1;
    }
    queue_set_idle(&s->queue, idle_clients(s));
    c->rx_counted = 0; /* the batch queue has counted it on its way since its first byte (queue_arriving) */
    /* A robot's usual request (two or three camera frames) takes ~0.1 ms to decode and prepare, now that the
     * backend resizes the frames: less than waking a preparation thread costs, so it is done here. Larger ones
     * (float frames to convert, many cameras) go to the preparation threads, so that this loop keeps serving
     * the other clients; so does a connection's request while its earlier one is in the server (replies keep
     * their order). */
    if (r->message_size <= INLINE_PREPARE_BYTES && c->in_flight == 1) {
        if ((r = prepare_request(s, r))) queue_push(&s->queue, r);
        else queue_expect(&s->queue, -1);
        return;
    }
    fifo_push(&s->prep, r);
}

/* Grows the message buffer to hold `need` bytes (the frame announced `announced` in all), within the
 * transit budget (but up to RX_ALWAYS regardless). Grows by doubling with what arrives, not with what a
 * frame announces (beyond RX_FIRST_MAX): a peer that claims 60 MB and sends nothing costs little. */
static int rx_reserve(server *s, conn *c, size_t need, size_t announced) {
    if (need <= c->rx_cap) return 0;
    size_t cap = c->rx_cap ? c->rx_cap * 2 : announced < RX_FIRST_MAX ? announced : RX_FIRST_MAX;
    if (cap < RX_CHUNK) cap = RX_CHUNK;
    if (cap < need) cap = need;
    if (cap > s->opts.max_frame_bytes) cap = s->opts.max_frame_bytes;
    if (cap > RX_ALWAYS && s->transit_bytes + (cap - c->rx_cap) > s->opts.max_transit_bytes) {
        conn_fail(s, c, "server busy: %zu MB of requests are arriving (its --max-transit-mb is %zu); try again later",
                  s->transit_bytes >> 20, s->opts.max_transit_bytes >> 20);
        return -1;
    }
    uint8_t *rx = realloc(c->rx, cap);
    if (!rx) {
        conn_fail(s, c, "out of memory receiving a request of %zu bytes", announced);
        return -1;
    }
    s->transit_bytes += cap - c->rx_cap;
    c->rx = rx;
    c->rx_cap = cap;
    return 0;
}

/* Asks the kernel to acknowledge what this connection has received now, with the window our read just
 * opened. Linux treats a request/reply connection as interactive ("pingpong") and delays its ACKs, hoping to
 * carry them on a reply; a window update freed by a read is then held too unless it at least doubles the
 * window. A client whose request is larger than the window (a ~400 KB observation against ~3 segments of
 * 64 KB on loopback) waits for it: measured, 54-56 ms (the delayed-ACK timer) in 8 of 42,000 requests of a
 * 5-minute run, each after exactly 3 x 65,483 bytes. Setting TCP_QUICKACK leaves pingpong mode and sends a
 * pending ACK at once; Linux may go back to pingpong, so it is set after every part of a request that is
 * not its last (one setsockopt per 64 KB read). Failure (not a TCP socket) changes nothing. */
static void ack_now(struct lws *wsi) {
    int fd = (int)lws_get_socket_fd(wsi), one = 1;
    if (fd >= 0) (void)setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
}

/* Where a slow receive_ms went (the bytes were late, not this loop: note_late_tick says when it is the loop). */
static void note_slow_part(server *s, conn *c) {
    if (c->slow_logged_ms && c->last_active_ms - c->slow_logged_ms < SLOW_RX_LOG_EVERY_MS) {
        c->slow_unlogged++;
        return;
    }
    server_log(s, "client %llu: %.1f ms between two parts of a request (%zu bytes in so far; monotonic clock %.3f s; "
               "%llu more such pauses since the previous line)", (unsigned long long)c->id, c->last_active_ms - c->rx_last_ms,
               c->rx_size, c->last_active_ms / 1e3, (unsigned long long)c->slow_unlogged);
    c->slow_logged_ms = c->last_active_ms;
    c->slow_unlogged = 0;
}

static void conn_receive(server *s, conn *c, struct lws *wsi, const uint8_t *data, size_t len) {
    c->last_active_ms = pi0_now_ms();
    if (lws_is_first_fragment(wsi)) {
        c->rx_size = 0;
        c->rx_t0 = c->rx_last_ms = c->last_active_ms;
        c->rx_skip = c->failed || s->stopping;
        if (!c->rx_skip && !lws_frame_is_binary(wsi)) {
            conn_fail(s, c, "expected a binary frame (a msgpack observation), got a text frame");
            return;
        }
        if (!c->rx_skip) { /* a message that is not skipped reaches conn_request or rx_release, which uncount it */
            c->rx_counted = 1;
            queue_arriving(&s->queue);
        }
    }
    if (c->rx_skip) return;
    if (c->last_active_ms - c->rx_last_ms > SLOW_RX_GAP_MS) note_slow_part(s, c);
    c->rx_last_ms = c->last_active_ms;
    /* The rest of this frame is announced in its header: refuse an oversized request before buffering it. */
    size_t remaining = lws_remaining_packet_payload(wsi), max = s->opts.max_frame_bytes;
    if (len > max - c->rx_size || remaining > max - c->rx_size - len) {
        conn_fail(s, c, "request too large: more than %zu bytes (the server's --max-frame-mb)", max);
        return;
    }
    if (rx_reserve(s, c, c->rx_size + len, c->rx_size + len + remaining)) return;
    if (len) memcpy(c->rx + c->rx_size, data, len);
    c->rx_size += len;
    if (lws_is_final_fragment(wsi)) conn_request(s, c);
    else ack_now(wsi);
}

/* Writes one fragment of the first queued message; asks for another callback while more remains. */
static int conn_writeable(server *s, conn *c, struct lws *wsi) {
    out_msg *m = c->out_head;
    if (!m) {
        if (!c->close_code) return 0;
        static const char error_reason[] = "Internal server error. The error is in the previous frame.";
        static const char away_reason[] = "Server shutting down.";
        static const char idle_reason[] = "Idle timeout.";
        const char *reason = c->close_code == LWS_CLOSE_STATUS_UNEXPECTED_CONDITION ? error_reason
                             : s->stopping                                          ? away_reason
                                                                                    : idle_reason;
        lws_close_reason(wsi, (enum lws_close_status)c->close_code, (unsigned char *)reason, strlen(reason));
        return -1;
    }
    size_t chunk = m->size - m->sent < WRITE_CHUNK ? m->size - m->sent : WRITE_CHUNK;
    int flags = lws_write_ws_flags(m->text ? LWS_WRITE_TEXT : LWS_WRITE_BINARY, m->sent == 0, m->sent + chunk == m->size);
    if (chunk) memcpy(s->scratch + LWS_PRE, m->data + m->sent, chunk);
    if (lws_write(wsi, s->scratch + LWS_PRE, chunk, (enum lws_write_protocol)flags) < (int)chunk) {
        server_log(s, "client %llu: write failed, closing", (unsigned long long)c->id);
        return -1;
    }
    m->sent += chunk;
    c->last_active_ms = pi0_now_ms();
    if (m->sent == m->size) {
        c->out_head = m->next;
        if (!c->out_head) c->out_tail = NULL;
        if (m->is_reply) {
            c->in_flight--;
            c->prev_total_ms = c->last_active_ms - m->t_received_ms;
            c->prev_send_ms = c->last_active_ms - m->t_posted_ms;
            if (c->paused && c->in_flight < MAX_IN_FLIGHT && !c->failed) {
                lws_rx_flow_control(wsi, 1);
                c->paused = 0;
            }
            if (s->stopping && !c->in_flight && !c->close_code) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
            if (!c->in_flight) queue_answered(&s->queue, idle_clients(s));
        }
        out_free(m);
    }
    if (c->out_head || c->close_code) lws_callback_on_writable(wsi);
    return 0;
}

/* Hands the other threads' replies to their connections; those whose client has gone are dropped. */
static void deliver_replies(server *s) {
    server_reply *r = queue_take_replies(&s->queue);
    while (r) {
        server_reply *next = r->next;
        conn *c = conn_find(s, r->conn_id);
        out_msg *m = c && !c->failed ? calloc(1, sizeof *m) : NULL;
        if (m) {
            m->data = r->data;
            m->size = r->size;
            m->text = r->is_error;
            m->is_reply = 1;
            m->t_received_ms = r->t_received_ms;
            m->t_posted_ms = r->t_posted_ms;
            r->data = NULL;
            if (r->is_error) {
                server_log(s, "client %llu: error: %.*s", (unsigned long long)c->id, (int)m->size, (const char *)m->data);
                c->failed = c->rx_skip = 1;
                c->close_code = LWS_CLOSE_STATUS_UNEXPECTED_CONDITION;
            }
            out_push(c, m);
        } else if (c && !c->failed) {
            conn_fail(s, c, "out of memory");
        }
        server_reply_free(r);
        r = next;
    }
}

/* Closes connections past their request or idle timeout. */
static void check_timeouts(server *s) {
    double now = pi0_now_ms(), request_ms = s->opts.request_timeout_s * 1e3, idle_ms = s->opts.idle_timeout_s * 1e3;
    for (conn *c = s->conns; c; c = c->next) {
        if (c->failed || c->close_code) continue;
        if (c->rx_size && now - c->rx_t0 > request_ms) {
            conn_fail(s, c, "request not complete %.0f s after its first byte (the server's --request-timeout-s)",
                      s->opts.request_timeout_s);
        } else if (!c->rx_size && !c->in_flight && !c->out_head && now - c->last_active_ms > idle_ms) {
            server_log(s, "client %llu: idle for %.0f s, closing", (unsigned long long)c->id, s->opts.idle_timeout_s);
            conn_close_soon(c, LWS_CLOSE_STATUS_GOINGAWAY);
        }
    }
}

static void begin_stop(server *s) {
    s->stopping = 1;
    int in_flight = 0;
    for (conn *c = s->conns; c; c = c->next) {
        in_flight += c->in_flight;
        if (!c->in_flight && !c->close_code) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
        lws_callback_on_writable(c->wsi);
    }
    server_log(s, "shutting down: %d requests in flight, %d clients connected", in_flight, s->num_conns);
    fifo_close(&s->prep);
}

/* After each lws_service round and tick: start or advance the shutdown. */
static void check_stop(server *s) {
    if (*s->stop && !s->stopping) begin_stop(s);
    if (!s->stopping || !atomic_load(&s->worker_done)) return;
    deliver_replies(s); /* the worker's last replies were posted before it set worker_done */
    double now = pi0_now_ms();
    if (!s->close_deadline_ms) s->close_deadline_ms = now + CLOSE_GRACE_MS;
    if (!s->num_conns || now > s->close_deadline_ms) s->exit_loop = 1;
}

static void on_tick(lws_sorted_usec_list_t *sul);

/* Schedules the next tick. */
static void schedule_tick(server *s) {
    s->tick_due_ms = pi0_now_ms() + TICK_US / 1000.0;
    lws_sul_schedule(s->ctx, 0, &s->tick, on_tick, TICK_US);
}

/* A late tick means the event loop (which reads every client's requests) was held up: said in the log
 * with the longest of our callbacks since the previous tick, which tells our work from the rest (lws,
 * the kernel, another process). */
static void note_late_tick(server *s) {
    double now = pi0_now_ms(), late = now - s->tick_due_ms;
    if (late > LATE_TICK_MS) {
        s->late_ticks++;
        if (late > s->worst_late_ms) s->worst_late_ms = late;
        server_log(s, "event loop held up: its tick came %.1f ms late (longest callback since the last tick: %s, %.1f ms; "
                   "monotonic clock %.3f s)", late, s->longest_callback ? s->longest_callback : "none",
                   s->longest_callback_ms, now / 1e3);
    }
    s->longest_callback_ms = 0;
    s->longest_callback = NULL;
}

static void on_tick(lws_sorted_usec_list_t *sul) {
    server *s = lws_container_of(sul, server, tick);
    note_late_tick(s);
    check_stop(s);
    if (!s->stopping) check_timeouts(s);
    schedule_tick(s);
}

static int write_http(struct lws *wsi, conn *c) {
    uint8_t buf[LWS_PRE + 512], *start = buf + LWS_PRE, *p = start, *end = buf + sizeof buf - 1;
    size_t len = strlen(c->http_body);
    if (lws_add_http_common_headers(wsi, (unsigned)c->http_status, "text/plain", len, &p, end) ||
        lws_finalize_write_http_header(wsi, start, &p, end))
        return -1;
    lws_callback_on_writable(wsi);
    return 0;
}

/* A websocket upgrade is accepted only as RFC 6455 asks: HTTP/1.1 and Sec-WebSocket-Version 13
 * (libwebsockets 4.1 would take any version, and HTTP/1.0). */
static int upgrade_refused(struct lws *wsi) {
    char version[16] = "", http[16] = "";
    lws_hdr_copy(wsi, version, sizeof version, WSI_TOKEN_VERSION);
    lws_hdr_copy(wsi, http, sizeof http, WSI_TOKEN_HTTP);
    return strcmp(version, "13") != 0 || strcmp(http, "HTTP/1.1") != 0;
}

/* A peer's close code that RFC 6455 (7.4) allows on the wire: 1000-1003, 1007-1014, 3000-4999. */
static int close_code_valid(const uint8_t *payload, size_t len) {
    if (len == 0) return 1;
    if (len == 1) return 0;
    int code = payload[0] << 8 | payload[1];
    return (code >= 1000 && code <= 1003) || (code >= 1007 && code <= 1014) || (code >= 3000 && code <= 4999);
}

static int dispatch(server *s, struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len) {
    conn *c = user;
    switch (reason) {
    case LWS_CALLBACK_FILTER_NETWORK_CONNECTION: {
        /* Refused at accept (closed at once): past max_clients, or too close to the descriptor limit, where
         * a failing accept() would leave the listening socket readable and the event loop spinning. */
        int fd = (int)(intptr_t)in, refuse = s->stopping || s->num_conns >= s->opts.max_clients || fd >= s->fd_limit;
        s->refused_connections += refuse;
        return refuse;
    }
    case LWS_CALLBACK_FILTER_PROTOCOL_CONNECTION:
        return upgrade_refused(wsi);
    case LWS_CALLBACK_HTTP: {
        /* Not an upgrade: openpi's server answers GET /healthz, and websockets' 426 to anything else. */
        int health = in && !strcmp((const char *)in, "/healthz");
        c->http_status = health ? HTTP_STATUS_OK : 426;
        c->http_body = health ? "OK\n" : "Failed to open a WebSocket connection: this is openpi's websocket "
                                         "policy server (GET /healthz answers OK).\n";
        return write_http(wsi, c);
    }
    case LWS_CALLBACK_HTTP_WRITEABLE: {
        if (!c->http_body) return -1;
        size_t n = strlen(c->http_body);
        uint8_t buf[LWS_PRE + 256];
        memcpy(buf + LWS_PRE, c->http_body, n);
        if (lws_write(wsi, buf + LWS_PRE, n, LWS_WRITE_HTTP_FINAL) != (int)n) return -1;
        int keep = c->http_status == HTTP_STATUS_OK;
        c->http_body = NULL;
        return !keep || lws_http_transaction_completed(wsi) ? -1 : 0;
    }
    case LWS_CALLBACK_ESTABLISHED:
        conn_established(s, c, wsi);
        return 0;
    case LWS_CALLBACK_RECEIVE:
        if (c && c->is_ws) conn_receive(s, c, wsi, in, len);
        return 0;
    case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
        return !close_code_valid(in, len); /* 0: lws echoes the close; else it just drops the connection */
    case LWS_CALLBACK_SERVER_WRITEABLE:
        return c && c->is_ws ? conn_writeable(s, c, wsi) : 0;
    case LWS_CALLBACK_CLOSED:
        if (c) conn_closed(s, c);
        return 0;
    case LWS_CALLBACK_EVENT_WAIT_CANCELLED:
        deliver_replies(s);
        check_stop(s);
        return 0;
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}

/* What a callback was doing, for the held-up loop's log line. */
static const char *callback_name(enum lws_callback_reasons reason) {
    switch (reason) {
    case LWS_CALLBACK_RECEIVE: return "receive (with an inline preparation)";
    case LWS_CALLBACK_SERVER_WRITEABLE: return "write";
    case LWS_CALLBACK_EVENT_WAIT_CANCELLED: return "deliver replies";
    case LWS_CALLBACK_ESTABLISHED: return "connect";
    case LWS_CALLBACK_CLOSED: return "close";
    default: return "other";
    }
}

/* Every callback is timed (two clock reads): the longest since the last tick goes into note_late_tick's line. */
static int callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len) {
    server *s = wsi ? lws_context_user(lws_get_context(wsi)) : NULL;
    if (!s) return lws_callback_http_dummy(wsi, reason, user, in, len);
    double t0 = pi0_now_ms();
    int rc = dispatch(s, wsi, reason, user, in, len);
    double ms = pi0_now_ms() - t0;
    if (ms > s->longest_callback_ms) {
        s->longest_callback_ms = ms;
        s->longest_callback = callback_name(reason);
    }
    return rc;
}

/* ---- set-up --------------------------------------------------------------------------------------- */

static void pack_int_pair(pi0_packer *p, const char *key, int64_t value) {
    pi0_pack_str(p, key);
    pi0_pack_int(p, value);
}

static pi0_status pack_metadata(server *s, pi0_error *err) {
    const pi0_model *m = pi0_policy_model(s->policy);
    const pi0_server_options *o = &s->opts;
    pi0_packer p = {0};
    pi0_pack_map(&p, 10);
    pi0_pack_str(&p, "engine");
    pi0_pack_str(&p, "pi0");
    pi0_pack_str(&p, "model");
    pi0_pack_str(&p, pi0_model_kind_name(pi0_model_dims(m)->kind));
    pi0_pack_str(&p, "adapter");
    pi0_pack_str(&p, pi0_policy_adapter_name(s->policy));
    pack_int_pair(&p, "action_horizon", pi0_policy_horizon(s->policy));
    pack_int_pair(&p, "action_dims", pi0_policy_action_dims(s->policy));
    pack_int_pair(&p, "action_dim", pi0_model_dims(m)->action_dim);
    pi0_pack_str(&p, "backend");
    pi0_pack_str(&p, pi0_backend_name(pi0_model_backend(m)));
    pack_int_pair(&p, "max_batch", o->max_batch);
    pack_ms(&p, "batch_wait_ms", o->batch_wait_ms);
    pi0_pack_str(&p, "limits");
    pi0_pack_map(&p, 7);
    pack_int_pair(&p, "max_frame_bytes", (int64_t)o->max_frame_bytes);
    pack_int_pair(&p, "max_transit_bytes", (int64_t)o->max_transit_bytes);
    pack_int_pair(&p, "max_queue_bytes", (int64_t)o->max_queue_bytes);
    pack_ms(&p, "request_timeout_s", o->request_timeout_s);
    pack_ms(&p, "idle_timeout_s", o->idle_timeout_s);
    pack_int_pair(&p, "max_clients", o->max_clients);
    pack_int_pair(&p, "max_in_flight_per_client", MAX_IN_FLIGHT);
    if (p.failed || !(s->metadata = malloc(p.size))) {
        pi0_packer_free(&p);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory packing the server metadata");
    }
    memcpy(s->metadata, p.data, p.size);
    s->metadata_size = p.size;
    pi0_packer_free(&p);
    return PI0_OK;
}

static uint64_t fresh_seed_base(void) {
    uint64_t v;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v) return v;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return rng_mix64((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ (uint64_t)getpid();
}

/* The options checked, with their 0s replaced by the defaults. */
static pi0_status resolve_options(const pi0_server_options *in, pi0_server_options *o, pi0_error *err) {
    *o = *in;
    if (o->max_batch < 1 || o->max_batch > PI0_MAX_BATCH)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "max_batch %d is outside 1..%d", o->max_batch, PI0_MAX_BATCH);
    if (!(o->batch_wait_ms >= 0 && o->batch_wait_ms <= 60000))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch_wait_ms %g is outside 0..60000", o->batch_wait_ms);
    if (o->port < 0 || o->port > 65535)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "port %d is outside 0..65535", o->port);
    if (!(o->request_timeout_s >= 0 && o->idle_timeout_s >= 0 && o->request_timeout_s <= 1e6 && o->idle_timeout_s <= 1e9))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "request_timeout_s %g or idle_timeout_s %g is negative or too large",
                        o->request_timeout_s, o->idle_timeout_s);
    if (o->max_clients < 0 || o->prep_threads < 0 || o->prep_threads > MAX_PREP_THREADS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "max_clients %d is negative or prep_threads %d outside 0..%d",
                        o->max_clients, o->prep_threads, MAX_PREP_THREADS);
    if (!o->max_frame_bytes) o->max_frame_bytes = DEFAULT_MAX_FRAME;
    if (!o->max_transit_bytes) o->max_transit_bytes = DEFAULT_MAX_TRANSIT;
    if (!o->max_queue_bytes) o->max_queue_bytes = DEFAULT_MAX_QUEUE;
    if (!o->request_timeout_s) o->request_timeout_s = DEFAULT_REQUEST_TIMEOUT_S;
    if (!o->idle_timeout_s) o->idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S;
    if (!o->max_clients) o->max_clients = DEFAULT_MAX_CLIENTS;
    if (!o->prep_threads) o->prep_threads = DEFAULT_PREP_THREADS;
    return PI0_OK;
}

/* Raises the soft descriptor limit to the hard one and returns the highest descriptor a connection may
 * take: FD_HEADROOM below the limit. */
static int descriptor_ceiling(void) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r)) return 1024 - FD_HEADROOM;
    if (r.rlim_cur < r.rlim_max) {
        struct rlimit raised = {r.rlim_max, r.rlim_max};
        if (!setrlimit(RLIMIT_NOFILE, &raised)) r = raised;
    }
    rlim_t limit = r.rlim_cur == RLIM_INFINITY || r.rlim_cur > (1 << 20) ? (1 << 20) : r.rlim_cur;
    return (int)limit - FD_HEADROOM;
}

static const struct lws_protocols protocols[] = {
    /* The first protocol serves plain HTTP and every websocket that asks for no sub-protocol (openpi's
     * client asks for none) on any path. No extensions are offered, so no permessage-deflate. */
    {"openpi", callback, sizeof(conn), RX_CHUNK, 0, NULL, 0},
    {NULL, NULL, 0, 0, 0, NULL, 0},
};

/* The threads run with every signal blocked, so SIGINT/SIGTERM interrupt the event loop's poll (or an
 * OpenMP thread's sleep; the tick notices those within TICK_US). */
static int start_thread(pthread_t *t, void *(*fn)(void *), server *s) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(t, NULL, fn, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

static pi0_status listen_on(server *s, int *port, pi0_error *err) {
    const char *host = s->opts.host && *s->opts.host ? s->opts.host : "127.0.0.1";
    int any = !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "*");
    struct lws_context_creation_info info;
    memset(&info, 0, sizeof info);
    info.port = s->opts.port;
    info.iface = any ? NULL : !strcmp(host, "localhost") ? "127.0.0.1" : host;
    info.protocols = protocols;
    info.gid = -1;
    info.uid = -1;
    info.user = s;
    info.pt_serv_buf_size = 256 * 1024;
    info.options = LWS_SERVER_OPTION_FAIL_UPON_UNABLE_TO_BIND | (strchr(host, ':') ? 0 : LWS_SERVER_OPTION_DISABLE_IPV6);
    lws_set_log_level(0, NULL); /* the library prints nothing; failures come back through err */
    if (!(s->ctx = lws_create_context(&info)))
        return pi0_fail(err, PI0_ERR_IO, "could not listen on %s:%d (address in use, or not an address of this machine?)",
                        host, s->opts.port);
    struct lws_vhost *vh = lws_get_vhost_by_name(s->ctx, "default");
    *port = vh ? lws_get_vhost_listen_port(vh) : s->opts.port;
    if (*port <= 0) return pi0_fail(err, PI0_ERR_IO, "could not listen on %s:%d", host, s->opts.port);
    return PI0_OK;
}

static void log_summary(server *s) {
    if (s->late_ticks)
        server_log(s, "the event loop was held up %llu times (a tick over %d ms late; the worst %.1f ms)",
                   (unsigned long long)s->late_ticks, LATE_TICK_MS, s->worst_late_ms);
    if (!s->served && !s->errors && !atomic_load(&s->dropped) && !s->refused_connections) return;
    server_log(s, "served %llu requests in %llu batches (mean batch %.2f, largest %d), %llu refused by the policy, "
               "%llu dropped (client gone), %llu connections refused at accept",
               (unsigned long long)s->served, (unsigned long long)s->batches,
               s->batches ? (double)s->served / (double)s->batches : 0.0, s->largest_batch,
               (unsigned long long)s->errors, (unsigned long long)atomic_load(&s->dropped),
               (unsigned long long)s->refused_connections);
}

pi0_status pi0_server_run(pi0_policy *policy, const pi0_server_options *opts, volatile sig_atomic_t *stop,
                          pi0_error *err) {
    if (!policy || !opts || !stop) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_server_run: NULL argument");
    server *s = calloc(1, sizeof *s);
    if (!s) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    pi0_status st = resolve_options(opts, &s->opts, err);
    if (st) {
        free(s);
        return st;
    }
    s->policy = policy;
    s->stop = stop;
    s->seed_base = fresh_seed_base();
    s->fd_limit = descriptor_ceiling();
    atomic_init(&s->worker_done, 0);
    atomic_init(&s->queued_bytes, 0);
    atomic_init(&s->dropped, 0);
    atomic_init(&s->preppers_running, s->opts.prep_threads);
    int fifo_ok = 0, queue_ok = 0, worker_started = 0, port = 0;
    size_t max = (size_t)s->opts.max_batch;
    s->batch = calloc(max, sizeof *s->batch);
    s->batch_prepared = calloc(max, sizeof *s->batch_prepared);
    s->batch_seeds = calloc(max, sizeof *s->batch_seeds);
    s->results = calloc(max, sizeof *s->results);
    if (!(s->scratch = malloc(LWS_PRE + WRITE_CHUNK)) || !s->batch || !s->batch_prepared || !s->batch_seeds ||
        !s->results) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
        goto done;
    }
    if ((st = pack_metadata(s, err))) goto done;
    if (!(fifo_ok = !fifo_init(&s->prep)) || !(queue_ok = !queue_init(&s->queue))) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "could not create the request queues");
        goto done;
    }
    if ((st = listen_on(s, &port, err))) goto done;
    if (start_thread(&s->worker, worker_main, s)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "could not start the inference thread");
        goto done;
    }
    worker_started = 1;
    for (; s->num_preppers < s->opts.prep_threads; s->num_preppers++)
        if (start_thread(&s->preppers[s->num_preppers], prep_main, s)) {
            st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "could not start the preparation threads");
            goto done;
        }

    schedule_tick(s);
    if (s->opts.on_listen) s->opts.on_listen(s->opts.user, port);
    while (!s->exit_loop) {
        if (lws_service(s->ctx, 0) < 0) {
            st = pi0_fail(err, PI0_ERR_IO, "the network event loop failed");
            break;
        }
    }

done:
    /* preparation first: what it still pushes, the worker runs (or drops) before it stops */
    if (fifo_ok) fifo_close(&s->prep);
    for (int i = 0; i < s->num_preppers; i++) pthread_join(s->preppers[i], NULL);
    if (worker_started) {
        queue_close(&s->queue);
        pthread_join(s->worker, NULL);
        log_summary(s);
    }
    if (s->ctx) {
        lws_sul_cancel(&s->tick);
        lws_context_destroy(s->ctx); /* closes what is left: LWS_CALLBACK_CLOSED frees each connection */
    }
    if (queue_ok) queue_destroy(&s->queue);
    if (fifo_ok) fifo_destroy(&s->prep);
    free(s->metadata);
    free(s->scratch);
    free(s->batch), free(s->batch_prepared), free(s->batch_seeds), free(s->results);
    free(s);
    return st;
}
