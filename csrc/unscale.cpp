// Host side of the unscale op family (contract: unscale.h): argument checks, the slow path for
// non-dense gradients, the hand-off of dense spans to a backend's launcher, the Autograd-key
// kernels, and the kernels of the keys that only reject (sparse layouts, CUDA in a CPU-only
// build).  The CPU and CUDA keys register in their backend's directory.
#include "unscale.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>

#include "launch_table.h"

namespace ampfused {

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
        is_grad_dtype(g.scalar_type()), "grads[", i, "] has dtype ", g.scalar_type(), "; only ",
        kGradDtypeNames,
        " gradients can be unscaled (integer, bool, complex and float8 gradients are not "
        "supported)");
    TORCH_CHECK(g.device() == device, "grads[", i, "] is on ", g.device(), " but found_inf is on ",
                device,
                "; pass the gradients of one device per call, with found_inf and the scale on "
                "that device (GradScaler groups them by device for you)");
  }
}

void check_scaler_state(const at::Tensor& t, const char* name, const at::Device& device,
                        const char* device_name) {
  TORCH_CHECK_TYPE(t.defined(), name, " is undefined (None); pass the scaler's int32 state of ",
                   int{kScalerStateSize}, " elements");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, name,
                              " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kInt && t.numel() == kScalerStateSize && t.is_contiguous(),
              name, " must be a contiguous int32 tensor of ", int{kScalerStateSize},
              " elements (the scale's float32 bits, the growth tracker, then the counters), got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but ", device_name, " is on ",
              device, "; keep the scaler's state on the device of the gradients");
}

int64_t grad_stats_rows(at::TensorList grads) {
  int64_t rows = 1;
  for (const at::Tensor& g : grads) rows += (g.numel() + kChunkSize - 1) / kChunkSize;
  return rows;
}

void check_grad_stats(const at::Tensor& t, at::TensorList grads, const at::Device& device) {
  const int64_t rows = grad_stats_rows(grads);
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided,
                              "grad_stats must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == kStatFields && t.is_contiguous(),
              "grad_stats must be a contiguous float64 tensor of shape [", rows, ", ",
              int{kStatFields}, "] for these grads (a header row, then ceil(numel / ", kChunkSize,
              ") rows per gradient), got ", t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == device, "grad_stats is on ", t.device(), " but found_inf is on ",
              device, "; allocate it on the device of the gradients");
}

const float* check_islands(c10::IntArrayRef islands, const std::optional<at::Tensor>& island_inv,
                           at::TensorList grads, const at::Device& device) {
  if (islands.empty()) return nullptr;
  TORCH_CHECK(islands.size() == grads.size(), "islands must give one island per gradient (0 for ",
              "none), got ", islands.size(), " for ", grads.size(), " grads");
  TORCH_CHECK_TYPE(island_inv.has_value() && island_inv->defined(),
                   "island_inv is None but islands is given; pass a float32 tensor of each "
                   "island's inverse factor (1 / f)");
  const at::Tensor& t = *island_inv;
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided,
                              "island_inv must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(),
              "island_inv must be a contiguous 1-D float32 tensor (island k's 1 / f at k - 1), "
              "got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == device, "island_inv is on ", t.device(), " but found_inf is on ",
              device, "; keep it on the device of the gradients");
  const int64_t count = std::min<int64_t>(t.numel(), std::numeric_limits<uint16_t>::max());
  for (const auto i : c10::irange(islands.size())) {
    TORCH_CHECK(islands[i] >= 0 && islands[i] <= count, "islands[", i, "] is ", islands[i],
                "; an island is 0 (none) or 1..", count,
                " (an entry of island_inv; 65535 at most)");
  }
  return t.const_data_ptr<float>();
}

