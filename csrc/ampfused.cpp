// The dispatcher is the API: every ampfused op is defined here, from its schema in ops.h.
// Contracts: unscale.h, clip.h, unscale_into.h.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(ampfused, m) {
  m.def(ampfused::ops::non_finite_check_and_unscale_::kSchema);
  m.def(ampfused::ops::non_finite_check_::kSchema);
  m.def(ampfused::ops::unscale_update_scale_::kSchema);
  m.def(ampfused::ops::scaler_pass_::kSchema);
  m.def(ampfused::ops::scaler_update_::kSchema);
  m.def(ampfused::ops::clip_factor_::kSchema);
  m.def(ampfused::ops::unscale_into_::kSchema);
}
