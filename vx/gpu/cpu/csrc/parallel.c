/* The C source every CPU kernel's parallel loops share: work sharing with stealing (`vx_ws`).

   Runs in: the Worker process (vx_kernels.c includes it first;
   the AMX GEMM, the LM-head argmax, the VDPBF16PS GEMV and the fast decode attention use it).

   Why it exists: the Worker's two OpenMP threads share two cores with the front, the EngineCore
   and, in a benchmark, the load generator. With ``schedule(static)`` a thread descheduled in the
   middle of a loop left its partner idle at the region's barrier for as long, and a decode step
   runs ~240 regions: at 64 requests, served steps ran well past their lone time. Here a thread
   that finishes its range takes what is left of the others' (served c = 64: more output tok/s in
   one interleaved A/B, two repeats each; `bench/compare.py --vx-variant
   static=VX_CPU_WORK_STEALING=0`). */
#include "vx_kernels.h"
#include <stdint.h>
#include <sched.h>
#include <omp.h>
/* Pins thread t of the OpenMP pool (torch's) to cpus[t], for t < n. A thread left free
   followed the front's wake-ups: the kernel moved it onto its partner's core while the front
   held its own, and two threads then shared one core until the next balancing. Returns the
   team size, or -1 if a pin failed. */
int vx_bind_threads(const int* cpus, int n) {
    int bad = 0, team = 1;
    _Pragma("omp parallel reduction(+ : bad)") {
        const int t = omp_get_thread_num();
        if (t == 0) team = omp_get_num_threads();
        if (t < n) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[t], &set);
            if (sched_setaffinity(0, sizeof(set), &set)) bad++;
        }
    }
    return bad ? -1 : team;
}
/* Work sharing that survives a preempted thread. Each thread owns a contiguous range of the
   n items (the static split, so its next-item prefetches hold) and takes them front first; a
   thread whose range is empty takes items from the back of the others' ranges. On two cores
   shared with the front and the load generator, a thread descheduled mid-loop otherwise left
   its partner idle at the region's barrier for as long (every step runs ~240 regions). One
   64-bit word per range (front | back << 32) taken by compare-and-swap, so an item goes to
   exactly one thread; each item's result is the same whichever thread computes it. */
#define VX_WS_MAX 16
typedef struct { uint64_t r __attribute__((aligned(64))); } vx_ws_range;
typedef struct { int nt; vx_ws_range t[VX_WS_MAX]; } vx_ws;
/* 0: each thread its own range only (schedule(static), for A/B timing); 1: stealing (the
   default); k > 1: stealing, with k ranges per thread, so that most ranges have no owner and
   every item beyond the first 1 / k goes through the stealing path (tests). */
static int vx_ws_mode = 1;
void vx_set_work_stealing(int mode) { vx_ws_mode = mode < 0 ? 0 : mode; }
/* n items, for a region whose if clause is par (0: it runs on the caller alone). */
static inline void vx_ws_init(vx_ws* ws, int64_t n, int par) {
    int nt = par ? omp_get_max_threads() : 1;
    if (vx_ws_mode > 1) nt *= vx_ws_mode;
    nt = nt < 1 ? 1 : nt > VX_WS_MAX ? VX_WS_MAX : nt;
    ws->nt = nt;
    for (int t = 0; t < nt; t++)
        ws->t[t].r = (uint64_t)(n * t / nt) | ((uint64_t)(n * (t + 1) / nt) << 32);
}
/* The next item for thread t, -1 once every range is empty. */
static inline int64_t vx_ws_next(vx_ws* ws, int t) {
    if (t < ws->nt) {
        uint64_t v = __atomic_load_n(&ws->t[t].r, __ATOMIC_RELAXED);
        while ((uint32_t)v < (uint32_t)(v >> 32))
            if (__atomic_compare_exchange_n(&ws->t[t].r, &v, v + 1, 1, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED))
                return (uint32_t)v;
        if (!vx_ws_mode) return -1;
    }
    for (int k = 1; k < ws->nt + (t >= ws->nt); k++) {
        vx_ws_range* o = &ws->t[(t + k) % ws->nt];
        uint64_t v = __atomic_load_n(&o->r, __ATOMIC_RELAXED);
        while ((uint32_t)v < (uint32_t)(v >> 32)) {
            const uint64_t b = (v >> 32) - 1;
            if (__atomic_compare_exchange_n(&o->r, &v, (v & 0xFFFFFFFFu) | (b << 32), 1,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                return (int64_t)b;
        }
    }
    return -1;
}
