// The default decode plan's block loop (polyformer/generate/rows.py) as one C++ call per step: the same
// ATen operations on the same buffers in the same order as the Python loop, without its per-operation
// interpreter and binding costs. Built and loaded by polyformer/generate/native.py. Also the int8 weight
// product of polyformer/quantize.py (`int8_linear`), which int8 blocks of the loop run too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <optional>
#include <vector>

namespace {

std::optional<at::Tensor> optional(bool has, const at::Tensor& t) {
  return has ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Dot products of float32 x (in) with 4 int8 rows w, w + in, w + 2 in, w + 3 in, into dots[4]: each weight
// converted to float32 exactly, the products summed in float32 (lanes, then across lanes and the tail).
using Dot4 = void (*)(const int8_t*, int64_t, const float*, float*);

float dot1(const int8_t* w, int64_t in, const float* x) {
  float acc = 0;
  for (int64_t i = 0; i < in; ++i) acc += static_cast<float>(w[i]) * x[i];
  return acc;
}

void dot4_scalar(const int8_t* w, int64_t in, const float* x, float* dots) {
  for (int r = 0; r < 4; ++r) dots[r] = dot1(w + r * in, in, x);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Named accumulators (an array of them is kept in memory at -O2): two per row, 8 independent FMA chains.
#define POLY_DOT4(VEC, WIDTH, ZERO, LOADX, CONVERT, FMA, REDUCE)                                          \
  VEC a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO(), b0 = ZERO(), b1 = ZERO(), b2 = ZERO(), b3 = ZERO(); \
  const int8_t *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in;                               \
  const int64_t ahead = 16 * in;    /* the same columns 4 tiles on: streamed ahead into L2 (2x faster here) */ \
  int64_t i = 0;                                                                                          \
  for (; i + 2 * WIDTH <= in; i += 2 * WIDTH) {                                                           \
    const VEC x0 = LOADX(x + i), x1 = LOADX(x + i + WIDTH);                                               \
    for (const int8_t* p : {w0, w1, w2, w3}) _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead), _MM_HINT_T1); \
    a0 = FMA(CONVERT(w0 + i), x0, a0); b0 = FMA(CONVERT(w0 + i + WIDTH), x1, b0);                         \
    a1 = FMA(CONVERT(w1 + i), x0, a1); b1 = FMA(CONVERT(w1 + i + WIDTH), x1, b1);                         \
    a2 = FMA(CONVERT(w2 + i), x0, a2); b2 = FMA(CONVERT(w2 + i + WIDTH), x1, b2);                         \
    a3 = FMA(CONVERT(w3 + i), x0, a3); b3 = FMA(CONVERT(w3 + i + WIDTH), x1, b3);                         \
  }                                                                                                       \
  for (; i + WIDTH <= in; i += WIDTH) {                                                                   \
    const VEC x0 = LOADX(x + i);                                                                          \
    a0 = FMA(CONVERT(w0 + i), x0, a0); a1 = FMA(CONVERT(w1 + i), x0, a1);                                 \
    a2 = FMA(CONVERT(w2 + i), x0, a2); a3 = FMA(CONVERT(w3 + i), x0, a3);                                 \
  }                                                                                                       \
  const float sums[4] = {REDUCE(a0, b0), REDUCE(a1, b1), REDUCE(a2, b2), REDUCE(a3, b3)};                 \
  for (int r = 0; r < 4; ++r) dots[r] = sums[r] + dot1(w + r * in + i, in - i, x + i);

__attribute__((target("avx2,fma"))) inline __m256 convert8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

__attribute__((target("avx2,fma"))) inline float reduce8(__m256 a, __m256 b) {
  const __m256 v = _mm256_add_ps(a, b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

__attribute__((target("avx2,fma"))) void dot4_avx2(const int8_t* w, int64_t in, const float* x, float* dots) {
  POLY_DOT4(__m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, convert8, _mm256_fmadd_ps, reduce8)
}

__attribute__((target("avx512f"))) inline __m512 convert16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

__attribute__((target("avx512f"))) inline float reduce16(__m512 a, __m512 b) {
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

__attribute__((target("avx512f"))) void dot4_avx512(const int8_t* w, int64_t in, const float* x, float* dots) {
  POLY_DOT4(__m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, convert16, _mm512_fmadd_ps, reduce16)
}
#undef POLY_DOT4
#endif

// The dot products for instruction set `level` (0 scalar, 1 AVX2, 2 AVX-512), or the best this CPU runs (-1).
int64_t best_level() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

Dot4 pick_dot4(int64_t level) {
  static const int64_t best = best_level();
  TORCH_CHECK(level <= best, "int8_linear: instruction set level ", level, " is above this CPU's ", best);
  if (level < 0) level = best;
#if defined(__x86_64__) && defined(__GNUC__)
  if (level == 2) return dot4_avx512;
  if (level == 1) return dot4_avx2;
#endif
  return dot4_scalar;
}

// out (b, out) = x (b, in) @ (q * scale[:, None]).T + bias, or out += that with `accumulate`: float32 rows
// (unit column stride), q (out, in) int8 contiguous, scale / bias (out,) float32. Weight-major: each
// 4-row slice of q is read once from memory for all b rows (b is small when decoding).
void int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate, int64_t level = -1) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "int8_linear: float32 CPU rows expected");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && scale.is_contiguous() &&
              scale.scalar_type() == at::kFloat, "int8_linear: int8 (out, in) weight and float32 scales expected");
  const int64_t b = x.size(0), in = q.size(1), n = q.size(0);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(1) == in && out.size(0) == b && out.size(1) == n &&
              (x.stride(1) == 1 || in == 1) && (out.stride(1) == 1 || n == 1), "int8_linear: shapes");
  const bool has_bias = bias.has_value();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous()), "int8_linear: bias");
  const Dot4 dot4 = pick_dot4(level);
  const int8_t* w = q.const_data_ptr<int8_t>();
  const float* xs = x.const_data_ptr<float>();
  const float* s = scale.const_data_ptr<float>();
  const float* bs = has_bias ? bias->const_data_ptr<float>() : nullptr;
  float* ys = out.mutable_data_ptr<float>();
  const int64_t xstride = x.stride(0), ystride = out.stride(0), tiles = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, in * b));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float dots[4];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o = 4 * t, rows = std::min<int64_t>(4, n - o);
      for (int64_t row = 0; row < b; ++row) {
        const float* xr = xs + row * xstride;
        if (rows == 4) {
          dot4(w + o * in, in, xr, dots);
        } else {                    // the last rows of a matrix whose row count is not a multiple of 4
          for (int64_t r = 0; r < rows; ++r) dots[r] = dot1(w + (o + r) * in, in, xr);
        }
        float* yr = ys + row * ystride + o;
        for (int64_t r = 0; r < rows; ++r) {
          const float y = dots[r] * s[o + r] + (has_bias ? bs[o + r] : 0.0f);
          yr[r] = accumulate ? yr[r] + y : y;
        }
      }
    }
  });
}

