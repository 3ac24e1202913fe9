// Host definitions of the CUDA intrinsics that the device branches of unscale_math.h and
// clip_math.h use, so that the host execution layer compiles and runs those branches (tests
// only; included by unscale_math.h under AMPFUSED_HOST_CUDA).
//
// The rounding intrinsics are IEEE round-to-nearest operations that are never contracted into
// an FMA, as CUDA documents them.  The layer compiles plain arithmetic with FMA contraction (as
// nvcc's default --fmad=true does), so each operation here is fenced off from its neighbours:
// an empty asm that the compiler must treat as producing its operand keeps an input from being
// a product in flight and the result from feeding a later add as one.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>

namespace ampfused {
namespace hostcuda {

template <typename T>
inline T rounded(T x) {
#if defined(__x86_64__)
  asm("" : "+x"(x));
#elif defined(__aarch64__)
  asm("" : "+w"(x));
#else
  volatile T v = x;
  x = v;
#endif
  return x;
}

}  // namespace hostcuda
}  // namespace ampfused

namespace ampfused {
namespace hostcuda {
// op(a, b) rounded once, its operands and result each held apart from any neighbour.
template <typename T, typename Op>
inline T round_once(T a, T b, Op op) {
  return rounded(op(rounded(a), rounded(b)));
}
}  // namespace hostcuda
}  // namespace ampfused

inline float __fmul_rn(float a, float b) {
  return ampfused::hostcuda::round_once(a, b, std::multiplies<>());
}
inline float __fadd_rn(float a, float b) {
  return ampfused::hostcuda::round_once(a, b, std::plus<>());
}
inline float __fdiv_rn(float a, float b) {
  return ampfused::hostcuda::round_once(a, b, std::divides<>());
}
inline double __dmul_rn(double a, double b) {
  return ampfused::hostcuda::round_once(a, b, std::multiplies<>());
}
inline double __dadd_rn(double a, double b) {
  return ampfused::hostcuda::round_once(a, b, std::plus<>());
}

namespace ampfused {
namespace hostcuda {
template <typename To, typename From>
inline To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}
}  // namespace hostcuda
}  // namespace ampfused

inline unsigned int __float_as_uint(float x) {
  return ampfused::hostcuda::bits_as<unsigned int>(x);
}
inline float __uint_as_float(unsigned int u) { return ampfused::hostcuda::bits_as<float>(u); }
inline long long __double_as_longlong(double x) {
  return ampfused::hostcuda::bits_as<long long>(x);
}
inline double __longlong_as_double(long long u) { return ampfused::hostcuda::bits_as<double>(u); }
