// K-quant GEMV / GEMM kernels (layouts and arithmetic: kquant.h): the block layout's, each super-block
// dequantized in registers and FMA-ed against x in fp32 (bf16 x widened once per call: a product differs
// from "dequantize, then matmul in fp32" only in summation order, whatever the output dtype, rounded to
// once at the end), and the packed layout's on AVX-512.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#include "kquant.h"

namespace kquants {
namespace {

constexpr int NA = 2;  // accumulators per x row (alternating vectors), so consecutive FMAs do not wait

// res[t] = dot(weight row, x row t) for NT rows of x: each super-block is dequantized once per NT rows.
// A row's sequence of operations is the same whatever NT is (batch invariance).
template <int QT, int NT>
inline void dot_rows(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, float* res) {
  V acc[NT][NA];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < NA; ++a) acc[t][a] = QSimd::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    superblock<QT>(wrow + b * block_bytes<QT>(), [&](int i, V w) {
      for (int t = 0; t < NT; ++t)
        acc[t][i % NA] = QSimd::fma(w, QSimd::load(xb + t * ldx + i * QSimd::W), acc[t][i % NA]);
    });
  }
  for (int t = 0; t < NT; ++t) res[t] = QSimd::sum(QSimd::add(acc[t][0], acc[t][1]));
}

template <int QT, int NT>
inline void tile(const uint8_t* wrow, int64_t nb, const float* x, int64_t ldx, int64_t nt, float* res) {
  if constexpr (NT > 1) {
    if (nt < NT) return tile<QT, NT - 1>(wrow, nb, x, ldx, nt, res);
  }
  dot_rows<QT, NT>(wrow, nb, x, ldx, res);
}

template <int QT, typename O>
void linear_impl(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, int64_t ldw, O* out,
                 int64_t ldo) {
  block_linear<TILE>(T, N, w, ldw, out, ldo, [&](const uint8_t* wrow, int64_t t0, int64_t nt, float* res) {
    tile<QT, TILE>(wrow, K / QK, x + t0 * K, K, nt, res);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
// four int8 activations k..k+3 of x row t0 + t, broadcast
inline __m512i xdword(const PackedX& x, int64_t t0, int t, int64_t k) {
  int32_t v;
  std::memcpy(&v, x.q.get() + (t0 + t) * x.K + k, 4);
  return _mm512_set1_epi32(v);
}

// Q4_K super-block s of a group against NT int8 x rows; integer sums per sub-block are exact (their order
// and NA, the chains per row, are free), the fp32 steps per row fixed
template <int NT>
__attribute__((always_inline)) inline void q4k_int8(const uint8_t* p, const PackedX& x, int64_t t0, int64_t s,
                                                    __m512* tot) {
  constexpr int NA = NT <= 2 ? 2 : 1;
  const int64_t K = x.K;
  const __m512 d = load_h(p), dmin = load_h(p + 32);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int pp = 0; pp < 4; ++pp) {
    __m512i acc[NT][2][NA];
    for (int t = 0; t < NT; ++t)
      for (int a = 0; a < NA; ++a) acc[t][0][a] = acc[t][1][a] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      const __m512i wv = _mm512_loadu_si512(p + 320 + (8 * pp + v) * 64);
      const __m512i lo = _mm512_and_si512(wv, m4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
      for (int t = 0; t < NT; ++t) {
        const int64_t k = s * QK + 64 * pp + 4 * v;
        acc[t][0][v % NA] = _mm512_dpbusd_epi32(acc[t][0][v % NA], lo, xdword(x, t0, t, k));
        acc[t][1][v % NA] = _mm512_dpbusd_epi32(acc[t][1][v % NA], hi, xdword(x, t0, t, k + 32));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * pp + h;
      const __m512 dsc = _mm512_mul_ps(d, load_u8(p + 64 + 16 * j)),
                   dm = _mm512_mul_ps(dmin, load_u8(p + 192 + 16 * j));
      for (int t = 0; t < NT; ++t) {
        const int64_t xi = (t0 + t) * (K / XB) + s * 8 + j;
        __m512i dot = acc[t][h][0];
        if constexpr (NA == 2) dot = _mm512_add_epi32(dot, acc[t][h][NA - 1]);
        const float dx = x.scale[xi];
        tot[t] = _mm512_fmadd_ps(_mm512_mul_ps(dsc, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(dot), tot[t]);
        tot[t] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(x.sum[xi]), tot[t]);
      }
    }
  }
}

// Q6_K super-block s of a group against NT int8 x rows
template <int NT>
__attribute__((always_inline)) inline void q6k_int8(const uint8_t* p, const PackedX& x, int64_t t0, int64_t s,
                                                    __m512* tot) {
  const int64_t K = x.K;
  const __m512 d = load_h(p);
  for (int a = 0; a < 8; ++a) {
    const uint8_t* blk = p + Q6_QL + Q6_A * a;
    __m512i acc[NT][2];
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      q6_bytes(blk, c, lo, hi);
      for (int t = 0; t < NT; ++t) {
        const int64_t k = s * QK + 32 * a + 4 * c;
        acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], lo, xdword(x, t0, t, k));
        acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], hi, xdword(x, t0, t, k + 16));
      }
    }
    const __m512i sc0 = load_i8(p + 32 + 16 * (2 * a)), sc1 = load_i8(p + 32 + 16 * (2 * a + 1));
    for (int t = 0; t < NT; ++t) {
      const int64_t xi = (t0 + t) * (K / XB) + s * 8 + a;
      // sc * (sum q x - 32 sum x) per 16 weights, in int32 (|.| < 2^24 each)
      const __m512i v = _mm512_add_epi32(
          _mm512_mullo_epi32(sc0, _mm512_sub_epi32(acc[t][0], _mm512_set1_epi32(32 * x.qsum[2 * xi]))),
          _mm512_mullo_epi32(sc1, _mm512_sub_epi32(acc[t][1], _mm512_set1_epi32(32 * x.qsum[2 * xi + 1]))));
      tot[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale[xi])), _mm512_cvtepi32_ps(v), tot[t]);
    }
  }
}

