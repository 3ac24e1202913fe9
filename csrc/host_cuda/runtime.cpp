// The host execution layer's scheduler (contract: runtime.h).
//
// A block is a set of fibers (one stack each) run by one OS thread.  A fiber runs
// until it reaches a barrier, a warp shuffle or its end, then returns to the block's scheduler,
// which picks the next ready fiber by the phase's policy.  When no fiber is ready: if every live
// fiber waits at the same barrier, the barrier opens (a new phase, a new policy); anything else
// is a deadlock on a GPU too, and is reported.  A warp's shuffle completes when every live lane
// of the warp has reached it.
#include "host_cuda/runtime.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace ampfused {
namespace hostcuda {
namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;  // a thread's frames plus a copy of the parameters

std::mutex config_mu;
Config current_config;
std::atomic<int64_t> launch_counter{0};
std::atomic<int64_t> n_launches{0}, n_blocks{0}, n_phases{0}, n_shuffles{0}, n_points{0},
    n_switches{0};
std::mutex kernels_mu;
std::map<std::string, int64_t> kernels;  // launches per kernel instantiation

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Fiber stacks, each with a guard page below it, kept for later blocks.
class StackPool {
 public:
  std::vector<char*> take(size_t n) {
    std::vector<char*> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!free_.empty() && out.size() < n) {
        out.push_back(free_.back());
        free_.pop_back();
      }
    }
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    while (out.size() < n) {
      void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      TORCH_CHECK(p != MAP_FAILED, "host CUDA layer: cannot map a fiber stack");
      TORCH_CHECK(mprotect(p, page, PROT_NONE) == 0, "host CUDA layer: cannot set a guard page");
      out.push_back(static_cast<char*>(p) + page);
    }
    return out;
  }
  void give(const std::vector<char*>& stacks) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.insert(free_.end(), stacks.begin(), stacks.end());
  }

 private:
  std::mutex mu_;
  std::vector<char*> free_;
};
StackPool stack_pool;

// ------------------------------------------------------------------ context switch
// A fiber's saved context.  On x86-64 a switch saves the callee-saved registers and the
// floating-point control words on the stack it leaves (a few nanoseconds; the statistics
// kernel's tree and shuffles take some 20,000 switches per work item); elsewhere ucontext's
// swapcontext (a system call per switch).
#if defined(__x86_64__)
extern "C" void ampfused_hostcuda_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type ampfused_hostcuda_switch, @function
ampfused_hostcuda_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ampfused_hostcuda_switch, .-ampfused_hostcuda_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context* from, Context* to) {
  ampfused_hostcuda_switch(&from->sp, to->sp);
}
// A context that starts entry() on the stack [base, base + size) when first switched to.
inline void make_context(Context* c, char* base, size_t size, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(base + size) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  slot[-1] = 0;                                  // entry's return address: it never returns
  slot[-2] = reinterpret_cast<uint64_t>(entry);  // where the switch's ret goes
  for (int r = 3; r <= 8; ++r) slot[-r] = 0;     // rbp, rbx, r12-r15
  uint32_t csr[2] = {0, 0};
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  std::memcpy(&slot[-9], csr, sizeof(csr));
  c->sp = &slot[-9];
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
inline void make_context(Context* c, char* base, size_t size, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = base;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, entry, 0);
}
#endif

// ------------------------------------------------------------------ blocks of fibers
enum class State { kReady, kBarrier, kShuffle, kDone };
enum class Policy { kUniform, kWarpPriority, kReverse };

struct Fiber {
  Context ctx;
  Dim3 tid;
  int warp = 0;
  int lane = 0;
  State state = State::kReady;
  const char* site = nullptr;
  int predicate = 0;   // __syncthreads_or's input, then its result
  uint64_t value = 0;  // a shuffle's value given, then the value received
  unsigned mask = 0;
  int lane_mask = 0;
  int width = kWarp;
};

class BlockRun {
 public:
  BlockRun(Dim3 block_idx, Dim3 block_dim, Dim3 grid_dim, const std::function<void()>& body,
           uint64_t seed)
      : block_idx_(block_idx),
        block_dim_(block_dim),
        grid_dim_(grid_dim),
        body_(body),
        rng_(seed),
        fibers_(block_dim.x),
        warps_((block_dim.x + kWarp - 1) / kWarp) {}

