// The compiled module ampfused._C: GradScaler's fused pass over optimizer.param_groups, and the
// eager entry points of ampfused.ops.  Every op runs through its typed dispatcher handle
// (ops.h); the gathering is grad_gather.cpp's.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "grad_gather.h"
#include "grad_stats.h"
#include "ops.h"
#include "unscale.h"
#include "unscale_math.h"

namespace py = pybind11;

namespace ampfused {
namespace {

using Found = std::vector<std::pair<at::Device, at::Tensor>>;

// Copies of the scale and found_inf to a gradient device may be asynchronous only when that
// device is a GPU, where the kernel runs after the copy on the stream.  A CPU kernel reads its
// inputs at once, so a copy from the GPU to the CPU must have landed (torch's
// _MultiDeviceReplicator copies non_blocking either way, and can read a pinned buffer early).
bool async_to(const at::Device& device) { return !device.is_cpu(); }

// The gradients of param_groups, gathered per device, each device's gathered grads handed to
// pass(DeviceGrads), which returns that device's result; long CPU passes run without the GIL.
// std::nullopt when some gradient needs torch's Python path (grad_gather.h).
// `unwrap`: DTensor gradients as their local shards (collect() in grad_gather.h).
template <typename Pass>
auto per_device(py::handle param_groups, bool allow_fp16, Pass pass, bool positions = false,
                py::handle unwrap = py::none())
    -> std::optional<std::vector<decltype(pass(std::declval<const DeviceGrads&>()))>> {
  std::vector<py::object> keep_alive;  // lists read from iterators: they own the params
  auto groups = collect(param_groups, allow_fp16, keep_alive, positions, unwrap);
  if (!groups) return std::nullopt;
  const auto no_gil = release_gil_if_long(*groups);
  const at::NoGradGuard no_grad;
  std::vector<decltype(pass(std::declval<const DeviceGrads&>()))> out;
  for (const DeviceGrads& g : *groups) out.push_back(pass(g));
  return out;
}

// One device's result of GradScaler's pass: found_inf, and with statistics the grad_stats table
// and an int64 [grads, 2] tensor of each gradient's parameter position (grad_gather.h) and numel.
using ScalerFound =
    std::tuple<at::Device, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>;

// GradScaler.unscale_ / _check_inf_per_device: the scaler pass on the state's device (found_inf
// overwritten, next_state computed).  On another device the plain ops run, or with statistics
// the scaler pass on a copy of the state (its next_state is dropped: with gradients on several
// devices GradScaler.update() recomputes the update from every found_inf).
// Scale islands: `island_of` (None, or a list of each parameter position's island, 0 for none)
// and `island_inv` (float32, on the state's device: scaler_pass_'s); a gradient of an island on
// another device is refused.
std::optional<std::vector<ScalerFound>> fused_pass(
    py::handle param_groups, const at::Tensor& state, const at::Tensor& next_state,
    double growth_factor, double backoff_factor, int64_t growth_interval, double min_scale,
    double max_scale, int64_t hysteresis, bool check_only, bool accumulate, bool allow_fp16,
    bool with_stats, py::handle unwrap, double headroom, py::handle island_of,
    const std::optional<at::Tensor>& island_inv) {
  at::Tensor inv_scale;  // for other devices, made on first need
  const bool with_islands = !island_of.is_none();
  std::vector<int64_t> of_position;
  if (with_islands) of_position = island_of.cast<std::vector<int64_t>>();
  return per_device(
      param_groups, allow_fp16,
      [&](const DeviceGrads& g) -> ScalerFound {
        const at::Device& device = g.device;
        at::TensorList grads = g.grads;
        std::vector<int64_t> islands;
        if (with_islands) {
          islands.reserve(grads.size());
          for (const int64_t position : g.positions) {
            TORCH_CHECK_VALUE(position < static_cast<int64_t>(of_position.size()), "island_of has ",
                              of_position.size(),
                              " entries but the optimizer holds more parameters; give one per "
                              "parameter of its param_groups");
            const int64_t k = of_position[position];
            TORCH_CHECK_NOT_IMPLEMENTED(k == 0 || device == state.device(),
                                        "scale islands: a gradient of an island is on ", device,
                                        " but the scale is on ", state.device(),
                                        "; islands need their gradients on the scale's device");
            islands.push_back(k);
          }
        }
        std::optional<at::Tensor> stats, positions;
        if (with_stats) {
          stats = at::empty({grad_stats_rows(grads), kStatFields},
                            state.options().dtype(at::kDouble).device(device));
          // [position, numel] per gradient: what the statistics rows are reduced by.
          std::vector<int64_t> pn;
          pn.reserve(2 * grads.size());
          for (size_t i = 0; i < grads.size(); ++i) {
            pn.push_back(g.positions[i]);
            pn.push_back(grads[i].numel());
          }
          positions = at::tensor(pn, at::kLong).view({-1, 2});
        }
        at::Tensor f = at::empty({}, state.options().dtype(at::kFloat).device(device));
        if (device == state.device() || with_stats) {
          const bool here = device == state.device();
          const at::Tensor s = here ? state : state.to(device, /*non_blocking=*/async_to(device));
          const at::Tensor next = here ? next_state : at::empty_like(s);
          ops::scaler_pass_::call(grads, f, s, next, stats, growth_factor, backoff_factor,
                                  growth_interval, min_scale, max_scale, hysteresis, check_only,
                                  here && accumulate, here ? headroom : 0.0,
                                  here ? c10::IntArrayRef(islands) : c10::IntArrayRef(),
                                  here && !islands.empty() ? island_inv : std::nullopt);
          return {device, f, stats, positions};
        }
        f.zero_();
        if (check_only) {
          ops::non_finite_check_::call(grads, f);
        } else {
          // inv_scale_of (unscale_math.h) as tensor ops, computed once on the state's device.
          if (!inv_scale.defined()) {
            inv_scale = state.narrow(0, kStateScale, 1)
                            .view(at::kFloat)
                            .to(at::kDouble)
                            .reciprocal()
                            .to(at::kFloat);
          }
          ops::non_finite_check_and_unscale_::call(
              grads, f, inv_scale.to(device, /*non_blocking=*/async_to(device)));
        }
        return {device, f, stats, positions};
      },
      /*positions=*/with_stats || with_islands, unwrap);
}

// GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16): torch's contract
// (found_inf is OR-ed into; copies of inv_scale/found_inf serve other devices).
// With `unwrap`, DTensor gradients are unscaled as their local shards, found_inf not reduced.
std::optional<Found> unscale_grads(py::handle param_groups, const at::Tensor& inv_scale,
                                   const at::Tensor& found_inf, bool allow_fp16,
                                   py::handle unwrap) {
  return per_device(
      param_groups, allow_fp16,
      [&](const DeviceGrads& g) -> Found::value_type {
        const at::Device& device = g.device;
        at::TensorList grads = g.grads;
        // torch's _MultiDeviceReplicator copies found_inf for every device, its own included, so
        // the caller's tensor is only an initial value.
        at::Tensor f = found_inf.to(device, /*non_blocking=*/async_to(device), /*copy=*/true);
        at::Tensor inv =
            device == inv_scale.device()
                ? inv_scale
                : inv_scale.to(device, /*non_blocking=*/async_to(device), /*copy=*/true);
        ops::non_finite_check_and_unscale_::call(grads, f, inv);
        return {device, f};
      },
      /*positions=*/false, unwrap);
}

// Test hook: the shared per-element code (unscale_math.h) called the way the CUDA kernel calls
// it - one element at a time, inv_is_one a run-time value - in place over a contiguous CPU
// tensor; returns whether an element was inf/NaN.  The CPU kernel calls the same functions with
// constant modes in vectorized loops (where the compiler may fold v * 1 to v); the tests run
// both on every special value, so the CUDA form of each fact is tested without a GPU.
bool visit_elements(const at::Tensor& t, double inv_scale, bool check_only) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous(), "_visit_elements takes a contiguous CPU tensor");
  const float inv = static_cast<float>(inv_scale);
  const bool inv_is_one = inv == 1.0f;
  uint32_t bad = 0;
  const bool known = visit_grad_dtype(t.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(t.data_ptr());
    const auto m = static_cast<opmath_t<T>>(inv);
    for (int64_t i = 0; i < t.numel(); ++i) {
      bad |=
          check_only ? visit<T, true>(p[i], m, inv_is_one) : visit<T, false>(p[i], m, inv_is_one);
    }
  });
  TORCH_CHECK_NOT_IMPLEMENTED(known, "_visit_elements: ", t.scalar_type(), " is not a grad dtype");
  return bad != 0;
}

