// MasterWeights' per-step walks (ampfused/master_weights.py), in C++: the scaler's pass from the
// model's gradients into the masters', and the version checks of step().
//
// In Python each walk costs about a microsecond per parameter, which at 1000 small parameters
// made MasterWeights slower than float32 masters by hand.  Here a parameter costs tens of
// nanoseconds.  The common case only is taken (dense gradients, and the masters' gradients of
// the same strides or not allocated yet): anything else returns None and the Python walk,
// which takes every layout and explains what it refuses, runs instead.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

#include "grad_gather.h"
#include "ops.h"

namespace py = pybind11;

namespace ampfused {
namespace {

// The gradients of one device: low-precision ones with their masters' gradients, and those of
// the parameters stepped as they are.
struct MasterDevice {
  at::Device device;
  GradList lows, outs, others;
  explicit MasterDevice(at::Device d) : device(d) {}
};

MasterDevice& slot_of(std::vector<MasterDevice>& out, const at::Device& dev) {
  for (auto& d : out) {
    if (d.device == dev) return d;
  }
  out.emplace_back(dev);
  return out.back();
}

PyObject* const* items_of(py::handle list, Py_ssize_t& n, const char* what) {
  TORCH_CHECK(PyList_CheckExact(list.ptr()), what, " must be a list");
  n = PyList_GET_SIZE(list.ptr());
  return PySequence_Fast_ITEMS(list.ptr());
}

const at::Tensor& tensor_of(PyObject* obj, const char* what) {
  TORCH_CHECK(THPVariable_Check(obj), what, " must hold tensors");
  return THPVariable_Unpack(obj);
}

py::object as_py(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

}  // namespace

std::optional<std::vector<std::pair<at::Device, at::Tensor>>> masters_pass(
    py::handle params, py::handle masters, const at::Tensor& inv_scale, py::dict cast_from) {
  Py_ssize_t n = 0, n_masters = 0;
  PyObject* const* ps = items_of(params, n, "params");
  PyObject* const* ms = items_of(masters, n_masters, "masters");
  TORCH_CHECK(n == n_masters, "masters_pass: ", n, " params but ", n_masters, " masters");
  // First the checks that send the whole pass to Python, before anything is written.  With a
  // torch function or dispatch mode set, the modes see the ops only through the Python walk.
  if (at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::any_modes_set()) {
    return std::nullopt;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor& g = tensor_of(ps[i], "params").unsafeGetTensorImpl()->grad();
    if (!g.defined()) continue;
    if (g.layout() != at::kStrided || g.unsafeGetTensorImpl()->is_python_dispatch()) {
      return std::nullopt;  // sparse values, subclasses, layouts MasterWeights refuses
    }
    if (ms[i] == ps[i]) continue;
    // The kernel takes a dense gradient and a master's gradient of the same strides (a size-1
    // dimension may have any stride: a channels_last Conv2d(1, ...) weight is contiguous).
    const at::Tensor& out = tensor_of(ms[i], "masters").unsafeGetTensorImpl()->grad();
    if (!g.is_non_overlapping_and_dense() || (out.defined() && out.strides() != g.strides())) {
      return std::nullopt;
    }
  }
  std::vector<MasterDevice> work;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor& p = THPVariable_Unpack(ps[i]);
    const at::Tensor& g = p.unsafeGetTensorImpl()->grad();
    if (!g.defined()) {
      // A master whose parameter has no gradient gets none (non-leaf warning as in Python).
      (void)p.grad();
      if (ms[i] != ps[i]) THPVariable_Unpack(ms[i]).mutable_grad().reset();
      continue;
    }
    MasterDevice& d = slot_of(work, g.device());
    if (ms[i] == ps[i]) {
      d.others.borrow(g);
      continue;
    }
    const at::Tensor& master = THPVariable_Unpack(ms[i]);
    if (!master.unsafeGetTensorImpl()->grad().defined()) {
      // After zero_grad(set_to_none=True): a float32 gradient with g's strides (as empty_like).
      master.mutable_grad() =
          at::empty_strided(g.sizes(), g.strides(), g.options().dtype(at::kFloat));
    }
    const at::Tensor& out = master.unsafeGetTensorImpl()->grad();
    d.lows.borrow(g);
    d.outs.borrow(out);
    // The master's version is not recorded (-1): after a scaler's pass, step() checks only the
    // model's side (MasterWeights._check_unchanged_since_pass).
    cast_from[py::int_(i)] =
        py::make_tuple(as_py(g), py::int_(g._version()), as_py(out), py::int_(-1));
  }
  std::vector<GradList*> lists;
  for (auto& d : work) lists.insert(lists.end(), {&d.lows, &d.outs, &d.others});
  const auto no_gil = release_gil_if_long(lists);  // (work is complete: the pointers hold)
  const at::NoGradGuard no_grad;
  std::vector<std::pair<at::Device, at::Tensor>> found;
  for (auto& d : work) {
    at::Tensor flag = at::zeros({}, inv_scale.options().dtype(at::kFloat).device(d.device));
    const at::Tensor inv = d.device == inv_scale.device()
                               ? inv_scale
                               : inv_scale.to(d.device, /*non_blocking=*/!d.device.is_cpu());
    if (!d.lows.grads.empty()) ops::unscale_into_::call(d.lows.grads, d.outs.grads, flag, inv);
    if (!d.others.grads.empty())
      ops::non_finite_check_and_unscale_::call(d.others.grads, flag, inv);
    found.emplace_back(d.device, flag);
  }
  return found;
}

int64_t masters_first_changed(py::handle params, py::handle positions, py::dict cast_from) {
  Py_ssize_t n = 0, n_pos = 0;
  PyObject* const* ps = items_of(params, n, "params");
  PyObject* const* pos = items_of(positions, n_pos, "positions");
  for (Py_ssize_t k = 0; k < n_pos; ++k) {
    const Py_ssize_t i = PyLong_AsSsize_t(pos[k]);
    if (i == -1 && PyErr_Occurred()) throw py::error_already_set();
    TORCH_CHECK(i >= 0 && i < n, "masters_first_changed: position ", i, " out of range");
    const at::Tensor& g = THPVariable_Unpack(ps[i]).unsafeGetTensorImpl()->grad();
    PyObject* seen = PyDict_GetItemWithError(cast_from.ptr(), pos[k]);  // borrowed
    if (seen == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      if (g.defined()) return i;
      continue;
    }
    TORCH_CHECK(PyTuple_CheckExact(seen) && PyTuple_GET_SIZE(seen) == 4,
                "masters_first_changed: cast_from holds 4-tuples");
    const long long seen_version = PyLong_AsLongLong(PyTuple_GET_ITEM(seen, 1));
    if (seen_version == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (!g.defined() || !THPVariable_Check(PyTuple_GET_ITEM(seen, 0)) ||
        !THPVariable_Unpack(PyTuple_GET_ITEM(seen, 0)).is_same(g) ||
        static_cast<long long>(g._version()) != seen_version) {
      return i;
    }
  }
  return -1;
}

std::vector<int64_t> versions_of(py::handle tensors) {
  Py_ssize_t n = 0;
  PyObject* const* ts = items_of(tensors, n, "tensors");
  std::vector<int64_t> out(n);
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = tensor_of(ts[i], "tensors")._version();
  return out;
}

std::vector<int64_t> versions_changed(py::handle tensors, const std::vector<int64_t>& versions) {
  Py_ssize_t n = 0;
  PyObject* const* ts = items_of(tensors, n, "tensors");
  TORCH_CHECK(static_cast<size_t>(n) == versions.size(), "versions_changed: ", n, " tensors but ",
              versions.size(), " versions");
  std::vector<int64_t> out;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(tensor_of(ts[i], "tensors")._version()) != versions[i]) {
      out.push_back(i);
    }
  }
  return out;
}

}  // namespace ampfused
