// loom_option_sweep: draws random gpt2_train and bert_train command lines, each a model and
// training setup with a random parallel layout, and checks the promise the examples make about
// every combination (DESIGN.md, invariant 3):
//   - a combination that can run trains the same model as one rank: each step's loss and
//     gradient norm equal, within the dtype's tolerance, those of the same setup on one rank
//     with one micro-batch, stored attention and no recomputation;
//   - a combination that cannot run is refused before step one, with loom's "loom: <what>: got
//     <value>; <rule>" message and a non-zero exit, never a crash, a hang or a failure mid-run.
// The sweep knows which combinations it expects refused and why (expected_refusal below): a
// combination refused against that expectation, or run where a refusal was expected, fails too,
// so a rule that loosens or tightens without the sweep's knowledge shows up.
// Every failure prints its command lines, to rerun by hand. A fixed --seed draws the same cases.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

// ---------------------------------------------------------------------------------------------
// Running a program

struct Outcome {
  int exit_code = -1;  // valid when neither signalled nor timed out
  int signal = 0;      // the signal that ended it, 0 if none
  bool timed_out = false;
  std::string out, err;  // what it printed
  double seconds = 0;
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string shell_quote(const std::string& word) {
  if (!word.empty() &&
      word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,/:+") ==
          std::string::npos)
    return word;
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

std::string command_line(const Args& argv) {
  std::string line;
  for (const auto& word : argv) {
    if (!line.empty()) line += ' ';
    line += shell_quote(word);
  }
  return line;
}

// Runs argv with stdout and stderr to files under `dir`, in a process group of its own, which is
// killed whole (thread ranks, or mpirun and its processes) once `timeout_s` has passed.
Outcome run_program(const Args& argv, const fs::path& dir, double timeout_s) {
  const fs::path out_path = dir / "stdout", err_path = dir / "stderr";
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&files, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  std::vector<char*> c_argv;
  for (const auto& word : argv) c_argv.push_back(const_cast<char*>(word.c_str()));
  c_argv.push_back(nullptr);

  Outcome outcome;
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, c_argv[0], &files, &attributes, c_argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attributes);
  if (spawned != 0) {
    outcome.err = "could not start " + argv[0] + ": " + std::strerror(spawned);
    return outcome;
  }
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > timeout_s) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      outcome.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!outcome.timed_out) {
    if (WIFEXITED(status)) outcome.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) outcome.signal = WTERMSIG(status);
  }
  outcome.out = read_file(out_path);
  outcome.err = read_file(err_path);
  return outcome;
}

// ---------------------------------------------------------------------------------------------
// The cases

// A model and training setup: what the reference and every layout of it share.
struct Setup {
  bool bert = false;
  int layers = 2, heads = 2, head_size = 8, seq = 16, batch = 24, steps = 3;
  bool bf16 = false, fp32_gradients = false;
  int max_predictions = 0;  // bert_train's --max-predictions (0 = no cap)
  bool validates = false;   // a validation loss before the first step and after each
  Args args;                // the command-line options all of this becomes

  int channels() const { return heads * head_size; }
  int pipeline_layers() const { return layers + 2; }  // embedding, blocks, head
};

// A parallel layout and the options that must not change what is trained.
struct Layout {
  int dp = 1, tp = 1, pp = 1, zero = 0, micro = 0, virtual_stages = 0, zero_replicas = 1;
  std::string schedule = "accumulation";
  Args args;
  std::string expected_refusal;  // empty when the combination should run

  int ranks() const { return dp * tp * pp; }
};

template <class T>
const T& pick(std::mt19937_64& rng, const std::vector<T>& choices) {
  return choices[std::uniform_int_distribution<std::size_t>(0, choices.size() - 1)(rng)];
}

bool chance(std::mt19937_64& rng, double p) { return std::bernoulli_distribution(p)(rng); }

// Appends an option and its value.
void add(Args& args, std::string flag, std::string value) {
  args.push_back(std::move(flag));
  args.push_back(std::move(value));
}

