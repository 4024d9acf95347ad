// gpt2_train's and bert_train's training loop, written once over the backend
// (examples/gpt2_train.cpp: the command line and the CPU backend; gpt2_train_cuda.cu: the CUDA
// backend) and over the model family: the same sources built with LOOM_EXAMPLE_BERT=1 are
// bert_train (masked-LM on BERT), without it gpt2_train (next-token on GPT-2). The backend's
// kernels must be included before this header's templates are instantiated.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <unistd.h>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/comm/any.hpp"
#include "loom/comm/ref.hpp"
#include "loom/comm/self.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/io/async_training_state.hpp"
#include "loom/io/checkpoint_series.hpp"
#include "loom/io/hugging_face.hpp"
#include "loom/io/llmc_checkpoint.hpp"
#include "loom/io/masked_lm.hpp"
#include "loom/io/padded.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/io/token_file.hpp"
#include "loom/io/token_encoder.hpp"
#include "loom/io/training_state.hpp"
#include "loom/models/gpt2/config.hpp"
#include "loom/models/gpt2/model.hpp"
#if LOOM_EXAMPLE_BERT
#include "loom/models/bert/config.hpp"
#include "loom/models/bert/model.hpp"
#endif
#include "loom/optim/adafactor.hpp"
#include "loom/optim/adamw.hpp"
#include "loom/optim/lr_schedule.hpp"
#include "loom/optim/sgd.hpp"
#include "loom/parallel/data_parallel.hpp"
#include "loom/parallel/mesh.hpp"
#include "loom/parallel/single_rank.hpp"
#include "loom/parallel/stop_request.hpp"
#include "loom/parallel/trainer.hpp"
#include "loom/parallel/validation.hpp"
#include "loom/parallel/zero.hpp"
#include "loom/schedule/gpipe.hpp"
#include "loom/schedule/gradient_accumulation.hpp"
#include "loom/schedule/interleaved.hpp"
#include "loom/schedule/one_f_one_b.hpp"
#include "loom/schedule/simulate.hpp"
#include "loom/schedule/zero_bubble.hpp"

namespace gpt2_example {

#if LOOM_EXAMPLE_BERT
namespace family = loom::bert;
//! The program's name, in its messages.
inline constexpr const char* program = "bert_train";
//! BERT trains on masked-LM batches of the data's token sequences.
template <class S>
using Data = loom::io::MaskedLm<S>;
//! A Hugging Face BertForMaskedLM's config, weights into a whole layout, and weights out.
inline family::Config read_hf_config(const std::string& path) { return loom::io::read_hf_bert_config(path); }
constexpr auto load_hf = [](const auto&... a) { return loom::io::load_hf_bert(a...); };
constexpr auto save_hf = [](const auto&... a) { loom::io::save_hf_bert(a...); };
#else
namespace family = loom::gpt2;
inline constexpr const char* program = "gpt2_train";
//! GPT-2 trains on the data's next-token batches as they are.
template <class S>
using Data = S;
//! A Hugging Face GPT2LMHeadModel's config, weights into a whole layout, and weights out.
inline family::Config read_hf_config(const std::string& path) { return loom::io::read_hf_gpt2_config(path); }
constexpr auto load_hf = [](const auto&... a) { return loom::io::load_hf_gpt2(a...); };
constexpr auto save_hf = [](const auto&... a) { loom::io::save_hf_gpt2(a...); };
#endif

//! Every command-line option (main fills it in).
struct Options {
  std::string model = "tiny";
  std::optional<std::int64_t> layers, heads, channels;
  std::optional<std::int64_t> vocab_size;  // the config's otherwise (a token file of a larger tokenizer)
  std::int64_t steps = 100;
  std::int64_t batch = 8;  // sequences per global batch
  std::int64_t micro_batch = 0;  // 0 = the whole batch in one micro-batch
  std::int64_t accumulation = 0;  // 0 = batch / micro_batch
  std::int64_t seq = 64;
  double lr = 1e-3;
  std::int64_t warmup = 0;
  double min_lr_factor = 0.1;
  std::string lr_decay = "cosine";     // --lr-decay: cosine, linear, constant, inverse-sqrt, wsd
  std::int64_t lr_decay_steps = 0;     // the step the decay ends at; 0 = steps
  std::int64_t wsd_decay_steps = 0;    // wsd: the cooldown's length; 0 = a fifth of the decay span
  std::string wsd_cooldown = "1-sqrt"; // wsd: linear, cosine or 1-sqrt
  double clip = 1.0;
  double weight_decay = 0.1;
  double hidden_dropout = 0.0;     // --dropout: the config's hidden_dropout
  double attention_dropout = 0.0;  // --attention-dropout
  std::string optimizer = "adamw";
  loom::AdamW::Options adam;  // --adam-beta1, --adam-beta2, --adam-eps; weight_decay from --weight-decay
  std::string dtype = "float";  // float, or bf16 (mixed precision: fp32 master weights and moments)
  bool fp32_gradients = false;  // bf16: micro-batches' gradients added up, reduced and clipped in fp32
  bool no_fp32_gradient_fusion = false;  // fp32 gradients drained from bf16, not added by the GEMMs
  bool no_stop_on_non_finite = false;    // apply a step whose loss or gradient norm is not finite
  std::string attention = "auto";  // stored (probabilities), recompute (log-sum-exp only), or auto
  std::string recompute_layers = "0";  // layers per chunk that recompute all their activations, or "all"
  std::int64_t logits_chunk_rows = 0;  // the config's logits_chunk_rows (0: the head keeps its probabilities)
  bool sequence_parallel = false;      // the config's sequence_parallel (rows split over --tp)
  bool logits_at_every_position = false;  // bert_train: the head on every position, not only the targeted ones
  std::int64_t max_predictions = 0;       // bert_train: targets per sequence, in the data and the model (0: no cap)
  bool flash_attention = true;       // --device cuda, bf16, recompute: the SRAM-tiled kernels
  bool warpgroup_attention = false;  // the tiled kernels at head size 64 on wgmma (an sm_90a build)
  bool communication_stream = true;  // --comm nccl: NCCL on a stream of its own beside the kernels
  std::optional<bool> gemm_epilogues;  // --device cuda: bias, GELU and GELU' fused into cuBLASLt GEMMs
                                       // (unset: on for bf16, off for float)
  std::uint64_t seed = 1337;
  std::string data = "synthetic";
  std::int64_t mask_token = -1;  // bert_train: the data's [MASK] id (-1: a new id after the data's vocabulary)
  double jump_probability = 0.1;
  std::int64_t pad_min = 0;     // sequences of drawn lengths in [pad_min, seq], padded (0: all full-length)
  std::int32_t pad_token = 0;   // the token padded positions read
  std::string metrics;
  std::string val_data;           // held-out data for the validation loss (empty: none)
  std::int64_t eval_every = 0;    // validation every N steps (0: before the first and after the last only)
  std::int64_t eval_batches = 4;  // batches of --batch sequences each validation reads
  std::int64_t sample_tokens = 0;  // gpt2_train: tokens to generate after training (0: none)
  std::int64_t sample_every = 0;   // also after every N steps (0: after the last only)
  std::int64_t samples = 1;        // texts from the same prompt, generated together
  std::string prompt;              // what they follow: text with bytes: data or --tokenizer, else ids "a,b,c"
  double temperature = 1.0;        // sampling temperature (0: greedy)
  std::int64_t top_k = 0;          // draw among the k most likely tokens (0: all)
  std::string tokenizer;           // token data's ids to text: llm.c's tokenizer file, a vocab.json or a tokenizer.json (empty: ids)
  std::string init;
  std::string save;
  std::string init_hf;  // a Hugging Face model directory (config.json, model.safetensors) to start from
  std::string save_hf;  // a directory to write the trained weights to, in Hugging Face's format
  std::string gelu;     // tanh or erf (empty: the model's default, or the --init-hf config's)
  std::string save_state;  // a loom training-state checkpoint, written at the end and every save_every steps
  std::int64_t save_every = 0;
  bool async_save = false;  // write the --save-every saves in the background while training goes on
  std::int64_t keep_last = 0;  // with a --save-state series ({step}): delete all but the newest N after a save (0: keep all)
  std::string resume;  // a training-state checkpoint to go on from
  std::string check_state;  // a training-state file or series to check whole, instead of training
  bool resume_if_exists = false;  // start at step 1 when --resume's file is not there (yet)
  std::int64_t stop_after = 0;  // stop after this step (0 = at --steps); the schedule still spans --steps
  double stop_after_minutes = 0;  // stop, saving --save-state, before the step that would end past this (0: none)
  bool no_save_on_signal = false;  // with --save-state: SIGINT, SIGTERM and SIGUSR1 end the process as usual
  // When the program started: --stop-after-minutes counts from here (loading and setup included,
  // as a scheduler's time limit does).
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  int threads = 0;
  double peak_tflops = 0;
  std::int64_t log_every = 1;
  int dp = 1;
  int tp = 1;
  int pp = 1;
  std::string schedule;  // empty: 1f1b with pipeline stages, accumulation without
  std::optional<int> virtual_stages;  // interleaved only; 2 when not given
  int zero = 0;
  int prefetch = 1;
  int zero_replicas = 1;  //!< --zero-replicas: hybrid sharding (Zero::replicas)
  std::string comm = "threads";
  std::string device = "cpu";  // cpu or cuda
  int gpus = 0;  // cuda: GPUs the thread ranks use (0 = every GPU this process sees)
  std::size_t bucket_mib = 25;
  bool no_overlap = false;
  bool demo = false;
};

//! The data's sequences, cut to drawn lengths and padded where --pad-min asks (else as they are).
using Source =
    std::variant<Data<loom::io::Padded<loom::io::SyntheticMarkov>>, Data<loom::io::Padded<loom::io::TokenFile>>>;

//! The data `name` names (--data or --val-data), for a model of `model_vocab` tokens, padded and
//! (bert_train) masked as the options say. bert_train's masked-LM batches take a new mask id
//! after the data's vocabulary unless --mask-token names the data's own.
inline Source open_data(const Options& o, const std::string& name, std::int64_t model_vocab) {
  const auto wrap = [&](auto sequences) -> Source {
    // --pad-min 0: min_length seq, nothing padded.
    loom::io::Padded padded(std::move(sequences), {.min_length = o.pad_min > 0 ? o.pad_min : o.seq,
                                                   .pad_token = o.pad_token,
                                                   .seed = o.seed + 3});
#if LOOM_EXAMPLE_BERT
    return Data<decltype(padded)>(std::move(padded), {.mask_token = o.mask_token,
                                                      .max_predictions = o.max_predictions,
                                                      .seed = o.seed + 2});
#else
    return padded;
#endif
  };
#if LOOM_EXAMPLE_BERT
  const std::int64_t data_vocab = o.mask_token < 0 ? model_vocab - 1 : model_vocab;
#else
  const std::int64_t data_vocab = model_vocab;
#endif
  if (name == "synthetic")
    return wrap(loom::io::SyntheticMarkov({.vocab_size = data_vocab, .jump_probability = o.jump_probability,
                                           .seed = o.seed + 1}));
  if (name.starts_with("bytes:")) return wrap(loom::io::TokenFile::bytes(name.substr(6)));
  return wrap(loom::io::TokenFile::open(name, data_vocab));
}

#if !LOOM_EXAMPLE_BERT
//! The tokens --prompt names: its bytes with bytes: data, its text encoded through --tokenizer
//! where one is given, else token ids separated by commas; with no --prompt, the data's first
//! token.
inline std::vector<std::int32_t> prompt_tokens(const Options& o, const Source& data) {
  if (o.prompt.empty())
    return {std::visit([](const auto& src) { return src.batch_at(0, 1, 1).tokens[0]; }, data)};
  std::vector<std::int32_t> tokens;
  if (o.data.starts_with("bytes:")) {
    for (unsigned char byte : o.prompt) tokens.push_back(byte);
    return tokens;
  }
  if (!o.tokenizer.empty()) {
    try {
      return loom::io::TokenEncoder::read(o.tokenizer).encode(o.prompt);
    } catch (const loom::Error& e) {
      throw loom::Error("--prompt (text, encoded through --tokenizer " + o.tokenizer + "): " + e.subject(), e.value(),
                        e.rule());
    }
  }
  std::string_view rest = o.prompt;
  while (true) {
    const std::string_view item = rest.substr(0, rest.find(','));
    std::int32_t id = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || error != std::errc{} || end != item.data() + item.size())
      throw loom::Error("--prompt", o.prompt,
                        "with token data it is token ids separated by commas (e.g. 15496,11); text is read with "
                        "bytes: data, or with --tokenizer");
    tokens.push_back(id);
    if (item.size() == rest.size()) return tokens;
    rest.remove_prefix(item.size() + 1);
  }
}

