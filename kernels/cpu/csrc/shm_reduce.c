/* The tensor-parallel all-reduce of the ranks of one machine, in C, on the shared-memory segment of
   backend/worker/parallel/shm.py (its protocol, not a copy's): the C layer stack's two reductions a
   layer (kernels/cpu/decode_stack.py) run here without crossing into Python (issue 47).

   The segment: per rank a sequence counter on a cache line of its own, then a closed flag line,
   then two data slots per rank (double-buffered) of slot_bytes each. An all-reduce copies the
   rank's floats into its slot of buffer seq % 2, publishes seq in its counter (a release store:
   the data before it), waits until every rank's counter reaches seq (acquire loads), and sums the
   slots in rank order, out = (s0 + s1) + s2 ..., the Python side's sum (torch.add then add_), so
   every rank and either side computes the same bits. The rank's own counter is the operation
   number both sides count from, so C and Python calls interleave freely on one segment.

   Waiting spins ~20 us, then yields the core up to 1 ms, then sleeps 50 us at a time, checking the
   closed flag (rank 0's close) and this process's failed flag (its group's lost rank) as the
   Python side does. Returns 0 when summed; 1 when the tensor does not fit a slot or the segment is
   gone (the caller then takes the Python path, which raises the group's error or uses gloo); 2
   when the group was closed or failed while waiting (likewise: the Python path raises why). */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define LINE_WORDS 8 /* int64 counters per 64-byte line */

typedef struct {
    int64_t *ctrl;          /* (size + 1) lines: the counters, then the closed flag; NULL once unmapped */
    uint8_t *data;          /* [2][size][slot_bytes] */
    int64_t rank, size, slot_bytes;
    const int64_t *failed;  /* this process's flag: the group has lost a rank */
    int64_t calls;          /* all-reduces summed here, and their time (the group's stats) */
    double seconds;
} shm_group_t;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int ready(const shm_group_t *g, int64_t seq) {
    for (int64_t r = 0; r < g->size; r++)
        if (__atomic_load_n(&g->ctrl[r * LINE_WORDS], __ATOMIC_ACQUIRE) < seq) return 0;
    return 1;
}

static int wait_for(const shm_group_t *g, int64_t seq) {
    if (ready(g, seq)) return 0;
    const double start = now();
    const struct timespec pause = {0, 50000};
    while (!ready(g, seq)) {
        const double waited = now() - start;
        if (waited > 20e-6) {
            if (__atomic_load_n(&g->ctrl[g->size * LINE_WORDS], __ATOMIC_ACQUIRE) ||
                __atomic_load_n(g->failed, __ATOMIC_ACQUIRE))
                return 2;
            if (waited < 1e-3)
                sched_yield();
            else
                nanosleep(&pause, NULL);
        }
    }
    return 0;
}

/* x [n] float32, summed over the ranks in place. */
int shm_all_reduce(shm_group_t *g, float *x, int64_t n) {
    const size_t bytes = sizeof(float) * (size_t)n;
    if (!g->ctrl || bytes > (size_t)g->slot_bytes) return 1;
    const double t0 = now();
    int64_t *mine = &g->ctrl[g->rank * LINE_WORDS];
    const int64_t seq = *mine + 1; /* only this rank writes its counter */
    uint8_t *buf = g->data + (size_t)(seq % 2) * (size_t)g->size * (size_t)g->slot_bytes;
    memcpy(buf + (size_t)g->rank * (size_t)g->slot_bytes, x, bytes);
    __atomic_store_n(mine, seq, __ATOMIC_RELEASE);
    if (wait_for(g, seq)) return 2;
    if (g->size > 1) {
        const float *a = (const float *)buf, *b = (const float *)(buf + g->slot_bytes);
        for (int64_t i = 0; i < n; i++) x[i] = a[i] + b[i];
    }
    for (int64_t r = 2; r < g->size; r++) { /* one pass per rank: the order of the sums is fixed */
        const float *s = (const float *)(buf + (size_t)r * (size_t)g->slot_bytes);
        for (int64_t i = 0; i < n; i++) x[i] += s[i];
    }
    g->calls++;
    g->seconds += now() - t0;
    return 0;
}
