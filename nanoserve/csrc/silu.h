// silu for the packed kernels' fused gate/up epilogue (quant_kernels.cpp, kquant_kernels.cpp); the build
// key of each module covers this header too (layers/cpu_kernels.py)
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

// silu(v) = v / (1 + e^-v) in fp32, 16 lanes: e^-v as 2^n * 2^r, |r| <= 1/2, by Cephes' degree-6 exp2
// polynomial (~1 ulp); the exponent is clamped to +-126, where silu is already v or -0 to fp32 precision
inline __m512 silu16(__m512 v) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-126.f), _mm512_min_ps(_mm512_set1_ps(126.f),
                                 _mm512_mul_ps(v, _mm512_set1_ps(-1.44269504088896341f))));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  for (float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                  6.931472028550421e-1f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_scalef_ps(p, n)));
}
#endif
