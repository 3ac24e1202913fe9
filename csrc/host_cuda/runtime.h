// The host execution layer: ampfused's CUDA kernels compiled by the C++ compiler and run on the
// CPU with CUDA's execution semantics.  Test-only (tests/host_cuda.py builds it); the product
// never compiles it.  Included by csrc/cuda/runtime.cuh when AMPFUSED_HOST_CUDA is defined.
//
// What a kernel sees, as on a GPU:
// - gridDim, blockDim, blockIdx, threadIdx (one-dimensional launches, as ours are);
// - every thread of a block is a fiber with its own stack; `__shared__` variables are per block
//   (each block runs on one OS thread at a time: thread_local statics are its shared memory);
// - __syncthreads and __syncthreads_or are real barriers of every live thread of the block, and
//   a block whose threads wait at different barriers, or at a barrier and a warp shuffle, is
//   reported (CUDA leaves it undefined);
// - between two barriers the threads run in a seeded random order: per phase either uniformly
//   shuffled threads, or whole warps at random priorities (a warp runs ahead of the others to its
//   next barrier), or the threads in reverse order, so a thread or a warp that runs ahead of a
//   forgotten barrier reads stale shared memory;
// - __shfl_xor_sync exchanges values between the 32 lanes of a warp (the lanes of `mask` must
//   all take part, at the same call), with CUDA's `width` rule;
// - the blocks of a launch are dealt, in a seeded random order, to `blocks_in_flight` OS
//   threads; they run in parallel between scheduling points (every access to an rt::Word, every
//   atomic and __threadfence, a thread's last block's end), and at each point one block in
//   flight, chosen by the seed, goes on: the points of a launch run one at a time in a seeded
//   interleaving, so a race between blocks is tried, and reproduced by its seed;
// - global words (rt::Word, below) follow a relaxed memory model on the writer's side: a plain
//   store or a posted atomic reaches other blocks only when flushed (in a seeded order, at the
//   latest at the writer's next __threadfence or the launch's end); a word is either atomic or
//   plain within a launch (the layer's rule, stricter than CUDA's), a mix is reported;
// - element accesses of a work item through rt::bounded and rt::vectors are checked against the
//   item, rt::slice's ends against its span: out of bounds is reported, as a misaligned vector
//   access is;
// - unscale_math.h's device-only branches are compiled, over host definitions of CUDA's
//   rounding intrinsics (intrinsics.h), and plain float arithmetic is contracted into FMAs where
//   the C++ compiler contracts (-ffp-contract=fast, -mfma on x86 CPUs with FMA), approximating
//   nvcc's default --fmad=true (nvcc may also fuse products GCC leaves apart);
// - a launch returns when every block has finished (a stream's launches run one after another),
//   unless it was held (hold_next_launch: the rest of its blocks run at release_held, as a
//   replayed graph's may while other work runs);
// - host threads that launch together share the layer's one stream as they share a CUDA stream:
//   their launches run one at a time, in the order they were queued (first come, first run), so
//   a launch queued while another thread's runs goes before that thread's next one, and two
//   passes' launches interleave (stream_handovers counts it).
// The kernel parameters are passed by value to every thread, as CUDA passes them.
//
// What it cannot show: nvcc's code generation beyond FMA contraction; the GPU's memory model
// beyond rt::Word's writer side (an atomic whose result is used is performed at once, in
// program order, so a missing fence between two such atomics goes unseen; loads are never
// stale beyond the writers' queues, so a reader's missing __threadfence goes unseen; a block's
// threads share one queue; plain memory shared between blocks is not modeled: the kernels
// share none but found_inf, where every block that writes stores 1.0); real warp-synchronous
// execution inside a phase; and timing.  Those stay for a GPU (.ci/gpu).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// --------------------------------------------------------------------------- CUDA's keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Per OS thread, and a block runs on one OS thread at a time: per-block shared memory.
#define __shared__ static thread_local
#define __isGlobal(p) true
#if !defined(__clang__)
#define __builtin_assume(x) ((void)0)
#endif