//! Rank 0's --sample-tokens after step `after_step`: tokens generated on `threads` CPU threads
//! from `whole` (the weights in whole_layout order, fp32 for either dtype), printed as text for
//! bytes: data and as token ids otherwise. Defined in gpt2_train.cpp, so that the CUDA
//! translation unit compiles no CPU kernels.
void print_sample(const Options& o, std::int64_t after_step, int threads, const family::Config& config,
                  std::span<const float> whole, const Source& data);
#endif

//! The token source under `s`: under the padding and (BERT) the masking.
template <class S>
const auto& tokens_of(const S& s) {
  if constexpr (requires { s.source(); }) return tokens_of(s.source());
  else return s;
}

inline std::int64_t source_vocab(const Source& s) {
  return std::visit([](const auto& src) { return src.vocab_size(); }, s);
}

//! The options only one model family takes; main checks them before any rank starts.
inline void check_family_options(const Options& o) {
#if LOOM_EXAMPLE_BERT
  LOOM_CHECK(o.init.empty() && o.save.empty(), "--init/--save", o.init.empty() ? o.save : o.init,
             "--init and --save read and write llm.c GPT-2 weight files; bert_train starts from and writes "
             "Hugging Face weights with --init-hf and --save-hf, and saves and resumes with --save-state and "
             "--resume");
  LOOM_CHECK(o.mask_token >= 0 || o.data == "synthetic" || o.data.starts_with("bytes:"), "--mask-token",
             o.mask_token, "a token file needs its tokenizer's [MASK] id (103 in BERT's uncased WordPiece)");
  LOOM_CHECK(o.sample_tokens == 0, "--sample-tokens", o.sample_tokens,
             "bert_train's masked LM does not generate text left to right; gpt2_train does");
#else
  LOOM_CHECK(o.mask_token < 0, "--mask-token", o.mask_token, "only bert_train masks tokens");
#endif
  LOOM_CHECK(o.init.empty() || o.init_hf.empty(), "--init-hf", o.init_hf,
             "give --init (llm.c) or --init-hf (Hugging Face), not both");
  if (o.vocab_size) {
    LOOM_CHECK(*o.vocab_size >= 1 && *o.vocab_size <= std::numeric_limits<std::int32_t>::max(), "--vocab-size",
               *o.vocab_size, "must be in [1, 2147483647]");
    LOOM_CHECK(o.init.empty() && o.init_hf.empty(), "--vocab-size", *o.vocab_size,
               "the checkpoint of --init or --init-hf sets the vocabulary");
    LOOM_CHECK(!o.data.starts_with("bytes:"), "--vocab-size", *o.vocab_size,
               "bytes: data sets the vocabulary (256 bytes)");
  }
  if (!o.gelu.empty()) loom::gelu_from_name(o.gelu, "--gelu");
}

inline family::Config model_config(const Options& o) {
  family::Config c = family::config_by_name(o.model);
  if (o.layers) c.num_layers = *o.layers;
  if (o.heads) c.num_heads = *o.heads;
  if (o.channels) c.channels = *o.channels;
  if (o.vocab_size) {  // wte's rows rounded up to 128, as GPT-2's 50257 are to 50304
    c.vocab_size = *o.vocab_size;
    c.padded_vocab_size = (*o.vocab_size + 127) / 128 * 128;
  }
  // The synthetic task takes the config's own vocabulary (256 for tiny and --demo, GPT-2's 50257
  // for small and up, BERT's 30522 with its mask token among them), so that --model small is the
  // 124M model whose throughput is compared with other frameworks'. Byte-level data has 256
  // tokens (BERT: plus its mask token, padded to 384).
#if LOOM_EXAMPLE_BERT
  if (o.data.starts_with("bytes:")) {
    c.vocab_size = 257;
    c.padded_vocab_size = 384;
  }
#else
  if (o.data.starts_with("bytes:")) c.vocab_size = c.padded_vocab_size = 256;
#endif
  c.max_seq_len = std::max(c.max_seq_len, o.seq);
#if !LOOM_EXAMPLE_BERT
  if (!o.init.empty()) c = loom::io::read_llmc_config(o.init);
#endif
  if (!o.init_hf.empty()) c = read_hf_config(o.init_hf);  // its architecture; dropout below is the flags'
  if (!o.gelu.empty()) c.gelu = loom::gelu_from_name(o.gelu, "--gelu");
  c.hidden_dropout = o.hidden_dropout;
  c.attention_dropout = o.attention_dropout;
  c.logits_chunk_rows = o.logits_chunk_rows;
  c.sequence_parallel = o.sequence_parallel;
#if LOOM_EXAMPLE_BERT
  c.logits_at_every_position = o.logits_at_every_position;
  c.max_predictions_per_seq = o.max_predictions;
#endif
  c.validate();
  return c;
}

