#include <doctest/doctest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "loom/core/parameters.hpp"
#include "loom/models/bert/config.hpp"
#include "loom/models/gpt2/config.hpp"

namespace test_gpt2_config {

using namespace loom;

TEST_CASE("GPT-2 small has exactly 124,439,808 parameters") {
  const gpt2::Config c = gpt2::small();
  CHECK(c.vocab_size == 50257);
  CHECK(c.max_seq_len == 1024);
  CHECK(c.parameter_count() == 124439808);
  // The layout stores the padded vocabulary rows too, and nothing else.
  const ParameterLayout layout(gpt2::parameter_specs(c));
  CHECK(layout.total() == c.stored_parameter_count());
  CHECK(layout.total() - c.parameter_count() == (50304 - 50257) * 768);
}

TEST_CASE("GPT-2 configs follow l(12h^2 + 13h) + vh + sh + 2h") {
  for (const char* name : {"tiny", "small", "medium", "large", "xl", "2.7B"}) {
    CAPTURE(name);
    const gpt2::Config c = gpt2::config_by_name(name);
    const std::int64_t l = c.num_layers, h = c.channels, v = c.vocab_size, s = c.max_seq_len;
    CHECK(c.parameter_count() == l * (12 * h * h + 13 * h) + v * h + s * h + 2 * h);
    CHECK(ParameterLayout(gpt2::parameter_specs(c)).total() == c.stored_parameter_count());
  }
  CHECK(gpt2::medium().parameter_count() == 354823168);
  CHECK(gpt2::large().parameter_count() == 774030080);
  CHECK(gpt2::xl().parameter_count() == 1557611200);
  CHECK(gpt2::config_by_name("2.7B").channels == 2560);
  CHECK(gpt2::config_by_name("2.7B").num_layers == 32);
  CHECK(gpt2::config_by_name("2.7B").num_heads == 32);
}

TEST_CASE("GPT-2 config validation names the value and the rule") {
  gpt2::Config c = gpt2::tiny();
  c.num_heads = 5;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("channels: got 64; must be a positive multiple of num_heads (5)"),
                       Error);
  c = gpt2::tiny();
  c.padded_vocab_size = 100;
  CHECK_THROWS_AS(c.validate(), Error);
  CHECK_THROWS_WITH_AS(gpt2::config_by_name("huge"), doctest::Contains("huge"), Error);
  CHECK(gpt2::pad_vocab(50257) == 50304);
}

TEST_CASE("GPT-2's GELU is a config value: tanh by default, compared, printed and validated") {
  gpt2::Config c = gpt2::small();
  CHECK(c.gelu == Gelu::tanh);
  gpt2::Config exact = c;
  exact.gelu = Gelu::erf;
  CHECK(exact != c);
  std::ostringstream out;
  out << exact;
  CHECK(out.str().find("gelu=erf") != std::string::npos);
  exact.validate();
  exact.gelu = static_cast<Gelu>(7);
  CHECK_THROWS_WITH_AS(exact.validate(), doctest::Contains("gpt2 config: gelu: got 7; must be Gelu::tanh or Gelu::erf"),
                       Error);
}

TEST_CASE("GPT-2 parameter specs: names, layers, decay") {
  const gpt2::Config c = gpt2::tiny();
  const ParameterLayout layout(gpt2::parameter_specs(c));
  CHECK(layout.find("wte").spec.layer == gpt2::embedding_layer);
  CHECK(layout.find("h.1.mlp.fc.weight").spec.layer == gpt2::block_layer(1));
  CHECK(layout.find("ln_f.bias").spec.layer == gpt2::head_layer(c));
  CHECK(layout.find("h.0.attn.qkv.weight").spec.weight_decay);
  CHECK_FALSE(layout.find("h.0.attn.qkv.bias").spec.weight_decay);
  CHECK_FALSE(layout.find("h.0.ln_1.weight").spec.weight_decay);
  CHECK(layout.find("h.0.attn.qkv.weight").spec.shape == Shape{3 * 64, 64});
}

