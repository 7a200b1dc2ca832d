// graphmode generated CPU kernels: int4 weight-only linear micro-kernels (q4gemm.py).
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w stored as 4-bit codes, two a byte,
// in groups of G along K (ir/ops/int4.py): byte j of a group holds code j (low nibble) and
// code j + G/2 (high nibble); the group's weight is (q - z) * s. A tile of MR rows of x by NR
// rows of w keeps MR x NR f32 vector accumulators; per step, L bytes of each weight row widen
// to 32-bit lanes, the mask and the shift split them into two runs of L codes, each becomes
// f32 exactly as the reference does ((q - z) exact in integers, then times s; AVX-512: a
// permute through the group's 16 weights so computed) and meets MR vectors of x in an FMA. Traits per ISA (AVX-512: 16 lanes, AVX2+FMA: 8, portable C: 8).
// Many rows (prefill) take the panel path: a block of columns is dequantized once into an f32
// panel that gemm.h's micro-kernels stream for every row tile (wgemm.h's row dispatch).

#ifndef GM_Q4GEMM_H
#define GM_Q4GEMM_H
@include wgemm.h

#if defined(__AVX512F__)
struct gm_q4_v512 {
  typedef __m512 V;
  typedef __m512i I;
  static constexpr int L = 16;
  static GM_WQ_FI V zero() { return _mm512_setzero_ps(); }
  static GM_WQ_FI V load(const float* p) { return _mm512_loadu_ps(p); }
  // a group's 16 weights (q - z) * s for q = 0..15 fill one register, so a code becomes its
  // weight in one permute (which reads the index's low 4 bits: no mask for the low nibbles)
  typedef V T;
  static GM_WQ_FI T group(float s, int z) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(z))),
        _mm512_set1_ps(s));
  }
  // L bytes -> the weights of their low nibbles, of their high nibbles
  static GM_WQ_FI void dequant(const uint8_t* p, T table, V& lo, V& hi) {
    const I b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = _mm512_permutexvar_ps(b, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
  static GM_WQ_FI V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static GM_WQ_FI float hsum(V x) { return _mm512_reduce_add_ps(x); }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
struct gm_q4_v256 {
  typedef __m256 V;
  typedef __m256i I;
  static constexpr int L = 8;
  static GM_WQ_FI V zero() { return _mm256_setzero_ps(); }
  static GM_WQ_FI V load(const float* p) { return _mm256_loadu_ps(p); }
  struct T { I z; V s; };
  static GM_WQ_FI T group(float s, int z) { return T{_mm256_set1_epi32(z), _mm256_set1_ps(s)}; }
  static GM_WQ_FI void dequant(const uint8_t* p, const T& t, V& lo, V& hi) {
    const I b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), t.z)), t.s);
    hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), t.z)), t.s);
  }
  static GM_WQ_FI V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static GM_WQ_FI float hsum(V x) { return gm_wq_v256::hsum(x); }
};
#endif
struct gm_q4_vc {
  typedef gm_wq_vc::V V;
  static constexpr int L = 8;
  static GM_WQ_FI V zero() { return gm_wq_vc::zero(); }
  static GM_WQ_FI V load(const float* p) { return gm_wq_vc::load(p); }
  struct T { int z; float s; };
  static GM_WQ_FI T group(float s, int z) { return T{z, s}; }
  static GM_WQ_FI void dequant(const uint8_t* p, const T& t, V& lo, V& hi) {
    GM_WQ_UNROLL for (int i = 0; i < 8; ++i) {
      lo.v[i] = (float)((int)(p[i] & 15) - t.z) * t.s;
      hi.v[i] = (float)((int)(p[i] >> 4) - t.z) * t.s;
    }
  }
  static GM_WQ_FI V fma(V a, V b, V c) { return gm_wq_vc::fma(a, b, c); }
  static GM_WQ_FI float hsum(V x) { return gm_wq_vc::hsum(x); }
};

// The scale and zero point of group g of weight row n (NG groups a row): asymmetric scales
// hold (s, z) pairs, symmetric ones s alone with z = 8.
template <bool ASYM>
GM_WQ_FI void gm_q4_sz(const float* sc, long NG, long n, long g, float& s, int& z) {
  if constexpr (ASYM) {
    s = sc[2 * (n * NG + g)];
    z = (int)sc[2 * (n * NG + g) + 1];
  } else {
    s = sc[n * NG + g];
    z = 8;
  }
}

// One MR x NR tile: rows x[0..MR) (stride ldx), packed weight rows n0..n0+NR (K / 2 bytes
// each), outputs y[i * ldy + j]; bias may be null.
template <class VT, int MR, int NR, int G, bool ASYM>
GM_WQ_FI void gm_q4_tile(const float* __restrict x, long ldx, const uint8_t* __restrict w, long K,
                         const float* __restrict sc, long n0, const float* __restrict bias, float* __restrict y,
                         long ldy) {
  typename VT::V acc[MR][NR];
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = VT::zero();
  const long KB = K / 2, NG = K / G;
  const uint8_t* wr = w + n0 * KB;
  for (long g = 0; g < NG; ++g) {
    typename VT::T t[NR];
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      float sj; int zj;
      gm_q4_sz<ASYM>(sc, NG, n0 + j, g, sj, zj);
      t[j] = VT::group(sj, zj);
      __builtin_prefetch(wr + (4 * NR + j) * KB + g * (G / 2), 0, 1);   // rows four tiles ahead, into L2
    }
    GM_WQ_UNROLL for (int c = 0; c < G / 2; c += VT::L) {
      typename VT::V lo[NR], hi[NR];
      GM_WQ_UNROLL for (int j = 0; j < NR; ++j) VT::dequant(wr + j * KB + g * (G / 2) + c, t[j], lo[j], hi[j]);
      GM_WQ_UNROLL for (int i = 0; i < MR; ++i) {
        const float* xg = x + i * ldx + g * G + c;
        const typename VT::V xl = VT::load(xg), xh = VT::load(xg + G / 2);
        GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = VT::fma(xh, hi[j], VT::fma(xl, lo[j], acc[i][j]));
      }
    }
  }
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      const float v = VT::hsum(acc[i][j]);
      y[i * ldy + j] = bias ? v + bias[n0 + j] : v;
    }
}

