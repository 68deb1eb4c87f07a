/*
 * server.c - the openpi websocket policy server on libwebsockets (see server.h).
 *
 * Threads: the caller's thread runs the lws event loop (every callback below, every connection's state);
 * one worker thread owns the policy (worker_main). They share only the queue (server/queue.h): requests
 * carry a connection id, replies come back with it, and the network thread looks the id up among the live
 * connections when it delivers, so a client that left while its request ran just loses its reply.
 *
 * Per connection: at most MAX_IN_FLIGHT requests are queued; beyond that the connection stops being read
 * (lws_rx_flow_control) until a reply is written, so a pipelining client cannot queue without bound. A
 * message is reassembled from its frames into one buffer no larger than max_frame_bytes: the size of the
 * frame being read is known from its header, so an oversized request is refused at its first bytes.
 */
#include "server/server.h"

#include <libwebsockets.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "server/msgpack_numpy.h"
#include "server/queue.h"
#include "util/clock.h"
#include "util/error.h"
#include "util/rng.h"

enum {
    WRITE_CHUNK = 256 * 1024,        /* bytes per outgoing websocket fragment */
    RX_CHUNK = 64 * 1024,            /* lws's per-connection receive buffer */
    KEEP_RX_BYTES = 8 * 1024 * 1024, /* a connection keeps a receive buffer up to this size between requests */
    MAX_IN_FLIGHT = 2,               /* queued requests per connection before it stops being read */
    TICK_US = 50 * 1000,             /* how often the event loop looks at *stop */
    CLOSE_GRACE_MS = 2000,           /* at shutdown, time for connections to finish their close handshake */
};

typedef struct out_msg {
    struct out_msg *next;
    uint8_t *data; /* owned unless `shared` */
    size_t size, sent;
    int text;      /* an error message: the connection closes with 1011 after it */
    int shared;    /* the server's metadata */
    int is_reply;  /* answers a request (in_flight counts it) */
    double t_received_ms;
} out_msg;

/* Per-session data: lws allocates it zeroed for every connection, HTTP or websocket, and frees it after
 * LWS_CALLBACK_CLOSED. Only the network thread touches it. */
