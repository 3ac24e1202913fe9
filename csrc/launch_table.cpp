// Host side of the CUDA launch metadata (launch_table.h), and private ops that expose it to the
// CPU tests and benchmarks/bench_table.py.
#include "launch_table.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <list>

namespace ampfused {

TableLayout table_layout(const std::vector<Span>& spans) {
  int64_t num_chunks = 0;
  for (const Span& s : spans) num_chunks += (s.numel + kChunkSize - 1) / kChunkSize;
  TORCH_CHECK(spans.size() < (1ull << 31), "ampfused: too many tensors in one call (", spans.size(),
              "); split the list");
  const int64_t tensor_bytes = static_cast<int64_t>(spans.size() * sizeof(TensorMeta));
  return {num_chunks, tensor_bytes,
          tensor_bytes + num_chunks * static_cast<int64_t>(sizeof(ChunkMeta))};
}

void fill_table(const std::vector<Span>& spans, const TableLayout& layout, uint8_t* out) {
  auto* tm = reinterpret_cast<TensorMeta*>(out);
  auto* cm = reinterpret_cast<ChunkMeta*>(out + layout.tensor_bytes);
  int64_t c = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    tm[i] = TensorMeta{spans[i].data, spans[i].numel, static_cast<int32_t>(spans[i].dtype), 0};
    const int64_t n = (spans[i].numel + kChunkSize - 1) / kChunkSize;
    for (int64_t k = 0; k < n; ++k)
      cm[c++] = ChunkMeta{static_cast<int32_t>(i), static_cast<int32_t>(k)};
  }
}

bool same_spans(const std::vector<Span>& a, const std::vector<Span>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].data != b[i].data || a[i].numel != b[i].numel || a[i].dtype != b[i].dtype) {
      return false;
    }
  }
  return true;
}

namespace {

std::vector<Span> spans_of(at::TensorList tensors) {
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (const at::Tensor& t : tensors) spans.push_back({t.data_ptr(), t.numel(), t.scalar_type()});
  return spans;
}

at::Tensor launch_table(at::TensorList tensors) {
  const std::vector<Span> spans = spans_of(tensors);
  const TableLayout layout = table_layout(spans);
  at::Tensor out = at::empty({layout.bytes}, at::kByte);
  fill_table(spans, layout, out.mutable_data_ptr<uint8_t>());
  return out;
}

// Host cost of one launch's metadata, in ns per tensor: the cache walk of get_meta_table and, on a
// miss, the key copy and table build.  `realloc` shifts every pointer on each call, as
// zero_grad(set_to_none=True) does; the pinned allocation and copy of a real miss are not in it.
double bench_launch_table(at::TensorList tensors, int64_t iters, bool realloc) {
  struct Entry {
    std::vector<Span> key;
    std::vector<uint8_t> table;
  };
  constexpr size_t kEntries = 16;
  std::list<Entry> cache;
  std::vector<Span> spans = spans_of(tensors);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    if (realloc) {
      for (Span& s : spans) s.data = static_cast<char*>(s.data) + 256;
    }
    bool hit = false;
    for (auto e = cache.begin(); e != cache.end(); ++e) {
      if (same_spans(e->key, spans)) {
        cache.splice(cache.begin(), cache, e);
        hit = true;
        break;
      }
    }
    if (hit) continue;
    const TableLayout layout = table_layout(spans);
    Entry e{spans, std::vector<uint8_t>(static_cast<size_t>(layout.bytes))};
    fill_table(spans, layout, e.table.data());
    cache.push_front(std::move(e));
    if (cache.size() > kEntries) cache.pop_back();
  }
  const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - start;
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
