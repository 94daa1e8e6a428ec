// The packed layout's GEMV / GEMM for the block types of 32 (Q4_0, Q4_1, Q5_0, Q8_0; layouts:
// quant_blocks.h), AVX-512 builds only: 16 rows a vector, fp32 activations in exact FMAs, bf16 ones
// (AVX512_VNNI) as int8 blocks in integer dot products (quant.h).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include "quant.h"
#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace blocks {
namespace {

// Q5_0: the fifth bit of 64 weights back into the bytes that hold their low 4 bits (lo: the low nibbles of
// qs[c], hi: the high ones, each already in 0..15), from hb's byte masks
__attribute__((always_inline)) inline void add_fifth_bits(const uint8_t* blk, int c, __m512i& lo,
                                                          __m512i& hi) {
  uint64_t m[2];
  std::memcpy(m, blk + 32 + 16 * c, 16);
  const __m512i b4 = _mm512_set1_epi8(16);
  lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m[0]), lo, b4);
  hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m[1]), hi, b4);
}

#if defined(__AVX512VNNI__)
// the integer dot products of one block of a group of 16 rows against NT int8 x rows (exact, so their
// order is free): one chain per x row when there are enough rows to hide vpdpbusd's latency, two
// otherwise; each starts at the type's offset correction (Q4_0: the weights' -8, Q5_0: their -16, Q8_0:
// the +128 of their unsigned reading, each times sum(x))
template <int QT, int NT, int CH>
__attribute__((always_inline)) inline void int8_block_dots(const uint8_t* blk, const PackedX& x, int64_t t0,
                                                           int64_t b, __m512i (*acc)[CH]) {
  constexpr int qo = qs_offset<QT>();
  constexpr int32_t offset = QT == Q4_0 ? -8 : QT == Q5_0 ? -16 : QT == Q8_0 ? -128 : 0;
  const int64_t K = x.nb * QK;
  auto xdword = [&](int t, int j) {  // four int8 activations j..j+3, broadcast
    int32_t v;
    std::memcpy(&v, x.q.get() + (t0 + t) * K + b * QK + j, 4);
    return _mm512_set1_epi32(v);
  };
  for (int t = 0; t < NT; ++t) {
    const int64_t xi = (t0 + t) * x.nb + b;
    acc[t][0] = _mm512_set1_epi32(offset * (x.qsum[2 * xi] + x.qsum[2 * xi + 1]));
    if constexpr (CH == 2) acc[t][CH - 1] = _mm512_setzero_si512();
  }
  if constexpr (QT == Q8_0) {
    // vpdpbusd multiplies unsigned by signed bytes: the weights + 128 (their top bit flipped) times x
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 8; c += 2) {
      const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(blk + qo + c * 64), flip);
      const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(blk + qo + c * 64 + 64), flip);
      for (int t = 0; t < NT; ++t) {
        acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], w0, xdword(t, 4 * c));
        acc[t][CH - 1] = _mm512_dpbusd_epi32(acc[t][CH - 1], w1, xdword(t, 4 * c + 4));
      }
    }
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(blk + qo + c * 64);
      __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if constexpr (QT == Q5_0) add_fifth_bits(blk, c, lo, hi);
      for (int t = 0; t < NT; ++t) {
        acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], lo, xdword(t, 4 * c));
        acc[t][CH - 1] = _mm512_dpbusd_epi32(acc[t][CH - 1], hi, xdword(t, 4 * c + 16));
      }
    }
  }
}

// one group of 16 rows against NT int8 x rows: the integer dot products a block, then per row one fp32
// step a block in a fixed order: tot += (d_w d_x) * dot (+ m_w * d_x * sum)
template <int QT, int NT>
inline void packed_group_int8(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  constexpr int bb = block_bytes<QT>(), CH = NT >= 4 ? 1 : 2;
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = group + b * G * bb;
    __m512i acc[NT][CH];
    int8_block_dots<QT, NT, CH>(blk, x, t0, b, acc);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    const __m512 m = QT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32))) : d;
    for (int t = 0; t < NT; ++t) {
      const int64_t xi = (t0 + t) * x.nb + b;
      const __m512i dot = CH == 2 ? _mm512_add_epi32(acc[t][0], acc[t][CH - 1]) : acc[t][0];
      tot[t] =
          _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale[xi])), _mm512_cvtepi32_ps(dot), tot[t]);
      if constexpr (QT == Q4_1) tot[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[xi]), tot[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}
#endif

