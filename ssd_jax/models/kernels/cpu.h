// Shared by the CPU kernels: the vector width and register count of the instruction set this
// build targets, 16-float vectors, and how many cores this process may run on.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#ifdef __linux__
#include <sched.h>
#endif

// The instruction set the compiler was told to target, read from its own predefined macros (so the
// blocking below follows the flags that really reached the compiler, not the ones we meant to pass).
// kLanes: floats per vector register; kRegs: vector registers the register blocking may plan for.
#if defined(__AVX512F__)
#define SSD_JAX_ISA "avx512"
#define SSD_JAX_LANES 16
#define SSD_JAX_REGS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define SSD_JAX_ISA "avx2"
#define SSD_JAX_LANES 8
#define SSD_JAX_REGS 16
#elif defined(__AVX__)
#define SSD_JAX_ISA "avx"
#define SSD_JAX_LANES 8
#define SSD_JAX_REGS 16
#elif defined(__aarch64__) || defined(__ARM_NEON)
#define SSD_JAX_ISA "neon"
#define SSD_JAX_LANES 4
#define SSD_JAX_REGS 32
#else
#define SSD_JAX_ISA "generic"
#define SSD_JAX_LANES 4
#define SSD_JAX_REGS 16
#endif

// The build asks for an instruction set by name (-DSSD_JAX_WANT_<ISA>, ssd_jax/models/kernels/__init__.py):
// a flag set that did not enable it fails the build here instead of running a blocking planned for
// registers the machine code does not have.
#if defined(SSD_JAX_WANT_AVX512) && !defined(__AVX512F__)
#error "the avx512 build's flags did not enable AVX-512F"
#endif
#if defined(SSD_JAX_WANT_AVX2) && !(defined(__AVX2__) && defined(__FMA__))
#error "the avx2 build's flags did not enable AVX2 and FMA"
#endif
#if defined(SSD_JAX_WANT_AVX2) && defined(__AVX512F__)
#error "the avx2 build's flags enabled AVX-512F (it must reproduce a machine without it)"
#endif

namespace ssd_jax_kernels {

constexpr int kLanes = SSD_JAX_LANES;
constexpr int kRegs = SSD_JAX_REGS;

// kLanes floats: one vector register of the target.
typedef float vf __attribute__((vector_size(4 * SSD_JAX_LANES)));
// 16 floats; one zmm register on AVX-512, else split by GCC into kLanes-wide registers.
typedef float v16 __attribute__((vector_size(64)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// XLA's pool has one thread per core normally, but one per fake device under
// --xla_force_host_platform_device_count (8 on 2 cores in the tests): a kernel never uses more
// threads than this.
inline int64_t usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace ssd_jax_kernels
