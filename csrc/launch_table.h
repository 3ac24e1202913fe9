// Host side of the CUDA launch metadata (used by cuda/multi_tensor_apply.cuh): the table of
// tensors and work chunks is built by plain host code, so it is unit-tested and benchmarked on
// the CPU (private ops in launch_table.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "unscale.h"

namespace ampfused {

constexpr int64_t kChunkSize = 65536;  // elements per work item, any dtype

struct TensorMeta {
  void* data;
  int64_t numel;
  int32_t dtype;  // c10::ScalarType
  int32_t reserved;
};

struct ChunkMeta {
  int32_t tensor;  // index into the TensorMeta table
  int32_t chunk;   // chunk index inside that tensor (element offset chunk * kChunkSize)
};

// Byte layout of one table: TensorMeta[spans.size()] then ChunkMeta[num_chunks].
struct TableLayout {
  int64_t num_chunks;
  int64_t tensor_bytes;
  int64_t bytes;
};

TableLayout table_layout(const std::vector<Span>& spans);
void fill_table(const std::vector<Span>& spans, const TableLayout& layout, uint8_t* out);
bool same_spans(const std::vector<Span>& a, const std::vector<Span>& b);

}  // namespace ampfused