//! TrainerOptions::recompute_layers of --recompute-layers: a count >= 0, or "all".
inline int recompute_layers_of(const Options& o) {
  if (o.recompute_layers == "all") return loom::TrainerOptions::all_layers;
  std::size_t used = 0;
  int n = -1;
  try {
    n = std::stoi(o.recompute_layers, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used == o.recompute_layers.size() && n >= 0, "--recompute-layers", o.recompute_layers,
             "must be a count of layers >= 0 or \"all\"");
  return n;
}

//! The learning-rate schedule of --lr, --warmup, --min-lr-factor, --lr-decay, --lr-decay-steps,
//! --wsd-decay-steps and --wsd-cooldown, validated: the decay ends at --lr-decay-steps (0: at
//! --steps), and a warmup-stable-decay cooldown takes a fifth of the steps after the warmup
//! unless --wsd-decay-steps says otherwise (Hägele et al. 2024 found 20% enough to match cosine).
inline loom::WarmupDecayLr lr_schedule(const Options& o) {
  using loom::LrCooldown, loom::LrDecay;
  constexpr std::array decays{LrDecay::cosine, LrDecay::linear, LrDecay::constant, LrDecay::inverse_sqrt,
                              LrDecay::warmup_stable_decay};
  constexpr std::array cooldowns{LrCooldown::linear, LrCooldown::cosine, LrCooldown::one_minus_sqrt};
  const auto decay = std::ranges::find(decays, o.lr_decay, [](LrDecay d) { return loom::name(d); });
  LOOM_CHECK(decay != decays.end(), "--lr-decay", o.lr_decay, "must be cosine, linear, constant, inverse-sqrt or wsd");
  const auto cooldown = std::ranges::find(cooldowns, o.wsd_cooldown, [](LrCooldown c) { return loom::name(c); });
  LOOM_CHECK(cooldown != cooldowns.end(), "--wsd-cooldown", o.wsd_cooldown, "must be linear, cosine or 1-sqrt");
  loom::WarmupDecayLr lr{.lr = o.lr,
                         .warmup = o.warmup,
                         .total_steps = o.lr_decay_steps > 0 ? o.lr_decay_steps : o.steps,
                         .min_lr_factor = o.min_lr_factor,
                         .decay = *decay,
                         .decay_steps = o.wsd_decay_steps,
                         .cooldown = *cooldown};
  const bool wsd = lr.decay == LrDecay::warmup_stable_decay;
  if (wsd && lr.decay_steps == 0) lr.decay_steps = std::max<std::int64_t>(1, (lr.total_steps - lr.warmup) / 5);
  // The library's checks name its fields; these name the flags.
  if (lr.has_end())
    LOOM_CHECK(lr.total_steps >= lr.warmup, o.lr_decay_steps > 0 ? "--lr-decay-steps" : "--steps", lr.total_steps,
               "the decay must end at or after the warmup (--warmup " + std::to_string(o.warmup) + ")");
  if (wsd)
    LOOM_CHECK(lr.decay_steps <= lr.total_steps - lr.warmup, "--wsd-decay-steps", lr.decay_steps,
               "the cooldown must fit between the warmup's end (step " + std::to_string(o.warmup) +
                   ") and the decay's (step " + std::to_string(lr.total_steps) + ")");
  lr.validate();
  return lr;
}

//! The attention storage of --attention. auto: recompute where that runs the tiled (flash)
//! kernels, which keep no probabilities and were the fastest attention on an H100
//! (docs/benchmarks.md): a GPU they are built for, bf16, the switch on (--flash-attention), a head
//! size they take, padded batches or not, with attention dropout or not (the kernels draw the
//! mask); stored everywhere else.
template <class T, class Backend>
loom::AttentionStorage attention_choice(const Options& o, const Backend& backend, const family::Config& config) {
  if (o.attention == "recompute") return loom::AttentionStorage::recompute;
  if (o.attention == "stored") return loom::AttentionStorage::stored;
  if constexpr (std::is_same_v<T, loom::bf16> && requires { backend.flash_attention(); }) {
    if (backend.flash_attention() && flash_attention_available(backend, config.channels / config.num_heads))
      return loom::AttentionStorage::recompute;
  }
  return loom::AttentionStorage::stored;
}

//! What a training-state checkpoint says about the run that saved it (JSON): enough to see,
//! before resuming, which model, data and batch it trained on.
template <class Config>
std::string state_meta(const Options& o, const Config& config, int ranks) {
  return nlohmann::json{{"program", program},
                        {"model", o.model},
                        {"config", loom::detail::to_text(config)},
                        {"dtype", o.dtype},
                        {"optimizer", o.optimizer},
                        {"data", o.data},
                        {"seed", o.seed},
                        {"batch", o.batch},
                        {"seq", o.seq},
                        {"steps", o.steps},
                        {"lr", loom::detail::to_text(lr_schedule(o))},
                        {"ranks", ranks},
                        {"mesh", {{"dp", o.dp}, {"tp", o.tp}, {"pp", o.pp}}}}
      .dump();
}

inline nlohmann::json memory_json(const loom::MemoryTracker& m) {
  nlohmann::json j;
  for (int i = 0; i < loom::memory_category_count; ++i) {
    const auto c = static_cast<loom::MemoryCategory>(i);
    j[std::string(loom::name(c))] = {{"bytes", m.current(c)}, {"peak_bytes", m.peak(c)}};
  }
  j["total"] = {{"bytes", m.current_total()}, {"peak_bytes", m.peak_total()}};
  return j;
}

//! Each rank's memory by category, gathered to rank 0 and printed there with the rank's mesh
//! coordinates and, with pipeline stages, the activation slots it holds (they differ by stage).
template <class Group>
void print_memory_per_rank(Group& world, const loom::MeshShape& shape, const loom::MemoryTracker& m,
                           std::int64_t activation_slots) {
  constexpr int fields = loom::memory_category_count + 2;  // the categories, the peak, the slots
  std::vector<double> mine(fields), all(static_cast<std::size_t>(fields * world.size()));
  for (int i = 0; i < loom::memory_category_count; ++i)
    mine[i] = loom::MemoryTracker::mib(m.current(static_cast<loom::MemoryCategory>(i)));
  mine[fields - 2] = loom::MemoryTracker::mib(m.peak_total());
  mine[fields - 1] = static_cast<double>(activation_slots);
  world.all_gather(std::span<double>(mine), std::span<double>(all));
  if (world.rank() != 0) return;
  const bool pipeline = shape.pp > 1;
  std::printf("memory per rank after step 1 (MiB):\n  rank dp tp pp");
  for (int i = 0; i < loom::memory_category_count; ++i)
    std::printf(" %15s", std::string(loom::name(static_cast<loom::MemoryCategory>(i))).c_str());
  std::printf(" %10s%s\n", "peak", pipeline ? "  slots" : "");
  for (int r = 0; r < world.size(); ++r) {
    const loom::MeshCoordinates c = loom::mesh_coordinates(shape, r);
    std::printf("  %4d %2d %2d %2d", r, c.dp, c.tp, c.pp);
    const double* row = all.data() + static_cast<std::ptrdiff_t>(r) * fields;
    for (int i = 0; i < loom::memory_category_count; ++i) std::printf(" %15.2f", row[i]);
    std::printf(" %10.2f", row[fields - 2]);
    if (pipeline) std::printf(" %6.0f", row[fields - 1]);
    std::printf("\n");
  }
}

//! "embedding", "h3" or "head": what layer `layer` of a model of `config` is.
inline std::string layer_name(const family::Config& config, int layer) {
  if (layer == family::embedding_layer) return "embedding";
  if (layer == family::head_layer(config)) return "head";
  return "h" + std::to_string(layer - 1);
}

//! Each stage's model layers (trainer.stage(), per chunk), activation slots and parameters,
//! gathered over `pipeline` (collective over it: every rank calls this) and printed by its
//! stage 0 when `print`.
template <class Group, class Stage>
void print_pipeline_stages(Group& pipeline, const Stage& stage, const family::Config& config,
                           std::int64_t activation_slots, bool tensor_parallel, bool print) {
  const int chunks = stage.chunks();  // the same on every stage
  const int fields = 2 + 2 * chunks;
  std::vector<double> mine(static_cast<std::size_t>(fields)), all(static_cast<std::size_t>(fields * pipeline.size()));
  mine[0] = static_cast<double>(activation_slots);
  mine[1] = static_cast<double>(stage.layout().total());
  for (int c = 0; c < chunks; ++c) {
    mine[2 + 2 * c] = stage.chunk_model_layers(c).first;
    mine[3 + 2 * c] = stage.chunk_model_layers(c).last;
  }
  pipeline.all_gather(std::span<double>(mine), std::span<double>(all));
  if (!print) return;
  for (int s = 0; s < pipeline.size(); ++s) {
    const double* row = all.data() + static_cast<std::ptrdiff_t>(s) * fields;
    std::string layers;
    for (int c = 0; c < chunks; ++c) {
      const int first = static_cast<int>(row[2 + 2 * c]), last = static_cast<int>(row[3 + 2 * c]);
      if (c > 0) layers += ", ";
      layers += first == last ? std::to_string(first) + " (" + layer_name(config, first) + ")"
                              : std::to_string(first) + ".." + std::to_string(last) + " (" +
                                    layer_name(config, first) + ".." + layer_name(config, last) + ")";
    }
    std::printf("  stage %d: layers %s, %.0f activation slot(s), %.0f parameters held%s\n", s, layers.c_str(),
                row[0], row[1], tensor_parallel ? " per TP rank" : "");
  }
}

//! A schedule type's name on the command line (--schedule) and in the library.
struct ScheduleNames {
  const char* option;
  const char* type;
};
template <class S>
constexpr ScheduleNames schedule_names() {
  if constexpr (std::is_same_v<S, loom::GPipe>) return {"gpipe", "GPipe"};
  else if constexpr (std::is_same_v<S, loom::OneFOneB>) return {"1f1b", "OneFOneB"};
  else if constexpr (std::is_same_v<S, loom::Interleaved1F1B>) return {"interleaved", "Interleaved1F1B"};
  else if constexpr (std::is_same_v<S, loom::ZeroBubbleH1>) return {"zb-h1", "ZeroBubbleH1"};
  else return {"accumulation", "GradientAccumulation"};
}

//! The schedule, its micro-batches and, for a pipeline, its bubble as the host simulator
//! predicts it with the zero-bubble paper's costs (F = 1, B = 2, I = W = 1).
template <class S>
std::string describe_schedule(const S& schedule, const loom::ScheduleShape& shape) {
  constexpr ScheduleNames names = schedule_names<S>();
  const std::string head = std::string(names.option) + " (" + names.type;
  if (shape.micro_batches < 1) return head + ")";  // the batch does not split: step 1 says why
  if constexpr (!loom::pipelined_schedule<S>) {
    return head + ", " + std::to_string(shape.micro_batches) + " micro-batch(es) per step per rank)";
  } else {
    char bubble[32];
    std::snprintf(bubble, sizeof bubble, "%.1f%%", 100.0 * loom::simulate(schedule, shape).idle_fraction());
    return head + ", " + std::to_string(shape.micro_batches) + " micro-batches per pipeline per step, " +
           std::to_string(shape.virtual_stages) + " chunk(s) per rank, simulated bubble " + bubble + " at F=1 B=2)";
  }
}

//! The ZeRO formula for this rank's parameters + gradients + optimizer state (sizeof(T) bytes
//! for each parameter and gradient, 4 per optimizer slot and, for bf16, 4 of fp32 master
//! weights; with fp32 gradients the gradients held are fp32, and stage 1 keeps the bf16 ones
//! too where the layers write any, `narrow_gradients`), plus the optimizer's per-tensor state
//! (Adafactor's moments, held whole on every rank), beside what it holds; padding and the
//! working set apart.
template <class T, class Strategy>
void print_zero_memory(const loom::ShardPlan& plan, const loom::MemoryTracker& m, const Strategy& strategy, int slots,
                       bool fp32_gradients, bool narrow_gradients, std::int64_t tensor_state_bytes) {
  using loom::MemoryCategory;
  const double psi = static_cast<double>(plan.padded_total() - plan.padding()), n = plan.ranks();
  const double bytes = sizeof(T), state = 4.0 * slots + (loom::is_narrow_storage<T> ? 4.0 : 0.0);
  const bool wide = fp32_gradients && loom::is_narrow_storage<T>;
  const double grad_bytes = wide ? 4.0 : bytes;
  const int stage = std::is_same_v<Strategy, loom::Zero<1>> ? 1 : std::is_same_v<Strategy, loom::Zero<2>> ? 2 : 3;
  const double formula = (stage == 1 ? (bytes + grad_bytes + (wide && narrow_gradients ? bytes : 0.0)) * psi +
                                            state * psi / n
                         : stage == 2 ? bytes * psi + (grad_bytes + state) * psi / n
                                      : (bytes + grad_bytes + state) * psi / n) +
                         static_cast<double>(tensor_state_bytes);
  const double held = static_cast<double>(m.current(MemoryCategory::parameters) + m.current(MemoryCategory::gradients) +
                                          m.current(MemoryCategory::optimizer_state));
  const std::string per_tensor =
      tensor_state_bytes > 0 ? ", per-tensor state " + std::to_string(tensor_state_bytes) + " bytes" : "";
  // Under hybrid sharding N is the ranks of one replica, over which the model is sharded.
  const std::string replicas =
      strategy.replicas > 1 ? " in each of " + std::to_string(strategy.replicas) + " replicas" : "";
  std::printf("ZeRO-%d memory on rank 0: formula %.2f MiB (psi = %.0f parameters, N = %d%s, %d state slots%s), "
              "held %.2f MiB, of which padding %.2f MiB (%lld elements); working set (communication, peak) %.2f MiB\n",
              stage, formula / (1 << 20), psi, plan.ranks(), replicas.c_str(), slots, per_tensor.c_str(), held / (1 << 20),
              (held - formula) / (1 << 20), static_cast<long long>(plan.padding()),
              loom::MemoryTracker::mib(m.peak(MemoryCategory::communication)));
}

//! What rank 0 computes on: "4 threads per rank" (cpu) or "GPU 0 for rank 0" (cuda).
template <class Backend>
std::string describe_backend(const Backend& backend) {
  if constexpr (requires { backend.threads(); })
    return std::to_string(backend.threads()) + " threads per rank";
  else
    return "GPU " + std::to_string(backend.device()) + " for rank 0" +
           (!backend.flash_attention()             ? ""
            : flash_attention_available(backend) ? " (flash attention on)"
                                                 : " (flash attention not built for this GPU: sm_80 or newer)") +
           (!backend.warpgroup_attention()                ? ""
            : warpgroup_attention_available(backend) ? " (on wgmma)"
                                                     : " (wgmma attention not built for this GPU: sm_90a)") +
           (backend.gemm_epilogues() ? " (GEMM epilogues on)" : "") +
           (backend.overlap_communication() ? "" : " (NCCL calls on the compute stream)");
}

//! What the training loop asks of a trainer, erased: run_training compiles once per
//! communicator group instead of once for each of the 65 (dtype, strategy, schedule,
//! optimizer) trainers an example builds (the loop inlined into each was 1 of the 5.8 MB of
//! code gpt2_train.cpp compiled to, and a fifth of its compile time).
class TrainingRun {
 public:
  virtual ~TrainingRun() = default;
  //! Trainer::step. Collective.
  virtual loom::StepMetrics step(const loom::io::Batch& batch) = 0;
  //! Trainer::evaluate, so that validation_loss takes a TrainingRun. Collective.
  virtual double evaluate(const loom::io::Batch& batch) = 0;
  //! The whole model's weights in whole_layout() order, fp32 for either dtype (Trainer::
  //! gather_state(0)). Collective.
  virtual std::vector<float> whole_weights() = 0;
  virtual const loom::ParameterLayout& whole_layout() const = 0;
  //! io::save_training_state. Collective: every rank gathers its part, rank 0 writes.
  virtual void save_state(const std::string& path, const std::string& meta) = 0;
  //! The run's io::AsyncTrainingStateSaver, for saves written in the background.
  virtual loom::io::BackgroundSave& background_save() = 0;
  virtual std::int64_t steps() const = 0;
  virtual const loom::MemoryTracker& memory() const = 0;
  virtual std::int64_t activation_slots() const = 0;
  //! Rank 0's ZeRO memory line (print_zero_memory) under a ZeRO strategy; nothing otherwise.
  virtual void print_zero_memory() const = 0;
};

//! TrainingRun over a Trainer (which must outlive it).
template <class Trainer>
class TrainingRunOf final : public TrainingRun {
 public:
  explicit TrainingRunOf(Trainer& trainer) : trainer_(&trainer), background_(trainer) {}
  loom::StepMetrics step(const loom::io::Batch& batch) override { return trainer_->step(batch); }
  double evaluate(const loom::io::Batch& batch) override { return trainer_->evaluate(batch); }
  std::vector<float> whole_weights() override {
    const auto whole = trainer_->gather_state(0);
    return std::vector<float>(whole.begin(), whole.end());
  }
  const loom::ParameterLayout& whole_layout() const override { return trainer_->whole_layout(); }
  void save_state(const std::string& path, const std::string& meta) override {
    loom::io::save_training_state(*trainer_, path, meta);
  }
  loom::io::BackgroundSave& background_save() override { return background_; }
  std::int64_t steps() const override { return trainer_->steps(); }
  const loom::MemoryTracker& memory() const override { return trainer_->memory(); }
  std::int64_t activation_slots() const override { return trainer_->activation_slots(); }
  void print_zero_memory() const override {
    if constexpr (requires { trainer_->engine().plan(); })
      gpt2_example::print_zero_memory<typename Trainer::scalar_type>(
          trainer_->engine().plan(), trainer_->memory(), trainer_->strategy(), Trainer::optimizer_type::state_slots,
          trainer_->options().fp32_gradients, trainer_->layers_write_gradients(), trainer_->tensor_state_bytes());
  }

 private:
  Trainer* trainer_;
  loom::io::AsyncTrainingStateSaver<Trainer> background_;
};

//! Rank 0's lines on the training data (and the validation data, if any).
inline void print_data(const Options& o, const Source& data, const std::optional<Source>& val_data,
                       const loom::ValidationOptions& val_options) {
  using namespace loom;
  std::visit([&](const auto& masked_or_not) {
    if constexpr (requires { masked_or_not.mask_token(); })
      std::printf("  data: masked-LM batches %s (mask token %lld)\n", detail::to_text(masked_or_not.config()).c_str(),
                  static_cast<long long>(masked_or_not.mask_token()));
    const auto& src = tokens_of(masked_or_not);
    if constexpr (std::is_same_v<std::decay_t<decltype(src)>, io::SyntheticMarkov>) {
      // The floor is the next-token task's; a masked position's neighbours on both sides tell more.
      if constexpr (requires { masked_or_not.mask_token(); })
        std::printf("  data: synthetic Markov task %s, ln(vocab) %.3f\n", detail::to_text(src.config()).c_str(),
                    std::log(double(src.vocab_size())));
      else
        std::printf("  data: synthetic Markov task %s, ln(vocab) %.3f, entropy floor %.3f nats\n",
                    detail::to_text(src.config()).c_str(), std::log(double(src.vocab_size())), src.entropy_floor());
    } else
      std::printf("  data: %s, %lld tokens, vocab %lld\n", src.name().c_str(),
                  static_cast<long long>(src.size()), static_cast<long long>(src.vocab_size()));
  }, data);
  if (o.pad_min > 0 && o.pad_min < o.seq)
    std::printf("  data: each sequence %lld to %lld tokens (drawn), padded with token %d that no query attends to\n",
                static_cast<long long>(o.pad_min), static_cast<long long>(o.seq), static_cast<int>(o.pad_token));
  if (val_data) {
    std::printf("  validation: %s, batches %lld..%lld of %lld x %lld, ", o.val_data.c_str(),
                static_cast<long long>(val_options.first),
                static_cast<long long>(val_options.first + val_options.batches - 1),
                static_cast<long long>(val_options.batch), static_cast<long long>(val_options.seq));
    if (o.eval_every > 0) std::printf("every %lld steps, ", static_cast<long long>(o.eval_every));
    std::printf("before the first step and after the last\n");
  }
}

//! Where run_training starts, and what it reads from: all of it set up by train.
struct LoopStart {
  const family::Config& config;
  const Source& data;
  const std::optional<Source>& val_data;
  const loom::ValidationOptions& val_options;
  std::int64_t first_step;                 //!< steps done before (--resume), else 0
  double resume_seconds;                   //!< how long loading --resume took
  const loom::io::TrainingStateInfo& resumed;  //!< --resume's header, if any
  const std::string& resumed_from;         //!< --resume's file (a series' newest), if any
  int sample_threads;                      //!< CPU threads --sample-tokens generates on
};

//! The step of the newest file of `series` as rank 0 (`lead`) lists it, -1 if there is none, on
//! every rank of `trainer`'s mesh: rank 0 alone reads the directory, so that all ranks take the
//! same file even where their views of a shared file system lag. Files in `passed_over` (corrupt
//! ones that --resume leaves behind, to be moved out) do not count. Collective; a failure to list
//! fails every rank instead of leaving the others waiting.
template <class Trainer>
std::int64_t newest_in_series(Trainer& trainer, const loom::io::CheckpointSeries& series, bool lead,
                              const std::vector<loom::io::SkippedCheckpoint>& passed_over = {}) {
  std::array<double, 2> shared{0, 0};  // rank 0 failed; its newest step + 1 (exact in a double below 2^53)
  std::exception_ptr failure;
  if (lead) {
    try {
      std::vector<loom::io::CheckpointSeries::File> files = series.list();
      std::erase_if(files, [&](const loom::io::CheckpointSeries::File& f) {
        return std::any_of(passed_over.begin(), passed_over.end(), [&](const loom::io::SkippedCheckpoint& s) {
          std::error_code ec;
          return std::filesystem::equivalent(f.path, s.path, ec);
        });
      });
      if (!files.empty()) shared[1] = static_cast<double>(files.back().step + 1);
    } catch (...) {
      failure = std::current_exception();
      shared[0] = 1;
    }
  }
  trainer.sum_over_ranks(shared);
  if (shared[0] > 0) {
    if (failure) std::rethrow_exception(failure);
    throw loom::Error("checkpoint series " + series.pattern().string(), "not listed", "rank 0 could not list it; its error says why");
  }
  return static_cast<std::int64_t>(shared[1]) - 1;
}

//! --check-state: reads the training-state file at `path`, or every file of the series it names
//! (oldest first), whole and compares its checksums (io::check_training_state); prints a line per
//! file. Returns 0 when every file is intact, 1 otherwise.
inline int check_state_files(const std::string& path) {
  namespace io = loom::io;
  std::vector<std::filesystem::path> files;
  if (io::CheckpointSeries::is_pattern(path)) {
    const io::CheckpointSeries series(path, "--check-state");
    for (const io::CheckpointSeries::File& f : series.list()) files.push_back(f.path);
    LOOM_CHECK(!files.empty(), "--check-state", path, "no file of the series is in " + series.directory().string());
  } else {
    files.emplace_back(path);
  }
  std::size_t intact = 0;
  for (const std::filesystem::path& file : files) {
    const auto begin = std::chrono::steady_clock::now();
    try {
      const io::TrainingStateInfo info = io::check_training_state(file);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      const double mib = static_cast<double>(std::filesystem::file_size(file)) / (1 << 20);
      std::printf("%s: intact: saved after step %lld, %s (%d state slots), %s, %.1f MiB checked in %.2f s\n",
                  file.string().c_str(), static_cast<long long>(info.steps), info.optimizer.c_str(), info.state_slots,
                  info.scalar_bytes == 4 ? "fp32" : "double", mib, seconds);
      ++intact;
    } catch (const io::CorruptCheckpoint& e) {
      std::printf("%s: CORRUPT: %s\n", file.string().c_str(), e.what());
    } catch (const loom::Error& e) {
      std::printf("%s: not checked: %s\n", file.string().c_str(), e.what());
    }
  }
  if (files.size() > 1) std::printf("%zu of %zu files intact\n", intact, files.size());
  return intact == files.size() ? 0 : 1;
}

//! Refuses, before step 1, a --save-state series that holds a file saved after `first_step`,
//! the step this run starts from (`newest`: the series' newest step, -1 for none): another run's,
//! or this one's future abandoned for an earlier file. Its saves would mix with those, a --resume
//! of the series would go on from the other run's newest, and --keep-last would delete this
//! run's files as older.
inline void check_series_is_this_runs(const Options& o, const loom::io::CheckpointSeries& series,
                                      std::int64_t newest, std::int64_t first_step) {
  if (newest <= first_step) return;
  throw loom::Error(
      "--save-state " + o.save_state, "a file saved after step " + std::to_string(newest) + ", " +
                                          series.path_for(newest).string(),
      "this run starts " + (first_step == 0 ? std::string("at step 1") : "after step " + std::to_string(first_step)) +
          ", and its saves would mix with that run's: go on from the series (--resume " + o.save_state +
          "), or move those files away, or save to another name");
}

//! Refuses, before step 1, a file that a save would fail to write only after the whole run: its
//! directory must exist and be writable (the writers go through `path + ".tmp"` and a rename).
inline void check_output_file(const char* flag, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  LOOM_CHECK(!fs::is_directory(path, ec), flag, path, "it is a directory; it must name a file");
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  LOOM_CHECK(fs::is_directory(dir, ec), flag, path, "its directory, " + dir.string() + ", must exist");
  LOOM_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, flag, path,
             "its directory, " + dir.string() + ", must be writable");
}

