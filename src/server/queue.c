/* queue.c - the server's hand-offs (queue.h). */
#include "server/queue.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "util/clock.h"

conn_token *conn_token_new(void) {
    conn_token *t = malloc(sizeof *t);
    if (!t) return NULL;
    atomic_init(&t->refs, 1);
    atomic_init(&t->closed, 0);
    return t;
}

conn_token *conn_token_ref(conn_token *t) {
    atomic_fetch_add(&t->refs, 1);
    return t;
}

void conn_token_release(conn_token *t) {
    if (t && atomic_fetch_sub(&t->refs, 1) == 1) free(t);
}

void server_request_free(server_request *r) {
    if (!r) return;
    free(r->message);
    pi0_prepared_free(r->prepared);
    conn_token_release(r->token);
    free(r);
}

void server_reply_free(server_reply *r) {
    if (!r) return;
    free(r->data);
    free(r);
}

/* Unlinks the requests of a list whose connection has gone; returns them, linked, and the new tail. */
static server_request *unlink_abandoned(server_request **head, server_request **tail, int *removed) {
    server_request *gone = NULL, **link = head;
    *tail = NULL;
    *removed = 0;
    while (*link) {
        server_request *r = *link;
        if (atomic_load(&r->token->closed)) {
            *link = r->next;
            r->next = gone;
            gone = r;
            ++*removed;
        } else {
            *tail = r;
            link = &r->next;
        }
    }
    return gone;
}

/* ---- preparation ------------------------------------------------------------------------------------- */

int fifo_init(request_fifo *f) {
    *f = (request_fifo){0};
    if (pthread_cond_init(&f->nonempty, NULL)) return -1;
    if (pthread_mutex_init(&f->lock, NULL)) {
        pthread_cond_destroy(&f->nonempty);
        return -1;
    }
    return 0;
}

void fifo_destroy(request_fifo *f) {
    while (f->head) {
        server_request *r = f->head;
        f->head = r->next;
        server_request_free(r);
    }
    pthread_cond_destroy(&f->nonempty);
    pthread_mutex_destroy(&f->lock);
}

void fifo_push(request_fifo *f, server_request *r) {
    r->next = NULL;
    pthread_mutex_lock(&f->lock);
    if (f->tail) f->tail->next = r;
    else f->head = r;
    f->tail = r;
    pthread_cond_signal(&f->nonempty);
    pthread_mutex_unlock(&f->lock);
}

server_request *fifo_take(request_fifo *f) {
    pthread_mutex_lock(&f->lock);
    while (!f->head && !f->closed) pthread_cond_wait(&f->nonempty, &f->lock);
    server_request *r = f->head;
    if (r) {
        f->head = r->next;
        if (!f->head) f->tail = NULL;
        r->next = NULL;
    }
    pthread_mutex_unlock(&f->lock);
    return r;
}

server_request *fifo_remove_abandoned(request_fifo *f) {
    int removed;
    pthread_mutex_lock(&f->lock);
    server_request *gone = unlink_abandoned(&f->head, &f->tail, &removed);
    pthread_mutex_unlock(&f->lock);
    return gone;
}

void fifo_close(request_fifo *f) {
    pthread_mutex_lock(&f->lock);
    f->closed = 1;
    pthread_cond_broadcast(&f->nonempty);
    pthread_mutex_unlock(&f->lock);
}

/* ---- the batch queue ------------------------------------------------------------------------------- */

int queue_init(server_queue *q) {
    *q = (server_queue){0};
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr)) return -1;
    int bad = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) || pthread_cond_init(&q->nonempty, &attr);
    pthread_condattr_destroy(&attr);
    if (bad) return -1;
    if (pthread_mutex_init(&q->lock, NULL)) {
        pthread_cond_destroy(&q->nonempty);
        return -1;
    }
    return 0;
}

void queue_destroy(server_queue *q) {
    while (q->head) {
        server_request *r = q->head;
        q->head = r->next;
        server_request_free(r);
    }
    while (q->replies) {
        server_reply *r = q->replies;
        q->replies = r->next;
        server_reply_free(r);
    }
    pthread_cond_destroy(&q->nonempty);
    pthread_mutex_destroy(&q->lock);
}

void queue_expect(server_queue *q, int delta) {
    pthread_mutex_lock(&q->lock);
    q->preparing += delta;
    pthread_cond_signal(&q->nonempty); /* a batch waiting for this one may go now */
    pthread_mutex_unlock(&q->lock);
}

void queue_arriving(server_queue *q) {
    pthread_mutex_lock(&q->lock);
    q->preparing++;
    q->arriving_ms = pi0_now_ms();
    pthread_cond_signal(&q->nonempty); /* a batch window closing now stays open for it */
    pthread_mutex_unlock(&q->lock);
}