  void run();

  const Dim3 block_idx_, block_dim_, grid_dim_;
  const std::function<void()>& body_;
  Context scheduler_;
  std::exception_ptr error_;

 private:
  struct Warp {
    std::vector<int> ready;  // fibers of this warp ready to run
    int live = 0;
    int at_shuffle = 0;
    int priority = 0;
  };
  void make_ready(int i) {
    fibers_[i].state = State::kReady;
    warps_[fibers_[i].warp].ready.push_back(i);
    ++ready_;
  }
  int pick();
  void new_phase();
  void arrived(int i);
  void complete_shuffle(int w);
  void open_barrier();
  [[noreturn]] void fail(const std::string& what);

  std::mt19937_64 rng_;
  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  Policy policy_ = Policy::kUniform;
  int ready_ = 0;
  int live_ = 0;
  int at_barrier_ = 0;
};

thread_local BlockRun* this_block = nullptr;
thread_local Fiber* this_fiber = nullptr;

void fiber_main() {
  BlockRun* b = this_block;
  try {
    b->body_();
  } catch (...) {
    if (!b->error_) b->error_ = std::current_exception();
  }
  this_fiber->state = State::kDone;
  switch_context(&this_fiber->ctx, &b->scheduler_);  // never resumed
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
void yield() {
  Fiber* f = this_fiber;
  switch_context(&f->ctx, &this_block->scheduler_);
}

void BlockRun::new_phase() {
  n_phases.fetch_add(1, std::memory_order_relaxed);
  const uint64_t r = rng_() % 10;
  policy_ = r < 4 ? Policy::kUniform : (r < 8 ? Policy::kWarpPriority : Policy::kReverse);
  std::vector<int> order(warps_.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng_);
  for (size_t k = 0; k < order.size(); ++k) warps_[order[k]].priority = static_cast<int>(k);
}

int BlockRun::pick() {
  Warp* from = nullptr;
  size_t at = 0;
  if (policy_ == Policy::kUniform) {
    int k = static_cast<int>(rng_() % static_cast<uint64_t>(ready_));
    for (Warp& w : warps_) {
      if (k < static_cast<int>(w.ready.size())) {
        from = &w;
        at = static_cast<size_t>(k);
        break;
      }
      k -= static_cast<int>(w.ready.size());
    }
  } else if (policy_ == Policy::kWarpPriority) {
    for (Warp& w : warps_) {
      if (!w.ready.empty() && (from == nullptr || w.priority < from->priority)) from = &w;
    }
    at = static_cast<size_t>(rng_() % from->ready.size());
  } else {  // kReverse: the highest thread index first
    for (auto w = warps_.rbegin(); w != warps_.rend() && from == nullptr; ++w) {
      if (!w->ready.empty()) from = &*w;
    }
    at = static_cast<size_t>(std::max_element(from->ready.begin(), from->ready.end()) -
                             from->ready.begin());
  }
  const int i = from->ready[at];
  from->ready[at] = from->ready.back();
  from->ready.pop_back();
  --ready_;
  return i;
}

void BlockRun::fail(const std::string& what) {
  std::ostringstream os;
  os << "host CUDA layer, block " << block_idx_.x << " of " << grid_dim_.x << ": " << what;
  throw std::runtime_error(os.str());
}

void BlockRun::complete_shuffle(int w) {
  Warp& warp = warps_[w];
  const int first = w * kWarp;
  const int last = std::min(first + kWarp, static_cast<int>(fibers_.size()));
  unsigned present = 0;
  const Fiber* any = nullptr;
  for (int i = first; i < last; ++i) {
    if (fibers_[i].state == State::kShuffle) {
      present |= 1u << (i - first);
      any = &fibers_[i];
    }
  }
  uint64_t given[kWarp] = {};
  for (int i = first; i < last; ++i) {
    const Fiber& f = fibers_[i];
    if (f.state != State::kShuffle) continue;
    if (f.site != any->site) {
      fail(std::string("the lanes of warp ") + std::to_string(w) + " shuffle at different calls (" +
           f.site + ", " + any->site + ")");
    }
    if ((f.mask & present) != f.mask || f.mask != any->mask) {
      fail(std::string("a __shfl_xor_sync at ") + f.site + " names lanes that did not take part");
    }
    given[f.lane] = f.value;
  }
  for (int i = first; i < last; ++i) {
    Fiber& f = fibers_[i];
    if (f.state != State::kShuffle) continue;
    const int src = f.lane ^ f.lane_mask;
    // CUDA: a lane reads its own value where the source is past the end of its width group.
    if (src < (f.lane / f.width + 1) * f.width && src < kWarp && (present >> src & 1u)) {
      f.value = given[src];
    }
    make_ready(i);
  }
  warp.at_shuffle = 0;
  n_shuffles.fetch_add(1, std::memory_order_relaxed);
}

void BlockRun::open_barrier() {
  const char* site = nullptr;
  int any = 0;
  for (const Fiber& f : fibers_) {
    if (f.state != State::kBarrier) continue;
    if (site == nullptr) site = f.site;
    if (f.site != site) {
      fail(std::string("threads wait at different barriers (") + site + " and " + f.site +
           "): a barrier in divergent code");
    }
    any |= f.predicate;
  }
  at_barrier_ = 0;
  new_phase();
  for (int i = 0; i < static_cast<int>(fibers_.size()); ++i) {
    if (fibers_[i].state != State::kBarrier) continue;
    fibers_[i].predicate = any;
    make_ready(i);
  }
}

// Fiber i has returned to the scheduler: at a barrier, a shuffle, or its end.
void BlockRun::arrived(int i) {
  Fiber& f = fibers_[i];
  Warp& w = warps_[f.warp];
  switch (f.state) {
    case State::kDone:
      --live_;
      --w.live;
      if (w.at_shuffle > 0 && w.at_shuffle == w.live) complete_shuffle(f.warp);
      break;
    case State::kShuffle:
      if (++w.at_shuffle == w.live) complete_shuffle(f.warp);
      break;
    case State::kBarrier:
      ++at_barrier_;
      break;
    case State::kReady:
      fail("a thread returned to the scheduler while ready");
  }
}

void BlockRun::run() {
  const int n = static_cast<int>(fibers_.size());
  std::vector<char*> stacks = stack_pool.take(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers_[i];
    f.tid.x = static_cast<unsigned>(i);
    f.warp = i / kWarp;
    f.lane = i % kWarp;
    make_context(&f.ctx, stacks[i], kStackBytes, fiber_main);
    ++warps_[f.warp].live;
    make_ready(i);
  }
  live_ = n;
  new_phase();
  BlockRun* const outer_block = this_block;
  Fiber* const outer_fiber = this_fiber;
  this_block = this;
  try {
    while (live_ > 0) {
      if (ready_ > 0) {
        const int i = pick();
        this_fiber = &fibers_[i];
        switch_context(&scheduler_, &fibers_[i].ctx);
        this_fiber = nullptr;
        if (error_) break;  // a thread raised: its block stops there, as a faulting one does
        arrived(i);
        continue;
      }
      if (at_barrier_ == live_) {
        open_barrier();
        continue;
      }
      std::ostringstream os;
      os << "deadlock: " << live_ << " threads live, " << at_barrier_ << " at a barrier";
      for (size_t w = 0; w < warps_.size(); ++w) {
        if (warps_[w].at_shuffle > 0) {
          os << ", warp " << w << " has " << warps_[w].at_shuffle << " of " << warps_[w].live
             << " live lanes at a shuffle";
        }
      }
      os << " (a barrier or shuffle that not every thread reaches)";
      fail(os.str());
    }
  } catch (...) {
    this_block = outer_block;
    this_fiber = outer_fiber;
    throw;  // the fibers' stacks are abandoned: nothing on them needs destroying
  }
  this_block = outer_block;
  this_fiber = outer_fiber;
  if (error_) std::rethrow_exception(error_);  // the other fibers' stacks are abandoned
  stack_pool.give(stacks);
}

Fiber& current_fiber(const char* what) {
  TORCH_CHECK(this_fiber != nullptr, "host CUDA layer: ", what, " called outside a kernel");
  return *this_fiber;
}

}  // namespace

