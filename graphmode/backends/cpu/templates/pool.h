// graphmode generated CPU kernels: helpers of the pooling kernels (pool.py).
// ATen's max update rule (NaN and the sign of a zero maximum come out as ATen's) and
// 16-float GCC vectors that the compiler lowers to the host's widest ISA.

#ifndef GM_NATIVE_POOL_H
#define GM_NATIVE_POOL_H
@include simd.h
// ATen's max-pool update: a later value replaces the running max only when strictly greater
// or NaN, so the first of equal maxima (the sign of a zero) and the last NaN win, as there.
// `|`, not `||`: both compares always run, so the select compiles to a blend, not branches.
GM_INLINE float gm_pool_max(float m, float v) { return ((v > m) | (v != v)) ? v : m; }
// 16 floats as registers of the host's own width: one AVX-512 register, two AVX2 ones, four
// SSE/NEON ones. Not one 64-byte GCC vector everywhere: below AVX-512 GCC lowers the selects
// and shuffles of such a vector lane by lane through the stack (a compare and branch per
// float), which made ResNet-18's max pool 16x slower under AVX2 than under AVX-512.
#if defined(__AVX512F__)
#define GM_PL 16
#elif defined(__AVX2__) && defined(__FMA__)   // where simd.h includes the intrinsics
#define GM_PL 8
#else
#define GM_PL 4
#endif
typedef float gm_vpf __attribute__((vector_size(GM_PL * 4)));
struct gm_v16f { gm_vpf v[16 / GM_PL]; };
GM_INLINE gm_vpf gm_vp_load(const float* p) { gm_vpf v; __builtin_memcpy(&v, p, sizeof v); return v; }
GM_INLINE gm_v16f gm_v16_load(const float* p) {
  gm_v16f r;
  for (int i = 0; i < 16 / GM_PL; ++i) r.v[i] = gm_vp_load(p + i * GM_PL);
  return r;
}
GM_INLINE void gm_v16_store(float* p, gm_v16f x) {
  for (int i = 0; i < 16 / GM_PL; ++i) __builtin_memcpy(p + i * GM_PL, &x.v[i], sizeof x.v[i]);
}
GM_INLINE gm_v16f gm_v16_fill(float x) {
  gm_v16f r;
  for (int i = 0; i < 16 / GM_PL; ++i) r.v[i] = x - (gm_vpf){};
  return r;
}
GM_INLINE gm_v16f gm_v16_add(gm_v16f a, gm_v16f b) {
  for (int i = 0; i < 16 / GM_PL; ++i) a.v[i] += b.v[i];
  return a;
}
GM_INLINE gm_v16f gm_v16_pool_max(gm_v16f m, gm_v16f x) {
  for (int i = 0; i < 16 / GM_PL; ++i) m.v[i] = ((x.v[i] > m.v[i]) | (x.v[i] != x.v[i])) ? x.v[i] : m.v[i];
  return m;
}
// p[0], p[2], ..., p[30]: reads p[0..30] only (the upper half's loads start at p[15]), so a
// block ending at the last element of a buffer never reads past it
GM_INLINE gm_v16f gm_v16_load_s2(const float* p) {
  gm_v16f r;
#if GM_PL == 16
  r.v[0] = __builtin_shufflevector(gm_vp_load(p), gm_vp_load(p + 15),
                                   0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29, 31);
#elif GM_PL == 8   // in-lane shuffle of the even (odd) floats, then the 64-bit quarters in order
  const __m256 lo = _mm256_shuffle_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 hi = _mm256_shuffle_ps(_mm256_loadu_ps(p + 15), _mm256_loadu_ps(p + 23), _MM_SHUFFLE(3, 1, 3, 1));
  r.v[0] = (gm_vpf)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(lo), _MM_SHUFFLE(3, 1, 2, 0)));
  r.v[1] = (gm_vpf)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(hi), _MM_SHUFFLE(3, 1, 2, 0)));
#else
  r.v[0] = __builtin_shufflevector(gm_vp_load(p), gm_vp_load(p + 4), 0, 2, 4, 6);
  r.v[1] = __builtin_shufflevector(gm_vp_load(p + 8), gm_vp_load(p + 12), 0, 2, 4, 6);
  r.v[2] = __builtin_shufflevector(gm_vp_load(p + 15), gm_vp_load(p + 19), 1, 3, 5, 7);
  r.v[3] = __builtin_shufflevector(gm_vp_load(p + 23), gm_vp_load(p + 27), 1, 3, 5, 7);
#endif
  return r;
}
// lane j + lane j+8, then + 4, then pairwise: the same order on every ISA
GM_INLINE float gm_v16_sum(gm_v16f x) {
  float l[16];
  gm_v16_store(l, x);
  float b[4];
  for (int j = 0; j < 4; ++j) b[j] = (l[j] + l[j + 8]) + (l[j + 4] + l[j + 12]);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
