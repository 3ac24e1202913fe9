// The CUDA key's kernels: the shared checks and parameters (unscale.h, clip.h, unscale_into.h) with
// the CUDA launchers. Host code, compiled by the C++ compiler: only the launchers need nvcc.
#include <torch/library.h>

#include "clip.h"
#include "unscale.h"
#include "unscale_into.h"

TORCH_LIBRARY_IMPL(ampfused, CUDA, m) {
  ampfused::register_kernels<ampfused::launch_pass_cuda>(m);
  m.impl(ampfused::ops::clip_factor_::kName,
         &ampfused::clip_factor_kernel<ampfused::launch_clip_cuda>);
  m.impl(ampfused::ops::unscale_into_::kName,
         &ampfused::unscale_into_kernel<ampfused::launch_into_cuda>);
}