namespace ampfused {
namespace hostcuda {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// The running thread's coordinates (valid inside a kernel only).
const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
const Dim3& grid_dim();

// `site` names the call ("file:line"): the threads of a block must meet at the same one.
void syncthreads(const char* site);
int syncthreads_or(int predicate, const char* site);
// The 8 bytes of `value` exchanged as __shfl_xor_sync(mask, value, lane_mask, width) does.
uint64_t shfl_xor(unsigned mask, uint64_t value, int lane_mask, int width, const char* site);

// Raises (as a GPU faults) unless p is a multiple of `alignment`.
void check_aligned(const void* p, size_t alignment);

// Runs body() as every thread of every block of a <<<grid, block>>> launch of `kernel` (a name
// that identifies the kernel's instantiation, for kernels_launched()).
void launch(const char* kernel, unsigned grid, unsigned block, const std::function<void()>& body);
// Every kernel instantiation launched in this process, with its launch count: for tests that
// every kernel of csrc/cuda/ was executed.
std::vector<std::pair<std::string, int64_t>> kernels_launched();

// The layer's settings (tests/host_cuda.py sets them through ampfused_host::configure):
// seed: the schedules of every later launch derive from it and a launch counter;
// blocks_in_flight: OS threads running blocks of one launch together (1: one block at a time);
// resident_blocks: what the occupancy query answers (the persistent grid's size);
// capturing: what the graph-capture query answers.
struct Config {
  int64_t seed = 0;
  int blocks_in_flight = 2;
  int64_t resident_blocks = 3;
  bool capturing = false;
};
void configure(const Config& config);
Config config();
// Launches, blocks and barrier phases run since the last configure(), for tests to check that a
// kernel really ran as they meant it to (how many launches a pass took, ...).
// points: scheduling points between blocks; switches: points after which another block went on.
struct Counters {
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t phases = 0;
  int64_t shuffles = 0;
  int64_t points = 0;
  int64_t switches = 0;
};
Counters counters();

// Launches since the last configure() that followed, on the stream, a launch queued by another
// host thread: for tests that passes of two threads really interleaved.
int64_t stream_handovers();

// The next launch runs `blocks` of its blocks (in its seeded order) and returns; release_held()
// runs the rest.  Tensors given to rt::graph_owns meanwhile are kept until then.
void hold_next_launch(int64_t blocks);
void release_held();

template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask, int width, const char* site) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move <= 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = shfl_xor(mask, bits, lane_mask, width, site);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask, const char* site) {
  return shfl_xor_sync(mask, value, lane_mask, 32, site);
}

}  // namespace hostcuda
}  // namespace ampfused

#define AMPFUSED_HOSTCUDA_STR2(x) #x
#define AMPFUSED_HOSTCUDA_STR(x) AMPFUSED_HOSTCUDA_STR2(x)
#define AMPFUSED_HOSTCUDA_SITE __FILE__ ":" AMPFUSED_HOSTCUDA_STR(__LINE__)

#define threadIdx (::ampfused::hostcuda::thread_idx())
#define blockIdx (::ampfused::hostcuda::block_idx())
#define blockDim (::ampfused::hostcuda::block_dim())
#define gridDim (::ampfused::hostcuda::grid_dim())
#define __syncthreads() ::ampfused::hostcuda::syncthreads(AMPFUSED_HOSTCUDA_SITE)
#define __syncthreads_or(p) ::ampfused::hostcuda::syncthreads_or((p), AMPFUSED_HOSTCUDA_SITE)
#define __shfl_xor_sync(mask, value, ...) \
  ::ampfused::hostcuda::shfl_xor_sync((mask), (value), __VA_ARGS__, AMPFUSED_HOSTCUDA_SITE)

// ---------------------------------------------------------------- global words and atomics
// rt::Word: a word of global memory through which the blocks of a launch communicate (the
// last-block hand-off's flag and counter).  Every access to one is a scheduling point of the
// launch (runtime.cpp: another block in flight may run there) and goes through the layer's
// memory model:
// - a plain store, and an atomic whose result is not used (the GPU posts it: RED), enter the
//   writing block's queue and reach memory later, in a seeded random order (program order per
//   address), at the latest at the block's next __threadfence or at the end of the launch; until
//   then other blocks read the older value;
// - a plain load, and an atomic whose result is used, see the block's own queued writes to that
//   address first (per-address coherence), then memory;
// - an address that a launch accesses both atomically and plainly is reported ("non-atomic
//   access to an atomically used address"): the layer's rule, stricter than CUDA's (a plain
//   access ordered by fences can be correct), so the hand-off needs no proof of ordering.
// Atomics on any other memory do not compile here, so every atomic of csrc/cuda/ is on a Word.
namespace ampfused {
namespace hostcuda {

class Word;
enum class WordOp : uint8_t { kStore, kOr, kAdd, kExch, kMax };
unsigned word_load(const Word* w);
void word_store(Word* w, unsigned value);
unsigned word_atomic(Word* w, WordOp op, unsigned value);     // performed now, old value returned
void word_post(Word* w, WordOp op, unsigned value) noexcept;  // queued (result unused)
void threadfence();

class Word {
 public:
  Word() = delete;  // only ever a view of device memory (a workspace tensor's int32 elements)
  Word(const Word&) = delete;
  operator unsigned() const { return word_load(this); }
  Word& operator=(unsigned value) {
    word_store(this, value);
    return *this;
  }
  Word& operator=(const Word& other) { return *this = static_cast<unsigned>(other); }

