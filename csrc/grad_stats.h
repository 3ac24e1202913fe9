// Host reduction of scaler_pass_'s grad_stats table (unscale_math.h, StatField) to per-gradient
// statistics, after the one device-to-host copy of the table.  Specification:
// ampfused/reference.py, reduce_grad_stats.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace ampfused {

// item_rows: the table's rows after the header (table[1:]), a CPU float64 [R, kStatFields]
// tensor with R = sum of ceil(numel / kChunkSize) over `numels` (each gradient's element count,
// zero-size ones included: they have no rows).  Returns float64 [numels.size(), kStatFields]:
// per gradient its rows reduced in item order (sum_squares summed sequentially in float64,
// counts summed, abs_max the max), and the total sum of squares over every row in clip_factor_'s
// order (clip_math.h, stat_total_rows), so a report's total equals the clip's bit for bit.
std::tuple<at::Tensor, double> reduce_grad_stats(const at::Tensor& item_rows,
                                                 const std::vector<int64_t>& numels);

}  // namespace ampfused
