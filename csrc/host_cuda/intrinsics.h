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

inline float __fmul_rn(float a, float b) {
  using ampfused::hostcuda::rounded;
  return rounded(rounded(a) * rounded(b));
}
inline float __fadd_rn(float a, float b) {
  using ampfused::hostcuda::rounded;
  return rounded(rounded(a) + rounded(b));
}
inline float __fdiv_rn(float a, float b) {
  using ampfused::hostcuda::rounded;
  return rounded(rounded(a) / rounded(b));
}
inline double __dmul_rn(double a, double b) {
  using ampfused::hostcuda::rounded;
  return rounded(rounded(a) * rounded(b));
}
inline double __dadd_rn(double a, double b) {
  using ampfused::hostcuda::rounded;
  return rounded(rounded(a) + rounded(b));
}

inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
inline long long __double_as_longlong(double x) {
  long long u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline double __longlong_as_double(long long u) {
  double x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
