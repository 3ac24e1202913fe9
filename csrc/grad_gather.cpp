// GradScaler's per-step walk over optimizer.param_groups, in C++.
//
// torch's _unscale_grads_ loops over every parameter in Python (about 1 us each).  This does the
// same walk - skip None grads, refuse float16 unless allowed, coalesce float16 sparse grads,
// take sparse ._values(), group by device - at tens of nanoseconds per parameter, then calls the
// ops with the gathered lists directly, so no per-parameter Python object is created either.
// Gradients that are tensor subclasses (DTensor, ...) make it return None: the caller then
// takes torch's Python path, which dispatches through the subclass.  param_groups and each
// group's 'params' may be any iterable, as in torch's Python loop; a generator is read once.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"
#include "unscale_math.h"

namespace py = pybind11;

namespace ampfused {
namespace {

// The gradients of one device.  Dense grads are *borrowed* (no refcount traffic: two atomic
// operations per tensor are a measurable share of the per-parameter cost); sparse values are
// new tensors, owned by `owned` and borrowed from there.  The parameters keep the dense grads
// alive for the duration of the call.
struct DeviceGrads {
  using Traits = c10::MaybeOwnedTraits<at::Tensor>;
  at::Device device;
  std::vector<at::Tensor> grads;  // borrows only
  std::vector<at::Tensor> owned;

