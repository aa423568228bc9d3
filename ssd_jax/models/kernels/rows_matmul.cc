// y = x @ W^T for a few rows: x (M, K) float32, W (N, K) stored (out, in), y (M, N) float32.
// W is float32 ("ssd_jax_rows_matmul") or bfloat16 ("ssd_jax_rows_matmul_bf16": half the bytes
// to stream, widened to float32 in registers; the products and sums stay float32).
//
// Built by ssd_jax/models/kernels/__init__.py with g++ (-O3 -march=native when the compiler
// accepts it) and called through the XLA FFI (jax.ffi.ffi_call "ssd_jax_rows_matmul").
// Every element of W is read from memory once: a block of 4 rows of W is contracted with all
// M rows of x while it sits in cache (x is small: M <= 16 rows). The N axis is cut into
// chunks that the calling thread and XLA's own intra-op thread pool claim from a shared
// counter, so the kernel never runs more threads than XLA has and cannot deadlock if the
// pool is busy (the caller then does every chunk itself).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {


using ssd_jax_kernels::load16;
using ssd_jax_kernels::v16;

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// 16 bfloat16 values widened to float32: a bfloat16 is the top half of a float32's bits.
inline v16 load16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
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

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// R rows of W (w, stride K) against MB rows of x (x, stride K): out[m * ldy + r] = dot.
// pf (or null): the next block of R rows, prefetched while this one is read. The hardware
// prefetcher alone follows R short row streams poorly; with this the kernel streams W
// near memory speed (measured: 1 block ahead into L2 beat 2 blocks, L1, and no prefetch).
template <int R, int MB, typename W>
inline void micro(const W* w, const float* x, int64_t K, float* y, int64_t ldy, const W* pf) {
  v16 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = v16{};
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    v16 wv[R];
    if (pf) {  // the next block of W rows (contiguous after this one), into L2
      // the next block's 16 * R values a step: R cache lines of float32, R / 2 of bfloat16
      constexpr int kLine = 64 / sizeof(W), kLines = (16 * R + kLine - 1) / kLine;
      for (int j = 0; j < kLines; ++j) __builtin_prefetch(pf + R * k + kLine * j, 0, 2);
    }
    for (int r = 0; r < R; ++r) wv[r] = load16(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const v16 xv = load16(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * widen(w[r * K + k]);
      y[m * ldy + r] = s;
    }
}

// R rows of W against mb <= 6 rows of x.
template <int R, typename W>
inline void group(const W* w, const float* x, int64_t mb, int64_t K, float* y, int64_t N, const W* pf) {
  switch (mb) {
#define SSD_CASE(n) \
  case n: micro<R, n, W>(w, x, K, y, N, pf); break;
    SSD_CASE(6) SSD_CASE(5) SSD_CASE(4) SSD_CASE(3) SSD_CASE(2)
#undef SSD_CASE
    default: micro<R, 1, W>(w, x, K, y, N, pf); break;
  }
}

// R <= 4 rows of W against all M rows of x, in near-equal groups of at most 6 rows of x
// (4 x 6 accumulators plus 4 weight vectors and one x vector fit the 32 vector registers of
// AVX-512). The first group streams the block of W from memory, later groups (M > 6) find it
// in L1. (Measured: 2 rows of W with up to 12 rows of x per pass was slower.)
template <int R, typename W>
inline void rows_block(const W* w, const float* x, int64_t M, int64_t K, float* y, int64_t N, const W* pf) {
  constexpr int64_t kMaxMB = 6;
  const int64_t groups = (M + kMaxMB - 1) / kMaxMB;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t mb = (M - m) / (groups - g);
    group<R, W>(w, x + m * K, mb, K, y + m * N, N, g == 0 ? pf : nullptr);
    m += mb;
  }
}

// Output rows [n0, n1) of W.
template <typename W>
void rows_range(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    rows_block<4, W>(w + n * K, x, M, K, y + n, N, n + 8 <= n1 ? w + (n + 4) * K : nullptr);
  for (; n < n1; ++n) rows_block<1, W>(w + n * K, x, M, K, y + n, N, nullptr);
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
  // About 4 chunks per thread (load balance on a shared machine), each a multiple of 4 rows
  // and at least 64 KiB of W (so the scheduling cost stays small for the narrow matrices).
  const int64_t min_rows =
      std::max<int64_t>(4, (((65536 / int64_t(sizeof(W))) / std::max<int64_t>(K, 1)) + 3) & ~int64_t(3));
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::max(min_rows, (chunk + 3) & ~int64_t(3));
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
