// graphmode generated CPU kernels: int4 x q8 linear micro-kernels (q4gemm.py, qlinear act q8).
// y[m, n] = sum over blocks b of 32 along K of (sum_k r[m, k] * (q[n, k] - 8)) * (s[n, b] * d[m, b])
// (+ bias[n]): the weight is symmetric group-32 int4 codes (ir/ops/int4.py: byte j of a group
// holds code j and code j + 16), x is quantized once per call to int8 codes r with a scale d
// per block (llama.cpp q8_0's rule, int4.quantize_activations). The integer block sums are
// exact: unsigned codes times signed r in one u8 x s8 dot instruction (AVX-512 VNNI vpdpbusd;
// AVX-512BW / AVX2 vpmaddubsw + vpmaddwd), started from -8 * sum(r) of the block so the sum
// is over q - 8; each block's sum then meets s * d in one f32 FMA. Traits per ISA: AVX-512
// four blocks a step (64 bytes of a weight row: a mask and a shift give the low and the high
// nibbles, which meet x codes stored in that order, lanes 4t..4t + 3 per block t), AVX2 one
// block (32 codes), portable C.

#ifndef GM_Q4Q8_H
#define GM_Q4Q8_H
@include wgemm.h

// x [M, K] as q8 blocks: codes r, d and -8 * sum(r) per block; a row holds NBP = K / 32 rounded
// up to whole steps of STEP blocks (the blocks beyond K are zero). SWZ (AVX-512): a step's
// codes are stored as the first halves of its STEP blocks, then their second halves, the
// order in which the step unpacks the weights' low and high nibbles.
struct gm_q8_act {
  int8_t* r;
  float* d;
  int32_t* c;
};

template <int STEP> constexpr long gm_q8_nbp(long K) { return (K / 32 + STEP - 1) / STEP * STEP; }

template <int STEP, bool SWZ>
GM_WQ_FI gm_q8_act gm_q8_quantize(const float* __restrict x, long M, long K) {
  gm_q8_act a;
  const long NB = K / 32, NBP = gm_q8_nbp<STEP>(K);
  a.r = (int8_t*)malloc(M * NBP * 32);
  a.d = (float*)malloc(M * NBP * sizeof(float));
  a.c = (int32_t*)malloc(M * NBP * sizeof(int32_t));
  __builtin_memset(a.r, 0, M * NBP * 32);
  __builtin_memset(a.d, 0, M * NBP * sizeof(float));
  __builtin_memset(a.c, 0, M * NBP * sizeof(int32_t));
  for (long m = 0; m < M; ++m)
    for (long b = 0; b < NB; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = __builtin_fabsf(xb[k]) > amax ? __builtin_fabsf(xb[k]) : amax;
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* rb = a.r + m * NBP * 32 + (SWZ ? b / STEP * STEP * 32 + b % STEP * 16 : b * 32);
      int sum = 0;
      for (int k = 0; k < 32; ++k) {
        const int r = (int)__builtin_rintf(xb[k] * id);      // round half to even, as torch.round
        rb[SWZ ? k / 16 * STEP * 16 + k % 16 : k] = (int8_t)r;
        sum += r;
      }
      a.d[m * NBP + b] = d;
      a.c[m * NBP + b] = -8 * sum;
    }
  return a;
}

GM_WQ_FI void gm_q8_free(gm_q8_act& a) { free(a.r); free(a.d); free(a.c); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct gm_q8_v512 {
  static constexpr int STEP = 4;             // blocks a step: 64 bytes of a weight row
  static constexpr bool SWZ = true;
  typedef __m512 F;
  static GM_WQ_FI F zero() { return _mm512_setzero_ps(); }
  static GM_WQ_FI __m512i dot(__m512i acc, __m512i codes, __m512i r) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, codes, r);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, r), _mm512_set1_epi16(1)));
