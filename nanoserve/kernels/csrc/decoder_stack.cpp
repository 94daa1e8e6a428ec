// The CPU layer loop (decoder_stack.h). A step of a small model is as much per-call overhead as math: the
// Python layer loop cost ~1.2 ms of a 4.5 ms batch-1 decode step of the embedded model, all of it on the
// main thread while the other core waited; here a step's layers are one call, with the GIL released.
// Every call is the one the model's Python layers make (the same kernels, so the same bits); the norm and
// RoPE are the C++ kernels', or, on steps beyond the plan's fused_rows, torch's ops as the torch loop
// (models/llama.py) applies them. Qwen3's and Gemma 3's extra norms (per head of q and k; of the branches'
// outputs) likewise; Gemma 3's tanh-GELU gate is torch's op on either path.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <algorithm>
#include <cmath>
#include "decoder_stack.h"
#include "kernels.h"

constexpr int64_t PACKED = 256, GROUP = 16;  // the kernels' packed type flag, and rows per packed group

namespace {

// RMSNorm of each of the first q_heads + k_heads heads of every row of x [T, width], in place, by qw (the
// first q_heads) or kw [d]; rounded as add_rms_norm rounds (the normalized value to T, then times the weight)
template <typename T>
void head_norm_rows(T* x, int64_t width, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t d,
                    const T* qw, const T* kw, float eps) {
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < q_heads + k_heads; ++j) {
        T* p = x + t * width + j * d;
        const T* w = j < q_heads ? qw : kw;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < d; ++c) ss += static_cast<float>(p[c]) * static_cast<float>(p[c]);
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
        for (int64_t c = 0; c < d; ++c)
          p[c] = static_cast<T>(static_cast<float>(w[c]) * static_cast<float>(static_cast<T>(p[c] * inv)));
      }
  });
}

void head_norm_(const at::Tensor& x, int64_t q_heads, int64_t k_heads, int64_t d, const at::Tensor& qw,
                const at::Tensor& kw, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && (q_heads + k_heads) * d <= x.size(1) &&
                  qw.is_contiguous() && kw.is_contiguous() && qw.numel() == d && kw.numel() == d &&
                  qw.scalar_type() == x.scalar_type() && kw.scalar_type() == x.scalar_type(),
              "decoder stack: q/k norm weights do not match the projection");
  switch (x.scalar_type()) {
#define NS_CASE(K, T)                                                                                      \
  case K:                                                                                                  \
    head_norm_rows<T>(x.data_ptr<T>(), x.size(1), x.size(0), q_heads, k_heads, d, qw.data_ptr<T>(),        \
                      kw.data_ptr<T>(), static_cast<float>(eps));                                          \
    break;
    NS_CASE(at::kBFloat16, c10::BFloat16)
    NS_CASE(at::kHalf, c10::Half)
    NS_CASE(at::kFloat, float)
#undef NS_CASE
    default: TORCH_CHECK(false, "head_norm_: unsupported dtype");
  }
}

}  // namespace

at::Tensor Scratch::take(int64_t n, at::ScalarType dtype) {
  if (!buf_.defined() || buf_.numel() < n || buf_.scalar_type() != dtype)
    buf_ = at::empty({n}, at::dtype(dtype));
  return buf_.narrow(0, 0, n);
}

at::Tensor Projection::silu_mul(const at::Tensor& x) const {
  const std::vector<at::Tensor> gate_up = (*this)(x).chunk(2, -1);
  return at::silu(gate_up[0]) * gate_up[1];
}

at::Tensor Projection::gelu_mul(const at::Tensor& x) const {
  const std::vector<at::Tensor> gate_up = (*this)(x).chunk(2, -1);
  return at::gelu(gate_up[0], "tanh") * gate_up[1];
}

at::Tensor QuantProjection::operator()(const at::Tensor& x) const {
  if (x.size(0) > max_kernel_rows) return gemm(x);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  for (const QuantPart& p : parts)
    quant_linear(x, p.blocks, p.qtype, parts.size() == 1 ? out : out.narrow(1, p.start, p.rows));
  return bias ? out.add_(*bias) : out;
}

