// CPU kernel of the unscale op family (contract: unscale.h).
//
// Plain loops the compiler vectorizes (the finiteness test is an integer mask on the bits, the
// found flag an integer OR), over pieces that threads share where splitting pays (parallel.h).
// What each element becomes is unscale_math.h's, shared with CUDA;
// the CPU key's kernels register at the end of this file.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "cpu/parallel.h"
#include "launch_table.h"
#include "unscale.h"

namespace ampfused {
namespace {

// A piece of the plain pass, in bytes of gradient.
constexpr int64_t kChunkBytes = 256 * 1024;

// The largest of two magnitudes (float32 bits, or a run's storage bits: MagnitudeOf).
template <typename B>
AMPFUSED_INLINE B max_bits(B a, B b) {
  return a > b ? a : b;
}

// One dense run: returns whether any input element was inf/NaN.  The per-element rule is
// unscale_math.h's visit(); the three loops give it a constant mode so each one vectorizes.
// kMeasure: the run's magnitude (MagnitudeOf, of the inputs) is also max-ed into `mag`, as
// float32 bits.
template <typename T, bool kMeasure = false>
AMPFUSED_INLINE bool process(T* __restrict p, int64_t n, opmath_t<T> inv, bool check_only,
                             uint32_t* mag = nullptr) {
  using Mag = MagnitudeOf<T>;
  magnitude_bits_t<T> m = 0;
  uint32_t bad = 0;
  if (check_only) {
    // Accumulated in lanes of the element's width, so 16-bit grads are tested 16 bits a lane.
    using Lane = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
    Lane lane_bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (kMeasure) m = max_bits(m, Mag::of(p[i]));
      lane_bad |= static_cast<Lane>(visit<T, true>(p[i], inv, false));
    }
    bad = lane_bad;
  } else if (inv == opmath_t<T>(1)) {
    for (int64_t i = 0; i < n; ++i) {
      if (kMeasure) m = max_bits(m, Mag::of(p[i]));
      bad |= visit<T, false>(p[i], inv, true);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if (kMeasure) m = max_bits(m, Mag::of(p[i]));
      bad |= visit<T, false>(p[i], inv, false);
    }
  }
  if (kMeasure) *mag = max_bits(*mag, Mag::to_float_bits(m));
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
// kMeasure: MagnitudeOf<c10::Half> eight at a time (the sign-cleared bits), max-ed into `mag`
// as process() does.
template <bool kMeasure>
__attribute__((target("avx2,f16c"))) bool unscale_half_f16c(c10::Half* p, int64_t n, float inv,
                                                            uint32_t* mag) {
  const __m128i exp_mask = _mm_set1_epi16(kHalfExpMask);
  const __m128i abs_mask = _mm_set1_epi16(0x7fff);
  const __m256 vinv = _mm256_set1_ps(inv);
  __m128i bad = _mm_setzero_si128();
  __m128i m = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    auto* at = reinterpret_cast<__m128i*>(p + i);
    const __m128i h = _mm_loadu_si128(at);
    // non_finite_half_bits, eight at a time.
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask));
    if (kMeasure) m = _mm_max_epu16(m, _mm_and_si128(h, abs_mask));
    __m256 f = _mm256_cvtph_ps(h);
    if (inv != 1.0f) f = _mm256_mul_ps(f, vinv);
    _mm_storeu_si128(at, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const bool vec_bad = _mm_movemask_epi8(bad) != 0;
  if (kMeasure) {
    alignas(16) uint16_t lanes[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), m);
    uint16_t top = 0;
    for (uint16_t l : lanes) top = max_bits(top, l);
    *mag = max_bits(*mag, MagnitudeOf<c10::Half>::to_float_bits(top));
  }
  return process<c10::Half, kMeasure>(p + i, n - i, inv, /*check_only=*/false, mag) || vec_bad;
}
#endif

