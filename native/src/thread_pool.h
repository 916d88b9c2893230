// A persistent pool of worker threads that run "jobs": a job is N independent tasks
// (task(i) for i in [0, N)) executed by the calling thread plus up to threads-1 helpers.
//
// - No thread is created per call: workers are started once (lazily, grown on demand up to
//   kMaxThreads) and sleep on a condition variable between jobs.
// - Several callers may run jobs at the same time (the Python wrappers release the GIL):
//   jobs are queued, each keeps its own task counter and helper limit.
// - The caller always works on its own job, so a job finishes even if no helper is free
//   (and in a child process after fork(), where the parent's workers do not exist: the pool
//   notices the pid change and starts over with a fresh pool).
// - Exceptions thrown by tasks are captured and the first one is rethrown in the caller.
#pragma once

#include <cstddef>
#include <functional>

namespace ucpd {

constexpr int kMaxThreads = 64;

// Runs task(i) for every i in [0, ntasks) using at most `threads` threads in total
// (the caller included). threads <= 1 or ntasks <= 1 runs everything inline.
void parallel_for(std::size_t ntasks, int threads, const std::function<void(std::size_t)>& task);

// Number of worker threads started so far (for tests and diagnostics).
int pool_worker_count();

}  // namespace ucpd
