// Which kernel serves a call, or why none does: the one place graphar decides it, for the op's C++
// kernel and for Python alike. The caller describes its tensors (graphar_tensor); the communicator holds
// the kernel table its ranks agreed on (graphar_comm_set_kernels). A declined call is not an error: the
// caller runs the collective, and the reason (graphar_last_error) is what it logs.
#include <cuda_runtime.h>

#include <cstdint>

#include "comm.cuh"
#include "graphar_cuda.h"
#include "host.h"
#include "launch.cuh"
#include "push_norm.cuh"

using namespace graphar;

namespace {

using ull = unsigned long long;

const char* algo_name(int algo) {
  switch (algo) {
    case GRAPHAR_ONE_STAGE: return "1stage";
    case GRAPHAR_TWO_STAGE: return "2stage";
    case GRAPHAR_PUSH_ONE_SHOT: return "push-oneshot";
    case GRAPHAR_PUSH_TWO_SHOT: return "push-twoshot";
    default: return nullptr;
  }
}

// An error, not a verdict: nothing of a group that timed out may run (its peers may be gone).
int check_usable(const Comm* c) {
  if (!c->opened) return fail(GRAPHAR_EINVAL, "a call before the peers' buffers were opened");
  if (*reinterpret_cast<const volatile uint32_t*>(&c->error.get()->failed) != 0) {  // the kernels write it, mapped
    return fail(GRAPHAR_EINVAL,
                "the group timed out (a kernel of it gave up waiting for a peer), so every call raises; "
                "graphar's GrapharTimeoutError (the communicator's check()) says where");
  }
  return 0;
}

// Whether the kernels can read t as it is; `what` names it in the reason.
int check_tensor(const Comm* c, const graphar_tensor& t, const char* what) {
  if (t.dtype < GRAPHAR_FLOAT32 || t.dtype > GRAPHAR_BFLOAT16) {
    return fail(GRAPHAR_DECLINED, "the %s's dtype is not float32, float16 or bfloat16", what);
  }
  if (t.device != c->device) {
    return t.device < 0 ? fail(GRAPHAR_DECLINED, "the %s is not on a GPU", what)
                        : fail(GRAPHAR_DECLINED, "the %s is on cuda:%d, not on cuda:%d", what, t.device, c->device);
  }
  if (!t.contiguous) return fail(GRAPHAR_DECLINED, "the %s is not contiguous", what);
  if (t.nbytes == 0 || t.nbytes % 16 != 0) {
    return fail(GRAPHAR_DECLINED, "the %s's %llu bytes is not a positive multiple of 16", what, ull(t.nbytes));
  }
  if (t.nbytes > c->max_bytes) {
    return fail(GRAPHAR_DECLINED, "the %s's %llu bytes is over the limit of %llu", what, ull(t.nbytes),
                ull(c->max_bytes));
  }
  if (t.data % 16 != 0) return fail(GRAPHAR_DECLINED, "the %s's data pointer is not 16-byte aligned", what);
  return 0;
}

int plan(const Comm* c, const graphar_tensor& x, cudaStream_t stream, int how, int forced, int32_t* out,
         int32_t* path) {
  if (int rc = check_usable(c)) return rc;
  if (int rc = check_tensor(c, x, "input")) return rc;
  int mode = GRAPHAR_ROWS_GRAPHAR_GRAPH;
  bool eager = false;  // graphar.graph's calls are captured
  if (how != GRAPHAR_PLAN_GRAPHAR_GRAPH) {
    if (int rc = is_eager(stream, &eager)) return rc;
    if (!eager && how == GRAPHAR_PLAN_EAGER_ONLY) return GRAPHAR_CAPTURING;
    mode = eager ? GRAPHAR_ROWS_EAGER : GRAPHAR_ROWS_GRAPH;
  }
  *path = eager ? GRAPHAR_UNCAPTURED : GRAPHAR_CAPTURED_COPY;
  if (forced != 0) {
    if (algo_name(forced) == nullptr) return fail(GRAPHAR_EINVAL, "unknown all-reduce algorithm %d", forced);
    if (x.nbytes > (forced == GRAPHAR_PUSH_ONE_SHOT ? one_shot_limit(c) : c->max_bytes)) {
      return fail(GRAPHAR_DECLINED, "%llu bytes is over the limits of the forced kernel '%s'", ull(x.nbytes),
                  algo_name(forced));
    }
    *out = forced;
    return 0;
  }
  const graphar_kernels& k = c->kernels;
  for (int i = 0; i < k.rows[mode]; i++) {
    if (x.nbytes > k.bounds[mode][i]) continue;
    if (k.algos[mode][i] == 0) break;
    *out = k.algos[mode][i];
    return 0;
  }
  return fail(GRAPHAR_DECLINED,
              "the kernel table gives %llu bytes to the collective (a forced kernel's limit, or a tuned row "
              "that measured it faster)",
              ull(x.nbytes));
}

int plan_norm(const Comm* c, const graphar_tensor& x, const graphar_tensor& residual, const graphar_tensor& weight,
              uint64_t row_bytes) {
  if (int rc = check_usable(c)) return rc;
  const uint64_t fused_max = c->kernels.fused_norm_max;
  if (fused_max == 0) return fail(GRAPHAR_DECLINED, "the fused norm is off (a kernel other than push-oneshot is forced)");
  if (int rc = check_tensor(c, x, "input")) return rc;
  if (x.nbytes > fused_max) {
    return fail(GRAPHAR_DECLINED, "%llu bytes are over the fused norm's %llu", ull(x.nbytes), ull(fused_max));
  }
  if (row_bytes == 0 || row_bytes % 16 != 0 || x.nbytes % row_bytes != 0) {
    return fail(GRAPHAR_DECLINED, "rows of %llu bytes are not a multiple of 16", ull(row_bytes));
  }
  if (row_bytes > kNormMaxRowBytes) {
    return fail(GRAPHAR_DECLINED, "rows of %llu bytes are over the kernel's %llu", ull(row_bytes),
                ull(kNormMaxRowBytes));
  }
  const struct {
    const graphar_tensor& t;
    const char* what;
    uint64_t nbytes;
  } others[] = {{residual, "residual", x.nbytes}, {weight, "weight", row_bytes}};
  for (const auto& o : others) {
    if (o.t.data == 0) continue;
    if (o.t.dtype != x.dtype) {
      return fail(GRAPHAR_DECLINED, "the %s's dtype is not the input's: the kernel takes one dtype", o.what);
    }
    if (int rc = check_tensor(c, o.t, o.what)) return rc;
    if (o.t.nbytes != o.nbytes) {
      return fail(GRAPHAR_DECLINED, "the %s has %llu bytes, the kernel takes %llu", o.what, ull(o.t.nbytes),
                  ull(o.nbytes));
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int graphar_comm_set_kernels(void* comm, const graphar_kernels* kernels) {
  Comm* c = as_comm(comm);
  const graphar_kernels& k = *kernels;
  for (int m = 0; m < GRAPHAR_ROW_MODES; m++) {
    if (k.rows[m] < 0 || k.rows[m] > GRAPHAR_MAX_ROWS) {
      return fail(GRAPHAR_EINVAL, "%d rows in mode %d: at most %d", k.rows[m], m, GRAPHAR_MAX_ROWS);
    }
    for (int i = 0; i < k.rows[m]; i++) {
      if ((k.algos[m][i] != 0 && algo_name(k.algos[m][i]) == nullptr) || (i > 0 && k.bounds[m][i] <= k.bounds[m][i - 1])) {
        return fail(GRAPHAR_EINVAL, "row %d of mode %d: an unknown kernel or bounds not ascending", i, m);
      }
    }
  }
  if (k.fused_norm_max > one_shot_limit(c)) {
    return fail(GRAPHAR_EINVAL, "the fused norm's %llu bytes are over the push one-shot's room", ull(k.fused_norm_max));
  }
  c->kernels = k;
  return 0;
}

int graphar_comm_plan(void* comm, const graphar_tensor* x, uint64_t stream, int how, int algo, int32_t* algo_out,
                      int32_t* path_out) {
  return plan(as_comm(comm), *x, reinterpret_cast<cudaStream_t>(stream), how, algo, algo_out, path_out);
}

int graphar_comm_plan_norm(void* comm, const graphar_tensor* x, const graphar_tensor* residual,
                           const graphar_tensor* weight, uint64_t row_bytes) {
  return plan_norm(as_comm(comm), *x, *residual, *weight, row_bytes);
}

}  // extern "C"