// QuantLinear's path beyond its kernels' rows: the whole weight dequantized where it is at most
// dequant_chunk weights, else each part in chunks of rows (a multiple of 16: packed groups stay whole)
at::Tensor QuantProjection::gemm(const at::Tensor& x) const {
  const int64_t in = in_features;
  if (out_features * in <= dequant_chunk) {
    const at::Tensor w = scratch->take(out_features * in, x.scalar_type()).view({out_features, in});
    for (const QuantPart& p : parts) quant_dequantize(p.blocks, p.qtype, w.narrow(0, p.start, p.rows));
    return at::linear(x, w, bias);
  }
  const int64_t step = std::max<int64_t>(GROUP, dequant_chunk / in / GROUP * GROUP);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  for (const QuantPart& p : parts)
    for (int64_t r = 0; r < p.rows; r += step) {
      const int64_t n = std::min(step, p.rows - r);
      const at::Tensor w = scratch->take(n * in, x.scalar_type()).view({n, in});
      const at::Tensor rows = p.qtype & PACKED
                                  ? p.blocks.narrow(0, r / GROUP, (r + n + GROUP - 1) / GROUP - r / GROUP)
                                  : p.blocks.narrow(0, r, n);
      quant_dequantize(rows, p.qtype, w);
      out.narrow(1, p.start + r, n).copy_(at::linear(x, w));
    }
  return bias ? out.add_(*bias) : out;
}

at::Tensor QuantProjection::silu_mul(const at::Tensor& x) const {
  if (!fused_glu || x.size(0) > max_kernel_rows) return Projection::silu_mul(x);
  at::Tensor out = at::empty({x.size(0), out_features / 2}, x.options());
  quant_linear_glu(x, parts[0].blocks, parts[0].qtype, out);
  return out;
}

at::Tensor OneDnnProjection::call(const at::Tensor& x, const char* attr, const at::Tensor* other) const {
  const int64_t rows = x.size(0);
  if (split[2] && rows >= split[0] && rows < split[1] && at::get_num_threads() == split[2])
    return linear_rows(x, packed, bias, out_features, attr,
                       other ? c10::optional<at::Tensor>(*other) : c10::nullopt);
  return onednn_linear(x, packed, bias, attr, other);
}

at::Tensor TorchProjection::operator()(const at::Tensor& x) const { return at::linear(x, weight, bias); }

at::Tensor GateUpProjection::operator()(const at::Tensor&) const {
  TORCH_CHECK(false, "a oneDNN gate/up pair computes silu(gate) * up only (a GELU model's is one Linear)");
}

at::Tensor GateUpProjection::silu_mul(const at::Tensor& x) const {
  const at::Tensor gate = this->gate.call(x, "swish", nullptr);
  return up.call(x, "mul", &gate);
}

at::Tensor DecoderStack::forward(at::Tensor residual, const Rope& rope, const c10::optional<Rope>& local,
                                 const StepArgs& step) const {
  const int64_t T = residual.size(0), h = plan_.heads, d = plan_.head_dim, nd = step.num_decodes;
  TORCH_CHECK(step.cache.size(1) == static_cast<int64_t>(plan_.layers.size()) &&
                  (nd == 0 || (step.decode_tables && step.decode_context)) &&
                  (nd == T ||
                   (step.prefill_tables && step.prefill_starts && step.prefill_lens && step.prefill_context)) &&
                  (step.windows.empty() || step.windows.size() == plan_.layers.size()),
              "decoder stack: step arguments do not match");
  const bool fused = T <= plan_.fused_rows;
  c10::optional<at::Tensor> delta;  // residual += delta happens in the next norm
  for (size_t i = 0; i < plan_.layers.size(); ++i) {
    const LayerPlan& L = plan_.layers[i];
    TORCH_CHECK(!L.local_rope || local, "decoder stack: layer ", i, " reads the local RoPE table, not given");
    const at::Tensor xn =
        times.time(PartTimes::kNorm, [&] { return add_norm(delta, residual, L.input_norm, fused); });
    const at::Tensor y = times.time(PartTimes::kQkv, [&] { return (*L.qkv)(xn); });
    const std::array<at::Tensor, 3> qkv =
        times.time(PartTimes::kRope, [&] { return rotated(y, L, L.local_rope ? *local : rope, fused); });
    const at::Tensor o = at::empty({T, h, d}, residual.options());
    attend(qkv, o, i, step);
    const at::Tensor ao = reduced(times.time(PartTimes::kO, [&] { return (*L.o)(o.view({T, h * d})); }));
    const at::Tensor x = times.time(PartTimes::kNorm, [&] {
      return add_norm(norm(ao, L.attn_out_norm, fused), residual, L.post_norm, fused);
    });
    const at::Tensor g = times.time(PartTimes::kGateUp, [&] {
      return plan_.gelu ? L.gate_up->gelu_mul(x) : L.gate_up->silu_mul(x);
    });
    const at::Tensor down = reduced(times.time(PartTimes::kDown, [&] { return (*L.down)(g); }));
    delta = times.time(PartTimes::kNorm, [&] { return norm(down, L.mlp_out_norm, fused); });
  }
  if (delta) residual.add_(*delta);
  return residual;
}