#ifdef AMPFUSED_HAVE_F16C_PATH
// The 16-bit formats with AVX-512F, 16 elements a step, for the plain pass (unscale16_avx512)
// and the one with statistics (stats16_avx512): float16 through vcvtph2ps/vcvtps2ph (IEEE, as
// c10::Half, a NaN's payload aside), bfloat16 through float_to_bf16_bits on 16 lanes, which GCC
// does not vectorize in 512 bits without AVX512BW.
// GCC 12's AVX-512 headers start intrinsics from _mm512_undefined_*(), which -Wall reports.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define AMPFUSED_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// Sixteen stored elements (their bits) in float32 (exact).
template <typename T>
AMPFUSED_AVX512 __m512 widen16_avx512(__m256i h) {
  if constexpr (std::is_same_v<T, c10::Half>) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename T>
AMPFUSED_AVX512 __m512 load16_avx512(const void* at) {
  return widen16_avx512<T>(_mm256_loadu_si256(static_cast<const __m256i*>(at)));
}

// Sixteen float32 values rounded to T and stored (to_storage<T>); returns the stored values in
// float32.
template <typename T>
AMPFUSED_AVX512 __m512 store16_avx512(void* at, __m512 u) {
  auto* out = static_cast<__m256i*>(at);
  if constexpr (std::is_same_v<T, c10::Half>) {
    const __m256i stored = _mm512_cvtps_ph(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(out, stored);
    return _mm512_cvtph_ps(stored);
  } else {
    // float_to_bf16_bits: round to nearest even, any NaN -> 0x7FC0.
    const __m512i b = _mm512_castps_si512(u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
    const __m512i stored = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(out, _mm512_cvtepi32_epi16(stored));
    return _mm512_castsi512_ps(_mm512_slli_epi32(stored, 16));
  }
}

// The plain writing pass over a 16-bit run: visit<T, false> sixteen at a time (the input's
// test on its float32 bits, which are inf/NaN exactly when the stored bits are), the last
// elements that fill no vector through process().
// kInvOne: the multiply-or-pass rule's pass (not a multiply by 1, which flushes a bfloat16
// denormal to zero under torch.set_flush_denormal(True)).
// kMeasure: MagnitudeOf<T> on the stored 16-bit lanes (an and and a max over 256 bits), max-ed
// into `mag`.
template <typename T, bool kInvOne, bool kMeasure>
__attribute__((target("avx512f,avx2"))) bool unscale16_avx512(T* p, int64_t n, float inv,
                                                              uint32_t* mag) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i inf32 = _mm512_set1_epi32(static_cast<int32_t>(kFloatExpMask));
  const __m256i abs16 = _mm256_set1_epi16(0x7fff);
  __mmask16 bad = 0;
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    if (kMeasure) m = _mm256_max_epu16(m, _mm256_and_si256(h, abs16));
    const __m512 v = widen16_avx512<T>(h);
    const __m512i vb = _mm512_castps_si512(v);
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(vb, inf32), inf32);
    store16_avx512<T>(p + i, kInvOne ? v : _mm512_mul_ps(v, vinv));
  }
  if (kMeasure) {
    alignas(32) uint16_t lanes[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    uint16_t top = 0;
    for (uint16_t l : lanes) top = max_bits(top, l);
    *mag = max_bits(*mag, MagnitudeOf<T>::to_float_bits(top));
  }
  return process<T, kMeasure>(p + i, n - i, static_cast<opmath_t<T>>(inv), /*check_only=*/false,
                              mag) ||
         bad != 0;
}
#pragma GCC diagnostic pop
#endif

// A 16-bit run: the AVX-512 loop where the CPU has it, else (float16) the F16C one, else
// process(); check-only passes test the bits in process(), which vectorizes without them.
template <typename T, bool kMeasure>
AMPFUSED_INLINE bool process16(T* p, int64_t n, float inv, bool check_only, uint32_t* mag) {
#ifdef AMPFUSED_HAVE_F16C_PATH
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512 && !check_only) {
    return inv == 1.0f ? unscale16_avx512<T, true, kMeasure>(p, n, inv, mag)
                       : unscale16_avx512<T, false, kMeasure>(p, n, inv, mag);
  }
  if constexpr (std::is_same_v<T, c10::Half>) {
    static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (f16c && !check_only) return unscale_half_f16c<kMeasure>(p, n, inv, mag);
  }
#endif
  return process<T, kMeasure>(p, n, static_cast<opmath_t<T>>(inv), check_only, mag);
}