Setup draw_setup(std::mt19937_64& rng, const std::vector<int>& head_sizes) {
  Setup s;
  s.bert = chance(rng, 0.3);
  s.layers = pick(rng, std::vector{2, 3, 4});
  s.heads = pick(rng, std::vector{2, 4});
  s.head_size = pick(rng, head_sizes);
  s.seq = pick(rng, std::vector{16, 32});
  s.batch = pick(rng, std::vector{12, 24});
  s.bf16 = chance(rng, 0.35);
  s.fp32_gradients = s.bf16 && chance(rng, 0.5);
  // SGD has no bf16 path (fp32 master weights are AdamW's and Adafactor's).
  const std::string optimizer = s.bf16 ? pick(rng, std::vector<std::string>{"adamw", "adamw", "adafactor"})
                                       : pick(rng, std::vector<std::string>{"adamw", "adamw", "sgd", "adafactor"});
  const std::string lr = optimizer == "sgd" ? "0.05" : optimizer == "adafactor" ? "0.01" : "0.004";
  s.args = {"--layers",    std::to_string(s.layers),
            "--heads",     std::to_string(s.heads),
            "--channels",  std::to_string(s.channels()),
            "--seq",       std::to_string(s.seq),
            "--batch",     std::to_string(s.batch),
            "--steps",     std::to_string(s.steps),
            "--seed",      std::to_string(std::uniform_int_distribution<int>(1, 1'000'000)(rng)),
            "--optimizer", optimizer,
            "--lr",        lr,
            "--dtype",     s.bf16 ? "bf16" : "float"};
  if (s.fp32_gradients) s.args.push_back("--fp32-gradients");
  add(s.args, "--clip", pick(rng, std::vector<std::string>{"0", "1", "0.3"}));
  add(s.args, "--warmup", pick(rng, std::vector<std::string>{"0", "1"}));
  add(s.args, "--lr-decay", pick(rng, std::vector<std::string>{"cosine", "linear", "constant", "wsd"}));
  if (chance(rng, 0.3)) add(s.args, "--dropout", "0.1");
  if (chance(rng, 0.2)) add(s.args, "--attention-dropout", "0.1");
  if (chance(rng, 0.25)) add(s.args, "--pad-min", std::to_string(s.seq / 2));
  if (chance(rng, 0.2)) add(s.args, "--gelu", s.bert ? "tanh" : "erf");
  if (chance(rng, 0.2)) add(s.args, "--weight-decay", "0");
  if (chance(rng, 0.3)) {
    s.validates = true;
    s.args.insert(s.args.end(), {"--val-data", "synthetic", "--eval-every", "1", "--eval-batches", "1"});
  }
  if (s.bert && chance(rng, 0.3)) {
    s.max_predictions = 3;
    add(s.args, "--max-predictions", "3");
  }
  return s;
}

// Every divisor of n.
std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

