// K-quant matrices between their layouts (kquant.h): packed from GGUF super-blocks, and dequantized
// from either, bit for bit the gguf package's values (prefill GEMMs, embedding rows).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include "kquant.h"

namespace kquants {
namespace {

template <int QT, typename O>
void dequant_impl(const uint8_t* w, int64_t N, int64_t K, int64_t ldw, O* out, int64_t ldo) {
  const int64_t nb = K / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        O* ob = out + n * ldo + b * QK;
        superblock<QT>(w + n * ldw + b * block_bytes<QT>(),
                       [&](int i, V v) { QSimd::store(ob + i * QSimd::W, v); });
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Q6_K: a super-block's 256 6-bit values (0..63), as q6k_value reads them, 32 bytes of each at a time
inline void q6_values(const uint8_t* b, uint8_t* q) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t *ql = b + 64 * h + l, qh = b[128 + 32 * h + l];
      q[128 * h + l] = (ql[0] & 15) | ((qh & 3) << 4);
      q[128 * h + l + 32] = (ql[32] & 15) | (((qh >> 2) & 3) << 4);
      q[128 * h + l + 64] = (ql[0] >> 4) | (((qh >> 4) & 3) << 4);
      q[128 * h + l + 96] = (ql[32] >> 4) | (((qh >> 6) & 3) << 4);
    }
}

// row r's GGUF super-block -> its place in a packed group's super-block, and back
template <int QT>
void pack_superblock(const uint8_t* b, int r, uint8_t* p) {
  if constexpr (QT == Q4_K) {
    std::memcpy(p + 2 * r, b, 2);
    std::memcpy(p + 32 + 2 * r, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* s = b + 4;
      p[64 + 16 * j + r] = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
      p[192 + 16 * j + r] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
    for (int c = 0; c < 32; ++c) std::memcpy(p + 320 + qs_index(4 * c, r), b + 16 + 4 * c, 4);
  } else {
    std::memcpy(p + 2 * r, b + 208, 2);
    for (int g = 0; g < 16; ++g) p[32 + 16 * g + r] = b[192 + g];
    uint8_t q[QK];
    q6_values(b, q);
    for (int a = 0; a < 8; ++a) {
      uint8_t* blk = p + Q6_QL + Q6_A * a;
      const uint8_t* qa = q + 32 * a;
      for (int k = 0; k < 16; ++k) blk[qs_index(k, r)] = (qa[k] & 15) | ((qa[k + 16] & 15) << 4);
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i)
          blk[256 + 64 * h + 4 * r + i] = (qa[8 * h + i] >> 4) | (qa[16 + 8 * h + i] >> 4 << 2) |
                                          (qa[8 * h + 4 + i] >> 4 << 4) | (qa[16 + 8 * h + 4 + i] >> 4 << 6);
    }
  }
}

template <int QT>
void unpack_superblock(const uint8_t* p, int r, uint8_t* b) {
  std::memset(b, 0, block_bytes<QT>());
  if constexpr (QT == Q4_K) {
    std::memcpy(b, p + 2 * r, 2);
    std::memcpy(b + 2, p + 32 + 2 * r, 2);
    uint8_t sc[8], m[8], *s = b + 4;
    for (int j = 0; j < 8; ++j) sc[j] = p[64 + 16 * j + r], m[j] = p[192 + 16 * j + r];
    for (int j = 0; j < 4; ++j) {  // get_scale_min's packing, inverted: all 96 bits are used
      s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
      s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
      s[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    for (int c = 0; c < 32; ++c) std::memcpy(b + 16 + 4 * c, p + 320 + qs_index(4 * c, r), 4);
  } else {
    std::memcpy(b + 208, p + 2 * r, 2);
    for (int g = 0; g < 16; ++g) b[192 + g] = p[32 + 16 * g + r];
    uint8_t q[QK];
    for (int a = 0; a < 8; ++a) {
      const uint8_t* blk = p + Q6_QL + Q6_A * a;
      for (int k = 0; k < 32; ++k) {
        const int h = (k % 16) / 8, shift = 4 * ((k % 8) / 4) + 2 * (k / 16);
        q[32 * a + k] = ((blk[qs_index(k % 16, r)] >> (4 * (k / 16))) & 15) |
                        (((blk[256 + 64 * h + 4 * r + k % 4] >> shift) & 3) << 4);
      }
    }
    for (int h = 0; h < 2; ++h)  // GGUF's order (q6k_value), byte by byte
      for (int l = 0; l < 32; ++l) {
        const uint8_t* qh = q + 128 * h + l;
        b[64 * h + l] = (qh[0] & 15) | ((qh[64] & 15) << 4);
        b[64 * h + l + 32] = (qh[32] & 15) | ((qh[96] & 15) << 4);
        b[128 + 32 * h + l] = (qh[0] >> 4) | (qh[32] >> 4 << 2) | (qh[64] >> 4 << 4) | (qh[96] >> 4 << 6);
      }
  }
}

template <int QT>
void pack_impl(const uint8_t* w, int64_t N, int64_t nb, uint8_t* out) {
  constexpr int64_t pb = packed_bytes<QT>(), bb = block_bytes<QT>();
  at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t s = 0; s < nb; ++s) {
        uint8_t* dst = out + (g * nb + s) * pb;
        std::memset(dst, 0, pb);
        for (int r = 0; r < G && g * G + r < N; ++r)
          pack_superblock<QT>(w + (g * G + r) * nb * bb + s * bb, r, dst);
      }
  });
}

