#include "server/queue.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "util/clock.h"

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

void queue_push(server_queue *q, server_request *r, int idle_clients) {
    r->next = NULL;
    pthread_mutex_lock(&q->lock);
    q->idle_clients = idle_clients;
    if (q->tail) q->tail->next = r;
    else q->head = r;
    q->tail = r;
    q->count++;
    pthread_cond_signal(&q->nonempty);
    pthread_mutex_unlock(&q->lock);
}

void queue_set_idle(server_queue *q, int idle_clients) {
    pthread_mutex_lock(&q->lock);
    q->idle_clients = idle_clients;
    pthread_cond_signal(&q->nonempty); /* a batch waiting for idle clients may go now */
    pthread_mutex_unlock(&q->lock);
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
    pthread_mutex_lock(&q->lock);
    while (!q->count && !q->closed) pthread_cond_wait(&q->nonempty, &q->lock);
    if (q->count && q->count < max && !q->closed && q->idle_clients > 0 && wait_ms > 0) {
        /* The batch window opens when its oldest request arrived: a request that already waited while the
         * previous batch ran does not wait again. */
        double deadline = q->head->t_queued_ms + wait_ms;
        struct timespec ts = timespec_from_ms(deadline);
        while (q->count < max && !q->closed && q->idle_clients > 0 && pi0_now_ms() < deadline)
            if (pthread_cond_timedwait(&q->nonempty, &q->lock, &ts)) break; /* ETIMEDOUT */
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
    pthread_mutex_lock(&q->lock);
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

void server_request_free(server_request *r) {
    if (!r) return;
    pi0_observation_free(&r->obs);
    free(r);
}

void server_reply_free(server_reply *r) {
    if (!r) return;
    free(r->data);
    free(r);
}
