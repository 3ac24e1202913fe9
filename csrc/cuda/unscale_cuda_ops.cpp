// The CUDA key's kernels: the shared checks and parameters (unscale.h) with the CUDA launcher.
// Host code, compiled by the C++ compiler: only launch_pass_cuda needs nvcc.
#include <torch/library.h>

#include "unscale.h"

TORCH_LIBRARY_IMPL(ampfused, CUDA, m) { ampfused::register_kernels<ampfused::launch_pass_cuda>(m); }
