// y = x @ w for the projections of a decode step, on CPU (XLA FFI).
//
//   x       [M, K]        float32  activations: M rows of the step (one token each)
//   panels  [L, P, K, NR] float32  per layer, w [K, N] cut into P = ceil(N / NR)
//                                  panels of NR columns, each one contiguous block,
//                                  the last zero-padded (cpu.pack_panels)
//   layer   []            int32    which of the L stacked weights to multiply by
//                                  (read in place: the decode step scans over layers)
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
//
// SwiGLU panels (cpu.pack_swiglu_panels) hold one vector of gate columns
// and the same up columns side by side; their tile computes silu(gate) * up from
// the accumulators and writes only the activation [M, F] (matmul_swiglu).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

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

inline Vec Load(const float* p) { return rl_jax::Load<Vec>(p); }
using rl_jax::Store;

// silu(g) * u lane by lane: g * sigmoid(g), the sigmoid from exp(-|g|) (no overflow).
inline Vec SwiGLU(Vec g, Vec u) {
  const Vec e = rl_jax::ExpNonpositive(g < 0 ? g : -g);
  const Vec sigmoid = (g < 0 ? e : Vec{} + 1.0f) / (1.0f + e);
  return g * sigmoid * u;
}

// What a tile does with its sums before they leave the registers (on its last k
// block only): scale row i by row_scale[i] (an RMSNorm's 1 / rms; the norm's
// weight is folded into the panels), then, with `act` (SwiGLU panels, NV = 2: a
// gate vector, then the same columns' up vector), write the activation
// [MR, kWidth] to act (rows ld_act apart) instead of the sums to c.
struct Epilogue {
  const float* row_scale = nullptr;
  float* act = nullptr;
  int64_t ld_act = 0;
};

// c[MR, NV * kWidth] = (accumulate ? c : 0) + a[MR, kc] @ w[kc, NV * kWidth]; rows of
// a lda apart, of c ldc apart; w contiguous (a panel's block); then `epilogue`.
template <int MR, int NV>
void Tile(int64_t kc, const float* a, int64_t lda, const float* w, float* c, int64_t ldc,
          bool accumulate, const Epilogue& epilogue) {
  Vec acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? Load(c + i * ldc + j * kWidth) : Vec{};
  }
  for (int64_t k = 0; k < kc; ++k) {
    Vec b[NV];
    for (int j = 0; j < NV; ++j) {
      // The panel streams in from L3 for the first row tile; the hardware's
      // prefetcher stops at each 4 KiB page (3-7% single-threaded).
      __builtin_prefetch(w + (k + 16) * NV * kWidth + j * kWidth);
      b[j] = Load(w + k * NV * kWidth + j * kWidth);
    }
    for (int i = 0; i < MR; ++i) {
      const float ai = a[i * lda + k];  // vector * scalar broadcasts it
      for (int j = 0; j < NV; ++j) acc[i][j] += b[j] * ai;
    }
  }
  if (epilogue.row_scale) {
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NV; ++j) acc[i][j] *= epilogue.row_scale[i];
    }
  }
  if constexpr (NV == 2) {
    if (epilogue.act) {
      for (int i = 0; i < MR; ++i) {
        Store(epilogue.act + i * epilogue.ld_act, SwiGLU(acc[i][0], acc[i][1]));
      }
      return;
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) Store(c + i * ldc + j * kWidth, acc[i][j]);
  }
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool,
                        const Epilogue&);

// Tile<mr, NV> for mr = 1 .. rows (the last row tile may be short).
template <int NV, int... MR>
constexpr auto MakeTiles(std::integer_sequence<int, MR...>) {
  return std::array<TileFn, sizeof...(MR)>{&Tile<MR + 1, NV>...};
}
constexpr auto kTiles = MakeTiles<kNV>(std::make_integer_sequence<int, kMR>{});

// SwiGLU panels: one gate and one up vector, kSwMR rows (as many accumulators as
// the plain tile).
constexpr int kSwMR = kMR * kNV / 2;
constexpr int kSwNR = 2 * kWidth;
constexpr auto kSwTiles = MakeTiles<2>(std::make_integer_sequence<int, kSwMR>{});

