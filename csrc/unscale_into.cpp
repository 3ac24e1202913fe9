// Host side of unscale_into_ (contract: unscale_into.h): the checks, the CPU kernel, and the
// kernels of the CPU key and of the CUDA key in a CPU-only build.  The CUDA kernel is
// csrc/cuda/unscale_into_cuda.cu.
#include "unscale_into.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu/parallel.h"
#include "launch_table.h"
#include "ops.h"
#include "unscale.h"

namespace ampfused {

namespace {

bool is_into_dtype(c10::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

}  // namespace

std::vector<IntoSpan> into_spans(at::TensorList grads, at::TensorList out,
                                 const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const at::Device device = check_found_inf(found_inf);
  check_state(inv_scale, "inv_scale", at::kFloat, device);
  TORCH_CHECK(grads.size() == out.size(), "out has ", out.size(), " tensors but grads has ",
              grads.size(), "; pass one float32 output per gradient");
  std::vector<IntoSpan> spans;
  spans.reserve(grads.size());
  for (const auto i : c10::irange(grads.size())) {
    const at::Tensor& g = grads[i];
    const at::Tensor& o = out[i];
    TORCH_CHECK_TYPE(g.defined(), "grads[", i, "] is undefined (None); leave it out of the list");
    TORCH_CHECK_TYPE(o.defined(), "out[", i, "] is undefined (None); pass a float32 tensor");
    TORCH_CHECK_NOT_IMPLEMENTED(g.layout() == at::kStrided && o.layout() == at::kStrided, "grads[",
                                i, "] and out[", i, "] must be dense (strided), got ", g.layout(),
                                " and ", o.layout());
    TORCH_CHECK_NOT_IMPLEMENTED(is_into_dtype(g.scalar_type()), "grads[", i, "] has dtype ",
                                g.scalar_type(),
                                "; unscale_into_ reads float16, bfloat16 or float32 gradients");
    TORCH_CHECK_NOT_IMPLEMENTED(o.scalar_type() == at::kFloat, "out[", i, "] has dtype ",
                                o.scalar_type(), "; unscale_into_ writes float32");
    TORCH_CHECK(g.device() == device && o.device() == device, "grads[", i, "] is on ", g.device(),
                " and out[", i, "] on ", o.device(), " but found_inf is on ", device,
                "; pass the tensors of one device per call");
    TORCH_CHECK(g.sizes() == o.sizes(), "out[", i, "] must have the shape of grads[", i, "]: got ",
                o.sizes(), " for ", g.sizes(),
                "; allocate it with torch.empty_like(grads[i], dtype=torch.float32)");
    if (g.numel() == 0) continue;  // nothing to read or write: any strides will do
    TORCH_CHECK(g.strides() == o.strides(), "out[", i, "] must have the strides of grads[", i,
                "]: got ", o.strides(), " for ", g.strides(),
                "; allocate it with torch.empty_like(grads[i], dtype=torch.float32)");
    TORCH_CHECK(g.is_non_overlapping_and_dense(), "grads[", i,
                "] has gaps or overlapping elements (strides ", g.strides(),
                "); pass grads[i].contiguous() and an out of its layout");
    TORCH_CHECK(!o.storage().is_alias_of(g.storage()), "out[", i, "] shares memory with grads[", i,
                "]; pass a separate float32 tensor (to unscale in place use "
                "non_finite_check_and_unscale_)");
    spans.push_back({g.const_data_ptr(), o.mutable_data_ptr<float>(), g.numel(), g.scalar_type()});
  }
  return spans;
}

namespace {

// One run, the per-element rule of visit_into with a constant mode so the loop vectorizes.
template <typename T>
uint32_t into_run(const T* __restrict in, float* __restrict out, int64_t n, float inv) {
  uint32_t bad = 0;
  if (inv == 1.0f) {
    for (int64_t i = 0; i < n; ++i) bad |= visit_into(in[i], out[i], inv, true);
  } else {
    for (int64_t i = 0; i < n; ++i) bad |= visit_into(in[i], out[i], inv, false);
  }
  return bad;
}

// float16 widens through F16C where the CPU has it (c10::Half's software conversion has branches
// and does not vectorize).  Widening is exact either way; the NaN test is on the input bits.
#if defined(__GNUC__) && defined(__x86_64__)
#define AMPFUSED_HAVE_F16C_INTO 1
__attribute__((target("avx2,f16c"))) uint32_t into_run_f16c(const c10::Half* in, float* out,
                                                            int64_t n, float inv) {
  const __m128i exp_mask = _mm_set1_epi16(kHalfExpMask);
  const __m256 vinv = _mm256_set1_ps(inv);
  __m128i bad = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask));
    __m256 f = _mm256_cvtph_ps(h);
    if (inv != 1.0f) f = _mm256_mul_ps(f, vinv);
    _mm256_storeu_ps(out + i, f);
  }
  return into_run(in + i, out + i, n - i, inv) | (_mm_movemask_epi8(bad) != 0 ? 1u : 0u);
}
#endif

