#pragma once
//! \file GPT-2 and BERT weights in Hugging Face's format, to and from a loom ParameterLayout:
//! the directory `save_pretrained` writes (config.json and model.safetensors, or shards named by
//! model.safetensors.index.json), as the Hub serves it for `gpt2`, `gpt2-medium`, ...,
//! `bert-base-uncased`, `bert-large-uncased`.
//!
//! The mapping (docs/data.md#hugging-face-models):
//! - GPT-2 (`GPT2LMHeadModel`/`GPT2Model`, names with or without `transformer.`): Conv1D weights
//!   are stored [in, out] and transposed into loom's [out, in]; `lm_head.weight`, where present,
//!   must equal `wte` (loom ties them). The causal-mask buffers (`attn.bias`,
//!   `attn.masked_bias`) of older files carry no parameters and are ignored.
//! - BERT (`BertForMaskedLM`, names under `bert.` and `cls.predictions.`): query, key and value
//!   are stacked into loom's fused qkv; the token-type embedding's row 0 is added into the
//!   position embeddings (loom has no segments: every token is of type 0); the pooler and the
//!   next-sentence head have no place in loom and are ignored. TensorFlow-era names
//!   (`LayerNorm.gamma`/`beta`) are accepted.
//! Every value is read as float32 (BF16 and F16 widen exactly, F64 rounds); loom's padding rows
//! of the vocabulary are zero.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/backend/gelu.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/io/json.hpp"
#include "loom/io/safetensors.hpp"
#include "loom/io/token_file.hpp"
#include "loom/models/bert/config.hpp"
#include "loom/models/gpt2/config.hpp"

namespace loom::io {

//! The files of a Hugging Face model: its config.json and its safetensors weights (one file, or
//! the shards an index names).
struct HfModelFiles {
  std::filesystem::path config;   //!< config.json
  std::filesystem::path weights;  //!< model.safetensors, or model.safetensors.index.json
};

//! The files of the model at `path`: a directory as `save_pretrained` writes it, or a
//! .safetensors file (or index) with config.json beside it. Refuses, naming the path, a path
//! that does not exist and a directory with only PyTorch pickles (pytorch_model.bin).
inline HfModelFiles hf_model_files(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string who = "Hugging Face model " + detail::quoted(path);
  if (fs::is_directory(path, ec)) {
    HfModelFiles files{path / "config.json", path / "model.safetensors"};
    if (!fs::exists(files.weights, ec) && fs::exists(path / "model.safetensors.index.json", ec))
      files.weights = path / "model.safetensors.index.json";
    if (!fs::exists(files.weights, ec))
      throw Error(who + ": weights", "no model.safetensors or model.safetensors.index.json",
                  fs::exists(path / "pytorch_model.bin", ec)
                      ? "loom reads safetensors only, not PyTorch pickles (pytorch_model.bin): "
                        "save the model with save_pretrained(dir, safe_serialization=True)"
                      : "expected the directory save_pretrained writes");
    return files;
  }
  LOOM_CHECK(fs::is_regular_file(path, ec), who, "not found",
             "expected a model directory or a .safetensors file with config.json beside it");
  return {path.parent_path() / "config.json", path};
}

namespace detail {

//! A model's config.json, with typed lookups whose errors name the file and the key.
class HfConfig {
 public:
  explicit HfConfig(const std::filesystem::path& path)
      : name_("Hugging Face config " + quoted(path)),
        json_(Json::parse(read_text_file(path, "Hugging Face config"), name_)) {
    json_.object(name_);  // the file must hold an object
  }

