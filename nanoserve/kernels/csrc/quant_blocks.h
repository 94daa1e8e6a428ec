// The GGUF block types of 32 weights (Q4_0, Q4_1, Q5_0, Q8_0) as both of their files read them:
// quant_blocks.cpp (the block layout's kernels, dequantization, packing) and quant_packed.cpp (the packed
// layout's GEMV / GEMM, AVX-512 builds). Layouts and arithmetic in general: quant.h.
//
// GGUF blocks (qs: 16 bytes, weight j < 16 in the low nibble of qs[j], weight j + 16 in its high one):
//   Q4_0 (18 bytes): fp16 d | qs;                       w = d * (q - 8)
//   Q4_1 (20 bytes): fp16 d | fp16 m | qs;              w = d * q + m (two roundings, no FMA)
//   Q5_0 (22 bytes): fp16 d | uint32 qh | qs;           w = d * (q - 16), q = nibble | (qh bit j) << 4
//   Q8_0 (34 bytes): fp16 d | 32 int8;                  w = d * q
// The packed layout, per group of 16 rows and block b (rows padded to a multiple of 16 with zero blocks):
//   Q4_0: d[16] (fp16) | qs[4][16][4]        qs[c][r][i] = byte 4c+i of row r's qs (weights 4c+i
//   Q4_1: d[16] | m[16] | qs[4][16][4]                    in its low nibble, 4c+i+16 in its high one)
//   Q5_0: d[16] | hb[4][2] (uint64) | qs[4][16][4]    hb[c][h] bit 4r+i = the fifth bit of row r's
//         weight 4c+i+16h: qh's bits rearranged (the same 64 bytes) into the byte masks of qs[c]'s low
//         (h = 0) and high (h = 1) nibbles, so that one masked byte add restores 64 weights' fifth bits
//   Q8_0: d[16] | qs[8][16][4]              qs[c][r][i] = weight 4c+i of row r
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <type_traits>
#include "quant.h"

namespace blocks {

constexpr int QK = 32;                                            // weights per block, every type here
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8 };  // GGML's type ids

template <int QT>
constexpr int64_t block_bytes() {
  return QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : 34;
}
// where the quant bytes start in a GGUF block, and how many there are
template <int QT>
constexpr int qs_in_block() {
  return QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 2;
}
template <int QT>
constexpr int qs_bytes() {
  return QT == Q8_0 ? 32 : 16;
}
// where qs starts in a packed group's block
template <int QT>
constexpr int qs_offset() {
  return QT == Q4_1 ? 64 : QT == Q5_0 ? 96 : 32;
}

// f(std::integral_constant<int, QT>()) for a block type
template <typename F>
void by_type(int64_t base, F&& f) {
  switch (base) {
    case Q4_0: f(std::integral_constant<int, Q4_0>()); break;
    case Q4_1: f(std::integral_constant<int, Q4_1>()); break;
    case Q5_0: f(std::integral_constant<int, Q5_0>()); break;
    case Q8_0: f(std::integral_constant<int, Q8_0>()); break;
    default: TORCH_CHECK(false, "quantized type ", base, " has no kernel (Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8)");
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// quant_packed.cpp: out = x W^T on a packed matrix of block type `base` ([ceil(N / 16), group_bytes]),
// or with glu (W = [gate; up]) out = silu(x gate^T) * (x up^T)
void packed_linear(const PackedX& x, int64_t base, const uint8_t* w, int64_t N_out, int64_t group_bytes,
                   const at::Tensor& out, bool glu);
#endif

}  // namespace blocks
