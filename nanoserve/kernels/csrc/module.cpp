// The extension module's Python face: every kernel under the name the Python side calls it by, and the
// decoder stack built from kernels/plan.py's typed plan, each field read by name
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include "decoder_stack.h"
#include "kernels.h"
#include "vec.h"

namespace {

template <typename T>
T field(const py::handle& obj, const char* name) {
  return obj.attr(name).cast<T>();
}

c10::optional<at::Tensor> optional_tensor(const py::handle& obj, const char* name) {
  const py::object value = obj.attr(name);
  return value.is_none() ? c10::nullopt : c10::optional<at::Tensor>(value.cast<at::Tensor>());
}

std::unique_ptr<QuantProjection> read_quant(const py::handle& p, const std::shared_ptr<Scratch>& scratch) {
  auto q = std::make_unique<QuantProjection>();
  for (const py::handle part : p.attr("parts"))
    q->parts.push_back({field<at::Tensor>(part, "blocks"), field<int64_t>(part, "qtype"),
                        field<int64_t>(part, "start"), field<int64_t>(part, "rows")});
  q->in_features = field<int64_t>(p, "in_features");
  q->out_features = field<int64_t>(p, "out_features");
  q->bias = optional_tensor(p, "bias");
  q->fused_glu = field<bool>(p, "fused_glu");
  q->max_kernel_rows = field<int64_t>(p, "max_kernel_rows");
  q->dequant_chunk = field<int64_t>(p, "dequant_chunk");
  q->scratch = scratch;
  TORCH_CHECK(!q->parts.empty() && (!q->fused_glu || q->parts.size() == 1),
              "a quantized projection's plan: no parts, "
              "or a fused GLU of several");
  return q;
}

OneDnnProjection read_onednn(const py::handle& p) {
  OneDnnProjection d;
  d.packed = field<at::Tensor>(p, "packed");
  d.bias = optional_tensor(p, "bias");
  d.out_features = field<int64_t>(p, "out_features");
  const py::object split = p.attr("split_rows");
  if (!split.is_none()) d.split = split.cast<std::array<int64_t, 3>>();
  return d;
}

// a projection of any kind kernels/plan.py defines; any other is refused, naming it
std::unique_ptr<Projection> read_projection(const py::handle& p, const std::shared_ptr<Scratch>& scratch) {
  const std::string kind = field<std::string>(p, "kind");
  if (kind == "quant") return read_quant(p, scratch);
  if (kind == "onednn") return std::make_unique<OneDnnProjection>(read_onednn(p));
  if (kind == "torch") {
    auto t = std::make_unique<TorchProjection>();
    t->weight = field<at::Tensor>(p, "weight");
    t->bias = optional_tensor(p, "bias");
    return t;
  }
  if (kind == "onednn_gate_up") {
    auto g = std::make_unique<GateUpProjection>();
    g->gate = read_onednn(p.attr("gate"));
    g->up = read_onednn(p.attr("up"));
    return g;
  }
  throw py::value_error("DecoderStack has no projection kind '" + kind + "' (" +
                        py::str(py::type::handle_of(p).attr("__name__")).cast<std::string>() + ")");
}

// the all-reduce the plan gives (a Python callable), called with the GIL: the stack runs without it
std::function<void(const at::Tensor&)> read_all_reduce(const py::object& fn) {
  if (fn.is_none()) return {};
  auto held =
      std::make_shared<py::object>(fn);  // released with the stack, which Python frees holding the GIL
  return [held](const at::Tensor& t) {
    py::gil_scoped_acquire gil;
    (*held)(t);
  };
}

LayerPlan read_layer(const py::handle& layer, const std::shared_ptr<Scratch>& scratch) {
  LayerPlan L{field<at::Tensor>(layer, "input_norm"), field<at::Tensor>(layer, "post_norm"),
              read_projection(layer.attr("qkv"), scratch), read_projection(layer.attr("o"), scratch),
              read_projection(layer.attr("gate_up"), scratch), read_projection(layer.attr("down"), scratch)};
  L.q_norm = optional_tensor(layer, "q_norm");
  L.k_norm = optional_tensor(layer, "k_norm");
  L.attn_out_norm = optional_tensor(layer, "attn_out_norm");
  L.mlp_out_norm = optional_tensor(layer, "mlp_out_norm");
  L.local_rope = field<bool>(layer, "local_rope");
  if (L.q_norm.has_value() != L.k_norm.has_value())
    throw py::value_error("DecoderStack: a q norm without k's, or a k norm without q's");
  return L;
}

DecoderStack read_stack(const py::object& plan) {
  StackPlan s;
  s.heads = field<int64_t>(plan, "heads");
  s.kv_heads = field<int64_t>(plan, "kv_heads");
  s.head_dim = field<int64_t>(plan, "head_dim");
  s.eps = field<double>(plan, "eps");
  s.fused_rows = field<int64_t>(plan, "fused_rows");
  const std::string act = field<std::string>(plan, "act");
  if (act != "silu" && act != "gelu_pytorch_tanh")
    throw py::value_error("DecoderStack has no activation '" + act + "'");
  s.gelu = act == "gelu_pytorch_tanh";
  const auto scratch = std::make_shared<Scratch>();
  for (const py::handle layer : plan.attr("layers")) s.layers.push_back(read_layer(layer, scratch));
  s.all_reduce = read_all_reduce(plan.attr("all_reduce"));
  return DecoderStack(std::move(s));
}

// a (cos, sin) pair, or None
c10::optional<Rope> read_rope(const py::object& pair) {
  if (pair.is_none()) return c10::nullopt;
  const auto t = pair.cast<std::pair<at::Tensor, at::Tensor>>();
  return Rope{t.first, t.second};
}

StepArgs read_step(const py::handle& step) {
  return {field<at::Tensor>(step, "cache"),
          field<at::Tensor>(step, "slot_blocks"),
          field<at::Tensor>(step, "slot_offsets"),
          field<int64_t>(step, "num_decodes"),
          optional_tensor(step, "decode_tables"),
          optional_tensor(step, "decode_context"),
          optional_tensor(step, "prefill_tables"),
          optional_tensor(step, "prefill_starts"),
          optional_tensor(step, "prefill_lens"),
          optional_tensor(step, "prefill_context"),
          field<double>(step, "scale"),
          field<bool>(step, "amx"),
          field<std::vector<int64_t>>(step, "windows")};
}

// below this many token bytes a call keeps the GIL: releasing it where another thread waits for it hands
// that thread the GIL, and taking it back can wait out its switch interval (5 ms), far more than the hash
constexpr size_t kChainReleaseBytes = 16 << 10;

// chain_digests(tokens, block_size, parent, key): the GIL held to read the arguments and make the result,
// released to hash (the bytes are immutable, and held by the call, so their buffers are read in place)
py::bytes chain_digests_bytes(const py::bytes& tokens, int64_t block_size, const py::object& parent,
                              const py::bytes& key) {
  if (block_size < 1) throw py::value_error("chain_digests: block_size must be >= 1, got " +
                                            std::to_string(block_size));
  const uint8_t* parent_digest = nullptr;
  if (!parent.is_none()) {
    if (!PyBytes_Check(parent.ptr()))
      throw py::type_error("chain_digests: parent must be bytes or None, not " +
                           py::str(py::type::handle_of(parent).attr("__name__")).cast<std::string>());
    if (PyBytes_GET_SIZE(parent.ptr()) != static_cast<Py_ssize_t>(kChainDigestBytes))
      throw py::value_error("chain_digests: parent must be a 32-byte digest, got " +
                            std::to_string(PyBytes_GET_SIZE(parent.ptr())) + " bytes");
    parent_digest = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(parent.ptr()));
  }
  const auto* data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(tokens.ptr()));
  const auto* key_data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(key.ptr()));
  const size_t key_len = static_cast<size_t>(PyBytes_GET_SIZE(key.ptr()));
  // one digest per full block: a trailing partial block (or token) is not hashed
  const size_t block_tokens = static_cast<size_t>(block_size);
  const size_t n_blocks = static_cast<size_t>(PyBytes_GET_SIZE(tokens.ptr())) / 8 / block_tokens;
  const size_t block_bytes = 8 * block_tokens;  // only used where n_blocks > 0 (no overflow then)
  py::bytes out(nullptr, n_blocks * kChainDigestBytes);  // uninitialized, written before anyone sees it
  auto* digests = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out.ptr()));
  if (n_blocks * block_bytes < kChainReleaseBytes) {
    chain_digests(data, n_blocks, block_bytes, parent_digest, key_data, key_len, digests);
  } else {
    py::gil_scoped_release release;
    chain_digests(data, n_blocks, block_bytes, parent_digest, key_data, key_len, digests);
  }
  return out;
}

