"""What the Autograd-key kernels of csrc/unscale.cpp save: three copies of a
``(Tensor(a!)[] g, Tensor(b!) f) -> ()`` op with a CPU kernel that only walks the list, one with
an unboxed Autograd kernel like ours, one with torch's default fallback, one with
autogradNotImplementedFallback + its ADInplaceOrView twin (torch's standard way to get version
bumps), each called from C++ through a typed handle on 1 and 3000 16-element tensors.
Compiles a scratch extension (about a minute).

    python -m benchmarks.autograd_key_cost
"""

from __future__ import annotations

import statistics

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/library.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <chrono>

using Sig = void(at::TensorList, const at::Tensor&);
void kern(at::TensorList g, const at::Tensor& f) {
  int64_t n = 0;
  for (const auto& t : g) n += t.numel();
  f.mutable_data_ptr<float>()[0] += static_cast<float>(n & 1);
}
void bump(const at::Tensor& t) { if (!t.is_inference()) torch::autograd::impl::bump_version(t); }
void explicit_ag(at::TensorList g, const at::Tensor& f) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("agb::explicit_", "").typed<Sig>();
  { at::AutoDispatchBelowADInplaceOrView below; op.call(g, f); }
  for (const auto& t : g) bump(t);
  bump(f);
}
TORCH_LIBRARY(agb, m) {
  m.def("explicit_(Tensor(a!)[] g, Tensor(b!) f) -> ()");
  m.def("basic_(Tensor(a!)[] g, Tensor(b!) f) -> ()");
  m.def("notimpl_(Tensor(a!)[] g, Tensor(b!) f) -> ()");
}
TORCH_LIBRARY_IMPL(agb, CPU, m) {
  m.impl("explicit_", &kern); m.impl("basic_", &kern); m.impl("notimpl_", &kern);
}
TORCH_LIBRARY_IMPL(agb, Autograd, m) {
  m.impl("explicit_", &explicit_ag);
  m.impl("notimpl_", torch::autograd::autogradNotImplementedFallback());
}
TORCH_LIBRARY_IMPL(agb, ADInplaceOrView, m) {
  m.impl("notimpl_", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}
// ns per call, C++ loop over typed handle
double time_op(const std::string& name, std::vector<at::Tensor> g, at::Tensor f, int iters) {
  auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(("agb::" + name).c_str(), "").typed<Sig>();
  for (int i = 0; i < 10; ++i) op.call(g, f);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) op.call(g, f);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}
"""


def main() -> None:
    ext = load_inline("ampfused_agb", CPP, functions=["time_op"], extra_cflags=["-O3"])
    f = torch.zeros(())
    for n in (1, 3000):
        g = [torch.randn(16) for _ in range(n)]
        for name in ("explicit_", "basic_", "notimpl_"):
            runs = [ext.time_op(name, g, f, 20000 if n == 1 else 300) for _ in range(7)]
            print(
                f"n={n:5d} {name:10s} min {min(runs):9.0f} ns/call  {min(runs) / n:7.1f} ns/tensor"
                f"  (median {statistics.median(runs):9.0f})"
            )


if __name__ == "__main__":
    main()
