// CPU kernel of the unscale op family (contract: unscale.h).
//
// Plain loops the compiler vectorizes (the finiteness test is an integer mask on the bits, the
// found flag an integer OR), split across at::parallel_for when the pass is large enough to pay
// for waking the thread pool.  Arithmetic matches torch's CPU kernel: opmath float (double for
// float64 grads), `inv == 1 ? v : v * inv`, rounded to the storage dtype.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstring>

#include "unscale.h"

namespace ampfused {
namespace {

// Below this many bytes a single thread finishes before the pool would have started.
constexpr int64_t kParallelMinBytes = 256 * 1024;
// Work item for the parallel split, in bytes of gradient.
constexpr int64_t kChunkBytes = 256 * 1024;

template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

inline uint32_t non_finite(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u & 0x7f800000u) == 0x7f800000u;
}
inline uint32_t non_finite(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// One dense run: returns whether any input element was inf/NaN.
template <typename T>
__attribute__((always_inline)) inline bool process(T* __restrict p, int64_t n,
                                                   typename OpMath<T>::type inv, bool check_only) {
  using M = typename OpMath<T>::type;
  uint32_t bad = 0;
  if (check_only) {
    for (int64_t i = 0; i < n; ++i) bad |= non_finite(static_cast<M>(p[i]));
  } else if (inv == M(1)) {
    // torch writes v back unscaled when inv_scale == 1 (no multiply: NaN payloads survive).
    for (int64_t i = 0; i < n; ++i) {
      const M v = static_cast<M>(p[i]);
      bad |= non_finite(v);
      p[i] = static_cast<T>(v);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const M v = static_cast<M>(p[i]);
      bad |= non_finite(v);
      p[i] = static_cast<T>(v * inv);
    }
  }
  return bad != 0;
}

// bfloat16 through its bits, so the loop vectorizes (c10::BFloat16's NaN branch stops GCC).
// Same rounding as c10::BFloat16(float): round to nearest even, NaN -> 0x7FC0.
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

__attribute__((always_inline)) inline bool process_bf16(uint16_t* __restrict p, int64_t n,
                                                        float inv, bool check_only) {
  uint32_t bad = 0;
  if (check_only) {
    for (int64_t i = 0; i < n; ++i) bad |= (p[i] & 0x7f80u) == 0x7f80u;
  } else {
    // No inv == 1 branch needed: v * 1.0f is exact, and a NaN becomes 0x7FC0 either way.
    for (int64_t i = 0; i < n; ++i) {
      const float v = bf16_to_float(p[i]);
      bad |= non_finite(v);
      p[i] = float_to_bf16(v * inv);
    }
  }
  return bad != 0;
}

// float16 needs hardware conversion to vectorize (c10::Half's software conversion has branches):
// an F16C/AVX2 loop, chosen at run time, with the scalar loop for other CPUs and for the tail.
// Same results: vcvtps2ph with round-to-nearest-even is IEEE conversion, as is c10::Half.
#if defined(__GNUC__) && defined(__x86_64__)
#define AMPFUSED_HAVE_F16C_PATH 1
__attribute__((target("avx2,f16c"))) bool process_half_f16c(c10::Half* p, int64_t n, float inv,
                                                            bool check_only) {
  const __m128i exp_mask = _mm_set1_epi16(0x7c00);
  const __m256 vinv = _mm256_set1_ps(inv);
  __m128i bad = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    auto* at = reinterpret_cast<__m128i*>(p + i);
    const __m128i h = _mm_loadu_si128(at);
    // inf/NaN <=> all exponent bits set, tested on the float16 bits directly.
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask));
    if (check_only) continue;
    __m256 f = _mm256_cvtph_ps(h);
    if (inv != 1.0f) f = _mm256_mul_ps(f, vinv);
    _mm_storeu_si128(at, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const bool vec_bad = _mm_movemask_epi8(bad) != 0;
  return process(p + i, n - i, inv, check_only) || vec_bad;
}
#endif

bool process_half(c10::Half* p, int64_t n, float inv, bool check_only) {
#ifdef AMPFUSED_HAVE_F16C_PATH
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (f16c) return process_half_f16c(p, n, inv, check_only);
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
  switch (s.dtype) {
    case at::kFloat:
      return process(static_cast<float*>(s.data) + begin, n, inv, check_only);
    case at::kDouble:
      return process(static_cast<double*>(s.data) + begin, n, static_cast<double>(inv), check_only);
    case at::kHalf:
      return process_half(static_cast<c10::Half*>(s.data) + begin, n, inv, check_only);
    case at::kBFloat16:
      return process_bf16(static_cast<uint16_t*>(s.data) + begin, n, inv, check_only);
    default:
      TORCH_CHECK(false, "ampfused: unexpected dtype ", s.dtype);  // rejected by the host checks
  }
}

struct Piece {
  int32_t span;
  int64_t begin;
  int64_t end;
};

}  // namespace

void launch_pass_cpu(const std::vector<Span>& spans, const PassArgs& a) {
  const float s = *a.scale;
  const float inv = a.scale_is_inverse ? s : static_cast<float>(1.0 / static_cast<double>(s));
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
