// graphmode's work-claiming thread pool (backends/cpu/claim_pool.py): one per process, built into
// its own library; kernel libraries built with codegen.schedule claim reach it through the
// entry point their gm_set_pool receives (templates/library.h), and call it from
// gm_parallel_for (templates/prelude.h).
//
// A job is `trips` iterations cut into chunks. The caller publishes it and claims chunks
// itself; workers that are awake claim the others. The caller returns when every chunk is
// claimed and every claimed chunk has finished: it never waits for a worker that claimed
// nothing (one the kernel scheduler took away, or one still asleep), unlike an OpenMP region,
// whose closing barrier waits for every thread of the team.
//
// Each taking part has a home range of the job's chunks (the caller the first n/T, worker i the
// (i+2)-th), which it claims from the front; when it is empty it steals from the back of the
// others'. When every thread runs, each one takes exactly its static share, so consecutive loops
// over the same tensor give the same rows to the same thread and its data stays in that core's
// caches, as under schedule(static); a thread the scheduler took away loses its chunks to the
// ones that run, as under a dynamic schedule. (One shared counter lost that affinity: ResNet-18
// at batch 1 ran 14% slower than its static build on a quiet host, 2026-12-04.)
// A range is one 64-bit word {epoch:32, next:16, end:16} claimed by CAS: a worker that read an
// old job's word and ran late cannot claim from a newer one (the CAS compares the whole word),
// and it reads the job's parameters only after its claim succeeded, when the job cannot end
// before its chunk does. So no job state outlives the caller's wait, whatever the workers do.
// Idle workers spin `spin` pauses (graphmode/openmp.py's bound), then sleep on a futex until
// the next job is published; a caller whose last chunks are still running elsewhere spins,
// then sleeps on the job's done count. No wait is on a mutex, so no thread ever waits for one
// that the scheduler took away while it held a lock.
#include <atomic>
#include <climits>
#include <linux/futex.h>
#include <mutex>
#include <pthread.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

