// The kernels' entry points, as module.cpp binds them and the decoder stack (decoder_stack.cpp) calls them
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// The attention kernels serve head_dim 64, 128 and 256; window > 0 is a sliding window (a query at position p
// sees keys p - window + 1 .. p), 0 plain causal.
// decode_attention.cpp: one query token per sequence over its KV blocks
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, int64_t layer, at::Tensor tables,
                                  at::Tensor ctx, double scale, c10::optional<at::Tensor> out, int64_t window);
// prefill_attention.cpp: every prefill chunk of a step, over its cached context
void paged_prefill_attention(at::Tensor q, at::Tensor out, at::Tensor cache, int64_t layer, at::Tensor tables,
                             at::Tensor start, at::Tensor len, at::Tensor ctx, double scale, bool allow_amx,
                             int64_t window);
bool amx();  // whether bf16 GEMM tiles can be packed for AMX here

// elementwise.cpp
at::Tensor add_rms_norm(c10::optional<at::Tensor> x, at::Tensor residual, at::Tensor weight, double eps);
void rope_(at::Tensor qkv, int64_t heads, int64_t d, at::Tensor cos, at::Tensor sin);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor cache, int64_t layer, at::Tensor blocks,
              at::Tensor offsets);

// gemm_split.cpp: oneDNN's matmul on a prepacked weight (epilogue attr; times *other where given), and the
// same by rows over the threads
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         c10::string_view attr, const at::Tensor* other);
at::Tensor linear_rows(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t n_out,
                       std::string attr, c10::optional<at::Tensor> other);

// quant.cpp: GGUF blocks computed on directly
void quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out);
void quant_linear_glu(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out);
void quant_dequantize(at::Tensor w, int64_t qtype, at::Tensor out);
void quant_rows(at::Tensor w, int64_t qtype, int64_t N, at::Tensor ids, at::Tensor out);
at::Tensor quant_pack(at::Tensor w, int64_t qtype);
bool quant_packs();       // whether packed matrices have kernels here (AVX-512)
bool int8_activations();  // whether bf16 activations meet packed weights as int8 (AVX512_VNNI)
std::string isa();

// chain_hash.cpp: a prompt's chain of block digests, keyed BLAKE2b-256 as Python's hashlib computes it. Block
// i's digest (out + 32 i) is over the previous one (block 0: parent, or 32 zero bytes where parent is null)
// and its block_bytes of tokens; the key is its first kChainKeyBytes (none: unkeyed). Raw buffers only: the
// caller may hold no GIL.
constexpr size_t kChainDigestBytes = 32, kChainKeyBytes = 64;
void chain_digests(const uint8_t* tokens, size_t n_blocks, size_t block_bytes, const uint8_t* parent,
                   const uint8_t* key, size_t key_len, uint8_t* out);

// kv_runs.cpp: a KV load's bookkeeping in one call each (kvcache/extents.py, kvcache/transfer.py)
struct BlockExtent {
  int64_t start, length;
};
// At most n blocks among where[0..num_blocks) == code (all of them if fewer) as the fewest extents: the
// longest runs whole, the rest from the start of the smallest run that holds it; ascending by start
std::vector<BlockExtent> free_extents(const uint8_t* where, int64_t num_blocks, uint8_t code, int64_t n);
// dst[d:d+n] = src[s:s+n] for each (s, d, n) of runs, cut before either side reaches a multiple of span
void copy_runs(const at::Tensor& src, const at::Tensor& dst, const std::vector<std::array<int64_t, 3>>& runs,
               int64_t span, bool non_blocking);