void define_attention(py::module_& m) {
#if defined(NS_PHASE_TIMES)
  m.def("phase_times", []() {  // {phase: seconds} since the last call, summed over threads
    std::map<std::string, double> r;
    const char* names[kPhases] = {"pack K/V", "load Q",     "QK^T GEMM",      "softmax",   "PV GEMM",
                                  "store O",  "decode q.k", "decode softmax", "decode p.V"};
    for (int p = 0; p < kPhases; ++p) r[names[p]] = phase_ns[p].exchange(0) * 1e-9;
    return r;
  });
#endif
  // tensor-only kernels run without the GIL: a step's forward on the compute thread (the LM head, the torch
  // path's attention) leaves the engine's Python free to schedule the next step meanwhile
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("q"), py::arg("out"), py::arg("cache"),
        py::arg("layer"), py::arg("tables"), py::arg("start"), py::arg("len"), py::arg("ctx"), py::arg("scale"),
        py::arg("allow_amx"), py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("amx", &amx);
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("cache"), py::arg("layer"),
        py::arg("tables"), py::arg("ctx"), py::arg("scale"), py::arg("out") = py::none(), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.attr("head_dims") = py::make_tuple(64, 128, 256);  // the attention kernels' templates
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("linear_rows", &linear_rows, py::call_guard<py::gil_scoped_release>());
#if defined(__AVX512F__)
  m.attr("vectorized") = true;  // the norm and RoPE kernels run 16 lanes at a time (bf16, fp32)
#else
  m.attr("vectorized") = false;  // element by element: only worth it on decode-sized batches
#endif
}

