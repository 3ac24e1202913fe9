// What the unscale pass computes per element, per tensor and per pass, written once and compiled
// by both g++ (csrc/cpu) and nvcc (csrc/cuda): the backends keep only the iteration (chunks,
// vectors, threads, blocks, the last-block hand-off).  Contract of the ops: unscale.h.
//
// Host and device alike: no at::Tensor here, raw pointers and values only.  The CPU suite runs
// every function of this file for every dtype and special value, so what the CUDA kernel
// computes per element is tested without a GPU.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define AMPFUSED_HOST_DEVICE __host__ __device__
#define AMPFUSED_INLINE __host__ __device__ __forceinline__
#else
#define AMPFUSED_HOST_DEVICE
// Always inlined: the CPU loops are compiled once per ISA (target_clones) and must vectorize.
#define AMPFUSED_INLINE inline __attribute__((always_inline))
#endif

// CUDA's rounding intrinsics and bit casts (__fmul_rn, __float_as_uint, ...): nvcc's device pass
// has them; the host execution layer (AMPFUSED_HOST_CUDA, tests only) defines them on the host,
// so the device branches below run in CI too; the CPU build takes the plain branches.
#if defined(__CUDA_ARCH__)
#define AMPFUSED_CUDA_INTRINSICS 1
#elif defined(AMPFUSED_HOST_CUDA)
#include "host_cuda/intrinsics.h"
#define AMPFUSED_CUDA_INTRINSICS 1
#else
#define AMPFUSED_CUDA_INTRINSICS 0
#endif

namespace ampfused {

// ---------------------------------------------------------------------------------------------
// Dtypes

// The gradient dtypes the kernels take, the one list both backends and the host checks use.
// Its spelling for error messages:
constexpr const char* kGradDtypeNames = "float16, bfloat16, float32 and float64";

template <typename T>
struct DtypeTag {
  using type = T;
};

// Calls f(DtypeTag<T>{}) with the storage type T of `dtype`; returns false (f not called) for a
// dtype the kernels do not take.
template <typename F>
AMPFUSED_INLINE bool visit_grad_dtype(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      f(DtypeTag<float>{});
      return true;
    case c10::ScalarType::Half:
      f(DtypeTag<c10::Half>{});
      return true;
    case c10::ScalarType::BFloat16:
      f(DtypeTag<c10::BFloat16>{});
      return true;
    case c10::ScalarType::Double:
      f(DtypeTag<double>{});
      return true;
    default:
      return false;
  }
}

AMPFUSED_INLINE bool is_grad_dtype(c10::ScalarType dtype) {
  return visit_grad_dtype(dtype, [](auto) {});
}

// Opmath: float for float16/bfloat16/float32, double for float64 (torch's AMP kernels).
template <typename T>
struct OpMathOf {
  using type = float;
};
template <>
struct OpMathOf<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMathOf<T>::type;

// ---------------------------------------------------------------------------------------------
// Bits: exact whatever the compiler flags (fast-math may assume finite values)

AMPFUSED_INLINE uint32_t float_bits(float x) {
#if AMPFUSED_CUDA_INTRINSICS
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}
AMPFUSED_INLINE float bits_float(uint32_t u) {
#if AMPFUSED_CUDA_INTRINSICS
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}
AMPFUSED_INLINE uint64_t double_bits(double x) {
#if AMPFUSED_CUDA_INTRINSICS
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// inf/NaN <=> every exponent bit set, in each format.
constexpr uint16_t kHalfExpMask = 0x7c00u;
constexpr uint16_t kBFloat16ExpMask = 0x7f80u;
constexpr uint32_t kFloatExpMask = 0x7f800000u;
constexpr uint64_t kDoubleExpMask = 0x7ff0000000000000ull;

// 1 if x is inf or NaN, else 0: an integer, so loops OR it without branches.  float64 is tested
// in float64 (torch's CUDA kernel narrows it to float32 first).
AMPFUSED_INLINE uint32_t non_finite(float x) {
  return (float_bits(x) & kFloatExpMask) == kFloatExpMask;
}
AMPFUSED_INLINE uint32_t non_finite(double x) {
  return (double_bits(x) & kDoubleExpMask) == kDoubleExpMask;
}
// The same test on the storage bits of the 16-bit formats (the check-only and SIMD paths).
AMPFUSED_INLINE uint32_t non_finite_half_bits(uint16_t h) {
  return (h & kHalfExpMask) == kHalfExpMask;
}
AMPFUSED_INLINE uint32_t non_finite_bf16_bits(uint16_t h) {
  return (h & kBFloat16ExpMask) == kBFloat16ExpMask;
}

// ---------------------------------------------------------------------------------------------
// Storage <-> opmath

// bfloat16 from float: round to nearest even, any NaN -> 0x7FC0 (c10::BFloat16's host rule).
// Written on the bits, without branches, so the CPU loop vectorizes; CUDA uses it too, so both
// backends store the same bits (c10's device conversion would store 0x7FFF for NaN on sm_80+).
// kMaskNaN: the NaN case as a mask instead of a select, the same bits.  GCC vectorizes the
// grad_stats loop, which reads the stored value back, only with the mask; the plain loop is
// faster with the select.
template <bool kMaskNaN = false>
AMPFUSED_INLINE uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  if (kMaskNaN) {
    const uint32_t nan = (u & 0x7fffffffu) > kFloatExpMask;
    return static_cast<uint16_t>((rounded & (nan - 1u)) | (0x7fc0u & (0u - nan)));
  }
  return (u & 0x7fffffffu) > kFloatExpMask ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}
AMPFUSED_INLINE float bf16_bits_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

template <typename T>
AMPFUSED_INLINE opmath_t<T> to_opmath(T x) {
  return static_cast<opmath_t<T>>(x);
}
template <>
AMPFUSED_INLINE float to_opmath<c10::BFloat16>(c10::BFloat16 x) {
  return bf16_bits_to_float(x.x);
}

