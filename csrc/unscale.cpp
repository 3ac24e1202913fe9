// Host side of the unscale op family (contract: unscale.h): argument checks, the slow path for
// non-dense gradients, and the hand-off of dense spans to the CPU or CUDA kernel.
#include "unscale.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>

namespace ampfused {
namespace {

bool is_supported_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// Exception types are torch's for the same input (contract: unscale.h): TORCH_CHECK for
// RuntimeError, TORCH_CHECK_NOT_IMPLEMENTED for NotImplementedError, TORCH_CHECK_TYPE for
// TypeError.

// A one-element state tensor: scale, inv_scale, found_inf, growth tracker and their pending twins.
void check_state(const at::Tensor& t, const char* name, c10::ScalarType dtype,
                 const at::Device& device) {
  TORCH_CHECK_TYPE(t.defined(), name, " is undefined (None); pass a one-element ", dtype,
                   " tensor");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, name,
                              " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.numel() == 1, name, " must have exactly one element (e.g. torch.zeros(()))",
              ", got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be a ", dtype, " tensor, got ",
              t.scalar_type(), "; create it with dtype=torch.",
              dtype == at::kInt ? "int32" : "float32");
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but found_inf is on ", device,
              "; keep the scale, found_inf and growth tracker on the device of the gradients");
}

// found_inf first: its device is the one every other argument is checked against.
at::Device check_found_inf(const at::Tensor& found_inf) {
  TORCH_CHECK_TYPE(found_inf.defined(),
                   "found_inf is undefined (None); pass a one-element Float tensor");
  check_state(found_inf, "found_inf", at::kFloat, found_inf.device());
  return found_inf.device();
}

// Every gradient is checked before any is written, so a bad one leaves the list unchanged
// (torch's kernels unscale the tensors before it first).
void check_grads(at::TensorList grads, const at::Device& device) {
  for (const auto i : c10::irange(grads.size())) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK_TYPE(g.defined(), "grads[", i, "] is undefined (None); leave it out of the list");
    TORCH_CHECK_NOT_IMPLEMENTED(
        g.layout() == at::kStrided, "grads[", i, "] has layout ", g.layout(),
        "; pass dense tensors (for a sparse COO gradient pass grad._values())");
    TORCH_CHECK_NOT_IMPLEMENTED(
        is_supported_dtype(g.scalar_type()), "grads[", i, "] has dtype ", g.scalar_type(),
        "; only float16, bfloat16, float32 and float64 gradients can be unscaled "
        "(integer, bool, complex and float8 gradients are not supported)");
    TORCH_CHECK(g.device() == device, "grads[", i, "] is on ", g.device(), " but found_inf is on ",
                device,
                "; pass the gradients of one device per call, with found_inf and the scale on "
                "that device (GradScaler groups them by device for you)");
  }
}

// True when no two elements of t share a memory location.  Sufficient test (the usual sorted
// stride check); a layout it cannot prove is treated as overlapping, which is still correct.
bool provably_non_overlapping(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (const auto d : c10::irange(t.dim())) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 1;  // elements spanned by the dims seen so far
  for (const auto& [stride, size] : dims) {
    if (stride < reach) return false;
    reach = stride * size;
  }
  return true;
}

// Dense spans for the kernels, plus what has to be copied back once they ran.
struct Prepared {
  std::vector<Span> spans;
  std::vector<at::Tensor> keep_alive;
  std::vector<std::function<void()>> write_back;
};

