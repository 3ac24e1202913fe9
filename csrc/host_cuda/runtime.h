// The host execution layer: ampfused's CUDA kernels compiled by the C++ compiler and run on the
// CPU with CUDA's execution semantics.  Test-only (tests/host_cuda.py builds it); the product
// never compiles it.  Included by csrc/cuda/runtime.cuh when AMPFUSED_HOST_CUDA is defined.
//
// What a kernel sees, as on a GPU:
// - gridDim, blockDim, blockIdx, threadIdx (one-dimensional launches, as ours are);
// - every thread of a block is a fiber with its own stack; `__shared__` variables are per block
//   (each block runs on one OS thread at a time: thread_local statics are its shared memory);
// - __syncthreads and __syncthreads_or are real barriers of every live thread of the block, and
//   a block whose threads wait at different barriers, or at a barrier and a warp shuffle, is
//   reported (CUDA leaves it undefined);
// - between two barriers the threads run in a seeded random order: per phase either uniformly
//   shuffled threads, or whole warps at random priorities (a warp runs ahead of the others to its
//   next barrier), or the threads in reverse order, so a thread or a warp that runs ahead of a
//   forgotten barrier reads stale shared memory;
// - __shfl_xor_sync exchanges values between the 32 lanes of a warp (the lanes of `mask` must
//   all take part, at the same call), with CUDA's `width` rule;
// - atomics and __threadfence are the CPU's sequentially consistent ones;
// - the blocks of a launch run in a seeded random order, `blocks_in_flight` of them at once on
//   as many OS threads (real concurrency for the last-block hand-off);
// - a launch returns when every block has finished (a stream's launches run one after another).
// The kernel parameters are passed by value to every thread, as CUDA passes them.
//
// What it cannot show: nvcc's code generation, the GPU's memory model (weaker than x86's), real
// warp-synchronous execution inside a phase, and timing.  Those stay for a GPU (.ci/gpu).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// --------------------------------------------------------------------------- CUDA's keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Per OS thread, and a block runs on one OS thread at a time: per-block shared memory.
#define __shared__ static thread_local
#define __isGlobal(p) true
#if !defined(__clang__)
#define __builtin_assume(x) ((void)0)
#endif

namespace ampfused {
namespace hostcuda {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// The running thread's coordinates (valid inside a kernel only).
const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
const Dim3& grid_dim();

// `site` names the call ("file:line"): the threads of a block must meet at the same one.
void syncthreads(const char* site);
int syncthreads_or(int predicate, const char* site);
// The 8 bytes of `value` exchanged as __shfl_xor_sync(mask, value, lane_mask, width) does.
uint64_t shfl_xor(unsigned mask, uint64_t value, int lane_mask, int width, const char* site);

// Raises (as a GPU faults) unless p is a multiple of `alignment`.
void check_aligned(const void* p, size_t alignment);

// Runs body() as every thread of every block of a <<<grid, block>>> launch of `kernel` (a name
// that identifies the kernel's instantiation, for kernels_launched()).
void launch(const char* kernel, unsigned grid, unsigned block, const std::function<void()>& body);
// Every kernel instantiation launched in this process, with its launch count: for tests that
// every kernel of csrc/cuda/ was executed.
std::vector<std::pair<std::string, int64_t>> kernels_launched();

// The layer's settings (tests/host_cuda.py sets them through ampfused_host::configure):
// seed: the schedules of every later launch derive from it and a launch counter;
// blocks_in_flight: OS threads running blocks of one launch together (1: one block at a time);
// resident_blocks: what the occupancy query answers (the persistent grid's size);
// capturing: what the graph-capture query answers.
struct Config {
  int64_t seed = 0;
  int blocks_in_flight = 2;
  int64_t resident_blocks = 3;
  bool capturing = false;
};
void configure(const Config& config);
Config config();
// Launches, blocks and barrier phases run since the last configure(), for tests to check that a
// kernel really ran as they meant it to (how many launches a pass took, ...).
struct Counters {
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t phases = 0;
  int64_t shuffles = 0;
};
Counters counters();

template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask, int width, const char* site) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move <= 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = shfl_xor(mask, bits, lane_mask, width, site);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask, const char* site) {
  return shfl_xor_sync(mask, value, lane_mask, 32, site);
}

}  // namespace hostcuda
}  // namespace ampfused

#define AMPFUSED_HOSTCUDA_STR2(x) #x
#define AMPFUSED_HOSTCUDA_STR(x) AMPFUSED_HOSTCUDA_STR2(x)
#define AMPFUSED_HOSTCUDA_SITE __FILE__ ":" AMPFUSED_HOSTCUDA_STR(__LINE__)

#define threadIdx (::ampfused::hostcuda::thread_idx())
#define blockIdx (::ampfused::hostcuda::block_idx())
#define blockDim (::ampfused::hostcuda::block_dim())
#define gridDim (::ampfused::hostcuda::grid_dim())
#define __syncthreads() ::ampfused::hostcuda::syncthreads(AMPFUSED_HOSTCUDA_SITE)
#define __syncthreads_or(p) ::ampfused::hostcuda::syncthreads_or((p), AMPFUSED_HOSTCUDA_SITE)
#define __shfl_xor_sync(mask, value, ...) \
  ::ampfused::hostcuda::shfl_xor_sync((mask), (value), __VA_ARGS__, AMPFUSED_HOSTCUDA_SITE)

// Atomics: the CPU's, sequentially consistent (stronger than CUDA's relaxed device atomics).
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned* p, unsigned v) {
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) {
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// --------------------------------------------------------------------------- the seam
namespace ampfused {
namespace cuda {
namespace rt {

using Stream = const void*;  // one host "stream": launches run one after another

struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};

// Host tensors live on the CPU (device index -1): the layer's one device is 0.
inline int device_of(const at::Tensor&) { return 0; }

inline Stream current_stream(int) {
  static const char kStream = 0;
  return &kStream;
}

inline bool capturing() { return hostcuda::config().capturing; }

// As a GPU faults on a misaligned vector access ("misaligned address"), the layer raises.
template <typename V, typename T>
V* vectors(T* p, int count) {
  if (count > 0) hostcuda::check_aligned(p, alignof(V));
  return reinterpret_cast<V*>(p);
}

template <auto kKernel>
int64_t resident_blocks(int, int) {
  return hostcuda::config().resident_blocks;
}

// __PRETTY_FUNCTION__ names kKernel's instantiation ("[with auto kKernel = ...").
template <auto kKernel, typename... Args>
void launch(unsigned grid, unsigned block, Stream, const Args&... args) {
  hostcuda::launch(__PRETTY_FUNCTION__, grid, block, [&] { kKernel(args...); });
}

}  // namespace rt
}  // namespace cuda
}  // namespace ampfused