#endif
  }
  static GM_WQ_FI float hsum(F v) { return _mm512_reduce_add_ps(v); }
  // NBK blocks from block b: the low nibbles of the 16 NBK bytes meet the steps' first halves,
  // the high nibbles the second halves; lanes 4t..4t + 3 hold block b + t's sum, which starts
  // at -8 * sum(r) and ends times s * d
  template <int MR, int NR, long K, int NBK>
  static GM_WQ_FI void step(F (&acc)[MR][NR], const gm_q8_act& a, long m, const uint8_t* __restrict w,
                            const float* __restrict sc, long n0, long b) {
    constexpr long NB = K / 32, KB = K / 2, NBP = gm_q8_nbp<STEP>(K);
    constexpr __mmask64 BYTES = NBK == 4 ? ~0ull : (1ull << (16 * NBK)) - 1;
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i lo4 = _mm512_set1_epi8(15);
    __m512i lo[NR], hi[NR];
    F s[NR];
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      const uint8_t* wj = w + (n0 + j) * KB + b * 16;
      const __m512i v = NBK == 4 ? _mm512_loadu_si512((const void*)wj) : _mm512_maskz_loadu_epi8(BYTES, wj);
      lo[j] = _mm512_and_si512(v, lo4);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
      const float* sj = sc + (n0 + j) * NB + b;
      s[j] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
          NBK == 4 ? _mm_loadu_ps(sj) : _mm_maskz_loadu_ps((__mmask8)((1u << NBK) - 1), sj)));
      __builtin_prefetch(wj + 4 * NR * KB, 0, 1);          // rows four tiles ahead, into L2
    }
    GM_WQ_UNROLL for (int i = 0; i < MR; ++i) {
      const long row = (m + i) * NBP + b;
      const int8_t* r = a.r + (m + i) * NBP * 32 + b * 32;
      const __m512i rl = _mm512_loadu_si512((const void*)r), rh = _mm512_loadu_si512((const void*)(r + 64));
      const __m512i st = _mm512_maskz_permutexvar_epi32(0x1111, spread,
                                                        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(a.c + row))));
      const F d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(a.d + row)));
      GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
        const __m512i sum = dot(dot(st, lo[j], rl), hi[j], rh);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s[j], d), acc[i][j]);
      }
    }
  }
};
#endif
#if defined(__AVX2__) && defined(__FMA__)
struct gm_q8_v256 {
  static constexpr int STEP = 1;
  static constexpr bool SWZ = false;
  typedef __m256 F;
  typedef __m256i I;
  static GM_WQ_FI F zero() { return _mm256_setzero_ps(); }
  static GM_WQ_FI I codes(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1),
                            _mm256_set1_epi8(15));
  }
  static GM_WQ_FI F scale(const float* s) { return _mm256_set1_ps(s[0]); }
  static GM_WQ_FI I start(const int32_t* c) { return _mm256_setr_epi32(c[0], 0, 0, 0, 0, 0, 0, 0); }
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
  static constexpr bool SWZ = false;
  typedef float F;
  struct I { int8_t v[32]; int32_t s; };         // 32 codes, or a block sum
  static GM_WQ_FI F zero() { return 0.0f; }
  static GM_WQ_FI I codes(const uint8_t* p) {
    I r;
    for (int k = 0; k < 16; ++k) { r.v[k] = (int8_t)(p[k] & 15); r.v[k + 16] = (int8_t)(p[k] >> 4); }
    return r;
  }
  static GM_WQ_FI F scale(const float* s) { return s[0]; }
  static GM_WQ_FI I start(const int32_t* c) { I r; r.s = c[0]; return r; }
  static GM_WQ_FI I rows(const int8_t* r) { I v; for (int k = 0; k < 32; ++k) v.v[k] = r[k]; return v; }
  static GM_WQ_FI I dot(I acc, const I& codes, const I& r) {
    for (int k = 0; k < 32; ++k) acc.s += (int)codes.v[k] * (int)r.v[k];
    return acc;
  }
  static GM_WQ_FI F fma(const I& sum, F s, F d, F acc) { return GM_FMA((float)sum.s, s * d, acc); }
  static GM_WQ_FI float hsum(F v) { return v; }
};

// One block of a tile (AVX2, portable): block b into the accumulators.
template <class QT, int MR, int NR, long K>
GM_WQ_FI void gm_q8_step(typename QT::F (&acc)[MR][NR], const gm_q8_act& a, long m, const uint8_t* __restrict w,
                         const float* __restrict sc, long n0, long b) {
  constexpr long NB = K / 32, KB = K / 2;
  typename QT::I c[NR];
  typename QT::F s[NR];
  GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
    const uint8_t* wj = w + (n0 + j) * KB + b * 16;
    c[j] = QT::codes(wj);
    s[j] = QT::scale(sc + (n0 + j) * NB + b);
    __builtin_prefetch(wj + 4 * NR * KB, 0, 1);            // rows four tiles ahead, into L2
  }
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i) {
    const long row = (m + i) * NB + b;
    const typename QT::I r = QT::rows(a.r + row * 32), st = QT::start(a.c + row);
    const typename QT::F d = QT::scale(a.d + row);
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = QT::fma(QT::dot(st, c[j], r), s[j], d, acc[i][j]);
  }
}