// The eager entry points of ampfused.ops: the op called through its typed handle with the
// caller's arguments as they are, as torch's generated bindings call torch's ops.  The generic
// torch.ops path boxes every argument in Python's operator binding: one 16-element CPU tensor
// costs ~2.0 us there (torch's own op ~2.4 us through torch.ops.aten) against ~0.9 us for
// torch._amp_foreach_non_finite_check_and_unscale_.  Anything but the plain form - a tensor
// subclass (it may override __torch_function__), a None or non-tensor in the list, another
// Python type for a number, a torch function mode - returns NotImplemented, and the wrapper
// takes torch.ops, which dispatches it or raises torch's error.  Same checks either way: they
// are the kernels'.

// C++ storage for one argument of an op's signature: tensors are borrowed from the caller's
// Python objects (see GradList), which the call's arguments keep alive.
struct BorrowedTensor {
  at::Tensor t;
  BorrowedTensor() = default;
  BorrowedTensor(const BorrowedTensor&) = delete;
  BorrowedTensor& operator=(const BorrowedTensor&) = delete;
  ~BorrowedTensor() {
    if (t.defined()) GradList::Traits::destroyBorrow(t);
  }
};
// An int[] argument (a list of Python ints), owned.
struct IntList {
  std::vector<int64_t> values;
};
template <typename T>
using Held =
    std::conditional_t<std::is_same_v<T, at::TensorList>, GradList,
                       std::conditional_t<std::is_same_v<T, const at::Tensor&>, BorrowedTensor,
                                          std::conditional_t<std::is_same_v<T, c10::IntArrayRef>,
                                                             IntList, std::decay_t<T>>>>;