// Memory-bound only with wide vectors: on 2 cores a 16-byte SSE loop tops out near the
// memory bandwidth, so the loops are also compiled for AVX2 and AVX-512 and picked at load time
// (GCC function multiversioning; the callees above are inlined into each clone).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define AMPFUSED_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AMPFUSED_CPU_CLONES
#endif

template <bool kMeasure>
AMPFUSED_INLINE bool process_span_of(const Span& s, int64_t begin, int64_t end, float inv,
                                     bool check_only, uint32_t* mag) {
  const int64_t n = end - begin;
  bool bad = false;
  // always_inline: the loops must land in each target clone, compiled for its ISA.
  const bool known = visit_grad_dtype(s.dtype, [&](auto tag) __attribute__((always_inline)) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(s.data) + begin;
    if constexpr (sizeof(T) == 2) {
      bad = process16<T, kMeasure>(p, n, inv, check_only, mag);
    } else {
      bad = process<T, kMeasure>(p, n, static_cast<opmath_t<T>>(inv), check_only, mag);
    }
  });
  TORCH_INTERNAL_ASSERT(known, "ampfused: unexpected dtype ", s.dtype);  // host checks reject
  return bad;
}

AMPFUSED_CPU_CLONES
bool process_span(const Span& s, int64_t begin, int64_t end, float inv, bool check_only) {
  return process_span_of<false>(s, begin, end, inv, check_only, nullptr);
}

// The same with the magnitude (the headroom policy's passes) max-ed into `mag`.
AMPFUSED_CPU_CLONES
bool measure_span(const Span& s, int64_t begin, int64_t end, float inv, bool check_only,
                  uint32_t* mag) {
  return process_span_of<true>(s, begin, end, inv, check_only, mag);
}

struct Piece {
  int32_t span;
  int64_t begin;
  int64_t end;
};

// ---------------------------------------------------------------------------------------------
// Passes with statistics (grad_stats): one work item of kChunkSize elements at a time, its row
// computed whole.  The lanes of unscale_math.h's order are an array (L1-resident, at most 16 KB)
// that the loop over a run of L elements updates in place, so it vectorizes.

// Inputs are counted in a second look at a run of L elements, only where one of its u was
// inf/NaN (rare): from x itself in a check-only pass, from the stored values in a writing pass
// where that gives the same counts (inputs_countable_after_write); otherwise (kCountInputs) in
// the loop.
template <typename T>
AMPFUSED_INLINE void count_inputs_of_run(const T* q, int m, StatCounts<opmath_t<T>>& c) {
  for (int l = 0; l < m; ++l) stat_count_input(to_opmath(q[l]), c);
}

template <typename T, bool kCheckOnly, bool kInvOne, bool kCountInputs>
AMPFUSED_INLINE bool stats_item(T* __restrict p, int64_t n, opmath_t<T> inv, double* row) {
  using M = opmath_t<T>;
  constexpr int V = kStatVec<T>;
  constexpr int L = kStatLanes<T>;
  alignas(64) M lanes[L];
  stat_zero_lanes<M, V>(lanes, n);
  StatCounts<M> c;
  for (int64_t j = 0; j < n; j += L) {
    T* __restrict q = p + j;
    const int m = static_cast<int>(std::min<int64_t>(L, n - j));
    c.any_max_bits = 0;
    for (int l = 0; l < m; ++l) {
      stat_visit<T, kCheckOnly, kCountInputs>(q[l], inv, kInvOne, lanes[l], c);
    }
    if (!kCountInputs && c.any_non_finite_u()) count_inputs_of_run(q, m, c);
  }
  stat_write_row<T>(row, stat_item_sum<M, V>(lanes, n), c);
  return c.found();
}

