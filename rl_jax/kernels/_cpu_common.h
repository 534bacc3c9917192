// What the CPU kernels (_cpu_attention.cc, _cpu_matmul.cc) share: work sharing on
// XLA's intra-op thread pool, and exp on float vectors.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
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

// A GCC float vector V from, or to, unaligned memory (one vector move).
template <typename V>
inline V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
inline void Store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof(v));
}

// exp(x) for x <= 0 (a softmax after max subtraction, a sigmoid of -|x|) on a GCC
// float vector V, lane by lane: Cephes' expf polynomial, ~2 ulp, 0 below -87
// (about the smallest normal float's log). libm's expf is a scalar call, and GCC
// does not vectorise a scalar version (its floor and float -> int conversions
// stay scalar).
template <typename V>
inline V ExpNonpositive(V x) {
  using VI = decltype(x < x);  // the int32 vector of the same lanes
  const V lo = V{} - 87.0f;
  x = x < lo ? lo : x;
  const V t = x * 1.44269504088896341f + 0.5f;
  V fx = __builtin_convertvector(__builtin_convertvector(t, VI), V);  // trunc
  fx = fx > t ? fx - 1.0f : fx;                                      // floor
  V r = x - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  const V z = r * r;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const VI bits = (__builtin_convertvector(fx, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= lo ? V{} : y * scale;
}

}  // namespace rl_jax