bool load(PyObject* o, BorrowedTensor& out) {
  if (!THPVariable_CheckExact(o)) return false;
  out.t = GradList::Traits::createBorrow(THPVariable_Unpack(o));
  return true;
}
bool load(PyObject* o, GradList& out) {
  if (!PyList_CheckExact(o) && !PyTuple_CheckExact(o)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  PyObject** items = PySequence_Fast_ITEMS(o);
  out.grads.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) return false;
    out.borrow(THPVariable_Unpack(items[i]));
  }
  return true;
}
bool load(PyObject* o, std::optional<at::Tensor>& out) {
  if (o == Py_None) {
    out = std::nullopt;
    return true;
  }
  if (!THPVariable_CheckExact(o)) return false;
  out = THPVariable_Unpack(o);
  return true;
}
bool load(PyObject* o, IntList& out) {
  if (!PyList_CheckExact(o) && !PyTuple_CheckExact(o)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  PyObject** items = PySequence_Fast_ITEMS(o);
  out.values.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return false;
    int overflow = 0;
    out.values[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0) return false;
  }
  return true;
}
bool load(PyObject* o, double& out) {
  if (!PyFloat_CheckExact(o)) return false;
  out = PyFloat_AS_DOUBLE(o);
  return true;
}
bool load(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0;
}
bool load(PyObject* o, bool& out) {
  if (!PyBool_Check(o)) return false;
  out = o == Py_True;
  return true;
}

const at::Tensor& unwrap(const BorrowedTensor& h) { return h.t; }
at::TensorList unwrap(const GradList& h) { return h.grads; }
c10::IntArrayRef unwrap(const IntList& h) { return h.values; }
template <typename T>
T unwrap(T v) {
  return v;
}

template <typename Op, typename Sig = typename Op::Signature>
struct EagerCall;