  const std::string& name() const noexcept { return name_; }
  const Json* find(std::string_view key) const noexcept { return json_.find(key); }
  bool has(std::string_view key) const noexcept {
    const Json* value = find(key);
    return value != nullptr && value->kind() != Json::Kind::null;
  }
  //! Required integer `key`, > 0.
  std::int64_t positive(std::string_view key) const {
    const std::int64_t value = required(key).integer(what(key));
    LOOM_CHECK(value > 0, what(key), value, "must be > 0");
    return value;
  }
  //! Number `key`, or `fallback` where absent.
  double number(std::string_view key, double fallback) const {
    return has(key) ? find(key)->number(what(key)) : fallback;
  }
  //! String `key`, or `fallback` where absent.
  std::string string(std::string_view key, std::string fallback) const {
    return has(key) ? find(key)->string(what(key)) : fallback;
  }
  //! Boolean `key`, or `fallback` where absent.
  bool boolean(std::string_view key, bool fallback) const {
    return has(key) ? find(key)->boolean(what(key)) : fallback;
  }
  //! Refuses a model_type other than `expected` (an absent one is taken on trust).
  void expect_model_type(const std::string& expected, const std::string& reader) const {
    const std::string type = string("model_type", expected);
    LOOM_CHECK(type == expected, what("model_type"), type, "expected \"" + expected + "\" (" + reader + ")");
  }
  //! Refuses `key` where present and not `expected`: a feature loom's model does not have.
  template <class V>
  void expect(std::string_view key, const V& value, const V& expected, const std::string& rule) const {
    LOOM_CHECK(value == expected, what(key), value, rule);
  }
  std::string what(std::string_view key) const { return name_ + ": " + std::string(key); }
  //! `config` once its rules hold; a broken one is named as this file's.
  template <class Config>
  Config validated(const Config& config) const {
    try {
      config.validate();
    } catch (const Error& e) {
      throw Error(name_ + ": " + e.subject(), e.value(), e.rule());
    }
    return config;
  }

 private:
  const Json& required(std::string_view key) const {
    const Json* value = find(key);
    if (value == nullptr) throw Error(what(key), "absent", "a Hugging Face config of this model type has it");
    return *value;
  }

  std::string name_;
  Json json_;
};

//! The GELU a Hugging Face activation name means: loom has the exact (erf) form and the tanh
//! approximation, which transformers calls gelu_new, gelu_pytorch_tanh or gelu_fast.
inline Gelu hf_gelu(const HfConfig& config, std::string_view key, const std::string& fallback) {
  const std::string name = config.string(key, fallback);
  if (name == "gelu") return Gelu::erf;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast") return Gelu::tanh;
  throw Error(config.what(key), name,
              "loom's models have the exact GELU (\"gelu\") and its tanh approximation (\"gelu_new\", "
              "\"gelu_pytorch_tanh\", \"gelu_fast\")");
}

//! The Hugging Face name of an activation.
inline const char* hf_gelu_name(Gelu gelu) noexcept { return gelu == Gelu::erf ? "gelu" : "gelu_new"; }

//! The tensors of a model's safetensors file or shards, each found by name; remembers which
//! were read, so that a loader can report the ones it had no place for.
class HfWeights {
 public:
  explicit HfWeights(const std::filesystem::path& weights) {
    if (weights.filename().string().ends_with(".index.json")) {
      const std::string who = "Hugging Face weight index " + quoted(weights);
      const Json index = Json::parse(read_text_file(weights, "Hugging Face weight index"), who);
      const Json* map = index.find("weight_map");
      if (map == nullptr) throw Error(who + ": weight_map", "absent", "an index names each tensor's shard");
      std::set<std::string> shards;
      for (const auto& [tensor, shard] : map->object(who + ": weight_map")) {
        const std::string& file = shard.string(who + ": weight_map." + tensor);
        // A shard lies beside its index: a name with a directory in it could reach any file.
        LOOM_CHECK(!file.empty() && file.find_first_of("/\\") == std::string::npos && file != "." && file != "..",
                   who + ": weight_map." + tensor, file, "must be a file name beside the index");
        shards.insert(file);
      }
      for (const std::string& shard : shards) files_.push_back(std::make_unique<SafetensorsReader>(weights.parent_path() / shard));
    } else {
      files_.push_back(std::make_unique<SafetensorsReader>(weights));
    }
    for (const auto& file : files_)
      for (const SafetensorsEntry& entry : file->entries()) names_.insert(entry.name);
  }

  std::string name() const {
    return "Hugging Face weights " + quoted(files_.front()->path()) + (files_.size() > 1 ? " and its shards" : "");
  }
  bool contains(const std::string& name) const { return names_.count(name) != 0; }