// rows[i] of a packed matrix: each super-block back in GGUF form, then the block layout's dequantization
template <int QT, typename O>
void dequant_packed_rows(const uint8_t* w, int64_t ldw, const int64_t* rows, int64_t n_out, int64_t K, O* out,
                         int64_t ldo) {
  const int64_t nb = K / QK;
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t blk[block_bytes<QT>()];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = rows[i];
      for (int64_t s = 0; s < nb; ++s) {
        unpack_superblock<QT>(w + n / G * ldw + s * packed_bytes<QT>(), static_cast<int>(n % G), blk);
        O* ob = out + i * ldo + s * QK;
        superblock<QT>(blk, [&](int j, V v) { QSimd::store(ob + j * QSimd::W, v); });
      }
    }
  });
}

// Q4_K super-block p of a group, its nr rows into ob[r * ldo]: (d sc) * q - (dmin m) by a 16-value table,
// the rows' quants moved back to row order (4 bytes a row a vector)
template <typename O>
void dequant_group_q4k(const uint8_t* p, int nr, O* ob, int64_t ldo) {
  alignas(64) uint8_t q[G][QK / 2];
  alignas(64) float d[G], dmin[G];
  const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  _mm512_store_ps(d, load_h(p));
  _mm512_store_ps(dmin, load_h(p + 32));
  for (int c = 0; c < 32; ++c)  // q[r] = row r's 128 nibble bytes
    for (int r = 0; r < G; ++r) std::memcpy(&q[r][4 * c], p + 320 + 64 * c + 4 * r, 4);
  for (int r = 0; r < nr; ++r) {
    for (int j = 0; j < 8; ++j) {
      const float dsc = d[r] * static_cast<float>(p[64 + 16 * j + r]),
                  dm = dmin[r] * static_cast<float>(p[192 + 16 * j + r]);
      const __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dsc), lanes), _mm512_set1_ps(dm));
      for (int h = 0; h < 2; ++h) {
        const __m512i nib =
            _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)&q[r][32 * (j / 2) + 16 * h]));
        QSimd::store(ob + r * ldo + 32 * j + 16 * h,
                     _mm512_permutexvar_ps(j % 2 ? _mm512_srli_epi32(nib, 4) : nib, t));
      }
    }
  }
}

// Q6_K super-block p of a group, its nr rows into ob[r * ldo]: (d sc) * (q - 32)
template <typename O>
void dequant_group_q6k(const uint8_t* p, int nr, O* ob, int64_t ldo) {
  alignas(64) uint8_t q[G][QK], tmp[2][64];
  alignas(64) float d[G];
  _mm512_store_ps(d, load_h(p));
  for (int a = 0; a < 8; ++a)
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      q6_bytes(p + Q6_QL + Q6_A * a, c, lo, hi);
      _mm512_store_si512(tmp[0], lo);
      _mm512_store_si512(tmp[1], hi);
      for (int r = 0; r < G; ++r) {
        std::memcpy(&q[r][32 * a + 4 * c], tmp[0] + 4 * r, 4);
        std::memcpy(&q[r][32 * a + 16 + 4 * c], tmp[1] + 4 * r, 4);
      }
    }
  for (int r = 0; r < nr; ++r) {
    for (int k = 0; k < 16; ++k) {
      const float dsc = d[r] * static_cast<float>(static_cast<int8_t>(p[32 + 16 * k + r]));
      const __m512i qv = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)&q[r][16 * k])),
                                          _mm512_set1_epi32(32));
      QSimd::store(ob + r * ldo + 16 * k, _mm512_mul_ps(_mm512_set1_ps(dsc), _mm512_cvtepi32_ps(qv)));
    }
  }
}

