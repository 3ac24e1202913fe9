// CUDA kernel of the unscale op family (contract: unscale.h).
//
// A persistent grid walks the work items of multi_tensor_apply.cuh, each item switching on its
// tensor's dtype (uniform across the block, so no divergence).  Inside an item: a scalar head up
// to the first 16-byte boundary, 16-byte vectors with kUnroll loads in flight per thread, and a
// scalar tail, so misaligned views still get the vector path.  The pass result is reduced with
// __syncthreads_or per block and handled as the launch's Epilogue says.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"
#include "unscale.h"

namespace ampfused {
namespace cuda {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// n <= kChunkSize, so every index of an item fits in int.  kMeasure: the thread's magnitude
// over the inputs it reads (MagnitudeOf) is max-ed into `mag` (float32 bits).
template <typename T, bool kCheckOnly, bool kMeasure = false>
__device__ bool process_chunk(T* data, int n, opmath_t<T> inv, bool inv_is_one, uint32_t& mag) {
  constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));
  constexpr int kStride = kBlockSize;  // every launch uses kBlockSize threads
  using V = Vec<T, kVec>;
  // Item pointers reach us as void*: without this the compiler emits generic LD/ST.
  __builtin_assume(__isGlobal(data));
  const auto p = rt::bounded(data, n);
  bool bad = false;
  // Items start at multiples of kChunkSize elements, so an item is as aligned as its tensor;
  // peel the elements before the first 16-byte boundary (all of them, in an item shorter than
  // its peel: a few 16-bit elements at an odd offset).
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
  int head = static_cast<int>(((kVecBytes - addr % kVecBytes) % kVecBytes) / sizeof(T));
  if (addr % sizeof(T) != 0 || head > n) head = n;
  const int nvec = (n - head) / kVec;
  const int tail = head + nvec * kVec;
  const int tid = static_cast<int>(threadIdx.x);
  using Mag = MagnitudeOf<T>;
  magnitude_bits_t<T> m = 0;
  const auto measure = [&](T x) {
    if (kMeasure) {
      const magnitude_bits_t<T> b = Mag::of(x);
      m = b > m ? b : m;
    }
  };

  for (int i = tid; i < head; i += kStride) {
    measure(p[i]);
    bad |= visit<T, kCheckOnly>(p[i], inv, inv_is_one);
  }

  const auto vp = rt::vectors<V>(p + head, nvec);
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
        for (int k = 0; k < kVec; ++k) {
          measure(r[u].v[k]);
          bad |= visit<T, kCheckOnly>(r[u].v[k], inv, inv_is_one);
        }
        if (!kCheckOnly) vp[i] = r[u];
      }
    }
  }

  for (int i = tail + tid; i < n; i += kStride) {
    measure(p[i]);
    bad |= visit<T, kCheckOnly>(p[i], inv, inv_is_one);
  }
  if (kMeasure) {
    const uint32_t f = Mag::to_float_bits(m);
    mag = f > mag ? f : mag;
  }
  return bad;
}

// An item with statistics (grad_stats): the elements as process_chunk visits them, plus the
// item's row.  Thread t owns lanes t*V .. t*V+V-1 of unscale_math.h's order, which are exactly
// its 16-byte vectors i = t, t + kBlockSize, ... of an aligned item; a misaligned item takes
// scalar loads with the same assignment (no head peel, which would move the lanes).
static_assert(kBlockSize == kStatThreads && kVecBytes == kStatVecBytes,
              "grad_stats' summation order assumes one lane group per thread and 16-byte vectors");

