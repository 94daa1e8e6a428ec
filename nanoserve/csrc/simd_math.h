// Vector pieces the kernel modules share (cpu_kernels.cpp, quant_kernels.cpp, kquant_kernels.cpp); each
// module's build key covers this header too (layers/cpu_kernels.py)
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstdint>

// 32 bf16 activations (their bits) rounded to int8 with their own scale, absmax / 127, as llama.cpp's
// Q8 blocks (vcvtps2dq rounds to nearest even, as nearbyint does in the default rounding mode). Returns
// the scale; sums[i] = the int8 values' sum of each 16. The packed kernels' activations, a block at a time
inline float quantize_block32(const uint16_t* x, int8_t* q, int32_t sums[2]) {
  const __m512i raw = _mm512_loadu_si512(x);
  const __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
  const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
  const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
  const __m512i q0 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(f0, id))));
  const __m512i q1 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(f1, id))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  sums[0] = _mm512_reduce_add_epi32(q0);
  sums[1] = _mm512_reduce_add_epi32(q1);
  return amax / 127.f;
}

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