// a whole packed matrix (prefill GEMMs), a group at a time, with superblock's arithmetic
template <int QT, typename O>
void dequant_packed(const uint8_t* w, int64_t ldw, int64_t n_out, int64_t K, O* out, int64_t ldo) {
  const int64_t nb = K / QK;
  at::parallel_for(0, (n_out + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int nr = static_cast<int>(std::min<int64_t>(G, n_out - g * G));
      for (int64_t s = 0; s < nb; ++s) {
        const uint8_t* p = w + g * ldw + s * packed_bytes<QT>();
        if constexpr (QT == Q4_K)
          dequant_group_q4k(p, nr, out + g * G * ldo + s * QK, ldo);
        else
          dequant_group_q6k(p, nr, out + g * G * ldo + s * QK, ldo);
      }
    }
  });
}
#endif

}  // namespace

int64_t block_bytes_of(int64_t qtype) {
  const int64_t base = qtype & ~PACKED;
  TORCH_CHECK((base == Q4_K || base == Q6_K) && (qtype == base || qtype == (base | PACKED)),
              "quantized type ", qtype, " has no K-quant kernel (Q4_K=12, Q6_K=14, each + 256 packed)");
  if (qtype & PACKED) return base == Q4_K ? 2368 : 3360;
  return base == Q4_K ? 144 : 210;
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, int64_t N) {
  const int64_t bb = block_bytes_of(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.dtype() == at::kByte && w.dim() == 2 && w.stride(1) == 1,
              "weight: 2-D uint8 CPU blocks, rows contiguous");
  TORCH_CHECK(K % QK == 0, "the input size must be a multiple of 256 for K-quants, got ", K);
  TORCH_CHECK(w.size(1) == K / QK * bb, "weight rows hold ", w.size(1), " bytes; type ", qtype, " with ", K,
              " inputs needs ", K / QK * bb);
  const int64_t want = qtype & PACKED ? (N + G - 1) / G : N;
  TORCH_CHECK(w.size(0) == want, "weight has ", w.size(0), " rows; ", N, " outputs need ", want);
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
  TORCH_CHECK(!(qtype & PACKED), "packed matrices need an AVX-512 build (see packs())");
#endif
}

// out[i, :] = the dequantized weight row ids[i] (all rows when ids is null), bit for bit gguf's
void dequantize(const at::Tensor& w, int64_t qtype, int64_t N, const int64_t* ids, int64_t n,
                const at::Tensor& out) {
  const int64_t K = out.size(1);
  check_weight(w, qtype, K, N);
  check_out(out, n, K);
  if (n == 0 || K == 0) return;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldw = w.stride(0), ldo = out.stride(0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (qtype & PACKED) {
    by_type(qtype, [&](auto qt) {
      by_out_dtype(out, [&](auto* o) {
        if (ids)
          dequant_packed_rows<decltype(qt)::value>(wp, ldw, ids, n, K, o, ldo);
        else
          dequant_packed<decltype(qt)::value>(wp, ldw, n, K, o, ldo);
      });
    });
    return;
  }
#endif
  TORCH_CHECK(!ids, "row lookups of a block-layout matrix: index_select its rows, then quant_dequantize");
  by_type(qtype, [&](auto qt) {
    by_out_dtype(out, [&](auto* o) { dequant_impl<decltype(qt)::value>(wp, n, K, ldw, o, ldo); });
  });
}

// the packed form of a block matrix [N, K/256 * block bytes]: [ceil(N / 16), K/256 * packed bytes]
at::Tensor pack(const at::Tensor& w, int64_t qtype) {
  const int64_t N = w.size(0), bb = block_bytes_of(qtype);
  TORCH_CHECK(w.size(1) % bb == 0, "weight rows of ", w.size(1), " bytes are not whole super-blocks of type ",
              qtype);
  const int64_t nb = w.size(1) / bb;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  at::Tensor out = at::empty({(N + G - 1) / G, nb * block_bytes_of(qtype | PACKED)}, w.options());
  by_type(qtype, [&](auto qt) {
    pack_impl<decltype(qt)::value>(w.data_ptr<uint8_t>(), N, nb, out.data_ptr<uint8_t>());
  });
  return out;
#else
  TORCH_CHECK(false, "packed matrices need an AVX-512 build (see packs())");
#endif
}

}  // namespace kquants
