// graphmode generated CPU kernels: the GEMM micro-kernels (gemm.py writes the loops around them).
// An MR x (NV vectors) tile of C stays in registers for a whole K block: per k, NV vectors
// of B are loaded and MR values of A broadcast, one FMA per accumulator. Portable C,
// AVX-512 and AVX2+FMA versions, the latter two behind the compiler's own ISA macros so a
// kernel built for a host without them falls back to the portable one. <immintrin.h> comes
// from simd.h.

#ifndef GM_GEMM_COMMON_H
#define GM_GEMM_COMMON_H
@include simd.h
#define GM_UNROLL _Pragma("GCC unroll 64")
// B is asked for this many k steps ahead, into L2, a prefetch per cache line it will read: where
// the weights do not fit the caches (GPT-2 at 16 tokens streams 500 MB a call) the hardware
// prefetcher alone left the FMAs waiting. Same kernels (heuristic policy), interleaved, Zen 4:
// GPT-2 (1,16) 30.3-31.8 -> 25.9-27.1 ms on the AVX-512 path, 32-35 -> 31-33 ms on the AVX2
// path; MiniLM (1,128), GPT-2 (1,128) and ResNet-18 (1) unchanged (B reused from cache there).
// The AVX2 tiles read half the bytes per k step (64-96 against 128-192), so they look twice as
// many steps ahead, about the same 8-12 KiB: GPT-2 (1,16) on the AVX2 path 4-9% faster than at
// 64 (two interleaved runs; MiniLM (1,128) and ResNet-18 (1) unchanged).
#define GM_PF_AHEAD 64
#define GM_PF_AHEAD_AVX2 128
// A fused epilogue (gemm.py `@SYM@_epi`) stays out of line where there are 16 vector
// registers: inlined, the constants it hoists (erf/exp polynomials) stay live across the
// micro-kernel's K loop and push accumulators to the stack (AVX2 6x16 linear+GELU
// 128x1536x384 ran at 46 GFLOP/s instead of 98; with AVX-512's 32 registers inlining is free).
#if defined(__AVX512F__)
#define GM_GEMM_EPI GM_INLINE
#else
#define GM_GEMM_EPI static __attribute__((noinline))
#endif


// Portable micro-kernel: an MR x (NV*8) tile, LAST valid columns in the last group of 8.
// Plain loops with constant bounds; the compiler vectorises the column loop.
template <int MR, int NV, int LAST, bool MASKB>
GM_INLINE void gm_gemm_ukr_c(long kc, const float* __restrict a, long lda, const float* __restrict b, long ldb,
                             float* __restrict c, long ldc, const float* __restrict bias, bool first) {
  constexpr int NC = (NV - 1) * 8 + LAST;       // valid columns
  constexpr int NB = MASKB ? NC : NV * 8;       // columns of B that may be read
  float acc[MR][NV * 8];
  GM_UNROLL for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV * 8; ++j)
      acc[i][j] = first ? ((bias && j < NC) ? bias[j] : 0.0f) : (j < NC ? c[i * ldc + j] : 0.0f);
  for (long k = 0; k < kc; ++k) {
    float bv[NV * 8];
    for (int j = 0; j < NV * 8; ++j) bv[j] = j < NB ? b[k * ldb + j] : 0.0f;
    GM_UNROLL for (int i = 0; i < MR; ++i) {
      const float av = a[i * lda + k];
      #pragma omp simd
      for (int j = 0; j < NV * 8; ++j) acc[i][j] = GM_FMA(av, bv[j], acc[i][j]);
    }
  }
  GM_UNROLL for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) c[i * ldc + j] = acc[i][j];
}

