// The K-quant super-blocks (Q4_K, Q6_K: the types of the usual Q4_K_M files) as both of their files read
// them: kquants.cpp (the GEMV / GEMM kernels) and kquant_layout.cpp (packing, dequantization).
//
// Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks of 32), 128
//   bytes of nibbles (bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c+1 in the high ones);
//   w = (d*sc)*q - dmin*m, each product and the difference rounded to fp32 (no FMA), as gguf does.
// Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per
//   16 weights), fp16 d; w = (d*scale) * (q - 32).
//
// The packed layout (AVX-512 builds; quant.h): per group of 16 rows and super-block (rows padded to a
// multiple of 16 with zero blocks):
//   Q4_K (2368 bytes = 16 x 148, 0.578 bytes a weight): d[16] fp16 | dmin[16] fp16 | sc[8][16] |
//     m[8][16] (the 6-bit scales and mins unpacked, a byte each, sub-block-major) | qs[32][16][4]
//     with qs[c][r][i] = byte 4c+i of row r's 128 nibble bytes (the GGUF nibble order: byte 32p+k
//     holds weight 64p+k in its low nibble, 64p+32+k in its high one)
//   Q6_K (3360 bytes = 16 x 210, as GGUF: 0.820 bytes a weight): d[16] fp16 | sc[16][16] int8 |
//     per 32 weights a: ql[4][16][4] | qh[2][16][4]: ql byte (c, r, i) holds the low 4 bits of weight
//     32a+4c+i (low nibble) and 32a+16+4c+i (high nibble); qh byte (h, r, i) the high 2 bits of
//     32a+8h+i, 32a+16+8h+i, 32a+8h+4+i, 32a+16+8h+4+i in bits 0-1, 2-3, 4-5, 6-7
// Computed on as quant.h says: Q4_K per sub-block (d sc) * sum(q x) - (dmin m) * sum(x), Q6_K per 16
// weights (d sc) * sum((q - 32) x); int8 activations: integer dot products per sub-block (Q4_K: 32
// weights) or per 16 weights (Q6_K: q - 32 via the block's int8 sum, times the int8 scale, exact in int32).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include "quant.h"

namespace kquants {

constexpr int QK = 256;                         // weights per super-block
enum QType : int64_t { Q4_K = 12, Q6_K = 14 };  // GGML's type ids

template <int QT>
constexpr int64_t block_bytes() {
  return QT == Q4_K ? 144 : 210;
}

// Q4_K sub-block j's (d * scale, dmin * min), as gguf's get_scale_min unpacks the 12 bytes
inline void q4k_scale_min(const uint8_t* b, int j, float& dsc, float& dm) {
  const uint8_t* s = b + 4;
  int sc, m;
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
  dsc = h2f(b) * static_cast<float>(sc);
  dm = h2f(b + 2) * static_cast<float>(m);
}

#if defined(__AVX2__) && defined(__F16C__)
// All 8 of Q4_K's (d * scale) and (dmin * min) at once: the 12 bytes unpacked with 32-bit masks (as
// llama.cpp does) into 8 scale bytes then 8 min bytes, widened and multiplied in one vector each
inline void q4k_scales_mins(const uint8_t* b, float* dsc, float* dm) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);  // mins 4-7
  const uint32_t mins_lo = u[1] & m6;                     // mins 0-3
  u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);         // scales 4-7
  u[2] = mins_lo;
  u[0] &= m6;  // scales 0-3
  const __m128i v = _mm_loadu_si128((const __m128i*)u);
  _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(h2f(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
  _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(h2f(b + 2)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
}
#endif

// Q6_K weight e's 6-bit value minus 32 (the llama.cpp layout gguf's reshapes spell out)
inline int q6k_value(const uint8_t* b, int e) {
  const int h = e / 128, r = e % 128;
  const int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 15;
  const int hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
  return (lo | (hi << 4)) - 32;
}

inline float q6k_scale(const uint8_t* b, int g) {  // d * scale of weights 16g..16g+15
  return h2f(b + 208) * static_cast<float>(static_cast<int8_t>(b[192 + g]));
}

// ---- one super-block -> fp32 vectors, in order, per instruction set: f(i, v) gets weights
// [i*W, (i+1)*W) -------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int TILE = 8;  // x rows per pass (2 accumulators each: 16 zmm)
template <int QT, typename F>
void superblock(const uint8_t* b, F&& f) {
  if constexpr (QT == Q4_K) {
    // a sub-block's 32 weights take one of 16 values: compute them (the reference's arithmetic)
    // and look each weight up by its nibble (vpermps reads the low 4 bits of each lane)
    const V lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    alignas(32) float dsc[8], dm[8];
    q4k_scales_mins(b, dsc, dm);
#pragma GCC unroll 4  // constant vector indices: each accumulator stays in its register
    for (int c = 0; c < 4; ++c) {
      const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 + 32 * c)));
      const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 + 32 * c + 16)));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        const V t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dsc[j]), lanes), _mm512_set1_ps(dm[j]));
        f(4 * c + 2 * h, _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q0, 4) : q0, t));
        f(4 * c + 2 * h + 1, _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q1, 4) : q1, t));
      }
    }
  } else {
    // d * scale of each 16 weights, one lane each (the reference's fp32 products)
    alignas(64) float dsc[16];
    _mm512_store_ps(
        dsc,
        _mm512_mul_ps(_mm512_set1_ps(h2f(b + 208)),
                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192))))));
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
    alignas(64) int8_t q[QK];  // the 6-bit values minus 32, widened from memory below (no lane extracts)
    for (int h = 0; h < 2; ++h) {
      // 128 weights as bytes: r < 64 take the low nibbles of ql, r >= 64 the high ones; the 2 high
      // bits are qh's bits 0-1, 2-3, 4-5, 6-7 for r in quarters (16-bit shifts leak bits across
      // bytes only above the ones masked)
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      const __m512i qhx = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      _mm512_store_si512(q + 128 * h,
                         _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(ql, m4),
                                                         _mm512_slli_epi16(_mm512_and_si512(qhx, m3), 4)),
                                         k32));
      _mm512_store_si512(
          q + 128 * h + 64,
          _mm512_sub_epi8(
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                              _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhx, 4), m3), 4)),
              k32));
    }
