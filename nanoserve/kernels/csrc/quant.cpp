// The quantized-weight kernels' entry points: each call goes to the family of its type (quant.h), after
// the checks every family shares; and the packed kernels' activations (PackedX).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <string>
#include "kernels.h"
#include "quant.h"

void check_out(const at::Tensor& out, int64_t rows, int64_t cols) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == rows && out.size(1) == cols &&
                  (out.stride(1) == 1 || cols <= 1),
              "out must be a CPU [", rows, ", ", cols, "] tensor with unit column stride");
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
PackedX prepare_x(const at::Tensor& x) {
  PackedX p;
  p.src = x.scalar_type() == at::kHalf ? x.to(at::kFloat).contiguous() : x.contiguous();
  const int64_t T = x.size(0), K = x.size(1), nb = K / XB;
  p.K = K;
  p.nb = nb;
#if defined(__AVX512VNNI__)
  p.int8 =
      x.scalar_type() == at::kBFloat16;  // bf16 activations meet the weights as int8; fp32 ones stay exact
#endif
  p.sum.resize(T * nb);
  if (!p.int8) {  // the values, and each block's sum (the offset terms) in a fixed order
    if (p.src.scalar_type() == at::kFloat) {
      p.f = p.src.data_ptr<float>();
    } else {
      p.fbuf.resize(T * K);
      const c10::BFloat16* xb = p.src.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < T * K; ++i) p.fbuf[i] = static_cast<float>(xb[i]);
      p.f = p.fbuf.data();
    }
    for (int64_t i = 0; i < T * nb; ++i) {
      float s = 0.f;
      for (int k = 0; k < XB; ++k) s += p.f[i * XB + k];
      p.sum[i] = s;
    }
    return p;
  }
  // not zero-filled: every byte is written below (a prefill step's activations are megabytes)
  p.q.reset(new int8_t[T * K]);
  p.scale.resize(T * nb);
  p.qsum.resize(2 * T * nb);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(p.src.data_ptr<c10::BFloat16>());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {  // rows in parallel: each row's values are its own
    for (int64_t i = t0 * nb; i < t1 * nb; ++i) {
      int32_t* s = p.qsum.data() + 2 * i;
      p.scale[i] = quantize_block32(xp + i * XB, p.q.get() + i * XB, s);
      p.sum[i] = p.scale[i] * static_cast<float>(s[0] + s[1]);
    }
  });
  return p;
}
#endif

namespace {

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor");
  TORCH_CHECK(
      x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
      "x must be float32, bfloat16 or float16, got ", x.scalar_type());
}

// which family computes on `qtype`: true for the K-quants
bool k_family(int64_t qtype) {
  const int64_t base = qtype & ~PACKED;
  TORCH_CHECK(blocks::has(base) || kquants::has(base), "quantized type ", qtype,
              " has no kernel: no block kernel "
              "(Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8) and no K-quant kernel (Q4_K=12, Q6_K=14), each + 256 packed");
  return kquants::has(base);
}

void linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const at::Tensor& out, bool glu) {
  check_x(x);
  if (k_family(qtype))
    kquants::linear(x, w, qtype, out, glu);
  else
    blocks::linear(x, w, qtype, out, glu);
}

void dequantize(const at::Tensor& w, int64_t qtype, int64_t N, const int64_t* ids, int64_t n,
                const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2, "out must be 2-D");
  if (k_family(qtype))
    kquants::dequantize(w, qtype, N, ids, n, out);
  else
    blocks::dequantize(w, qtype, N, ids, n, out);
}

}  // namespace

void quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out) {
  linear(x, w, qtype, out, false);
}
void quant_linear_glu(at::Tensor x, at::Tensor w, int64_t qtype, at::Tensor out) {
  linear(x, w, qtype, out, true);
}

// out[n, :] = the dequantized weight row n (prefill GEMMs)
void quant_dequantize(at::Tensor w, int64_t qtype, at::Tensor out) {
  dequantize(w, qtype, out.dim() == 2 ? out.size(0) : 0, nullptr, out.dim() == 2 ? out.size(0) : 0, out);
}

// out[i, :] = the dequantized row ids[i] of an [N, K] matrix (embedding lookups: only those rows are read)
void quant_rows(at::Tensor w, int64_t qtype, int64_t N, at::Tensor ids, at::Tensor out) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: 1-D int64");
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id ", id[i], " out of [0, ", N, ")");
  dequantize(w, qtype, N, id, ids.size(0), out);
}

// the packed form of a block matrix (quant.h)
at::Tensor quant_pack(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(!(qtype & PACKED), "already packed");
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "weight: 2-D contiguous uint8 blocks");
  return k_family(qtype) ? kquants::pack(w, qtype) : blocks::pack(w, qtype);
}

bool quant_packs() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

bool int8_activations() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

std::string isa() {
#if defined(__AVX512BF16__)
  return std::string(QSimd::name()) + "+bf16";
#else
  return QSimd::name();
#endif
}