namespace {

//! What a block parameter's spec must say, written out here rather than derived from the code
//! that makes the specs.
struct ExpectedBlockSpec {
  const char* what;
  Shape shape;
  bool decay;
  Partition partition;
  int groups;
  Init::Kind init;
  bool projection;  //!< drawn with the models' residual-projection deviation
};

//! Block 1's twelve specs in `specs` (in layout order, after `first` specs before the blocks)
//! against `expected`: names, order, shapes, splits, decay and init.
void check_block_specs(const std::vector<ParameterSpec>& specs, std::size_t first,
                       const std::vector<ExpectedBlockSpec>& expected, double std_dev, double projection_std) {
  REQUIRE(specs.size() > first + 2 * expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const ExpectedBlockSpec& e = expected[i];
    const ParameterSpec& got = specs[first + expected.size() + i];
    CAPTURE(e.what);
    CHECK(got.name == std::string("h.1.") + e.what);
    CHECK(got.layer == gpt2::block_layer(1));
    CHECK(got.shape == e.shape);
    CHECK(got.weight_decay == e.decay);
    CHECK(got.partition == e.partition);
    CHECK(got.shard.groups == e.groups);
    CHECK(got.init.kind == e.init);
    if (e.init == Init::Kind::normal) CHECK(got.init.stddev == (e.projection ? projection_std : std_dev));
  }
}

}  // namespace

TEST_CASE("GPT-2's and BERT's blocks: each parameter's shape, split, decay and init, in each model's order") {
  using P = Partition;
  using K = Init::Kind;
  const std::int64_t C = 64;
  const ExpectedBlockSpec ln1w{"ln_1.weight", {C}, false, P::replicated, 1, K::ones, false},
      ln1b{"ln_1.bias", {C}, false, P::replicated, 1, K::zeros, false},
      qkvw{"attn.qkv.weight", {3 * C, C}, true, P::split_rows, 3, K::normal, false},
      qkvb{"attn.qkv.bias", {3 * C}, false, P::split_rows, 3, K::zeros, false},
      projw{"attn.proj.weight", {C, C}, true, P::split_cols, 1, K::normal, true},
      projb{"attn.proj.bias", {C}, false, P::replicated, 1, K::zeros, false},
      ln2w{"ln_2.weight", {C}, false, P::replicated, 1, K::ones, false},
      ln2b{"ln_2.bias", {C}, false, P::replicated, 1, K::zeros, false},
      fcw{"mlp.fc.weight", {4 * C, C}, true, P::split_rows, 1, K::normal, false},
      fcb{"mlp.fc.bias", {4 * C}, false, P::split_rows, 1, K::zeros, false},
      fcprojw{"mlp.proj.weight", {C, 4 * C}, true, P::split_cols, 1, K::normal, true},
      fcprojb{"mlp.proj.bias", {C}, false, P::replicated, 1, K::zeros, false};
  // GPT-2: pre-LN order, the two projections drawn with 0.02 / sqrt(2L) (L = 2 in tiny).
  const gpt2::Config g = gpt2::tiny();
  REQUIRE(g.channels == C);
  check_block_specs(gpt2::parameter_specs(g), 2,
                    {ln1w, ln1b, qkvw, qkvb, projw, projb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb}, 0.02,
                    0.02 / std::sqrt(4.0));
  // BERT: post-LN order (each layernorm after its branch), every matrix N(0, 0.02).
  const bert::Config b = bert::tiny();
  REQUIRE(b.channels == C);
  check_block_specs(bert::parameter_specs(b), 4,
                    {qkvw, qkvb, projw, projb, ln1w, ln1b, fcw, fcb, fcprojw, fcprojb, ln2w, ln2b}, 0.02, 0.02);
}

}  // namespace test_gpt2_config
