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
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Vectors of the target's own width (cpu.h): 16-float vectors split into halves on AVX2 measured 10x
// slower at T = 5 than at T = 1 (issue 54), the -march=haswell build of this file against the native one.
using ssd_jax_kernels::kLanes;
using ssd_jax_kernels::kRegs;
using ssd_jax_kernels::loadv;
using ssd_jax_kernels::storev;
typedef ssd_jax_kernels::vf fv;  // kLanes floats
typedef int32_t iv __attribute__((vector_size(4 * SSD_JAX_LANES)));

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

// ---- Register blocking (issue 54). One dot product per (slot, query row) with a horizontal sum each, and
// a load / FMA / store of a row's whole output vector per (slot, row), made the cost grow with T at
// several times XLA's rate (T = 16 twice the einsum's time). Both products of a work item are small matrix
// products over its rows r = t * G + g (R = T * G of them) and the slots the spans cover:
//   scores (R x S) = Q (R x hd) . K^T        out (R x hd) = P (R x S) . V
// and both are done by one register tile (Tile below): kRows rows x kVecs vectors of accumulators, kept in
// registers over a whole run of the shared dimension, each step loading kVecs vectors of the right-hand
// side and broadcasting kRows left-hand floats for kRows * kVecs FMAs; every result is stored once.
// For the scores the right-hand side is K^T: each run of keys is transposed once (shuffles in registers)
// into slot-major rows, so a score vector holds kLanes slots and no horizontal sum is needed. With few
// rows (a decode step's R = G) the transpose would cost more than it saves: there each dot is a vector of
// partial products and kLanes of them are summed together by one shuffle tree (score_dots).

// 6 x 4 = 24 accumulators where the target has 32 vector registers, 4 x 3 = 12 where it has 16; the rest
// hold the right-hand vectors and the broadcast (3 x 4 on AVX2 spilled two accumulators to the stack and
// ran at half the speed).
constexpr int kRows = kRegs >= 32 ? 6 : 4;
constexpr int kVecs = kRegs >= 32 ? 4 : 3;
// Below this many rows the scores are dot products (score_dots), from it on a product with K^T (measured:
// with 16-float vectors the transpose pays from 4 rows on, with 8-float ones from 8).
constexpr int kTransposeRows = kLanes >= 16 ? 4 : 8;

// c[m][0, nh * kLanes) (=, or += unless first) sum over x in [x0, x1) of a[m][x] * (b + off[x])[0, nh * kLanes)
struct Tile {
  const float* a[kRows];
  float* c[kRows];
  const float* b;
  const int64_t* off;
  int64_t x0, x1;
  bool first;
};

template <int MR, int NH>
void tile(const Tile& t) {
  fv acc[MR][NH];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < NH; ++h) acc[m][h] = t.first ? fv{} : loadv(t.c[m] + h * kLanes);
  for (int64_t x = t.x0; x < t.x1; ++x) {
    const float* bx = t.b + t.off[x];
    fv bv[NH];
    for (int h = 0; h < NH; ++h) bv[h] = loadv(bx + h * kLanes);
    for (int m = 0; m < MR; ++m) {
      const fv am = t.a[m][x] - fv{};  // a broadcast (x + 0 would not fold: -0 + 0 = +0)
      for (int h = 0; h < NH; ++h) acc[m][h] += am * bv[h];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < NH; ++h) storev(t.c[m] + h * kLanes, acc[m][h]);
}

// tile<MR, NH> for every MR <= kRows, NH <= kVecs (the last block of rows or vectors may be short)
typedef void (*TileFn)(const Tile&);
template <size_t... I>
constexpr std::array<TileFn, sizeof...(I)> tiles(std::index_sequence<I...>) {
  return {&tile<int(I / kVecs) + 1, int(I % kVecs) + 1>...};
}
constexpr auto kTiles = tiles(std::make_index_sequence<kRows * kVecs>());

// c rows [0, R) x vectors [0, nvec) by tiles: rows(r) and cols(r) give row r's left-hand and result
// pointers; b + off[x] is the right-hand row x.
template <class A, class C>
void product(int64_t R, int64_t nvec, A rows, C cols, const float* b, const int64_t* off, int64_t x0, int64_t x1,
             bool first) {
  for (int64_t v0 = 0; v0 < nvec; v0 += kVecs) {
    const int nh = int(std::min<int64_t>(kVecs, nvec - v0));
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
      const int mr = int(std::min<int64_t>(kRows, R - r0));
      Tile t{{}, {}, b + v0 * kLanes, off, x0, x1, first};
      for (int m = 0; m < mr; ++m) {
        t.a[m] = rows(r0 + m);
        t.c[m] = cols(r0 + m) + v0 * kLanes;
      }
      kTiles[(mr - 1) * kVecs + (nh - 1)](t);
    }
  }
}

