// CUDA kernel of the unscale op family (contract: unscale.h).
//
// A persistent grid walks the work items of multi_tensor_apply.cuh, each item switching on its
// tensor's dtype (uniform across the block, so no divergence).  Inside an item: a scalar head up
// to the first 16-byte boundary, 16-byte vectors with kUnroll loads in flight per thread, and a
// scalar tail, so misaligned views still get the vector path.  The pass result is reduced with
// __syncthreads_or per block and handled as the launch's Epilogue says.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
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

// n <= kChunkSize, so every index of an item fits in int.
template <typename T, bool kCheckOnly>
__device__ bool process_chunk(T* p, int n, opmath_t<T> inv, bool inv_is_one) {
  constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));
  constexpr int kStride = kBlockSize;  // every launch uses kBlockSize threads
  using V = Vec<T, kVec>;
  // Item pointers reach us as void*: without this the compiler emits generic LD/ST.
  __builtin_assume(__isGlobal(p));
  bool bad = false;
  // Items start at multiples of kChunkSize elements, so an item is as aligned as its tensor;
  // peel the elements before the first 16-byte boundary.
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  int head = static_cast<int>(((kVecBytes - addr % kVecBytes) % kVecBytes) / sizeof(T));
  if (addr % sizeof(T) != 0 || head > n) head = n;
  const int nvec = (n - head) / kVec;
  const int tail = head + nvec * kVec;
  const int tid = static_cast<int>(threadIdx.x);

  for (int i = tid; i < head; i += kStride) bad |= visit<T, kCheckOnly>(p[i], inv, inv_is_one);

  V* vp = reinterpret_cast<V*>(p + head);
  for (int base = tid; base < nvec; base += kStride * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kStride;
      if (i < nvec) r[u] = vp[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kStride;
      if (i < nvec) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) bad |= visit<T, kCheckOnly>(r[u].v[k], inv, inv_is_one);
        if (!kCheckOnly) vp[i] = r[u];
      }
    }
  }

  for (int i = tail + tid; i < n; i += kStride) bad |= visit<T, kCheckOnly>(p[i], inv, inv_is_one);
  return bad;
}

template <int64_t kCapacity>
using KernelArgs = LaunchArgs<PassParams, kCapacity>;

// Occupancy (ptxas -v, 512 threads): the mixed-dtype kernel takes 110-128 registers, so
// one block per SM (25%, 32 KB of loads in flight per SM); the kernel for float32-only passes
// (float32 master gradients, the usual AMP case) fits 64 registers without spilling (48-56), so
// it asks for two blocks per SM: 50%, twice the bytes in flight, same per-element code.
constexpr int kFloatOnlyMinBlocks = 2;

template <bool kCheckOnly, bool kFloatOnly, int64_t kCapacity>
__global__ void __launch_bounds__(kBlockSize, kFloatOnly ? kFloatOnlyMinBlocks : 1)
    unscale_kernel(const __grid_constant__ KernelArgs<kCapacity> k) {
  const float inv = k.pass.inv_scale();
  const bool inv_is_one = inv == 1.0f;
  bool bad = false;
  const int stride = static_cast<int>(gridDim.x);
  int c = static_cast<int>(blockIdx.x);
  // Items come from the constant bank, uniform across the block; the next one is loaded before
  // the current one is processed, so a constant-cache miss overlaps the work instead of
  // stalling between items (small tensors are one short item each).
  WorkItem next = c < k.num_items ? k.items[c] : WorkItem{};
  for (; c < k.num_items; c += stride) {
    const WorkItem w = next;
    if (c + stride < k.num_items) next = k.items[c + stride];
    if constexpr (kFloatOnly) {
      bad |= process_chunk<float, kCheckOnly>(static_cast<float*>(w.data),
                                              static_cast<int>(w.numel), inv, inv_is_one);
    } else {
      // Uniform across the block (one item, one tensor): no divergence.  Other dtypes are
      // rejected on the host.
      visit_grad_dtype(static_cast<c10::ScalarType>(w.dtype), [&](auto tag) {
        using T = typename decltype(tag)::type;
        bad |= process_chunk<T, kCheckOnly>(static_cast<T*>(w.data), static_cast<int>(w.numel),
                                            static_cast<opmath_t<T>>(inv), inv_is_one);
      });
    }
  }
  bad = __syncthreads_or(bad);

  if (k.epilogue == Epilogue::kSetFlag) {
    // torch's contract (set, never clear): every writer stores 1.0, so the race is benign.
    if (bad && threadIdx.x == 0) *k.pass.found_inf = 1.0f;
    return;
  }
  int* ws = k.workspace;
  if (k.epilogue == Epilogue::kAccumulate) {
    // The kernel boundary orders this before the reads of the pass's kFinish launch.
    if (bad && threadIdx.x == 0) atomicOr(&ws[0], 1);
    return;
  }
  __shared__ bool is_last;
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
    ws[1] = 0;  // leave the workspace zeroed for the next pass on this stream
    finish_pass(found, k.pass);
  }
}

