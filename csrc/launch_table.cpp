// The work list of one CUDA pass (launch_table.h), and private ops that expose it to the CPU
// tests (and to benchmarks/bench_table.py, retired once its decision was made; in git before
// 77e5fb8).
#include "launch_table.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace ampfused {

LaunchPlanner::LaunchPlanner(const std::vector<Span>& spans) : spans_(spans) {
  // Locals, not members, in the loops: a member store could alias a span as far as the
  // compiler knows, and would be reloaded every iteration.
  int64_t total = 0;
  c10::ScalarType uniform = c10::ScalarType::Undefined;
  bool mixed = false;
  for (const Span& s : spans) {
    if (s.numel == 0) continue;
    total += (s.numel + kChunkSize - 1) / kChunkSize;
    mixed |= uniform != c10::ScalarType::Undefined && s.dtype != uniform;
    uniform = s.dtype;
  }
  total_ = total;
  uniform_ = mixed ? c10::ScalarType::Undefined : uniform;
}

int64_t LaunchPlanner::next_capacity() const {
  const int64_t remaining = total_ - handed_out_;
  for (const int64_t cap : kLaunchCapacities) {
    if (remaining <= cap) return cap;
  }
  return kLaunchCapacities.back();
}

int64_t LaunchPlanner::fill(WorkItem* out, int64_t capacity) {
  const Span* const spans = spans_.data();
  const size_t num_spans = spans_.size();
  size_t span = span_;
  int64_t chunk = chunk_;
  int64_t n = 0;
  while (n < capacity && span < num_spans) {
    const Span& s = spans[span];
    if (chunk == 0 && s.numel <= kChunkSize) {  // one item or none: the common, fast case
      if (s.numel > 0) {
        out[n++] = WorkItem{s.data, static_cast<uint32_t>(s.numel), static_cast<int16_t>(s.dtype),
                            static_cast<uint16_t>(s.island)};
      }
      ++span;
      continue;
    }
    auto* const data = static_cast<char*>(s.data);
    const int64_t item_bytes = kChunkSize * static_cast<int64_t>(c10::elementSize(s.dtype));
    const auto dtype = static_cast<int16_t>(s.dtype);
    const auto island = static_cast<uint16_t>(s.island);
    int64_t start = chunk * kChunkSize;
    for (; start < s.numel && n < capacity; start += kChunkSize, ++chunk) {
      out[n++] =
          WorkItem{data + chunk * item_bytes,
                   static_cast<uint32_t>(std::min(kChunkSize, s.numel - start)), dtype, island};
    }
    if (start >= s.numel) {  // this span is done (a zero-size one gives no item)
      ++span;
      chunk = 0;
    }
  }
  span_ = span;
  chunk_ = chunk;
  handed_out_ += n;
  started_ = true;
  return n;
}

namespace {

std::vector<Span> spans_of(at::TensorList tensors) {
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (const at::Tensor& t : tensors) spans.push_back({t.data_ptr(), t.numel(), t.scalar_type()});
  return spans;
}

// The pass as bytes: int64 uniform dtype (c10::ScalarType, -1 for Undefined), then per launch
// int64 capacity, int64 item count and the items (16 bytes each).
at::Tensor launch_table(at::TensorList tensors) {
  const std::vector<Span> spans = spans_of(tensors);
  LaunchPlanner plan(spans);
  const int64_t uniform = plan.uniform_dtype() == c10::ScalarType::Undefined
                              ? -1
                              : static_cast<int64_t>(plan.uniform_dtype());
  std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(&uniform),
                             reinterpret_cast<const uint8_t*>(&uniform + 1));
  std::vector<WorkItem> items(static_cast<size_t>(kLaunchCapacities.back()));
  do {
    const int64_t capacity = plan.next_capacity();
    const int64_t head[2] = {capacity, plan.fill(items.data(), capacity)};
    const auto* h = reinterpret_cast<const uint8_t*>(head);
    const auto* it = reinterpret_cast<const uint8_t*>(items.data());
    bytes.insert(bytes.end(), h, h + sizeof(head));
    bytes.insert(bytes.end(), it, it + head[1] * static_cast<int64_t>(sizeof(WorkItem)));
  } while (!plan.done());
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(out.mutable_data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return out;
}

// Host cost of one pass's work list, in ns per tensor: the per-tensor part of what
// launch_pass_cuda does before its launches (plan, fill the parameter block); its fixed costs
// (workspace lookup, capture query, the launch itself) are not in it.  One caller at a time.
// `realloc` moves every pointer on each call, as zero_grad(set_to_none=True) does; the same code
// runs either way.
double bench_launch_table(at::TensorList tensors, int64_t iters, bool realloc) {
  std::vector<Span> spans = spans_of(tensors);
  static WorkItem params[kLaunchCapacities.back()];  // stands in for the kernel parameters
  int64_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    if (realloc) {
      for (Span& s : spans) s.data = static_cast<char*>(s.data) + 256;
    }
    LaunchPlanner plan(spans);
    do {
      sink += plan.fill(params, plan.next_capacity());
    } while (!plan.done());
  }
  const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - start;
  TORCH_CHECK(sink >= 0);  // keeps the loop from being optimized away
  return dt.count() / static_cast<double>(iters) /
         static_cast<double>(std::max<size_t>(1, spans.size()));
}

}  // namespace
}  // namespace ampfused

// Private ops for tests and benchmarks (not part of the API): the schemas live here, not in
// ampfused.cpp, because they exist only to reach host code that has no public face.
TORCH_LIBRARY_FRAGMENT(ampfused, m) {
  m.def("_launch_table(Tensor[] tensors) -> Tensor", &ampfused::launch_table);
  m.def("_bench_launch_table(Tensor[] tensors, int iters, bool realloc) -> float",
        &ampfused::bench_launch_table);
}
