// CUDA kernel of clip_factor_ (contract: clip.h): one block of kTotalLanes threads.  Thread l is
// lane l of clip_math.h's order (rows l, l + kTotalLanes, ... in order), the lanes meet in a
// shared-memory tree with a barrier per level, and thread 0 writes the two outputs.  A table has
// a row per 64K gradient elements (~2,000 for a 124M-parameter model), so one block suffices.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "clip.h"

namespace ampfused {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kTotalLanes) clip_factor_kernel(const ClipParams p) {
  __shared__ StatTotal lanes[kTotalLanes];
  const int l = static_cast<int>(threadIdx.x);
  StatTotal t = {};
  for (int64_t r = l; r < p.num_rows; r += kTotalLanes) {
    stat_total_add_row(t, p.rows + r * kStatFields);
  }
  lanes[l] = t;
  for (int h = kTotalLanes / 2; h > 0; h /= 2) {
    __syncthreads();  // level h reads what level 2h wrote
    if (l < h) stat_total_merge(lanes[l], lanes[l + h]);
  }
  if (l == 0) clip_finish(lanes[0], p);
}

}  // namespace
}  // namespace cuda

void launch_clip_cuda(const ClipParams& p, const at::Tensor& on_device) {
  const c10::cuda::CUDAGuard guard(on_device.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(on_device.get_device()).stream();
  cuda::clip_factor_kernel<<<1, kTotalLanes, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ampfused