  //! `name`, or where the file lacks it the name of the same tensor in an older file:
  //! TensorFlow-era `LayerNorm.gamma`/`beta` for `LayerNorm.weight`/`bias`, and BERT's
  //! `cls.predictions.decoder.bias` for its tied twin `cls.predictions.bias`.
  std::string resolve(const std::string& name) const {
    if (contains(name)) return name;
    static constexpr std::pair<std::string_view, std::string_view> aliases[] = {
        {"LayerNorm.weight", "LayerNorm.gamma"},
        {"LayerNorm.bias", "LayerNorm.beta"},
        {"cls.predictions.bias", "cls.predictions.decoder.bias"},
    };
    for (const auto& [now, then] : aliases)
      if (name.ends_with(now)) {
        std::string old = name.substr(0, name.size() - now.size()) + std::string(then);
        if (contains(old)) return old;
      }
    return name;  // read() names it as absent
  }

  //! The shape tensor `name` has in the file (refused where absent).
  const std::vector<std::int64_t>& shape(const std::string& name) const { return locate(name).second->shape; }

  //! The values of tensor `name`, whose shape must be `shape`.
  std::vector<float> read(const std::string& name, const std::vector<std::int64_t>& shape) {
    const auto [file, entry] = checked(name, shape);
    std::vector<float> values(static_cast<std::size_t>(entry->numel()));
    file->read(*entry, values.data());
    used_.insert(name);
    return values;
  }

  //! The tensors no read() asked for, in name order.
  std::vector<std::string> unused() const {
    std::vector<std::string> names;
    for (const std::string& name : names_)
      if (used_.count(name) == 0) names.push_back(name);
    return names;
  }

  //! The file holding tensor `name` and its entry, refused where absent or not of `shape`.
  std::pair<const SafetensorsReader*, const SafetensorsEntry*> checked(const std::string& name,
                                                                      const std::vector<std::int64_t>& shape) const {
    const auto found = locate(name);
    if (found.second->shape != shape)
      throw Error(this->name() + ": shape of " + name, shape_text(found.second->shape),
                  "expected " + shape_text(shape) + " for the config in config.json");
    return found;
  }

 private:
  //! The file holding tensor `name`, and its entry (refused where absent).
  std::pair<const SafetensorsReader*, const SafetensorsEntry*> locate(const std::string& name) const {
    for (const auto& file : files_)
      if (const SafetensorsEntry* entry = file->find(name)) return {file.get(), entry};
    throw Error(this->name() + ": tensor " + name, "absent", "a model of this kind has it");
  }

  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::set<std::string> names_, used_;
};

//! Where the whole parameters of a model live in a flat float buffer laid out by `layout`, each
//! checked against the reference (unsharded) specs; `who` prefixes messages.
class WholeParameters {
 public:
  WholeParameters(const std::vector<ParameterSpec>& reference, const ParameterLayout& layout, std::string who)
      : reference_(reference), layout_(layout), who_(std::move(who)) {}

  //! The first element of parameter `name` in the buffer, and its element count.
  std::pair<std::int64_t, std::int64_t> place(const std::string& name) const {
    LOOM_CHECK(layout_.contains(name), who_ + ": parameter layout", name,
               "has no parameter of this name; use the model's whole (unsharded) layout");
    const ParameterLayout::Entry& entry = layout_.find(name);
    const Shape& shape = reference_.find(name).spec.shape;
    if (!(entry.spec.shape == shape))
      throw Error(who_ + ": shape of parameter " + name, entry.spec.shape,
                  "expected " + to_text(shape) + " (the global, unsharded shape)");
    return {entry.offset, entry.numel()};
  }

