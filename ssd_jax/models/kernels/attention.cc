// Attention of a few new query tokens over a static-shape KV cache, float32, CPU:
//   q (B, T, KVH, G, hd), k / v (Bc, Sc, KVH, hd), mask (B, T, S) bool -> out (B, T, KVH, G, hd)
//   out[b, t, j, g] = sum_s softmax_s(scale * q[b, t, j, g] . k[b, s, j] | mask[b, t, s]) v[b, s, j]
// over the first B rows and S slots of the cache (Bc >= B, Sc >= S): a batch bucket or an attention
// window reads the whole cache buffer in place, so XLA never materialises a slice of it (a slice
// fused with the step's cache write made XLA copy every layer's whole cache).
// (grouped-query attention: the G query heads of a group share the group's key / value head).
//
// Built with rows_matmul.cc by ssd_jax/models/kernels/__init__.py; called through the XLA FFI
// ("ssd_jax_attention"). XLA:CPU runs the einsum formulation of decode / verify attention (two
// small batched dots with the cache transposed, a masked softmax) at several times its memory
// cost (experiments/results/attention_cpu.md); here each (row b, key/value head j) is one work item:
// every key and value vector is read once and used for all G * T query rows of the group, and
// slots past the last one any query row may see are never read (the cache is sized for the
// longest run; a row's context is usually shorter).
//
// A query row that sees no slot gets the mean of all S values, as the einsum reference does
// (its scores are all the float32 minimum there, so its softmax is uniform).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Vectors of the target's own width (cpu.h): 16-float vectors split into halves on AVX2 measured 10x
// slower at T = 5 than at T = 1 (issue 54), the -march=haswell build of this file against the native one.
using ssd_jax_kernels::kLanes;
using ssd_jax_kernels::loadv;
using ssd_jax_kernels::storev;
typedef ssd_jax_kernels::vf fv;  // kLanes floats
typedef int32_t iv __attribute__((vector_size(4 * SSD_JAX_LANES)));

inline float dot(const float* a, const float* b, int64_t n) {
  fv acc = fv{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += loadv(a + i) * loadv(b + i);
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for x <= 0 (scores minus their maximum), kLanes lanes: 2^n * e^r with |r| <= ln2 / 2, a
// degree-6 polynomial for e^r (relative error about 2e-7, float32's own rounding); lanes below
// -87 give 0.
inline fv exp_neg(fv x) {
  const fv lo = fv{} - 87.f;
  x = x < lo ? lo : x;  // lane-wise select
  const fv magic = fv{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const fv n = (x * 1.4426950408889634f + magic) - magic;
  const fv r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  fv p = fv{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const iv bits = (__builtin_convertvector(n, iv) + 127) << 23;
  fv scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const fv out = p * scale;
  return x <= lo ? fv{} : out;
}

struct Shape {
  int64_t B, T, KVH, G, hd, S, Sc;  // S: the slots attended (the mask's width); Sc: the cache's slots
};

// Where slot s of row b lives. Contiguous: row b's slots in order (row stride Sc). Paged: the pool's
// block pages[b, s / bs] (clamped to the pool, as XLA's gather clamps: an empty entry lies past the
// row's length, so no visible slot reads it), offset s % bs.
struct Slots {
  const int32_t* pages = nullptr;  // (B, P) block table, or none
  int64_t P = 0, bs = 0, N = 0;
  inline int64_t index(int64_t b, int64_t s, int64_t Sc) const {
    if (!pages) return b * Sc + s;
    const int64_t blk = std::min<int64_t>(std::max<int32_t>(pages[b * P + s / bs], 0), N - 1);
    return blk * bs + s % bs;
  }
};

// One (b, j) work item. scores: scratch of G * T * S floats.
void attend(const float* q, const float* k, const float* v, const bool* mask, float* out, const Shape& d,
            const Slots& at, float scale, int64_t b, int64_t j, float* scores) {
  const int64_t T = d.T, G = d.G, hd = d.hd, S = d.S, KVH = d.KVH;
  const bool* mb = mask + b * T * S;
  // the slots any query row of this batch row may see: [0, smax)
  int64_t smax = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = S - 1; s >= smax; --s)
      if (mb[t * S + s]) {
        smax = s + 1;
        break;
      }
  const int64_t kstride = KVH * hd;
  auto key = [&](int64_t s) { return k + at.index(b, s, d.Sc) * kstride + j * hd; };
  auto val = [&](int64_t s) { return v + at.index(b, s, d.Sc) * kstride + j * hd; };
  const int64_t rows = T * G;
  auto qrow = [&](int64_t t, int64_t g) { return q + (((b * T + t) * KVH + j) * G + g) * hd; };
  auto orow = [&](int64_t t, int64_t g) { return out + (((b * T + t) * KVH + j) * G + g) * hd; };
  const float neg = -std::numeric_limits<float>::infinity();
  // The slots read: spans of whole 16-slot chunks that some query row sees (an SSD tree step's rows see
  // their prefix and a few slots of the tree region past the cache's end, not the slots between). A
  // skipped chunk's scores would all be -inf and add exactly 0 to every sum below: the result is the
  // same bit for bit. The last span ends at smax (the softmax's scalar tail lies in it).
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t c = 0; c * 16 < smax; ++c) {
    const int64_t a = c * 16, e = std::min<int64_t>(smax, a + 16);
    bool any = e == smax;
    for (int64_t t = 0; t < T && !any; ++t)
      for (int64_t s = a; s < e; ++s)
        if (mb[t * S + s]) {
          any = true;
          break;
        }
    if (!any) continue;
    if (!spans.empty() && spans.back().second == a)
      spans.back().second = e;
    else
      spans.emplace_back(a, e);
  }
  // scores: every key read once, dotted with all rows of the group
  for (const auto& [a, e] : spans)
    for (int64_t s = a; s < e; ++s) {
      const float* ks = key(s);
      for (int64_t t = 0; t < T; ++t) {
        const bool vis = mb[t * S + s];
        for (int64_t g = 0; g < G; ++g) scores[(t * G + g) * S + s] = vis ? scale * dot(qrow(t, g), ks, hd) : neg;
      }
    }
  // softmax per row over [0, smax) (rows that see nothing: uniform over all S)
  std::vector<char> blind(rows, 0);
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * S;
    float m = neg;
    for (const auto& [a, e] : spans)
      for (int64_t s = a; s < e; ++s) m = std::max(m, sr[s]);
    if (m == neg) {
      blind[r] = 1;
      continue;
    }
    fv tot = fv{};
    int64_t s = 0;
    for (const auto& [a, b] : spans)
      for (s = a; s + kLanes <= b; s += kLanes) {
        const fv e = exp_neg(loadv(sr + s) - m);
        storev(sr + s, e);
        tot += e;
      }
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += tot[l];
    for (; s < smax; ++s) {
      const float e = sr[s] == neg ? 0.f : std::exp(sr[s] - m);
      sr[s] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (const auto& [a, b] : spans)
      for (s = a; s < b; ++s) sr[s] *= inv;
  }
  // output: every value read once, accumulated into all rows of the group
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) std::memset(orow(t, g), 0, sizeof(float) * hd);
  for (const auto& [a, b] : spans)
    for (int64_t s = a; s < b; ++s) {
      const float* vs = val(s);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = t * G + g;
          const float p = scores[r * S + s];
          if (blind[r] || p == 0.f) continue;
          float* o = orow(t, g);
          int64_t i = 0;
          for (; i + kLanes <= hd; i += kLanes) storev(o + i, loadv(o + i) + p * loadv(vs + i));
          for (; i < hd; ++i) o[i] += p * vs[i];
        }
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      if (!blind[t * G + g]) continue;
      float* o = orow(t, g);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t i = 0; i < hd; ++i) o[i] += val(s)[i];
      for (int64_t i = 0; i < hd; ++i) o[i] /= float(S);
    }
}