// one group of 16 rows against NT int8 x rows
template <int QT, int NT>
inline void group_int8(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res) {
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < x.K / QK; ++s) {
    if constexpr (QT == Q4_K)
      q4k_int8<NT>(group + s * packed_bytes<QT>(), x, t0, s, tot);
    else
      q6k_int8<NT>(group + s * packed_bytes<QT>(), x, t0, s, tot);
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}
#endif

// fp32 path: the 16 rows' weights 4c+i (lo) and kh+4c+i (hi) of unit u (Q4_K: a sub-block pair, q;
// Q6_K: 32 weights, q - 32) of a packed super-block, as fp32 vectors
constexpr int F32_UNITS = 8 * 4;  // (u, c) a super-block, both types
template <int QT>
inline void f32_weights(const uint8_t* p, int u, int c, __m512* wl, __m512* wh) {
  __m512i lo, hi;
  if constexpr (QT == Q4_K) {
    lo = _mm512_loadu_si512(p + 320 + (8 * u + c) * 64);
    hi = _mm512_srli_epi32(lo, 4);
  } else {
    q6_bytes(p + Q6_QL + Q6_A * u, c, lo, hi);
    lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(32));
    hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(32));
  }
  const __m512 tbl = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    if constexpr (QT == Q4_K) {  // vpermps reads the low 4 bits of each lane
      wl[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 8 * i), tbl);
      wh[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(hi, 8 * i), tbl);
    } else {
      wl[i] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lo, 24 - 8 * i), 24));
      wh[i] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(hi, 24 - 8 * i), 24));
    }
  }
}

// a group's weights as f32_weights gives them, all super-blocks (buf: K/256 * F32_UNITS * 8 vectors)
template <int QT>
void f32_fill(const uint8_t* group, int64_t nsb, __m512* buf) {
  for (int64_t s = 0; s < nsb; ++s)
    for (int uc = 0; uc < F32_UNITS; ++uc) {
      __m512* b = buf + (s * F32_UNITS + uc) * 8;
      const int nc = QT == Q4_K ? 8 : 4;
      f32_weights<QT>(group + s * packed_bytes<QT>(), uc / nc, uc % nc, b, b + 4);
    }
}

