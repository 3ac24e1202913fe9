// csrc/cuda/clip_cuda.cu compiled by the C++ compiler over the host execution layer (runtime.h):
// the same kernel and launcher source nvcc compiles, run on the CPU by the tests.
#include "cuda/clip_cuda.cu"
