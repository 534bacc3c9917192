// One decode step of grouped-query attention over a paged KV cache, on CPU (XLA FFI).
//
// Why a hand-written kernel: XLA:CPU runs the decode score and value matmuls
// as batched [R, hd] x [hd, S] products (R = query heads per KV head, often 1
// or 2), which stream the cache at a fraction of memory bandwidth, and it reads
// every page of a row's table, filled or not. This kernel reads only the
// positions a row can see (0 .. its own), once, front to back, page by page:
//
//   q        [B, K, R, hd]           float32  queries (RoPE applied)
//   k, v     [B, K, hd]              float32  this step's key and value
//   keys     [K, L, N, P/16, hd, 16] float32  N pages of P positions per kv head and
//                                             layer, a page's keys in tiles of 16
//                                             positions, each one contiguous [hd, 16]
//   values   [K, L, N, P, hd]        float32
//   table    [B, W]                  int32    row b's position p at page table[b, p / P]
//   pos      [B]                     int32    this step's position of each row: its key
//                                             and value are written there, and it sees
//                                             positions 0 .. pos
//   live     [B]                     int32    rows that write (0: the row ended, its
//                                             pages may be another's: it writes
//                                             nothing, and its attention is zeros)
//   layer    []                      int32    the layer whose pages this step uses
// results:
//   out      [B, K, R, hd]           float32  softmax(scale * q k^T) v
//   keys, values                              the cache with k, v written at `pos` of
//                                             `layer`: aliased to the inputs (the
//                                             decode step's scan over layers carries
//                                             the whole stack)
//
// Writing the new key here rather than in XLA: a key is one float in each of hd
// cache lines of its tile, which the score loop reads right after anyway.
//
// PagedAttentionQKV does the same from the q/k/v projection's rows
// [B, (H + 2K) hd], splitting the heads and applying RoPE itself.
//
// Same math as the model's attention (float32 scores, max-subtracted softmax,
// probabilities times values); summation order differs, so results agree to
// float32 rounding, not bit for bit. Work is split over (b, k) pairs on XLA's
// intra-op thread pool; the calling thread takes its share too.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "_cpu_common.h"

namespace ffi = xla::ffi;