PassParams scaler_params(const at::Tensor& state, const at::Tensor& next_state,
                         double growth_factor, double backoff_factor, int64_t growth_interval,
                         double min_scale, double max_scale, int64_t hysteresis, double headroom) {
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= INT32_MAX,
              "hysteresis must be an int >= 1 (the number of consecutive overflowing steps "
              "that backs the scale off; 1 is torch's rule), got ",
              hysteresis);
  TORCH_CHECK(!(min_scale > max_scale), "min_scale (", min_scale, ") must not exceed max_scale (",
              max_scale, ")");
  const double most = headroom < 0.0 ? -headroom : headroom;  // (< 0: a learned margin)
  TORCH_CHECK(headroom == 0.0 || (most >= 1.0 && most <= 65504.0),
              "headroom must be 0 (torch's rule) or a factor from 1 to 65504 (how far below "
              "float16's largest finite value the headroom policy keeps the largest measured "
              "magnitude; negated: the most a learned margin takes), got ",
              headroom);
  PassParams p;
  const int32_t* in = state.const_data_ptr<int32_t>();
  int32_t* out = next_state.mutable_data_ptr<int32_t>();
  p.scale = reinterpret_cast<const float*>(in + kStateScale);
  p.growth_tracker = in + kStateGrowthTracker;
  p.counters = in + kStateHysteresisLeft;
  p.next_scale = reinterpret_cast<float*>(out + kStateScale);
  p.next_growth_tracker = out + kStateGrowthTracker;
  p.next_counters = out + kStateHysteresisLeft;
  p.with_update = true;
  p.policy.growth_factor = growth_factor;
  p.policy.backoff_factor = backoff_factor;
  p.policy.growth_interval = growth_interval;
  p.policy.min_scale = static_cast<float>(min_scale);
  p.policy.max_scale = static_cast<float>(max_scale);
  p.policy.hysteresis = static_cast<int32_t>(hysteresis);
  p.policy.headroom = static_cast<float>(most);
  p.policy.learned = headroom < 0.0;
  return p;
}

void refuse_without_cuda(const at::Device& device) {
  TORCH_CHECK(false, "ampfused was built without CUDA kernels, so it cannot process ", device,
              " tensors; rebuild it where torch has CUDA and nvcc is found "
              "(pip install --no-build-isolation .)");
}

namespace {

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

// The one span of `g`: its own memory, or a packed copy written back after the pass.
void add_span(Prepared& out, const at::Tensor& g, bool check_only, bool with_stats) {
  if (g.is_non_overlapping_and_dense()) {
    // Any stride permutation of a dense block: the elementwise pass can walk raw memory.
    out.spans.push_back({g.data_ptr(), g.numel(), g.scalar_type()});
    return;
  }
  if (provably_non_overlapping(g)) {
    // Gaps between elements: work on a packed copy, then copy back.
    at::Tensor packed = g.contiguous();
    out.spans.push_back({packed.data_ptr(), packed.numel(), packed.scalar_type()});
    out.keep_alive.push_back(packed);
    if (!check_only) out.write_back.emplace_back([g, packed]() mutable { g.copy_(packed); });
    return;
  }
  // Overlapping elements (expanded or as_strided views): unscale each distinct memory location
  // once, as a dense in-place pass over the underlying storage would.  Statistics are per
  // element of the gradient, which such a pass does not visit one by one.
  TORCH_CHECK_NOT_IMPLEMENTED(!with_stats,
                              "grad_stats: a gradient's elements overlap in memory (an "
                              "expanded or as_strided view, shape ",
                              g.sizes(), ", strides ", g.strides(),
                              "); per-gradient statistics need gradients whose elements have "
                              "memory of their own: make it .contiguous()");
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

// `islands`: empty, or each gradient's scale island, given to its span.
Prepared prepare(at::TensorList grads, bool check_only, bool with_stats, c10::IntArrayRef islands) {
  Prepared out;
  out.spans.reserve(grads.size());
  for (const auto i : c10::irange(grads.size())) {
    if (grads[i].numel() == 0) continue;
    add_span(out, grads[i], check_only, with_stats);
    if (!islands.empty()) out.spans.back().island = static_cast<int32_t>(islands[i]);
  }
  return out;
}

}  // namespace

void run_pass(at::TensorList grads, const at::Tensor& found_inf, const PassParams& params,
              LaunchFn launch, c10::IntArrayRef islands) {
  Prepared prep = prepare(grads, params.check_only, params.grad_stats != nullptr, islands);
  launch(prep.spans, params, found_inf);
  for (auto& fn : prep.write_back) fn();
}

namespace {

// The CUDA key of a build without CUDA kernels: the arguments are checked as everywhere, then
// this says why nothing runs.
[[maybe_unused]] void launch_pass_without_cuda(const std::vector<Span>&, const PassParams&,
                                               const at::Tensor& on_device) {
  refuse_without_cuda(on_device.device());
}

// Sparse keys: a sparse argument always fails its layout check before anything launches.
void launch_pass_rejected(const std::vector<Span>&, const PassParams&, const at::Tensor&) {
  TORCH_INTERNAL_ASSERT(false, "ampfused: a sparse argument passed the layout checks");
}

}  // namespace
}  // namespace ampfused