struct Problem {
  const float* x;
  const float* panels;
  float* y;
  int64_t M, K, N;
  // SwiGLU panels (pack_swiglu_panels): y is [M, P * kSwNR] scratch for the
  // pre-activations of all but the last k block, and the activation [M, F] goes to
  // act; null otherwise.
  float* act = nullptr;
  int64_t F = 0;
  // With an RMSNorm folded in: 1 / rms of each row of x, [M]; null otherwise.
  const float* row_scale = nullptr;
  bool add = false;  // y holds a residual on entry: y += x @ w
};

// Rows [m0, m1) times panel p.
void Item(const Problem& pr, int64_t p, int64_t m0, int64_t m1) {
  const int64_t n0 = p * kNR;
  const int64_t cols = std::min<int64_t>(kNR, pr.N - n0);
  const float* panel = pr.panels + p * pr.K * kNR;
  if (pr.K == 0) {
    if (pr.add) return;
    for (int64_t m = m0; m < m1; ++m) std::fill_n(pr.y + m * pr.N + n0, cols, 0.0f);
    return;
  }
  alignas(64) float edge[kMR * kNR];  // the padded last panel's tile
  for (int64_t k0 = 0; k0 < pr.K; k0 += kKC) {
    const int64_t kc = std::min(kKC, pr.K - k0);
    const bool accumulate = k0 > 0 || pr.add;
    const bool last = k0 + kKC >= pr.K;
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, m1 - m);
      const float* a = pr.x + m * pr.K + k0;
      const float* w = panel + k0 * kNR;
      float* c = pr.y + m * pr.N + n0;
      const Epilogue e{last && pr.row_scale ? pr.row_scale + m : nullptr};
      if (cols == kNR) {
        kTiles[mr - 1](kc, a, pr.K, w, c, pr.N, accumulate, e);
        continue;
      }
      if (accumulate) {
        for (int64_t i = 0; i < mr; ++i) std::memcpy(edge + i * kNR, c + i * pr.N, cols * 4);
      }
      kTiles[mr - 1](kc, a, pr.K, w, edge, kNR, accumulate, e);
      for (int64_t i = 0; i < mr; ++i) std::memcpy(c + i * pr.N, edge + i * kNR, cols * 4);
    }
  }
}

// Rows [m0, m1) times SwiGLU panel p: activation columns p * kWidth .. + kWidth.
void SwiGLUItem(const Problem& pr, int64_t p, int64_t m0, int64_t m1) {
  const int64_t j0 = p * kWidth;
  const int64_t cols = std::min<int64_t>(kWidth, pr.F - j0);
  const float* panel = pr.panels + p * pr.K * kSwNR;
  alignas(64) float edge[kSwMR * kWidth];  // the last panel's part tile
  for (int64_t k0 = 0; k0 < std::max<int64_t>(pr.K, 1); k0 += kKC) {
    const int64_t kc = std::min(kKC, pr.K - k0);
    const bool last = k0 + kKC >= pr.K;
    for (int64_t m = m0; m < m1; m += kSwMR) {
      const int64_t mr = std::min<int64_t>(kSwMR, m1 - m);
      const float* a = pr.x + m * pr.K + k0;
      float* c = pr.y + m * pr.N + p * kSwNR;
      const Epilogue e{last && pr.row_scale ? pr.row_scale + m : nullptr,
                       !last ? nullptr : cols == kWidth ? pr.act + m * pr.F + j0 : edge,
                       cols == kWidth ? pr.F : kWidth};
      kSwTiles[mr - 1](kc, a, pr.K, panel + k0 * kSwNR, c, pr.N, k0 > 0, e);
      if (last && cols < kWidth) {
        for (int64_t i = 0; i < mr; ++i) {
          std::copy_n(edge + i * kWidth, cols, pr.act + (m + i) * pr.F + j0);
        }
      }
    }
  }
}

// 1 / sqrt(mean(x[m]^2) + eps) for each row of x [M, K]: an RMSNorm's scale, in
// float32 like the model's.
std::vector<float> InverseRms(const float* x, int64_t M, int64_t K, float eps) {
  std::vector<float> out(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    Vec acc = {};
    int64_t k = 0;
    for (; k + kWidth <= K; k += kWidth) {
      const Vec v = Load(row + k);
      acc += v * v;
    }
    float sum = 0.0f;
    for (int l = 0; l < kWidth; ++l) sum += acc[l];
    for (; k < K; ++k) sum += row[k] * row[k];
    const float mean = K ? sum / static_cast<float>(K) : 0.0f;  // no NaN for K = 0
    out[m] = 1.0f / std::sqrt(mean + eps);
  }
  return out;
}

