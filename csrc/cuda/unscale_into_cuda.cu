// CUDA kernel of unscale_into_ (contract: unscale_into.h).
//
// The spans are cut into items of at most kChunkSize elements (input pointer, output pointer,
// count, dtype: 24 bytes) that travel by value in the kernel parameters, up to kIntoLarge per
// launch; block b of a launch takes item b, its threads striding through it, so consecutive
// threads read and write consecutive elements.  Per element: visit_into (unscale_math.h, the
// same function the CPU kernel runs).  found_inf is set, never cleared, so blocks and launches
// need no hand-off: every block that saw inf/NaN stores 1.0 (a benign race).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cuda/multi_tensor_apply.cuh"
#include "unscale_into.h"
#include "unscale_math.h"

namespace ampfused {
namespace cuda {
namespace {

struct IntoItem {
  const void* in;
  float* out;
  uint32_t numel;  // 1..kChunkSize
  int32_t dtype;   // c10::ScalarType: Half, BFloat16 or Float
};
static_assert(sizeof(IntoItem) == 24, "IntoItem is a 24-byte kernel parameter record");

// Items per launch, two classes as launch_table.h's: the driver copies every parameter byte at
// each launch, so a pass of a few items takes the small one.
constexpr int kIntoSmall = 128;
constexpr int kIntoLarge = 1024;
constexpr int kIntoBlockSize = 256;

template <int kCapacity>
struct IntoArgs {
  const float* inv_scale;
  float* found_inf;
  IntoItem items[kCapacity];  // gridDim.x of them are set
};
static_assert(sizeof(IntoArgs<kIntoLarge>) <= kMaxKernelParamBytes,
              "kernel parameters over the CUDA limit");

template <typename T>
__device__ uint32_t into_item(const IntoItem& w, float inv, bool inv_is_one) {
  const int n = static_cast<int>(w.numel);
  const auto in = rt::bounded(static_cast<const T*>(w.in), n);
  const auto out = rt::bounded(w.out, n);
  uint32_t bad = 0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kIntoBlockSize) {
    bad |= visit_into(in[i], out[i], inv, inv_is_one);
  }
  return bad;
}

template <int kCapacity>
__global__ void __launch_bounds__(kIntoBlockSize)
    unscale_into_kernel(const __grid_constant__ IntoArgs<kCapacity> k) {
  const IntoItem& w = k.items[blockIdx.x];  // uniform across the block: no divergence below
  const float inv = *k.inv_scale;
  const bool inv_is_one = inv == 1.0f;
  uint32_t bad = 0;
  switch (static_cast<c10::ScalarType>(w.dtype)) {
    case c10::ScalarType::Half:
      bad = into_item<c10::Half>(w, inv, inv_is_one);
      break;
    case c10::ScalarType::BFloat16:
      bad = into_item<c10::BFloat16>(w, inv, inv_is_one);
      break;
    default:  // Float: the host admits nothing else
      bad = into_item<float>(w, inv, inv_is_one);
      break;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *k.found_inf = 1.0f;
}

// One launch over items[first, first + count), count <= kCapacity.
template <int kCapacity>
void launch_slice(const std::vector<IntoItem>& items, size_t first, int count,
                  const float* inv_scale, float* found_inf, rt::Stream stream) {
  IntoArgs<kCapacity> k;  // items past count stay unset: no block reads them
  k.inv_scale = inv_scale;
  k.found_inf = found_inf;
  std::copy_n(items.begin() + static_cast<std::ptrdiff_t>(first), count, k.items);
  rt::launch<unscale_into_kernel<kCapacity>>(static_cast<unsigned>(count), kIntoBlockSize, stream,
                                             k);
}

}  // namespace
}  // namespace cuda

void launch_into_cuda(const std::vector<IntoSpan>& spans, const float* inv_scale, float* found_inf,
                      const at::Tensor& on_device) {
  const cuda::rt::DeviceGuard guard(on_device.device());
  const cuda::rt::Stream stream = cuda::rt::current_stream(cuda::rt::device_of(on_device));
  std::vector<cuda::IntoItem> items;
  for (const IntoSpan& s : spans) {
    const size_t elem = c10::elementSize(s.dtype);
    for (int64_t b = 0; b < s.numel; b += kChunkSize) {
      // A gradient of 2^31 elements or more has items past int's range, where an int index
      // wraps and the loop never ends.  No test can allocate such a gradient: checked here.
      static_assert(std::is_same_v<decltype(b), int64_t>, "index the chunks with int64_t");
      items.push_back({static_cast<const char*>(s.in) + b * elem, s.out + b,
                       static_cast<uint32_t>(std::min(kChunkSize, s.numel - b)),
                       static_cast<int32_t>(s.dtype)});
    }
  }
  // Full large launches, then the rest in the smallest class that holds it.
  for (size_t first = 0; first < items.size();) {
    const size_t left = items.size() - first;
    if (left <= static_cast<size_t>(cuda::kIntoSmall)) {
      cuda::launch_slice<cuda::kIntoSmall>(items, first, static_cast<int>(left), inv_scale,
                                           found_inf, stream);
      break;
    }
    const int count = static_cast<int>(std::min<size_t>(left, cuda::kIntoLarge));
    cuda::launch_slice<cuda::kIntoLarge>(items, first, count, inv_scale, found_inf, stream);
    first += static_cast<size_t>(count);
  }
}

}  // namespace ampfused