// One MR x NR tile: q8 rows m..m + MR, weight rows n0..n0 + NR, outputs y[i * ldy + j]
// (K, a multiple of 32, a constant: the threads' outlined loop keeps it one).
template <class QT, int MR, int NR, long K>
GM_WQ_FI void gm_q8_tile(const gm_q8_act& a, long m, const uint8_t* __restrict w, const float* __restrict sc,
                         long n0, const float* __restrict bias, float* __restrict y, long ldy) {
  typename QT::F acc[MR][NR];
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) acc[i][j] = QT::zero();
  long b = 0;
  constexpr long NB = K / 32;
  if constexpr (QT::SWZ) {
    for (; b + QT::STEP <= NB; b += QT::STEP) QT::template step<MR, NR, K, QT::STEP>(acc, a, m, w, sc, n0, b);
    if constexpr (NB % QT::STEP != 0) QT::template step<MR, NR, K, (int)(NB % QT::STEP)>(acc, a, m, w, sc, n0, b);
  } else {
    for (; b < NB; ++b) gm_q8_step<QT, MR, NR, K>(acc, a, m, w, sc, n0, b);
  }
  GM_WQ_UNROLL for (int i = 0; i < MR; ++i)
    GM_WQ_UNROLL for (int j = 0; j < NR; ++j) {
      const float v = QT::hsum(acc[i][j]);
      y[i * ldy + j] = bias ? v + bias[n0 + j] : v;
    }
}

template <class QT, int R, int NR, long K>
GM_WQ_FI void gm_q8_rest(long rem, const gm_q8_act& a, long m, const uint8_t* w, const float* sc, long n,
                         const float* b, float* y, long ldy) {
  if (rem == R) gm_q8_tile<QT, R, NR, K>(a, m, w, sc, n, b, y, ldy);
  else if constexpr (R > 1) gm_q8_rest<QT, R - 1, NR, K>(rem, a, m, w, sc, n, b, y, ldy);
}

// rows [m0, m1) against weight rows n..n + NR: full MR-row tiles, then one of the rows left
template <class QT, int MR, int NR, long K>
GM_WQ_FI void gm_q8_rows(const gm_q8_act& a, const uint8_t* w, const float* sc, const float* b, float* y, long N,
                         long m0, long m1, long n) {
  long m = m0;
  for (; m + MR <= m1; m += MR) gm_q8_tile<QT, MR, NR, K>(a, m, w, sc, n, b, y + m * N + n, N);
  if (m < m1) {
    if constexpr (MR > 1) gm_q8_rest<QT, MR - 1, NR, K>(m1 - m, a, m, w, sc, n, b, y + m * N + n, N);
  }
}

template <class QT, int MR, int C, long K>
GM_WQ_FI void gm_q8_narrow(long nr, const gm_q8_act& a, const uint8_t* w, const float* sc, const float* b, float* y,
                           long N, long m0, long m1, long n) {
  if (nr == C) gm_q8_rows<QT, MR, C, K>(a, w, sc, b, y, N, m0, m1, n);
  else if constexpr (C > 1) gm_q8_narrow<QT, MR, C - 1, K>(nr, a, w, sc, b, y, N, m0, m1, n);
}

// Output columns [n0, n1) of y [M, N]: rows in chunks of 32 (their q8 codes stay in L2 while
// this range's weights stream through once per chunk), NR columns at a time.
template <class QT, int MR, int NR, long K>
GM_WQ_FI void gm_q8_cols(const gm_q8_act& a, const uint8_t* __restrict w, const float* __restrict sc,
                         const float* __restrict bias, float* __restrict y, long M, long N, long n0, long n1) {
  for (long m0 = 0; m0 < M; m0 += 32) {
    const long m1 = m0 + 32 < M ? m0 + 32 : M;
    for (long n = n0; n < n1; n += NR) {
      const long nr = n1 - n < NR ? n1 - n : NR;
      if (nr == NR) gm_q8_rows<QT, MR, NR, K>(a, w, sc, bias, y, N, m0, m1, n);
      else if constexpr (NR > 1) gm_q8_narrow<QT, MR, NR - 1, K>(nr, a, w, sc, bias, y, N, m0, m1, n);
    }
  }
}
#endif
