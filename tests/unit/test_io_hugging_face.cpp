// Hugging Face GPT-2 and BERT weights (io/hugging_face.hpp). The reference models in
// tests/data/hugging_face were written by transformers itself (make_reference.py there): loom
// loads them and computes transformers' loss, and after one SGD step transformers' loss again
// (so the gradients agree too), on one rank and on DP x TP x PP meshes. Then saving and loading
// round-trips every bit, sharded files load, and bad files are refused naming what is wrong.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/hugging_face.hpp"
#include "loom/loom.hpp"
#include "loom/models/bert/model.hpp"
#include "support/error_of.hpp"
#include "support/temp_path.hpp"

namespace test_io_hugging_face {

using namespace loom;
using loom::test::error_of;

namespace {

namespace fs = std::filesystem;

const fs::path data_dir = fs::path(LOOM_TEST_DATA_DIR) / "hugging_face";

//! A reference.json: the batch and transformers' losses on it.
struct Reference {
  io::Batch batch;
  double loss = 0, sgd_lr = 0, loss_after_sgd = 0;
};

std::string text_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::int32_t> integers(const io::Json& json, const char* key) {
  std::vector<std::int32_t> values;
  for (const io::Json& v : json.find(key)->array(key)) values.push_back(static_cast<std::int32_t>(v.integer(key)));
  return values;
}

Reference reference(const std::string& model) {
  const io::Json json = io::Json::parse(text_of(data_dir / model / "reference.json"), model + " reference");
  Reference r;
  r.batch.batch = json.find("batch")->integer("batch");
  r.batch.seq = json.find("seq")->integer("seq");
  r.batch.tokens = integers(json, "tokens");
  r.batch.targets = integers(json, "targets");
  r.batch.lengths = integers(json, "lengths");
  r.loss = json.find("loss")->number("loss");
  r.sgd_lr = json.find("sgd_lr")->number("sgd_lr");
  r.loss_after_sgd = json.find("loss_after_sgd")->number("loss_after_sgd");
  return r;
}

//! The two model families, each with its reader, loader and saver.
struct Gpt2Family {
  template <class B, class T>
  using Model = gpt2::Model<B, T>;
  static constexpr const char* name = "gpt2";
  static gpt2::Config config(const fs::path& p) { return io::read_hf_gpt2_config(p); }
  static io::HfLoadReport load(const fs::path& p, const gpt2::Config& c, const ParameterLayout& l, float* f) {
    return io::load_hf_gpt2(p, c, l, f);
  }
  static void save(const fs::path& p, const gpt2::Config& c, const ParameterLayout& l, const float* f) {
    io::save_hf_gpt2(p, c, l, f);
  }
};
struct BertFamily {
  template <class B, class T>
  using Model = bert::Model<B, T>;
  static constexpr const char* name = "bert";
  static bert::Config config(const fs::path& p) { return io::read_hf_bert_config(p); }
  static io::HfLoadReport load(const fs::path& p, const bert::Config& c, const ParameterLayout& l, float* f) {
    return io::load_hf_bert(p, c, l, f);
  }
  static void save(const fs::path& p, const bert::Config& c, const ParameterLayout& l, const float* f) {
    io::save_hf_bert(p, c, l, f);
  }
};

//! The whole parameters of the model at `path`, in the whole layout of `config`.
template <class Family, class Config>
std::vector<float> load_whole(const fs::path& path, const Config& config) {
  const typename Family::template Model<cpu, float> model(config);
  std::vector<float> flat(static_cast<std::size_t>(model.layout().total()), -1.0f);
  Family::load(path, config, model.layout(), flat.data());
  return flat;
}

bool close(double a, double b, double tolerance) { return std::abs(a - b) <= tolerance * std::abs(b); }

//! "loom L, transformers R (relative difference D)", to 9 digits.
std::string against(double loom, double reference) {
  char text[128];
  std::snprintf(text, sizeof text, "loom %.9g, transformers %.9g (relative difference %.2e)", loom, reference,
                std::abs(loom - reference) / std::abs(reference));
  return text;
}

//! One rank: transformers' loss, and its loss after one SGD step.
template <class Family>
void check_one_rank() {
  const fs::path dir = data_dir / Family::name;
  const Reference ref = reference(Family::name);
  const auto config = Family::config(dir);
  using Model = typename Family::template Model<cpu, float>;
  cpu be(1);
  Trainer<Model, SgdMomentum> trainer(be, Model(config), SgdMomentum({.momentum = 0}), ConstantLr{.lr = ref.sgd_lr},
                                      {.micro_batch_size = ref.batch.batch});
  std::vector<float> whole(static_cast<std::size_t>(trainer.whole_layout().total()));
  const io::HfLoadReport report = Family::load(dir, config, trainer.whole_layout(), whole.data());
  CHECK(report.ignored.empty());
  trainer.load_state(0, whole);
  const double loss = trainer.evaluate(ref.batch);
  INFO(std::string(Family::name), ": ", against(loss, ref.loss));
  CHECK(close(loss, ref.loss, 2e-6));
  trainer.step(ref.batch);
  const double after = trainer.evaluate(ref.batch);
  INFO("after one SGD step: ", against(after, ref.loss_after_sgd));
  CHECK(close(after, ref.loss_after_sgd, 2e-5));
}

//! On `shape` (thread ranks), every rank loads the whole file and keeps its part; the loss is
//! transformers'.
template <class Family, class Schedule, class Strategy>
void check_mesh(MeshShape shape, Strategy strategy = {}) {
  const fs::path dir = data_dir / Family::name;
  const Reference ref = reference(Family::name);
  const auto config = Family::config(dir);
  using Model = typename Family::template Model<cpu, float>;
  std::mutex mutex;
  std::vector<std::string> failures;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Model, SgdMomentum, Schedule, Strategy> trainer(
        be, mesh, Model(config, mesh.tensor_parallel()), SgdMomentum({.momentum = 0}), ConstantLr{.lr = ref.sgd_lr},
        {.micro_batch_size = 1}, strategy, Schedule{});
    std::vector<float> whole(static_cast<std::size_t>(trainer.whole_layout().total()));
    Family::load(dir, config, trainer.whole_layout(), whole.data());
    trainer.load_state(0, whole);
    const double loss = trainer.evaluate(ref.batch);
    trainer.step(ref.batch);
    const double after = trainer.evaluate(ref.batch);
    std::lock_guard lock(mutex);
    if (!close(loss, ref.loss, 2e-6) || !close(after, ref.loss_after_sgd, 2e-5))
      failures.push_back("rank " + std::to_string(world.rank()) + ": " + std::to_string(loss) + " then " +
                         std::to_string(after));
  });
  std::string failed;
  for (const std::string& f : failures) failed += f + "; ";
  CHECK_MESSAGE(failures.empty(), failed);
}

