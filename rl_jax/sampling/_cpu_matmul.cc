// y = x @ w for the projections of a decode step, on CPU (XLA FFI).
//
//   x       [M, K]        float32  activations: M rows of the step (one token each)
//   panels  [P, K, NR]    float32  w [K, N] cut into P = ceil(N / NR) panels of NR
//                                  columns, each one contiguous block, the last
//                                  zero-padded (_cpu_kernels.pack_panels)
// result:
//   y       [M, N]        float32
//
// Why a hand-written kernel: a decode step multiplies a few dozen rows by each
// weight matrix, and XLA:CPU runs these small-M products at under half the rate it
// reaches on large ones (bench model, 64 rows: ~140 GFLOP/s on 2 cores, where
// this kernel and MKL reach ~300). The weights are packed once per decode call,
// outside the token loop, so each panel is read front to back.
//
// The register tile is kMR rows x kNR columns (kNV vectors): per k, kNV loads of
// the panel, kMR broadcasts of x, kMR * kNV multiply-adds into accumulators that
// stay in registers across a block of kKC values of k. The panel's kKC x kNR
// block is reused by every row tile from L1/L2. Panels are split over XLA's
// intra-op threads. Summation runs over k in order, in float32, with fused
// multiply-adds: results agree with XLA's to float32 rounding, not bit for bit.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "_cpu_common.h"

namespace ffi = xla::ffi;

namespace {

// The tile fills the vector registers: 32 of them (AVX-512, AArch64) hold
// 8 x 3 accumulators plus 3 panel vectors and a broadcast; 16 (AVX2, SSE) hold
// 6 x 2 plus 2 and 1.
#if defined(__AVX512F__)
constexpr int kWidth = 16;
#elif defined(__AVX__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kMR = 8, kNV = 3;
#else
constexpr int kMR = 6, kNV = 2;
#endif
constexpr int kNR = kNV * kWidth;
// k per block: the panel's block (kKC x kNR floats, 48 KiB with AVX-512) stays in
// L1/L2 while every row tile passes over it.
constexpr int64_t kKC = 256;
// Rows per work item: with more rows than this, items split rows too, so one
// item's rows (kMC x kKC floats) stay in L2.
constexpr int64_t kMC = 256;

typedef float Vec __attribute__((vector_size(kWidth * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof(v)); }

// c[MR, kNR] = (accumulate ? c : 0) + a[MR, kc] @ w[kc, kNR]; rows of a lda apart,
// of c ldc apart; w contiguous (a panel's block).
template <int MR>
void Tile(int64_t kc, const float* a, int64_t lda, const float* w, float* c, int64_t ldc,
          bool accumulate) {
  Vec acc[MR][kNV];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kNV; ++j) acc[i][j] = accumulate ? Load(c + i * ldc + j * kWidth) : Vec{};
  }
  for (int64_t k = 0; k < kc; ++k) {
    Vec b[kNV];
    for (int j = 0; j < kNV; ++j) b[j] = Load(w + k * kNR + j * kWidth);
    for (int i = 0; i < MR; ++i) {
      const float ai = a[i * lda + k];  // vector * scalar broadcasts it
      for (int j = 0; j < kNV; ++j) acc[i][j] += b[j] * ai;
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kNV; ++j) Store(c + i * ldc + j * kWidth, acc[i][j]);
  }
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool);

// Tile<mr> for mr = 1 .. kMR (the last row tile may be short).
template <int... MR>
constexpr auto MakeTiles(std::integer_sequence<int, MR...>) {
  return std::array<TileFn, sizeof...(MR)>{&Tile<MR + 1>...};
}
constexpr auto kTiles = MakeTiles(std::make_integer_sequence<int, kMR>{});

struct Problem {
  const float* x;
  const float* panels;
  float* y;
  int64_t M, K, N;
};

// Rows [m0, m1) times panel p.
void Item(const Problem& pr, int64_t p, int64_t m0, int64_t m1) {
  const int64_t n0 = p * kNR;
  const int64_t cols = std::min<int64_t>(kNR, pr.N - n0);
  const float* panel = pr.panels + p * pr.K * kNR;
  if (pr.K == 0) {
    for (int64_t m = m0; m < m1; ++m) std::fill_n(pr.y + m * pr.N + n0, cols, 0.0f);
    return;
  }
  alignas(64) float edge[kMR * kNR];  // the padded last panel's tile
  for (int64_t k0 = 0; k0 < pr.K; k0 += kKC) {
    const int64_t kc = std::min(kKC, pr.K - k0);
    const bool accumulate = k0 > 0;
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, m1 - m);
      const float* a = pr.x + m * pr.K + k0;
      const float* w = panel + k0 * kNR;
      float* c = pr.y + m * pr.N + n0;
      if (cols == kNR) {
        kTiles[mr - 1](kc, a, pr.K, w, c, pr.N, accumulate);
        continue;
      }
      if (accumulate) {
        for (int64_t i = 0; i < mr; ++i) std::memcpy(edge + i * kNR, c + i * pr.N, cols * 4);
      }
      kTiles[mr - 1](kc, a, pr.K, w, edge, kNR, accumulate);
      for (int64_t i = 0; i < mr; ++i) std::memcpy(c + i * pr.N, edge + i * kNR, cols * 4);
    }
  }
}

// One pool task per this many multiply-adds, at most one per thread: scheduling a
// task costs microseconds, the time of ~10^5 multiply-adds.
constexpr int64_t kMinMacsPerHelper = 1 << 18;

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                  bool parallel, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto pd = panels.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[1] != xd[1] ||
      pd[2] != kNR || yd[0] != xd[0] || pd[0] != (yd[1] + kNR - 1) / kNR) {
    return ffi::Error::InvalidArgument(
        "matmul: expected x [M, K], panels [ceil(N / " + std::to_string(kNR) + "), K, " +
        std::to_string(kNR) + "] and result [M, N]");
  }
  const Problem pr{x.typed_data(), panels.typed_data(), y->typed_data(), xd[0], xd[1], yd[1]};
  if (pr.M == 0 || pr.N == 0) return ffi::Error::Success();
  const int64_t row_blocks = (pr.M + kMC - 1) / kMC;
  const int64_t items = pd[0] * row_blocks;
  const int64_t helpers = parallel ? pr.M * pr.K * pr.N / kMinMacsPerHelper : 0;
  rl_jax::ParallelFor(pool, items, helpers, [pr, row_blocks](int64_t i) {
    const int64_t m0 = (i % row_blocks) * kMC;
    Item(pr, i / row_blocks, m0, std::min(pr.M, m0 + kMC));
  });
  return ffi::Error::Success();
}

}  // namespace

// The panel width NR the library was built for (it depends on the vector
// registers): pack_panels cuts weights to it.
extern "C" int RlJaxMatmulPanelWidth() { return kNR; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels
                                  .Attr<bool>("parallel")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);