template <bool kCheckOnly, bool kFloatOnly, int64_t kCapacity>
void launch(const KernelArgs<kCapacity>& k, int device, cudaStream_t stream) {
  constexpr auto kernel = unscale_kernel<kCheckOnly, kFloatOnly, kCapacity>;
  kernel<<<grid_size(k.num_items, resident_blocks<kernel>(device)), kBlockSize, 0, stream>>>(k);
}

// One launch: the next items of `plan`, as many as the class kCapacity holds.
template <int64_t kCapacity>
void launch_items(LaunchPlanner& plan, const PassParams& pass, bool hand_off, int* workspace,
                  int device, cudaStream_t stream) {
  static_assert(sizeof(KernelArgs<kCapacity>) <= kMaxKernelParamBytes,
                "kernel parameters over the CUDA limit: lower the largest kLaunchCapacities");
  KernelArgs<kCapacity> k;  // items past num_items stay unset: the kernel never reads them
  k.pass = pass;
  k.workspace = workspace;
  k.num_items = static_cast<int32_t>(plan.fill(k.items, kCapacity));
  k.epilogue =
      !hand_off ? Epilogue::kSetFlag : (plan.done() ? Epilogue::kFinish : Epilogue::kAccumulate);
  const bool float_only = plan.uniform_dtype() == c10::ScalarType::Float;
  if (pass.check_only) {
    float_only ? launch<true, true>(k, device, stream) : launch<true, false>(k, device, stream);
  } else {
    float_only ? launch<false, true>(k, device, stream) : launch<false, false>(k, device, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

void launch_pass_cuda(const std::vector<Span>& spans, const PassParams& args,
                      const at::Tensor& any_device_tensor) {
  const c10::cuda::CUDAGuard guard(any_device_tensor.device());
  const int device = any_device_tensor.get_device();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
  // Overwriting found_inf or updating the scale needs the whole pass's result in one place.
  TORCH_CHECK_NOT_IMPLEMENTED(args.grad_stats == nullptr, "grad_stats: not implemented yet");
  const bool hand_off = args.needs_whole_pass();
  LaunchPlanner plan(spans);
  if (plan.total_items() == 0 && !hand_off) return;  // nothing to visit, nothing to write
  const bool one_launch = plan.total_items() <= kLaunchCapacities.back();
  const at::Tensor workspace =
      hand_off ? cuda::pass_workspace(any_device_tensor, stream, one_launch) : at::Tensor();
  int* ws = hand_off ? workspace.mutable_data_ptr<int>() : nullptr;
  constexpr auto kCap = kLaunchCapacities;
  static_assert(kCap.size() == 2, "one branch per launch capacity");
  do {
    if (plan.next_capacity() == kCap[0]) {
      cuda::launch_items<kCap[0]>(plan, args, hand_off, ws, device, stream);
    } else {
      cuda::launch_items<kCap[1]>(plan, args, hand_off, ws, device, stream);
    }
  } while (!plan.done());
}

}  // namespace ampfused