// Rounds an opmath value to the storage dtype (IEEE round to nearest even for every format;
// float16 through c10::Half, __float2half on CUDA).  Finite values round identically on both
// backends; a float16 NaN stays a NaN, but its payload bits are the converter's (CUDA, F16C and
// c10's software conversion each keep different bits), as with torch's own kernels.
template <typename T>
AMPFUSED_INLINE T to_storage(opmath_t<T> v) {
  return static_cast<T>(v);
}
template <>
AMPFUSED_INLINE c10::BFloat16 to_storage<c10::BFloat16>(float v) {
  return c10::BFloat16(float_to_bf16_bits(v), c10::BFloat16::from_bits());
}

// ---------------------------------------------------------------------------------------------
// Per element

// torch's multiply-or-pass rule: with inv_scale == 1 the value is written back unmultiplied (so
// a float32/float64 NaN keeps its payload, even a signalling one).
template <typename M>
AMPFUSED_INLINE M unscaled(M v, M inv, bool inv_is_one) {
  return inv_is_one ? v : v * inv;
}

// The finiteness test of a stored element: on the storage bits for the 16-bit formats (the same
// answer as testing the converted value, with no conversion).
template <typename T>
AMPFUSED_INLINE uint32_t non_finite_stored(T x) {
  return non_finite(to_opmath(x));
}
template <>
AMPFUSED_INLINE uint32_t non_finite_stored<c10::Half>(c10::Half x) {
  return non_finite_half_bits(x.x);
}
template <>
AMPFUSED_INLINE uint32_t non_finite_stored<c10::BFloat16>(c10::BFloat16 x) {
  return non_finite_bf16_bits(x.x);
}

// One gradient element: returns 1 if the *input* is inf/NaN; unless kCheckOnly, x becomes the
// unscaled value rounded to its dtype.  Backends pass inv_is_one as a constant where they have
// specialised loops, so the select folds away.
template <typename T, bool kCheckOnly>
AMPFUSED_INLINE uint32_t visit(T& x, opmath_t<T> inv, bool inv_is_one) {
  if (kCheckOnly) return non_finite_stored(x);
  const opmath_t<T> v = to_opmath(x);
  x = to_storage<T>(unscaled(v, inv, inv_is_one));
  return non_finite(v);
}

// One gradient element unscaled out of place into float32 (unscale_into_, unscale_into.h: float16
// model gradients into float32 master gradients): `out` becomes the input in opmath, unscaled by
// the multiply-or-pass rule, and the result is 1 if the *input* is inf/NaN.  float16, bfloat16
// and float32 widen to float exactly, so this is torch's `out.copy_(g); out.mul_(inv_scale)`.
template <typename T>
AMPFUSED_INLINE uint32_t visit_into(T x, float& out, float inv, bool inv_is_one) {
  static_assert(std::is_same_v<opmath_t<T>, float>, "unscale_into_ writes float32");
  const float v = to_opmath(x);
  out = unscaled(v, inv, inv_is_one);
  return non_finite(v);
}

// ---------------------------------------------------------------------------------------------
// Per pass

// float32(1 / float64(scale)): torch's `_scale.double().reciprocal().float()`.  The tensor form
// of the same expression is in ampfused/grad_scaler.py (torch's path) and python_module.cpp
// (inv_scale copied to the devices other than the scale's).
AMPFUSED_INLINE float inv_scale_of(float scale) {
  return static_cast<float>(1.0 / static_cast<double>(scale));
}

// The headroom policy's history: the scale caps of this many recent iterations.
constexpr int kHistory = 16;

// The GradScaler state the scaler ops (scaler_pass_, scaler_update_) read and write: one int32
// tensor, so one copy commits an iteration's update.  The scale is stored as its float32 bits
// (ampfused.GradScaler's _scale is a float32 view of element 0).
enum ScalerState : int {
  kStateScale = 0,         // float32 bits
  kStateGrowthTracker,     // consecutive clean steps, as torch's _growth_tracker
  kStateHysteresisLeft,    // overflowing steps still tolerated before a backoff
  kStateSteps,             // iterations (update() calls) so far
  kStateSkippedSteps,      // ... that found inf/NaN (the optimizer step was skipped)
  kStateConsecutiveSkips,  // skipped iterations since the last clean one
  kStateGrowths,           // iterations that raised the scale
  kStateBackoffs,          // iterations that lowered the scale
  kStateFloorHits,         // backoffs held at min_scale
  // float32 bits: the largest finite |scaled gradient| the iteration's passes measured (the
  // headroom policy's measurement, Magnitude below), +inf where one found inf/NaN, 0 where
  // nothing was measured.  In next_state the passes of an iteration combine it (max).
  kStateMagnitude,
  // float32 bits: the headroom policy's ceiling, a scale that overflowed again soon after an
  // overflow (the measured magnitudes miss what overflows there); +inf: none.
  kStateCeiling,
  // The headroom policy's count of clean iterations since the last overflow that backed the
  // scale off (saturating at INT32_MAX, its value before any).
  kStateSinceBackoff,
  // kHistory float32 bits: the headroom policy's entries of the last kHistory iterations,
  // iteration `steps` at kStateHistory + steps % kHistory: a clean iteration's scale cap
  // (headroom_cap), an overflow's bound (the scale it backed off to) negated, +inf: none.
  kStateHistory,
  // float32 bits: the learned margin in force (ScalePolicy::learned); 0: none learned yet.
  kStateMargin = kStateHistory + kHistory,
  kScalerStateSize,
};
// Counters are int32 and wrap modulo 2^32 (2^31 steps is years of training).
AMPFUSED_INLINE int32_t counter_plus(int32_t c, int32_t add) {
  return static_cast<int32_t>(static_cast<uint32_t>(c) + static_cast<uint32_t>(add));
}

