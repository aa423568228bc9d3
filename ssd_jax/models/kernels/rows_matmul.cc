// y = x @ W^T for a few rows: x (M, K) float32, W (N, K) stored (out, in), y (M, N) float32.
// W is float32 ("ssd_jax_rows_matmul") or bfloat16 ("ssd_jax_rows_matmul_bf16": half the bytes
// to stream, widened to float32 in registers; the products and sums stay float32).
//
// Built by ssd_jax/models/kernels/__init__.py with g++ (one build per instruction set: native,
// AVX2-only, portable) and called through the XLA FFI (jax.ffi.ffi_call "ssd_jax_rows_matmul").
// Every element of W is read from memory once at any row count: a block of kR rows of W is
// contracted with all M rows of x while it sits in cache (x is small: M <= 16 rows), kMB rows of x
// at a time. kR and kMB follow the target's vector registers (cpu.h): the kMB x kR accumulators plus
// the kR weight vectors and one x vector must fit in them, or the compiler spills the accumulators
// and the kernel turns compute-bound, its time linear in the rows (issue 54: 16-float vectors in a
// 6 x 4 block on AVX2's 16 registers cost 5x one row at 5 rows). The N axis is cut into chunks that
// the calling thread and XLA's own intra-op thread pool claim from a shared counter, so the kernel
// never runs more threads than XLA has and cannot deadlock if the pool is busy (the caller then
// does every chunk itself).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using ssd_jax_kernels::kLanes;
using ssd_jax_kernels::kRegs;
using ssd_jax_kernels::loadv;
using ssd_jax_kernels::vf;

// kR rows of W per block; kMB rows of x per pass over it (override with -DSSD_JAX_ROWS_R / _MB): kMB x kR
// accumulators, kR weight vectors and one x vector in the registers. Measured (issue 54, 2-core EPYC,
// SmolLM2 and Qwen2.5-1.5B shapes, M = 1..16): on 16 registers 2 x 5 (13 registers) beat 4 x 2, 3 x 3,
// 3 x 4 and 1 x 10, and one pass at M = 5 (the K = 4 verify) costs about one row's time; on 32 registers
// 3 x 8 (28) matched 4 x 6 up to M = 5 and cost 0.6x it at M = 8 (one pass instead of two).
#ifdef SSD_JAX_ROWS_R
constexpr int kR = SSD_JAX_ROWS_R;
#else
constexpr int kR = kRegs >= 32 ? 3 : 2;
#endif
#ifdef SSD_JAX_ROWS_MB
constexpr int kMB = SSD_JAX_ROWS_MB;
#else
constexpr int kMB = kRegs >= 32 ? 8 : 5;
#endif
#if !defined(SSD_JAX_ROWS_R) && !defined(SSD_JAX_ROWS_MB)
static_assert(kMB * kR + kR + 1 <= kRegs, "the register block does not fit the target's registers");
#endif
static_assert(kMB >= 1 && kMB <= 12 && kR >= 1 && kR <= 8, "register blocking out of range");

typedef uint16_t u16v __attribute__((vector_size(2 * SSD_JAX_LANES)));
typedef uint32_t u32v __attribute__((vector_size(4 * SSD_JAX_LANES)));