const Dim3& thread_idx() { return current_fiber("threadIdx").tid; }
const Dim3& block_idx() { return (current_fiber("blockIdx"), this_block->block_idx_); }
const Dim3& block_dim() { return (current_fiber("blockDim"), this_block->block_dim_); }
const Dim3& grid_dim() { return (current_fiber("gridDim"), this_block->grid_dim_); }

void check_aligned(const void* p, size_t alignment) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  TORCH_CHECK(address % alignment == 0, "host CUDA layer: a ", alignment,
              "-byte vector access at an address ", address % alignment,
              " bytes past alignment (a GPU faults here: misaligned address)");
}

void syncthreads(const char* site) { (void)syncthreads_or(0, site); }

int syncthreads_or(int predicate, const char* site) {
  Fiber& f = current_fiber("__syncthreads");
  f.state = State::kBarrier;
  f.site = site;
  f.predicate = predicate != 0;
  yield();
  return f.predicate;
}

uint64_t shfl_xor(unsigned mask, uint64_t value, int lane_mask, int width, const char* site) {
  Fiber& f = current_fiber("__shfl_xor_sync");
  TORCH_CHECK(width > 0 && width <= kWarp && (width & (width - 1)) == 0,
              "host CUDA layer: __shfl_xor_sync width must be a power of two <= 32, got ", width);
  f.state = State::kShuffle;
  f.site = site;
  f.mask = mask;
  f.value = value;
  f.lane_mask = lane_mask;
  f.width = width;
  yield();
  return f.value;
}