// one group of 16 rows against NT fp32 x rows: res[t] = the 16 rows' results for x row t. Two
// accumulator chains per x row whatever NT is (a row's summation order is its own)
template <int QT, int NT>
inline void packed_group_f32(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  constexpr int bb = block_bytes<QT>(), qo = qs_offset<QT>();
  const int64_t nb = x.nb, K = nb * QK;
  // a weight's integer value by its quant bits: 16 of them (Q4), or 32 over two tables (Q5_0)
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 tbl = QT == Q4_0   ? _mm512_sub_ps(iota, _mm512_set1_ps(8))
                     : QT == Q5_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(16))
                                  : iota;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * G * bb;
    __m512 acc[NT][2];
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int c = 0; c < (QT == Q8_0 ? 8 : 4); ++c) {
      const __m512i v = _mm512_loadu_si512(blk + qo + c * 64);
      __m512i lo = v, hi = v;  // Q5_0: each byte the 5-bit value of the low (high) nibble's weight
      if constexpr (QT == Q5_0) {
        lo = _mm512_and_si512(v, low4);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        add_fifth_bits(blk, c, lo, hi);
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * c + i;
        __m512 w0, w1;  // weight j and (Q4, Q5) j + 16, or (Q8_0) weight j twice split over both chains
        if constexpr (QT == Q8_0) {
          w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24));
        } else if constexpr (QT == Q5_0) {
          // vpermt2ps reads the low 5 bits of each lane: bit 4 picks the table (q - 16 < 0, or not)
          w0 = _mm512_permutex2var_ps(tbl, _mm512_srli_epi32(lo, 8 * i), iota);
          w1 = _mm512_permutex2var_ps(tbl, _mm512_srli_epi32(hi, 8 * i), iota);
        } else {
          // vpermps reads the low 4 bits of each lane: the byte's low nibble, then its high one
          w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * i), tbl);
          w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * i + 4), tbl);
        }
        for (int t = 0; t < NT; ++t) {
          const float* xb = x.f + (t0 + t) * K + b * QK;
          if constexpr (QT == Q8_0) {
            acc[t][i & 1] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[j]), acc[t][i & 1]);
          } else {
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xb[j]), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xb[j + 16]), acc[t][1]);
          }
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    for (int t = 0; t < NT; ++t) tot[t] = _mm512_fmadd_ps(d, _mm512_add_ps(acc[t][0], acc[t][1]), tot[t]);
    if constexpr (QT == Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
      for (int t = 0; t < NT; ++t)
        tot[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[(t0 + t) * nb + b]), tot[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}

template <int QT, int NT>
inline void packed_group(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
#if defined(__AVX512VNNI__)
  if (x.int8) return packed_group_int8<QT, NT>(group, x, t0, res);
#endif
  packed_group_f32<QT, NT>(group, x, t0, res);
}

constexpr int PTILE = 8;  // x rows per pass over a group: 3 vectors each, within the 32 registers

// out = x W^T, or with GLU (W = [gate; up], N/2 rows each, a multiple of 16) out = silu(x G^T) * (x U^T):
// the gate and up groups of the same output columns are computed back to back (store_tile combines them)
template <int QT, typename O, bool GLU>
void packed_linear_impl(const PackedX& x, int64_t T, const uint8_t* w, int64_t N_out, int64_t group_bytes,
                        O* out, int64_t ldo) {
  const int64_t cols = GLU ? N_out / 2 : N_out, groups = (cols + G - 1) / G,
                up = GLU ? groups * group_bytes : 0;
  // prefill: the weights are swept once per XBLOCK x rows, whose activations then stay in L2 across
  // the groups (all of a 2048 x 8192 prompt's int8 activations are 16 MB)
  constexpr int64_t XBLOCK = 256;
  for (int64_t x0 = 0; x0 < T; x0 += XBLOCK) {
    const int64_t x1 = std::min<int64_t>(T, x0 + XBLOCK);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      __m512 res[PTILE], res_up[GLU ? PTILE : 1];
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = w + g * group_bytes;
        const int rows = static_cast<int>(std::min<int64_t>(G, cols - g * G));
        for (int64_t t0 = x0; t0 < x1; t0 += PTILE) {
          const int64_t nt = std::min<int64_t>(PTILE, x1 - t0);
          by_rows(nt, [&](auto NT) {
            packed_group<QT, decltype(NT)::value>(group, x, t0, res);
            if constexpr (GLU) packed_group<QT, decltype(NT)::value>(group + up, x, t0, res_up);
          });
          store_tile<GLU>(res, res_up, nt, rows, out + t0 * ldo + g * G, ldo);
        }
      }
    });
  }
}

}  // namespace

void packed_linear(const PackedX& x, int64_t base, const uint8_t* w, int64_t N_out, int64_t group_bytes,
                   const at::Tensor& out, bool glu) {
  const int64_t T = out.size(0), ldo = out.stride(0);
  by_type(base, [&](auto qt) {
    by_out_dtype(out, [&](auto* o) {
      using O = std::remove_pointer_t<decltype(o)>;
      if (glu)
        packed_linear_impl<decltype(qt)::value, O, true>(x, T, w, N_out, group_bytes, o, ldo);
      else
        packed_linear_impl<decltype(qt)::value, O, false>(x, T, w, N_out, group_bytes, o, ldo);
    });
  });
}

}  // namespace blocks
#endif