void define_quant(py::module_& m) {
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_glu", &quant_linear_glu, py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_dequantize", &quant_dequantize, py::arg("w"), py::arg("qtype"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("quant_rows", &quant_rows, py::arg("w"), py::arg("qtype"), py::arg("rows"), py::arg("ids"),
        py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("quant_pack", &quant_pack, py::arg("w"), py::arg("qtype"));
  // whether quant_linear takes packed matrices (the layer packs its weights at load where it does)
  m.def("packs", &quant_packs);
  // whether bf16 activations meet packed weights as int8 (AVX512_VNNI), not exact (quant.h)
  m.def("int8_activations", &int8_activations);
  m.def("isa", &isa);
}

// free_extents(where, code, n): read in place, the GIL held (a bytearray the engine thread alone writes)
py::list free_extents_list(const py::buffer& where, int64_t code, int64_t n) {
  const py::buffer_info info = where.request();
  if (info.ndim != 1 || info.itemsize != 1)
    throw py::type_error("free_extents: `where` must be a one-dimensional byte buffer");
  if (code < 0 || code > 255)
    throw py::value_error("free_extents: code must be a byte, got " + std::to_string(code));
  py::list out;
  for (const BlockExtent& e : free_extents(static_cast<const uint8_t*>(info.ptr), info.shape[0],
                                           static_cast<uint8_t>(code), n))
    out.append(py::make_tuple(e.start, e.length));
  return out;
}

// copy_runs(src, dst, runs, span, non_blocking): the runs read by hand (pybind's caster for a vector of
// arrays costs ~10 us warm, several times that cold, on the step path). The GIL is released only for
// copies made here (not non_blocking): enqueueing CUDA copies is microseconds each, and handing the GIL
// to a thread that waits for it (the intake hashing a prompt) can cost the engine thread its switch
// interval (5 ms) to take it back
void copy_runs_list(const at::Tensor& src, const at::Tensor& dst, const py::list& runs, int64_t span,
                    bool non_blocking) {
  std::vector<std::array<int64_t, 3>> parsed(static_cast<size_t>(PyList_GET_SIZE(runs.ptr())));
  for (size_t i = 0; i < parsed.size(); ++i) {
    const py::handle run = PyList_GET_ITEM(runs.ptr(), static_cast<Py_ssize_t>(i));
    if (!PyTuple_Check(run.ptr()) || PyTuple_GET_SIZE(run.ptr()) != 3)
      throw py::type_error("copy_runs: each run must be a tuple (src start, dst start, length)");
    for (Py_ssize_t j = 0; j < 3; ++j) {
      parsed[i][j] = PyLong_AsLongLong(PyTuple_GET_ITEM(run.ptr(), j));
      if (parsed[i][j] == -1 && PyErr_Occurred()) throw py::error_already_set();
    }
  }
  if (non_blocking) {
    copy_runs(src, dst, parsed, span, true);
    return;
  }
  py::gil_scoped_release release;
  copy_runs(src, dst, parsed, span, false);
}

// stored_runs(index, stored, hashes, keys, start): chain_runs.stored_runs' runs [(first block, end block)]:
// per run one index lookup, then the stored keys compared with the chain's by pointer first, with no list
// slice (a slice increfs every key it copies: thousands of cold objects touched on the step path)
py::list stored_runs_list(const py::dict& index, const py::list& stored, const py::list& hashes,
                          const py::list& keys, int64_t start) {
  if (start < 0) throw py::value_error("stored_runs: start must be >= 0, got " + std::to_string(start));
  // the sizes are read again at each use: a comparison that runs Python code could change the lists
  const auto links = [&] { return std::min(PyList_GET_SIZE(hashes.ptr()), PyList_GET_SIZE(keys.ptr())); };
  const auto blocks = [&] { return PyList_GET_SIZE(stored.ptr()); };
  const auto same = [](PyObject* a, PyObject* b) {
    if (a == b) return true;
    const auto hold_a = py::reinterpret_borrow<py::object>(a), hold_b = py::reinterpret_borrow<py::object>(b);
    const int eq = PyObject_RichCompareBool(a, b, Py_EQ);
    if (eq < 0) throw py::error_already_set();
    return eq == 1;
  };
  py::list out;
  for (Py_ssize_t i = start; i < links();) {
    const py::object digest = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(hashes.ptr(), i));
    PyObject* found = PyDict_GetItemWithError(index.ptr(), digest.ptr());  // borrowed
    if (found == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      break;
    }
    const Py_ssize_t b = PyLong_AsSsize_t(found);
    if (b == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (b < 0 || b >= blocks())
      throw py::value_error("stored_runs: the index names block " + std::to_string(b) + ", outside the pool");
    Py_ssize_t k = 0;  // the run: stored[b + k] is link i + k's key
    while (i + k < links() && b + k < blocks() &&
           same(PyList_GET_ITEM(stored.ptr(), b + k), PyList_GET_ITEM(keys.ptr(), i + k)))
      ++k;
    if (k == 0) break;  // a digest whose stored key differs: a miss there
    out.append(py::make_tuple(b, b + k));
    i += k;
  }
  return out;
}

void define_hashing(py::module_& m) {
  m.def("chain_digests", &chain_digests_bytes, py::arg("tokens"), py::arg("block_size"), py::arg("parent"),
        py::arg("key"),
        "The concatenated 32-byte digests of the full blocks of `tokens` (int64 ids, native order): keyed "
        "BLAKE2b-256 (key[:64]) of the previous digest (block 0: parent, or 32 zero bytes for None) and "
        "the block's bytes, as kvcache's chain_hash computes them one by one.");
}

// ---- the KV tiers' step-path kernels as plain CPython functions (METH_FASTCALL, positional arguments) ----
// pybind11's dispatcher costs ~40 us on a first call after a forward has left the caches cold (~10 us on a
// later one), more than these kernels' own work; admitting a load calls three of them
template <PyObject* (*F)(PyObject* const*, Py_ssize_t)>
PyObject* fast_call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return F(args, nargs);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::cast_error& e) {  // an argument of the wrong type (its overload resolution's TypeError)
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

void check_nargs(const char* name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most) {
  if (nargs < least || nargs > most)
    throw py::type_error(std::string(name) + "() takes " + std::to_string(least) +
                         (most > least ? " to " + std::to_string(most) : std::string()) +
                         " positional arguments, got " + std::to_string(nargs));
}

template <typename T>
T arg_as(PyObject* arg) {
  return py::reinterpret_borrow<py::object>(arg).cast<T>();
}

PyObject* free_extents_fast(PyObject* const* args, Py_ssize_t nargs) {
  check_nargs("free_extents", nargs, 3, 3);
  return free_extents_list(py::reinterpret_borrow<py::buffer>(args[0]), arg_as<int64_t>(args[1]),
                           arg_as<int64_t>(args[2]))
      .release()
      .ptr();
}

PyObject* stored_runs_fast(PyObject* const* args, Py_ssize_t nargs) {
  check_nargs("stored_runs", nargs, 5, 5);
  if (!PyDict_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2]) || !PyList_Check(args[3]))
    throw py::type_error("stored_runs: (index: dict, stored: list, hashes: list, keys: list, start: int)");
  const auto list = [&](int i) { return py::reinterpret_borrow<py::list>(args[i]); };
  return stored_runs_list(py::reinterpret_borrow<py::dict>(args[0]), list(1), list(2), list(3),
                          arg_as<int64_t>(args[4]))
      .release()
      .ptr();
}