 private:
  ParameterLayout reference_;
  const ParameterLayout& layout_;
  std::string who_;
};

//! out[c, r] = in[r, c] for an in of [rows, cols]: Conv1D's [in, out] to loom's [out, in].
inline void transpose_into(const float* in, std::int64_t rows, std::int64_t cols, float* out) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
}

//! One tensor of a Hugging Face file and where its values live in a loom parameter. A model's
//! list of them serves both directions: loading and saving.
struct HfTensor {
  std::string file;                 //!< name in the file
  std::vector<std::int64_t> shape;  //!< shape in the file
  std::string loom;                 //!< the loom parameter
  std::int64_t at = 0;              //!< its first element there (q, k and v share the fused qkv)
  bool transposed = false;          //!< the file's [rows, cols] is loom's [cols, rows] (GPT-2's Conv1D)
};

inline std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

//! Where tensor `t`'s values start in `flat`, after checking that they fit their parameter.
template <class F>
F* place_of(const HfTensor& t, const WholeParameters& params, F* flat, const std::string& who) {
  const auto [offset, count] = params.place(t.loom);
  LOOM_CHECK(t.at + numel_of(t.shape) <= count, who + ": " + t.file + " in loom parameter " + t.loom,
             t.at + numel_of(t.shape), "elements must fit the parameter's " + std::to_string(count));
  return flat + offset + t.at;
}

//! Reads `tensors` from `weights` into `flat`, once every one is found with its shape. Each loom
//! parameter named is zeroed first, so that the vocabulary's padding rows (which no file tensor
//! covers) are zero.
inline void load_tensors(HfWeights& weights, const std::vector<HfTensor>& tensors, const WholeParameters& params,
                         float* flat) {
  // Every tensor is there with its shape, and fits its parameter, before anything is written.
  for (const HfTensor& t : tensors) {
    weights.checked(weights.resolve(t.file), t.shape);
    place_of(t, params, flat, weights.name());
  }
  for (const HfTensor& t : tensors) {
    const auto [offset, count] = params.place(t.loom);
    std::fill(flat + offset, flat + offset + count, 0.0f);
  }
  for (const HfTensor& t : tensors) {
    const std::vector<float> values = weights.read(weights.resolve(t.file), t.shape);
    float* out = place_of(t, params, flat, weights.name());
    if (t.transposed)
      transpose_into(values.data(), t.shape[0], t.shape[1], out);
    else
      std::copy(values.begin(), values.end(), out);
  }
}

//! Writes `tensors` from `flat`, and `extra` after them, into `directory` as model.safetensors,
//! and `config` (JSON text) as config.json, each through a temporary file, so a failure leaves
//! no partial file.
inline void save_tensors(const std::filesystem::path& directory, const std::vector<HfTensor>& tensors,
                         const WholeParameters& params, const float* flat, std::vector<SafetensorsTensor> extra,
                         const std::string& config) {
  const std::string who = "Hugging Face model " + quoted(directory);
  std::vector<std::vector<float>> values;
  values.reserve(tensors.size());
  for (const HfTensor& t : tensors) {
    const float* in = place_of(t, params, flat, who);
    const std::int64_t n = numel_of(t.shape);
    if (t.transposed) {  // loom's [cols, rows] back to the file's [rows, cols]
      values.emplace_back(static_cast<std::size_t>(n));
      transpose_into(in, t.shape[1], t.shape[0], values.back().data());
    } else {
      values.emplace_back(in, in + n);
    }
  }
  std::vector<SafetensorsTensor> out;
  for (std::size_t i = 0; i < tensors.size(); ++i) out.push_back({tensors[i].file, tensors[i].shape, values[i]});
  out.insert(out.end(), extra.begin(), extra.end());
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  LOOM_CHECK(!ec, who + ": cannot create the directory", ec.message(), "must be a writable directory path");
  save_safetensors(directory / "model.safetensors", out, {{"format", "pt"}});
  write_file_replacing(directory / "config.json", "Hugging Face config",
                       [&](BinaryFile& file) { file.write(config.data(), config.size()); });
}

//! A JSON object's text from (key, JSON value text) pairs, one member a line.
inline std::string json_object(const std::vector<std::pair<std::string, std::string>>& members) {
  std::string text = "{\n";
  for (std::size_t i = 0; i < members.size(); ++i)
    text += "  " + json_quote(members[i].first) + ": " + members[i].second + (i + 1 < members.size() ? ",\n" : "\n");
  return text + "}\n";
}

//! A number as JSON text that reads back as the same double.
inline std::string json_number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

//! Checks that file tensor `name`, where present, equals the loom tensor `tied` points at
//! (`numel` values): loom ties it, so it cannot hold other values.
inline void check_tied(HfWeights& weights, const std::string& name, const std::vector<std::int64_t>& shape,
                       const float* tied, const std::string& tied_name) {
  if (!weights.contains(name)) return;
  const std::vector<float> values = weights.read(name, shape);
  for (std::size_t i = 0; i < values.size(); ++i)
    if (values[i] != tied[i] && !(std::isnan(values[i]) && std::isnan(tied[i])))
      throw Error(weights.name() + ": " + name + " element " + std::to_string(i), to_text(values[i]),
                  "expected " + to_text(tied[i]) + ", as in " + tied_name +
                      ": loom ties the output embedding to the input embedding");
}

//! The name prefix under which a file holds `probe` ("" or one of `prefixes`).
inline std::string hf_prefix(const HfWeights& weights, const std::string& probe,
                             std::initializer_list<const char*> prefixes, const std::string& model) {
  for (const char* prefix : prefixes)
    if (weights.contains(prefix + probe)) return prefix;
  if (weights.contains(probe)) return "";
  throw Error(weights.name() + ": tensor " + probe, "absent", "expected the weights of a Hugging Face " + model);
}

}  // namespace detail