namespace {

// dst = x rotated by the angles (cos, sin), pairs (i, i + hd/2): RoPE's "rotate
// half" layout, as rl_jax.models.layers.apply_rope.
void Rope(const float* x, const float* cos, const float* sin, int64_t hd, float* dst) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    dst[i] = x[i] * cos[i] - x[i + half] * sin[i];
    dst[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

// One vector of floats: GCC/Clang vector extensions, so the same code compiles to
// AVX-512, AVX2 (two halves) or NEON (four) for whatever -march=native finds. The
// inner loops below load and multiply-add whole vectors only, without branches,
// so the accumulators stay in registers.
constexpr int kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec LoadVec(const float* p) { return rl_jax::Load<Vec>(p); }

// s[r * stride + j] = scale * q[r] . key(lo + j) for RR query rows, j < n. Keys come in
// tiles of kLanes slots, [hd, kLanes] each and contiguous, so a tile is one
// sequential read and one vector per head dimension. kChains interleaved
// accumulators per row: one chain of dependent multiply-adds would wait on each
// add's latency.
constexpr int kChains = 4;

template <int RR>
void Scores(const float* q, const float* tiles, int64_t hd, int64_t lo, int64_t n,
            float scale, float* s, int64_t stride) {
  for (int64_t t = lo / kLanes; t * kLanes < lo + n; ++t) {
    const float* tile = tiles + t * hd * kLanes;
    Vec acc[kChains][RR] = {};
    int64_t d = 0;
    for (; d + kChains <= hd; d += kChains) {
      for (int u = 0; u < kChains; ++u) {
        const Vec kv = LoadVec(tile + (d + u) * kLanes);
        for (int r = 0; r < RR; ++r) acc[u][r] += q[r * hd + d + u] * kv;
      }
    }
    for (; d < hd; ++d) {
      const Vec kv = LoadVec(tile + d * kLanes);
      for (int r = 0; r < RR; ++r) acc[0][r] += q[r * hd + d] * kv;
    }
    // Lanes of this tile inside [lo, lo + n).
    const int64_t first = std::max<int64_t>(lo - t * kLanes, 0);
    const int64_t last = std::min<int64_t>(lo + n - t * kLanes, kLanes);
    for (int r = 0; r < RR; ++r) {
      Vec total = acc[0][r];
      for (int u = 1; u < kChains; ++u) total += acc[u][r];
      total *= scale;
      float lanes[kLanes];
      std::memcpy(lanes, &total, sizeof(lanes));
      std::memcpy(s + r * stride + t * kLanes + first - lo, lanes + first,
                  (last - first) * sizeof(float));
    }
  }
}

// out[r, :] = sum_j p[r, j] vrows[j][:], C * kLanes head dimensions per pass (hd a
// multiple of that): RR x C accumulators while the rows stream (a row's value rows lie
// on its pages, anywhere in the cache).
template <int RR, int C>
void WeightedRows(const float* p, const float* const* vrows, int64_t hd, int64_t n, float* out) {
  for (int64_t d0 = 0; d0 < hd; d0 += C * kLanes) {
    Vec acc[RR][C] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vrows[j] + d0;
      Vec vv[C];
      for (int c = 0; c < C; ++c) vv[c] = LoadVec(vr + c * kLanes);
      for (int r = 0; r < RR; ++r) {
        const float pj = p[r * n + j];
        for (int c = 0; c < C; ++c) acc[r][c] += pj * vv[c];
      }
    }
    for (int r = 0; r < RR; ++r) {
      for (int c = 0; c < C; ++c) {
        std::memcpy(out + r * hd + d0 + c * kLanes, &acc[r][c], sizeof(Vec));
      }
    }
  }
}

// Scaled scores -> probabilities, in place: `rows` rows of n slots. The max and the
// total run over whole vectors (a scalar float reduction does not vectorise
// without reassociation), the exponentials in a loop of their own, which does.
void Softmax(float* s, int64_t rows, int64_t n) {
  const int64_t whole = n - n % kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * n;
    float m = -INFINITY;
    if (whole) {
      Vec vm = LoadVec(sr);
      for (int64_t j = kLanes; j < whole; j += kLanes) {
        const Vec x = LoadVec(sr + j);
        vm = x > vm ? x : vm;
      }
      for (int l = 0; l < kLanes; ++l) m = std::max(m, vm[l]);
    }
    for (int64_t j = whole; j < n; ++j) m = std::max(m, sr[j]);
    Vec vt = {};
    for (int64_t j = 0; j < whole; j += kLanes) {
      const Vec e = rl_jax::ExpNonpositive(LoadVec(sr + j) - m);
      std::memcpy(sr + j, &e, sizeof(e));
      vt += e;
    }
    if (whole < n) {  // the tail in one vector, padded with -inf (exp: 0)
      float tail[kLanes];
      std::fill_n(tail, kLanes, -INFINITY);
      std::memcpy(tail, sr + whole, (n - whole) * sizeof(float));
      const Vec e = rl_jax::ExpNonpositive(LoadVec(tail) - m);
      std::memcpy(tail, &e, sizeof(e));
      std::memcpy(sr + whole, tail, (n - whole) * sizeof(float));
      vt += e;
    }
    float total = 0.0f;
    for (int l = 0; l < kLanes; ++l) total += vt[l];
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
  }
}

// One pool task per this many cache floats read, at most one per thread: for a
// short cache, scheduling a task costs more than it saves.
constexpr int64_t kMinFloatsPerHelper = 1 << 16;

struct PagedProblem {
  const float* q;
  const float* k_new;
  const float* v_new;
  // The fused form (PagedAttentionQKV): q is the projection's row [B, (H + 2K) hd]
  // (k_new, v_new unused), rotated here with cos, sin [B, hd / 2]; null otherwise.
  const float* cos = nullptr;
  const float* sin = nullptr;
  float* keys;    // this layer's [K] blocks of N pages, stride layer_stride per kv head
  float* values;
  int64_t head_stride;  // floats between kv heads' blocks (L N P hd)
  const int32_t* table;
  const int32_t* pos;
  const int32_t* live;
  float scale;
  float* out;
  int64_t B, K, R, hd, N, P, width;  // width: pages per table row
};

