// GradScaler's per-step walk over optimizer.param_groups, in C++ (grad_gather.cpp): it only
// gathers; python_module.cpp calls the ops on what it gathered, through their typed handles.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/MaybeOwned.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <vector>

namespace ampfused {

// A list of tensors *borrowed* from Python objects that outlive the call (no refcount traffic:
// copying an at::Tensor that Python owns also takes and later drops a reference on its Python
// object, a measurable share of the per-tensor cost).  Tensors made here (sparse values) are
// owned by `owned` and borrowed from there.
struct GradList {
  using Traits = c10::MaybeOwnedTraits<at::Tensor>;
  std::vector<at::Tensor> grads;  // borrows only, until own_all()
  std::vector<at::Tensor> owned;
  bool borrowed = true;

  GradList() = default;
  GradList(GradList&& o) noexcept = default;
  GradList(const GradList&) = delete;
  GradList& operator=(const GradList&) = delete;
  GradList& operator=(GradList&&) = delete;
  ~GradList() {
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
  void borrow(const at::Tensor& t) { grads.push_back(Traits::createBorrow(t)); }
  void own(at::Tensor t) {
    owned.push_back(std::move(t));
    borrow(owned.back());
  }
};

// The gradients of one device, with each one's parameter position: its index in the flat list of
// every group's 'params' (parameters without a grad counted too).
struct DeviceGrads : GradList {
  at::Device device;
  std::vector<int64_t> positions;
  explicit DeviceGrads(at::Device d) : device(d) {}
};

// The gradients of param_groups, grouped by device, plus the Python objects that keep them
// alive (lists read from iterators).  std::nullopt when some gradient needs torch's Python path
// (a tensor subclass, or a device without ampfused kernels).  Errors as torch's _unscale_grads_
// raises them (grad_gather.cpp).
// With `positions`, each DeviceGrads also lists its gradients' parameter positions.
// `unwrap` (None, or ampfused._dist.dtensor_unwrap()'s tuple (DTensor, name of its local-shard
// attribute, name of its spec attribute, a list)): gradients of that type are gathered as their
// local shards, and each distinct (spec.mesh, spec.placements) is appended to the list, as a
// tuple, in the order first met.
std::optional<std::vector<DeviceGrads>> collect(pybind11::handle param_groups, bool allow_fp16,
                                                std::vector<pybind11::object>& keep_alive,
                                                bool positions = false,
                                                pybind11::handle unwrap = pybind11::none());

// Long CPU passes run without the GIL, so other Python threads (data loading) keep going; the
// borrowed grads become owned references first.  Short passes and CUDA launches keep it.
// Each list holds the grads of one device.
std::optional<pybind11::gil_scoped_release> release_gil_if_long(c10::ArrayRef<GradList*> lists);
std::optional<pybind11::gil_scoped_release> release_gil_if_long(std::vector<DeviceGrads>& groups);
std::optional<pybind11::gil_scoped_release> release_gil_if_long(GradList& grads);

// MasterWeights' per-step walks (master_gather.cpp; the contract is master_weights.py's).
// masters_pass: MasterWeights._grads_to_masters over the flat lists `params` and `masters`,
// recording each low-precision gradient cast into `cast_from` as {position: (grad, its version,
// the master's grad, -1)}; returns found_inf per device, or std::nullopt (nothing written) where
// the Python walk must run: a gradient that is not dense, or a tensor subclass, or a master's
// gradient with other strides, or a torch function or dispatch mode set.  A master without a
// gradient gets a new one, with its gradient's strides.
std::optional<std::vector<std::pair<at::Device, at::Tensor>>> masters_pass(
    pybind11::handle params, pybind11::handle masters, const at::Tensor& inv_scale,
    pybind11::dict cast_from);
// The first of `positions` whose parameter's gradient is not the one `cast_from` recorded at
// the version recorded (or has none recorded), else -1.
int64_t masters_first_changed(pybind11::handle params, pybind11::handle positions,
                              pybind11::dict cast_from);
// Each tensor's version counter, and the indices of those whose counter is not `versions`'.
std::vector<int64_t> versions_of(pybind11::handle tensors);
std::vector<int64_t> versions_changed(pybind11::handle tensors,
                                      const std::vector<int64_t>& versions);

}  // namespace ampfused