uint32_t into_span(const IntoSpan& s, int64_t begin, int64_t end, float inv) {
  const int64_t n = end - begin;
  float* out = s.out + begin;
  switch (s.dtype) {
    case at::kHalf: {
      const auto* in = static_cast<const c10::Half*>(s.in) + begin;
#ifdef AMPFUSED_HAVE_F16C_INTO
      static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
      if (f16c) return into_run_f16c(in, out, n, inv);
#endif
      return into_run(in, out, n, inv);
    }
    case at::kBFloat16:
      return into_run(static_cast<const c10::BFloat16*>(s.in) + begin, out, n, inv);
    default:  // float32: into_spans admits nothing else
      return into_run(static_cast<const float*>(s.in) + begin, out, n, inv);
  }
}

}  // namespace

void launch_into_cpu(const std::vector<IntoSpan>& spans, const float* inv_scale, float* found_inf,
                     const at::Tensor&) {
  const float inv = *inv_scale;
  // Pieces of at most kChunkSize elements of one span, so a large tensor is split across threads.
  std::vector<std::tuple<size_t, int64_t, int64_t>> pieces;
  int64_t bytes = 0;  // read and written: the split's cost measure (parallel.h)
  for (const auto s : c10::irange(spans.size())) {
    for (int64_t b = 0; b < spans[s].numel; b += kChunkSize) {
      pieces.emplace_back(s, b, std::min(spans[s].numel, b + kChunkSize));
    }
    bytes += spans[s].numel * static_cast<int64_t>(c10::elementSize(spans[s].dtype) + 4);
  }
  const auto n = static_cast<int64_t>(pieces.size());
  const bool bad = cpu::run_pieces(n, bytes, [&](int64_t first, int64_t last) {
    uint32_t local = 0;
    for (int64_t k = first; k < last; ++k) {
      const auto& [s, b, e] = pieces[k];
      local |= into_span(spans[s], b, e, inv);
    }
    return local != 0;
  });
  if (bad) *found_inf = 1.0f;  // set, never clear (the contract)
}

namespace {

[[maybe_unused]] void launch_into_without_cuda(const std::vector<IntoSpan>&, const float*, float*,
                                               const at::Tensor& on_device) {
  refuse_without_cuda(on_device.device());
}

// The checks raise before this could run: some argument is sparse.
void launch_into_rejected(const std::vector<IntoSpan>&, const float*, float*, const at::Tensor&) {
  TORCH_INTERNAL_ASSERT(false, "unscale_into_: a sparse argument passed the layout checks");
}

void register_into_rejecting(torch::Library& m) {
  m.impl(ops::unscale_into_::kName, &unscale_into_kernel<launch_into_rejected>);
}

}  // namespace
}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, CPU, m) {
  m.impl(ampfused::ops::unscale_into_::kName,
         &ampfused::unscale_into_kernel<ampfused::launch_into_cpu>);
}

// A sparse argument routes the call to a sparse key: the checks reject it there, naming it,
// before any launch (NotImplementedError, as for the other ops).
TORCH_LIBRARY_IMPL(ampfused, SparseCPU, m) { ampfused::register_into_rejecting(m); }
TORCH_LIBRARY_IMPL(ampfused, SparseCUDA, m) { ampfused::register_into_rejecting(m); }
TORCH_LIBRARY_IMPL(ampfused, SparseCsrCPU, m) { ampfused::register_into_rejecting(m); }
TORCH_LIBRARY_IMPL(ampfused, SparseCsrCUDA, m) { ampfused::register_into_rejecting(m); }

#ifndef AMPFUSED_WITH_CUDA
TORCH_LIBRARY_IMPL(ampfused, CUDA, m) {
  m.impl(ampfused::ops::unscale_into_::kName,
         &ampfused::unscale_into_kernel<ampfused::launch_into_without_cuda>);
}
#endif
