#include "thread_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ucpd {
namespace {

struct Job {
  const std::function<void(std::size_t)>* task = nullptr;
  std::size_t ntasks = 0;
  int max_helpers = 0;               // threads - 1
  int helpers = 0;                   // helpers that joined (guarded by Pool::mu)
  std::atomic<std::size_t> next{0};  // next task index to claim
  std::atomic<std::size_t> done{0};  // tasks finished
  std::mutex err_mu;
  std::exception_ptr error;

  // Claims and runs tasks until none is left. Returns when this thread has no more work.
  void work() {
    for (;;) {
      std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= ntasks) return;
      try {
        (*task)(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(err_mu);
        if (!error) error = std::current_exception();
      }
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
  bool has_unclaimed() const { return next.load(std::memory_order_relaxed) < ntasks; }
};

class Pool {
 public:
  Pool() = default;
  // Workers are detached on purpose: the pool lives for the whole process (a static that is
  // never destroyed), so interpreter shutdown never joins threads or touches freed state.
  ~Pool() = delete;

  void run(Job& job, int threads) {
    job.max_helpers = std::min(threads, kMaxThreads) - 1;
    {
      std::lock_guard<std::mutex> g(mu_);
      grow_locked(job.max_helpers);
      queue_.push_back(&job);
    }
    cv_.notify_all();
    job.work();
    // Leave the queue (no new helper may join), then wait for helpers still running tasks.
    std::unique_lock<std::mutex> lk(mu_);
    queue_.erase(std::find(queue_.begin(), queue_.end(), &job));
    done_cv_.wait(lk, [&] { return job.helpers == 0; });
  }

  int workers() {
    std::lock_guard<std::mutex> g(mu_);
    return static_cast<int>(nworkers_);
  }

 private:
  void grow_locked(int want) {
    while (nworkers_ < static_cast<std::size_t>(want)) {
      std::thread([this] { loop(); }).detach();
      ++nworkers_;
    }
  }

  Job* pick_locked() {
    for (Job* j : queue_)
      if (j->helpers < j->max_helpers && j->has_unclaimed()) return j;
    return nullptr;
  }

  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      Job* job = nullptr;
      cv_.wait(lk, [&] { return (job = pick_locked()) != nullptr; });
      ++job->helpers;
      lk.unlock();
      job->work();
      lk.lock();
      if (--job->helpers == 0) done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;       // workers wait here for a job
  std::condition_variable done_cv_;  // callers wait here for their helpers to leave
  std::deque<Job*> queue_;
  std::size_t nworkers_ = 0;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;
pid_t g_pool_pid = 0;

// fork() while another thread holds g_pool_mu would leave it locked forever in the child:
// hold it across fork so that it is free (and consistent) on both sides.
void register_atfork() {
  static const int once = pthread_atfork([] { g_pool_mu.lock(); }, [] { g_pool_mu.unlock(); },
                                         [] { g_pool_mu.unlock(); });
  (void)once;
}

Pool& pool() {
  register_atfork();
  std::lock_guard<std::mutex> g(g_pool_mu);
  pid_t pid = getpid();
  if (g_pool == nullptr || g_pool_pid != pid) {
    // First use, or first use in a forked child: the parent's workers do not exist here and its
    // mutexes may have been held at fork time, so the old pool is abandoned (leaked), not used.
    g_pool = new Pool();
    g_pool_pid = pid;
  }
  return *g_pool;
}

}  // namespace

void parallel_for(std::size_t ntasks, int threads, const std::function<void(std::size_t)>& task) {
  if (ntasks == 0) return;
  if (threads > static_cast<int>(ntasks)) threads = static_cast<int>(ntasks);
  if (threads <= 1) {
    for (std::size_t i = 0; i < ntasks; ++i) task(i);
    return;
  }
  Job job;
  job.task = &task;
  job.ntasks = ntasks;
  pool().run(job, threads);
  if (job.error) std::rethrow_exception(job.error);
}

int pool_worker_count() { return pool().workers(); }

}  // namespace ucpd
