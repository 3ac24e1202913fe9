// CUDA kernel of the unscale op family (contract: unscale.h).
//
// One launch per call: a persistent grid walks the chunk table of multi_tensor_apply.cuh, each
// chunk switching on its tensor's dtype (uniform across the block, so no divergence).  Inside a
// chunk: a scalar head up to the first 16-byte boundary, 16-byte vectors with kUnroll loads in
// flight per thread, and a scalar tail, so misaligned views still get the vector path.  The pass
// result is reduced with __syncthreads_or per block; when found_inf must be overwritten or the
// scale update is fused, the last block to finish (threadfence + atomic ticket) writes found_inf
// and the pending scale/tracker, and resets the workspace.
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cuda/multi_tensor_apply.cuh"
#include "unscale.h"

namespace ampfused {
namespace cuda {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, bool kCheckOnly>
__device__ bool process_chunk(T* p, int64_t n, opmath_t<T> inv, bool inv_is_one) {
  constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));
  using V = Vec<T, kVec>;
  // Table pointers reach us as void*: without this the compiler emits generic LD/ST.
  __builtin_assume(__isGlobal(p));
  bool bad = false;
  // Chunks start at multiples of kChunkSize elements, so a chunk is as aligned as its tensor;
  // peel the elements before the first 16-byte boundary.
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  int64_t head = static_cast<int64_t>(((kVecBytes - addr % kVecBytes) % kVecBytes) / sizeof(T));
  if (addr % sizeof(T) != 0 || head > n) head = n;
  const int64_t nvec = (n - head) / kVec;
  const int64_t tail = head + nvec * kVec;
  const int64_t tid = threadIdx.x;
  const int64_t stride = blockDim.x;

  for (int64_t i = tid; i < head; i += stride) bad |= visit<T, kCheckOnly>(p[i], inv, inv_is_one);

  V* vp = reinterpret_cast<V*>(p + head);
  for (int64_t base = tid; base < nvec; base += stride * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < nvec) r[u] = vp[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < nvec) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) bad |= visit<T, kCheckOnly>(r[u].v[k], inv, inv_is_one);
        if (!kCheckOnly) vp[i] = r[u];
      }
    }
  }

  for (int64_t i = tail + tid; i < n; i += stride) {
    bad |= visit<T, kCheckOnly>(p[i], inv, inv_is_one);
  }
  return bad;
}

struct KernelArgs {
  MetaTable table;
  PassParams pass;
};

template <bool kCheckOnly>
__global__ void __launch_bounds__(kBlockSize) unscale_kernel(KernelArgs k) {
  const float inv = k.pass.inv_scale();
  const bool inv_is_one = inv == 1.0f;
  bool bad = false;
  for (int64_t c = blockIdx.x; c < k.table.num_chunks; c += gridDim.x) {
    const ChunkMeta cm = k.table.chunks[c];
    const TensorMeta tm = k.table.tensors[cm.tensor];
    const int64_t start = static_cast<int64_t>(cm.chunk) * kChunkSize;
    const int64_t n = min(kChunkSize, tm.numel - start);
    // Uniform across the block (one chunk, one tensor): no divergence.  Other dtypes are
    // rejected on the host.
    visit_grad_dtype(static_cast<c10::ScalarType>(tm.dtype), [&](auto tag) {
      using T = typename decltype(tag)::type;
      bad |= process_chunk<T, kCheckOnly>(static_cast<T*>(tm.data) + start, n,
                                          static_cast<opmath_t<T>>(inv), inv_is_one);
    });
  }
  bad = __syncthreads_or(bad);

  if (!k.pass.needs_whole_pass()) {
    // torch's contract (set, never clear): every writer stores 1.0, so the race is benign.
    if (bad && threadIdx.x == 0) *k.pass.found_inf = 1.0f;
    return;
  }
  __shared__ bool is_last;
  int* ws = k.table.workspace;
  if (threadIdx.x == 0) {
    if (bad) atomicOr(&ws[0], 1);
    __threadfence();  // publish this block's flag before it counts as finished
    const unsigned int done = atomicAdd(reinterpret_cast<unsigned int*>(&ws[1]), 1u);
    is_last = (done == gridDim.x - 1);
  }
  __syncthreads();
  if (is_last && threadIdx.x == 0) {
    __threadfence();
    const bool found = atomicExch(&ws[0], 0) != 0;
    ws[1] = 0;  // leave the workspace zeroed for the next launch on this stream
    finish_pass(found, k.pass);
  }
}

// Blocks of this kernel that fit on the device at once (it needs ~128 registers per thread, so
// usually one 512-thread block per SM): the persistent grid never runs in waves.
template <bool kCheckOnly>
int64_t resident_blocks(int device) {
  static int cached[64] = {0};  // per device; a racing first call computes the same value
  int& n = cached[device % 64];
  if (n == 0) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, unscale_kernel<kCheckOnly>, kBlockSize, 0));
    n = at::cuda::getDeviceProperties(device)->multiProcessorCount * std::max(1, per_sm);
  }
  return n;
}

}  // namespace
}  // namespace cuda

void launch_pass_cuda(const std::vector<Span>& spans, const PassParams& args,
                      const at::Tensor& any_device_tensor) {
  const c10::cuda::CUDAGuard guard(any_device_tensor.device());
  const cuda::MetaTable table = cuda::get_meta_table(spans, any_device_tensor);
  cuda::KernelArgs k{table, args};
  const int device = any_device_tensor.get_device();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // At least one block: the epilogue runs even for an empty list.
  const auto grid = [&](int64_t resident) {
    return static_cast<unsigned>(std::max<int64_t>(1, std::min(table.num_chunks, resident)));
  };
  if (args.check_only) {
    cuda::unscale_kernel<true>
        <<<grid(cuda::resident_blocks<true>(device)), cuda::kBlockSize, 0, stream>>>(k);
  } else {
    cuda::unscale_kernel<false>
        <<<grid(cuda::resident_blocks<false>(device)), cuda::kBlockSize, 0, stream>>>(k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ampfused