// Draws a layout of `s`, and says whether (and why) gpt2_train should refuse it. `max_ranks`
// bounds dp x tp x pp (thread ranks share the cores; each is cheap at these sizes).
Layout draw_layout(std::mt19937_64& rng, const Setup& s, int max_ranks) {
  Layout l;
  do {
    l.dp = pick(rng, std::vector{1, 1, 2, 2, 3, 4});
    l.tp = pick(rng, std::vector{1, 1, 2, 2, 4});
    l.pp = pick(rng, std::vector{1, 1, 2, 2, 3});
  } while (l.ranks() > max_ranks);
  if (l.pp > 1) l.schedule = pick(rng, std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zb-h1"});
  // Every ZeRO stage under every schedule, pipelines included.
  l.zero = l.dp > 1 ? pick(rng, std::vector{0, 1, 2, 3}) : pick(rng, std::vector{0, 0, 0, 1, 3});
  // The micro-batch: a divisor of each rank's slice (batches of 12 and 24 divide by every dp
  // drawn), or now and then one that does not divide.
  const int slice = s.batch / l.dp;
  l.micro = chance(rng, 0.05) ? 5 : pick(rng, divisors(slice));

  add(l.args, "--dp", std::to_string(l.dp));
  add(l.args, "--tp", std::to_string(l.tp));
  add(l.args, "--pp", std::to_string(l.pp));
  add(l.args, "--zero", std::to_string(l.zero));
  add(l.args, "--micro-batch", std::to_string(l.micro));
  if (l.pp > 1) add(l.args, "--schedule", l.schedule);
  if (l.schedule == "interleaved") {
    l.virtual_stages = pick(rng, std::vector{2, 2, 3});
    add(l.args, "--virtual-stages", std::to_string(l.virtual_stages));
  }
  // Now and then a flag that would change nothing in this layout, which must be refused.
  const bool sequence_parallel = l.tp > 1 ? chance(rng, 0.5) : chance(rng, 0.03);
  if (sequence_parallel) l.args.push_back("--sequence-parallel");
  const std::string recompute = pick(rng, std::vector<std::string>{"0", "0", "0", "1", "all"});
  add(l.args, "--recompute-layers", recompute);
  add(l.args, "--attention", pick(rng, std::vector<std::string>{"stored", "recompute", "auto"}));
  if (chance(rng, 0.3)) add(l.args, "--logits-chunk-rows", pick(rng, std::vector<std::string>{"5", "16"}));
  const bool every_position = s.bert && chance(rng, 0.25);
  if (every_position) l.args.push_back("--logits-at-every-position");
  if (chance(rng, 0.3)) l.args.push_back("--no-overlap");
  // Hybrid sharding: now and then copies of the sharded model, and rarely a count that does not
  // divide --dp, or one without ZeRO.
  const bool replicas = l.zero >= 1 && l.dp > 1 ? chance(rng, 0.4) : chance(rng, 0.03);
  if (replicas) {
    l.zero_replicas = chance(rng, 0.1) ? l.dp + 1 : pick(rng, divisors(l.dp));
    add(l.args, "--zero-replicas", std::to_string(l.zero_replicas));
  }
  const bool prefetch = l.zero == 3 || chance(rng, 0.03);
  if (prefetch) add(l.args, "--prefetch", pick(rng, std::vector<std::string>{"0", "1", "2"}));
  if (s.fp32_gradients && chance(rng, 0.3)) l.args.push_back("--no-fp32-gradient-fusion");

  // What gpt2_train refuses, by its documented rules (docs/gpt2_train.md).
  const int micro_batches = slice % l.micro == 0 ? slice / l.micro : 0;
  std::string& why = l.expected_refusal;
  if (s.heads % l.tp != 0)
    why = "--tp must divide the heads";
  else if (micro_batches == 0)
    why = "the batch must divide by micro-batch x dp";
  else if (l.dp % l.zero_replicas != 0)
    why = "--zero-replicas must divide --dp";
  else if (l.pp > s.pipeline_layers())
    why = "more stages than layers";
  else if (l.schedule == "interleaved" && l.pp * l.virtual_stages > s.pipeline_layers())
    why = "pp x virtual stages above the layers";
  else if (l.schedule == "interleaved" && micro_batches % l.pp != 0)
    why = "interleaved micro-batches must divide by pp";
  else if (l.schedule == "zb-h1" && recompute != "0")
    why = "ZB-H1's weight passes read activations that recomputation would have dropped";
  else if (every_position && s.max_predictions > 0)
    why = "a head on every position has no room for a cap on the predictions";
  else if (sequence_parallel && l.tp == 1)
    why = "--sequence-parallel with --tp 1 would change nothing";
  else if (prefetch && l.zero != 3)
    why = "--prefetch without ZeRO-3 would change nothing";
  else if (replicas && l.zero == 0)
    why = "--zero-replicas without ZeRO would change nothing";
  return l;
}

// The one-rank run every layout of a setup is compared with.
Args reference_layout(const Setup& s) { return {"--micro-batch", std::to_string(s.batch), "--attention", "stored"}; }

// ---------------------------------------------------------------------------------------------
// Checking

struct Step {
  std::int64_t step = 0;
  double loss = 0, grad_norm = 0;
};

// What a run's --metrics file says: its steps, and the validation losses by the steps done
// before each (0: before the first step).
struct Metrics {
  std::vector<Step> steps;
  std::map<std::int64_t, double> val_loss;
};

Metrics read_metrics(const fs::path& path) {
  Metrics m;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_discarded() || !record.contains("step")) continue;
    const auto step = record.at("step").get<std::int64_t>();
    if (record.contains("val_loss")) m.val_loss[step] = record.at("val_loss").get<double>();
    if (record.contains("grad_norm"))
      m.steps.push_back({step, record.at("loss").get<double>(), record.at("grad_norm").get<double>()});
  }
  return m;
}

