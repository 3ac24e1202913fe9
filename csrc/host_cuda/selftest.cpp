// Kernels that test the host execution layer itself (tests/test_host_cuda.py): that its
// barriers, shuffles and schedules have CUDA's semantics, and that it exposes the mistakes
// ampfused's kernels could make (a missing barrier, a barrier in divergent code).
#include <torch/library.h>

#include <string>
#include <vector>

#include "host_cuda/runtime.h"

namespace ampfused {
namespace {

constexpr int kThreads = 512;

// out[t] for lane t: its own value xor-shuffled by 1, 16 and (width 4) 4, and a sum reduced
// over the warp by the butterfly ampfused's statistics kernel uses.
__global__ void shuffle_kernel(int64_t* out) {
  const int t = static_cast<int>(threadIdx.x);
  const int64_t v = 1000 + t;
  int64_t sum = v;
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  int64_t* row = out + 4 * t;
  row[0] = __shfl_xor_sync(0xffffffffu, v, 1);
  row[1] = __shfl_xor_sync(0xffffffffu, v, 16);
  row[2] = __shfl_xor_sync(0xffffffffu, v, 4, 4);
  row[3] = sum;
}

// Each thread writes its slot, then reads a slot of another warp: with the barrier, always the
// value written; without it, whatever the schedule let through.  out[0] counts stale reads.
template <bool kBarrier>
__global__ void neighbour_kernel(int64_t* out) {
  __shared__ int slots[kThreads];
  const int t = static_cast<int>(threadIdx.x);
  slots[t] = -1;
  __syncthreads();
  slots[t] = t;
  if (kBarrier) __syncthreads();
  const int other = (t + 37) % kThreads;
  if (slots[other] != other) atomicAdd(reinterpret_cast<int*>(out), 1);
}

// The first warp waits at one barrier, the others at another: undefined on a GPU, reported here.
__global__ void divergent_kernel(int64_t*) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

// Half a warp shuffles while the other half waits at a barrier: a deadlock on a GPU.
__global__ void half_warp_kernel(int64_t* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
  } else {
    __syncthreads();
  }
}

std::vector<int64_t> selftest(const std::string& name) {
  std::vector<int64_t> out(4 * kThreads, 0);
  int64_t* p = out.data();
  if (name == "shuffle") {
    cuda::rt::launch<shuffle_kernel>(1, 64, nullptr, p);
  } else if (name == "neighbour") {
    cuda::rt::launch<neighbour_kernel<false>>(1, kThreads, nullptr, p);
    out.resize(1);
  } else if (name == "neighbour_with_barrier") {
    cuda::rt::launch<neighbour_kernel<true>>(1, kThreads, nullptr, p);
    out.resize(1);
  } else if (name == "divergent") {
    cuda::rt::launch<divergent_kernel>(1, 64, nullptr, p);
  } else if (name == "half_warp") {
    cuda::rt::launch<half_warp_kernel>(1, 32, nullptr, p);
  } else {
    TORCH_CHECK(false, "selftest: unknown kernel '", name, "'");
  }
  return out;
}

}  // namespace
}  // namespace ampfused

TORCH_LIBRARY_FRAGMENT(ampfused_host, m) {
  m.def("selftest(str name) -> int[]", &ampfused::selftest);
}
