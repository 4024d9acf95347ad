#include <doctest/doctest.h>

#include <sstream>
#include <string>

#include "loom/core/parameters.hpp"
#include "loom/models/gpt2/config.hpp"

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