bool printed_a_step(const std::string& out) {
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);)
    if (line.starts_with("step ")) return true;
  return false;
}

// The first line of `err` that is loom's error message, or empty.
std::string loom_message(const std::string& err) {
  std::istringstream lines(err);
  for (std::string line; std::getline(lines, line);) {
    const auto at = line.find("loom: ");
    if (at != std::string::npos) return line.substr(at);
  }
  return {};
}

struct Tolerance {
  double loss = 0, grad_norm = 0;  // relative
};

double relative(double got, double want) { return std::abs(got - want) / std::max(std::abs(want), 1e-6); }

// Step 1 has not stepped the optimizer yet, whose normalised update then moves parameters of
// (nearly) zero gradient, the attention's key biases, by about lr whatever their rounding noise:
// what is measured before it gets a fifth of the tolerance.
Tolerance tolerance_at(std::int64_t steps_done, Tolerance t) {
  const double factor = steps_done == 0 ? 0.2 : 1.0;
  return {factor * t.loss, factor * t.grad_norm};
}

// How a run's metrics compare with the reference's: what differs beyond the tolerance (empty if
// nothing), and the largest relative differences of its steps' losses and gradient norms.
struct Comparison {
  std::string differs;
  double loss = 0, grad_norm = 0;
};

// Whether `got` holds the reference's steps `first`..`last` (numbered from 1) within `t`, and
// each validation loss it took is the reference's after as many steps (if `validates`, at least
// one).
Comparison compare_metrics(const Metrics& got_metrics, const Metrics& want_metrics, int first, int last, Tolerance t,
                           bool validates) {
  Comparison c;
  const std::vector<Step>& got = got_metrics.steps;
  const std::vector<Step>& want = want_metrics.steps;
  const int count = last - first + 1;
  if (static_cast<int>(got.size()) != count) {
    c.differs = "metrics: " + std::to_string(got.size()) + " steps, " + std::to_string(count) + " expected";
    return c;
  }
  for (int i = 0; i < count; ++i) {
    const Step& g = got[i];
    const Step& w = want[first - 1 + i];
    if (g.step != w.step) {
      c.differs = "metrics: step " + std::to_string(g.step) + " where " + std::to_string(w.step) + " was due";
      return c;
    }
    const Tolerance at = tolerance_at(g.step - 1, t);
    c.loss = std::max(c.loss, relative(g.loss, w.loss));
    c.grad_norm = std::max(c.grad_norm, relative(g.grad_norm, w.grad_norm));
    if (!std::isfinite(g.loss) || !std::isfinite(g.grad_norm) || relative(g.loss, w.loss) > at.loss ||
        relative(g.grad_norm, w.grad_norm) > at.grad_norm) {
      char text[240];
      std::snprintf(
          text, sizeof text,
          "step %lld: loss %.9g against %.9g (%.2e, allowed %.0e), grad norm %.9g against %.9g (%.2e, allowed "
          "%.0e)",
          static_cast<long long>(g.step), g.loss, w.loss, relative(g.loss, w.loss), at.loss, g.grad_norm, w.grad_norm,
          relative(g.grad_norm, w.grad_norm), at.grad_norm);
      c.differs = text;
      return c;
    }
  }
  if (validates && got_metrics.val_loss.empty()) {
    c.differs = "metrics: no validation loss";
    return c;
  }
  for (const auto& [steps_done, val_loss] : got_metrics.val_loss) {
    const auto want_val = want_metrics.val_loss.find(steps_done);
    if (want_val == want_metrics.val_loss.end()) {
      c.differs =
          "metrics: a validation loss after step " + std::to_string(steps_done) + ", where the reference has none";
      return c;
    }
    const double allowed = tolerance_at(steps_done, t).loss;
    if (!std::isfinite(val_loss) || relative(val_loss, want_val->second) > allowed) {
      char text[160];
      std::snprintf(text, sizeof text, "validation loss after step %lld: %.9g against %.9g (%.2e, allowed %.0e)",
                    static_cast<long long>(steps_done), val_loss, want_val->second,
                    relative(val_loss, want_val->second), allowed);
      c.differs = text;
      return c;
    }
  }
  return c;
}

// ---------------------------------------------------------------------------------------------

