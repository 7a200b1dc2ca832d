// graphmode generated CPU kernels: what the prelude declares, defined once per shared library
// (a library's parts are compiled separately; only the first part includes this).
// gm_threads is the library's OpenMP thread count, set from Python through gm_set_threads
// and read by every parallel region through gm_nt().
__attribute__((visibility("hidden"))) int gm_threads = 0;
GM_EXPORT void gm_set_threads(int n) { gm_threads = n < 0 ? 0 : n; }
GM_EXPORT int gm_get_threads(void) { return gm_nt(); }
#if defined(GM_SCHEDULE_CLAIM)
__attribute__((visibility("hidden"))) gm_pool_fn_t gm_pool_run = nullptr;
GM_EXPORT void gm_set_pool(void* entry) { gm_pool_run = (gm_pool_fn_t)entry; }
#endif
// gm_flush_lines(p, n) evicts the bytes [p, p + n) from every cache level and returns 1, or
// returns 0 where it cannot (tactic timing then reads rotating copies instead). Timing a
// candidate "cold" (its weight read from DRAM, as a model larger than the LLC reads it) by
// flushing its weight before each call needs no pool of copies, which took 2x the LLC of
// peak memory and read it all between two calls.
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
__attribute__((target("clflushopt"))) static void gm_clflushopt_range(const char* c, long n) {
  for (long i = 0; i < n; i += 64) __builtin_ia32_clflushopt((void*)(c + i));
  __builtin_ia32_sfence();
}
static void gm_clflush_range(const char* c, long n) {
  for (long i = 0; i < n; i += 64) __builtin_ia32_clflush(c + i);
  __builtin_ia32_mfence();
}
GM_EXPORT int gm_flush_lines(const void* p, long n) {
  static int opt = -1;                       // CPUID.(7,0):EBX bit 23 = CLFLUSHOPT
  if (opt < 0) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    opt = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((b >> 23) & 1);
  }
  const char* s = (const char*)((unsigned long)p & ~63UL);
  long len = n + ((const char*)p - s);
  if (opt) gm_clflushopt_range(s, len); else gm_clflush_range(s, len);
  return 1;
}
#elif defined(__aarch64__)
GM_EXPORT int gm_flush_lines(const void* p, long n) {
  const char* s = (const char*)((unsigned long)p & ~63UL);
  for (const char* c = s; c < (const char*)p + n; c += 64) __asm__ volatile("dc civac, %0" ::"r"(c) : "memory");
  __asm__ volatile("dsb ish" ::: "memory");
  return 1;
}
#else
GM_EXPORT int gm_flush_lines(const void* p, long n) { (void)p; (void)n; return 0; }
#endif