std::vector<std::pair<std::string, int64_t>> kernels_launched() {
  std::lock_guard<std::mutex> lock(kernels_mu);
  return {kernels.begin(), kernels.end()};
}

namespace {

// A launch's blocks, run `in_flight` at a time by as many OS threads ("workers").  Between
// scheduling points the workers run in parallel; each point waits for its worker's turn, does
// its memory operation and hands the turn to a worker chosen by the launch's generator, so the
// points of a launch happen one at a time in a seeded order, and the whole run is reproducible
// from the seed.
class LaunchRun {
 public:
  LaunchRun(uint64_t seed, int workers) : rng_(seed), live_(workers, 1), n_live_(workers) {
    turn_ = static_cast<int>(rng_() % static_cast<uint64_t>(workers));
  }

  // Runs op(*this) at the calling worker's next scheduling point.
  template <typename Op>
  auto at_point(Op&& op) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return turn_ == this_worker_; });
    n_points.fetch_add(1, std::memory_order_relaxed);
    // A queued write may reach memory early too (rarely: late is what breaks hand-offs).
    if (!pending_.empty() && rng_() % 8 == 0) flush_one(rng_() % pending_.size());
    if constexpr (std::is_void_v<decltype(op(*this))>) {
      op(*this);
      pass_turn();
    } else {
      auto result = op(*this);
      pass_turn();
      return result;
    }
  }

  // The calling worker has no block left: its last point.
  void leave() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return turn_ == this_worker_; });
    live_[this_worker_] = 0;
    if (--n_live_ > 0) pass_turn();
  }

  // The memory operations, called by at_point's op (the turn held).
  unsigned load(const Word* w, unsigned block) {
    use(w, false, block);
    flush_own(block, w);
    return *memory(w);
  }
  void queue(Word* w, WordOp op, unsigned value, unsigned block, bool atomic) {
    use(w, atomic, block);
    pending_.push_back({block, w, op, value});
  }
  unsigned perform(Word* w, WordOp op, unsigned value, unsigned block) {
    use(w, true, block);
    flush_own(block, w);
    const unsigned old = *memory(w);
    apply(w, op, value);
    return old;
  }
  void fence(unsigned block) { flush_own(block, nullptr); }
  // The launch's end: every queued write reaches memory (the kernel boundary).
  void finish() {
    while (!pending_.empty()) flush_one(rng_() % pending_.size());
  }

  std::string violation;  // the first non-atomic access to an atomically used address
  static thread_local LaunchRun* current;
  static thread_local int this_worker_;

 private:
  struct Pending {
    unsigned block;
    Word* word;
    WordOp op;
    unsigned value;
  };
  struct Use {
    bool atomic = false;
    bool plain = false;
  };

  static unsigned* memory(const Word* w) {
    return reinterpret_cast<unsigned*>(const_cast<Word*>(w));
  }
  static void apply(Word* w, WordOp op, unsigned value) {
    unsigned* m = memory(w);
    switch (op) {
      case WordOp::kStore:
      case WordOp::kExch:
        *m = value;
        break;
      case WordOp::kOr:
        *m |= value;
        break;
      case WordOp::kAdd:
        *m += value;
        break;
      case WordOp::kMax:
        *m = *m > value ? *m : value;
        break;
    }
  }
  void use(const Word* w, bool atomic, unsigned block) {
    Use& u = uses_[w];
    (atomic ? u.atomic : u.plain) = true;
    if (u.atomic && u.plain && violation.empty()) {
      violation = "host CUDA layer, block " + std::to_string(block) +
                  ": non-atomic access to an atomically used address (an rt::Word that this "
                  "launch accesses both with atomics and with plain loads or stores; the "
                  "layer's rule: a word is atomic-only or plain-only within a launch)";
    }
  }
  // Writes entry i, or the oldest entry of its block to the same address (program order per
  // address is kept; across addresses any order).
  void flush_one(size_t i) {
    const Pending e = pending_[i];
    for (size_t j = 0; j < i; ++j) {
      if (pending_[j].block == e.block && pending_[j].word == e.word) {
        i = j;
        break;
      }
    }
    apply(pending_[i].word, pending_[i].op, pending_[i].value);
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  // Every queued write of `block` (to `w` only, unless null), in a seeded order.
  void flush_own(unsigned block, const Word* w) {
    for (;;) {
      std::vector<size_t> mine;
      for (size_t j = 0; j < pending_.size(); ++j) {
        if (pending_[j].block == block && (w == nullptr || pending_[j].word == w))
          mine.push_back(j);
      }
      if (mine.empty()) return;
      flush_one(mine[rng_() % mine.size()]);
    }
  }
  void pass_turn() {
    int k = static_cast<int>(rng_() % static_cast<uint64_t>(n_live_));
    int next = 0;
    for (int i = 0; i < static_cast<int>(live_.size()); ++i) {
      if (live_[i] && k-- == 0) {
        next = i;
        break;
      }
    }
    if (next != turn_) n_switches.fetch_add(1, std::memory_order_relaxed);
    turn_ = next;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::mt19937_64 rng_;
  std::vector<char> live_;
  int n_live_;
  int turn_ = 0;
  std::vector<Pending> pending_;
  std::map<const Word*, Use> uses_;
};
thread_local LaunchRun* LaunchRun::current = nullptr;
thread_local int LaunchRun::this_worker_ = 0;

LaunchRun& current_launch(const char* what) {
  TORCH_CHECK(LaunchRun::current != nullptr && this_block != nullptr, "host CUDA layer: ", what,
              " called outside a kernel");
  return *LaunchRun::current;
}
unsigned current_block() { return this_block->block_idx_.x; }

// Runs the blocks order[0..count) of a <<<grid, block>>> launch, in_flight at a time.
void run_blocks(const std::function<void()>& body, unsigned grid, unsigned block,
                const std::vector<unsigned>& order, uint64_t seed, int in_flight) {
  const unsigned count = static_cast<unsigned>(order.size());
  const int workers =
      static_cast<int>(std::max(1u, std::min(count, static_cast<unsigned>(in_flight))));
  LaunchRun run(mix(seed ^ 0x5bd1e995u), workers);
  std::atomic<bool> stop{false};
  std::mutex error_mu;
  std::string error;
  // Worker w runs blocks order[w], order[w + workers], ...: which worker runs which block is
  // fixed by the seed, and starting a block needs no point.
  const auto worker = [&](int w) {
    LaunchRun::current = &run;
    LaunchRun::this_worker_ = w;
    for (unsigned k = static_cast<unsigned>(w); k < count && !stop.load();
         k += static_cast<unsigned>(workers)) {
      try {
        BlockRun b(Dim3{order[k], 1, 1}, Dim3{block, 1, 1}, Dim3{grid, 1, 1}, body,
                   mix(seed + order[k] + 1));
        b.run();
      } catch (const std::exception& e) {
        const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
        std::lock_guard<std::mutex> lock(error_mu);
        if (error.empty()) error = c10_error ? c10_error->what_without_backtrace() : e.what();
        stop.store(true);  // stop starting blocks
      }
    }
    run.leave();
    LaunchRun::current = nullptr;
  };
  std::vector<std::thread> others;
  for (int t = 1; t < workers; ++t) others.emplace_back(worker, t);
  worker(0);
  for (std::thread& t : others) t.join();
  run.finish();
  TORCH_CHECK(error.empty(), error);
  TORCH_CHECK(run.violation.empty(), run.violation);
}

// A launch held by hold_next_launch: the blocks still to run.
struct Held {
  std::function<void()> body;
  unsigned grid = 0, block = 0;
  std::vector<unsigned> order;
  uint64_t seed = 0;
  int in_flight = 1;
};
std::mutex held_mu;
int64_t hold_blocks = -1;  // the next launch's blocks to run before it is held; -1: none
std::optional<Held> held;
std::vector<at::Tensor> graph_tensors;

// The layer's one stream (runtime.h): each launch takes a ticket and runs when it is served, so
// the launches of several host threads run one at a time, first queued first run.  (Without it
// two threads' launches would run together, as no CUDA stream runs them.)
std::mutex stream_mu;
std::condition_variable stream_cv;
uint64_t stream_queued = 0, stream_serving = 0;
std::thread::id stream_last;  // the host thread of the stream's last launch
std::atomic<int64_t> n_handovers{0};

class StreamTurn {
 public:
  StreamTurn() {
    std::unique_lock<std::mutex> lock(stream_mu);
    const uint64_t ticket = stream_queued++;
    stream_cv.wait(lock, [&] { return stream_serving == ticket; });
    const std::thread::id me = std::this_thread::get_id();
    if (stream_last != std::thread::id() && stream_last != me) {
      n_handovers.fetch_add(1, std::memory_order_relaxed);
    }
    stream_last = me;
  }
  ~StreamTurn() {
    {
      std::lock_guard<std::mutex> lock(stream_mu);
      ++stream_serving;
    }
    stream_cv.notify_all();
  }
  StreamTurn(const StreamTurn&) = delete;
  StreamTurn& operator=(const StreamTurn&) = delete;
};

}  // namespace

