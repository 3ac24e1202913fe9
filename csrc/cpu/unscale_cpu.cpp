// CPU kernel of the unscale op family (contract: unscale.h).
//
// Plain loops the compiler vectorizes (the finiteness test is an integer mask on the bits, the
// found flag an integer OR), split across at::parallel_for when the pass is large enough to pay
// for waking the thread pool.  What each element becomes is unscale_math.h's, shared with CUDA;
// the CPU key's kernels register at the end of this file.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "unscale.h"

namespace ampfused {
namespace {

// Below this many bytes a single thread finishes before the pool would have started.
constexpr int64_t kParallelMinBytes = 256 * 1024;
// Work item for the parallel split, in bytes of gradient.
constexpr int64_t kChunkBytes = 256 * 1024;

// One dense run: returns whether any input element was inf/NaN.  The per-element rule is
// unscale_math.h's visit(); the three loops give it a constant mode so each one vectorizes.
template <typename T>
AMPFUSED_INLINE bool process(T* __restrict p, int64_t n, opmath_t<T> inv, bool check_only) {
  uint32_t bad = 0;
  if (check_only) {
    // Accumulated in lanes of the element's width, so 16-bit grads are tested 16 bits a lane.
    using Lane = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
    Lane lane_bad = 0;
    for (int64_t i = 0; i < n; ++i) lane_bad |= static_cast<Lane>(visit<T, true>(p[i], inv, false));
    bad = lane_bad;
  } else if (inv == opmath_t<T>(1)) {
    for (int64_t i = 0; i < n; ++i) bad |= visit<T, false>(p[i], inv, true);
  } else {
    for (int64_t i = 0; i < n; ++i) bad |= visit<T, false>(p[i], inv, false);
  }
  return bad != 0;
}

// Unscaling float16 needs hardware conversion to vectorize (c10::Half's software conversion has
// branches): an F16C/AVX2 loop, chosen at run time, with the scalar loop for other CPUs and for
// the tail.  Same results as visit<c10::Half> (the tail) for every non-NaN value: the same bit
// test, the same multiply-or-pass rule, and vcvtps2ph with round-to-nearest-even is IEEE
// conversion, as is c10::Half (a NaN's payload bits may differ: see to_storage).  A check-only pass
// needs no conversion: process() tests the bits, vectorized.
#if defined(__GNUC__) && defined(__x86_64__)
#define AMPFUSED_HAVE_F16C_PATH 1
__attribute__((target("avx2,f16c"))) bool unscale_half_f16c(c10::Half* p, int64_t n, float inv) {
  const __m128i exp_mask = _mm_set1_epi16(kHalfExpMask);
  const __m256 vinv = _mm256_set1_ps(inv);
  __m128i bad = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    auto* at = reinterpret_cast<__m128i*>(p + i);
    const __m128i h = _mm_loadu_si128(at);
    // non_finite_half_bits, eight at a time.
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask));
    __m256 f = _mm256_cvtph_ps(h);
    if (inv != 1.0f) f = _mm256_mul_ps(f, vinv);
    _mm_storeu_si128(at, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const bool vec_bad = _mm_movemask_epi8(bad) != 0;
  return process(p + i, n - i, inv, /*check_only=*/false) || vec_bad;
}
#endif

AMPFUSED_INLINE bool process_half(c10::Half* p, int64_t n, float inv, bool check_only) {
#ifdef AMPFUSED_HAVE_F16C_PATH
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (f16c && !check_only) return unscale_half_f16c(p, n, inv);
#endif
  return process(p, n, inv, check_only);
}

// Memory-bound only with wide vectors: on 2 cores a 16-byte SSE loop tops out near the
// memory bandwidth, so the loops are also compiled for AVX2 and AVX-512 and picked at load time
// (GCC function multiversioning; the callees above are inlined into each clone).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define AMPFUSED_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AMPFUSED_CPU_CLONES
#endif

AMPFUSED_CPU_CLONES
bool process_span(const Span& s, int64_t begin, int64_t end, float inv, bool check_only) {
  const int64_t n = end - begin;
  bool bad = false;
  // always_inline: the loops must land in each target clone, compiled for its ISA.
  const bool known = visit_grad_dtype(s.dtype, [&](auto tag) __attribute__((always_inline)) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(s.data) + begin;
    if constexpr (std::is_same_v<T, c10::Half>) {
      bad = process_half(p, n, inv, check_only);
    } else {
      bad = process(p, n, static_cast<opmath_t<T>>(inv), check_only);
    }
  });
  TORCH_INTERNAL_ASSERT(known, "ampfused: unexpected dtype ", s.dtype);  // host checks reject
  return bad;
}

struct Piece {
  int32_t span;
  int64_t begin;
  int64_t end;
};

}  // namespace

void launch_pass_cpu(const std::vector<Span>& spans, const PassParams& a, const at::Tensor&) {
  TORCH_CHECK_NOT_IMPLEMENTED(a.grad_stats == nullptr, "grad_stats: not implemented yet");
  const float inv = a.inv_scale();
  int64_t total_bytes = 0;
  for (const Span& sp : spans)
    total_bytes += sp.numel * static_cast<int64_t>(c10::elementSize(sp.dtype));

  bool found = false;
  if (total_bytes < kParallelMinBytes || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (const Span& sp : spans) found |= process_span(sp, 0, sp.numel, inv, a.check_only);
  } else {
    // Cut every span into ~kChunkBytes pieces so threads get even shares of large and small
    // gradients alike.
    std::vector<Piece> pieces;
    pieces.reserve(spans.size() + static_cast<size_t>(total_bytes / kChunkBytes) + 1);
    for (size_t i = 0; i < spans.size(); ++i) {
      const int64_t step = kChunkBytes / static_cast<int64_t>(c10::elementSize(spans[i].dtype));
      for (int64_t b = 0; b < spans[i].numel; b += step) {
        pieces.push_back({static_cast<int32_t>(i), b, std::min(spans[i].numel, b + step)});
      }
    }
    std::atomic<bool> any{false};
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t b, int64_t e) {
      bool local = false;
      for (int64_t k = b; k < e; ++k) {
        const Piece& pc = pieces[k];
        local |= process_span(spans[pc.span], pc.begin, pc.end, inv, a.check_only);
      }
      if (local) any.store(true, std::memory_order_relaxed);
    });
    found = any.load();
  }
  finish_pass(found, a);
}

}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, CPU, m) { ampfused::register_kernels<ampfused::launch_pass_cpu>(m); }
