// Host reduction of the grad_stats table (grad_stats.h).
#include "grad_stats.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "clip_math.h"
#include "launch_table.h"
#include "unscale_math.h"

namespace ampfused {

std::tuple<at::Tensor, double> reduce_grad_stats(const at::Tensor& item_rows,
                                                 const std::vector<int64_t>& numels) {
  int64_t rows = 0;
  for (const int64_t n : numels) {
    TORCH_CHECK(n >= 0, "reduce_grad_stats: numels must be element counts (>= 0), got ", n);
    rows += (n + kChunkSize - 1) / kChunkSize;
  }
  TORCH_CHECK(item_rows.defined() && item_rows.device().is_cpu() &&
                  item_rows.scalar_type() == at::kDouble && item_rows.dim() == 2 &&
                  item_rows.size(0) == rows && item_rows.size(1) == kStatFields &&
                  item_rows.is_contiguous(),
              "reduce_grad_stats: item_rows must be the item rows of the grad_stats table "
              "(table[1:], copied to the CPU), a contiguous float64 tensor of shape [",
              rows, ", ", int{kStatFields}, "] for these numels, got ",
              item_rows.defined() ? item_rows.toString() : "None", " of shape ",
              item_rows.defined() ? item_rows.sizes() : at::IntArrayRef{});
  at::Tensor out = at::zeros({static_cast<int64_t>(numels.size()), kStatFields}, at::kDouble);
  const double* in = item_rows.const_data_ptr<double>();
  double* o = out.mutable_data_ptr<double>();
  for (const int64_t n : numels) {
    const int64_t items = (n + kChunkSize - 1) / kChunkSize;
    for (int64_t r = 0; r < items; ++r, in += kStatFields) {
      for (int f = 0; f < kStatFields; ++f) {
        o[f] = f == kStatAbsMax ? std::max(o[f], in[f]) : o[f] + in[f];
      }
    }
    o += kStatFields;
  }
  return {out, stat_total_rows(item_rows.const_data_ptr<double>(), rows).sum_squares};
}

}  // namespace ampfused