namespace ampfused {
namespace {

// Autograd-key kernels: run the backend kernel below autograd, then bump the version counters of
// what was written (the ADInplaceOrView kernel's job).  They pay for themselves against torch's
// boxed mechanisms, which convert the gradient list to IValues and back.  Measured on the 2-core
// dev CPU with benchmarks/autograd_key_cost.py (retired once decided; in git at b208c16)
// (torch 2.14.1: three copies of a (Tensor(a!)[], Tensor(b!)) op whose kernel only walks the list,
// called from C++ through a typed handle, 16-element grads, minimum of 7 runs):
//                                                     1 tensor    3000 tensors
//   these kernels (unboxed, bump per written tensor)    57 ns     6.8 ns/tensor
//   torch's default fallback (warns, bumps nothing)    154 ns    19.2 ns/tensor
//   autogradNotImplementedFallback + InplaceOrView     190 ns    30.3 ns/tensor
// The last is torch's standard way to get the version bumps: ~23 ns more per tensor, which would
// triple the C++ param_groups walk (~10 ns/tensor).
//
// Gradients that require grad (after backward(create_graph=True)) are unscaled in place like any
// other, as torch's ops do: the ops are not differentiable and record nothing in the graph.
// Unlike torch's ops, the version bump lets autograd refuse a later backward through a node
// that saved such a gradient before it was unscaled, instead of silently using the new values.

void bump(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}
void bump(at::TensorList ts) {
  for (const at::Tensor& t : ts) bump(t);
}

// The arguments the schema marks as written (Tensor(a!)), by position.
std::vector<bool> written_arguments(const c10::FunctionSchema& schema) {
  std::vector<bool> out;
  for (const auto& arg : schema.arguments()) {
    out.push_back(arg.alias_info() != nullptr && arg.alias_info()->isWrite());
  }
  return out;
}

template <typename T>
void bump_if(bool written, const T& arg) {
  if constexpr (std::is_same_v<T, at::Tensor> || std::is_same_v<T, at::TensorList>) {
    if (written) bump(arg);
  } else if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
    if (written && arg.has_value() && arg->defined()) bump(*arg);
  }
}

template <typename Op, typename Sig = typename Op::Signature>
struct AutogradKernel;

template <typename Op, typename... Args>
struct AutogradKernel<Op, void(Args...)> {
  static void call(Args... args) {
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      Op::call(args...);
    }
    static const std::vector<bool> written = written_arguments(Op::handle().schema());
    // unscale_update_scale_ / scaler_pass_ with check_only (argument 9 / 11) writes no gradient,
    // though its schema marks grads (argument 0) as written for the passes that do.
    bool grads_written = true;
    if constexpr (std::is_same_v<Op, ops::unscale_update_scale_>) {
      grads_written = !std::get<9>(std::tie(args...));
    } else if constexpr (std::is_same_v<Op, ops::scaler_pass_>) {
      grads_written = !std::get<11>(std::tie(args...));
    }
    const auto is_written = [&](size_t k) { return written[k] && (k != 0 || grads_written); };
    size_t i = 0;
    (bump_if(is_written(i++), args), ...);
  }
};

}  // namespace
}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, Autograd, m) {
  using namespace ampfused;
  m.impl(ops::non_finite_check_and_unscale_::kName,
         &AutogradKernel<ops::non_finite_check_and_unscale_>::call);
  m.impl(ops::non_finite_check_::kName, &AutogradKernel<ops::non_finite_check_>::call);
  m.impl(ops::unscale_update_scale_::kName, &AutogradKernel<ops::unscale_update_scale_>::call);
  m.impl(ops::scaler_pass_::kName, &AutogradKernel<ops::scaler_pass_>::call);
  m.impl(ops::scaler_update_::kName, &AutogradKernel<ops::scaler_update_>::call);
  m.impl(ops::clip_factor_::kName, &AutogradKernel<ops::clip_factor_>::call);
  m.impl(ops::unscale_into_::kName, &AutogradKernel<ops::unscale_into_>::call);
}

// A sparse argument routes the call to a sparse dispatch key; the shared kernels run there so
// their layout checks reject it with a message that names the argument (NotImplementedError, the
// type of the dispatcher's "Could not run ... SparseCPU" that torch's ops raise).
TORCH_LIBRARY_IMPL(ampfused, SparseCPU, m) {
  ampfused::register_kernels<ampfused::launch_pass_rejected>(m);
}
TORCH_LIBRARY_IMPL(ampfused, SparseCUDA, m) {
  ampfused::register_kernels<ampfused::launch_pass_rejected>(m);
}
TORCH_LIBRARY_IMPL(ampfused, SparseCsrCPU, m) {
  ampfused::register_kernels<ampfused::launch_pass_rejected>(m);
}
TORCH_LIBRARY_IMPL(ampfused, SparseCsrCUDA, m) {
  ampfused::register_kernels<ampfused::launch_pass_rejected>(m);
}

#ifndef AMPFUSED_WITH_CUDA
TORCH_LIBRARY_IMPL(ampfused, CUDA, m) {
  ampfused::register_kernels<ampfused::launch_pass_without_cuda>(m);
}
#endif