Prepared prepare(at::TensorList grads, bool check_only) {
  Prepared out;
  out.spans.reserve(grads.size());
  for (const at::Tensor& g : grads) {
    if (g.numel() == 0) continue;
    if (g.is_non_overlapping_and_dense()) {
      // Any stride permutation of a dense block: the elementwise pass can walk raw memory.
      out.spans.push_back({g.data_ptr(), g.numel(), g.scalar_type()});
      continue;
    }
    if (provably_non_overlapping(g)) {
      // Gaps between elements: work on a packed copy, then copy back.
      at::Tensor packed = g.contiguous();
      out.spans.push_back({packed.data_ptr(), packed.numel(), packed.scalar_type()});
      out.keep_alive.push_back(packed);
      if (!check_only) out.write_back.emplace_back([g, packed]() mutable { g.copy_(packed); });
      continue;
    }
    // Overlapping elements (expanded or as_strided views): unscale each distinct memory location
    // once, as a dense in-place pass over the underlying storage would.
    int64_t extent = 1;
    for (const auto d : c10::irange(g.dim())) extent += (g.size(d) - 1) * g.stride(d);
    const at::Tensor offsets =
        at::arange(extent, g.options().dtype(at::kLong)).as_strided(g.sizes(), g.strides(), 0);
    const at::Tensor distinct = std::get<0>(at::_unique(offsets.reshape(-1), /*sorted=*/true));
    at::Tensor base = g.as_strided({extent}, {1}, g.storage_offset());
    at::Tensor packed = base.index_select(0, distinct);
    out.spans.push_back({packed.data_ptr(), packed.numel(), packed.scalar_type()});
    out.keep_alive.push_back(packed);
    if (!check_only) {
      out.write_back.emplace_back(
          [base, distinct, packed]() mutable { base.index_copy_(0, distinct, packed); });
    }
  }
  return out;
}

void run_pass(at::TensorList grads, const at::Tensor& found_inf, const PassArgs& args) {
  Prepared prep = prepare(grads, args.check_only);
  if (found_inf.is_cpu()) {
    launch_pass_cpu(prep.spans, args);
  } else {
#ifdef AMPFUSED_WITH_CUDA
    TORCH_CHECK(found_inf.is_cuda(), "ampfused has kernels for CPU and CUDA tensors, got ",
                found_inf.device());
    launch_pass_cuda(prep.spans, args, found_inf);
#else
    TORCH_CHECK(false, "ampfused was built without CUDA kernels, so it cannot process ",
                found_inf.device(),
                " tensors; rebuild it where torch has CUDA and nvcc is found "
                "(pip install --no-build-isolation .)");
#endif
  }
  for (auto& fn : prep.write_back) fn();
}

}  // namespace

void non_finite_check_and_unscale_(at::TensorList grads, const at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  const at::Device device = check_found_inf(found_inf);
  check_state(inv_scale, "inv_scale", at::kFloat, device);
  check_grads(grads, device);
  PassArgs a{};
  a.scale = inv_scale.const_data_ptr<float>();
  a.scale_is_inverse = true;
  a.found_inf = found_inf.mutable_data_ptr<float>();
  run_pass(grads, found_inf, a);
}

void non_finite_check_(at::TensorList grads, const at::Tensor& found_inf) {
  check_grads(grads, check_found_inf(found_inf));
  PassArgs a{};
  a.scale = found_inf.const_data_ptr<float>();  // never read: nothing is scaled
  a.scale_is_inverse = true;
  a.check_only = true;
  a.found_inf = found_inf.mutable_data_ptr<float>();
  run_pass(grads, found_inf, a);
}

void unscale_update_scale_(at::TensorList grads, const at::Tensor& found_inf,
                           const at::Tensor& scale, const at::Tensor& growth_tracker,
                           const at::Tensor& next_scale, const at::Tensor& next_growth_tracker,
                           double growth_factor, double backoff_factor, int64_t growth_interval,
                           bool check_only, bool accumulate) {
  const at::Device device = check_found_inf(found_inf);
  check_state(scale, "scale", at::kFloat, device);
  check_state(growth_tracker, "growth_tracker", at::kInt, device);
  check_state(next_scale, "next_scale", at::kFloat, device);
  check_state(next_growth_tracker, "next_growth_tracker", at::kInt, device);
  check_grads(grads, device);
  PassArgs a{};
  a.scale = scale.const_data_ptr<float>();
  a.scale_is_inverse = false;
  a.check_only = check_only;
  a.found_inf = found_inf.mutable_data_ptr<float>();
  a.overwrite_found_inf = true;
  a.with_update = true;
  a.update = UpdateArgs{scale.const_data_ptr<float>(),
                        growth_tracker.const_data_ptr<int32_t>(),
                        next_scale.mutable_data_ptr<float>(),
                        next_growth_tracker.mutable_data_ptr<int32_t>(),
                        growth_factor,
                        backoff_factor,
                        growth_interval,
                        accumulate};
  run_pass(grads, found_inf, a);
}

}  // namespace ampfused

