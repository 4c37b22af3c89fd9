// The MLX primitive around Orchard's fused decode attention (attention.c, in the sgemm
// library): one node of the graph where MLX's CPU backend has ~21 a layer (two matmuls looping
// over sequences and heads, the softmax's ops, the views between them: bench/attention.py), run on the CPU stream like any other op.
//
// Built on first use by engine/kernels/native/mlx_extension.py (nanobind, in MLX's domain, so its
// arrays are MLX's own); the kernel's address comes from Python (engine/kernels/blas.py loaded the
// library), so this module links nothing of Orchard's and imports without it.
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "attention.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using Kernel = int (*)(const orchard_attention_t*);
Kernel kernel = nullptr;

// A 4-D float32 operand as the kernel reads it: its last axis contiguous. Strides are only
// known once MLX has evaluated an array (a view, a broadcast), so this is decided in eval_cpu;
// the rare operand without a contiguous last axis is copied into a packed buffer first.
struct Operand {
  const float* data;
  long strides[4];
  int shape[4];

  explicit Operand(const mx::array& x) : data(x.data<float>()) {
    for (int axis = 0; axis < 4; axis++) strides[axis] = x.strides(axis), shape[axis] = x.shape(axis);
  }
  bool packed() const { return strides[3] == 1 || shape[3] == 1; }
  // Copies into `buffer` (row-major) and points there.
  void pack(std::vector<float>& buffer) {
    buffer.resize((size_t)shape[0] * shape[1] * shape[2] * shape[3]);
    float* out = buffer.data();
    for (int i = 0; i < shape[0]; i++)
      for (int j = 0; j < shape[1]; j++)
        for (int k = 0; k < shape[2]; k++)
          for (int l = 0; l < shape[3]; l++)
            *out++ = data[i * strides[0] + j * strides[1] + k * strides[2] + l * strides[3]];
    data = buffer.data();
    strides[3] = 1, strides[2] = shape[3], strides[1] = (long)shape[2] * shape[3];
    strides[0] = strides[1] * shape[1];
  }
};

class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream stream, float scale, bool causal, bool masked)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal), masked_(masked) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    orchard_attention_t a{};
    if (masked_) {
      const auto& m = inputs[3];  // 4-D, broadcastable to (B, H, L, S): any strides
      auto stride = [&](int axis) { return m.shape(axis) == 1 ? 0L : (long)m.strides(axis); };
      a.mask = reinterpret_cast<const unsigned char*>(m.data<bool>());
      a.m_b = stride(0), a.m_h = stride(1), a.m_l = stride(2), a.m_s = stride(3);
    }
    a.causal = causal_;
    a.scale = scale_;
    a.out = out.data<float>();
    encoder.dispatch([a, q = Operand(inputs[0]), k = Operand(inputs[1]), v = Operand(inputs[2]),
                      size = out.size(), run = kernel]() mutable {
      std::vector<float> buffers[3];
      Operand* operands[3] = {&q, &k, &v};
      for (int i = 0; i < 3; i++)
        if (!operands[i]->packed()) operands[i]->pack(buffers[i]);
      a.B = q.shape[0], a.H = q.shape[1], a.L = q.shape[2], a.D = q.shape[3];
      a.KH = k.shape[1], a.S = k.shape[2], a.DV = v.shape[3];
      a.q = q.data, a.q_b = q.strides[0], a.q_h = q.strides[1], a.q_l = q.strides[2];
      a.k = k.data, a.k_b = k.strides[0], a.k_h = k.strides[1], a.k_s = k.strides[2];
      a.v = v.data, a.v_b = v.strides[0], a.v_h = v.strides[1], a.v_s = v.strides[2];
      if (run(&a) != 0)  // decode_attention checked the shapes: never, but never garbage
        for (size_t i = 0; i < size; i++) a.out[i] = NAN;
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("Orchard's decode attention runs on the CPU only");
  }

  const char* name() const override { return "OrchardDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && masked_ == o.masked_;
  }

 private:
  float scale_;
  bool causal_, masked_;
};

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           std::optional<mx::array> mask, float scale, bool causal) {
  if (!kernel) throw std::runtime_error("set_kernel was not called");
  auto fits = [](const mx::array& x) { return x.ndim() == 4 && x.dtype() == mx::float32; };
  if (!fits(q) || !fits(k) || !fits(v)) throw std::invalid_argument("4-D float32 arrays only");
  int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
  int KH = k.shape(1), S = k.shape(2), DV = v.shape(3);
  if (k.shape(0) != B || v.shape(0) != B || k.shape(3) != D || v.shape(1) != KH ||
      v.shape(2) != S || KH < 1 || H % KH || S < 1 || D % 8 || DV % 8 || D < 8 || DV < 8 ||
      D > ORCHARD_ATTENTION_MAX_DIM || DV > ORCHARD_ATTENTION_MAX_DIM ||
      H / KH * L > ORCHARD_ATTENTION_MAX_ROWS)
    throw std::invalid_argument("shapes the kernel does not take");
  auto stream = mx::to_stream(mx::StreamOrDevice{});
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("CPU only");
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    mx::array m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() > 4) throw std::invalid_argument("bool masks only");
    mx::Shape shape(4 - m.ndim(), 1);
    shape.insert(shape.end(), m.shape().begin(), m.shape().end());
    int full[4] = {B, H, L, S};
    for (int axis = 0; axis < 4; axis++)
      if (shape[axis] != 1 && shape[axis] != full[axis])
        throw std::invalid_argument("the mask does not broadcast to the scores");
    inputs.push_back(mx::reshape(m, shape, stream));
  }
  return mx::array(
      {B, H, L, DV}, mx::float32,
      std::make_shared<DecodeAttention>(stream, scale, causal, mask.has_value()), inputs);
}

}  // namespace

NB_MODULE(_orchard_attention, m) {
  m.doc() = "Orchard's fused decode attention as an MLX primitive (engine/kernels/native/attention.c)";
  m.def("set_kernel", [](uintptr_t address) { kernel = reinterpret_cast<Kernel>(address); },
        nb::arg("address"), "The address of orchard_attention in the loaded sgemm library.");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("mask").none(), nb::arg("scale"), nb::arg("causal"),
        "softmax(q k^T * scale) v over the visible keys: (B, H, L, D) queries, (B, KH, S, D) "
        "keys and (B, KH, S, DV) values, float32; mask a bool array broadcastable to "
        "(B, H, L, S) or None; causal hides key j from query l when j > S - L + l.");
  m.attr("MAX_ROWS") = (int)ORCHARD_ATTENTION_MAX_ROWS;
  m.attr("MAX_DIM") = (int)ORCHARD_ATTENTION_MAX_DIM;
}
