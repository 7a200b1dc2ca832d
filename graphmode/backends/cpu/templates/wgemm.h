// graphmode generated CPU kernels: weight-only quantized linear micro-kernels (wgemm.py).
// y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n] (+ bias[n]) with w stored [N, K] as int8 or
// bf16 and read as stored: a tile of MR rows of x by NR rows of w keeps MR x NR vector
// accumulators over K; per K step, NR vectors of w are widened to f32 (int8: sign-extend and
// convert; bf16: the 16 bits moved to the top of an f32) and each meets MR vectors of x in one
// FMA. Dot products end in a horizontal sum, a scalar K tail, the per-channel scale and bias.
// Traits per ISA (AVX-512: 16 lanes, AVX2+FMA: 8, portable C: 8) behind the compiler's macros.
// Many rows (prefill) take the panel path at the end instead: a block of output columns is
// widened once into an f32 panel that gemm.h's micro-kernels stream for every row tile.

#ifndef GM_WGEMM_H
#define GM_WGEMM_H
@include simd.h
@include gemm.h
#define GM_WQ_UNROLL _Pragma("GCC unroll 64")
#define GM_WQ_FI __attribute__((always_inline)) inline
typedef __UINT16_TYPE__ gm_bf16_t;

GM_INLINE float gm_wq_scalar(int8_t w) { return (float)w; }
GM_INLINE float gm_wq_scalar(gm_bf16_t w) { return gm_bits_f32((int32_t)((uint32_t)w << 16)); }