#pragma GCC unroll 16  // constant vector indices: each accumulator stays in its register
    for (int i = 0; i < QK / QSimd::W; ++i)
      f(i, _mm512_mul_ps(_mm512_set1_ps(dsc[i]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                     _mm_load_si128((const __m128i*)(q + 16 * i))))));
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int TILE = 4;  // 2 accumulators per x row: 8 of the 16 ymm
inline __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
template <int QT, typename F>
void superblock(const uint8_t* b, F&& f) {
  if constexpr (QT == Q4_K) {
    alignas(32) float dsc[8], dm[8];
    q4k_scales_mins(b, dsc, dm);
#pragma GCC unroll 8  // constant vector indices: each accumulator stays in its register
    for (int j = 0; j < 8; ++j) {
      const V vd = _mm256_set1_ps(dsc[j]), vm = _mm256_set1_ps(dm[j]);
      const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m256i q = _mm256_and_si256(_mm256_srl_epi32(bytes8(b + 16 + 32 * (j / 2) + 8 * k), shift),
                                           _mm256_set1_epi32(15));
        const V w = _mm256_sub_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(q)), vm);
        f(4 * j + k, w);
      }
    }
  } else {
#pragma GCC unroll 32
    for (int i = 0; i < QK / QSimd::W; ++i) {
      const int h = i / 16, r = 8 * (i % 16);
      const __m256i lo =
          _mm256_and_si256(_mm256_srl_epi32(bytes8(b + h * 64 + r % 64), _mm_cvtsi32_si128(4 * (r / 64))),
                           _mm256_set1_epi32(15));
      const __m256i hi = _mm256_and_si256(
          _mm256_srl_epi32(bytes8(b + 128 + h * 32 + r % 32), _mm_cvtsi32_si128(2 * (r / 32))),
          _mm256_set1_epi32(3));
      const __m256i q =
          _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
      const V w = _mm256_mul_ps(_mm256_set1_ps(q6k_scale(b, i / 2)), _mm256_cvtepi32_ps(q));
      f(i, w);
    }
  }
}
#else
constexpr int TILE = 4;
template <int QT, typename F>
void superblock(const uint8_t* b, F&& f) {
  for (int j = 0; j < QK / 32; ++j) {
    float dsc = 0.f, dm = 0.f;
    if constexpr (QT == Q4_K) q4k_scale_min(b, j, dsc, dm);
    for (int i = 32 * j; i < 32 * j + 32; ++i) {
      float w;
      if constexpr (QT == Q4_K) {
        w = dsc * static_cast<float>((b[16 + 32 * (j / 2) + i % 32] >> (4 * (j % 2))) & 15) - dm;
      } else {
        w = q6k_scale(b, i / 16) * static_cast<float>(q6k_value(b, i));
      }
      f(i, w);
    }
  }
}
#endif

// bytes a [N, K] matrix's row (block layout) or group of 16 rows (packed) holds per super-block
int64_t block_bytes_of(int64_t qtype);
// a block matrix [N, K/256 * block bytes], or a packed one [ceil(N / 16), K/256 * packed bytes]
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, int64_t N);

// f(std::integral_constant<int, QT>()) for a K-quant type (+ PACKED or not)
template <typename F>
void by_type(int64_t qtype, F&& f) {
  if ((qtype & ~PACKED) == Q4_K)
    f(std::integral_constant<int, Q4_K>());
  else
    f(std::integral_constant<int, Q6_K>());
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int QT>
constexpr int64_t packed_bytes() {
  return QT == Q4_K ? 2368 : 3360;
}
constexpr int Q6_QL = 288, Q6_A = 384;  // Q6_K: where the quants start; bytes per 32 weights

inline __m512 load_h(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline __m512i load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }

// Q6_K: the 6-bit values of 32a+4c+i (lo) and 32a+16+4c+i (hi) of 16 rows, a byte each
inline void q6_bytes(const uint8_t* blk, int c, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i ql = _mm512_loadu_si512(blk + 64 * c), qh = _mm512_loadu_si512(blk + 256 + 64 * (c / 2));
  // the high bits moved to bits 4-5, the rest cleared
#if defined(__GFNI__)
  // one affine map a byte: output bit i is the parity of (matrix byte 7-i & input), so bits 4 and 5
  // take input bits s and s+1
  auto bits45 = [&](int s) {
    return _mm512_gf2p8affine_epi64_epi8(
        qh, _mm512_set1_epi64((int64_t{1} << s << 24) | (int64_t{2} << s << 16)), 0);
  };
  const __m512i hlo = bits45(4 * (c % 2)), hhi = bits45(4 * (c % 2) + 2);
  (void)m30;
#else  // 16-bit shifts: the bits kept come from the same byte
  const __m512i hlo = _mm512_and_si512(c % 2 ? qh : _mm512_slli_epi16(qh, 4), m30);
  const __m512i hhi = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(qh, 2) : _mm512_slli_epi16(qh, 2), m30);
#endif
  lo = _mm512_ternarylogic_epi32(ql, hlo, m4, 0xE4);  // m4 ? ql : h, bit by bit
  hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hhi, m4, 0xE4);
}
#endif

}  // namespace kquants