// one group of 16 rows against NT fp32 x rows: two FMA chains per x row and scale (by weight parity).
// The weights converted here, or (buf) read from f32_fill's buffer: the same values, so the same bits
template <int QT, int NT, bool BUF>
inline void group_f32(const uint8_t* group, const PackedX& x, int64_t t0, __m512* res, const __m512* buf) {
  const int64_t K = x.K, nsb = K / QK;
  __m512 tot[NT];
  for (int t = 0; t < NT; ++t) tot[t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = group + s * packed_bytes<QT>();
    const __m512 d = load_h(p);
    for (int u = 0; u < (QT == Q4_K ? 4 : 8); ++u) {  // Q4_K: sub-block pairs; Q6_K: 32-weight blocks
      __m512 acc[NT][2][2];
      for (int t = 0; t < NT; ++t)
        acc[t][0][0] = acc[t][0][1] = acc[t][1][0] = acc[t][1][1] = _mm512_setzero_ps();
      const int64_t k0 = s * QK + (QT == Q4_K ? 64 : 32) * u,
                    kh = QT == Q4_K ? 32 : 16;  // x of lo / hi weights
      constexpr int nc = QT == Q4_K ? 8 : 4;
      for (int c = 0; c < nc; ++c) {
        __m512 wv[8];
        if constexpr (!BUF) f32_weights<QT>(p, u, c, wv, wv + 4);
        const __m512* w8 = BUF ? buf + (s * F32_UNITS + u * nc + c) * 8 : wv;
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          for (int t = 0; t < NT; ++t) {
            const float* xb = x.f + (t0 + t) * K + k0 + 4 * c + i;
            acc[t][0][i & 1] = _mm512_fmadd_ps(w8[i], _mm512_set1_ps(xb[0]), acc[t][0][i & 1]);
            acc[t][1][i & 1] = _mm512_fmadd_ps(w8[4 + i], _mm512_set1_ps(xb[kh]), acc[t][1][i & 1]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        if constexpr (QT == Q4_K) {
          const int j = 2 * u + h;
          const __m512 dsc = _mm512_mul_ps(d, load_u8(p + 64 + 16 * j)),
                       dm = _mm512_mul_ps(load_h(p + 32), load_u8(p + 192 + 16 * j));
          for (int t = 0; t < NT; ++t) {
            tot[t] = _mm512_fmadd_ps(dsc, _mm512_add_ps(acc[t][h][0], acc[t][h][1]), tot[t]);
            tot[t] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(x.sum[(t0 + t) * (K / XB) + s * 8 + j]), tot[t]);
          }
        } else {
          const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(load_i8(p + 32 + 16 * (2 * u + h))));
          for (int t = 0; t < NT; ++t)
            tot[t] = _mm512_fmadd_ps(dsc, _mm512_add_ps(acc[t][h][0], acc[t][h][1]), tot[t]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = tot[t];
}

template <int QT, int NT>
inline void group_tile(const uint8_t* group, const PackedX& x, int64_t t0, int64_t nt, __m512* res,
                       const __m512* buf) {
  if constexpr (NT > 1) {
    if (nt < NT) return group_tile<QT, NT - 1>(group, x, t0, nt, res, buf);
  }
#if defined(__AVX512VNNI__)
  if (x.int8) return group_int8<QT, NT>(group, x, t0, res);
#endif
  if constexpr (NT <= 4) {
    if (buf)
      group_f32<QT, NT, true>(group, x, t0, res, buf);
    else
      group_f32<QT, NT, false>(group, x, t0, res, buf);
  } else
    for (int64_t t = 0; t < NT; t += 4)
      group_tile<QT, 4>(group, x, t0 + t, std::min<int64_t>(4, NT - t), res + t, buf);
}

constexpr int PTILE = 8;  // x rows per pass over a group (fp32: in passes of 4)

// out = x W^T, or with GLU (W = [gate; up], N/2 rows each, a multiple of 16) silu(x gate^T) * (x up^T),
// combined in fp32 and rounded once, as quant_blocks.cpp's
template <int QT, bool GLU = false, typename O>
void packed_linear_impl(const PackedX& x, int64_t T, const uint8_t* w, int64_t N, int64_t ldw, O* out,
                        int64_t ldo) {
  const int64_t cols = GLU ? N / 2 : N, groups = (cols + G - 1) / G, up = GLU ? groups * ldw : 0;
  constexpr int64_t XBLOCK = 256;  // prefill: the weights swept once per 256 x rows (theirs stay in L2)
  for (int64_t x0 = 0; x0 < T; x0 += XBLOCK) {
    const int64_t x1 = std::min<int64_t>(T, x0 + XBLOCK);
    // fp32 Q6_K prefill: each group's weights converted once per sweep, not once per pass of 4 x rows
    // (1 thread, 2048x2048 at 1024 rows: 110 -> 86 ms; Q4_K's conversion is too cheap to gain)
    const bool buffered = QT == Q6_K && !x.int8 && x1 - x0 > 16;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      __m512 res[PTILE], res_up[GLU ? PTILE : 1];
      const int64_t units = x.K / QK * F32_UNITS * 8;
      std::vector<__m512> buf(buffered ? units * (GLU ? 2 : 1) : 0);
      for (int64_t g = begin; g < end; ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(G, cols - g * G));
        if (buffered) f32_fill<QT>(w + g * ldw, x.K / QK, buf.data());
        if (buffered && GLU) f32_fill<QT>(w + up + g * ldw, x.K / QK, buf.data() + units);
        for (int64_t t0 = x0; t0 < x1; t0 += PTILE) {
          const int64_t nt = std::min<int64_t>(PTILE, x1 - t0);
          group_tile<QT, PTILE>(w + g * ldw, x, t0, nt, res, buffered ? buf.data() : nullptr);
          if constexpr (GLU)
            group_tile<QT, PTILE>(w + up + g * ldw, x, t0, nt, res_up,
                                  buffered ? buf.data() + units : nullptr);
          store_tile<GLU>(res, res_up, nt, rows, out + t0 * ldo + g * G, ldo);
        }
      }
    });
  }
}
#endif

}  // namespace

// out[t, n] = sum_k x[t, k] * W[n, k], W given as K-quant super-blocks [N, K/256 * block bytes] or
// packed (qtype + 256); `out` may be a column slice of a wider tensor (fused parts of different types
// each write their columns).
void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu) {
  TORCH_CHECK(!glu || ((qtype & PACKED) && out.size(-1) % G == 0),
              "quant_linear_glu: a packed [gate; up] matrix, "
              "each half a multiple of 16 rows");
  const int64_t T = x.size(0), K = x.size(1), N = qtype & PACKED ? out.size(-1) * (glu ? 2 : 1) : w.size(0);
  check_weight(w, qtype, K, N);
  check_out(out, T, glu ? N / 2 : N);
  if (T == 0 || N == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldw = w.stride(0), ldo = out.stride(0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (qtype & PACKED) {
    const PackedX px = prepare_x(x);
    by_type(qtype, [&](auto qt) {
      by_out_dtype(out, [&](auto* o) {
        if (glu)
          packed_linear_impl<decltype(qt)::value, true>(px, T, wp, N, ldw, o, ldo);
        else
          packed_linear_impl<decltype(qt)::value, false>(px, T, wp, N, ldw, o, ldo);
      });
    });
    return;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 / fp16 widen exactly, once per call
  const float* xp = xf.data_ptr<float>();
  by_type(qtype, [&](auto qt) {
    by_out_dtype(out, [&](auto* o) { linear_impl<decltype(qt)::value>(xp, T, K, wp, N, ldw, o, ldo); });
  });
}

}  // namespace kquants
