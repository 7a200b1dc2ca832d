// graphmode generated CPU kernels: the body of a paged KV-cache attention kernel (paged.py).
// Instantiated inside each kernel's own namespace, after the shape constants (B, H, KVH, G,
// S, D, E, PAGES, PAGE, MAXP, TB, NTB, TASKS, SCALE, PAR_WORK), the pool element type KV and
// the vector traits VT that paged.py writes; uses the traits of attention.h. check() validates one sequence, write()
// scatters its new keys/values into the pools, row() attends one query row over the cache
// (scores L keys at a time, reduced across lanes by hsums; softmax with 16 partial sums;
// P V accumulated in registers over E, page by page), task() runs (sequence, kv head, rows).

constexpr long DV = D / VT::L, DT = D % VT::L;     // whole vectors and the tail of a key row

// Pool elements (KV, from paged.py): f32, or bf16 (gm_u16: the top half of an f32, written
// rounded to nearest even as torch converts, a NaN as 0x7FC0) widened when read.
GM_ATTN_FI VT::V kv_load(const float* p) { return VT::load(p); }
template <int N> GM_ATTN_FI VT::V kv_loadn(const float* p) { return VT::template loadn<N>(p); }
GM_ATTN_FI float kv_f32(gm_u16 x) { return gm_bits_f32((int32_t)((uint32_t)x << 16)); }
GM_ATTN_FI VT::V kv_load(const gm_u16* p) {
  float t[VT::L];
  GM_ATTN_UNROLL for (int l = 0; l < VT::L; ++l) t[l] = kv_f32(p[l]);
  return VT::load(t);
}
template <int N> GM_ATTN_FI VT::V kv_loadn(const gm_u16* p) {
  float t[VT::L];
  GM_ATTN_UNROLL for (int l = 0; l < N; ++l) t[l] = kv_f32(p[l]);
  return VT::template loadn<N>(t);
}
// f16 (gm_h16: IEEE binary16), widened exactly and written rounded to nearest even as torch
// converts (past 65504 to inf at the halfway point and beyond, a NaN as a quiet NaN of its sign).
GM_ATTN_FI float kv_f32(gm_h16 x) {
  const uint32_t h = x.b, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {                                         // zero or subnormal: m x 2^-24, exact in f32
    const float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  const uint32_t u = sign | (e == 0x1fu ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
  return gm_bits_f32((int32_t)u);
}
// a whole vector of halves by the ISA's own conversion (exact, like kv_f32): one instruction
// where element by element a decode step's attention ran 1.4x (b=1) to 2.2x (b=4) the f32 pool's
#if defined(__AVX512F__)
GM_ATTN_FI VT::V kv_load(const gm_h16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
GM_ATTN_FI VT::V kv_load(const gm_h16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
GM_ATTN_FI VT::V kv_load(const gm_h16* p) {
  float t[VT::L];
  GM_ATTN_UNROLL for (int l = 0; l < VT::L; ++l) t[l] = kv_f32(p[l]);
  return VT::load(t);
}
#endif
template <int N> GM_ATTN_FI VT::V kv_loadn(const gm_h16* p) {
  float t[VT::L];
  GM_ATTN_UNROLL for (int l = 0; l < N; ++l) t[l] = kv_f32(p[l]);
  return VT::template loadn<N>(t);
}
GM_INLINE gm_h16 kv_h16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  uint32_t h;
  if (a > 0x7f800000u) h = 0x7e00u;                     // NaN
  else if (a >= 0x477ff000u) h = 0x7c00u;               // 65520 and up (inf too) round to inf
  else if (a >= 0x38800000u) h = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);   // normal: 2^-14 up
  else {                                                // subnormal or zero: units of 2^-24, nearest even
    float v;
    __builtin_memcpy(&v, &a, 4);
    h = (uint32_t)__builtin_rintf(v * 16777216.0f);
  }
  gm_h16 out;
  out.b = (gm_u16)(sign | h);
  return out;
}
GM_INLINE void kv_put(gm_h16* __restrict dst, const float* __restrict src, long n) {
  for (long x = 0; x < n; ++x) dst[x] = kv_h16(src[x]);
}
GM_INLINE void kv_put(float* __restrict dst, const float* __restrict src, long n) {
  __builtin_memcpy(dst, src, n * sizeof(float));
}
GM_INLINE void kv_put(gm_u16* __restrict dst, const float* __restrict src, long n) {
  for (long x = 0; x < n; ++x) {
    uint32_t u;
    __builtin_memcpy(&u, src + x, 4);
    dst[x] = (u & 0x7fffffffu) > 0x7f800000u ? (gm_u16)0x7FC0 : (gm_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}
constexpr long EV = E / VT::L, ET = E % VT::L;     // ... of a value row
constexpr long NE = EV + (ET ? 1 : 0);

// v[u] = sum of the lanes of a[u], u < L: one vector of L sums (a lane transpose and add tree)
#if defined(__AVX512F__)
GM_ATTN_FI __m512 hsums(const __m512* a) {
  __m512 t[8], w[4], x[2];
  GM_ATTN_UNROLL for (int i = 0; i < 8; ++i)   // 128-bit block b: [a2i, a2i+1] partial sums, 2 each
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  GM_ATTN_UNROLL for (int i = 0; i < 4; ++i)   // block b: keys 4i..4i+3, one partial sum each
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  GM_ATTN_UNROLL for (int i = 0; i < 2; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
GM_ATTN_FI __m256 hsums(const __m256* a) {
  __m256 t[4], w[2];
  GM_ATTN_UNROLL for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  GM_ATTN_UNROLL for (int i = 0; i < 2; ++i)
    w[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
}
#else
GM_ATTN_FI gm_attn_vc::V hsums(const gm_attn_vc::V* a) {
  gm_attn_vc::V r;
  for (int u = 0; u < 8; ++u) {
    float x = 0.0f;
    for (int l = 0; l < 8; ++l) x += a[u].x[l];
    r.x[u] = x;
  }
  return r;
}
#endif

// the pool row of cache position j of kv head g (row width W) through a sequence's table row
GM_INLINE long pool_row(const int64_t* __restrict tab, long j, long g, long w) {
  return ((tab[j / PAGE] * PAGE + j % PAGE) * KVH + g) * w;
}

// 0: nothing to do (lens <= 0), 1: valid, 2: positions outside the table or a page outside the pool
GM_INLINE int check(const int64_t* __restrict tab, long s0, long n) {
  if (n <= 0) return 0;
  if (n > S || s0 < 0 || s0 > MAXP * PAGE - n) return 2;
  for (long p = 0; p <= (s0 + n - 1) / PAGE; ++p)
    if (tab[p] < 0 || tab[p] >= PAGES) return 2;
  return 1;
}

// keys / values of positions s0 .. s0 + n - 1 of sequence i into their pool rows
GM_INLINE void write(const float* __restrict k, const float* __restrict v, KV* kp, KV* vp,
                     const int64_t* __restrict tab, long i, long s0, long n) {
  for (long g = 0; g < KVH; ++g)
    for (long t = 0; t < n; ++t) {
      kv_put(kp + pool_row(tab, s0 + t, g, D), k + ((i * KVH + g) * S + t) * D, D);
      kv_put(vp + pool_row(tab, s0 + t, g, E), v + ((i * KVH + g) * S + t) * E, E);
    }
}

// s[j] = e^(score_j - max) over cache positions j0 .. j0 + n - 1 of kv head g (s: n rounded up
// to 16 floats and one vector more); returns their sum, the max in *mx_out
GM_INLINE float exp_scores(const float* __restrict q, const KV* __restrict kp, const int64_t* __restrict tab,
                           long g, long j0, long n, float* __restrict s, float* mx_out) {
  typedef VT::V V;
  constexpr long L = VT::L;
  V qv[DV + 1];
  GM_ATTN_UNROLL for (long c = 0; c < DV; ++c) qv[c] = VT::load(q + c * L);
  if (DT) qv[DV] = VT::loadn<DT ? DT : 1>(q + DV * L);
  const V sc = VT::set1(SCALE);
  for (long b0 = 0; b0 < n; b0 += L) {
    V acc[L];
    GM_ATTN_UNROLL for (long u = 0; u < L; ++u) {
      acc[u] = VT::zero();
      if (b0 + u < n) {
        const KV* kr = kp + pool_row(tab, j0 + b0 + u, g, D);
        GM_ATTN_UNROLL for (long c = 0; c < DV; ++c) acc[u] = VT::fma(qv[c], kv_load(kr + c * L), acc[u]);
        if (DT) acc[u] = VT::fma(qv[DV], kv_loadn<DT ? DT : 1>(kr + DV * L), acc[u]);
      }
    }
    VT::store(s + b0, VT::mul(hsums(acc), sc));
  }
  const long n16 = (n + 15) & ~15L;
  float mx = -GM_INF;
  #pragma omp simd reduction(max:mx)
  for (long j = 0; j < n; ++j) mx = mx > s[j] ? mx : s[j];
  for (long j = n; j < n16; ++j) s[j] = -GM_INF;
  *mx_out = mx;
  return gm_attn_exp_sum(s, n16, mx);
}

// o[E] = softmax(q . k_j * SCALE) v_j over cache positions j < ext of kv head g; s: ext rounded
// up to 16 floats of scratch
GM_INLINE void row(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                   const int64_t* __restrict tab, long g, long ext, float* __restrict s, float* __restrict o) {
  typedef VT::V V;
  constexpr long L = VT::L;
  float mx;
  const float sum = exp_scores(q, kp, tab, g, 0, ext, s, &mx);
  V acc[NE];
  GM_ATTN_UNROLL for (long u = 0; u < NE; ++u) acc[u] = VT::zero();
  for (long p0 = 0; p0 < ext; p0 += PAGE) {
    const KV* vr = vp + pool_row(tab, p0, g, E);
    const long m = ext - p0 < PAGE ? ext - p0 : PAGE;
    for (long j = 0; j < m; ++j, vr += KVH * E) {
      const V pj = VT::set1(s[p0 + j]);
      GM_ATTN_UNROLL for (long u = 0; u < EV; ++u) acc[u] = VT::fma(pj, kv_load(vr + u * L), acc[u]);
      if (ET) acc[EV] = VT::fma(pj, kv_loadn<ET ? ET : 1>(vr + EV * L), acc[EV]);
    }
  }
  const V r = VT::set1(1.0f / sum);
  GM_ATTN_UNROLL for (long u = 0; u < EV; ++u) VT::store(o + u * L, VT::mul(acc[u], r));
  if (ET) VT::storen<ET ? ET : 1>(o + EV * L, VT::mul(acc[EV], r));
}

// task t: sequence i, kv head g, query rows t0 .. t0 + TB - 1 of its G query heads
GM_INLINE void task(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                    const int64_t* __restrict table, const int64_t* __restrict start, const int64_t* __restrict lens,
                    const uint8_t* __restrict ok, float* __restrict o, long t, float* __restrict s) {
  const long i = t / (KVH * NTB), g = (t / NTB) % KVH, t0 = (t % NTB) * TB;
  const long t1 = t0 + TB < S ? t0 + TB : S;
  const long n = ok[i] == 1 ? lens[i] : 0, s0 = start[i];
  for (long hh = 0; hh < G; ++hh) {
    const long h = g * G + hh;
    for (long tt = t0; tt < t1; ++tt) {
      float* orow = o + ((i * H + h) * S + tt) * E;
      if (tt < n) row(q + ((i * H + h) * S + tt) * D, kp, vp, table + i * MAXP, g, s0 + tt + 1, s, orow);
      else for (long x = 0; x < E; ++x) orow[x] = 0.0f;
    }
  }
}

// Decode rows (S == 1) split the context instead (paged.py: generate_paged): one task per
// (sequence, kv head, SPLIT cache positions), each the partial softmax of its G query heads over
// its positions, written as {max, sum of e^(score - max), sum of e^(score - max) v} to `part`;
// the caller merges a head's parts in position order (merge()). Rows of one kv head, one task
// each, left a 2-thread team one long task behind the other (3 kv heads) and read the cache at
// one thread's rate. A row's parts depend on its own context only: bits equal alone or batched.
GM_INLINE void partial(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                       const int64_t* __restrict tab, long g, long j0, long j1, float* __restrict part) {
  typedef VT::V V;
  constexpr long L = VT::L;
  alignas(64) float s[SPLIT + 16];
  const long n = j1 - j0;
  float mx;
  const float sum = exp_scores(q, kp, tab, g, j0, n, s, &mx);
  V acc[NE];
  GM_ATTN_UNROLL for (long u = 0; u < NE; ++u) acc[u] = VT::zero();
  for (long j = 0; j < n; ++j) {
    const KV* vr = vp + pool_row(tab, j0 + j, g, E);
    const V pj = VT::set1(s[j]);
    GM_ATTN_UNROLL for (long u = 0; u < EV; ++u) acc[u] = VT::fma(pj, kv_load(vr + u * L), acc[u]);
    if (ET) acc[EV] = VT::fma(pj, kv_loadn<ET ? ET : 1>(vr + EV * L), acc[EV]);
  }
  part[0] = mx;
  part[1] = sum;
  GM_ATTN_UNROLL for (long u = 0; u < EV; ++u) VT::store(part + 2 + u * L, acc[u]);
  if (ET) VT::storen<ET ? ET : 1>(part + 2 + EV * L, acc[EV]);
}

// task t of the decode split: sequence i (tasks off[i] .. off[i + 1]), kv head g, part c
GM_INLINE void split_task(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                          const int64_t* __restrict table, const int64_t* __restrict start,
                          const long* __restrict off, long nparts, float* __restrict part, long t) {
  long i = 0;
  while (off[i + 1] <= t) ++i;
  const long ns = (off[i + 1] - off[i]) / KVH, r = t - off[i];
  const long g = r / ns, c = r % ns;
  const long ext = start[i] + 1, j0 = c * SPLIT, j1 = j0 + SPLIT < ext ? j0 + SPLIT : ext;
  for (long hh = 0; hh < G; ++hh) {
    const long h = g * G + hh;
    partial(q + (i * H + h) * D, kp, vp, table + i * MAXP, g, j0, j1, part + ((i * H + h) * nparts + c) * (2 + E));
  }
}

// o[E] of one head from its ns parts: each part's sums rescaled to the largest max, in order
GM_INLINE void merge(const float* __restrict part, long ns, float* __restrict o) {
  float mx = -GM_INF;
  for (long c = 0; c < ns; ++c) mx = mx > part[c * (2 + E)] ? mx : part[c * (2 + E)];
  float sum = 0.0f;
  float acc[E];
  for (long x = 0; x < E; ++x) acc[x] = 0.0f;
  for (long c = 0; c < ns; ++c) {
    const float* p = part + c * (2 + E);
    const float w = ns == 1 ? 1.0f : gm_expf(p[0] - mx);
    sum = GM_FMA(p[1], w, sum);
    #pragma omp simd
    for (long x = 0; x < E; ++x) acc[x] = GM_FMA(p[2 + x], w, acc[x]);
  }
  const float r = 1.0f / sum;
  #pragma omp simd
  for (long x = 0; x < E; ++x) o[x] = acc[x] * r;
}