struct Work {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  Shape d;
  Slots at;
  float scale;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void drain() {
    std::vector<float> scores(d.T * d.G * d.S);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      attend(q, k, v, mask, out, d, at, scale, i / d.KVH, i % d.KVH, scores.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs the (b, j) items on XLA's thread pool (and this thread).
ffi::Error Run(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  work->items = work->d.B * work->d.KVH;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), ssd_jax_kernels::usable_cores()));
  const int64_t helpers = std::min(threads, work->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
  return ffi::Error::Success();
}

std::shared_ptr<Work> NewWork(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                              ffi::Buffer<ffi::PRED>& mask, ffi::ResultBuffer<ffi::F32>& out, float scale) {
  auto work = std::make_shared<Work>();
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->mask = reinterpret_cast<const bool*>(mask.untyped_data());
  work->out = (*out).typed_data();
  work->d = Shape{qd[0], qd[1], qd[2], qd[3], qd[4], md[2], kd[1]};
  work->scale = scale;
  return work;
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                         float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || md.size() != 3 || vd.size() != 4 || kd[0] < qd[0] || kd[2] != qd[2] ||
      kd[3] != qd[4] || md[0] != qd[0] || md[1] != qd[1] || md[2] > kd[1] ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument(
        "attention: want q (B,T,KVH,G,hd), k/v (Bc>=B,Sc>=S,KVH,hd) alike, mask (B,T,S)");
  return Run(pool, NewWork(q, k, v, mask, out, scale));
}

// k / v: a pool of N blocks (N, bs, KVH, hd); pages (B, P): each row's blocks, P * bs >= S.
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::PRED> mask,
                              ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions(), pd = pages.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || md.size() != 3 || vd.size() != 4 || pd.size() != 2 || kd[2] != qd[2] ||
      kd[3] != qd[4] || md[0] != qd[0] || md[1] != qd[1] || pd[0] != qd[0] || pd[1] * kd[1] < md[2] ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument(
        "paged attention: want q (B,T,KVH,G,hd), k/v pools (N,bs,KVH,hd) alike, pages (B,P) with P*bs >= S, "
        "mask (B,T,S)");
  auto work = NewWork(q, k, v, mask, out, scale);
  work->at = Slots{pages.typed_data(), pd[1], kd[1], kd[0]};
  return Run(pool, work);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