// measure_scale > 0: thread 0 max-es the item's magnitude (stat_magnitude_bits of its abs-max
// and this scale) into `mag`.
template <typename T, bool kCheckOnly>
__device__ bool process_chunk_stats(T* data, int n, opmath_t<T> inv, bool inv_is_one, double* row,
                                    float measure_scale, uint32_t& mag) {
  using M = opmath_t<T>;
  using B = typename StatBits<M>::type;
  constexpr int kVec = kStatVec<T>;
  using V = Vec<T, kVec>;
  __builtin_assume(__isGlobal(data));
  const auto p = rt::bounded(data, n);
  const int tid = static_cast<int>(threadIdx.x);
  M lanes[kVec] = {};
  StatCounts<M> c;
  const int nfull = n / kVec;
  if (reinterpret_cast<uintptr_t>(data) % kVecBytes == 0) {
    const auto vp = rt::vectors<V>(p, nfull);
    // Increasing u is increasing i for this thread: each lane still adds in element order.
    for (int base = tid; base < nfull; base += kBlockSize * kUnroll) {
      V r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kBlockSize;
        if (i < nfull) r[u] = vp[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kBlockSize;
        if (i < nfull) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            stat_visit<T, kCheckOnly>(r[u].v[k], inv, inv_is_one, lanes[k], c);
          }
          if (!kCheckOnly) vp[i] = r[u];
        }
      }
    }
  } else {
    for (int i = tid; i < nfull; i += kBlockSize) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        stat_visit<T, kCheckOnly>(p[i * kVec + k], inv, inv_is_one, lanes[k], c);
      }
    }
  }
  // The partial last vector belongs to the thread whose lanes it maps to, after its others.
  if (nfull * kVec < n && tid == nfull % kBlockSize) {
    // Unrolled with a guard, not bounded by n: a run-time bound on lanes[k] would put the lanes
    // in local memory for the whole kernel.
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (nfull * kVec + k < n) {
        stat_visit<T, kCheckOnly>(p[nfull * kVec + k], inv, inv_is_one, lanes[k], c);
      }
    }
  }
  const bool bad = c.found();

  // The sum in the tree order; the counts and the abs-max in any order (integers).
  __shared__ M sums[kStatThreads];
  // (the five counts, then the abs-max)
  constexpr int kFields = 6;
  __shared__ B warp_fields[kStatThreads / 32][kFields];
  sums[tid] = stat_thread_sum<M, kVec>(lanes);
  B f[kFields] = {c.pos_inf, c.neg_inf, c.nan, c.zeros, c.below_normal, c.abs_max_bits};
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
#pragma unroll
    for (int j = 0; j < kFields - 1; ++j) f[j] += __shfl_xor_sync(0xffffffffu, f[j], off);
    const B other = __shfl_xor_sync(0xffffffffu, f[kFields - 1], off);
    f[kFields - 1] = f[kFields - 1] > other ? f[kFields - 1] : other;
  }
  if (tid % 32 == 0) {
#pragma unroll
    for (int j = 0; j < kFields; ++j) warp_fields[tid / 32][j] = f[j];
  }
  __syncthreads();
  for (int h = kStatThreads / 2; h > 0; h /= 2) {
    if (tid < h) stat_tree_level(sums, h, tid);
    __syncthreads();
  }
  if (tid == 0) {
    StatCounts<M> total;
    for (int w = 0; w < kStatThreads / 32; ++w) {
      total.pos_inf += warp_fields[w][0];
      total.neg_inf += warp_fields[w][1];
      total.nan += warp_fields[w][2];
      total.zeros += warp_fields[w][3];
      total.below_normal += warp_fields[w][4];
      if (warp_fields[w][5] > total.abs_max_bits) total.abs_max_bits = warp_fields[w][5];
    }
    stat_write_row<T>(row, sums[0], total);
    if (measure_scale > 0.0f) {
      const uint32_t f = stat_magnitude_bits(StatBits<M>::value(total.abs_max_bits), measure_scale);
      mag = f > mag ? f : mag;
    }
  }
  __syncthreads();  // the next item reuses the shared arrays
  return bad;
}

template <int64_t kCapacity>
using KernelArgs = LaunchArgs<PassParams, kCapacity>;

// Occupancy (ptxas -v, 512 threads): the mixed-dtype kernel takes 110-128 registers, so
// one block per SM (25%, 32 KB of loads in flight per SM); the kernel for float32-only passes
// (float32 master gradients, the usual AMP case) fits 64 registers without spilling (48-56), so
// it asks for two blocks per SM: 50%, twice the bytes in flight, same per-element code.  With
// statistics (kStats) the float32-only kernel takes ~115 registers (one block per SM, no
// spills) and the mixed one 128 with ~200-270 bytes spilled (sm_80/90): unmeasured on a GPU.
constexpr int kFloatOnlyMinBlocks = 2;

// The largest of the block's `mag` (float32 bits), in thread 0.
__device__ uint32_t block_max(uint32_t mag) {
  __shared__ uint32_t warp_max[kBlockSize / 32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, mag, off);
    mag = other > mag ? other : mag;
  }
  const int tid = static_cast<int>(threadIdx.x);
  if (tid % 32 == 0) warp_max[tid / 32] = mag;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kBlockSize / 32; ++w) mag = warp_max[w] > mag ? warp_max[w] : mag;
  }
  return mag;
}