// kLanes bfloat16 values widened to float32: a bfloat16 is the top half of a float32's bits.
inline vf loadv(const uint16_t* p) {
  u16v h;
  std::memcpy(&h, p, sizeof(h));
  const u32v wide = __builtin_convertvector(h, u32v) << 16;
  vf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t bits = uint32_t(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// The slice [k0, k0 + L) of R rows of W (w: row stride K) against MB rows of x (x: row stride K):
// y[m * ldy + r] = (add ? y[m * ldy + r] : 0) + dot. L is a multiple of kLanes except in the last slice
// of K (its scalar tail). pf (or null): the same slice of the next block of R rows, prefetched while
// this one is read. The hardware prefetcher alone follows R short row streams poorly; with this the
// kernel streams W near memory speed (measured: 1 block ahead into L2 beat 2 blocks, L1, and no
// prefetch).
template <int R, int MB, typename W>
inline void micro(const W* w, const float* x, int64_t K, int64_t L, float* y, int64_t ldy, const W* pf, bool add) {
  vf acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vf{};
  const int64_t Lv = L - L % kLanes;
  constexpr int kLine = 64 / sizeof(W);  // W values per cache line
  for (int64_t k = 0; k < Lv; k += kLanes) {
    vf wv[R];
    if (pf && k % kLine == 0)  // one line of each of the next block's rows, into L2
      for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * K + k, 0, 2);
    for (int r = 0; r < R; ++r) wv[r] = loadv(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const vf xv = loadv(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t k = Lv; k < L; ++k) s += x[m * K + k] * widen(w[r * K + k]);
      y[m * ldy + r] = add ? y[m * ldy + r] + s : s;
    }
}

// R rows of W against mb <= kMB rows of x.
template <int R, typename W>
inline void group(const W* w, const float* x, int64_t mb, int64_t K, int64_t L, float* y, int64_t N, const W* pf,
                  bool add) {
  switch (mb) {
#define SSD_CASE(n)                                                      \
  case n:                                                                \
    if constexpr (n <= kMB) micro<R, n, W>(w, x, K, L, y, N, pf, add); \
    break;
    SSD_CASE(12) SSD_CASE(11) SSD_CASE(10) SSD_CASE(9) SSD_CASE(8) SSD_CASE(7)
    SSD_CASE(6) SSD_CASE(5) SSD_CASE(4) SSD_CASE(3) SSD_CASE(2)
#undef SSD_CASE
    default: micro<R, 1, W>(w, x, K, L, y, N, pf, add); break;
  }
}

// A slice of K of R <= kR rows of W against all M rows of x, in near-equal groups of at most kMB rows
// of x. The first group streams the block of W from memory, later groups find it in L1.
template <int R, typename W>
inline void rows_block(const W* w, const float* x, int64_t M, int64_t K, int64_t L, float* y, int64_t N,
                       const W* pf, bool add) {
  const int64_t groups = (M + kMB - 1) / kMB;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t mb = (M - m) / (groups - g);
    group<R, W>(w, x + m * K, mb, K, L, y + m * N, N, g == 0 ? pf : nullptr, add);
    m += mb;
  }
}

// Output rows [n0, n1) of W. (Measured, issue 54: cutting K into slices so that x stays in L1 made
// every shape slower, since W's rows were then read in pieces instead of streamed whole.)
template <typename W>
void rows_range(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kR <= n1; n += kR)
    rows_block<kR, W>(w + n * K, x, M, K, K, y + n, N, n + 2 * kR <= n1 ? w + (n + kR) * K : nullptr, false);
  for (; n < n1; ++n) rows_block<1, W>(w + n * K, x, M, K, K, y + n, N, nullptr, false);
}


template <typename W>
struct Work {
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs chunks until none is left.
  void drain() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      rows_range(x, w, y, M, K, N, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType WT, typename W>
ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_matmul: want x (M, K) and W (N, K)");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  auto work = std::make_shared<Work<W>>();
  work->x = x.typed_data();
  work->w = reinterpret_cast<const W*>(w.untyped_data());
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  // XLA's pool has one thread per core normally, but one per fake device under
  // --xla_force_host_platform_device_count (8 on 2 cores in the tests): never use more
  // threads than the cores this process may run on.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), ssd_jax_kernels::usable_cores()));
  // About 4 chunks per thread (load balance on a shared machine), each a multiple of kR rows
  // and at least 64 KiB of W (so the scheduling cost stays small for the narrow matrices).
  auto round_up = [](int64_t v) { return (v + kR - 1) / kR * kR; };
  const int64_t min_rows = round_up(std::max<int64_t>(4, (65536 / int64_t(sizeof(W))) / std::max<int64_t>(K, 1)));
  const int64_t chunk = std::max(min_rows, round_up((N + 4 * threads - 1) / (4 * threads)));
  work->chunk = chunk;
  work->chunks = (N + chunk - 1) / chunk;
  const int64_t helpers = std::min(threads, work->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  // Chunks already claimed by helpers are running: wait for them (a helper that starts later
  // finds nothing left and only drops its reference).
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error RowsMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  return RowsMatmulImpl<ffi::F32, float>(pool, x, w, y);
}

ffi::Error RowsMatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  return RowsMatmulImpl<ffi::BF16, uint16_t>(pool, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxRowsMatmul, RowsMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdJaxRowsMatmulBF16, RowsMatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// What this build targets, for the loader's check and the benchmark's records.
extern "C" const char* ssd_jax_kernels_isa() {
  static const std::string s = std::string(SSD_JAX_ISA) + " lanes=" + std::to_string(kLanes) +
                               " regs=" + std::to_string(kRegs) + " rows=" + std::to_string(kR) + "x" +
                               std::to_string(kMB);
  return s.c_str();
}