void queue_push(server_queue *q, server_request *r) {
    r->next = NULL;
    pthread_mutex_lock(&q->lock);
    q->preparing--;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
    q->count++;
    pthread_cond_signal(&q->nonempty);
    pthread_mutex_unlock(&q->lock);
}

/* answered_ms < 0: unchanged */
static void set_idle(server_queue *q, int idle_clients, double answered_ms) {
    pthread_mutex_lock(&q->lock);
    q->idle_clients = idle_clients;
    if (answered_ms >= 0) q->answered_ms = answered_ms;
    pthread_cond_signal(&q->nonempty); /* a batch waiting for idle clients may go now, or wait longer */
    pthread_mutex_unlock(&q->lock);
}

void queue_set_idle(server_queue *q, int idle_clients) { set_idle(q, idle_clients, -1); }
void queue_answered(server_queue *q, int idle_clients) { set_idle(q, idle_clients, pi0_now_ms()); }

server_request *queue_remove_abandoned(server_queue *q) {
    int removed;
    pthread_mutex_lock(&q->lock);
    server_request *gone = unlink_abandoned(&q->head, &q->tail, &removed);
    q->count -= removed;
    pthread_mutex_unlock(&q->lock);
    return gone;
}

void queue_close(server_queue *q) {
    pthread_mutex_lock(&q->lock);
    q->closed = 1;
    pthread_cond_broadcast(&q->nonempty);
    pthread_mutex_unlock(&q->lock);
}

/* Absolute CLOCK_MONOTONIC time of the pi0_now_ms() value `ms`. */
static struct timespec timespec_from_ms(double ms) {
    struct timespec ts;
    double s = floor(ms / 1e3);
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((ms - s * 1e3) * 1e6);
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    if (ts.tv_nsec < 0) ts.tv_nsec = 0;
    return ts;
}

int queue_take(server_queue *q, int max, double wait_ms, server_request **out) {
    double model_free_ms = pi0_now_ms();
    pthread_mutex_lock(&q->lock);
    /* until a request is there after the batch window (requests of connections that went during the window
     * may have been removed meanwhile: then it starts again) or the queue is closed and empty */
    while (q->count || !q->closed) {
        while (!q->count && !q->closed) pthread_cond_wait(&q->nonempty, &q->lock);
        if (!q->count) break;
        /* The batch window opens when its oldest request was queued, when the model became free, or when a client
         * last got its reply, whichever is latest: a request that queued while the previous batch ran waits for
         * the clients that batch answered to send again. Otherwise clients in step fall into split waves (of 4:
         * 3 in one batch, the 4th alone after it) that take longer than one batch of all of them. It opens again
         * when a request on its way begins to arrive: a client that turned its reply around a little slower than
         * the others (its first byte 1.9 ms into a 2 ms window) still joins, where it would wait a whole batch. */
        while (q->count < max && !q->closed && (q->idle_clients > 0 || q->preparing > 0) && wait_ms > 0) {
            double opened = q->head->t_prepared_ms > model_free_ms ? q->head->t_prepared_ms : model_free_ms;
            if (q->answered_ms > opened) opened = q->answered_ms;
            if (q->preparing > 0 && q->arriving_ms > opened) opened = q->arriving_ms;
            if (pi0_now_ms() >= opened + wait_ms) break;
            struct timespec ts = timespec_from_ms(opened + wait_ms);
            pthread_cond_timedwait(&q->nonempty, &q->lock, &ts); /* a push, a change of idle clients, or the end */
            if (!q->count) break; /* its requests were removed (connections gone): wait for new ones */
        }
        if (q->count) break;
    }
    int n = 0;
    while (q->head && n < max) {
        server_request *r = q->head;
        q->head = r->next;
        r->next = NULL;
        out[n++] = r;
        q->count--;
    }
    if (!q->head) q->tail = NULL;
    pthread_mutex_unlock(&q->lock);
    return n;
}

void queue_post_replies(server_queue *q, server_reply *first, server_reply *last) {
    if (!first) return;
    last->next = NULL;
    int answered = 0;
    for (server_reply *r = first; r; r = r->next) answered++;
    pthread_mutex_lock(&q->lock);
    /* Their clients are about to be idle (the network thread sets the exact count once it has written the
     * replies): the next batch window counts on them coming back. */
    q->idle_clients += answered;
    if (q->replies_tail) q->replies_tail->next = first;
    else q->replies = first;
    q->replies_tail = last;
    pthread_mutex_unlock(&q->lock);
}

server_reply *queue_take_replies(server_queue *q) {
    pthread_mutex_lock(&q->lock);
    server_reply *r = q->replies;
    q->replies = q->replies_tail = NULL;
    pthread_mutex_unlock(&q->lock);
    return r;
}