// A linear layer's (in, out) matrix: an input-major copy of `param`, valid while the parameter's version
// counter and storage are those it was made from, or (no copy) param.t(), read afresh every step.
// Or an int8 layer's (out, in) weight `param` with its per-row `scale` (`int8`), run by int8_linear.
struct Product {
  at::Tensor param, copy, bias, scale;
  bool has_copy = false, has_bias = false, int8 = false;
  int64_t version = 0;
  const void* ptr = nullptr;

  at::Tensor rows() const { return has_copy ? copy : param.t(); }
  bool current() const { return !has_copy || (param._version() == version && param.const_data_ptr() == ptr); }
  void into(const at::Tensor& x, at::Tensor& out) const {
    if (int8) int8_linear(x, param, scale, optional(has_bias, bias), out, false);
    else if (has_bias) at::addmm_out(out, bias, x, rows());
    else at::mm_out(out, x, rows());
  }
  void accumulate(at::Tensor& res, const at::Tensor& x) const {
    if (int8) return int8_linear(x, param, scale, optional(has_bias, bias), res, true);
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

  // Block n's first (q|k|v, feedforward in) or second product as an int8 one: its weight, given to add_*,
  // is the (out, in) int8 matrix and `scale` its rows' float32 scales.
  void set_int8(int64_t n, bool second, at::Tensor scale) {
    Product& p = second ? blocks_.at(n).second : blocks_.at(n).first;
    TORCH_CHECK(p.param.scalar_type() == at::kChar && !p.has_copy, "set_int8: an int8 weight without a copy");
    p.int8 = true;
    p.scale = std::move(scale);
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
      .def("step", &NativeRows::step)
      .def("set_int8", &NativeRows::set_int8);
  m.def("int8_linear", [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias, at::Tensor out, bool accumulate, int64_t level) {
    int8_linear(x, q, scale, bias, out, accumulate, level);
  }, pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scale"), pybind11::arg("bias"), pybind11::arg("out"),
        pybind11::arg("accumulate") = false, pybind11::arg("level") = -1);
  m.def("int8_level", &best_level);
}