// How the scale moves.  The defaults of min_scale, max_scale and hysteresis give torch's rule.
struct ScalePolicy {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  // A backoff below min_scale is held at it, a growth above max_scale at it; a scale already
  // beyond a bound stays where it is (an overflow never raises the scale, a growth never lowers).
  float min_scale = -__builtin_huge_valf();
  float max_scale = __builtin_huge_valf();
  int32_t hysteresis = 1;  // back off on the hysteresis-th consecutive overflowing step
  // > 0: the headroom policy (update_scale_state): the scale is moved so that the largest
  // measured magnitude stays `headroom` times below float16's largest finite value, instead of
  // growing every growth_interval clean steps.  0: torch's rule.
  float headroom = 0.0f;
  // With the headroom policy: the margin is learned (from kMarginLeast up to `headroom`) from
  // how far the measured magnitudes have risen above their recent largest (learned_margin).
  bool learned = false;
};

// float16's largest finite value: the ceiling the headroom policy keeps its distance from.
constexpr float kHalfMax = 65504.0f;
// An overflow backing off within this many clean iterations of an earlier one sets the ceiling.
constexpr int32_t kCeilingWindow = 2 * kHistory;
// Where nothing is measured the headroom policy grows each clean iteration up to this scale
// (torch's initial scale), then by torch's rule.
constexpr float kBlindGrowthLimit = 65536.0f;
// The learned margin's least value, and the factor a measured rise is taken with: sqrt(2)
// (float32), half a binade.
constexpr float kMarginLeast = 1.41421354f;
// The learned margin forgets: times this each measured clean iteration (a binade in 512).
constexpr double kMarginDecay = 0.9986471128909702;  // 2^(-1/512)

// ---------------------------------------------------------------------------------------------
// The headroom policy's measurement: the largest finite |v| over the scaled values v a pass
// reads, taken on each element's storage bits with the sign cleared (for non-negative values of
// one format integer order is value order) and turned into a float32 at the end of a run
// (MagnitudeOf<T>::to_float_bits), where the runs of a pass combine by an unsigned max of
// float32 bits (atomicMax across CUDA blocks).  inf/NaN are not masked out: a pass that reads one
// found inf/NaN, and its magnitude is then +inf whatever the runs measured (finish_pass), so the
// loops spend two operations per element on it (an and, a max).
template <typename T>
struct MagnitudeOf {  // float32
  using type = uint32_t;
  static AMPFUSED_INLINE uint32_t of(float x) { return float_bits(x) & 0x7fffffffu; }
  static AMPFUSED_INLINE uint32_t to_float_bits(uint32_t b) { return b; }
};
template <>
struct MagnitudeOf<double> {
  using type = uint64_t;
  static AMPFUSED_INLINE uint64_t of(double x) { return double_bits(x) & 0x7fffffffffffffffull; }
  // Rounded to float32, up to float32's largest finite value (a float64 beyond its range).
  static AMPFUSED_INLINE uint32_t to_float_bits(uint64_t b) {
    double d;
#if AMPFUSED_CUDA_INTRINSICS
    d = __longlong_as_double(static_cast<long long>(b));
#else
    std::memcpy(&d, &b, sizeof(d));
#endif
    const uint32_t f = float_bits(static_cast<float>(d));
    return f < kFloatExpMask ? f : kFloatExpMask - 1u;
  }
};
template <>
struct MagnitudeOf<c10::Half> {
  using type = uint16_t;
  static AMPFUSED_INLINE uint16_t of(c10::Half x) { return x.x & 0x7fffu; }
  static AMPFUSED_INLINE uint32_t to_float_bits(uint16_t b) {
    return float_bits(static_cast<float>(c10::Half(b, c10::Half::from_bits())));
  }
};
template <>
struct MagnitudeOf<c10::BFloat16> {
  using type = uint16_t;
  static AMPFUSED_INLINE uint16_t of(c10::BFloat16 x) { return x.x & 0x7fffu; }
  static AMPFUSED_INLINE uint32_t to_float_bits(uint16_t b) {
    return static_cast<uint32_t>(b) << 16;
  }
};
template <typename T>
using magnitude_bits_t = typename MagnitudeOf<T>::type;

// The measurement of a pass with statistics, from an item's abs-max of unscaled values:
// abs_max * scale (in float64, rounded to float32, up to its largest finite value; 0 where not
// positive).  It equals
// the largest finite |v| where the scale is a power of two and no value underflowed.
// A product that is not positive (a scale <= 0 or NaN) measures nothing.
template <typename M>
AMPFUSED_INLINE uint32_t stat_magnitude_bits(M abs_max, float scale) {
  const double product = static_cast<double>(abs_max) * scale;
  if (!(product > 0.0)) return 0u;
  const uint32_t f = float_bits(static_cast<float>(product));
  return f < kFloatExpMask ? f : kFloatExpMask - 1u;
}

// Per-gradient statistics (opt-in: scaler_pass_'s grad_stats), a float64 table of kStatFields
// columns.  Row 0 is the pass header, then one row per work item of kChunkSize elements
// (launch_table.h), the items of each gradient in order: ceil(numel / kChunkSize) rows each.
constexpr int kStatFields = 7;
enum StatField : int {
  kStatSumSquares = 0,  // sum of u*u over the item, u the unscaled value, in the lane order
  kStatAbsMax,          // max |u| over the finite u of the item (0 if none)
  kStatPosInf,          // input elements that were +inf
  kStatNegInf,          // input elements that were -inf
  kStatNaN,             // input elements that were NaN
  kStatZeros,           // u that are exactly zero (+0 or -0)
  // float16 gradients: finite u with 0 < |u| < 2^-14, float16's smallest normal (its
  // subnormals: kept with fewer than 11 significant bits; below 2^-24 a value is lost to zero);
  // 0 for the other dtypes, which hold such values in full (and whose passes pay nothing for it)
  kStatSubnormal,
};
enum StatHeader : int {
  kHeaderScale = 0,  // the scale in force during the pass
  kHeaderStep,       // the steps counter before this iteration's update
  kHeaderFound,      // 1 if this pass found inf/NaN
};