typedef struct conn {
    struct conn *prev, *next; /* the server's live websocket connections */
    struct lws *wsi;
    uint64_t id;              /* never reused */
    int is_ws;                /* established (plain HTTP requests share this struct) */
    uint8_t *rx;              /* the message being reassembled */
    size_t rx_size, rx_cap;
    int rx_skip;              /* dropping the rest of the current message */
    double rx_t0;             /* its first byte */
    int in_flight;            /* requests queued whose reply is not written yet */
    int paused;               /* reading stopped (lws_rx_flow_control) */
    double prev_total_ms;     /* < 0: no request answered yet */
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
    pi0_server_options opts;
    size_t max_frame;
    volatile sig_atomic_t *stop;
    struct lws_context *ctx;
    lws_sorted_usec_list_t tick;
    server_queue queue;
    pthread_t worker;
    atomic_int worker_done;
    uint8_t *metadata;
    size_t metadata_size;
    uint8_t *scratch; /* LWS_PRE + WRITE_CHUNK: each outgoing fragment is copied here behind lws's headroom */
    /* network thread */
    conn *conns;
    int num_conns;
    uint64_t next_conn_id, seed_base, seed_count;
    int stopping, exit_loop;
    double close_deadline_ms; /* set once the worker has finished: connections get until then to close */
    /* worker thread (the counters are read by the network thread after joining it) */
    server_request **batch;                /* max_batch each */
    const pi0_observation **batch_obs;
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

/* ---- the inference thread ------------------------------------------------------------------------ */

static server_reply *reply_error(uint64_t conn_id, const char *message) {
    server_reply *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->conn_id = conn_id;
    r->is_error = 1;
    r->size = strlen(message);
    if (!(r->data = malloc(r->size + 1))) {
        free(r);
        return NULL;
    }
    memcpy(r->data, message, r->size + 1);
    return r;
}

/* openpi's reply: {"actions": float64 (H, dims), "policy_timing": {...}, "server_timing": {...}}. */
static server_reply *reply_make(const server_request *rq, const pi0_policy_result *res, int batch_size,
                                double policy_ms, double t_start_ms) {
    if (res->error.status) return reply_error(rq->conn_id, res->error.message);
    pi0_packer p = {0};
    double now = pi0_now_ms();
    pi0_pack_policy_reply(&p, res, policy_ms, 1);
    pi0_pack_str(&p, "server_timing");
    pi0_pack_map(&p, rq->prev_total_ms >= 0 ? 4 : 3);
    pi0_pack_str(&p, "infer_ms");
    pi0_pack_double(&p, now - rq->t_queued_ms);
    if (rq->prev_total_ms >= 0) {
        pi0_pack_str(&p, "prev_total_ms");
        pi0_pack_double(&p, rq->prev_total_ms);
    }
    pi0_pack_str(&p, "batch_size");
    pi0_pack_int(&p, batch_size);
    pi0_pack_str(&p, "queue_ms");
    pi0_pack_double(&p, t_start_ms - rq->t_queued_ms);
    server_reply *r = p.failed ? NULL : calloc(1, sizeof *r);
    if (!r) {
        pi0_packer_free(&p);
        return reply_error(rq->conn_id, "out of memory packing the reply");
    }
    r->conn_id = rq->conn_id;
    r->data = p.data; /* the packer's buffer is plain malloc'd memory: the reply takes it */
    r->size = p.size;
    return r;
}

static void *worker_main(void *arg) {
    server *s = arg;
    for (;;) {
        int n = queue_take(&s->queue, s->opts.max_batch, s->opts.batch_wait_ms, s->batch);
        if (!n) break;
        double t_start = pi0_now_ms(), policy_ms = 0;
        pi0_error err = {0};
        for (int i = 0; i < n; i++) {
            s->batch_obs[i] = &s->batch[i]->obs;
            s->batch_seeds[i] = s->batch[i]->seed;
            s->results[i] = (pi0_policy_result){0};
        }
        /* A failure of the whole batch is in every result too: each client gets it. */
        pi0_policy_infer(s->policy, s->batch_obs, s->batch_seeds, n, s->results, &policy_ms, &err);
        server_reply *first = NULL, *last = NULL;
        for (int i = 0; i < n; i++) {
            server_reply *r = reply_make(s->batch[i], &s->results[i], n, policy_ms, t_start);
            if (r) { /* NULL only when even the error message found no memory: that client gets no answer */
                r->t_received_ms = s->batch[i]->t_received_ms;
                if (last) last->next = r;
                else first = r;
                last = r;
            }
            s->errors += s->results[i].error.status != PI0_OK;
            pi0_policy_result_free(&s->results[i]);
            server_request_free(s->batch[i]);
        }
        s->served += (uint64_t)n;
        s->batches++;
        if (n > s->largest_batch) s->largest_batch = n;
        queue_post_replies(&s->queue, first, last);
        lws_cancel_service(s->ctx);
    }
    atomic_store(&s->worker_done, 1);
    lws_cancel_service(s->ctx);
    return NULL;
}

/* ---- connections (network thread) ------------------------------------------------------------- */

/* Connected clients with nothing queued: the ones a batch can still wait for. */
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

static void rx_release(conn *c) {
    free(c->rx);
    c->rx = NULL;
    c->rx_size = c->rx_cap = 0;
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
    c->close_code = LWS_CLOSE_STATUS_UNEXPECTED_CONDITION;
    rx_release(c);
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
        lws_callback_on_writable(c->wsi); /* close without the message */
    }
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
    c->prev_total_ms = -1;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->num_conns++;
    queue_set_idle(&s->queue, idle_clients(s));
    lws_get_peer_simple(wsi, c->peer, sizeof c->peer);
    server_log(s, "client %llu connected from %s (%d connected)", (unsigned long long)c->id, c->peer, s->num_conns);
    out_msg *m = calloc(1, sizeof *m);
    if (!m) {
        conn_fail(s, c, "out of memory");
        return;
    }
    m->data = s->metadata;
    m->size = s->metadata_size;
    m->shared = 1;
    out_push(c, m);
    if (s->stopping) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
}

