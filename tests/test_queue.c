/*
 * test_queue.c - the server's batch queue (src/server/queue.c): when the inference thread takes a batch.
 * A single robot never waits; a window waits for clients that can still come and no longer than
 * --batch-wait-ms; and the clients a batch has just answered count as idle, so that a request that queued
 * while that batch ran waits for them (clients in step keep sharing one batch), and a client's reply going out
 * reopens the window for it, as does a request beginning to arrive.
 */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "server/queue.h"
#include "util/clock.h"

static server_request *request_at(double t_prepared_ms) {
    server_request *r = calloc(1, sizeof *r);
    r->t_prepared_ms = t_prepared_ms;
    return r;
}

static void push(server_queue *q, double t_prepared_ms) {
    queue_expect(q, +1);
    queue_push(q, request_at(t_prepared_ms));
}

static int take(server_queue *q, int max, double wait_ms, double *took_ms) {
    server_request *out[64];
    double t0 = pi0_now_ms();
    int n = queue_take(q, max, wait_ms, out);
    *took_ms = pi0_now_ms() - t0;
    for (int i = 0; i < n; i++) server_request_free(out[i]);
    return n;
}

static void post_replies(server_queue *q, int n) {
    server_reply *first = NULL;
    for (int i = 0; i < n; i++) {
        server_reply *r = calloc(1, sizeof *r);
        r->next = first;
        first = r;
    }
    server_reply *last = first;
    while (last && last->next) last = last->next;
    queue_post_replies(q, first, last);
    for (server_reply *r = queue_take_replies(q), *next; r; r = next) next = r->next, server_reply_free(r);
}

TEST(single_robot_never_waits) {
    server_queue q;
    REQUIRE(queue_init(&q) == 0);
    queue_set_idle(&q, 0); /* the only client has its request in the server */
    push(&q, pi0_now_ms());
    double ms;
    CHECK(take(&q, 8, 500, &ms) == 1 && ms < 50, "took %.1f ms", ms);
    queue_destroy(&q);
}

TEST(window_is_bounded_by_batch_wait) {
    server_queue q;
    REQUIRE(queue_init(&q) == 0);
    queue_set_idle(&q, 3); /* three clients that send nothing */
    push(&q, pi0_now_ms());
    double ms;
    CHECK(take(&q, 8, 30, &ms) == 1 && ms >= 25 && ms < 500, "took %.1f ms", ms);
    queue_destroy(&q);
}

typedef struct {
    server_queue *q;
    int count;
    double after_ms;
} late_pushes;

static void *push_later(void *arg) {
    late_pushes *l = arg;
    struct timespec ts = {0, (long)(l->after_ms * 1e6)};
    nanosleep(&ts, NULL);
    for (int i = 0; i < l->count; i++) push(l->q, pi0_now_ms());
    queue_set_idle(l->q, 0);
    return NULL;
}

/* Four clients in step, split: 3 answered by the batch that just ran, the 4th queued while it ran. The 4th
 * waits for the 3 (they come back 10 ms later) and the four run as one batch. */
TEST(answered_clients_are_waited_for) {
    server_queue q;
    REQUIRE(queue_init(&q) == 0);
    queue_set_idle(&q, 0);
    push(&q, pi0_now_ms() - 300); /* queued long ago, while the previous batch ran */
    post_replies(&q, 3);          /* that batch's replies: their clients are about to be idle */
    late_pushes l = {&q, 3, 10};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, push_later, &l) == 0);
    double ms;
    int n = take(&q, 8, 200, &ms); /* the window opens now, not 300 ms ago when the 4th was queued */
    pthread_join(t, NULL);
    CHECK(n == 4 && ms >= 8 && ms < 190, "batch of %d after %.1f ms (want 4 after the 3 came back)", n, ms);
    queue_destroy(&q);
}

/* A second client's request comes after the first window (60 ms) has closed; what reopens the window for it
 * happens at `reopen_ms`: its reply going out (then it sends the whole request at `complete_ms`), or its request's
 * first byte (then it is complete and prepared at `complete_ms`). */
typedef struct {
    server_queue *q;
    int by_arrival;
    long reopen_ms, complete_ms;
} second_client;

static void *second_client_main(void *arg) {
    second_client *c = arg;
    struct timespec ts = {0, c->reopen_ms * 1000000L}, then = {0, (c->complete_ms - c->reopen_ms) * 1000000L};
    nanosleep(&ts, NULL);
    if (c->by_arrival) queue_arriving(c->q);
    else queue_answered(c->q, 1);
    nanosleep(&then, NULL);
    if (c->by_arrival) queue_push(c->q, request_at(pi0_now_ms())); /* counted on its way since its first byte */
    else push(c->q, pi0_now_ms());
    queue_set_idle(c->q, 0);
    return NULL;
}

/* Whether the second request joins the first one's batch, which then starts right after it. */
static void second_request_joins(int by_arrival, long reopen_ms, long complete_ms) {
    server_queue q;
    REQUIRE(queue_init(&q) == 0);
    queue_set_idle(&q, 1);
    push(&q, pi0_now_ms());
    second_client c = {&q, by_arrival, reopen_ms, complete_ms};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, second_client_main, &c) == 0);
    double ms, late_ms;
    int n = take(&q, 8, 60, &ms);
    pthread_join(t, NULL);
    CHECK(n == 2 && ms >= complete_ms - 5 && ms < complete_ms + 29, "batch of %d after %.1f ms (want 2 after ~%ld ms)", n,
          ms, complete_ms);
    if (n == 1) take(&q, 8, 60, &late_ms); /* the late one, so the queue is empty when destroyed */
    queue_destroy(&q);
}

/* The reply goes out 40 ms into the window; the next request comes ~70 ms in, inside the reopened window. */
TEST(a_reply_reopens_the_window) { second_request_joins(0, 40, 70); }

/* A client slower than the others to turn its reply around: its request begins to arrive just before the window
 * closes (50 ms into 60) and is complete just after (80 ms). It joins the batch instead of waiting for the next. */
TEST(an_arriving_request_reopens_the_window) { second_request_joins(1, 50, 80); }

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(single_robot_never_waits);
    RUN(window_is_bounded_by_batch_wait);
    RUN(answered_clients_are_waited_for);
    RUN(a_reply_reopens_the_window);
    RUN(an_arriving_request_reopens_the_window);
    return check_finish();
}