template <class VT, int R, int NR, int G, bool ASYM>
GM_WQ_FI void gm_q4_rest(long rem, const float* x, long K, const uint8_t* w, const float* sc, long n,
                         const float* b, float* y, long ldy) {
  if (rem == R) gm_q4_tile<VT, R, NR, G, ASYM>(x, K, w, K, sc, n, b, y, ldy);
  else if constexpr (R > 1) gm_q4_rest<VT, R - 1, NR, G, ASYM>(rem, x, K, w, sc, n, b, y, ldy);
}

template <class VT, int MR, int NR, int G, bool ASYM>
GM_WQ_FI void gm_q4_rows(const float* x, const uint8_t* w, long K, const float* sc, const float* b, float* y,
                         long N, long m0, long m1, long n) {
  long m = m0;
  for (; m + MR <= m1; m += MR) gm_q4_tile<VT, MR, NR, G, ASYM>(x + m * K, K, w, K, sc, n, b, y + m * N + n, N);
  if (m < m1) {
    if constexpr (MR > 1) gm_q4_rest<VT, MR - 1, NR, G, ASYM>(m1 - m, x + m * K, K, w, sc, n, b, y + m * N + n, N);
  }
}

template <class VT, int MR, int C, int G, bool ASYM>
GM_WQ_FI void gm_q4_narrow(long nr, const float* x, const uint8_t* w, long K, const float* sc, const float* b,
                           float* y, long N, long m0, long m1, long n) {
  if (nr == C) gm_q4_rows<VT, MR, C, G, ASYM>(x, w, K, sc, b, y, N, m0, m1, n);
  else if constexpr (C > 1) gm_q4_narrow<VT, MR, C - 1, G, ASYM>(nr, x, w, K, sc, b, y, N, m0, m1, n);
}

// Output columns [n0, n1) of y [M, N]: rows in chunks of MC (a chunk of x stays in L2 while
// this range's weights stream through once per chunk), NR columns at a time.
template <class VT, int MR, int NR, int G, bool ASYM>
GM_WQ_FI void gm_q4_cols(const float* __restrict x, const uint8_t* __restrict w, const float* __restrict sc,
                         const float* __restrict bias, float* __restrict y, long M, long N, long K, long n0, long n1) {
  constexpr long MC = 32;
  for (long m0 = 0; m0 < M; m0 += MC) {
    const long m1 = m0 + MC < M ? m0 + MC : M;
    for (long n = n0; n < n1; n += NR) {
      const long nr = n1 - n < NR ? n1 - n : NR;
      if (nr == NR) gm_q4_rows<VT, MR, NR, G, ASYM>(x, w, K, sc, bias, y, N, m0, m1, n);
      else if constexpr (NR > 1) gm_q4_narrow<VT, MR, NR - 1, G, ASYM>(nr, x, w, K, sc, bias, y, N, m0, m1, n);
    }
  }
}

// ---- the panel path (many rows) ----------------------------------------------------------
// panel[k][j] = the dequantized w[n0 + j][k] for j < nc, 0 beyond (the reference's weight)
template <int G, bool ASYM>
GM_WQ_FI void gm_q4_dequant_panel(const uint8_t* __restrict w, const float* __restrict sc, long K, long n0, long nc,
                                  long nblk, float* __restrict panel) {
  const long KB = K / 2, NG = K / G;
  for (long j = 0; j < nc; ++j) {
    const uint8_t* wj = w + (n0 + j) * KB;
    for (long g = 0; g < NG; ++g) {
      float s; int z;
      gm_q4_sz<ASYM>(sc, NG, n0 + j, g, s, z);
      for (long c = 0; c < G / 2; ++c) {
        const int b = wj[g * (G / 2) + c];
        panel[(g * G + c) * nblk + j] = (float)((b & 15) - z) * s;
        panel[(g * G + G / 2 + c) * nblk + j] = (float)((b >> 4) - z) * s;
      }
    }
  }
  for (long k = 0; k < K; ++k)
    for (long j = nc; j < nblk; ++j) panel[k * nblk + j] = 0.0f;
}

// Output columns [n0, n1) of y [M, N], a panel of NV * L columns at a time (`panel`: K x that
// many floats of scratch); TV / TLAST: the last, narrower block of N (TV = 0: none).
template <class P, int TV, int TLAST, int G, bool ASYM>
GM_WQ_FI void gm_q4_panels(const float* __restrict x, const uint8_t* __restrict w, const float* __restrict sc,
                           const float* __restrict bias, float* __restrict y, long M, long N, long K, long n0,
                           long n1, float* __restrict panel) {
  constexpr long NBLK = P::NV * P::L;
  for (long n = n0; n < n1; n += NBLK) {
    const long nc = n1 - n < NBLK ? n1 - n : NBLK;
    gm_q4_dequant_panel<G, ASYM>(w, sc, K, n, nc, NBLK, panel);
    const float* bn = bias ? bias + n : 0;
    if (nc == NBLK) gm_wq_prows<P, P::NV, P::L>(x, M, K, panel, NBLK, y + n, N, bn);
    else if constexpr (TV > 0) gm_wq_prows<P, TV, TLAST>(x, M, K, panel, NBLK, y + n, N, bn);
  }
}
#endif