void AttendPaged(const PagedProblem& p, int64_t item, std::vector<float>& scores,
                 std::vector<float>& rotated, std::vector<const float*>& vrows) {
  const int64_t b = item / p.K, k = item % p.K;
  const int64_t R = p.R, hd = p.hd, P = p.P;
  float* out = p.out + item * R * hd;
  const int32_t* table = p.table + b * p.width;
  const int64_t at = p.pos[b];
  if (!p.live[b] || at < 0 || at >= p.width * P) {
    std::fill(out, out + R * hd, 0.0f);
    return;
  }
  const float *q, *k_new, *v_new;
  if (!p.cos) {
    q = p.q + item * R * hd;
    k_new = p.k_new + item * hd;
    v_new = p.v_new + item * hd;
  } else {
    const int64_t H = p.K * R;
    const float* row = p.q + b * (H + 2 * p.K) * hd;
    const float* cos = p.cos + b * hd / 2;
    const float* sin = p.sin + b * hd / 2;
    rotated.resize((R + 1) * hd);
    for (int64_t r = 0; r < R; ++r) Rope(row + (k * R + r) * hd, cos, sin, hd, &rotated[r * hd]);
    Rope(row + (H + k) * hd, cos, sin, hd, &rotated[R * hd]);
    q = rotated.data();
    k_new = q + R * hd;
    v_new = row + (H + p.K + k) * hd;
  }
  float* keys = p.keys + k * p.head_stride;
  float* values = p.values + k * p.head_stride;
  const int64_t n = at + 1;
  const int64_t pages = (n + P - 1) / P;
  for (int64_t j = 0; j < pages; ++j) {
    if (table[j] < 0 || table[j] >= p.N) {  // a position without a page: nothing to read
      std::fill(out, out + R * hd, 0.0f);
      return;
    }
  }
  {  // this step's key and value
    const int64_t page = table[at / P], off = at % P;
    float* tile = keys + (page * P + off / kLanes * kLanes) * hd + off % kLanes;
    for (int64_t d = 0; d < hd; ++d) tile[d * kLanes] = k_new[d];
    std::memcpy(values + (page * P + off) * hd, v_new, hd * sizeof(float));
  }
  if (static_cast<int64_t>(scores.size()) < 4 * n) scores.resize(4 * n);
  vrows.resize(n);
  for (int64_t j = 0; j < pages; ++j) {
    const float* base = values + table[j] * P * hd;
    for (int64_t o = 0; o < P && j * P + o < n; ++o) vrows[j * P + o] = base + o * hd;
  }
  float* s = scores.data();
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const float* qr = q + r0 * hd;
    float* o = out + r0 * hd;
    const int64_t rr = std::min<int64_t>(4, R - r0);
    for (int64_t j = 0; j < pages; ++j) {
      const float* tiles = keys + table[j] * P * hd;
      const int64_t m = std::min<int64_t>(P, n - j * P);
      switch (rr) {
        case 1: Scores<1>(qr, tiles, hd, 0, m, p.scale, s + j * P, n); break;
        case 2: Scores<2>(qr, tiles, hd, 0, m, p.scale, s + j * P, n); break;
        case 3: Scores<3>(qr, tiles, hd, 0, m, p.scale, s + j * P, n); break;
        default: Scores<4>(qr, tiles, hd, 0, m, p.scale, s + j * P, n); break;
      }
    }
    Softmax(s, rr, n);
    const float* const* rows = vrows.data();
    if (rr <= 2 && hd % (4 * kLanes) == 0) {
      if (rr == 1) WeightedRows<1, 4>(s, rows, hd, n, o); else WeightedRows<2, 4>(s, rows, hd, n, o);
    } else if (hd % (2 * kLanes) == 0) {
      switch (rr) {
        case 1: WeightedRows<1, 2>(s, rows, hd, n, o); break;
        case 2: WeightedRows<2, 2>(s, rows, hd, n, o); break;
        case 3: WeightedRows<3, 2>(s, rows, hd, n, o); break;
        default: WeightedRows<4, 2>(s, rows, hd, n, o); break;
      }
    } else {
      switch (rr) {
        case 1: WeightedRows<1, 1>(s, rows, hd, n, o); break;
        case 2: WeightedRows<2, 1>(s, rows, hd, n, o); break;
        case 3: WeightedRows<3, 1>(s, rows, hd, n, o); break;
        default: WeightedRows<4, 1>(s, rows, hd, n, o); break;
      }
    }
  }
}

