// GradScaler's per-step walk over optimizer.param_groups, in C++.
//
// torch's _unscale_grads_ loops over every parameter in Python (about 1 us each).  This does the
// same walk - skip None grads, refuse float16 unless allowed, coalesce float16 sparse grads,
// take sparse ._values(), group by device - at tens of nanoseconds per parameter, and hands the
// gathered lists to the ops without creating any per-parameter Python object.  Only gathers:
// the ops are called in python_module.cpp.
// Gradients that are tensor subclasses (DTensor, ...) make it return None: the caller then
// takes torch's Python path, which dispatches through the subclass.  DTensor gradients are
// gathered as their local shards instead when the caller asks (it then agrees on found_inf
// across the meshes itself).  param_groups and each group's 'params' may be any iterable, as in
// torch's Python loop; a generator is read once.
#include "grad_gather.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "unscale_math.h"

namespace py = pybind11;

namespace ampfused {
namespace {

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

// collect()'s `unwrap` (grad_gather.h): DTensor gradients as their local shards.
class Unwrap {
 public:
  explicit Unwrap(py::handle spec) {
    if (spec.is_none()) return;
    const py::tuple t = py::reinterpret_borrow<py::tuple>(spec);
    TORCH_CHECK(t.size() == 4,
                "collect: unwrap must be (type, local attribute, spec attribute, "
                "list)");
    type_ = t[0];
    local_attr_ = t[1];
    spec_attr_ = t[2];
    specs_ = t[3];
    mesh_attr_ = py::str("mesh");
    placements_attr_ = py::str("placements");
  }
  bool on() const { return type_.ptr() != nullptr; }

  // The local shard of `grad` if it is of the unwrapped type and its shard is a plain tensor;
  // an undefined tensor otherwise (torch's path takes it).  Records its (mesh, placements).
  at::Tensor local_of(const at::Tensor& grad) {
    const py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(grad));
    const int is = PyObject_IsInstance(obj.ptr(), type_.ptr());
    if (is < 0) throw py::error_already_set();
    if (is == 0) return {};
    const py::object local = obj.attr(local_attr_);
    if (!THPVariable_Check(local.ptr())) return {};
    const at::Tensor& t = THPVariable_Unpack(local.ptr());
    if (t.unsafeGetTensorImpl()->is_python_dispatch()) return {};
    const py::object spec = obj.attr(spec_attr_);
    const py::object mesh = spec.attr(mesh_attr_);
    const py::object placements = spec.attr(placements_attr_);
    for (const auto& [m, p] : seen_) {
      if (m == mesh.ptr() &&
          (p == placements.ptr() || PyObject_RichCompareBool(p, placements.ptr(), Py_EQ) == 1)) {
        return t;
      }
    }
    if (PyErr_Occurred()) throw py::error_already_set();
    py::list(specs_).append(py::make_tuple(mesh, placements));  // (keeps both alive)
    seen_.emplace_back(mesh.ptr(), placements.ptr());
    return t;
  }

 private:
  // (all null when not unwrapping: a plain pass makes no Python object)
  py::object type_, local_attr_, spec_attr_, specs_, mesh_attr_, placements_attr_;
  std::vector<std::pair<PyObject*, PyObject*>> seen_;  // borrowed: the list holds them
};

}  // namespace

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
                                                std::vector<py::object>& keep_alive, bool positions,
                                                py::handle unwrap) {
  Unwrap dtensors(unwrap);
  std::vector<DeviceGrads> out;
  keep_alive.push_back(as_sequence(param_groups, -1));
  PyObject* groups_seq = keep_alive.back().ptr();
  const Py_ssize_t ngroups = PySequence_Fast_GET_SIZE(groups_seq);
  std::vector<std::pair<size_t, py::object>> consumed;  // (group, list read from an iterator)
  std::string unsupported;                              // the first grad no kernel takes
  bool fallback = false;                                // some grad needs torch's path
  // Once fallback is decided or an error found, grads are no longer gathered.
  bool skip_rest = false;
  int64_t position = -1;  // of the current parameter, over all groups
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
      ++position;
      if (!THPVariable_Check(obj)) {
        raise(PyExc_AssertionError, "expected param to be torch.Tensor, got " +
                                        std::string(Py_TYPE(obj)->tp_name) + " at " + where(gi, i));
      }
      const at::Tensor& param = THPVariable_Unpack(obj);
      // The TensorImpl's gradient: Tensor::grad() first asks autograd whether the parameter is a
      // leaf (a virtual call, a tenth of this loop's cost per parameter), only to warn about a
      // non-leaf whose .grad is undefined; that case still goes through it, warning included.
      const at::Tensor& grad = param.unsafeGetTensorImpl()->grad();
      if (!grad.defined()) {
        (void)param.grad();
        continue;
      }
      const auto dtype = grad.scalar_type();
      if (dtype == at::kHalf && !allow_fp16) {
        raise(PyExc_ValueError,
              "Attempting to unscale FP16 gradients. " + where(gi, i) +
                  " has a float16 .grad: GradScaler unscales float32 master gradients. Either "
                  "keep the parameters in float32 and let torch.autocast run float16 math (do "
                  "not call model.half()), or keep float32 masters of the float16 parameters: "
                  "optimizer = ampfused.MasterWeights(optimizer). (GradScaler(allow_fp16=True) "
                  "unscales float16 gradients in place, at a precision cost.)");
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
      // What is gathered when it is not grad itself (then owned here for the pass): a sparse
      // grad's values, a DTensor grad's local shard.
      at::Tensor values;
      if (grad.unsafeGetTensorImpl()->is_python_dispatch()) {
        // (the dtype and layout checked above are the local shard's: a DTensor reports them)
        if (dtensors.on()) values = dtensors.local_of(grad);
        if (!values.defined()) {
          skip_rest = fallback = true;
          continue;
        }
      } else if (layout == at::kSparse) {
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
      if (positions) slot->positions.push_back(position);
    }
  }
  if (!unsupported.empty()) raise(PyExc_NotImplementedError, unsupported);
  if (fallback) {
    restore_one_shot(param_groups, groups_seq, consumed);
    return std::nullopt;
  }
  return out;
}

namespace {
constexpr int64_t kLongPassBytes = 1 << 20;

int64_t bytes_of(at::TensorList grads) {
  int64_t bytes = 0;
  for (const at::Tensor& t : grads) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}
}  // namespace

std::optional<py::gil_scoped_release> release_gil_if_long(c10::ArrayRef<GradList*> lists) {
  int64_t bytes = 0;
  for (const GradList* l : lists) {
    // One device per list (the ops check it): its first grad's says whether it is on the CPU.
    if (!l->grads.empty() && l->grads[0].is_cpu()) bytes += bytes_of(l->grads);
  }
  if (bytes < kLongPassBytes) return std::nullopt;
  for (GradList* l : lists) l->own_all();
  return std::make_optional<py::gil_scoped_release>();
}

std::optional<py::gil_scoped_release> release_gil_if_long(std::vector<DeviceGrads>& groups) {
  std::vector<GradList*> lists;
  lists.reserve(groups.size());
  for (auto& g : groups) lists.push_back(&g);
  return release_gil_if_long(lists);
}

std::optional<py::gil_scoped_release> release_gil_if_long(GradList& grads) {
  GradList* one = &grads;  // (no allocation: the ops' eager entry points call this)
  return release_gil_if_long(c10::ArrayRef<GradList*>(one));
}

}  // namespace ampfused
