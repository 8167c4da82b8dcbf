// Row-indexed AdamW for the STEM tables' optimizer (megatron_stem/training/tables/adam.py).
//
// Updates chosen rows of a table and of its Adam moments in place, with DeepSpeed's CPU
// Adam arithmetic (its Adam_Optimizer, compiled from its own sources): the touched rows of
// a 128k-row table are scattered, and packing them into contiguous buffers for DeepSpeed's
// flat-tensor kernel, then scattering them back, moves the master and both moments twice
// more than Adam itself does. Every element goes through the kernel's SIMD code: a row's
// last `width % kVector` elements are updated in a zero-padded vector (DeepSpeed's scalar
// tail rounds differently), so an element's result does not depend on how rows are
// packed, and equals what DeepSpeed's op gives for the same element in a flat tensor.
//
// Clipping is folded in (`grad_scale`: each gradient row is scaled into a small buffer as
// the kernel is about to read it, no pass over all gradients of its own), and the op runs
// without the GIL: the overlapped update calls it from a worker thread while the main
// thread launches the next step's kernels.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstring>

// DeepSpeed's kernel definitions (Step_8 & co. are templates defined in this file).
#include "cpu_adam_impl.cpp"

namespace {

constexpr int64_t kVector = 64;  // a multiple of every SIMD width DeepSpeed builds for
constexpr int64_t kSpan = 64;    // rows per kernel call at most

void check_rows(const torch::Tensor& t, const char* name, int64_t width)
{
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2,
                name, ": expected a 2-D fp32 CPU tensor");
    TORCH_CHECK(t.size(1) == width && t.stride(1) == 1, name, ": rows must be contiguous and ",
                width, " wide");
}

template <typename out_t>
void copy_row(out_t* dst, const float* src, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<out_t>(src[i]);
}

}  // namespace

// params[param_rows[k]], exp_avg[state_rows[k]], exp_avg_sq[state_rows[k]] take one AdamW
// step with gradient grads[grad_rows[k]] x grad_scale (grad_rows[k] < 0: a zero gradient); the new
// params rows go to out[k] (fp32 or bf16) when `out` is not empty. Rows may repeat only
// if they are not written twice (param_rows and state_rows each unique).
void adam_update_rows(int64_t step,
                      double lr,
                      double beta1,
                      double beta2,
                      double eps,
                      double weight_decay,
                      double grad_scale,
                      torch::Tensor params,
                      torch::Tensor exp_avg,
                      torch::Tensor exp_avg_sq,
                      torch::Tensor grads,
                      torch::Tensor param_rows,
                      torch::Tensor state_rows,
                      torch::Tensor grad_rows,
                      torch::Tensor out)
{
    const int64_t width = params.size(1), count = param_rows.numel();
    for (auto [t, name] : {std::pair{&params, "params"}, {&exp_avg, "exp_avg"},
                           {&exp_avg_sq, "exp_avg_sq"}, {&grads, "grads"}})
        check_rows(*t, name, width);
    for (auto [t, name] : {std::pair{&param_rows, "param_rows"}, {&state_rows, "state_rows"},
                           {&grad_rows, "grad_rows"}})
        TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() &&
                        t->numel() == count,
                    name, ": expected ", count, " contiguous int64 row ids");
    const bool write_out = out.numel() > 0;
    if (write_out) {
        TORCH_CHECK(out.is_contiguous() && out.size(0) == count && out.size(1) == width &&
                        (out.scalar_type() == torch::kFloat32 ||
                         out.scalar_type() == torch::kBFloat16),
                    "out: expected a contiguous [rows, width] fp32 or bf16 tensor");
    }

    // A fresh instance: its beta powers are exactly those of step `step` (pow, or beta
    // itself at step 1), whatever was called before.
    Adam_Optimizer opt(lr, beta1, beta2, eps, weight_decay, /*adamw_mode=*/true);
    opt.IncrementStep(step, beta1, beta2);
    opt.update_state(lr, eps, weight_decay, /*bias_correction=*/true);

    const int64_t* prow = param_rows.data_ptr<int64_t>();
    const int64_t* srow = state_rows.data_ptr<int64_t>();
    const int64_t* grow = grad_rows.data_ptr<int64_t>();
    float* p = params.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    const float* g = grads.data_ptr<float>();
    const int64_t ps = params.stride(0), ms = exp_avg.stride(0), vs = exp_avg_sq.stride(0),
                  gs = grads.stride(0);
    const int64_t prows = params.size(0), srows = exp_avg.size(0), grows = grads.size(0);
    for (int64_t k = 0; k < count; ++k) {
        TORCH_CHECK(prow[k] >= 0 && prow[k] < prows && srow[k] >= 0 && srow[k] < srows &&
                        grow[k] < grows,
                    "row ids out of range at ", k);
    }
    // Runs of rows that follow each other in all three tensors (a `dense` update's owned
    // rows, zero-gradient stretches) go to the kernel as one span: a call per row would
    // cost more than the row's arithmetic at small widths.
    const bool packed = ps == width && ms == width && vs == width && gs == width;
    const std::vector<float> zeros(kSpan * width, 0.0f);
    const float scale = static_cast<float>(grad_scale);

    at::parallel_for(0, count, std::max<int64_t>(1, 16384 / width), [&](int64_t lo, int64_t hi) {
        float pad[4][kVector];
        std::vector<float> scaled(scale != 1.0f ? kSpan * width : 0);
        for (int64_t k = lo, n = 1; k < hi; k += n) {
            n = 1;
            while (packed && k + n < hi && n < kSpan && prow[k + n] == prow[k] + n &&
                   srow[k + n] == srow[k] + n &&
                   (grow[k] < 0 ? grow[k + n] < 0 : grow[k + n] == grow[k] + n))
                ++n;
            float* pk = p + prow[k] * ps;
            float* mk = m + srow[k] * ms;
            float* vk = v + srow[k] * vs;
            // DeepSpeed's kernel takes a mutable gradient pointer but only reads it.
            float* gk = const_cast<float*>(grow[k] < 0 ? zeros.data() : g + grow[k] * gs);
            const int64_t size = n * width, body = size - size % kVector, tail = size - body;
            if (!scaled.empty() && grow[k] >= 0) {  // the rows' gradients, clipped (g x c)
                for (int64_t r = 0; r < n; ++r)
                    for (int64_t i = 0; i < width; ++i)
                        scaled[r * width + i] = gk[r * gs + i] * scale;
                gk = scaled.data();
            }
            if (body) opt.Step_8(pk, gk, mk, vk, body, /*parallel=*/false);
            if (tail) {
                std::memset(pad, 0, sizeof(pad));
                float* rows[4] = {pk + body, gk + body, mk + body, vk + body};
                for (int i = 0; i < 4; ++i) std::memcpy(pad[i], rows[i], tail * sizeof(float));
                opt.Step_8(pad[0], pad[1], pad[2], pad[3], kVector, /*parallel=*/false);
                for (int i : {0, 2, 3}) std::memcpy(rows[i], pad[i], tail * sizeof(float));
            }
            if (!write_out) continue;
            for (int64_t r = 0; r < n; ++r) {
                const float* row = pk + r * ps;
                if (out.scalar_type() == torch::kFloat32)
                    copy_row(out.data_ptr<float>() + (k + r) * width, row, width);
                else
                    copy_row(out.data_ptr<c10::BFloat16>() + (k + r) * width, row, width);
            }
        }
    });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("adam_update_rows", &adam_update_rows,
          "AdamW on chosen rows of a table and its moments, in place (DeepSpeed arithmetic)",
          py::call_guard<py::gil_scoped_release>());
}