PyObject* copy_runs_fast(PyObject* const* args, Py_ssize_t nargs) {
  check_nargs("copy_runs", nargs, 5, 5);
  if (!THPVariable_Check(args[0]) || !THPVariable_Check(args[1]) || !PyList_Check(args[2]))
    throw py::type_error("copy_runs: (src: Tensor, dst: Tensor, runs: list, span: int, non_blocking: bool)");
  copy_runs_list(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]),
                 py::reinterpret_borrow<py::list>(args[2]), arg_as<int64_t>(args[3]), arg_as<bool>(args[4]));
  Py_RETURN_NONE;
}

#define NS_FAST(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<fn>)), METH_FASTCALL
PyMethodDef kv_methods[] = {
    {"free_extents", NS_FAST(free_extents_fast),
     "free_extents(where, code, n): kvcache/extents.py's choose_extents(*free_runs(where), n) for the blocks "
     "where where[b] == code: [(start, length)], the fewest extents, ascending."},
    {"stored_runs", NS_FAST(stored_runs_fast),
     "stored_runs(index, stored, hashes, keys, start): kvcache/chain_runs.py's stored_runs, the runs [(first "
     "block, end block)] of consecutive blocks whose stored keys are links start, start + 1, ... of the "
     "chain, up to the first link the verified lookup (index[hashes[i]] holding keys[i]) does not find."},
    {"copy_runs", NS_FAST(copy_runs_fast),
     "copy_runs(src, dst, runs, span, non_blocking): dst[d:d+n].copy_(src[s:s+n]) for each (s, d, n) of runs "
     "(tuples), cut before either side reaches a multiple of span (kvcache/transfer.py's cut_runs), the GIL "
     "released unless non_blocking; raises at the first failing copy, the ones before it done."},
};
#undef NS_FAST