#ifdef AMPFUSED_HAVE_F16C_PATH
// float16 with statistics, eight elements at a time with F16C (as unscale_half_f16c), the same
// lanes and fields as stat_visit: the counts on the input's bits, u's zero and abs-max tests on
// its float bits.  vcvtps2ph rounds as c10::Half does; only a NaN's payload may differ, which no
// field sees.  The last elements of an item that fill no vector take stat_visit.
template <bool kCheckOnly, bool kCountInputs>
__attribute__((target("avx2,f16c"))) bool stats_half_f16c(c10::Half* p, int64_t n, float inv,
                                                          double* row) {
  constexpr int L = kStatLanes<c10::Half>;
  alignas(64) float lanes[L];
  stat_zero_lanes<float, kStatVec<c10::Half>>(lanes, n);
  const bool inv_is_one = inv == 1.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m128i abs16 = _mm_set1_epi16(0x7fff);
  const __m128i inf16 = _mm_set1_epi16(static_cast<int16_t>(kHalfExpMask));
  const __m128i ninf16 = _mm_set1_epi16(static_cast<int16_t>(0xfc00));
  const __m256i abs32 = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf32 = _mm256_set1_epi32(static_cast<int32_t>(kFloatExpMask));
  const __m256i zero32 = _mm256_setzero_si256();
  const __m256i normal32 = _mm256_set1_epi32(static_cast<int32_t>(StatBits<float>::kHalfNormal));
  // Counted by subtracting all-ones masks; 16-bit lanes hold an item's 65536 / 8 at most.
  // `below` counts |u| < 2^-14, zeros included (stat_below_normal16).
  __m128i pos = _mm_setzero_si128(), neg = pos, nan = pos;
  __m256i zeros = zero32, below = zero32, maxbits = zero32;
  StatCounts<float> c;
  for (int64_t j = 0; j < n; j += L) {
    c10::Half* q = p + j;
    const int m = static_cast<int>(std::min<int64_t>(L, n - j));
    __m256i any_max = zero32;
    c.any_max_bits = 0;
    int l = 0;
    for (; l + 8 <= m; l += 8) {
      auto* at = reinterpret_cast<__m128i*>(q + l);
      const __m128i h = _mm_loadu_si128(at);
      if (kCountInputs) {
        pos = _mm_sub_epi16(pos, _mm_cmpeq_epi16(h, inf16));
        neg = _mm_sub_epi16(neg, _mm_cmpeq_epi16(h, ninf16));
        nan = _mm_sub_epi16(nan, _mm_cmpgt_epi16(_mm_and_si128(h, abs16), inf16));
      }
      __m256 u = _mm256_cvtph_ps(h);
      if (!inv_is_one) u = _mm256_mul_ps(u, vinv);
      if (!kCheckOnly) {
        const __m128i stored = _mm256_cvtps_ph(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(at, stored);
        u = _mm256_cvtph_ps(stored);
      }
      float* lane = lanes + l;
      _mm256_store_ps(lane, _mm256_add_ps(_mm256_load_ps(lane), _mm256_mul_ps(u, u)));
      const __m256i ub = _mm256_and_si256(_mm256_castps_si256(u), abs32);
      zeros = _mm256_sub_epi32(zeros, _mm256_cmpeq_epi32(ub, zero32));
      below = _mm256_sub_epi32(below, _mm256_cmpgt_epi32(normal32, ub));
      maxbits = _mm256_max_epu32(maxbits, _mm256_and_si256(ub, _mm256_cmpgt_epi32(inf32, ub)));
      if (!kCountInputs) any_max = _mm256_max_epu32(any_max, ub);
    }
    for (; l < m; ++l) {
      stat_visit<c10::Half, kCheckOnly, kCountInputs>(q[l], inv, inv_is_one, lanes[l], c);
    }
    if (!kCountInputs) {
      alignas(32) uint32_t am[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(am), any_max);
      for (int k = 0; k < 8; ++k) c.any_max_bits = std::max(c.any_max_bits, am[k]);
      if (c.any_non_finite_u()) count_inputs_of_run(q, m, c);
    }
  }
  alignas(32) uint16_t c16[3][8];
  alignas(32) uint32_t c32[3][8];
  _mm_store_si128(reinterpret_cast<__m128i*>(c16[0]), pos);
  _mm_store_si128(reinterpret_cast<__m128i*>(c16[1]), neg);
  _mm_store_si128(reinterpret_cast<__m128i*>(c16[2]), nan);
  _mm256_store_si256(reinterpret_cast<__m256i*>(c32[0]), zeros);
  _mm256_store_si256(reinterpret_cast<__m256i*>(c32[1]), maxbits);
  _mm256_store_si256(reinterpret_cast<__m256i*>(c32[2]), below);
  for (int k = 0; k < 8; ++k) {
    c.pos_inf += c16[0][k];
    c.neg_inf += c16[1][k];
    c.nan += c16[2][k];
    c.zeros += c32[0][k];
    c.below_normal += c32[2][k];
    c.abs_max_bits = std::max(c.abs_max_bits, c32[1][k]);
  }
  stat_write_row<c10::Half>(row, stat_item_sum<float, kStatVec<c10::Half>>(lanes, n), c);
  return c.found();
}
// The 16-bit formats with AVX-512F, 16 elements per step (load16_avx512/store16_avx512; float16
// in half the instructions of stats_half_f16c); lanes, fields and the rare second look as above.
// Without kCountInputs the finite abs-max of a run is its any_max_bits when that is finite (the
// common case), else it is taken in the second look: the loop keeps one maximum, not two.
// (Walking several runs per load of the lanes was tried: slower, from the strided access.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <typename T, bool kCheckOnly, bool kCountInputs, bool kInvOne>
__attribute__((target("avx512f"))) bool stats16_avx512(T* p, int64_t n, float inv, double* row) {
  static_assert(sizeof(T) == 2);
  constexpr int L = kStatLanes<T>;
  alignas(64) float lanes[L];
  stat_zero_lanes<float, kStatVec<T>>(lanes, n);
  const bool inv_is_one = inv == 1.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i abs32 = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf32 = _mm512_set1_epi32(static_cast<int32_t>(kFloatExpMask));
  const __m512i one32 = _mm512_set1_epi32(1);
  const __m512i normal32 = _mm512_set1_epi32(static_cast<int32_t>(StatBits<float>::kHalfNormal));
  __m512i zeros = _mm512_setzero_si512(), below = zeros, maxbits = zeros;
  StatCounts<float> c;
  for (int64_t j = 0; j < n; j += L) {
    T* q = p + j;
    const int m = static_cast<int>(std::min<int64_t>(L, n - j));
    __m512i any_max = _mm512_setzero_si512();
    c.any_max_bits = 0;
    int l = 0;
    for (; l + 16 <= m; l += 16) {
      const __m512 v = load16_avx512<T>(q + l);
      if (kCountInputs) {
        const __m512i vb = _mm512_castps_si512(v);
        const __mmask16 nf = _mm512_cmpeq_epi32_mask(_mm512_and_si512(vb, inf32), inf32);
        if (nf) {  // rare: classify these inputs one by one
          for (int k = 0; k < 16; ++k) stat_count_input(to_opmath(q[l + k]), c);
        }
      }
      __m512 u = kInvOne ? v : _mm512_mul_ps(v, vinv);  // (kInvOne: see unscale16_avx512)
      if constexpr (!kCheckOnly) u = store16_avx512<T>(q + l, u);
      float* lane = lanes + l;
      _mm512_store_ps(lane, _mm512_add_ps(_mm512_load_ps(lane), _mm512_mul_ps(u, u)));
      const __m512i ub = _mm512_and_si512(_mm512_castps_si512(u), abs32);
      zeros = _mm512_mask_add_epi32(zeros, _mm512_testn_epi32_mask(ub, ub), zeros, one32);
      if constexpr (std::is_same_v<T, c10::Half>) {  // (float16 only: kStatSubnormal)
        below = _mm512_mask_add_epi32(below, _mm512_cmplt_epi32_mask(ub, normal32), below, one32);
      }
      if (kCountInputs) {
        maxbits = _mm512_mask_max_epu32(maxbits, _mm512_cmplt_epu32_mask(ub, inf32), maxbits, ub);
      } else {
        any_max = _mm512_max_epu32(any_max, ub);
      }
    }
    for (; l < m; ++l) {
      stat_visit<T, kCheckOnly, kCountInputs>(q[l], inv, inv_is_one, lanes[l], c);
    }
    if (kCountInputs) continue;
    c.any_max_bits = std::max(c.any_max_bits, _mm512_reduce_max_epu32(any_max));
    if (!c.any_non_finite_u()) {
      c.abs_max_bits = std::max(c.abs_max_bits, c.any_max_bits);
      continue;
    }
    count_inputs_of_run(q, m, c);  // rare: the inputs counted, the finite abs-max taken
    for (int k = 0; k < m; ++k) {
      const float u = kCheckOnly ? unscaled(to_opmath(q[k]), inv, inv_is_one) : to_opmath(q[k]);
      stat_take_finite_abs(float_bits(u) & 0x7fffffffu, c);
    }
  }
  c.zeros += static_cast<uint32_t>(_mm512_reduce_add_epi32(zeros));
  c.below_normal += static_cast<uint32_t>(_mm512_reduce_add_epi32(below));
  c.abs_max_bits = std::max(c.abs_max_bits, _mm512_reduce_max_epu32(maxbits));
  stat_write_row<T>(row, stat_item_sum<float, kStatVec<T>>(lanes, n), c);
  return c.found();
}
#pragma GCC diagnostic pop
#endif

template <typename T>
AMPFUSED_INLINE bool stats_item_any(T* p, int64_t n, opmath_t<T> inv, bool check_only,
                                    double* row) {
#ifdef AMPFUSED_HAVE_F16C_PATH
  if constexpr (sizeof(T) == 2) {
    static const bool avx512 = __builtin_cpu_supports("avx512f");
    if (avx512) {
      const bool one = inv == 1.0f;
      if (check_only) {
        return one ? stats16_avx512<T, true, false, true>(p, n, inv, row)
                   : stats16_avx512<T, true, false, false>(p, n, inv, row);
      }
      if (one) return stats16_avx512<T, false, false, true>(p, n, inv, row);
      return inputs_countable_after_write(inv)
                 ? stats16_avx512<T, false, false, false>(p, n, inv, row)
                 : stats16_avx512<T, false, true, false>(p, n, inv, row);
    }
  }
  if constexpr (std::is_same_v<T, c10::Half>) {
    static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (f16c) {
      if (check_only) return stats_half_f16c<true, false>(p, n, inv, row);
      return inputs_countable_after_write(inv) ? stats_half_f16c<false, false>(p, n, inv, row)
                                               : stats_half_f16c<false, true>(p, n, inv, row);
    }
  }
#endif
  if (check_only) {
    return inv == opmath_t<T>(1) ? stats_item<T, true, true, false>(p, n, inv, row)
                                 : stats_item<T, true, false, false>(p, n, inv, row);
  }
  if (inv == opmath_t<T>(1)) return stats_item<T, false, true, false>(p, n, inv, row);
  return inputs_countable_after_write(inv) ? stats_item<T, false, false, false>(p, n, inv, row)
                                           : stats_item<T, false, false, true>(p, n, inv, row);
}

AMPFUSED_CPU_CLONES
bool stats_span(const Span& s, int64_t begin, int64_t end, float inv, bool check_only,
                double* row) {
  bool bad = false;
  const bool known = visit_grad_dtype(s.dtype, [&](auto tag) __attribute__((always_inline)) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(s.data) + begin;
    bad = stats_item_any(p, end - begin, static_cast<opmath_t<T>>(inv), check_only, row);
  });
  TORCH_INTERNAL_ASSERT(known, "ampfused: unexpected dtype ", s.dtype);
  return bad;
}

