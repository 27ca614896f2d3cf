/* The machine's read bandwidth, for the benchmarks' floors (scripts/decode_breakdown.py and
kernel_speed.py): bytes only loaded, as fast as this CPU's loads go.

A sum in torch, the first probe, is not a bound: it waits on its arithmetic (on a 2-core EPYC it
read 32-46 GB/s where these loads, in turn with it, read 62-65). Here each thread reads its part
as `streams` sequences side by side (as a product reads several weight rows), prefetching `ahead`
bytes on; the caller tries a few of each and keeps the fastest. The loads are folded by XOR into
the value returned, so the compiler cannot leave them out.
*/

#include "common.h"

#define LINE 64
#define MAX_STREAMS 16

/* 64 bytes, as GCC and clang's vector extension: one register with AVX-512, two with AVX2. */
typedef uint64_t line_t __attribute__((vector_size(LINE)));

static uint64_t read_part(const uint8_t *p, int64_t per, int streams, int ahead) {
    line_t fold[MAX_STREAMS] = {0};
    for (int64_t i = 0; i < per; i += LINE)
        for (int s = 0; s < streams; s++) {
            const uint8_t *at = p + s * per + i;
            if (ahead)
                __builtin_prefetch(at + ahead, 0, 2); /* (into L2, as pairs.h's product prefetches) */
            line_t v;
            memcpy(&v, at, LINE);
            fold[s] ^= v;
        }
    uint64_t out = 0;
    for (int s = 0; s < MAX_STREAMS; s++)
        for (int l = 0; l < LINE / 8; l++)
            out ^= fold[s][l];
    return out;
}

/* Reads the first n bytes at p (rounded down to whole lines for each thread and stream) on
   `threads` threads, each its own contiguous part; returns the bytes read, or -1 for streams out of
   1 .. 16. The XOR of the bytes read goes to *fold. */
int64_t read_bytes(const uint8_t *p, int64_t n, int threads, int streams, int ahead, uint64_t *fold) {
    if (streams < 1 || streams > MAX_STREAMS)
        return -1;
    if (threads < 1)
        threads = 1;
    int64_t per = n / threads / streams / LINE * LINE;
    uint64_t folded = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(^ : folded)
    for (int t = 0; t < threads; t++)
        folded ^= read_part(p + t * per * streams, per, streams, ahead);
    *fold = folded;
    return per * streams * threads;
}