// residual += delta (in place), then RMSNorm(residual) * weight
at::Tensor DecoderStack::add_norm(const c10::optional<at::Tensor>& delta, at::Tensor& residual,
                                  const at::Tensor& weight, bool fused) const {
  if (fused) return add_rms_norm(delta, residual, weight, plan_.eps);
  if (delta) residual.add_(*delta);
  return at::rms_norm(residual, {residual.size(1)}, weight, plan_.eps);
}

// RMSNorm(x) * weight (a branch's output, Gemma 3), or x where the layer has no such norm
at::Tensor DecoderStack::norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                              bool fused) const {
  if (!weight) return x;
  return fused ? add_rms_norm(c10::nullopt, x, *weight, plan_.eps)
               : at::rms_norm(x, {x.size(1)}, *weight, plan_.eps);
}

// q, k (per-head norms where the layer has them, then RoPE) and v of the step's fused QKV output: in place by
// the kernels, or in torch's ops as the torch loop applies them (layers/rotary.py's rotate)
std::array<at::Tensor, 3> DecoderStack::rotated(const at::Tensor& qkv, const LayerPlan& layer,
                                                const Rope& rope, bool fused) const {
  const int64_t T = qkv.size(0), h = plan_.heads, hk = plan_.kv_heads, d = plan_.head_dim;
  const at::Tensor v = qkv.narrow(1, (h + hk) * d, hk * d).view({T, hk, d});
  TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "decoder stack: a q norm without k's");
  if (fused) {
    if (layer.q_norm) head_norm_(qkv, h, hk, d, *layer.q_norm, *layer.k_norm, plan_.eps);
    rope_(qkv, h + hk, d, rope.cos, rope.sin);
    return {qkv.narrow(1, 0, h * d).view({T, h, d}), qkv.narrow(1, h * d, hk * d).view({T, hk, d}), v};
  }
  at::Tensor qk = qkv.narrow(1, 0, (h + hk) * d).view({T, h + hk, d});
  if (layer.q_norm)
    qk = at::cat({at::rms_norm(qk.narrow(1, 0, h), {d}, *layer.q_norm, plan_.eps),
                  at::rms_norm(qk.narrow(1, h, hk), {d}, *layer.k_norm, plan_.eps)},
                 1);
  const std::vector<at::Tensor> half = qk.chunk(2, -1);
  const at::Tensor& cos = rope.cos;
  const at::Tensor& sin = rope.sin;
  const at::Tensor qk_rot = at::cat({half[0] * cos - half[1] * sin, half[1] * cos + half[0] * sin}, -1);
  return {qk_rot.narrow(1, 0, h), qk_rot.narrow(1, h, hk), v};
}

// the step's new K/V into the cache, then the decodes (the first num_decodes rows) and the prefill chunks
// attended into out: layers/attention.py's TorchAttention with the kernels
void DecoderStack::attend(const std::array<at::Tensor, 3>& qkv, const at::Tensor& out, int64_t layer,
                          const StepArgs& s) const {
  const at::Tensor& q = qkv[0];
  const int64_t T = q.size(0), nd = s.num_decodes;
  const int64_t window = s.windows.empty() ? 0 : s.windows[layer];
  times.time(PartTimes::kKvWrite,
             [&] { write_kv(qkv[1], qkv[2], s.cache, layer, s.slot_blocks, s.slot_offsets); });
  times.time(PartTimes::kAttention, [&] {
    if (nd)
      paged_decode_attention(q.narrow(0, 0, nd), s.cache, layer, *s.decode_tables, *s.decode_context, s.scale,
                             out.narrow(0, 0, nd), window);
    if (nd < T)
      paged_prefill_attention(q.narrow(0, nd, T - nd), out.narrow(0, nd, T - nd), s.cache, layer,
                              *s.prefill_tables, *s.prefill_starts, *s.prefill_lens, *s.prefill_context,
                              s.scale, s.amx, window);
  });
}

// t summed over the tensor-parallel ranks, in place (itself on one rank)
const at::Tensor& DecoderStack::reduced(const at::Tensor& t) const {
  if (plan_.all_reduce) times.time(PartTimes::kAllReduce, [&] { plan_.all_reduce(t); });
  return t;
}
