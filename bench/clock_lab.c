/*
 * clock_lab.c - the clock a multiprocessor runs at under the kinds of work the engine does, read on the GPU.
 *
 * nvidia-smi reports the clock the driver asks for (1980 MHz on an H200). What a multiprocessor runs at is its
 * %clock64 against %globaltimer, which a one-thread kernel samples here beside a load on every multiprocessor, on
 * one, or on none. On an H200 (bench/NOTES.md, session 51) tensor-core products on any multiprocessor of a GPC hold
 * the whole GPC at ~1795 MHz, where FMAs and memory traffic leave it at 1980, and products that start after a quiet
 * microsecond dip it to ~1550-1600 MHz for 1-3 us. So the engine's tensor phases run ~10% below the clock the
 * floors in bench/NOTES.md before session 51 assumed, and lent machines may differ in it.
 *
 * Usage: build/bench/clock_lab [--sm N] [--brief]
 *   --sm N    the multiprocessor sampled (default 0)
 *   --brief   one line, which bench/device.sh records beside each machine's nvidia-smi line
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock_lab.h"
#include "lab.h"

#define PERIOD_NS 2000LL  /* a sample every 2 us */
#define LEAD_NS 200000LL  /* the load starts this long after it is launched, so that the sampler runs by then */
#define MAX_SAMPLES 1024
#define MAX_SMS 1023      /* the map's length */

typedef struct {
    int sms, sm; /* the device's multiprocessors; the one sampled */
    unsigned long long *pairs, *now, host[2 * MAX_SAMPLES];
    int *taken;
    float *sink;
    cudaStream_t sampler, load;
} lab;

enum { NO_LOAD = -1, EVERY_SM = -1 };

/* The sampled multiprocessor's mean MHz while `kind` (NO_LOAD: nothing) runs on multiprocessor `on` (EVERY_SM: all)
 * for total_ns, in bursts of burst_ns every burst_ns + gap_ns; the load's first fifth is left out. -1 if no sampler
 * block landed on the multiprocessor. */
static double clock_under(lab *l, int kind, int on, long long total_ns, long long burst_ns, long long gap_ns) {
    const int n = (int)((LEAD_NS + total_ns + 100000) / PERIOD_NS);
    unsigned long long t0;
    int taken;
    if (n > MAX_SAMPLES) return -1;
    CK(clock_lab_now(l->now, l->load));
    CK(cudaMemcpyAsync(&t0, l->now, sizeof t0, cudaMemcpyDeviceToHost, l->load));
    CK(cudaMemsetAsync(l->taken, 0, sizeof(int), l->sampler));
    CK(cudaStreamSynchronize(l->load));
    t0 += LEAD_NS;
    /* enough one-thread blocks that some land on every multiprocessor; loads four blocks a multiprocessor */
    CK(clock_lab_sample(l->pairs, n, PERIOD_NS, l->sm, l->taken, 8 * l->sms, l->sampler));
    if (kind != NO_LOAD) CK(clock_lab_load(kind, on, t0, total_ns, burst_ns, gap_ns, l->sink, 4 * l->sms, l->load));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(&taken, l->taken, sizeof taken, cudaMemcpyDeviceToHost));
    if (!taken) return -1;
    CK(cudaMemcpy(l->host, l->pairs, 2 * sizeof(unsigned long long) * (size_t)n, cudaMemcpyDeviceToHost));
    double sum = 0;
    int count = 0;
    for (int i = 1; i < n; i++) {
        const unsigned long long a = l->host[2 * i - 2], b = l->host[2 * i];
        if (a < t0 + (unsigned long long)(total_ns / 5) || b > t0 + (unsigned long long)total_ns || b <= a) continue;
        sum += (double)(l->host[2 * i + 1] - l->host[2 * i - 1]) * 1e3 / (double)(b - a);
        count++;
    }
    return count ? sum / count : -1;
}

/* Which multiprocessors' products move the sampled one's clock: '#' for those, '.' for the others. Returns how many. */
static int clock_domain(lab *l, double idle_mhz, char *map) {
    int shared = 0;
    for (int i = 0; i < l->sms; i++) {
        const double mhz = clock_under(l, CLOCK_LOAD_TENSOR, i, 200000, 200000, 0);
        map[i] = mhz < 0 ? '?' : mhz < 0.97 * idle_mhz ? '#' : '.';
        shared += map[i] == '#';
    }
    map[l->sms] = '\0';
    return shared;
}

