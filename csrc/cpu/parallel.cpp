// The split decision's measurements (parallel.h), and private ops that reach them from tests and
// the benchmarks.
#include "cpu/parallel.h"

#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <tuple>

namespace ampfused::cpu {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double SplitGate::late_ns(int64_t now) const {
  const double late = late_ns_.load(std::memory_order_relaxed);
  const auto age = static_cast<double>(now - late_at_.load(std::memory_order_relaxed));
  if (late <= 0.0 || age <= 0.0) return late;
  return late * std::exp2(-age / half_life_ns.load(std::memory_order_relaxed));
}

bool SplitGate::pays(int64_t bytes, int threads, int64_t now) const {
  const double saving = static_cast<double>(bytes) * ns_per_byte_.load(std::memory_order_relaxed) *
                        (threads - 1) / threads;
  return saving > late_ns(now);
}

void SplitGate::take_rate(double measured) {
  if (!(measured > 0.0) || !std::isfinite(measured)) return;
  const double old = ns_per_byte_.load(std::memory_order_relaxed);
  // A pass the OS preempted for a time slice reads 100x slow: one such sample moves the rate
  // by at most 3/8 (a lasting change still takes over within a few passes).
  measured = std::min(measured, 4 * old);
  ns_per_byte_.store(old + (measured - old) / 8, std::memory_order_relaxed);
}

void SplitGate::ran_inline(int64_t bytes, int64_t ns) {
  last_inline_.store(true, std::memory_order_relaxed);
  take_rate(static_cast<double>(ns) / static_cast<double>(bytes));
}

void SplitGate::ran_split(int64_t caller_bytes, int64_t caller_ns, int64_t wait_ns, int64_t now) {
  if (caller_bytes > 0) {
    take_rate(static_cast<double>(caller_ns) / static_cast<double>(caller_bytes));
  }
  // After passes kept on the calling thread the pool's threads may have gone to sleep, and their
  // wake is a cost of this split only: it is not taken as what the next split will wait.
  if (last_inline_.exchange(false, std::memory_order_relaxed)) return;
  const double late = late_ns(now);
  const auto wait = static_cast<double>(std::max<int64_t>(wait_ns, 0));
  late_ns_.store(late + (wait - late) * kWaitWeight, std::memory_order_relaxed);
  late_at_.store(now, std::memory_order_relaxed);
}

void SplitGate::reset() {
  ns_per_byte_.store(0.05, std::memory_order_relaxed);
  late_ns_.store(0.0, std::memory_order_relaxed);
  late_at_.store(0, std::memory_order_relaxed);
  last_inline_.store(true, std::memory_order_relaxed);
  split_passes.store(0, std::memory_order_relaxed);
  inline_passes.store(0, std::memory_order_relaxed);
}

SplitGate& split_gate() {
  static SplitGate gate;
  return gate;
}

void delay_worker() {
  const int64_t ns = split_gate().worker_delay_ns.load(std::memory_order_relaxed);
  if (ns > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
}

namespace {

// Sets the mode ("auto", "always", "never") and the test delay of threads other than the
// caller, and with `reset` clears the measurements and counters; returns the previous mode.
std::string cpu_split_config(const std::string& mode, int64_t worker_delay_ns, bool reset) {
  static const char* const kNames[] = {"auto", "always", "never"};
  int m = -1;
  for (int i = 0; i < 3; ++i) {
    if (mode == kNames[i]) m = i;
  }
  TORCH_CHECK_VALUE(m >= 0, "mode must be 'auto', 'always' or 'never', got '", mode, "'");
  TORCH_CHECK_VALUE(worker_delay_ns >= 0, "worker_delay_ns must be >= 0, got ", worker_delay_ns);
  SplitGate& gate = split_gate();
  const int before = gate.mode.exchange(m);
  gate.worker_delay_ns.store(worker_delay_ns);
  if (reset) gate.reset();
  return kNames[before];
}

// (split passes, passes kept on the calling thread, late in ns now, ns per byte).
std::tuple<int64_t, int64_t, double, double> cpu_split_stats() {
  const SplitGate& gate = split_gate();
  const int64_t now = now_ns();
  return {gate.split_passes.load(), gate.inline_passes.load(), gate.late_ns(now),
          gate.ns_per_byte()};
}

}  // namespace
}  // namespace ampfused::cpu

// Private ops for tests and benchmarks (not part of the API).
TORCH_LIBRARY_FRAGMENT(ampfused, m) {
  m.def("_cpu_split_config(str mode, int worker_delay_ns=0, bool reset=True) -> str",
        &ampfused::cpu::cpu_split_config);
  m.def("_cpu_split_tune(float half_life_ns) -> ()",
        [](double h) { ampfused::cpu::split_gate().half_life_ns = h; });
  m.def("_cpu_split_stats() -> (int, int, float, float)", &ampfused::cpu::cpu_split_stats);
}