//! A copy of reference model `name` in a temporary directory, for tests that change it.
struct ModelCopy {
  test::TempPath dir{"hf_model"};
  explicit ModelCopy(const std::string& name) {
    fs::create_directories(dir.path);
    for (const char* file : {"config.json", "model.safetensors"}) fs::copy_file(data_dir / name / file, dir.path / file);
  }
  //! Replaces `from` by `to` in config.json.
  void edit_config(const std::string& from, const std::string& to) const {
    std::string text = text_of(dir.path / "config.json");
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    std::ofstream(dir.path / "config.json", std::ios::binary) << text;
  }
  //! Rewrites model.safetensors with `edit` applied to its tensors.
  template <class Edit>
  void edit_weights(Edit edit) const {
    const io::SafetensorsReader file(dir.path / "model.safetensors");
    std::vector<std::string> names;
    std::vector<std::vector<std::int64_t>> shapes;
    std::vector<std::vector<float>> values;
    for (const io::SafetensorsEntry& e : file.entries()) {
      names.push_back(e.name);
      shapes.push_back(e.shape);
      values.push_back(file.read(e.name));
    }
    edit(names, shapes, values);
    std::vector<io::SafetensorsTensor> tensors;
    for (std::size_t i = 0; i < names.size(); ++i) tensors.push_back({names[i], shapes[i], values[i]});
    io::save_safetensors(dir.path / "model.safetensors", tensors);
  }
};

}  // namespace

TEST_CASE("Hugging Face configs: GPT-2's and BERT's fields, the activation, the padded vocabulary") {
  const gpt2::Config g = io::read_hf_gpt2_config(data_dir / "gpt2");
  CHECK(g.channels == 32);
  CHECK(g.num_heads == 4);
  CHECK(g.num_layers == 2);
  CHECK(g.max_seq_len == 64);
  CHECK(g.vocab_size == 101);
  CHECK(g.padded_vocab_size == 128);
  CHECK(g.gelu == Gelu::tanh);  // gelu_new
  const bert::Config b = io::read_hf_bert_config(data_dir / "bert" / "model.safetensors");  // a file: config beside it
  CHECK(b.channels == 32);
  CHECK(b.vocab_size == 103);
  CHECK(b.padded_vocab_size == 128);
  CHECK(b.gelu == Gelu::erf);  // BERT's "gelu"
  CHECK(b.layernorm_eps == 1e-12);
}

