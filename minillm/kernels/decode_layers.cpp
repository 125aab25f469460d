// A float32 model's decode-only step through every layer in one call from Python: the operations of
// minillm/model.py, in its order, on the same kernels (PyTorch's products, oneDNN's on packed weights where the
// model packed them; the C functions of small_ops.c; the C attention of paged_decode.c), so the same floats come
// out; only the Python between them is gone. At batch 1 a layer is eight calls, each paid after the weights of a
// product have pushed Python's own data out of the caches. Built against PyTorch's headers by
// minillm/kernels/decode_layers.py, which hands over the C functions' addresses (set_kernels).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

using RmsNorm = void (*)(const float *, int64_t, const float *, float, int64_t, int64_t, float *);
using SiluMul = void (*)(const float *, int64_t, int64_t, float *);
using RopeStoreDecode = void (*)(float *, const float *, const float *, const int64_t *, void *, void *, float *,
                                 float *, const int32_t *, const int32_t *, float *, int64_t, int64_t, int64_t,
                                 int64_t, int64_t, int64_t, float);
RmsNorm rms_norm_fn = nullptr;
SiluMul silu_mul_fn = nullptr;
RopeStoreDecode attention_fn = nullptr;

void set_kernels(int64_t rms_norm, int64_t silu_mul, int64_t rope_store_decode) {
    rms_norm_fn = reinterpret_cast<RmsNorm>(rms_norm);
    silu_mul_fn = reinterpret_cast<SiluMul>(silu_mul);
    attention_fn = reinterpret_cast<RopeStoreDecode>(rope_store_decode);
}

// layers.Linear.product: x W^T (+ bias) (+ residual), on oneDNN's packed weight (the skip connection added in the
// same call) or through F.linear.
at::Tensor product(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                   bool packed, const at::Tensor *residual) {
    static auto plain = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &,
                          c10::string_view, c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
    static auto binary = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
        .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                          const std::optional<at::Tensor> &, c10::string_view)>();
    if (packed)
        return residual ? binary.call(x, *residual, weight, bias, "add")
                        : plain.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
    at::Tensor y = at::linear(x, weight, bias);
    return residual ? at::add(y, *residual) : y;
}

// layers.rms_norm (small_ops.rms_norm) of contiguous rows x.
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &gain, double eps) {
    at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
    rms_norm_fn(x.const_data_ptr<float>(), x.stride(0), gain.const_data_ptr<float>(), static_cast<float>(eps),
                x.size(0), x.size(1), out.mutable_data_ptr<float>());
    return out;
}

// weights: each layer's q/k/v, o, gate/up and down products in turn, each oneDNN's packed weight where packed says
// so (1), else the plain [out, in] one; qkv_biases: each layer's q/k/v bias or none; norms: each layer's input and post-attention RMSNorm gains; caches:
// each layer's (k, v) float32 pools, or (k, v, k_scale, v_scale) int8 ones; num_heads: each layer's query heads (as
// pruning left them). x [seqs, hidden] is left unchanged.
at::Tensor decode_layers(const at::Tensor &x_in, at::TensorList weights, at::IntArrayRef packed,
                         const c10::List<std::optional<at::Tensor>> &qkv_biases, at::TensorList norms,
                         at::TensorList caches, const at::Tensor &cos, const at::Tensor &sin_signed,
                         const at::Tensor &positions, const at::Tensor &slots, const at::Tensor &block_tables,
                         const at::Tensor &context_lens, at::IntArrayRef num_heads, double eps, double scale) {
    TORCH_CHECK(attention_fn != nullptr, "decode_layers: set_kernels was not called");
    const int64_t layers = static_cast<int64_t>(norms.size()) / 2, seqs = x_in.size(0);
    const int64_t per_layer = static_cast<int64_t>(caches.size()) / layers; // 2 float32 pools, or 2 int8 + scales
    const at::Tensor &pool = caches[0];
    const int64_t block_size = pool.size(1), kv_heads = pool.size(2), head_dim = pool.size(3);
    const at::Tensor rope_cos = at::index_select(cos, 0, positions);  // RotaryEmbedding.cos_sin: one row a token
    const at::Tensor rope_sin = at::index_select(sin_signed, 0, positions);
    at::Tensor x = x_in;
    for (int64_t l = 0; l < layers; l++) {
        const at::TensorList w = weights.slice(4 * l, 4), cache = caches.slice(per_layer * l, per_layer);
        // attention: x + o(attend(rope(qkv(norm(x))))), its cache written on the way (attention.cpu_decode_layer)
        at::Tensor qkv = product(rms_norm(x, norms[2 * l], eps), w[0], qkv_biases.get(l), packed[4 * l], nullptr);
        at::Tensor o = at::empty({seqs, num_heads[l] * head_dim}, x.options());
        attention_fn(qkv.mutable_data_ptr<float>(), rope_cos.const_data_ptr<float>(),
                     rope_sin.const_data_ptr<float>(), slots.const_data_ptr<int64_t>(), cache[0].data_ptr(),
                     cache[1].data_ptr(), per_layer == 4 ? cache[2].mutable_data_ptr<float>() : nullptr,
                     per_layer == 4 ? cache[3].mutable_data_ptr<float>() : nullptr,
                     block_tables.const_data_ptr<int32_t>(), context_lens.const_data_ptr<int32_t>(),
                     o.mutable_data_ptr<float>(), seqs, num_heads[l], kv_heads, head_dim, block_size,
                     block_tables.size(1), static_cast<float>(scale));
        x = product(o, w[1], std::nullopt, packed[4 * l + 1], &x);
        // the MLP: x + down(silu(gate) * up), gate and up from one product of norm(x)
        at::Tensor gate_up =
            product(rms_norm(x, norms[2 * l + 1], eps), w[2], std::nullopt, packed[4 * l + 2], nullptr);
        const int64_t inter = gate_up.size(1) / 2;
        at::Tensor act = at::empty({seqs, inter}, x.options());
        silu_mul_fn(gate_up.const_data_ptr<float>(), seqs, inter, act.mutable_data_ptr<float>());
        x = product(act, w[3], std::nullopt, packed[4 * l + 3], &x);
    }
    return x;
}

} // namespace

TORCH_LIBRARY(minillm, m) {
    m.def("set_kernels(int rms_norm, int silu_mul, int rope_store_decode) -> ()", set_kernels);
    m.def("decode_layers(Tensor x, Tensor[] weights, int[] packed, Tensor?[] qkv_biases, Tensor[] norms, "
          "Tensor[] caches, Tensor cos, Tensor sin_signed, Tensor positions, Tensor slots, Tensor block_tables, "
          "Tensor context_lens, int[] num_heads, float eps, float scale) -> Tensor",
          decode_layers);
}