static void conn_closed(server *s, conn *c) {
    if (!c->is_ws) return;
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->num_conns--;
    rx_release(c);
    while (c->out_head) {
        out_msg *m = c->out_head;
        c->out_head = m->next;
        out_free(m);
    }
    c->out_tail = NULL;
    c->is_ws = 0;
    queue_set_idle(&s->queue, idle_clients(s));
    server_log(s, "client %llu disconnected after %llu requests%s (%d connected)", (unsigned long long)c->id,
               (unsigned long long)c->requests, c->in_flight ? ", its reply dropped" : "", s->num_conns);
}

static uint64_t next_seed(server *s) {
    if (s->opts.has_seed) return s->opts.seed;
    return rng_mix64(s->seed_base + ++s->seed_count);
}

/* The whole message is in c->rx: decode it and queue it for the worker. */
static void conn_request(server *s, conn *c) {
    if (s->stopping) return; /* arrived after shutdown began: dropped with the connection */
    if (!c->rx_size) {
        conn_fail(s, c, "empty request: expected a msgpack map (the observation)");
        return;
    }
    server_request *r = calloc(1, sizeof *r);
    if (!r) {
        conn_fail(s, c, "out of memory");
        return;
    }
    pi0_error err = {0};
    if (pi0_observation_decode(c->rx, c->rx_size, &r->obs, &err)) {
        free(r);
        conn_fail(s, c, "bad request: %s", err.message);
        return;
    }
    if (c->rx_cap > KEEP_RX_BYTES) rx_release(c);
    c->rx_size = 0;
    r->conn_id = c->id;
    r->seed = next_seed(s);
    r->t_received_ms = c->rx_t0;
    r->t_queued_ms = pi0_now_ms();
    r->prev_total_ms = c->prev_total_ms;
    c->requests++;
    if (++c->in_flight >= MAX_IN_FLIGHT && !c->paused) {
        lws_rx_flow_control(c->wsi, 0);
        c->paused = 1;
    }
    queue_push(&s->queue, r, idle_clients(s));
}

static void conn_receive(server *s, conn *c, struct lws *wsi, const uint8_t *data, size_t len) {
    if (lws_is_first_fragment(wsi)) {
        c->rx_size = 0;
        c->rx_t0 = pi0_now_ms();
        c->rx_skip = c->failed || s->stopping;
        if (!c->rx_skip && !lws_frame_is_binary(wsi)) {
            conn_fail(s, c, "expected a binary frame (a msgpack observation), got a text frame");
            return;
        }
    }
    if (c->rx_skip) return;
    /* The rest of this frame is announced in its header: refuse an oversized request before buffering it. */
    size_t remaining = lws_remaining_packet_payload(wsi), max = s->max_frame;
    if (len > max - c->rx_size || remaining > max - c->rx_size - len) {
        conn_fail(s, c, "request too large: more than %zu bytes (the server's --max-frame-mb)", max);
        return;
    }
    /* Grow by doubling with what arrives, not with what a frame announces: a peer that claims 60 MB and
     * sends nothing costs nothing, and many small fragments cost amortized O(1) copies per byte. */
    size_t need = c->rx_size + len;
    if (need > c->rx_cap) {
        size_t cap = c->rx_cap * 2 > RX_CHUNK ? c->rx_cap * 2 : RX_CHUNK;
        if (cap < need) cap = need;
        if (cap > max) cap = max;
        uint8_t *rx = realloc(c->rx, cap);
        if (!rx) {
            conn_fail(s, c, "out of memory receiving a request of %zu bytes", need + remaining);
            return;
        }
        c->rx = rx;
        c->rx_cap = cap;
    }
    if (len) memcpy(c->rx + c->rx_size, data, len);
    c->rx_size += len;
    if (lws_is_final_fragment(wsi)) conn_request(s, c);
}

