// A small pool of worker threads for qfserve's native CPU kernels (see pool's comment).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#define QF_PAUSE() _mm_pause()
#else
#define QF_PAUSE() ((void)0)
#endif

namespace qfserve {

// ---------------------------------------------------------------------------------------
// A fixed pool of worker threads sharing a job's chunks of rows. The calling thread claims
// chunks too and never waits for a worker that has not started: on a busy machine it simply
// does the whole job itself, and waits at the end only for chunks a worker is still running.
// A claim is a compare-and-swap on (job generation << 32 | next chunk), so a worker that wakes
// late can never claim a chunk of a later job with an earlier job's function.
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads < 1 ? 1 : threads) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return threads_; }

  // Run fn(chunk) for chunk in [0, chunks).
  void run(int chunks, const std::function<void(int)>& fn) {
    if (chunks <= 1 || threads_ == 1) {
      for (int c = 0; c < chunks; ++c) fn(c);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mutex_);  // callers on two streams take turns
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      gen = ++generation_;
      job_ = &fn;
      chunks_ = chunks;
      done_.store(0, std::memory_order_relaxed);
      ticket_.store(gen << 32, std::memory_order_release);
    }
    wake_.notify_all();
    int mine = work(gen, fn, chunks);
    // A worker still running a chunk may have lost its core to another thread (a server's
    // Python threads share the machine): after a short spin this thread gives its core up
    // rather than spin through the scheduler's time slice.
    for (int spin = 0; done_.load(std::memory_order_acquire) != chunks - mine; ++spin) {
      if (spin < spin_limit_) {
        QF_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  // Claim and run chunks of job `gen`; returns how many this thread ran.
  int work(uint64_t gen, const std::function<void(int)>& fn, int chunks) {
    int ran = 0;
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && static_cast<int>(t & 0xffffffffu) < chunks) {
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        fn(static_cast<int>(t & 0xffffffffu));
        ++ran;
        t = ticket_.load(std::memory_order_acquire);
      }
    }
    return ran;
  }

  void loop() {
    uint64_t seen = 0;
    while (true) {
      // Spin a while for the next job before sleeping (decode calls ~200 times a step).
      for (int spin = 0; spin < spin_limit_ && (ticket_.load() >> 32) == seen; ++spin) {
        QF_PAUSE();
      }
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<void(int)>* job = job_;
      const int chunks = chunks_;
      lock.unlock();
      const int ran = work(seen, *job, chunks);
      if (ran) done_.fetch_add(ran, std::memory_order_release);
    }
  }

  int threads_;
  // Pause instructions a worker spins for the next job before it sleeps (tens of microseconds).
  static constexpr int spin_limit_ = 2000;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_;
  uint64_t generation_ = 0;  // guarded by mutex_
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  const std::function<void(int)>* job_ = nullptr;
  int chunks_ = 0;
  bool stop_ = false;
};

inline int threads_from_env() {
  const char* v = std::getenv("QFSERVE_NATIVE_THREADS");
  int n = v ? std::atoi(v) : static_cast<int>(std::thread::hardware_concurrency());
  return n < 1 ? 1 : (n > 64 ? 64 : n);
}

inline Pool& pool() {
  static Pool instance(threads_from_env());
  return instance;
}

}  // namespace qfserve