unsigned word_load(const Word* w) {
  LaunchRun& run = current_launch("a load of an rt::Word");
  const unsigned b = current_block();
  return run.at_point([&](LaunchRun& r) { return r.load(w, b); });
}
void word_store(Word* w, unsigned value) {
  LaunchRun& run = current_launch("a store to an rt::Word");
  const unsigned b = current_block();
  run.at_point([&](LaunchRun& r) { r.queue(w, WordOp::kStore, value, b, false); });
}
unsigned word_atomic(Word* w, WordOp op, unsigned value) {
  LaunchRun& run = current_launch("an atomic");
  const unsigned b = current_block();
  return run.at_point([&](LaunchRun& r) { return r.perform(w, op, value, b); });
}
void word_post(Word* w, WordOp op, unsigned value) noexcept {
  // From an atomic's destructor: no exception may leave.
  if (LaunchRun::current == nullptr || this_block == nullptr) {
    std::fprintf(stderr, "host CUDA layer: an atomic outside a kernel\n");
    std::abort();
  }
  LaunchRun& run = *LaunchRun::current;
  const unsigned b = current_block();
  run.at_point([&](LaunchRun& r) { r.queue(w, op, value, b, true); });
}
void threadfence() {
  LaunchRun& run = current_launch("__threadfence");
  const unsigned b = current_block();
  run.at_point([&](LaunchRun& r) { r.fence(b); });
}

