/*
 * queue.h - the hand-offs between the server's threads.
 *
 * A request goes network thread -> preparation (a FIFO that the preparation threads drain: decode the
 * msgpack, pi0_policy_prepare) -> the batch queue (the inference thread takes up to `max` prepared
 * requests at once) -> a reply, which comes back to the network thread on a list it collects whole.
 *
 * No thread holds a pointer into another's state: a request names its connection by a 64-bit id that is
 * never reused, and carries the connection's `conn_token`, which the network thread marks closed when the
 * connection goes; the other threads then drop the request unrun, and a reply whose connection has gone
 * by the time it is collected is dropped.
 */
#ifndef PI0_SERVER_QUEUE_H
#define PI0_SERVER_QUEUE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "pi0_policy.h"

/* Shared by a connection and its requests: freed by whichever lets go last. */
typedef struct {
    atomic_int refs;
    atomic_int closed; /* the connection has gone: its requests are dropped, not run */
} conn_token;

conn_token *conn_token_new(void); /* one reference; NULL when out of memory */
conn_token *conn_token_ref(conn_token *t);
void conn_token_release(conn_token *t);

typedef struct server_request {
    struct server_request *next;
    uint64_t conn_id;
    conn_token *token;       /* a reference */
    uint8_t *message;        /* the msgpack bytes (owned), until prepared */
    size_t message_size;
    size_t bytes;            /* what the request holds against the server's queue budget */
    pi0_prepared *prepared;  /* owned, once prepared */
    uint64_t seed;           /* noise seed */
    double t_received_ms;    /* the request's first byte (pi0_now_ms) */
    double t_complete_ms;    /* its last byte: handed to preparation */
    double t_prepared_ms;    /* decoded and prepared: queued for the model */
    double decode_ms;        /* msgpack to observation */
    double prev_total_ms;    /* the connection's previous request, first byte to reply written; < 0: none */
    double prev_send_ms;     /* ... and its reply's writing, from posted to last byte; < 0: none */
} server_request;

void server_request_free(server_request *r);

typedef struct server_reply {
    struct server_reply *next;
    uint64_t conn_id;
    int is_error;         /* `data` is an error message: a text frame, then close 1011 */
    uint8_t *data;        /* owned; msgpack (binary frame) or UTF-8 text */
    size_t size;
    double t_received_ms; /* copied from the request */
    double t_posted_ms;   /* handed to the network thread */
} server_reply;

void server_reply_free(server_reply *r);

/* ---- preparation: a plain FIFO ------------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t nonempty;
    server_request *head, *tail;
    int closed;
} request_fifo;

int fifo_init(request_fifo *f);      /* 0 or -1 */
void fifo_destroy(request_fifo *f);  /* frees whatever is still queued */
void fifo_push(request_fifo *f, server_request *r);
/* Blocks until a request is there (returns it) or the FIFO is closed and empty (returns NULL). */
server_request *fifo_take(request_fifo *f);
void fifo_close(request_fifo *f);
/* Removes the requests whose connection has gone and returns them as a list (linked through `next`). */
server_request *fifo_remove_abandoned(request_fifo *f);

/* ---- the batch queue, and the replies ------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t nonempty; /* CLOCK_MONOTONIC */
    server_request *head, *tail;
    int count;
    int closed;              /* no more pushes; take what is left without waiting */
    int idle_clients;        /* connected clients with no request in the server: only they can still join */
    double answered_ms;      /* when a client last got its reply (pi0_now_ms): it may send its next request */
    int preparing;           /* requests on their way: arriving (queue_arriving) or being prepared, not yet pushed */
    double arriving_ms;      /* when the latest of them began to arrive (its first byte) */
    server_reply *replies, *replies_tail;
} server_queue;

int queue_init(server_queue *q);     /* 0 or -1 */
void queue_destroy(server_queue *q); /* frees whatever is still queued */

/* A request is on its way (+1 when handed to preparation) or will not come (-1 when preparation drops it). */
void queue_expect(server_queue *q, int delta);
/* A request's first byte is in: it is on its way (queue_expect(q, +1)), and the batch window reopens for it
 * (queue_take), so that a client whose request is still arriving when the window would close is not left for
 * the next batch. queue_expect(q, -1) if it never comes (refused, or the connection goes). */
void queue_arriving(server_queue *q);
/* Queues a prepared request (which was expected). */
void queue_push(server_queue *q, server_request *r);
void queue_set_idle(server_queue *q, int idle_clients);
/* The same when a client has just been sent its reply: the batch window reopens for it (queue_take). */
void queue_answered(server_queue *q, int idle_clients);
/* Wakes the taker; later takes return what is queued at once, then 0. */
void queue_close(server_queue *q);
/* Removes the requests whose connection has gone and returns them as a list (linked through `next`). */
server_request *queue_remove_abandoned(server_queue *q);
/* Blocks until a request is queued, then collects up to `max` into out[]: while fewer are queued, it waits up
 * to `wait_ms` after the latest of: the oldest one queued, this call's start, a client answered, a request on its
 * way beginning to arrive; as long as more can come (a request on its way, or an idle client). Returns how many
 * (>= 1), or 0 when the queue is closed and empty. */
int queue_take(server_queue *q, int max, double wait_ms, server_request **out);

/* Appends a list of replies (linked through `next`); their clients count as idle from now on. */
void queue_post_replies(server_queue *q, server_reply *first, server_reply *last);
/* Takes every posted reply, oldest first (NULL if none). */
server_reply *queue_take_replies(server_queue *q);

#endif
