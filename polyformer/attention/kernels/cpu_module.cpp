// The CPU attention extension's memory and its Python face: the buffer pool its large tensors come
// from, the checks of the tensors it is handed, the gradient tensors the backward entry points
// allocate around the kernels of cpu_attention.cpp and cpu_backward.cpp (those files hold the
// attention arithmetic), and the module's bindings.
//
// The buffers come from a pool that hands a buffer out again once nothing else holds it, so that the
// steps of a training loop write into memory the process has already touched (polyformer/buffers.py).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace polyformer_cpu {

// defined in cpu_attention.cpp
int64_t kept_per_task(int64_t I, int64_t J, bool causal, int64_t window);
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool causal, bool keep, int64_t window);
void set_chunk(int64_t keys);
int64_t scored_entries(bool reset);

// defined in cpu_backward.cpp
void backward_into(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& weights, double scale, bool causal, int64_t window, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv);

}  // namespace polyformer_cpu

namespace {

// Byte buffers for large training tensors (the kept weights and the large outputs and gradients here;
// polyformer/buffers.py hands them to Python). A buffer is free when the pool holds its storage alone
// (the tensor handed out, and whatever saved it for the backward, are gone). A request takes the
// smallest free buffer of at least its size and at most twice it, or a new one. Free buffers are
// dropped, least recently used first, only while they add up to more than the most the pool has had
// handed out at once: a training loop's steps keep every buffer they use (the sizes of one step
// differ, and dropping one kind to make room for another would fault fresh pages in every step),
// while requests of ever new sizes cannot make it grow past twice what a step holds.
struct Buffer {
  at::Tensor bytes;
  int64_t last_use;
};
std::mutex pool_lock;
std::vector<Buffer> pool;
int64_t pool_clock = 0, held_peak = 0;

inline bool unheld(const Buffer& b) { return b.bytes.storage().use_count() == 1; }

// (held, free) bytes of the pool (pool_lock held)
std::pair<int64_t, int64_t> pool_bytes() {
  int64_t held = 0, free = 0;
  for (const Buffer& b : pool) (unheld(b) ? free : held) += b.bytes.numel();
  return {held, free};
}

// drop least recently used free buffers while the free bytes exceed `limit` (pool_lock held)
void evict(int64_t limit) {
  int64_t free = pool_bytes().second;
  while (free > limit) {
    auto oldest = pool.end();
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (unheld(*it) && (oldest == pool.end() || it->last_use < oldest->last_use)) oldest = it;
    }
    free -= oldest->bytes.numel();
    pool.erase(oldest);
  }
}

}  // namespace

namespace polyformer_cpu {

at::Tensor pooled_bytes(int64_t n) {
  std::lock_guard<std::mutex> guard(pool_lock);
  Buffer* best = nullptr;
  for (Buffer& b : pool) {
    const int64_t size = b.bytes.numel();
    if (unheld(b) && size >= n && size <= 2 * n && (!best || size < best->bytes.numel())) best = &b;
  }
  if (!best) {
    pool.push_back({at::empty({n}, at::TensorOptions().dtype(at::kByte)), 0});
    best = &pool.back();
  }
  best->last_use = ++pool_clock;
  at::Tensor handed = best->bytes.narrow(0, 0, n);
  held_peak = std::max(held_peak, pool_bytes().first);
  evict(held_peak);
  return handed;
}

// A contiguous tensor of these sizes and dtype on a pooled buffer's storage: not a view of the pool's
// byte tensor, so autograd takes it as a fresh tensor and views of it have it as their base.
at::Tensor pooled_tensor(std::vector<int64_t> sizes, at::ScalarType dtype) {
  const int64_t n = c10::multiply_integers(sizes);
  const at::Tensor raw = pooled_bytes(std::max<int64_t>(n, 1) * c10::elementSize(dtype));
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(raw.storage(), 0, sizes);
}

// A float32 tensor of these sizes, contiguous: from the pool from 1 MiB up (outputs and gradients of a
// training step, which would otherwise fault in fresh pages every step), else a plain allocation.
at::Tensor empty_floats(std::vector<int64_t> sizes) {
  if (c10::multiply_integers(sizes) * 4 < (int64_t{1} << 20)) {
    return at::empty(sizes, at::TensorOptions().dtype(at::kFloat));
  }
  return pooled_tensor(std::move(sizes), at::kFloat);
}

// (buffers, free buffers, bytes held) of the pool; with release, the free ones are dropped first (and
// the most handed out at once starts again from what is held now)
std::vector<int64_t> pool_state(bool release) {
  std::lock_guard<std::mutex> guard(pool_lock);
  if (release) {
    evict(0);
    held_peak = pool_bytes().first;
  }
  int64_t free = 0;
  for (const Buffer& b : pool) free += unheld(b);
  const auto [held, free_bytes] = pool_bytes();
  return {static_cast<int64_t>(pool.size()), free, held + free_bytes};
}

// The BLAS wants a leading dimension of at least the row length; a length-1 sequence dimension may
// carry any stride (torch ignores it), so its rows are given the row length (the kernels read them so:
// cpu_attention.cpp's slice).
int64_t leading(const at::Tensor& t) {
  return t.size(2) <= 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
}

// q (b, h, i, d), k (b, hk, j, d), v (b, hk, j, dv) as the kernels read them
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4,
                "cpu attention takes float32 CPU tensors of shape (batch, heads, seq, dim)");
    TORCH_CHECK(t->stride(3) == 1 && leading(*t) >= t->size(3),
                "cpu attention needs unit stride in the last dimension and rows that do not overlap");
  }
  TORCH_CHECK(q.size(0) == k.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2) &&
              q.size(3) == k.size(3),
              "cpu attention: q, k, v disagree in batch, heads (a multiple of the kv heads), key length "
              "or head dim");
  TORCH_CHECK(k.size(2) > 0, "cpu attention needs at least one key");
}

}  // namespace polyformer_cpu