struct Options {
  std::string gpt2_train, bert_train;
  std::uint64_t seed = 1;
  int setups = 20, layouts = 3, max_ranks = 8, threads = 2;
  double timeout_s = 120, resume_chance = 0.2;
  // Relative differences from one rank a layout may show after step 1 (a fifth of them at step 1):
  // float, then bf16, {loss, grad norm}. float: the sums' order only (other splits, other
  // micro-batches), measured at most 3.2e-7 and 1.2e-5 over 996 trained cases of 9 seeds; bf16:
  // rounding at other points, and without --fp32-gradients micro-batches summed in bf16, growing
  // with the steps, measured at most 5.1e-4 and 3.1e-2.
  Tolerance float_tolerance{3e-6, 2e-4}, bf16_tolerance{3e-3, 1.2e-1};
  std::vector<int> head_sizes{8, 16};  // drawn from for each setup
  std::string candidate_args;          // appended to every layout's command line (--device cuda, say)
  std::string launcher;                // put before every layout's command line (mpirun -n {ranks})
  std::string work_dir;
  bool verbose = false;
};

// The words of `text`, split at white space.
Args words_of(const std::string& text) {
  Args words;
  std::istringstream in(text);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

class Sweep {
 public:
  explicit Sweep(const Options& o)
      : o_(o),
        rng_(o.seed),
        work_(o.work_dir.empty() ? fs::temp_directory_path() / ("loom_sweep_" + std::to_string(getpid()))
                                 : fs::path(o.work_dir)) {
    fs::create_directories(work_);
  }

  int run() {
    for (int index = 0; index < o_.setups; ++index) run_setup(index);
    const int cases = o_.setups * o_.layouts;
    // A sweep whose draws mostly get refused checks little: that is a failure of the sweep.
    if (3 * ran_ < cases) {
      std::cout << "FAILED: only " << ran_ << " of " << cases << " cases trained; the draws check too little\n";
      ++failed_;
    }
    if (!refusals_.empty()) {
      std::cout << "refusals by subject:\n";
      for (const auto& [subject, count] : refusals_) std::cout << "    " << count << " x " << subject << "\n";
    }
    std::printf(
        "largest relative differences from one rank: float loss %.2e, grad norm %.2e; bf16 loss %.2e, "
        "grad norm %.2e\n",
        worst_[0][0], worst_[0][1], worst_[1][0], worst_[1][1]);
    // The summary last, where scripts/gpu_check.sh's table takes it from.
    std::cout << "loom_option_sweep: seed " << o_.seed << ", " << o_.setups << " setups x " << o_.layouts
              << " layouts: " << ran_ << " trained as one rank (" << resumed_ << " of them resumed on another layout), "
              << refused_ << " refused before step one as expected, " << failed_ << " failed\n";
    if (failed_ == 0 && o_.work_dir.empty()) fs::remove_all(work_);
    return failed_ == 0 ? 0 : 1;
  }

 private:
  // What a layout's run came to.
  enum class Verdict { trained, refused, failed };

  void fail(const std::string& what, const std::vector<Args>& commands, const Outcome* outcome) {
    ++failed_;
    std::cout << "FAILED: " << what << "\n";
    for (const auto& c : commands) std::cout << "    " << command_line(c) << "\n";
    if (outcome) {
      const std::string& err = outcome->err;
      const std::string tail = err.size() > 2000 ? err.substr(err.size() - 2000) : err;
      if (!tail.empty()) std::cout << "  stderr:\n" << tail << (tail.ends_with('\n') ? "" : "\n");
    }
  }

  Args launcher_for(int ranks) const {
    Args words = words_of(o_.launcher);
    for (auto& word : words) {
      const auto at = word.find("{ranks}");
      if (at != std::string::npos) word.replace(at, 7, std::to_string(ranks));
    }
    return words;
  }

  // Runs `command`, a layout of setup `s`, and checks it: refused before step one with loom's
  // message when `expected_refusal` names a reason, else training steps `first`..`last` of the
  // reference's `want` within the setup's tolerance. `commands` are printed with a failure (the
  // reference's too).
  Verdict check(const std::string& label, const Args& command, const fs::path& dir, const fs::path& metrics,
                const std::string& expected_refusal, const Setup& s, const Metrics& want, int first, int last,
                std::vector<Args> commands) {
    commands.insert(commands.begin(), command);
    fs::remove(metrics);
    const Outcome got = run_program(command, dir, o_.timeout_s);
    if (got.timed_out) {
      fail(label + ": still running after " + std::to_string(static_cast<int>(o_.timeout_s)) + " s (a hang?)", commands,
           &got);
      return Verdict::failed;
    }
    if (got.signal != 0) {
      fail(label + ": killed by signal " + std::to_string(got.signal) + " (" + strsignal(got.signal) + ")", commands,
           &got);
      return Verdict::failed;
    }
    if (got.exit_code != 0) {
      const std::string message = loom_message(got.err);
      if (message.empty()) {
        fail(label + ": exit " + std::to_string(got.exit_code) + " without loom's error message", commands, &got);
      } else if (printed_a_step(got.out)) {
        fail(label + ": failed after training began: " + message, commands, &got);
      } else if (expected_refusal.empty()) {
        fail(label + ": refused, and the sweep expected it to run: " + message, commands, &got);
      } else {
        ++refused_;
        ++refusals_[message.substr(0, std::min(message.find(": got"), message.find("; ")))];
        if (o_.verbose) std::cout << label << ": refused (" << expected_refusal << "): " << message << "\n";
        return Verdict::refused;
      }
      return Verdict::failed;
    }
    if (!expected_refusal.empty()) {
      fail(label + ": ran, and the sweep expected a refusal (" + expected_refusal + ")", commands, &got);
      return Verdict::failed;
    }
    const Comparison c = compare_metrics(read_metrics(metrics), want, first, last,
                                         s.bf16 ? o_.bf16_tolerance : o_.float_tolerance, s.validates);
    if (!c.differs.empty()) {
      fail(label + ": trains another model than one rank: " + c.differs, commands, nullptr);
      return Verdict::failed;
    }
    worst_[s.bf16][0] = std::max(worst_[s.bf16][0], c.loss);
    worst_[s.bf16][1] = std::max(worst_[s.bf16][1], c.grad_norm);
    if (o_.verbose)
      std::printf("%s: steps %d..%d as one rank's (%s; loss %.1e, grad norm %.1e off) in %.2f s\n", label.c_str(),
                  first, last, s.bf16 ? "bf16" : "float", c.loss, c.grad_norm, got.seconds);
    return Verdict::trained;
  }

  void run_setup(int index) {
    const Setup s = draw_setup(rng_, o_.head_sizes);
    Args common{s.bert ? o_.bert_train : o_.gpt2_train};
    common.insert(common.end(), s.args.begin(), s.args.end());
    common.insert(common.end(), {"--threads", std::to_string(o_.threads), "--log-every", "100"});
    const fs::path dir = work_ / ("setup" + std::to_string(index));
    fs::create_directories(dir);
    const std::string label = "setup " + std::to_string(index);

    Args reference = common;
    const Args ref_layout = reference_layout(s);
    reference.insert(reference.end(), ref_layout.begin(), ref_layout.end());
    reference.insert(reference.end(), {"--metrics", (dir / "reference.jsonl").string()});
    const Outcome ref = run_program(reference, dir, o_.timeout_s);
    const auto want = read_metrics(dir / "reference.jsonl");
    if (ref.timed_out || ref.exit_code != 0 || static_cast<int>(want.steps.size()) != s.steps ||
        (s.validates && want.val_loss.size() != static_cast<std::size_t>(s.steps) + 1)) {
      fail(label + ": the one-rank reference did not train", {reference}, &ref);
      return;
    }
    const Args extra = words_of(o_.candidate_args);
    const auto layout_command = [&](const Layout& l, const Args& more) {
      Args command = launcher_for(l.ranks());
      command.insert(command.end(), common.begin(), common.end());
      command.insert(command.end(), l.args.begin(), l.args.end());
      command.insert(command.end(), extra.begin(), extra.end());
      command.insert(command.end(), more.begin(), more.end());
      return command;
    };

    for (int layout_index = 0; layout_index < o_.layouts; ++layout_index) {
      const std::string case_label = label + " layout " + std::to_string(layout_index);
      const fs::path metrics = dir / ("layout" + std::to_string(layout_index) + ".jsonl");
      const Layout l = draw_layout(rng_, s, o_.max_ranks);
      // Now and then a valid layout trains step 1 alone and saves its state, and another valid
      // layout resumes from it: the steps after the checkpoint must be one rank's as well.
      if (l.expected_refusal.empty() && std::bernoulli_distribution(o_.resume_chance)(rng_)) {
        Layout next = draw_layout(rng_, s, o_.max_ranks);
        for (int tries = 0; tries < 20 && !next.expected_refusal.empty(); ++tries)
          next = draw_layout(rng_, s, o_.max_ranks);
        if (next.expected_refusal.empty()) {
          const fs::path state = dir / ("layout" + std::to_string(layout_index) + ".state");
          const Args first =
              layout_command(l, {"--stop-after", "1", "--save-state", state.string(), "--metrics", metrics.string()});
          if (check(case_label + " (steps to the checkpoint)", first, dir, metrics, "", s, want, 1, 1, {reference}) !=
              Verdict::trained)
            continue;
          const Args second = layout_command(next, {"--resume", state.string(), "--metrics", metrics.string()});
          if (check(case_label + " (resumed on another layout)", second, dir, metrics, "", s, want, 2, s.steps,
                    {first, reference}) == Verdict::trained) {
            ++ran_;
            ++resumed_;
          }
          continue;
        }
      }
      const Args command = layout_command(l, {"--metrics", metrics.string()});
      if (check(case_label, command, dir, metrics, l.expected_refusal, s, want, 1, s.steps, {reference}) ==
          Verdict::trained)
        ++ran_;
    }
  }

  const Options& o_;
  std::mt19937_64 rng_;
  fs::path work_;
  int ran_ = 0, resumed_ = 0, refused_ = 0, failed_ = 0;
  std::map<std::string, int> refusals_;  // loom's message up to its value -> how many
  double worst_[2][2] = {};              // the largest relative differences that passed: [bf16][grad norm]
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Random gpt2_train/bert_train combinations: each trains as one rank does, or is refused before step one."};
  app.add_option("--gpt2-train", o.gpt2_train, "The gpt2_train executable")->required();
  app.add_option("--bert-train", o.bert_train, "The bert_train executable")->required();
  app.add_option("--seed", o.seed, "Seed of the draws (the same seed draws the same cases)")->capture_default_str();
  app.add_option("--setups", o.setups, "Model and training setups, each with its one-rank reference")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--layouts", o.layouts, "Parallel layouts drawn per setup")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-ranks", o.max_ranks, "Largest dp x tp x pp drawn")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "--threads of every run")->capture_default_str();
  app.add_option("--head-sizes", o.head_sizes,
                 "Head sizes drawn from (the GPU's tiled attention runs at 32, 64 and 128 only)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--timeout", o.timeout_s, "Seconds a run may take before it counts as a hang")->capture_default_str();
  app.add_option("--float-tolerance", o.float_tolerance.loss,
                 "Relative loss difference from one rank allowed in float after step 1 (the gradient norm's: "
                 "67x; at step 1, a fifth)")
      ->capture_default_str();
  app.add_option("--bf16-tolerance", o.bf16_tolerance.loss,
                 "Relative loss difference from one rank allowed in bf16 after step 1 (the gradient norm's: "
                 "40x; at step 1, a fifth)")
      ->capture_default_str();
  app.add_option("--resume-chance", o.resume_chance,
                 "How often a case saves its state after step 1 and another layout resumes it")
      ->capture_default_str();
  app.add_option("--candidate-args", o.candidate_args,
                 "Options appended to every layout's command line, one string: --candidate-args='--device cuda'");
  app.add_option("--launcher", o.launcher,
                 "What goes before every layout's command, one string, {ranks} replaced by dp x tp x pp: "
                 "--launcher='mpirun -n {ranks}' (with --candidate-args='--comm mpi')");
  app.add_option("--work-dir", o.work_dir,
                 "Keep the runs' outputs here (default: a temporary directory, removed if all pass)");
  app.add_flag("--verbose", o.verbose, "Print every case");
  CLI11_PARSE(app, argc, argv);
  if (app.count("--float-tolerance") > 0) o.float_tolerance.grad_norm = 67 * o.float_tolerance.loss;
  if (app.count("--bf16-tolerance") > 0) o.bf16_tolerance.grad_norm = 40 * o.bf16_tolerance.loss;
  return Sweep(o).run();
}