//! What a Hugging Face load did not use: the file's tensors loom's model has no place for
//! (BERT's pooler and next-sentence head, GPT-2's causal-mask buffers). A caller may print them.
struct HfLoadReport {
  std::vector<std::string> ignored;
};

// ---------------------------------------------------------------------------------------------
// GPT-2

//! The GPT-2 config of the Hugging Face model at `path` (see hf_model_files): n_embd, n_head,
//! n_layer, n_positions, vocab_size (padded to gpt2::pad_vocab), the activation and the dropout
//! rates (resid_pdrop, attn_pdrop; loom drops the embeddings' output at the residual rate).
//! Refuses, naming the key, what loom's GPT-2 does not have: an MLP other than 4C wide, a
//! layernorm epsilon other than 1e-5, unscaled or layer-scaled attention, cross-attention.
inline gpt2::Config read_hf_gpt2_config(const std::filesystem::path& path) {
  const detail::HfConfig json(hf_model_files(path).config);
  json.expect_model_type("gpt2", "read_hf_gpt2_config reads GPT-2");
  gpt2::Config c;
  c.channels = json.positive("n_embd");
  c.num_heads = json.positive("n_head");
  c.num_layers = json.positive("n_layer");
  c.max_seq_len = json.positive("n_positions");
  c.vocab_size = json.positive("vocab_size");
  c.padded_vocab_size = gpt2::pad_vocab(c.vocab_size);
  c.gelu = detail::hf_gelu(json, "activation_function", "gelu_new");
  if (json.has("n_inner"))
    json.expect("n_inner", json.find("n_inner")->integer(json.what("n_inner")), 4 * c.channels,
                "loom's GPT-2 MLP is 4 * n_embd wide");
  json.expect("layer_norm_epsilon", json.number("layer_norm_epsilon", 1e-5), 1e-5, "loom's GPT-2 uses 1e-5");
  json.expect("scale_attn_weights", json.boolean("scale_attn_weights", true), true,
              "loom scales attention scores by 1/sqrt(head size)");
  json.expect("scale_attn_by_inverse_layer_idx", json.boolean("scale_attn_by_inverse_layer_idx", false), false,
              "loom does not scale attention by layer");
  json.expect("add_cross_attention", json.boolean("add_cross_attention", false), false,
              "loom's GPT-2 has no cross-attention");
  c.hidden_dropout = json.number("resid_pdrop", 0.0);
  c.attention_dropout = json.number("attn_pdrop", 0.0);
  return json.validated(c);
}

namespace detail {
//! GPT-2's tensors, named with `prefix` ("transformer." in the files save_pretrained writes).
inline std::vector<HfTensor> hf_gpt2_tensors(const gpt2::Config& c, const std::string& prefix) {
  const std::int64_t C = c.channels;
  std::vector<HfTensor> t{{prefix + "wte.weight", {c.vocab_size, C}, "wte"},  // the padding rows stay 0
                          {prefix + "wpe.weight", {c.max_seq_len, C}, "wpe"}};
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string h = prefix + "h." + std::to_string(l) + ".";
    auto loom = [&](std::string_view what) { return gpt2::block_param(l, what); };
    // Conv1D stores [in, out]; loom's linear weights are [out, in].
    t.push_back({h + "ln_1.weight", {C}, loom("ln_1.weight")});
    t.push_back({h + "ln_1.bias", {C}, loom("ln_1.bias")});
    t.push_back({h + "attn.c_attn.weight", {C, 3 * C}, loom("attn.qkv.weight"), 0, true});
    t.push_back({h + "attn.c_attn.bias", {3 * C}, loom("attn.qkv.bias")});
    t.push_back({h + "attn.c_proj.weight", {C, C}, loom("attn.proj.weight"), 0, true});
    t.push_back({h + "attn.c_proj.bias", {C}, loom("attn.proj.bias")});
    t.push_back({h + "ln_2.weight", {C}, loom("ln_2.weight")});
    t.push_back({h + "ln_2.bias", {C}, loom("ln_2.bias")});
    t.push_back({h + "mlp.c_fc.weight", {C, 4 * C}, loom("mlp.fc.weight"), 0, true});
    t.push_back({h + "mlp.c_fc.bias", {4 * C}, loom("mlp.fc.bias")});
    t.push_back({h + "mlp.c_proj.weight", {4 * C, C}, loom("mlp.proj.weight"), 0, true});
    t.push_back({h + "mlp.c_proj.bias", {C}, loom("mlp.proj.bias")});
  }
  t.push_back({prefix + "ln_f.weight", {C}, "ln_f.weight"});
  t.push_back({prefix + "ln_f.bias", {C}, "ln_f.bias"});
  return t;
}
}  // namespace detail