// Shuffle masks built lane by lane in a fully unrolled loop: GCC folds them to constants, so each
// __builtin_shuffle below is one or two permute instructions.
template <class F>
inline iv lanes(F f) {
  iv m;
#pragma GCC unroll 16
  for (int l = 0; l < kLanes; ++l) m[l] = f(l);
  return m;
}

// In-register transpose of kLanes vectors (a[l][i] -> a[i][l]): log2(kLanes) rounds, each interleaving
// vector i with vector i + kLanes / 2 (lanes 2n and 2n + 1 of the outputs 2i and 2i + 1 take lane n, resp.
// kLanes / 2 + n, of the two); every round moves one bit of the lane index into the vector index.
inline void transpose(fv* a) {
  const iv lo = lanes([](int l) { return (l % 2) * kLanes + l / 2; });
  const iv hi = lanes([](int l) { return (l % 2) * kLanes + kLanes / 2 + l / 2; });
  for (int round = 1; round < kLanes; round *= 2) {
    fv b[kLanes];
    for (int i = 0; i < kLanes / 2; ++i) {
      b[2 * i] = __builtin_shuffle(a[i], a[i + kLanes / 2], lo);
      b[2 * i + 1] = __builtin_shuffle(a[i], a[i + kLanes / 2], hi);
    }
    for (int i = 0; i < kLanes; ++i) a[i] = b[i];
  }
}

// kt[i * ld + s - a] = key(s)[i] for the slots s in [a, e), i < hd, in groups of kLanes slots (a group
// past e repeats slot e - 1: scores computed, never read).
void transpose_keys(const float* k, const int64_t* off, int64_t a, int64_t e, int64_t hd, float* kt, int64_t ld) {
  for (int64_t s0 = a; s0 < e; s0 += kLanes) {
    const float* ks[kLanes];
    for (int l = 0; l < kLanes; ++l) ks[l] = k + off[std::min(s0 + l, e - 1)];
    float* dst = kt + (s0 - a);
    int64_t i = 0;
    for (; i + kLanes <= hd; i += kLanes) {
      fv x[kLanes];
      for (int l = 0; l < kLanes; ++l) x[l] = loadv(ks[l] + i);
      transpose(x);
      for (int l = 0; l < kLanes; ++l) storev(dst + (i + l) * ld, x[l]);
    }
    for (; i < hd; ++i)
      for (int l = 0; l < kLanes; ++l) dst[i * ld + l] = ks[l][i];
  }
}

// One step of the shuffle tree, H = kLanes / 2, kLanes / 4, ..., 1: in each block of 2H lanes of the
// result, the first H lanes are p's block folded in half (lane i + lane i + H), the last H q's.
template <int H>
inline fv fold(fv p, fv q) {
  const iv lo = lanes([](int l) {
    const int blk = l & ~(2 * H - 1), w = l & (2 * H - 1);
    return w < H ? blk + w : kLanes + blk + w - H;  // index kLanes + i: lane i of q
  });
  return __builtin_shuffle(p, q, lo) + __builtin_shuffle(p, q, lo + H);
}

// a[0, N) -> a[0, N / 2): vector i folds a[i] with a[i + N / 2]; after all steps lane l of a[0] is the sum
// of the lanes of the original a[l] (pairing i with i + N / 2 is what puts the sums in order).
template <int N>
inline void fold_all(fv* a) {
  if constexpr (N > 1) {
    for (int i = 0; i < N / 2; ++i) a[i] = fold<N / 2>(a[i], a[i + N / 2]);
    fold_all<N / 2>(a);
  }
}