void define_kv(py::module_& m) {
  const py::object module_name = m.attr("__name__");
  for (PyMethodDef& def : kv_methods) {
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, module_name.ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  define_attention(m);
  define_quant(m);
  define_hashing(m);
  define_kv(m);
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init(&read_stack), py::arg("plan"))
      .def(
          "forward",
          // local: the local_rope layers' (cos, sin), or None where no layer reads it
          [](const DecoderStack& stack, at::Tensor residual, at::Tensor cos, at::Tensor sin,
             const py::object& step, const py::object& local) {
            const StepArgs args = read_step(step);
            const c10::optional<Rope> local_rope = read_rope(local);
            py::gil_scoped_release release;
            return stack.forward(residual, Rope{cos, sin}, local_rope, args);
          },
          py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("step"), py::arg("local") = py::none())
      .def_property(
          "timing", [](const DecoderStack& stack) { return stack.times.on; },
          [](const DecoderStack& stack, bool on) { stack.times.on = on; })
      .def("part_times", [](const DecoderStack& stack) {  // {part: seconds} since the last call
        std::map<std::string, double> r;
        for (int p = 0; p < PartTimes::kParts; ++p)
          r[PartTimes::names[p]] = std::exchange(stack.times.seconds[p], 0.0);
        return r;
      });
}