//! Loads the Hugging Face GPT-2 at `path` into `flat`, a buffer laid out by `layout` (the whole
//! layout of gpt2::parameter_specs(config); other parameters in it are left alone). Every
//! tensor is found and its shape checked against `config` before any value is written; an
//! `lm_head.weight` that differs from `wte` is refused.
inline HfLoadReport load_hf_gpt2(const std::filesystem::path& path, const gpt2::Config& config,
                                 const ParameterLayout& layout, float* flat) {
  detail::HfWeights weights(hf_model_files(path).weights);
  const detail::WholeParameters params(gpt2::parameter_specs(config), layout, weights.name());
  const std::string prefix = detail::hf_prefix(weights, "wte.weight", {"transformer."}, "GPT-2");
  detail::load_tensors(weights, detail::hf_gpt2_tensors(config, prefix), params, flat);
  detail::check_tied(weights, "lm_head.weight", {config.vocab_size, config.channels},
                     flat + params.place("wte").first, prefix + "wte.weight");
  return {weights.unused()};
}

//! Saves the GPT-2 parameters in `flat` (laid out by `layout`, the whole layout of
//! gpt2::parameter_specs(config)) into `directory` as a Hugging Face GPT2LMHeadModel:
//! config.json and model.safetensors (float32; `transformers` loads it with
//! GPT2LMHeadModel.from_pretrained). The vocabulary's padding rows are not written.
inline void save_hf_gpt2(const std::filesystem::path& directory, const gpt2::Config& config,
                         const ParameterLayout& layout, const float* flat) {
  using detail::json_number;
  const auto integer = [](std::int64_t v) { return std::to_string(v); };
  const std::string json = detail::json_object({
      {"architectures", "[\"GPT2LMHeadModel\"]"},
      {"model_type", "\"gpt2\""},
      {"vocab_size", integer(config.vocab_size)},
      {"n_positions", integer(config.max_seq_len)},
      {"n_embd", integer(config.channels)},
      {"n_layer", integer(config.num_layers)},
      {"n_head", integer(config.num_heads)},
      {"n_inner", "null"},
      {"activation_function", json_quote(detail::hf_gelu_name(config.gelu))},
      {"layer_norm_epsilon", "1e-05"},
      {"resid_pdrop", json_number(config.hidden_dropout)},
      {"embd_pdrop", json_number(config.hidden_dropout)},
      {"attn_pdrop", json_number(config.attention_dropout)},
      {"scale_attn_weights", "true"},
      {"tie_word_embeddings", "true"},
  });
  const detail::WholeParameters params(gpt2::parameter_specs(config), layout,
                                       "Hugging Face model " + detail::quoted(directory));
  detail::save_tensors(directory, detail::hf_gpt2_tensors(config, "transformer."), params, flat, {}, json);
}

// ---------------------------------------------------------------------------------------------
// BERT