template <typename Op, typename... Args>
struct EagerCall<Op, void(Args...)> {
  static PyObject* call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    // With a mode set, Python runs inside the op call and could drop a borrowed tensor.
    if (nargs != static_cast<Py_ssize_t>(sizeof...(Args)) ||
        at::impl::torch_function_mode_enabled() ||
        c10::impl::TorchDispatchModeTLS::any_modes_set()) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    std::tuple<Held<Args>...> held;
    const bool plain = std::apply(
        [&](auto&... h) {
          Py_ssize_t i = 0;
          return (load(args[i++], h) && ...);
        },
        held);
    if (!plain) Py_RETURN_NOTIMPLEMENTED;
    {
      // The grads list could be emptied by another thread once the GIL is released.
      const auto no_gil = release_gil_if_long(std::get<0>(held));
      std::apply([](const auto&... h) { Op::call(unwrap(h)...); }, held);
    }
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
  }
};

PyMethodDef eager_calls[] = {
    {"non_finite_check_and_unscale_",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(&EagerCall<ops::non_finite_check_and_unscale_>::call)),
     METH_FASTCALL, "ampfused.ops.non_finite_check_and_unscale_'s eager path"},
    {"non_finite_check_",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(&EagerCall<ops::non_finite_check_>::call)),
     METH_FASTCALL, "ampfused.ops.non_finite_check_'s eager path"},
    {"unscale_update_scale_",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(&EagerCall<ops::unscale_update_scale_>::call)),
     METH_FASTCALL, "ampfused.ops.unscale_update_scale_'s eager path"},
    {"scaler_pass_",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)()>(&EagerCall<ops::scaler_pass_>::call)),
     METH_FASTCALL, "ampfused.ops.scaler_pass_'s eager path (also activation tracing's)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace ampfused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ampfused compiled core: ops are registered under torch.ops.ampfused";
  m.def("fused_pass", &ampfused::fused_pass, py::arg("param_groups"), py::arg("state"),
        py::arg("next_state"), py::arg("growth_factor"), py::arg("backoff_factor"),
        py::arg("growth_interval"), py::arg("min_scale"), py::arg("max_scale"),
        py::arg("hysteresis"), py::arg("check_only"), py::arg("accumulate"), py::arg("allow_fp16"),
        py::arg("with_stats"), py::arg("unwrap") = py::none(), py::arg("headroom") = 0.0,
        py::arg("island_of") = py::none(), py::arg("island_inv") = std::nullopt);
  m.def("unscale_grads", &ampfused::unscale_grads, py::arg("param_groups"), py::arg("inv_scale"),
        py::arg("found_inf"), py::arg("allow_fp16"), py::arg("unwrap") = py::none());
  m.def("reduce_grad_stats", &ampfused::reduce_grad_stats, py::arg("item_rows"), py::arg("numels"));
  m.def(
      "reduce_grad_stats",
      [](const at::Tensor& item_rows, const at::Tensor& numels) {
        TORCH_CHECK(numels.dim() == 1 && numels.scalar_type() == at::kLong,
                    "reduce_grad_stats: numels must be a list of ints or a 1-D int64 tensor, got ",
                    numels.scalar_type(), " of shape ", numels.sizes());
        const at::Tensor n = numels.cpu().contiguous();
        const int64_t* p = n.const_data_ptr<int64_t>();
        return ampfused::reduce_grad_stats(item_rows, std::vector<int64_t>(p, p + n.numel()));
      },
      py::arg("item_rows"), py::arg("numels"));
  m.def("masters_pass", &ampfused::masters_pass, py::arg("params"), py::arg("masters"),
        py::arg("inv_scale"), py::arg("cast_from"));
  m.def("masters_first_changed", &ampfused::masters_first_changed, py::arg("params"),
        py::arg("positions"), py::arg("cast_from"));
  m.def("versions_of", &ampfused::versions_of, py::arg("tensors"));
  m.def("versions_changed", &ampfused::versions_changed, py::arg("tensors"), py::arg("versions"));
  m.def("_visit_elements", &ampfused::visit_elements, py::arg("tensor"), py::arg("inv_scale"),
        py::arg("check_only"));
  if (PyModule_AddFunctions(m.ptr(), ampfused::eager_calls) != 0) throw py::error_already_set();
#ifdef AMPFUSED_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