  explicit DeviceGrads(at::Device d) : device(d) {}
  DeviceGrads(DeviceGrads&& o) noexcept = default;
  DeviceGrads(const DeviceGrads&) = delete;
  DeviceGrads& operator=(const DeviceGrads&) = delete;
  DeviceGrads& operator=(DeviceGrads&&) = delete;
  ~DeviceGrads() {
    if (!borrowed) return;
    for (at::Tensor& g : grads) Traits::destroyBorrow(g);
  }
  // Before the GIL is released: another thread could then drop a parameter's .grad.
  void own_all() {
    if (!borrowed) return;
    for (at::Tensor& g : grads) {
      at::Tensor ref = g;
      Traits::destroyBorrow(g);
      g = std::move(ref);
    }
    borrowed = false;
  }
  bool borrowed = true;
  void borrow(const at::Tensor& t) { grads.push_back(Traits::createBorrow(t)); }
  void own(at::Tensor t) {
    owned.push_back(std::move(t));
    borrow(owned.back());
  }
};

[[noreturn]] void raise(PyObject* type, const std::string& msg) {
  PyErr_SetString(type, msg.c_str());
  throw py::error_already_set();
}

std::string where(size_t group, size_t index) {
  return "optimizer.param_groups[" + std::to_string(group) + "]['params'][" +
         std::to_string(index) + "]";
}

// `obj` as a list or tuple (a new reference): lists and tuples as they are, any other iterable
// (a generator, dict values, ...) read once into a new list, as a Python for loop reads it.
// `group` names it in the error: -1 for optimizer.param_groups, else that group's 'params'.
py::object as_sequence(py::handle obj, Py_ssize_t group) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  if (type->tp_iter == nullptr && !PySequence_Check(obj.ptr())) {
    const std::string what =
        group < 0 ? "optimizer.param_groups"
                  : "optimizer.param_groups[" + std::to_string(group) + "]['params']";
    raise(PyExc_TypeError, what + " must be an iterable, got " + std::string(type->tp_name));
  }
  PyObject* seq = PySequence_Fast(obj.ptr(), "");  // errors raised while iterating propagate
  if (seq == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(seq);
}

// Before falling back to torch's Python path, which reads optimizer.param_groups again: a
// group's 'params' that was a one-shot iterator (a generator) has been consumed here, so the
// list read from it takes its place.  A one-shot param_groups cannot be restored from here.
void restore_one_shot(py::handle param_groups, py::handle groups_seq,
                      const std::vector<std::pair<size_t, py::object>>& consumed) {
  if (PyIter_Check(param_groups.ptr())) {
    raise(PyExc_TypeError,
          "optimizer.param_groups is a one-shot iterator (" +
              std::string(Py_TYPE(param_groups.ptr())->tp_name) +
              ") and a gradient needs torch's own unscale path (a tensor subclass or a device "
              "without ampfused kernels), which reads optimizer.param_groups again; make "
              "optimizer.param_groups a list");
  }
  PyObject** groups = PySequence_Fast_ITEMS(groups_seq.ptr());
  for (const auto& [gi, params] : consumed) {
    if (PyObject_SetItem(groups[gi], py::str("params").ptr(), params.ptr()) != 0) {
      throw py::error_already_set();
    }
  }
}

// The gradients of param_groups, grouped by device, plus the Python objects that keep them
// alive (lists read from iterators).  std::nullopt when some gradient needs torch's Python path
// (a tensor subclass, or a device without ampfused kernels).
//
// Errors, as torch's _unscale_grads_ raises them: a param that is not a tensor (AssertionError)
// and a float16 grad without allow_fp16 (ValueError) as they are met; a grad that no kernel
// takes (integer, bool, complex or float8 dtype, a layout other than strided or sparse COO) only
// after the whole walk (NotImplementedError, which torch's op raises once the loop is done, so
// a float16 grad anywhere wins).  Either way nothing was unscaled.
std::optional<std::vector<DeviceGrads>> collect(py::handle param_groups, bool allow_fp16,
                                                std::vector<py::object>& keep_alive) {
  std::vector<DeviceGrads> out;
  keep_alive.push_back(as_sequence(param_groups, -1));
  PyObject* groups_seq = keep_alive.back().ptr();
  const Py_ssize_t ngroups = PySequence_Fast_GET_SIZE(groups_seq);
  std::vector<std::pair<size_t, py::object>> consumed;  // (group, list read from an iterator)
  std::string unsupported;                              // the first grad no kernel takes
  bool fallback = false;                                // some grad needs torch's path
  // Once fallback is decided or an error found, grads are no longer gathered.
  bool skip_rest = false;
  for (Py_ssize_t gi = 0; gi < ngroups; ++gi) {
    py::handle group = PySequence_Fast_GET_ITEM(groups_seq, gi);
    py::object params_obj = group["params"];
    keep_alive.push_back(as_sequence(params_obj, gi));
    PyObject* seq = keep_alive.back().ptr();
    if (PyIter_Check(params_obj.ptr())) consumed.emplace_back(gi, keep_alive.back());
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* obj = items[i];
      if (!THPVariable_Check(obj)) {
        raise(PyExc_AssertionError, "expected param to be torch.Tensor, got " +
                                        std::string(Py_TYPE(obj)->tp_name) + " at " + where(gi, i));
      }
      const at::Tensor& param = THPVariable_Unpack(obj);
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      const auto dtype = grad.scalar_type();
      if (dtype == at::kHalf && !allow_fp16) {
        raise(PyExc_ValueError,
              "Attempting to unscale FP16 gradients. " + where(gi, i) +
                  " has a float16 .grad: GradScaler unscales float32 master gradients. Keep the "
                  "parameters in float32 and let torch.autocast run float16 math (do not call "
                  "model.half()).");
      }
      const at::Layout layout = grad.layout();
      const bool kernel_dtype = is_grad_dtype(dtype);
      const bool kernel_layout = layout == at::kStrided || layout == at::kSparse;
      if (C10_UNLIKELY(!kernel_dtype || !kernel_layout || skip_rest)) {
        // After an error to raise or a fallback decision, only errors are looked for.
        skip_rest = true;
        if (!unsupported.empty()) continue;  // raised after the walk: only the first one
        if (!kernel_dtype) {
          unsupported = "unscaling " + std::string(c10::toString(dtype)) +
                        " gradients is not implemented: " + where(gi, i) +
                        ".grad has that dtype; GradScaler unscales " + kGradDtypeNames +
                        " gradients only";
        } else if (!kernel_layout) {
          unsupported = where(gi, i) + ".grad has layout " + c10::str(layout) +
                        "; GradScaler unscales dense (strided) and sparse COO gradients only";
        }
        continue;
      }
      if (grad.unsafeGetTensorImpl()->is_python_dispatch()) {
        skip_rest = fallback = true;
        continue;
      }
      at::Tensor values;  // defined for sparse grads only
      if (layout == at::kSparse) {
        if (dtype == at::kHalf) {
          // As torch does: duplicates of a float16 sparse grad may only overflow once summed.
          at::Tensor coalesced = grad.coalesce();
          const_cast<at::Tensor&>(param).mutable_grad() = coalesced;
          values = coalesced._values();
        } else {
          values = grad._values();
        }
      }
      const at::Device dev = values.defined() ? values.device() : grad.device();
      // Devices without an ampfused kernel (mps, xpu, ...) take torch's own path.
      if (!(dev.is_cpu() || dev.is_cuda())) {
        skip_rest = fallback = true;
        continue;
      }
      DeviceGrads* slot = nullptr;
      for (auto& d : out) {
        if (d.device == dev) slot = &d;
      }
      if (slot == nullptr) {
        out.emplace_back(dev);
        slot = &out.back();
      }
      if (values.defined()) {
        slot->own(std::move(values));
      } else {
        slot->borrow(grad);
      }
    }
  }
  if (!unsupported.empty()) raise(PyExc_NotImplementedError, unsupported);
  if (fallback) {
    restore_one_shot(param_groups, groups_seq, consumed);
    return std::nullopt;
  }
  return out;
}

using Found = std::vector<std::pair<at::Device, at::Tensor>>;

// Long CPU passes run without the GIL, so other Python threads (data loading) keep going; the
// borrowed grads become owned references first.  Short passes and CUDA launches keep it.
std::optional<py::gil_scoped_release> release_gil_if_long(std::vector<DeviceGrads>& groups) {
  constexpr int64_t kLongPassBytes = 1 << 20;
  int64_t cpu_bytes = 0;
  for (const auto& g : groups) {
    if (!g.device.is_cpu()) continue;
    for (const at::Tensor& t : g.grads)
      cpu_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  if (cpu_bytes < kLongPassBytes) return std::nullopt;
  for (auto& g : groups) g.own_all();
  return std::make_optional<py::gil_scoped_release>();
}

// GradScaler.unscale_ / _check_inf_per_device: the fused pass on the scale's device (found_inf
// overwritten, pending scale/tracker computed), the plain op on any other device.
std::optional<Found> fused_pass(py::handle param_groups, const at::Tensor& scale,
                                const at::Tensor& growth_tracker, const at::Tensor& next_scale,
                                const at::Tensor& next_growth_tracker, double growth_factor,
                                double backoff_factor, int64_t growth_interval, bool check_only,
                                bool accumulate, bool allow_fp16) {
  std::vector<py::object> keep_alive;  // lists read from iterators: they own the params
  auto groups = collect(param_groups, allow_fp16, keep_alive);
  if (!groups) return std::nullopt;
  const auto no_gil = release_gil_if_long(*groups);
  const at::NoGradGuard no_grad;
  Found found;
  at::Tensor inv_scale;  // for other devices, made on first need
  for (auto& g : *groups) {
    if (g.device == scale.device()) {
      at::Tensor f = at::empty({}, scale.options());
      ops::unscale_update_scale_::call(g.grads, f, scale, growth_tracker, next_scale,
                                       next_growth_tracker, growth_factor, backoff_factor,
                                       growth_interval, check_only, accumulate);
      found.emplace_back(g.device, f);
      continue;
    }
    at::Tensor f = at::zeros({}, scale.options().device(g.device));
    if (check_only) {
      ops::non_finite_check_::call(g.grads, f);
    } else {
      if (!inv_scale.defined()) inv_scale = scale.to(at::kDouble).reciprocal().to(at::kFloat);
      ops::non_finite_check_and_unscale_::call(g.grads, f,
                                               inv_scale.to(g.device, /*non_blocking=*/true));
    }
    found.emplace_back(g.device, f);
  }
  return found;
}

// GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16): torch's contract
// (found_inf is OR-ed into; copies of inv_scale/found_inf serve other devices).
std::optional<Found> unscale_grads(py::handle param_groups, const at::Tensor& inv_scale,
                                   const at::Tensor& found_inf, bool allow_fp16) {
  std::vector<py::object> keep_alive;  // lists read from iterators: they own the params
  auto groups = collect(param_groups, allow_fp16, keep_alive);
  if (!groups) return std::nullopt;
  const auto no_gil = release_gil_if_long(*groups);
  const at::NoGradGuard no_grad;
  Found found;
  for (auto& g : *groups) {
    // torch's _MultiDeviceReplicator copies found_inf for every device, its own included, so the
    // caller's tensor is only an initial value.
    at::Tensor f = found_inf.to(g.device, /*non_blocking=*/true, /*copy=*/true);
    at::Tensor inv = g.device == inv_scale.device()
                         ? inv_scale
                         : inv_scale.to(g.device, /*non_blocking=*/true, /*copy=*/true);
    ops::non_finite_check_and_unscale_::call(g.grads, f, inv);
    found.emplace_back(g.device, f);
  }
  return found;
}

}  // namespace
}  // namespace ampfused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ampfused compiled core: ops are registered under torch.ops.ampfused";
  m.def("fused_pass", &ampfused::fused_pass, py::arg("param_groups"), py::arg("scale"),
        py::arg("growth_tracker"), py::arg("next_scale"), py::arg("next_growth_tracker"),
        py::arg("growth_factor"), py::arg("backoff_factor"), py::arg("growth_interval"),
        py::arg("check_only"), py::arg("accumulate"), py::arg("allow_fp16"));
  m.def("unscale_grads", &ampfused::unscale_grads, py::arg("param_groups"), py::arg("inv_scale"),
        py::arg("found_inf"), py::arg("allow_fp16"));
#ifdef AMPFUSED_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
