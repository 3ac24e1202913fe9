// The dispatcher is the API: every ampfused op's schema, in one place.  Contracts: unscale.h.
#include <torch/library.h>

TORCH_LIBRARY(ampfused, m) {
  m.def(
      "non_finite_check_and_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale)"
      " -> ()");
  m.def("non_finite_check_(Tensor[] grads, Tensor(a!) found_inf) -> ()");
  m.def(
      "unscale_update_scale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor scale, "
      "Tensor growth_tracker, Tensor(c!) next_scale, Tensor(d!) next_growth_tracker, "
      "float growth_factor, float backoff_factor, int growth_interval, bool check_only, "
      "bool accumulate) -> ()");
}