// The fixed order of an item's sum of squares, the same on every backend and at any alignment:
// with V = kStatVecBytes / sizeof(T) and L = kStatThreads * V lanes, element i of the item
// goes to lane i % L, each lane adds its squares in increasing i, thread t sums its lanes
// t*V .. t*V+V-1 in order, and stat_tree_level pairs the kStatThreads thread sums.  On CUDA
// thread t's lanes are exactly its 16-byte vectors of an aligned item.
constexpr int kStatThreads = 512;
constexpr int kStatVecBytes = 16;
template <typename T>
constexpr int kStatVec = kStatVecBytes / static_cast<int>(sizeof(T));
template <typename T>
constexpr int kStatLanes = kStatThreads * kStatVec<T>;

// Multiply and add, each rounded: never contracted into an FMA (CUDA's _rn intrinsics; the CPU
// sources are compiled with -ffp-contract=off, setup.py), so the sums match the reference.
AMPFUSED_INLINE float stat_mul(float a, float b) {
#if AMPFUSED_CUDA_INTRINSICS
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
AMPFUSED_INLINE float stat_add(float a, float b) {
#if AMPFUSED_CUDA_INTRINSICS
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
AMPFUSED_INLINE double stat_mul(double a, double b) {
#if AMPFUSED_CUDA_INTRINSICS
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
AMPFUSED_INLINE double stat_add(double a, double b) {
#if AMPFUSED_CUDA_INTRINSICS
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// The opmath type's bits: the special values and the abs-max are compared as integers (for
// non-negative floats integer order is float order), which vectorizes on the CPU.
template <typename M>
struct StatBits {
  using type = uint32_t;
  static constexpr uint32_t kSign = 0x80000000u;
  static constexpr uint32_t kInf = kFloatExpMask;
  static constexpr uint32_t kHalfNormal = 0x38800000u;  // 2^-14
  static AMPFUSED_INLINE uint32_t of(float x) { return float_bits(x); }
  static AMPFUSED_INLINE float value(uint32_t b) { return bits_float(b); }
};
template <>
struct StatBits<double> {
  using type = uint64_t;
  static constexpr uint64_t kSign = 0x8000000000000000ull;
  static constexpr uint64_t kInf = kDoubleExpMask;
  static constexpr uint64_t kHalfNormal = 0x3f10000000000000ull;  // 2^-14
  static AMPFUSED_INLINE uint64_t of(double x) { return double_bits(x); }
  static AMPFUSED_INLINE double value(uint64_t b) {
#if AMPFUSED_CUDA_INTRINSICS
    return __longlong_as_double(static_cast<long long>(b));
#else
    double x;
    std::memcpy(&x, &b, sizeof(x));
    return x;
#endif
  }
};

// An item's (CPU) or a thread's share of an item's (CUDA) fields other than the sum: each
// order-free, counted in the width of the bits so the CPU loops stay one lane width.
template <typename M>
struct StatCounts {
  using B = typename StatBits<M>::type;
  B pos_inf = 0;
  B neg_inf = 0;
  B nan = 0;
  B zeros = 0;
  B below_normal = 0;  // |u| < 2^-14, zeros included (stat_below_normal16)
  B abs_max_bits = 0;  // max |u| over the finite u, as bits
  B any_max_bits = 0;  // max |u| over all u, as bits (stat_visit without kCountInputs)
  AMPFUSED_INLINE bool found() const { return (pos_inf | neg_inf | nan) != 0; }
  // Whether some u since any_max_bits was zeroed was inf/NaN.
  AMPFUSED_INLINE bool any_non_finite_u() const { return any_max_bits >= StatBits<M>::kInf; }
};

// 1 if |u| (its bits, sign cleared, so at most the signed maximum) is below float16's smallest
// normal 2^-14, zero included: one signed compare, which every vector ISA has.  The subnormal
// count is this count less the zeros, taken once per row (stat_write_row); float16 items only.
template <typename M>
AMPFUSED_INLINE typename StatBits<M>::type stat_below_normal16(typename StatBits<M>::type ub) {
  using B = typename StatBits<M>::type;
  using S = std::make_signed_t<B>;
  return static_cast<B>(static_cast<S>(ub) < static_cast<S>(StatBits<M>::kHalfNormal));
}

// Counts v as an input element (+inf, -inf, NaN).
template <typename M>
AMPFUSED_INLINE void stat_count_input(M v, StatCounts<M>& c) {
  using SB = StatBits<M>;
  const typename SB::type vb = SB::of(v);
  c.pos_inf += vb == SB::kInf;
  c.neg_inf += vb == (SB::kInf | SB::kSign);
  c.nan += (vb & ~SB::kSign) > SB::kInf;
}

// Whether, in a writing pass, each stored u is inf/NaN exactly when its input v was, of the same
// class (+inf, -inf, NaN): so with 0 < inv <= 1 (scale >= 1) the inputs can be counted from
// the stored values afterwards.  A finite v gives |v * inv| <= |v|, which rounds (in opmath,
// then to the storage type, which holds v) to a finite value; inf * inv is inf of the same sign
// and NaN stays NaN.  With inv > 1 a finite v can overflow, with inv == 0 an inf becomes NaN.
template <typename M>
AMPFUSED_INLINE bool inputs_countable_after_write(M inv) {
  return inv > M(0) && inv <= M(1);
}

// |u| (its bits, sign cleared) into the finite abs-max, unless u is inf/NaN.
template <typename M>
AMPFUSED_INLINE void stat_take_finite_abs(typename StatBits<M>::type ub, StatCounts<M>& c) {
  using B = typename StatBits<M>::type;
  // A mask, not a select: GCC vectorizes the max reduction of this form only.
  const B finite_abs = ub & (B{0} - static_cast<B>(ub < StatBits<M>::kInf));
  c.abs_max_bits = c.abs_max_bits > finite_abs ? c.abs_max_bits : finite_abs;
}

// One element with statistics: x as visit() leaves it, its square added to `lane`, the counts
// of its input and of u (StatField).  u is the value a writing pass stores, read back in
// opmath; a check-only pass writes nothing and u is v * inv in opmath.  Without kCountInputs
// the input is not classified; any_max_bits tells whether some u was inf/NaN, which every
// non-finite v makes it, so a caller can count the inputs of such a run afterwards (the CPU
// loop: in a check-only pass from x, in a writing pass from the stored values where
// inputs_countable_after_write).
template <typename T, bool kCheckOnly, bool kCountInputs = true>
AMPFUSED_INLINE void stat_visit(T& x, opmath_t<T> inv, bool inv_is_one, opmath_t<T>& lane,
                                StatCounts<opmath_t<T>>& c) {
  using M = opmath_t<T>;
  using SB = StatBits<M>;
  using B = typename SB::type;
  const M v = to_opmath(x);
  if (kCountInputs) stat_count_input(v, c);
  M u = unscaled(v, inv, inv_is_one);
  if constexpr (!kCheckOnly && std::is_same_v<T, c10::BFloat16>) {
    x.x = float_to_bf16_bits<true>(u);  // to_storage<c10::BFloat16>, vectorizable here
    u = to_opmath(x);
  } else if constexpr (!kCheckOnly) {
    x = to_storage<T>(u);
    u = to_opmath(x);
  }
  lane = stat_add(lane, stat_mul(u, u));
  const B ub = SB::of(u) & ~SB::kSign;
  c.zeros += ub == 0;
  if constexpr (std::is_same_v<T, c10::Half>) c.below_normal += stat_below_normal16<M>(ub);
  stat_take_finite_abs(ub, c);
  if (!kCountInputs) c.any_max_bits = c.any_max_bits > ub ? c.any_max_bits : ub;
}

// Thread t's sum: its V lanes in order.
template <typename M, int V>
AMPFUSED_INLINE M stat_thread_sum(const M* lanes) {
  M s = lanes[0];
  for (int k = 1; k < V; ++k) s = stat_add(s, lanes[k]);
  return s;
}

// One level of the pairwise tree over the thread sums: s[j] += s[j + h] for j < h, with h =
// kStatThreads / 2, ..., 2, 1; s[0] is then the item's sum.  (CUDA runs a level per barrier.)
template <typename M>
AMPFUSED_INLINE void stat_tree_level(M* s, int h, int j) {
  s[j] = stat_add(s[j], s[j + h]);
}

// The CPU's form of the same sums, for an item of n elements whose lanes were accumulated in
// `lanes`: only the lanes the item touched are read (stat_zero_lanes zeroes them first), so a
// small item costs what it touches.  The others would hold +0.0, and adding +0.0 leaves a sum of
// squares unchanged (none is -0.0), so the threads and tree additions that would only add them
// are skipped with the same result.
template <typename M, int V>
AMPFUSED_INLINE int stat_active_threads(int64_t n) {
  return n >= int64_t{kStatThreads} * V ? kStatThreads : static_cast<int>((n + V - 1) / V);
}
template <typename M, int V>
AMPFUSED_INLINE void stat_zero_lanes(M* lanes, int64_t n) {
  const int touched = stat_active_threads<M, V>(n) * V;
  for (int l = 0; l < touched; ++l) lanes[l] = M(0);
}
template <typename M, int V>
AMPFUSED_INLINE M stat_item_sum(const M* lanes, int64_t n) {
  int active = stat_active_threads<M, V>(n);
  M s[kStatThreads];
  for (int t = 0; t < active; ++t) s[t] = stat_thread_sum<M, V>(lanes + t * V);
  for (int h = kStatThreads / 2; h > 0; h /= 2) {
    if (h >= active) continue;  // every partner s[j + h] is beyond the touched threads
    for (int j = 0; j + h < active; ++j) stat_tree_level(s, h, j);
    active = h;
  }
  return s[0];
}

// An item's row of grad_stats, for an item of storage type T.
template <typename T, typename M>
AMPFUSED_INLINE void stat_write_row(double* row, M sum_squares, const StatCounts<M>& c) {
  row[kStatSumSquares] = static_cast<double>(sum_squares);
  row[kStatAbsMax] = static_cast<double>(StatBits<M>::value(c.abs_max_bits));
  row[kStatPosInf] = static_cast<double>(c.pos_inf);
  row[kStatNegInf] = static_cast<double>(c.neg_inf);
  row[kStatNaN] = static_cast<double>(c.nan);
  row[kStatZeros] = static_cast<double>(c.zeros);
  row[kStatSubnormal] =
      std::is_same_v<T, c10::Half> ? static_cast<double>(c.below_normal - c.zeros) : 0.0;
}

// Everything one pass needs, as raw pointers on the pass's device: built by the op kernels
// (Kernels in unscale.h), read by the CPU loop and passed by value to the CUDA kernel.
struct PassParams {
  // The scale (scale_is_inverse == false) or inv_scale (true).  Null in a check-only pass
  // without update: nothing is scaled, so nothing reads it.
  const float* scale = nullptr;
  bool scale_is_inverse = false;
  bool check_only = false;           // read-only: no gradient is written
  float* found_inf = nullptr;        // null: no flag to write (scaler_update_)
  bool overwrite_found_inf = false;  // write 0.0 when nothing was found (else leave it)
  const float* found_in = nullptr;   // scaler_update_'s verdict: nonzero counts as found
  // The fused scale update (with_update): reads *scale (the scale itself), *growth_tracker and,
  // for the scaler ops, state[kStateHysteresisLeft..] through `counters`; writes the next_*.
  bool with_update = false;
  bool accumulate = false;
  const int32_t* growth_tracker = nullptr;
  const int32_t* counters = nullptr;  // null: no hysteresis state, no counters (torch's rule)
  float* next_scale = nullptr;
  int32_t* next_growth_tracker = nullptr;
  int32_t* next_counters = nullptr;
  ScalePolicy policy;
  double* grad_stats = nullptr;  // the opt-in statistics table above, or null
  // scaler_update_: the iteration's measured magnitude as the passes left it in next_state
  // (kStateMagnitude; read before next_state is written), combined with found_in.
  const int32_t* magnitude_in = nullptr;
  // Scale islands (scaler_pass_'s islands/island_inv): an item of island k >= 1 carries the
  // global scale times the island's power-of-two factor, so its multiplier is the pass's times
  // island_inv[k - 1] (item_inv; exact: a product by a power of two), its statistics are of its
  // truly unscaled values, and its measured magnitude is taken at the global scale
  // (global_magnitude: what it would be without the island).  Null: no island in the pass.
  const float* island_inv = nullptr;

  // What an item of `island` is multiplied by, given the pass's multiplier (inv_scale(), or
  // stats_inv_scale() for what the statistics see).
  AMPFUSED_INLINE float item_inv(float inv, int island) const {
    return island == 0 ? inv : inv * island_inv[island - 1];
  }
  // An item's measured magnitude (float32 bits) at the global scale: an island's divided by its
  // factor (exact).  inf/NaN bits stay as they are (the pass found inf/NaN).
  AMPFUSED_INLINE uint32_t global_magnitude(uint32_t bits, int island) const {
    if (island == 0 || bits >= kFloatExpMask) return bits;
    return float_bits(bits_float(bits) * island_inv[island - 1]);
  }

  // What each element is multiplied by; a check-only pass reads no scale (1 is never applied).
  AMPFUSED_INLINE float inv_scale() const {
    if (check_only) return 1.0f;
    return scale_is_inverse ? *scale : inv_scale_of(*scale);
  }
  // What the statistics see an element multiplied by: the unscaled value, in a check-only pass
  // too (what a fused optimizer will step with).
  AMPFUSED_INLINE float stats_inv_scale() const {
    if (scale == nullptr) return 1.0f;
    return scale_is_inverse ? *scale : inv_scale_of(*scale);
  }
  // Whether the pass measures the magnitude (MagnitudeOf): for the headroom policy's update.
  AMPFUSED_INLINE bool measures() const {
    return with_update && counters != nullptr && policy.headroom > 0.0f;
  }
  // The end of the pass (the CPU after its loop, the last CUDA block): found_inf, the update.
  AMPFUSED_INLINE bool needs_whole_pass() const {
    return overwrite_found_inf || with_update || grad_stats != nullptr;
  }
};

// The headroom policy's cap from one clean iteration: the largest scale at which the magnitude
// measured at `scale` would stay `headroom` times below kHalfMax (float64, rounded to float32,
// at most float32's largest finite value); +inf (no cap) where nothing was measured.
AMPFUSED_INLINE float headroom_cap(float scale, float magnitude, float headroom) {
  if (!(magnitude > 0.0f)) return __builtin_huge_valf();
  const float cap = static_cast<float>(static_cast<double>(kHalfMax) * static_cast<double>(scale) /
                                       (static_cast<double>(headroom) * magnitude));
  return non_finite(cap) ? bits_float(kFloatExpMask - 1u) : cap;
}

// The headroom policy's move for a clean iteration, given the lowest cap of the history
// (`allowed`, finite): up by growth_factor as many times as the scale stays within allowed
// (and max_scale, where a growth beyond it is held), else down by backoff_factor until it is
// within allowed (a lowering held at min_scale).  Each factor is applied as torch applies it
// (float64 product rounded to float32), at most 64 times per iteration.
AMPFUSED_INLINE float headroom_move(float scale, float allowed, const ScalePolicy& p) {
  float s = scale;
  for (int i = 0; i < 64; ++i) {
    const float g = static_cast<float>(static_cast<double>(s) * p.growth_factor);
    if (!(g > s) || non_finite(g) || g > allowed) break;
    if (g > p.max_scale) {
      if (s < p.max_scale && p.max_scale <= allowed) s = p.max_scale;
      break;
    }
    s = g;
  }
  if (s != scale) return s;
  for (int i = 0; i < 64 && s > allowed; ++i) {
    const float b = static_cast<float>(static_cast<double>(s) * p.backoff_factor);
    if (!(b < s)) break;
    if (b < p.min_scale) {
      if (s > p.min_scale) s = p.min_scale;
      break;
    }
    s = b;
  }
  return s;
}

// A history entry's value as a bound on the scale: a cap as it is, an overflow's (negated) as
// its magnitude.
AMPFUSED_INLINE float history_bound(float h) { return bits_float(float_bits(h) & 0x7fffffffu); }
AMPFUSED_INLINE bool history_is_cap(float h) { return h > 0.0f; }

// The learned margin after a measured clean iteration (cap finite): the margin in force
// (`margin`; 0: none learned yet, the most) times kMarginDecay, raised to kMarginLeast times
// how far this iteration's magnitude rose above the largest of the history's clean iterations
// (`lowest_cap`, their lowest cap, over this one's: +inf, none), held from kMarginLeast to
// `most` (`most` where that is lower).  float64, rounded to float32.
AMPFUSED_INLINE float learned_margin(float margin, float lowest_cap, float cap, float most) {
  double m =
      (margin > 0.0f && !non_finite(margin) ? static_cast<double>(margin) : most) * kMarginDecay;
  if (!non_finite(lowest_cap)) {
    const double rise = static_cast<double>(lowest_cap) / cap * kMarginLeast;
    if (rise > m) m = rise;
  }
  if (m < kMarginLeast) m = kMarginLeast;
  if (m > most) m = most;
  return static_cast<float>(m);
}

// torch._amp_update_scale_ (aten/src/ATen/native/cuda/AmpKernels.cu), element for element under
// the default policy, extended by min_scale, max_scale, hysteresis (apex's
// update_scale_hysteresis: each overflowing step uses up one of hysteresis_left and the scale
// backs off once none is left; any clean step refills it), the headroom policy and the
// counters.  `counters` and `out_counters` point at state[kStateHysteresisLeft]; null gives
// torch's rule (hysteresis 1, no headroom).
//
// The headroom policy (p.headroom > 0, with counters): an overflow backs off as above, and its
// history entry is the scale it backed off to, negated (a bound: the scale is held at or below
// it while the entry is in the history; where the history holds no cap, nothing: see
// `measured`); a clean iteration's entry is headroom_cap of its measured magnitude, and the scale
// moves to the lowest bound of the history (headroom_move), growing as soon as every recent
// iteration leaves room and lowering, with no overflow needed, when one leaves none.  With a
// learned margin (p.learned) the caps are taken at the margin in force instead of p.headroom
// (times p.headroom / margin; the overflows' bounds as they are), and each measured clean
// iteration updates the margin (learned_margin): it rises at once with a magnitude that went
// beyond the history's largest, and forgets slowly.  An overflow that backs off within
// kCeilingWindow clean iterations of the last overflow that backed off (the measured magnitudes
// miss what overflows at that scale: a spike does not come twice in a row) makes its scale the
// ceiling: the scale stays at most the ceiling times backoff_factor, and every growth_interval
// clean iterations after that backoff the ceiling rises by growth_factor (a probe, as torch's rule
// grows).  Once there is a ceiling, any overflow that backs off below it (a probe's) lowers it to
// its scale.  Where no entry of the history holds a cap and there is no ceiling (nothing measured:
// no gradient was read, or all were zero), the scale grows by growth_factor each clean iteration up
// to kBlindGrowthLimit, then by torch's rule. Under the headroom policy the growth tracker counts
// clean iterations since the last overflow.
AMPFUSED_INLINE void update_scale_state(float scale, int32_t tracker, const int32_t* counters,
                                        bool found, float magnitude, const ScalePolicy& p,
                                        float* out_scale, int32_t* out_tracker,
                                        int32_t* out_counters) {
  float next = scale;
  bool floor_hit = false;
  int32_t hysteresis_left = counters != nullptr ? counters[0] : 1;
  const auto in = [&](int field) { return counters[field - kStateHysteresisLeft]; };
  const bool headroom = p.headroom > 0.0f && counters != nullptr;
  float cap = __builtin_huge_valf();  // this iteration's history entry
  int slot = 0;
  float ceiling = __builtin_huge_valf();
  int32_t since_backoff = 0;
  // Whether the history holds a cap (this slot's, the oldest, aside): something was measured in
  // the last kHistory - 1 iterations.  An overflow while none is held (a NaN in the first step)
  // says nothing about the level the measurements will find: it records no cap, and the first
  // measured iteration after it forgets the ceiling and the backoff (see below).
  bool measured = false;
  if (headroom) {
    slot = static_cast<int>(static_cast<uint32_t>(in(kStateSteps)) % kHistory);
    ceiling = bits_float(static_cast<uint32_t>(in(kStateCeiling)));
    since_backoff = in(kStateSinceBackoff);
    for (int j = 0; j < kHistory; ++j) {
      if (j != slot && !non_finite(bits_float(static_cast<uint32_t>(in(kStateHistory + j))))) {
        measured = true;
      }
    }
  }
  float margin = headroom && p.learned ? bits_float(static_cast<uint32_t>(in(kStateMargin))) : 0.0f;
  if (found) {
    *out_tracker = 0;
    hysteresis_left = hysteresis_left > 1 ? hysteresis_left - 1 : 0;
    if (hysteresis_left == 0) {
      next = static_cast<float>(static_cast<double>(scale) * p.backoff_factor);
      if (next < p.min_scale) {
        next = scale < p.min_scale ? scale : p.min_scale;
        floor_hit = true;
      }
      if (headroom) {
        // (with a ceiling, as at a probe, any overflow below it lowers it)
        if ((since_backoff < kCeilingWindow || !non_finite(ceiling)) && scale < ceiling) {
          ceiling = scale;
        }
        since_backoff = 0;
      }
    }
    if (measured) cap = -next;  // (a bound, not a measurement)
  } else {
    hysteresis_left = p.hysteresis;
    const int32_t successful = tracker + 1;
    float allowed = __builtin_huge_valf();
    if (headroom) {
      cap = headroom_cap(scale, magnitude, p.headroom);
      if (!measured && !non_finite(cap)) {
        // The first measurement after none: a ceiling and backoff learned while nothing was
        // measured (overflows of unread or all-zero gradients) do not bound what is now read.
        ceiling = __builtin_huge_valf();
        since_backoff = INT32_MAX;
      }
      if (since_backoff < INT32_MAX) ++since_backoff;
      if (p.growth_interval > 0 && since_backoff % p.growth_interval == 0) {
        ceiling = static_cast<float>(static_cast<double>(ceiling) * p.growth_factor);  // a probe
      }
      float lowest_cap = __builtin_huge_valf();  // of the history's clean iterations
      float bound = __builtin_huge_valf();       // of its overflows
      for (int j = 0; j < kHistory; ++j) {
        const float h = bits_float(static_cast<uint32_t>(in(kStateHistory + j)));
        if (j == slot) continue;
        if (history_is_cap(h)) {
          if (h < lowest_cap) lowest_cap = h;
        } else if (history_bound(h) < bound) {
          bound = history_bound(h);
        }
      }
      allowed = cap < lowest_cap ? cap : lowest_cap;
      if (p.learned) {
        if (!non_finite(cap)) margin = learned_margin(margin, lowest_cap, cap, p.headroom);
        const float in_force = margin > 0.0f ? margin : p.headroom;
        const double relaxed = static_cast<double>(allowed) * p.headroom / in_force;
        const float most = bits_float(kFloatExpMask - 1u);
        if (!non_finite(allowed)) allowed = relaxed > most ? most : static_cast<float>(relaxed);
      }
      if (bound < allowed) allowed = bound;
      const float below = static_cast<float>(static_cast<double>(ceiling) * p.backoff_factor);
      if (below < allowed) allowed = below;
    }
    if (headroom && !non_finite(allowed)) {
      next = headroom_move(scale, allowed, p);
      *out_tracker = successful;
    } else if (headroom && scale < kBlindGrowthLimit) {  // nothing measured yet: a fast start
      float grown = static_cast<float>(static_cast<double>(scale) * p.growth_factor);
      if (grown > kBlindGrowthLimit) grown = kBlindGrowthLimit;
      if (grown > p.max_scale) grown = scale > p.max_scale ? scale : p.max_scale;
      next = grown > scale ? grown : scale;
      *out_tracker = successful;
    } else if (successful == p.growth_interval) {
      float grown = static_cast<float>(static_cast<double>(scale) * p.growth_factor);
      // A grown scale that overflowed float32 is not taken; the tracker still resets.
      if (non_finite(grown)) grown = scale;
      if (grown > p.max_scale) grown = scale > p.max_scale ? scale : p.max_scale;
      next = grown;
      *out_tracker = 0;
    } else {
      *out_tracker = successful;
    }
  }
  *out_scale = next;
  if (out_counters == nullptr) return;
  int32_t* out = out_counters - kStateHysteresisLeft;  // indexed by ScalerState from here
  out[kStateHysteresisLeft] = hysteresis_left;
  out[kStateSteps] = counter_plus(in(kStateSteps), 1);
  out[kStateSkippedSteps] = counter_plus(in(kStateSkippedSteps), found ? 1 : 0);
  out[kStateConsecutiveSkips] = found ? counter_plus(in(kStateConsecutiveSkips), 1) : 0;
  out[kStateGrowths] = counter_plus(in(kStateGrowths), next > scale ? 1 : 0);
  out[kStateBackoffs] = counter_plus(in(kStateBackoffs), next < scale ? 1 : 0);
  out[kStateFloorHits] = counter_plus(in(kStateFloorHits), floor_hit ? 1 : 0);
  out[kStateMagnitude] = static_cast<int32_t>(float_bits(magnitude));
  out[kStateCeiling] = headroom ? static_cast<int32_t>(float_bits(ceiling)) : in(kStateCeiling);
  out[kStateSinceBackoff] = headroom ? since_backoff : in(kStateSinceBackoff);
  for (int j = 0; j < kHistory; ++j) out[kStateHistory + j] = in(kStateHistory + j);
  if (headroom) out[kStateHistory + slot] = static_cast<int32_t>(float_bits(cap));
  out[kStateMargin] =
      headroom && p.learned ? static_cast<int32_t>(float_bits(margin)) : in(kStateMargin);
}

// Writes found_inf, the grad_stats header and, with_update, the pending state.  Called once per
// pass, after every element has been checked; `measured`: the pass's magnitude as float32 bits
// (0 where it measured none).
AMPFUSED_INLINE void finish_pass(bool found, uint32_t measured, const PassParams& p) {
  if (p.found_in != nullptr && *p.found_in != 0.0f) found = true;
  if (p.found_inf != nullptr) {
    if (found) {
      *p.found_inf = 1.0f;
    } else if (p.overwrite_found_inf) {
      *p.found_inf = 0.0f;
    }
  }
  if (p.grad_stats != nullptr) {
    double* header = p.grad_stats;
    for (int i = 0; i < kStatFields; ++i) header[i] = 0.0;
    header[kHeaderScale] = p.scale != nullptr ? static_cast<double>(*p.scale) : 1.0;
    if (p.counters != nullptr) header[kHeaderStep] = p.counters[kStateSteps - kStateHysteresisLeft];
    header[kHeaderFound] = found ? 1.0 : 0.0;
  }
  if (!p.with_update) return;
  if (p.counters == nullptr) {  // unscale_update_scale_: torch's state, torch's rule
    if (!p.accumulate || found) {
      update_scale_state(*p.scale, *p.growth_tracker, nullptr, found, 0.0f, p.policy, p.next_scale,
                         p.next_growth_tracker, nullptr);
    }
    return;
  }
  // The iteration's magnitude: +inf once a pass found inf/NaN, else the largest measured.  A
  // later pass of the iteration (accumulate) combines with what the earlier ones left in
  // next_state and computes the update again from the unchanged state.
  uint32_t m = found ? kFloatExpMask : measured;
  const int32_t* earlier = p.accumulate               ? p.next_counters
                           : p.policy.headroom > 0.0f ? p.magnitude_in
                                                      : nullptr;
  if (earlier != nullptr) {
    uint32_t e = static_cast<uint32_t>(earlier[kStateMagnitude - kStateHysteresisLeft]);
    if (p.magnitude_in != nullptr && e >= kFloatExpMask) e = 0;  // (scaler_update_: found_in says)
    if (e > m) m = e;
  }
  // (bits at or above +inf's: inf, NaN or a sign, an earlier pass's verdict: found)
  const bool any_found = m >= kFloatExpMask;
  update_scale_state(*p.scale, *p.growth_tracker, p.counters, any_found,
                     any_found ? __builtin_huge_valf() : bits_float(m), p.policy, p.next_scale,
                     p.next_growth_tracker, p.next_counters);
}

}  // namespace ampfused
