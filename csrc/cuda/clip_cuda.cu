// CUDA kernel of clip_factor_ (contract: clip.h): one block of kTotalLanes threads.  Thread l is
// lane l of clip_math.h's order (rows l, l + kTotalLanes, ... in order), the lanes meet in a
// shared-memory tree with a barrier per level, and thread 0 writes the two outputs.  A table has
// a row per 64K gradient elements (~2,000 for a 124M-parameter model), so one block suffices.
#include "clip.h"
#include "cuda/runtime.cuh"

namespace ampfused {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kTotalLanes) clip_factor_kernel(const ClipParams p) {
  __shared__ StatTotal lanes[kTotalLanes];
  const int l = static_cast<int>(threadIdx.x);
  const auto rows = rt::bounded(p.rows, p.num_rows * kStatFields);
  StatTotal t = {};
  for (int64_t r = l; r < p.num_rows; r += kTotalLanes) {
    stat_total_add_row(t, rt::slice(rows, r * kStatFields, kStatFields));
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
  const cuda::rt::DeviceGuard guard(on_device.device());
  const cuda::rt::Stream stream = cuda::rt::current_stream(cuda::rt::device_of(on_device));
  cuda::rt::launch<cuda::clip_factor_kernel>(1, kTotalLanes, stream, p);
}

}  // namespace ampfused