//! The same for --save-hf's directory, which the save creates: it must be a directory if it
//! exists, and its nearest existing ancestor a writable directory if it does not.
inline void check_output_directory(const char* flag, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  const fs::path target = fs::absolute(path, ec);
  fs::path dir = target;
  while (!fs::exists(dir, ec) && dir.has_parent_path() && dir.parent_path() != dir) dir = dir.parent_path();
  LOOM_CHECK(fs::is_directory(dir, ec), flag, path,
             dir == target ? "it is a file; it must name a directory"
                           : dir.string() + " is a file; it must be a directory for the save to create " + path);
  LOOM_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, flag, path, dir.string() + " must be writable");
}

//! What an MPI process returns for run_training's status: 0, or 128 + a signal's number after a
//! stop every rank agreed on (stop_early); any other status is a failure, raised so that the
//! other ranks hear of it.
inline int mpi_status(int code) {
  if (code != 0 && (code <= 128 || code >= 128 + NSIG))
    throw loom::Error(program, code, "training failed");
  return code;
}

//! The end of a run stopped after `end_step` by `why` (a signal or --stop-after-minutes): the
//! training state is saved (unless --save-every just did) and nothing else is written, since
//! the run is not over; the resumed run writes --save and --save-hf at its end. Returns the exit
//! status: 128 + the signal's number, as if the signal had ended the process (which shells and
//! schedulers read as "ended by that signal"), or 0 at the time limit. Collective over `world`.
template <class Group, class SaveState>
int stop_early(const Options& o, Group& world, const loom::StopReason& why, std::int64_t end_step,
               const std::optional<loom::TimeLimit>& time_limit, SaveState& save_state) {
  const bool lead = world.rank() == 0;
  if (lead) {
    if (why.signal != 0)
      std::printf("stopped after step %lld of %lld: got %s\n", static_cast<long long>(end_step),
                  static_cast<long long>(o.steps), loom::signal_name(why.signal).c_str());
    else {
      const double elapsed = time_limit->elapsed();
      std::printf("stopped after step %lld of %lld: --stop-after-minutes %g: %.1f %s in, the next step would end "
                  "past it\n",
                  static_cast<long long>(end_step), static_cast<long long>(o.steps), o.stop_after_minutes,
                  elapsed >= 60 ? elapsed / 60 : elapsed, elapsed >= 60 ? "minutes" : "s");
    }
    std::fflush(stdout);
  }
  if (o.save_state.empty()) {
    if (lead) std::printf("nothing saved: there is no --save-state\n");
  } else {
    if (o.save_every == 0 || end_step % o.save_every != 0) save_state();
    if (lead) std::printf("go on with --resume %s\n", o.save_state.c_str());
  }
  std::fflush(stdout);
  // Every rank's part is written before any returns: under mpirun the first process to exit with
  // a status other than 0 ends the others.
  world.barrier();
  return why.signal != 0 ? 128 + why.signal : 0;
}

