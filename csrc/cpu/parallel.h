// How the CPU passes use more than one thread (the plain, statistics and unscale_into passes).
//
// A pass is a list of pieces (runs of up to a few hundred KB of one gradient).  Where it is
// split, each thread of an at::parallel_for region starts on its own share of the pieces, as a
// static split would (the same thread meets the same memory pass after pass), and a thread that
// runs out takes pieces from the others' shares, a claim of ~kClaimBytes at a time.
//
// A fork-join region still waits for every thread to arrive.  On a busy machine (a dataloader
// worker per core) the OS can run a pool thread a time slice late (8-12 ms here; the wait shows
// at the fork or at the join), and a region that would have saved 50 us costs that: 1000 x 4 KB
// float32 gradients took 7.9 ms against 0.12 ms on the calling thread alone (2 cores, 2 busy
// processes).  So each split measures what it cost (how long the caller waited, at the fork and
// after its last piece, and the caller's own time per byte), and a pass is split only where its
// expected saving beats the expected wait:
//     saving = bytes x ns_per_byte x (threads - 1) / threads  >  late
// `late` is a running mean of the waits (kWaitWeight), halved every kLateHalfLifeNs: a busy
// spell keeps small passes on the calling thread while large ones still split, one hiccup of an
// idle machine moves little, and an idle machine is noticed again within seconds.  The first
// split, and the first after passes kept on the calling thread, are not measured (the pool
// may not exist yet or may have gone to sleep; its start is that split's cost only).  The
// measurements are per process, shared by every pass; a race between two passes updating them loses
// a measurement, nothing else.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace ampfused::cpu {

// Below this many bytes a pass never splits: one thread is done before the pool would start.
constexpr int64_t kParallelMinBytes = 256 * 1024;
// A thread takes pieces from a share ~this many bytes at a time.
constexpr int64_t kClaimBytes = 256 * 1024;
// Each split's wait weighs kWaitWeight in `late`, so a late thread in one split of twenty
// counts (it is the expected wait) and one 5 ms hiccup adds 0.16 ms; with no splits to
// measure, `late` halves every kLateHalfLifeNs.
constexpr double kWaitWeight = 1.0 / 32;
constexpr double kLateHalfLifeNs = 1e9;

enum class SplitMode : int { kAuto = 0, kAlways = 1, kNever = 2 };

int64_t now_ns();

// The measurements the decision rests on (the header's comment), and counters for tests and the
// benchmark notes.
class SplitGate {
 public:
  // Whether a pass of `bytes` over `threads` threads is split at time `now`.
  bool pays(int64_t bytes, int threads, int64_t now) const;
  // `late` at time `now`: the mean wait of recent splits, decayed.
  double late_ns(int64_t now) const;
  double ns_per_byte() const { return ns_per_byte_.load(std::memory_order_relaxed); }
  // A pass of `bytes` run on the calling thread in `ns` (passes of >= kParallelMinBytes only).
  void ran_inline(int64_t bytes, int64_t ns);
  // A split pass: the caller ran `caller_bytes` in `caller_ns`, then waited `wait_ns`.
  void ran_split(int64_t caller_bytes, int64_t caller_ns, int64_t wait_ns, int64_t now);

  void reset();
  std::atomic<int> mode{static_cast<int>(SplitMode::kAuto)};
  // Tests only: threads other than the caller sleep this long before their first claim (a pool
  // thread the OS starts late).
  std::atomic<int64_t> worker_delay_ns{0};
  std::atomic<int64_t> split_passes{0}, inline_passes{0};
  std::atomic<double> half_life_ns{kLateHalfLifeNs};

 private:
  void take_rate(double measured);
  std::atomic<double> ns_per_byte_{0.05};  // ~20 GB/s until a pass has been measured
  std::atomic<double> late_ns_{0.0};
  std::atomic<int64_t> late_at_{0};
  std::atomic<bool> last_inline_{true};  // (before the first split the pool may not exist)
};

SplitGate& split_gate();

// Tests only: the worker delay, applied by a thread other than the caller.
void delay_worker();

// Whether a pass of `bytes` may be split at all: not below kParallelMinBytes, nor with one
// thread, nor inside a parallel region, nor in mode "never".  Where not, the pass runs on the
// calling thread without asking the gate (callers may skip cutting it into pieces).
inline bool may_split(int64_t bytes) {
  return bytes >= kParallelMinBytes && at::get_num_threads() > 1 && !at::in_parallel_region() &&
         split_gate().mode.load(std::memory_order_relaxed) != static_cast<int>(SplitMode::kNever);
}

// run(first, last) over every piece index in [0, n), each exactly once, returning whether any
// call returned true.  `bytes`: the pass's gradient bytes (the pieces together).  Anything else
// a pass accumulates (a magnitude) it combines itself, run() being called from several threads.
template <typename Run>
bool run_pieces(int64_t n, int64_t bytes, const Run& run) {
  SplitGate& gate = split_gate();
  const int threads = at::get_num_threads();
  const auto mode = static_cast<SplitMode>(gate.mode.load(std::memory_order_relaxed));
  const bool splittable = n > 1 && may_split(bytes);
  const int64_t t0 = splittable ? now_ns() : 0;
  if (!splittable || (mode == SplitMode::kAuto && !gate.pays(bytes, threads, t0))) {
    const bool found = run(0, n);
    if (splittable) {
      gate.ran_inline(bytes, now_ns() - t0);
      gate.inline_passes.fetch_add(1, std::memory_order_relaxed);
    }
    return found;
  }
  gate.split_passes.fetch_add(1, std::memory_order_relaxed);
  const int64_t claim = std::max<int64_t>(1, n * kClaimBytes / bytes);
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::vector<Share> shares(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    shares[t].next.store(n * t / threads, std::memory_order_relaxed);
    shares[t].end = n * (t + 1) / threads;
  }
  std::atomic<bool> any{false};
  int64_t caller_pieces = 0, caller_start = t0, caller_done = t0;
  at::parallel_for(0, threads, 1, [&](int64_t me, int64_t) {
    if (me == 0) caller_start = now_ns();  // (the fork can wait for a thread the OS runs late)
    if (me != 0) delay_worker();
    bool found = false;
    int64_t mine = 0;
    for (int64_t i = 0; i < threads; ++i) {
      Share& s = shares[(me + i) % threads];
      for (int64_t k; (k = s.next.fetch_add(claim, std::memory_order_relaxed)) < s.end;) {
        const int64_t last = std::min(s.end, k + claim);
        found |= run(k, last);
        mine += last - k;
      }
    }
    if (found) any.store(true, std::memory_order_relaxed);
    if (me == 0) {  // thread 0 of the region is the caller
      caller_pieces = mine;
      caller_done = now_ns();
    }
  });
  const int64_t t1 = now_ns();
  gate.ran_split(bytes * caller_pieces / n, caller_done - caller_start,
                 (caller_start - t0) + (t1 - caller_done), t1);
  return any.load(std::memory_order_relaxed);
}

}  // namespace ampfused::cpu
