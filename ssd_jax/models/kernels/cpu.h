// Shared by the CPU kernels: 16-float vectors and how many cores this process may run on.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#ifdef __linux__
#include <sched.h>
#endif

namespace ssd_jax_kernels {

// 16 floats; with -march=native on an AVX-512 machine one zmm register, else split by GCC.
typedef float v16 __attribute__((vector_size(64)));

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