// kStats: the pass fills grad_stats (item rows from k.first_item on); a statistics-free pass
// compiles to the kernel it was before statistics existed.  kMeasure: the headroom policy's
// magnitude (PassParams::measures), reduced across blocks by atomicMax in the workspace; with
// statistics it comes from the item rows (whether is read at run time: no kernel of its own).
template <bool kCheckOnly, bool kFloatOnly, bool kStats, bool kMeasure, int64_t kCapacity>
__global__ void __launch_bounds__(kBlockSize, kFloatOnly && !kStats ? kFloatOnlyMinBlocks : 1)
    unscale_kernel(const __grid_constant__ KernelArgs<kCapacity> k) {
  // In a check-only pass visit() ignores inv; the statistics still see unscaled values.
  const float pass_inv = kStats ? k.pass.stats_inv_scale() : k.pass.inv_scale();
  // With statistics the magnitude is an item's unscaled abs-max times the global scale: at the
  // global scale for any item, an island's too.
  const float measure_scale = kStats && k.pass.measures() ? *k.pass.scale : 0.0f;
  uint32_t mag = 0;
  uint32_t island_mag = 0;  // what an island's item measures, at its own scale
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
    // Uniform across the block, as the item is.
    const float inv = k.pass.item_inv(pass_inv, w.island);
    const bool inv_is_one = inv == 1.0f;
    // (without statistics an island's item measures at its own scale: divided below)
    uint32_t& item_mag = w.island == 0 ? mag : island_mag;
    if constexpr (kStats) {
      double* row = k.pass.grad_stats + (1 + k.first_item + c) * kStatFields;
      visit_grad_dtype(static_cast<c10::ScalarType>(w.dtype), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (!kFloatOnly || std::is_same_v<T, float>) {
          bad |= process_chunk_stats<T, kCheckOnly>(
              static_cast<T*>(w.data), static_cast<int>(w.numel), static_cast<opmath_t<T>>(inv),
              inv_is_one, row, measure_scale, mag);
        }
      });
    } else if constexpr (kFloatOnly) {
      bad |= process_chunk<float, kCheckOnly, kMeasure>(
          static_cast<float*>(w.data), static_cast<int>(w.numel), inv, inv_is_one, item_mag);
    } else {
      // Uniform across the block (one item, one tensor): no divergence.  Other dtypes are
      // rejected on the host.
      visit_grad_dtype(static_cast<c10::ScalarType>(w.dtype), [&](auto tag) {
        using T = typename decltype(tag)::type;
        bad |= process_chunk<T, kCheckOnly, kMeasure>(
            static_cast<T*>(w.data), static_cast<int>(w.numel), static_cast<opmath_t<T>>(inv),
            inv_is_one, item_mag);
      });
    }
    if (kMeasure && !kStats && w.island != 0) {  // (at the global scale: divided by its factor)
      const uint32_t global = k.pass.global_magnitude(island_mag, w.island);
      mag = global > mag ? global : mag;
      island_mag = 0;
    }
  }
  bad = __syncthreads_or(bad);
  // (stats: thread 0 holds the block's magnitude already)
  if (kMeasure && !kStats) mag = block_max(mag);

  if (k.epilogue == Epilogue::kSetFlag) {
    // torch's contract (set, never clear): every writer stores 1.0, so the race is benign.
    if (bad && threadIdx.x == 0) *k.pass.found_inf = 1.0f;
    return;
  }
  rt::Word* ws = k.workspace;
  if (k.epilogue == Epilogue::kAccumulate) {
    // The kernel boundary orders this before the reads of the pass's kFinish launch.
    if (threadIdx.x == 0) {
      if (bad) atomicOr(&ws[kFoundFlag], 1u);
      if (mag != 0) atomicMax(&ws[kMagnitude], mag);
    }
    return;
  }
  // The last block to finish sees every block's flag and magnitude: each block ORs its flag
  // (max-es its magnitude) in, fences, and only then counts itself finished, so the block whose
  // count completes the grid reads those of all the others.  Every access to the workspace is
  // atomic.
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    if (bad) atomicOr(&ws[kFoundFlag], 1u);
    if (mag != 0) atomicMax(&ws[kMagnitude], mag);
    __threadfence();  // publish this block's flag and magnitude before it counts as finished
    const unsigned done = atomicAdd(&ws[kBlocksDone], 1u);
    is_last = (done == gridDim.x - 1);
  }
  __syncthreads();
  if (is_last && threadIdx.x == 0) {
    __threadfence();
    const bool found = atomicExch(&ws[kFoundFlag], 0u) != 0;
    const uint32_t measured = atomicExch(&ws[kMagnitude], 0u);
    atomicExch(&ws[kBlocksDone], 0u);  // zeroed for the next pass on this stream
    finish_pass(found, measured, k.pass);
  }
}