TEST_CASE("GPT-2 from transformers: loom computes its loss, and its loss after one SGD step") {
  check_one_rank<Gpt2Family>();
}

TEST_CASE("BERT from transformers (erf GELU, token types, a padded row): its loss, and after one SGD step") {
  check_one_rank<BertFamily>();
}

TEST_CASE("BERT's exact GELU matters: the same weights with the tanh approximation miss transformers' loss") {
  const Reference ref = reference("bert");
  bert::Config config = io::read_hf_bert_config(data_dir / "bert");
  config.gelu = Gelu::tanh;
  using Bert = bert::Model<cpu, float>;
  cpu be(1);
  Trainer<Bert, SgdMomentum> trainer(be, Bert(config), SgdMomentum({.momentum = 0}), ConstantLr{},
                                     {.micro_batch_size = ref.batch.batch});
  trainer.load_state(0, load_whole<BertFamily>(data_dir / "bert", config));
  const double loss = trainer.evaluate(ref.batch);
  INFO("tanh GELU: ", against(loss, ref.loss));
  CHECK(!close(loss, ref.loss, 2e-5));
}

TEST_CASE("a Hugging Face model loads into DP x TP x PP meshes and computes transformers' losses there") {
  check_mesh<Gpt2Family, GradientAccumulation>({.dp = 2, .tp = 2, .pp = 1}, Zero<3>{});
  check_mesh<Gpt2Family, OneFOneB, DataParallel>({.dp = 1, .tp = 2, .pp = 2});
  check_mesh<BertFamily, GradientAccumulation>({.dp = 2, .tp = 2, .pp = 1}, Zero<2>{});
  check_mesh<BertFamily, OneFOneB, DataParallel>({.dp = 2, .tp = 1, .pp = 2});
}

TEST_CASE_TEMPLATE("saving as Hugging Face and loading again gives back every bit", Family, Gpt2Family, BertFamily) {
  const auto config = Family::config(data_dir / Family::name);
  const std::vector<float> original = load_whole<Family>(data_dir / Family::name, config);
  const test::TempPath dir("hf_saved");
  const typename Family::template Model<cpu, float> model(config);
  Family::save(dir.path, config, model.layout(), original.data());
  CHECK(Family::config(dir.path) == config);
  CHECK(load_whole<Family>(dir.path, config) == original);
  // Saving again replaces the files in place.
  Family::save(dir.path, config, model.layout(), original.data());
  CHECK(load_whole<Family>(dir.path, config) == original);
}

TEST_CASE("a model in safetensors shards, named by model.safetensors.index.json, loads as one file does") {
  const auto config = io::read_hf_gpt2_config(data_dir / "gpt2");
  const std::vector<float> whole = load_whole<Gpt2Family>(data_dir / "gpt2", config);
  const test::TempPath dir("hf_sharded");
  fs::create_directories(dir.path);
  fs::copy_file(data_dir / "gpt2" / "config.json", dir.path / "config.json");
  const io::SafetensorsReader file(data_dir / "gpt2" / "model.safetensors");
  std::vector<std::vector<float>> values;
  for (const io::SafetensorsEntry& e : file.entries()) values.push_back(file.read(e.name));
  std::vector<io::SafetensorsTensor> shards[2];
  std::string map;
  for (std::size_t i = 0; i < file.entries().size(); ++i) {
    const io::SafetensorsEntry& e = file.entries()[i];
    shards[i % 2].push_back({e.name, e.shape, values[i]});
    map += std::string(map.empty() ? "" : ",") + "\"" + e.name + "\": \"part-" + std::to_string(i % 2) + ".safetensors\"";
  }
  io::save_safetensors(dir.path / "part-0.safetensors", shards[0]);
  io::save_safetensors(dir.path / "part-1.safetensors", shards[1]);
  std::ofstream(dir.path / "model.safetensors.index.json") << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  CHECK(load_whole<Gpt2Family>(dir.path, config) == whole);
  // An index may name only files beside it.
  std::ofstream(dir.path / "model.safetensors.index.json") << R"({"weight_map": {"wte.weight": "../x.safetensors"}})";
  CHECK(loom::test::contains(error_of([&] { load_whole<Gpt2Family>(dir.path, config); }),
                             "must be a file name beside the index"));
}

