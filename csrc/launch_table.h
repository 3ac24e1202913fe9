// The work list of one CUDA pass, built by plain host code: no GPU is needed to run it, so it is
// unit-tested and benchmarked on the CPU (private ops in launch_table.cpp).
//
// A pass is cut into work items of at most kChunkSize elements of one tensor, 16 bytes each
// (pointer, count, dtype, scale island), and the items travel BY VALUE in the kernel's parameters:
// CUDA 12.1+ accepts 32,764 bytes of parameters on Volta and newer (every arch we
// build, 7.5/8.0/9.0), so one launch carries up to kLaunchCapacities.back() items and a larger pass
// takes several launches.  Why by value and not a cached device table (what this replaced):
// - a reallocated gradient set (zero_grad(set_to_none=True)) costs exactly what an unchanged one
//   costs, because nothing is cached: no key copy or compare, no pinned host buffer, no device
//   buffer, no host-to-device copy, no table eviction;
// - a CUDA graph that captures the launch owns a copy of its parameters, so a captured pass
//   outlives any cache and a pass over gradients allocated during the capture needs nothing
//   prepared beforehand;
// - the kernel reads its item in one load from the constant bank instead of two dependent
//   global loads (chunk, then tensor).
// Parameter bytes are copied by the driver at every launch, so small passes use a smaller class.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "unscale.h"

namespace ampfused {

constexpr int64_t kChunkSize = 65536;  // elements per work item, any dtype

struct WorkItem {
  void* data;       // first element of the item
  uint32_t numel;   // 1..kChunkSize
  int16_t dtype;    // c10::ScalarType
  uint16_t island;  // its gradient's scale island (Span::island): 0 for none
};
static_assert(sizeof(WorkItem) == 16, "WorkItem is a 16-byte kernel parameter record");

// Item capacities of a launch, smallest first; the largest keeps a launch's parameters under
// 32,764 bytes (checked where the kernel arguments are defined).
constexpr std::array<int64_t, 2> kLaunchCapacities = {256, 2032};

// Hands out the work items of `spans` launch by launch: every launch but the last is full and
// of the largest class; the last takes the smallest class that holds what is left.  Zero-size
// spans give no item; an empty pass is one launch of zero items.
class LaunchPlanner {
 public:
  explicit LaunchPlanner(const std::vector<Span>& spans);
  int64_t total_items() const { return total_; }
  // The dtype of every item, or Undefined when they differ or there is none: a pass of one
  // dtype can take a kernel compiled for it alone.
  c10::ScalarType uniform_dtype() const { return uniform_; }
  bool done() const { return handed_out_ == total_ && started_; }
  int64_t handed_out() const { return handed_out_; }  // items filled so far
  int64_t next_capacity() const;
  // Writes the next min(capacity, remaining) items to `out` and returns their count.
  int64_t fill(WorkItem* out, int64_t capacity);

 private:
  const std::vector<Span>& spans_;
  int64_t total_ = 0;
  c10::ScalarType uniform_ = c10::ScalarType::Undefined;
  int64_t handed_out_ = 0;
  bool started_ = false;
  size_t span_ = 0;    // cursor: span of the next item
  int64_t chunk_ = 0;  // and its chunk inside that span
};

}  // namespace ampfused
