// Work sharing for the CPU kernels (_cpu_attention.cc, _cpu_matmul.cc) on XLA's
// intra-op thread pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace rl_jax {

// Runs body(i) for every i in [0, items) on the calling thread and on up to
// `helpers` pool tasks (and at most the pool's threads less one), all claiming items from one counter; returns when every
// item is done. The calling thread works too, so a pool slow to start a task
// costs nothing: the caller takes the items. A task that starts after every item
// is claimed returns without calling body, so body may point into buffers that
// XLA frees once the handler returns.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t helpers, Body body) {
  struct Shared {
    Shared(Body b, int64_t n) : body(std::move(b)), items(n) {}
    Body body;
    int64_t items;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};

    void Run() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        body(i);
        finished.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(body), items);
  helpers = std::min<int64_t>({helpers, pool.num_threads() - 1, items - 1});
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  while (shared->finished.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace rl_jax