void RunPaged(ffi::ThreadPool& pool, const PagedProblem& problem, bool parallel) {
  int64_t last = 0;
  for (int64_t b = 0; b < problem.B; ++b) {
    if (problem.live[b]) last = std::max<int64_t>(last, problem.pos[b]);
  }
  const int64_t reads = (last + 1) * problem.hd * 2;
  const int64_t items = problem.B * problem.K;
  const int64_t helpers = parallel ? items * reads / kMinFloatsPerHelper : 0;
  rl_jax::ParallelFor(pool, items, helpers, [problem](int64_t item) {
    thread_local std::vector<float> scores, rotated;
    thread_local std::vector<const float*> vrows;
    AttendPaged(problem, item, scores, rotated, vrows);
  });
}

// Whether keys [K,L,N,P/16,hd,16], values [K,L,N,P,hd] (updated in place: the results
// aliased to them), table [B,R], pos [B], live [B] and layer [] fit B rows of K kv heads
// of width hd; sets the problem's cache pointers to the layer's pages.
ffi::Error CheckPaged(ffi::Buffer<ffi::F32>& keys, ffi::Buffer<ffi::F32>& values,
                      ffi::ResultBuffer<ffi::F32>& keys_out,
                      ffi::ResultBuffer<ffi::F32>& values_out, ffi::Buffer<ffi::S32>& table,
                      ffi::Buffer<ffi::S32>& pos, ffi::Buffer<ffi::S32>& live,
                      ffi::Buffer<ffi::S32>& layer, int64_t B, int64_t K, int64_t hd,
                      PagedProblem* p) {
  auto kd = keys.dimensions();
  auto vd = values.dimensions();
  auto td = table.dimensions();
  if (kd.size() != 6 || vd.size() != 5 || td.size() != 2 || kd[0] != K || vd[0] != K ||
      kd[1] != vd[1] || kd[2] != vd[2] || kd[3] * kLanes != vd[3] || kd[4] != hd ||
      kd[5] != kLanes || vd[4] != hd || hd % kLanes != 0 || td[0] != B ||
      pos.element_count() != static_cast<size_t>(B) ||
      live.element_count() != static_cast<size_t>(B) || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "paged attention: expected keys [K,L,N,P/16,hd,16], values [K,L,N,P,hd] (hd a "
        "multiple of 16), table [B,R], pos [B], live [B], layer []");
  }
  const int64_t l = layer.typed_data()[0], L = vd[1];
  if (l < 0 || l >= L) {
    return ffi::Error::InvalidArgument("paged attention: layer " + std::to_string(l) +
                                       " is outside the cache's " + std::to_string(L));
  }
  if (keys_out->typed_data() != keys.typed_data() ||
      values_out->typed_data() != values.typed_data()) {
    return ffi::Error::Internal("paged attention: the cache results are not aliased");
  }
  p->N = vd[2];
  p->P = vd[3];
  p->head_stride = L * p->N * p->P * hd;
  const int64_t offset = l * p->N * p->P * hd;
  p->keys = keys_out->typed_data() + offset;
  p->values = values_out->typed_data() + offset;
  p->table = table.typed_data();
  p->width = td[1];
  p->pos = pos.typed_data();
  p->live = live.typed_data();
  p->B = B;
  p->K = K;
  p->hd = hd;
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                          ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> pos,
                          ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::S32> layer, float scale,
                          bool parallel, ffi::ResultBuffer<ffi::F32> out,
                          ffi::ResultBuffer<ffi::F32> keys_out,
                          ffi::ResultBuffer<ffi::F32> values_out) {
  auto qd = q.dimensions();
  if (qd.size() != 4 || k_new.element_count() != static_cast<size_t>(qd[0] * qd[1] * qd[3]) ||
      v_new.element_count() != k_new.element_count()) {
    return ffi::Error::InvalidArgument(
        "paged attention: expected q [B,K,R,hd], k and v [B,K,hd]");
  }
  PagedProblem problem{};
  if (auto e = CheckPaged(keys, values, keys_out, values_out, table, pos, live, layer, qd[0],
                          qd[1], qd[3], &problem);
      e.failure()) {
    return e;
  }
  problem.q = q.typed_data();
  problem.k_new = k_new.typed_data();
  problem.v_new = v_new.typed_data();
  problem.R = qd[2];
  problem.scale = scale;
  problem.out = out->typed_data();
  RunPaged(pool, problem, parallel);
  return ffi::Error::Success();
}