TEST_CASE("Hugging Face files loom cannot load are refused, naming the key or tensor and why") {
  SUBCASE("a config field loom's model does not have") {
    const ModelCopy copy("bert");
    copy.edit_config("\"intermediate_size\": 128", "\"intermediate_size\": 100");
    CHECK(error_of([&] { io::read_hf_bert_config(copy.dir.path); }).find("intermediate_size") != std::string::npos);
  }
  SUBCASE("an activation loom has not") {
    const ModelCopy copy("gpt2");
    copy.edit_config("\"gelu_new\"", "\"relu\"");
    const std::string error = error_of([&] { io::read_hf_gpt2_config(copy.dir.path); });
    CHECK(error.find("activation_function") != std::string::npos);
    CHECK(error.find("relu") != std::string::npos);
  }
  SUBCASE("the other model type") {
    CHECK(error_of([&] { io::read_hf_bert_config(data_dir / "gpt2"); }).find("model_type") != std::string::npos);
  }
  SUBCASE("a config whose shapes the file does not have") {
    const ModelCopy copy("gpt2");
    copy.edit_config("\"n_positions\": 64", "\"n_positions\": 32");
    const auto config = io::read_hf_gpt2_config(copy.dir.path);
    const std::string error = error_of([&] { load_whole<Gpt2Family>(copy.dir.path, config); });
    CHECK(error.find("wpe.weight") != std::string::npos);
    CHECK(error.find("[64, 32]") != std::string::npos);
  }
  SUBCASE("a missing tensor") {
    const ModelCopy copy("bert");
    copy.edit_weights([](auto& names, auto&, auto&) {
      for (auto& name : names)
        if (name == "bert.encoder.layer.1.attention.self.key.weight") name = "renamed";
    });
    const auto config = io::read_hf_bert_config(copy.dir.path);
    const std::string error = error_of([&] { load_whole<BertFamily>(copy.dir.path, config); });
    CHECK(error.find("bert.encoder.layer.1.attention.self.key.weight") != std::string::npos);
    CHECK(error.find("absent") != std::string::npos);
  }
  SUBCASE("an untied output embedding") {
    const ModelCopy copy("gpt2");
    copy.edit_weights([](auto& names, auto& shapes, auto& values) {
      for (std::size_t i = 0; i < names.size(); ++i)
        if (names[i] == "transformer.wte.weight") {
          names.push_back("lm_head.weight");
          shapes.push_back(shapes[i]);
          values.push_back(values[i]);
          values.back()[5] += 1.0f;
        }
    });
    const auto config = io::read_hf_gpt2_config(copy.dir.path);
    CHECK(error_of([&] { load_whole<Gpt2Family>(copy.dir.path, config); }).find("lm_head.weight element 5") !=
          std::string::npos);
  }
  SUBCASE("a BERT without its masked-LM head") {
    const ModelCopy copy("bert");
    copy.edit_weights([](auto& names, auto& shapes, auto& values) {
      for (std::size_t i = names.size(); i-- > 0;)
        if (names[i].starts_with("cls.")) {
          names.erase(names.begin() + static_cast<std::ptrdiff_t>(i));
          shapes.erase(shapes.begin() + static_cast<std::ptrdiff_t>(i));
          values.erase(values.begin() + static_cast<std::ptrdiff_t>(i));
        }
    });
    const auto config = io::read_hf_bert_config(copy.dir.path);
    CHECK(error_of([&] { load_whole<BertFamily>(copy.dir.path, config); }).find("BertForMaskedLM") !=
          std::string::npos);
  }
  SUBCASE("PyTorch pickles and missing paths") {
    const test::TempPath dir("hf_pickle");
    fs::create_directories(dir.path);
    std::ofstream(dir.path / "pytorch_model.bin") << "not read";
    CHECK(error_of([&] { io::hf_model_files(dir.path); }).find("safe_serialization=True") != std::string::npos);
    CHECK(error_of([&] { io::hf_model_files(dir.path / "nothing"); }).find("not found") != std::string::npos);
  }
}

TEST_CASE("tensors loom has no place for are reported, not loaded: BERT's pooler") {
  const ModelCopy copy("bert");
  copy.edit_weights([](auto& names, auto& shapes, auto& values) {
    names.push_back("bert.pooler.dense.weight");
    shapes.push_back({32, 32});
    values.push_back(std::vector<float>(32 * 32, 0.5f));
  });
  const auto config = io::read_hf_bert_config(copy.dir.path);
  const bert::Model<cpu, float> model(config);
  std::vector<float> flat(static_cast<std::size_t>(model.layout().total()));
  const io::HfLoadReport report = io::load_hf_bert(copy.dir.path, config, model.layout(), flat.data());
  CHECK(report.ignored == std::vector<std::string>{"bert.pooler.dense.weight"});
  CHECK(flat == load_whole<BertFamily>(data_dir / "bert", config));
}

}  // namespace test_io_hugging_face