 private:
  unsigned bits_;
};
static_assert(sizeof(Word) == sizeof(unsigned), "a Word is one 32-bit word of memory");

// What an atomic returns: performed when its value is first read (once), queued (posted) when
// it is never read.  Not posted while an exception unwinds through its expression.
class AtomicResult {
 public:
  AtomicResult(Word* w, WordOp op, unsigned value)
      : w_(w), op_(op), value_(value), unwinding_(std::uncaught_exceptions()) {}
  AtomicResult(const AtomicResult&) = delete;
  AtomicResult& operator=(const AtomicResult&) = delete;
  ~AtomicResult() {
    if (!used_ && std::uncaught_exceptions() == unwinding_) word_post(w_, op_, value_);
  }
  operator unsigned() {
    if (!used_) old_ = word_atomic(w_, op_, value_);
    used_ = true;
    return old_;
  }

 private:
  Word* w_;
  WordOp op_;
  unsigned value_;
  int unwinding_;
  bool used_ = false;
  unsigned old_ = 0;
};

// A pointer to the `n` elements of a work item whose every access is checked against them:
// "out-of-bounds access" is reported, as a misaligned vector access is.
void out_of_bounds(const void* at, size_t bytes, const void* lo, const void* hi);
template <typename T>
class Bounded {
 public:
  Bounded(T* p, const void* lo, const void* hi) : p_(p), lo_(lo), hi_(hi) {}
  T& operator[](int64_t i) const {
    T* at = p_ + i;
    const auto a = reinterpret_cast<uintptr_t>(at);
    if (a < reinterpret_cast<uintptr_t>(lo_) || a + sizeof(T) > reinterpret_cast<uintptr_t>(hi_)) {
      out_of_bounds(at, sizeof(T), lo_, hi_);
    }
    return *at;
  }
  Bounded operator+(int64_t k) const { return Bounded(p_ + k, lo_, hi_); }
  T* get() const { return p_; }
  const void* lo() const { return lo_; }
  const void* hi() const { return hi_; }

 private:
  T* p_;
  const void* lo_;
  const void* hi_;
};

}  // namespace hostcuda
}  // namespace ampfused

inline ::ampfused::hostcuda::AtomicResult atomicOr(::ampfused::hostcuda::Word* p, unsigned v) {
  return {p, ::ampfused::hostcuda::WordOp::kOr, v};
}
inline ::ampfused::hostcuda::AtomicResult atomicAdd(::ampfused::hostcuda::Word* p, unsigned v) {
  return {p, ::ampfused::hostcuda::WordOp::kAdd, v};
}
inline ::ampfused::hostcuda::AtomicResult atomicExch(::ampfused::hostcuda::Word* p, unsigned v) {
  return {p, ::ampfused::hostcuda::WordOp::kExch, v};
}
inline ::ampfused::hostcuda::AtomicResult atomicMax(::ampfused::hostcuda::Word* p, unsigned v) {
  return {p, ::ampfused::hostcuda::WordOp::kMax, v};
}
inline void __threadfence() { ::ampfused::hostcuda::threadfence(); }

// --------------------------------------------------------------------------- the seam
namespace ampfused {
namespace cuda {
namespace rt {

using Stream = const void*;  // one host "stream": launches run one after another

struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};

// Host tensors live on the CPU (device index -1): the layer's one device is 0.
inline int device_of(const at::Tensor&) { return 0; }

inline Stream current_stream(int) {
  static const char kStream = 0;
  return &kStream;
}

inline bool capturing() { return hostcuda::config().capturing; }

// Under capture the graph owns `t` (the caching allocator's capture pool does so on a GPU): the
// layer keeps it while a captured launch is held (hostcuda::hold_next_launch).
void graph_owns(const at::Tensor& t);

using Word = hostcuda::Word;

// The `n` elements at p, every access checked (out of bounds: reported).
template <typename T>
hostcuda::Bounded<T> bounded(T* p, int64_t n) {
  return hostcuda::Bounded<T>(p, p, p + n);
}

// The `count` elements at p + offset, checked, as a plain pointer.
template <typename T>
T* slice(const hostcuda::Bounded<T>& p, int64_t offset, int64_t count) {
  if (count > 0) {
    (void)p[offset];
    (void)p[offset + count - 1];
  }
  return p.get() + offset;
}

// As a GPU faults on a misaligned vector access ("misaligned address"), the layer raises; the
// vectors keep the item's bounds.
template <typename V, typename T>
hostcuda::Bounded<V> vectors(const hostcuda::Bounded<T>& p, int count) {
  if (count > 0) hostcuda::check_aligned(p.get(), alignof(V));
  return hostcuda::Bounded<V>(reinterpret_cast<V*>(p.get()), p.lo(), p.hi());
}

template <auto kKernel>
int64_t resident_blocks(int, int) {
  return hostcuda::config().resident_blocks;
}

// __PRETTY_FUNCTION__ names kKernel's instantiation ("[with auto kKernel = ...").
// The parameters are copied into the launch (a held launch outlives the caller's frame).
template <auto kKernel, typename... Args>
void launch(unsigned grid, unsigned block, Stream, const Args&... args) {
  hostcuda::launch(__PRETTY_FUNCTION__, grid, block, [args...] { kKernel(args...); });
}

}  // namespace rt
}  // namespace cuda
}  // namespace ampfused
