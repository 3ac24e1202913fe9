// The work list of one CUDA pass (launch_table.h), and private ops that expose it to the CPU
// tests and benchmarks/bench_table.py.
#include "launch_table.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace ampfused {

LaunchPlanner::LaunchPlanner(const std::vector<Span>& spans) : spans_(spans) {
  for (const Span& s : spans) total_ += (s.numel + kChunkSize - 1) / kChunkSize;
}

int64_t LaunchPlanner::next_capacity() const {
  const int64_t remaining = total_ - handed_out_;
  for (const int64_t cap : kLaunchCapacities) {
    if (remaining <= cap) return cap;
  }
  return kLaunchCapacities.back();
}

int64_t LaunchPlanner::fill(WorkItem* out, int64_t capacity) {
  started_ = true;
  int64_t n = 0;
  while (n < capacity && span_ < spans_.size()) {
    const Span& s = spans_[span_];
    const int64_t start = chunk_ * kChunkSize;
    if (start >= s.numel) {  // past the end of this span (or a zero-size one)
      ++span_;
      chunk_ = 0;
      continue;
    }
    out[n++] = WorkItem{static_cast<char*>(s.data) + start * c10::elementSize(s.dtype),
                        static_cast<uint32_t>(std::min(kChunkSize, s.numel - start)),
                        static_cast<int32_t>(s.dtype)};
    ++chunk_;
  }
  handed_out_ += n;
  return n;
}

namespace {

std::vector<Span> spans_of(at::TensorList tensors) {
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (const at::Tensor& t : tensors) spans.push_back({t.data_ptr(), t.numel(), t.scalar_type()});
  return spans;
}

// Every launch of the pass as bytes: per launch, int64 capacity, int64 item count, then the
// items (16 bytes each).
at::Tensor launch_table(at::TensorList tensors) {
  const std::vector<Span> spans = spans_of(tensors);
  LaunchPlanner plan(spans);
  std::vector<uint8_t> bytes;
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

// Host cost of one pass's work list, in ns per tensor: exactly what launch_pass_cuda does before
// each kernel launch (plan, fill the parameter block).  `realloc` moves every pointer on each
// call, as zero_grad(set_to_none=True) does; the same code runs either way.
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