int main(int argc, char **argv) {
    lab l = {0};
    int brief = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--brief")) brief = 1;
        else if (!strcmp(argv[i], "--sm") && i + 1 < argc) {
            char *end;
            const long sm = strtol(argv[++i], &end, 10);
            if (*end || end == argv[i] || sm < 0 || sm > 4096) {
                fprintf(stderr, "--sm: '%s' is not a multiprocessor number\n", argv[i]);
                return 2;
            }
            l.sm = (int)sm;
        }
        else {
            const int help = !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
            fprintf(help ? stdout : stderr, "usage: %s [--sm N] [--brief]\n", argv[0]);
            return help ? 0 : 2;
        }
    }
    setenv("CUDA_MODULE_LOADING", "EAGER", 0); /* a kernel's first launch must not wait for its module */
    CK(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, 0));
    if (l.sms > MAX_SMS) {
        fprintf(stderr, "clock_lab: the device has %d multiprocessors, more than the map's %d\n", l.sms, MAX_SMS);
        return 1;
    }
    if (l.sm < 0 || l.sm >= l.sms) {
        fprintf(stderr, "--sm must be in 0..%d\n", l.sms - 1);
        return 2;
    }
    CK(cudaMalloc((void **)&l.pairs, 2 * sizeof(unsigned long long) * MAX_SAMPLES));
    CK(cudaMalloc((void **)&l.now, sizeof(unsigned long long)));
    CK(cudaMalloc((void **)&l.taken, sizeof(int)));
    CK(cudaMalloc((void **)&l.sink, sizeof(float)));
    CK(cudaStreamCreateWithFlags(&l.sampler, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&l.load, cudaStreamNonBlocking));

    const long long ms = 1000000;
    const double idle = clock_under(&l, NO_LOAD, EVERY_SM, ms, ms, 0);
    if (idle < 0) {
        fprintf(stderr, "clock_lab: no sampler block landed on multiprocessor %d\n", l.sm);
        return 1;
    }
    const double fma = clock_under(&l, CLOCK_LOAD_FMA, EVERY_SM, ms, ms, 0);
    const double tensor = clock_under(&l, CLOCK_LOAD_TENSOR, EVERY_SM, ms, ms, 0);
    const double bursts = clock_under(&l, CLOCK_LOAD_TENSOR, EVERY_SM, ms, 1000, 1000);
    char map[MAX_SMS + 1];
    const int shared = clock_domain(&l, idle, map);
    if (brief) {
        printf("clock_lab: SM %d at %.0f MHz idle, %.0f with FMAs, %.0f with tensor products, %.0f with 1 us bursts of "
               "them; %d multiprocessors' products move its clock\n",
               l.sm, idle, fma, tensor, bursts, shared);
        return 0;
    }
    printf("multiprocessor %d of %d, sampled every %lld ns (mean MHz over each load's last 4/5)\n", l.sm, l.sms,
           PERIOD_NS);
    printf("  %-58s %6.0f\n", "nothing else running", idle);
    printf("  %-58s %6.0f\n", "float32 FMA chains on every multiprocessor", fma);
    printf("  %-58s %6.0f\n", "tensor products (mma.sync) on every multiprocessor", tensor);
    printf("  %-58s %6.0f\n", "tensor products in 1 us bursts, 1 us apart, everywhere", bursts);
    printf("  %-58s %6.0f\n", "tensor products in 3 us bursts, 3 us apart, everywhere",
           clock_under(&l, CLOCK_LOAD_TENSOR, EVERY_SM, ms, 3000, 3000));
    printf("  %-58s %6.0f\n", "tensor products on this multiprocessor only", clock_under(&l, CLOCK_LOAD_TENSOR, l.sm, ms, ms, 0));
    printf("tensor products on one multiprocessor at a time ('#': this one's clock fell), %d of %d:\n  %s\n", shared,
           l.sms, map);
    return 0;
}
