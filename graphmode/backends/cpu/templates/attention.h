// graphmode generated CPU kernels: the fused attention micro-kernels (attention.py).
// Vector traits per ISA (AVX-512: 16 lanes, AVX2+FMA: 8, portable C: 8) and, templated over
// them, the Q K^T tile (scores scaled at the store), the P V tile (rows scaled by 1/sum,
// masked on the value-dim tail) and the K -> K^T transpose in L x L register blocks.

#ifndef GM_ATTN_COMMON_H
#define GM_ATTN_COMMON_H
@include simd.h
#define GM_ATTN_UNROLL _Pragma("GCC unroll 64")
#define GM_ATTN_FI __attribute__((always_inline)) inline

// Vector traits: L lanes; loadn/storen touch only the first N lanes (the E tail of V / O).
#if defined(__AVX512F__)
struct gm_attn_v512 {
  typedef __m512 V;
  static constexpr int L = 16;
  static GM_ATTN_FI V zero() { return _mm512_setzero_ps(); }
  static GM_ATTN_FI V set1(float x) { return _mm512_set1_ps(x); }
  static GM_ATTN_FI V load(const float* p) { return _mm512_loadu_ps(p); }
  template <int N> static GM_ATTN_FI V loadn(const float* p) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << N) - 1u), p);
  }
  static GM_ATTN_FI V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static GM_ATTN_FI V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static GM_ATTN_FI void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  template <int N> static GM_ATTN_FI void storen(float* p, V x) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << N) - 1u), x);
  }
  // dst[c][r] = src[r][c] for a 16 x 16 block (unpack / shuffle / lane-permute stages)
  static GM_ATTN_FI void tblock(const float* __restrict src, long lds, float* __restrict dst, long ldd) {
    __m512 r[16], t[16];
    GM_ATTN_UNROLL for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
    GM_ATTN_UNROLL for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    GM_ATTN_UNROLL for (int i = 0; i < 4; ++i) {
      r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    GM_ATTN_UNROLL for (int i = 0; i < 4; ++i) {
      t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
      t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
      t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
      t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
    }
    GM_ATTN_UNROLL for (int i = 0; i < 8; ++i) {
      _mm512_storeu_ps(dst + i * ldd, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
      _mm512_storeu_ps(dst + (8 + i) * ldd, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
    }
  }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
struct gm_attn_v256 {
  typedef __m256 V;
  static constexpr int L = 8;
  template <int N> static GM_ATTN_FI __m256i lanes() {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(N), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static GM_ATTN_FI V zero() { return _mm256_setzero_ps(); }
  static GM_ATTN_FI V set1(float x) { return _mm256_set1_ps(x); }
  static GM_ATTN_FI V load(const float* p) { return _mm256_loadu_ps(p); }
  template <int N> static GM_ATTN_FI V loadn(const float* p) { return _mm256_maskload_ps(p, lanes<N>()); }
  static GM_ATTN_FI V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static GM_ATTN_FI V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static GM_ATTN_FI void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  template <int N> static GM_ATTN_FI void storen(float* p, V x) { _mm256_maskstore_ps(p, lanes<N>(), x); }
  // dst[c][r] = src[r][c] for an 8 x 8 block
  static GM_ATTN_FI void tblock(const float* __restrict src, long lds, float* __restrict dst, long ldd) {
    __m256 r[8], t[8];
    GM_ATTN_UNROLL for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    GM_ATTN_UNROLL for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    GM_ATTN_UNROLL for (int i = 0; i < 2; ++i) {
      r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    GM_ATTN_UNROLL for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
      _mm256_storeu_ps(dst + (4 + i) * ldd, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
    }
  }
};
#endif
// Portable C: 8 lanes as a struct of floats (the compiler vectorises what it can).
struct gm_attn_vc {
  struct V { float x[8]; };
  static constexpr int L = 8;
  static GM_ATTN_FI V zero() { V r; for (int l = 0; l < 8; ++l) r.x[l] = 0.0f; return r; }
  static GM_ATTN_FI V set1(float a) { V r; for (int l = 0; l < 8; ++l) r.x[l] = a; return r; }
  static GM_ATTN_FI V load(const float* p) { V r; for (int l = 0; l < 8; ++l) r.x[l] = p[l]; return r; }
  template <int N> static GM_ATTN_FI V loadn(const float* p) {
    V r; for (int l = 0; l < 8; ++l) r.x[l] = l < N ? p[l] : 0.0f; return r;
  }
  static GM_ATTN_FI V fma(V a, V b, V c) {
    V r; for (int l = 0; l < 8; ++l) r.x[l] = GM_FMA(a.x[l], b.x[l], c.x[l]); return r;
  }
  static GM_ATTN_FI V mul(V a, V b) { V r; for (int l = 0; l < 8; ++l) r.x[l] = a.x[l] * b.x[l]; return r; }
  static GM_ATTN_FI void store(float* p, V a) { for (int l = 0; l < 8; ++l) p[l] = a.x[l]; }
  template <int N> static GM_ATTN_FI void storen(float* p, V a) { for (int l = 0; l < N; ++l) p[l] = a.x[l]; }
  static GM_ATTN_FI void tblock(const float* __restrict src, long lds, float* __restrict dst, long ldd) {
    for (int c = 0; c < 8; ++c)
      for (int r = 0; r < 8; ++r) dst[c * ldd + r] = src[r * lds + c];
  }
};

// S[MR x NV*L] = (A[MR x kd] * B[kd x NV*L]) * scale: A rows broadcast (Q, row-major), B rows as
// vectors (K^T, padded to whole vectors, so no masking).
template <class T, int MR, int NV>
GM_INLINE void gm_attn_qk(long kd, const float* __restrict a, long lda, const float* __restrict b, long ldb,
                          float* __restrict c, long ldc, float scale) {
  typename T::V acc[MR][NV];
  GM_ATTN_UNROLL for (int i = 0; i < MR; ++i)
    GM_ATTN_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = T::zero();
  for (long d = 0; d < kd; ++d) {
    typename T::V bv[NV];
    GM_ATTN_UNROLL for (int v = 0; v < NV; ++v) bv[v] = T::load(b + d * ldb + v * T::L);
    GM_ATTN_UNROLL for (int i = 0; i < MR; ++i) {
      const typename T::V av = T::set1(a[i * lda + d]);
      GM_ATTN_UNROLL for (int v = 0; v < NV; ++v) acc[i][v] = T::fma(av, bv[v], acc[i][v]);
    }
  }
  const typename T::V sc = T::set1(scale);
  GM_ATTN_UNROLL for (int i = 0; i < MR; ++i)
    GM_ATTN_UNROLL for (int v = 0; v < NV; ++v) T::store(c + i * ldc + v * T::L, T::mul(acc[i][v], sc));
}

// O[MR x ((NV-1)*L + LAST)] = (P[MR x kj] * V[kj x ...]) * r[i]: P broadcast, V rows as vectors
// (the last vector masked to LAST lanes: V and O rows end there).
template <class T, int MR, int NV, int LAST>
GM_INLINE void gm_attn_pv(long kj, const float* __restrict p, long ldp, const float* __restrict v, long ldv,
                          const float* __restrict r, float* __restrict o, long ldo) {
  typename T::V acc[MR][NV];
  GM_ATTN_UNROLL for (int i = 0; i < MR; ++i)
    GM_ATTN_UNROLL for (int u = 0; u < NV; ++u) acc[i][u] = T::zero();
  for (long j = 0; j < kj; ++j) {
    typename T::V vv[NV];
    GM_ATTN_UNROLL for (int u = 0; u < NV; ++u)
      vv[u] = (u == NV - 1 && LAST < T::L) ? T::template loadn<LAST>(v + j * ldv + u * T::L)
                                           : T::load(v + j * ldv + u * T::L);
    GM_ATTN_UNROLL for (int i = 0; i < MR; ++i) {
      const typename T::V pv = T::set1(p[i * ldp + j]);
      GM_ATTN_UNROLL for (int u = 0; u < NV; ++u) acc[i][u] = T::fma(pv, vv[u], acc[i][u]);
    }
  }
  GM_ATTN_UNROLL for (int i = 0; i < MR; ++i) {
    const typename T::V ri = T::set1(r[i]);
    GM_ATTN_UNROLL for (int u = 0; u < NV; ++u) {
      if (u == NV - 1 && LAST < T::L) T::template storen<LAST>(o + i * ldo + u * T::L, T::mul(acc[i][u], ri));
      else T::store(o + i * ldo + u * T::L, T::mul(acc[i][u], ri));
    }
  }
}

// K^T [d][ldt] from K [sk][d] (rows `ldk` floats apart): whole L x L blocks in registers, the
// edges scalar.
template <class T>
GM_INLINE void gm_attn_transpose(const float* __restrict k, long sk, long d, long ldk, float* __restrict kt,
                                 long ldt) {
  constexpr long L = T::L;
  const long sk0 = sk - sk % L, d0 = d - d % L;
  for (long j = 0; j < sk0; j += L) {
    for (long c = 0; c < d0; c += L) T::tblock(k + j * ldk + c, ldk, kt + c * ldt + j, ldt);
    for (long c = d0; c < d; ++c)
      for (long jj = j; jj < j + L; ++jj) kt[c * ldt + jj] = k[jj * ldk + c];
  }
  for (long c = 0; c < d; ++c)
    for (long jj = sk0; jj < sk; ++jj) kt[c * ldt + jj] = k[jj * ldk + c];
}
// s[0 .. n16) <- exp(s - mx), returning their sum; n16 is a multiple of 16. Arguments below
// -87 give exactly 0 (s - mx <= 0: only weights under 1.7e-38 of the row's largest, and
// masked keys at -inf). 16 partial sums and a tree at the end: an `omp simd reduction(+)`
// ends in a chain of 16 dependent scalar adds per row (no reassociation without -ffast-math).
GM_INLINE float gm_attn_exp_sum(float* __restrict s, long n16, float mx) {
  float part[16];
  for (int l = 0; l < 16; ++l) part[l] = 0.0f;
  for (long j0 = 0; j0 < n16; j0 += 16) {
    #pragma omp simd
    for (int l = 0; l < 16; ++l) {
      const float x = s[j0 + l] - mx;
      const float e = x < -87.0f ? 0.0f : gm_expf_nc(x);
      s[j0 + l] = e;
      part[l] += e;
    }
  }
  for (int w = 8; w > 0; w >>= 1)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}
#endif  // GM_ATTN_COMMON_H
