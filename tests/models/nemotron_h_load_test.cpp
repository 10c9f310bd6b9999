// Bad checkpoints give one clear message naming the tensor and file, never a crash.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

class BadCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = test::source_path("tests/fixtures/models/all_kinds");
    ASSERT_TRUE(fs::exists(fs::path(src_) / "config.json")) << "missing fixture " << src_;
    dir_ = fs::temp_directory_path() /
           ("chimera_badckpt_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(fs::path(src_) / "config.json", dir_ / "config.json");
    const Checkpoint ck = Checkpoint::open(src_);
    for (const auto& n : ck.names()) tensors_.emplace_back(n, ck.tensor(n).clone());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes tensors_ and returns the error message of loading the model (empty if it loaded).
  std::string load_error() {
    write_safetensors(dir_ / "model.safetensors", tensors_);
    try {
      const ModelConfig c = load_model_config(dir_);
      const Checkpoint ck = Checkpoint::open(dir_);
      NemotronH::load(c, ck);
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), 2) << e.what();
      return e.what();
    }
    return "";
  }

  std::string src_;
  fs::path dir_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

TEST_F(BadCheckpoint, IntactCopyLoads) { EXPECT_EQ(load_error(), ""); }

TEST_F(BadCheckpoint, MissingTensorIsNamed) {
  std::string removed;
  for (auto it = tensors_.begin(); it != tensors_.end(); ++it) {
    if (it->first.find("mixer.A_log") != std::string::npos) {
      removed = it->first;
      tensors_.erase(it);
      break;
    }
  }
  ASSERT_FALSE(removed.empty());
  const std::string msg = load_error();
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  // The canonical name (without the backbone./model. prefix) is reported.
  EXPECT_NE(msg.find(removed.substr(removed.find("layers."))), std::string::npos) << msg;
}

TEST_F(BadCheckpoint, UnexpectedTensorIsNamed) {
  tensors_.emplace_back("backbone.layers.0.mixer.surprise.weight", Tensor::zeros(DType::kF32, {3}));
  const std::string msg = load_error();
  EXPECT_NE(msg.find("unexpected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("backbone.layers.0.mixer.surprise.weight"), std::string::npos) << msg;
}

TEST_F(BadCheckpoint, WrongShapeIsNamedWithBothShapes) {
  std::string name;
  for (auto& [n, t] : tensors_) {
    if (n.find("norm_f") != std::string::npos) {
      name = n;
      t = Tensor::zeros(t.dtype(), {t.dim(0) + 1});
    }
  }
  ASSERT_FALSE(name.empty());
  const std::string msg = load_error();
  EXPECT_NE(msg.find(name), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
}

// A config without an MTP head ignores the checkpoint's mtp.* tensors (they are not the model's).
TEST_F(BadCheckpoint, MtpTensorsOfAConfigWithoutAHeadAreIgnored) {
  tensors_.emplace_back("mtp.layers.0.enorm.weight", Tensor::zeros(DType::kF32, {4}));
  write_safetensors(dir_ / "model.safetensors", tensors_);
  const ModelConfig c = load_model_config(dir_);
  ASSERT_EQ(c.num_nextn_predict_layers, 0);
  const Checkpoint ck = Checkpoint::open(dir_);
  const NemotronH m = NemotronH::load(c, ck);
  EXPECT_EQ(m.mtp_blocks(), 0);
}

}  // namespace
}  // namespace chimera