void out_of_bounds(const void* at, size_t bytes, const void* lo, const void* hi) {
  const auto a = reinterpret_cast<intptr_t>(at), l = reinterpret_cast<intptr_t>(lo);
  TORCH_CHECK(false, "host CUDA layer: out-of-bounds access: ", bytes, " bytes at byte ", a - l,
              " of a work item of ", reinterpret_cast<intptr_t>(hi) - l,
              " bytes (a GPU reads or writes another tensor's memory here; memcheck reports it)");
}

void launch(const char* kernel, unsigned grid, unsigned block, const std::function<void()>& body) {
  TORCH_CHECK(grid >= 1 && block >= 1 && block <= 1024, "host CUDA layer: invalid launch <<<", grid,
              ", ", block, ">>>");
  const StreamTurn turn;  // (a held launch's rest runs at release_held, off the stream)
  {
    // "[with auto kKernel = <instantiation>; Args = ...]" -> "<instantiation>"
    std::string name(kernel);
    const size_t at = name.find("kKernel = ");
    if (at != std::string::npos) {
      name = name.substr(at + 10);
      name = name.substr(0, std::min(name.find(';'), name.find(']')));
    }
    std::lock_guard<std::mutex> lock(kernels_mu);
    ++kernels[name];
  }
  const Config c = config();
  const uint64_t seed = mix(static_cast<uint64_t>(c.seed) ^ mix(launch_counter.fetch_add(1)));
  std::vector<unsigned> order(grid);
  std::iota(order.begin(), order.end(), 0u);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  n_launches.fetch_add(1, std::memory_order_relaxed);
  n_blocks.fetch_add(grid, std::memory_order_relaxed);
  const int in_flight = std::max(1, c.blocks_in_flight);
  int64_t hold = -1;
  {
    std::lock_guard<std::mutex> lock(held_mu);
    std::swap(hold, hold_blocks);
  }
  if (hold >= 0) {
    // The blocks run before the hold finished long ago: their writes have all reached memory.
    // Meant for a pass of one launch over dense gradients (nothing else of the pass waits).
    {
      std::lock_guard<std::mutex> lock(held_mu);
      TORCH_CHECK(!held, "host CUDA layer: a launch is held already (release_held first)");
    }
    TORCH_CHECK(hold < static_cast<int64_t>(grid), "host CUDA layer: hold_next_launch(", hold,
                ") holds nothing of a launch of ", grid, " blocks");
    const std::vector<unsigned> first(order.begin(), order.begin() + hold);
    if (!first.empty()) run_blocks(body, grid, block, first, seed, in_flight);
    std::lock_guard<std::mutex> lock(held_mu);
    held = Held{body,
                grid,
                block,
                std::vector<unsigned>(order.begin() + hold, order.end()),
                mix(seed + 0x9e37u),
                in_flight};
    return;
  }
  run_blocks(body, grid, block, order, seed, in_flight);
}