#if defined(__AVX512F__)
struct gm_wq_v512 {
  typedef __m512 V;
  static constexpr int L = 16;
  static GM_WQ_FI V zero() { return _mm512_setzero_ps(); }
  static GM_WQ_FI V load(const float* p) { return _mm512_loadu_ps(p); }
  static GM_WQ_FI V widen(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static GM_WQ_FI V widen(const gm_bf16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static GM_WQ_FI V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static GM_WQ_FI float hsum(V x) { return _mm512_reduce_add_ps(x); }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
struct gm_wq_v256 {
  typedef __m256 V;
  static constexpr int L = 8;
  static GM_WQ_FI V zero() { return _mm256_setzero_ps(); }
  static GM_WQ_FI V load(const float* p) { return _mm256_loadu_ps(p); }
  static GM_WQ_FI V widen(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static GM_WQ_FI V widen(const gm_bf16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static GM_WQ_FI V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static GM_WQ_FI float hsum(V x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif
struct gm_wq_vc {
  struct V { float v[8]; };
  static constexpr int L = 8;
  static GM_WQ_FI V zero() { V r; GM_WQ_UNROLL for (int i = 0; i < 8; ++i) r.v[i] = 0.0f; return r; }
  static GM_WQ_FI V load(const float* p) { V r; GM_WQ_UNROLL for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
  template <class W> static GM_WQ_FI V widen(const W* p) {
    V r; GM_WQ_UNROLL for (int i = 0; i < 8; ++i) r.v[i] = gm_wq_scalar(p[i]); return r;
  }
  static GM_WQ_FI V fma(V a, V b, V c) {
    GM_WQ_UNROLL for (int i = 0; i < 8; ++i) c.v[i] = GM_FMA(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static GM_WQ_FI float hsum(V x) {
    float s = 0.0f;
    GM_WQ_UNROLL for (int i = 0; i < 8; ++i) s += x.v[i];
    return s;
  }
};

// One MR x NR tile: rows x[0..MR) (stride ldx), weight rows w[0..NR) (stride K), outputs
// y[i * ldy + j]; bias may be null.
template <class VT, int MR, int NR, class W>
GM_WQ_FI void gm_wq_tile(const float* __restrict x, long ldx, const W* __restrict w, long K,
                         const float* __restrict scale, const float* __restrict bias, float* __restrict y, long ldy) {
  typename VT::V acc[MR][NR];
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = VT::zero();
  long k = 0;
  for (; k + VT::L <= K; k += VT::L) {
    typename VT::V wv[NR];
    // once per cache line, the rows four tiles ahead (short row streams the hardware prefetcher
    // does not ramp up on), into L2 (locality 1): an L1 prefetch (3) or a non-temporal one (0)
    // streamed 15 GB/s from memory here, into L2 24-30 GB/s
    if (((k * (long)sizeof(W)) & 63) == 0) {
      GM_WQ_UNROLL for (int j = 0; j < NR; ++j) __builtin_prefetch(w + (4 * NR + j) * K + k, 0, 1);
    }
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) wv[j] = VT::widen(w + j * K + k);
    GM_WQ_UNROLL for (int i = 0; i < MR; ++i) {
      typename VT::V xv = VT::load(x + i * ldx + k);
      GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = VT::fma(xv, wv[j], acc[i][j]);
    }
  }
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      float s = VT::hsum(acc[i][j]);
      for (long kk = k; kk < K; ++kk) s = GM_FMA(x[i * ldx + kk], gm_wq_scalar(w[j * K + kk]), s);
      y[i * ldy + j] = bias ? GM_FMA(s, scale[j], bias[j]) : s * scale[j];
    }
}

// Row dispatch: the full MR-row tiles of rows [m0, m1), then one tile of the rows left over.
template <class VT, int R, int NR, class W>
GM_WQ_FI void gm_wq_rest(long rem, const float* x, long K, const W* w, const float* sc, const float* b, float* y,
                         long ldy) {
  if (rem == R) gm_wq_tile<VT, R, NR, W>(x, K, w, K, sc, b, y, ldy);
  else if constexpr (R > 1) gm_wq_rest<VT, R - 1, NR, W>(rem, x, K, w, sc, b, y, ldy);
}

template <class VT, int MR, int NR, class W>
GM_WQ_FI void gm_wq_rows(const float* x, const W* w, long K, const float* sc, const float* b, float* y, long N,
                         long m0, long m1, long n) {
  long m = m0;
  for (; m + MR <= m1; m += MR) gm_wq_tile<VT, MR, NR, W>(x + m * K, K, w, K, sc, b, y + m * N + n, N);
  if (m < m1) {
    if constexpr (MR > 1) gm_wq_rest<VT, MR - 1, NR, W>(m1 - m, x + m * K, K, w, sc, b, y + m * N + n, N);
  }
}

// Column dispatch for the last, narrower block of columns.
template <class VT, int MR, int C, class W>
GM_WQ_FI void gm_wq_narrow(long nr, const float* x, const W* w, long K, const float* sc, const float* b, float* y,
                           long N, long m0, long m1, long n) {
  if (nr == C) gm_wq_rows<VT, MR, C, W>(x, w, K, sc, b, y, N, m0, m1, n);
  else if constexpr (C > 1) gm_wq_narrow<VT, MR, C - 1, W>(nr, x, w, K, sc, b, y, N, m0, m1, n);
}

// Output columns [n0, n1) of y [M, N]: rows in chunks of MC (a chunk of x stays in L2 while
// this range's weights stream through L1 once per chunk), NR columns at a time.
template <class VT, int MR, int NR, class W>
GM_WQ_FI void gm_wq_cols(const float* __restrict x, const W* __restrict w, const float* __restrict scale,
                         const float* __restrict bias, float* __restrict y, long M, long N, long K, long n0, long n1) {
  constexpr long MC = 32;
  for (long m0 = 0; m0 < M; m0 += MC) {
    const long m1 = m0 + MC < M ? m0 + MC : M;
    for (long n = n0; n < n1; n += NR) {
      const long nr = n1 - n < NR ? n1 - n : NR;
      const W* wn = w + n * K;
      const float* bn = bias ? bias + n : 0;
      if (nr == NR) gm_wq_rows<VT, MR, NR, W>(x, wn, K, scale + n, bn, y, N, m0, m1, n);
      else if constexpr (NR > 1) gm_wq_narrow<VT, MR, NR - 1, W>(nr, x, wn, K, scale + n, bn, y, N, m0, m1, n);
    }
  }
}

// ---- the panel path (many rows) ----------------------------------------------------------
// P: the f32 GEMM micro-kernel of one ISA (gemm.h) as MR rows x NV vectors of L lanes
// (a function template cannot be a template argument: one macro writes the three adapters).
#define GM_WQ_PANEL(NAME, UKR, MR_, L_)                                                              \
  struct NAME {                                                                                   \
    static constexpr int MR = MR_, NV = 2, L = L_;                                                \
    template <int R, int V, int LAST>                                                             \
    static GM_WQ_FI void ukr(long kc, const float* a, const float* b, long ldb, float* c, long ldc, \
                             const float* bias) {                                                 \
      UKR<R, V, LAST, false>(kc, a, kc, b, ldb, c, ldc, bias, true);                              \
    }                                                                                             \
  };
#if defined(__AVX512F__)
GM_WQ_PANEL(gm_wq_p512, gm_gemm_ukr_avx512, 8, 16)
#endif
#if defined(__AVX2__) && defined(__FMA__)
GM_WQ_PANEL(gm_wq_p256, gm_gemm_ukr_avx2, 6, 8)
#endif
GM_WQ_PANEL(gm_wq_pc, gm_gemm_ukr_c, 4, 8)

// panel[k][j] = w[n0 + j][k] * scale[n0 + j] for j < nc, 0 beyond: the reference's weight
template <class W>
GM_WQ_FI void gm_wq_widen_panel(const W* __restrict w, const float* __restrict scale, long K, long n0, long nc,
                                long nblk, float* __restrict panel) {
  const W* w0 = w + n0 * K;
  const float* s0 = scale + n0;
  for (long k = 0; k < K; ++k) {         // nc strided row streams in, one contiguous panel row out
    float* __restrict pk = panel + k * nblk;
    for (long j = 0; j < nc; ++j) pk[j] = gm_wq_scalar(w0[j * K + k]) * s0[j];
    for (long j = nc; j < nblk; ++j) pk[j] = 0.0f;
  }
}

template <class P, int R, int V, int LAST>
GM_WQ_FI void gm_wq_prest(long rem, const float* x, long K, const float* panel, long ldp, float* y, long N,
                          const float* b) {
  if (rem == R) P::template ukr<R, V, LAST>(K, x, panel, ldp, y, N, b);
  else if constexpr (R > 1) gm_wq_prest<P, R - 1, V, LAST>(rem, x, K, panel, ldp, y, N, b);
}

template <class P, int V, int LAST>
GM_WQ_FI void gm_wq_prows(const float* x, long M, long K, const float* panel, long ldp, float* y, long N,
                          const float* b) {
  long m = 0;
  for (; m + P::MR <= M; m += P::MR) P::template ukr<P::MR, V, LAST>(K, x + m * K, panel, ldp, y + m * N, N, b);
  if (m < M) {
    if constexpr (P::MR > 1) gm_wq_prest<P, P::MR - 1, V, LAST>(M - m, x + m * K, K, panel, ldp, y + m * N, N, b);
  }
}

// Output columns [n0, n1) of y [M, N], a panel of NV * L columns at a time (`panel`: K x that
// many floats of scratch); TV / TLAST: the vectors and lanes of the last, narrower block of N
// (TV = 0: N is a whole number of blocks).
template <class P, int TV, int TLAST, class W>
GM_WQ_FI void gm_wq_panels(const float* __restrict x, const W* __restrict w, const float* __restrict scale,
                           const float* __restrict bias, float* __restrict y, long M, long N, long K, long n0,
                           long n1, float* __restrict panel) {
  constexpr long NBLK = P::NV * P::L;
  for (long n = n0; n < n1; n += NBLK) {
    const long nc = n1 - n < NBLK ? n1 - n : NBLK;
    gm_wq_widen_panel(w, scale, K, n, nc, NBLK, panel);
    const float* bn = bias ? bias + n : 0;
    if (nc == NBLK) gm_wq_prows<P, P::NV, P::L>(x, M, K, panel, NBLK, y + n, N, bn);
    else if constexpr (TV > 0) gm_wq_prows<P, TV, TLAST>(x, M, K, panel, NBLK, y + n, N, bn);
  }
}
#endif