// PagedAttention on the q/k/v projection's rows: qkv [B, (H + 2K) hd] (H = K R query
// heads, then K key heads, then K value heads, as the decode step's fused
// projection), q and k rotated here (RoPE) with cos, sin [B, hd / 2]; out
// [B, H hd], the same floats as [B, K, R, hd]. Saves the decode step's slices,
// rotations and copies of q, k and v in XLA.
ffi::Error PagedAttentionQKV(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv,
                             ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                             ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                             ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> pos,
                             ffi::Buffer<ffi::S32> live, ffi::Buffer<ffi::S32> layer,
                             float scale, bool parallel, ffi::ResultBuffer<ffi::F32> out,
                             ffi::ResultBuffer<ffi::F32> keys_out,
                             ffi::ResultBuffer<ffi::F32> values_out) {
  auto xd = qkv.dimensions();
  auto kd = keys.dimensions();
  const int64_t K = kd.size() == 6 ? kd[0] : 0, hd = kd.size() == 6 ? kd[4] : 0;
  const int64_t B = xd.size() == 2 ? xd[0] : 0;
  PagedProblem problem{};
  if (auto e = CheckPaged(keys, values, keys_out, values_out, table, pos, live, layer, B, K,
                          hd, &problem);
      e.failure()) {
    return e;
  }
  const int64_t H = xd.size() == 2 && hd ? xd[1] / hd - 2 * K : 0;
  if (H <= 0 || H % K != 0 || xd[1] != (H + 2 * K) * hd ||
      cos.element_count() != static_cast<size_t>(B * hd / 2) ||
      sin.element_count() != static_cast<size_t>(B * hd / 2) ||
      out->element_count() != static_cast<size_t>(B * H * hd)) {
    return ffi::Error::InvalidArgument(
        "paged attention (qkv): expected qkv [B,(H+2K)hd] (H a multiple of K), cos and "
        "sin [B,hd/2], result [B,H hd]");
  }
  problem.q = qkv.typed_data();
  problem.cos = cos.typed_data();
  problem.sin = sin.typed_data();
  problem.R = H / K;
  problem.scale = scale;
  problem.out = out->typed_data();
  RunPaged(pool, problem, parallel);
  return ffi::Error::Success();
}

}  // namespace

#define RL_JAX_PAGED_BINDING                                                \
  ffi::Ffi::Bind()                                                          \
      .Ctx<ffi::ThreadPool>()                                               \
      .Arg<ffi::Buffer<ffi::F32>>() /* q, or qkv */                         \
      .Arg<ffi::Buffer<ffi::F32>>() /* k, or cos */                         \
      .Arg<ffi::Buffer<ffi::F32>>() /* v, or sin */                         \
      .Arg<ffi::Buffer<ffi::F32>>() /* keys */                              \
      .Arg<ffi::Buffer<ffi::F32>>() /* values */                            \
      .Arg<ffi::Buffer<ffi::S32>>() /* table */                             \
      .Arg<ffi::Buffer<ffi::S32>>() /* pos */                               \
      .Arg<ffi::Buffer<ffi::S32>>() /* live */                              \
      .Arg<ffi::Buffer<ffi::S32>>() /* layer */                             \
      .Attr<float>("scale")                                                 \
      .Attr<bool>("parallel")                                               \
      .Ret<ffi::Buffer<ffi::F32>>() /* out */                               \
      .Ret<ffi::Buffer<ffi::F32>>() /* keys (aliased) */                    \
      .Ret<ffi::Buffer<ffi::F32>>() /* values (aliased) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxPagedAttention, PagedAttention, RL_JAX_PAGED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxPagedAttentionQKV, PagedAttentionQKV, RL_JAX_PAGED_BINDING);
