// The host execution layer's ops: ampfused's CUDA kernels and launchers (csrc/cuda/, compiled
// by the C++ compiler over runtime.h) behind the ops' own checks, as the namespace
// ampfused_host.  Each op has the schema of its ampfused:: namesake and takes CPU tensors;
// tests/host_cuda.py builds this library and calls them.  Test-only: never part of the product.
#include "ops.h"

#include <torch/library.h>

#include <string>
#include <string_view>
#include <vector>

#include "clip.h"
#include "host_cuda/runtime.h"
#include "unscale.h"
#include "unscale_into.h"

namespace ampfused {
namespace {

void configure(int64_t seed, int64_t blocks_in_flight, int64_t resident_blocks, bool capturing) {
  hostcuda::Config c;
  c.seed = seed;
  c.blocks_in_flight = static_cast<int>(blocks_in_flight);
  c.resident_blocks = resident_blocks;
  c.capturing = capturing;
  hostcuda::configure(c);
}

// "ampfused::op(...)" as "op(...)", for the block of namespace ampfused_host.
const char* unqualified(const char* schema) {
  constexpr std::string_view kPrefix = "ampfused::";
  TORCH_INTERNAL_ASSERT(std::string_view(schema).substr(0, kPrefix.size()) == kPrefix);
  return schema + kPrefix.size();
}

// "name count" per kernel instantiation launched in this process.
std::vector<std::string> kernels_launched() {
  std::vector<std::string> out;
  for (const auto& [name, count] : hostcuda::kernels_launched()) {
    out.push_back(name + " " + std::to_string(count));
  }
  return out;
}

std::vector<int64_t> counters() {
  const hostcuda::Counters c = hostcuda::counters();
  return {c.launches, c.blocks, c.phases, c.shuffles, c.points, c.switches};
}

}  // namespace
}  // namespace ampfused

TORCH_LIBRARY(ampfused_host, m) {
  using ampfused::Kernels;
  using ampfused::launch_pass_cuda;
  using ampfused::unqualified;
  namespace ops = ampfused::ops;
  m.def(unqualified(ops::non_finite_check_and_unscale_::kSchema),
        &Kernels<launch_pass_cuda>::non_finite_check_and_unscale_);
  m.def(unqualified(ops::non_finite_check_::kSchema),
        &Kernels<launch_pass_cuda>::non_finite_check_);
  m.def(unqualified(ops::unscale_update_scale_::kSchema),
        &Kernels<launch_pass_cuda>::unscale_update_scale_);
  m.def(unqualified(ops::scaler_pass_::kSchema), &Kernels<launch_pass_cuda>::scaler_pass_);
  m.def(unqualified(ops::scaler_update_::kSchema), &Kernels<launch_pass_cuda>::scaler_update_);
  m.def(unqualified(ops::clip_factor_::kSchema),
        &ampfused::clip_factor_kernel<ampfused::launch_clip_cuda>);
  m.def(unqualified(ops::unscale_into_::kSchema),
        &ampfused::unscale_into_kernel<ampfused::launch_into_cuda>);
  m.def("configure(int seed, int blocks_in_flight, int resident_blocks, bool capturing) -> ()",
        &ampfused::configure);
  m.def("counters() -> int[]", &ampfused::counters);
  m.def("stream_handovers() -> int", &ampfused::hostcuda::stream_handovers);
  m.def("hold_next_launch(int blocks) -> ()", &ampfused::hostcuda::hold_next_launch);
  m.def("release_held() -> ()", &ampfused::hostcuda::release_held);
  m.def("kernels_launched() -> str[]", &ampfused::kernels_launched);
}