#if defined(__AVX512F__)
// AVX-512 micro-kernel: MR x NV vectors of 16; LAST valid lanes in the last vector.
template <int MR, int NV, int LAST, bool MASKB>
GM_INLINE void gm_gemm_ukr_avx512(long kc, const float* __restrict a, long lda, const float* __restrict b, long ldb,
                                  float* __restrict c, long ldc, const float* __restrict bias, bool first) {
  const __mmask16 lm = (__mmask16)((1u << LAST) - 1u);
  __m512 acc[MR][NV];
  if (first) {
    GM_UNROLL for (int v = 0; v < NV; ++v) {
      __m512 x = _mm512_setzero_ps();
      if (bias) x = (v == NV - 1 && LAST < 16) ? _mm512_maskz_loadu_ps(lm, bias + 16 * v) : _mm512_loadu_ps(bias + 16 * v);
      GM_UNROLL for (int i = 0; i < MR; ++i) acc[i][v] = x;
    }
  } else {
    GM_UNROLL for (int i = 0; i < MR; ++i)
      GM_UNROLL for (int v = 0; v < NV; ++v)
        acc[i][v] = (v == NV - 1 && LAST < 16) ? _mm512_maskz_loadu_ps(lm, c + i * ldc + 16 * v)
                                               : _mm512_loadu_ps(c + i * ldc + 16 * v);
  }
  for (long k = 0; k < kc; ++k) {
    __m512 bv[NV];
    GM_UNROLL for (int v = 0; v < NV; ++v) _mm_prefetch((const char*)(b + (k + GM_PF_AHEAD) * ldb + 16 * v), _MM_HINT_T1);
    GM_UNROLL for (int v = 0; v < NV; ++v)
      bv[v] = (MASKB && v == NV - 1 && LAST < 16) ? _mm512_maskz_loadu_ps(lm, b + k * ldb + 16 * v)
                                                  : _mm512_loadu_ps(b + k * ldb + 16 * v);
    GM_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
      GM_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
  GM_UNROLL for (int i = 0; i < MR; ++i)
    GM_UNROLL for (int v = 0; v < NV; ++v) {
      if (v == NV - 1 && LAST < 16) _mm512_mask_storeu_ps(c + i * ldc + 16 * v, lm, acc[i][v]);
      else _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
GM_INLINE __m256i gm_gemm_mask8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// AVX2 micro-kernel: MR x NV vectors of 8; LAST valid lanes in the last vector.
template <int MR, int NV, int LAST, bool MASKB>
GM_INLINE void gm_gemm_ukr_avx2(long kc, const float* __restrict a, long lda, const float* __restrict b, long ldb,
                                float* __restrict c, long ldc, const float* __restrict bias, bool first) {
  const __m256i lm = gm_gemm_mask8(LAST);
  __m256 acc[MR][NV];
  if (first) {
    GM_UNROLL for (int v = 0; v < NV; ++v) {
      __m256 x = _mm256_setzero_ps();
      if (bias) x = (v == NV - 1 && LAST < 8) ? _mm256_maskload_ps(bias + 8 * v, lm) : _mm256_loadu_ps(bias + 8 * v);
      GM_UNROLL for (int i = 0; i < MR; ++i) acc[i][v] = x;
    }
  } else {
    GM_UNROLL for (int i = 0; i < MR; ++i)
      GM_UNROLL for (int v = 0; v < NV; ++v)
        acc[i][v] = (v == NV - 1 && LAST < 8) ? _mm256_maskload_ps(c + i * ldc + 8 * v, lm)
                                              : _mm256_loadu_ps(c + i * ldc + 8 * v);
  }
  // four k steps per loop trip: with 16 ymm registers the loop is issue-bound (a third of
  // AVX-512's FLOPs per instruction); measured on Zen 4, 4x24 at M=16: 20% faster, 6x16: 1-14%
  // (the AVX-512 kernel measured the same either way)
  _Pragma("GCC unroll 4")
  for (long k = 0; k < kc; ++k) {
    __m256 bv[NV];
    // (16 k steps ahead into L1 for two-vector tiles only, as before, measured 4-9% slower on
    // GPT-2 (1,16) than this and the same on ResNet-18 (1))
    GM_UNROLL for (int u = 0; u < (NV + 1) / 2; ++u)
      _mm_prefetch((const char*)(b + (k + GM_PF_AHEAD_AVX2) * ldb + 16 * u), _MM_HINT_T1);
    GM_UNROLL for (int v = 0; v < NV; ++v)
      bv[v] = (MASKB && v == NV - 1 && LAST < 8) ? _mm256_maskload_ps(b + k * ldb + 8 * v, lm)
                                                 : _mm256_loadu_ps(b + k * ldb + 8 * v);
    GM_UNROLL for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + k);
      GM_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
  GM_UNROLL for (int i = 0; i < MR; ++i)
    GM_UNROLL for (int v = 0; v < NV; ++v) {
      if (v == NV - 1 && LAST < 8) _mm256_maskstore_ps(c + i * ldc + 8 * v, lm, acc[i][v]);
      else _mm256_storeu_ps(c + i * ldc + 8 * v, acc[i][v]);
    }
}
#endif
#endif  // GM_GEMM_COMMON_H
