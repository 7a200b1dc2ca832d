// graphmode generated CPU kernels: shared prelude (no system headers: keeps g++ start-up cheap).
// The float math below is branch-free so that gcc/clang vectorise it inside `#pragma omp simd`
// loops; libm's scalar expf/tanhf/erff would keep every loop that uses them scalar.
typedef __INT64_TYPE__ int64_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT8_TYPE__ int8_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __SIZE_TYPE__ size_t;

#define GM_EXPORT extern "C" __attribute__((visibility("default")))
#define GM_INLINE static inline __attribute__((always_inline))
#define GM_INF __builtin_inff()
#define GM_NAN __builtin_nanf("")

#ifdef _OPENMP
extern "C" int omp_get_max_threads(void);
extern "C" int omp_get_thread_num(void);
#endif
extern "C" void* malloc(size_t) noexcept;
extern "C" void free(void*) noexcept;

extern int gm_threads;  // per library; 0 = the OpenMP default
GM_INLINE int gm_nt(void) {
#ifdef _OPENMP
  return gm_threads > 0 ? gm_threads : omp_get_max_threads();
#else
  return 1;
#endif
}
GM_INLINE long gm_thread_num(void) {    // this thread's scratch block in a blocked schedule
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// GM_SCHED(c): the schedule of the loops a generator made claimable (backends/cpu/omp_loops.py),
// chosen by the build's flag: chunks of c claimed dynamically, guided down to c, or static.
#if defined(GM_SCHEDULE_DYNAMIC) || defined(GM_SCHEDULE_CLAIM)
#define GM_SCHED(c) dynamic, c
#elif defined(GM_SCHEDULE_GUIDED)
#define GM_SCHED(c) guided, c
#else
#define GM_SCHED(c) static
#endif

// gm_parallel_for(lo, hi, chunk, nt, f): f(a, b) over [lo, hi) in chunks of `chunk` (0: one per thread), claimed by
// the process's work-claiming pool (templates/claim_pool.h) with up to `nt` threads, the caller
// one of them. Under codegen.schedule claim, omp_loops.claim_loops writes a claimable
// `#pragma omp parallel for` loop this way. gm_pool_run is set when the library is loaded
// (gm_set_pool); unset, the caller runs the whole loop.
#if defined(GM_SCHEDULE_CLAIM)
typedef void (*gm_pool_fn_t)(long, long, long, int, void (*)(void*, long, long), void*);
extern gm_pool_fn_t gm_pool_run;
template <class F>
GM_INLINE void gm_parallel_for(long lo, long hi, long chunk, int nt, const F& f) {
  if (chunk <= 0) chunk = nt > 1 ? (hi - lo + nt - 1) / nt : hi - lo;   // a static loop: a chunk per thread
  if (gm_pool_run == nullptr || nt <= 1 || hi - lo <= chunk) {
    if (hi > lo) f(lo, hi);
    return;
  }
  gm_pool_run(lo, hi, chunk, nt, [](void* c, long a, long b) { (*(const F*)c)(a, b); }, (void*)&f);
}
#endif

GM_INLINE float gm_bits_f32(int32_t i) { float f; __builtin_memcpy(&f, &i, 4); return f; }

// a*b+c: one rounding where the CPU has FMA (-ffp-contract=off leaves explicit fmas alone)
#ifdef __FMA__
#define GM_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define GM_FMA(a, b, c) ((a) * (b) + (c))
#endif

// Cephes-style e^x core: x = n*ln2 + r, |r| <= ln2/2; returns e^r (degree-7 polynomial), n in *n_out
GM_INLINE float gm_exp_reduced(float x, float* n_out) {
  float n = GM_FMA(x, 1.44269504088896341f, 12582912.0f) - 12582912.0f;  // round to nearest
  float r = GM_FMA(n, -0.693359375f, x);
  r = GM_FMA(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = GM_FMA(p, r, 1.3981999507e-3f);
  p = GM_FMA(p, r, 8.3334519073e-3f);
  p = GM_FMA(p, r, 4.1665795894e-2f);
  p = GM_FMA(p, r, 1.6666665459e-1f);
  p = GM_FMA(p, r, 5.0000001201e-1f);
  *n_out = n;
  return GM_FMA(p, r * r, r) + 1.0f;
}

// e^x: 2^n applied in two halves so results down to the subnormal range and overflow to inf
// come out right. ~1 ulp. NaN propagates through the clamps (comparisons with NaN are false).
GM_INLINE float gm_expf(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  xc = xc > 89.0f ? 89.0f : xc;
  float n;
  const float p = gm_exp_reduced(xc, &n);
  int32_t ni = (int32_t)n;
  int32_t n1 = ni >> 1;
  int32_t n2 = ni - n1;
  return (p * gm_bits_f32((n1 + 127) << 23)) * gm_bits_f32((n2 + 127) << 23);
}

// e^x for x in [-87, 88] only (no clamping: callers bound the argument); NaN propagates.
GM_INLINE float gm_expf_nc(float x) {
  float n;
  const float p = gm_exp_reduced(x, &n);
  return p * gm_bits_f32(((int32_t)n + 127) << 23);
}

// tanh: odd polynomial below 0.625 (Cephes tanhf), 1 - 2/(e^{2|x|}+1) above.
GM_INLINE float gm_tanhf(float x) {
  float ax = __builtin_fabsf(x);
  float z = x * x;
  float ps = -5.70498872745e-3f;
  ps = GM_FMA(ps, z, 2.06390887954e-2f);
  ps = GM_FMA(ps, z, -5.37397155531e-2f);
  ps = GM_FMA(ps, z, 1.33314422036e-1f);
  ps = GM_FMA(ps, z, -3.33332819422e-1f);
  ps = __builtin_copysignf(GM_FMA(ps * z, x, x), x);     // odd: -0.0 stays -0.0 (the FMA gives +0.0)
  // from |x| 10 on, 2 / (e^{2|x|} + 1) < 2^-25 and tanh rounds to +-1 exactly (at 9 it is 1 - 2^-24:
  // 1 + tanh(-9) was 6e-8, not 0, and a tanh GELU of -1e6 gave -0.03)
  float e = gm_expf_nc(2.0f * (ax > 10.0f ? 10.0f : ax));
  float pl = __builtin_copysignf(1.0f - 2.0f / (e + 1.0f), x);
  return ax < 0.625f ? ps : pl;
}

// erf: below 0.5, x * P4(x^2); above, 1 - exp(P6(|x|)) with P6 a weighted least-squares fit
// of log(erfc) on [0.5, 3.95] (beyond, erf rounds to +-1). Both fitted here for float
// evaluation: <= 3 ulp over all floats (torch's own vectorised erf is Abramowitz-Stegun
// 7.1.26, abs error 1.5e-7).
GM_INLINE float gm_erff(float x) {
  float ax = __builtin_fabsf(x);
  float z = x * x;
  float s = 0.0047447397373616695f;
  s = GM_FMA(s, z, -0.026769310235977173f);
  s = GM_FMA(s, z, 0.11282991617918015f);
  s = GM_FMA(s, z, -0.37612617015838623f);
  s = GM_FMA(s, z, 1.1283791065216064f);
  float small = x * s;
  float a = ax > 3.95f ? 3.95f : ax;
  float q = 0.00022475446166936308f;
  q = GM_FMA(q, a, -0.0033048433251678944f);
  q = GM_FMA(q, a, 0.02318963035941124f);
  q = GM_FMA(q, a, -0.10577091574668884f);
  q = GM_FMA(q, a, -0.635255753993988f);
  q = GM_FMA(q, a, -1.1287258863449097f);
  q = GM_FMA(q, a, 3.752193515538238e-05f);
  float big = __builtin_copysignf(1.0f - gm_expf_nc(q), x);  // q in [-18, 0]
  return ax < 0.5f ? small : big;
}

GM_INLINE float gm_sigmoidf(float x) { return 1.0f / (1.0f + gm_expf(-x)); }
GM_INLINE double gm_sigmoid(double x) { return 1.0 / (1.0 + __builtin_exp(-x)); }

// NaN-propagating max/min (torch.maximum/minimum, amax); plain for integers.
GM_INLINE float gm_maxf(float a, float b) { return (a != a || a > b) ? a : b; }
GM_INLINE float gm_minf(float a, float b) { return (a != a || a < b) ? a : b; }
GM_INLINE double gm_max(double a, double b) { return (a != a || a > b) ? a : b; }
GM_INLINE double gm_min(double a, double b) { return (a != a || a < b) ? a : b; }

// integer power by squaring (torch semantics for integer pow; negative exponents give 0
// except for bases 1 and -1)
GM_INLINE int64_t gm_ipow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  int64_t r = 1;
  while (b) { if (b & 1) r *= a; a *= a; b >>= 1; }
  return r;
}