/* Writes one fragment of the first queued message; asks for another callback while more remains. */
static int conn_writeable(server *s, conn *c, struct lws *wsi) {
    out_msg *m = c->out_head;
    if (!m) {
        if (!c->close_code) return 0;
        static const char error_reason[] = "Internal server error. The error is in the previous frame.";
        static const char away_reason[] = "Server shutting down.";
        const char *reason = c->close_code == LWS_CLOSE_STATUS_GOINGAWAY ? away_reason : error_reason;
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
    if (m->sent == m->size) {
        c->out_head = m->next;
        if (!c->out_head) c->out_tail = NULL;
        if (m->is_reply) {
            c->in_flight--;
            c->prev_total_ms = pi0_now_ms() - m->t_received_ms;
            if (c->paused && c->in_flight < MAX_IN_FLIGHT && !c->failed) {
                lws_rx_flow_control(wsi, 1);
                c->paused = 0;
            }
            if (s->stopping && !c->in_flight && !c->close_code) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
            if (!c->in_flight) queue_set_idle(&s->queue, idle_clients(s));
        }
        out_free(m);
    }
    if (c->out_head || c->close_code) lws_callback_on_writable(wsi);
    return 0;
}

/* Hands the worker's replies to their connections; those whose client has gone are dropped. */
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

static void begin_stop(server *s) {
    s->stopping = 1;
    int in_flight = 0;
    for (conn *c = s->conns; c; c = c->next) {
        in_flight += c->in_flight;
        if (!c->in_flight && !c->close_code) c->close_code = LWS_CLOSE_STATUS_GOINGAWAY;
        lws_callback_on_writable(c->wsi);
    }
    server_log(s, "shutting down: %d requests in flight, %d clients connected", in_flight, s->num_conns);
    queue_close(&s->queue);
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

static void on_tick(lws_sorted_usec_list_t *sul) {
    server *s = lws_container_of(sul, server, tick);
    check_stop(s);
    lws_sul_schedule(s->ctx, 0, &s->tick, on_tick, TICK_US);
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

static int callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len) {
    server *s = wsi ? lws_context_user(lws_get_context(wsi)) : NULL;
    conn *c = user;
    if (!s) return lws_callback_http_dummy(wsi, reason, user, in, len);
    switch (reason) {
    case LWS_CALLBACK_FILTER_NETWORK_CONNECTION:
        return s->stopping; /* refuse new connections once shutting down */
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

/* ---- set-up --------------------------------------------------------------------------------------- */

static pi0_status pack_metadata(server *s, pi0_error *err) {
    const pi0_model *m = pi0_policy_model(s->policy);
    pi0_packer p = {0};
    pi0_pack_map(&p, 9);
    pi0_pack_str(&p, "engine");
    pi0_pack_str(&p, "pi0");
    pi0_pack_str(&p, "model");
    pi0_pack_str(&p, pi0_model_kind_name(pi0_model_dims(m)->kind));
    pi0_pack_str(&p, "adapter");
    pi0_pack_str(&p, pi0_policy_adapter_name(s->policy));
    pi0_pack_str(&p, "action_horizon");
    pi0_pack_int(&p, pi0_policy_horizon(s->policy));
    pi0_pack_str(&p, "action_dims");
    pi0_pack_int(&p, pi0_policy_action_dims(s->policy));
    pi0_pack_str(&p, "action_dim");
    pi0_pack_int(&p, pi0_model_dims(m)->action_dim);
    pi0_pack_str(&p, "backend");
    pi0_pack_str(&p, pi0_backend_name(pi0_model_backend(m)));
    pi0_pack_str(&p, "max_batch");
    pi0_pack_int(&p, s->opts.max_batch);
    pi0_pack_str(&p, "batch_wait_ms");
    pi0_pack_double(&p, s->opts.batch_wait_ms);
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

static const struct lws_protocols protocols[] = {
    /* The first protocol serves plain HTTP and every websocket that asks for no sub-protocol (openpi's
     * client asks for none) on any path. No extensions are offered, so no permessage-deflate. */
    {"openpi", callback, sizeof(conn), RX_CHUNK, 0, NULL, 0},
    {NULL, NULL, 0, 0, 0, NULL, 0},
};

pi0_status pi0_server_run(pi0_policy *policy, const pi0_server_options *opts, volatile sig_atomic_t *stop,
                          pi0_error *err) {
    if (!policy || !opts || !stop) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_server_run: NULL argument");
    if (opts->max_batch < 1 || opts->max_batch > 64)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "max_batch %d is outside 1..64", opts->max_batch);
    if (!(opts->batch_wait_ms >= 0 && opts->batch_wait_ms <= 60000))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch_wait_ms %g is outside 0..60000", opts->batch_wait_ms);
    if (opts->port < 0 || opts->port > 65535)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "port %d is outside 0..65535", opts->port);

    server *s = calloc(1, sizeof *s);
    if (!s) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    s->policy = policy;
    s->opts = *opts;
    s->stop = stop;
    s->max_frame = opts->max_frame_bytes ? opts->max_frame_bytes : (size_t)64 << 20;
    s->seed_base = fresh_seed_base();
    atomic_init(&s->worker_done, 0);
    pi0_status st = PI0_OK;
    int queue_ok = 0, worker_started = 0;
    size_t max = (size_t)opts->max_batch;
    s->batch = calloc(max, sizeof *s->batch);
    s->batch_obs = calloc(max, sizeof *s->batch_obs);
    s->batch_seeds = calloc(max, sizeof *s->batch_seeds);
    s->results = calloc(max, sizeof *s->results);
    if (!(s->scratch = malloc(LWS_PRE + WRITE_CHUNK)) || !s->batch || !s->batch_obs || !s->batch_seeds || !s->results) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
        goto done;
    }
    if ((st = pack_metadata(s, err))) goto done;
    if (queue_init(&s->queue)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "could not create the request queue");
        goto done;
    }
    queue_ok = 1;

    const char *host = opts->host && *opts->host ? opts->host : "127.0.0.1";
    int any = !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "*");
    struct lws_context_creation_info info;
    memset(&info, 0, sizeof info);
    info.port = opts->port;
    info.iface = any ? NULL : !strcmp(host, "localhost") ? "127.0.0.1" : host;
    info.protocols = protocols;
    info.gid = -1;
    info.uid = -1;
    info.user = s;
    info.pt_serv_buf_size = 256 * 1024;
    info.options = LWS_SERVER_OPTION_FAIL_UPON_UNABLE_TO_BIND | (strchr(host, ':') ? 0 : LWS_SERVER_OPTION_DISABLE_IPV6);
    lws_set_log_level(0, NULL); /* the library prints nothing; failures come back through err */
    if (!(s->ctx = lws_create_context(&info))) {
        st = pi0_fail(err, PI0_ERR_IO, "could not listen on %s:%d (address in use, or not an address of this machine?)",
                      host, opts->port);
        goto done;
    }
    struct lws_vhost *vh = lws_get_vhost_by_name(s->ctx, "default");
    int port = vh ? lws_get_vhost_listen_port(vh) : opts->port;
    if (port <= 0) {
        st = pi0_fail(err, PI0_ERR_IO, "could not listen on %s:%d", host, opts->port);
        goto done;
    }

    /* The worker runs with every signal blocked, so SIGINT/SIGTERM interrupt the event loop's poll (or
     * an OpenMP thread's sleep; the tick notices those within TICK_US). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&s->worker, NULL, worker_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "could not start the inference thread");
        goto done;
    }
    worker_started = 1;

    lws_sul_schedule(s->ctx, 0, &s->tick, on_tick, TICK_US);
    if (opts->on_listen) opts->on_listen(opts->user, port);
    while (!s->exit_loop) {
        if (lws_service(s->ctx, 0) < 0) {
            st = pi0_fail(err, PI0_ERR_IO, "the network event loop failed");
            break;
        }
    }

done:
    if (worker_started) {
        queue_close(&s->queue);
        pthread_join(s->worker, NULL);
        if (s->served || s->errors)
            server_log(s, "served %llu requests in %llu batches (mean batch %.2f, largest %d), %llu refused by the policy",
                       (unsigned long long)s->served, (unsigned long long)s->batches,
                       s->batches ? (double)s->served / (double)s->batches : 0.0, s->largest_batch,
                       (unsigned long long)s->errors);
    }
    if (s->ctx) {
        lws_sul_cancel(&s->tick);
        lws_context_destroy(s->ctx); /* closes what is left: LWS_CALLBACK_CLOSED frees each connection */
    }
    if (queue_ok) queue_destroy(&s->queue);
    free(s->metadata);
    free(s->scratch);
    free(s->batch), free(s->batch_obs), free(s->batch_seeds), free(s->results);
    free(s);
    return st;
}
