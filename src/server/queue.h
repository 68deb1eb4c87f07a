/*
 * queue.h - the hand-off between the server's network thread and its inference thread.
 *
 * Requests go one way: the network thread pushes decoded observations; the inference thread takes them
 * in batches (queue_take: up to `max` requests, waiting at most `wait_ms` after the oldest one arrived
 * for more to come). Replies go the other way as a list the network thread collects whole.
 *
 * Neither side holds a pointer into the other's state: a request names its connection by a 64-bit id
 * that is never reused, and a reply whose connection has gone by the time it is collected is dropped.
 */
#ifndef PI0_SERVER_QUEUE_H
#define PI0_SERVER_QUEUE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "pi0_policy.h"

typedef struct server_request {
    struct server_request *next;
    uint64_t conn_id;
    pi0_observation obs;   /* owned */
    uint64_t seed;         /* noise seed */
    double t_received_ms;  /* the request's first byte (pi0_now_ms) */
    double t_queued_ms;    /* decoded and pushed */
    double prev_total_ms;  /* the connection's previous request, first byte to reply written; < 0: none */
} server_request;

typedef struct server_reply {
    struct server_reply *next;
    uint64_t conn_id;
    int is_error;         /* `data` is an error message: a text frame, then close 1011 */
    uint8_t *data;        /* owned; msgpack (binary frame) or UTF-8 text */
    size_t size;
    double t_received_ms; /* copied from the request */
} server_reply;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t nonempty; /* CLOCK_MONOTONIC */
    server_request *head, *tail;
    int count;
    int closed;              /* no more pushes; take what is left without waiting */
    int idle_clients;        /* connected clients with no request queued: only they can still join a batch */
    server_reply *replies, *replies_tail;
} server_queue;

int queue_init(server_queue *q);   /* 0 or -1 */
void queue_destroy(server_queue *q); /* frees whatever is still queued */

/* Queues `r` and records how many clients are now idle (see queue_take). */
void queue_push(server_queue *q, server_request *r, int idle_clients);
void queue_set_idle(server_queue *q, int idle_clients);
/* Wakes the taker; later takes return what is queued at once, then 0. */
void queue_close(server_queue *q);
/* Blocks until a request is queued, then collects up to `max` into out[] as described above; it does not wait
 * for more when no client is idle (every connected client already has a request queued or running). Returns
 * how many (>= 1), or 0 when the queue is closed and empty. */
int queue_take(server_queue *q, int max, double wait_ms, server_request **out);

/* Appends a list of replies (linked through `next`). */
void queue_post_replies(server_queue *q, server_reply *first, server_reply *last);
/* Takes every posted reply, oldest first (NULL if none). */
server_reply *queue_take_replies(server_queue *q);

void server_request_free(server_request *r);
void server_reply_free(server_reply *r);

#endif
