// graphmode generated CPU kernels: int4 x q8 linear micro-kernels (q4gemm.py, qlinear act q8).
// y[m, n] = sum over blocks b of 32 along K of (sum_k r[m, k] * (q[n, k] - 8)) * (s[n, b] * d[m, b])
// (+ bias[n]): the weight is symmetric group-32 int4 codes (ir/ops/int4.py: byte j of a group
// holds code j and code j + 16), x is quantized once per call to int8 codes r with a scale d
// per block (llama.cpp q8_0's rule, int4.quantize_activations). The integer block sums are
// exact: unsigned codes times signed r in one u8 x s8 dot instruction (AVX-512 VNNI vpdpbusd;
// AVX-512BW / AVX2 vpmaddubsw + vpmaddwd), started from -8 * sum(r) of the block so the sum
// is over q - 8; each block's sum then meets s * d in one f32 FMA. Traits per ISA: AVX-512
// two blocks a step (64 codes, lanes 0-7 / 8-15 per block), AVX2 one (32 codes), portable C.

#ifndef GM_Q4Q8_H
#define GM_Q4Q8_H
@include wgemm.h

// x [M, K] as q8 blocks: codes r (K bytes a row, 64 spare at the end), d and -8 * sum(r) per block
struct gm_q8_act {
  int8_t* r;
  float* d;
  int32_t* c;
  long K, NB;
};

GM_WQ_FI gm_q8_act gm_q8_quantize(const float* __restrict x, long M, long K) {
  gm_q8_act a;
  a.K = K;
  a.NB = K / 32;
  a.r = (int8_t*)malloc(M * K + 64);
  a.d = (float*)malloc(M * a.NB * sizeof(float) + 64);
  a.c = (int32_t*)malloc(M * a.NB * sizeof(int32_t) + 64);
  for (long m = 0; m < M; ++m)
    for (long b = 0; b < a.NB; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = __builtin_fabsf(xb[k]) > amax ? __builtin_fabsf(xb[k]) : amax;
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int k = 0; k < 32; ++k) {
        const int r = (int)__builtin_rintf(xb[k] * id);      // round half to even, as torch.round
        a.r[m * K + b * 32 + k] = (int8_t)r;
        sum += r;
      }
      a.d[m * a.NB + b] = d;
      a.c[m * a.NB + b] = -8 * sum;
    }
  for (int k = 0; k < 64; ++k) a.r[M * K + k] = 0;
  return a;
}

GM_WQ_FI void gm_q8_free(gm_q8_act& a) { free(a.r); free(a.d); free(a.c); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct gm_q8_v512 {
  static constexpr int STEP = 2;             // blocks a step
  typedef __m512 F;
  typedef __m512i I;
  static GM_WQ_FI F zero() { return _mm512_setzero_ps(); }
  static GM_WQ_FI I pidx() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }
  // the 64 codes of blocks b, b + 1 in r's order (n: blocks present, 1 or 2; a missing block's codes are 0)
  static GM_WQ_FI I codes(const uint8_t* p, int n) {
    const I raw = n == 2 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p))
                         : _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i*)p));
    const I bb = _mm512_shuffle_i64x2(raw, raw, 0x50);            // 128-bit lanes: b, b, b + 1, b + 1
    return _mm512_and_si512(_mm512_mask_srli_epi16(bb, 0xFF00FF00u, bb, 4), _mm512_set1_epi8(15));
  }
  // the weight row's two block scales, each over its block's 8 lanes
  static GM_WQ_FI F pair(const float* s, int n) {
    const __m128 v = n == 2 ? _mm_castpd_ps(_mm_load_sd((const double*)s)) : _mm_load_ss(s);
    return _mm512_permutexvar_ps(pidx(), _mm512_castps128_ps512(v));
  }
  // the blocks' -8 * sum(r) in lanes 0 and 8 (0 elsewhere): where the block sums start
  static GM_WQ_FI I start(const int32_t* c, int n) {
    const __m128i v = n == 2 ? _mm_loadl_epi64((const __m128i*)c) : _mm_cvtsi32_si128(c[0]);
    return _mm512_maskz_permutexvar_epi32(0x0101, pidx(), _mm512_castsi128_si512(v));
  }
  static GM_WQ_FI I rows(const int8_t* r) { return _mm512_loadu_si512((const void*)r); }
  static GM_WQ_FI I dot(I acc, I codes, I r) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, codes, r);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, r), _mm512_set1_epi16(1)));
#endif
  }
  static GM_WQ_FI F fma(I sum, F s, F d, F acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, d), acc); }
  static GM_WQ_FI float hsum(F v) { return _mm512_reduce_add_ps(v); }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