namespace ampfused {
namespace {

// Autograd-key kernels.  Without them every call takes torch's boxed autograd fallback, which
// converts the whole gradient list to IValues and back (most of the per-tensor cost for
// thousands of small gradients).  These stay unboxed: run the backend kernel below autograd, and
// bump the version counters of what was mutated, which is the ADInplaceOrView kernel's job.
//
// Gradients that require grad (after backward(create_graph=True)) are unscaled in place like any
// other, as torch's ops do: the ops are not differentiable and record nothing in the graph.
// Unlike torch's ops, the version bump lets autograd refuse a later backward through a node
// that saved such a gradient before it was unscaled, instead of silently using the new values.

void bump(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

void non_finite_check_and_unscale_autograd(at::TensorList grads, const at::Tensor& found_inf,
                                           const at::Tensor& inv_scale) {
  using Sig = void(at::TensorList, const at::Tensor&, const at::Tensor&);
  static const auto op = handle<Sig>("ampfused::non_finite_check_and_unscale_");
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    op.call(grads, found_inf, inv_scale);
  }
  for (const at::Tensor& g : grads) bump(g);
  bump(found_inf);
}

void non_finite_check_autograd(at::TensorList grads, const at::Tensor& found_inf) {
  using Sig = void(at::TensorList, const at::Tensor&);
  static const auto op = handle<Sig>("ampfused::non_finite_check_");
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    op.call(grads, found_inf);
  }
  bump(found_inf);
}

void unscale_update_scale_autograd(at::TensorList grads, const at::Tensor& found_inf,
                                   const at::Tensor& scale, const at::Tensor& growth_tracker,
                                   const at::Tensor& next_scale,
                                   const at::Tensor& next_growth_tracker, double growth_factor,
                                   double backoff_factor, int64_t growth_interval, bool check_only,
                                   bool accumulate) {
  using Sig = void(at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, double, double, int64_t, bool, bool);
  static const auto op = handle<Sig>("ampfused::unscale_update_scale_");
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    op.call(grads, found_inf, scale, growth_tracker, next_scale, next_growth_tracker, growth_factor,
            backoff_factor, growth_interval, check_only, accumulate);
  }
  if (!check_only) {
    for (const at::Tensor& g : grads) bump(g);  // a check-only pass wrote no gradient
  }
  bump(found_inf);
  bump(next_scale);
  bump(next_growth_tracker);
}

}  // namespace
}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, Autograd, m) {
  m.impl("non_finite_check_and_unscale_", &ampfused::non_finite_check_and_unscale_autograd);
  m.impl("non_finite_check_", &ampfused::non_finite_check_autograd);
  m.impl("unscale_update_scale_", &ampfused::unscale_update_scale_autograd);
}

// The host wrappers pick the CPU or CUDA kernel from the device, so one registration per key.
TORCH_LIBRARY_IMPL(ampfused, CPU, m) {
  m.impl("non_finite_check_and_unscale_", &ampfused::non_finite_check_and_unscale_);
  m.impl("non_finite_check_", &ampfused::non_finite_check_);
  m.impl("unscale_update_scale_", &ampfused::unscale_update_scale_);
}

TORCH_LIBRARY_IMPL(ampfused, CUDA, m) {
  m.impl("non_finite_check_and_unscale_", &ampfused::non_finite_check_and_unscale_);
  m.impl("non_finite_check_", &ampfused::non_finite_check_);
  m.impl("unscale_update_scale_", &ampfused::unscale_update_scale_);
}

// A sparse argument routes the call to a sparse dispatch key; the same wrappers run there so
// their layout checks reject it with a message that names the argument (NotImplementedError, the
// type of the dispatcher's "Could not run ... SparseCPU" that torch's ops raise).
#define AMPFUSED_REJECT_LAYOUT(KEY)                                                    \
  TORCH_LIBRARY_IMPL(ampfused, KEY, m) {                                               \
    m.impl("non_finite_check_and_unscale_", &ampfused::non_finite_check_and_unscale_); \
    m.impl("non_finite_check_", &ampfused::non_finite_check_);                         \
    m.impl("unscale_update_scale_", &ampfused::unscale_update_scale_);                 \
  }
AMPFUSED_REJECT_LAYOUT(SparseCPU)
AMPFUSED_REJECT_LAYOUT(SparseCUDA)
AMPFUSED_REJECT_LAYOUT(SparseCsrCPU)
AMPFUSED_REJECT_LAYOUT(SparseCsrCUDA)