// One pool task per this many multiply-adds, at most one per thread: scheduling a
// task costs microseconds, the time of ~10^5 multiply-adds.
constexpr int64_t kMinMacsPerHelper = 1 << 18;

// x @ w into pr.y (and pr.act), panels and row blocks split over the pool.
// norm_eps >= 0: x is the input of an RMSNorm whose weight is folded into the
// panels, and the result is RMSNorm(x) @ w (the rows' 1 / rms applied to the sums).
void Multiply(ffi::ThreadPool& pool, Problem pr, int64_t panels, bool parallel,
              float norm_eps = -1.0f) {
  if (pr.M == 0 || pr.N == 0) return;
  std::vector<float> scale;
  if (norm_eps >= 0) {
    scale = InverseRms(pr.x, pr.M, pr.K, norm_eps);
    pr.row_scale = scale.data();
  }
  const int64_t row_blocks = (pr.M + kMC - 1) / kMC;
  const int64_t helpers = parallel ? pr.M * pr.K * pr.N / kMinMacsPerHelper : 0;
  rl_jax::ParallelFor(pool, panels * row_blocks, helpers, [pr, row_blocks](int64_t i) {
    const int64_t m0 = (i % row_blocks) * kMC;
    const int64_t m1 = std::min(pr.M, m0 + kMC);
    pr.act ? SwiGLUItem(pr, i / row_blocks, m0, m1) : Item(pr, i / row_blocks, m0, m1);
  });
}

// The panels of `layer` in a stack [L, P, K, W]: its first float, or nullptr when
// layer is not a scalar in [0, L).
const float* LayerPanels(ffi::Buffer<ffi::F32>& panels, ffi::Buffer<ffi::S32>& layer) {
  auto pd = panels.dimensions();
  if (pd.size() != 4 || layer.element_count() != 1) return nullptr;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return nullptr;
  return panels.typed_data() + l * pd[1] * pd[2] * pd[3];
}

// Whether x [M, K], panels [L, ceil(N / NR), K, NR], layer [] (in [0, L)) and y [M, N]
// fit; else the error that says what was expected (`name`, and `extra` words about
// other buffers).
ffi::Error CheckPanels(const char* name, const char* extra, ffi::Buffer<ffi::F32>& x,
                       ffi::Buffer<ffi::F32>& panels, ffi::Buffer<ffi::S32>& layer,
                       ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  auto pd = panels.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || yd.size() != 2 || pd[2] != xd[1] ||
      pd[3] != kNR || yd[0] != xd[0] || pd[1] != (yd[1] + kNR - 1) / kNR ||
      LayerPanels(panels, layer) == nullptr) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": expected x [M, K], panels [L, ceil(N / " + std::to_string(kNR) +
        "), K, " + std::to_string(kNR) + "], layer [] in [0, L)" + extra + " and result [M, N]");
  }
  return ffi::Error::Success();
}

// x @ w; with norm_eps >= 0, RMSNorm(x) @ w (Multiply). w: the panels of `layer`.
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                  ffi::Buffer<ffi::S32> layer, bool parallel, float norm_eps,
                  ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckPanels("matmul", "", x, panels, layer, y); e.failure()) return e;
  auto xd = x.dimensions();
  const Problem pr{x.typed_data(), LayerPanels(panels, layer), y->typed_data(),
                   xd[0], xd[1], y->dimensions()[1]};
  Multiply(pool, pr, panels.dimensions()[1], parallel, norm_eps);
  return ffi::Error::Success();
}