struct gm_q8_v256 {
  static constexpr int STEP = 1;
  typedef __m256 F;
  typedef __m256i I;
  static GM_WQ_FI F zero() { return _mm256_setzero_ps(); }
  static GM_WQ_FI I codes(const uint8_t* p, int) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1),
                            _mm256_set1_epi8(15));
  }
  static GM_WQ_FI F pair(const float* s, int) { return _mm256_set1_ps(s[0]); }
  static GM_WQ_FI I start(const int32_t* c, int) { return _mm256_setr_epi32(c[0], 0, 0, 0, 0, 0, 0, 0); }
  static GM_WQ_FI I rows(const int8_t* r) { return _mm256_loadu_si256((const __m256i*)r); }
  static GM_WQ_FI I dot(I acc, I codes, I r) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, r), _mm256_set1_epi16(1)));
  }
  static GM_WQ_FI F fma(I sum, F s, F d, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s, d), acc); }
  static GM_WQ_FI float hsum(F v) { return gm_wq_v256::hsum(v); }
};
#endif
struct gm_q8_vc {                               // one block a step, one lane
  static constexpr int STEP = 1;
  typedef float F;
  struct I { int8_t v[32]; int32_t s; };         // 32 codes, or a block sum
  static GM_WQ_FI F zero() { return 0.0f; }
  static GM_WQ_FI I codes(const uint8_t* p, int) {
    I r;
    for (int k = 0; k < 16; ++k) { r.v[k] = (int8_t)(p[k] & 15); r.v[k + 16] = (int8_t)(p[k] >> 4); }
    return r;
  }
  static GM_WQ_FI F pair(const float* s, int) { return s[0]; }
  static GM_WQ_FI I start(const int32_t* c, int) { I r; r.s = c[0]; return r; }
  static GM_WQ_FI I rows(const int8_t* r) { I v; for (int k = 0; k < 32; ++k) v.v[k] = r[k]; return v; }
  static GM_WQ_FI I dot(I acc, const I& codes, const I& r) {
    for (int k = 0; k < 32; ++k) acc.s += (int)codes.v[k] * (int)r.v[k];
    return acc;
  }
  static GM_WQ_FI F fma(const I& sum, F s, F d, F acc) { return GM_FMA((float)sum.s, s * d, acc); }
  static GM_WQ_FI float hsum(F v) { return v; }
};

// One MR x NR tile: q8 rows a.r + m * K.., weight rows n0..n0 + NR, outputs y[i * ldy + j].
template <class QT, int MR, int NR>
GM_WQ_FI void gm_q8_tile(const gm_q8_act& a, long m, const uint8_t* __restrict w, const float* __restrict sc,
                         long n0, const float* __restrict bias, float* __restrict y, long ldy) {
  const long K = a.K, NB = a.NB, KB = K / 2;
  typename QT::F acc[MR][NR];
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = QT::zero();
  for (long b = 0; b < NB; b += QT::STEP) {
    const int nb = NB - b < QT::STEP ? (int)(NB - b) : QT::STEP;
    typename QT::I c[NR];
    typename QT::F s[NR];
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      const uint8_t* wj = w + (n0 + j) * KB + b * 16;
      c[j] = QT::codes(wj, nb);
      s[j] = QT::pair(sc + (n0 + j) * NB + b, nb);
      __builtin_prefetch(wj + 4 * NR * KB, 0, 1);          // rows four tiles ahead, into L2
    }
    GM_WQ_UNROLL for (int i = 0; i < MR; ++i) {
      const long row = (m + i) * NB + b;
      const typename QT::I r = QT::rows(a.r + (m + i) * K + b * 32), st = QT::start(a.c + row, nb);
      const typename QT::F d = QT::pair(a.d + row, nb);
      GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = QT::fma(QT::dot(st, c[j], r), s[j], d, acc[i][j]);
    }
  }
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      const float v = QT::hsum(acc[i][j]);
      y[i * ldy + j] = bias ? v + bias[n0 + j] : v;
    }
}

template <class QT, int R, int NR>
GM_WQ_FI void gm_q8_rest(long rem, const gm_q8_act& a, long m, const uint8_t* w, const float* sc, long n,
                         const float* b, float* y, long ldy) {
  if (rem == R) gm_q8_tile<QT, R, NR>(a, m, w, sc, n, b, y, ldy);
  else if constexpr (R > 1) gm_q8_rest<QT, R - 1, NR>(rem, a, m, w, sc, n, b, y, ldy);
}

// rows [m0, m1) against weight rows n..n + NR: full MR-row tiles, then one of the rows left
template <class QT, int MR, int NR>
GM_WQ_FI void gm_q8_rows(const gm_q8_act& a, const uint8_t* w, const float* sc, const float* b, float* y, long N,
                         long m0, long m1, long n) {
  long m = m0;
  for (; m + MR <= m1; m += MR) gm_q8_tile<QT, MR, NR>(a, m, w, sc, n, b, y + m * N + n, N);
  if (m < m1) {
    if constexpr (MR > 1) gm_q8_rest<QT, MR - 1, NR>(m1 - m, a, m, w, sc, n, b, y + m * N + n, N);
  }
}

template <class QT, int MR, int C>
GM_WQ_FI void gm_q8_narrow(long nr, const gm_q8_act& a, const uint8_t* w, const float* sc, const float* b, float* y,
                           long N, long m0, long m1, long n) {
  if (nr == C) gm_q8_rows<QT, MR, C>(a, w, sc, b, y, N, m0, m1, n);
  else if constexpr (C > 1) gm_q8_narrow<QT, MR, C - 1>(nr, a, w, sc, b, y, N, m0, m1, n);
}

// Output columns [n0, n1) of y [M, N]: rows in chunks of 32 (their q8 codes stay in L2 while
// this range's weights stream through once per chunk), NR columns at a time.
template <class QT, int MR, int NR>
GM_WQ_FI void gm_q8_cols(const gm_q8_act& a, const uint8_t* __restrict w, const float* __restrict sc,
                         const float* __restrict bias, float* __restrict y, long M, long N, long n0, long n1) {
  for (long m0 = 0; m0 < M; m0 += 32) {
    const long m1 = m0 + 32 < M ? m0 + 32 : M;
    for (long n = n0; n < n1; n += NR) {
      const long nr = n1 - n < NR ? n1 - n : NR;
      if (nr == NR) gm_q8_rows<QT, MR, NR>(a, w, sc, bias, y, N, m0, m1, n);
      else if constexpr (NR > 1) gm_q8_narrow<QT, MR, NR - 1>(nr, a, w, sc, bias, y, N, m0, m1, n);
    }
  }
}
#endif
