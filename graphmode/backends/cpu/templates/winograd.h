// graphmode generated CPU kernels: helpers of the Winograd convolutions (winograd.py).
// 16-channel GCC vectors for the input and output transforms (lowered to the host's widest
// ISA).

#ifndef GM_WINO_COMMON_H
#define GM_WINO_COMMON_H
typedef float gm_v16 __attribute__((vector_size(64)));
typedef float gm_v16u __attribute__((vector_size(64), aligned(4)));
GM_INLINE gm_v16 gm_ld16(const float* p) { return *(const gm_v16u*)p; }
GM_INLINE void gm_st16(float* p, gm_v16 v) { *(gm_v16u*)p = v; }
#endif
