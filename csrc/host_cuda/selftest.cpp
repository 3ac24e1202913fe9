// Kernels that test the host execution layer itself (tests/test_host_cuda.py): that its
// barriers, shuffles and schedules have CUDA's semantics, and that it exposes the mistakes
// ampfused's kernels could make (a missing barrier, a barrier in divergent code).
#include <torch/library.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/runtime.cuh"
#include "host_cuda/intrinsics.h"

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
// value written; without it, whatever the schedule let through.  out[t]: thread t read stale.
template <bool kBarrier>
__global__ void neighbour_kernel(int64_t* out) {
  __shared__ int slots[kThreads];
  const int t = static_cast<int>(threadIdx.x);
  slots[t] = -1;
  __syncthreads();
  slots[t] = t;
  if (kBarrier) __syncthreads();
  const int other = (t + 37) % kThreads;
  out[t] = slots[other] != other;
}

// Each block stores 1 to its own word (plain), fences or not, and counts itself finished; the
// last block reads every block's word.  out[0]: words the last block read as still 0.  Without
// the fence the stores may not have reached memory (the layer's relaxed model); with it, they
// have (the pattern of the last-block hand-off).
template <bool kFence>
__global__ void publish_kernel(cuda::rt::Word* words, int64_t* out) {
  if (threadIdx.x != 0) return;
  cuda::rt::Word* count = &words[gridDim.x];
  words[blockIdx.x] = 1u;
  if (kFence) __threadfence();
  if (atomicAdd(count, 1u) == gridDim.x - 1) {
    if (kFence) __threadfence();
    for (unsigned b = 0; b < gridDim.x; ++b) *out += words[b] == 0u;
  }
}

// A word counted with atomics by every block and read plainly by one: a race on a GPU,
// reported by the layer.
__global__ void plain_and_atomic_kernel(cuda::rt::Word* words, int64_t*) {
  if (threadIdx.x != 0) return;
  atomicAdd(&words[0], 1u);
  if (blockIdx.x == 0) (void)static_cast<unsigned>(words[0]);
}

// Thread 0 reads one element past a 5-element item: reported as out of bounds.
__global__ void past_the_item_kernel(int64_t* out) {
  const auto item = cuda::rt::bounded(reinterpret_cast<float*>(out), 5);
  if (threadIdx.x == 0) item[0] = item[5];
}

// a * b + c in plain float arithmetic (contracted into an FMA here, as nvcc does by default) and
// with the _rn intrinsics (never contracted); out[0..1] their float bits.
__global__ void fma_kernel(int64_t* out) {
  float in[3];
  for (int k = 0; k < 3; ++k) {
    const auto bits = static_cast<uint32_t>(out[k]);
    std::memcpy(&in[k], &bits, sizeof(float));
  }
  const float plain = in[0] * in[1] + in[2];
  const float rounded = __fadd_rn(__fmul_rn(in[0], in[1]), in[2]);
  uint32_t b[2];
  std::memcpy(&b[0], &plain, sizeof(float));
  std::memcpy(&b[1], &rounded, sizeof(float));
  out[0] = b[0];
  out[1] = b[1];
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
  } else if (name == "neighbour" || name == "neighbour_with_barrier") {
    if (name == "neighbour") {
      cuda::rt::launch<neighbour_kernel<false>>(1, kThreads, nullptr, p);
    } else {
      cuda::rt::launch<neighbour_kernel<true>>(1, kThreads, nullptr, p);
    }
    out = {std::accumulate(out.begin(), out.begin() + kThreads, int64_t{0})};
  } else if (name == "publish" || name == "publish_with_fence") {
    // 100 launches of 4 blocks: out[0] stale reads in all.
    for (int launch = 0; launch < 100; ++launch) {
      std::vector<uint32_t> words(5, 0);
      auto* w = reinterpret_cast<cuda::rt::Word*>(words.data());
      if (name == "publish") {
        cuda::rt::launch<publish_kernel<false>>(4, 32, nullptr, w, p);
      } else {
        cuda::rt::launch<publish_kernel<true>>(4, 32, nullptr, w, p);
      }
    }
    out.resize(1);
  } else if (name == "plain_and_atomic") {
    std::vector<uint32_t> words(1, 0);
    auto* w = reinterpret_cast<cuda::rt::Word*>(words.data());
    cuda::rt::launch<plain_and_atomic_kernel>(3, 32, nullptr, w, p);
  } else if (name == "past_the_item") {
    cuda::rt::launch<past_the_item_kernel>(1, 32, nullptr, p);
  } else if (name == "fma") {
    // 1 + 2^-12 squared is 1 + 2^-11 + 2^-24: rounded to float, then minus (1 + 2^-11), 0;
    // fused, 2^-24.
    const float a = 1.0f + 0x1p-12f, c = -(1.0f + 0x1p-11f);
    uint32_t bits[2];
    std::memcpy(&bits[0], &a, sizeof(float));
    std::memcpy(&bits[1], &c, sizeof(float));
    out[0] = out[1] = bits[0];
    out[2] = bits[1];
    cuda::rt::launch<fma_kernel>(1, 1, nullptr, p);
    out.resize(2);
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
