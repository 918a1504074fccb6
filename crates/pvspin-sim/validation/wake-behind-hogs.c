// Wake-to-run latency of a sleeping thread on this host while HOGS threads spin beside it:
// what the simulator's wake-up preemption rule has to reproduce (docs/simulator.md, "Sources I
// and J"). A waker thread spins 0.2-1 ms (a vCPU running guest code), then wakes the sleeper
// through a futex; the sleeper records how long it took to run. 3000 wake-ups.
//
//   gcc -O2 -pthread -o wake-behind-hogs wake-behind-hogs.c && ./wake-behind-hogs 4
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WAKEUPS 3000
#define MAX_HOGS 64

static atomic_int word;
static atomic_long woken_at;
static atomic_int stop;
static long latency_ns[WAKEUPS];

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *hog(void *unused) {
    (void)unused;
    volatile unsigned long spins = 0;
    while (!atomic_load(&stop))
        spins++;
    return NULL;
}

static void *sleeper(void *unused) {
    (void)unused;
    for (int i = 0; i < WAKEUPS; i++) {
        while (atomic_load(&word) == 0)
            syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
        latency_ns[i] = now_ns() - atomic_load(&woken_at);
        atomic_store(&word, 0);
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int hogs = argc > 1 ? atoi(argv[1]) : 0;
    if (hogs < 0 || hogs > MAX_HOGS) {
        fprintf(stderr, "hogs: 0 to %d\n", MAX_HOGS);
        return 2;
    }
    pthread_t hog_threads[MAX_HOGS], sleeper_thread;
    for (int i = 0; i < hogs; i++)
        pthread_create(&hog_threads[i], NULL, hog, NULL);
    pthread_create(&sleeper_thread, NULL, sleeper, NULL);
    srand(1);
    for (int i = 0; i < WAKEUPS; i++) {
        long until = now_ns() + 200000 + rand() % 800000;
        while (now_ns() < until || atomic_load(&word) != 0)
            ;
        atomic_store(&woken_at, now_ns());
        atomic_store(&word, 1);
        syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
    pthread_join(sleeper_thread, NULL);
    atomic_store(&stop, 1);
    for (int i = 0; i < hogs; i++)
        pthread_join(hog_threads[i], NULL);
    qsort(latency_ns, WAKEUPS, sizeof(long), by_value);
    printf("hogs %d, wake-to-run us: p10 %.1f p50 %.1f p90 %.1f p99 %.1f max %.1f\n", hogs,
           latency_ns[WAKEUPS / 10] / 1e3, latency_ns[WAKEUPS / 2] / 1e3,
           latency_ns[WAKEUPS * 9 / 10] / 1e3, latency_ns[WAKEUPS * 99 / 100] / 1e3,
           latency_ns[WAKEUPS - 1] / 1e3);
    return 0;
}