//! The BERT config of the Hugging Face model at `path`: hidden_size, num_attention_heads,
//! num_hidden_layers, max_position_embeddings, vocab_size (padded to a multiple of 128),
//! hidden_act, layer_norm_eps and the dropout rates. Refuses, naming the key, what loom's BERT
//! does not have: intermediate_size other than 4 * hidden_size, relative position embeddings,
//! a decoder or cross-attention.
inline bert::Config read_hf_bert_config(const std::filesystem::path& path) {
  const detail::HfConfig json(hf_model_files(path).config);
  json.expect_model_type("bert", "read_hf_bert_config reads BERT");
  bert::Config c;
  c.channels = json.positive("hidden_size");
  c.num_heads = json.positive("num_attention_heads");
  c.num_layers = json.positive("num_hidden_layers");
  c.max_seq_len = json.positive("max_position_embeddings");
  c.vocab_size = json.positive("vocab_size");
  c.padded_vocab_size = gpt2::pad_vocab(c.vocab_size);
  c.gelu = detail::hf_gelu(json, "hidden_act", "gelu");
  json.expect("intermediate_size", json.positive("intermediate_size"), 4 * c.channels,
              "loom's BERT MLP is 4 * hidden_size wide");
  json.expect("position_embedding_type", json.string("position_embedding_type", "absolute"), std::string("absolute"),
              "loom's BERT has absolute position embeddings");
  json.expect("is_decoder", json.boolean("is_decoder", false), false, "loom's BERT is an encoder");
  json.expect("add_cross_attention", json.boolean("add_cross_attention", false), false,
              "loom's BERT has no cross-attention");
  c.layernorm_eps = json.number("layer_norm_eps", 1e-12);
  c.hidden_dropout = json.number("hidden_dropout_prob", 0.0);
  c.attention_dropout = json.number("attention_probs_dropout_prob", 0.0);
  return json.validated(c);
}

namespace detail {
//! BERT's tensors: the encoder's named with `prefix` ("bert." in BertForMaskedLM's files), the
//! masked-LM head's under "cls.predictions.".
inline std::vector<HfTensor> hf_bert_tensors(const bert::Config& c, const std::string& prefix) {
  const std::int64_t C = c.channels;
  const std::string e = prefix + "embeddings.", head = "cls.predictions.";
  std::vector<HfTensor> t{{e + "word_embeddings.weight", {c.vocab_size, C}, "wte"},  // the padding rows stay 0
                          {e + "position_embeddings.weight", {c.max_seq_len, C}, "wpe"},
                          {e + "LayerNorm.weight", {C}, "ln_e.weight"},
                          {e + "LayerNorm.bias", {C}, "ln_e.bias"}};
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string layer = prefix + "encoder.layer." + std::to_string(l) + ".";
    auto loom = [&](std::string_view what) { return bert::block_param(l, what); };
    std::int64_t part = 0;
    for (const char* which : {"query", "key", "value"}) {  // loom stacks [q; k; v]
      const std::string self = layer + "attention.self." + which;
      t.push_back({self + ".weight", {C, C}, loom("attn.qkv.weight"), part * C * C});
      t.push_back({self + ".bias", {C}, loom("attn.qkv.bias"), part * C});
      ++part;
    }
    auto linear = [&](const std::string& name, std::int64_t out, std::int64_t in, std::string_view what) {
      t.push_back({layer + name + ".weight", {out, in}, loom(std::string(what) + ".weight")});
      t.push_back({layer + name + ".bias", {out}, loom(std::string(what) + ".bias")});
    };
    auto norm = [&](const std::string& name, std::string_view what) {
      t.push_back({layer + name + ".weight", {C}, loom(std::string(what) + ".weight")});
      t.push_back({layer + name + ".bias", {C}, loom(std::string(what) + ".bias")});
    };
    linear("attention.output.dense", C, C, "attn.proj");
    norm("attention.output.LayerNorm", "ln_1");
    linear("intermediate.dense", 4 * C, C, "mlp.fc");
    linear("output.dense", C, 4 * C, "mlp.proj");
    norm("output.LayerNorm", "ln_2");
  }
  t.push_back({head + "transform.dense.weight", {C, C}, "mlm.dense.weight"});
  t.push_back({head + "transform.dense.bias", {C}, "mlm.dense.bias"});
  t.push_back({head + "transform.LayerNorm.weight", {C}, "mlm.ln.weight"});
  t.push_back({head + "transform.LayerNorm.bias", {C}, "mlm.ln.bias"});
  t.push_back({head + "bias", {c.vocab_size}, "mlm.bias"});
  return t;
}
}  // namespace detail