template <auto kKernel, int64_t kCapacity>
void launch_kernel(const KernelArgs<kCapacity>& k, int device, rt::Stream stream) {
  const unsigned grid = grid_size(k.num_items, rt::resident_blocks<kKernel>(device, kBlockSize));
  rt::launch<kKernel>(grid, kBlockSize, stream, k);
}

template <bool kCheckOnly, bool kStats, bool kMeasure, int64_t kCapacity>
void launch(const KernelArgs<kCapacity>& k, bool float_only, int device, rt::Stream stream) {
  if (float_only) {
    launch_kernel<unscale_kernel<kCheckOnly, true, kStats, kMeasure, kCapacity>>(k, device, stream);
  } else {
    launch_kernel<unscale_kernel<kCheckOnly, false, kStats, kMeasure, kCapacity>>(k, device,
                                                                                  stream);
  }
}

// The kernel for the pass's modes (a statistics pass measures in the kernel with statistics).
template <bool kCheckOnly, int64_t kCapacity>
void launch_mode(const KernelArgs<kCapacity>& k, bool stats, bool measure, bool float_only,
                 int device, rt::Stream stream) {
  if (stats) {
    launch<kCheckOnly, true, false>(k, float_only, device, stream);
  } else if (measure) {
    launch<kCheckOnly, false, true>(k, float_only, device, stream);
  } else {
    launch<kCheckOnly, false, false>(k, float_only, device, stream);
  }
}

// One launch: the next items of `plan`, as many as the class kCapacity holds.
template <int64_t kCapacity>
void launch_items(LaunchPlanner& plan, const PassParams& pass, bool hand_off, rt::Word* workspace,
                  int device, rt::Stream stream) {
  static_assert(sizeof(KernelArgs<kCapacity>) <= kMaxKernelParamBytes,
                "kernel parameters over the CUDA limit: lower the largest kLaunchCapacities");
  KernelArgs<kCapacity> k;  // items past num_items stay unset: the kernel never reads them
  k.pass = pass;
  k.workspace = workspace;
  k.first_item = plan.handed_out();
  k.num_items = static_cast<int32_t>(plan.fill(k.items, kCapacity));
  k.epilogue =
      !hand_off ? Epilogue::kSetFlag : (plan.done() ? Epilogue::kFinish : Epilogue::kAccumulate);
  const bool float_only = plan.uniform_dtype() == c10::ScalarType::Float;
  const bool stats = pass.grad_stats != nullptr;
  if (pass.check_only) {
    launch_mode<true>(k, stats, pass.measures(), float_only, device, stream);
  } else {
    launch_mode<false>(k, stats, pass.measures(), float_only, device, stream);
  }
}

}  // namespace
}  // namespace cuda

void launch_pass_cuda(const std::vector<Span>& spans, const PassParams& args,
                      const at::Tensor& any_device_tensor) {
  const cuda::rt::DeviceGuard guard(any_device_tensor.device());
  const int device = cuda::rt::device_of(any_device_tensor);
  const cuda::rt::Stream stream = cuda::rt::current_stream(device);
  // Overwriting found_inf, updating the scale or the stats header needs the whole pass's result
  // in one place.
  const bool hand_off = args.needs_whole_pass();
  LaunchPlanner plan(spans);
  if (plan.total_items() == 0 && !hand_off) return;  // nothing to visit, nothing to write
  const bool one_launch = plan.total_items() <= kLaunchCapacities.back();
  const at::Tensor workspace =
      hand_off ? cuda::pass_workspace(any_device_tensor, stream, one_launch) : at::Tensor();
  cuda::rt::Word* ws =
      hand_off ? reinterpret_cast<cuda::rt::Word*>(workspace.mutable_data_ptr<int>()) : nullptr;
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
