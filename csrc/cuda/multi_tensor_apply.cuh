// Multi-tensor apply for ampfused: one pass over any number of tensors of mixed dtypes.
//
// The pass's work items (launch_table.h: at most kChunkSize elements of one tensor each) travel
// by value in the kernel parameters, up to a few thousand per launch; a persistent grid walks
// them.  A pass whose result needs the whole grid (found_inf overwritten, fused scale update)
// ends with a "last block" hand-off through a small zeroed workspace; a pass of several launches
// ORs the flag of the earlier launches into the workspace and lets the last launch finish.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "cuda/runtime.cuh"
#include "launch_table.h"

namespace ampfused {
namespace cuda {

constexpr int kBlockSize = 512;
constexpr int kVecBytes = 16;                   // one 16-byte load/store per thread per vector
constexpr int kUnroll = 4;                      // vectors in flight per thread
constexpr int kWorkspaceWords = 3;              // rt::Words: kFoundFlag, kBlocksDone, kMagnitude
constexpr int kFoundFlag = 0;                   // 1 once a block of the pass saw inf/NaN
constexpr int kBlocksDone = 1;                  // blocks of the last launch that finished
constexpr int kMagnitude = 2;                   // the blocks' largest magnitude (float32 bits)
constexpr size_t kMaxKernelParamBytes = 32764;  // CUDA 12.1+, compute capability 7.0+
constexpr size_t kMaxStreamWorkspaces = 64;     // eager workspaces kept, one per stream

// What the grid does with its result once every item of the launch has been visited.
enum class Epilogue : int32_t {
  kSetFlag,     // each block that saw a non-finite value stores 1.0 to found_inf
  kAccumulate,  // ... ORs 1 into workspace[0]: a later launch of the same pass finishes it
  kFinish,      // the last block to finish runs the pass's epilogue and rezeroes the workspace
};

// The kernel parameters: the pass, then its items for this launch.
template <typename Pass, int64_t kCapacity>
struct LaunchArgs {
  Pass pass;
  rt::Word* workspace;  // kWorkspaceWords zeros on entry to a pass, left zero by its kFinish launch
  int64_t first_item;   // the pass's index of items[0] (its grad_stats row is 1 + first_item)
  int32_t num_items;
  Epilogue epilogue;
  WorkItem items[kCapacity];
};

// The workspace of a hand-off pass on the current stream of like's device (call under a device
// guard).  A pass of one launch on an eager stream shares that stream's workspace, kept zeroed
// by each pass's last block: kernels on one stream run one after the other, whatever thread
// queued them.  Evicting one is safe because it was allocated on its stream, so the caching
// allocator only hands its block to later work on that stream.  Every other pass gets its own
// (a zero fill, then dropped once its launches are queued, on the same terms):
// - a pass of several launches, because another thread could queue a pass on the same stream
//   between two of its launches;
// - a pass under CUDA graph capture: the zero fill is captured with it, so each replay starts
//   from zeros, and no eager pass or other graph can touch it while a replay runs.
inline at::Tensor pass_workspace(const at::Tensor& like, rt::Stream stream, bool one_launch) {
  static_assert(sizeof(rt::Word) == sizeof(int32_t), "a workspace word is an int32 element");
  const auto zeros = [&] { return at::zeros({kWorkspaceWords}, like.options().dtype(at::kInt)); };
  if (rt::capturing()) {
    at::Tensor own = zeros();
    rt::graph_owns(own);
    return own;
  }
  if (!one_launch) return zeros();
  static std::mutex mu;
  static std::vector<std::tuple<int, rt::Stream, at::Tensor>> per_stream;
  const int device = rt::device_of(like);
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [d, s, t] : per_stream) {
    if (d == device && s == stream) return t;
  }
  per_stream.emplace_back(device, stream, zeros());
  if (per_stream.size() > kMaxStreamWorkspaces) per_stream.erase(per_stream.begin());
  return std::get<2>(per_stream.back());
}

// Grid of a launch over `items` items: at most one resident wave, and at least one block, since
// the epilogue runs even when there is nothing to visit.
inline unsigned grid_size(int64_t items, int64_t resident) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(items, resident)));
}

}  // namespace cuda
}  // namespace ampfused
