// The decoder layers of a step in one C++ call: the CPU layer loop of a model the C++ kernels serve
// (models/llama.py's torch loop runs every other). Its inputs are kernels/plan.py's typed plan, which
// module.cpp reads field by field into the structs below.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

// The buffer that steps beyond the quantized kernels' rows dequantize weights into, shared by every
// projection of a stack (they run one at a time), as layers/quant_linear.py's Scratch is by its layers
class Scratch {
 public:
  at::Tensor take(int64_t n, at::ScalarType dtype);

 private:
  at::Tensor buf_;
};

// One projection, computed as its Python layer computes it (kernels/plan.py names each kind's fields)
struct Projection {
  virtual ~Projection() = default;
  virtual at::Tensor operator()(const at::Tensor& x) const = 0;
  // silu(gate) * up of a [gate; up] projection: from the output's halves, unless the kind fuses it
  virtual at::Tensor silu_mul(const at::Tensor& x) const;
  // gelu_tanh(gate) * up (Gemma 3): always from the output's halves, no kind fuses it
  at::Tensor gelu_mul(const at::Tensor& x) const;
};

struct QuantPart {
  at::Tensor blocks;
  int64_t qtype, start, rows;  // the kernels' type id; the output columns [start, start + rows) it writes
};

// QuantLinear: its kernels up to max_kernel_rows rows, beyond them its weight dequantized for the GEMM
struct QuantProjection final : Projection {
  std::vector<QuantPart> parts;
  int64_t in_features = 0, out_features = 0;
  c10::optional<at::Tensor> bias;
  bool fused_glu = false;
  int64_t max_kernel_rows = 0, dequant_chunk = 0;
  std::shared_ptr<Scratch> scratch;
  at::Tensor operator()(const at::Tensor& x) const override;
  at::Tensor silu_mul(const at::Tensor& x) const override;

 private:
  at::Tensor gemm(const at::Tensor& x) const;
};

// Linear on a oneDNN-packed weight: one matmul, its epilogue `attr` (times *other where given), split by
// rows over the threads (linear_rows) for split[0] <= rows < split[1] on split[2] threads
struct OneDnnProjection final : Projection {
  at::Tensor packed;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0;
  std::array<int64_t, 3> split{0, 0, 0};
  at::Tensor operator()(const at::Tensor& x) const override { return call(x, "none", nullptr); }
  at::Tensor call(const at::Tensor& x, const char* attr, const at::Tensor* other) const;
};

// Linear on a weight oneDNN did not pack: F.linear
struct TorchProjection final : Projection {
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  at::Tensor operator()(const at::Tensor& x) const override;
};

// GateUp: gate and up as two oneDNN calls whose epilogues apply silu and the product (a SiLU model's only)
struct GateUpProjection final : Projection {
  OneDnnProjection gate, up;
  at::Tensor operator()(const at::Tensor& x) const override;
  at::Tensor silu_mul(const at::Tensor& x) const override;
};

struct LayerPlan {
  at::Tensor input_norm, post_norm;
  std::unique_ptr<Projection> qkv, o, gate_up, down;
  // Qwen3's and Gemma 3's per-head norms of q and k [head_dim], before RoPE; Gemma 3's norms of the
  // attention's and the MLP's outputs [hidden], before the residual adds them
  c10::optional<at::Tensor> q_norm, k_norm, attn_out_norm, mlp_out_norm;
  bool local_rope = false;  // RoPE from the step's local table (Gemma 3's windowed layers)
};

struct StackPlan {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 0;
  bool gelu = false;  // the MLP's gate: gelu_tanh (Gemma 3), else silu
  int64_t fused_rows = 0;  // steps of at most this many rows: the C++ norm and RoPE; larger: torch's ops
  std::vector<LayerPlan> layers;
  std::function<void(const at::Tensor&)> all_reduce;  // tensor parallel: the sum over the ranks, in place
};

// One step's attention arguments (kernels/plan.py's KernelStep)
// A RoPE table's rows for the step's tokens, [T, 1, head_dim / 2] each
struct Rope {
  at::Tensor cos, sin;
};

struct StepArgs {
  at::Tensor cache, slot_blocks, slot_offsets;
  int64_t num_decodes = 0;
  c10::optional<at::Tensor> decode_tables, decode_context;
  c10::optional<at::Tensor> prefill_tables, prefill_starts, prefill_lens, prefill_context;
  double scale = 0;
  bool amx = false;
  std::vector<int64_t> windows;  // each layer's sliding window (0: none); empty: no layer has one
};

// Time of each part of the stack's steps, summed while on (bench/latency.py --breakdown): a clock read
// around each call, a few microseconds a step; off, one branch per call
struct PartTimes {
  enum Part { kNorm, kQkv, kRope, kKvWrite, kAttention, kO, kAllReduce, kGateUp, kDown, kParts };
  static constexpr std::array<const char*, kParts> names = {"add+rmsnorm", "linear qkv",     "rope",
                                                            "kv write",    "attention",      "linear o",
                                                            "all-reduce",  "linear gate+up", "linear down"};
  bool on = false;
  std::array<double, kParts> seconds{};

  template <typename F>
  auto time(Part part, F&& f) -> decltype(f()) {
    if (!on) return f();
    const auto t0 = std::chrono::steady_clock::now();
    struct Lap {  // also when f() throws: the step's other parts stay comparable
      PartTimes& times;
      Part part;
      std::chrono::steady_clock::time_point t0;
      ~Lap() {
        times.seconds[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    } lap{*this, part, t0};
    return f();
  }
};

// Not reentrant: one step at a time (the projections share their scratch)
class DecoderStack {
 public:
  explicit DecoderStack(StackPlan plan) : plan_(std::move(plan)) {}
  // residual: the embedded tokens [T, hidden], updated in place to the last layer's output (the caller's
  // final norm reads it); rope: every layer's table but the local_rope layers', which read local
  at::Tensor forward(at::Tensor residual, const Rope& rope, const c10::optional<Rope>& local,
                     const StepArgs& step) const;
  mutable PartTimes times;  // off unless a benchmark turns it on

 private:
  at::Tensor add_norm(const c10::optional<at::Tensor>& delta, at::Tensor& residual, const at::Tensor& weight,
                      bool fused) const;
  at::Tensor norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, bool fused) const;
  std::array<at::Tensor, 3> rotated(const at::Tensor& qkv, const LayerPlan& layer, const Rope& rope,
                                    bool fused) const;
  void attend(const std::array<at::Tensor, 3>& qkv, const at::Tensor& out, int64_t layer,
              const StepArgs& step) const;
  const at::Tensor& reduced(const at::Tensor& t) const;

  StackPlan plan_;
};
