// The seam between ampfused's CUDA kernels and a CUDA runtime: streams, the device guard, the
// device of a tensor, graph capture, occupancy and the launch itself.
//
// nvcc builds it over CUDA's runtime (the product).  A host build (AMPFUSED_HOST_CUDA, tests
// only: csrc/host_cuda/) builds it over the host execution layer, so that the very kernels and
// launchers of csrc/cuda/ compile with the C++ compiler and run over CPU tensors with CUDA's
// semantics (threads, blocks, barriers, shuffles, atomics).  Nothing else in csrc/cuda/ names a
// CUDA header or API.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#if defined(AMPFUSED_HOST_CUDA)
#include "host_cuda/runtime.h"
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMacros.h>

#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <algorithm>
#include <atomic>

// Work items travel in the kernel parameters, beyond the 4 KB that CUDA allowed before 12.1.
#if !defined(CUDART_VERSION) || CUDART_VERSION < 12010
#error "ampfused's CUDA kernels need CUDA 12.1 or newer (kernel parameters up to 32,764 bytes)"
#endif

namespace ampfused {
namespace cuda {
namespace rt {

using Stream = cudaStream_t;
using DeviceGuard = c10::cuda::CUDAGuard;

inline int device_of(const at::Tensor& t) { return t.get_device(); }

inline Stream current_stream(int device) { return at::cuda::getCurrentCUDAStream(device).stream(); }

// Whether the current stream is being captured into a CUDA graph.
inline bool capturing() {
  return at::cuda::currentStreamCaptureStatus() != at::cuda::CaptureStatus::None;
}

// Blocks of `kKernel` (launched with `block` threads) that fit on `device` at once: a
// persistent grid of this size never runs in waves.  Computed once per (kernel, device); a
// racing first call computes the same value.
template <auto kKernel>
int64_t resident_blocks(int device, int block) {
  static std::atomic<int64_t> per_device[C10_COMPILE_TIME_MAX_GPUS] = {};
  std::atomic<int64_t>& n = per_device[device];
  int64_t blocks = n.load(std::memory_order_relaxed);
  if (blocks == 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, block, 0));
    blocks =
        int64_t{at::cuda::getDeviceProperties(device)->multiProcessorCount} * std::max(1, per_sm);
    n.store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

// Under capture the graph owns `t`: a block freed during capture stays in the capture's private
// pool (later allocations of the same capture may reuse it, in stream order), never handed to
// work outside the graph, so nothing is needed here (the host layer keeps the tensor itself).
inline void graph_owns(const at::Tensor&) {}

// A word of global memory through which the blocks of one launch communicate (the last-block
// hand-off's flag and counter): accessed with atomics, ordered by __threadfence.  The host
// layer's Word models the accesses (a relaxed memory model, plain-vs-atomic races).
using Word = unsigned int;

// The `n` elements of a work item at p.  The host layer checks every access against them.
template <typename T>
__device__ __forceinline__ T* bounded(T* p, int64_t /*n*/) {
  return p;
}

// The `count` elements at p + offset, as a plain pointer (the host layer checks they lie within
// p's elements).
template <typename T>
__device__ __forceinline__ T* slice(T* p, int64_t offset, int64_t /*count*/) {
  return p + offset;
}

// `p` as a pointer to `count` vectors V (16-byte loads and stores): a GPU faults with
// "misaligned address" where one is accessed and p is not aligned to V; the host layer raises.
template <typename V, typename T>
__device__ __forceinline__ V* vectors(T* p, int /*count*/) {
  return reinterpret_cast<V*>(p);
}

// kKernel<<<grid, block, 0, stream>>>(args...), then the launch's error check.
template <auto kKernel, typename... Args>
void launch(unsigned grid, unsigned block, Stream stream, const Args&... args) {
  // clang-format reads a .cuh as C++ and would split the chevrons.
  // clang-format off
  kKernel<<<grid, block, 0, stream>>>(args...);
  // clang-format on
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace rt
}  // namespace cuda
}  // namespace ampfused
#endif