//! The training loop, from step first_step on: logging, --metrics, validation, sampling, and
//! saving (--save-state, --save, --save-hf). Collective over the mesh.
template <class Group>
int run_training(const Options& o, TrainingRun& run, loom::Mesh<Group>& mesh, const LoopStart& start) {
  using namespace loom;
  Group& world = mesh.world();
  const bool lead = world.rank() == 0;
  const int stages = mesh.shape().pp;
  const family::Config& config = start.config;
  const Source& data = start.data;
  const std::optional<Source>& val_data = start.val_data;
  const ValidationOptions& val_options = start.val_options;
  const std::int64_t first_step = start.first_step;
  const double resume_seconds = start.resume_seconds;
  const io::TrainingStateInfo& resumed = start.resumed;
  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics);
    LOOM_CHECK(metrics.good(), "--metrics", o.metrics, "the file must be writable");
  }
  // Every rank writes its part of --save-state; rank 0 alone writes --save.
  const std::optional<io::CheckpointSeries> series =
      io::CheckpointSeries::is_pattern(o.save_state)
          ? std::optional<io::CheckpointSeries>(std::in_place, o.save_state, "--save-state")
          : std::nullopt;
  check_output_file("--save-state", series ? series->path_for(first_step + 1).string() : o.save_state);
  if (lead) check_output_file("--save", o.save);
  if (lead) check_output_directory("--save-hf", o.save_hf);
  if (lead && first_step > 0)
    std::printf("resumed from %s after step %lld in %.2f s (saved by %s)\n", start.resumed_from.c_str(),
                static_cast<long long>(first_step), resume_seconds, resumed.meta.c_str());
  // After a save is in place: the series' older files go (--keep-last), once every rank's part
  // of the new one is written. Rank 0.
  const auto prune = [&](std::int64_t step) {
    if (!series || o.keep_last == 0) return;
    const io::CheckpointSeries::Pruned pruned = series->prune(o.keep_last, step);
    for (const std::filesystem::path& gone : pruned.removed)
      std::printf("removed %s (--keep-last %lld)\n", gone.string().c_str(), static_cast<long long>(o.keep_last));
    // An old file that stays costs disk, not the run: said, and training goes on.
    for (const std::string& failure : pruned.failures)
      std::fprintf(stderr, "%s: --keep-last: could not remove %s\n", program, failure.c_str());
  };
  const auto state_path = [&] { return series ? series->path_for(run.steps()).string() : o.save_state; };
  // --async-save: the periodic saves are written while training goes on; each step polls.
  io::BackgroundSave& background = run.background_save();
  const auto background_done = [&] {
    if (!lead) return;
    std::printf("saved training state %s after step %lld (%.1f MiB, in the background: in place %.2f s after it began)\n",
                background.path().c_str(), static_cast<long long>(background.steps()),
                static_cast<double>(std::filesystem::file_size(background.path())) / (1 << 20), background.seconds());
    prune(background.steps());
  };
  // Collective: a save under way in the background finishes (files land in step order).
  const auto finish_background_save = [&] {
    if (!background.pending()) return;
    background.wait();
    background_done();
  };
  const auto save_state_in_background = [&] {
    finish_background_save();
    const auto begin = std::chrono::steady_clock::now();
    background.start(state_path(), state_meta(o, config, world.size()));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (lead)
      std::printf("saving training state %s after step %lld in the background (rank 0 copied %.1f MiB in %.2f s)\n",
                  background.path().c_str(), static_cast<long long>(background.steps()),
                  static_cast<double>(background.snapshot_bytes()) / (1 << 20), seconds);
  };
  // Collective: every rank writes its part, and waits for the others'.
  const auto save_state = [&] {
    finish_background_save();
    const auto begin = std::chrono::steady_clock::now();
    const std::string path = state_path();
    run.save_state(path, state_meta(o, config, world.size()));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (!lead) return;
    std::printf("saved training state %s after step %lld (%.1f MiB in %.2f s)\n", path.c_str(),
                static_cast<long long>(run.steps()),
                static_cast<double>(std::filesystem::file_size(path)) / (1 << 20), seconds);
    prune(run.steps());
  };
  double first_loss = 0, last_loss = 0;
  const std::int64_t last_step = o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps;
  // The run may also end early: at --stop-after-minutes, or (with --save-state) at a signal, which
  // main's StopSignals records. After each step every rank asks, and all agree on one answer.
  std::optional<TimeLimit> time_limit;
  if (o.stop_after_minutes > 0) time_limit.emplace(o.started, o.stop_after_minutes * 60);
  const bool stop_on_signal = !o.save_state.empty() && !o.no_save_on_signal;
  StopReason stopped;
  std::int64_t end_step = last_step;
  // Collective: every rank runs the forward passes, rank 0 prints.
  std::optional<ValidationLoss> first_val, last_val;
  const auto validate = [&](std::int64_t after_step) {
    const auto begin = std::chrono::steady_clock::now();
    const ValidationLoss v =
        std::visit([&](const auto& src) { return validation_loss(run, src, val_options); }, *val_data);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (!first_val) first_val = v;
    last_val = v;
    if (lead) {
      std::printf("step %5lld | val loss %.4f | perplexity %.2f | %lld targets in %.2f s\n",
                  static_cast<long long>(after_step), v.loss, v.perplexity(), static_cast<long long>(v.targets),
                  seconds);
      std::fflush(stdout);
    }
    return v;
  };