void hold_next_launch(int64_t blocks) {
  TORCH_CHECK(blocks >= 0, "host CUDA layer: hold_next_launch takes a block count >= 0");
  std::lock_guard<std::mutex> lock(held_mu);
  hold_blocks = blocks;
}

void release_held() {
  std::optional<Held> h;
  std::vector<at::Tensor> kept;
  {
    std::lock_guard<std::mutex> lock(held_mu);
    TORCH_CHECK(held, "host CUDA layer: no launch is held");
    h.swap(held);
    kept.swap(graph_tensors);
  }
  run_blocks(h->body, h->grid, h->block, h->order, h->seed, h->in_flight);
}

void configure(const Config& config) {
  TORCH_CHECK(config.blocks_in_flight >= 1 && config.resident_blocks >= 1,
              "host CUDA layer: blocks_in_flight and resident_blocks must be >= 1");
  std::lock_guard<std::mutex> lock(config_mu);
  current_config = config;
  launch_counter = 0;
  n_launches = n_blocks = n_phases = n_shuffles = n_points = n_switches = n_handovers = 0;
}

Config config() {
  std::lock_guard<std::mutex> lock(config_mu);
  return current_config;
}

int64_t stream_handovers() { return n_handovers.load(); }

Counters counters() {
  return Counters{n_launches.load(), n_blocks.load(), n_phases.load(),
                  n_shuffles.load(), n_points.load(), n_switches.load()};
}

}  // namespace hostcuda

namespace cuda {
namespace rt {
void graph_owns(const at::Tensor& t) {
  // Kept for a launch that is (or is about to be) held; the others run before their caller
  // drops t.
  std::lock_guard<std::mutex> lock(hostcuda::held_mu);
  if (hostcuda::hold_blocks >= 0 || hostcuda::held) hostcuda::graph_tensors.push_back(t);
}
}  // namespace rt
}  // namespace cuda
}  // namespace ampfused
