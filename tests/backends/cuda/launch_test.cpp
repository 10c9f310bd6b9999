// cuda::launch with programmatic dependent launch (src/backends/cuda/launch.cuh): chains of ~200 dependent tiny
// kernels, each reading what its predecessor wrote (from other blocks) and overwriting what its predecessor
// read, must give exact results with PDL on and off, eagerly and captured in a CUDA graph replayed with new
// inputs, also when plain <<<>>> launches and memcpy nodes sit in the chain. Blocks sleep between their read
// and their write, so a kernel that got past pdl_wait() before its predecessor finished would read stale or
// poisoned values. Each chain also measures (%globaltimer) that PDL really let kernels start early. And
// cuBLASLt GEMMs between PDL kernels give the same bits with PDL on and off. Skips without a GPU; in a build
// without CUDA the chain cases skip as well.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backends/device_api.h"
#include "common/compare.h"
#include "ops/ops.h"

#if defined(CHIMERA_HAVE_CUDA)
#include "backends/cuda/pdl_chain.h"
#endif

namespace chimera {
namespace {

struct ChainCase {
  bool pdl;
  bool graph;
  bool mixed;  // plain launches and memcpy nodes in the chain
};

class PdlLaunch : public ::testing::TestWithParam<ChainCase> {
 protected:
  void SetUp() override {
    if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
#if defined(CHIMERA_HAVE_CUDA)
    if (GetParam().pdl && test::device_cc_major() < 9) GTEST_SKIP() << "PDL needs sm_90+";
#endif
  }
};

TEST_P(PdlLaunch, DependentChainIsExact) {
#if defined(CHIMERA_HAVE_CUDA)
  const ChainCase cc = GetParam();
  const device::LaunchScope pdl(cc.pdl);  // this thread's launches
  ASSERT_EQ(device::pdl_enabled(), cc.pdl);
  test::Rng rng = test::Rng::for_test();
  test::PdlChain c;
  c.n = static_cast<int>(rng.integer(20001, 40000));  // a partial last block; 157-313 blocks
  c.steps = 200;
  c.copy_every = cc.mixed ? 50 : 0;
  c.plain_every = cc.mixed ? 7 : 0;
  c.delay_ns = 2000;
  c.graph = cc.graph;
  std::vector<std::vector<uint32_t>> inputs(3);
  for (auto& in : inputs) {
    in.resize(static_cast<size_t>(c.n));
    for (auto& v : in) v = static_cast<uint32_t>(rng.integer(0, 0xffffffffLL));
  }
  const test::PdlChainResult res = test::run_pdl_chain(c, inputs);
  const auto& got = res.outputs;
  ASSERT_EQ(got.size(), inputs.size());
  // The mechanism itself: with PDL the successor's blocks enter while the predecessor still sleeps and writes
  // (so the exact results above were not just plain serialisation); without it they never do.
  std::printf("  %d of %d PDL-launched kernel pairs overlapped\n", res.overlapped_pairs, res.pdl_pairs);
  ASSERT_GT(res.pdl_pairs, 100);
  // Eager launches come from the host one at a time, slower than these kernels run, so a predecessor has always
  // finished before its successor is even submitted: only a graph, where the launches are queued on the device, can show the overlap.
  if (cc.pdl && cc.graph) {
    EXPECT_GT(res.overlapped_pairs, 0) << "no kernel started before its predecessor finished: PDL was not applied";
  } else if (!cc.pdl) {
    EXPECT_EQ(res.overlapped_pairs, 0);
  }
  for (size_t r = 0; r < inputs.size(); ++r) {
    SCOPED_TRACE(::testing::Message() << "run " << r << ", n = " << c.n);
    const std::vector<uint32_t> want = test::pdl_chain_reference(c, inputs[r]);
    size_t bad = 0, first = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      if (got[r][j] != want[j] && bad++ == 0) first = j;
    }
    EXPECT_EQ(bad, 0u) << "first mismatch at " << first << ": got " << got[r][first] << ", want " << want[first];
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(Chains, PdlLaunch,
                         ::testing::Values(ChainCase{true, false, false}, ChainCase{true, true, false},
                                           ChainCase{true, false, true}, ChainCase{true, true, true},
                                           ChainCase{false, false, true}, ChainCase{false, true, true}),
                         [](const ::testing::TestParamInfo<ChainCase>& i) {
                           return std::string(i.param.pdl ? "Pdl" : "NoPdl") + (i.param.graph ? "Graph" : "Eager") +
                                  (i.param.mixed ? "Mixed" : "");
                         });

// The cuBLASLt neighbour (launch.cuh): PDL kernels (add, rms_norm) right after and right before cuBLASLt GEMMs
// (ops::linear, 37 rows: never a decode-size special path), 30 rounds of x = rms_norm(linear(x) + x), eager and
// as a CUDA graph. Every op is deterministic, so PDL on and off must give the same bits; a PDL kernel that read
// the GEMM's output before it was complete would see the previous round's values.
TEST(PdlNeighbours, CublasLtBetweenPdlKernelsGivesTheSameBitsAsWithoutPdl) {
  if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  test::Rng rng = test::Rng::for_test();
  const int64_t T = 37, D = 200;
  const Tensor x0 = device::to_device(rng.normal_tensor({T, D}), Device::kCuda);
  const Tensor w = device::to_device(rng.normal_tensor({D, D}, 0.5f / 14.1f), Device::kCuda);
  const Tensor gamma = device::to_device(rng.uniform_tensor({D}, 0.5f, 1.5f), Device::kCuda);
  auto run = [&](bool pdl, bool graph) {
    const device::Stream stream = device::Stream::create();
    ops::Context ctx{Device::kCuda, stream.get()};
    ctx.kernels.pdl = pdl;  // the ops' launches follow their context
    const Tensor x = device::empty(Device::kCuda, DType::kF32, {T, D});
    const Tensor y = device::empty(Device::kCuda, DType::kF32, {T, D});
    const Tensor h = device::empty(Device::kCuda, DType::kF32, {T, D});
    auto body = [&] {
      for (int round = 0; round < 30; ++round) {
        ops::linear(ctx, y, x, w);               // cuBLASLt
        ops::add(ctx, h, y, x);                  // PDL, reads the GEMM's output
        ops::rms_norm(ctx, x, h, gamma, 1e-5f);  // PDL, overwrites the next GEMM's input
      }
    };
    device::copy(x, x0);
    body();  // eager, and the warm-up of the host caches (cuBLASLt plans) before a capture
    stream.synchronize();
    if (graph) {
      device::AllocPool pool;
      device::Graph g;
      {
        const device::ScopedAllocPool scope(pool);
        g = device::Graph::capture(ctx.stream, body);
      }
      device::copy(x, x0);
      g.launch(ctx.stream);
      stream.synchronize();
    }
    return device::to_host_f32(x);
  };
  for (bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graph" : "eager");
    const Tensor off = run(false, graph);
    const Tensor on = run(true, graph);
    for (int64_t i = 0; i < off.numel(); ++i) ASSERT_TRUE(std::isfinite(off.f32()[i])) << i;
    EXPECT_ALL_CLOSE(on, off, (test::Tolerance{0, 0}));
  }
}

}  // namespace
}  // namespace chimera