namespace {

using namespace polyformer_cpu;

// dK and dV of each query head, zeroed (tasks of one kv head's group run on different threads)
at::Tensor per_query_head(int64_t B, int64_t H, int64_t J, int64_t D) {
  return empty_floats({B, J, H, D}).zero_().transpose(1, 2);
}

// dK or dV per query head (b, h, j, d) summed over each kv head's group of `group` heads
at::Tensor grouped(const at::Tensor& t, int64_t group) {
  return t.reshape({t.size(0), t.size(1) / group, group, t.size(2), t.size(3)}).sum(2);
}

// Returns (dq, dk, dv) for grad_out (b, h, i, dv) given the forward's out, lse and weights (kept, or
// empty: recomputed).
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& weights, double scale, bool causal, int64_t window) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), J = k.size(2), group = H / k.size(1);
  at::Tensor dq = empty_floats({B, I, H, q.size(3)}).transpose(1, 2);
  at::Tensor dk = per_query_head(B, H, J, k.size(3)), dv = per_query_head(B, H, J, v.size(3));
  backward_into(grad_out, q, k, v, out, lse, weights, scale, causal, window, dq, dk, dv);
  if (group > 1) return {dq, grouped(dk, group), grouped(dv, group)};
  return {dq, dk, dv};
}

// The same gradients for q, k and v that are one projection's columns, side by side: heads of q, then
// of k, then of v, in each row of a (b, t, C) tensor. Returns that tensor's gradient, written in
// place of the three (no concatenation afterwards).
at::Tensor backward_packed(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const at::Tensor& weights, double scale, bool causal, int64_t window) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), HK = k.size(1), group = H / HK;
  const int64_t D = q.size(3), DV = v.size(3);
  TORCH_CHECK(k.size(2) == I, "cpu attention backward_packed: keys and queries must be the same rows");
  const int64_t C = H * D + HK * D + HK * DV;
  at::Tensor dqkv = empty_floats({B, I, C});
  auto columns = [&](int64_t start, int64_t heads, int64_t d) {
    return dqkv.narrow(2, start, heads * d).view({B, I, heads, d}).transpose(1, 2);
  };
  at::Tensor dq = columns(0, H, D), dk = columns(H * D, HK, D), dv = columns(H * D + HK * D, HK, DV);
  if (group == 1) {
    dk.zero_();
    dv.zero_();
    backward_into(grad_out, q, k, v, out, lse, weights, scale, causal, window, dq, dk, dv);
    return dqkv;
  }
  at::Tensor dk_heads = per_query_head(B, H, I, D), dv_heads = per_query_head(B, H, I, DV);
  backward_into(grad_out, q, k, v, out, lse, weights, scale, causal, window, dq, dk_heads, dv_heads);
  dk.copy_(grouped(dk_heads, group));
  dv.copy_(grouped(dv_heads, group));
  return dqkv;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_chunk", &set_chunk, "keys per chunk (default 1024)");
  m.def("kept_per_task", &kept_per_task, "floats of kept weights per (batch, head)", py::arg("I"),
        py::arg("J"), py::arg("causal"), py::arg("window") = 0);
  m.def("scored_entries", &scored_entries, "query-key entries the score products have computed since "
        "the last reset (the work a call did); with reset, the count starts again from 0");
  m.def("pool_state", &pool_state, "(buffers, free buffers, bytes) of the buffer pool; release drops the "
        "free ones first");
  m.def("pooled_bytes", &pooled_bytes, "a uint8 tensor of n bytes from the buffer pool");
  m.def("pooled_tensor", &pooled_tensor, "a contiguous tensor of these sizes and dtype from the buffer pool");
  // the GIL is released: other Python threads run while a kernel does
  m.def("forward", &forward, "exact attention forward (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "exact attention backward (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward_packed", &backward_packed, "exact attention backward into one (b, t, q|k|v columns) "
        "gradient (float32, CPU)", py::call_guard<py::gil_scoped_release>());
}
