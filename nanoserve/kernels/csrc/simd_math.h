// exp2 and silu in vectors, for the attention softmax (vec.h) and the quantized GLU (quant.h)
#pragma once
#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Cephes' exp2f polynomial for 2^r, |r| <= 1/2 (~1 ulp), highest degree first: every vector width's exp2
constexpr float kExp2Poly[7] = {1.535336188319500e-4f,
                                1.339887440266574e-3f,
                                9.618437357674640e-3f,
                                5.550332471162809e-2f,
                                2.402264791363012e-1f,
                                6.931472028550421e-1f,
                                1.f};

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 2^x for x in [-126, 0], 8 lanes: 2^round(x) * 2^r by kExp2Poly; the power of two built in the exponent
// field (AVX2 has no VSCALEFPS)
inline __m256 exp2_8f(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
// 2^x in fp32, 16 lanes, finite x (VSCALEFPS saturates to 0 or inf): 2^round(x) * 2^r by kExp2Poly
// (VSCALEFPS takes the power of two)
inline __m512 exp2_16f(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// silu(v) = v / (1 + e^-v) in fp32, 16 lanes; the exponent is clamped to +-126, where silu is already v
// or -0 to fp32 precision
inline __m512 silu16(__m512 v) {
  const __m512 x = _mm512_max_ps(
      _mm512_set1_ps(-126.f),
      _mm512_min_ps(_mm512_set1_ps(126.f), _mm512_mul_ps(v, _mm512_set1_ps(-1.44269504088896341f))));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), exp2_16f(x)));
}
#endif