// residual + x @ w, summed in place in the residual's buffer (the result is aliased
// to it): a decoder layer's o and down projections with their residual connection.
ffi::Error MatmulAdd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> residual, bool parallel,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckPanels("matmul_add", ", residual", x, panels, layer, y); e.failure()) {
    return e;
  }
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (residual.element_count() != static_cast<size_t>(yd[0] * yd[1])) {
    return ffi::Error::InvalidArgument("matmul_add: the residual must be [M, N], as the result");
  }
  if (y->typed_data() != residual.typed_data()) {
    return ffi::Error::Internal("matmul_add: the result is not aliased to the residual");
  }
  Problem pr{x.typed_data(), LayerPanels(panels, layer), y->typed_data(), xd[0], xd[1], yd[1]};
  pr.add = true;
  Multiply(pool, pr, panels.dimensions()[1], parallel);
  return ffi::Error::Success();
}

// out[b] = table[clamp(ids[b], 0, V - 1)]: the step's token embeddings, every row
// requested before any is copied (they are cold: a decode step streams more
// weights and cache than the caches hold).
ffi::Error TakeRows(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                    ffi::ResultBuffer<ffi::F32> out) {
  auto td = table.dimensions();
  auto od = out->dimensions();
  const int64_t B = static_cast<int64_t>(ids.element_count());
  if (td.size() != 2 || od.size() != 2 || od[0] != B || od[1] != td[1] || td[0] == 0) {
    return ffi::Error::InvalidArgument("take_rows: expected table [V, D], ids [B], result [B, D]");
  }
  const int64_t V = td[0], D = td[1];
  const float* t = table.typed_data();
  const int32_t* id = ids.typed_data();
  auto row = [&](int64_t b) { return t + std::clamp<int64_t>(id[b], 0, V - 1) * D; };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t d = 0; d < D; d += 64 / sizeof(float)) __builtin_prefetch(row(b) + d);
  }
  for (int64_t b = 0; b < B; ++b) std::copy_n(row(b), D, out->typed_data() + b * D);
  return ffi::Error::Success();
}

// SwiGLU's activation silu(x @ gate) * (x @ up), [M, F], from panels that hold both
// (pack_swiglu_panels), computed from the accumulators of each tile's last k block:
// `scratch` [M, P * 2W] holds the earlier blocks' sums, the activation goes to `act`.
ffi::Error MatmulSwiGLU(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> panels, ffi::Buffer<ffi::S32> layer, bool parallel,
                        float norm_eps, ffi::ResultBuffer<ffi::F32> scratch,
                        ffi::ResultBuffer<ffi::F32> act) {
  auto xd = x.dimensions();
  auto pd = panels.dimensions();
  auto sd = scratch->dimensions();
  auto ad = act->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || sd.size() != 2 || ad.size() != 2 || pd[2] != xd[1] ||
      pd[3] != kSwNR || ad[0] != xd[0] || pd[1] != (ad[1] + kWidth - 1) / kWidth ||
      sd[0] != xd[0] || sd[1] != pd[1] * kSwNR || LayerPanels(panels, layer) == nullptr) {
    return ffi::Error::InvalidArgument(
        "matmul_swiglu: expected x [M, K], panels [L, ceil(F / " + std::to_string(kWidth) +
        "), K, " + std::to_string(kSwNR) + "], layer [] in [0, L), scratch [M, P * " +
        std::to_string(kSwNR) + "] and result [M, F]");
  }
  Problem pr{x.typed_data(), LayerPanels(panels, layer), scratch->typed_data(), xd[0], xd[1],
             sd[1]};
  pr.act = act->typed_data();
  pr.F = ad[1];
  Multiply(pool, pr, pd[1], parallel, norm_eps);
  return ffi::Error::Success();
}

}  // namespace

// The panel width NR the library was built for (it depends on the vector
// registers): pack_panels cuts weights to it.
extern "C" int RlJaxMatmulPanelWidth() { return kNR; }
// The same for SwiGLU panels (pack_swiglu_panels): a gate and an up vector.
extern "C" int RlJaxSwiGLUPanelWidth() { return kSwNR; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [L, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<bool>("parallel")
                                  .Attr<float>("norm_eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxMatmulAdd, MatmulAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [L, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual
                                  .Attr<bool>("parallel")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (aliased)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxTakeRows, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rows
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxMatmulSwiGLU, MatmulSwiGLU,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels [L, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<bool>("parallel")
                                  .Attr<float>("norm_eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scratch
                                  .Ret<ffi::Buffer<ffi::F32>>()  // act
);
