// graphmode generated CPU kernels: the body of a fused attention kernel (attention.py).
// Instantiated inside each kernel's own namespace, after the shape constants (H, SQ, SK, D,
// E, QB, NQB, SKP, MSB..MSJ, MASK, CAUSAL, mask_t, and each operand's batch / head / row
// strides: Q_SB, Q_SH, QLD, ...) and the tile loops @SYM@_qk / @SYM@_pv
// that attention.py writes for those shapes; @SYM@ is the kernel's symbol.
// row_extent finds how far a mask row attends (causal and right-padded masks skip dead
// keys); task runs one (batch, head, query block): K^T packed once per head, S = Q K^T,
// masked softmax in two passes with 16 partial sums, O = P V.

// keys this row attends lie below the returned index (0: none)
GM_INLINE long row_extent(const mask_t* __restrict m, long kend) {
  if (MASK == 0) return kend;
  if (MSJ == 0) return (MASK == 1 ? m[0] != 0 : m[0] != -GM_INF) ? kend : 0;
  long j = kend;
  if (MASK == 1) {
    while (j >= 8) {
      __UINT64_TYPE__ w; __builtin_memcpy(&w, (const uint8_t*)m + j - 8, 8);
      if (w) break;
      j -= 8;
    }
    while (j > 0 && !m[j - 1]) --j;
  } else {
    while (j > 0 && m[j - 1] == -GM_INF) --j;
  }
  return j;
}

// one (batch, head, query block): kt holds this head's K^T when *cached == bh
void task(const float* __restrict q, const float* __restrict k, const float* __restrict v,
          const mask_t* __restrict m, float* __restrict o, long t, float* __restrict kt,
          float* __restrict s, float* __restrict rs, long* cached) {
  (void)m;
  const long bh = t / NQB, i0 = (t % NQB) * QB, b = bh / H, h = bh % H;
  const long nrows = SQ - i0 < QB ? SQ - i0 : QB;
  const float* qp = q + b * Q_SB + h * Q_SH + i0 * QLD;
  const float* vp = v + b * V_SB + h * V_SH;
  float* op = o + b * O_SB + h * O_SH + i0 * OLD;
  const mask_t* mp = m ? m + (bh / H) * MSB + (bh % H) * MSH + i0 * MSI : (const mask_t*)0;
  long kend = SK;
  if (CAUSAL) kend = i0 + nrows < SK ? i0 + nrows : SK;
  if (MASK != 0) {
    long ext = 0;
    const long rows = MSI == 0 ? 1 : nrows;
    for (long r = 0; r < rows && ext < kend; ++r) {
      const long x = row_extent(mp + r * MSI, kend);
      ext = x > ext ? x : ext;
    }
    kend = ext;
  }
  if (kend == 0) {   // no row of the block attends any key: torch returns zeros
    for (long r = 0; r < nrows; ++r)
      for (long x = 0; x < E; ++x) op[r * OLD + x] = EMPTY_NAN ? GM_NAN : 0.0f;
    return;
  }
  if (*cached != bh) {
    gm_attn_transpose<VT>(k + b * K_SB + h * K_SH, SK, D, KLD, kt, SKP);
    *cached = bh;
  }
  const long nvec = (kend + VL - 1) / VL;
  @SYM@_qk(qp, kt, s, nrows, nvec);
  const long kend16 = (kend + 15) & ~15L;   // score rows are padded to SKP, a multiple of 16
  for (long r = 0; r < nrows; ++r) {
    float* __restrict sr = s + r * SKP;
    const mask_t* __restrict mr = mp + r * MSI;
    const long i = i0 + r;
    (void)mr; (void)i;
    float mx = -GM_INF;
    #pragma omp simd reduction(max:mx)
    for (long j = 0; j < kend; ++j) {
      float x = sr[j];
      if (MASK == 1) x = x + (mr[j * MSJ] ? 0.0f : -GM_INF);   // as torch: a masked NaN stays NaN
      if (MASK == 2) x = x + (float)mr[j * MSJ];
      if (CAUSAL) x = j <= i ? x : -GM_INF;
      sr[j] = x;
      mx = mx > x ? mx : x;
    }
    if (!(mx > -GM_INF)) {   // no attended key (or only NaN scores): 0 like torch, NaN if a NaN
      bool nan = false;
      for (long j = 0; j < kend; ++j) { nan |= sr[j] != sr[j]; sr[j] = 0.0f; }
      rs[r] = nan || EMPTY_NAN ? GM_NAN : 0.0f;
      continue;
    }
    for (long j = kend; j < kend16; ++j) sr[j] = -GM_INF;
    rs[r] = 1.0f / gm_attn_exp_sum(sr, kend16, mx);
  }
  @SYM@_pv(s, vp, rs, op, nrows, kend);
}