// The pass with statistics: rows 1.. of the table are the items in span order.
void launch_stats_cpu(const std::vector<Span>& spans, const PassParams& a) {
  const float inv = a.stats_inv_scale();  // (times an island's inverse factor: item_inv)
  std::vector<Piece> items;
  int64_t total_bytes = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    total_bytes += spans[i].numel * static_cast<int64_t>(c10::elementSize(spans[i].dtype));
    for (int64_t b = 0; b < spans[i].numel; b += kChunkSize) {
      items.push_back({static_cast<int32_t>(i), b, std::min(spans[i].numel, b + kChunkSize)});
    }
  }
  const auto run = [&](int64_t k) {
    const Piece& pc = items[k];
    const Span& sp = spans[pc.span];
    return stats_span(sp, pc.begin, pc.end, a.item_inv(inv, sp.island), a.check_only,
                      a.grad_stats + (1 + k) * kStatFields);
  };
  const auto num_items = static_cast<int64_t>(items.size());
  const bool found = cpu::run_pieces(num_items, total_bytes, [&](int64_t first, int64_t last) {
    bool any = false;
    for (int64_t k = first; k < last; ++k) any |= run(k);
    return any;
  });
  // The magnitude from the items' abs-max (stat_magnitude_bits), as the CUDA blocks take it.
  uint32_t mag = 0;
  if (a.measures()) {
    const float scale = *a.scale;
    for (int64_t k = 0; k < num_items; ++k) {  // (unscaled, so at the global scale: islands too)
      const double abs_max = a.grad_stats[(1 + k) * kStatFields + kStatAbsMax];
      mag = max_bits(mag, stat_magnitude_bits(abs_max, scale));
    }
  }
  finish_pass(found, mag, a);
}

}  // namespace