// Few rows: dst[m][n] = q[m] . k[n] for MR rows and NS = kLanes / MR slots, n < n_ok (slots past the end
// repeat the last one: computed, not stored). kLanes accumulators of partial products (4 query and NS key
// vectors loaded per 4 * NS FMAs at MR = 4), summed by one shuffle tree of kLanes - 1 folds.
template <int MR>
inline void score_dots(const float* const* q, const float* const* k, int64_t hd, float* const* dst, int64_t n_ok) {
  constexpr int NS = kLanes / MR;
  fv acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= hd; i += kLanes) {
    fv kv[NS];
    for (int n = 0; n < NS; ++n) kv[n] = loadv(k[n] + i);
    for (int m = 0; m < MR; ++m) {
      const fv qv = loadv(q[m] + i);
      for (int n = 0; n < NS; ++n) acc[m * NS + n] += qv * kv[n];
    }
  }
  fold_all<kLanes>(acc);
  fv sums = acc[0];  // lane m * NS + n: q[m] . k[n]
  for (; i < hd; ++i)  // hd not a multiple of kLanes: the last columns lane by lane
    for (int l = 0; l < kLanes; ++l) sums[l] += q[l / NS][i] * k[l % NS][i];
  alignas(64) float d[kLanes];
  storev(d, sums);
  if (n_ok == NS)  // a whole tile: copies of a constant size
    for (int m = 0; m < MR; ++m) std::memcpy(dst[m], d + m * NS, sizeof(float) * NS);
  else
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < n_ok; ++n) dst[m][n] = d[m * NS + n];
}

// Slots per run: the run's transposed keys (scores) or value slices (output) stay in L1 (16 KiB) while
// every block of rows uses them.
inline int64_t run_slots(int64_t floats_per_slot) {
  return std::max<int64_t>(16, (4096 / std::max<int64_t>(1, floats_per_slot)) / 16 * 16);
}

// Per-thread scratch of a work item.
struct Scratch {
  int64_t ld;                 // the scores' row stride: S rounded up to whole 16-slot chunks
  std::vector<float> scores;  // R * ld
  std::vector<int64_t> off;   // S: where slot s's key / value vector of the head starts
  std::vector<int64_t> kx;    // hd: row i of the transposed keys (i * their row stride)
  std::vector<float> kt;      // hd * run_slots(hd): a run of transposed keys
  std::vector<float> inv;     // R: 1 / the row's softmax sum (0: a row that sees nothing)
  explicit Scratch(const Shape& d)
      : ld((d.S + 15) / 16 * 16), scores(d.T * d.G * ld), off(d.S), kx(d.hd), kt(d.hd * run_slots(d.hd)),
        inv(d.T * d.G) {}
};

