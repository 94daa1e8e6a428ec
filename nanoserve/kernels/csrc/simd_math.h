// Vector pieces the kernel modules share (cpu_kernels.cpp, quant_kernels.cpp, kquant_kernels.cpp); each
// module's build key covers this header too (kernels/cpu_kernels.py)
#pragma once
#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Cephes' exp2f polynomial for 2^r, |r| <= 1/2 (~1 ulp), highest degree first: every vector width's exp2
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};

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

// 32 bf16 activations (their bits) rounded to int8 with their own scale, absmax / 127, as llama.cpp's
// Q8 blocks (vcvtps2dq rounds to nearest even, as nearbyint does in the default rounding mode). Returns
// the scale; sums[i] = the int8 values' sum of each 16. The packed kernels' activations, a block at a
// time; 7% of an 8192-token prefill's CPU time before it lost its cross-lane widening, clamps and two of
// its three horizontal reductions (the sums now in SAD)
inline float quantize_block32(const uint16_t* x, int8_t* q, int32_t sums[2]) {
  const __m512i raw = _mm512_loadu_si512(x);
  // each 32-bit lane holds elements 2i, 2i+1: the even one as fp32 once shifted up, the odd one once
  // its low half is cleared
  const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  const __m512 od = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(ev), _mm512_abs_ps(od)));
  const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // |x| <= amax, so |x| * fl(127 / amax) rounds to at most 127: no clamp
  const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(ev, id)), qo = _mm512_cvtps_epi32(_mm512_mul_ps(od, id));
  // the two bytes of each lane back in element order, then 16 lanes' low words = the 32 bytes
  const __m256i bytes = _mm512_cvtepi32_epi16(
      _mm512_or_si512(_mm512_and_si512(qe, _mm512_set1_epi32(0xFF)), _mm512_slli_epi32(qo, 8)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  // each 8 bytes' sum, read unsigned (+128 each)
  const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80))),
                                      _mm256_setzero_si256());
  const __m128i lo = _mm256_castsi256_si128(sad), hi = _mm256_extracti128_si256(sad, 1);
  sums[0] = static_cast<int32_t>(_mm_cvtsi128_si64(lo) + _mm_extract_epi64(lo, 1)) - 16 * 128;
  sums[1] = static_cast<int32_t>(_mm_cvtsi128_si64(hi) + _mm_extract_epi64(hi, 1)) - 16 * 128;
  return amax / 127.f;
}

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