void launch_pass_cpu(const std::vector<Span>& spans, const PassParams& a, const at::Tensor&) {
  if (a.grad_stats != nullptr) return launch_stats_cpu(spans, a);
  const float inv = a.inv_scale();  // (an island's span: times its inverse factor, item_inv)
  int64_t total_bytes = 0;
  for (const Span& sp : spans)
    total_bytes += sp.numel * static_cast<int64_t>(c10::elementSize(sp.dtype));
  const bool measure = a.measures();
  if (!cpu::may_split(total_bytes)) {  // the calling thread, span by span
    bool found = false;
    uint32_t mag = 0;
    for (const Span& sp : spans) {
      const float sp_inv = a.item_inv(inv, sp.island);
      if (!measure) {
        found |= process_span(sp, 0, sp.numel, sp_inv, a.check_only);
        continue;
      }
      uint32_t m = 0;
      found |= measure_span(sp, 0, sp.numel, sp_inv, a.check_only, &m);
      mag = std::max(mag, a.global_magnitude(m, sp.island));
    }
    finish_pass(found, mag, a);
    return;
  }
  // Every span cut into ~kChunkBytes pieces, so threads get even shares of large and small
  // gradients alike.
  std::vector<Piece> pieces;
  pieces.reserve(spans.size() + static_cast<size_t>(total_bytes / kChunkBytes) + 1);
  for (size_t i = 0; i < spans.size(); ++i) {
    const int64_t step = kChunkBytes / static_cast<int64_t>(c10::elementSize(spans[i].dtype));
    for (int64_t b = 0; b < spans[i].numel; b += step) {
      pieces.push_back({static_cast<int32_t>(i), b, std::min(spans[i].numel, b + step)});
    }
  }
  std::atomic<uint32_t> top{0};
  const auto n = static_cast<int64_t>(pieces.size());
  const bool found = cpu::run_pieces(n, total_bytes, [&](int64_t first, int64_t last) {
    bool any = false;
    uint32_t mag = 0;
    for (int64_t k = first; k < last; ++k) {
      const Piece& pc = pieces[k];
      const Span& sp = spans[pc.span];
      const float sp_inv = a.item_inv(inv, sp.island);
      if (!measure) {
        any |= process_span(sp, pc.begin, pc.end, sp_inv, a.check_only);
        continue;
      }
      uint32_t m = 0;
      any |= measure_span(sp, pc.begin, pc.end, sp_inv, a.check_only, &m);
      mag = std::max(mag, a.global_magnitude(m, sp.island));
    }
    uint32_t seen = top.load(std::memory_order_relaxed);
    while (mag > seen && !top.compare_exchange_weak(seen, mag)) {
    }
    return any;
  });
  finish_pass(found, top.load(), a);
}

}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, CPU, m) { ampfused::register_kernels<ampfused::launch_pass_cpu>(m); }
