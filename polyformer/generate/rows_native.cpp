// The default decode plan's block loop (polyformer/generate/rows.py) as one C++ call per step: the same
// ATen operations on the same buffers in the same order as the Python loop, without its per-operation
// interpreter and binding costs. Built and loaded by polyformer/generate/native.py.
#include <torch/extension.h>

#include <optional>
#include <vector>

namespace {

// A linear layer's (in, out) matrix: an input-major copy of `param`, valid while the parameter's version
// counter and storage are those it was made from, or (no copy) param.t(), read afresh every step.
struct Product {
  at::Tensor param, copy, bias;
  bool has_copy = false, has_bias = false;
  int64_t version = 0;
  const void* ptr = nullptr;

  at::Tensor rows() const { return has_copy ? copy : param.t(); }
  bool current() const { return !has_copy || (param._version() == version && param.const_data_ptr() == ptr); }
  void into(const at::Tensor& x, at::Tensor& out) const {
    if (has_bias) at::addmm_out(out, bias, x, rows());
    else at::mm_out(out, x, rows());
  }
  void accumulate(at::Tensor& res, const at::Tensor& x) const {
    res.addmm_(x, rows());
    if (has_bias) res.add_(bias);
  }
};

struct Block {
  bool attention = false;
  int64_t norm = 0;                 // 0 none, 1 layer norm, 2 RMS norm
  at::Tensor norm_weight, norm_bias;
  bool norm_has_weight = false, norm_has_bias = false;
  std::vector<int64_t> norm_shape;
  double eps = 0;
  Product first, second;            // q|k|v and output, or the feedforward's two
  at::Tensor buf, q, k, v, gelu;    // buffers and views (attention: q|k|v rows; feedforward: hidden, its GELU view)
  double scale = 1;
  bool gqa = false;
};

std::optional<at::Tensor> optional(bool has, const at::Tensor& t) {
  return has ? std::optional<at::Tensor>(t) : std::nullopt;
}

Product make_product(const at::Tensor& param, const std::optional<at::Tensor>& copy,
                     const std::optional<at::Tensor>& bias) {
  Product p;
  p.param = param;
  if (copy) {
    p.copy = *copy;
    p.has_copy = true;
    p.version = param._version();
    p.ptr = param.const_data_ptr();
  }
  if (bias) {
    p.bias = *bias;
    p.has_bias = true;
  }
  return p;
}

class NativeRows {
 public:
  explicit NativeRows(at::Tensor res) : res_(std::move(res)) {}

  void set_norm(Block& b, int64_t kind, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& bias,
                std::vector<int64_t> shape, double eps) {
    b.norm = kind;
    if (w) { b.norm_weight = *w; b.norm_has_weight = true; }
    if (bias) { b.norm_bias = *bias; b.norm_has_bias = true; }
    b.norm_shape = std::move(shape);
    b.eps = eps;
  }

  void add_attention(int64_t norm, std::optional<at::Tensor> norm_w, std::optional<at::Tensor> norm_b,
                     std::vector<int64_t> norm_shape, double eps, at::Tensor qkv_w, std::optional<at::Tensor> qkv_copy,
                     std::optional<at::Tensor> qkv_b, at::Tensor out_w, std::optional<at::Tensor> out_copy,
                     std::optional<at::Tensor> out_b, at::Tensor buf, at::Tensor q, at::Tensor k, at::Tensor v,
                     double scale, bool gqa) {
    Block b;
    b.attention = true;
    set_norm(b, norm, norm_w, norm_b, std::move(norm_shape), eps);
    b.first = make_product(qkv_w, qkv_copy, qkv_b);
    b.second = make_product(out_w, out_copy, out_b);
    b.buf = buf; b.q = q; b.k = k; b.v = v;
    b.scale = scale;
    b.gqa = gqa;
    blocks_.push_back(std::move(b));
  }

  void add_feedforward(int64_t norm, std::optional<at::Tensor> norm_w, std::optional<at::Tensor> norm_b,
                       std::vector<int64_t> norm_shape, double eps, at::Tensor in_w, std::optional<at::Tensor> in_copy,
                       std::optional<at::Tensor> in_b, at::Tensor out_w, std::optional<at::Tensor> out_copy,
                       std::optional<at::Tensor> out_b, at::Tensor hidden, at::Tensor gelu) {
    Block b;
    set_norm(b, norm, norm_w, norm_b, std::move(norm_shape), eps);
    b.first = make_product(in_w, in_copy, in_b);
    b.second = make_product(out_w, out_copy, out_b);
    b.buf = hidden;
    b.gelu = gelu;
    blocks_.push_back(std::move(b));
  }

  // Whether every input-major copy still matches its parameter (else the caller refreshes and rebinds).
  bool current() const {
    for (const auto& b : blocks_)
      if (!b.first.current() || !b.second.current()) return false;
    return true;
  }

  // One step over the residual rows: keys / values of attention block n go to row rows[n] of k / v
  // (layers, b, hk, max_len, d) at position `length`, attention reads positions [0, length].
  bool step(const at::Tensor& k, const at::Tensor& v, int64_t length, const std::optional<at::Tensor>& mask,
            const std::vector<int64_t>& rows) {
    if (!current()) return false;
    size_t n = 0;
    const int64_t end = length + 1, batch = res_.size(0);
    for (auto& b : blocks_) {
      at::Tensor x = res_;
      if (b.norm == 1) {
        x = at::layer_norm(res_, b.norm_shape, optional(b.norm_has_weight, b.norm_weight),
                           optional(b.norm_has_bias, b.norm_bias), b.eps);
      } else if (b.norm == 2) {
        x = at::rms_norm(res_, b.norm_shape, optional(b.norm_has_weight, b.norm_weight), b.eps);
      }
      b.first.into(x, b.buf);
      if (b.attention) {
        at::Tensor keys = k.select(0, rows[n]), values = v.select(0, rows[n]);
        ++n;
        keys.select(2, length).copy_(b.k);
        values.select(2, length).copy_(b.v);
        at::Tensor out = at::scaled_dot_product_attention(
            b.q, keys.narrow(2, 0, end), values.narrow(2, 0, end), mask, 0.0, false, b.scale, b.gqa);
        b.second.accumulate(res_, out.reshape({batch, -1}));
      } else {
        at::gelu_(b.gelu);
        b.second.accumulate(res_, b.buf);
      }
    }
    return true;
  }

 private:
  at::Tensor res_;
  std::vector<Block> blocks_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<NativeRows>(m, "NativeRows")
      .def(pybind11::init<at::Tensor>())
      .def("add_attention", &NativeRows::add_attention)
      .def("add_feedforward", &NativeRows::add_feedforward)
      .def("current", &NativeRows::current)
      .def("step", &NativeRows::step);
}