// One (b, j) work item.
void attend(const float* q, const float* k, const float* v, const bool* mask, float* out, const Shape& d,
            const Slots& at, float scale, int64_t b, int64_t j, Scratch& w) {
  const int64_t T = d.T, G = d.G, hd = d.hd, S = d.S, KVH = d.KVH, ld = w.ld;
  const int64_t R = T * G;
  const bool* mb = mask + b * T * S;
  // the slots any query row of this batch row may see: [0, smax)
  int64_t smax = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = S - 1; s >= smax; --s)
      if (mb[t * S + s]) {
        smax = s + 1;
        break;
      }
  // where each slot's key / value vector of head j lives (the paged index's division once per slot)
  int64_t* off = w.off.data();
  for (int64_t s = 0; s < S; ++s) off[s] = at.index(b, s, d.Sc) * KVH * hd + j * hd;
  // row r = t * G + g: the q and out rows of one t are contiguous
  auto qrow = [&](int64_t r) { return q + ((b * T + r / G) * KVH + j) * G * hd + (r % G) * hd; };
  auto orow = [&](int64_t r) { return out + ((b * T + r / G) * KVH + j) * G * hd + (r % G) * hd; };
  float* scores = w.scores.data();
  auto srow = [&](int64_t r) { return scores + r * ld; };
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
  // raw scores q . k, in runs of slots whose keys stay in L1 while every block of rows uses them
  const int64_t krun = run_slots(hd);
  if (R >= kTransposeRows) {
    // scores[r][a, e) = sum_i q[r][i] * kt[i]: whole vectors of slots (the last one past e lies in the
    // row's padding or in slots no span covers)
    for (int64_t i = 0; i < hd; ++i) w.kx[i] = i * krun;
    for (const auto& [a0, e0] : spans)
      for (int64_t a = a0; a < e0; a += krun) {
        const int64_t e = std::min(e0, a + krun);
        transpose_keys(k, off, a, e, hd, w.kt.data(), krun);
        product(R, (e - a + kLanes - 1) / kLanes, qrow, [&](int64_t r) { return srow(r) + a; }, w.kt.data(),
                w.kx.data(), 0, hd, true);
      }
  } else {
    for (const auto& [a0, e0] : spans)
      for (int64_t a = a0; a < e0; a += krun) {
        const int64_t e = std::min(e0, a + krun);
        for (int64_t r0 = 0; r0 < R;) {
          const int mr = R - r0 >= 4 ? std::min(4, kLanes) : R - r0 >= 2 ? 2 : 1;
          const int ns = kLanes / mr;
          const float* qs[4];
          for (int m = 0; m < mr; ++m) qs[m] = qrow(r0 + m);
          for (int64_t s0 = a; s0 < e; s0 += ns) {
            const float* ks[kLanes];
            for (int n = 0; n < ns; ++n) ks[n] = k + off[std::min(s0 + n, e - 1)];
            float* dst[4];
            for (int m = 0; m < mr; ++m) dst[m] = srow(r0 + m) + s0;
            const int64_t n_ok = std::min<int64_t>(ns, e - s0);
            if (mr == 1)
              score_dots<1>(qs, ks, hd, dst, n_ok);
            else if (mr == 2)
              score_dots<2>(qs, ks, hd, dst, n_ok);
            else
              score_dots<std::min(4, kLanes)>(qs, ks, hd, dst, n_ok);
          }
          r0 += mr;
        }
      }
  }
  // softmax per row over the spans: scale, mask (slots the row does not see: -inf), maximum, exponentials
  // and their sum; 1 / sum scales the output row at the end. A row that sees nothing gets inv = 0 and
  // zero probabilities, and the mean of all S values below.
  typedef uint8_t bv __attribute__((vector_size(SSD_JAX_LANES)));
  const fv negv = fv{} + neg;
  for (int64_t r = 0; r < R; ++r) {
    float* sr = srow(r);
    const bool* vis = mb + (r / G) * S;
    fv mv = negv;
    int64_t s = 0;
    for (const auto& [a, e] : spans)
      for (s = a; s + kLanes <= e; s += kLanes) {
        bv seen;
        std::memcpy(&seen, vis + s, sizeof(seen));
        const fv x = __builtin_convertvector(seen, iv) != 0 ? loadv(sr + s) * scale : negv;
        storev(sr + s, x);
        mv = mv < x ? x : mv;
      }
    float m = neg;
    for (int l = 0; l < kLanes; ++l) m = std::max(m, mv[l]);
    for (; s < smax; ++s) {
      sr[s] = vis[s] ? scale * sr[s] : neg;
      m = std::max(m, sr[s]);
    }
    if (m == neg) {
      for (const auto& [a, e] : spans) std::fill(sr + a, sr + e, 0.f);
      w.inv[r] = 0.f;
      continue;
    }
    fv tot = fv{};
    for (const auto& [a, e] : spans)
      for (s = a; s + kLanes <= e; s += kLanes) {
        const fv x = exp_neg(loadv(sr + s) - m);
        storev(sr + s, x);
        tot += x;
      }
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += tot[l];
    for (; s < smax; ++s) {
      const float x = sr[s] == neg ? 0.f : std::exp(sr[s] - m);
      sr[s] = x;
      sum += x;
    }
    w.inv[r] = 1.f / sum;
  }
  // output rows = P . V, in runs of slots whose value slices stay in L1 while every block of rows uses
  // them (a run's tiles continue from the previous run's stores)
  const int64_t nvec = hd / kLanes;  // whole vectors per row; the rest (hd % kLanes) lane by lane
  const int64_t vrun = run_slots(kVecs * kLanes);
  bool first = true;
  for (const auto& [a0, e0] : spans)
    for (int64_t a = a0; a < e0; a += vrun, first = false) {
      const int64_t e = std::min(e0, a + vrun);
      product(R, nvec, srow, orow, v, off, a, e, first);
      for (int64_t r = 0; r < R; ++r) {
        float* o = orow(r);
        const float* p = srow(r);
        for (int64_t i = nvec * kLanes; i < hd; ++i) {
          float x = first ? 0.f : o[i];
          for (int64_t s = a; s < e; ++s) x += p[s] * v[off[s] + i];
          o[i] = x;
        }
      }
    }
  for (int64_t r = 0; r < R; ++r) {
    float* o = orow(r);
    const float inv = w.inv[r];
    if (inv != 0.f) {
      for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
      continue;
    }
    // sees nothing: the mean of all S values
    std::fill(o, o + hd, 0.f);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t i = 0; i < hd; ++i) o[i] += v[off[s] + i];
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
    Scratch scratch(d);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      attend(q, k, v, mask, out, d, at, scale, i / d.KVH, i % d.KVH, scratch);
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
