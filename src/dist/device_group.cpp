#include "dist/device_group.h"

#include <cuda_runtime.h>

#include <set>

#include "backends/device_api.h"
#include "core/error.h"
#include "dist/topology.h"

namespace chimera::dist {

namespace {

ncclDataType_t nccl_dtype(const Tensor& t, const char* op) {
  switch (t.dtype()) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    default: runtime_error("dist::DeviceGroup::{}: {} is not F32, BF16 or F16", op, t.describe());
  }
}

// [rows, cols] of a tensor of any rank: its last dimension as the row length.
std::pair<int64_t, int64_t> rows_cols(const Tensor& t) {
  const int64_t cols = t.ndim() == 0 ? 1 : t.dim(t.ndim() - 1);
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

}  // namespace

DeviceGroup::DeviceGroup(const std::vector<int>& devices, AllReduceConfig config) {
  if (devices.size() < 2)
    invalid_input("dist::DeviceGroup: {} device(s); device collectives need 2 or more", devices.size());
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
    invalid_input("dist::DeviceGroup: every rank needs its own GPU (NCCL refuses two ranks on one device)");
  }
  comm_ = Communicator::create_local(devices);
  fusion_ = std::make_unique<AllReduceFusion>(*comm_, detect_topology(devices), config);
}

DeviceGroup::DeviceGroup(const ncclUniqueId& id, int n_ranks, int first_rank, const std::vector<int>& devices,
                         AllReduceConfig config) {
  if (n_ranks < 2) invalid_input("dist::DeviceGroup: {} rank(s); device collectives need 2 or more", n_ranks);
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
    invalid_input("dist::DeviceGroup: every rank needs its own GPU (NCCL refuses two ranks on one device)");
  }
  comm_ = Communicator::create_ranks(id, n_ranks, first_rank, devices);
  fusion_ = std::make_unique<AllReduceFusion>(*comm_, detect_topology(devices), config);
}

DeviceGroup::~DeviceGroup() = default;

void DeviceGroup::abort() { comm_->abort(); }

int DeviceGroup::local(int rank) const {
  if (comm_->aborted()) runtime_error("dist::DeviceGroup: the NCCL clique was aborted (a peer failed or hung)");
  const int i = rank - comm_->first_rank();
  if (i < 0 || i >= comm_->local_ranks()) {
    runtime_error("dist::DeviceGroup: rank {} is not one of this process's ranks {}-{}", rank, comm_->first_rank(),
                  comm_->first_rank() + comm_->local_ranks() - 1);
  }
  return i;
}

void DeviceGroup::all_reduce(int rank, const Tensor& x, void* stream) {
  const auto [rows, cols] = rows_cols(x);
  if (rows == 0 || cols == 0) return;
  const Tensor sum = device::empty(Device::kCuda, x.dtype(), x.shape());
  AllReduceParams p;
  p.pattern = FusionPattern::kAllReduce;
  p.dtype = x.dtype();
  p.tokens = rows;
  p.hidden = cols;
  p.input = x.data();
  p.output = sum.data();
  fusion_->run(local(rank), p, stream);
  const cudaError_t e =
      cudaMemcpyAsync(x.data(), sum.data(), x.nbytes(), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) runtime_error("dist::DeviceGroup::all_reduce: cudaMemcpyAsync: {}", cudaGetErrorString(e));
}

void DeviceGroup::all_reduce_add_rms_norm(int rank, const Tensor& residual, const Tensor& out, const Tensor& x,
                                          const Tensor& weight, float eps, void* stream) {
  if (residual.dtype() != x.dtype() || out.dtype() != x.dtype() || weight.dtype() != x.dtype()) {
    runtime_error(
        "dist::DeviceGroup::all_reduce_add_rms_norm: residual {}, out {}, x {} and weight {} must share a dtype",
        residual.describe(), out.describe(), x.describe(), weight.describe());
  }
  if (x.dim(0) == 0) return;
  AllReduceParams p;
  p.pattern = FusionPattern::kResidualRmsNorm;
  p.dtype = x.dtype();
  p.tokens = x.dim(0);
  p.hidden = x.dim(1);
  p.input = x.data();
  p.residual_in = residual.data();
  p.residual_out = residual.data();
  p.norm_out = out.data();
  p.norm_weight = weight.data();
  p.eps = eps;
  fusion_->run(local(rank), p, stream);
}

void DeviceGroup::all_gather(int rank, const Tensor& in, const Tensor& out, void* stream) {
  if (out.numel() != in.numel() * size()) {
    runtime_error("dist::DeviceGroup::all_gather: out {} does not hold {} x in {}", out.describe(), size(),
                  in.describe());
  }
  nccl_check(ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.numel()), nccl_dtype(in, "all_gather"),
                           comm_->nccl(local(rank)), static_cast<cudaStream_t>(stream)),
             "ncclAllGather");
}

}  // namespace chimera::dist