#if !LOOM_EXAMPLE_BERT
  // Collective, as --save: every rank gathers the whole tensors; rank 0 generates, on the CPU
  // with the threads it trained with (thread ranks share the cores, and one rank taking them all
  // while the others' OpenMP teams still hold theirs runs many times slower).
  const auto sample = [&](std::int64_t after_step) {
    const std::vector<float> whole = run.whole_weights();
    if (lead) print_sample(o, after_step, start.sample_threads, config, whole, data);
  };
#endif
  if (val_data) {
    const ValidationLoss v = validate(first_step);
    if (metrics.is_open()) {
      metrics << nlohmann::json{{"step", first_step}, {"val_loss", v.loss}}.dump() << '\n';
      metrics.flush();
    }
  }
  for (std::int64_t s = first_step; s < last_step; ++s) {
    // The batch of step s does not depend on where the run started: a resumed run sees the
    // batches the uninterrupted one would have.
    const io::Batch batch = std::visit([&](const auto& src) { return src.batch_at(s, o.batch, o.seq); }, data);
    const StepMetrics m = run.step(batch);
    if (s == first_step) first_loss = m.loss;
    last_loss = m.loss;
    const double tflops = m.flops / m.seconds / 1e12;
    const MemoryTracker& mem = run.memory();
    if (lead && (s % o.log_every == 0 || s + 1 == last_step)) {
      std::printf("step %5lld | loss %.4f | lr %.2e | grad norm %.3f | %8.0f tok/s | %.3f TFLOP/s",
                  static_cast<long long>(m.step), m.loss, m.lr, m.grad_norm, m.tokens_per_second, tflops);
      if (o.peak_tflops > 0) std::printf(" | MFU %.1f%%", 100.0 * tflops / o.peak_tflops);
      // Rank 0's measured bubble: the share of its step spent waiting for other stages.
      if (stages > 1) std::printf(" | pipeline wait %.1f%%", 100.0 * m.pipeline_wait_seconds / m.seconds);
      std::printf(" | mem %.1f MiB (peak %.1f)\n", MemoryTracker::mib(mem.current_total()),
                  MemoryTracker::mib(mem.peak_total()));
      std::fflush(stdout);
    }
    std::optional<ValidationLoss> val;
    if (val_data && ((o.eval_every > 0 && m.step % o.eval_every == 0) || s + 1 == last_step)) val = validate(m.step);
#if !LOOM_EXAMPLE_BERT
    if (o.sample_tokens > 0 && o.sample_every > 0 && m.step % o.sample_every == 0 && s + 1 < last_step)
      sample(m.step);
#endif
    if (s == first_step && lead) std::cout << "memory by category after step 1 (rank 0):\n" << mem;
    if (s == first_step && world.size() > 1)
      print_memory_per_rank(world, mesh.shape(), mem, run.activation_slots());
    if (s == first_step && lead) run.print_zero_memory();
    if (metrics.is_open()) {
      nlohmann::json j = {{"step", m.step}, {"loss", m.loss}, {"lr", m.lr},
                          {"grad_norm", m.grad_norm}, {"tokens", m.tokens},
                          {"seconds", m.seconds}, {"tokens_per_second", m.tokens_per_second},
                          {"tflops", tflops}, {"memory", memory_json(mem)}};
      if (o.peak_tflops > 0) j["mfu"] = tflops / o.peak_tflops;
      if (stages > 1) j["pipeline_wait_seconds"] = m.pipeline_wait_seconds;
      if (val) j["val_loss"] = val->loss;
      metrics << j.dump() << '\n';
      metrics.flush();
    }
    if (background.pending() && background.poll()) background_done();
    if (!o.save_state.empty() && o.save_every > 0 && m.step % o.save_every == 0 && s + 1 < last_step) {
      if (o.async_save)
        save_state_in_background();
      else
        save_state();
    }
    if ((stop_on_signal || time_limit) && s + 1 < last_step) {
      stopped = agree_to_stop(world, stop_on_signal ? StopSignals::received() : 0,
                              time_limit && time_limit->next_step_would_pass());
      if (stopped) {
        end_step = m.step;
        break;
      }
    }
  }
  if (lead && first_step == 0 && end_step == o.steps)
    std::printf("loss %.4f -> %.4f over %lld steps\n", first_loss, last_loss, static_cast<long long>(o.steps));
  else if (lead)
    std::printf("loss %.4f -> %.4f over steps %lld..%lld of %lld\n", first_loss, last_loss,
                static_cast<long long>(first_step + 1), static_cast<long long>(end_step),
                static_cast<long long>(o.steps));
  finish_background_save();
  if (stopped) return stop_early(o, world, stopped, end_step, time_limit, save_state);
  if (lead && first_val)
    std::printf("val loss %.4f -> %.4f (perplexity %.2f -> %.2f)\n", first_val->loss, last_val->loss,
                first_val->perplexity(), last_val->perplexity());
  if (!o.save_state.empty()) save_state();