namespace {

typedef void (*gm_chunk_fn)(void*, long, long);
constexpr long GM_POOL_MAX_CHUNKS = 0xFFFF;   // chunks per job: the word's 16-bit fields
constexpr int GM_POOL_MAX_WORKERS = 255;

// a job's word {epoch:32, 0:16, chunks:16}, and a range's {epoch:32, next:16, end:16}
inline uint64_t gm_word(uint64_t epoch, uint64_t next, uint64_t last) {
  return (epoch << 32) | (next << 16) | last;
}
inline uint32_t gm_word_epoch(uint64_t w) { return (uint32_t)(w >> 32); }
inline long gm_word_next(uint64_t w) { return (long)((w >> 16) & 0xFFFF); }
inline long gm_word_end(uint64_t w) { return (long)(w & 0xFFFF); }

struct alignas(64) GmRange {             // a cache line each: owner and thief do not share one with another range
  std::atomic<uint64_t> w{0};
};

inline void gm_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

bool gm_forked = false;                 // in a child of fork(): the pool's threads are not there
thread_local bool gm_in_job = false;    // a pool thread, or a caller inside its job

static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free, "futex word");
inline void gm_futex_wait(std::atomic<uint32_t>* a, uint32_t expected) {
  syscall(SYS_futex, (uint32_t*)a, FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void gm_futex_wake(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, (uint32_t*)a, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

struct GmPool {
  std::atomic<uint64_t> word{0};         // the current job's: {epoch, 0, chunks}
  GmRange ranges[GM_POOL_MAX_WORKERS + 1];  // the current job's home ranges, one per taker
  std::atomic<uint32_t> done{0};        // chunks of the current job finished
  std::atomic<uint32_t> caller_asleep{0};
  // the current job, written by its caller before it publishes `word`, read after a claim
  std::atomic<gm_chunk_fn> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<long> lo{0}, hi{0}, chunk{1};
  std::atomic<int> helpers{0};          // workers (by index) that may take part in the current job
  uint32_t epoch = 0;                   // the caller's, under `busy`
  std::atomic<int> spin{1000};
  std::mutex busy;                      // one job at a time (try_lock only); another caller runs its loop alone
  std::atomic<uint32_t> wake_gen{0};    // bumped to wake sleeping workers
  std::atomic<int> sleepers{0};
  std::atomic<int> workers{0};          // started (changed under `busy`)
  std::atomic<long> jobs{0}, worker_chunks{0}, inline_jobs{0}, caller_waits{0}, wakes{0};

  // Claim and run chunks of the job in `w` as taker `me` (0: the caller, i + 1: worker i) of
  // `nt`: its home range from the front, then the others' from the back, until none is left.
  void work(uint64_t w, int me, int nt, bool is_worker) {
    const uint32_t ep = gm_word_epoch(w);
    const uint32_t n = (uint32_t)gm_word_end(w);
    for (int k = 0; k < nt; ++k) {
      std::atomic<uint64_t>& r = ranges[(me + k) % nt].w;
      uint64_t rw = r.load(std::memory_order_acquire);
      for (;;) {
        if (gm_word_epoch(rw) != ep) return;      // a newer job: this one has no chunk left to claim
        const long next = gm_word_next(rw), end = gm_word_end(rw);
        if (next >= end) break;
        const bool home = k == 0;
        const long got = home ? next : end - 1;
        const uint64_t claimed = home ? rw + (1u << 16) : rw - 1;
        if (!r.compare_exchange_weak(rw, claimed, std::memory_order_acq_rel, std::memory_order_acquire))
          continue;                     // rw now holds the range's word: retry on it
        const long c = chunk.load(std::memory_order_relaxed), l = lo.load(std::memory_order_relaxed);
        const long h = hi.load(std::memory_order_relaxed);
        const long a = l + got * c, b = a + c < h ? a + c : h;
        fn.load(std::memory_order_relaxed)(ctx.load(std::memory_order_relaxed), a, b);
        if (is_worker) worker_chunks.fetch_add(1, std::memory_order_relaxed);
        if (done.fetch_add(1, std::memory_order_seq_cst) + 1 == n && caller_asleep.load(std::memory_order_seq_cst))
          gm_futex_wake(&done);
        rw = r.load(std::memory_order_acquire);
      }
    }
  }

  void worker_loop(int index) {
    uint64_t seen = 0;                  // no job's word (epochs start at 1): a new worker joins the job it was started for
    for (;;) {
      uint64_t w = word.load(std::memory_order_acquire);
      if (w != seen) {
        seen = w;
        const int h = helpers.load(std::memory_order_relaxed);
        if (index < h) work(w, index + 1, h + 1, true);   // the job is cut for its helpers and the caller
        continue;
      }
      const int s = spin.load(std::memory_order_relaxed);
      int i = 0;
      while (i < s && word.load(std::memory_order_acquire) == seen) { gm_pause(); ++i; }
      if (i < s) continue;
      const uint32_t gen = wake_gen.load(std::memory_order_seq_cst);
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (word.load(std::memory_order_seq_cst) == seen) gm_futex_wait(&wake_gen, gen);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void run(long l, long h, long c, int nt, gm_chunk_fn f, void* x) {
    if (c < 1) c = 1;
    long n = (h - l + c - 1) / c;
    if (n > GM_POOL_MAX_CHUNKS) { c = (h - l + GM_POOL_MAX_CHUNKS - 1) / GM_POOL_MAX_CHUNKS; n = (h - l + c - 1) / c; }
    if (nt > GM_POOL_MAX_WORKERS + 1) nt = GM_POOL_MAX_WORKERS + 1;
    // alone: one chunk, one thread, a forked child (its workers did not survive the fork), a
    // loop inside a chunk, or the pool busy with another thread's job: the caller does it all
    if (n <= 1 || nt <= 1 || gm_forked || gm_in_job || !busy.try_lock()) {
      if (h > l) f(x, l, h);
      inline_jobs.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    for (int i = workers.load(); i < nt - 1; i = workers.load()) {
      try {
        std::thread([this, i] { gm_in_job = true; worker_loop(i); }).detach();
      } catch (...) {
        break;                          // no thread to be had: those there are (or the caller) do it
      }
      workers.store(i + 1);
    }
    gm_in_job = true;
    fn.store(f, std::memory_order_relaxed);
    ctx.store(x, std::memory_order_relaxed);
    lo.store(l, std::memory_order_relaxed);
    hi.store(h, std::memory_order_relaxed);
    chunk.store(c, std::memory_order_relaxed);
    helpers.store(nt - 1, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    ++epoch;
    for (int t = 0; t < nt; ++t)        // taker t's home: chunks [t*n/nt, (t+1)*n/nt)
      ranges[t].w.store(gm_word(epoch, (uint64_t)(t * n / nt), (uint64_t)((t + 1) * n / nt)), std::memory_order_relaxed);
    const uint64_t w = gm_word(epoch, 0, (uint64_t)n);
    word.store(w, std::memory_order_seq_cst);                     // publishes the stores above
    if (sleepers.load(std::memory_order_seq_cst) > 0) {
      wake_gen.fetch_add(1, std::memory_order_seq_cst);
      gm_futex_wake(&wake_gen);
      wakes.fetch_add(1, std::memory_order_relaxed);
    }
    work(w, 0, nt, false);
    const int s = spin.load(std::memory_order_relaxed);
    for (int i = 0; i < s && done.load(std::memory_order_acquire) < (uint32_t)n; ++i) gm_pause();
    for (uint32_t d = done.load(std::memory_order_acquire); d < (uint32_t)n; d = done.load(std::memory_order_acquire)) {
      caller_asleep.store(1, std::memory_order_seq_cst);
      d = done.load(std::memory_order_seq_cst);
      if (d < (uint32_t)n) gm_futex_wait(&done, d);   // returns at once if a chunk finished since
      caller_waits.fetch_add(1, std::memory_order_relaxed);
    }
    caller_asleep.store(0, std::memory_order_relaxed);
    gm_in_job = false;
    jobs.fetch_add(1, std::memory_order_relaxed);
    busy.unlock();
  }
};

GmPool* gm_pool() {
  static GmPool* pool = [] {            // never destroyed: detached workers may outlive exit's destructors
    pthread_atfork(nullptr, nullptr, [] { gm_forked = true; });
    return new GmPool();
  }();
  return pool;
}

void gm_pool_run_impl(long lo, long hi, long chunk, int nt, gm_chunk_fn fn, void* ctx) {
  gm_pool()->run(lo, hi, chunk, nt, fn, ctx);
}

}  // namespace

GM_EXPORT void* gm_pool_entry(void) { return (void*)&gm_pool_run_impl; }
GM_EXPORT void gm_pool_set_spin(int spin) { gm_pool()->spin.store(spin < 0 ? 0 : spin); }
// jobs run by the pool, chunks its workers ran, loops the caller ran alone, workers started,
// the caller's sleeps waiting for a worker's chunk, wakes of sleeping workers
GM_EXPORT void gm_pool_stats(long* out) {
  GmPool* p = gm_pool();
  out[0] = p->jobs.load();
  out[1] = p->worker_chunks.load();
  out[2] = p->inline_jobs.load();
  out[3] = p->workers.load();
  out[4] = p->caller_waits.load();
  out[5] = p->wakes.load();
}