//! Loads the Hugging Face BERT (BertForMaskedLM) at `path` into `flat`, laid out by `layout`
//! (the whole layout of bert::parameter_specs(config)). Row 0 of the token-type embeddings is
//! added into wpe; a `cls.predictions.decoder.weight` that differs from the word embeddings is
//! refused, and so is a file without the masked-LM head (a BertModel's).
inline HfLoadReport load_hf_bert(const std::filesystem::path& path, const bert::Config& config,
                                 const ParameterLayout& layout, float* flat) {
  detail::HfWeights weights(hf_model_files(path).weights);
  const detail::WholeParameters params(bert::parameter_specs(config), layout, weights.name());
  const std::string prefix = detail::hf_prefix(weights, "embeddings.word_embeddings.weight", {"bert."}, "BERT");
  const std::string head = "cls.predictions.";
  LOOM_CHECK(weights.contains(head + "bias") || weights.contains(head + "decoder.bias"),
             weights.name() + ": the masked-LM head (" + head + "*)", "absent",
             "loom's BERT is BertForMaskedLM: save that model, not a BertModel");
  detail::load_tensors(weights, detail::hf_bert_tensors(config, prefix), params, flat);
  const std::int64_t C = config.channels;
  const std::string types = prefix + "embeddings.token_type_embeddings.weight";
  if (weights.contains(types)) {
    // Every token is of type 0 in loom: that row is a constant added at every position.
    const std::vector<std::int64_t>& shape = weights.shape(types);  // [type_vocab_size, C]
    const std::vector<float> rows = weights.read(types, {shape.empty() ? 0 : std::max<std::int64_t>(shape[0], 1), C});
    float* wpe = flat + params.place("wpe").first;
    for (std::int64_t t = 0; t < config.max_seq_len; ++t)
      for (std::int64_t c = 0; c < C; ++c) wpe[t * C + c] += rows[static_cast<std::size_t>(c)];
  }
  detail::check_tied(weights, head + "decoder.bias", {config.vocab_size}, flat + params.place("mlm.bias").first,
                     head + "bias");
  detail::check_tied(weights, head + "decoder.weight", {config.vocab_size, C}, flat + params.place("wte").first,
                     prefix + "embeddings.word_embeddings.weight");
  return {weights.unused()};
}

//! Saves the BERT parameters in `flat` (laid out by `layout`, the whole layout of
//! bert::parameter_specs(config)) into `directory` as a Hugging Face BertForMaskedLM:
//! config.json and model.safetensors (float32). The token-type embeddings are written as two
//! zero rows, so that `transformers` with token_type_ids = 0 computes what loom does.
inline void save_hf_bert(const std::filesystem::path& directory, const bert::Config& config,
                         const ParameterLayout& layout, const float* flat) {
  using detail::json_number;
  const auto integer = [](std::int64_t v) { return std::to_string(v); };
  const std::string json = detail::json_object({
      {"architectures", "[\"BertForMaskedLM\"]"},
      {"model_type", "\"bert\""},
      {"vocab_size", integer(config.vocab_size)},
      {"hidden_size", integer(config.channels)},
      {"num_hidden_layers", integer(config.num_layers)},
      {"num_attention_heads", integer(config.num_heads)},
      {"intermediate_size", integer(4 * config.channels)},
      {"hidden_act", json_quote(detail::hf_gelu_name(config.gelu))},
      {"max_position_embeddings", integer(config.max_seq_len)},
      {"type_vocab_size", "2"},
      {"layer_norm_eps", json_number(config.layernorm_eps)},
      {"hidden_dropout_prob", json_number(config.hidden_dropout)},
      {"attention_probs_dropout_prob", json_number(config.attention_dropout)},
      {"position_embedding_type", "\"absolute\""},
      {"tie_word_embeddings", "true"},
  });
  const detail::WholeParameters params(bert::parameter_specs(config), layout,
                                       "Hugging Face model " + detail::quoted(directory));
  const std::vector<float> zero_types(static_cast<std::size_t>(2 * config.channels), 0.0f);
  detail::save_tensors(directory, detail::hf_bert_tensors(config, "bert."), params, flat,
                       {{"bert.embeddings.token_type_embeddings.weight", {2, config.channels}, zero_types}}, json);
}

}  // namespace loom::io
