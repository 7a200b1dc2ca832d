// graphmode generated CPU kernels: helpers of the pooling kernels (pool.py).
// ATen's max update rule (NaN and the sign of a zero maximum come out as ATen's) and
// 16-float GCC vectors that the compiler lowers to the host's widest ISA.

#ifndef GM_NATIVE_POOL_H
#define GM_NATIVE_POOL_H
// ATen's max-pool update: a later value replaces the running max only when strictly greater
// or NaN, so the first of equal maxima (the sign of a zero) and the last NaN win, as there.
// `|`, not `||`: both compares always run, so the select compiles to a blend, not branches.
GM_INLINE float gm_pool_max(float m, float v) { return ((v > m) | (v != v)) ? v : m; }
// 16 floats as a GCC vector: one AVX-512 register, two AVX2 ones, four SSE ones.
typedef float gm_v16f __attribute__((vector_size(64)));
GM_INLINE gm_v16f gm_v16_load(const float* p) { gm_v16f v; __builtin_memcpy(&v, p, 64); return v; }
GM_INLINE void gm_v16_store(float* p, gm_v16f v) { __builtin_memcpy(p, &v, 64); }
// p[0], p[2], ..., p[30]: reads p[0..30] only (the second load starts at p[15]), so a block
// ending at the last element of a buffer never reads past it
GM_INLINE gm_v16f gm_v16_load_s2(const float* p) {
  const gm_v16f a = gm_v16_load(p), b = gm_v16_load(p + 15);
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29, 31);
}
GM_INLINE gm_v16f gm_v16_pool_max(gm_v16f m, gm_v16f v) { return ((v > m) | (v != v)) ? v : m; }
typedef float gm_v8f __attribute__((vector_size(32)));
typedef float gm_v4f __attribute__((vector_size(16)));
GM_INLINE float gm_v16_sum(gm_v16f v) {
  const gm_v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const gm_v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
