// Vector pieces the kernel modules share (cpu_kernels.cpp, quant_kernels.cpp, kquant_kernels.cpp); each
// module's build key covers this header too (layers/cpu_kernels.py)
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstdint>

// 2^x in fp32, 16 lanes, finite x (VSCALEFPS saturates to 0 or inf): 2^round(x) * 2^r, |r| <= 1/2, by
// Cephes' degree-6 exp2f polynomial (~1 ulp)
inline __m512 exp2_16f(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  for (float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                  6.931472028550421e-1f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// silu(v) = v / (1 + e^-v) in fp32, 16 lanes; the exponent is clamped to +-126, where silu is already v
// or -0 to fp32 precision
inline __m512 silu16(__m512 v) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-126.f), _mm512_min_ps(_mm512_set1_ps(126.f),
                                 _mm512_mul_ps(v, _mm512_set1_ps(-1.44269504088896341f))));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), exp2_16f(x)));
}

// A packed kernel's tile: res[t] holds 16 output columns of x row t, `rows` of them real. Stored as O,
// with GLU first combined with the up projection's tile: silu(gate) * up in fp32, rounded once (unfused,
// gate and up would each be rounded, written, and read back)
template <bool GLU, typename O>
inline void store_tile(__m512* res, const __m512* res_up, int64_t nt, int rows, O* out, int64_t ldo) {
  alignas(64) float lane[16];
  for (int64_t t = 0; t < nt; ++t) {
    if constexpr (GLU) res[t] = _mm512_mul_ps(silu16(res[t]), res_up[t]);
    _mm512_store_ps(lane, res[t]);
    for (int r = 0; r < rows; ++r) out[t * ldo + r] = static_cast<O>(lane[r]);
  }
}
#endif