#if !LOOM_EXAMPLE_BERT
  if (!o.save.empty()) {
    // Collective over the mesh: every rank gathers the whole tensors (its tensor-parallel slices,
    // its stage's layers, its ZeRO shard), rank 0 writes. In bf16 these are the fp32 master
    // weights.
    const std::vector<float> weights = run.whole_weights();
    if (lead) {
      io::save_llmc_checkpoint(o.save, config, run.whole_layout(), weights.data());
      std::printf("saved %s\n", o.save.c_str());
    }
  }
#endif
#if !LOOM_EXAMPLE_BERT
  if (o.sample_tokens > 0) sample(run.steps());
#endif
  if (!o.save_hf.empty()) {
    // Collective, as --save: every rank gathers the whole tensors, rank 0 writes.
    const std::vector<float> weights = run.whole_weights();
    if (lead) {
      save_hf(std::filesystem::path(o.save_hf), config, run.whole_layout(), weights.data());
      std::printf("saved Hugging Face model %s\n", o.save_hf.c_str());
    }
  }
  return 0;
}

template <class T, class Backend, class Schedule, class Strategy, class Opt, class Group>
int train(const Options& o, Backend& backend, loom::Mesh<Group>& mesh, Opt optimizer, Strategy strategy,
          Schedule schedule) {
  using namespace loom;
  Group& group = mesh.data_parallel();
  Group& world = mesh.world();
  const bool lead = world.rank() == 0;
  const int stages = mesh.shape().pp;
  const family::Config config = model_config(o);
  // The data `name` names, whose vocabulary must fit the model's; `flag` names it in the error.
  const auto open_for_model = [&](const std::string& name, const std::string& flag) {
    Source source = open_data(o, name, config.vocab_size);
    LOOM_CHECK(source_vocab(source) <= config.vocab_size, flag + " vocabulary", source_vocab(source),
               "must be <= the model's vocab_size (" + std::to_string(config.vocab_size) + ")");
    return source;
  };
  const Source data = open_for_model(o.data, "--data");
  // Held-out batches: a file's from its start, or the synthetic task's after the run's last
  // step's (training reads batches 0 .. steps - 1, so never these).
  const std::optional<Source> val_data =
      o.val_data.empty() ? std::nullopt : std::optional<Source>(open_for_model(o.val_data, "--val-data"));
#if !LOOM_EXAMPLE_BERT
  // The prompt is read and checked before the first step, not after the last.
  if (o.sample_tokens > 0)
    for (std::int32_t token : prompt_tokens(o, data))
      LOOM_CHECK(token >= 0 && token < config.vocab_size, "--prompt: token", token,
                 "must be in [0, vocab_size = " + std::to_string(config.vocab_size) + ")");
#endif
  const ValidationOptions val_options{.first = o.val_data == "synthetic" ? o.steps : 0,
                                      .batches = o.eval_batches, .batch = o.batch, .seq = o.seq};
  LOOM_CHECK(o.seq >= 1 && o.seq <= config.max_seq_len, "--seq", o.seq,
             "must be in [1, max_seq_len = " + std::to_string(config.max_seq_len) + "]");
  // --micro-batch 0: each rank's whole slice in one micro-batch, or, under a pipeline schedule,
  // 2 x pp micro-batches per pipeline (one alone would leave all but one stage idle).
  const std::int64_t per_slice = pipelined_schedule<Schedule> ? 2 * stages : 1;
  const std::int64_t micro =
      o.micro_batch == 0 ? std::max<std::int64_t>(1, o.batch / (group.size() * per_slice)) : o.micro_batch;
  if (o.accumulation > 0)
    LOOM_CHECK(o.batch == micro * o.accumulation * group.size(), "--accumulation", o.accumulation,
               "--batch (" + std::to_string(o.batch) + ") must equal --micro-batch (" +
                   std::to_string(micro) + ") x --accumulation x data-parallel ranks (" +
                   std::to_string(group.size()) + ")");
  const WarmupDecayLr lr = lr_schedule(o);
  // Checks the pipeline against the model (pp x virtual stages <= layers) and the schedule
  // against the pipeline (accumulation runs one stage) on every rank, before any step.
  Trainer<family::Model<Backend, T>, Opt, Schedule, Strategy> trainer(
      backend, mesh,
      family::Model<Backend, T>(config, mesh.tensor_parallel(), attention_choice<T>(o, backend, config)), optimizer, lr,
      {.micro_batch_size = micro,
       .clip_grad_norm = o.clip,
       .seed = o.seed,
       .recompute_layers = recompute_layers_of(o),
       .fp32_gradients = o.fp32_gradients,
       .fp32_gradient_fusion = !o.no_fp32_gradient_fusion,
       .stop_on_non_finite = !o.no_stop_on_non_finite},
      strategy, schedule);
#if !LOOM_EXAMPLE_BERT
  if (!o.init.empty()) {
    // Every rank reads the file (whole tensors) and keeps its part: its tensor-parallel slices
    // of its stage's layers, or its ZeRO shard; in bf16 the fp32 master weights take the file's
    // values exactly.
    std::vector<float> weights(static_cast<std::size_t>(trainer.whole_layout().total()));
    io::load_llmc_checkpoint(o.init, config, trainer.whole_layout(), weights.data());
    trainer.load_state(0, std::vector<typename decltype(trainer)::state_type>(weights.begin(), weights.end()));
  }
#endif
  if (!o.init_hf.empty()) {
    // As --init: every rank reads the whole tensors and keeps its part.
    std::vector<float> weights(static_cast<std::size_t>(trainer.whole_layout().total()));
    const io::HfLoadReport report = load_hf(std::filesystem::path(o.init_hf), config, trainer.whole_layout(), weights.data());
    if (lead) {
      std::printf("loaded Hugging Face weights %s", o.init_hf.c_str());
      if (!report.ignored.empty()) std::printf(" (%zu tensors with no place in loom's model ignored, first %s)",
                                               report.ignored.size(), report.ignored.front().c_str());
      std::printf("\n");
    }
    trainer.load_state(0, std::vector<typename decltype(trainer)::state_type>(weights.begin(), weights.end()));
  }
  std::int64_t first_step = 0;
  double resume_seconds = 0;
  io::TrainingStateInfo resumed;
  std::string resume_path = o.resume;
  std::vector<io::SkippedCheckpoint> passed_over;
  // A run with nothing left to do ends before anything is loaded.
  const auto check_steps_left = [&](const std::string& file, std::int64_t steps_done) {
    LOOM_CHECK(steps_done < o.steps && (o.stop_after == 0 || steps_done < o.stop_after),
               "--resume " + file + ": steps done", steps_done,
               "--steps (" + std::to_string(o.steps) + ") and --stop-after must be more, or there is nothing to do");
  };
  // A --save-state series that would mix with another run's is refused before anything loads.
  const auto check_save_series = [&](std::int64_t start, const std::vector<io::SkippedCheckpoint>& corrupt) {
    if (!io::CheckpointSeries::is_pattern(o.save_state)) return;
    const io::CheckpointSeries series(o.save_state, "--save-state");
    check_series_is_this_runs(o, series, newest_in_series(trainer, series, lead, corrupt), start);
  };
  if (io::CheckpointSeries::is_pattern(o.resume)) {
    // A series: its newest intact file, as rank 0 lists it, is every rank's. Corrupt newer ones
    // are passed over and moved out of the series.
    const io::CheckpointSeries series(o.resume, "--resume");
    const auto begin = std::chrono::steady_clock::now();
    const std::optional<io::SeriesCheckpoint> found =
        io::load_newest_training_state(trainer, series, [&](const io::SeriesCheckpoint& candidate) {
          check_steps_left(candidate.file.path.string(), candidate.info.steps);
          check_save_series(candidate.info.steps, candidate.skipped);
        });
    if (found) {
      resume_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      resume_path = found->file.path.string();
      resumed = found->info;
      first_step = resumed.steps;
      passed_over = found->skipped;
    } else if (!o.resume_if_exists) {
      throw Error("--resume", o.resume,
                  "no file of the series is in " + series.directory().string() +
                      " (--resume-if-exists starts at step 1 instead)");
    } else {
      if (lead)
        std::printf("--resume %s: no file of the series yet; starting at step 1 (--resume-if-exists)\n",
                    o.resume.c_str());
      check_save_series(0, {});
    }
  } else {
    bool resume = !o.resume.empty();
    if (resume && o.resume_if_exists) {
      // All ranks resume if any finds the file: one that cannot read it then fails the load, and
      // every rank with it, instead of starting afresh while the others load.
      resume = trainer.any_of_ranks(std::filesystem::exists(o.resume));
      if (!resume && lead)
        std::printf("--resume %s: no such file yet; starting at step 1 (--resume-if-exists)\n", o.resume.c_str());
    }
    if (resume) {
      // The header alone first.
      resumed = io::read_training_state_info(resume_path);
      first_step = resumed.steps;
      check_steps_left(resume_path, first_step);
    }
    check_save_series(first_step, {});
    if (resume) {
      // Every rank reads the file and keeps its part; any mesh and strategy can resume any other's.
      const auto begin = std::chrono::steady_clock::now();
      io::load_training_state(trainer, resume_path);
      resume_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    }
  }
  if (lead)
    for (const io::SkippedCheckpoint& s : passed_over)
      std::printf("--resume %s: passed over step %lld, which is corrupt (%s); moved it to %s\n", o.resume.c_str(),
                  static_cast<long long>(s.step), s.reason.c_str(), s.moved_to.string().c_str());
  // The schedule's shape on this rank; live_micro_batches runs the schedule's own checks
  // (interleaved: micro-batches a multiple of pp) on every rank alike, before any step. A batch
  // that does not split into micro-batches is left to step 1, whose message names the rule.
  const std::int64_t split = micro * group.size();
  const ScheduleShape shape{.stages = stages,
                            .stage = trainer.pipeline_rank(),
                            .micro_batches = o.batch % split == 0 ? o.batch / split : 0,
                            .virtual_stages = trainer.stage().chunks()};
  const std::int64_t slots = shape.micro_batches > 0 ? trainer.schedule().live_micro_batches(shape) : 0;

  if (lead) {
  std::printf("loom %s: model %s %s\n", program, o.model.c_str(),
              detail::to_text(config).c_str());
  std::printf("  parameters %lld (stored %lld) in %s, %s, batch %lld x seq %lld, micro-batch %lld (%lld per step per %s), attention %s, recompute layers %s\n",
              static_cast<long long>(config.parameter_count()),
              static_cast<long long>(config.stored_parameter_count()),
              !is_narrow_storage<T> ? "float"
              : o.fp32_gradients    ? (o.no_fp32_gradient_fusion
                                           ? "bf16 (fp32 master weights, moments and gradients, drained)"
                                           : "bf16 (fp32 master weights, moments and gradients)")
                                    : "bf16 (fp32 master weights and moments)",
              describe_backend(backend).c_str(),
              static_cast<long long>(o.batch), static_cast<long long>(o.seq),
              static_cast<long long>(micro), static_cast<long long>(o.batch / split),
              stages > 1 ? "pipeline" : "rank", loom::name(trainer.model().attention()), o.recompute_layers.c_str());
  std::printf("  strategy %s over %d rank(s) (%s), mesh %s schedule %s\n", detail::to_text(strategy).c_str(),
              world.size(), world.size() == 1 ? "one rank" : o.comm.c_str(), detail::to_text(mesh.shape()).c_str(),
              describe_schedule(schedule, shape).c_str());
  std::printf("  optimizer %s %s, lr %s\n", Opt::name, detail::to_text(optimizer.options()).c_str(),
              detail::to_text(lr).c_str());
  print_data(o, data, val_data, val_options);
  }
  if (stages > 1) {
    if (lead) std::printf("  pipeline: %d layers (embedding, %lld blocks, head) in %d stages x %d chunk(s):\n",
                          trainer.model().num_layers(), static_cast<long long>(config.num_layers), stages,
                          trainer.stage().chunks());
    print_pipeline_stages(mesh.pipeline(), trainer.stage(), config, slots, mesh.shape().tp > 1, lead);
  }
  std::fflush(stdout);
  int sample_threads = o.threads;
  if constexpr (std::is_same_v<Backend, loom::cpu>) sample_threads = backend.threads();
  TrainingRunOf<decltype(trainer)> run(trainer);
  return run_training(o, run, mesh,
                      LoopStart{.config = config, .data = data, .val_data = val_data, .val_options = val_options,
                                .first_step = first_step, .resume_seconds = resume_seconds, .resumed = resumed,
                                .resumed_from = resume_path,
                                .sample_threads = sample_threads});
}

