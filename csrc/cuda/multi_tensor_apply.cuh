// Multi-tensor apply for ampfused: one launch over any number of tensors of mixed dtypes.
//
// torch and apex pass per-tensor metadata in kernel arguments (110 tensors / 320 blocks per
// launch, one dtype per launch).  Here the metadata lives in a device table: one TensorMeta per
// tensor and one ChunkMeta per kChunkSize-element work item, and a persistent grid walks the
// chunk list.  The table is built on the host, copied once, and cached by (device, stream, the
// exact list of (pointer, numel, dtype)): an unchanged gradient set - the common case from one
// step to the next - costs no copy, and a set reallocated by zero_grad(set_to_none=True)
// simply misses and rebuilds.  Each cache entry also owns a small workspace that the
// "last block" reduction leaves zeroed for the next launch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <cstdint>
#include <list>
#include <mutex>
#include <vector>

#include "launch_table.h"
#include "unscale.h"

namespace ampfused {
namespace cuda {

constexpr int kBlockSize = 512;
constexpr int kVecBytes = 16;  // one 16-byte load/store per thread per vector
constexpr int kUnroll = 4;     // vectors in flight per thread
constexpr size_t kCacheEntries = 16;
constexpr int kWorkspaceInts = 2;  // [0] found flag, [1] finished-block counter

struct MetaTable {
  const TensorMeta* tensors = nullptr;
  const ChunkMeta* chunks = nullptr;
  int64_t num_chunks = 0;
  int* workspace = nullptr;  // kWorkspaceInts zeros on entry, left zero on exit
};

namespace detail {

struct Entry {
  int device;
  cudaStream_t stream;
  std::vector<Span> key;
  at::Tensor table;      // uint8 on the device: TensorMeta[n] then ChunkMeta[c]
  at::Tensor workspace;  // int32[kWorkspaceInts]
  MetaTable view;
};

inline Entry build_entry(const std::vector<Span>& spans, const at::Tensor& like,
                         cudaStream_t stream) {
  const TableLayout layout = table_layout(spans);
  Entry e;
  e.device = like.get_device();
  e.stream = stream;
  e.key = spans;
  e.workspace = at::zeros({kWorkspaceInts}, like.options().dtype(at::kInt));
  e.view.workspace = e.workspace.mutable_data_ptr<int>();
  e.view.num_chunks = layout.num_chunks;
  if (layout.bytes == 0) return e;

  at::Tensor host =
      at::empty({layout.bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  fill_table(spans, layout, host.mutable_data_ptr<uint8_t>());
  // Pinned source + non_blocking: the caching host allocator keeps `host` alive until the copy
  // on this stream has run, so it is safe to drop our reference right away.
  e.table = at::empty({layout.bytes}, like.options().dtype(at::kByte));
  e.table.copy_(host, /*non_blocking=*/true);
  const uint8_t* base = e.table.const_data_ptr<uint8_t>();
  e.view.tensors = reinterpret_cast<const TensorMeta*>(base);
  e.view.chunks = reinterpret_cast<const ChunkMeta*>(base + layout.tensor_bytes);
  return e;
}

}  // namespace detail

// The device table for `spans` on the current stream of like's device.  Call under a device
// guard for that device.
inline MetaTable get_meta_table(const std::vector<Span>& spans, const at::Tensor& like) {
  static std::mutex mu;
  static std::list<detail::Entry> cache;  // most recently used first
  const int device = like.get_device();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->device == device && it->stream == stream && same_spans(it->key, spans)) {
      cache.splice(cache.begin(), cache, it);
      return cache.front().view;
    }
  }
  TORCH_CHECK(at::cuda::currentStreamCaptureStatus() == at::cuda::CaptureStatus::None,
              "ampfused: this gradient set has not been seen outside CUDA graph capture; run the "
              "step once eagerly (warm-up) before capturing it, so its metadata table exists");
  cache.push_front(detail::build_entry(spans, like, stream));
  if (cache.size() > kCacheEntries) cache.pop_back();
  return cache.front().view;
}

}  // namespace cuda
}  // namespace ampfused
