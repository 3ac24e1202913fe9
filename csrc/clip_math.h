// What clip_factor_ computes (contract: clip.h), written once for g++ and nvcc: the totals of a
// grad_stats table's item rows in a fixed order, the total norm from them, and the clip factor.
// The backends keep only the iteration over rows (CPU: stat_total_rows; CUDA: one block).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "unscale_math.h"

namespace ampfused {

// Lanes of the total: lane l takes item rows l, l + kTotalLanes, l + 2 * kTotalLanes, ... in
// order; then the pairwise tree of stat_tree_level over the lanes.  On CUDA a lane is a thread
// of the one block, so every thread reads its rows coalesced whatever the gradients' sizes.
constexpr int kTotalLanes = 256;

// The fields of the totals; the sums are float64 additions (stat_add), the rest order-free.  An
// aggregate (zeroed by `= {}`), so CUDA can hold an array of them in shared memory.
struct StatTotal {
  double sum_squares;
  double abs_max;     // max over the rows' abs_max (finite values, never NaN)
  double non_finite;  // +inf, -inf and NaN input elements
  double nan;         // NaN input elements
};

AMPFUSED_INLINE void stat_total_add_row(StatTotal& t, const double* row) {
  t.sum_squares = stat_add(t.sum_squares, row[kStatSumSquares]);
  t.abs_max = t.abs_max > row[kStatAbsMax] ? t.abs_max : row[kStatAbsMax];
  t.non_finite += row[kStatPosInf] + row[kStatNegInf] + row[kStatNaN];  // integers: exact
  t.nan += row[kStatNaN];
}

// One tree step: a += b (for the lane j < h and its partner j + h).
AMPFUSED_INLINE void stat_total_merge(StatTotal& a, const StatTotal& b) {
  a.sum_squares = stat_add(a.sum_squares, b.sum_squares);
  a.abs_max = a.abs_max > b.abs_max ? a.abs_max : b.abs_max;
  a.non_finite += b.non_finite;
  a.nan += b.nan;
}

// The CPU's form of the order above, over n item rows (rows[r * kStatFields + f]).
inline StatTotal stat_total_rows(const double* rows, int64_t n) {
  StatTotal lanes[kTotalLanes] = {};
  for (int64_t r = 0; r < n; ++r)
    stat_total_add_row(lanes[r % kTotalLanes], rows + r * kStatFields);
  for (int h = kTotalLanes / 2; h > 0; h /= 2) {
    for (int j = 0; j < h; ++j) stat_total_merge(lanes[j], lanes[j + h]);
  }
  return lanes[0];
}

// The norms clip_factor_ computes from the totals.
enum ClipNorm : int { kClipNorm2 = 0, kClipNormInf };

// The total norm of the unscaled gradients in float64.  2: sqrt of the summed squares (inf and
// NaN elements make it inf and NaN through the squares).  inf: NaN if an element was NaN (in
// the squares too: an inf unscaled by inv == 0), else inf if one was inf, else the largest
// finite magnitude.
AMPFUSED_INLINE double stat_total_norm(const StatTotal& t, ClipNorm norm) {
  if (norm == kClipNorm2) return sqrt(t.sum_squares);
  if (t.nan > 0.0 || t.sum_squares != t.sum_squares)
    return std::numeric_limits<double>::quiet_NaN();
  return t.non_finite > 0.0 ? std::numeric_limits<double>::infinity() : t.abs_max;
}

// Everything clip_factor_ reads and writes, as raw pointers on the table's device.
struct ClipParams {
  const double* rows = nullptr;  // the item rows (table row 1 on)
  int64_t num_rows = 0;
  const float* scale = nullptr;  // the scaler's scale: the factor includes its inverse (null: 1)
  float max_norm = 0.0f;
  ClipNorm norm = kClipNorm2;
  float* total_norm = nullptr;
  float* factor = nullptr;
};

AMPFUSED_INLINE float clip_div(float a, float b) {
#if AMPFUSED_CUDA_INTRINSICS
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The total norm rounded to float32, and the factor the gradients are multiplied by: torch's
// clip_coef = max_norm / (total + 1e-6) (Tensor.__rtruediv__: (1 / (total + 1e-6)) * max_norm,
// each step in float32), clamp(max=1.0) (NaN stays NaN), times inv_scale_of(scale).
AMPFUSED_INLINE void clip_finish(const StatTotal& t, const ClipParams& p) {
  const float total = static_cast<float>(stat_total_norm(t, p.norm));
  const float coef = stat_mul(clip_div(1.0f, stat_add(total, 1e-6f)), p.max_norm);
  const float clamped = coef > 1.0f ? 1.0f : coef;
  const float inv = p.scale == nullptr ? 1.0f : inv_scale_of(*p.scale);
  *p.total_norm = total;
  *p.factor = stat_mul(inv, clamped);
}

}  // namespace ampfused