//! Calls `fn` with the schedule --schedule names (main has filled in the default).
template <class Fn>
int with_schedule(const Options& o, Fn&& fn) {
  if (o.schedule == "gpipe") return fn(loom::GPipe{});
  if (o.schedule == "1f1b") return fn(loom::OneFOneB{});
  if (o.schedule == "interleaved") return fn(loom::Interleaved1F1B{.virtual_stages = o.virtual_stages.value_or(2)});
  if (o.schedule == "zb-h1") return fn(loom::ZeroBubbleH1{});
  return fn(loom::GradientAccumulation{});
}

//! Calls `fn` with the strategy of --zero: SingleRank on one data-parallel rank, DataParallel on
//! more, or a ZeRO stage. Under a pipeline schedule DataParallel stands for SingleRank too (a
//! no-op reduction on one rank), which keeps the instantiations fewer.
template <class Schedule, class Fn>
int with_strategy(const Options& o, int data_parallel_ranks, Fn&& fn) {
  const std::size_t bucket_bytes = o.bucket_mib << 20;
  const bool overlap = !o.no_overlap;
  switch (o.zero) {
    case 1: return fn(loom::Zero<1>{.bucket_bytes = bucket_bytes, .overlap = overlap, .replicas = o.zero_replicas});
    case 2: return fn(loom::Zero<2>{.bucket_bytes = bucket_bytes, .overlap = overlap, .replicas = o.zero_replicas});
    case 3:
      return fn(loom::Zero<3>{
          .bucket_bytes = bucket_bytes, .overlap = overlap, .prefetch = o.prefetch, .replicas = o.zero_replicas});
    default:
      if (data_parallel_ranks == 1 && !loom::pipelined_schedule<Schedule>) return fn(loom::SingleRank{});
      return fn(loom::DataParallel{.bucket_bytes = bucket_bytes, .overlap = overlap});
  }
}

//! Calls `fn` with the element type of --dtype: float, or loom::bf16 (with AdamW or Adafactor,
//! which keeps the instantiations few).
template <class Fn>
int with_dtype(const Options& o, Fn&& fn) {
  LOOM_CHECK(!o.no_fp32_gradient_fusion || o.fp32_gradients, "--fp32-gradients with --no-fp32-gradient-fusion", "off",
             "--no-fp32-gradient-fusion chooses how fp32 gradient sums are made: it needs --dtype bf16 --fp32-gradients");
  if (o.dtype == "bf16") {
    LOOM_CHECK(o.optimizer != "sgd", "--optimizer", o.optimizer, "--dtype bf16 trains with adamw or adafactor");
    return fn(loom::bf16{});
  }
  // A float model's gradients are fp32 already: the flag would change nothing, so a run that
  // names it has most likely lost its --dtype bf16.
  LOOM_CHECK(!o.fp32_gradients, "--fp32-gradients with --dtype", o.dtype,
             "needs --dtype bf16 (a float model's gradients are fp32 already)");
  return fn(float{});
}

//! AdamW's hyper-parameters from --adam-beta1, --adam-beta2, --adam-eps and --weight-decay.
inline loom::AdamW::Options adam_options(const Options& o) {
  loom::AdamW::Options adam = o.adam;
  adam.weight_decay = o.weight_decay;
  return adam;
}

//! Calls `fn` with the optimizer of --optimizer (SGD only for float models).
template <class T, class Fn>
int with_optimizer(const Options& o, Fn&& fn) {
  if (o.optimizer == "adafactor") return fn(loom::Adafactor({.weight_decay = o.weight_decay}));
  if constexpr (std::is_same_v<T, float>)
    if (o.optimizer == "sgd") return fn(loom::SgdMomentum({.momentum = 0.9, .weight_decay = o.weight_decay}));
  return fn(loom::AdamW(adam_options(o)));
}

//! Builds the dp x tp x pp mesh over `world` and trains on `backend` with the schedule, strategy
//! and optimizer the options name (train_on below picks `Group`).
template <class Backend, class Group>
int train_on_mesh(const Options& o, Backend& backend, Group& world) {
  LOOM_CHECK(world.size() % (o.tp * o.pp) == 0, "--tp x --pp", std::to_string(o.tp) + " x " + std::to_string(o.pp),
             "must divide the number of ranks (" + std::to_string(world.size()) + ")");
  loom::Mesh<Group> mesh(world, {.dp = world.size() / (o.tp * o.pp), .tp = o.tp, .pp = o.pp});
  return with_schedule(o, [&](auto schedule) {
    return with_strategy<decltype(schedule)>(o, mesh.data_parallel().size(), [&](auto strategy) {
      return with_dtype(o, [&](auto element) {
        using T = decltype(element);
        return with_optimizer<T>(o, [&](auto optimizer) { return train<T>(o, backend, mesh, optimizer, strategy, schedule); });
      });
    });
  });
}

//! Trains over `world` through an AnyCommunicator viewing it, so that every communicator type
//! (one rank, thread ranks, MPI processes, NCCL, staged through a GPU's memory) shares one
//! instantiation of the training loop per schedule, strategy, element type and optimizer (one per
//! communicator type made these the build's longest compiles).
template <class Backend, class Group>
int train_on(const Options& o, Backend& backend, Group& world) {
  loom::AnyCommunicator any = loom::AnyCommunicator::view(world);
  return train_on_mesh(o, backend, any);
}

//! Under MPI the mesh is the world: --dp x --tp x --pp must equal its size, or --dp be left at 1
//! to take what tp x pp leaves. Checked on every process before any work.
inline void check_mpi_world(const Options& o, int world_size) {
  LOOM_CHECK(o.dp == 1 || o.dp * o.tp * o.pp == world_size, "--dp", o.dp,
             "x --tp x --pp must equal the MPI world size (" + std::to_string(world_size) + ") with --comm " +
                 o.comm + " (or leave --dp at 1 to take the rest)");
}

//! --device cuda: trains on GPUs (gpt2_train_cuda.cu); throws where gpt2_train was built
//! without CUDA.
int run_cuda(const Options& o, int& argc, char**& argv);

}  // namespace gpt2_example
