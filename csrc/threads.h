// How many threads an op of sicl_fast.ops._C runs on. One count for the whole process (set_num_threads), not the
// calling thread's OpenMP setting: an op called from a server's worker thread uses the same count as one called
// from the main thread, and the count torch uses (sicl_fast.run.threads applies one number to both). Work too small
// to repay waking the other threads runs on the calling thread alone: every parallel region ends in a barrier,
// and on a machine shared with other work a barrier waits for whichever thread the scheduler has taken off its
// core, which costs far more than the work itself.
#pragma once
#include <atomic>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sicl {

// element operations below which an op stays on one thread (torch's parallel_for uses the same grain, 32768)
constexpr int64_t kGrain = 32768;
// a Philox normal costs about as much as this many plain element operations
constexpr int64_t kRandnCost = 16;

inline std::atomic<int> g_threads{0};  // 0: OpenMP's default (OMP_NUM_THREADS or the cores)

inline int max_threads() {
#ifdef _OPENMP
    const int n = g_threads.load(std::memory_order_relaxed);
    return n > 0 ? n : omp_get_max_threads();
#else
    return 1;
#endif
}

// threads for `work` element operations: 1 below the grain, then one per grain, at most max_threads()
inline int threads_for(int64_t work) {
    const int64_t useful = work / kGrain;
    const int n = max_threads();
    return useful < 2 ? 1 : static_cast<int>(useful < n ? useful : n);
}

inline void set_threads(int n) {
    if (n >= 1) g_threads.store(n, std::memory_order_relaxed);
}

}  // namespace sicl
